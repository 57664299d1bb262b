//! Flushing, first half: pick the pending subgraph a read needs and take it out of the graph.
//!
//! Under the engine's lock, the walk goes back from the requested nodes through pending inputs
//! (taking along a pending companion that costs nothing beside a node it takes: [`companion`]);
//! values of other devices it meets (remote leaves) are fetched from their engines first,
//! without this lock. Then `extract` builds the flush graph, marks its nodes in flight and
//! hands donated inputs to the flush; `run` (without the lock) plans and executes it.

use super::env::FlushEnv;
use super::marks::Marks;
use super::{Engine, EngineState, Ticket, Value};
use crate::error::{Error, Result};
use braid_devices::Buffer;
use braid_graph::{External, FlushGraph, FlushNode, NodeId, Op, ValueRef};
use hashbrown::HashSet;
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
    pub(super) ticket: Arc<Ticket>,
    pub(super) number: u64,
    /// The `BRAID_*` settings it runs with.
    pub(super) env: FlushEnv,
}

/// What the walk found: pending nodes needed by the targets, inputs first; tickets of in-flight
/// inputs; the pending nodes that need a lost value (directly or through other pending nodes),
/// with the reason, which are left out of the order; and remote leaves to resolve first.
pub(super) struct Walked {
    pub(super) order: Vec<NodeId>,
    pub(super) waits: Vec<Arc<Ticket>>,
    pub(super) lost: Vec<(NodeId, String)>,
    pub(super) remotes: Vec<NodeId>,
}

impl Engine {
    /// Computes the pending nodes among `targets` and everything pending they need; waits for
    /// work other threads already started. Returns once the values are ready.
    pub(crate) fn flush_nodes(&self, targets: &[NodeId]) -> Result<()> {
        self.flush_reading(targets, targets)
    }

    /// [`Self::flush_nodes`], where `read_out` are the targets read out of the flush (by a
    /// read, or a caller that needs them computed): only those a backward pass's copies
    /// (`recompute_copies`) must leave computed. A sync names every pending node a target
    /// but reads none of them out: the values autograd saved are still free to be copied.
    fn flush_reading(&self, targets: &[NodeId], read_out: &[NodeId]) -> Result<()> {
        super::capture::refuse_while_capturing("a flush or sync")?;
        // A variable braid does not understand fails the read before anything is taken out.
        let env = super::env::FlushEnv::for_flush()?;
        let mut lost_target: Option<String> = None;
        loop {
            let mut st = self.state();
            let walked = walk(&mut st, targets);
            // Pending work that needs a lost value can never run: it is lost too (its readers
            // get the reason); everything else still runs.
            for (id, reason) in walked.lost {
                if targets.contains(&id) && lost_target.is_none() {
                    lost_target = Some(reason.clone());
                }
                st.graph.node_mut(id).value = Some(Value::Lost(reason));
                st.pending -= 1;
                super::collective::release_lost(&mut st, id);
            }
            for &t in targets {
                if lost_target.is_none()
                    && st.graph.contains(t)
                    && let Some(Value::Lost(reason)) = &st.graph.node(t).value
                {
                    lost_target = Some(reason.clone());
                }
            }
            if !walked.remotes.is_empty() {
                drop(st);
                self.resolve_remotes(&walked.remotes)?;
                continue;
            }
            if !walked.waits.is_empty() {
                drop(st);
                for t in walked.waits {
                    // Failed work reverts to pending and is picked up by the next walk.
                    let _ = t.wait();
                }
                continue;
            }
            if walked.order.is_empty() {
                return lost_target.map_or(Ok(()), |r| Err(Error::ValueLost(r)));
            }
            // A backward pass flushed with its forward pass: saved values copied for it change
            // the flush's nodes, so walk again.
            if self.recompute_under(&env)
                && super::recompute_copies::copy_for_backward(&mut st, &walked.order, read_out)
            {
                continue;
            }
            let extracted = self.extract(&mut st, &walked.order, Some(targets), env);
            drop(st);
            self.run(extracted)?;
            return lost_target.map_or(Ok(()), |r| Err(Error::ValueLost(r)));
        }
    }

    /// Flushes everything pending here and waits for work in flight here.
    pub(crate) fn flush_all(&self) -> Result<()> {
        let (targets, tickets): (Vec<NodeId>, Vec<Arc<Ticket>>) = {
            let st = self.state();
            let mut targets = Vec::with_capacity(st.pending.min(4096));
            let mut tickets = Vec::new();
            for id in st.graph.node_ids() {
                match &st.graph.node(id).value {
                    None => targets.push(id),
                    Some(Value::InFlight(t)) => tickets.push(t.clone()),
                    Some(_) => {}
                }
            }
            (targets, tickets)
        };
        let result = self.flush_reading(&targets, &[]);
        for t in tickets {
            let _ = t.wait();
        }
        result
    }

    /// Fetches the values (and waits for the events) of other devices that remote leaves
    /// stand for, without this engine's lock. A failure there is this read's failure.
    fn resolve_remotes(&self, leaves: &[NodeId]) -> Result<()> {
        for &leaf in leaves {
            let (source, node, event) = {
                let st = self.state();
                match st.graph.contains(leaf).then(|| &st.graph.node(leaf).value) {
                    Some(Some(Value::Remote(r))) if !r.resolved() => (r.source.clone(), r.node, r.event),
                    _ => continue, // resolved meanwhile by another thread
                }
            };
            let fetched = if event {
                source.complete(node)?;
                None
            } else {
                Some(source.materialize(|| node)?)
            };
            let mut st = self.state();
            if let Some(Some(Value::Remote(r))) =
                st.graph.contains(leaf).then(|| st.graph.node_mut(leaf).value.as_mut())
                && !r.resolved()
            {
                r.reached = event;
                r.fetched = fetched;
                // Resolved: the handle on the source node is no longer needed.
                let release = (r.source.clone(), r.node);
                st.deferred.push(release);
            }
        }
        Ok(())
    }

    /// Builds the flush graph of `order` and marks its nodes in flight. With the flush's
    /// `targets`, views that stay pending are chosen (see [`lazy_views`]).
    pub(super) fn extract(
        &self,
        st: &mut EngineState,
        order: &[NodeId],
        targets: Option<&[NodeId]>,
        env: FlushEnv,
    ) -> Extracted {
        let budgeted = self.memory_budget().is_some();
        let target = self.backend.target();
        // Each node's place in the flush graph (the walk's marks, same stamp); nodes the walk
        // visited outside `order` keep a mark that is no place.
        for (i, &id) in order.iter().enumerate() {
            st.marks.set(id, i as u32);
        }
        let (mut lazy, recompute, superseded) = match targets {
            Some(t) if t.len() <= LAZY_VIEW_TARGETS => {
                let superseded = super::superseded::candidates(st, order, t);
                let recompute = if self.recompute_under(&env) {
                    super::recompute::choose(st, order, t, |id| st.marks.node_place(id).is_some(), &superseded)
                } else {
                    Default::default()
                };
                (lazy_views(st, order, t), recompute, superseded)
            }
            _ => (HashSet::new(), Default::default(), HashSet::new()),
        };
        lazy.extend(recompute.pending.iter().copied());
        // Saved values the backward pass reads from elsewhere: freed after their last reader.
        let superseded = super::superseded::settle(st, superseded, &lazy, |id| st.marks.node_place(id).is_some());
        super::superseded::note(&mut st.superseded, &st.graph, order, &superseded);
        let EngineState { graph: recorded, marks, backward_marks, recomputing, .. } = st;
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
                // before, or a view, holds the buffer too: then it is not handed over. Another
                // device's value is never handed over.)
                let donated = pn.handles == 0
                    && match &pn.value {
                        Some(Value::Ready(buffer)) => !buffer.is_shared(),
                        Some(Value::Host(_)) => true,
                        _ => false,
                    }
                    && recorded.successors(p).all(|s| marks.node_place(s).is_some() && !lazy.contains(&s));
                // Another device's value stays in that device's memory: copied by a transfer
                // (remote), or read where it is (foreign); either way not this device's to count.
                let (data, device, remote, foreign) = match &pn.value {
                    Some(Value::Ready(buffer)) => (ExternalData::Device(buffer.clone()), pn.device, false, false),
                    Some(Value::Host(bytes)) => (ExternalData::Host(bytes.clone()), pn.device, false, false),
                    Some(Value::Remote(r)) => {
                        let buffer = r.fetched.clone().expect("the walk resolves remote leaves first");
                        let in_place = target.reads_in_place(buffer.memory_kind());
                        (ExternalData::Device(buffer), r.source.id, !in_place, in_place)
                    }
                    _ => unreachable!("walk waits for in-flight inputs and takes pending ones"),
                };
                // Left in host memory by an earlier flush's offload: copied in before its first reader.
                let offloaded = matches!(&data, ExternalData::Device(b) if b.is_offloaded()) && !remote && !foreign;
                externals.push(data);
                graph.externals.push(External {
                    id: p,
                    dtype: pn.dtype,
                    shape: pn.shape.clone(),
                    device,
                    stream: pn.stream,
                    donated,
                    on_host: donated && matches!(pn.value, Some(Value::Host(_))),
                    offloaded,
                    persistent: matches!(&pn.value, Some(Value::Ready(b)) if b.is_persistent()),
                    overwritable: donated
                        && matches!(&pn.value, Some(Value::Ready(b)) if !b.is_offloaded())
                        && !budgeted,
                    remote,
                    foreign,
                });
                inputs.push(ValueRef::External(e));
            }
            let after = crate::small(control.into_iter().filter_map(|p| marks.node_place(p)));
            // A collective holds a handle on itself until it ran (`collective.rs`): that one
            // makes it run, it does not keep its value past the flush.
            let held = n.handles > super::collective::own_handles(&n.op) && !superseded.contains(&id);
            let keep = recompute.kept.contains(&id)
                || !lazy.contains(&id) && (held || recorded.successors(id).any(|s| marks.node_place(s).is_none()));
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
                recomputed: recomputing.get(&id) == Some(&n.seq)
                    || super::recompute_copies::is_copy(backward_marks, n.seq),
            });
        }
        keep_collectives_read_later(&mut graph, recorded, marks, &lazy);
        // This flush computes its recomputed nodes; it leaves others pending for that.
        recomputing.retain(|&id, &mut seq| {
            recorded.contains(id) && {
                let n = recorded.node(id);
                n.seq == seq && n.value.is_none() && marks.node_place(id).is_none()
            }
        });
        recomputing.extend(recompute.pending.iter().map(|&id| (id, recorded.node(id).seq)));
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
        Extracted { graph, externals, ticket, number: st.flushes, env }
    }
}

/// Keeps every collective of the flush that a node the flush leaves pending reads, directly or
/// through other nodes left pending: that node is computed again if it is ever read, and a
/// collective cannot run again on one rank. (Other collectives nobody names are freed after
/// their last reader: their own handle only makes them run.) The flush graph is in recording
/// order, so a node's readers come after it and one backward pass decides.
fn keep_collectives_read_later(
    graph: &mut FlushGraph,
    recorded: &braid_graph::Graph<Value>,
    marks: &super::marks::Marks,
    lazy: &HashSet<NodeId>,
) {
    if !graph.nodes.iter().any(|n| !n.keep && matches!(n.op, Op::Collective(_))) {
        return;
    }
    // Whether the node at each place is pending after the flush (left pending, or not kept and
    // read by such a node).
    let mut pending_after = vec![false; graph.nodes.len()];
    for i in (0..graph.nodes.len()).rev() {
        let id = graph.nodes[i].id;
        let read_later = recorded.data_successors(id).any(|s| marks.node_place(s).is_some_and(|j| pending_after[j]));
        if matches!(graph.nodes[i].op, Op::Collective(_)) {
            graph.nodes[i].keep |= read_later;
            continue;
        }
        pending_after[i] = lazy.contains(&id) || (!graph.nodes[i].keep && read_later);
    }
}

/// Reads with at most this many targets leave views pending ([`lazy_views`]); a sync (every
/// pending node a target) computes everything.
const LAZY_VIEW_TARGETS: usize = 64;

/// The views among `order` that a flush for `targets` leaves pending: a reshape, permute,
/// expand or narrow that a tensor still names but that is not a target, over a value computed
/// before this flush (or over such a view). The flush folds it into its readers' loads (not an
/// output: kept, it would be a copy kernel of its own) and it is pending again afterwards, its
/// input held by its edge (so never handed to the flush to free), computed if it is ever read.
/// `x.reshape([n]).sum().item()` would otherwise copy `x`: the temporary `x.reshape(..)` lives
/// to the end of the statement, after the read.
fn lazy_views(st: &EngineState, order: &[NodeId], targets: &[NodeId]) -> HashSet<NodeId> {
    let mut lazy: HashSet<NodeId> = HashSet::new();
    for &id in order {
        let n = st.graph.node(id);
        if n.handles == 0 || !matches!(n.op, Op::Reshape | Op::Permute(_) | Op::Expand | Op::Narrow { .. }) {
            continue;
        }
        let (data, control) = st.graph.in_edges(id);
        let over_computed = match data.as_slice() {
            [p] => {
                lazy.contains(p)
                    || matches!(st.graph.node(*p).value, Some(Value::Ready(_) | Value::Host(_)))
                        && st.graph.node(*p).device == n.device
            }
            _ => false,
        };
        if over_computed && control.is_empty() && !targets.contains(&id) {
            lazy.insert(id);
        }
    }
    lazy
}

pub(super) fn walk(st: &mut EngineState, targets: &[NodeId]) -> Walked {
    // Sized for the pending nodes up front (a small flush grew these one doubling at a time),
    // up to a bound: a read of one value among many pending ones walks few of them.
    let pending = st.pending.min(4096);
    let EngineState { graph, marks, .. } = st;
    marks.start(graph.slot_count());
    // (seq, id): sorted by recording order at the end.
    let mut order: Vec<(u64, NodeId)> = Vec::with_capacity(pending);
    let mut waits: Vec<Arc<Ticket>> = Vec::new();
    let mut lost: Vec<(NodeId, String)> = Vec::new();
    let mut remotes: Vec<NodeId> = Vec::new();
    let mut stack: Vec<(NodeId, bool)> = Vec::with_capacity(pending + targets.len());
    for &t in targets {
        match graph.contains(t).then(|| &graph.node(t).value) {
            Some(None) => stack.push((t, false)),
            Some(Some(Value::InFlight(ticket))) => waits.push(ticket.clone()),
            _ => {}
        }
    }
    while let Some((id, expanded)) = stack.pop() {
        if expanded {
            // Inputs are finished first (post-order), so their lost status is known. A user
            // event that can never be reached (ordered after lost work) orders nothing: the
            // work that waits for it is not lost with it (the lost work's readers report it).
            // Nor does a lost collective that a collective is only ordered after (the device's
            // previous one, `collective.rs`): a broken group's leftover never runs, and a new
            // group's collectives on the same device go on.
            let (data, control) = graph.in_edges(id);
            let ordering_only = |p: &NodeId| matches!(graph.node(*p).op, Op::Event | Op::Collective(_));
            let reason = data.iter().chain(control.iter().filter(|p| !ordering_only(p))).find_map(|&p| {
                match &graph.node(p).value {
                    Some(Value::Lost(r)) => Some(r.clone()),
                    None if marks.get(p) == Some(Marks::LOST) => {
                        lost.iter().find(|(l, _)| *l == p).map(|(_, r)| r.clone())
                    }
                    _ => None,
                }
            });
            // A collective whose group is broken can never run: it is lost, not flushed.
            let reason = reason.or_else(|| super::collective::broken(&graph.node(id).op));
            match reason {
                Some(r) => {
                    marks.set(id, Marks::LOST);
                    lost.push((id, r));
                }
                None => {
                    order.push((graph.node(id).seq, id));
                    if let Some(c) = companion(graph, id).filter(|&c| marks.get(c).is_none()) {
                        marks.set(c, Marks::VISITED);
                        order.push((graph.node(c).seq, c));
                    }
                }
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
                Some(Value::Remote(r)) if !r.resolved() && !remotes.contains(&p) => remotes.push(p),
                _ => {}
            }
        }
    }
    // Recording order: a topological order, and each stream's program order. Keys carried
    // along: one looked up in the graph at every comparison cost more than the sort.
    order.sort_unstable_by_key(|&(seq, _)| seq);
    Walked { order: order.into_iter().map(|(_, id)| id).collect(), waits, lost, remotes }
}

/// A pending node that a flush computing `id` computes too, because it costs almost nothing
/// there: the log-sum-exp that autograd recorded beside an attention output, over the same
/// inputs (fusion puts both parts in one kernel; left for the backward pass's flush, it would
/// run the scores again on its own). Someone holds it, or it would not be in the graph.
fn companion(graph: &braid_graph::Graph<Value>, id: NodeId) -> Option<NodeId> {
    let node = graph.node(id);
    let Op::Attention { causal, part: braid_graph::AttentionPart::Out } = node.op else { return None };
    let edges = graph.in_edges(id);
    let first = *edges.0.first()?;
    graph.successors(first).find(|&s| {
        let n = graph.node(s);
        n.value.is_none()
            && n.stream == node.stream
            && n.op == Op::Attention { causal, part: braid_graph::AttentionPart::Lse }
            && graph.in_edges(s) == edges
    })
}
