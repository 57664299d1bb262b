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
