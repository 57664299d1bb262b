//! Optimizers against a plain f64 implementation of the same update rules, over several steps
//! with gradients that depend on the parameters (so optimizer state matters).

mod common;

use braid::optim::{Adam, AdamW, Sgd};
use braid::prelude::*;
use common::Rng;

/// loss = sum(c * p^2) / 2 + sum(d * p): gradient c * p + d.
fn loss(p: &Tensor, c: &Tensor, d: &Tensor) -> Tensor {
    (&(&(c * &p.square()) * 0.5) + &(d * p)).sum()
}

fn grad_host(p: &[f64], c: &[f64], d: &[f64]) -> Vec<f64> {
    p.iter().zip(c).zip(d).map(|((p, c), d)| c * p + d).collect()
}

/// Runs `steps` braid steps and returns the parameter values after each.
fn run(mut step: impl FnMut(&mut [Tensor], &Grads), p0: &[f64], c: &[f64], d: &[f64], steps: usize) -> Vec<Vec<f64>> {
    let dev = braid::testing::test_device();
    let n = p0.len();
    // f64, or f32 on a device without it (wgpu; `assert_close` then allows f32 rounding).
    let dtype = if dev.target().dtypes.contains(DType::F64) { DType::F64 } else { DType::F32 };
    let shape = Shape::from([n]);
    let p = common::tensor_from_f64(p0, &shape, dtype, &dev).requires_grad();
    let (ct, dt) = (common::tensor_from_f64(c, &shape, dtype, &dev), common::tensor_from_f64(d, &shape, dtype, &dev));
    (0..steps)
        .map(|_| {
            let grads = loss(&p, &ct, &dt).backward().unwrap();
            step(&mut [p.clone()], &grads);
            match dtype {
                DType::F64 => p.to_vec::<f64>().unwrap(),
                _ => p.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect(),
            }
        })
        .collect()
}

fn assert_close(name: &str, got: &[Vec<f64>], want: &[Vec<f64>]) {
    let dev = braid::testing::test_device();
    let tol = if dev.target().dtypes.contains(DType::F64) { 1e-12 } else { 1e-5 };
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{name}: step {s}, element {i}: {a} vs {b}");
        }
    }
}

fn problem(seed: u64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut rng = Rng::new(seed);
    let p = (0..6).map(|_| rng.uniform(-2.0, 2.0)).collect();
    let c = (0..6).map(|_| rng.uniform(0.5, 2.0)).collect();
    let d = (0..6).map(|_| rng.uniform(-1.0, 1.0)).collect();
    (p, c, d)
}

#[test]
fn sgd_with_momentum_nesterov_and_weight_decay() {
    let (p0, c, d) = problem(1);
    for (momentum, dampening, wd, nesterov) in [(0.0, 0.0, 0.0, false), (0.9, 0.1, 0.01, false), (0.8, 0.0, 0.05, true)]
    {
        let lr = 0.1;
        let mut opt = Sgd::new(lr).momentum(momentum).dampening(dampening).weight_decay(wd).nesterov(nesterov);
        let got = run(|p, g| opt.step(p, g), &p0, &c, &d, 5);
        let mut p = p0.clone();
        let mut b: Option<Vec<f64>> = None;
        let want: Vec<Vec<f64>> = (0..5)
            .map(|_| {
                let mut g: Vec<f64> = grad_host(&p, &c, &d).iter().zip(&p).map(|(g, p)| g + wd * p).collect();
                if momentum != 0.0 {
                    let nb: Vec<f64> = match &b {
                        Some(b) => b.iter().zip(&g).map(|(b, g)| momentum * b + (1.0 - dampening) * g).collect(),
                        None => g.clone(),
                    };
                    g = if nesterov { g.iter().zip(&nb).map(|(g, b)| g + momentum * b).collect() } else { nb.clone() };
                    b = Some(nb);
                }
                p = p.iter().zip(&g).map(|(p, g)| p - lr * g).collect();
                p.clone()
            })
            .collect();
        assert_close(&format!("sgd m={momentum} nesterov={nesterov}"), &got, &want);
    }
}

fn adam_host(p0: &[f64], c: &[f64], d: &[f64], lr: f64, wd: f64, decoupled: bool, steps: usize) -> Vec<Vec<f64>> {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
    let mut p = p0.to_vec();
    let mut m = vec![0.0; p.len()];
    let mut v = vec![0.0; p.len()];
    (1..=steps)
        .map(|t| {
            let mut g = grad_host(&p, c, d);
            if decoupled {
                p.iter_mut().for_each(|p| *p *= 1.0 - lr * wd);
            } else {
                g.iter_mut().zip(&p).for_each(|(g, p)| *g += wd * p);
            }
            for i in 0..p.len() {
                m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                let denom = v[i].sqrt() / (1.0 - b2.powi(t as i32)).sqrt() + eps;
                p[i] -= lr / (1.0 - b1.powi(t as i32)) * m[i] / denom;
            }
            p.clone()
        })
        .collect()
}

#[test]
fn adam_and_adamw_match_the_published_rules() {
    let (p0, c, d) = problem(2);
    let mut adam = Adam::new(0.05).weight_decay(0.02);
    let got = run(|p, g| adam.step(p, g), &p0, &c, &d, 6);
    assert_close("adam", &got, &adam_host(&p0, &c, &d, 0.05, 0.02, false, 6));
    let mut adamw = AdamW::new(0.05).weight_decay(0.1);
    let got = run(|p, g| adamw.step(p, g), &p0, &c, &d, 6);
    assert_close("adamw", &got, &adam_host(&p0, &c, &d, 0.05, 0.1, true, 6));
}

/// A state taken from one AdamW after 3 steps and set on a fresh one, for a copy of the
/// parameter, continues as the first does (a checkpoint's restart); moments of another shape
/// are misuse at the caller's line.
#[test]
fn adamw_states_carry_a_run_over_to_another_optimizer() {
    let (p0, c, d) = problem(3);
    let mut first = AdamW::new(0.05);
    let want = run(|p, g| first.step(p, g), &p0, &c, &d, 6);
    let mut adamw = AdamW::new(0.05);
    let mut steps = 0;
    let mut step = |p: &mut [Tensor], g: &Grads| {
        steps += 1;
        if steps == 4 {
            // A fresh optimizer, continuing from the state the first three steps left.
            let state = adamw.state(&p[0]).expect("a state after 3 steps");
            assert_eq!(state.step, 3);
            adamw = AdamW::new(0.05);
            adamw.set_state(&p[0], state);
        }
        adamw.step(p, g);
    };
    let got = run(&mut step, &p0, &c, &d, 6);
    assert_close("adamw restored after 3 steps", &got, &want);
    let dev = braid::testing::test_device();
    let w = Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev).requires_grad();
    let wrong = braid::optim::AdamState {
        exp_avg: Tensor::zeros([3], DType::F32, &dev),
        exp_avg_sq: Tensor::zeros([3], DType::F32, &dev),
        step: 1,
    };
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| AdamW::new(0.1).set_state(&w, wrong)))
        .expect_err("misuse");
    let m = e.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(m.contains("Adam::set_state") && m.contains("shape") && m.contains("tests/optim.rs"), "{m}");
}

#[test]
fn training_steps_replay_the_cached_schedule() {
    let dev = braid::testing::test_device();
    let p = Tensor::randn([64], DType::F32, &dev).requires_grad();
    let c = Tensor::rand([64], 0.5, 1.5, DType::F32, &dev);
    let mut opt = Adam::new(0.01);
    let mut losses = Vec::new();
    for _ in 0..6 {
        let l = loss(&p, &c, &Tensor::zeros([64], DType::F32, &dev));
        let grads = l.backward().unwrap();
        opt.step(&mut [p.clone()], &grads);
        losses.push(l.item::<f32>().unwrap());
    }
    assert!(losses.windows(2).all(|w| w[1] < w[0]), "{losses:?}");
    let (hits, misses) = dev.plan_cache_stats();
    // Step 1 (no optimizer state yet) and step 2 differ in structure; later steps replay.
    assert!(hits >= 3, "hits {hits}, misses {misses}");
}

#[test]
fn a_parameter_that_is_not_a_leaf_is_misuse() {
    let dev = braid::testing::test_device();
    let w = Tensor::from_vec(vec![1.0f32], [1], &dev).requires_grad();
    let derived = &w * 2.0;
    let grads = derived.sum().backward().unwrap();
    let e =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Sgd::new(0.1).step(&mut [derived.clone()], &grads)))
            .expect_err("misuse");
    let m = e.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(m.contains("Sgd::step") && m.contains("leaves") && m.contains("optim.rs"), "{m}");
}

/// Parameters live in exact-size memory: every version of every parameter, step after step,
/// and nothing else does.
#[test]
fn parameters_live_in_exact_size_memory() {
    let dev = braid::testing::test_device();
    dev.seed(4);
    let x = Tensor::randn([32, 24], DType::F32, &dev);
    let w1 = (Tensor::randn([24, 40], DType::F32, &dev) * 0.2).detach().requires_grad();
    let w2 = Tensor::randn([40, 3], DType::F32, &dev).requires_grad();
    let b = Tensor::zeros([3], DType::F32, &dev).requires_grad();
    let round = |bytes: u64| bytes.div_ceil(64) * 64;
    let params_bytes = round(24 * 40 * 4) + round(40 * 3 * 4) + round(3 * 4);
    let mut params = vec![w1, w2, b];
    let mut opt = Adam::new(0.01);
    for _ in 0..3 {
        let h = (&x.matmul(&params[0]).tanh().matmul(&params[1]) + &params[2]).square().mean();
        let grads = h.backward().unwrap();
        opt.step(&mut params, &grads);
        drop(grads);
        dev.sync().unwrap();
        assert_eq!(dev.persistent_memory(), params_bytes, "{:?}", dev.memory());
    }
    // The step's kernels write the three new parameter versions into parameter memory: fresh
    // buffers, or the old versions' buffers where an update overwrites one in place.
    let dump: serde_json::Value = serde_json::from_str(&dev.last_schedule().unwrap().to_json()).unwrap();
    let persistent: Vec<&str> = dump["buffers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["persistent"] == true)
        .map(|b| b["id"].as_str().unwrap())
        .collect();
    let mut written: Vec<&str> = dump["streams"][0]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] == "kernel")
        .flat_map(|s| s["outputs"].as_array().unwrap())
        .map(|b| b.as_str().unwrap())
        .filter(|b| persistent.contains(b))
        .collect();
    written.sort_unstable();
    written.dedup();
    assert_eq!(written.len(), 3, "the three new parameter versions");
}
