//! CPU kernels are compiled for several vector levels (baseline x86-64, AVX2, AVX-512) and run
//! at the best one the CPU has. Every level must compute the same bits, and those must match the
//! reference interpreter. The workloads reach the paths that only large or oddly sized data
//! takes: outputs written with streaming stores (4 MiB and more) at unaligned row starts, and
//! reductions folded in many lanes, with NaN, over rows shorter and longer than the lanes.
//!
//! This file holds one test on purpose: the level is a process-wide setting.

mod common;

use braid::prelude::*;
use braid_devices::cpu::eval::{Simd as CpuSimd, limit_simd as limit_cpu_simd};
use common::{Rng, check_recorded, random_values, tensor_from_f64};

/// Each workload's outputs, as bits.
type Outputs = Vec<Vec<u32>>;

fn run_workloads(dev: &Device) -> Outputs {
    let mut rng = Rng::new(11);
    let mut outputs = Vec::new();
    let mut keep = |t: &Tensor| {
        check_recorded(&[t]).unwrap_or_else(|e| panic!("against the reference: {e}"));
        outputs.push(t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect());
    };

    // The C1 chain over 1Mi + 37 elements: a 4 MiB output (streaming stores) with a tail.
    let n = (1 << 20) + 37;
    let x = tensor_from_f64(&random_values(&mut rng, DType::F32, n), &[n].into(), DType::F32, dev);
    let w = tensor_from_f64(&random_values(&mut rng, DType::F32, n), &[n].into(), DType::F32, dev);
    keep(&((&x * &w + 1.0).gelu() * x.sigmoid()));
    keep(&(x.tanh() - w.exp() / 8.0));

    // A softmax over rows of 1023: row starts are not 16-byte aligned; the output is 4.3 MiB.
    let (r, c) = (1100, 1023);
    let x = tensor_from_f64(&random_values(&mut rng, DType::F32, r * c), &[r, c].into(), DType::F32, dev);
    keep(&x.softmax(1));

    // Row reductions around the lane widths (16, and 4 x 16), with and without a NaN.
    for len in [1, 7, 15, 16, 17, 63, 64, 65, 200, 1000] {
        let rows = 6;
        let mut v = random_values(&mut rng, DType::F32, rows * len);
        v[rng.below(len)] = f64::NAN; // in the first row only
        let x = tensor_from_f64(&v, &[rows, len].into(), DType::F32, dev);
        keep(&x.max_dim(1, false));
        keep(&x.min_dim(1, false));
        keep(&x.sum_dim(1, false));
        keep(&(x.exp().sum_dim(1, true) * 0.5));
    }
    outputs
}

#[test]
fn every_vector_level_computes_the_same_bits() {
    let dev = Device::new_cpu();
    let best = limit_cpu_simd(CpuSimd::Avx512);
    let levels: Vec<CpuSimd> =
        [CpuSimd::Avx512, CpuSimd::Avx2, CpuSimd::Baseline].into_iter().filter(|&l| l <= best).collect();
    println!("vector levels this CPU runs: {levels:?}");
    let mut first: Option<(CpuSimd, Outputs)> = None;
    for level in levels {
        assert_eq!(limit_cpu_simd(level), level);
        let outputs = run_workloads(&dev);
        match &first {
            None => first = Some((level, outputs)),
            Some((l0, o0)) => {
                for (i, (a, b)) in o0.iter().zip(&outputs).enumerate() {
                    let diff = a.iter().zip(b).position(|(x, y)| x != y);
                    assert!(diff.is_none(), "workload {i}: {l0:?} and {level:?} differ at element {diff:?}");
                }
            }
        }
    }
    limit_cpu_simd(CpuSimd::Avx512);
}
