//! Fused attention printed with the tuner's other tilings (`braid_lowering::cuda::
//! attention_shapes`, timed by `devices/src/cuda/tune.rs`) on a real GPU: every pass, in bf16
//! (head dimensions 64 and 128, causal and not) and f16 (64, causal), odd lengths (partial
//! tiles), each
//! tiling against the table's. A tiling the tuner marks bitwise (the table's tiles over other
//! warps or another register cap) must give the table's bytes exactly; the others must agree
//! within the tuner's tolerance (`braid_devices::runtime::tune::tolerance`: 2^-6 of the
//! largest magnitude for halves). (The table's tiling itself is checked against the reference
//! interpreter by `tests/attention.rs`.)
//!
//! Without a GPU or NVRTC the test prints `skipped: <reason>` and passes.

mod common;

use braid_devices::cuda::{CudaKernel, LaunchOptions, run_compiled_on_gpu};
use braid_devices::runtime::tune::tolerance;
use braid_graph::{DType, Shape, View};
use braid_lowering::kernel::Arg;
use braid_lowering::{AttentionGradInputs, AttentionKernel, AttentionPass, Body, Kernel, Load};
use common::Rng;

/// Attention over contiguous `[problems, rows, d]` operands: q, k, v (and for a backward pass
/// d_out, lse, delta), then the outputs (forward: out, lse; query gradient: dq; key and value
/// gradients: dk, dv).
fn kernel(dtype: DType, pass: u8, problems: usize, sq: usize, sk: usize, d: usize, causal: bool) -> Kernel {
    let load = |arg: u16, dt: DType, dims: &[usize]| Load { arg, dtype: dt, view: View::contiguous(&Shape::new(dims)) };
    let (q, k, v) =
        (load(0, dtype, &[problems, sq, d]), load(1, dtype, &[problems, sk, d]), load(2, dtype, &[problems, sk, d]));
    let mut args = vec![(dtype, problems * sq * d), (dtype, problems * sk * d), (dtype, problems * sk * d)];
    let grads = |args: &mut Vec<(DType, usize)>| {
        args.extend([(dtype, problems * sq * d), (DType::F32, problems * sq), (DType::F32, problems * sq)]);
        AttentionGradInputs {
            d_out: load(3, dtype, &[problems, sq, d]),
            lse: load(4, DType::F32, &[problems, sq]),
            delta: load(5, DType::F32, &[problems, sq]),
        }
    };
    let pass = match pass {
        0 => {
            args.extend([(dtype, problems * sq * d), (DType::F32, problems * sq)]);
            AttentionPass::Forward { out: Some(3), lse: Some(4) }
        }
        1 => {
            let g = grads(&mut args);
            args.push((dtype, problems * sq * d));
            AttentionPass::GradQ { grads: g, dq: 6 }
        }
        _ => {
            let g = grads(&mut args);
            args.extend([(dtype, problems * sk * d), (dtype, problems * sk * d)]);
            AttentionPass::GradKv { grads: g, dk: Some(6), dv: Some(7) }
        }
    };
    let inputs = if matches!(pass, AttentionPass::Forward { .. }) { 3 } else { 6 };
    let body = AttentionKernel { dtype, causal, batch: [problems].into_iter().collect(), sq, sk, d, q, k, v, pass };
    Kernel {
        args: args.into_iter().map(|(dtype, len)| Arg { dtype, len }).collect(),
        inputs,
        body: Body::Attention(Box::new(body)),
    }
}

/// Random arguments: q, k, v and d_out in [-1, 1), a log-sum-exp in [2, 6) (so that
/// `exp(s - lse)` stays finite), delta in [-1, 1); outputs filled with a pattern.
fn init(rng: &mut Rng, k: &Kernel) -> Vec<Vec<u8>> {
    (k.args.iter().enumerate())
        .map(|(i, a)| {
            let value = |rng: &mut Rng| if i == 4 { rng.uniform(2.0, 6.0) } else { rng.uniform(-1.0, 1.0) };
            (0..a.len)
                .flat_map(|_| {
                    let x = value(rng);
                    match a.dtype {
                        DType::BF16 => half::bf16::from_f64(x).to_le_bytes().to_vec(),
                        DType::F16 => half::f16::from_f64(x).to_le_bytes().to_vec(),
                        _ => (x as f32).to_le_bytes().to_vec(),
                    }
                })
                .collect()
        })
        .collect()
}

fn floats(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DType::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64()).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64()).collect(),
        _ => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect(),
    }
}

/// Where `got` differs from `want` beyond the tuner's tolerance, if it does.
fn differs(dtype: DType, want: &[u8], got: &[u8]) -> Option<String> {
    let (a, b) = (floats(dtype, want), floats(dtype, got));
    let scale = a.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let limit = tolerance(dtype) * scale.max(f64::MIN_POSITIVE);
    let at = a.iter().zip(&b).position(|(x, y)| !(x - y).abs().le(&limit))?;
    Some(format!("element {at}: {} against {} (limit {limit:e})", b[at], a[at]))
}

#[test]
fn every_tiling_the_tuner_may_choose_agrees_with_the_table() {
    let Some(h) = common::cuda_harness("attention tilings") else { return };
    let mut rng = Rng::new(0xA77);
    let (mut runs, mut failures) = (0, vec![]);
    // bf16 in every case; f16 (the same kernels but for the conversions) at head dimension 64,
    // causal: each tiling is an NVRTC compile of a second or more.
    for dtype in [DType::BF16, DType::F16] {
        for pass in 0..3u8 {
            for d in [64, 128] {
                for causal in [false, true] {
                    if dtype == DType::F16 && (d != 64 || !causal) {
                        continue;
                    }
                    let (sq, sk) = if causal { (333, 333) } else { (301, 190) };
                    let k = kernel(dtype, pass, 16, sq, sk, d, causal);
                    let what = format!("{dtype} pass {pass} d {d} causal {causal}");
                    let compiled = CudaKernel::new(&h.compiler, &k).unwrap_or_else(|e| panic!("{what}: {e}"));
                    let Some(v) = compiled.variants() else { panic!("{what}: no variants") };
                    assert!(compiled.printed().len() >= 3, "{what}: {} tilings", compiled.printed().len());
                    let start = init(&mut rng, &k);
                    let mut want = start.clone();
                    run_compiled_on_gpu(&h, &compiled, &mut want, LaunchOptions::default()).unwrap();
                    for (variant, &options) in v.variants.iter().zip(&v.options).filter(|(_, o)| o.printed > 0) {
                        let mut got = start.clone();
                        runs += 1;
                        let label = format!("{what}, {}", variant.name);
                        if let Err(e) = run_compiled_on_gpu(&h, &compiled, &mut got, options) {
                            failures.push(format!("{label}: {e}"));
                            continue;
                        }
                        for o in k.inputs..k.args.len() {
                            let dt = k.args[o].dtype;
                            if variant.bitwise && want[o] != got[o] {
                                failures.push(format!("{label}: output {o} not bit for bit"));
                            } else if let Some(why) = differs(dt, &want[o], &got[o]) {
                                failures.push(format!("{label}: output {o}: {why}"));
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("attention tilings: {runs} GPU runs");
    assert!(failures.is_empty(), "{} differ:\n{}", failures.len(), failures.join("\n"));
}
