//! Long rows and whole-tensor reductions, which the CPU splits across threads: every reduction
//! op, with work fused before and after, equals the f64 reference; the result is the same bits
//! at 1 and at N threads; long float sums stay accurate (compensated).

mod common;

use braid::prelude::*;
use common::check_recorded;

fn data(dev: &Device, n: usize, seed: u64) -> Tensor {
    dev.seed(seed);
    Tensor::randn([n], DType::F32, dev)
}

/// The values of `f()` computed in a rayon pool of `threads` threads.
fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

#[test]
fn whole_tensor_and_long_row_reductions_match_the_reference() {
    let dev = braid::testing::test_device();
    let x = data(&dev, 300_001, 1);
    let rows = x.narrow(0, 0, 300_000).reshape([3, 100_000]);
    let mut outs = vec![
        x.sum(),
        (x.tanh() * 2.0).mean(),
        x.max(),
        x.exp().min(),
        rows.softmax(1),
        rows.sum_dim(1, false),
        (rows.exp() - 1.0).max_dim(1, false),
    ];
    // Indices are i64, which wgpu cannot hold (refused at the call).
    if dev.target().dtypes.contains(DType::I64) {
        outs.extend([x.argmax_dim(0, false), rows.argmax_dim(-1, true)]);
    }
    let refs: Vec<&Tensor> = outs.iter().collect();
    let stats = check_recorded(&refs).unwrap();
    assert!(stats.checked > 300_000, "{stats:?}");
}

#[test]
fn split_reductions_give_the_same_bits_at_any_thread_count() {
    let run = || {
        let dev = Device::new_cpu();
        let x = data(&dev, 1 << 20, 2);
        let i = (x.clone() * 1000.0).to_dtype(DType::I64);
        let rows = x.reshape([4, 1 << 18]);
        (
            (x.exp() + &x).sum().to_vec::<f32>().unwrap(),
            x.mean().to_vec::<f32>().unwrap(),
            x.max().to_vec::<f32>().unwrap(),
            x.argmax_dim(0, false).to_vec::<i64>().unwrap(),
            i.sum().to_vec::<i64>().unwrap(),
            rows.softmax(-1).to_vec::<f32>().unwrap(),
            rows.log_softmax(1).sum_dim(1, false).to_vec::<f32>().unwrap(),
        )
    };
    let one = with_threads(1, run);
    let many = with_threads(4, run);
    assert!(one == many, "results differ between 1 and 4 threads");
}

#[test]
fn long_float_sums_are_compensated() {
    let dev = Device::new_cpu();
    // 2^22 copies of a value whose running f32 sum would drift by about one rounding per chunk.
    let v = -2.394_531_2_f32;
    let x = Tensor::full([1 << 22], v as f64, DType::F32, &dev);
    let mean = x.mean().item::<f32>().unwrap();
    assert!((mean - v).abs() <= 2.0 * f32::EPSILON * v.abs(), "mean {mean} vs {v}");
    let sum = x.sum().item::<f32>().unwrap() as f64;
    let want = v as f64 * (1 << 22) as f64;
    assert!((sum - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs(), "sum {sum} vs {want}");
}

/// `n` pseudo-random floats in [-4, 4) with `special` values placed at given positions.
fn host_data(n: usize, seed: u64, special: &[(usize, f32)]) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect();
    for &(i, x) in special {
        v[i] = x;
    }
    v
}

/// Sizes that split (more than two tasks of row positions) and end inside a segment.
const LONG: usize = (1 << 20) + 12_345;

#[test]
fn every_split_reduction_op_matches_the_reference() {
    let dev = braid::testing::test_device();
    let x = Tensor::from_vec(host_data(LONG, 3, &[]), [LONG], &dev);
    // Few long rows along the last axis, and along a non-last axis with narrow rows (inner
    // positions 2..63 are not re-tiled, so they split too).
    let rows = x.narrow(0, 0, 1 << 20).reshape([2, 1 << 19]);
    let cols = x.narrow(0, 0, 1 << 20).reshape([1 << 18, 4]);
    let mut outs = vec![
        // Elementwise work before and after each reduction.
        (x.tanh().exp() + 1.0).sum() * 0.5,
        (x.square() - 1.0).mean().sqrt(),
        (x.sin() * 3.0).max() + 1.0,
        (x.cos() - &x).min().neg(),
        rows.exp().sum_dim(1, true) + 2.0,
        (rows.sigmoid() * 2.0).mean_dim(-1, false),
        rows.min_dim(1, false),
        rows.softmax(-1),
        rows.layer_norm(1, 1e-5),
        cols.sum_dim(0, false),
        (cols.abs() + 1.0).mean_dim(0, true).log(),
        cols.max_dim(0, false),
        cols.min_dim(0, false) * 2.0,
        cols.softmax(0),
    ];
    if dev.target().dtypes.contains(DType::I64) {
        outs.extend([
            x.argmax_dim(0, false),
            (x.exp() * -1.0).argmax_dim(0, true),
            rows.argmax_dim(1, false),
            cols.argmax_dim(0, false),
            x.argmin_dim(0, false),
            (&x * 100.0).to_dtype(DType::I64).sum(),
            (&x * 100.0).to_dtype(DType::I64).max(),
            (&x * 100.0).to_dtype(DType::I64).argmax_dim(0, false),
        ]);
    }
    if dev.target().dtypes.contains(DType::F64) {
        let w = x.to_dtype(DType::F64);
        outs.extend([w.exp().sum(), w.mean(), w.max(), w.reshape([1, LONG]).softmax(1)]);
    }
    outs.extend([(&x * 100.0).to_dtype(DType::I32).sum(), (&x * 100.0).to_dtype(DType::I32).min()]);
    let refs: Vec<&Tensor> = outs.iter().collect();
    let stats = check_recorded(&refs).unwrap();
    assert!(stats.checked > 2_000_000, "{stats:?}");
}

#[test]
fn split_extremes_keep_nan_and_the_first_index() {
    let dev = braid::testing::test_device();
    if common::skip_without_i64(&dev, "split_extremes_keep_nan_and_the_first_index") {
        return;
    }
    let n = LONG;
    // Ties of the largest value in three segments: the first index wins.
    let ties = Tensor::from_vec(host_data(n, 4, &[(70_000, 9.0), (5_000, 9.0), (900_000, 9.0)]), [n], &dev);
    assert_eq!(ties.argmax_dim(0, false).item::<i64>().unwrap(), 5_000);
    assert_eq!(ties.max().item::<f32>().unwrap(), 9.0);
    // The same through an epilogue and a prologue: -x has the ties as its minimum.
    assert_eq!((-&ties).argmin_dim(0, false).item::<i64>().unwrap(), 5_000);
    // NaN is the extreme wherever it is, and the first NaN is the argmax.
    let nan = Tensor::from_vec(
        host_data(n, 5, &[(800_000, f32::NAN), (300_000, f32::NAN), (10, 50.0), (n - 1, 60.0)]),
        [n],
        &dev,
    );
    assert!(nan.max().item::<f32>().unwrap().is_nan());
    assert!(nan.min().item::<f32>().unwrap().is_nan());
    assert!(nan.sum().item::<f32>().unwrap().is_nan());
    assert_eq!(nan.argmax_dim(0, false).item::<i64>().unwrap(), 300_000);
    // Without NaN, the largest value late in the row.
    let late = Tensor::from_vec(host_data(n, 6, &[(n - 1, 60.0)]), [n], &dev);
    assert_eq!(late.argmax_dim(0, false).item::<i64>().unwrap(), (n - 1) as i64);
    // Infinities do not poison compensated sums into NaN.
    let inf = Tensor::from_vec(host_data(n, 7, &[(123_456, f32::INFINITY)]), [n], &dev);
    assert_eq!(inf.sum().item::<f32>().unwrap(), f32::INFINITY);
    assert_eq!(inf.mean().item::<f32>().unwrap(), f32::INFINITY);
}

#[test]
fn every_split_reduction_op_gives_the_same_bits_at_any_thread_count() {
    // With one stream the CPU device runs a flush on the reading thread, so a read inside
    // `install` runs its kernels' rayon tasks in that pool.
    let run = |threads: usize| {
        with_threads(threads, move || {
            assert_eq!(rayon::current_num_threads(), threads);
            let dev = Device::new_cpu();
            let v = host_data(LONG, 8, &[(400_000, 9.0), (200_000, 9.0)]);
            let x = Tensor::from_vec(v, [LONG], &dev);
            let nan = Tensor::from_vec(host_data(LONG, 9, &[(600_000, f32::NAN), (700_000, f32::NAN)]), [LONG], &dev);
            let rows = x.narrow(0, 0, 1 << 20).reshape([2, 1 << 19]);
            let cols = x.narrow(0, 0, 1 << 20).reshape([1 << 18, 4]);
            let w = x.to_dtype(DType::F64);
            // Long enough for segments above the shortest.
            dev.seed(10);
            let big = Tensor::randn([(1 << 23) + 777], DType::F32, &dev);
            let f32s = [
                (big.tanh().exp() + 1.0).sum(),
                big.mean(),
                big.min(),
                (x.tanh().exp() + 1.0).sum(),
                x.sum(),
                (&x * 3.0).mean(),
                x.max(),
                x.min(),
                nan.max(),
                rows.sum_dim(1, false),
                rows.mean_dim(1, false),
                rows.max_dim(1, false),
                rows.softmax(-1),
                rows.layer_norm(1, 1e-5),
                cols.sum_dim(0, false),
                cols.softmax(0),
            ]
            .map(|t| t.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>());
            let i64s = [
                big.argmax_dim(0, false),
                x.argmax_dim(0, false),
                nan.argmax_dim(0, false),
                x.argmin_dim(0, false),
                rows.argmax_dim(1, false),
                cols.argmax_dim(0, false),
                (&x * 1000.0).to_dtype(DType::I64).sum(),
            ]
            .map(|t| t.to_vec::<i64>().unwrap());
            let f64s = [w.sum(), w.exp().mean()].map(|t| t.to_vec::<f64>().unwrap()[0].to_bits());
            let i32s = (&x * 1000.0).to_dtype(DType::I32).sum().to_vec::<i32>().unwrap();
            (f32s, i64s, f64s, i32s)
        })
    };
    let one = run(1);
    for threads in [2, 3, 8] {
        assert!(one == run(threads), "results differ between 1 and {threads} threads");
    }
}

#[test]
fn long_rows_with_several_passes_match_the_reference() {
    // Rows longer than one chunk and short enough that the CPU keeps per-element values from
    // pass to pass instead of recomputing them: on one thread per row (20 rows) and per few
    // rows (3 rows, too short to split).
    let dev = braid::testing::test_device();
    let mut outs = Vec::new();
    for (rows, len, seed) in [(20usize, 5000usize, 11u64), (3, 30_000, 12)] {
        let x = Tensor::from_vec(host_data(rows * len, seed, &[]), [rows, len], &dev);
        dev.seed(seed);
        let noise = Tensor::randn([rows, len], DType::F32, &dev);
        let e = (&x - x.max_dim(1, true)).exp();
        outs.extend([
            x.softmax(-1),
            x.log_softmax(1),
            x.layer_norm(1, 1e-5),
            &e / e.sum_dim(1, true) + x.tanh().mean_dim(1, true),
            (&x + &noise).softmax(1) * x.sigmoid(),
            (x.sin() * 2.0).sum_dim(1, true) + x.sin().max_dim(1, true) - x.sin(),
        ]);
    }
    let refs: Vec<&Tensor> = outs.iter().collect();
    let stats = check_recorded(&refs).unwrap();
    assert!(stats.checked > 500_000, "{stats:?}");
}
