//! Reverse-mode automatic differentiation over the lazy graph.
//!
//! While gradients are enabled ([`no_grad`] turns them off on a thread), every op that reads a
//! tensor with gradient history records, next to its graph node, a [`GradNode`]: the op, where
//! each input's gradient goes ([`GradSource`]) and handles on exactly the forward values its
//! derivative reads (the op table's `saves`). Those handles are ordinary graph values, so the
//! memory planner frees them once their last backward reader is done. `loss.backward()` walks
//! the `GradNode`s in reverse recording order and records each derivative, as ordinary lazy
//! tensor ops, on the stream of the forward op it differentiates; nothing runs until a
//! gradient is read.
//!
//! Gradient bookkeeping is per version: an in-place update gives the tensor a new version and
//! a new `GradNode` whose input is the old version. It is read and written only under the
//! engine lock (see [`Tracker`]), so it always agrees with the version a recording read.
//!
//! This module never executes anything and never reads device values.

mod backward;
pub(crate) mod hooks;
mod rules;

pub use backward::Grads;

use crate::device::Device;
use crate::recorder::Retainer;
use crate::tensor::Tensor;
use braid_graph::{DType, NodeId, Op, ReduceOp, Shape, StreamId};
use smallvec::SmallVec;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Tensors whose current version has gradient bookkeeping (a marked leaf, or the result of ops
/// on one). While there are none, no op can need tracking and recording skips autograd.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Whether any tensor has gradient bookkeeping now.
fn in_use() -> bool {
    LIVE.load(Ordering::Relaxed) > 0
}

/// Replaces a tensor's bookkeeping with `new`, keeping [`LIVE`] in step; returns the old one
/// (to be dropped outside the engine lock).
pub(crate) fn replace_meta(meta: &mut Option<GradSource>, new: Option<GradSource>) -> Option<GradSource> {
    match (meta.is_some(), new.is_some()) {
        (false, true) => {
            LIVE.fetch_add(1, Ordering::Relaxed);
        }
        (true, false) => {
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
        _ => {}
    }
    std::mem::replace(meta, new)
}
/// Recording order of `GradNode`s (a node is always created after its inputs').
static NEXT_SEQ: AtomicU64 = AtomicU64::new(0);
/// Identities of leaves (stable across in-place updates of the leaf).
static NEXT_LEAF: AtomicU64 = AtomicU64::new(1);

/// The sequence number the next recorded op with gradient history gets: ops recorded after
/// this call have this number or more (how `braid::dist::Sharded` tells units apart).
pub(crate) fn next_seq() -> u64 {
    NEXT_SEQ.load(Ordering::Relaxed)
}

thread_local! {
    static NO_GRAD_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f` with gradient recording off on this thread: ops recorded inside have no gradient
/// history (use it for optimizer updates and evaluation). Scopes nest; recording is back on
/// afterwards, even if `f` panics.
///
/// ```
/// use braid::prelude::*;
/// let w = Tensor::from_vec(vec![1.0f32, 2.0], [2], &Device::cpu()).requires_grad();
/// let y = braid::no_grad(|| &w * 2.0);
/// assert!(!y.needs_grad());
/// assert!((&w * 2.0).needs_grad());
/// ```
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            NO_GRAD_DEPTH.with(|d| d.set(d.get() - 1));
        }
    }
    NO_GRAD_DEPTH.with(|d| d.set(d.get() + 1));
    let _restore = Restore;
    f()
}

/// Whether ops recorded now on this thread get gradient history.
pub fn grad_enabled() -> bool {
    NO_GRAD_DEPTH.with(|d| d.get() == 0)
}

/// Where the gradient of a version goes.
#[derive(Clone)]
pub(crate) enum GradSource {
    /// A leaf marked with `requires_grad`; its gradients are summed into [`Grads`] under this
    /// identity.
    Leaf(u64),
    /// The output of a recorded op.
    Node(Arc<GradNode>),
}

/// One input of a differentiated op.
pub(crate) struct InputSlot {
    /// `None` when the input has no gradient history (nothing flows back through it).
    pub(crate) source: Option<GradSource>,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
}

/// The forward values a derivative reads: graph handles that keep them alive until released.
#[derive(Clone)]
pub(crate) struct Saved {
    pub(crate) inputs: SmallVec<[Option<Tensor>; 3]>,
    pub(crate) output: Option<Tensor>,
    /// Attention's log-sum-exp, recorded beside its output (see [`GradNode::save_attention_lse`]).
    pub(crate) attention_lse: Option<Tensor>,
}

/// The record of one differentiable op.
pub(crate) struct GradNode {
    pub(crate) op: Op,
    pub(crate) seq: u64,
    pub(crate) device: Device,
    /// The forward op's stream: its derivative is recorded there.
    pub(crate) stream: StreamId,
    pub(crate) inputs: SmallVec<[InputSlot; 3]>,
    pub(crate) out_shape: Shape,
    pub(crate) out_dtype: DType,
    /// `None` once a backward pass has released the saved values.
    pub(crate) saved: Mutex<Option<Saved>>,
}

impl Drop for GradNode {
    /// Releases a chain of recorded ops iteratively: a history of a million ops (a running sum
    /// kept with gradients on) would otherwise be freed by a million nested drops.
    fn drop(&mut self) {
        let mut stack: SmallVec<[Arc<GradNode>; 8]> = SmallVec::new();
        take_node_sources(&mut self.inputs, &mut stack);
        while let Some(mut node) = stack.pop() {
            // The last owner empties the node in place (moving it out of its `Arc` would copy
            // it whole); dropping it then releases nothing recursively.
            if let Some(last) = Arc::get_mut(&mut node) {
                take_node_sources(&mut last.inputs, &mut stack);
            }
        }
    }
}

impl GradNode {
    /// Keeps `lse`, the log-sum-exp part recorded over this attention output's inputs, for the
    /// backward pass: recorded in the forward pass, fusion computes it in the output's kernel,
    /// so the backward pass does not run the scores a third time to find it.
    pub(crate) fn save_attention_lse(&self, lse: Tensor) {
        if let Some(saved) = self.saved.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            saved.attention_lse = Some(lse);
        }
    }
}

/// Moves the gradient nodes `inputs` hold onto `stack`.
fn take_node_sources(inputs: &mut [InputSlot], stack: &mut SmallVec<[Arc<GradNode>; 8]>) {
    for slot in inputs {
        // A leaf's source is dropped here, as before.
        if let Some(GradSource::Node(n)) = slot.source.take() {
            stack.push(n);
        }
    }
}

/// Marks `t` as a leaf whose gradient [`Grads`] collects and returns the leaf's identity (the
/// one it has already, for a leaf). Misuse (checked by the caller): an integer tensor, or one
/// that already has gradient history from ops.
pub(crate) fn mark_leaf(t: &Tensor) -> Result<u64, &'static str> {
    if t.quant_layout().is_some() {
        return Err("a quantized weight has no gradient (quantize a trained weight for serving)");
    }
    if !t.dtype().is_float() {
        return Err("only floating-point tensors can require gradients");
    }
    t.device().engine().with_state(|_| {
        let mut meta = t.grad_meta().lock().unwrap_or_else(|p| p.into_inner());
        match &*meta {
            Some(GradSource::Leaf(id)) => Ok(*id),
            Some(GradSource::Node(_)) => {
                Err("the tensor is the result of recorded ops; only leaves can be marked (use detach() first)")
            }
            None => {
                let id = NEXT_LEAF.fetch_add(1, Ordering::Relaxed);
                replace_meta(&mut meta, Some(GradSource::Leaf(id)));
                Ok(id)
            }
        }
    })
}

/// The gradient bookkeeping of `t`'s current version.
pub(crate) fn source_of(t: &Tensor) -> Option<GradSource> {
    if !in_use() {
        return None;
    }
    t.device().engine().with_state(|_| t.grad_meta().lock().unwrap_or_else(|p| p.into_inner()).clone())
}

/// Misuse of an in-place update of `t` (checked by the caller before recording): a leaf that
/// requires gradients cannot change while gradients are recorded, or its gradient would
/// silently refer to a value that no longer exists.
pub(crate) fn check_in_place(t: &Tensor) -> Result<(), &'static str> {
    if grad_enabled() && matches!(source_of(t), Some(GradSource::Leaf(_))) {
        return Err("a leaf that requires gradients cannot be updated in place while gradients are recorded \
                    (update parameters inside braid::no_grad, as optimizers do)");
    }
    Ok(())
}

/// Whether an op can pass gradients to its inputs (given a floating-point result).
fn differentiable(op: &Op) -> bool {
    match op {
        Op::Unary(_)
        | Op::Binary(_)
        | Op::BinaryScalar { .. }
        | Op::Select
        | Op::Clamp { .. }
        | Op::Cast
        | Op::Matmul
        | Op::Reshape
        | Op::Permute(_)
        | Op::Expand
        | Op::Narrow { .. }
        | Op::Cat { .. }
        | Op::Gather { .. }
        | Op::IndexSelect { .. }
        | Op::ScatterAdd { .. }
        | Op::Scatter { .. }
        | Op::Contiguous
        | Op::ToDevice => true,
        Op::Reduce { op, .. } => *op != ReduceOp::ArgMax,
        // The output's derivative is recorded as the gradient parts, whose own derivatives
        // (second derivatives of attention) are not defined.
        Op::Attention { part, .. } => *part == braid_graph::AttentionPart::Out,
        Op::Input | Op::Full(_) | Op::Arange { .. } | Op::Rand { .. } | Op::Randn { .. } | Op::Compare(_) => false,
        // Collectives carry no gradient: data parallelism reduces gradients, it does not
        // differentiate through the reduction.
        Op::Event | Op::Collective(_) => false,
        // Refused when recorded with an input that needs a gradient (see `Tensor::matmul`).
        Op::QuantMatmul(_) | Op::Quantize(_) => false,
    }
}

/// Which inputs (given which of them need gradients) and whether the output the derivative of
/// `op` reads.
fn saves(op: &Op, needs: &[bool]) -> (SmallVec<[bool; 3]>, bool) {
    let all = |on: bool| SmallVec::<[bool; 3]>::from_elem(on, needs.len());
    match op {
        Op::Unary(u) => (all(u.def().saves.inputs()), u.def().saves.output()),
        Op::Binary(b) | Op::BinaryScalar { op: b, .. } => (all(b.def().saves.inputs()), b.def().saves.output()),
        Op::Select => (SmallVec::from_slice(&[true, false, false]), false),
        Op::Clamp { .. } => (all(true), true),
        Op::Reduce { op: ReduceOp::Max | ReduceOp::Min, .. } => (all(true), true),
        // dA = g B^T needs B; dB = A^T g needs A.
        Op::Matmul => (SmallVec::from_slice(&[needs[1], needs[0]]), false),
        // The source's gradient is scattered to where the index read it.
        Op::Gather { .. } | Op::IndexSelect { .. } => (SmallVec::from_slice(&[false, needs[0]]), false),
        // The source's gradient is gathered from where the index sent it.
        Op::ScatterAdd { .. } => (SmallVec::from_slice(&[false, needs[2], false]), false),
        // The base's gradient is zeroed where the index wrote, the source's gathered there.
        Op::Scatter { .. } => (SmallVec::from_slice(&[false, needs[0] || needs[2], false]), false),
        // Every gradient recomputes the scores from q and k and reads v and the output.
        Op::Attention { .. } => (all(true), true),
        _ => (all(false), false),
    }
}

/// Autograd's part of recording one op: built before the engine lock is taken, run under it
/// (as the engine's [`Track`] callback), finished after it is released.
pub(crate) struct Tracker<'a> {
    op: Op,
    inputs: &'a [&'a Tensor],
    /// The tensor an in-place op moves to a new version.
    in_place: Option<&'a Tensor>,
    out_shape: Shape,
    out_dtype: DType,
    device: Device,
    stream: StreamId,
    /// The output's bookkeeping, for a fresh tensor.
    pub(crate) result: Option<GradSource>,
    /// Bookkeeping replaced or copied under the lock, dropped after it (dropping may release
    /// graph handles, which takes the lock).
    graveyard: Vec<GradSource>,
}

impl<'a> Tracker<'a> {
    /// A tracker when autograd may be involved in recording `op`, else `None` (the fast path).
    pub(crate) fn new(
        op: &Op,
        inputs: &'a [&'a Tensor],
        in_place: Option<&'a Tensor>,
        out: (&Shape, DType, &Device, StreamId),
    ) -> Option<Tracker<'a>> {
        // Nothing to record: no gradients anywhere yet, a source op, or (outside an in-place
        // update, which must still keep or drop the tensor's bookkeeping) gradients turned off.
        if !in_use() || inputs.is_empty() || (in_place.is_none() && !grad_enabled()) {
            return None;
        }
        Some(Tracker {
            op: op.clone(),
            inputs,
            in_place,
            out_shape: out.0.clone(),
            out_dtype: out.1,
            device: out.2.clone(),
            stream: out.3,
            result: None,
            graveyard: Vec::new(),
        })
    }

    /// The output's bookkeeping, once recording is done.
    pub(crate) fn into_result(self) -> Option<GradSource> {
        self.result
    }

    /// Under the engine lock: reads the inputs' bookkeeping for the versions `ids` and records
    /// the output's.
    pub(crate) fn run(&mut self, retainer: &mut Retainer<'_>, ids: &[NodeId], out: NodeId) {
        let sources: SmallVec<[Option<GradSource>; 3]> =
            crate::small(self.inputs.iter().map(|t| t.grad_meta().lock().unwrap_or_else(|p| p.into_inner()).clone()));
        let tracked = grad_enabled()
            && self.out_dtype.is_float()
            && differentiable(&self.op)
            && sources.iter().any(Option::is_some);
        let new = if tracked {
            let needs: SmallVec<[bool; 3]> = crate::small(sources.iter().map(Option::is_some));
            let (save_inputs, save_output) = saves(&self.op, &needs);
            // The saved inputs and the input slots in one pass, element by element (see
            // `crate::small`).
            let mut inputs: SmallVec<[Option<Tensor>; 3]> = SmallVec::new();
            let mut slots: SmallVec<[InputSlot; 3]> = SmallVec::new();
            for (((t, &id), &save), source) in self.inputs.iter().zip(ids).zip(&save_inputs).zip(sources) {
                inputs.push(save.then(|| {
                    let saved = retainer.retain_saved(id);
                    Tensor::saved_from_node(id, t.shape().clone(), t.dtype(), t.device().clone(), saved)
                }));
                slots.push(InputSlot {
                    source,
                    shape: t.shape().clone(),
                    dtype: t.dtype(),
                    device: t.device().clone(),
                });
            }
            let output = save_output.then(|| {
                let saved = retainer.retain_saved(out);
                Tensor::saved_from_node(out, self.out_shape.clone(), self.out_dtype, self.device.clone(), saved)
            });
            Some(GradSource::Node(Arc::new(GradNode {
                op: self.op.clone(),
                seq: NEXT_SEQ.fetch_add(1, Ordering::Relaxed),
                device: self.device.clone(),
                stream: self.stream,
                inputs: slots,
                out_shape: self.out_shape.clone(),
                out_dtype: self.out_dtype,
                saved: Mutex::new(Some(Saved { inputs, output, attention_lse: None })),
            })))
        } else {
            self.graveyard.extend(sources.into_iter().flatten());
            None
        };
        match self.in_place {
            Some(t) => {
                let mut meta = t.grad_meta().lock().unwrap_or_else(|p| p.into_inner());
                // Without gradients a leaf stays the same leaf (an optimizer update); anything
                // else loses its history.
                let keep_leaf = !tracked && matches!(&*meta, Some(GradSource::Leaf(_)));
                if keep_leaf {
                    retainer.mark_persistent(out);
                } else if let Some(old) = replace_meta(&mut meta, new) {
                    self.graveyard.push(old);
                }
            }
            None => self.result = new,
        }
    }
}
