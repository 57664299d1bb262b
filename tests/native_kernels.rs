//! Compiled CPU kernels against the interpreter, **bit for bit** (but for NaN payloads): random kernels of map loops
//! (every dtype the host C printer prints, every view kind: transposed, padded, offset,
//! reversed, broadcast; random expression DAGs over every primitive; NaN, infinities and -0 in
//! the inputs) are printed, compiled by the system's C compiler and loaded as the CPU device
//! does (`braid_devices::cpu::native`), then run next to the interpreter on the same random
//! inputs. Every byte of every argument must agree (a NaN may differ from another NaN only in
//! its payload: gcc may swap the operands of `+` and `*`). Large cases split into parallel tasks that start and end in the middle of runs.
//! Through the engine: a device compiling before the first run, and one compiling in the
//! background, give the interpreter's bits.
//!
//! Skipped, with a message, when there is no C compiler.

// The printer test's generators; this test uses the map-loop ones.
#[allow(dead_code)]
#[path = "cuda_printer/cases.rs"]
mod cases;
mod common;

use braid::prelude::*;
use braid_devices::cpu::map::ArgPtr;
use braid_devices::cpu::native::{NativeKernel, SMALL_RUNS};
use braid_devices::cpu::run_kernel;
use braid_lowering::{Body, Kernel};
use cases::*;
use common::Rng;
use rayon::prelude::*;

fn skip() -> bool {
    no_compiler("native_kernels")
}

#[test]
fn compiled_kernels_compute_the_interpreters_bits() {
    if skip() {
        return;
    }
    let start = std::time::Instant::now();
    let mut rng = Rng::new(0x5EED_C0DE);
    let mut cases = vec![edges_case()];
    cases.extend((0..140).map(|n| map_case(&mut rng, n, MathLib::Host)));
    // Large loops (tasks of 32Ki indices in parallel), some with a short last dimension.
    for n in 0..6 {
        let dims: Vec<usize> = match n % 3 {
            0 => vec![70_000 + rng.below(70_000)],
            1 => vec![300 + rng.below(200), 250 + rng.below(200)],
            _ => vec![20_000 + rng.below(9_000), 1 + rng.below(5), 2],
        };
        cases.push(map_case_over(&mut rng, 1000 + n, &dims, MathLib::Host));
    }
    cases.extend((0..6).map(|n| concat_case(&mut rng, n)));
    let failures = compiled_differences(&cases);
    let half = |c: &&Case| c.kernel.args.iter().any(|a| matches!(a.dtype, DType::F16 | DType::BF16));
    eprintln!(
        "native_kernels: {} kernels ({} with f16 or bf16 arguments) compiled and compared in {:.2?}",
        cases.len(),
        cases.iter().filter(half).count(),
        start.elapsed()
    );
    assert!(failures.is_empty(), "{} of {} kernels differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// Row kernels compiled against the interpreter, bit for bit: every reduction (float sums and
/// extremes fold in the interpreter's chunks and lanes), softmaxes, layer norms, argmaxes with
/// one-hots and random numbers, along the last axis, along other axes (positions after the
/// axis, re-tiled column blocks) and over whole tensors; short rows, rows of one chunk, rows of
/// several chunks with kept values, rows past the kept length; NaN, infinities and -0 in the
/// inputs; few rows long enough to be split across threads compiled in their split form (see
/// also `tests/native_split.rs`). Kernels the printer leaves to the interpreter (more positions
/// after the axis than `MAX_INNER`, views that do not walk a row with one stride) are counted,
/// not compared.
#[test]
fn compiled_row_kernels_compute_the_interpreters_bits() {
    if skip() {
        return;
    }
    use braid_devices::cpu::rows;
    let start = std::time::Instant::now();
    let mut rng = Rng::new(0x0520_0555);
    let mut cases = vec![];
    for n in 0..160 {
        let rank = 1 + rng.below(3);
        let dims: Vec<usize> = (0..rank).map(|_| *rng.pick(&[1, 2, 3, 5, 7, 33])).collect();
        let axis = match n % 4 {
            0 => None,
            1 => Some(rng.below(rank)),
            _ => Some(rank - 1),
        };
        cases.push(rows_case_over(&mut rng, n, &dims, axis, MathLib::Host, true));
    }
    // Rows of one chunk (up to 4096), of several chunks (kept values), and past the kept length
    // in few rows (not split: under 2 x 32Ki positions).
    let long: [(&[usize], Option<usize>); 11] = [
        (&[24, 1000], Some(1)),
        (&[5, 4096], Some(1)),
        (&[3, 2, 5000], Some(2)),
        (&[17, 9000], Some(1)),
        (&[2, 30000], Some(1)),
        (&[4000], None),
        (&[2, 70000], Some(1)),
        // Enough rows not to be split, a scratch of over 1 MiB for f64 (allocated per call).
        (&[16, 140_000], Some(1)),
        // Reductions along a non-last axis: re-tiled into column blocks, or (enough rows) as
        // they are.
        (&[300, 512], Some(0)),
        (&[4, 50, 256], Some(1)),
        (&[20, 7, 130], Some(1)),
    ];
    for (i, (dims, axis)) in long.iter().enumerate() {
        for j in 0..6 {
            let specials = j % 2 == 0;
            cases.push(rows_case_over(&mut rng, 1000 + 10 * i + j, dims, *axis, MathLib::Host, specials));
        }
    }
    let results: Vec<Result<Option<String>, String>> = cases
        .par_iter()
        .map(|case| {
            let k = &case.kernel;
            let Body::Rows(r) = &k.body else { unreachable!("row cases") };
            let plan = rows::plan(r);
            let planned = Kernel { body: Body::Rows(plan.kernel(r).clone()), ..k.clone() };
            let want = run_on_copies(k, &case.init, |args| run_kernel(k, args)).unwrap();
            let got = if plan.splits() {
                // Few long rows: split across threads, compiled in the split form.
                let native = NativeKernel::build_split(&planned)?;
                // SAFETY: `native` is the split form of the planned kernel, `plan` its plan.
                run_on_copies(k, &case.init, |args| unsafe { native.run_split_rows(plan.kernel(r), &plan, args) })
            } else {
                let native = NativeKernel::build(&planned)?;
                // SAFETY: `native` was built from the planned kernel.
                run_on_copies(k, &case.init, |args| unsafe { native.run_rows(plan.kernel(r), args) })
            };
            Ok(first_difference(case, &want, &got.unwrap()))
        })
        .collect();
    let compared = results.iter().filter(|r| r.is_ok()).count();
    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().ok()?.as_ref()).collect();
    let mut left: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    left.sort();
    left.dedup();
    eprintln!(
        "native_kernels: {compared} of {} row kernels compiled and compared in {:.2?}; the others interpreted: {left:?}",
        cases.len(),
        start.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{} of {compared} row kernels differ:\n{}",
        failures.len(),
        failures.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
    );
    assert!(compared >= 120, "only {compared} row kernels were printed for the host");
}

/// Past the streaming size, written in place over `x` (the output argument aliases the input,
/// as the planner's in-place updates do), beside a second f32 output and a bool one, checked
/// both ways on the same data: `x * x + x` (memory-bound: the f32 outputs streamed after each
/// block) and `tanh(x) * x + exp(-x)` (compute-bound where the CPU has 8 or fewer f32 lanes:
/// the f32 outputs stored directly from the vectorised loop, the bool one from its block).
#[test]
fn in_place_and_streamed_outputs_match() {
    if skip() {
        return;
    }
    use braid_graph::expr::{ExprBuilder, PrimCmp};
    use braid_lowering::{Arg, Load, MapLoop, Store, View};
    // Past the size from which outputs leave the cache; the offset makes the stores start off
    // a 64-byte boundary.
    let n = braid_devices::cpu::map::stream_bytes() / 4 + (1 << 18) + 13;
    let view = View { dims: [n - 3].as_slice().into(), strides: [1].as_slice().into(), offset: 3 };
    let mut rng = Rng::new(3);
    let init: Vec<f32> = (0..n).map(|_| rng.uniform(-20.0, 20.0) as f32).collect();
    for heavy in [false, true] {
        let mut b = ExprBuilder::new();
        let x = b.load(0, DType::F32);
        let (y, other) = if heavy {
            let t = b.tanh(x);
            let tx = b.mul(t, x);
            let nx = b.neg(x);
            let e = b.exp(nx);
            (b.add(tx, e), e)
        } else {
            let xx = b.mul(x, x);
            (b.add(xx, x), xx)
        };
        let zero = b.constant(0.0, DType::F32);
        let negative = b.cmp(PrimCmp::Lt, x, zero);
        let store = |arg: u16, dtype: DType, value| Store { arg, dtype, view: view.clone(), value };
        let l = MapLoop {
            dims: view.dims.clone(),
            loads: vec![Load { arg: 0, dtype: DType::F32, view: view.clone() }],
            expr: b.finish(),
            stores: vec![store(1, DType::F32, y), store(2, DType::F32, other), store(3, DType::Bool, negative)],
        };
        assert_eq!(braid_lowering::host_c::compute_bound(&l, 8), heavy);
        let mut args = vec![Arg { dtype: DType::F32, len: n }; 3];
        args.push(Arg { dtype: DType::Bool, len: n });
        let k = Kernel { args, inputs: 1, body: Body::Map(vec![l]) };
        let native = NativeKernel::build(&k).unwrap();
        let run = |compiled: bool| {
            let (mut buf, mut other, mut flags) = (init.clone(), vec![f32::NAN; n], vec![7u8; n]);
            let p = ArgPtr { ptr: buf.as_mut_ptr() as *mut u8, len: n, dtype: DType::F32 };
            let o = ArgPtr { ptr: other.as_mut_ptr() as *mut u8, len: n, dtype: DType::F32 };
            let f = ArgPtr { ptr: flags.as_mut_ptr(), len: n, dtype: DType::Bool };
            // SAFETY: `native` was built from `k`.
            let r = if compiled { unsafe { native.run(&k, &[p, p, o, f]) } } else { run_kernel(&k, &[p, p, o, f]) };
            r.unwrap();
            (buf, other, flags)
        };
        let (want, got) = (run(false), run(true));
        assert!(want.0[..3] == init[..3] && want.0[3..] != init[3..], "the interpreter updated the buffer in place");
        assert!(want.1[3..].iter().all(|v| !v.is_nan()) && want.2[3..].iter().all(|&f| f < 2));
        for (what, w, g) in [("in place", &want.0, &got.0), ("beside", &want.1, &got.1)] {
            let diff = w.iter().zip(g).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(diff, None, "first differing element of the output {what} (compute-bound: {heavy})");
        }
        assert!(want.2 == got.2, "the bool output (compute-bound: {heavy})");
    }
}

/// `exp` and `tanh` where their steps change course: around `exp`'s range limits (inputs
/// beyond them are not clamped, the result is replaced at the end), at the subnormal results,
/// at tanh's switch between its two formulas, and far out (huge magnitudes, infinities, NaN):
/// compiled and interpreted give the same bits, and the limits give 0 and infinity.
#[test]
fn exp_and_tanh_match_at_their_edges() {
    if skip() {
        return;
    }
    use braid_graph::expr::ExprBuilder;
    use braid_lowering::{Arg, Load, MapLoop, Store, View, vmath};
    let mut xs = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN, 1e30, -1e30, 0.0, -0.0];
    // Every float within 2,000 steps of each limit, both signs.
    let around = [vmath::EXP_RANGE[0], vmath::EXP_RANGE[1], -87.34, 88.72, vmath::TANH_SMALL, 44.4, 9.0];
    for &c in &around {
        for v in [c, -c] {
            let b = v.to_bits() as i64;
            xs.extend((b - 2000..=b + 2000).map(|u| f32::from_bits(u as u32)));
        }
    }
    let mut rng = Rng::new(11);
    xs.extend((0..20_000).map(|_| rng.uniform(-1.0, 1.0) as f32 * 10f32.powi(rng.below(40) as i32 - 10)));
    let n = xs.len();
    let view = View { dims: [n].as_slice().into(), strides: [1].as_slice().into(), offset: 0 };
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let (e, t) = (b.exp(x), b.tanh(x));
    let store = |arg, value| Store { arg, dtype: DType::F32, view: view.clone(), value };
    let l = MapLoop {
        dims: view.dims.clone(),
        loads: vec![Load { arg: 0, dtype: DType::F32, view: view.clone() }],
        expr: b.finish(),
        stores: vec![store(1, e), store(2, t)],
    };
    let k = Kernel { args: vec![Arg { dtype: DType::F32, len: n }; 3], inputs: 1, body: Body::Map(vec![l]) };
    let native = NativeKernel::build(&k).unwrap();
    let run = |compiled: bool| {
        let (mut x, mut e, mut t) = (xs.clone(), vec![0f32; n], vec![0f32; n]);
        let ptr = |v: &mut Vec<f32>| ArgPtr { ptr: v.as_mut_ptr() as *mut u8, len: n, dtype: DType::F32 };
        let args = [ptr(&mut x), ptr(&mut e), ptr(&mut t)];
        // SAFETY: `native` was built from `k`.
        let r = if compiled { unsafe { native.run(&k, &args) } } else { run_kernel(&k, &args) };
        r.unwrap();
        (e, t)
    };
    let ((want_e, want_t), (got_e, got_t)) = (run(false), run(true));
    for (name, want, got) in [("exp", &want_e, &got_e), ("tanh", &want_t, &got_t)] {
        let diff = (0..n).find(|&i| want[i].to_bits() != got[i].to_bits() && !(want[i].is_nan() && got[i].is_nan()));
        assert_eq!(diff.map(|i| (xs[i], want[i], got[i])), None, "{name}: input, interpreted, compiled");
    }
    // tanh is odd down to the sign of zero.
    assert_eq!((want_t[7].to_bits(), want_t[8].to_bits()), (0.0f32.to_bits(), (-0.0f32).to_bits()));
    for (i, &x) in xs.iter().enumerate() {
        let e = want_e[i];
        match x {
            x if x.is_nan() => assert!(e.is_nan() && want_t[i].is_nan()),
            x if x > vmath::EXP_RANGE[1] => assert_eq!(e, f32::INFINITY, "exp({x})"),
            x if x < vmath::EXP_RANGE[0] => assert_eq!(e, 0.0, "exp({x})"),
            x if ((x as f64).exp() as f32).is_infinite() => assert_eq!(e, f32::INFINITY, "exp({x})"),
            x => assert!((e as f64 - (x as f64).exp()).abs() <= (x as f64).exp() * 2e-7 + 1.5e-45, "exp({x}) = {e}"),
        }
    }
}

/// A softmax whose output is past the streaming size (written with non-temporal stores from a
/// block) and one below it (stored as computed): compiled, both give the interpreter's bits.
#[test]
fn row_kernels_streamed_and_stored_directly_give_the_interpreters_bits() {
    if skip() {
        return;
    }
    let cols = 1024;
    let big = braid_devices::cpu::map::stream_bytes() / (4 * cols) + 3;
    for rows in [big, 517] {
        let run = |mode: CompileMode| {
            let dev = Device::new_cpu();
            dev.set_compile_mode(mode);
            dev.seed(5);
            let x = Tensor::randn([rows, cols], DType::F32, &dev) * 4.0;
            let y = x.softmax(1).to_vec::<f32>().unwrap();
            (y, dev.compiled_kernels_launched())
        };
        let ((want, none), (got, launched)) = (run(CompileMode::Off), run(CompileMode::Blocking));
        assert_eq!(none, 0);
        assert!(launched >= 1, "{rows} rows: the softmax ran compiled");
        let diff = want.iter().zip(&got).position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(diff, None, "{rows} rows: first differing element");
    }
}

/// `gelu(x * w + b) * sigmoid(x)` with `b` broadcast along rows, and a tanh: C1's chain on a
/// 2-D shape.
fn chain(dev: &Device, seed: u64) -> Vec<f32> {
    dev.seed(seed);
    let x = Tensor::randn([384, 512], DType::F32, dev);
    let w = Tensor::randn([384, 512], DType::F32, dev);
    let b = Tensor::randn([512], DType::F32, dev);
    let y = (&x * &w + &b).gelu() * x.sigmoid() + x.tanh();
    y.to_vec::<f32>().unwrap()
}

#[test]
fn a_device_gives_the_same_bits_compiled_and_interpreted() {
    if skip() {
        return;
    }
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Off);
    let interpreted = chain(&dev, 7);
    assert_eq!(dev.compiled_kernels_launched(), 0);
    dev.set_compile_mode(CompileMode::Blocking);
    let compiled = chain(&dev, 7);
    assert_eq!(dev.compiled_kernels_launched(), 1, "the fused chain ran compiled");
    assert!(interpreted.iter().zip(&compiled).all(|(a, b)| a.to_bits() == b.to_bits()));

    // In the background: interpreted until the library is ready, compiled after, and the same
    // bits throughout.
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Background);
    let waited = std::time::Instant::now();
    while dev.compiled_kernels_launched() == 0 {
        let y = chain(&dev, 7);
        assert!(interpreted.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(waited.elapsed().as_secs() < 120, "the background compile never finished");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Small kernels run a few times are interpreted (compiling them would cost more than it
    // saves).
    let before = dev.compiled_kernels_launched();
    let s = (Tensor::randn([1000], DType::F32, &dev).exp() * 2.0).to_vec::<f32>().unwrap();
    assert_eq!(s.len(), 1000);
    assert_eq!(dev.compiled_kernels_launched(), before);
}

#[test]
fn a_small_kernel_run_many_times_is_compiled_from_its_sixty_fourth_run() {
    if skip() {
        return;
    }
    // A replayed step over scalars (C4's shape of work): one small kernel, interpreted for its
    // first SMALL_RUNS - 1 runs, compiled from the SMALL_RUNS-th (Blocking: compiled then and
    // there); its values within 1e-5 of Rust's throughout.
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Blocking);
    let step = braid::Step::new(|x: &[Tensor]| vec![((&x[0] * 3.0 + 1.0).tanh() * &x[1]).exp()]);
    let mut rng = Rng::new(64);
    for run in 1..=SMALL_RUNS + 2 {
        let (a, b) = (rng.uniform(-2.0, 2.0) as f32, rng.uniform(-2.0, 2.0) as f32);
        let args = [Tensor::from_vec(vec![a], (), &dev), Tensor::from_vec(vec![b], (), &dev)];
        let y = step.call(&args).unwrap()[0].item::<f32>().unwrap();
        let want = ((a * 3.0 + 1.0).tanh() * b).exp();
        // The capture's run and the replays share the kernel: runs 1 to SMALL_RUNS - 1
        // interpreted, then compiled.
        assert_eq!(dev.compiled_kernels_launched(), run.saturating_sub(SMALL_RUNS - 1), "run {run}");
        assert!((y - want).abs() <= 1e-5 * want.abs().max(1.0), "run {run}: {y} vs {want}");
    }
}

#[test]
fn a_kernel_of_more_than_max_nodes_stays_interpreted() {
    if skip() {
        return;
    }
    // Compiling thousands of nodes takes the compiler seconds and gives a loop too large to
    // vectorise: such kernels are interpreted (the same values either way).
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Blocking);
    let x = Tensor::randn([1 << 17], DType::F32, &dev);
    x.to_vec::<f32>().unwrap();
    let before = dev.compiled_kernels_launched();
    let chain = |ops: usize| {
        let mut y = x.clone();
        for i in 0..ops {
            y = if i % 2 == 0 { y.tanh() } else { &y * 1.01 };
        }
        y.to_vec::<f32>().unwrap().iter().sum::<f32>()
    };
    chain(8);
    assert_eq!(dev.compiled_kernels_launched(), before + 1, "a short chain runs compiled");
    let long = chain(braid_devices::cpu::native::MAX_NODES);
    assert_eq!(
        dev.compiled_kernels_launched(),
        before + 1,
        "a chain of {} nodes runs interpreted",
        braid_devices::cpu::native::MAX_NODES
    );
    assert!(long.is_finite());
}

/// Matrix products with elementwise epilogues: a layer's `relu(x w + b)` and its mask (the
/// product overwritten in place, a bool output beside it), a product kept as an output beside
/// its epilogue's result, and a transposed operand; every product of 65,536 elements (large
/// enough to be compiled from its first run).
fn products(dev: &Device, seed: u64) -> Vec<Vec<u8>> {
    dev.seed(seed);
    let x = Tensor::randn([256, 160], DType::F32, dev);
    let w = Tensor::randn([160, 256], DType::F32, dev);
    let b = Tensor::randn([256], DType::F32, dev);
    let h = &x.matmul(&w) + &b;
    let kept = x.matmul(&w);
    let scaled = (&kept * 0.5).tanh();
    let transposed = (x.matmul(&x.t()) - 1.0).exp();
    let bytes = |t: &Tensor| t.to_vec::<f32>().unwrap().iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    let mask = h.gt(&Tensor::zeros([], DType::F32, dev)).to_vec::<bool>().unwrap();
    vec![bytes(&h.relu()), mask.iter().map(|&m| m as u8).collect(), bytes(&kept), bytes(&scaled), bytes(&transposed)]
}

#[test]
fn matrix_product_epilogues_run_compiled_with_the_interpreters_bits() {
    if skip() {
        return;
    }
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Off);
    let interpreted = products(&dev, 11);
    dev.set_compile_mode(CompileMode::Blocking);
    let compiled = products(&dev, 11);
    assert!(dev.compiled_kernels_launched() >= 3, "{} kernels ran compiled", dev.compiled_kernels_launched());
    for (i, (a, b)) in interpreted.iter().zip(&compiled).enumerate() {
        assert!(a == b, "output {i} differs between the interpreted and the compiled epilogue");
    }
}

/// Conversions to and from f16 and bf16, compiled against the interpreter on every value where
/// rounding can go wrong: for each of the 65,536 values of each half type, its f32 and f64, the
/// ties half way to the next value, and the numbers just either side of them (in f64 closer to
/// the tie than f32 can hold, where rounding twice would go wrong); NaNs with payloads,
/// infinities, the largest finite values and the subnormal range come with them. And every f16
/// and bf16 bit pattern widened to f32.
#[test]
fn half_conversions_match_the_interpreter_on_every_boundary() {
    if skip() {
        return;
    }
    use braid_graph::expr::ExprBuilder;
    use braid_lowering::{Arg, Load, MapLoop, Store, View};
    use half::{bf16, f16};
    let mut wide: Vec<f64> = vec![];
    for bits in 0..=u16::MAX {
        for (v, next) in [
            (f16::from_bits(bits).to_f64(), f16::from_bits(bits.wrapping_add(1)).to_f64()),
            (bf16::from_bits(bits).to_f64(), bf16::from_bits(bits.wrapping_add(1)).to_f64()),
        ] {
            wide.push(v);
            if v.is_finite() && next.is_finite() {
                let tie = (v + next) / 2.0;
                wide.extend([tie, tie + tie.abs() * 1e-12, tie - tie.abs() * 1e-12]);
                let t = tie as f32;
                wide.extend([f32::from_bits(t.to_bits() + 1), f32::from_bits(t.to_bits().max(1) - 1)].map(f64::from));
            }
        }
    }
    wide.extend([f64::NAN, -f64::NAN, f64::from_bits(0x7ff0_0000_0000_0001), f64::MAX, f64::MIN_POSITIVE, 1e300]);
    let n = wide.len();
    let view = View { dims: [n].as_slice().into(), strides: [1].as_slice().into(), offset: 0 };
    let (mut b, mut stores) = (ExprBuilder::new(), vec![]);
    let (from_f32, from_f64) = (b.load(0, DType::F32), b.load(1, DType::F64));
    let (from_f16, from_bf16) = (b.load(2, DType::F16), b.load(3, DType::BF16));
    let mut args = vec![DType::F32, DType::F64, DType::F16, DType::BF16];
    let mut store = |dtype: DType, value| {
        stores.push(Store { arg: args.len() as u16, dtype, view: view.clone(), value });
        args.push(dtype);
    };
    // Stored as a half type straight from f32 (as lowering stores a value it rounded), and
    // rounded from f64 by a cast.
    for to in [DType::F16, DType::BF16] {
        store(to, from_f32);
        let rounded = b.cast(to, from_f64);
        store(to, rounded);
    }
    // Widened (as loads), and rounded from f32 by a cast and widened again.
    store(DType::F32, from_f16);
    store(DType::F32, from_bf16);
    for to in [DType::F16, DType::BF16] {
        let rounded = b.cast(to, from_f32);
        store(DType::F32, rounded);
    }
    let loads = [DType::F32, DType::F64, DType::F16, DType::BF16].into_iter().enumerate();
    let l = MapLoop {
        dims: view.dims.clone(),
        loads: loads.map(|(a, dtype)| Load { arg: a as u16, dtype, view: view.clone() }).collect(),
        expr: b.finish(),
        stores,
    };
    let k =
        Kernel { args: args.iter().map(|&dtype| Arg { dtype, len: n }).collect(), inputs: 4, body: Body::Map(vec![l]) };
    let bits: Vec<f64> = (0..n).map(|i| i as u16 as f64).collect();
    let mut init = vec![encode(DType::F32, &wide), encode(DType::F64, &wide)];
    // Every bit pattern of the half types (encoded through their bits: NaNs keep their payloads).
    let every: Vec<u8> = (0..n).flat_map(|i| (i as u16).to_le_bytes()).collect();
    init.extend([every.clone(), every]);
    init.extend(args[4..].iter().map(|d| encode(*d, &bits)));
    let want = run_on_copies(&k, &init, |a| run_kernel(&k, a)).unwrap();
    // Compiled for the CPU's vector level (F16C's conversions where it has them), and for the
    // baseline (the printed conversions alone).
    use braid_devices::cpu::eval::Simd;
    for level in [Simd::Avx512, Simd::Baseline] {
        let native = NativeKernel::build_at(&k, level).unwrap();
        // SAFETY: `native` was built from `k`.
        let got = run_on_copies(&k, &init, |a| unsafe { native.run(&k, a) }).unwrap();
        let case = Case {
            label: format!("half conversions, compiled at {level:?}"),
            kernel: k.clone(),
            init: init.clone(),
            from_cpu: vec![],
        };
        assert_eq!(first_difference(&case, &want, &got), None);
    }
}
