//! Host C printing of the body of row kernels with positions after the axis (`inner > 1`:
//! reductions along a non-last axis, such as a bias gradient's sum over the batch, re-tiled by
//! the CPU into column blocks): each row is `len` steps along the axis of `inner` positions
//! each, walked with one stride along the axis and one across the positions. Per-row values are
//! arrays of `inner`; each pass steps along the axis and, innermost, across the positions (a
//! loop the compiler vectorises over contiguous columns), folding each position's accumulator
//! one value at a time, as the interpreter folds rows with positions after the axis (float sums
//! without compensation, extremes keeping the first and NaN sticky), so the bits are the
//! interpreter's. The entry point, the checks and the row starts are [`super::rows`]'.

use super::along;
use crate::cexpr::*;
use crate::kernel::{RowKernel, View};
use crate::row_passes::{KeepPlan, RowPasses};
use braid_graph::ReduceOp;
use braid_graph::expr::ExprOp;
use std::fmt::Write;

/// The most positions after the axis printed (per-row values are arrays of this many on the
/// stack); more are interpreted.
pub const MAX_INNER: usize = 4096;

/// A row kernel with `inner` positions after its axis, and each view's strides.
pub(super) struct Columns<'a> {
    pub r: &'a RowKernel,
    pub len: usize,
    pub inner: usize,
    /// Per load and per store: the stride along the axis.
    pub load_strides: &'a [isize],
    pub store_strides: &'a [isize],
    /// Per load, then per store: the stride across the positions after the axis.
    pub inner_strides: &'a [isize],
}

impl Columns<'_> {
    /// Prints the statements of one row (inside the loop over rows, after the row starts
    /// `o{slot}` and `w{s}`): per-row values, one pass per reduction, the stores.
    pub fn body(
        &self,
        out: &mut String,
        passes: &RowPasses,
        live: &[bool],
        phases: &[usize],
        keep: &KeepPlan,
    ) -> Result<(), String> {
        let (r, len, inner) = (self.r, self.len, self.inner);
        let nodes = &r.expr.nodes;
        let loads = r.loads.len();
        let offset = |v: &View| {
            let slot = r.loads.iter().position(|x| &x.view == v).expect("a load's own view");
            along(&along(&format!("o{slot}"), "a", self.load_strides[slot]), "ii", self.inner_strides[slot])
        };
        let index = format!("(o * {}LL + p)", len * inner);
        // Checked even when dead: the CPU evaluates every node.
        let exprs: Vec<String> = (nodes.iter().enumerate())
            .map(|(i, n)| match n.op {
                ExprOp::Reduce(..) => Ok(String::new()),
                _ => node_expr(Dialect::Host, &r.expr, &r.loads, i, &offset, &index),
            })
            .collect::<Result<_, _>>()?;
        let mut done: Vec<usize> = vec![];
        // The per-row values computed so far, as scalars at position `ii`.
        let row_scalars = |out: &mut String, done: &[usize], indent: &str| {
            for &i in done {
                let _ = writeln!(out, "{indent}const {} v{i} = pr{i}[ii];", ctype(nodes[i].dtype));
            }
        };
        let elements = |out: &mut String, indent: &str, q: usize| {
            let pass = (&keep.need[q][..], &keep.fill[q][..], &keep.save[q][..]);
            super::fold::print_elements(out, indent, nodes, &exprs, pass);
        };
        let per_row = |i: usize| passes.per_row[i] && live[i] && !matches!(nodes[i].op, ExprOp::Reduce(..));
        // Per-row values as soon as their reductions are done, as the interpreter computes them.
        let mut next = 0;
        let mut per_row_values = |out: &mut String, done: &mut Vec<usize>, upto: usize| {
            let new: Vec<usize> = (next..upto).filter(|&i| per_row(i)).collect();
            next = next.max(upto);
            if new.is_empty() {
                return;
            }
            for &i in &new {
                let _ = writeln!(out, "    {} pr{i}[{inner}];", ctype(nodes[i].dtype));
            }
            let _ = writeln!(out, "    for (int ii = 0; ii < {inner}; ii++) {{");
            row_scalars(out, done, "      ");
            for &i in &new {
                let t = ctype(nodes[i].dtype);
                let _ = writeln!(out, "      const {t} v{i} = {};\n      pr{i}[ii] = v{i};", exprs[i]);
            }
            out.push_str("    }\n");
            done.extend(new);
        };
        for (q, &red) in phases.iter().enumerate() {
            per_row_values(out, &mut done, red);
            let ExprOp::Reduce(op, x) = nodes[red].op else { unreachable!("phases are reductions") };
            let d = nodes[x as usize].dtype;
            let t = ctype(d);
            let init = super::fold::reduction_init(op, d);
            let acc = format!("acc{red}[ii]");
            let at = format!("at{red}[ii]");
            let fold = match (op, d.is_float()) {
                (ReduceOp::Sum | ReduceOp::Mean, true) => format!("{acc} = {acc} + v;"),
                (ReduceOp::Sum, false) => {
                    let u = super::fold::unsigned(d);
                    format!("{acc} = ({t})(({u}){acc} + ({u})v);")
                }
                // NaN is sticky and the first extreme is kept.
                (ReduceOp::Min, true) => {
                    format!("if ({acc} == {acc} && (v < {acc} || v != v)) {{ {acc} = v; {at} = a; }}")
                }
                (_, true) => format!("if ({acc} == {acc} && (v > {acc} || v != v)) {{ {acc} = v; {at} = a; }}"),
                (ReduceOp::Min, false) => format!("if (v < {acc}) {acc} = v;"),
                (ReduceOp::Max, false) => format!("if (v > {acc}) {acc} = v;"),
                _ => format!("if (v > {acc}) {{ {acc} = v; {at} = a; }}"),
            };
            let _ = writeln!(
                out,
                "    {t} acc{red}[{inner}];\n    long long at{red}[{inner}];\n    for (int ii = 0; ii < {inner}; ii++) {{ acc{red}[ii] = {init}; at{red}[ii] = 0; }}"
            );
            let _ = writeln!(
                out,
                "    for (long long a = 0; a < {len}LL; a++) {{\n      for (int ii = 0; ii < {inner}; ii++) {{\n        const long long p = a * {inner}LL + ii;"
            );
            row_scalars(out, &done, "        ");
            elements(out, "        ", q);
            let _ = writeln!(out, "        const {t} v = v{x};\n        {fold}\n      }}\n    }}");
            let rt = ctype(nodes[red].dtype);
            let value = match op {
                ReduceOp::ArgMax => format!("at{red}[ii]"),
                ReduceOp::Mean => format!("acc{red}[ii] / ({t}){len}LL"),
                _ => format!("acc{red}[ii]"),
            };
            let _ = writeln!(
                out,
                "    {rt} pr{red}[{inner}];\n    for (int ii = 0; ii < {inner}; ii++) pr{red}[ii] = {value};"
            );
            done.push(red);
        }
        per_row_values(out, &mut done, nodes.len());
        let row_stores: Vec<usize> = (0..r.stores.len()).filter(|&s| passes.row_stores[s]).collect();
        if !row_stores.is_empty() {
            let _ = writeln!(out, "    for (int ii = 0; ii < {inner}; ii++) {{");
            row_scalars(out, &done, "      ");
            for s in row_stores {
                let store = &r.stores[s];
                let at = along(&format!("w{s}"), "ii", self.inner_strides[loads + s]);
                let _ = writeln!(out, "      a{}[{at}] = {};", store.arg, stored_value(store));
            }
            out.push_str("    }\n");
        }
        let elem: Vec<usize> = (0..r.stores.len()).filter(|&s| !passes.row_stores[s]).collect();
        if !elem.is_empty() {
            let _ = writeln!(
                out,
                "    for (long long a = 0; a < {len}LL; a++) {{\n      for (int ii = 0; ii < {inner}; ii++) {{\n        const long long p = a * {inner}LL + ii;"
            );
            row_scalars(out, &done, "        ");
            elements(out, "        ", phases.len());
            for s in elem {
                let store = &r.stores[s];
                let at =
                    along(&along(&format!("w{s}"), "a", self.store_strides[s]), "ii", self.inner_strides[loads + s]);
                let _ = writeln!(out, "        a{}[{at}] = {};", store.arg, stored_value(store));
            }
            out.push_str("      }\n    }\n");
        }
        Ok(())
    }
}
