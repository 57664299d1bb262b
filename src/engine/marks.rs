//! The stamped per-node mark table the walk and extract of a flush use: whether the walk
//! visited a node, and each node's place in the flush graph. Starting a new flush costs nothing
//! per node (a new stamp invalidates every mark), where hash sets and maps cost a hash per
//! visit. It never decides what a flush contains; `flush.rs` does.

use braid_graph::{NodeId, ValueRef};

/// Per-node scratch of the flush being extracted, indexed by node index and valid while its
/// stamp is current (so starting a walk costs nothing per node): whether the walk visited a
/// node, and each node's place in the flush graph (a node or an external).
#[derive(Default)]
pub(crate) struct Marks {
    stamp: u32,
    entries: Vec<(u32, u32)>,
}

impl Marks {
    /// Marks at or above this and below `LOST` are external places.
    pub(super) const EXTERNAL: u32 = 1 << 31;
    /// The walk found this node needs a lost value.
    pub(super) const LOST: u32 = u32::MAX - 1;
    /// The walk visited this node (its place is not known yet, or it has none).
    pub(super) const VISITED: u32 = u32::MAX;

    /// Forgets every mark, for a graph whose node indices are below `bound`.
    pub(super) fn start(&mut self, bound: usize) {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.entries.fill((0, 0));
            self.stamp = 1;
        }
        if self.entries.len() < bound {
            self.entries.resize(bound, (0, 0));
        }
    }

    pub(super) fn get(&self, id: NodeId) -> Option<u32> {
        self.entries.get(id.index()).filter(|e| e.0 == self.stamp).map(|e| e.1)
    }

    pub(super) fn set(&mut self, id: NodeId, mark: u32) {
        self.entries[id.index()] = (self.stamp, mark);
    }

    /// The place of `id` in the flush graph, if it has one yet.
    pub(super) fn place(&self, id: NodeId) -> Option<ValueRef> {
        match self.get(id)? {
            m if m < Self::EXTERNAL => Some(ValueRef::Node(m as usize)),
            m if m < Self::LOST => Some(ValueRef::External((m - Self::EXTERNAL) as usize)),
            _ => None,
        }
    }

    /// The index of `id` among the flush graph's nodes, if it is one of them.
    pub(super) fn node_place(&self, id: NodeId) -> Option<usize> {
        self.get(id).filter(|&m| m < Self::EXTERNAL).map(|m| m as usize)
    }
}
