//! The CPU card's training rows: C3 mlp_step, C5 mini_gpt (op by op and as a captured
//! `braid::Step`) and activation offloading under a memory budget. Each step holds or applies
//! exactly what its peers compute (every parameter's gradient, through the SGD update of every
//! parameter, as `loss.backward()` and `jax.value_and_grad` do), each line says so, and each
//! counts the matrix products its step ran and fails when fewer ran than the workload has by
//! construction (`benches/common/products.rs`).

use super::median;
use super::mini_gpt;
use super::products::{check_products, one_run};
use braid::prelude::*;

/// C3's matrix products by construction: 4 forward, 4 weight gradients, 3 input gradients (the
/// first layer's input, x, needs no gradient; neither peer computes one).
const C3_PRODUCTS: usize = 4 + 4 + 3;

/// C3 mlp_step: 4 x `relu(h @ W + b)` (H = 512, batch 256, f32), loss `mean(h^2)`, backward,
/// in-place SGD of all 8 parameters. Checked first against an f64 host computation of the loss
/// and of every parameter after the update.
pub fn c3(dev: &Device) -> (f64, String) {
    const H: usize = 512;
    const B: usize = 256;
    const LAYERS: usize = 4;
    const LR: f64 = 0.01;
    dev.seed(3);
    let x = Tensor::randn([B, H], DType::F32, dev);
    let scale = (2.0 / H as f64).sqrt();
    let mut params: Vec<Tensor> = Vec::new();
    for _ in 0..LAYERS {
        params.push(braid::no_grad(|| Tensor::randn([H, H], DType::F32, dev) * scale).requires_grad());
        params.push(braid::no_grad(|| Tensor::randn([H], DType::F32, dev) * 0.1).requires_grad());
    }
    let host = |t: &Tensor| t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect::<Vec<f64>>();
    let (xs, ps): (Vec<f64>, Vec<Vec<f64>>) = (host(&x), params.iter().map(host).collect());
    let mut opt = braid::optim::Sgd::new(LR);
    let mut step = |params: &mut [Tensor]| {
        let mut h = x.clone();
        for l in 0..LAYERS {
            h = (&h.matmul(&params[2 * l]) + &params[2 * l + 1]).relu();
        }
        let loss = h.square().mean();
        let grads = loss.backward().unwrap();
        opt.step(params, &grads);
        dev.sync().unwrap();
        loss
    };
    let (loss, ran) = one_run("C3", dev, || step(&mut params));
    let products = check_products("C3", C3_PRODUCTS, &ran);
    let loss = loss.item::<f32>().unwrap() as f64;
    let (want_loss, want_params) = mlp_host(&xs, &ps, B, H, LR);
    let worst = params
        .iter()
        .zip(&want_params)
        .flat_map(|(p, want)| host(p).into_iter().zip(want.clone()))
        .map(|(a, b)| (a - b).abs() / (1e-3 + b.abs()))
        .fold(0.0, f64::max);
    let loss_err = (loss - want_loss).abs() / want_loss;
    assert!(loss_err < 1e-4 && worst < 1e-3, "C3: loss {loss} vs {want_loss}, worst parameter error {worst}");
    let t = median(3, 21, || {
        step(&mut params);
    });
    let gflop = C3_PRODUCTS as f64 * 2.0 * (B * H * H) as f64 / 1e9;
    let line = format!(
        "C3 mlp_step (H=512, batch 256, 4 layers, f32, fwd+bwd+SGD): {:.2} ms = {:.1} GFLOP/s ({gflop:.2} GFLOP), {} kernel(s) in the flush, peak +{:.1} MiB over the inputs; \
         braid and its peers: loss, all 8 gradients, SGD applied to all 8 parameters; {products}; \
         loss rel. error {loss_err:.1e}, all 8 updated parameters max rel. error {worst:.1e} (f64 on the host); target <= 14 ms",
        t * 1e3,
        gflop / t,
        ran.kernels,
        ran.peak_extra as f64 / 1048576.0
    );
    (t, line)
}

/// The C3 step on the host in f64: returns the loss and every parameter after the update.
fn mlp_host(x: &[f64], ps: &[Vec<f64>], b: usize, h: usize, lr: f64) -> (f64, Vec<Vec<f64>>) {
    // c[m x n] = a[m x k] * w[k x n] (+ optional transposes by index functions).
    let matmul = |m: usize, k: usize, n: usize, a: &dyn Fn(usize, usize) -> f64, w: &dyn Fn(usize, usize) -> f64| {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for kk in 0..k {
                let av = a(i, kk);
                if av != 0.0 {
                    for j in 0..n {
                        c[i * n + j] += av * w(kk, j);
                    }
                }
            }
        }
        c
    };
    let layers = ps.len() / 2;
    let mut acts = vec![x.to_vec()];
    for l in 0..layers {
        let (w, bias) = (&ps[2 * l], &ps[2 * l + 1]);
        let prev = acts.last().unwrap();
        let mut z = matmul(b, h, h, &|i, k| prev[i * h + k], &|k, j| w[k * h + j]);
        for (i, v) in z.iter_mut().enumerate() {
            *v = (*v + bias[i % h]).max(0.0);
        }
        acts.push(z);
    }
    let out = acts.last().unwrap();
    let n = out.len() as f64;
    let loss = out.iter().map(|v| v * v).sum::<f64>() / n;
    // Backward through every layer: each weight's and bias's gradient, and the input's for
    // every layer but the first.
    let mut g: Vec<f64> = out.iter().map(|v| 2.0 * v / n).collect();
    let mut updated = ps.to_vec();
    for l in (0..layers).rev() {
        let a_out = &acts[l + 1];
        for (gv, av) in g.iter_mut().zip(a_out) {
            if *av <= 0.0 {
                *gv = 0.0;
            }
        }
        let a_in = &acts[l];
        let gw = matmul(h, b, h, &|k, i| a_in[i * h + k], &|i, j| g[i * h + j]);
        let mut gb = vec![0.0; h];
        for (i, gv) in g.iter().enumerate() {
            gb[i % h] += gv;
        }
        for (p, grad) in [(2 * l, gw), (2 * l + 1, gb)] {
            updated[p].iter_mut().zip(grad).for_each(|(v, gv)| *v -= lr * gv);
        }
        if l > 0 {
            let w = &ps[2 * l];
            g = matmul(b, h, h, &|i, j| g[i * h + j], &|j, k| w[k * h + j]);
        }
    }
    (loss, updated)
}

/// C5's matrix products by construction (`mini_gpt::MiniGpt::loss_of_one_hot`; context 8,
/// batch 1). Forward: the token lookup as a one-hot product (1), per layer the query, key and
/// value projections (3), the scores `q @ k^T` and `att @ v` over all heads at once (2), the
/// output projection (1) and the feed-forward pair (2), 8 x 6 layers, and the head (1): 50.
/// Backward: a weight gradient for the lookup (the one-hot tokens need none), per layer two
/// products for each of the 6 linear layers and for each of the 2 attention products (both
/// operands need gradients), 16 x 6, and two for the head: 1 + 96 + 2 = 99. 149 in all.
const C5_PRODUCTS: usize = (1 + 8 * mini_gpt::LAYERS + 1) + (1 + 16 * mini_gpt::LAYERS + 2);

/// C5 mini_gpt: one SGD step per sample (forward, backward, update of every parameter, device
/// sync), f32. Checked first: 46,337 parameters, and the loss falls over the first steps. The
/// step lets its gradients go before the sync, as a training loop does when it reads only the
/// loss (see `examples/mini_gpt.rs`): each is consumed by its parameter's update, so all are
/// computed, but never all stored at once. The peak is also measured with the gradients kept
/// until after the sync, as PyTorch keeps them until `zero_grad`.
pub fn c5(dev: &Device) -> (f64, String) {
    let model = mini_gpt::MiniGpt::new(dev, 5);
    let params = model.params();
    assert_eq!(params.numel(), 46_337, "C5 parameter count");
    let tokens = mini_gpt::tokens();
    let ctx = mini_gpt::CONTEXT;
    let mut opt = braid::optim::Sgd::new(0.1);
    let mut at = 0;
    let mut step = |params: &braid::nn::Params, keep_grads: bool| {
        at = (at + 7) % (tokens.len() - ctx - 1);
        let loss = model.loss(&tokens[at..at + ctx], &tokens[at + 1..at + ctx + 1]);
        let grads = loss.backward().unwrap();
        braid::optim::Optimizer::update(&mut opt, params, &grads);
        let kept = keep_grads.then_some(grads);
        dev.sync().unwrap();
        drop(kept);
        loss
    };
    let (_, ran) = one_run("C5", dev, || step(&params, false));
    let products = check_products("C5", C5_PRODUCTS, &ran);
    let first: Vec<f32> = (0..40).map(|_| step(&params, false).item::<f32>().unwrap()).collect();
    let (early, late) = (first[..10].iter().sum::<f32>() / 10.0, first[30..].iter().sum::<f32>() / 10.0);
    assert!(late < early, "C5 loss does not fall: {early} -> {late}");
    dev.reset_peak();
    let t = median(20, 201, || {
        step(&params, false);
    });
    let peak = dev.memory().peak;
    let s = dev.last_schedule().unwrap();
    dev.reset_peak();
    for _ in 0..5 {
        step(&params, true);
    }
    let peak_kept = dev.memory().peak;
    let line = format!(
        "C5 mini_gpt (46,337 parameters, context 8, batch 1, f32, fwd+bwd+SGD+sync): {:.2} ms per step, {} kernel(s) per step; \
         braid and its peers: loss, every parameter's gradient, SGD applied to every parameter (braid's token lookup and loss \
         are one-hot products, PyTorch's an embedding and cross_entropy); {products}; \
         loss {early:.3} -> {late:.3} over 40 steps; peak device memory {:.0} KiB ({:.0} KiB with the gradients kept \
         past the sync); target <= 2.5 ms, peak below PyTorch's",
        t * 1e3,
        s.kernel_count(),
        peak as f64 / 1024.0,
        peak_kept as f64 / 1024.0
    );
    (t, line)
}

/// C5 as a captured `braid::Step` (the counterpart of `jax.jit`): the step takes the parameters,
/// the causal mask and one-hot tokens and targets as arguments, and returns the loss and the
/// updated parameters (SGD, lr 0.1, as the op-by-op C5), which the next step is called with.
pub fn c5_step(dev: &Device) -> (f64, String) {
    let model = mini_gpt::MiniGpt::new(dev, 5);
    let mut params: Vec<Tensor> = model.params().iter().cloned().collect();
    let n = params.len();
    let step = braid::Step::new(move |args: &[Tensor]| mini_gpt::sgd_step(args, n, 0.1));
    let tokens = mini_gpt::tokens();
    let ctx = mini_gpt::CONTEXT;
    let mut at = 0;
    let mut run = |params: &mut Vec<Tensor>| {
        at = (at + 7) % (tokens.len() - ctx - 1);
        let args = model.step_args(params, &tokens[at..at + ctx], &tokens[at + 1..at + ctx + 1]);
        let mut out = step.call(&args).unwrap();
        dev.sync().unwrap();
        *params = out.split_off(1);
        out.pop().unwrap()
    };
    // The first call captures; the products are counted on a replay, what is timed.
    run(&mut params);
    let (_, ran) = one_run("C5 step", dev, || run(&mut params));
    let products = check_products("C5 step", C5_PRODUCTS, &ran);
    let first: Vec<f32> = (0..40).map(|_| run(&mut params).item::<f32>().unwrap()).collect();
    let (early, late) = (first[..10].iter().sum::<f32>() / 10.0, first[30..].iter().sum::<f32>() / 10.0);
    assert!(late < early, "C5 step loss does not fall: {early} -> {late}");
    let t = median(20, 201, || {
        run(&mut params);
    });
    let line = format!(
        "C5 mini_gpt as a captured braid::Step (parameters in, loss and updated parameters out, sync): {:.2} ms per step, {} kernel(s), {} capture(s); \
         braid and jax.jit: loss, every parameter's gradient, every parameter updated; {products}; loss {early:.3} -> {late:.3} over 40 steps",
        t * 1e3,
        dev.last_schedule().unwrap().kernel_count(),
        step.captures()
    );
    (t, line)
}

/// The offload row's matrix products: 8 forward, 8 weight gradients, 7 input gradients (x needs
/// none).
const OFFLOAD_PRODUCTS: usize = 8 + 8 + 7;

/// G5 at CPU scale: an activation-heavy MLP training step (8 x `tanh(h @ W)`, batch 4096,
/// width 128, f32, SGD of all 8 weights) without a budget and with half and 35% of its planned
/// peak as the device budget: peak device memory and step time, and the results checked equal.
/// No peer runs it (PyTorch's `save_on_cpu` peer is G5's, on the GPU).
pub fn offload(dev_plain: &Device) -> (f64, String) {
    let build = |dev: &Device| {
        dev.seed(9);
        let x = Tensor::randn([4096, 128], DType::F32, dev);
        let ws: Vec<Tensor> = (0..8)
            .map(|_| braid::no_grad(|| Tensor::randn([128, 128], DType::F32, dev) * 0.1).requires_grad())
            .collect();
        dev.sync().unwrap();
        (x, ws)
    };
    let step = |dev: &Device, x: &Tensor, ws: &mut [Tensor]| {
        let mut h = x.clone();
        for w in ws.iter() {
            h = h.matmul(w).tanh();
        }
        let grads = h.square().mean().backward().unwrap();
        braid::optim::Sgd::new(0.01).step(ws, &grads);
        drop(grads);
        dev.sync().unwrap();
    };
    let run = |dev: &Device, budget: Option<u64>, row: &str| {
        let (x, mut ws) = build(dev);
        dev.set_memory_budget(budget);
        let ((), ran) = one_run(row, dev, || step(dev, &x, &mut ws));
        // Since `one_run` reset it: the inputs and weights included, as the budget counts them.
        let peak = dev.memory().peak;
        check_products(row, OFFLOAD_PRODUCTS, &ran);
        let planned = dev.last_schedule().unwrap().planned_peak_bytes();
        let offloads = dev.last_schedule().unwrap().to_json().matches("\"d2h\"").count();
        let t = median(2, 11, || step(dev, &x, &mut ws));
        let values: Vec<Vec<f32>> = ws.iter().map(|w| w.to_vec::<f32>().unwrap()).collect();
        (t, peak, planned, offloads, values, ran.products)
    };
    let (t0, peak0, planned0, _, v0, products) = run(dev_plain, None, "offload");
    let mut lines = vec![format!(
        "offload (MLP 8 x 128, batch 4096, f32, fwd+bwd+SGD of all 8 weights, braid only): no budget {:.2} ms, peak {:.1} MiB, \
         {products}/{OFFLOAD_PRODUCTS} products ran",
        t0 * 1e3,
        peak0 as f64 / 1048576.0
    )];
    let mut last = t0;
    for (name, fraction) in [("half", 0.5), ("35% of", 0.35)] {
        let dev = Device::new_cpu();
        let budget = (planned0 as f64 * fraction) as u64;
        let (t1, peak1, _, offloads, v1, products) = run(&dev, Some(budget), "offload under a budget");
        assert_eq!(v0, v1, "offloading changed the training result");
        assert!(peak1 <= budget, "peak {peak1} over the budget {budget}");
        lines.push(format!(
            "  budget {:.1} MiB ({name} the planned peak): {:.2} ms ({:+.0}%), peak {:.1} MiB ({:.0}% saved), {offloads} value(s) offloaded, \
             {products}/{OFFLOAD_PRODUCTS} products ran; all 8 weights identical",
            budget as f64 / 1048576.0,
            t1 * 1e3,
            100.0 * (t1 / t0 - 1.0),
            peak1 as f64 / 1048576.0,
            100.0 * (1.0 - peak1 as f64 / peak0 as f64)
        ));
        last = t1;
    }
    (last, lines.join("\n"))
}
