//! The bench card (shared/BENCH.md), CPU part: C1 chain, C2 softmax, C3 mlp_step, C4 tiny_graph (forward, and
//! forward + backward, recorded op by op and as a captured `braid::Step`), C5 mini_gpt, and activation offloading under a memory budget (G5 at CPU
//! scale; the training rows are in `card/training.rs`),
//! each checked for correctness first, timed as the median of repeated runs after a warm-up, and
//! shown next to a physical limit (a parallel copy measured in the same run) and peers (JAX and
//! PyTorch, where installed: `pip install jax torch`), whose scripts `benches/peers/card_jax.py`
//! and `benches/peers/card_torch.py` run in the same command. Each timed run holds, until its
//! sync or read, what its peers compute (the training steps update every parameter), each line
//! says what both sides compute, and a training row whose step ran fewer matrix products than
//! its workload has fails (`benches/common/products.rs`).
//!
//! Run: `cargo bench --bench card` (or `cargo bench --bench card -- c1` for one workload; with
//! `BRAID_NO_PEERS=1` the peer scripts are not run). `-- --autotune-pairs N [c1]`: instead,
//! every workload (or the one named) alternately with tuning off and on, N pairs
//! (`benches/common/autotune_compare.rs`).

#[path = "common/autotune_compare.rs"]
mod autotune_compare;
#[path = "../examples/common/micrograd.rs"]
mod micrograd;
#[path = "../examples/common/mini_gpt.rs"]
mod mini_gpt;
#[path = "common/products.rs"]
mod products;
#[path = "common/timing.rs"]
mod timing;
#[path = "card/training.rs"]
mod training;

use micrograd::micrograd;

use braid::prelude::*;
use rayon::prelude::*;
use std::process::Command;
use std::time::Instant;

/// Median seconds of `runs` calls of `f` after `warm` warm-up calls.
fn median(warm: usize, runs: usize, f: impl FnMut()) -> f64 {
    timing::median_ms(warm, runs, f) / 1e3
}

/// GB/s of a copy of `bytes` (read + write counted), as memory-bandwidth yardsticks: split
/// across all threads (`parallel`), or one `memcpy` (BENCH.md's "memcpy-style copy").
fn copy_bandwidth(bytes: usize, parallel: bool) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    let t = median(2, 9, || {
        if parallel {
            dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s));
        } else {
            dst.copy_from_slice(&src);
        }
        std::hint::black_box(&mut dst);
    });
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
    let (xs, ws) = (x.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
    // The kernel interpreted, then compiled (the same bits either way).
    let mut results = vec![];
    for mode in [CompileMode::Off, CompileMode::Blocking] {
        dev.set_compile_mode(mode);
        let compiled_before = dev.compiled_kernels_launched();
        let ys = run().to_vec::<f32>().unwrap();
        let compiled = dev.compiled_kernels_launched() > compiled_before;
        // Correctness on sampled elements, in f64.
        let mut worst = 0.0f64;
        for i in (0..N).step_by(997) {
            let (xv, wv) = (xs[i] as f64, ws[i] as f64);
            let want = gelu(xv * wv + 1.0) * (1.0 / (1.0 + (-xv).exp()));
            worst = worst.max((ys[i] as f64 - want).abs() / (1.0 + want.abs()));
        }
        assert!(worst < 1e-5, "C1 relative error {worst}");
        let kernels = dev.last_schedule().unwrap().kernel_count();
        let t = median(2, 9, || drop(run()));
        results.push((mode, compiled, t, kernels, worst, ys));
    }
    assert!(results[0].5 == results[1].5, "C1: the compiled kernel's bits differ from the interpreter's");
    let (memcpy, parallel) = (copy_bandwidth(4 * N, false), copy_bandwidth(4 * N, true));
    // Issue 17's floor: a plain single-threaded loop that reads and writes the same bytes
    // (two inputs, one output), in this process.
    let mut plain_out = vec![0.0f32; N];
    let plain = median(2, 9, || {
        for ((o, a), b) in plain_out.iter_mut().zip(&xs).zip(&ws) {
            *o = a * b;
        }
        std::hint::black_box(&mut plain_out);
    });
    let mut lines = vec![];
    for (mode, compiled, t, kernels, worst, _) in &results {
        let how = match (mode, compiled) {
            (CompileMode::Off, _) => "interpreted",
            (_, true) => "compiled",
            (_, false) => "compiled: NO C COMPILER, interpreted",
        };
        let bw = 3.0 * 4.0 * N as f64 / t / 1e9;
        lines.push(format!(
            "C1 chain (16Mi f32, {how}): {:.2} ms, {kernels} kernel(s), {:.1} GB/s = {:.0}% of one memcpy ({:.1} GB/s), {:.0}% of a copy on all threads ({:.1} GB/s), {:.2}x the speed of a plain single-threaded x*w loop over the same bytes ({:.2} ms); braid and its peers: y held until the sync; max rel. error {worst:.1e}; target >= 80% of the copy, >= 0.8x the plain loop",
            t * 1e3,
            bw,
            100.0 * bw / memcpy,
            memcpy,
            100.0 * bw / parallel,
            parallel,
            plain / t,
            plain * 1e3
        ));
    }
    dev.set_compile_mode(CompileMode::Blocking);
    (results[1].2, lines.join("\n"))
}

fn c2(dev: &Device) -> (f64, String) {
    let (r, c) = (2048, 1024);
    dev.seed(2);
    let x = Tensor::randn([r, c], DType::F32, dev);
    dev.sync().unwrap();
    // `softmax` records the composed ops (max, sub, exp, sum, div) and lets the intermediates go
    // out of scope, so only the output is materialised (G2: "extra memory = output only").
    let run = || {
        let y = x.softmax(1);
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
    let (kernels, extra) = {
        run();
        let dump = dev.last_schedule().unwrap();
        let extra: u64 = dump.dump().buffers.iter().filter(|b| !b.external).map(|b| b.bytes).sum();
        (dump.kernel_count(), extra)
    };
    let t = median(10, 101, || drop(run()));
    let line = format!(
        "C2 softmax [2048, 1024] as max/sub/exp/sum/recip/mul: {:.3} ms, {kernels} kernel(s), {:.1} MiB allocated (the output is 8 MiB); braid and its peers: the softmax held until the sync; max rel. error {worst:.1e}; target <= 1.3 ms",
        t * 1e3,
        extra as f64 / (1 << 20) as f64
    );
    (t, line)
}

/// The micrograd example graph: returns the leaves a, b (marked `requires_grad` when
/// `with_grad`) and g.
fn tiny_graph(dev: &Device, with_grad: bool) -> (Tensor, Tensor, Tensor) {
    let s = |v: f64| {
        let t = Tensor::from_vec(vec![v], (), dev);
        if with_grad { t.requires_grad() } else { t }
    };
    let (a, b) = (s(-4.0), s(2.0));
    let g = micrograd(&a, &b);
    (a, b, g)
}

fn c4(dev: &Device) -> (f64, String) {
    let g = tiny_graph(dev, false).2.item::<f64>().unwrap();
    assert!((g - 24.7041).abs() < 1e-4, "C4 g = {g}");
    let t = median(200, 2001, || {
        tiny_graph(dev, false).2.item::<f64>().unwrap();
    });
    let kernels = dev.last_schedule().unwrap().kernel_count();
    let line = format!(
        "C4 tiny_graph forward (f64 scalars, record + flush + read): {:.2} us per iteration, {kernels} kernel(s); braid and jax.jit: g read; g = {g:.4}",
        t * 1e6
    );
    (t, line)
}

/// C4 forward + backward as a captured step (`braid::Step`): each iteration makes the inputs,
/// replays the captured plan of both passes, and reads g, dg/da, dg/db.
fn c4_step(dev: &Device) -> (f64, String) {
    let step = braid::Step::new(|x: &[Tensor]| {
        let (a, b) = (x[0].detach().requires_grad(), x[1].detach().requires_grad());
        let g = micrograd(&a, &b);
        let grads = g.backward().unwrap();
        vec![g, grads.get(&a).unwrap(), grads.get(&b).unwrap()]
    });
    let run = || {
        let args = [Tensor::from_vec(vec![-4.0f64], (), dev), Tensor::from_vec(vec![2.0f64], (), dev)];
        let out = step.call(&args).unwrap();
        (out[0].item::<f64>().unwrap(), out[1].item::<f64>().unwrap(), out[2].item::<f64>().unwrap())
    };
    let (g, da, db) = run();
    assert!(
        (g - 24.7041).abs() < 1e-4 && (da - 138.8338).abs() < 1e-4 && (db - 645.5773).abs() < 1e-4,
        "C4 step: g = {g}, dg/da = {da}, dg/db = {db}"
    );
    let t = median(200, 5001, || {
        std::hint::black_box(run());
    });
    let kernels = dev.last_schedule().unwrap().kernel_count();
    let line = format!(
        "C4 tiny_graph forward+backward as a captured braid::Step (inputs made, plan replayed, 3 values read): {:.2} us per iteration, {kernels} kernel(s), {} capture(s); braid and its peers: g, dg/da, dg/db read; target <= 10 us",
        t * 1e6,
        step.captures()
    );
    (t, line)
}

/// C4 forward + backward: record both passes, run them in one flush, read g, dg/da, dg/db.
fn c4_backward(dev: &Device) -> (f64, String) {
    let step = || {
        let (a, b, g) = tiny_graph(dev, true);
        let grads = g.backward().unwrap();
        let (da, db) = (grads.get(&a).unwrap(), grads.get(&b).unwrap());
        dev.sync().unwrap();
        (g.item::<f64>().unwrap(), da.item::<f64>().unwrap(), db.item::<f64>().unwrap())
    };
    let (g, da, db) = step();
    assert!(
        (g - 24.7041).abs() < 1e-4 && (da - 138.8338).abs() < 1e-4 && (db - 645.5773).abs() < 1e-4,
        "C4: g = {g}, dg/da = {da}, dg/db = {db}"
    );
    let t = median(200, 2001, || {
        step();
    });
    let kernels = dev.last_schedule().unwrap().kernel_count();
    // Where the time goes: recording both passes, the flush (cached schedule + kernels), reads.
    let (mut rec, mut flush, mut read) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..2001 {
        let t0 = Instant::now();
        let (a, b, g) = tiny_graph(dev, true);
        let grads = g.backward().unwrap();
        let (da, db) = (grads.get(&a).unwrap(), grads.get(&b).unwrap());
        let t1 = Instant::now();
        dev.sync().unwrap();
        let t2 = Instant::now();
        std::hint::black_box((g.item::<f64>().unwrap(), da.item::<f64>().unwrap(), db.item::<f64>().unwrap()));
        let t3 = Instant::now();
        rec.push((t1 - t0).as_secs_f64());
        flush.push((t2 - t1).as_secs_f64());
        read.push((t3 - t2).as_secs_f64());
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2] * 1e6
    };
    let line = format!(
        "C4 tiny_graph forward+backward (f64 scalars): {:.2} us per iteration, {kernels} kernel(s); braid and its peers: g, dg/da, dg/db read; g = {g:.4}, dg/da = {da:.4}, dg/db = {db:.4}; \
         medians: record {:.2} us, flush {:.2} us, reads {:.2} us; target <= 10 us, never above 45 us",
        t * 1e6,
        med(&mut rec),
        med(&mut flush),
        med(&mut read)
    );
    (t, line)
}

/// Runs the peer scripts (JAX, then PyTorch) and returns their lines (or why one could not run).
fn peers(which: &str) -> Vec<String> {
    if std::env::var_os("BRAID_NO_PEERS").is_some() {
        return vec!["  peers: not run (BRAID_NO_PEERS is set)".into()];
    }
    let mut lines = Vec::new();
    for (name, script) in [
        // Relative to the current directory (the repository root, as `cargo bench` runs it), so
        // that a binary copied to another machine finds them too.
        ("jax", "benches/peers/card_jax.py"),
        ("torch", "benches/peers/card_torch.py"),
    ] {
        match Command::new("python3").arg(script).arg(which).output() {
            Ok(out) if out.status.success() => {
                lines.extend(String::from_utf8_lossy(&out.stdout).lines().map(|l| format!("  peer {l}")))
            }
            Ok(out) => lines.push(format!(
                "  peer {name}: not run ({})",
                String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("failed")
            )),
            Err(e) => lines.push(format!("  peer {name}: not run (python3: {e})")),
        }
    }
    lines
}

fn main() {
    let which = std::env::args().skip(1).find(|a| !a.starts_with('-')).unwrap_or_else(|| "all".into());
    let dev = Device::cpu();
    // Kernels are compiled before their first run, so warm-ups never time the interpreter.
    dev.set_compile_mode(CompileMode::Blocking);
    println!("braid bench card (CPU, {} threads)", rayon::current_num_threads());
    let all = which == "all";
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--autotune-pairs") {
        let pairs: usize = args.get(i + 1).and_then(|v| v.parse().ok()).expect("--autotune-pairs N");
        let which = args.iter().skip(1).find(|a| !a.starts_with('-') && a.parse::<usize>().is_err()).cloned();
        type Card = fn(&Device) -> (f64, String);
        let ms = |f: Card, id: &'static str, dev: &Device| vec![(id.to_string(), f(dev).0 * 1e3)];
        let table: [(&str, Card); 7] = [
            ("c1", c1),
            ("c2", c2),
            ("c3", training::c3),
            ("c4", c4),
            ("c4_step", c4_step),
            ("c5", training::c5),
            ("c5_step", training::c5_step),
        ];
        let dev = &dev;
        let workloads = table
            .into_iter()
            .filter(|(id, _)| which.as_deref().is_none_or(|w| id.starts_with(w)))
            .map(|(id, f)| (id, Box::new(move || ms(f, id, dev)) as Box<dyn FnMut() -> Vec<(String, f64)>>))
            .collect();
        println!("{}", autotune_compare::compare(workloads, pairs));
        return;
    }
    if all || which == "c1" {
        println!("{}", c1(&dev).1);
        peers("c1").iter().for_each(|l| println!("{l}"));
    }
    if all || which == "c2" {
        println!("{}", c2(&dev).1);
        peers("c2").iter().for_each(|l| println!("{l}"));
    }
    if all || which == "c3" {
        println!("{}", training::c3(&dev).1);
        peers("c3").iter().for_each(|l| println!("{l}"));
    }
    if all || which == "c5" {
        println!("{}", training::c5(&dev).1);
        println!("{}", training::c5_step(&dev).1);
        peers("c5").iter().for_each(|l| println!("{l}"));
    }
    if all || which == "offload" {
        let dev = Device::new_cpu();
        dev.set_compile_mode(CompileMode::Blocking);
        println!("{}", training::offload(&dev).1);
    }
    if all || which == "c4" {
        println!("{}", c4(&dev).1);
        println!("{}", c4_backward(&dev).1);
        println!("{}", c4_step(&dev).1);
        peers("c4").iter().for_each(|l| println!("{l}"));
    }
}
