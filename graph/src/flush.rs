//! The subgraph of one flush, extracted from the recorded graph and put in execution order.
//!
//! This is what fusion and the scheduler work on: a plain list in topological order with
//! inputs resolved to positions, so neither needs the recorded graph (or its lock). It holds no
//! data and knows nothing about buffers.

use crate::dtype::DType;
use crate::ir::{DeviceId, NodeId, StreamId};
use crate::op::Op;
use crate::shape::Shape;
use smallvec::SmallVec;

/// Where an input of a flush node comes from.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ValueRef {
    /// The result of `FlushGraph::nodes[i]`.
    Node(usize),
    /// `FlushGraph::externals[i]`: a value computed before this flush.
    External(usize),
}

#[derive(Clone, Debug)]
pub struct FlushNode {
    /// The node's id in the recorded graph (what dumps print).
    pub id: NodeId,
    pub op: Op,
    pub dtype: DType,
    pub shape: Shape,
    pub device: DeviceId,
    pub stream: StreamId,
    pub inputs: SmallVec<[ValueRef; 2]>,
    /// Nodes of this flush that must finish first without passing data (control edges).
    pub after: SmallVec<[usize; 1]>,
    /// The value outlives the flush (it is read, held by a tensor, or needed by later work).
    pub keep: bool,
    /// Offload this value to host memory when it is idle long enough, budget or not.
    pub offload_hint: bool,
    /// A parameter: its buffer comes from exact-size memory.
    pub persistent: bool,
    /// Computed again for a backward pass in this flush (see `braid_graph::Node::recomputed`):
    /// it joins only kernels that such copies start, where the backward pass's nodes join it.
    pub recomputed: bool,
}

impl FlushNode {
    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size()
    }
}

/// A value that already exists when the flush starts.
#[derive(Clone, Debug)]
pub struct External {
    pub id: NodeId,
    pub dtype: DType,
    pub shape: Shape,
    pub device: DeviceId,
    pub stream: StreamId,
    /// Nothing outside this flush reads the value any more (no tensor names it, every reader is
    /// in the flush): its buffer is handed to the flush, which frees it after its last reader.
    pub donated: bool,
    /// Donated host data: uploaded when its first reader runs, not when the flush starts.
    pub on_host: bool,
    /// Held in this device's host (offload) memory, where an earlier flush left it (an offload
    /// that outlived its flush): copied into device memory before its first reader, that copy
    /// freed after its last; the host copy stays the value. Takes no device memory until then.
    pub offloaded: bool,
    /// Held in parameter (exact-size) memory: only a new version of a parameter may be written
    /// over it in place, and nothing else.
    pub persistent: bool,
    /// Donated device data that a kernel may write a new version over in place. Not under a
    /// memory budget: there the value stays free to be offloaded instead.
    pub overwritable: bool,
    /// Held by another device whose memory this device's kernels cannot read in place (a GPU's
    /// value read by the CPU, or host memory read by a GPU): only a `to_device` reads it, by a
    /// copy step, and it takes none of this device's memory.
    pub remote: bool,
    /// Held by another device whose memory this device's kernels read in place (another CPU
    /// device's buffer: both in host memory, so `to_device` copies nothing). It lives in that
    /// device's memory, which counts it: it takes none of this device's memory either, and it is
    /// never donated (this device never frees, overwrites or offloads it).
    pub foreign: bool,
}

impl External {
    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size()
    }

    /// Whether the value is in another device's memory (`remote` or `foreign`): no peak or
    /// budget of this device counts it, and this device only reads it.
    pub fn held_elsewhere(&self) -> bool {
        self.remote || self.foreign
    }
}

/// The nodes of one flush in topological order (every input precedes its users).
#[derive(Clone, Debug, Default)]
pub struct FlushGraph {
    pub nodes: Vec<FlushNode>,
    pub externals: Vec<External>,
}

impl FlushGraph {
    /// Dtype and shape of a value.
    pub fn meta(&self, v: ValueRef) -> (DType, &Shape) {
        match v {
            ValueRef::Node(i) => (self.nodes[i].dtype, &self.nodes[i].shape),
            ValueRef::External(i) => (self.externals[i].dtype, &self.externals[i].shape),
        }
    }

    /// Checks the ordering promise; used by tests and debug builds.
    pub fn is_topological(&self) -> bool {
        self.nodes.iter().enumerate().all(|(i, n)| {
            n.inputs.iter().all(|v| match *v {
                ValueRef::Node(j) => j < i,
                ValueRef::External(j) => j < self.externals.len(),
            }) && n.after.iter().all(|&j| j < i)
        })
    }
}
