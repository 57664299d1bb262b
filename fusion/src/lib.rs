//! # braid-fusion: grouping nodes into kernels
//!
//! Takes the subgraph of a flush and groups its nodes into segments, each of which becomes one
//! kernel, and states each segment's inputs and outputs:
//! - **Map**: elementwise nodes over one index space (sources, unary, binary with broadcasting,
//!   comparisons, select, clamp, casts);
//! - **Rows**: reductions along one axis with the elementwise work before them (over the full
//!   shape) and after them (over the reduced shape), so a composed softmax or layer norm is one
//!   kernel that keeps a row in cache;
//! - **Matmul**: a matrix product with an elementwise epilogue (bias, activation), but not a
//!   cast that widens its result when the product's own values are written anyway or the
//!   cast's readers could convert as they read (a cross-entropy over bf16 logits reads them
//!   narrow);
//! - **Attention**: the parts of one attention pass that read the same inputs (the output and
//!   its log-sum-exp; the key and value gradients), one fused kernel that never writes scores;
//! - **Single**: anything else (concatenation, a materialised movement, a user event);
//! - **Transfer**: a `to_device` of a value held where this device's kernels cannot read it
//!   (another device's own memory): not a kernel but a copy step.
//!
//! Elementwise kernels that follow one another, on one stream, and read nothing of each
//! other's are then **packed** into one kernel of several loops, so that an optimizer's
//! update of many parameters is a few kernels, not one per parameter.
//!
//! Movement ops (permute, expand, narrow, reshape where no copy is needed) whose readers all
//! load through views are not kernels at all: they are *folded* into those loads.
//!
//! The pass never fuses across streams, across an event wait or control edge, or past a
//! target's limit on kernel inputs, and it records why it refused each fusion a reader would
//! expect (shown in dumps as `fusion.refused`). It never allocates buffers or picks streams.

mod group;

use braid_graph::{DType, FlushGraph, Op, Shape, StreamId, Target, ValueRef, View};
use smallvec::SmallVec;

/// What kind of kernel a segment becomes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SegmentKind {
    /// One node that is not fused.
    Single,
    /// Elementwise nodes, all of the same shape (the index space).
    Map,
    /// Independent elementwise kernels packed into one, a loop each (a multi-tensor update):
    /// `parts[k]` nodes of `nodes` in a row make loop `k`, over their own index space. No part
    /// reads another's values. `input_part[i]` is the part that reads input `i` when one part
    /// alone does. See `group/pack.rs`.
    PackedMaps { parts: Vec<usize>, input_part: Vec<Option<usize>> },
    /// Reductions along `axis` of `full` (all elements when `None`), with elementwise nodes over
    /// `full` and over the reduced shape.
    Rows { full: Shape, axis: Option<usize> },
    /// A matrix product (the first node) and elementwise nodes on its result.
    Matmul,
    /// Parts of one attention pass over the same inputs (`Op::Attention`): the output with its
    /// log-sum-exp, or the key gradient with the value gradient, or one part alone.
    Attention,
    /// One `to_device` whose input is another device's value that this device cannot read in
    /// place ([`External::remote`](braid_graph::External::remote)): the scheduler copies it
    /// instead of running a kernel.
    Transfer,
}

/// A group of flush nodes that runs as one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub kind: SegmentKind,
    /// Indices into `FlushGraph::nodes`, in execution order.
    pub nodes: Vec<usize>,
    /// Values read from outside the segment, each once, in order of first use (movement folded
    /// into loads is resolved to the value underneath). These are the kernel's input arguments.
    pub inputs: Vec<ValueRef>,
    /// Per input: every load of it is the identity over the segment's index space (so a Map
    /// kernel may overwrite it in place); in packed maps, over its part's, which alone reads it.
    pub direct: Vec<bool>,
    /// Nodes whose values leave the segment (read later, through a view or directly, or kept),
    /// in node order. These are the kernel's output arguments.
    pub outputs: Vec<usize>,
}

/// Why two nodes were not fused (shown in dumps as `fusion.refused`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub a: usize,
    pub b: usize,
    pub reason: String,
}

impl Refusal {
    /// The reason given for nodes on different streams (`a`'s group's, `b`'s).
    pub fn different_streams(a: StreamId, b: StreamId) -> String {
        format!("different streams ({}, {})", a.0, b.0)
    }

    /// The streams a reason made by [`Refusal::different_streams`] names.
    pub fn streams_of(reason: &str) -> Option<(StreamId, StreamId)> {
        let (a, b) = reason.strip_prefix("different streams (")?.strip_suffix(')')?.split_once(", ")?;
        Some((StreamId(a.parse().ok()?), StreamId(b.parse().ok()?)))
    }
}

/// The result of the pass.
#[derive(Clone, Debug, Default)]
pub struct Fusion {
    pub segments: Vec<Segment>,
    pub refused: Vec<Refusal>,
    /// Movement nodes folded into their readers' loads (no kernel, no buffer).
    pub folded: Vec<usize>,
}

impl Fusion {
    /// Number of graph ops in kernels (folded movement not counted).
    pub fn fused_ops(&self) -> usize {
        self.segments.iter().map(|s| s.nodes.len()).sum()
    }
}

/// Settings of the pass.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// `false` (`BRAID_FUSION=0`): every node is its own kernel and no movement is folded.
    pub enabled: bool,
    /// The target's limit on distinct input buffers of one kernel.
    pub max_inputs: usize,
    /// The target's limit on reductions in one row kernel.
    pub max_reductions: usize,
    /// The target's limit on nodes in one kernel.
    pub max_nodes: usize,
    /// The target's limit on buffers one kernel binds (inputs and outputs; one more is kept
    /// for the backend's scratch).
    pub max_buffers: usize,
    /// The target's [`braid_graph::Target::copies_transposed_rows`].
    pub copy_transposed_rows: bool,
}

impl Options {
    /// The limits of `target`, fusing when `enabled`.
    pub fn for_target(target: &Target, enabled: bool) -> Options {
        Options {
            enabled,
            max_inputs: target.max_kernel_inputs,
            max_reductions: target.max_row_reductions,
            max_nodes: target.max_kernel_nodes,
            max_buffers: target.max_kernel_buffers,
            copy_transposed_rows: target.copies_transposed_rows,
        }
    }
}

impl Default for Options {
    /// The CPU's limits, fusing.
    fn default() -> Options {
        Options::for_target(&Target::CPU, true)
    }
}

/// Groups the nodes of `graph` into segments.
pub fn segment(graph: &FlushGraph, options: &Options) -> Fusion {
    group::run(graph, options)
}

/// The value a read of `v` really loads: through folded movement, the value underneath; a
/// folded constant (which has nothing underneath) is returned as itself.
pub fn underlying(graph: &FlushGraph, folded: &[bool], mut v: ValueRef) -> ValueRef {
    while let ValueRef::Node(n) = v {
        match graph.nodes[n].inputs.first() {
            Some(&input) if folded[n] => v = input,
            _ => break,
        }
    }
    v
}

/// The region of concatenation `c`'s output that its input `k` fills, as a view over that
/// input's shape.
pub fn cat_region(graph: &FlushGraph, c: usize, k: usize) -> View {
    let node = &graph.nodes[c];
    let Op::Cat { dim } = node.op else { panic!("n{} is not a concatenation", node.id.index()) };
    let strides = node.shape.contiguous_strides();
    let before: usize = node.inputs[..k].iter().map(|&v| graph.meta(v).1.dims()[dim]).sum();
    let dims = graph.meta(node.inputs[k]).1.dims().into();
    View { dims, strides: strides.clone(), offset: before * strides[dim] as usize }
}

/// What a read of a value amounts to once folding is resolved.
pub enum FoldedRead {
    /// A folded constant of this dtype.
    Const(f64, DType),
    /// A load of a value (with a buffer) through a view over the read value's shape.
    Value(ValueRef, View),
}

/// Resolves a read of `v` through folded constants and movement: the chain of folded nodes is
/// walked down to what it reads, then its views are applied from there up, without recursion
/// (a program may fold tens of thousands of views in a row).
pub fn folded_read(graph: &FlushGraph, folded: &[bool], v: ValueRef) -> FoldedRead {
    let mut chain: SmallVec<[usize; 8]> = SmallVec::new();
    let mut at = v;
    let mut read = loop {
        match at {
            ValueRef::Node(j) if folded[j] => {
                let node = &graph.nodes[j];
                if let Op::Full(x) = node.op {
                    break FoldedRead::Const(node.dtype.round_f64(x.0), node.dtype);
                }
                chain.push(j);
                at = node.inputs[0];
            }
            v => break FoldedRead::Value(v, View::contiguous(graph.meta(v).1)),
        }
    };
    for &j in chain.iter().rev() {
        let node = &graph.nodes[j];
        read = match read {
            FoldedRead::Const(x, _) => FoldedRead::Const(x, node.dtype),
            FoldedRead::Value(u, view) => {
                let view = match &node.op {
                    Op::Permute(p) => view.permute(p),
                    Op::Expand => view.broadcast_to(&node.shape),
                    Op::Narrow { dim, start, len } => view.narrow(*dim, *start, *len),
                    _ => view.reshape(&node.shape).expect("fusion folds only views that exist"),
                };
                FoldedRead::Value(u, view)
            }
        };
    }
    read
}

/// `view`, a view over a value of `shape` read by a row kernel over `full` reduced along `axis`,
/// as seen from the kernel's index space: values of the full shape broadcast; reduced ones (the
/// axis kept with size 1, removed, or a scalar) get stride 0 along the axis.
pub fn row_view(view: View, shape: &Shape, full: &Shape, axis: Option<usize>) -> View {
    let mut v = view.broadcast_to(shape);
    if let Some(d) = axis
        && shape != full
        && shape.rank() + 1 == full.rank()
    {
        v.dims.insert(d, 1);
        v.strides.insert(d, 0);
    }
    v.broadcast_to(full)
}
