//! The recorded dataflow graph, on petgraph.
//!
//! A node is an op with its result's dtype, shape, device and stream, plus whatever value state
//! the engine attaches (`V`: pending when `None`). Data edges carry the input slot; control
//! edges order work without moving data. The graph never computes and never decides what runs:
//! it stores, answers structural questions and prints itself as DOT.

use crate::dtype::DType;
use crate::op::Op;
use crate::shape::Shape;
use petgraph::Direction;
use petgraph::stable_graph::{EdgeIndex, NodeIndex, StableGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::fmt::Write;

/// A node of the recorded graph. Stable while the node lives; reused after removal.
pub type NodeId = NodeIndex<u32>;

/// A device known to the engine (an index into its device table).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize, PartialOrd, Ord)]
pub struct DeviceId(pub u32);

/// A stream of one device; 0 is the device's default stream.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize, PartialOrd, Ord, Default)]
pub struct StreamId(pub u32);

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Edge {
    /// The source is input number `slot` of the target.
    Data(u16),
    /// The target must run after the source; no data moves.
    Control,
}

#[derive(Debug)]
pub struct Node<V> {
    pub op: Op,
    pub dtype: DType,
    pub shape: Shape,
    pub device: DeviceId,
    pub stream: StreamId,
    /// The engine's value state; `None` while the node is pending.
    pub value: Option<V>,
    /// How many tensor handles currently name this node as their version.
    pub handles: u32,
    /// Recording order (program order): every input has a smaller number.
    pub seq: u64,
    /// The user asked for this value to be offloaded while idle (`Tensor::offload_hint`).
    pub offload_hint: bool,
    /// A parameter (a leaf that requires gradients, or its update): stored apart, in
    /// exact-size memory.
    pub persistent: bool,
}

impl<V> Node<V> {
    pub fn new(op: Op, dtype: DType, shape: Shape, device: DeviceId, stream: StreamId) -> Node<V> {
        Node {
            op,
            dtype,
            shape,
            device,
            stream,
            value: None,
            handles: 0,
            seq: 0,
            offload_hint: false,
            persistent: false,
        }
    }

    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size()
    }
}

/// The recorded graph.
#[derive(Debug)]
pub struct Graph<V> {
    g: StableGraph<Node<V>, Edge, petgraph::Directed, u32>,
}

impl<V> Default for Graph<V> {
    fn default() -> Self {
        Graph { g: StableGraph::default() }
    }
}

impl<V> Graph<V> {
    pub fn new() -> Graph<V> {
        Graph::default()
    }

    /// Adds `node` with data edges from `inputs` (in slot order).
    pub fn add(&mut self, node: Node<V>, inputs: &[NodeId]) -> NodeId {
        let id = self.g.add_node(node);
        for (slot, &input) in inputs.iter().enumerate() {
            self.g.add_edge(input, id, Edge::Data(slot as u16));
        }
        id
    }

    /// Adds a control edge: `after` runs after `before`.
    pub fn add_control(&mut self, before: NodeId, after: NodeId) -> EdgeIndex<u32> {
        self.g.add_edge(before, after, Edge::Control)
    }

    pub fn node(&self, id: NodeId) -> &Node<V> {
        &self.g[id]
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node<V> {
        &mut self.g[id]
    }

    pub fn contains(&self, id: NodeId) -> bool {
        self.g.contains_node(id)
    }

    pub fn len(&self) -> usize {
        self.g.node_count()
    }

    pub fn is_empty(&self) -> bool {
        self.g.node_count() == 0
    }

    /// An upper bound of every node index in use (for tables indexed by node).
    pub fn node_bound(&self) -> usize {
        petgraph::visit::NodeIndexable::node_bound(&self.g)
    }

    /// The data inputs of `id`, in slot order.
    pub fn inputs(&self, id: NodeId) -> SmallVec<[NodeId; 4]> {
        self.in_edges(id).0
    }

    /// The data inputs of `id` in slot order, and its control predecessors, in one pass over
    /// its incoming edges.
    pub fn in_edges(&self, id: NodeId) -> (SmallVec<[NodeId; 4]>, SmallVec<[NodeId; 2]>) {
        let mut data: SmallVec<[NodeId; 4]> = SmallVec::new();
        let mut control = SmallVec::new();
        for e in self.g.edges_directed(id, Direction::Incoming) {
            match *e.weight() {
                Edge::Data(slot) => {
                    // Slots are 0..n, each once, so every filler `end()` is overwritten.
                    let slot = slot as usize;
                    if data.len() <= slot {
                        data.resize(slot + 1, NodeId::end());
                    }
                    data[slot] = e.source();
                }
                Edge::Control => control.push(e.source()),
            }
        }
        (data, control)
    }

    /// Every direct predecessor (data and control), possibly with repeats.
    pub fn predecessors(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.g.neighbors_directed(id, Direction::Incoming)
    }

    /// Every direct successor (data and control), possibly with repeats.
    pub fn successors(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.g.neighbors_directed(id, Direction::Outgoing)
    }

    /// Whether any node still depends on `id` (data or control).
    pub fn has_successors(&self, id: NodeId) -> bool {
        self.g.neighbors_directed(id, Direction::Outgoing).next().is_some()
    }

    /// Removes the incoming edges of `id` (it no longer needs its inputs) and returns the
    /// former predecessors.
    pub fn detach_inputs(&mut self, id: NodeId) -> SmallVec<[NodeId; 4]> {
        let edges: SmallVec<[(EdgeIndex<u32>, NodeId); 4]> =
            self.g.edges_directed(id, Direction::Incoming).map(|e| (e.id(), e.source())).collect();
        edges
            .into_iter()
            .map(|(e, src)| {
                self.g.remove_edge(e);
                src
            })
            .collect()
    }

    /// Removes a node (and its edges), returning it.
    pub fn remove(&mut self, id: NodeId) -> Option<Node<V>> {
        self.g.remove_node(id)
    }

    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.g.node_indices()
    }

    /// Graphviz DOT of the nodes in `ids` (or of every node when `None`): one box per node
    /// labelled with op, shape and dtype; solid data edges and dashed control edges; pending
    /// nodes white, materialised ones grey.
    pub fn to_dot(&self, ids: Option<&[NodeId]>) -> String {
        let keep = |n: NodeId| ids.is_none_or(|ids| ids.contains(&n));
        let mut s = String::from("digraph recorded {\n  node [shape=box, fontname=monospace];\n");
        for id in self.g.node_indices().filter(|&n| keep(n)) {
            let n = &self.g[id];
            let fill = if n.value.is_some() { ", style=filled, fillcolor=lightgrey" } else { "" };
            let _ = writeln!(
                s,
                "  n{} [label=\"n{} {}\\n{} {} s{}\"{fill}];",
                id.index(),
                id.index(),
                n.op.name(),
                n.shape,
                n.dtype,
                n.stream.0
            );
        }
        for e in (&self.g).edge_references() {
            if !keep(e.source()) || !keep(e.target()) {
                continue;
            }
            let style = match e.weight() {
                Edge::Data(slot) => format!("label=\"{slot}\""),
                Edge::Control => "style=dashed".to_string(),
            };
            let _ = writeln!(s, "  n{} -> n{} [{style}];", e.source().index(), e.target().index());
        }
        s.push_str("}\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::BinaryOp;

    fn leaf(g: &mut Graph<()>) -> NodeId {
        g.add(Node::new(Op::Input, DType::F32, Shape::from([2]), DeviceId(0), StreamId(0)), &[])
    }

    #[test]
    fn inputs_keep_slot_order_and_detach_works() {
        let mut g: Graph<()> = Graph::new();
        let a = leaf(&mut g);
        let b = leaf(&mut g);
        let c = g
            .add(Node::new(Op::Binary(BinaryOp::Sub), DType::F32, Shape::from([2]), DeviceId(0), StreamId(0)), &[b, a]);
        assert_eq!(g.inputs(c).as_slice(), &[b, a]);
        assert!(g.has_successors(a));
        let preds = g.detach_inputs(c);
        assert_eq!(preds.len(), 2);
        assert!(!g.has_successors(a));
        assert!(g.to_dot(None).contains("sub"));
    }
}
