//! The device runtime over a recording queue (`common::recording`): a fake asynchronous device
//! whose queues log every call and defer the work to a simulated device that runs streams in a
//! random interleaving, returning memory to the pool only when it gets to a free. This is what
//! the CUDA and wgpu backends rely on:
//! - the random programs of the property suites (streams, user events, in-place updates, memory
//!   budgets with offloads, fusion on and off) give the reference's results on it, in poison
//!   mode, so no buffer is reused or freed while the simulated device still needs it;
//! - the runtime never hands a gated free over before the records of the events it names, and
//!   issues every wait after its record (checked on every call);
//! - the same holds on one in-order queue with memory reused the moment it is freed (wgpu's
//!   ordering, `RecordingBackend::single_queue`), and with each stream issued by a thread of
//!   its own, the calls of different streams racing (CUDA's, `RecordingBackend::issue_threads`);
//! - the simulation is not vacuous: a schedule whose gated frees lose their gates (which the
//!   validator would refuse, so it is run on the runtime directly) gives wrong results.

mod common;

use braid::prelude::*;
use common::program::{self, Config};
use common::recording::{Logged, RecordingBackend};
use std::sync::Arc;

fn cases() -> u64 {
    std::env::var("BRAID_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).map_or(1500, |n: u64| n.max(50))
}

/// Runs `n` random programs of `config` on a fresh device opened by name (`recording:N`, ...:
/// the recording backends register like any backend, see `RecordingBackend::register`), with
/// poison on; returns the device.
fn run_programs_on(name: &str, n: u64, config: &Config, fusion: bool, seed: u64) -> Device {
    RecordingBackend::register();
    let dev = Device::new(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    dev.set_poison(true);
    dev.set_fusion(fusion);
    for i in 0..n {
        let program_seed = seed.wrapping_mul(1_000_003).wrapping_add(i);
        if let Err(e) = program::run(program_seed, &dev, config) {
            panic!("program {program_seed} on {name}: {e}");
        }
    }
    let violations = RecordingBackend::of(&dev).violations();
    assert!(violations.is_empty(), "the runtime broke an ordering promise: {violations:#?}");
    dev
}

/// [`run_programs_on`] a `recording:seed` device; returns its log.
fn run_programs(n: u64, config: &Config, fusion: bool, seed: u64) -> Vec<Logged> {
    RecordingBackend::of(&run_programs_on(&format!("recording:{seed}"), n, config, fusion, seed)).log()
}

fn count(log: &[Logged], f: impl Fn(&Logged) -> bool) -> usize {
    log.iter().filter(|l| f(l)).count()
}

#[test]
fn random_programs_on_streams_with_events_match_the_reference_on_an_asynchronous_device() {
    let config = Config { streams: 2, events: true, max_ops: 40, reads_in_middle: false, ..Config::default() };
    let fused = run_programs(cases(), &config, true, 1);
    let unfused = run_programs(cases() / 2, &config, false, 2);
    for log in [fused, unfused] {
        let gated = count(&log, |l| matches!(l, Logged::FreeAfter { after, .. } if !after.is_empty()));
        let waits = count(&log, |l| matches!(l, Logged::Wait { .. }));
        let launches = count(&log, |l| matches!(l, Logged::Launch { .. }));
        println!("{launches} kernels, {waits} waits, {gated} gated frees");
        assert!(
            gated > 20 && waits > 100 && launches > 1000,
            "too little was exercised: {launches} kernels, {waits} waits, {gated} gated frees"
        );
    }
}

/// Runs three-stream programs with events (fused) and two-stream programs under memory budgets
/// (offloading) on backends made by `backend` (from a seed), and checks that enough waits, gated
/// frees and offload copies were exercised (`min_copies` copies at least).
fn run_mixed(label: &str, backend: &str, seeds: (u64, u64), budget_runs: u64, min_copies: usize) {
    let config = Config { streams: 3, events: true, max_ops: 30, reads_in_middle: false, ..Config::default() };
    let fused = run_programs_on(&format!("{backend}:{}", seeds.0), cases() / 2, &config, true, seeds.0);
    let budgets = Config { streams: 2, events: true, budgets: true, max_ops: 32, ..Config::default() };
    let offloaded = run_programs_on(&format!("{backend}:{}", seeds.1), budget_runs, &budgets, false, seeds.1);
    let log = RecordingBackend::of(&fused).log();
    let gated = count(&log, |l| matches!(l, Logged::FreeAfter { after, .. } if !after.is_empty()));
    let waits = count(&log, |l| matches!(l, Logged::Wait { .. }));
    let copies = count(&RecordingBackend::of(&offloaded).log(), |l| matches!(l, Logged::Copy { .. }));
    println!("{label}: {waits} waits, {gated} gated frees, {copies} offload copies");
    assert!(
        gated > 10 && waits > 50 && copies > min_copies,
        "too little was exercised: {waits} waits, {gated} gated frees, {copies} copies"
    );
}

/// wgpu's ordering: every stream on one in-order queue, memory reusable the moment it is freed
/// (gated or not), uploads and poison fills in issue order. The interleaved walker's issue
/// order must then respect every event and gated free of the schedule by itself.
#[test]
fn random_programs_match_the_reference_on_one_in_order_queue() {
    run_mixed("one queue", "recording_one_queue", (5, 6), cases() / 2, 10);
}

/// CUDA's driving: each stream issued by a host thread of its own, so the calls of different
/// streams race; the walker must still hold every wait back until its record was issued and
/// hand gated frees over only after their records.
#[test]
fn random_programs_match_the_reference_when_each_stream_is_issued_on_its_own_thread() {
    run_mixed("issue threads", "recording_issue_threads", (7, 8), cases() / 4, 5);
}

#[test]
fn random_programs_under_memory_budgets_match_the_reference_on_an_asynchronous_device() {
    let config = Config { streams: 2, events: true, budgets: true, max_ops: 32, ..Config::default() };
    let log = run_programs(cases() / 2, &config, false, 3);
    let copies = count(&log, |l| matches!(l, Logged::Copy { .. }));
    println!("{copies} offload copies");
    assert!(copies > 20, "budgets should have offloaded values");
}

/// Values of the CPU reach the device (whose memory is its own) by copy steps on its copy
/// stream, shown in the dump; CPU to CPU needs no copy.
#[test]
fn transfers_from_the_cpu_are_copy_steps_on_the_copy_stream() {
    RecordingBackend::register();
    let dev = Device::new("recording:4").unwrap();
    let backend = RecordingBackend::of(&dev);
    dev.set_poison(true);
    let cpu = Device::new_cpu();
    let x = Tensor::from_vec((0..64).map(|i| i as f32 * 0.5 - 7.0).collect(), [8, 8], &cpu);
    let y = (&x * 2.0).exp(); // pending on the CPU: the transfer makes the CPU compute it first
    let on_dev = (y.to_device(&dev) + 1.0).sum_dim(1, false);
    let expected: Vec<f32> =
        (0..8).map(|r| (0..8).map(|c| ((r * 8 + c) as f32 * 0.5 - 7.0) * 2.0).map(|v| v.exp() + 1.0).sum()).collect();
    let got = on_dev.to_vec::<f32>().unwrap();
    for (g, e) in got.iter().zip(&expected) {
        assert!((g - e).abs() <= 1e-5 * e.abs(), "{got:?} vs {expected:?}");
    }
    let dump = dev.last_schedule().unwrap().to_json();
    assert!(dump.contains(r#""direction": "transfer""#), "{dump}");
    assert!(dump.contains(r#""space": "remote""#), "{dump}");
    let text = dev.last_schedule().unwrap().to_text();
    assert!(text.contains("stream copy:"), "the copy runs on the copy stream:\n{text}");
    assert!(backend.violations().is_empty(), "{:?}", backend.violations());
    // And back: the CPU reads the device's memory in place (both are host memory here).
    let back = on_dev.to_device(&cpu);
    assert_eq!(back.to_vec::<f32>().unwrap(), got);
    // CPU to CPU: no copy step, the reader loads the other device's buffer where it is.
    let other = Device::new_cpu();
    let z = (x.to_device(&other) * 3.0).to_vec::<f32>().unwrap();
    assert_eq!(z[3], (3.0 * 0.5 - 7.0) * 3.0);
    let dump = other.last_schedule().unwrap().to_json();
    assert!(!dump.contains(r#""kind": "copy""#), "{dump}");
}

/// Without the events that gate its frees, a schedule frees buffers that another stream still
/// reads: the simulated device then shows wrong values (poisoned memory) in some interleaving.
#[test]
fn the_simulation_catches_frees_that_lose_their_gates() {
    use braid_devices::runtime::{Input, Job, execute};
    use braid_graph::{FlushGraph, FlushNode, Op, StreamId, ValueRef, table::UnaryOp};
    // Stream 0 computes a; stream 1 computes x, then reads a twice; stream 0 waits for x (so
    // the runtime issues stream 1's reads before stream 0 goes on), reads a once more and frees
    // it, gated on stream 1's reads.
    let node = |op: Op, stream: u32, inputs: &[usize], after: &[usize], keep: bool| FlushNode {
        id: braid_graph::NodeId::new(0),
        op,
        dtype: DType::F32,
        shape: Shape::from([4096]),
        device: braid_graph::DeviceId(0),
        stream: StreamId(stream),
        inputs: inputs.iter().map(|&i| ValueRef::Node(i)).collect(),
        after: after.iter().copied().collect(),
        keep,
        offload_hint: false,
        persistent: false,
        recomputed: false,
    };
    let mut graph = FlushGraph::default();
    graph.nodes.push(node(Op::Arange { start: 1 }, 0, &[], &[], false));
    graph.nodes.push(node(Op::Cast, 0, &[0], &[], false)); // a
    graph.nodes.push(node(Op::Unary(UnaryOp::Neg), 1, &[], &[], true)); // x (below)
    graph.nodes.push(node(Op::Unary(UnaryOp::Exp), 1, &[1], &[], false));
    graph.nodes.push(node(Op::Unary(UnaryOp::Sqrt), 1, &[1], &[], true)); // read and kept
    graph.nodes.push(node(Op::Unary(UnaryOp::Neg), 0, &[1], &[2], true)); // a's last read
    graph.nodes[0].dtype = DType::I64;
    graph.nodes[2].op = Op::Full(braid_graph::Scalar(2.0));
    for (i, n) in graph.nodes.iter_mut().enumerate() {
        n.id = braid_graph::NodeId::new(i);
    }
    let options = braid_fusion::Options { enabled: false, ..Default::default() };
    let schedule = braid_scheduler::plan(&graph, braid_fusion::segment(&graph, &options));
    let gated = schedule
        .streams
        .iter()
        .flat_map(|s| &s.steps)
        .any(|st| matches!(st, braid_scheduler::StreamStep::Free { after, .. } if !after.is_empty()));
    assert!(gated, "the plan gates a free: {schedule:#?}");
    let mut ungated = schedule.clone();
    for st in &mut ungated.streams {
        for step in &mut st.steps {
            if let braid_scheduler::StreamStep::Free { after, .. } = step {
                after.clear();
            }
        }
    }
    let lowering = braid_lowering::Lowering::new(&graph, &schedule.fusion);
    let kernels: Vec<Arc<braid_lowering::Kernel>> =
        schedule.kernels.iter().map(|k| Arc::new(lowering.segment(&schedule.fusion.segments[k.segment]))).collect();
    let label = |k: braid_scheduler::KernelId| k.to_string();
    let run = |schedule: &braid_scheduler::Schedule, seed: u64| {
        let backend = RecordingBackend::new(seed);
        let job = Job {
            schedule,
            kernels: &kernels,
            externals: Vec::<Input>::new(),
            label: &label,
            poison: true,
            fail_at: None,
            flush: 0,
            profile: None,
        };
        let outputs = execute(&backend, job).0.expect("runs");
        let sqrt = &outputs[1];
        let values = backend_download(&backend, sqrt);
        (values, backend.violations())
    };
    let mut wrong = 0;
    for seed in 1..200u64 {
        let (good, violations) = run(&schedule, seed);
        assert!(violations.is_empty(), "{violations:?}");
        assert!(good.iter().enumerate().all(|(i, v)| *v == ((i + 1) as f32).sqrt()), "the valid plan is right");
        let (bad, _) = run(&ungated, seed);
        if bad != good {
            wrong += 1;
        }
    }
    assert!(wrong > 0, "losing the gates never showed: the simulation would miss early frees");
}

fn backend_download(backend: &RecordingBackend, buffer: &braid_devices::Buffer) -> Vec<f32> {
    use braid_devices::Backend;
    let bytes = backend.download(buffer).unwrap();
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
