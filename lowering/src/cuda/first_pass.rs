//! The first pass of a plain row kernel: its reductions that read no reduction's value (a
//! cross-entropy's maximum and target logit, a layer norm backward's two sums) fold in one
//! sweep over the row, then combine one after another, instead of a sweep each. `plan_keep`
//! plans its shared memory for the same sweeps ([`RowPlan::sweep_roots`]).
//!
//! Must never: fold a reduction that reads another's value (through any chain of nodes) into
//! the first pass, or print a per-row value that reads a reduction before that reduction.

use super::rows::{Reduced, RowPlan};
use super::*;
use crate::row_passes::after_reductions;

/// A reduction of the kernel: (node, op, operand, operand's dtype).
pub(super) type Reduction = (usize, ReduceOp, usize, DType);

/// Prints reductions folded in one sweep and returns their values' expressions, in order.
pub(super) type Merged<'f> = dyn FnMut(&mut String, &[Reduction]) -> Result<Vec<String>, String> + 'f;

impl RowPlan<'_> {
    /// The live reductions that read no reduction's value, in node order, when there are two
    /// or more (the first pass); else none.
    pub fn first_pass(&self) -> Vec<Reduction> {
        let after = after_reductions(&self.r.expr);
        let first: Vec<Reduction> = self.reductions().into_iter().filter(|&(_, _, x, _)| !after[x]).collect();
        if first.len() >= 2 { first } else { vec![] }
    }

    /// The roots of each sweep over the row, in order: the first pass's operands together,
    /// then each later reduction's operand.
    pub fn sweep_roots(&self) -> Vec<Vec<usize>> {
        let first = self.first_pass();
        let mut sweeps: Vec<Vec<usize>> = vec![];
        if !first.is_empty() {
            sweeps.push(first.iter().map(|&(_, _, x, _)| x).collect());
        }
        let later = self.reductions().into_iter().filter(|r| !first.contains(r));
        sweeps.extend(later.map(|(_, _, x, _)| vec![x]));
        sweeps
    }

    /// The per-row values the first pass's folds may read (every node before its last
    /// reduction that reads no reduction's value), printed: what a split kernel's merged first
    /// pass (`split.rs`) prints before its sweep. Nothing without a first pass.
    pub fn per_row_values_before_first_pass(&self, out: &mut String) -> Result<(), String> {
        let Some(&(last, ..)) = self.first_pass().last() else { return Ok(()) };
        let after = after_reductions(&self.r.expr);
        (0..last).filter(|&j| !after[j]).try_for_each(|j| {
            // Never called: a node that reads no reduction is none.
            self.per_row_value(out, j, &mut |_, i, _, _, _| Err(format!("node {i}: a reduction before the first pass")))
        })
    }

    /// [`Self::per_row_values`] of every node, the first pass's reductions printed together by
    /// `merged` where the first of them falls (after the per-row values they may read, none of
    /// which reads a reduction), the later ones by `reduced`.
    pub fn per_row_values_merged(
        &self,
        out: &mut String,
        merged: &mut Merged<'_>,
        reduced: &mut Reduced<'_>,
    ) -> Result<(), String> {
        let nodes = &self.r.expr.nodes;
        let first = self.first_pass();
        let (Some(&(start, ..)), Some(&(last, ..))) = (first.first(), first.last()) else {
            return self.per_row_values(out, nodes.len(), reduced);
        };
        let after = after_reductions(&self.r.expr);
        let mut printed = vec![false; nodes.len()];
        for i in 0..nodes.len() {
            if printed[i] {
                continue;
            }
            if i != start {
                self.per_row_value(out, i, reduced)?;
                continue;
            }
            for j in (start + 1..last).filter(|&j| !after[j]) {
                self.per_row_value(out, j, reduced)?;
                printed[j] = true;
            }
            let values = merged(out, &first)?;
            for (&(k, ..), value) in first.iter().zip(values) {
                // Checked and declared as `per_row_value` does, with the value the pass folded.
                self.per_row_value(out, k, &mut |_, _, _, _, _| Ok(value.clone()))?;
                printed[k] = true;
            }
        }
        Ok(())
    }
}
