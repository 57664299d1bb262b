//! "Fusion never slower": shapes where a fused kernel could lose to the ops run one by one
//! (a whole-tensor reduction, long rows, short rows, a reduction along a non-last axis, an
//! elementwise chain), each timed fused and unfused (`set_fusion(false)`) on two devices in the
//! same run, interleaved, with the ratio fused / unfused printed. Results are checked equal
//! first (within float tolerance).
//!
//! Run: `cargo bench --bench fusion_guard` (full sizes), or with `-- --quick` (CI: smaller
//! sizes, and exit status 1 when a fused case is more than `--limit` (default 1.2) times slower
//! than unfused).

use braid::prelude::*;
use std::time::Instant;

/// Median milliseconds of `runs` runs of each of `a` and `b`, alternating, after a warm-up.
fn paired(runs: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    a();
    b();
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        a();
        ta.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        b();
        tb.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap());
        v[v.len() / 2]
    };
    (med(&mut ta), med(&mut tb))
}

struct Case {
    name: &'static str,
    shape: Vec<usize>,
    f: fn(&Tensor) -> Tensor,
}

fn cases(quick: bool) -> Vec<Case> {
    let s = |full: usize, small: usize| if quick { small } else { full };
    vec![
        Case {
            name: "whole-tensor mean of tanh(x) * exp(x)",
            shape: vec![s(1 << 26, 1 << 22)],
            f: |x| (x.tanh() * x.exp()).mean(),
        },
        Case { name: "whole-tensor max", shape: vec![s(1 << 26, 1 << 22)], f: |x| x.max() },
        Case { name: "long rows: softmax", shape: vec![8, s(1 << 22, 1 << 19)], f: |x| x.softmax(-1) },
        Case { name: "short rows: softmax", shape: vec![s(1 << 18, 1 << 15), 64], f: |x| x.softmax(-1) },
        Case {
            name: "short rows: sum of squares",
            shape: vec![s(1 << 20, 1 << 17), 32],
            f: |x| x.square().sum_dim(1, false),
        },
        Case {
            name: "non-last axis: sum over dim 0",
            shape: vec![s(4096, 1024), 4096],
            f: |x| (x * 2.0).sum_dim(0, false),
        },
        Case {
            name: "elementwise chain",
            shape: vec![s(1 << 25, 1 << 22)],
            f: |x| (x * 1.5 + 1.0).gelu() * x.sigmoid(),
        },
    ]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let limit: f64 =
        args.iter().position(|a| a == "--limit").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(1.2);
    let (fused, unfused) = (Device::new_cpu(), Device::new_cpu());
    unfused.set_fusion(false);
    for d in [&fused, &unfused] {
        d.set_compile_mode(CompileMode::Blocking);
    }
    println!("fusion guard ({}): fused / unfused, medians of paired runs", if quick { "quick" } else { "full" });
    let mut worst: f64 = 0.0;
    for case in cases(quick) {
        let inputs: Vec<Tensor> = [&fused, &unfused]
            .iter()
            .map(|d| {
                d.seed(7);
                let x = Tensor::randn(case.shape.clone(), DType::F32, d);
                d.sync().unwrap();
                x
            })
            .collect();
        let run = |i: usize| {
            let y = (case.f)(&inputs[i]);
            [&fused, &unfused][i].sync().unwrap();
            y
        };
        let (a, b) = (run(0).to_vec::<f32>().unwrap(), run(1).to_vec::<f32>().unwrap());
        let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0f32, f32::max);
        assert!(err < 1e-4, "{}: fused and unfused differ by {err}", case.name);
        let runs = if quick { 7 } else { 15 };
        let (tf, tu) = paired(runs, || drop(run(0)), || drop(run(1)));
        let ratio = tf / tu;
        worst = worst.max(ratio);
        println!("  {:<40} {:?}: fused {tf:8.2} ms, unfused {tu:8.2} ms, ratio {ratio:.2}", case.name, case.shape);
    }
    println!("worst ratio {worst:.2} (limit {limit})");
    if quick && worst > limit {
        eprintln!("fusion guard: a fused case is more than {limit}x slower than unfused");
        std::process::exit(1);
    }
}
