//! What kind of work a flush node is, for the grouping: its class (elementwise, reduction,
//! product, attention part, other), where a value sits in a row segment (`Level`), and the
//! shapes and words the grouping's checks and refusals use.
//!
//! Must never: decide whether two nodes share a kernel (that is `super`'s).

use braid_graph::{FlushGraph, Op, Shape, ValueRef};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Class {
    Elementwise,
    Reduce,
    Matmul,
    /// A part of attention: joins only a sibling part over the same inputs.
    Attention,
    Other,
}

/// What a reduction runs over, in words: `dimension 1`, `all elements`.
pub(super) fn along(axis: Option<usize>) -> String {
    axis.map_or("all elements".into(), |d| format!("dimension {d}"))
}

/// Whether node `i` moves a value from memory this device's kernels cannot read: a copy step.
pub(super) fn is_transfer(graph: &FlushGraph, i: usize) -> bool {
    let node = &graph.nodes[i];
    node.op == Op::ToDevice && matches!(node.inputs[0], ValueRef::External(e) if graph.externals[e].remote)
}

pub(super) fn class(op: &Op) -> Class {
    match op {
        _ if op.is_elementwise() => Class::Elementwise,
        Op::Full(_) | Op::Arange { .. } | Op::Rand { .. } | Op::Randn { .. } => Class::Elementwise,
        Op::Reduce { .. } => Class::Reduce,
        Op::Matmul | Op::QuantMatmul(_) => Class::Matmul,
        Op::Attention { .. } => Class::Attention,
        _ => Class::Other,
    }
}

/// Where a node's value sits in a Rows segment: over the full shape, or reduced (keeping the
/// axis with size 1, or without it).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Level {
    Full,
    Keep,
    Flat,
}

/// The level of a reduction's result.
pub(super) fn reduce_level(op: &Op) -> Level {
    match op {
        Op::Reduce { dim: None, .. } | Op::Reduce { keepdim: true, .. } => Level::Keep,
        _ => Level::Flat,
    }
}

/// The shape of `full` reduced along `axis` (a scalar when `None`).
pub(super) fn reduced(full: &Shape, axis: Option<usize>, keepdim: bool) -> Shape {
    match axis {
        None => Shape::scalar(),
        Some(d) => full.reduced(d, keepdim),
    }
}
