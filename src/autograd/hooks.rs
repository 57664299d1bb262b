//! Hooks into the backward pass for code that owns some leaves' values: `braid::dist::Sharded`
//! gathers a unit's parameters again for the backward pass instead of keeping the forward
//! pass's copies, and reduces a unit's gradients as soon as the walk leaves the unit.
//!
//! A hook sees two things: the walk reaching a recorded op (by its recording sequence number,
//! before its derivative is recorded), and every value a derivative saved that is a *leaf*, or
//! a chain of movement and casts over one (`w.t()`, `w.t().to_dtype(bf16)`): the hook may give
//! another tensor with the leaf's value, and the chain is recorded again over it. Whatever the
//! hook does not replace (a value computed from a leaf by arithmetic) is used as saved, so a
//! hook can only change where a value comes from, never what a derivative computes.
//!
//! This module never records anything but the replayed movement and casts; the hook records
//! the rest.

use super::{GradNode, GradSource, Grads, Saved};
use crate::tensor::Tensor;
use braid_graph::{DType, Op, Shape};
use smallvec::SmallVec;

/// What the backward pass tells a [`BackwardHook`] and asks of it.
pub(crate) trait BackwardHook {
    /// The walk is about to record the derivative of the op recorded with sequence number `seq`
    /// (called in decreasing `seq`, on the thread's stream, outside the op's stream scope).
    /// `grads` holds the leaves' gradients so far (complete for leaves no later op reads).
    fn reached(&mut self, seq: u64, grads: &Grads);

    /// A tensor holding the current value of leaf `leaf`, to be read instead of the one the
    /// forward pass saved (or saved a chain of movement over), or `None` to keep that.
    fn leaf_value(&mut self, leaf: u64) -> Option<Tensor>;
}

/// One link of a movement chain: the op and the shape and dtype it gave.
type Link = (Op, Shape, DType);

/// The leaf under `source` and the movement and casts from it to the value, innermost first,
/// when the value is such a chain (each op with one input).
fn chain(source: &GradSource) -> Option<(u64, Vec<Link>)> {
    let mut links: Vec<Link> = Vec::new();
    let mut at = source.clone();
    loop {
        match at {
            GradSource::Leaf(leaf) => {
                links.reverse();
                return Some((leaf, links));
            }
            GradSource::Node(node) => {
                let [slot] = &node.inputs[..] else { return None };
                if !replayable(&node.op) {
                    return None;
                }
                links.push((node.op.clone(), node.out_shape.clone(), node.out_dtype));
                at = slot.source.clone()?;
            }
        }
        if links.len() > 8 {
            return None;
        }
    }
}

fn replayable(op: &Op) -> bool {
    matches!(op, Op::Permute(_) | Op::Reshape | Op::Cast | Op::Narrow { .. } | Op::Expand | Op::Contiguous)
}

/// `link` recorded again over `x`.
fn replay(x: &Tensor, (op, shape, dtype): &Link) -> Tensor {
    match op {
        Op::Permute(perm) => x.permute(perm),
        Op::Reshape => x.reshape(shape.clone()),
        Op::Cast => x.to_dtype(*dtype),
        Op::Narrow { dim, start, len } => x.narrow(*dim, *start, *len),
        Op::Expand => x.expand(shape.clone()),
        Op::Contiguous => x.contiguous(),
        _ => unreachable!("only replayable links are kept"),
    }
}

/// The saved values that `loss`'s backward pass, under a hook that gives a value for each of
/// `leaves`, reads from the hook's replacements instead ([`substitute`]): the graph node of
/// each, once per saved handle, so that a flush before that backward pass need not keep them
/// (`Engine::supersede`).
pub(crate) fn superseded_saved(loss: &Tensor, leaves: &hashbrown::HashSet<u64>) -> Vec<braid_graph::NodeId> {
    let Some(root) = super::source_of(loss) else { return Vec::new() };
    let mut out = Vec::new();
    for node in super::backward::reachable(&root) {
        let saved = node.saved.lock().unwrap_or_else(|p| p.into_inner());
        let Some(saved) = saved.as_ref() else { continue };
        for (slot, value) in node.inputs.iter().zip(&saved.inputs) {
            if let (Some(value), Some(source)) = (value, &slot.source)
                && let Some((leaf, links)) = chain(source)
                && leaves.contains(&leaf)
                && links.last().is_none_or(|(_, shape, dtype)| shape == value.shape() && *dtype == value.dtype())
            {
                out.push(value.node());
            }
        }
    }
    out
}

/// `saved` with every saved input the hook replaces read from its replacement (`None` when it
/// replaces none).
pub(super) fn substitute(node: &GradNode, saved: &Saved, hook: &mut dyn BackwardHook) -> Option<Saved> {
    let mut replaced: SmallVec<[Option<Tensor>; 3]> = SmallVec::new();
    let mut any = false;
    for (slot, value) in node.inputs.iter().zip(&saved.inputs) {
        let new = match (value, &slot.source) {
            (Some(value), Some(source)) => chain(source).and_then(|(leaf, links)| {
                let base = hook.leaf_value(leaf)?;
                let out = links.iter().fold(base, |x, link| replay(&x, link));
                (out.shape() == value.shape() && out.dtype() == value.dtype()).then_some(out)
            }),
            _ => None,
        };
        any |= new.is_some();
        replaced.push(new.or_else(|| value.clone()));
    }
    any.then(|| Saved { inputs: replaced, output: saved.output.clone(), attention_lse: saved.attention_lse.clone() })
}
