//! The versions of a captured step's arguments that the step updates in place
//! ([`crate::Step`]): whether an argument's value is the step's alone to write over, the new
//! version a replay installs, and the old one a failed capture points an argument back at.
//!
//! This module only moves version cells and handles under the engine lock; it must never run
//! work or free a value another tensor or a pending node still reads.

use super::{Engine, Value, current};
use braid_devices::Buffer;
use braid_graph::{DType, NodeId, Shape, StreamId};
use std::sync::atomic::{AtomicU32, Ordering};

impl Engine {
    /// Whether the value the version cell `cell` names may be written over in place: one
    /// tensor names it (clones share the cell), no recorded node reads it, and its buffer has
    /// no holders but the node and `others` known ones (the caller's own handles). For a step's
    /// argument that the step updates in place.
    pub(crate) fn sole_value(&self, cell: &AtomicU32, others: usize) -> bool {
        self.with_state(|st| {
            let id = current(cell);
            let node = st.graph.node(id);
            node.handles == 1
                && !st.graph.has_successors(id)
                && matches!(&node.value, Some(Value::Ready(b)) if b.holders() == 1 + others)
        })
    }

    /// Makes `buffer` (computed) the value of a new version of the tensor whose version cell is
    /// `cell`: a step's argument that the step updated. The old version loses the tensor's
    /// handle.
    pub(crate) fn install_version(
        &self,
        cell: &AtomicU32,
        dtype: DType,
        shape: Shape,
        stream: StreamId,
        buffer: Buffer,
    ) {
        let mut st = self.state();
        let old = current(cell);
        let node = self.leaf(dtype, shape, stream, Value::Ready(buffer));
        let id = st.add(node, &[]);
        cell.store(id.index() as u32, Ordering::Relaxed);
        st.drop_handle(old);
    }

    /// Points the version cell `cell` at `id` again (a failed capture undoing an update of its
    /// argument); `id` must still be in the graph (the caller holds a handle of it).
    pub(crate) fn restore_version(&self, cell: &AtomicU32, id: NodeId) {
        let mut st = self.state();
        let old = current(cell);
        if old == id {
            return;
        }
        st.graph.node_mut(id).handles += 1;
        cell.store(id.index() as u32, Ordering::Relaxed);
        st.drop_handle(old);
    }
}
