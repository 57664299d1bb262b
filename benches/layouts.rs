//! Transposed views: elementwise work and reductions over `x.t()` for `x` a `[4096, 1024]` f32
//! matrix (a copy, an `exp`, a row sum and a softmax along the transposed rows), each beside
//! the same op over `x` itself (the same bytes, read in order), in one run. braid's figures
//! include recording, the flush and its kernels (`Device::sync`, no read back). The PyTorch
//! peer is `python3 benches/peers/layouts_torch.py` (note that PyTorch's elementwise ops keep
//! a transposed input's strides in their output, so its `x.t().exp()` reads and writes in
//! order; braid's outputs are row-major, so it transposes).
//!
//! On the device `BRAID_DEVICE` names (the CPU when unset).
//!
//! Run: `cargo bench --bench layouts` (criterion's group "transposed views"; add `-- --quick`
//! for a short run).

use braid::prelude::*;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;

type Case = (&'static str, fn(&Tensor) -> Tensor, fn(&Tensor) -> Tensor);

fn layouts(c: &mut Criterion) {
    let dev = Device::from_env().expect("the device BRAID_DEVICE names");
    dev.seed(1);
    let x = Tensor::randn([4096, 1024], DType::F32, &dev);
    dev.sync().unwrap();
    let mut g = c.benchmark_group("transposed views");
    g.throughput(Throughput::Bytes((4096 * 1024 * 4) as u64));
    let cases: [Case; 4] = [
        ("copy", |x| x.t().contiguous(), |x| x * 1.0),
        ("exp", |x| x.t().exp(), |x| x.exp()),
        ("sum_dim(1)", |x| x.t().sum_dim(1, false), |x| x.sum_dim(1, false)),
        ("softmax(-1)", |x| x.t().softmax(-1), |x| x.softmax(-1)),
    ];
    for (name, transposed, plain) in cases {
        for (side, f) in [("x.t()", transposed), ("x", plain)] {
            g.bench_function(BenchmarkId::new(side, name), |b| {
                b.iter(|| {
                    let y = f(&x);
                    dev.sync().unwrap();
                    black_box(y)
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, layouts);
criterion_main!(benches);
