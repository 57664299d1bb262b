//! The backward pass: walking recorded `GradNode`s from a loss and recording their
//! derivatives, and [`Grads`], the gradients it produces.

use super::hooks::BackwardHook;
use super::rules::{self, InFlight, Val};
use super::{GradNode, GradSource, Saved, no_grad, source_of};
use crate::device::Device;
use crate::stream::Stream;
use crate::tensor::{Tensor, misuse};
use braid_graph::{DType, Shape};
use hashbrown::HashMap;
use std::sync::Arc;

/// Gradients of leaves (tensors marked with [`Tensor::requires_grad`]), as lazy tensors.
///
/// Several backward passes can add into one `Grads` ([`Tensor::backward_into`]), which is
/// how gradients accumulate over micro-batches.
#[derive(Clone, Default)]
pub struct Grads {
    by_leaf: HashMap<u64, Tensor>,
}

impl Grads {
    /// No gradients yet.
    pub fn new() -> Grads {
        Grads::default()
    }

    /// The gradient of leaf `t` (same shape and dtype), or `None` when `t` is not a leaf or
    /// the loss does not depend on it.
    pub fn get(&self, t: &Tensor) -> Option<Tensor> {
        match source_of(t) {
            Some(GradSource::Leaf(id)) => self.by_leaf.get(&id).cloned(),
            _ => None,
        }
    }

    /// Sets the gradient of leaf `t` to `g`, replacing any (gradients averaged across devices,
    /// clipped, or computed some other way). Misuse when `t` is not a leaf that requires
    /// gradients, or `g` differs from it in shape, dtype or device.
    #[track_caller]
    pub fn insert(&mut self, t: &Tensor, g: Tensor) {
        let Some(GradSource::Leaf(id)) = source_of(t) else {
            misuse("Grads::insert", "t is not a leaf that requires gradients", &[("t", t.describe())])
        };
        if g.shape() != t.shape() || g.dtype() != t.dtype() || g.device() != t.device() {
            misuse(
                "Grads::insert",
                "a gradient has its leaf's shape, dtype and device",
                &[("t", t.describe()), ("g", g.describe())],
            );
        }
        self.by_leaf.insert(id, g);
    }

    /// The gradient of the leaf numbered `leaf`, if there is one.
    pub(crate) fn of_leaf(&self, leaf: u64) -> Option<Tensor> {
        self.by_leaf.get(&leaf).cloned()
    }

    /// How many leaves have a gradient.
    pub fn len(&self) -> usize {
        self.by_leaf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_leaf.is_empty()
    }

    /// The gradients in the order their leaves were made (a stable order: the same recorded
    /// structure on every call).
    pub fn values(&self) -> impl Iterator<Item = Tensor> + '_ {
        let mut leaves: Vec<&u64> = self.by_leaf.keys().collect();
        leaves.sort_unstable();
        leaves.into_iter().map(|l| self.by_leaf[l].clone())
    }

    /// These gradients, each replaced by `f` of it (for the same leaf; `f` keeps the shape,
    /// dtype and device, as [`insert`](Grads::insert) requires).
    pub fn map(&self, mut f: impl FnMut(&Tensor) -> Tensor) -> Grads {
        let by_leaf = self.by_leaf.iter().map(|(&leaf, g)| (leaf, f(g))).collect();
        Grads { by_leaf }
    }

    /// Forgets every gradient (the next `backward_into` starts from zero).
    pub fn clear(&mut self) {
        self.by_leaf.clear();
    }

    /// Adds `other`'s gradients into these (recorded lazily).
    #[track_caller]
    pub fn accumulate(&mut self, other: &Grads) {
        for (&leaf, g) in &other.by_leaf {
            self.add(leaf, g.clone());
        }
    }

    fn add(&mut self, leaf: u64, g: Tensor) {
        let sum = match self.by_leaf.remove(&leaf) {
            Some(prev) => no_grad(|| &prev + &g),
            None => g,
        };
        self.by_leaf.insert(leaf, sum);
    }
}

impl std::fmt::Debug for Grads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grads({} leaves)", self.by_leaf.len())
    }
}

impl Tensor {
    /// Records the backward pass from this scalar loss and returns the gradients of every
    /// leaf it depends on. Nothing runs until a gradient is read. Each derivative runs on the
    /// stream of the forward op it differentiates.
    ///
    /// The values saved for the backward pass are released afterwards (so memory does not
    /// stay pinned while `self` lives); to run backward through the same graph again, use
    /// [`Tensor::backward_with`] with `keep_graph`.
    ///
    /// Misuse (a panic at the caller's line): a loss with more than one element, an integer
    /// loss, a loss without gradient history, a graph already released by a backward pass.
    /// Run-time failures of the recorded work come back from the reads, as everywhere.
    #[track_caller]
    pub fn backward(&self) -> crate::Result<Grads> {
        let mut grads = Grads::new();
        self.backward_with(&mut grads, false)?;
        Ok(grads)
    }

    /// Like [`Tensor::backward`], adding into `grads` (gradient accumulation).
    #[track_caller]
    pub fn backward_into(&self, grads: &mut Grads) -> crate::Result<()> {
        self.backward_with(grads, false)
    }

    /// The backward pass, adding into `grads`; with `keep_graph` the saved values stay for
    /// another backward pass through the same ops.
    #[track_caller]
    pub fn backward_with(&self, grads: &mut Grads, keep_graph: bool) -> crate::Result<()> {
        self.backward_hooked(grads, keep_graph, None)
    }

    /// [`Tensor::backward_with`], telling `hook` where the walk is and letting it give the
    /// values of leaves that derivatives read (see [`super::hooks`]).
    #[track_caller]
    pub(crate) fn backward_hooked(
        &self,
        grads: &mut Grads,
        keep_graph: bool,
        mut hook: Option<&mut dyn BackwardHook>,
    ) -> crate::Result<()> {
        let describe = || [("loss", format!("{:?}", self))];
        if self.numel() != 1 || !self.dtype().is_float() {
            misuse("backward", "the loss must be a floating-point tensor with one element", &describe());
        }
        let root = match source_of(self) {
            None => misuse(
                "backward",
                "the loss has no gradient history: no tensor it depends on was marked with requires_grad \
                 (or it was recorded inside no_grad)",
                &describe(),
            ),
            Some(root) => root,
        };
        let nodes = reachable(&root);
        // Take (or copy) every saved value before recording anything, so that misuse leaves
        // `grads` untouched.
        let mut saved: Vec<Saved> = Vec::with_capacity(nodes.len());
        for node in &nodes {
            let mut slot = node.saved.lock().unwrap_or_else(|p| p.into_inner());
            let s = if keep_graph { slot.clone() } else { slot.take() };
            drop(slot);
            match s {
                Some(s) => saved.push(s),
                None => {
                    for (node, s) in nodes.iter().zip(saved) {
                        *node.saved.lock().unwrap_or_else(|p| p.into_inner()) = Some(s);
                    }
                    misuse(
                        "backward",
                        "this graph was already released by a backward pass; pass keep_graph = true to \
                         backward_with to differentiate through the same ops again",
                        &describe(),
                    )
                }
            }
        }
        // Where the backward pass starts in the recording order: a flush holding both passes
        // computes cheap saved values again for it (the engine's `recompute_copies`).
        self.device().engine().mark_backward();
        // Gradients keep their forward dtypes: autocast does not apply to the backward pass.
        crate::amp::off(|| {
            no_grad(|| {
                // d loss / d loss = 1, kept as a constant until an op needs it as a tensor.
                let mut pending: HashMap<*const GradNode, InFlight> = HashMap::with_capacity(nodes.len().min(4096));
                let seed_at = (self.shape(), self.dtype(), self.device());
                route(&root, InFlight::Val(Val::S(1.0)), seed_at, &mut pending, grads);
                let current = crate::recorder::current_stream(self.device().id());
                for (node, saved) in nodes.iter().zip(&saved) {
                    let Some(g) = pending.remove(&Arc::as_ptr(node)) else { continue };
                    let replaced = match hook.as_deref_mut() {
                        Some(hook) => {
                            hook.reached(node.seq, grads);
                            super::hooks::substitute(node, saved, hook)
                        }
                        None => None,
                    };
                    let saved = replaced.as_ref().unwrap_or(saved);
                    let differentiate = || {
                        let input_grads = rules::input_grads(node, saved, g);
                        for (slot, ig) in node.inputs.iter().zip(input_grads) {
                            if let (Some(source), Some(ig)) = (&slot.source, ig) {
                                route(source, ig, (&slot.shape, slot.dtype, &slot.device), &mut pending, grads);
                            }
                        }
                    };
                    if node.stream == current {
                        differentiate();
                    } else {
                        Stream::new(node.device.clone(), node.stream).scope(differentiate);
                    }
                }
                rules::forget_transposed();
            })
        });
        Ok(())
    }
}

/// Every `GradNode` reachable from `root`, latest first (a valid order for the backward pass:
/// a node is recorded after all of its inputs).
pub(super) fn reachable(root: &GradSource) -> Vec<Arc<GradNode>> {
    // Sized for a small graph at once (growing rehashes every entry, several times over).
    let mut seen: HashMap<*const GradNode, Arc<GradNode>> = HashMap::with_capacity(64);
    let mut stack: Vec<Arc<GradNode>> = Vec::with_capacity(64);
    if let GradSource::Node(n) = root {
        stack.push(n.clone());
    }
    while let Some(n) = stack.pop() {
        if seen.contains_key(&Arc::as_ptr(&n)) {
            continue;
        }
        for slot in &n.inputs {
            if let Some(GradSource::Node(input)) = &slot.source {
                stack.push(input.clone());
            }
        }
        seen.insert(Arc::as_ptr(&n), n);
    }
    let mut nodes: Vec<Arc<GradNode>> = seen.into_values().collect();
    nodes.sort_by_key(|n| std::cmp::Reverse(n.seq));
    nodes
}

/// Adds gradient `g` (of a value with shape, dtype and device `at`) to where `source`
/// collects it (on the current stream).
fn route(
    source: &GradSource,
    g: InFlight,
    at: (&Shape, DType, &Device),
    pending: &mut HashMap<*const GradNode, InFlight>,
    grads: &mut Grads,
) {
    match source {
        GradSource::Leaf(leaf) => grads.add(*leaf, g.to_tensor(at.0, at.1, at.2)),
        GradSource::Node(node) => {
            let key = Arc::as_ptr(node);
            let sum = match pending.remove(&key) {
                Some(prev) => prev.plus(g, at),
                None => g,
            };
            pending.insert(key, sum);
        }
    }
}
