//! Folding: which movement nodes (permute, expand, narrow, reshape, a readable `to_device`) and
//! constants become views and constants in their readers' loads instead of kernels, and
//! whether each folded view is a transpose (a target that copies transposed rows keeps some
//! apart: see `rows_across_lines`). It decides only what folds; grouping is `group`'s.

use super::{Class, class, is_transfer};
use crate::Options;
use braid_graph::{FlushGraph, Op, ValueRef, View};

/// Whether reader `r` takes node `i`, a constant of value `v`, as a constant: an expression
/// does; a scatter-add takes a zero base as no base at all (its sums are the result); a
/// concatenation fills the constant's region (a padded product's gradient: zeros beside the
/// narrowed value's). Matrix products and other copies need a buffer.
fn takes_constant(graph: &FlushGraph, r: usize, i: usize, v: f64) -> bool {
    let reader = &graph.nodes[r];
    match reader.op {
        Op::ScatterAdd { .. } => {
            v == 0.0
                && reader.inputs[0] == ValueRef::Node(i)
                && reader.inputs[1..].iter().all(|&x| x != ValueRef::Node(i))
        }
        Op::Cat { .. } => true,
        _ => matches!(class(&reader.op), Class::Elementwise | Class::Reduce),
    }
}

/// Decides which movement and constant nodes are folded into their readers' loads: not kept,
/// not ordering anything, and (for movement) expressible as a view of the value underneath.
pub(super) fn fold(
    graph: &FlushGraph,
    options: &Options,
    control_pred: &[bool],
    readers: &[Vec<usize>],
) -> (Vec<bool>, Vec<bool>) {
    let n = graph.nodes.len();
    let mut folded = vec![false; n];
    // The view of each folded movement node over its underlying value; `None` for constants.
    let mut views: Vec<Option<View>> = vec![None; n];
    for (i, node) in graph.nodes.iter().enumerate() {
        if node.keep || control_pred[i] {
            continue;
        }
        match &node.op {
            // A constant folds into readers that evaluate expressions (not into matrix products
            // or copies, which need a buffer).
            Op::Full(v) => folded[i] = readers[i].iter().all(|&r| takes_constant(graph, r, i, v.0)),
            // A transfer from memory this device cannot read is a copy, never a view.
            Op::ToDevice if is_transfer(graph, i) => {}
            // A collective reads whole contiguous buffers (NCCL's, a peer's): never a view.
            Op::Reshape | Op::Permute(_) | Op::Expand | Op::Narrow { .. } | Op::Contiguous | Op::ToDevice
                if readers[i].iter().any(|&r| matches!(graph.nodes[r].op, Op::Collective(_))) => {}
            Op::Reshape | Op::Permute(_) | Op::Expand | Op::Narrow { .. } | Op::Contiguous | Op::ToDevice => {
                let input = node.inputs[0];
                let base = match input {
                    ValueRef::Node(j) if folded[j] => match &views[j] {
                        Some(v) => v.clone(),
                        None => {
                            // Movement of a folded constant is still that constant.
                            // (Not reached today: a constant read by movement is not folded.)
                            folded[i] = readers[i]
                                .iter()
                                .all(|&r| matches!(class(&graph.nodes[r].op), Class::Elementwise | Class::Reduce));
                            continue;
                        }
                    },
                    v => View::contiguous(graph.meta(v).1),
                };
                let view = match &node.op {
                    Op::Reshape | Op::Contiguous | Op::ToDevice => base.reshape(&node.shape),
                    Op::Permute(p) => Some(base.permute(p)),
                    Op::Expand => Some(base.broadcast_to(&node.shape)),
                    Op::Narrow { dim, start, len } => Some(base.narrow(*dim, *start, *len)),
                    _ => unreachable!(),
                };
                if let Some(v) = view {
                    if options.copy_transposed_rows && rows_across_lines(graph, &readers[i], &v) {
                        // Left a kernel of its own: a transposing copy.
                        continue;
                    }
                    folded[i] = true;
                    views[i] = Some(v);
                } else if matches!(node.op, Op::Reshape | Op::Contiguous)
                    && splits_into_cats(graph, i, &readers[i], &base)
                {
                    // No view, but every reader is a concatenation that can copy it in its
                    // input's order (`braid_lowering`'s `lower/cat.rs`); nothing reads it as a
                    // view (`views[i]` stays empty).
                    folded[i] = true;
                }
            }
            _ => {}
        }
    }
    let transposes = views.iter().map(|v| v.as_ref().is_some_and(transposed)).collect();
    (folded, transposes)
}

/// Whether every reader of reshape `i` (of `input`, which it is no view of) is a
/// concatenation whose region for it splits into `input`'s shape, so that the concatenation
/// can copy it in `input`'s order.
fn splits_into_cats(graph: &FlushGraph, i: usize, readers: &[usize], input: &View) -> bool {
    let shape = input.shape();
    !readers.is_empty()
        && readers.iter().all(|&r| {
            let cat = &graph.nodes[r];
            matches!(cat.op, Op::Cat { .. })
                && (cat.inputs.iter().enumerate())
                    .filter(|&(_, &v)| v == ValueRef::Node(i))
                    .all(|(k, _)| crate::cat_region(graph, r, k).reshape(&shape).is_some())
        })
}

/// Whether `view`, a transpose (its last dimension walked at a stride, another one contiguous),
/// is read both by a reduction along its last dimension and by elementwise work over its whole
/// shape (softmax, layer norm), or by a reduction over every element: a row kernel fusing them
/// reads its rows across the view's lines (and a softmax writes them across the output's). A
/// transposing copy first, then the row kernel over contiguous rows, is faster where copies go
/// tile by tile: `x.t().softmax(-1)` of a `[4096, 1024]` f32 on the CPU (a 2-core Zen 3) 8.5 ms
/// fused, 5.2 copied (2.4 of them the copy). (Elementwise work over the view that a reduction
/// over every element reads is kept from that reduction by `Grouper::check` instead.)
fn rows_across_lines(graph: &FlushGraph, readers: &[usize], view: &View) -> bool {
    let Some(last) = view.dims.len().checked_sub(1) else { return false };
    let reduced_along_last = |r: usize| matches!(graph.nodes[r].op, Op::Reduce { dim: Some(d), .. } if d == last);
    let whole =
        |r: usize| class(&graph.nodes[r].op) == Class::Elementwise && graph.nodes[r].shape.dims() == &view.dims[..];
    // A reduction over every element reads in the view's order (its bits depend on it): across
    // lines, one element each (`x.t().sum()`).
    let everything = |r: usize| matches!(graph.nodes[r].op, Op::Reduce { dim: None, .. });
    transposed(view)
        && (readers.iter().any(|&r| everything(r))
            || readers.iter().any(|&r| reduced_along_last(r)) && readers.iter().any(|&r| whole(r)))
}

/// Whether `view` walks its last dimension at a stride while another dimension is contiguous.
fn transposed(view: &View) -> bool {
    let Some(last) = view.dims.len().checked_sub(1) else { return false };
    let contiguous_elsewhere = (0..last).any(|d| view.strides[d] == 1 && view.dims[d] > 1);
    view.strides[last].abs() > 1 && view.dims[last] > 1 && contiguous_elsewhere
}
