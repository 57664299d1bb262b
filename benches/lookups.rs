//! Lookups: `embedding` of 2,048 ids from tables of 1,000 and 32,000 rows of 256 f32 features
//! (a gather kernel), and the gradient of the table for a gradient of ones on the rows (a
//! scatter-add), each against a plain single-threaded Rust loop doing the same work in the
//! same run: copying the rows (`copy_from_slice`) into a buffer of the result's size, or
//! zeroing a table-sized buffer and adding each gradient row to its table row. braid's figures
//! include recording, the flush and its kernels (`Device::sync`, no read back; the backward's
//! recording of the gradient program too); the loops', only the work. The ids are a fixed
//! pseudo-random walk over the table, so most rows are read from memory, not cache, at 32,000
//! rows.
//!
//! On the device `BRAID_DEVICE` names (the CPU when unset), with i64 ids (i32 on wgpu, which
//! holds no i64). On a GPU the plain loops are not
//! a peer (they run on the host): compare with PyTorch's `F.embedding` and its backward in the
//! same command instead, `python3 benches/peers/lookups_torch.py --device cuda`. Both rows
//! compute the same work on both sides: the lookup's rows (held until the sync), and the
//! table's gradient alone (braid records the forward but holds only the gradient, so the
//! lookup, product and sum are never run; the peer runs its forward once, outside the timed
//! region, and times the backward pass over it).
//!
//! Run: `cargo bench --bench lookups` (criterion's group "lookups"; add `-- --quick` for a
//! short run).

use braid::prelude::*;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;

const IDS: usize = 2048;
const FEATURES: usize = 256;

fn lookups(c: &mut Criterion) {
    let cpu = Device::from_env().expect("the device BRAID_DEVICE names");
    let on_host = cpu.name().starts_with("cpu");
    if !on_host {
        println!("lookups on {}: the plain host loops are skipped (not a peer of a GPU)", cpu.name());
    }
    // The ids are i64 (as the peer's) where the device holds them; wgpu holds i32 only.
    let wide_ids = cpu.target().dtypes.contains(DType::I64);
    if !wide_ids {
        println!("lookups on {}: i32 ids (the device holds no i64)", cpu.name());
    }
    let mut g = c.benchmark_group("lookups");
    g.throughput(Throughput::Bytes((IDS * FEATURES * 4) as u64));
    for vocabulary in [1000usize, 32_000] {
        let table: Vec<f32> = (0..vocabulary * FEATURES).map(|i| (i % 97) as f32 * 0.25 - 12.0).collect();
        let ids: Vec<i64> = (0..IDS).map(|i| ((i * 7919 + 13) % vocabulary) as i64).collect();
        let weight = Tensor::from_vec(table.clone(), [vocabulary, FEATURES], &cpu);
        let id_tensor = if wide_ids {
            Tensor::from_vec(ids.clone(), [IDS], &cpu)
        } else {
            Tensor::from_vec(ids.iter().map(|&i| i as i32).collect::<Vec<_>>(), [IDS], &cpu)
        };
        // The result is checked once against the plain loop's before anything is timed.
        let mut plain = vec![0.0f32; IDS * FEATURES];
        let copy_rows = |out: &mut [f32]| {
            for (row, &id) in out.chunks_exact_mut(FEATURES).zip(&ids) {
                let at = id as usize * FEATURES;
                row.copy_from_slice(&table[at..at + FEATURES]);
            }
        };
        copy_rows(&mut plain);
        assert_eq!(id_tensor.embedding(&weight).to_vec::<f32>().unwrap(), plain);
        g.bench_function(BenchmarkId::new("embedding", vocabulary), |b| {
            b.iter(|| {
                let rows = id_tensor.embedding(&weight);
                cpu.sync().unwrap();
                black_box(rows)
            })
        });
        if on_host {
            g.bench_function(BenchmarkId::new("plain_copy_loop", vocabulary), |b| {
                b.iter(|| {
                    copy_rows(black_box(&mut plain));
                })
            });
        }
        // The gradient of the table: the backward of a lookup whose rows' gradient is ones.
        let trained = weight.requires_grad();
        let grad_ones = Tensor::ones([IDS, FEATURES], DType::F32, &cpu);
        let mut sums = vec![0.0f32; vocabulary * FEATURES];
        let add_rows = |sums: &mut [f32], rows: &[f32]| {
            sums.fill(0.0);
            for (row, &id) in rows.chunks_exact(FEATURES).zip(&ids) {
                let at = id as usize * FEATURES;
                for (s, r) in sums[at..at + FEATURES].iter_mut().zip(row) {
                    *s += r;
                }
            }
        };
        let ones = vec![1.0f32; IDS * FEATURES];
        add_rows(&mut sums, &ones);
        let backward = || (id_tensor.embedding(&trained) * &grad_ones).sum().backward().unwrap();
        assert_eq!(backward().get(&trained).unwrap().to_vec::<f32>().unwrap(), sums);
        g.bench_function(BenchmarkId::new("embedding_backward", vocabulary), |b| {
            b.iter(|| {
                let grads = backward();
                cpu.sync().unwrap();
                black_box(grads)
            })
        });
        if on_host {
            g.bench_function(BenchmarkId::new("plain_add_rows_loop", vocabulary), |b| {
                b.iter(|| add_rows(black_box(&mut sums), black_box(&ones)))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, lookups);
criterion_main!(benches);
