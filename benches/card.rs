//! The bench card (shared/BENCH.md), CPU part: C1 chain, C2 softmax, C4 tiny_graph (forward),
//! each checked for correctness first, timed as the median of repeated runs after a warm-up, and
//! shown next to a physical limit (a parallel copy measured in the same run) and a peer (JAX,
//! if installed: `pip install jax`), whose script `benches/peers/card_jax.py` runs in the same
//! command.
//!
//! Run: `cargo bench --bench card` (or `cargo bench --bench card -- c1` for one workload).

use braid::prelude::*;
use rayon::prelude::*;
use std::process::Command;
use std::time::Instant;

/// Median seconds of `runs` calls of `f` after `warm` warm-up calls.
fn median(warm: usize, runs: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warm {
        f();
    }
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[t.len() / 2]
}

/// GB/s of a parallel copy of `bytes` (read + write counted), as a memory-bandwidth yardstick.
fn copy_bandwidth(bytes: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    let t = median(2, 9, || {
        dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s));
    });
    std::hint::black_box(&dst);
    2.0 * bytes as f64 / t / 1e9
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn c1(dev: &Device) -> (f64, String) {
    const N: usize = 16 << 20;
    dev.seed(1);
    let x = Tensor::randn([N], DType::F32, dev);
    let w = Tensor::randn([N], DType::F32, dev);
    dev.sync().unwrap();
    let run = || {
        let y = (&x * &w + 1.0).gelu() * x.sigmoid();
        dev.sync().unwrap();
        y
    };
    // Correctness on sampled elements, in f64.
    let (xs, ws, ys) = (x.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap(), run().to_vec::<f32>().unwrap());
    let mut worst = 0.0f64;
    for i in (0..N).step_by(997) {
        let (xv, wv) = (xs[i] as f64, ws[i] as f64);
        let want = gelu(xv * wv + 1.0) * (1.0 / (1.0 + (-xv).exp()));
        worst = worst.max((ys[i] as f64 - want).abs() / (1.0 + want.abs()));
    }
    assert!(worst < 1e-5, "C1 relative error {worst}");
    let kernels = {
        run();
        dev.last_schedule().unwrap().kernel_count()
    };
    let t = median(2, 9, || drop(run()));
    let bw = 3.0 * 4.0 * N as f64 / t / 1e9;
    let copy = copy_bandwidth(4 * N);
    let line = format!(
        "C1 chain (16Mi f32): {:.2} ms, {kernels} kernel(s), {:.1} GB/s = {:.0}% of the parallel copy ({:.1} GB/s); max rel. error {worst:.1e}; target >= 80%",
        t * 1e3,
        bw,
        100.0 * bw / copy,
        copy
    );
    (t, line)
}

fn c2(dev: &Device) -> (f64, String) {
    let (r, c) = (2048, 1024);
    dev.seed(2);
    let x = Tensor::randn([r, c], DType::F32, dev);
    dev.sync().unwrap();
    let run = || {
        let m = x.max_dim(1, true);
        let e = (&x - &m).exp();
        let y = &e / &e.sum_dim(1, true);
        dev.sync().unwrap();
        y
    };
    let (xs, ys) = (x.to_vec::<f32>().unwrap(), run().to_vec::<f32>().unwrap());
    let mut worst = 0.0f64;
    for row in (0..r).step_by(61) {
        let v = &xs[row * c..(row + 1) * c];
        let m = v.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let z: f64 = v.iter().map(|&b| (b as f64 - m).exp()).sum();
        for (j, &b) in v.iter().enumerate() {
            let want = (b as f64 - m).exp() / z;
            worst = worst.max((ys[row * c + j] as f64 - want).abs() / want);
        }
    }
    assert!(worst < 1e-5, "C2 relative error {worst}");
    let kernels = {
        run();
        dev.last_schedule().unwrap().kernel_count()
    };
    let t = median(3, 15, || drop(run()));
    let line = format!(
        "C2 softmax [2048, 1024] as max/sub/exp/sum/div: {:.3} ms, {kernels} kernel(s); max rel. error {worst:.1e}; target <= 1.3 ms",
        t * 1e3
    );
    (t, line)
}

/// The micrograd example graph, forward; returns g.
fn tiny_graph(dev: &Device) -> Tensor {
    let s = |v: f64| Tensor::from_vec(vec![v], (), dev);
    let a = s(-4.0);
    let b = s(2.0);
    let mut c = &a + &b;
    let mut d = &a * &b + b.powf(3.0);
    c = &c + &(&c + 1.0);
    c = &c + &(1.0 + &c + (-&a));
    d = &d + &(&d * 2.0 + (&b + &a).relu());
    d = &d + &(3.0 * &d + (&b - &a).relu());
    let e = &c - &d;
    let f = e.powf(2.0);
    let g = &f / 2.0;
    &g + &(10.0 / &f)
}

fn c4(dev: &Device) -> (f64, String) {
    let g = tiny_graph(dev).item::<f64>().unwrap();
    assert!((g - 24.7041).abs() < 1e-4, "C4 g = {g}");
    let t = median(200, 2001, || {
        tiny_graph(dev).item::<f64>().unwrap();
    });
    let kernels = dev.last_schedule().unwrap().kernel_count();
    let line = format!(
        "C4 tiny_graph forward (f64 scalars, record + flush + read): {:.2} us per iteration, {kernels} kernel(s); g = {g:.4} (backward comes with autodiff)",
        t * 1e6
    );
    (t, line)
}

/// Runs the JAX peer script and returns its lines (or why it could not run).
fn peers(which: &str) -> Vec<String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/peers/card_jax.py");
    match Command::new("python3").arg(script).arg(which).output() {
        Ok(out) if out.status.success() => {
            String::from_utf8_lossy(&out.stdout).lines().map(|l| format!("  peer {l}")).collect()
        }
        Ok(out) => vec![format!(
            "  peer: not run ({})",
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("failed")
        )],
        Err(e) => vec![format!("  peer: not run (python3: {e})")],
    }
}

fn main() {
    let which = std::env::args().skip(1).find(|a| !a.starts_with('-')).unwrap_or_else(|| "all".into());
    let dev = Device::cpu();
    println!("braid bench card (CPU, {} threads)", rayon::current_num_threads());
    let all = which == "all";
    if all || which == "c1" {
        println!("{}", c1(&dev).1);
        peers("c1").iter().for_each(|l| println!("{l}"));
    }
    if all || which == "c2" {
        println!("{}", c2(&dev).1);
        peers("c2").iter().for_each(|l| println!("{l}"));
    }
    if all || which == "c4" {
        println!("{}", c4(&dev).1);
        peers("c4").iter().for_each(|l| println!("{l}"));
    }
}
