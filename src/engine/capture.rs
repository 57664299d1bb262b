//! Captured steps ([`crate::Step`]): a function of tensors recorded and planned once, then
//! replayed with new arguments without recording, walking or planning anything again.
//!
//! A capture runs the function on the arguments as usual (refusing reads and flushes inside,
//! see [`during`]) and flushes what its outputs need in one flush. It keeps that flush's graph
//! and plan, where each input of the flush comes from (an argument, or host data the function
//! created), and where each output comes from. A replay binds the arguments' buffers to those
//! inputs, runs the plan on the runtime, and returns the outputs for the API to wrap. Where the
//! backend records device graphs (`Backend::record_graph`, CUDA graphs), the first replay
//! records the plan into one and later replays launch it; a stale graph is dropped and
//! recorded again, and a replay that is profiled, has a fault injected or runs under a memory
//! budget runs the plan as a flush. An argument passed as the same buffer at the call before
//! the graph is recorded (a step's weights) is read in place by it, not copied in at each
//! launch; a later call with another buffer for it records the graph again.
//!
//! This module must never keep a plan whose replay could differ from running the function
//! again. A capture fails with [`Error::Capture`] (and nothing is kept) when the function reads
//! a value while it is recorded, needs a tensor that is not an argument, keeps a tensor it does
//! not return, updates a tensor from outside the step in place (its arguments aside: their new
//! versions are extra outputs of the capture, and a replay installs them, written over the
//! arguments' buffers where only the step reads them), makes a random tensor (every replay
//! would draw the capture's numbers), or records or waits for a user event. The updates and
//! waits are refused when they are recorded and not done, so that a failed capture leaves
//! every tensor and stream from outside the step as it was.

use super::env::FlushEnv;
use super::flush::ExternalData;
use super::run::{Planned, kernel_label};
use super::{Engine, EngineState, Value};
use crate::error::{Error, Result};
use braid_devices::runtime::{Graph, GraphRun};
use braid_devices::{Buffer, Input, Job};
use braid_graph::{DType, DeviceId, Node, NodeId, Op, Shape};
use braid_scheduler::KernelId;
use std::cell::Cell;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};

thread_local! {
    /// How many captures are running on this thread (reads and flushes are refused inside).
    static CAPTURING: Cell<u32> = const { Cell::new(0) };
    /// The first thing refused inside the running capture: the capture fails with it even if
    /// the function ignored the `Err`.
    static REFUSED: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
    /// The running capture's device, and the recording order its work starts at.
    static START: Cell<Option<(DeviceId, u64)>> = const { Cell::new(None) };
    /// The version cells (addresses) of the running capture's arguments: the tensors from
    /// outside it that it may update in place.
    static ARGUMENTS: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether this thread is inside a capture.
pub(crate) fn capturing() -> bool {
    CAPTURING.with(|c| c.get() > 0)
}

/// `Err` inside a capture: `what` (a read, a sync, a flush) would make the step depend on a
/// value of this one run.
pub(crate) fn refuse_while_capturing(what: &str) -> Result<()> {
    let refused = refuse(|| {
        format!(
            "{what} inside a step while it is captured: a replay would not do it again, so the step's \
             work must not depend on it (read values outside the step, or pass them as arguments)"
        )
    });
    match refused {
        Some(message) => Err(Error::Capture(message)),
        None => Ok(()),
    }
}

/// Inside a capture: fails it with `message` (unless something was refused first) and returns
/// the message; `None` outside a capture. For what the function did that a replay would not
/// do again, or that would change something outside the step.
pub(crate) fn refuse(message: impl FnOnce() -> String) -> Option<String> {
    if !capturing() {
        return None;
    }
    let message = message();
    REFUSED.with(|r| {
        r.borrow_mut().get_or_insert_with(|| message.clone());
    });
    Some(message)
}

/// Inside a capture: whether the version of a tensor on `engine` that `cell` names was
/// recorded outside the step (before the capture started, or on another device); `false`
/// outside a capture (one thread-local read, so recording pays nothing more).
pub(crate) fn from_outside(engine: &Engine, cell: &AtomicU32) -> bool {
    let Some((device, start)) = START.with(Cell::get) else { return false };
    device != engine.id || engine.with_state(|st| st.graph.node(super::current(cell)).seq < start)
}

/// Inside a capture: whether `cell` is the version cell of one of its arguments (which the step
/// may update in place: a replay updates it again).
pub(crate) fn is_argument(cell: &AtomicU32) -> bool {
    let address = cell as *const AtomicU32 as usize;
    capturing() && ARGUMENTS.with(|a| a.borrow().contains(&address))
}

/// Runs the step's function `f` as a capture on this thread of the work recorded on `device`
/// from recording order `start` on: reads, syncs and flushes inside are refused, and so are
/// in-place updates of tensors from outside the step, random tensors and user events; the
/// first refusal fails the capture even if `f` ignored the `Err`.
pub(crate) fn during<R>(device: DeviceId, start: u64, arguments: &[&AtomicU32], f: impl FnOnce() -> R) -> Result<R> {
    struct Restore(Option<(DeviceId, u64)>, Vec<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CAPTURING.with(|c| c.set(c.get() - 1));
            START.with(|s| s.set(self.0));
            ARGUMENTS.with(|a| *a.borrow_mut() = std::mem::take(&mut self.1));
        }
    }
    CAPTURING.with(|c| c.set(c.get() + 1));
    REFUSED.with(|r| r.borrow_mut().take());
    let cells = arguments.iter().map(|&c| c as *const AtomicU32 as usize).collect();
    let out = {
        let _restore = Restore(START.with(|s| s.replace(Some((device, start)))), ARGUMENTS.with(|a| a.replace(cells)));
        f()
    };
    match REFUSED.with(|r| r.borrow_mut().take()) {
        Some(refused) => Err(Error::Capture(refused)),
        None => Ok(out),
    }
}

/// Where an input of the captured flush comes from at a replay.
enum Source {
    Arg(usize),
    /// Host data the function created (`from_vec` inside it): uploaded again at each replay.
    Host(Arc<[u8]>),
}

/// Where an output comes from at a replay.
pub(crate) enum Output {
    /// `schedule.outputs[pos]`.
    Computed { pos: usize, dtype: DType, shape: Shape },
    /// An argument returned as it is.
    Arg(usize),
    /// Host data the function created and returned as it is.
    Host { bytes: Arc<[u8]>, dtype: DType, shape: Shape },
}

/// What a replay produced, for the API to wrap as tensors.
pub(crate) enum Produced<'c> {
    Computed { buffer: Buffer, dtype: DType, shape: &'c Shape },
    Arg(usize),
    Host { bytes: &'c Arc<[u8]>, dtype: DType, shape: &'c Shape },
}

/// One captured signature of a step.
pub(crate) struct Capture {
    /// `None` when no output needs work (every output is an argument or host data).
    planned: Option<Planned>,
    sources: Vec<Source>,
    outputs: Vec<Output>,
    /// The plan recorded into a device graph (CUDA graphs), from the first replay on.
    graph: Mutex<DeviceGraph>,
    /// The addresses of the arguments' buffers at the last call: those passed again as the same
    /// buffer are bound to a graph recorded now (read in place, never copied).
    last_args: Mutex<Vec<usize>>,
    /// Per argument, the address of the buffer the recorded device graph reads in place (and
    /// holds), if any.
    bound_args: Mutex<Vec<Option<usize>>>,
    /// The arguments the step updates in place (see [`Capture::updated`]).
    updated: Vec<usize>,
}

/// Whether a capture's plan runs as a device graph.
enum DeviceGraph {
    /// Not recorded yet (or the last one went stale): the next replay tries.
    Untried,
    Recorded(Arc<dyn Graph>),
    /// The device records no graph of this plan (or recording it failed): flushes run it.
    Refused,
}

impl Capture {
    /// Whether a replay runs a plan (otherwise every output is an argument or host data).
    pub(crate) fn runs(&self) -> bool {
        self.planned.is_some()
    }

    /// Notes the buffers the arguments had at the capture (see `last_args`).
    pub(crate) fn note_args(&self, addresses: &[usize]) {
        *crate::lock(&self.last_args) = addresses.to_vec();
    }

    /// The arguments the step updates in place (their new values are its last outputs).
    pub(crate) fn updated(&self) -> &[usize] {
        &self.updated
    }

    /// Notes that argument `k` is `buffer` now (a step's argument it updated: passed as it is
    /// at the next call, it counts as the same buffer).
    pub(crate) fn note_arg(&self, k: usize, buffer: &Buffer) {
        if let Some(a) = crate::lock(&self.last_args).get_mut(k) {
            *a = buffer.address();
        }
    }

    /// Whether the recorded device graph holds `buffer` as argument `k`, read in place (one of
    /// the buffer's holders, besides the tensor's).
    pub(crate) fn holds(&self, k: usize, buffer: &Buffer) -> bool {
        matches!(*crate::lock(&self.graph), DeviceGraph::Recorded(_))
            && crate::lock(&self.bound_args).get(k) == Some(&Some(buffer.address()))
    }

    /// Kernels one replay runs.
    pub(crate) fn kernel_count(&self) -> usize {
        self.planned.as_ref().map_or(0, |p| p.schedule.kernels.len())
    }
}

impl Engine {
    /// The recording order the next node gets (a capture's work is what is recorded from here).
    pub(crate) fn next_seq(&self) -> u64 {
        super::state::next_seq()
    }

    /// Flushes what the captured function's outputs (`out_ids`, recorded since `start`, from
    /// arguments `arg_nodes`) need, in one flush, and keeps it as a capture.
    /// Arguments `updated` (positions in `arg_nodes`) are updated in place by the step: their
    /// inputs may be written over (`External::overwritable`), on a private copy unless nothing
    /// but their tensors read their values (`sole`, per argument, found before the step ran).
    pub(crate) fn capture(
        &self,
        start: u64,
        arg_nodes: &[NodeId],
        out_ids: &[NodeId],
        updated: &[usize],
        sole: &[bool],
    ) -> Result<Capture> {
        // Read before the lock is taken, as a flush reads it.
        let env = FlushEnv::for_flush()?;
        loop {
            let mut st = self.state();
            let walked = super::flush::walk(&mut st, out_ids);
            if let Some((_, reason)) = walked.lost.into_iter().next() {
                return Err(Error::ValueLost(reason));
            }
            if !walked.remotes.is_empty() {
                return Err(Error::Capture("the step reads a value of another device; pass it as an argument".into()));
            }
            if !walked.waits.is_empty() {
                drop(st);
                for t in walked.waits {
                    let _ = t.wait();
                }
                continue;
            }
            if self.recompute_under(&env) && super::recompute_copies::copy_for_backward(&mut st, &walked.order, out_ids)
            {
                continue; // saved values copied for the step's backward pass: walk again
            }
            check_leaks(&st, start, out_ids)?;
            check_work(&st, &walked.order, start, arg_nodes)?;
            let outputs = classify_outputs(&st, out_ids, start, arg_nodes)?;
            if walked.order.is_empty() {
                drop(st);
                let outputs = outputs.into_iter().map(|o| o.expect("no work, so nothing is computed")).collect();
                return Ok(Capture {
                    planned: None,
                    sources: Vec::new(),
                    outputs,
                    graph: Mutex::new(DeviceGraph::Refused),
                    last_args: Mutex::new(Vec::new()),
                    bound_args: Mutex::new(Vec::new()),
                    updated: updated.to_vec(),
                });
            }
            // Every view a step makes is computed in it (a replay leaves nothing pending).
            let mut ex = self.extract(&mut st, &walked.order, None, env);
            drop(st);
            // Inputs stay with the step: nothing of them is handed to the flush to free.
            // Arguments the step updates may be written over: where only their tensors read
            // them, in place; otherwise on a private copy.
            let mut sources = Vec::with_capacity(ex.graph.externals.len());
            for (meta, data) in ex.graph.externals.iter_mut().zip(ex.externals.iter_mut()) {
                let arg = arg_nodes.iter().position(|&a| a == meta.id);
                let update = arg.is_some_and(|k| updated.contains(&k));
                if update
                    && !arg.is_some_and(|k| sole[k])
                    && let ExternalData::Device(buffer) = data
                {
                    *buffer = self.private_copy(buffer)?;
                }
                let on_device = matches!(data, ExternalData::Device(b) if !b.is_offloaded());
                meta.donated = false;
                meta.on_host = false;
                meta.overwritable = update && on_device;
                sources.push(match (arg, data) {
                    (Some(k), _) => Source::Arg(k),
                    (None, ExternalData::Host(bytes)) => Source::Host(bytes.clone()),
                    (None, _) => unreachable!("check_work admits only arguments and host data"),
                });
            }
            let planned = self.run(ex)?;
            let outputs = outputs
                .into_iter()
                .zip(out_ids)
                .map(|(o, &id)| match o {
                    Some(o) => Ok(o),
                    None => {
                        let i = planned.graph.nodes.iter().position(|n| n.id == id);
                        let pos = i.and_then(|i| planned.schedule.outputs.iter().position(|&(n, _)| n == i));
                        let node = i.map(|i| &planned.graph.nodes[i]);
                        match (pos, node) {
                            (Some(pos), Some(n)) => {
                                Ok(Output::Computed { pos, dtype: n.dtype, shape: n.shape.clone() })
                            }
                            _ => Err(Error::Internal("a captured output is not among the flush's outputs".into())),
                        }
                    }
                })
                .collect::<Result<Vec<Output>>>()?;
            let graph = Mutex::new(DeviceGraph::Untried);
            let (last_args, bound_args) = (Mutex::new(Vec::new()), Mutex::new(Vec::new()));
            let updated = updated.to_vec();
            return Ok(Capture { planned: Some(planned), sources, outputs, graph, last_args, bound_args, updated });
        }
    }

    /// A copy of `buffer` in a new buffer of this device, through the host (for a capture's
    /// argument updated in place whose value something else still reads: the capture's flush
    /// takes the arguments' buffers as they are; a replay copies on the device).
    fn private_copy(&self, buffer: &Buffer) -> Result<Buffer> {
        let bytes = self.backend.download(buffer).map_err(|e| self.device_error(e))?;
        self.backend.upload(&bytes, self.poison_enabled()).map_err(|e| self.device_error(e))
    }

    /// Runs a captured step on the buffers of its arguments: one execution of the kept plan.
    pub(crate) fn replay<'c>(&self, c: &'c Capture, args: &[Buffer], env: &FlushEnv) -> Result<Vec<Produced<'c>>> {
        refuse_while_capturing("running a step")?;
        let mut computed: Vec<Buffer> = Vec::new();
        if let Some(planned) = &c.planned {
            // Arguments passed as the same buffer as at the last call (weights, above all).
            let stable: Vec<bool> = {
                let mut last = crate::lock(&c.last_args);
                let now: Vec<usize> = args.iter().map(Buffer::address).collect();
                let stable = (0..args.len()).map(|k| last.get(k) == Some(&now[k])).collect();
                *last = now;
                stable
            };
            let poison = self.poison_under(env);
            let externals = c
                .sources
                .iter()
                .map(|s| match s {
                    // A value an offload left in host memory goes to the device first: the
                    // plan reads its arguments where device values are.
                    Source::Arg(k) if args[*k].is_offloaded() => self
                        .backend
                        .download(&args[*k])
                        .and_then(|bytes| self.backend.upload(&bytes, poison))
                        .map(Input::Buffer)
                        .map_err(|e| self.device_error(e)),
                    Source::Arg(k) => Ok(Input::Buffer(args[*k].clone())),
                    Source::Host(bytes) => {
                        self.backend.upload(bytes, poison).map(Input::Buffer).map_err(|e| self.device_error(e))
                    }
                })
                .collect::<Result<smallvec::SmallVec<[Input; 8]>>>()?;
            let fail_at = crate::lock(&self.faults).fail_at.take().map(KernelId);
            let number = {
                let mut st = self.state();
                st.flushes += 1;
                st.flushes
            };
            let label = |k: KernelId| kernel_label(&planned.schedule, &planned.graph, k);
            let sink = self.profile_sink(env);
            if fail_at.is_none() && sink.is_none() && self.memory_budget().is_none() {
                let job = Job {
                    schedule: &planned.schedule,
                    kernels: &planned.kernels,
                    externals: Vec::new(),
                    label: &label,
                    poison,
                    fail_at: None,
                    flush: number,
                    profile: None,
                };
                // Bound when a graph is recorded: stable arguments, read where they are (not those
                // an offload left on the host).
                let bound = || -> Vec<Option<Buffer>> {
                    (c.sources.iter())
                        .map(|s| match s {
                            Source::Arg(k) if stable[*k] && !args[*k].is_offloaded() => Some(args[*k].clone()),
                            _ => None,
                        })
                        .collect()
                };
                let launched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.launch_graph(c, job, &externals, bound)
                }))
                .unwrap_or_else(|panic| {
                    let what = braid_devices::panic_message(panic.as_ref());
                    Err(Error::Internal(format!("a step's device graph panicked (a bug in braid): {what}")))
                });
                if let Some(outputs) = launched? {
                    self.publish_dump(&planned.schedule, &planned.graph, &planned.kernels, number, None, env);
                    return Ok(c.produced(outputs));
                }
            }
            let started = std::time::Instant::now();
            let job = Job {
                schedule: &planned.schedule,
                kernels: &planned.kernels,
                externals: externals.into_vec(),
                label: &label,
                poison,
                fail_at,
                flush: number,
                profile: sink.as_ref(),
            };
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                braid_devices::runtime::execute(self.backend.as_ref(), job).0
            }));
            self.keep_profile(number, sink, started, env);
            computed = match run {
                Ok(result) => result.map_err(|e| self.device_error(e))?,
                Err(panic) => {
                    let what = braid_devices::panic_message(panic.as_ref());
                    return Err(Error::Internal(format!("a step's replay panicked (a bug in braid): {what}")));
                }
            };
            self.publish_dump(&planned.schedule, &planned.graph, &planned.kernels, number, None, env);
        }
        Ok(c.produced(computed))
    }

    /// Runs a captured plan as a device graph (recorded at its first replay, where the device
    /// records graphs): the outputs, or `None` when the plan must run as a flush this time.
    fn launch_graph(
        &self,
        c: &Capture,
        job: Job<'_>,
        inputs: &[Input],
        bound: impl FnOnce() -> Vec<Option<Buffer>>,
    ) -> Result<Option<Vec<Buffer>>> {
        // The graph is taken out of the capture's slot and launched without holding it, so that
        // replays of one step from several threads run at the same time where the device lets
        // them (a CPU graph keeps nothing between launches; CUDA orders its launches itself).
        let graph = {
            let mut slot = crate::lock(&c.graph);
            if matches!(*slot, DeviceGraph::Untried) {
                let bound = bound();
                let mut by_arg = Vec::new();
                for (s, b) in c.sources.iter().zip(&bound) {
                    if let (Source::Arg(k), Some(b)) = (s, b) {
                        by_arg.resize(by_arg.len().max(k + 1), None);
                        by_arg[*k] = Some(b.address());
                    }
                }
                *crate::lock(&c.bound_args) = by_arg;
                *slot = match self.backend.record_graph(job, &bound) {
                    None => DeviceGraph::Refused,
                    Some(Ok(g)) => DeviceGraph::Recorded(Arc::from(g)),
                    Some(Err(e)) => {
                        tracing::debug!(target: "braid", "a step is not run as a device graph: {e}");
                        DeviceGraph::Refused
                    }
                };
            }
            let DeviceGraph::Recorded(graph) = &*slot else { return Ok(None) };
            graph.clone()
        };
        let buffers: smallvec::SmallVec<[Buffer; 8]> = inputs
            .iter()
            .map(|i| match i {
                Input::Buffer(b) => Ok(b.clone()),
                Input::Upload(_) => Err(Error::Internal("a step's input is not on the device".into())),
            })
            .collect::<Result<_>>()?;
        match graph.launch(self.backend.as_ref(), &buffers).map_err(|e| self.device_error(e))? {
            GraphRun::Ran(outputs) => Ok(Some(outputs)),
            GraphRun::NotNow => Ok(None),
            GraphRun::Stale => {
                let mut slot = crate::lock(&c.graph);
                // Unless another replay already replaced it.
                if matches!(&*slot, DeviceGraph::Recorded(g) if Arc::ptr_eq(g, &graph)) {
                    *slot = DeviceGraph::Untried;
                }
                Ok(None)
            }
        }
    }
}

impl Capture {
    /// What a replay produced, from the buffers of the plan's outputs (`computed`).
    fn produced(&self, computed: Vec<Buffer>) -> Vec<Produced<'_>> {
        self.outputs
            .iter()
            .map(|o| match o {
                Output::Computed { pos, dtype, shape } => {
                    Produced::Computed { buffer: computed[*pos].clone(), dtype: *dtype, shape }
                }
                Output::Arg(k) => Produced::Arg(*k),
                Output::Host { bytes, dtype, shape } => Produced::Host { bytes, dtype: *dtype, shape },
            })
            .collect()
    }
}

/// A tensor the function recorded and kept without returning it (stored outside, or an
/// in-place update of an argument or another tensor) would not be updated by a replay.
fn check_leaks(st: &EngineState, start: u64, out_ids: &[NodeId]) -> Result<()> {
    for id in st.graph.node_ids() {
        let n = st.graph.node(id);
        if n.seq >= start && n.value.is_none() && n.handles > 0 && !out_ids.contains(&id) {
            return Err(Error::Capture(format!(
                "the step keeps a tensor it does not return ({} {} {}: stored outside the function, or an \
                 in-place update); a replay would not update it, so return it as an output",
                n.op.name(),
                n.shape,
                n.dtype
            )));
        }
    }
    Ok(())
}

/// The work of the step's flush must all be recorded by the function, without events, and
/// read only the arguments and host data the function created.
fn check_work(st: &EngineState, order: &[NodeId], start: u64, arg_nodes: &[NodeId]) -> Result<()> {
    let describe = |n: &Node<Value>| format!("{} {} {}", n.op.name(), n.shape, n.dtype);
    for &id in order {
        let n = st.graph.node(id);
        if n.seq < start {
            return Err(Error::Capture(format!(
                "the step needs pending work recorded before it ({}); pass that tensor as an argument",
                describe(n)
            )));
        }
        if n.op == Op::Event {
            return Err(Error::Capture("a step cannot record user events".into()));
        }
        if matches!(n.op, Op::Collective(_)) {
            return Err(Error::Capture(format!(
                "a step cannot record collectives yet ({}); record them outside the step",
                describe(n)
            )));
        }
        for p in st.graph.in_edges(id).0 {
            let pn = st.graph.node(p);
            let created_host = pn.seq >= start && matches!(pn.value, Some(Value::Host(_)));
            if pn.value.is_some() && !arg_nodes.contains(&p) && !created_host {
                return Err(Error::Capture(format!(
                    "the step reads a tensor that is not one of its arguments ({}); a replay would reuse \
                     its value from the capture, so pass it as an argument",
                    describe(pn)
                )));
            }
        }
    }
    Ok(())
}

/// Outputs that need no work: arguments and host data; `None` for computed ones.
fn classify_outputs(
    st: &EngineState,
    out_ids: &[NodeId],
    start: u64,
    arg_nodes: &[NodeId],
) -> Result<Vec<Option<Output>>> {
    out_ids
        .iter()
        .map(|&id| {
            let n = st.graph.node(id);
            match &n.value {
                None => Ok(None),
                _ if arg_nodes.contains(&id) => {
                    Ok(Some(Output::Arg(arg_nodes.iter().position(|&a| a == id).expect("checked"))))
                }
                Some(Value::Host(bytes)) if n.seq >= start => {
                    Ok(Some(Output::Host { bytes: bytes.clone(), dtype: n.dtype, shape: n.shape.clone() }))
                }
                _ => Err(Error::Capture(format!(
                    "the step returns a value computed outside it ({} {} {}); pass it as an argument",
                    n.op.name(),
                    n.shape,
                    n.dtype
                ))),
            }
        })
        .collect()
}
