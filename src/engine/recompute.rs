//! Which values autograd saved a flush leaves uncomputed, to be computed again where the
//! derivative reads them (rematerialization, as a compiler's min-cut partitioner does it, in a
//! greedy form).
//!
//! A forward pass read before its backward is recorded (the loss read of an eager training
//! step) would otherwise write every saved value to memory and keep it until the backward pass
//! reads it. For a saved value that is a cheap elementwise function (a cast, an `exp`, a
//! comparison, a view) of values that are cheaper to keep, that is the wrong trade: the
//! cross-entropy of a language model saves `exp(logits - max)` in f32 and a one-hot mask, three
//! times the bytes of the bf16 logits they are computed from. Such a value, and the elementwise
//! nodes between it and what it is computed from, stay pending after the flush (their readers
//! in the flush compute them inline, fused); what they are computed from is kept instead; the
//! backward pass recomputes them inside its own fused kernels.
//!
//! A value qualifies when:
//! - only autograd holds it (its handles are all saved ones) or pending work the flush leaves
//!   reads it (a backward pass recorded before the loss read), no tensor of the program names
//!   it, and the flush does not read it out (not a target);
//! - it and the nodes recomputed with it are elementwise ops, views or constants on one stream,
//!   with no control edges, whose readers in the flush are elementwise ops or reductions on
//!   that stream, or for views also products and attention, which read through views (so the
//!   flush fuses them and never writes them);
//! - it is not a parameter's version;
//! - what it is computed from is computed before the flush, kept by the flush anyway, or kept
//!   for it (the frontier), and the frontier it adds, with the values from before the flush it
//!   keeps alive that would otherwise be freed, costs fewer bytes than the value itself;
//!   or, for views, no more bytes than every view over the same value that the pending work
//!   reads (attention's q, k and v split from one product: keeping the product is keeping
//!   them, without three copy kernels).
//!
//! - it is not what a choice already made relies on being kept (values are considered from the
//!   last recorded: a layer norm's normalized rows are chosen, and the residual stream value
//!   they are computed from stays kept; chosen the other way round, each layer's rows would
//!   need the residual stream computed again from the first layer on, all at once).
//!
//! This module only chooses; `flush::extract` marks the choice (`keep`, and
//! `EngineState::recomputing`, which keeps later events from waiting for the chosen nodes and
//! tells fusion to compute them inside their readers) and `run::install` leaves the chosen nodes
//! pending. It never changes what is computed, only when.

use super::{EngineState, Value};
use braid_graph::{NodeId, Op};
use hashbrown::HashSet;

/// At most this many nodes are recomputed for one saved value.
const MAX_RECOMPUTED: usize = 16;

/// What a flush leaves pending for recomputation and what it keeps so that it can.
#[derive(Default)]
pub(super) struct Recompute {
    /// Nodes of the flush that stay pending after it (saved values and what they are
    /// recomputed through).
    pub(super) pending: HashSet<NodeId>,
    /// Nodes of the flush it keeps (materializes) for them.
    pub(super) kept: HashSet<NodeId>,
}

/// An op cheap enough to compute again inside another kernel: elementwise, a view, a constant.
pub(super) fn cheap(op: &Op) -> bool {
    op.is_elementwise()
        || matches!(op, Op::Reshape | Op::Permute(_) | Op::Expand | Op::Narrow { .. } | Op::Full(_) | Op::Arange { .. })
}

/// A movement op: a view of its input wherever the layout allows.
fn is_view(op: &Op) -> bool {
    matches!(op, Op::Reshape | Op::Permute(_) | Op::Expand | Op::Narrow { .. })
}

/// Chooses, among `order` (the flush's nodes in recording order; `in_flush` tells them apart),
/// the saved values to leave pending. `targets` are what the flush reads out; `superseded`
/// are saved values the backward pass reads from elsewhere (freed, not kept for it).
pub(super) fn choose(
    st: &EngineState,
    order: &[NodeId],
    targets: &[NodeId],
    in_flush: impl Fn(NodeId) -> bool,
    superseded: &HashSet<NodeId>,
) -> Recompute {
    let graph = &st.graph;
    let mut chosen = Recompute::default();
    // Whether every reader of `id` in the flush fuses with it: elementwise or a reduction, on
    // its stream; for a view, also a matrix product or attention, which read their operands
    // through views (a linear layer's transposed weight, heads split by a permute).
    let readers_fuse = |id: NodeId| {
        let stream = graph.node(id).stream;
        let view = is_view(&graph.node(id).op);
        graph.successors(id).filter(|&s| in_flush(s)).all(|s| {
            let n = graph.node(s);
            let reads_views = matches!(n.op, Op::Matmul | Op::QuantMatmul(_) | Op::Attention { .. });
            n.stream == stream && (cheap(&n.op) || matches!(n.op, Op::Reduce { .. }) || (view && reads_views))
        })
    };
    let recomputable = |id: NodeId| {
        let n = graph.node(id);
        cheap(&n.op) && graph.in_edges(id).1.is_empty() && readers_fuse(id)
    };
    // Values a choice relies on being kept: autograd holds them, so they were counted as
    // kept anyway. Chosen later, they would have to be computed again before each value that
    // relies on them, and a residual stream's values chained across every layer would be
    // computed again (and written) at once.
    let mut relied: HashSet<NodeId> = HashSet::new();
    // Later values first: a value read later by the backward pass (a layer norm's normalized
    // rows) is chosen before what it is computed from (the residual stream), which it then
    // relies on.
    for &v in order.iter().rev() {
        let n = graph.node(v);
        // The cheap tests first: this runs over every node of a read's flush. A tensor's own
        // handle keeps a value; so does being a parameter's version (left pending, it would keep
        // the version before it, and that one's moments, alive one more step instead).
        if n.persistent
            || n.handles != u32::from(n.saved)
            || !cheap(&n.op)
            || targets.contains(&v)
            || relied.contains(&v)
            || chosen.pending.contains(&v)
            || superseded.contains(&v)
        {
            continue;
        }
        // Kept only for autograd's saved handles or for pending work the flush leaves (the
        // backward pass recorded before the loss read).
        let needed_later = n.handles > 0 || graph.successors(v).any(|s| !in_flush(s));
        if !needed_later || !recomputable(v) {
            continue;
        }
        // The nodes recomputed with `v`, and the nodes of the flush they need kept.
        let mut closure = vec![v];
        let mut frontier: Vec<NodeId> = Vec::new();
        // Bytes of values from before the flush that no tensor names, which would be freed
        // after it but stay alive for the recomputation.
        let mut held_longer = 0usize;
        let mut before: Vec<NodeId> = Vec::new();
        let mut stack: Vec<NodeId> = graph.in_edges(v).0.into_vec();
        let mut relies: Vec<NodeId> = Vec::new();
        let mut ok = true;
        while let Some(p) = stack.pop() {
            if closure.contains(&p) || frontier.contains(&p) {
                continue;
            }
            let pn = graph.node(p);
            if pn.device != n.device {
                ok = false;
                break;
            }
            match &pn.value {
                // Computed before the flush: the pending node's edge holds it.
                Some(Value::Ready(_) | Value::Host(_)) => {
                    if pn.handles == 0 && !before.contains(&p) {
                        held_longer += pn.bytes();
                    }
                    before.push(p);
                    continue;
                }
                None if in_flush(p) => {}
                _ => {
                    ok = false;
                    break;
                }
            }
            let held = pn.handles > super::collective::own_handles(&pn.op) && !chosen.pending.contains(&p);
            let kept_anyway = chosen.kept.contains(&p) || held || graph.successors(p).any(|s| !in_flush(s));
            if held {
                relies.push(p);
            }
            if kept_anyway || chosen.pending.contains(&p) {
                continue;
            }
            if pn.stream == n.stream && recomputable(p) && closure.len() < MAX_RECOMPUTED {
                closure.push(p);
                stack.extend(graph.in_edges(p).0);
            } else {
                frontier.push(p);
            }
        }
        let frontier_bytes: usize = frontier.iter().map(|&p| graph.node(p).bytes()).sum();
        // Views cost nothing to compute again: keeping what they view instead is no worse at
        // equal bytes, and spares a copy (a view kept is written out).
        let views = closure.iter().all(|&c| is_view(&graph.node(c).op));
        let kept = frontier_bytes + held_longer;
        if ok && (kept < n.bytes() || (views && kept <= n.bytes())) {
            chosen.pending.extend(closure);
            chosen.kept.extend(frontier);
            relied.extend(relies);
        } else if let Some((chain, base)) = views_together(graph, v, &in_flush, targets, &recomputable) {
            chosen.pending.extend(chain);
            chosen.kept.insert(base);
        }
    }
    chosen
}

/// For a view `v` needed later: the views between it and the value of the flush they view
/// (`base`), when keeping `base` costs no more than keeping every view over it that is needed
/// later, and those views can all stay pending. Attention's query, key and value, split by
/// views from one product, are each a third of it: one at a time none is worth keeping the
/// product for, together they are, and each kept alone would be a copy kernel.
fn views_together(
    graph: &braid_graph::Graph<Value>,
    v: NodeId,
    in_flush: &impl Fn(NodeId) -> bool,
    targets: &[NodeId],
    recomputable: &impl Fn(NodeId) -> bool,
) -> Option<(Vec<NodeId>, NodeId)> {
    let n = graph.node(v);
    // A view that could stay pending: of this flush, on `v`'s stream, named by no tensor.
    let pending_view = |c: NodeId| {
        let cn = graph.node(c);
        is_view(&cn.op)
            && in_flush(c)
            && cn.stream == n.stream
            && !cn.persistent
            && cn.handles == u32::from(cn.saved)
            && !targets.contains(&c)
            && recomputable(c)
    };
    let mut chain = vec![v];
    let base = loop {
        let [p] = graph.in_edges(*chain.last()?).0[..] else { return None };
        if pending_view(p) && graph.node(p).handles == 0 && graph.successors(p).all(in_flush) {
            chain.push(p);
        } else {
            break p;
        }
    };
    let bn = graph.node(base);
    if !in_flush(base) || bn.device != n.device || bn.value.is_some() || targets.contains(&base) {
        return None;
    }
    // Every view over `base` needed later, through views that could stay pending.
    let mut later = 0usize;
    let mut stack: Vec<NodeId> = graph.successors(base).filter(|&s| pending_view(s)).collect();
    let mut seen: Vec<NodeId> = Vec::new();
    while let Some(w) = stack.pop() {
        if seen.contains(&w) {
            continue;
        }
        seen.push(w);
        let wn = graph.node(w);
        if wn.handles > 0 || graph.successors(w).any(|s| !in_flush(s)) {
            later += wn.bytes();
        }
        stack.extend(graph.successors(w).filter(|&s| pending_view(s)));
    }
    (bn.bytes() <= later).then_some((chain, base))
}
