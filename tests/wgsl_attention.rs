//! The WGSL attention kernels on a real wgpu adapter (lavapipe in CI) against the CPU's
//! (`braid_devices::cpu::run_kernel`) on the same inputs: every pass (forward with the output
//! and/or the log-sum-exp, the query gradient, the key and/or value gradients), f32, f16 and
//! bf16, causal and not, head dimensions from 1 to 300, query and key counts across the tiles
//! (1 to 70, unequal), operands read through strided views (heads of one `[b, t, 3, h, d]`
//! buffer, a transposed key matrix, value rows reversed, statistics at every other element from an offset). Each
//! kernel runs as printed for the adapter and as printed for WebGPU's default 16 KiB of
//! workgroup memory, which stages the head dimension in several chunks. Without an adapter
//! the test prints `skipped: <reason>` and passes.
//!
//! Masked entries are skipped, never multiplied by zero: causal cases hold an infinity that
//! only masked entries read, and must come out finite where the CPU's do.
//!
//! Comparison: equal values (NaN equals NaN) pass; otherwise the CPU and the GPU add in other orders and `exp` differs by a few ulps, so an
//! element passes within `1e-4` of the output's largest magnitude (at least 1), plus two ulps
//! of its storage type when that is a half (both round an f32 result once).

mod common;

use braid_devices::cpu::map::ArgPtr;
use braid_devices::cpu::run_kernel;
use braid_devices::wgpu::{WgpuContext, run_printed_on_wgpu};
use braid_graph::DType;
use braid_graph::dtype::{bf16_from_f64, f16_from_f64};
use braid_lowering::wgsl::{self, Features};
use braid_lowering::{Arg, AttentionGradInputs, AttentionKernel, AttentionPass, Body, Kernel, Load, View};
use common::Rng;
use half::{bf16, f16};
use smallvec::SmallVec;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Pass {
    Forward { out: bool, lse: bool },
    GradQ,
    GradKv { dk: bool, dv: bool },
}

/// One attention problem set: `pass` over `batch` problems (as `[b, h]`), `sq` queries and
/// `sk` keys of dimension `d`; `strided` reads q, k and v as heads of one buffer (sq == sk),
/// otherwise k is stored transposed and v read with its rows reversed; the statistics are read at every other element.
#[derive(Clone, Copy, Debug)]
struct Shape {
    pass: Pass,
    dtype: DType,
    causal: bool,
    b: usize,
    h: usize,
    sq: usize,
    sk: usize,
    d: usize,
    strided: bool,
    /// Causal only: an infinity where no unmasked entry reads it (the last key's value row
    /// for the forward pass and the query gradient, the first query row for the key and value
    /// gradients), so that a masked entry multiplied by zero would show as a NaN.
    poison: bool,
}

fn encode(d: DType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * d.size());
    for &v in vals {
        match d {
            DType::F32 => out.extend((v as f32).to_le_bytes()),
            DType::F16 => out.extend(f16_from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend(bf16_from_f64(v).to_le_bytes()),
            _ => unreachable!("attention operands are f32, f16 or bf16 here"),
        }
    }
    out
}

fn element(d: DType, b: &[u8], i: usize) -> f64 {
    let s = &b[i * d.size()..(i + 1) * d.size()];
    match d {
        DType::F32 => f32::from_le_bytes(s.try_into().unwrap()) as f64,
        DType::F16 => f16::from_le_bytes(s.try_into().unwrap()).to_f64(),
        _ => bf16::from_le_bytes(s.try_into().unwrap()).to_f64(),
    }
}

fn view(dims: &[usize], strides: &[isize], offset: usize) -> View {
    View { dims: SmallVec::from_slice(dims), strides: SmallVec::from_slice(strides), offset }
}

/// The kernel and its arguments' initial bytes.
fn case(rng: &mut Rng, s: Shape) -> (Kernel, Vec<Vec<u8>>) {
    let Shape { dtype, b, h, sq, sk, d, .. } = s;
    let mut args: Vec<Arg> = vec![];
    let mut init: Vec<Vec<u8>> = vec![];
    let mut buffer = |rng: &mut Rng, dtype: DType, len: usize, lo: f64, hi: f64| {
        let vals: Vec<f64> = (0..len).map(|_| rng.uniform(lo, hi)).collect();
        args.push(Arg { dtype, len });
        init.push(encode(dtype, &vals));
        args.len() as u16 - 1
    };
    let load = |arg: u16, dtype: DType, view: View| Load { arg, dtype, view };
    let contiguous =
        |rows: usize| view(&[b, h, rows, d], &[(h * rows * d) as isize, (rows * d) as isize, d as isize, 1], 0);
    let (q, k, v) = if s.strided {
        // [b, t, 3, h, d]: q, k, v at offsets 0, h d, 2 h d.
        let t = sq;
        let arg = buffer(rng, dtype, b * t * 3 * h * d, -1.0, 1.0);
        let head = |i: usize| {
            let strides = [(t * 3 * h * d) as isize, d as isize, (3 * h * d) as isize, 1];
            load(arg, dtype, view(&[b, h, t, d], &strides, i * h * d))
        };
        (head(0), head(1), head(2))
    } else {
        let q = load(buffer(rng, dtype, b * h * sq * d, -1.0, 1.0), dtype, contiguous(sq));
        // k stored as [b, h, d, sk], read transposed.
        let kt = view(&[b, h, sk, d], &[(h * sk * d) as isize, (sk * d) as isize, 1, sk as isize], 0);
        let k = load(buffer(rng, dtype, b * h * sk * d, -1.0, 1.0), dtype, kt);
        // v read with its rows reversed (a negative stride).
        let rev = view(&[b, h, sk, d], &[(h * sk * d) as isize, (sk * d) as isize, -(d as isize), 1], (sk - 1) * d);
        let v = load(buffer(rng, dtype, b * h * sk * d, -1.0, 1.0), dtype, rev);
        (q, k, v)
    };
    let mut grads = |rng: &mut Rng| {
        let d_out = load(buffer(rng, dtype, b * h * sq * d, -1.0, 1.0), dtype, contiguous(sq));
        // Every other element, from element 1.
        let stats = view(&[b, h, sq], &[(2 * h * sq) as isize, (2 * sq) as isize, 2], 1);
        let lse = load(buffer(rng, DType::F32, 2 * b * h * sq + 1, 1.0, 3.0), DType::F32, stats.clone());
        let delta = load(buffer(rng, DType::F32, 2 * b * h * sq + 1, -1.0, 1.0), DType::F32, stats);
        AttentionGradInputs { d_out, lse, delta }
    };
    // q, k and v: one argument when strided, three otherwise.
    let inputs_before = if s.strided { 1 } else { 3 };
    let (pass, outs) = match s.pass {
        Pass::Forward { out, lse } => {
            let outs = [(out, dtype, sq * d), (lse, DType::F32, sq)];
            let mut next = inputs_before as u16;
            let mut arg = |wanted: bool| {
                next += wanted as u16;
                wanted.then_some(next - 1)
            };
            (AttentionPass::Forward { out: arg(out), lse: arg(lse) }, outs.to_vec())
        }
        Pass::GradQ => {
            let g = grads(rng);
            (AttentionPass::GradQ { grads: g, dq: (inputs_before + 3) as u16 }, vec![(true, dtype, sq * d)])
        }
        Pass::GradKv { dk, dv } => {
            let g = grads(rng);
            let mut next = (inputs_before + 3) as u16;
            let mut arg = |wanted: bool| {
                next += wanted as u16;
                wanted.then_some(next - 1)
            };
            let (dk_arg, dv_arg) = (arg(dk), arg(dv));
            (AttentionPass::GradKv { grads: g, dk: dk_arg, dv: dv_arg }, vec![(dk, dtype, sk * d), (dv, dtype, sk * d)])
        }
    };
    if s.poison {
        assert!(s.causal && !s.strided, "poison needs a causal mask and separate operands");
        // Stored rows: q's first; v's first, which is its last key (v is read reversed).
        let (arg, rows) = match s.pass {
            Pass::GradKv { .. } => (0, sq),
            _ => (2, sk),
        };
        for problem in 0..b * h {
            for c in 0..d {
                let e = (problem * rows * d + c) * dtype.size();
                let inf = encode(dtype, &[f64::INFINITY]);
                init[arg][e..e + inf.len()].copy_from_slice(&inf);
            }
        }
    }
    let inputs = args.len();
    for (wanted, dtype, n) in outs {
        if wanted {
            args.push(Arg { dtype, len: b * h * n });
            // Garbage, so that an element the kernel does not write shows.
            init.push(encode(dtype, &vec![7.0; b * h * n]));
        }
    }
    let a = AttentionKernel { dtype, causal: s.causal, batch: SmallVec::from_slice(&[b, h]), sq, sk, d, q, k, v, pass };
    (Kernel { args, inputs, body: Body::Attention(Box::new(a)) }, init)
}

fn run_cpu(k: &Kernel, init: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut bufs: Vec<Vec<u64>> = init.iter().map(|b| vec![0u64; b.len().div_ceil(8).max(1)]).collect();
    for (b, i) in bufs.iter_mut().zip(init) {
        // SAFETY: `b` holds at least `i.len()` bytes.
        unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut u8, i.len()) }.copy_from_slice(i);
    }
    let args: Vec<ArgPtr> = (k.args.iter().zip(&mut bufs))
        .map(|(a, b)| ArgPtr { ptr: b.as_mut_ptr() as *mut u8, len: a.len, dtype: a.dtype })
        .collect();
    run_kernel(k, &args).expect("the CPU runs the kernel");
    // SAFETY: as above.
    bufs.iter()
        .zip(init)
        .map(|(b, i)| unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, i.len()) }.to_vec())
        .collect()
}

/// The first output element where `got` differs from the CPU's `want` beyond the tolerance.
fn compare(k: &Kernel, want: &[Vec<u8>], got: &[Vec<u8>]) -> Option<String> {
    for a in k.inputs..k.args.len() {
        let (d, n) = (k.args[a].dtype, k.args[a].len);
        let largest = (0..n).map(|e| element(d, &want[a], e).abs()).fold(1.0, f64::max);
        let half_ulps = if d == DType::F32 { 0.0 } else { 2.0 * d.epsilon() };
        for e in 0..n {
            let (w, g) = (element(d, &want[a], e), element(d, &got[a], e));
            if w == g || (w.is_nan() && g.is_nan()) {
                continue;
            }
            let within = (w - g).abs() <= 1e-4 * largest + half_ulps * w.abs().max(g.abs());
            if !within {
                return Some(format!("argument {a} ({d}) element {e} of {n}: cpu {w}, wgpu {g}"));
            }
        }
    }
    None
}

fn shapes() -> Vec<Shape> {
    let mut rng = Rng::new(0xA77E);
    let passes = [Pass::Forward { out: true, lse: true }, Pass::GradQ, Pass::GradKv { dk: true, dv: true }];
    let mut out = vec![];
    let dims: [(usize, usize, usize, usize); 10] = [
        (1, 1, 1, 1),
        (2, 7, 7, 16),
        (1, 33, 33, 24),
        (1, 65, 40, 64),
        (2, 17, 70, 100),
        (1, 40, 17, 128),
        (1, 20, 20, 200),
        (1, 33, 33, 256),
        (1, 9, 12, 300),
        (3, 48, 48, 32),
    ];
    for (n, &(h, sq, sk, d)) in dims.iter().enumerate() {
        for pass in passes {
            let dtype = *rng.pick(&[DType::F32, DType::F32, DType::F16, DType::BF16]);
            let strided = sq == sk && n % 2 == 0;
            out.push(Shape { pass, dtype, causal: rng.chance(0.5), b: 2, h, sq, sk, d, strided, poison: false });
        }
    }
    // Partial outputs: only the output, only the statistics, only one gradient.
    let partial = [
        Pass::Forward { out: true, lse: false },
        Pass::Forward { out: false, lse: true },
        Pass::GradKv { dk: true, dv: false },
        Pass::GradKv { dk: false, dv: true },
    ];
    for (i, pass) in partial.into_iter().enumerate() {
        let d = [8, 72, 40, 136][i];
        let causal = i % 2 == 0;
        out.push(Shape {
            pass,
            dtype: DType::F32,
            causal,
            b: 1,
            h: 2,
            sq: 19,
            sk: 35,
            d,
            strided: false,
            poison: false,
        });
    }
    for pass in passes {
        let (sq, sk, d) = (40, 40, 24);
        out.push(Shape { pass, dtype: DType::F32, causal: true, b: 1, h: 2, sq, sk, d, strided: false, poison: true });
    }
    out
}

#[test]
fn attention_kernels_match_the_cpu() {
    let ctx = match WgpuContext::new() {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    eprintln!("wgsl_attention: on {}", ctx.describe());
    let webgpu = Features { max_workgroup_storage_size: 16_384, ..ctx.features };
    let mut rng = Rng::new(0xA77E_0001);
    let mut failures = vec![];
    for shape in shapes() {
        let (kernel, init) = case(&mut rng, shape);
        let want = run_cpu(&kernel, &init);
        for (which, features) in [("the adapter's limits", &ctx.features), ("16 KiB of workgroup memory", &webgpu)] {
            let mut got = init.clone();
            let ran = wgsl::print(&kernel, features)
                .map_err(|e| format!("not printed: {e}"))
                .and_then(|p| run_printed_on_wgpu(&ctx, &kernel, p, &mut got).map_err(|e| e.to_string()));
            let failure = match ran {
                Err(e) => Some(e),
                Ok(()) => compare(&kernel, &want, &got),
            };
            if let Some(f) = failure {
                failures.push(format!("{shape:?} with {which}: {f}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
