//! Kernels over views whose last dimension is not their contiguous one (transposes and
//! permutes), which the CPU runs in another order of the index space (tiles for elementwise
//! work, the contiguous dimension moved after the axis for reductions): the results equal the
//! f64 reference, and are the same bits at 1 and N threads, interpreted and compiled.

mod common;

use braid::prelude::*;
use common::check_recorded;

fn randn(dev: &Device, shape: &[usize], seed: u64) -> Tensor {
    dev.seed(seed);
    Tensor::randn(shape.to_vec(), DType::F32, dev)
}

/// Elementwise work and reductions over `x.t()` (`x` of `shape`), and over a permuted batch.
fn programs(dev: &Device, shape: [usize; 2], seed: u64) -> Vec<Tensor> {
    let x = randn(dev, &shape, seed);
    let y = randn(dev, &[shape[1], shape[0]], seed + 1);
    let b = randn(dev, &[6, shape[0], 24], seed + 2);
    let mut outs = vec![
        x.t().contiguous(),
        x.t().exp() * 2.0 + &y,
        &y - x.t().tanh(),
        x.t().sum_dim(1, false),
        (x.t() * 3.0).max_dim(-1, true),
        x.t().softmax(-1),
        x.t().log_softmax(1) + &y,
        x.t().mean(),
        b.permute(&[0, 2, 1]).sigmoid(),
        b.permute(&[2, 0, 1]).sum_dim(2, false),
    ];
    if dev.target().dtypes.contains(DType::I64) {
        outs.push(x.t().argmax_dim(1, false));
    }
    outs
}

#[test]
fn transposed_and_permuted_kernels_match_the_reference() {
    let dev = braid::testing::test_device();
    // Shapes whose dimensions divide into tiles (of 64, 32, 16 or 8) and ones that do not.
    for (i, shape) in [[96, 40], [256, 192], [200, 72], [50, 30], [33, 100]].into_iter().enumerate() {
        let outs = programs(&dev, shape, 10 * i as u64);
        let refs: Vec<&Tensor> = outs.iter().collect();
        let stats = check_recorded(&refs).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
        assert!(stats.checked >= 5 * shape[0] * shape[1], "{shape:?}: {stats:?}");
    }
}

/// The values of `f()` computed in a rayon pool of `threads` threads.
fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

#[test]
fn tiled_kernels_give_the_same_bits_at_any_thread_count_interpreted_and_compiled() {
    let compiler = braid_devices::cpu::native::compiler_available();
    if let Err(why) = &compiler {
        eprintln!("skipped the compiled half: {why}");
    }
    let run = |mode: CompileMode| {
        let dev = Device::new_cpu();
        dev.set_compile_mode(mode);
        let outs = programs(&dev, [512, 384], 3);
        let bits: Vec<Vec<u32>> = outs
            .iter()
            .map(|t| match t.dtype() {
                DType::I64 => t.to_vec::<i64>().unwrap().into_iter().map(|v| v as u32).collect(),
                _ => t.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits).collect(),
            })
            .collect();
        (bits, dev.compiled_kernels_launched())
    };
    let (one, _) = with_threads(1, || run(CompileMode::Off));
    let (many, _) = with_threads(4, || run(CompileMode::Off));
    assert!(one == many, "interpreted results differ between 1 and 4 threads");
    if compiler.is_ok() {
        let (compiled, launched) = with_threads(4, || run(CompileMode::Blocking));
        assert!(launched > 0, "no kernel ran compiled");
        for (i, (a, b)) in one.iter().zip(&compiled).enumerate() {
            assert!(a == b, "output {i}: compiled bits differ from interpreted ones");
        }
    }
}
