//! The engine's side of device graphs (`Backend::record_graph`), on a test backend that runs on
//! the CPU and records a "graph" as the plan kept to run again: what CUDA graphs rely on, checked
//! without a GPU. A replayed step records at its first replay and launches from then on; a graph
//! that cannot run now, or has gone stale, gives way to a flush (and a stale one is recorded
//! again); profiled, fault-injected and budgeted replays never use one; every launch gives
//! fresh outputs.

use braid::Step;
use braid::prelude::*;
use braid_devices::cpu::CpuDevice;
use braid_devices::runtime::{self, Flush, Graph, GraphRun, Input, Job};
use braid_devices::{Backend, Buffer, DeviceError};
use braid_lowering::Kernel;
use braid_scheduler::Schedule;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What the test backend's graphs do and did.
#[derive(Default)]
struct Graphs {
    recorded: AtomicU64,
    launched: AtomicU64,
    /// The next launch answers `NotNow` / `Stale`.
    not_now: AtomicBool,
    stale: AtomicBool,
}

/// The CPU device, recording graphs.
struct GraphBackend {
    cpu: CpuDevice,
    graphs: Arc<Graphs>,
}

/// A recorded plan: its schedule and kernels, run again by the CPU at each launch.
struct KeptPlan {
    schedule: Schedule,
    kernels: Vec<Arc<Kernel>>,
    graphs: Arc<Graphs>,
}

impl Graph for KeptPlan {
    fn launch(&self, backend: &dyn Backend, inputs: &[Buffer]) -> Result<GraphRun, DeviceError> {
        if self.graphs.not_now.swap(false, Ordering::SeqCst) {
            return Ok(GraphRun::NotNow);
        }
        if self.graphs.stale.swap(false, Ordering::SeqCst) {
            return Ok(GraphRun::Stale);
        }
        let label = |k: braid_scheduler::KernelId| format!("{k}");
        let job = Job {
            schedule: &self.schedule,
            kernels: &self.kernels,
            externals: inputs.iter().cloned().map(Input::Buffer).collect(),
            label: &label,
            poison: false,
            fail_at: None,
            flush: 0,
            profile: None,
        };
        let outputs = runtime::execute(backend, job).0?;
        self.graphs.launched.fetch_add(1, Ordering::SeqCst);
        Ok(GraphRun::Ran(outputs))
    }
}

impl Backend for GraphBackend {
    fn name(&self) -> String {
        "graphs".into()
    }
    crate::common::cpu_backend_methods!();
    fn begin<'a>(&'a self, schedule: &'a Schedule, poison: bool) -> Result<Box<dyn Flush + 'a>, DeviceError> {
        self.cpu.begin(schedule, poison)
    }
    fn record_graph(&self, job: Job<'_>, _bound: &[Option<Buffer>]) -> Option<Result<Box<dyn Graph>, DeviceError>> {
        assert!(job.fail_at.is_none() && job.profile.is_none(), "a graph is never recorded for such a flush");
        self.graphs.recorded.fetch_add(1, Ordering::SeqCst);
        let plan =
            KeptPlan { schedule: job.schedule.clone(), kernels: job.kernels.to_vec(), graphs: self.graphs.clone() };
        Some(Ok(Box::new(plan)))
    }
}

fn step_fn(a: &[Tensor]) -> Vec<Tensor> {
    let h = a[0].matmul(&a[1]).tanh();
    vec![(&h - &h.max_dim(1, true)).exp(), h.sum()]
}

fn values(out: &[Tensor]) -> Vec<Vec<f32>> {
    out.iter().map(|t| t.to_vec::<f32>().unwrap()).collect()
}

#[test]
fn a_backend_that_records_graphs_replays_steps_through_them() {
    let graphs = Arc::new(Graphs::default());
    let backend = Arc::new(GraphBackend { cpu: CpuDevice::new(), graphs: graphs.clone() });
    let dev = braid::testing::device_with_backend(backend);
    let count = |g: &Graphs| (g.recorded.load(Ordering::SeqCst), g.launched.load(Ordering::SeqCst));
    let step = Step::new(step_fn);
    let w = Tensor::randn([8, 8], DType::F32, &dev);
    let mut held = Vec::new();
    let mut call = |expect: (u64, u64), what: &str| {
        let x = Tensor::randn([4, 8], DType::F32, &dev);
        let out = step.call(&[x.clone(), w.clone()]).unwrap();
        let eager = values(&step_fn(&[x, w.clone()]));
        assert_eq!(values(&out), eager, "{what}: the replay equals the eager run");
        assert_eq!(count(&graphs), expect, "{what}: (graphs recorded, launched)");
        held.push((out, eager));
    };
    call((0, 0), "the capture runs as a flush");
    call((1, 1), "the first replay records a graph and launches it");
    call((1, 2), "later replays launch it");
    graphs.not_now.store(true, Ordering::SeqCst);
    call((1, 2), "a graph that cannot run now gives way to a flush");
    call((1, 3), "and runs again next time");
    graphs.stale.store(true, Ordering::SeqCst);
    call((1, 3), "a stale graph gives way to a flush");
    call((2, 4), "and is recorded again at the next replay");
    // Every launch gave fresh outputs: those held from earlier calls are unchanged.
    for (i, (out, expected)) in held.iter().enumerate() {
        assert_eq!(&values(out), expected, "call {i}'s outputs, read after the others");
    }
    drop(held);

    // A replay with a failure injected runs as a flush (and fails); the next one launches.
    let x = Tensor::randn([4, 8], DType::F32, &dev);
    braid::testing::fail_next_flush_at(&dev, 0);
    assert!(matches!(step.call(&[x.clone(), w.clone()]), Err(Error::Device { .. })));
    assert_eq!(count(&graphs), (2, 4));
    assert_eq!(values(&step.call(&[x.clone(), w.clone()]).unwrap()), values(&step_fn(&[x.clone(), w.clone()])));
    assert_eq!(count(&graphs), (2, 5));

    // Under a memory budget the step is captured again and never recorded into a graph.
    dev.set_memory_budget(Some(1 << 30));
    for _ in 0..3 {
        assert_eq!(values(&step.call(&[x.clone(), w.clone()]).unwrap()), values(&step_fn(&[x.clone(), w.clone()])));
    }
    assert_eq!(step.captures(), 2);
    assert_eq!(count(&graphs), (2, 5));
}
