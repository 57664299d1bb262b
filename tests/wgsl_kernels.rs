//! The WGSL printer on a real wgpu adapter (lavapipe, Mesa's software Vulkan driver, in CI):
//! random kernels are printed, compiled into pipelines, run over random inputs (never all
//! zeros) and compared with `braid_devices::cpu::run_kernel` on the same inputs. Without an
//! adapter the test prints `skipped: <reason>` and passes.
//!
//! Kernels: the semantic corners; random map loops over every dtype wgpu holds (f32, f16,
//! bf16, i32, u8, bool arguments; i64 values inside) through random views (transposed,
//! padded, offset, reversed, broadcast); the CUDA printer test's row kernels and
//! concatenations (those without f64/i64 arguments); row kernels along every axis at lengths
//! from 1 to 50,000 (one workgroup per row, and rows split into segments over two passes),
//! whole-tensor reductions over 2^20 elements and more; batched, strided, transposed matrix
//! products of f32, f16, bf16, i32 and u8 with epilogues, sizes across the 16 x 16 tiles;
//! products with quantized weights (`cuda_printer/quant_cases.rs`: int8 and int4 weights,
//! f32 and f16 scales, x of f32, f16 and bf16 through any strides, with and without epilogues);
//! the CUDA printer test's gathers (every element dtype wgpu holds, moved bit for bit) and
//! scatter-adds (f32, i32, u8) with i32 indices, out-of-range ones included;
//! sub-word outputs (u8, bool, f16, bf16) written by neighbouring threads; a map loop of more
//! than 65,535 workgroups; and some kernels printed for an adapter with 3 workgroups per
//! dimension, so that every dispatch spreads over y and z.
//!
//! Comparison: integers and bools exactly; floats bit for bit (NaN equals any NaN) unless they
//! derive from a function WGSL leaves approximate (`exp`, `log`, `sin`, `cos`, `tanh`, `pow`,
//! normal random numbers) or from a float sum or mean (another summation order): those within
//! 1e-5 relative, or 4 ulps of their storage type if looser, of the larger magnitude or 1
//! (so that values near zero are judged absolutely). So that this stays meaningful, random
//! DAGs never feed such values to comparisons, casts to integers or halves, additions or
//! divisions, and `sin`/`cos` read arguments clamped to [-8, 8]. A matrix product element may
//! differ by `k * 2^-23 * sum |a b|` (two summation orders of `k` products) plus 2 ulps of its
//! storage type (a quantized product's bound adds an ulp of an f16 or bf16 product);
//! integer products exactly. On a hardware adapter (not lavapipe), every float
//! result is judged like an approximate one: its driver may divide in 2.5 ulps and fuse
//! multiplies with adds, as WGSL's accuracy rules allow (on the H100, 2 of 193 kernels
//! differed from the CPU by 1 ulp for that reason, and lavapipe matches the CPU bit for bit).

#[path = "cuda_printer/cases.rs"]
#[allow(dead_code)] // the CUDA-only generators
mod cases;
mod common;
#[path = "cuda_printer/gathers.rs"]
#[allow(dead_code)] // the CUDA printer's checks of its cases
mod gathers;
#[path = "cuda_printer/quant_cases.rs"]
mod quant_cases;
#[path = "cuda_printer/scatters.rs"]
#[allow(dead_code)]
mod scatters;
#[path = "wgsl_kernels/cases.rs"]
mod wgsl_cases;

use braid_devices::DeviceError;
use braid_devices::cpu::run_kernel;
use braid_devices::wgpu::{WgpuContext, run_kernel_on_wgpu, run_printed_on_wgpu};
use braid_graph::{DType, ReduceOp};
use braid_lowering::wgsl::{self, Features};
use braid_lowering::{Body, Kernel, MapLoop, RowKernel};
use cases::{Case, element, run_on_copies};
use common::Rng;
use std::time::Instant;
use wgsl_cases::*;

/// The context, or `None` after printing why there is none.
fn context() -> Option<WgpuContext> {
    match WgpuContext::new() {
        Ok(ctx) => {
            eprintln!("wgsl_kernels: on {}", ctx.describe());
            Some(ctx)
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn run_cpu(k: &Kernel, init: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, String> {
    run_on_copies(k, init, |args| run_kernel(k, args))
}

/// Whether `got` passes for the CPU's `want` (see the module docs); `extra` is an absolute
/// allowance (a matrix product's bound).
fn close(want: f64, got: f64, storage: DType, approx: bool, extra: f64) -> bool {
    if want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()) {
        return true;
    }
    let tol = 1e-5f64.max(8.0 * storage.epsilon());
    let scale = want.abs().max(got.abs());
    (approx && (want - got).abs() <= tol * scale.max(1.0))
        || (extra > 0.0 && (want - got).abs() <= extra + 4.0 * storage.epsilon() * scale)
}

/// The first element where the wgpu results differ from the CPU's, if any.
/// `relaxed`: every float output is judged as approximate (a hardware adapter; see the module
/// docs).
fn compare(case: &Case, cpu: &[Vec<u8>], got: &[Vec<u8>], bound: Option<&Bound>, relaxed: bool) -> Option<String> {
    let (loops, rows): (Vec<&MapLoop>, Option<&RowKernel>) = match &case.kernel.body {
        Body::Map(l) => (l.iter().collect(), None),
        Body::Rows(r) => (vec![], Some(r)),
        Body::Matmul(m) => (m.epilogue.iter().collect(), None),
        Body::QuantMatmul(q) => (q.epilogue.iter().collect(), None),
        // Elements moved, or summed in the CPU's order: exact.
        Body::Gather(_) | Body::Scatter(_) | Body::ScatterWrite(_) => (vec![], None),
        Body::Collective(_) | Body::Quantize(_) => unreachable!("the generators make no collectives or quantizations"),
        Body::Attention(_) => {
            unreachable!("the generators make no attention kernels (tests/wgsl_attention.rs checks them)")
        }
    };
    let mut approx = vec![false; case.kernel.args.len()];
    for (expr, stores) in loops.iter().map(|l| (&l.expr, &l.stores)).chain(rows.map(|r| (&r.expr, &r.stores))) {
        let t = approximate(expr);
        stores.iter().for_each(|s| approx[s.arg as usize] |= t[s.value as usize]);
    }
    for a in case.kernel.inputs..case.kernel.args.len() {
        let d = case.kernel.args[a].dtype;
        for e in 0..case.kernel.args[a].len {
            let (w, g) = (element(d, &cpu[a], e), element(d, &got[a], e));
            let extra = bound.map_or(0.0, |b| b.0.get(e).copied().unwrap_or(0.0));
            let ok = match (w, g) {
                (Ok(w), Ok(g)) => close(w, g, d, approx[a] || (relaxed && d.is_float()), extra),
                (w, g) => w == g,
            };
            if !ok {
                return Some(format!("{}: argument a{a} ({d}) element {e}: cpu {w:?}, wgpu {g:?}", case.label));
            }
        }
    }
    None
}

/// Runs `case` on the CPU and on wgpu (printed for `features` when given); returns a failure.
fn check(ctx: &WgpuContext, case: &Case, bound: Option<&Bound>, features: Option<&Features>) -> Option<String> {
    let cpu = run_cpu(&case.kernel, &case.init).unwrap_or_else(|e| panic!("{}: the CPU rejects it: {e}", case.label));
    let mut got = case.init.clone();
    let ran = match features {
        None => run_kernel_on_wgpu(ctx, &case.kernel, &mut got),
        Some(f) => match wgsl::print(&case.kernel, f) {
            Ok(p) => run_printed_on_wgpu(ctx, &case.kernel, p, &mut got),
            Err(e) => return Some(format!("{}: not printed: {e}", case.label)),
        },
    };
    if let Err(e) = ran {
        return Some(format!("{}: {e}", case.label));
    }
    // (`wgpu::DeviceType::Cpu` by its name: this crate does not depend on wgpu directly.)
    let relaxed = format!("{:?}", ctx.info.device_type) != "Cpu";
    let failure = compare(case, &cpu, &got, bound, relaxed);
    if failure.is_some() && std::env::var_os("BRAID_WGSL_TEST_SHOW").is_some() {
        let printed = wgsl::print(&case.kernel, features.unwrap_or(&ctx.features)).map(|p| p.source);
        eprintln!("--- {}\n{:?}\n{}", case.label, case.kernel, printed.unwrap_or_else(|e| e));
        for (a, (w, g)) in cpu.iter().zip(&got).enumerate().skip(case.kernel.inputs) {
            eprintln!("a{a}: cpu {w:?}\n    wgpu {g:?}");
        }
    }
    failure
}

/// The random kernels, each with its matrix-product bound if it has one.
fn kernels() -> Vec<(Case, Option<Bound>)> {
    use DType::*;
    let mut rng = Rng::new(0x3C51);
    let mut out: Vec<(Case, Option<Bound>)> = vec![(edges_case(), None)];
    for n in 0..70 {
        let dims: Vec<usize> = (0..1 + rng.below(3)).map(|_| 1 + rng.below(5)).collect();
        out.push((map_case(&mut rng, n, &dims), None));
    }
    for n in 0..6 {
        let dims = [1 + rng.below(40), 200 + rng.below(400)];
        out.push((map_case(&mut rng, 1000 + n, &dims), None));
    }
    let mut rows = 0;
    while rows < 40 {
        let c = cases::rows_case(&mut rng, rows, cases::MathLib::Cuda);
        if storable(&c) {
            out.push((c, None));
            rows += 1;
        }
    }
    let mut concats = 0;
    while concats < 6 {
        let c = cases::concat_case(&mut rng, concats);
        if storable(&c) {
            out.push((c, None));
            concats += 1;
        }
    }
    let ops = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax];
    let mut n = 0;
    for len in [1, 31, 32, 33, 256, 257, 1000, 4097, 8192, 20_000, 50_000] {
        for shape in 0..4 {
            let (dims, axis) = match shape {
                0 => (vec![3, len], Some(1)),
                1 => (vec![len, 3], Some(0)),
                2 => (vec![2, len, 3], Some(1)),
                _ => (vec![len.min(5000)], None),
            };
            let xd = *rng.pick(&[F32, F32, F16, BF16, I32, U8]);
            let template = if xd.is_float() { n % 3 } else { [0, 2][n % 2] };
            // Means are of floats only (the op table's rule).
            let allowed: Vec<ReduceOp> = ops.into_iter().filter(|o| xd.is_float() || *o != ReduceOp::Mean).collect();
            let op = *rng.pick(&allowed);
            let label = format!("rows {n}: {dims:?} along {axis:?}, {xd}, template {template}, {op:?}");
            out.push((rows_over(&mut rng, label, &dims, axis, xd, template, op), None));
            n += 1;
        }
    }
    // 128 rows of 300: one workgroup per row; and wide rows of many positions.
    out.push((rows_over(&mut rng, "rows: 128 x 300".into(), &[128, 300], Some(1), F32, 1, ReduceOp::Sum), None));
    // Whole tensors of 2^20 elements and more, in two passes.
    for (k, (template, op)) in
        [(0, ReduceOp::Sum), (0, ReduceOp::Max), (0, ReduceOp::ArgMax), (1, ReduceOp::Sum), (0, ReduceOp::Mean)]
            .into_iter()
            .enumerate()
    {
        let dims = if k % 2 == 0 { vec![(1 << 20) + 37] } else { vec![1024, 1031] };
        let label = format!("whole tensor {dims:?}, template {template}, {op:?}");
        out.push((rows_over(&mut rng, label, &dims, None, F32, template, op), None));
    }
    // The CUDA printer test's gathers and scatter-adds with i32 indices over dtypes wgpu holds.
    let (mut gathered, mut scattered, mut n) = (0, 0, 0);
    while gathered < 40 || scattered < 30 {
        let (g, s) = (gathers::gather_case(&mut rng, n), scatters::scatter_case(&mut rng, n));
        n += 1;
        if gathered < 40 && storable(&g) {
            out.push((g, None));
            gathered += 1;
        }
        if scattered < 30 && storable(&s) {
            out.push((s, None));
            scattered += 1;
        }
    }
    // Scatters (bits moved, the last write winning) over dtypes wgpu holds.
    let mut writes = Rng::new(0x5CA7);
    out.extend((scatters::scatter_write_cases(&mut writes, 40).into_iter()).filter(storable).map(|c| (c, None)));
    let mut m = 0;
    for d in [F32, F16, BF16, I32, U8] {
        for _ in 0..4 {
            let size = |rng: &mut Rng| *rng.pick(&[1, 3, 16, 17, 40]);
            let shape =
                [1 + rng.below(3), size(&mut rng), if rng.chance(0.1) { 0 } else { size(&mut rng) }, size(&mut rng)];
            let (c, b) = matmul_case(&mut rng, m, d, shape);
            out.push((c, Some(b)));
            m += 1;
        }
    }
    // Products with quantized weights (int8, int4 in groups of 32, 64 and 128).
    for n in 0..40 {
        let (c, b) = quant_cases::quant_case(&mut rng, n);
        out.push((c, Some(Bound(b))));
    }
    out
}

#[test]
fn printed_kernels_compute_what_the_cpu_computes_on_wgpu() {
    let Some(ctx) = context() else { return };
    let start = Instant::now();
    let all = kernels();
    let mut failures = vec![];
    let only = std::env::var("BRAID_WGSL_TEST_ONLY").ok();
    for (case, bound) in all.iter().filter(|(c, _)| only.as_ref().is_none_or(|o| c.label.contains(o.as_str()))) {
        failures.extend(check(&ctx, case, bound.as_ref(), None));
    }
    let random = start.elapsed();
    // Dispatches spread over y and z: the same kernels printed for 3 workgroups per dimension (up to 27).
    let narrow = Features { max_workgroups_per_dimension: 3, ..ctx.features };
    let mut spread = 0;
    let fits = |c: &Case| wgsl::print(&c.kernel, &narrow).is_ok_and(|p| p.entries.iter().any(|e| e.workgroups[1] > 1));
    for (case, bound) in all.iter().filter(|(c, _)| fits(c)).step_by(2) {
        failures.extend(check(&ctx, case, bound.as_ref(), Some(&narrow)));
        spread += 1;
    }
    // More than 65,535 workgroups of 256 threads in one dimension.
    let wide = wide_case(&mut Rng::new(7), 65_536 * 256 + 5);
    assert!(
        wgsl::print(&wide.kernel, &ctx.features).unwrap().entries[0].workgroups[1] > 1,
        "the wide case must spread"
    );
    failures.extend(check(&ctx, &wide, None, None));
    eprintln!(
        "wgsl_kernels: {} kernels compared, {spread} more printed for 3 workgroups per dimension (up to 27), 1 of {} workgroups; \
         {} pipelines; random kernels {:.2?}, all {:.2?}",
        all.len(),
        (65_536 * 256 + 5usize).div_ceil(256),
        ctx.cached_kernels(),
        random,
        start.elapsed()
    );
    assert!(failures.is_empty(), "{} kernels differ:\n{}", failures.len(), failures.join("\n"));
}

/// Run-time failures are `Err`s that leave the device usable: dtypes WGSL lacks, a buffer over
/// the adapter's limit, a kernel whose views leave their arguments, wrong buffers for a
/// kernel; and a kernel printed twice compiles once.
#[test]
fn failures_are_errors_and_pipelines_are_cached() {
    let Some(ctx) = context() else { return };
    for d in [DType::F64, DType::I64] {
        let e = wgsl::supports(d, &ctx.features).unwrap_err();
        assert!(e.contains(d.name()) && e.contains("not supported on wgpu"), "{e}");
    }
    let mut rng = Rng::new(3);
    let case = map_case(&mut rng, 0, &[4, 5]);
    let mut f64_kernel = case.kernel.clone();
    f64_kernel.args[0].dtype = DType::F64;
    assert!(wgsl::print(&f64_kernel, &ctx.features).unwrap_err().contains("f64 is not supported"));
    let too_big = ctx.limits.max_buffer_size + 4;
    match ctx.create_buffer(too_big) {
        Err(e @ (DeviceError::Kernel(_) | DeviceError::OutOfMemory { .. })) => eprintln!("wgsl_kernels: {e}"),
        other => panic!("a buffer over max_buffer_size gave {:?}", other.map(|b| b.size())),
    }
    let mut outside = case.kernel.clone();
    if let Body::Map(loops) = &mut outside.body {
        loops[0].loads[0].view.offset += 1000;
    }
    let mut args = case.init.clone();
    assert!(run_kernel_on_wgpu(&ctx, &outside, &mut args).is_err(), "a view outside its argument must be refused");
    let compiled = ctx.kernel(&case.kernel).unwrap();
    let mut encoder = ctx.encoder();
    assert!(ctx.encode(&mut encoder, &compiled, &[]).is_err(), "missing buffers must be refused");
    let small = ctx.create_buffer(4).unwrap();
    let refs: Vec<_> = compiled.source.bindings.iter().filter(|b| **b != wgsl::Binding::Zero).map(|_| &small).collect();
    if compiled.source.bindings.iter().any(|b| b.bytes() > 4 && *b != wgsl::Binding::Zero) {
        assert!(
            ctx.encode(&mut encoder, &compiled, &refs).is_err(),
            "buffers smaller than their bindings must be refused"
        );
    }
    // Still usable, and the same kernel compiles once.
    let before = ctx.cached_kernels();
    let again = ctx.kernel(&case.kernel).unwrap();
    assert!(std::sync::Arc::ptr_eq(&compiled, &again) && ctx.cached_kernels() == before);
    assert!(check(&ctx, &case, None, None).is_none());
}

/// The launch shapes the wgpu device's tuner times (`wgsl::print_with`: 64 to 1024 threads a
/// workgroup as the adapter allows, several indices a thread) give the default printing's
/// bytes, NaNs aside (each is compiled anew, and lavapipe's LLVM may give a NaN the other sign
/// when it orders an addition's operands otherwise): random map loops of every dtype wgpu holds
/// through random views, and neighbouring threads writing neighbouring bytes (u8 and bool).
#[test]
fn map_loops_in_other_launch_shapes_give_the_default_bytes() {
    let Some(ctx) = context() else { return };
    let mut rng = Rng::new(0x7E57);
    let mut all: Vec<Case> = (0..12)
        .map(|n| {
            let dims = [1 + rng.below(40), 200 + rng.below(400)];
            map_case(&mut rng, n, &dims)
        })
        .collect();
    all.push(wide_case(&mut rng, 3 * 65_536 + 17));
    let shapes = [(64, 1), (128, 1), (512, 1), (1024, 1), (256, 2), (256, 4), (128, 4), (64, 3)];
    let mut failures = vec![];
    let mut runs = 0;
    for case in &all {
        let mut want = case.init.clone();
        run_kernel_on_wgpu(&ctx, &case.kernel, &mut want).unwrap_or_else(|e| panic!("{}: {e}", case.label));
        for (map_threads, map_elements) in shapes {
            if map_threads > ctx.features.max_invocations_per_workgroup {
                continue;
            }
            let options = wgsl::WgslOptions { map_threads, map_elements };
            let printed = wgsl::print_with(&case.kernel, &ctx.features, &options).unwrap();
            let mut got = case.init.clone();
            run_printed_on_wgpu(&ctx, &case.kernel, printed, &mut got)
                .unwrap_or_else(|e| panic!("{} {options:?}: {e}", case.label));
            runs += 1;
            for a in case.kernel.inputs..got.len() {
                let d = case.kernel.args[a].dtype;
                let nan = |b: &[u8], i| element(d, b, i).is_ok_and(f64::is_nan);
                let differs = (0..case.kernel.args[a].len).find(|&i| {
                    let at = i * d.size()..(i + 1) * d.size();
                    got[a][at.clone()] != want[a][at] && !(nan(&got[a], i) && nan(&want[a], i))
                });
                if let Some(i) = differs {
                    failures
                        .push(format!("{} {options:?}: output {a} element {i} differs from the default's", case.label));
                }
            }
        }
    }
    eprintln!("wgsl_kernels: {} map kernels in {runs} other launch shapes", all.len());
    assert!(runs >= all.len() * 4 && failures.is_empty(), "{}", failures.join("\n"));
}
