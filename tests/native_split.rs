//! Compiled split row kernels against the interpreter, **bit for bit** (but for NaN payloads):
//! whole-tensor reductions and a few long rows, which the CPU splits across threads
//! (`braid_devices::cpu::split`), printed in their split form (`host_c::print_split`: one
//! segment per call, the segments combined by the interpreter's own combine). Random row
//! kernels of every reduction and dtype with work before and after (softmaxes, layer norms,
//! argmaxes with one-hots and random numbers), rows whose lengths end inside a chunk, compiled
//! and run at 1 and 3 threads beside the interpreter; and through a device, programs whose
//! whole-tensor reductions fuse their elementwise work and random numbers, compiled before
//! their first run against interpreted, at 1, 2, 3 and 8 threads, the compiled runs counted.
//!
//! Skipped, with a message, when there is no C compiler.

// The printer test's generators; this test uses the row-kernel ones.
#[allow(dead_code)]
#[path = "cuda_printer/cases.rs"]
mod cases;
mod common;

use braid::prelude::*;
use braid_devices::cpu::native::NativeKernel;
use braid_devices::cpu::{rows, run_kernel};
use braid_lowering::{Body, Kernel};
use cases::*;
use common::Rng;
use rayon::prelude::*;

fn skip() -> bool {
    no_compiler("native_split")
}

/// `f()` run in a rayon pool of `threads` threads (a kernel's tasks run in the pool it is
/// called from).
fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

#[test]
fn compiled_split_row_kernels_compute_the_interpreters_bits() {
    if skip() {
        return;
    }
    let start = std::time::Instant::now();
    let mut rng = Rng::new(0x5B11_7C0D);
    // Whole tensors and a few long rows, of lengths that end inside a chunk (and one that is
    // exactly the shortest split row); a whole tensor over two dimensions (its views merge,
    // unless transposed: then interpreted); positions after the axis (interpreted).
    let shapes: [(&[usize], Option<usize>); 8] = [
        (&[(1 << 20) + 12_345], None),
        (&[70_001], None),
        (&[65_536], None),
        (&[300, 701], None),
        (&[3, 70_001], Some(1)),
        (&[2, 3, 65_601], Some(2)),
        (&[15, 66_000], Some(1)),
        (&[1 << 16, 3], Some(0)),
    ];
    let mut cases = vec![];
    for (i, (dims, axis)) in shapes.iter().enumerate() {
        for j in 0..7 {
            // NaN and infinities in some (a sum of them is NaN, an argmax finds the first).
            let specials = j % 3 == 0;
            let mut case = rows_case_over(&mut rng, 100 * i + j, dims, *axis, MathLib::Host, specials);
            if j % 2 == 1 {
                keep_prologue(&mut rng, &mut case);
            }
            cases.push(case);
        }
    }
    // Printed and compiled in parallel; the kernels the printer leaves to the interpreter are
    // counted with their reason.
    let built: Vec<Result<NativeKernel, String>> = cases
        .par_iter()
        .map(|case| {
            let Body::Rows(r) = &case.kernel.body else { unreachable!("row cases") };
            let plan = rows::plan(r);
            if !plan.splits() {
                return Err("not split".into());
            }
            let planned = Kernel { body: Body::Rows(plan.kernel(r).clone()), ..case.kernel.clone() };
            NativeKernel::build_split(&planned)
        })
        .collect();
    let (mut compared, mut failures, mut left) = (0, vec![], vec![]);
    for (case, native) in cases.iter().zip(&built) {
        let native = match native {
            Ok(native) => native,
            Err(e) => {
                left.push(e.clone());
                continue;
            }
        };
        let k = &case.kernel;
        let Body::Rows(r) = &k.body else { unreachable!("row cases") };
        let plan = rows::plan(r);
        let want = run_on_copies(k, &case.init, |args| run_kernel(k, args)).unwrap();
        for threads in [1, 3] {
            let got = with_threads(threads, || {
                // SAFETY: `native` is the split form of the planned kernel.
                run_on_copies(k, &case.init, |args| unsafe { native.run_split_rows(plan.kernel(r), &plan, args) })
            });
            if let Some(d) = first_difference(case, &want, &got.unwrap()) {
                failures.push(format!("{threads} threads: {d}"));
            }
        }
        compared += 1;
    }
    left.sort();
    left.dedup();
    eprintln!(
        "native_split: {compared} of {} split row kernels compiled and compared in {:.2?}; the others interpreted: {left:?}",
        cases.len(),
        start.elapsed()
    );
    assert!(failures.is_empty(), "{} split row kernels differ:\n{}", failures.len(), failures.join("\n"));
    assert!(compared >= 40, "only {compared} split row kernels were printed for the host");
    // Rows with positions after the axis stay interpreted, and say so.
    assert!(left.iter().any(|e| e.contains("positions after the axis")), "{left:?}");
}

/// Stores the operand of `case`'s first reduction too, through a random view (a prologue the
/// program keeps: the first pass of a split row writes it as it computes it).
fn keep_prologue(rng: &mut Rng, case: &mut Case) {
    let Body::Rows(r) = &mut case.kernel.body else { unreachable!("row cases") };
    let Some(x) = r.expr.nodes.iter().find_map(|n| match n.op {
        braid_graph::expr::ExprOp::Reduce(_, x) => Some(x),
        _ => None,
    }) else {
        return;
    };
    let (dims, d) = (r.dims.clone(), r.expr.nodes[x as usize].dtype);
    let (view, len) = random_view(rng, &dims, false);
    let arg = case.kernel.args.len();
    let mut body = std::mem::replace(&mut case.kernel.body, Body::Map(vec![]));
    let Body::Rows(r) = &mut body else { unreachable!("row cases") };
    r.stores.push(output(rng, d, view, len, x, arg, case));
    case.kernel.body = body;
    case.label.push_str(" (its prologue stored)");
}

/// Every value of `t`, as the bits of its dtype, with every NaN the same (compiled code may
/// give another NaN payload).
fn bits(t: &Tensor) -> Vec<u64> {
    let float = |v: f64, b: u64| if v.is_nan() { u64::MAX } else { b };
    match t.dtype() {
        DType::F32 => t.to_vec::<f32>().unwrap().into_iter().map(|v| float(v as f64, v.to_bits() as u64)).collect(),
        DType::F64 => t.to_vec::<f64>().unwrap().into_iter().map(|v| float(v, v.to_bits())).collect(),
        DType::F16 | DType::BF16 => t
            .to_dtype(DType::F32)
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(|v| float(v as f64, v.to_bits() as u64))
            .collect(),
        DType::I32 => t.to_vec::<i32>().unwrap().into_iter().map(|v| v as u64).collect(),
        DType::I64 => t.to_vec::<i64>().unwrap().into_iter().map(|v| v as u64).collect(),
        DType::U8 => t.to_vec::<u8>().unwrap().into_iter().map(u64::from).collect(),
        DType::Bool => t.to_vec::<bool>().unwrap().into_iter().map(u64::from).collect(),
    }
}

/// Length of the whole-tensor reductions below: split into segments, the last ending inside a
/// chunk.
const N: usize = (1 << 20) + 4_321;

/// Programs whose whole-tensor reductions (and a few long rows) fuse elementwise work, casts
/// and random numbers generated in the kernel, on a device in `mode`: each value's bits, and
/// how many kernels ran compiled.
fn programs(mode: CompileMode) -> (Vec<Vec<u64>>, u64) {
    let dev = Device::new_cpu();
    dev.set_compile_mode(mode);
    dev.seed(21);
    let x = Tensor::randn([N], DType::F32, &dev) * 2.0;
    x.to_vec::<f32>().unwrap();
    let random = |seed: u64| {
        dev.seed(seed);
        Tensor::rand([N], -1.0, 1.0, DType::F32, &dev)
    };
    // Values the program keeps beside a whole-tensor reduction of them (a prologue, random
    // numbers): the reduction's kernel stores them too.
    let kept = (&x * 0.5).tanh();
    let noise = random(6) * 3.0;
    let outs = [
        (kept.exp() + 1.0).mean(),
        kept,
        noise.sum(),
        noise,
        x.sum(),
        ((&x - x.mean()).square()).mean(),
        ((&x * 0.5).tanh().exp() + 1.0).mean(),
        x.square().mean(),
        x.abs().max(),
        (x.sin() * 3.0).min(),
        x.reshape([1, N]).softmax(1),
        x.narrow(0, 0, 3 * 70_001).reshape([3, 70_001]).log_softmax(-1),
        x.narrow(0, 0, 2 * 70_001).reshape([2, 70_001]).layer_norm(1, 1e-5),
        (&x * random(3)).sum(),
        random(4).max(),
        {
            dev.seed(5);
            Tensor::randn([N], DType::F32, &dev).mean()
        },
        x.argmax_dim(0, false),
        (x.exp() * -1.0).argmin_dim(0, true),
        x.to_dtype(DType::F64).exp().sum(),
        (x.to_dtype(DType::F64) - 1.0).max(),
        x.to_dtype(DType::F16).sum(),
        (x.to_dtype(DType::BF16) * 3.0).mean(),
        (&x * 1000.0).to_dtype(DType::I32).sum(),
        (&x * 1000.0).to_dtype(DType::I64).max(),
        (x.abs() * 40.0).to_dtype(DType::U8).sum(),
    ];
    let values = outs.iter().map(bits).collect();
    (values, dev.compiled_kernels_launched())
}

#[test]
fn split_reductions_through_a_device_give_the_interpreters_bits_at_any_thread_count() {
    if skip() {
        return;
    }
    let (interpreted, none) = with_threads(1, || programs(CompileMode::Off));
    assert_eq!(none, 0);
    for threads in [1, 2, 3, 8] {
        let (compiled, launched) = with_threads(threads, || programs(CompileMode::Blocking));
        for (i, (a, b)) in interpreted.iter().zip(&compiled).enumerate() {
            let diff = a.iter().zip(b).position(|(a, b)| a != b);
            assert_eq!(diff, None, "output {i} at {threads} threads: first differing element");
        }
        // Every output's kernel is large enough to compile from its first run (the kept values
        // come with their reductions' kernels).
        let kernels = interpreted.len() as u64 - 2;
        assert!(launched >= kernels, "{launched} kernels ran compiled at {threads} threads");
    }
}

#[test]
fn a_whole_tensor_reduction_runs_compiled() {
    if skip() {
        return;
    }
    // Before a kernel's first run (Blocking), the mean and the variance are one compiled
    // kernel each.
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Blocking);
    let x = Tensor::randn([N], DType::F32, &dev);
    x.to_vec::<f32>().unwrap();
    let before = dev.compiled_kernels_launched();
    let mean = ((&x * 0.5).tanh().exp() + 1.0).mean().item::<f32>().unwrap();
    assert_eq!(dev.compiled_kernels_launched(), before + 1, "the fused mean ran compiled");
    let var = ((&x - x.mean()).square()).mean().item::<f32>().unwrap();
    assert_eq!(dev.compiled_kernels_launched(), before + 2, "the fused variance ran compiled");
    assert!(mean > 1.0 && mean < 3.0 && (var - 1.0).abs() < 0.01, "mean {mean}, variance {var}");
    // Random numbers the program keeps beside their mean: one compiled kernel writes them as it
    // folds them (not a second pass generating them again), with the values of a kernel of
    // their own.
    dev.seed(4);
    let noise = Tensor::randn([N], DType::F32, &dev);
    let noise_mean = noise.mean();
    let m = noise_mean.item::<f32>().unwrap();
    assert_eq!(dev.last_schedule().unwrap().kernel_count(), 1, "one kernel for the numbers and their mean");
    assert_eq!(dev.compiled_kernels_launched(), before + 3, "it ran compiled");
    let values = noise.to_vec::<f32>().unwrap();
    dev.seed(4);
    let again = Tensor::randn([N], DType::F32, &dev).to_vec::<f32>().unwrap();
    assert!(values == again, "the stored random numbers are those of the same draw alone");
    let want = values.iter().map(|&v| v as f64).sum::<f64>() / N as f64;
    assert!((m as f64 - want).abs() < 1e-6, "mean {m} vs {want}");
    // In the background: interpreted until the library is ready (compiled from its second
    // run, or found in the disk cache an earlier run of this test left), with the same bits
    // throughout.
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Background);
    dev.seed(9);
    let x = Tensor::randn([N], DType::F32, &dev);
    x.to_vec::<f32>().unwrap();
    let first = (x.sin() + 1.0).sum().item::<f32>().unwrap();
    let waited = std::time::Instant::now();
    while dev.compiled_kernels_launched() == 0 {
        let again = (x.sin() + 1.0).sum().item::<f32>().unwrap();
        assert_eq!(again.to_bits(), first.to_bits());
        assert!(waited.elapsed().as_secs() < 120, "the background compile never finished");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A split row kernel storing values that need no reduction: `x * 3` (computed from `x`
/// before the sum, so by the first pass as it folds) and `x * 2`, whose constant is recorded
/// after the sum (a per-row value the first pass has not computed yet, so left to the last
/// pass), both past the streaming size (written with non-temporal stores a block at a time).
/// Interpreted, every stored value is exact; compiled, the same bits.
#[test]
fn values_kept_beside_a_split_sum_are_stored_by_the_pass_that_can_compute_them() {
    use braid_devices::cpu::map::ArgPtr;
    use braid_graph::expr::ExprBuilder;
    use braid_lowering::{Arg, Load, RowKernel, Store, View};
    let n = braid_devices::cpu::map::stream_bytes() / 4 + 3;
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let three = b.constant(3.0, DType::F32);
    let thrice = b.mul(x, three);
    let sum = b.reduce(braid_graph::ReduceOp::Sum, thrice);
    let two = b.constant(2.0, DType::F32);
    let twice = b.mul(x, two);
    let view = |stride: isize| View { dims: [n].as_slice().into(), strides: [stride].as_slice().into(), offset: 0 };
    let store = |arg, stride, value| Store { arg, dtype: DType::F32, view: view(stride), value };
    let r = RowKernel {
        dims: [n].as_slice().into(),
        axis: None,
        loads: vec![Load { arg: 0, dtype: DType::F32, view: view(1) }],
        expr: b.finish(),
        stores: vec![store(1, 0, sum), store(2, 1, thrice), store(3, 1, twice)],
    };
    let lens = [n, 1, n, n];
    let k = Kernel {
        args: lens.iter().map(|&len| Arg { dtype: DType::F32, len }).collect(),
        inputs: 1,
        body: Body::Rows(r),
    };
    let Body::Rows(r) = &k.body else { unreachable!() };
    let plan = rows::plan(r);
    assert!(plan.splits());
    let mut rng = Rng::new(17);
    let xs: Vec<f32> = (0..n).map(|_| rng.uniform(-4.0, 4.0) as f32).collect();
    let init: Vec<Vec<u8>> = lens.iter().map(|&len| vec![0xFF; 4 * len]).collect();
    let init = [vec![xs.iter().flat_map(|v| v.to_le_bytes()).collect()], init[1..].to_vec()].concat();
    let floats = |b: &[u8]| b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    let want = run_on_copies(&k, &init, |args: &[ArgPtr]| run_kernel(&k, args)).unwrap();
    assert!(floats(&want[2]).iter().zip(&xs).all(|(y, x)| *y == x * 3.0), "x * 3, interpreted");
    assert!(floats(&want[3]).iter().zip(&xs).all(|(y, x)| *y == x * 2.0), "x * 2, interpreted");
    if skip() {
        return;
    }
    let native = NativeKernel::build_split(&k).unwrap();
    // SAFETY: `native` is the split form of `k`, which its plan runs as it is.
    let got = run_on_copies(&k, &init, |args| unsafe { native.run_split_rows(r, &plan, args) }).unwrap();
    let case = Case { label: "kept values".into(), kernel: k.clone(), init, from_cpu: vec![] };
    assert_eq!(first_difference(&case, &want, &got), None);
}
