//! Flushing, second half: plan an extracted flush, execute it on the device's runtime, and
//! install its results.
//!
//! Without the engine's lock: fusion -> scheduler -> validation -> lowering (or a cached plan
//! of the same structure), then the runtime executes the schedule. Then, under the lock again,
//! kept values become ready and everything else is released. If planning or the device fails,
//! the nodes become pending again (no work is lost), donated inputs are given back unless the
//! flush freed or overwrote them, and the error goes to the reader.

use super::cache::{Plan, PlanCache, user_streams};
use super::dump::{self, ScheduleDump};
use super::env::FlushEnv;
use super::flush::{ExternalData, Extracted};
use super::{Engine, EngineState, Value, collect};
use crate::error::{Error, Result};
use crate::lock;
use braid_devices::{Buffer, Input, Job};
use braid_graph::{FlushGraph, NodeId, Op, ValueRef};
use braid_lowering::{Kernel, Lowering};
use braid_scheduler::{HazardKind, KernelId, Schedule};
use std::sync::Arc;

/// What a flush ran: its graph and its plan (a captured step keeps them to run again).
pub(crate) struct Planned {
    pub(crate) graph: Arc<FlushGraph>,
    pub(crate) schedule: Arc<Schedule>,
    pub(crate) kernels: Arc<[Arc<Kernel>]>,
}

/// The inputs of a flush as the runtime takes them, and the host data uploaded for it.
struct Inputs {
    job: Vec<Input>,
    uploaded: Vec<(NodeId, Buffer)>,
}

impl Engine {
    /// Plans and executes an extracted flush, then installs its results. A panic inside (a bug
    /// in braid) becomes an error and the flush's nodes become pending again, so nothing waits
    /// forever.
    pub(super) fn run(&self, mut ex: Extracted) -> Result<Planned> {
        let ids: Vec<NodeId> = ex.graph.nodes.iter().map(|n| n.id).collect();
        let donated: Vec<(usize, NodeId)> =
            ex.graph.externals.iter().enumerate().filter(|(_, e)| e.donated).map(|(i, e)| (i, e.id)).collect();
        let ticket = ex.ticket.clone();
        // The inputs stay here until the job takes them, so that a panic before that (a bug in
        // braid) can give donated ones back.
        let mut inputs = std::mem::take(&mut ex.externals);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.plan_and_execute(ex, &mut inputs))) {
            Ok(result) => result,
            Err(panic) => {
                let what = braid_devices::panic_message(panic.as_ref());
                let err = Error::Internal(format!("a flush panicked (a bug in braid): {what}"));
                let mut st = self.state();
                for &(i, id) in &donated {
                    if st.graph.contains(id) && matches!(st.graph.node(id).value, Some(Value::Lent)) {
                        st.graph.node_mut(id).value = Some(match inputs.get_mut(i).map(std::mem::take) {
                            Some(ExternalData::Device(buffer)) => Value::Ready(buffer),
                            _ => Value::Lost(err.to_string()),
                        });
                    }
                }
                for &id in &ids {
                    if st.graph.contains(id) && matches!(st.graph.node(id).value, Some(Value::InFlight(_))) {
                        st.graph.node_mut(id).value = None;
                        st.pending += 1;
                    }
                }
                collect(&mut st, ids);
                drop(st);
                ticket.finish(Err(err.clone()));
                Err(err)
            }
        }
    }

    fn plan_and_execute(&self, ex: Extracted, inputs: &mut Vec<ExternalData>) -> Result<Planned> {
        let _span = tracing::debug_span!(target: "braid::flush", "flush", n = ex.number, nodes = ex.graph.nodes.len())
            .entered();
        let mut graph = ex.graph;
        let auto_streams = lock(&self.settings.auto_streams).clone();
        if auto_streams.len() > 1 {
            braid_scheduler::spread_default_stream(&mut graph, &auto_streams);
        }
        if self.backend.target().copy_stream {
            braid_scheduler::transfers_to_copy_stream(&mut graph);
        }
        let env = ex.env;
        let (graph, schedule, kernels, checked) = self.plan(graph, &env);
        let label = |k: KernelId| kernel_label(&schedule, &graph, k);
        // The job takes the external buffers (moved, not cloned: a donated one must have no other
        // owner for its memory to return when the schedule frees it).
        let donated: Vec<(usize, NodeId)> = graph
            .externals
            .iter()
            .zip(inputs.iter())
            .enumerate()
            .filter(|(_, (e, data))| e.donated && matches!(data, ExternalData::Device(_)))
            .map(|(i, (e, _))| (i, e.id))
            .collect();
        let poison = self.poison_under(&env);
        let (prepared, upload_failed) = self.inputs(&graph, std::mem::take(inputs), poison);
        let mut ran = false;
        let (result, mut lent) = match (checked, upload_failed) {
            (Err(e), _) => (Err(e), held(prepared.job)),
            (_, Some(e)) => (Err(self.device_error(e)), held(prepared.job)),
            (Ok(()), None) => {
                let _s = tracing::debug_span!(target: "braid::flush", "execute", kernels = kernels.len()).entered();
                let fail_at = lock(&self.faults).fail_at.take().map(KernelId);
                let sink = self.profile_sink(&env);
                let started = std::time::Instant::now();
                let job = Job {
                    schedule: &schedule,
                    kernels: &kernels,
                    externals: prepared.job,
                    label: &label,
                    poison,
                    fail_at,
                    flush: ex.number,
                    profile: sink.as_ref(),
                };
                let (result, held) = braid_devices::runtime::execute(self.backend.as_ref(), job);
                self.keep_profile(ex.number, sink, started, &env);
                ran = true;
                (result.map_err(|e| self.device_error(e)), held)
            }
        };
        let not_run = (!ran).then(|| result.as_ref().err().map(|e| e.to_string())).flatten();
        self.publish_dump(&schedule, &graph, &kernels, ex.number, not_run, &env);

        let mut st = self.state();
        for (id, buffer) in &prepared.uploaded {
            Engine::install_upload(&mut st, *id, buffer);
        }
        let result = match result {
            Ok(outputs) => {
                install(&mut st, &graph, &schedule.outputs, outputs);
                super::collective::release_ran(&mut st, &graph);
                Ok(Planned { graph: graph.clone(), schedule: schedule.clone(), kernels: kernels.clone() })
            }
            Err(e) => {
                super::collective::abort_groups(&graph, &e);
                let overwritten = if ran { overwritten_inputs(&schedule) } else { Vec::new() };
                revert(&mut st, &graph, &donated, &mut lent, &overwritten, ex.number, &e);
                super::collective::lose_broken(&mut st, &graph, &e);
                Err(e)
            }
        };
        drop(st);
        drop(lent);
        drop(prepared.uploaded);
        ex.ticket.finish(result.as_ref().map(|_| ()).map_err(Error::clone));
        result
    }

    /// The flush's plan: a cached one of the same structure (not with a test's rewrite), or a
    /// new one (fusion, scheduling with offloads, validation, lowering), cached when valid.
    #[allow(clippy::type_complexity)]
    fn plan(
        &self,
        graph: FlushGraph,
        env: &FlushEnv,
    ) -> (Arc<FlushGraph>, Arc<Schedule>, Arc<[Arc<Kernel>]>, Result<()>) {
        let graph = Arc::new(graph);
        let fusion_on = self.fusion_under(env);
        let rewrite = lock(&self.faults).rewrite.clone();
        let budget = self.memory_budget();
        let streams = user_streams(&graph);
        let key = rewrite.is_none().then(|| PlanCache::key(&graph, fusion_on, budget, &streams));
        if let Some(plan) = key.as_ref().and_then(|k| lock(&self.plans).get(k)) {
            return (graph, plan.on_streams(&streams), plan.kernels.clone(), Ok(()));
        }
        let target = self.backend.target();
        let (mut schedule, placed) = {
            let _s = tracing::debug_span!(target: "braid::flush", "schedule").entered();
            let options = braid_fusion::Options::for_target(target, fusion_on);
            let base = braid_scheduler::plan(&graph, braid_fusion::segment(&graph, &options));
            place_offloads(&graph, base, budget, &target.cost)
        };
        schedule.memory_budget = budget;
        if let Some(rewrite) = &rewrite {
            rewrite(&mut schedule);
        }
        let schedule = Arc::new(schedule);
        let checked = placed.and_then(|()| check(&schedule, &graph, env.validate));
        let lowering = Lowering::new(&graph, &schedule.fusion);
        let kernels: Arc<[Arc<Kernel>]> = {
            let mut cache = lock(&self.plans);
            schedule
                .kernels
                .iter()
                .map(|k| cache.intern(lowering.segment(&schedule.fusion.segments[k.segment])))
                .collect()
        };
        if let (Some(k), Ok(())) = (key, &checked) {
            let plan = Arc::new(Plan { schedule: schedule.clone(), kernels: kernels.clone(), streams });
            lock(&self.plans).insert(k, plan);
        }
        (graph, schedule, kernels, checked)
    }

    /// The inputs as the runtime takes them: host data goes to the device first (those leaves
    /// then keep the device copy), except donated host data, which the device uploads when its
    /// first reader runs. Also the first upload that failed.
    fn inputs(
        &self,
        graph: &FlushGraph,
        data: Vec<ExternalData>,
        poison: bool,
    ) -> (Inputs, Option<braid_devices::DeviceError>) {
        let mut uploaded = Vec::new();
        let mut failed = None;
        let mut job = Vec::with_capacity(data.len());
        for (data, meta) in data.into_iter().zip(&graph.externals) {
            match data {
                ExternalData::Device(b) => job.push(Input::Buffer(b)),
                ExternalData::Host(bytes) if meta.on_host => job.push(Input::Upload(bytes)),
                ExternalData::Host(bytes) => match self.backend.upload(&bytes, poison) {
                    Ok(b) => {
                        uploaded.push((meta.id, b.clone()));
                        job.push(Input::Buffer(b));
                    }
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                },
                ExternalData::Taken => unreachable!("inputs are taken once"),
            }
        }
        (Inputs { job, uploaded }, failed)
    }

    /// Where the runtime records step times, when profiling is on or a trace is written.
    pub(super) fn profile_sink(&self, env: &FlushEnv) -> Option<std::sync::Mutex<Vec<braid_devices::runtime::Span>>> {
        let on = self.settings.profiling.load(std::sync::atomic::Ordering::Relaxed) || env.trace.is_some();
        on.then(|| std::sync::Mutex::new(Vec::new()))
    }

    /// Keeps flush `number`'s profile as the device's last, and appends it to the trace file.
    pub(super) fn keep_profile(
        &self,
        number: u64,
        sink: Option<std::sync::Mutex<Vec<braid_devices::runtime::Span>>>,
        started: std::time::Instant,
        env: &FlushEnv,
    ) {
        let Some(sink) = sink else { return };
        let spans = sink.into_inner().unwrap_or_else(|p| p.into_inner());
        let profile = super::profile::Profile::new(number, self.name(), spans, self.backend.memory().peak);
        if let Some(path) = env.trace.clone() {
            super::profile::append(path, self.id.0, &self.name(), &profile, started);
        }
        *lock(&self.last_profile) = Some(profile);
    }

    /// Makes a schedule that ran the device's last schedule, and writes its files under
    /// `BRAID_DUMP`.
    pub(super) fn publish_dump(
        &self,
        schedule: &Arc<Schedule>,
        graph: &Arc<FlushGraph>,
        kernels: &Arc<[Arc<Kernel>]>,
        number: u64,
        not_run: Option<String>,
        env: &FlushEnv,
    ) {
        let mut last = lock(&self.last_schedule);
        let renumbered = not_run.is_none() && last.as_mut().is_some_and(|d| d.renumber(schedule, graph, number));
        if !renumbered {
            let variants = Some((kernels.clone(), Arc::downgrade(&self.backend)));
            *last =
                Some(ScheduleDump::live(schedule.clone(), graph.clone(), number, self.name.clone(), not_run, variants));
        }
        if let Some(dir) = &env.dump {
            let dump = last.clone().expect("published above");
            drop(last);
            dump::write_files(dir, self.id, &dump);
        }
    }
}

/// The buffers of inputs that never reached the runtime, by position.
fn held(inputs: Vec<Input>) -> Vec<Option<Buffer>> {
    inputs
        .into_iter()
        .map(|i| match i {
            Input::Buffer(b) => Some(b),
            Input::Upload(_) => None,
        })
        .collect()
}

/// After a failed flush: donated inputs go back, unless the flush freed them or was to write
/// over them (it may have) before failing; the flush's nodes become pending again.
fn revert(
    st: &mut EngineState,
    graph: &FlushGraph,
    donated: &[(usize, NodeId)],
    lent: &mut [Option<Buffer>],
    overwritten: &[usize],
    number: u64,
    e: &Error,
) {
    for &(i, id) in donated {
        let buffer = lent.get_mut(i).and_then(Option::take).filter(|_| !overwritten.contains(&i));
        st.graph.node_mut(id).value = Some(match buffer {
            Some(buffer) => Value::Ready(buffer),
            None => Value::Lost(format!(
                "flush {number} was given it (nothing else read it any more), freed or overwrote it, and then failed: {e}"
            )),
        });
    }
    for n in &graph.nodes {
        st.graph.node_mut(n.id).value = None;
    }
    st.pending += graph.nodes.len();
    let ids: Vec<NodeId> = graph.nodes.iter().map(|n| n.id).collect();
    collect(st, ids);
}

/// The flush inputs (external positions) that a kernel of `schedule` writes over in place.
fn overwritten_inputs(schedule: &Schedule) -> Vec<usize> {
    let mut inputs = Vec::new();
    for k in &schedule.kernels {
        let seg = &schedule.fusion.segments[k.segment];
        for &(_, i) in &k.in_place {
            if let ValueRef::External(e) = seg.inputs[i] {
                inputs.push(e);
            }
        }
    }
    inputs
}

/// Describes kernel `k` for logs and errors: its ops and recorded nodes.
pub(super) fn kernel_label(schedule: &Schedule, graph: &FlushGraph, k: KernelId) -> String {
    let seg = &schedule.fusion.segments[schedule.kernels[k.index()].segment];
    let ops: Vec<&str> = seg.nodes.iter().map(|&n| graph.nodes[n].op.name()).collect();
    let nodes: Vec<String> = seg.nodes.iter().map(|&n| format!("n{}", graph.nodes[n].id.index())).collect();
    format!("{k} {} [{}]", ops.join("+"), nodes.join(" "))
}

/// Adds offloads to a schedule planned without them: to keep it under the device's memory
/// budget, and for values with `offload_hint`. When the budget cannot be met, the schedule is
/// returned as it was with the error (it is dumped, not run).
fn place_offloads(
    graph: &FlushGraph,
    base: Schedule,
    budget: Option<u64>,
    cost: &braid_graph::CostModel,
) -> (Schedule, Result<()>) {
    let hinted = graph.nodes.iter().any(|n| n.offload_hint);
    if !hinted && budget.is_none() {
        return (base, Ok(()));
    }
    match braid_scheduler::offload::choose(graph, &base, budget, cost) {
        Ok(decisions) => (braid_scheduler::plan_with_offloads(graph, base, &decisions), Ok(())),
        Err(u) => {
            let at = match u.at {
                braid_scheduler::PeakAt::Kernel(k) => {
                    let plan = &base.kernels[k.index()];
                    let seg = &base.fusion.segments[plan.segment];
                    let ops: Vec<&str> = seg.nodes.iter().map(|&n| graph.nodes[n].op.name()).collect();
                    format!("kernel {k} ({}) on stream {}", ops.join("+"), plan.stream.0)
                }
                braid_scheduler::PeakAt::Start => {
                    "the start of the flush (its inputs, computed earlier, are all in device memory)".to_string()
                }
                braid_scheduler::PeakAt::End => "the end of the flush (the inputs it does not free and every value \
                                                 that outlives it, which offloading cannot move)"
                    .to_string(),
            };
            let err = Error::MemoryBudget { budget: budget.unwrap_or(u64::MAX), min_peak: u.min_peak, at };
            (base, Err(err))
        }
    }
}

/// Checks a schedule before it runs: fully (every hazard) in debug builds or with
/// `BRAID_VALIDATE=1`; otherwise only that every wait can be satisfied, so that a bad schedule
/// is an error and never a hang.
fn check(schedule: &Schedule, graph: &FlushGraph, validate: bool) -> Result<()> {
    let full = cfg!(debug_assertions) || validate;
    let hazards = if full {
        braid_scheduler::validate(schedule, graph).err().unwrap_or_default()
    } else {
        braid_scheduler::check_reachable(schedule, graph).err().into_iter().collect()
    };
    match hazards.first() {
        None => Ok(()),
        Some(h) if h.kind == HazardKind::Deadlock => Err(Error::Deadlock(h.to_string())),
        Some(_) => Err(Error::InvalidSchedule(hazards.iter().map(|h| h.to_string()).collect::<Vec<_>>().join("; "))),
    }
}

/// Kept values become ready; every other node of the flush leaves the graph; nodes of the
/// flush no longer need their inputs.
fn install(
    st: &mut EngineState,
    graph: &FlushGraph,
    outputs: &[(usize, braid_scheduler::BufferId)],
    buffers: Vec<Buffer>,
) {
    for (&(i, _), buffer) in outputs.iter().zip(buffers) {
        st.graph.node_mut(graph.nodes[i].id).value = Some(Value::Ready(buffer));
    }
    let mut candidates: Vec<NodeId> = Vec::with_capacity(graph.nodes.len());
    let mut events_reached = false;
    // Readers first: a node left pending is seen before the nodes it is computed from.
    for n in graph.nodes.iter().rev() {
        if n.keep {
            if n.op == Op::Event {
                st.graph.node_mut(n.id).value = Some(Value::Done);
                events_reached = true;
            }
            candidates.extend(st.graph.detach_inputs(n.id));
            // Its tensor may have been dropped while it was computed.
            candidates.push(n.id);
        } else if super::superseded::lose_if_freed(st, n.id) {
            // Saved for a backward pass that reads it from elsewhere: gone, its inputs free.
            candidates.extend(st.graph.detach_inputs(n.id));
            candidates.push(n.id);
        } else if !matches!(n.op, Op::Collective(_))
            && (st.graph.node(n.id).handles > 0
                || st.graph.data_successors(n.id).any(|s| st.graph.node(s).value.is_none()))
        {
            // A view a tensor names, a value autograd saved, or a node one of those is computed
            // from, left pending by the flush (`flush::lazy_views`, `recompute`; a node without
            // an output has no other handle, and no other pending reader once the flush's
            // readers are installed): computed if it is ever read.
            st.graph.node_mut(n.id).value = None;
            st.pending += 1;
        } else {
            // Removing the node removes its edges: a node only ordered before a pending one (a
            // user event recorded while this flush ran, the next collective) has run, which is
            // all that order asks. A collective that ran is never left pending (it cannot run
            // again on one rank): the flush kept it if anything left pending reads it.
            candidates.extend(st.graph.predecessors(n.id));
            st.graph.remove(n.id);
        }
    }
    collect(st, candidates);
    if events_reached && !st.waits.is_empty() {
        st.forget_reached_waits();
    }
}
