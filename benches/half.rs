//! Half precision on the device: elementwise work, casts and reductions over `[4096, 1024]`
//! f16 and bf16 tensors (an add, an `exp`, casts to and from f32, a row sum and a softmax) and a
//! `[512, 1024] x [1024, 1024]` matrix product, each beside the same op in f32, in one run. braid's figures include recording, the flush and its
//! kernels (`Device::sync`, no read back), each result held until the sync, as the peer's
//! eager op computes it. The PyTorch peer is
//! `python3 benches/peers/half_torch.py` (the same cases and shapes).
//!
//! On the device `BRAID_DEVICE` names (the CPU when unset).
//!
//! Run: `cargo bench --bench half` (criterion's group "half precision"; add `-- --quick` for a
//! short run).

use braid::prelude::*;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;

/// A case: its name, and the op on `a`, `b` (both of the dtype measured) and `wide` (`a` in f32).
type Case = (&'static str, fn(&Tensor, &Tensor, &Tensor) -> Tensor);

fn half(c: &mut Criterion) {
    let dev = Device::from_env().expect("the device BRAID_DEVICE names");
    dev.seed(1);
    let shape = [4096, 1024];
    let mut g = c.benchmark_group("half precision");
    g.throughput(Throughput::Elements((shape[0] * shape[1]) as u64));
    let cases: [Case; 7] = [
        ("a + b", |a, b, _| a + b),
        ("exp", |a, _, _| a.exp()),
        ("cast to f32", |a, _, _| a.to_dtype(DType::F32)),
        ("cast from f32", |a, _, wide| wide.to_dtype(a.dtype())),
        ("sum_dim(1)", |a, _, _| a.sum_dim(1, false)),
        ("softmax(-1)", |a, _, _| a.softmax(-1)),
        // [512, 1024] x [1024, 1024]: both operands contiguous views of a and b.
        ("matmul", |a, b, _| a.narrow(0, 0, 512).matmul(&b.narrow(0, 0, 1024))),
    ];
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        let a = Tensor::randn(shape, DType::F32, &dev).to_dtype(dtype);
        let b = Tensor::randn(shape, DType::F32, &dev).to_dtype(dtype);
        let wide = a.to_dtype(DType::F32);
        dev.sync().unwrap();
        for (name, f) in cases {
            if dtype == DType::F32 && name.starts_with("cast") {
                continue;
            }
            if name == "matmul" {
                // The peer's `a[:512] @ b[:1024]` is one product: braid's run must run it too.
                let y = f(&a, &b, &wide);
                dev.sync().unwrap();
                let products = dev.last_schedule().map_or(0, |s| s.product_count());
                assert!(products >= 1, "half {dtype} matmul: braid ran {products} matrix products, the peer 1");
                drop(y);
            }
            g.bench_function(BenchmarkId::new(dtype.to_string(), name), |bench| {
                bench.iter(|| {
                    let y = f(&a, &b, &wide);
                    dev.sync().unwrap();
                    black_box(y)
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, half);
criterion_main!(benches);
