//! The rules by which a node joins a growing kernel ([`Grouper::check`]): same stream, no
//! wait or control edge between, a level in the kernel's index space, the target's limits on
//! nodes, inputs and bound buffers, no cycle between kernels, and the refusals' reasons in
//! words. `super` decides which kernels a node tries, in which order.
//!
//! Must never: place a node (that is `super::Grouper::place`'s).

use super::classify::{Class, Level, along, class, reduce_level, reduced};
use super::{Grouper, Kind};
use braid_graph::{Op, ValueRef};

impl Grouper<'_> {
    /// Whether a node of group `g` reads a folded view that is a transpose.
    fn reads_transposed(&self, g: usize) -> bool {
        let transposed_input = |v: &ValueRef| matches!(*v, ValueRef::Node(j) if self.folded[j] && self.transposes[j]);
        self.groups[g].nodes.iter().any(|&k| self.graph.nodes[k].inputs.iter().any(transposed_input))
    }

    /// Whether node `i` is a widening cast of a product's result that should not be the
    /// product's epilogue: the product's own values are written anyway (kept, or read by
    /// another kernel), or the cast's values are not kept and every reader of them is
    /// elementwise or a reduction, which converts the narrow values as it reads them. (A kept
    /// cast, such as an f32 gradient of a bf16 product, stays the epilogue: the product then
    /// writes only the wide values.)
    fn widens_a_kept_or_streamed_product(&self, i: usize) -> bool {
        let node = &self.graph.nodes[i];
        let [ValueRef::Node(p)] = node.inputs.as_slice() else { return false };
        let product = &self.graph.nodes[*p];
        if node.op != Op::Cast
            || !matches!(product.op, Op::Matmul | Op::QuantMatmul(_))
            || node.dtype.size() <= product.dtype.size()
        {
            return false;
        }
        let product_written = product.keep || self.readers[*p].iter().any(|&r| r != i);
        let streamed = !node.keep
            && self.readers[i]
                .iter()
                .all(|&r| matches!(class(&self.graph.nodes[r].op), Class::Elementwise | Class::Reduce));
        product_written || streamed
    }

    /// Whether group `from` depends (transitively) on group `to`.
    fn depends(&self, from: usize, to: usize) -> bool {
        let mut stack = vec![from];
        let mut seen = vec![false; self.groups.len()];
        while let Some(x) = stack.pop() {
            if x == to {
                return true;
            }
            if !std::mem::replace(&mut seen[x], true) {
                stack.extend(&self.groups[x].deps);
            }
        }
        false
    }

    /// Whether concatenation `i` may join map kernel `g`: the kernel computes some of its
    /// inputs, reads it directly, and writes them nowhere else (nothing else reads them, none is
    /// kept), so the loop stores them into their regions instead (`braid_lowering`'s
    /// `lower/cat.rs`); one concatenation per kernel.
    fn cat_joins(&self, g: usize, i: usize) -> Result<(), String> {
        let nid = self.graph.nodes[i].id.index();
        let nodes = &self.groups[g].nodes;
        if nodes.iter().any(|&k| matches!(self.graph.nodes[k].op, Op::Cat { .. })) {
            return Err("this kernel already writes a concatenation".into());
        }
        let mut claimed = false;
        for (_, j, _) in self.producers(i) {
            if self.group_of[j] != Some(g) {
                continue;
            }
            if self.graph.nodes[j].keep || self.readers[j].iter().any(|&r| r != i) {
                return Err(format!(
                    "n{} is read beside concatenation n{nid}: the kernel writes it anyway",
                    self.graph.nodes[j].id.index()
                ));
            }
            claimed = true;
        }
        if !claimed {
            return Err(format!("concatenation n{nid} takes no value this kernel computes"));
        }
        Ok(())
    }

    /// Can node `i` join group `g`? The level it would have, or why not.
    pub(super) fn check(&self, g: usize, i: usize) -> Result<Level, String> {
        let grp = &self.groups[g];
        let node = &self.graph.nodes[i];
        let nid = node.id.index();
        if grp.stream != node.stream {
            return Err(crate::Refusal::different_streams(grp.stream, node.stream));
        }
        if node.after.iter().any(|a| grp.waits.binary_search(a).is_err()) {
            return Err(format!("an event wait or control edge orders n{nid} after work in this kernel"));
        }
        // A copy computed again for a backward pass joins only kernels copies start (where the
        // backward pass's readers join it): in a forward kernel it would be written out.
        if node.recomputed && !self.graph.nodes[grp.nodes[0]].recomputed {
            return Err(format!("n{nid} is computed again for the backward pass, not in a forward kernel"));
        }
        // Every read of a value of this group must be direct (no view of a value being computed).
        let producers = self.producers(i);
        if producers.iter().any(|&(_, j, via)| via && self.group_of[j] == Some(g)) {
            return Err(format!("n{nid} reads a value of this kernel through a view"));
        }
        let inside = |j: usize| self.group_of[j] == Some(g);
        // A concatenation in a map kernel is written region by region; no node reads it there,
        // and no reduction turns the kernel into a row kernel (which writes no regions).
        let writes_cat = || grp.nodes.iter().any(|&k| matches!(self.graph.nodes[k].op, Op::Cat { .. }));
        if producers.iter().any(|&(_, j, _)| inside(j) && matches!(self.graph.nodes[j].op, Op::Cat { .. })) {
            return Err(format!("n{nid} reads a concatenation this kernel writes region by region"));
        }
        if class(&node.op) == Class::Reduce && writes_cat() {
            return Err(format!("n{nid} would make a row kernel of one that writes a concatenation"));
        }
        let levels: Vec<Level> =
            producers.iter().filter(|&&(_, j, _)| inside(j)).map(|&(_, j, _)| self.level[j]).collect();
        let level = match (&grp.kind, class(&node.op)) {
            (Kind::Single | Kind::Attention, _) => return Err("a kernel of this kind does not fuse".into()),
            (Kind::Map(_), Class::Other) if matches!(node.op, Op::Cat { .. }) => {
                self.cat_joins(g, i)?;
                Level::Full
            }
            (Kind::Map(space), Class::Elementwise) if &node.shape == space => Level::Full,
            (Kind::Map(space), Class::Reduce) if self.graph.meta(node.inputs[0]).1 == space => {
                if self.options.copy_transposed_rows
                    && matches!(node.op, Op::Reduce { dim: None, .. })
                    && self.reads_transposed(g)
                {
                    // Fused, the reduction would read the view in its order, across lines; the
                    // map kernel writes its values in order first (a tiled loop).
                    return Err(format!("n{nid} reduces every element of a kernel that reads a transposed view"));
                }
                reduce_level(&node.op)
            }
            (Kind::Rows(full, axis), Class::Elementwise) => {
                let keep = reduced(full, *axis, true);
                let flat = reduced(full, *axis, false);
                // Sources number their elements over the kernel's whole index space.
                let source = matches!(node.op, Op::Arange { .. } | Op::Rand { .. } | Op::Randn { .. });
                if &node.shape == full && levels.iter().all(|&l| l != Level::Flat || axis.is_none()) {
                    Level::Full
                } else if source {
                    return Err(format!(
                        "n{nid} ({}) numbers its elements, which a reduced index space cannot",
                        node.op.name()
                    ));
                } else if node.shape == keep && levels.iter().all(|&l| l == Level::Keep) {
                    Level::Keep
                } else if node.shape == flat && levels.iter().all(|&l| l == Level::Flat) {
                    Level::Flat
                } else {
                    return Err(format!(
                        "index spaces {full} (reduced over {}) and {} differ",
                        along(*axis),
                        node.shape
                    ));
                }
            }
            (Kind::Rows(full, axis), Class::Reduce) => {
                let Op::Reduce { dim, .. } = node.op else { unreachable!() };
                let reductions =
                    grp.nodes.iter().filter(|&&j| matches!(self.graph.nodes[j].op, Op::Reduce { .. })).count();
                if reductions >= self.options.max_reductions {
                    return Err(format!(
                        "a row kernel with {reductions} reductions already re-reads its rows that often; a new kernel for n{nid} costs less"
                    ));
                }
                if dim != *axis || self.graph.meta(node.inputs[0]).1 != full || levels.iter().any(|&l| l != Level::Full)
                {
                    return Err(format!(
                        "a reduction over {} does not share rows reduced over {}",
                        along(dim),
                        along(*axis)
                    ));
                }
                reduce_level(&node.op)
            }
            (Kind::Matmul(_), Class::Elementwise) if self.widens_a_kept_or_streamed_product(i) => {
                return Err(format!(
                    "n{nid} widens the product's values to {}: its readers convert them as they read them, \
                     instead of the product writing them twice or wide",
                    node.dtype
                ));
            }
            (Kind::Matmul(out), Class::Elementwise) if &node.shape == out => Level::Full,
            (Kind::Map(space) | Kind::Matmul(space), _) => {
                return Err(format!("n{nid} ({}, {}) does not fit a kernel over {space}", node.op.name(), node.shape));
            }
            (Kind::Rows(..), Class::Matmul) => return Err("a matrix product starts its own kernel".into()),
            (Kind::Rows(..), _) => return Err(format!("n{nid} ({}) does not join a row kernel", node.op.name())),
        };
        // The target's limit on kernel size.
        if grp.nodes.len() >= self.options.max_nodes {
            return Err(format!("kernel node limit {} reached", self.options.max_nodes));
        }
        // The target's limit on kernel inputs.
        let new_inputs: Vec<ValueRef> = node
            .inputs
            .iter()
            .map(|&v| crate::underlying(self.graph, &self.folded, v))
            .filter(|&u| match u {
                ValueRef::Node(j) => !self.folded[j] && !inside(j),
                ValueRef::External(_) => true,
            })
            .filter(|u| !grp.inputs.contains(u))
            .collect();
        let mut distinct = new_inputs.clone();
        distinct.dedup();
        if grp.inputs.len() + distinct.len() > self.options.max_inputs {
            return Err(format!("kernel input limit {} reached", self.options.max_inputs));
        }
        // The target's limit on bound buffers: inputs and outputs together.
        if self.options.max_buffers != usize::MAX {
            let (opens, closes) = self.exposure(g, i);
            let outputs = (grp.exposed + usize::from(opens) - closes).max(1);
            let inputs = grp.inputs.len() + distinct.len();
            if inputs + outputs > self.options.max_buffers {
                return Err(format!(
                    "kernel buffer limit {} reached ({inputs} inputs and {outputs} outputs)",
                    self.options.max_buffers
                ));
            }
        }
        // No cycle: nothing this node reads from elsewhere may depend on this group.
        for u in &new_inputs {
            if let ValueRef::Node(j) = *u
                && let Some(h) = self.group_of[j]
                && self.depends(h, g)
            {
                return Err(format!(
                    "joining would form a cycle through the kernel of n{}",
                    self.graph.nodes[j].id.index()
                ));
            }
        }
        Ok(level)
    }
}
