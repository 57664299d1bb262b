//! Engine overhead (BENCH.md, "Engine overhead"):
//! - O1 `record_one_op`: recording one elementwise op (`&x + &y`), drop excluded.
//! - O2 `schedule_10k_nodes`: fusion + scheduling/memory planning + lowering of a 10,000-node
//!   flush graph (no execution), reported per node.
//! - O2 `flush_10k_nodes`: the whole flush of a recorded 10,000-node graph of small tensors
//!   (walk, schedule, lower, execute, install), recording excluded, per node.
//! - O3 `replay_1k_nodes`: flushing a 1,000-node graph structurally identical to an earlier one
//!   (the plan comes from the cache), recording excluded; everything else (extracting the
//!   subgraph, the structural key, execution, install) included.
//! - O1 `release_10k_consumers`: dropping 10,000 pending results of one input, oldest first
//!   (the order a `Vec<Tensor>` drops in), reported per result. Was quadratic in the number of
//!   results while the graph kept singly linked edge lists.
//!
//! Run: `cargo bench --bench overhead`. Per-node figures: divide by 10,000 (criterion reports
//! the time per flush; `Throughput::Elements` prints nodes per second).

use braid::prelude::*;
use braid_graph::table::{BinaryOp, UnaryOp};
use braid_graph::{DeviceId, FlushGraph, FlushNode, NodeId, Op, StreamId, ValueRef};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;

const NODES: usize = 10_000;

fn record_one_op(c: &mut Criterion) {
    braid::set_max_pending_nodes(0); // never flush while timing recording
    let cpu = Device::cpu();
    let x = Tensor::from_vec(vec![1.0f32; 64], [64], &cpu);
    let y = Tensor::from_vec(vec![2.0f32; 64], [64], &cpu);
    let mut g = c.benchmark_group("O1");
    g.throughput(Throughput::Elements(1));
    g.bench_function("record_one_op", |b| b.iter_with_large_drop(|| black_box(&x) + black_box(&y)));
    g.finish();
    braid::set_max_pending_nodes(braid::DEFAULT_MAX_PENDING);
}

/// A 10,000-node flush graph: a random DAG of unary and binary elementwise ops over [16, 16]
/// f32 values, with a few values kept.
fn flush_graph() -> FlushGraph {
    let mut state = 12345u64;
    let mut rand = |n: usize| {
        state = braid_graph::rng::mix64(state);
        (state % n as u64) as usize
    };
    let shape = braid_graph::Shape::from([16, 16]);
    let mut g = FlushGraph::default();
    for i in 0..4 {
        g.externals.push(braid_graph::External {
            id: NodeId::new(i),
            dtype: DType::F32,
            shape: shape.clone(),
            device: DeviceId(0),
            stream: StreamId(0),
            donated: false,
            on_host: false,
            offloaded: false,
            persistent: false,
            overwritable: false,
            remote: false,
            foreign: false,
        });
    }
    for i in 0..NODES {
        let pick = |r: usize| {
            if i == 0 || r.is_multiple_of(8) {
                ValueRef::External(r % 4)
            } else {
                ValueRef::Node(i - 1 - r % i.min(32))
            }
        };
        let (op, inputs) = if rand(3) == 0 {
            (Op::Unary(UnaryOp::ALL[rand(UnaryOp::ALL.len())]), vec![pick(rand(1000))])
        } else {
            (
                Op::Binary([BinaryOp::Add, BinaryOp::Mul, BinaryOp::Sub][rand(3)]),
                vec![pick(rand(1000)), pick(rand(1000))],
            )
        };
        g.nodes.push(FlushNode {
            id: NodeId::new(i + 4),
            op,
            dtype: DType::F32,
            shape: shape.clone(),
            device: DeviceId(0),
            stream: StreamId(0),
            inputs: inputs.into(),
            after: Default::default(),
            keep: i % 1000 == 999,
            offload_hint: false,
            persistent: false,
            recomputed: false,
        });
    }
    g
}

fn schedule_10k(c: &mut Criterion) {
    let graph = flush_graph();
    let mut g = c.benchmark_group("O2");
    g.throughput(Throughput::Elements(NODES as u64));
    g.sample_size(20).measurement_time(Duration::from_secs(5));
    g.bench_function("schedule_10k_nodes", |b| {
        b.iter(|| {
            let fusion = braid_fusion::segment(&graph, &braid_fusion::Options::default());
            let schedule = braid_scheduler::plan(&graph, fusion);
            let lowering = braid_lowering::Lowering::new(&graph, &schedule.fusion);
            let kernels: Vec<_> =
                schedule.kernels.iter().map(|k| lowering.segment(&schedule.fusion.segments[k.segment])).collect();
            black_box((schedule, kernels))
        })
    });
    g.finish();
}

fn flush_10k(c: &mut Criterion) {
    let cpu = Device::cpu();
    let leaves: Vec<Tensor> = (0..4)
        .map(|i| {
            Tensor::from_vec((0..256).map(|j| ((i * 256 + j) % 17) as f32 * 0.1).collect::<Vec<_>>(), [16, 16], &cpu)
        })
        .collect();
    for l in &leaves {
        l.to_vec::<f32>().unwrap();
    }
    let mut g = c.benchmark_group("O2");
    g.throughput(Throughput::Elements(NODES as u64));
    g.sample_size(20).measurement_time(Duration::from_secs(8));
    g.bench_function("flush_10k_nodes", |b| {
        b.iter_batched(
            || {
                // Record a chain with fan-in from recent values (recording is not timed).
                let mut recent: Vec<Tensor> = leaves.clone();
                for i in 0..NODES {
                    let a = &recent[recent.len() - 1];
                    let bb = &recent[recent.len() - 1 - i % 3];
                    let t = match i % 4 {
                        0 => a + bb,
                        1 => a * 0.5,
                        2 => a.tanh(),
                        _ => a - bb,
                    };
                    recent.push(t);
                    if recent.len() > 8 {
                        recent.remove(0);
                    }
                }
                recent.pop().unwrap()
            },
            |last| last.to_vec::<f32>().unwrap(),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

/// A graph of `n` nodes over [16] f32 values whose structure is the same every time.
fn record_mlp_like(leaves: &[Tensor], n: usize) -> Tensor {
    let mut recent: Vec<Tensor> = leaves.to_vec();
    for i in 0..n {
        let a = &recent[recent.len() - 1];
        let b = &recent[recent.len() - 1 - i % 3];
        let t = match i % 5 {
            0 => a + b,
            1 => a * 0.5,
            2 => a.tanh(),
            3 => a.sum_dim(0, true) * b,
            _ => a - b,
        };
        recent.push(t);
        if recent.len() > 8 {
            recent.remove(0);
        }
    }
    recent.pop().unwrap()
}

fn replay_1k(c: &mut Criterion) {
    const REPLAY: usize = 1000;
    let cpu = Device::new_cpu();
    let leaves: Vec<Tensor> = (0..4)
        .map(|i| Tensor::from_vec((0..16).map(|j| ((i * 16 + j) % 7) as f32 * 0.1).collect::<Vec<_>>(), [16], &cpu))
        .collect();
    cpu.sync().unwrap();
    record_mlp_like(&leaves, REPLAY).to_vec::<f32>().unwrap(); // plans once
    let mut g = c.benchmark_group("O3");
    g.throughput(Throughput::Elements(REPLAY as u64));
    g.sample_size(30).measurement_time(Duration::from_secs(5));
    g.bench_function("replay_1k_nodes", |b| {
        b.iter_batched(
            || record_mlp_like(&leaves, REPLAY),
            |last| last.to_vec::<f32>().unwrap(),
            BatchSize::PerIteration,
        )
    });
    g.finish();
    let (hits, misses) = cpu.plan_cache_stats();
    assert!(hits > misses, "the replays hit the plan cache ({hits} hits, {misses} misses)");
}

fn release_10k_consumers(c: &mut Criterion) {
    braid::set_max_pending_nodes(0); // keep the results pending
    let cpu = Device::cpu();
    let x = Tensor::from_vec(vec![1.0f32; 64], [64], &cpu);
    let y = Tensor::from_vec(vec![2.0f32; 64], [64], &cpu);
    let mut g = c.benchmark_group("O1");
    g.throughput(Throughput::Elements(NODES as u64));
    g.sample_size(20);
    g.bench_function("release_10k_consumers", |b| {
        b.iter_batched(|| (0..NODES).map(|_| &x + &y).collect::<Vec<Tensor>>(), drop, BatchSize::PerIteration)
    });
    g.finish();
    braid::set_max_pending_nodes(braid::DEFAULT_MAX_PENDING);
}

criterion_group!(overhead, record_one_op, release_10k_consumers, schedule_10k, flush_10k, replay_1k);
criterion_main!(overhead);
