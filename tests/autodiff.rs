//! Autodiff: every op's gradient against central finite differences (f64, or f32 with larger
//! steps and tolerances on a device without f64; random inputs away
//! from kinks), on one stream and across streams; the micrograd graph; accumulation, no_grad,
//! in-place updates and misuse; whole models (an MLP, a transformer block) checked against the
//! reference interpreter evaluating exactly the backward graph braid recorded. Each gradient
//! check also reads its loss before the backward pass (which may leave saved values to be
//! recomputed) and gets the same gradients.

mod common;

use braid::prelude::*;
use braid_graph::table::{BinaryOp, UnaryOp};
use common::{Rng, check_recorded};

/// The device under test, one for the whole binary (tests mix tensors made by separate calls).
fn cpu() -> Device {
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEVICE.get_or_init(braid::testing::test_device).clone()
}

/// Random values in `[-2, 2]` at least 0.2 away from zero (kinks of relu/abs), or positive.
fn values(rng: &mut Rng, n: usize, positive: bool) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let v = rng.uniform(0.2, 2.0);
            if positive || rng.chance(0.5) { v } else { -v }
        })
        .collect()
}

fn leaf(shape: &[usize], vals: &[f64], dev: &Device) -> Tensor {
    wide(vals, shape.to_vec(), dev)
}

/// The widest float `dev` computes with: f64, or f32 on a device without it (wgpu), where
/// finite differences take larger steps and tolerances (`check_gradients_on`).
fn widest(dev: &Device) -> DType {
    if dev.target().dtypes.contains(DType::F64) { DType::F64 } else { DType::F32 }
}

/// A tensor of the widest float of `dev` holding `vals`.
fn wide(vals: &[f64], shape: impl Into<Shape>, dev: &Device) -> Tensor {
    common::tensor_from_f64(vals, &shape.into(), widest(dev), dev)
}

/// Reads tensors of the widest float as f64.
trait Wide {
    fn wide_vec(&self) -> Vec<f64>;
    fn wide_item(&self) -> f64;
}

impl Wide for Tensor {
    fn wide_vec(&self) -> Vec<f64> {
        match self.dtype() {
            DType::F64 => self.to_vec::<f64>().unwrap(),
            _ => self.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect(),
        }
    }

    fn wide_item(&self) -> f64 {
        let v = self.wide_vec();
        assert_eq!(v.len(), 1, "an item of {} elements", v.len());
        v[0]
    }
}

/// `sum(f(xs) * r)` for fixed random weights `r`, so every output element matters differently.
fn weighted_loss(out: &Tensor, weights: &[f64]) -> Tensor {
    (out * &leaf(out.dims(), weights, out.device())).sum()
}

/// Checks the gradients `backward` records for `f` against central finite differences.
fn check_gradients(name: &str, inputs: &[(Vec<usize>, Vec<f64>)], f: &dyn Fn(&[Tensor]) -> Tensor) {
    check_gradients_on(&cpu(), name, inputs, f)
}

fn check_gradients_on(dev: &Device, name: &str, inputs: &[(Vec<usize>, Vec<f64>)], f: &dyn Fn(&[Tensor]) -> Tensor) {
    let dev = dev.clone();
    // In f32 (a device without f64), rounding swamps steps of 1e-5: larger steps, looser
    // tolerances, which still catch a wrong derivative.
    let f64_steps = widest(&dev) == DType::F64;
    let mut rng = Rng::new(name.len() as u64 * 7919);
    let leaves: Vec<Tensor> = inputs.iter().map(|(s, v)| leaf(s, v, &dev).requires_grad()).collect();
    let out = f(&leaves);
    let weights = values(&mut rng, out.numel(), false);
    let loss = weighted_loss(&out, &weights);
    let grads = loss.backward().unwrap();
    // The same with the loss read before the backward pass, as an eager training step reads
    // it: that flush may leave saved values for the backward pass to recompute
    // (tests/recompute.rs), which must not change the gradients.
    let read_first = weighted_loss(&f(&leaves), &weights);
    read_first.wide_item();
    let grads_read_first = read_first.backward().unwrap();
    let same = if f64_steps { 1e-12 } else { 1e-6 };
    for (i, x) in leaves.iter().enumerate() {
        if let (Some(a), Some(b)) = (grads.get(x), grads_read_first.get(x)) {
            for (j, (a, b)) in a.wide_vec().iter().zip(b.wide_vec()).enumerate() {
                assert!((a - b).abs() <= same * (1.0 + b.abs()), "{name}: d/dx{i}[{j}] = {a}, {b} after a loss read");
            }
        }
    }
    let loss_at = |vals: &[Vec<f64>]| -> f64 {
        braid::no_grad(|| {
            let xs: Vec<Tensor> = inputs.iter().zip(vals).map(|((s, _), v)| leaf(s, v, &dev)).collect();
            weighted_loss(&f(&xs), &weights).wide_item()
        })
    };
    let base: Vec<Vec<f64>> = inputs.iter().map(|(_, v)| v.clone()).collect();
    for (i, x) in leaves.iter().enumerate() {
        let g = grads.get(x).unwrap_or_else(|| panic!("{name}: no gradient for input {i}"));
        assert_eq!((g.dims(), g.dtype()), (x.dims(), x.dtype()), "{name}: gradient {i} shape/dtype");
        let analytic = g.wide_vec();
        for j in 0..base[i].len() {
            let h = if f64_steps { 1e-5 } else { 1e-2 } * base[i][j].abs().max(1.0);
            let mut plus = base.clone();
            plus[i][j] += h;
            let mut minus = base.clone();
            minus[i][j] -= h;
            let numeric = (loss_at(&plus) - loss_at(&minus)) / (2.0 * h);
            let tol = if f64_steps { 1e-5 } else { 2e-2 } * (1.0 + numeric.abs());
            assert!(
                (analytic[j] - numeric).abs() <= tol,
                "{name}: d/dx{i}[{j}] = {} but finite differences give {numeric}",
                analytic[j]
            );
        }
    }
}

#[test]
fn every_unary_op_of_the_table() {
    let mut rng = Rng::new(1);
    for &op in UnaryOp::ALL {
        let positive = matches!(op, UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt);
        let x = values(&mut rng, 6, positive);
        check_gradients(op.name(), &[(vec![2, 3], x)], &|xs| xs[0].unary(op));
    }
}

#[test]
fn every_binary_op_of_the_table_with_broadcasting() {
    let mut rng = Rng::new(2);
    for &op in BinaryOp::ALL {
        let positive = op == BinaryOp::Pow;
        for (sa, sb) in
            [(vec![2, 3], vec![2, 3]), (vec![2, 3], vec![3]), (vec![2, 1], vec![1, 3]), (vec![], vec![2, 2])]
        {
            let na: usize = sa.iter().product();
            let nb: usize = sb.iter().product();
            let a = values(&mut rng, na, positive);
            let b = values(&mut rng, nb, false);
            let name = format!("{}({sa:?}, {sb:?})", op.name());
            check_gradients(&name, &[(sa, a), (sb, b)], &|xs| xs[0].binary(op, &xs[1]));
        }
    }
}

#[test]
fn scalar_forms_select_clamp_and_cast() {
    let mut rng = Rng::new(3);
    let x = || (vec![2, 3], values(&mut Rng::new(33), 6, false));
    let pos = (vec![2, 3], values(&mut rng, 6, true));
    check_gradients("x + 2", &[x()], &|xs| &xs[0] + 2.0);
    check_gradients("2 - x", &[x()], &|xs| 2.0 - &xs[0]);
    check_gradients("3 * x", &[x()], &|xs| 3.0 * &xs[0]);
    check_gradients("3 / x", &[x()], &|xs| 3.0 / &xs[0]);
    check_gradients("x / 4", &[x()], &|xs| &xs[0] / 4.0);
    check_gradients("x ^ 2.5", std::slice::from_ref(&pos), &|xs| xs[0].powf(2.5));
    check_gradients("1.5 ^ x", &[x()], &|xs| xs[0].binary_scalar(BinaryOp::Pow, 1.5, true));
    check_gradients("maximum(x, 0.1)", &[x()], &|xs| xs[0].binary_scalar(BinaryOp::Maximum, 0.1, false));
    let cond = Tensor::from_vec(vec![true, false, true], [3], &cpu());
    let b = (vec![2, 1], values(&mut rng, 2, false));
    check_gradients("select", &[x(), b], &|xs| cond.select(&xs[0], &xs[1]));
    // Bounds well away from every value (all |v| >= 0.2).
    check_gradients("clamp", &[x()], &|xs| xs[0].clamp(-0.15, 0.1) + xs[0].clamp(-10.0, 10.0));
    check_gradients("cast", &[x()], &|xs| xs[0].to_dtype(widest(xs[0].device())).exp());
}

#[test]
fn reductions() {
    let x = || (vec![3, 4], values(&mut Rng::new(4), 12, false));
    check_gradients("sum", &[x()], &|xs| xs[0].sum());
    check_gradients("mean", &[x()], &|xs| xs[0].mean());
    for dim in 0..2 {
        for keep in [false, true] {
            let tag = format!("dim {dim} keep {keep}");
            check_gradients(&format!("sum_dim {tag}"), &[x()], &|xs| xs[0].sum_dim(dim, keep));
            check_gradients(&format!("mean_dim {tag}"), &[x()], &|xs| xs[0].mean_dim(dim, keep));
            check_gradients(&format!("max_dim {tag}"), &[x()], &|xs| xs[0].max_dim(dim, keep));
            check_gradients(&format!("min_dim {tag}"), &[x()], &|xs| xs[0].min_dim(dim, keep));
        }
    }
}

#[test]
fn max_shares_the_gradient_between_ties() {
    let x = wide(&[1.0, 3.0, 3.0, 2.0], [4], &cpu()).requires_grad();
    let g = x.max_dim(0, false).backward().unwrap();
    assert_eq!(g.get(&x).unwrap().wide_vec(), vec![0.0, 0.5, 0.5, 0.0]);
}

#[test]
fn maximum_and_minimum_split_the_gradient_of_a_tie() {
    // As PyTorch: each operand gets half where they are equal, so maximum(x, x) passes the
    // gradient on whole, and relu written as maximum(x, 0) has slope 1/2 at 0.
    let dev = cpu();
    let a = wide(&[1.0, 2.0, 3.0], [3], &dev).requires_grad();
    let b = wide(&[1.0, 0.0, 4.0], [3], &dev).requires_grad();
    let w = wide(&[2.0, 3.0, 5.0], [3], &dev);
    let g = (&a.maximum(&b) * &w).sum().backward().unwrap();
    assert_eq!(g.get(&a).unwrap().wide_vec(), vec![1.0, 3.0, 0.0]);
    assert_eq!(g.get(&b).unwrap().wide_vec(), vec![1.0, 0.0, 5.0]);
    let g = (&a.minimum(&b) * &w).sum().backward().unwrap();
    assert_eq!(g.get(&a).unwrap().wide_vec(), vec![1.0, 0.0, 5.0]);
    assert_eq!(g.get(&b).unwrap().wide_vec(), vec![1.0, 3.0, 0.0]);
    let g = (&a.maximum(&a) * &w).sum().backward().unwrap();
    assert_eq!(g.get(&a).unwrap().wide_vec(), vec![2.0, 3.0, 5.0]);
    let z = wide(&[0.0, -1.0, 2.0], [3], &dev).requires_grad();
    let g = z.binary_scalar(BinaryOp::Maximum, 0.0, false).sum().backward().unwrap();
    assert_eq!(g.get(&z).unwrap().wide_vec(), vec![0.5, 0.0, 1.0]);
}

#[test]
fn matrix_products_with_broadcast_batches() {
    let mut rng = Rng::new(5);
    for (sa, sb) in [
        (vec![2, 3], vec![3, 4]),
        (vec![2, 2, 3], vec![3, 2]),
        (vec![1, 2, 3], vec![2, 3, 2]),
        (vec![2, 1, 2, 3], vec![3, 3, 2]),
    ] {
        let na: usize = sa.iter().product();
        let nb: usize = sb.iter().product();
        let inputs = [(sa.clone(), values(&mut rng, na, false)), (sb.clone(), values(&mut rng, nb, false))];
        check_gradients(&format!("matmul {sa:?} x {sb:?}"), &inputs, &|xs| xs[0].matmul(&xs[1]));
    }
    let inputs = [(vec![3, 2], values(&mut rng, 6, false)), (vec![4, 2], values(&mut rng, 8, false))];
    check_gradients("x @ w^T", &inputs, &|xs| xs[0].matmul(&xs[1].t()));
}

#[test]
fn movement() {
    let x = || (vec![2, 3, 2], values(&mut Rng::new(6), 12, false));
    check_gradients("reshape", &[x()], &|xs| xs[0].reshape([3, 4]).exp());
    check_gradients("permute", &[x()], &|xs| xs[0].permute(&[2, 0, 1]).sin());
    check_gradients("transpose", &[x()], &|xs| xs[0].transpose(0, 2).square());
    check_gradients("expand", &[(vec![3, 1], values(&mut Rng::new(7), 3, false))], &|xs| xs[0].expand([2, 3, 4]));
    check_gradients("narrow", &[x()], &|xs| xs[0].narrow(1, 1, 1).exp() + xs[0].narrow(0, 0, 1).sum());
    // Parts of one value: side by side and whole, with a gap, overlapping, and over two axes.
    let parts = |xs: &[Tensor], spans: &[(usize, usize, usize)]| {
        let y = xs[0].exp();
        spans.iter().map(|&(dim, at, len)| y.narrow(dim, at, len).sin().sum()).fold(y.sum() * 0.0, |a, b| a + b)
    };
    check_gradients("narrows side by side", &[x()], &|xs| parts(xs, &[(2, 0, 1), (2, 1, 1)]));
    check_gradients("narrows with a gap", &[x()], &|xs| parts(xs, &[(1, 2, 1), (1, 0, 1)]));
    check_gradients("narrows overlapping", &[x()], &|xs| parts(xs, &[(1, 0, 2), (1, 1, 2), (1, 2, 1)]));
    check_gradients("narrows over two axes", &[x()], &|xs| parts(xs, &[(1, 0, 1), (0, 1, 1), (1, 1, 2)]));
    let y = (vec![2, 1, 2], values(&mut Rng::new(8), 4, false));
    check_gradients("cat", &[x(), y], &|xs| Tensor::cat(&[&xs[0], &xs[1], &xs[0]], 1).tanh());
    check_gradients("contiguous", &[x()], &|xs| xs[0].contiguous().cos());
    check_gradients("squeeze/unsqueeze/flatten", &[x()], &|xs| xs[0].unsqueeze(1).squeeze(1).flatten().exp());
}

#[test]
fn composites() {
    let x = || (vec![2, 5], values(&mut Rng::new(9), 10, false));
    check_gradients("softmax", &[x()], &|xs| xs[0].softmax(1));
    check_gradients("log_softmax", &[x()], &|xs| xs[0].log_softmax(1));
    check_gradients("layer_norm", &[x()], &|xs| xs[0].layer_norm(1, 1e-5));
    check_gradients("gelu(x) * sigmoid(x)", &[x()], &|xs| xs[0].gelu() * xs[0].sigmoid());
}

#[test]
fn in_place_updates_are_differentiated_per_version() {
    let mut rng = Rng::new(10);
    let inputs = [(vec![4], values(&mut rng, 4, false)), (vec![4], values(&mut rng, 4, false))];
    check_gradients("in-place chain", &inputs, &|xs| {
        let h = &xs[0] * 1.0;
        h.add_assign(&xs[1]);
        h.mul_assign(&xs[0]);
        let keep = h.clone();
        h.sub_assign(&xs[1].exp());
        h.assign(&(&h * &keep));
        h
    });
}

/// The micrograd example (BENCH.md C4), with in-place `+=` as the example writes it.
fn tiny_graph(dev: &Device) -> (Tensor, Tensor, Tensor) {
    let a = wide(&[-4.0], (), dev).requires_grad();
    let b = wide(&[2.0], (), dev).requires_grad();
    let c = &a + &b;
    let d = &(&a * &b) + &b.powf(3.0);
    c.add_assign(&(&c + 1.0));
    c.add_assign(&(&(1.0 + &c) + &a.neg()));
    d.add_assign(&(&(&d * 2.0) + &(&b + &a).relu()));
    d.add_assign(&(&(3.0 * &d) + &(&b - &a).relu()));
    let e = &c - &d;
    let f = e.powf(2.0);
    let g = &f / 2.0;
    g.add_assign(&(10.0 / &f));
    (a, b, g)
}

#[test]
fn micrograd_example_gives_the_published_values() {
    let (a, b, g) = tiny_graph(&cpu());
    let grads = g.backward().unwrap();
    let close = |x: f64, want: f64| (x - want).abs() < 1e-4 * want.abs().max(1.0);
    assert!(close(g.wide_item(), 24.7041), "g = {}", g.wide_item());
    let da = grads.get(&a).unwrap().wide_item();
    let db = grads.get(&b).unwrap().wide_item();
    assert!(close(da, 138.8338) && close(db, 645.5773), "dg/da = {da}, dg/db = {db}");
}

#[test]
fn backward_follows_the_forward_streams() {
    // Its own device: the dump read below must be this test's last flush.
    let dev = braid::testing::test_device();
    let side = dev.new_stream();
    let mut rng = Rng::new(11);
    let inputs = [(vec![3, 4], values(&mut rng, 12, false)), (vec![4, 2], values(&mut rng, 8, false))];
    let f = |xs: &[Tensor]| {
        let h = side.scope(|| xs[0].matmul(&xs[1]).tanh());
        (&h * &h).sum_dim(1, false)
    };
    check_gradients_on(&dev, "two streams", &inputs, &f);
    // The gradient of w is `x^T @ g`, recorded where the forward matmul ran; the gradient of
    // `h * h` stays on the default stream.
    let x = leaf(&inputs[0].0, &inputs[0].1, &dev).requires_grad();
    let w = leaf(&inputs[1].0, &inputs[1].1, &dev).requires_grad();
    let loss = f(&[x.clone(), w.clone()]).sum();
    let grads = loss.backward().unwrap();
    assert_eq!(grads.get(&w).unwrap().stream(), side);
    assert_eq!(grads.get(&x).unwrap().stream(), side);
    let gw = grads.get(&w).unwrap();
    gw.wide_vec();
    let dump = dev.last_schedule().unwrap().to_json();
    let json: serde_json::Value = serde_json::from_str(&dump).unwrap();
    let kernels_on = |s: u64| {
        json["streams"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|st| st["id"] == s)
            .flat_map(|st| st["steps"].as_array().unwrap().iter())
            .filter(|step| step["kind"] == "kernel")
            .count()
    };
    assert!(kernels_on(side.id() as u64) >= 2, "backward kernels on the side stream:\n{dump}");
}

#[test]
fn gradients_accumulate_over_backward_calls() {
    let dev = cpu();
    let w = wide(&[1.0, 2.0], [2], &dev).requires_grad();
    let mut grads = Grads::new();
    (&w * &w).sum().backward_into(&mut grads).unwrap();
    (&w * 3.0).sum().backward_into(&mut grads).unwrap();
    assert_eq!(grads.get(&w).unwrap().wide_vec(), vec![5.0, 7.0]);
    assert_eq!(grads.len(), 1);
}

#[test]
fn no_grad_and_detach_stop_gradients() {
    let dev = cpu();
    let w = wide(&[1.0, 2.0], [2], &dev).requires_grad();
    let frozen = braid::no_grad(|| &w * 2.0);
    assert!(!frozen.needs_grad() && !w.detach().needs_grad() && w.needs_grad());
    assert!(braid::grad_enabled());
    let loss = (&(&w * &frozen) + &w.detach()).sum();
    let g = loss.backward().unwrap();
    assert_eq!(g.get(&w).unwrap().wide_vec(), vec![2.0, 4.0]);
    assert!(g.get(&frozen).is_none());
    // A leaf updated without gradients stays the same leaf.
    braid::no_grad(|| w.sub_assign(&(&g.get(&w).unwrap() * 0.5)));
    assert!(w.needs_grad());
    let g2 = w.sum().backward().unwrap();
    assert_eq!(g2.get(&w).unwrap().wide_vec(), vec![1.0, 1.0]);
    assert_eq!(w.wide_vec(), vec![0.0, 0.0]);
}

fn panic_message(f: impl FnOnce()) -> String {
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("should panic");
    e.downcast_ref::<String>().cloned().unwrap_or_default()
}

#[test]
fn misuse_is_reported_at_the_call() {
    let dev = cpu();
    let w = Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev).requires_grad();
    let m = panic_message(|| (&w * 2.0).backward().map(|_| ()).unwrap());
    assert!(m.contains("backward") && m.contains("one element") && m.contains("autodiff.rs"), "{m}");
    let m = panic_message(|| Tensor::from_vec(vec![1.0f32], [1], &dev).sum().backward().map(|_| ()).unwrap());
    assert!(m.contains("no gradient history"), "{m}");
    let m = panic_message(|| w.add_assign(&w));
    assert!(m.contains("no_grad") && m.contains("autodiff.rs"), "{m}");
    // An integer tensor cannot require gradients (i32: wgpu has no i64 for `arange`).
    let m = panic_message(|| {
        Tensor::from_vec(vec![0i32, 1, 2], [3], &dev).requires_grad();
    });
    assert!(m.contains("floating-point"), "{m}");
    let loss = (&w * &w).sum();
    loss.backward().unwrap();
    let m = panic_message(|| loss.backward().map(|_| ()).unwrap());
    assert!(m.contains("keep_graph"), "{m}");
    // Keeping the graph allows a second pass, and the engine is fine after all of the above.
    let loss = (&w * &w).sum();
    let mut g = Grads::new();
    loss.backward_with(&mut g, true).unwrap();
    loss.backward_with(&mut g, false).unwrap();
    assert_eq!(g.get(&w).unwrap().to_vec::<f32>().unwrap(), vec![4.0, 8.0]);
}

/// A two-layer MLP's gradients, as braid computes them (fusion on, poison on or off),
/// against the reference interpreter evaluating the recorded backward graph.
#[test]
fn mlp_gradients_equal_the_reference() {
    for (poison, budget) in [(false, false), (true, false), (true, true)] {
        let dev = braid::testing::test_device();
        dev.set_poison(poison);
        if budget {
            // Out of reach: the read raises it to the lowest reachable peak, which offloads.
            dev.set_memory_budget(Some(1));
        }
        dev.seed(12);
        let x = Tensor::randn([64, 16], DType::F32, &dev);
        let w1 = Tensor::randn([16, 32], DType::F32, &dev).requires_grad();
        let b1 = Tensor::randn([32], DType::F32, &dev).requires_grad();
        let w2 = Tensor::randn([32, 4], DType::F32, &dev).requires_grad();
        let h = (&x.matmul(&w1) + &b1).relu();
        let loss = h.matmul(&w2).square().mean();
        let grads = loss.backward().unwrap();
        let targets: Vec<Tensor> = [&w1, &b1, &w2].iter().map(|p| grads.get(p).unwrap()).collect();
        let refs: Vec<&Tensor> = targets.iter().collect();
        let stats = check_recorded(&refs).unwrap_or_else(|e| panic!("poison {poison}: {e}"));
        assert!(stats.checked > 500, "{stats:?}");
        let offloads = dev.last_schedule().unwrap().to_json().matches("\"d2h\"").count();
        assert_eq!(offloads > 0, budget, "{}", dev.last_schedule().unwrap().to_text());
    }
}

/// One pre-norm transformer block (attention with a causal mask, an MLP with GELU) on two
/// streams, checked against the reference.
#[test]
fn transformer_block_gradients_equal_the_reference() {
    for budget in [false, true] {
        transformer_block(budget);
    }
}

fn transformer_block(budget: bool) {
    let dev = braid::testing::test_device();
    if budget {
        dev.set_poison(true);
        dev.set_memory_budget(Some(1));
    }
    dev.seed(13);
    let (t, d) = (6, 8);
    let p = |shape: &[usize]| (Tensor::randn(shape.to_vec(), DType::F32, &dev) * 0.3).detach().requires_grad();
    let x = Tensor::randn([t, d], DType::F32, &dev);
    let (wq, wk, wv, wo, w1, w2) = (p(&[d, d]), p(&[d, d]), p(&[d, d]), p(&[d, d]), p(&[d, 4 * d]), p(&[4 * d, d]));
    let mask_vals: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -30.0 } else { 0.0 }).collect();
    let mask = Tensor::from_vec(mask_vals, [t, t], &dev);
    let side = dev.new_stream();
    let h = x.layer_norm(1, 1e-5);
    let q = h.matmul(&wq);
    let k = side.scope(|| h.matmul(&wk));
    let v = side.scope(|| h.matmul(&wv));
    let att = (&(&q.matmul(&k.t()) * (1.0 / (d as f64).sqrt())) + &mask).softmax(1);
    let x2 = &x + &att.matmul(&v).matmul(&wo);
    let mlp = x2.layer_norm(1, 1e-5).matmul(&w1).gelu().matmul(&w2);
    let loss = (&x2 + &mlp).square().mean();
    let grads = loss.backward().unwrap();
    let params = [&wq, &wk, &wv, &wo, &w1, &w2];
    let targets: Vec<Tensor> = params.iter().map(|p| grads.get(p).unwrap()).collect();
    let refs: Vec<&Tensor> = targets.iter().collect();
    let stats = check_recorded(&refs).unwrap();
    assert!(stats.checked > 600, "{stats:?}");
    let offloads = dev.last_schedule().unwrap().to_json().matches("\"d2h\"").count();
    assert_eq!(offloads > 0, budget, "{}", dev.last_schedule().unwrap().to_text());
}

/// Regressions found in review.
#[test]
fn a_scalar_loss_times_operands_of_other_ranks() {
    let dev = cpu();
    let a = Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev).requires_grad();
    let b = Tensor::from_vec(vec![3.0f32], [1], &dev).requires_grad();
    let g = (&a.sum() * &b).backward().unwrap();
    assert_eq!(g.get(&a).unwrap().to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
    assert_eq!(g.get(&b).unwrap().to_vec::<f32>().unwrap(), vec![3.0]);
    let x = Tensor::from_vec(vec![2.0f32], [1, 1], &dev).requires_grad();
    let s = Tensor::from_vec(vec![5.0f32], (), &dev).requires_grad();
    let g = (&x * &s).sum().backward().unwrap();
    assert_eq!(
        (g.get(&x).unwrap().to_vec::<f32>().unwrap(), g.get(&s).unwrap().to_vec::<f32>().unwrap()),
        (vec![5.0], vec![2.0])
    );
    // A constant gradient times a smaller operand broadcast over the output: summed over it.
    let p = Tensor::from_vec(vec![2.0f32], [1], &dev).requires_grad();
    let q = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &dev).requires_grad();
    let g = (&(&p * &q) * 1.0).sum().backward().unwrap();
    assert_eq!(g.get(&p).unwrap().to_vec::<f32>().unwrap(), vec![6.0]);
}

#[test]
fn a_very_deep_history_is_dropped_without_overflowing_the_stack() {
    let w = Tensor::from_vec(vec![1.0f32], [1], &cpu()).requires_grad();
    let mut h = w.clone();
    for _ in 0..200_000 {
        h = &h + 1.0;
    }
    drop(h);
}

#[test]
fn pow_gradients_at_a_zero_base_are_zero_not_nan() {
    let dev = cpu();
    let x = wide(&[0.0, 2.0], [2], &dev).requires_grad();
    let p = wide(&[2.0, 2.0], [2], &dev).requires_grad();
    let g = x.pow(&p).sum().backward().unwrap();
    let dp = g.get(&p).unwrap().wide_vec();
    assert_eq!(dp[0], 0.0);
    assert!((dp[1] - 4.0 * 2f64.ln()).abs() < if widest(&dev) == DType::F64 { 1e-12 } else { 1e-6 });
    let g = x.powf(0.0).sum().backward().unwrap();
    assert_eq!(g.get(&x).unwrap().wide_vec(), vec![0.0, 0.0]);
}

#[test]
fn in_place_misuse_names_the_method_called() {
    let w = Tensor::from_vec(vec![1.0f32], [1], &cpu()).requires_grad();
    let m = panic_message(|| w.assign(&Tensor::from_vec(vec![2.0f32], [1], &cpu())));
    assert!(m.contains("invalid assign at"), "{m}");
}

#[test]
fn indexing_ops_and_cross_entropy() {
    if common::skip_without_i64(&cpu(), "indexing_ops_and_cross_entropy") {
        return;
    }
    let mut rng = Rng::new(20);
    let ids = |v: Vec<i64>, shape: &[usize]| Tensor::from_vec(v, shape.to_vec(), &cpu());
    let x = (vec![3, 4], values(&mut rng, 12, false));
    // Repeated indices (their gradients add up) and one out of range (no gradient).
    let gi = ids(vec![1, 1, 3, 0, 2, 2, 0, 4], &[2, 4]);
    check_gradients("gather(0)", std::slice::from_ref(&x), &|xs| xs[0].gather(0, &gi));
    let gi1 = ids(vec![3, 3, 0, 1, 1, 2], &[3, 2]);
    check_gradients("gather(-1)", std::slice::from_ref(&x), &|xs| xs[0].gather(-1, &gi1));
    let si = ids(vec![2, 0, 2, 9, 1], &[5]);
    check_gradients("index_select(1)", std::slice::from_ref(&x), &|xs| xs[0].index_select(1, &si));
    let tokens = ids(vec![0, 2, 2, 1, 0, 2], &[2, 3]);
    check_gradients("embedding", std::slice::from_ref(&x), &|xs| tokens.embedding(&xs[0]));
    let src = (vec![2, 4], values(&mut rng, 8, false));
    let sc = ids(vec![2, 0, 2, 1, 0, 0, 5, 1], &[2, 4]);
    check_gradients("scatter_add(0)", &[x.clone(), src.clone()], &|xs| xs[0].scatter_add(0, &sc, &xs[1]));
    // Distinct rows in each column (a later write would take an earlier one's gradient, as in
    // PyTorch), one out of range (no gradient): the base's gradient is zero where written.
    let wi = ids(vec![2, 0, 1, 5, 0, 1, 2, 2], &[2, 4]);
    check_gradients("scatter(0)", &[x.clone(), src], &|xs| xs[0].scatter(0, &wi, &xs[1]));
    let logits = (vec![2, 3, 4], values(&mut rng, 24, false));
    let target = ids(vec![3, 0, 1, 1, 2, 0], &[2, 3]);
    check_gradients("cross_entropy", &[logits], &|xs| xs[0].cross_entropy(&target));
}

#[test]
fn the_gradients_of_a_values_parts_are_one_concatenation() {
    // A product split into three parts along its columns (attention's q, k and v): what reaches
    // the product is the parts' gradients side by side, not each padded with zeros to the
    // whole and the padded copies added. (A device of its own: the shared one's last schedule
    // may be another test's.)
    let dev = braid::testing::test_device();
    let x = leaf(&[4, 6], &values(&mut Rng::new(11), 24, false), &dev).requires_grad();
    let y = x.exp();
    let (q, k, v) = (y.narrow(1, 0, 2), y.narrow(1, 2, 2), y.narrow(1, 4, 2));
    let loss = (&(&q.sin() * &k) + &v.square()).sum();
    let g = loss.backward().unwrap().get(&x).unwrap();
    g.wide_vec();
    let text = dev.last_schedule().unwrap().to_text();
    let ops: Vec<&str> = text.lines().filter_map(|l| l.trim().strip_prefix('k')?.split_whitespace().nth(1)).collect();
    let count = |op: &str| ops.iter().flat_map(|o| o.split('+')).filter(|o| *o == op).count();
    // (Only the gradient is read, so the loss's own sum and add are not computed.)
    assert_eq!((count("cat"), count("add")), (1, 0), "one concatenation and no sums of padded copies:\n{text}");
}
