//! "Fusion never slower": shapes where a fused kernel could lose to the ops run one by one (a
//! whole-tensor reduction, alone or with elementwise work or random numbers before it, also
//! with those values kept by the program, as a statement reading the reduction keeps its
//! temporaries; long rows, short rows, a reduction along a non-last axis, rows of a transposed
//! view, an elementwise chain), each timed fused and unfused (`set_fusion(false)`, as `BRAID_FUSION=0`)
//! on one device in the same run, interleaved, reading the same input buffer (two devices' buffers
//! can differ in speed by 10-15% with nothing else different), with the ratio fused / unfused
//! printed (the plan cache keeps both plans). Results
//! are checked equal first (within float tolerance). Beside them, the machine's read bandwidth
//! in the same process (a rayon-parallel sum over the bytes of the largest whole-tensor mean),
//! and the whole-tensor mean's share of it.
//!
//! Run: `cargo bench --bench fusion_guard` (full sizes: criterion's group "fusion never slower",
//! then the ratio table from paired runs), or `cargo bench --bench fusion_guard -- --quick`
//! (what `.ci/run` runs, about 30 s: smaller sizes, no criterion, and exit status 1 when a fused
//! case is more than `--limit` (default 1.2) times slower than unfused); `-- --only mean` runs
//! the cases whose names contain `mean`, at full size, without criterion. Each side's figure is
//! the best of its repetitions, so a noisy 2-core machine slows a side only if every repetition
//! was slowed; a case over the limit is measured again (three tries) before the guard fails.
//! This file must never hide a failing case: every case is printed, and a mismatch panics.

use braid::prelude::*;
use criterion::{BenchmarkId, Criterion};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// Best (smallest) milliseconds of `runs` runs of each of `a` and `b`, alternating, after a
/// warm-up of each (and more runs, up to 40, while a side has had less than 0.2 s: short cases
/// are the noisiest).
fn paired(runs: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let t = Instant::now();
    a();
    b();
    let runs = ((0.4 / t.elapsed().as_secs_f64()) as usize).clamp(runs, 40);
    let (mut ta, mut tb) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..runs {
        let t = Instant::now();
        a();
        ta = ta.min(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        b();
        tb = tb.min(t.elapsed().as_secs_f64() * 1e3);
    }
    (ta, tb)
}

struct Case {
    name: &'static str,
    shape: Vec<usize>,
    /// The program: the tensors it keeps until its work is done (all of them checked, fused
    /// against unfused), the case's result first.
    f: fn(&Tensor) -> Vec<Tensor>,
}

fn cases(quick: bool) -> Vec<Case> {
    let s = |full: usize, small: usize| if quick { small } else { full };
    vec![
        Case { name: "whole tensor: mean", shape: vec![s(1 << 24, 1 << 23)], f: |x| vec![x.mean()] },
        Case { name: "whole tensor: mean", shape: vec![s(1 << 26, 1 << 24)], f: |x| vec![x.mean()] },
        Case { name: "whole tensor: randn(shape).mean", shape: vec![s(1 << 26, 1 << 24)], f: randn_mean },
        Case { name: "whole tensor: (exp(tanh x) + 1).sum", shape: vec![s(1 << 24, 1 << 22)], f: chain_sum },
        Case { name: "whole tensor: (exp(tanh x) + 1).sum", shape: vec![s(1 << 26, 1 << 23)], f: chain_sum },
        Case { name: "whole tensor: max", shape: vec![s(1 << 26, 1 << 24)], f: |x| vec![x.max()] },
        // Issue 41's whole-tensor reductions of 2^25 f32 with elementwise work before them
        // (the fused kernel is split across threads and runs compiled in its split form).
        Case { name: "whole tensor: (exp(tanh(x/2)) + 1).mean", shape: vec![s(1 << 25, 1 << 23)], f: chain_mean },
        Case { name: "whole tensor: randn(shape).mean", shape: vec![s(1 << 25, 1 << 23)], f: randn_mean },
        // The same as the issue ran them, `.item()` in the statement keeping every temporary.
        Case {
            name: "whole tensor: the chain's mean, values kept",
            shape: vec![s(1 << 25, 1 << 23)],
            f: chain_mean_kept,
        },
        Case { name: "whole tensor: randn.mean, numbers kept", shape: vec![s(1 << 25, 1 << 23)], f: randn_mean_kept },
        Case { name: "whole tensor: (a * b).sum", shape: vec![2, s(1 << 25, 1 << 23)], f: product_sum },
        Case { name: "whole tensor: square().mean", shape: vec![s(1 << 25, 1 << 23)], f: |x| vec![x.square().mean()] },
        Case { name: "whole tensor: variance", shape: vec![s(1 << 25, 1 << 23)], f: variance },
        Case { name: "whole tensor: abs().max", shape: vec![s(1 << 25, 1 << 23)], f: |x| vec![x.abs().max()] },
        Case { name: "whole tensor: argmax", shape: vec![s(1 << 26, 1 << 24)], f: |x| vec![x.argmax_dim(0, false)] },
        Case { name: "long rows: softmax", shape: vec![16, 1 << 18], f: |x| vec![x.softmax(-1)] },
        Case { name: "long rows: softmax", shape: vec![16, 1 << 20], f: |x| vec![x.softmax(-1)] },
        Case { name: "long rows: sum of exp", shape: vec![16, 1 << 20], f: |x| vec![x.exp().sum_dim(1, false)] },
        Case { name: "short rows: softmax", shape: vec![s(1 << 16, 1 << 14), 64], f: |x| vec![x.softmax(-1)] },
        Case {
            name: "short rows: sum of squares",
            shape: vec![s(1 << 16, 1 << 14), 64],
            f: |x| vec![x.square().sum_dim(1, false)],
        },
        Case {
            name: "non-last axis: sum over dim 0",
            shape: vec![s(4096, 1024), 4096],
            f: |x| vec![x.sum_dim(0, false)],
        },
        Case {
            name: "non-last axis: (2x).sum over dim 0",
            shape: vec![s(4096, 1024), 4096],
            f: |x| vec![(x * 2.0).sum_dim(0, false)],
        },
        Case {
            name: "transposed rows: x.t().softmax",
            shape: vec![4096, s(1024, 512)],
            f: |x| vec![x.t().softmax(-1)],
        },
        Case {
            name: "transposed rows: x.t().sum over dim 1",
            shape: vec![4096, s(1024, 512)],
            f: |x| vec![x.t().sum_dim(1, false)],
        },
        Case {
            name: "transposed whole: x.t().exp().sum",
            shape: vec![4096, s(1024, 512)],
            f: |x| vec![x.t().exp().sum()],
        },
        Case {
            name: "elementwise chain",
            shape: vec![s(1 << 25, 1 << 22)],
            f: |x| vec![(x * 1.5 + 1.0).gelu() * x.sigmoid()],
        },
    ]
}

/// The example: `randn([n]).mean()`, the random numbers generated inside the reduction
/// when fused (seeded, so that both sides draw the same numbers).
fn randn_mean(x: &Tensor) -> Vec<Tensor> {
    x.device().seed(11);
    vec![Tensor::randn(x.shape().clone(), DType::F32, x.device()).mean()]
}

/// [`randn_mean`] as `Tensor::randn(..).mean().item()` runs it: the random numbers are a
/// temporary of the statement, alive until the read, so they are stored too.
fn randn_mean_kept(x: &Tensor) -> Vec<Tensor> {
    x.device().seed(11);
    let numbers = Tensor::randn(x.shape().clone(), DType::F32, x.device());
    vec![numbers.mean(), numbers]
}

fn chain_sum(x: &Tensor) -> Vec<Tensor> {
    vec![(x.tanh().exp() + 1.0).sum()]
}

/// Issue 41's example of elementwise work before a whole-tensor mean.
fn chain_mean(x: &Tensor) -> Vec<Tensor> {
    vec![((x * 0.5).tanh().exp() + 1.0).mean()]
}

/// [`chain_mean`] as `((&x * 0.5).tanh().exp() + 1.0).mean().item()` runs it: its
/// intermediate values are temporaries of the statement, alive until the read, so stored too.
fn chain_mean_kept(x: &Tensor) -> Vec<Tensor> {
    let half = x * 0.5;
    let tanh = half.tanh();
    let shifted = tanh.exp() + 1.0;
    vec![shifted.mean(), half, tanh, shifted]
}

/// A dot product: the two rows of `x` (`[2, n]`), multiplied and summed over all `n`.
fn product_sum(x: &Tensor) -> Vec<Tensor> {
    vec![(x.narrow(0, 0, 1) * x.narrow(0, 1, 1)).sum()]
}

/// `((x - mean) ^ 2).mean()`: two whole-tensor reductions, the second over work that reads the
/// first.
fn variance(x: &Tensor) -> Vec<Tensor> {
    vec![(x - x.mean()).square().mean()]
}

/// The device, compiling kernels before their first run so that the timings do not include the
/// compiler.
fn device() -> Device {
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Blocking);
    dev
}

/// The case's input (computed, so that only the case is timed).
fn input(dev: &Device, case: &Case) -> Tensor {
    dev.seed(7);
    let x = Tensor::randn(case.shape.clone(), DType::F32, dev);
    dev.sync().unwrap();
    x
}

/// Runs the case fused (`i == 0`) or unfused (`i == 1`) and waits for it.
fn run(dev: &Device, case: &Case, x: &Tensor, i: usize) -> Vec<Tensor> {
    dev.set_fusion(i == 0);
    let kept = (case.f)(x);
    dev.sync().unwrap();
    kept
}

/// The values of every tensor in `kept` as f64 (argmax gives i64).
fn values(kept: &[Tensor]) -> Vec<f64> {
    let each = |t: &Tensor| match t.dtype() {
        DType::I64 => t.to_vec::<i64>().unwrap().into_iter().map(|v| v as f64).collect::<Vec<_>>(),
        _ => t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect(),
    };
    kept.iter().flat_map(each).collect()
}

/// A rayon-parallel sum over `data`: what reading these bytes costs on this machine, in fixed
/// chunks with 16 lanes each so that the loop vectorises.
fn read_all(data: &[f32]) -> f32 {
    data.par_chunks(1 << 16)
        .map(|c| {
            let mut lanes = [0f32; 16];
            let mut it = c.chunks_exact(16);
            for ch in &mut it {
                for (l, &v) in lanes.iter_mut().zip(ch) {
                    *l += v;
                }
            }
            lanes.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
        })
        .sum()
}

/// Criterion's group "fusion never slower": each case fused and unfused.
fn criterion_group(dev: &Device) {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut group = c.benchmark_group("fusion never slower");
    for case in cases(false) {
        let x = input(dev, &case);
        let label = format!("{} {:?}", case.name, case.shape);
        for (i, side) in ["fused", "unfused"].into_iter().enumerate() {
            group.bench_function(BenchmarkId::new(side, &label), |b| b.iter(|| drop(run(dev, &case, &x, i))));
        }
    }
    group.finish();
    c.final_summary();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let limit: f64 =
        args.iter().position(|a| a == "--limit").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(1.2);
    // `--only TEXT`: the cases whose names contain TEXT, without criterion.
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned();
    let dev = device();
    if !quick && only.is_none() {
        criterion_group(&dev);
    }
    let runs = if quick { 5 } else { 10 };
    println!(
        "fusion guard ({}, {} rayon threads): fused / unfused, best of {runs} paired runs",
        if quick { "quick" } else { "full" },
        rayon::current_num_threads()
    );
    let mut worst: f64 = 0.0;
    let mut mean_floor = None;
    for case in cases(quick) {
        if only.as_ref().is_some_and(|o| !case.name.contains(o.as_str())) {
            continue;
        }
        let x = input(&dev, &case);
        let (a, b) = (values(&run(&dev, &case, &x, 0)), values(&run(&dev, &case, &x, 1)));
        let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0, f64::max);
        assert!(err < 1e-4, "{}: fused and unfused differ by {err}", case.name);
        let mut tries = 0;
        let (tf, tu) = loop {
            tries += 1;
            let (tf, tu) = paired(runs, || drop(run(&dev, &case, &x, 0)), || drop(run(&dev, &case, &x, 1)));
            if tf <= limit * tu || tries == 3 {
                break (tf, tu);
            }
        };
        let ratio = tf / tu;
        worst = worst.max(ratio);
        println!(
            "  {:<38} {:<14} fused {tf:8.2} ms, unfused {tu:8.2} ms, ratio {ratio:.2}",
            case.name,
            format!("{:?}", case.shape)
        );
        if case.name == "whole tensor: mean" {
            // The largest whole-tensor mean against the read floor of the same bytes, paired.
            let host = x.to_vec::<f32>().unwrap();
            let (tm, floor) = paired(
                runs,
                || drop(run(&dev, &case, &x, 0)),
                || {
                    std::hint::black_box(read_all(&host));
                },
            );
            mean_floor = Some((case.shape[0], tm, floor));
        }
    }
    if let Some((n, tm, floor)) = mean_floor {
        let gb = (n * 4) as f64 / 1e9;
        println!(
            "read bandwidth (paired with the fused mean, best of each): a rayon sum over the same {n} f32 in \
             {floor:.2} ms = {:.1} GB/s; the fused mean in {tm:.2} ms = {:.1} GB/s ({:.0}% of it)",
            gb / (floor / 1e3),
            gb / (tm / 1e3),
            100.0 * floor / tm
        );
    }
    println!("worst ratio {worst:.2} (limit {limit})");
    if quick && worst > limit {
        eprintln!("fusion guard: a fused case is more than {limit}x slower than unfused");
        std::process::exit(1);
    }
}
