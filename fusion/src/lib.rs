//! # braid-fusion: grouping nodes into kernels
//!
//! Takes the subgraph of a flush and groups its nodes into segments, each of which becomes one
//! kernel, and states each segment's inputs and outputs. **Today this pass does not fuse**:
//! every node is its own segment, and no report claims otherwise (`fused_ops` equals the number
//! of nodes and nothing is refused). Real fusion (elementwise chains, reductions with
//! prologue/epilogue, matmul epilogues, with refusal reasons) arrives with its own issue; its
//! contract is fixed here already: a segment never contains nodes of two streams, and never
//! spans an event wait or control edge. This crate never allocates buffers or picks streams.

use braid_graph::{FlushGraph, ValueRef};

/// A group of flush nodes that runs as one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Indices into `FlushGraph::nodes`, in execution order.
    pub nodes: Vec<usize>,
    /// Values read from outside the segment, each once, in order of first use. These are the
    /// kernel's input arguments, in this order.
    pub inputs: Vec<ValueRef>,
    /// Nodes whose values leave the segment (used later or kept), in node order. These are the
    /// kernel's output arguments, in this order.
    pub outputs: Vec<usize>,
}

/// Why two neighbouring nodes were not fused (shown in dumps as `fusion.refused`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub a: usize,
    pub b: usize,
    pub reason: String,
}

/// The result of the pass.
#[derive(Clone, Debug, Default)]
pub struct Fusion {
    pub segments: Vec<Segment>,
    pub refused: Vec<Refusal>,
}

impl Fusion {
    /// Number of graph ops that ended up in kernels.
    pub fn fused_ops(&self) -> usize {
        self.segments.iter().map(|s| s.nodes.len()).sum()
    }
}

/// Groups the nodes of `graph` into segments. Pass-through for now: one segment per node, in
/// the graph's (topological) order.
pub fn segment(graph: &FlushGraph) -> Fusion {
    let segments = graph
        .nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for v in &node.inputs {
                if !inputs.contains(v) {
                    inputs.push(*v);
                }
            }
            Segment { nodes: vec![i], inputs, outputs: vec![i] }
        })
        .collect();
    Fusion { segments, refused: Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_graph::{DType, DeviceId, FlushNode, Op, Shape, StreamId, table::BinaryOp};

    #[test]
    fn every_node_is_its_own_segment_and_inputs_are_deduplicated() {
        let node = |inputs: Vec<ValueRef>| FlushNode {
            id: Default::default(),
            op: Op::Binary(BinaryOp::Mul),
            dtype: DType::F32,
            shape: Shape::from([2]),
            device: DeviceId(0),
            stream: StreamId(0),
            inputs: inputs.into(),
            after: Default::default(),
            keep: false,
        };
        let g = FlushGraph {
            nodes: vec![
                node(vec![ValueRef::External(0), ValueRef::External(0)]),
                node(vec![ValueRef::Node(0), ValueRef::External(0)]),
            ],
            externals: vec![],
        };
        let f = segment(&g);
        assert_eq!(f.segments.len(), 2);
        assert_eq!(f.segments[0].inputs, vec![ValueRef::External(0)]);
        assert_eq!(f.segments[1].inputs, vec![ValueRef::Node(0), ValueRef::External(0)]);
        assert_eq!(f.fused_ops(), 2);
        assert!(f.refused.is_empty());
    }
}
