//! The recorded dataflow graph.
//!
//! A node is an op with its result's dtype, shape, device and stream, plus whatever value state
//! the engine attaches (`V`: pending when `None`). Data edges carry the input slot; control
//! edges order work without moving data. The graph never computes and never decides what runs:
//! it stores, answers structural questions and prints itself as DOT.

use crate::dtype::DType;
use crate::op::Op;
use crate::shape::Shape;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::fmt::Write;

/// A node of the recorded graph: an index, stable while the node lives, reused after removal.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u32);

impl NodeId {
    /// The node with index `index` (which must fit in 32 bits).
    pub fn new(index: usize) -> NodeId {
        NodeId(u32::try_from(index).expect("graph: node index above 2^32 - 1"))
    }

    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// A filler that names no node.
    pub fn end() -> NodeId {
        NodeId(u32::MAX)
    }
}

impl std::fmt::Debug for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "n{}", self.0)
    }
}

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
    /// How many of `handles` are values autograd keeps for a derivative: a value held by
    /// those alone may be left uncomputed by a flush and computed again where the derivative
    /// reads it (see the engine's `flush::recomputed`). Counts up to `u8::MAX`; handles past
    /// that count as ordinary ones.
    pub saved: u8,
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
            saved: 0,
            seq: 0,
            offload_hint: false,
            persistent: false,
        }
    }

    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size()
    }
}

/// The recorded graph: a slab of nodes, each with its incoming and outgoing edges.
///
/// Every edge is stored twice, as an entry in its target's `ins` and one in its source's
/// `outs`, and each entry knows where its mirror sits. Removing an edge is then O(1) however
/// many edges its endpoints have: swap-remove both entries and repoint the two entries that
/// moved. (petgraph's graphs keep singly linked edge lists, where removing the oldest of `n`
/// edges walks all `n`: releasing 20,000 results of one input took 0.75 s and grew with the
/// square of their number.)
pub struct Graph<V> {
    slots: Vec<Slot<V>>,
    /// Vacant slots, the most recently vacated last (reused first).
    free: Vec<u32>,
    len: usize,
}

struct Slot<V> {
    node: Option<Node<V>>,
    ins: SmallVec<[In; 4]>,
    // Four inline: a value read by three or four ops (a leaf of a small model, an activation
    // and its derivatives) is common, and a spilled list costs an allocation per growth.
    outs: SmallVec<[Out; 4]>,
}

/// An incoming edge: from `from`, whose `outs[at]` is the mirror entry.
#[derive(Clone, Copy, Debug)]
struct In {
    from: NodeId,
    edge: Edge,
    at: u32,
}

/// An outgoing edge: to `to`, whose `ins[at]` is the mirror entry.
#[derive(Clone, Copy, Debug)]
struct Out {
    to: NodeId,
    at: u32,
}

impl<V> Default for Graph<V> {
    fn default() -> Self {
        Graph { slots: Vec::new(), free: Vec::new(), len: 0 }
    }
}

impl<V: std::fmt::Debug> std::fmt::Debug for Graph<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.node_ids().map(|id| (id, (self.node(id), self.inputs(id))))).finish()
    }
}

impl<V> Graph<V> {
    pub fn new() -> Graph<V> {
        Graph::default()
    }

    /// Adds `node` with data edges from `inputs` (in slot order).
    pub fn add(&mut self, node: Node<V>, inputs: &[NodeId]) -> NodeId {
        let id = match self.free.pop() {
            Some(i) => {
                let slot = &mut self.slots[i as usize];
                debug_assert!(slot.node.is_none() && slot.ins.is_empty() && slot.outs.is_empty());
                slot.node = Some(node);
                NodeId(i)
            }
            None => {
                assert!(self.slots.len() < u32::MAX as usize, "graph: more than 2^32 - 1 nodes");
                self.slots.push(Slot { node: Some(node), ins: SmallVec::new(), outs: SmallVec::new() });
                NodeId(self.slots.len() as u32 - 1)
            }
        };
        self.len += 1;
        for (slot, &input) in inputs.iter().enumerate() {
            self.link(input, id, Edge::Data(slot as u16));
        }
        id
    }

    /// Adds a control edge: `after` runs after `before`.
    pub fn add_control(&mut self, before: NodeId, after: NodeId) {
        self.link(before, after, Edge::Control);
    }

    fn link(&mut self, from: NodeId, to: NodeId, edge: Edge) {
        assert!(
            self.contains(from) && self.contains(to),
            "graph: an edge between {from:?} and {to:?}, not both present"
        );
        let out_at = self.slots[from.index()].outs.len() as u32;
        let in_at = self.slots[to.index()].ins.len() as u32;
        self.slots[from.index()].outs.push(Out { to, at: in_at });
        self.slots[to.index()].ins.push(In { from, edge, at: out_at });
    }

    /// Removes `from.outs[at]` and repoints the entry that took its place.
    fn remove_out(&mut self, from: NodeId, at: u32) {
        let outs = &mut self.slots[from.index()].outs;
        outs.swap_remove(at as usize);
        if let Some(&moved) = outs.get(at as usize) {
            self.slots[moved.to.index()].ins[moved.at as usize].at = at;
        }
    }

    /// Removes `to.ins[at]` and repoints the entry that took its place.
    fn remove_in(&mut self, to: NodeId, at: u32) {
        let ins = &mut self.slots[to.index()].ins;
        ins.swap_remove(at as usize);
        if let Some(&moved) = ins.get(at as usize) {
            self.slots[moved.from.index()].outs[moved.at as usize].at = at;
        }
    }

    pub fn node(&self, id: NodeId) -> &Node<V> {
        self.slots.get(id.index()).and_then(|s| s.node.as_ref()).unwrap_or_else(|| panic!("graph: no node {id:?}"))
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node<V> {
        self.slots.get_mut(id.index()).and_then(|s| s.node.as_mut()).unwrap_or_else(|| panic!("graph: no node {id:?}"))
    }

    pub fn contains(&self, id: NodeId) -> bool {
        self.slots.get(id.index()).is_some_and(|s| s.node.is_some())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One more than the largest node index there has been: a bound of every node index, at
    /// no cost (tables indexed by node are sized by it once per flush; finding the largest
    /// index in use would scan the free slots at the end, which a program that once held many
    /// nodes keeps).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
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
        for e in &self.slots[id.index()].ins {
            match e.edge {
                // Edges are stored in the order they were added, so slots come in order unless a
                // removal moved one; then `end()` fills the gap until its slot's edge comes.
                Edge::Data(slot) if slot as usize == data.len() => data.push(e.from),
                Edge::Data(slot) => {
                    let slot = slot as usize;
                    while data.len() <= slot {
                        data.push(NodeId::end());
                    }
                    data[slot] = e.from;
                }
                Edge::Control => control.push(e.from),
            }
        }
        (data, control)
    }

    /// Every direct predecessor (data and control), possibly with repeats.
    pub fn predecessors(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.slots[id.index()].ins.iter().map(|e| e.from)
    }

    /// Every direct successor (data and control), possibly with repeats.
    pub fn successors(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.slots[id.index()].outs.iter().map(|e| e.to)
    }

    /// The direct successors that read `id`'s value (not those only ordered after it), possibly
    /// with repeats.
    pub fn data_successors(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.slots[id.index()]
            .outs
            .iter()
            .filter(|e| matches!(self.slots[e.to.index()].ins[e.at as usize].edge, Edge::Data(_)))
            .map(|e| e.to)
    }

    /// Whether any node still depends on `id` (data or control).
    pub fn has_successors(&self, id: NodeId) -> bool {
        !self.slots[id.index()].outs.is_empty()
    }

    /// Makes `source` input number `slot` of `to`, in place of the node that was (which loses
    /// that edge; the slot keeps its place among `to`'s inputs).
    pub fn retarget(&mut self, to: NodeId, slot: u16, source: NodeId) {
        assert!(self.contains(source), "graph: retargeting to {source:?}, which is not present");
        let at = (self.slots[to.index()].ins.iter().position(|e| e.edge == Edge::Data(slot)))
            .unwrap_or_else(|| panic!("graph: {to:?} has no data input {slot}"));
        let old = self.slots[to.index()].ins[at];
        self.remove_out(old.from, old.at);
        let out_at = self.slots[source.index()].outs.len() as u32;
        self.slots[source.index()].outs.push(Out { to, at: at as u32 });
        self.slots[to.index()].ins[at] = In { from: source, edge: old.edge, at: out_at };
    }

    /// Removes the incoming edges of `id` (it no longer needs its inputs) and returns the
    /// former predecessors.
    pub fn detach_inputs(&mut self, id: NodeId) -> SmallVec<[NodeId; 4]> {
        let mut preds = SmallVec::new();
        // Newest first, so each removal takes the last entry and nothing moves.
        while let Some(&e) = self.slots[id.index()].ins.last() {
            self.remove_out(e.from, e.at);
            self.slots[id.index()].ins.pop();
            preds.push(e.from);
        }
        preds
    }

    /// Removes a node (and its edges), returning it.
    pub fn remove(&mut self, id: NodeId) -> Option<Node<V>> {
        if !self.contains(id) {
            return None;
        }
        self.detach_inputs(id);
        while let Some(&e) = self.slots[id.index()].outs.last() {
            self.remove_in(e.to, e.at);
            self.slots[id.index()].outs.pop();
        }
        let slot = &mut self.slots[id.index()];
        // A node that had many consumers gives its spilled edge list back.
        if slot.outs.spilled() {
            slot.outs = SmallVec::new();
        }
        if slot.ins.spilled() {
            slot.ins = SmallVec::new();
        }
        self.free.push(id.0);
        self.len -= 1;
        slot.node.take()
    }

    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.slots.iter().enumerate().filter(|(_, s)| s.node.is_some()).map(|(i, _)| NodeId(i as u32))
    }

    /// Graphviz DOT of the nodes in `ids` (or of every node when `None`): one box per node
    /// labelled with op, shape and dtype; solid data edges and dashed control edges; pending
    /// nodes white, materialised ones grey.
    pub fn to_dot(&self, ids: Option<&[NodeId]>) -> String {
        let keep = |n: NodeId| ids.is_none_or(|ids| ids.contains(&n));
        let mut s = String::from("digraph recorded {\n  node [shape=box, fontname=monospace];\n");
        for id in self.node_ids().filter(|&n| keep(n)) {
            let n = self.node(id);
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
        for to in self.node_ids().filter(|&n| keep(n)) {
            for e in self.slots[to.index()].ins.iter().filter(|e| keep(e.from)) {
                let style = match e.edge {
                    Edge::Data(slot) => format!("label=\"{slot}\""),
                    Edge::Control => "style=dashed".to_string(),
                };
                let _ = writeln!(s, "  n{} -> n{} [{style}];", e.from.index(), to.index());
            }
        }
        s.push_str("}\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::BinaryOp;
    use proptest::prelude::*;

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

    /// Every entry's mirror points back at it (the invariant O(1) removal relies on).
    fn assert_mirrored(g: &Graph<()>) {
        for (i, slot) in g.slots.iter().enumerate() {
            if slot.node.is_none() {
                assert!(slot.ins.is_empty() && slot.outs.is_empty(), "vacant slot {i} keeps edges");
            }
            for (k, e) in slot.ins.iter().enumerate() {
                let m = g.slots[e.from.index()].outs[e.at as usize];
                assert_eq!((m.to.index(), m.at as usize), (i, k));
            }
            for (k, e) in slot.outs.iter().enumerate() {
                let m = g.slots[e.to.index()].ins[e.at as usize];
                assert_eq!((m.from.index(), m.at as usize), (i, k));
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Step {
        Add(Vec<usize>),
        Control(usize, usize),
        Detach(usize),
        Remove(usize),
        Retarget(usize, usize, usize),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let step = prop_oneof![
            3 => proptest::collection::vec(0usize..64, 0..4).prop_map(Step::Add),
            1 => (0usize..64, 0usize..64).prop_map(|(a, b)| Step::Control(a, b)),
            1 => (0usize..64).prop_map(Step::Detach),
            2 => (0usize..64).prop_map(Step::Remove),
            1 => (0usize..64, 0usize..4, 0usize..64).prop_map(|(a, s, b)| Step::Retarget(a, s, b)),
        ];
        proptest::collection::vec(step, 1..200)
    }

    proptest! {
        /// Random adds, control edges, detaches, removals and retargeted inputs (fan-outs of many consumers
        /// included, since picks favour few live nodes) against a list of edges: inputs in
        /// slot order, control predecessors, successors and counts always agree.
        #[test]
        fn edges_match_a_list_of_edges_under_random_edits(steps in steps()) {
            let mut g: Graph<()> = Graph::new();
            let mut live: Vec<NodeId> = Vec::new();
            // (from, to, edge) of every edge, as the graph should hold them.
            let mut edges: Vec<(NodeId, NodeId, Edge)> = Vec::new();
            for step in steps {
                let pick = |i: usize| live[i % live.len()];
                match step {
                    Step::Add(inputs) => {
                        let inputs: Vec<NodeId> =
                            if live.is_empty() { Vec::new() } else { inputs.iter().map(|&i| pick(i)).collect() };
                        let id = g.add(Node::new(Op::Input, DType::F32, Shape::from([2]), DeviceId(0), StreamId(0)), &inputs);
                        prop_assert!(!live.contains(&id));
                        edges.extend(inputs.iter().enumerate().map(|(s, &f)| (f, id, Edge::Data(s as u16))));
                        live.push(id);
                    }
                    Step::Control(a, b) if live.len() > 1 && pick(a) != pick(b) => {
                        g.add_control(pick(a), pick(b));
                        edges.push((pick(a), pick(b), Edge::Control));
                    }
                    Step::Detach(i) if !live.is_empty() => {
                        let id = pick(i);
                        let mut got = g.detach_inputs(id).to_vec();
                        let mut want: Vec<NodeId> = edges.iter().filter(|e| e.1 == id).map(|e| e.0).collect();
                        got.sort();
                        want.sort();
                        prop_assert_eq!(got, want);
                        edges.retain(|e| e.1 != id);
                    }
                    Step::Retarget(i, slot, j) if !live.is_empty() => {
                        let (to, source) = (pick(i), pick(j));
                        let slots = edges.iter().filter(|e| e.1 == to && matches!(e.2, Edge::Data(_))).count();
                        if slots > 0 {
                            let slot = (slot % slots) as u16;
                            if let Some(e) = edges.iter_mut().find(|e| e.1 == to && e.2 == Edge::Data(slot)) {
                                g.retarget(to, slot, source);
                                e.0 = source;
                            }
                        }
                    }
                    Step::Remove(i) if !live.is_empty() => {
                        let id = pick(i);
                        prop_assert!(g.remove(id).is_some());
                        prop_assert!(g.remove(id).is_none());
                        edges.retain(|e| e.0 != id && e.1 != id);
                        live.retain(|&n| n != id);
                    }
                    _ => {}
                }
                assert_mirrored(&g);
                prop_assert_eq!(g.len(), live.len());
                prop_assert!(live.iter().all(|n| n.index() < g.slot_count()));
                let mut ids: Vec<NodeId> = g.node_ids().collect();
                let mut want_ids = live.clone();
                ids.sort();
                want_ids.sort();
                prop_assert_eq!(ids, want_ids);
                for &n in &live {
                    let (data, control) = g.in_edges(n);
                    // Slots whose input was removed read as `end()`.
                    let mut want_data: Vec<NodeId> = Vec::new();
                    for e in edges.iter().filter(|e| e.1 == n) {
                        if let Edge::Data(s) = e.2 {
                            if want_data.len() <= s as usize {
                                want_data.resize(s as usize + 1, NodeId::end());
                            }
                            want_data[s as usize] = e.0;
                        }
                    }
                    prop_assert_eq!(data.to_vec(), want_data);
                    let mut control = control.to_vec();
                    let mut want_control: Vec<NodeId> =
                        edges.iter().filter(|e| e.1 == n && e.2 == Edge::Control).map(|e| e.0).collect();
                    control.sort();
                    want_control.sort();
                    prop_assert_eq!(control, want_control);
                    let mut succ: Vec<NodeId> = g.successors(n).collect();
                    let mut want_succ: Vec<NodeId> = edges.iter().filter(|e| e.0 == n).map(|e| e.1).collect();
                    succ.sort();
                    want_succ.sort();
                    prop_assert_eq!(g.has_successors(n), !want_succ.is_empty());
                    prop_assert_eq!(succ, want_succ);
                }
            }
        }
    }
}
