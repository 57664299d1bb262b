//! Saved values a backward pass will read from elsewhere, which a flush before it frees after
//! their last reader instead of keeping.
//!
//! A sharded step (`braid::dist::Sharded`) gathers each unit's parameters for the forward pass
//! and gathers them again for the backward pass (FSDP's `reshard_after_forward`): its backward
//! hook replaces every value autograd saved that is a gathered parameter, or a movement chain
//! over one (`w.t()`). When the forward pass is flushed before the backward pass is recorded
//! (`Sharded::record_ranks`), those saved values still hold handles at the flush, which would
//! keep every unit's full parameters to the flush's end. The recording side names them first
//! ([`Engine::supersede`], one entry per saved handle the backward pass will not read); the
//! flush then treats those handles as not keeping the value, and afterwards marks it lost
//! (a read of it is an `Err` naming why, never a wrong value).
//!
//! A node qualifies only when every handle it has is one of those, it is not a target of the
//! flush, and nothing left pending after the flush (or outside it) reads it. This module never
//! decides what a backward pass reads; the caller vouches for that.

use super::{Engine, EngineState};
use braid_graph::NodeId;
use hashbrown::{HashMap, HashSet};

/// Why a superseded value is gone, for a read of it.
const REASON: &str = "a value autograd saved for a backward pass that reads it from elsewhere (a sharded \
                      unit's parameters, gathered again for the backward pass) was freed after its last reader \
                      in the forward pass's flush";

/// The named saved handles, and the nodes a running flush frees as superseded.
#[derive(Default)]
pub(crate) struct Superseded {
    /// Per node (and its place in the recording order: a vacated id is reused): how many of
    /// its handles are saved values the backward pass will not read. Consumed by the next
    /// flush.
    named: HashMap<NodeId, (u64, u32)>,
    /// Nodes of a running flush that are lost once it ran, with their place in the order.
    dropping: HashMap<NodeId, u64>,
}

impl Engine {
    /// Names saved values (their nodes, once per saved handle) that the backward pass about to
    /// be recorded reads from elsewhere: the next flush holding them frees them after their
    /// last reader (see the module docs). Replaces what was named before.
    pub(crate) fn supersede(&self, saved: &[NodeId]) {
        let mut st = self.state();
        let mut named: HashMap<NodeId, (u64, u32)> = HashMap::with_capacity(saved.len());
        for &id in saved {
            if st.graph.contains(id) {
                let seq = st.graph.node(id).seq;
                named.entry(id).or_insert((seq, 0)).1 += 1;
            }
        }
        st.superseded.named = named;
    }
}

/// The nodes of a flush (`order`, reading out `targets`) whose every handle was named by
/// [`Engine::supersede`]; what recomputation must not choose.
pub(super) fn candidates(st: &EngineState, order: &[NodeId], targets: &[NodeId]) -> HashSet<NodeId> {
    if st.superseded.named.is_empty() {
        return HashSet::new();
    }
    order
        .iter()
        .copied()
        .filter(|id| {
            let n = st.graph.node(*id);
            let own = super::collective::own_handles(&n.op);
            st.superseded.named.get(id).is_some_and(|&(seq, count)| {
                seq == n.seq && n.handles > own && n.handles - own == count && !n.persistent && !targets.contains(id)
            })
        })
        .collect()
}

/// Of `candidates`, those the flush frees: none of their readers stays pending after the
/// flush (`pending_after`: lazy views, values left for recomputation) or is outside it.
pub(super) fn settle(
    st: &EngineState,
    mut candidates: HashSet<NodeId>,
    pending_after: &HashSet<NodeId>,
    in_flush: impl Fn(NodeId) -> bool,
) -> HashSet<NodeId> {
    candidates.retain(|&id| {
        !pending_after.contains(&id) && st.graph.successors(id).all(|s| in_flush(s) && !pending_after.contains(&s))
    });
    candidates
}

/// Notes that the flush of `order` frees `freed`; what was named is consumed (a value named
/// but not in this flush, computed by an earlier one, stays as it is).
pub(super) fn note(
    state: &mut Superseded,
    graph: &braid_graph::Graph<super::Value>,
    order: &[NodeId],
    freed: &HashSet<NodeId>,
) {
    state.named.clear();
    if state.dropping.is_empty() && freed.is_empty() {
        return;
    }
    for id in order {
        state.dropping.remove(id);
    }
    state.dropping.extend(freed.iter().map(|&id| (id, graph.node(id).seq)));
}

/// After a flush ran: whether it freed `id` as superseded; if so the node is marked lost.
pub(super) fn lose_if_freed(st: &mut EngineState, id: NodeId) -> bool {
    let seq = st.graph.node(id).seq;
    if st.superseded.dropping.remove(&id) != Some(seq) {
        return false;
    }
    st.graph.node_mut(id).value = Some(super::Value::Lost(REASON.into()));
    true
}
