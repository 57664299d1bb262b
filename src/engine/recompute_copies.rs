//! Saved values computed again inside one flush: the forward and backward passes of a training
//! step flushed together (a captured `Step`, a step read only at its end, or ended by a sync,
//! which names every pending node a target but reads none out).
//!
//! `recompute.rs` leaves a cheap saved value uncomputed when a read splits the forward pass from
//! its backward pass (the loss read of an eager step), so that the backward pass computes it
//! again inside its own kernels. When both passes run in one flush there is no such split: the
//! forward kernel that computes `exp(logits - max)` for a language model's cross-entropy also
//! writes it (f32, twice the bf16 logits' bytes) for the backward kernel to read. Here the same
//! choice is made at the start of a backward pass (`BackwardMark`, recorded by
//! `Tensor::backward`): a value the forward pass computes and the backward pass reads, chosen
//! by `recompute::choose` with the forward part of the flush as the flush, gets copies of its
//! cheap nodes for the backward readers; the forward kernels compute it inline and never store
//! it, the backward kernels compute the copies inline from what the forward pass keeps.
//!
//! The copies are ordinary pending nodes: recorded into the graph with places in the recording
//! order reserved below the backward pass's first (`COPY_PLACES`), and the backward readers'
//! inputs retargeted to them; an original no reader is left to is dropped. A forward part of
//! nothing but cheap nodes (what an eager step's loss read left pending) gets no copies. Must
//! never: copy anything but the elementwise ops and views
//! `recompute::choose` accepts, or change what any node computes.

use super::recompute::{Recompute, choose};
use super::{Engine, EngineState};
use braid_graph::{Node, NodeId};
use hashbrown::{HashMap, HashSet};

/// Places in the recording order kept below each backward pass's first node for copies.
const COPY_PLACES: u64 = 1 << 20;

/// Backward passes remembered per device (older ones have long been flushed).
const MARKS: usize = 64;

/// Where a backward pass began in the recording order, and the next of the places reserved
/// below it for copies.
pub(super) struct BackwardMark {
    first: u64,
    next_copy: u64,
}

impl Engine {
    /// Notes that a backward pass starts recording now: its nodes come after a gap of
    /// [`COPY_PLACES`] places in the recording order, for copies of the values it reads.
    pub(crate) fn mark_backward(&self) {
        let mut st = self.state();
        let base = super::state::reserve_seqs(COPY_PLACES);
        if st.backward_marks.len() == MARKS {
            st.backward_marks.remove(0);
        }
        st.backward_marks.push(BackwardMark { first: base + COPY_PLACES, next_copy: base });
    }
}

/// Whether a node at place `seq` in the recording order is a copy (its place is one reserved
/// below a backward pass's first).
pub(super) fn is_copy(marks: &[BackwardMark], seq: u64) -> bool {
    // Marks are in recording order: the first one past `seq` is the only one it can be below.
    let after = marks.partition_point(|m| m.first <= seq);
    marks.get(after).is_some_and(|m| seq >= m.first - COPY_PLACES)
}

/// Copies, for the backward readers in `order` (a flush's nodes, in recording order), the saved
/// values the forward part computes that are cheaper to compute again (see the module docs).
/// Returns whether it recorded any (the caller then walks again: the flush's nodes changed).
pub(super) fn copy_for_backward(st: &mut EngineState, order: &[NodeId], targets: &[NodeId]) -> bool {
    let (Some(&first), Some(&last)) = (order.first(), order.last()) else { return false };
    let (lo, hi) = (st.graph.node(first).seq, st.graph.node(last).seq);
    // Copies take places at and after a mark's `split`: they belong to the backward pass.
    let split = |m: &BackwardMark| m.first - COPY_PLACES;
    let marks: Vec<usize> =
        (0..st.backward_marks.len()).filter(|&m| (lo + 1..=hi).contains(&split(&st.backward_marks[m]))).collect();
    if marks.is_empty() {
        return false; // no backward pass starts inside this flush
    }
    let in_order: HashSet<NodeId> = order.iter().copied().collect();
    for m in marks {
        let split = split(&st.backward_marks[m]);
        let early: Vec<NodeId> = order.iter().copied().take_while(|&id| st.graph.node(id).seq < split).collect();
        // A forward part of nothing but cheap nodes is what an earlier flush left pending for
        // the backward pass to compute again (the loss read of an eager step): the backward
        // kernels compute those values inline already.
        if early.iter().all(|&id| super::recompute::cheap(&st.graph.node(id).op)) {
            continue;
        }
        let before: HashSet<NodeId> = early.iter().copied().collect();
        let forward = |id: NodeId| before.contains(&id);
        let chosen = choose(st, &early, targets, forward, &HashSet::new());
        // Only values every later reader of which is in this flush (a reader left pending would
        // still need the value itself, stored), computed from a reduction or broadcast from far
        // fewer bytes (see `worth_copying`).
        let values: Vec<NodeId> = (chosen.pending.iter().copied())
            .filter(|&v| {
                let mut late = late_readers(st, v, &forward).peekable();
                late.peek().is_some() && late.all(|s| in_order.contains(&s)) && worth_copying(st, &chosen, v)
            })
            .collect();
        // The graph changed: the caller walks again, and this runs again on the new nodes.
        if !values.is_empty() && copy(st, m, &chosen, &values, &forward) {
            return true;
        }
    }
    false
}

/// The nodes after the forward part that read `v` as data. A node ordered after `v` by a
/// control edge alone (a user event, a wait) reads nothing: it is never pointed at a copy, so
/// counting it would find `v` still read after the copy and copy it again on every walk.
fn late_readers<'a>(
    st: &'a EngineState,
    v: NodeId,
    forward: &'a dyn Fn(NodeId) -> bool,
) -> impl Iterator<Item = NodeId> + 'a {
    st.graph.successors(v).filter(move |&s| !forward(s) && st.graph.inputs(s).contains(&v))
}

/// Whether copying `v` (computed through the nodes `chosen` leaves pending from the rest, its
/// frontier) is worth it: the frontier holds a reduction (the row kernel that computes both
/// writes `v` for a later kernel, since what reads `v` later needs the reduction's result too,
/// a second pass: `exp(x - max)` of a cross-entropy, read by its derivative beside the sum), or
/// is a small fraction of `v`'s bytes (a broadcast: the cross-entropy's one-hot mask, from the
/// targets). Other elementwise values are left to fusion, which may put their backward readers
/// in their own kernel (the last layer's `h + gelu(h W)` under a mean's constant gradient);
/// copied, they would split that kernel.
fn worth_copying(st: &EngineState, chosen: &Recompute, v: NodeId) -> bool {
    let mut stack = vec![v];
    let mut seen: Vec<NodeId> = Vec::new();
    let mut frontier_bytes = 0usize;
    while let Some(n) = stack.pop() {
        if seen.contains(&n) {
            continue;
        }
        seen.push(n);
        let node = st.graph.node(n);
        if chosen.pending.contains(&n) {
            stack.extend(st.graph.inputs(n));
        } else if matches!(node.op, braid_graph::Op::Reduce { .. }) {
            return true;
        } else {
            frontier_bytes += node.bytes();
        }
    }
    frontier_bytes.saturating_mul(8) <= st.graph.node(v).bytes()
}

/// Records copies of `values` and of the nodes of `chosen.pending` they are computed through,
/// and points the readers outside `forward` at them.
fn copy(
    st: &mut EngineState,
    mark: usize,
    chosen: &Recompute,
    values: &[NodeId],
    forward: &dyn Fn(NodeId) -> bool,
) -> bool {
    // The nodes to copy: each value and what it is computed through, in recording order.
    let mut nodes: Vec<NodeId> = Vec::new();
    let mut stack: Vec<NodeId> = values.to_vec();
    while let Some(n) = stack.pop() {
        if chosen.pending.contains(&n) && !nodes.contains(&n) {
            nodes.push(n);
            stack.extend(st.graph.inputs(n));
        }
    }
    nodes.sort_by_key(|&n| st.graph.node(n).seq);
    let BackwardMark { first, next_copy } = st.backward_marks[mark];
    if next_copy + nodes.len() as u64 >= first {
        return false; // the reserved places are used up
    }
    let mut copy_of: HashMap<NodeId, NodeId> = HashMap::with_capacity(nodes.len());
    for (k, &n) in nodes.iter().enumerate() {
        let original = st.graph.node(n);
        let mut node =
            Node::new(original.op.clone(), original.dtype, original.shape.clone(), original.device, original.stream);
        node.seq = next_copy + k as u64;
        let inputs: Vec<NodeId> = st.graph.inputs(n).iter().map(|p| *copy_of.get(p).unwrap_or(p)).collect();
        let id = st.graph.add(node, &inputs);
        copy_of.insert(n, id);
        st.pending += 1;
    }
    st.backward_marks[mark].next_copy = next_copy + nodes.len() as u64;
    for &v in values {
        let mut readers: Vec<NodeId> = late_readers(st, v, forward).collect();
        readers.sort_unstable();
        readers.dedup();
        for r in readers {
            let inputs = st.graph.inputs(r);
            for (slot, _) in inputs.iter().enumerate().filter(|&(_, &p)| p == v) {
                st.graph.retarget(r, slot as u16, copy_of[&v]);
            }
        }
    }
    // An original no reader is left to (a value the forward part computed for the backward
    // pass alone, a one-hot mask) is dropped, as any value nothing reads: a sync, which names
    // every pending node, would otherwise compute it for nothing.
    super::state::collect(st, values.iter().copied());
    tracing::debug!(target: "braid::flush", values = values.len(), nodes = nodes.len(), "saved values copied for a backward pass");
    true
}
