//! Collectives in the engine: recording one device's part of a collective, keeping it until
//! it ran, and breaking its group when a flush that holds it fails.
//!
//! Every rank of a group pairs its `k`-th collective with the others' `k`-th, so a device must
//! run its collectives in recording order and must run every one of them, even one whose
//! result nobody reads any more (the other ranks wait for it). Hence: each collective is ordered
//! after the device's previous one by a control edge (a flush that runs it runs the earlier
//! ones first), and holds one extra handle until it ran, so dropping its tensor never drops it.
//! The order spans groups: a device in several groups (HSDP's replica and part groups, a
//! world group beside them) runs all of their collectives in the order it recorded them, as
//! NCCL runs them on one stream; a flush that ran only what it needs of one group could wait
//! at a collective of another while its peer waits for a collective it skipped.
//! This module never waits for other devices; the rendezvous (`braid_devices::collective`) does.

use super::{Engine, EngineState, NewNode, Value};
use braid_graph::{FlushGraph, NodeId, Op};
use std::sync::atomic::{AtomicU32, Ordering};

impl Engine {
    /// Records this device's part of a collective (`new.op` is an `Op::Collective`) over the
    /// version `input` names, after the device's previous collective (of any group). Returns the node with one
    /// handle counted for the caller (and one more that the collective keeps until it ran).
    pub(crate) fn record_collective(&self, new: NewNode, input: &AtomicU32) -> NodeId {
        debug_assert!(matches!(new.op, Op::Collective(_)), "record_collective records collectives");
        let mut st = self.state();
        let source = NodeId::new(input.load(Ordering::Relaxed) as usize);
        let id = self.add_recorded(&mut st, new, &[source], None, None);
        st.graph.node_mut(id).handles += 1;
        if let Some((prev, seq)) = st.last_collective
            && st.graph.contains(prev)
            && st.graph.node(prev).seq == seq
            && matches!(st.graph.node(prev).value, None | Some(Value::InFlight(_)))
        {
            st.graph.add_control(prev, id);
        }
        let seq = st.graph.node(id).seq;
        st.last_collective = Some((id, seq));
        self.finish_record(st);
        id
    }
}

/// Why the collective `op` can never run (its group is broken or gone), if it is one.
pub(super) fn broken(op: &Op) -> Option<String> {
    let Op::Collective(c) = op else { return None };
    match braid_devices::collective::group(c) {
        Ok(group) => {
            group.broken().map(|r| format!("{} of group {}: the group is broken ({r})", c.kind.name(), c.group))
        }
        Err(e) => Some(e.to_string()),
    }
}

/// A collective found lost (by a flush's walk) lets go of the handle that kept it until it ran.
pub(super) fn release_lost(st: &mut EngineState, id: NodeId) {
    if matches!(st.graph.node(id).op, Op::Collective(_)) {
        st.drop_handle(id);
    }
}

/// The handles a pending node of `op` holds on itself: one for a collective (until it ran, so
/// that it runs even when no tensor names it), none for anything else. A flush keeps a value
/// past its end only for handles beyond these, so a gathered weight nobody names is freed
/// after its last reader in the flush.
pub(super) fn own_handles(op: &Op) -> u32 {
    u32::from(matches!(op, Op::Collective(_)))
}

/// After a flush ran: its collectives let go of the handle that kept them until they ran.
pub(super) fn release_ran(st: &mut EngineState, graph: &FlushGraph) {
    for n in &graph.nodes {
        if matches!(n.op, Op::Collective(_)) && st.graph.contains(n.id) {
            st.drop_handle(n.id);
        }
    }
}

/// After a failed flush was reverted: its collectives can never run (their group is broken), so
/// they are lost (their readers get the reason) and let go of the handle that kept them. So is
/// the flush's pending work ordered after them, user events included: a stream waiting for such
/// an event no longer waits for it (see `EngineState::apply_waits`), so a new group's
/// collectives on the same communication stream can run.
pub(super) fn lose_broken(st: &mut EngineState, graph: &FlushGraph, error: &crate::Error) {
    let reason = format!("its group is broken: {error}");
    let mut lost: hashbrown::HashSet<NodeId> = hashbrown::HashSet::new();
    for n in &graph.nodes {
        if !st.graph.contains(n.id) || st.graph.node(n.id).value.is_some() {
            continue;
        }
        if matches!(n.op, Op::Collective(_)) || st.graph.predecessors(n.id).any(|p| lost.contains(&p)) {
            st.graph.node_mut(n.id).value = Some(Value::Lost(reason.clone()));
            st.pending -= 1;
            lost.insert(n.id);
        }
    }
    // Handles are dropped after the walk above: dropping one may release the node.
    for n in graph.nodes.iter().filter(|n| matches!(n.op, Op::Collective(_)) && lost.contains(&n.id)) {
        st.drop_handle(n.id);
    }
}

/// After a flush failed: every group it ran a collective of is broken, so that the other ranks
/// get an `Err` instead of waiting for this one.
pub(super) fn abort_groups(graph: &FlushGraph, error: &crate::Error) {
    for n in &graph.nodes {
        if let Op::Collective(c) = &n.op
            && let Ok(group) = braid_devices::collective::group(c)
        {
            group.abort(c.rank, &error.to_string());
        }
    }
}
