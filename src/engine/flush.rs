//! Flushing: pick the pending subgraph a read needs, plan it, run it, install the results.
//!
//! The pipeline of a flush: walk back from the requested nodes through pending inputs (under
//! the graph lock), mark them in flight, then without the lock: fusion -> scheduler -> lowering
//! -> device. Then, under the lock again, kept values become ready and everything else is
//! released. If the device fails, the nodes become pending again (no work is lost) and the
//! error goes to the reader.

use super::cache::{Plan, PlanCache};
use super::marks::Marks;
use super::{State, Ticket, Value, collect, device_error, state};
use crate::device::{Device, lock};
use crate::dump::{self, ScheduleDump};
use crate::error::{Error, Result};
use braid_devices::{Buffer, Input, Job};
use braid_graph::{DeviceId, External, FlushGraph, FlushNode, NodeId, Op, ValueRef};
use braid_lowering::{Kernel, Lowering};
use braid_scheduler::{HazardKind, KernelId, Schedule};
use smallvec::SmallVec;
use std::sync::Arc;

/// An input of a flush that exists before it: on the device already, or host data to upload
/// (`Taken` once the job has it).
#[derive(Default)]
pub(super) enum ExternalData {
    Device(Buffer),
    Host(Arc<[u8]>),
    #[default]
    Taken,
}

/// What one flush took out of the graph.
pub(super) struct Extracted {
    pub(super) graph: FlushGraph,
    pub(super) externals: Vec<ExternalData>,
    device: Device,
    ticket: Arc<Ticket>,
    number: u64,
}

/// Computes the pending nodes among `targets` and everything pending they need; waits for
/// work other threads already started. Returns once the values are ready.
pub(crate) fn flush_nodes(targets: &[NodeId]) -> Result<()> {
    super::capture::refuse_while_capturing("a flush or sync")?;
    let mut lost_target: Option<String> = None;
    loop {
        let mut st = state();
        let (order, waits, lost) = walk(&mut st, targets);
        // Pending work that needs a lost value can never run: it is lost too (its readers get
        // the reason); everything else still runs.
        for (id, reason) in lost {
            if targets.contains(&id) && lost_target.is_none() {
                lost_target = Some(reason.clone());
            }
            st.graph.node_mut(id).value = Some(Value::Lost(reason));
            st.pending -= 1;
        }
        for &t in targets {
            if lost_target.is_none()
                && st.graph.contains(t)
                && let Some(Value::Lost(reason)) = &st.graph.node(t).value
            {
                lost_target = Some(reason.clone());
            }
        }
        if !waits.is_empty() {
            drop(st);
            for t in waits {
                // Failed work reverts to pending and is picked up by the next walk.
                let _ = t.wait();
            }
            continue;
        }
        if order.is_empty() {
            return lost_target.map_or(Ok(()), |r| Err(Error::ValueLost(r)));
        }
        // One device per flush: take the longest prefix of the (topological) order that runs on
        // the first node's device; a prefix has all its inputs computed or inside it. What
        // remains is flushed by the next round.
        let device = st.graph.node(order[0]).device;
        let prefix = order.iter().position(|&id| st.graph.node(id).device != device).unwrap_or(order.len());
        let rest = prefix < order.len();
        let extracted = extract(&mut st, &order[..prefix]);
        drop(st);
        run(extracted)?;
        if !rest {
            return lost_target.map_or(Ok(()), |r| Err(Error::ValueLost(r)));
        }
    }
}

/// Flushes everything pending (on `device`, or everywhere) and waits for work in flight there.
pub(crate) fn flush_device(device: Option<DeviceId>) -> Result<()> {
    let on = |d: DeviceId| device.is_none_or(|x| x == d);
    let (targets, tickets): (Vec<NodeId>, Vec<Arc<Ticket>>) = {
        let st = state();
        let mut targets = Vec::new();
        let mut tickets = Vec::new();
        for id in st.graph.node_ids() {
            let n = st.graph.node(id);
            if !on(n.device) {
                continue;
            }
            match &n.value {
                None => targets.push(id),
                Some(Value::InFlight(t)) => tickets.push(t.clone()),
                Some(Value::Ready(_) | Value::Host(_) | Value::Done | Value::Lent | Value::Lost(_)) => {}
            }
        }
        (targets, tickets)
    };
    let result = flush_nodes(&targets);
    for t in tickets {
        let _ = t.wait();
    }
    result
}

/// Pending nodes needed by `targets`, inputs first; tickets of in-flight inputs; and the pending
/// nodes that need a lost value (directly or through other pending nodes), with the reason,
/// which are left out of the order.
pub(super) type Walked = (Vec<NodeId>, Vec<Arc<Ticket>>, Vec<(NodeId, String)>);

pub(super) fn walk(st: &mut State, targets: &[NodeId]) -> Walked {
    let State { graph, marks, .. } = st;
    marks.start(graph.node_bound());
    let mut order = Vec::new();
    let mut waits: Vec<Arc<Ticket>> = Vec::new();
    let mut lost: Vec<(NodeId, String)> = Vec::new();
    let mut stack: Vec<(NodeId, bool)> = Vec::new();
    for &t in targets {
        match graph.contains(t).then(|| &graph.node(t).value) {
            Some(None) => stack.push((t, false)),
            Some(Some(Value::InFlight(ticket))) => waits.push(ticket.clone()),
            _ => {}
        }
    }
    while let Some((id, expanded)) = stack.pop() {
        if expanded {
            // Inputs are finished first (post-order), so their lost status is known.
            let reason = graph.predecessors(id).find_map(|p| match &graph.node(p).value {
                Some(Value::Lost(r)) => Some(r.clone()),
                None if marks.get(p) == Some(Marks::LOST) => lost.iter().find(|(l, _)| *l == p).map(|(_, r)| r.clone()),
                _ => None,
            });
            match reason {
                Some(r) => {
                    marks.set(id, Marks::LOST);
                    lost.push((id, r));
                }
                None => order.push(id),
            }
            continue;
        }
        if marks.get(id).is_some() {
            continue;
        }
        marks.set(id, Marks::VISITED);
        stack.push((id, true));
        for p in graph.predecessors(id) {
            // Ready values and host data are inputs of the flush; pending ones join it.
            match &graph.node(p).value {
                None if marks.get(p).is_none() => stack.push((p, false)),
                Some(Value::InFlight(t)) if !waits.iter().any(|w| Arc::ptr_eq(w, t)) => waits.push(t.clone()),
                _ => {}
            }
        }
    }
    // Recording order: a topological order, and each stream's program order.
    order.sort_unstable_by_key(|&id| graph.node(id).seq);
    (order, waits, lost)
}

/// Builds the flush graph of `order` and marks its nodes in flight.
pub(super) fn extract(st: &mut State, order: &[NodeId]) -> Extracted {
    let State { graph: recorded, marks, .. } = st;
    // Each node's place in the flush graph (the walk's marks, same stamp); nodes the walk
    // visited outside `order` keep a mark that is no place.
    for (i, &id) in order.iter().enumerate() {
        marks.set(id, i as u32);
    }
    let device_id = recorded.node(order[0]).device;
    let device = Device::by_id(device_id);
    let budgeted = device.memory_budget().is_some();
    let mut graph = FlushGraph { nodes: Vec::with_capacity(order.len()), externals: Vec::new() };
    let mut externals = Vec::new();
    for &id in order {
        let n = recorded.node(id);
        let (data, control) = recorded.in_edges(id);
        let mut inputs: SmallVec<[ValueRef; 2]> = SmallVec::new();
        for p in data {
            if let Some(place) = marks.place(p) {
                inputs.push(place);
                continue;
            }
            let e = graph.externals.len();
            marks.set(p, Marks::EXTERNAL + e as u32);
            let pn = recorded.node(p);
            // A value that no tensor names and that only this flush reads (an old version of a
            // parameter, above all) is handed to the flush, which frees it after its last
            // reader or writes a new version over it in place (host data: its upload; the host
            // copy stays in the graph). What the flush frees or overwrites is lost if the flush
            // fails; nothing outside the flush could read it any more. (A download started
            // before, or a view, holds the buffer too: then it is not handed over.)
            let donated = pn.handles == 0
                && pn.device == device_id
                && match &pn.value {
                    Some(Value::Ready(buffer)) => !buffer.is_shared(),
                    Some(Value::Host(_)) => true,
                    _ => false,
                }
                && recorded.successors(p).all(|s| marks.node_place(s).is_some());
            externals.push(match &pn.value {
                Some(Value::Ready(buffer)) => ExternalData::Device(buffer.clone()),
                Some(Value::Host(bytes)) => ExternalData::Host(bytes.clone()),
                _ => unreachable!("walk waits for in-flight inputs and takes pending ones"),
            });
            graph.externals.push(External {
                id: p,
                dtype: pn.dtype,
                shape: pn.shape.clone(),
                device: pn.device,
                stream: pn.stream,
                donated,
                on_host: donated && matches!(pn.value, Some(Value::Host(_))),
                persistent: matches!(&pn.value, Some(Value::Ready(b)) if b.is_persistent()),
                overwritable: donated && matches!(pn.value, Some(Value::Ready(_))) && !budgeted,
            });
            inputs.push(ValueRef::External(e));
        }
        let after = control.into_iter().filter_map(|p| marks.node_place(p)).collect();
        let keep = n.handles > 0 || recorded.successors(id).any(|s| marks.node_place(s).is_none());
        graph.nodes.push(FlushNode {
            id,
            op: n.op.clone(),
            dtype: n.dtype,
            shape: n.shape.clone(),
            device: n.device,
            stream: n.stream,
            inputs,
            after,
            keep,
            offload_hint: n.offload_hint,
            persistent: n.persistent,
        });
    }
    let ticket = Arc::new(Ticket::default());
    for &id in order {
        recorded.node_mut(id).value = Some(Value::InFlight(ticket.clone()));
    }
    // The flush owns donated device buffers now (the graph keeps no clone, so freeing returns
    // memory).
    for e in graph.externals.iter().filter(|e| e.donated) {
        if matches!(recorded.node(e.id).value, Some(Value::Ready(_))) {
            recorded.node_mut(e.id).value = Some(Value::Lent);
        }
    }
    st.pending -= order.len();
    st.flushes += 1;
    debug_assert!(graph.is_topological());
    Extracted { graph, externals, device, ticket, number: st.flushes }
}

/// What a flush ran: its graph and its plan (a captured step keeps them to run again).
pub(crate) struct Planned {
    pub(crate) graph: Arc<FlushGraph>,
    pub(crate) schedule: Arc<Schedule>,
    pub(crate) kernels: Arc<[Arc<Kernel>]>,
}

/// Plans and executes an extracted flush, then installs its results. A panic inside (a bug in
/// braid) becomes an error and the flush's nodes become pending again, so nothing waits forever.
pub(super) fn run(mut ex: Extracted) -> Result<Planned> {
    let ids: Vec<NodeId> = ex.graph.nodes.iter().map(|n| n.id).collect();
    let donated: Vec<(usize, NodeId)> =
        ex.graph.externals.iter().enumerate().filter(|(_, e)| e.donated).map(|(i, e)| (i, e.id)).collect();
    let ticket = ex.ticket.clone();
    // The inputs stay here until the job takes them, so that a panic before that (a bug in
    // braid) can give donated ones back.
    let mut inputs = std::mem::take(&mut ex.externals);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_inner(ex, &mut inputs))) {
        Ok(result) => result,
        Err(panic) => {
            let what = braid_devices::panic_message(panic.as_ref());
            let err = Error::Internal(format!("a flush panicked (a bug in braid): {what}"));
            let mut st = state();
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

fn run_inner(ex: Extracted, inputs: &mut Vec<ExternalData>) -> Result<Planned> {
    let _span =
        tracing::debug_span!(target: "braid::flush", "flush", n = ex.number, nodes = ex.graph.nodes.len()).entered();
    let mut graph = ex.graph;
    let auto_streams = ex.device.auto_stream_ids();
    if auto_streams.len() > 1 {
        braid_scheduler::spread_default_stream(&mut graph, &auto_streams);
    }
    let graph = Arc::new(graph);
    let fusion_on = ex.device.fusion_enabled();
    let hook = lock(&ex.device.0.schedule_hook).clone();
    // A structurally identical flush reuses its validated plan (not with a test hook).
    let budget = ex.device.memory_budget();
    let key = hook.is_none().then(|| PlanCache::key(&graph, fusion_on, budget));
    let cached = key.as_ref().and_then(|k| lock(&ex.device.0.plans).get(k));
    let (schedule, kernels, checked) = match cached {
        Some(plan) => (plan.schedule.clone(), plan.kernels.clone(), Ok(())),
        None => {
            let (mut schedule, placed) = {
                let _s = tracing::debug_span!(target: "braid::flush", "schedule").entered();
                let options = braid_fusion::Options { enabled: fusion_on, ..Default::default() };
                let base = braid_scheduler::plan(&graph, braid_fusion::segment(&graph, &options));
                place_offloads(&graph, base, budget, &ex.device)
            };
            if let Some(hook) = &hook {
                hook(&mut schedule);
            }
            let schedule = Arc::new(schedule);
            let checked = placed.and_then(|()| check(&schedule, &graph));
            let lowering = Lowering::new(&graph, &schedule.fusion);
            let kernels: Arc<[Arc<Kernel>]> = {
                let mut cache = lock(&ex.device.0.plans);
                schedule
                    .kernels
                    .iter()
                    .map(|k| cache.intern(lowering.segment(&schedule.fusion.segments[k.segment])))
                    .collect()
            };
            if let (Some(k), Ok(())) = (key, &checked) {
                let plan = Arc::new(Plan { schedule: schedule.clone(), kernels: kernels.clone() });
                lock(&ex.device.0.plans).insert(k, plan);
            }
            (schedule, kernels, checked)
        }
    };
    let label = |k: KernelId| kernel_label(&schedule, &graph, k);
    // Host data goes to the device first; those leaves then keep the device copy.
    let backend = &ex.device.0.backend;
    let poison = ex.device.poison_enabled();
    let mut uploaded: Vec<(NodeId, Buffer)> = Vec::new();
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
    let mut upload_failed = None;
    let mut job_inputs: Vec<Option<Input>> = std::mem::take(inputs)
        .into_iter()
        .zip(&graph.externals)
        .map(|(data, meta)| match data {
            ExternalData::Device(b) => Some(Input::Buffer(b)),
            // Donated host data: the device uploads it when its first reader runs.
            ExternalData::Host(bytes) if meta.on_host => Some(Input::Upload(bytes)),
            ExternalData::Host(bytes) => match backend.upload(&bytes, poison) {
                Ok(b) => {
                    uploaded.push((meta.id, b.clone()));
                    Some(Input::Buffer(b))
                }
                Err(e) => {
                    upload_failed.get_or_insert(e);
                    None
                }
            },
            ExternalData::Taken => unreachable!("inputs are taken once"),
        })
        .collect();
    let as_lent = |inputs: Vec<Option<Input>>| -> Vec<Option<Buffer>> {
        inputs
            .into_iter()
            .map(|i| match i {
                Some(Input::Buffer(b)) => Some(b),
                _ => None,
            })
            .collect()
    };
    let mut lent: Vec<Option<Buffer>>;
    let mut ran = false;
    let result = match (checked, upload_failed) {
        (Err(e), _) => {
            lent = as_lent(std::mem::take(&mut job_inputs));
            Err(e)
        }
        (_, Some(e)) => {
            lent = as_lent(std::mem::take(&mut job_inputs));
            Err(device_error(&ex.device, e))
        }
        (Ok(()), None) => {
            let _s = tracing::debug_span!(target: "braid::flush", "execute", kernels = kernels.len()).entered();
            let externals = std::mem::take(&mut job_inputs).into_iter().map(|i| i.expect("uploaded")).collect();
            let fail_at = lock(&ex.device.0.fail_at).take().map(KernelId);
            let job = Job { schedule: &schedule, kernels: &kernels, externals, label: &label, poison, fail_at };
            let (result, held) = backend.execute(job);
            lent = held;
            ran = true;
            result.map_err(|e| device_error(&ex.device, e))
        }
    };
    publish_dump(&ex.device, &schedule, &graph, ex.number);

    let mut st = state();
    for (id, buffer) in &uploaded {
        super::install_upload(&mut st, *id, buffer);
    }
    drop(uploaded);
    let result = match result {
        Ok(outputs) => {
            install(&mut st, &graph, &schedule.outputs, outputs);
            Ok(Planned { graph: graph.clone(), schedule: schedule.clone(), kernels: kernels.clone() })
        }
        Err(e) => {
            // Donated inputs go back, unless the flush freed them or was to write over them
            // (it may have) before failing.
            let overwritten = if ran { overwritten_inputs(&schedule) } else { Vec::new() };
            for &(i, id) in &donated {
                let buffer = lent.get_mut(i).and_then(Option::take).filter(|_| !overwritten.contains(&i));
                st.graph.node_mut(id).value = Some(match buffer {
                    Some(buffer) => Value::Ready(buffer),
                    None => Value::Lost(format!(
                        "flush {} was given it (nothing else read it any more), freed or overwrote it, and then failed: {e}",
                        ex.number
                    )),
                });
            }
            for n in &graph.nodes {
                st.graph.node_mut(n.id).value = None;
            }
            st.pending += graph.nodes.len();
            let ids: Vec<NodeId> = graph.nodes.iter().map(|n| n.id).collect();
            collect(&mut st, ids);
            Err(e)
        }
    };
    drop(st);
    drop(lent);
    ex.ticket.finish(result.as_ref().map(|_| ()).map_err(Error::clone));
    result
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

/// Makes a schedule that ran the device's last schedule, and writes its files under
/// `BRAID_DUMP`.
pub(super) fn publish_dump(device: &Device, schedule: &Arc<Schedule>, graph: &Arc<FlushGraph>, number: u64) {
    let dump = ScheduleDump::live(schedule.clone(), graph.clone(), number, device.name());
    if let Some(dir) = dump::dir() {
        dump::write_files(&dir, &dump);
    }
    *lock(&device.0.last_schedule) = Some(dump);
}

/// Adds offloads to a schedule planned without them: to keep it under the device's memory
/// budget, and for values with `offload_hint`. When the budget cannot be met, the schedule is
/// returned as it was with the error (it is dumped, not run).
fn place_offloads(graph: &FlushGraph, base: Schedule, budget: Option<u64>, device: &Device) -> (Schedule, Result<()>) {
    let hinted = graph.nodes.iter().any(|n| n.offload_hint);
    if !hinted && budget.is_none() {
        return (base, Ok(()));
    }
    match braid_scheduler::offload::choose(graph, &base, budget, &device.0.backend.cost_model()) {
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
fn check(schedule: &Schedule, graph: &FlushGraph) -> Result<()> {
    let full = cfg!(debug_assertions) || std::env::var("BRAID_VALIDATE").is_ok_and(|v| v == "1");
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
fn install(st: &mut State, graph: &FlushGraph, outputs: &[(usize, braid_scheduler::BufferId)], buffers: Vec<Buffer>) {
    for (&(i, _), buffer) in outputs.iter().zip(buffers) {
        st.graph.node_mut(graph.nodes[i].id).value = Some(Value::Ready(buffer));
    }
    let mut candidates: Vec<NodeId> = Vec::with_capacity(graph.nodes.len());
    for n in &graph.nodes {
        if n.keep {
            if n.op == Op::Event {
                st.graph.node_mut(n.id).value = Some(Value::Done);
            }
            candidates.extend(st.graph.detach_inputs(n.id));
            // Its tensor may have been dropped while it was computed.
            candidates.push(n.id);
        } else {
            // Removing the node removes its edges.
            candidates.extend(st.graph.predecessors(n.id));
            st.graph.remove(n.id);
        }
    }
    collect(st, candidates);
}
