//! Host C printing of one pass of a row kernel: the per-element nodes a pass computes, and the
//! fold of a reduction over a range of row positions (a whole row for [`super::rows`], one
//! segment of a split row for [`super::split`]), in the CPU interpreter's chunks and lanes
//! (`braid_devices::cpu::reduce`): float sums, maxima and minima fold each chunk in four
//! accumulators of 16 lanes, then the lanes in order, a sum's chunk then added to the row's
//! with compensation, so they come out bit for bit as interpreted; an argmax finds a chunk's
//! best value in lanes too, then, only when it beats the row's so far, its first position, as
//! the interpreter does; integer sums and extremes, exact in any order, fold one by one (loops
//! gcc vectorises). It prints; it never decides chunks or passes (`crate::row_passes` does).

use crate::cexpr::*;
use crate::kernel::RowKernel;
use braid_graph::expr::ExprOp;
use braid_graph::{DType, ReduceOp};
use std::fmt::Write;

/// What a pass computes at each position: the nodes it evaluates (`need`), those it takes from
/// the kept values first (`fill`), and those it keeps after (`save`) (see
/// `crate::row_passes::KeepPlan`).
pub(super) type PassNodes<'a> = (&'a [usize], &'a [usize], &'a [usize]);

/// A per-element store that a fold writes as it computes its values (see `super::split`).
pub(super) struct FoldStore {
    /// The statement at position `p`, place `j` of its block: the store itself, or, streamed,
    /// the value into the block's array.
    pub at: String,
    /// A streamed store's statement writing out the block's values (from position `c + t`, as
    /// many as [`FoldStore::COUNT`] is replaced with), after each block.
    pub flush: Option<String>,
}

impl FoldStore {
    pub const COUNT: &str = "COUNT";
}

/// Positions computed per block of a pass (the lanes' four accumulators of 16 take one block).
pub(super) const FOLD_BLOCK: usize = 64;
/// Lanes per accumulator (as `braid_devices::cpu::reduce::fold_lanes`).
const LANES: usize = 16;

/// Prints the passes of one row kernel.
pub(super) struct Printer<'a> {
    pub(super) r: &'a RowKernel,
    /// Each node's C expression (empty for reductions: their accumulators print them).
    pub(super) exprs: &'a [String],
    /// Positions per row, and per chunk of a pass (the interpreter's chunks: a float sum adds
    /// each chunk's sum to the row's, so both must chunk alike).
    pub(super) len: usize,
    pub(super) width: usize,
}

impl Printer<'_> {
    pub(super) fn elements(&self, out: &mut String, indent: &str, pass: PassNodes<'_>) {
        print_elements(out, indent, &self.r.expr.nodes, self.exprs, pass);
    }

    /// [`Printer::elements`] at position `p` (place `j` of its block), then `stores`.
    fn position(&self, out: &mut String, indent: &str, pass: PassNodes<'_>, stores: &[FoldStore]) {
        self.elements(out, indent, pass);
        for s in stores {
            let _ = writeln!(out, "{indent}{}", s.at);
        }
    }

    /// The end of a block of `count` positions from `c + t`: the streamed `stores` written out.
    fn flush(out: &mut String, indent: &str, stores: &[FoldStore], count: &str) {
        for f in stores.iter().filter_map(|s| s.flush.as_ref()) {
            let _ = writeln!(out, "{indent}{}", f.replace(FoldStore::COUNT, count));
        }
    }

    /// A pass folding reduction node `red` over the row, then declaring `v{red}`.
    pub(super) fn reduction(&self, out: &mut String, red: usize, pass: PassNodes<'_>) {
        let nodes = &self.r.expr.nodes;
        let ExprOp::Reduce(op, x) = nodes[red].op else { unreachable!("phases are reductions") };
        let (len, t) = (self.len, ctype(nodes[x as usize].dtype));
        self.declare_acc(out, red);
        self.fold(out, red, pass, ("0", &format!("{len}LL")), &[]);
        let rt = ctype(nodes[red].dtype);
        let value = match op {
            ReduceOp::ArgMax => format!("at{red}"),
            ReduceOp::Mean => format!("acc{red} / ({t}){len}LL"),
            _ => format!("acc{red}"),
        };
        let _ = writeln!(out, "    const {rt} v{red} = {value};\n    (void)comp{red};\n    (void)at{red};");
    }

    /// Declares reduction `red`'s accumulator at the reduction's identity: `acc{red}` (in its
    /// operand's compute type), the compensation of a float sum `comp{red}`, and the position
    /// of an argmax's best value `at{red}`.
    pub(super) fn declare_acc(&self, out: &mut String, red: usize) {
        let ExprOp::Reduce(op, x) = self.r.expr.nodes[red].op else { unreachable!("phases are reductions") };
        let d = self.r.expr.nodes[x as usize].dtype;
        let (t, init) = (ctype(d), reduction_init(op, d));
        let _ = writeln!(out, "    {t} acc{red} = {init}, comp{red} = 0;\n    long long at{red} = 0;");
    }

    /// Folds the row positions `from..to` (C expressions; `from` at a chunk's start) into
    /// reduction `red`'s accumulator ([`Printer::declare_acc`]) a chunk of `width` at a time,
    /// computing `pass`'s nodes, as the interpreter folds them; `stores` (statements) run at
    /// every position, after its nodes.
    pub(super) fn fold(
        &self,
        out: &mut String,
        red: usize,
        pass: PassNodes<'_>,
        (from, to): (&str, &str),
        stores: &[FoldStore],
    ) {
        let nodes = &self.r.expr.nodes;
        let ExprOp::Reduce(op, x) = nodes[red].op else { unreachable!("phases are reductions") };
        let d = nodes[x as usize].dtype;
        let (t, len, width) = (ctype(d), self.len, self.width);
        let float = d.is_float();
        let init = reduction_init(op, d);
        let _ = writeln!(
            out,
            "    for (long long c = {from}; c < {to}; c += {width}) {{\n      const int m = {to} - c < {width} ? (int)({to} - c) : {width};\n      {t} xs[{FOLD_BLOCK}] __attribute__((aligned(64)));"
        );
        // Computes xs[0..n] for positions c + t.. of the chunk.
        let block = |out: &mut String, n: &str| {
            let _ = writeln!(out, "        for (int j = 0; j < {n}; j++) {{\n          const long long p = c + t + j;");
            self.position(out, "          ", pass, stores);
            let _ = writeln!(out, "          xs[j] = v{x};\n        }}");
            Self::flush(out, "        ", stores, n);
        };
        let lanes = float && matches!(op, ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Max | ReduceOp::Min);
        if lanes {
            // fold_lanes: four accumulators of 16 lanes over blocks of 64 (held as one array
            // `l` of 64, so the block's loop updates them as it computes: one loop the
            // compiler vectorises), blocks of 16 of the rest into the first, the accumulators
            // pairwise, then the last positions and the lanes one by one.
            let f = |a: &str, v: &str| match op {
                ReduceOp::Max => format!("(({v}) > ({a}) || ({v}) != ({v})) ? ({v}) : ({a})"),
                ReduceOp::Min => format!("(({v}) < ({a}) || ({v}) != ({v})) ? ({v}) : ({a})"),
                _ => format!("{a} + {v}"),
            };
            let start = if matches!(op, ReduceOp::Max | ReduceOp::Min) { format!("acc{red}") } else { init.clone() };
            let _ = writeln!(
                out,
                "      {t} l[{FOLD_BLOCK}] __attribute__((aligned(64)));\n      for (int j = 0; j < {FOLD_BLOCK}; j++) l[j] = {start};\n      int t = 0;\n      for (; t + {FOLD_BLOCK} <= m; t += {FOLD_BLOCK}) {{"
            );
            let _ = writeln!(
                out,
                "        for (int j = 0; j < {FOLD_BLOCK}; j++) {{\n          const long long p = c + t + j;"
            );
            self.position(out, "          ", pass, stores);
            let _ = writeln!(out, "          l[j] = {};\n        }}", f("l[j]", &format!("v{x}")));
            Self::flush(out, "        ", stores, &FOLD_BLOCK.to_string());
            // Chunks of whole blocks (a row and its chunks of multiples of 64) leave no rest. (A
            // segment of a split row starts at a multiple of the chunk and is whole chunks or
            // ends with the row, so the row's length decides for it too.)
            let rest = len % FOLD_BLOCK != 0 || width % FOLD_BLOCK != 0;
            out.push_str("      }\n");
            if rest {
                out.push_str("      const int n = m - t;\n      {\n");
                block(out, "n");
                out.push_str("      }\n      int u = 0;\n");
                let _ = writeln!(
                    out,
                    "      for (; u + {LANES} <= n; u += {LANES})\n        for (int j = 0; j < {LANES}; j++) l[j] = {};",
                    f("l[j]", "xs[u + j]")
                );
            }
            let (l1, l2, l3) =
                (format!("l[{LANES} + j]"), format!("l[{} + j]", 2 * LANES), format!("l[{} + j]", 3 * LANES));
            let _ = writeln!(
                out,
                "      for (int j = 0; j < {LANES}; j++) {{\n        l[j] = {};\n        {l2} = {};\n        l[j] = {};\n      }}",
                f("l[j]", &l1),
                f(&l2, &l3),
                f("l[j]", &l2)
            );
            let _ = writeln!(out, "      {t} s = {start};");
            if rest {
                let _ = writeln!(out, "      for (; u < n; u++) s = {};", f("s", "xs[u]"));
            }
            let _ = writeln!(out, "      for (int j = 0; j < {LANES}; j++) s = {};", f("s", "l[j]"));
            if matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
                // Kahan, as `reduce::kahan_add`: an infinite or NaN sum drops the compensation.
                let _ = writeln!(
                    out,
                    "      const {t} y = s - comp{red};\n      const {t} sum = acc{red} + y;\n      comp{red} = __builtin_isfinite(sum) ? (sum - acc{red}) - y : 0;\n      acc{red} = sum;"
                );
            } else {
                let _ = writeln!(out, "      acc{red} = s;");
            }
        } else if op == ReduceOp::ArgMax {
            // `row_passes::early_stores` gives a split row whose first reduction is an argmax no
            // stores to write as it folds (its fold skips a segment's rest after a NaN).
            debug_assert!(stores.is_empty(), "an argmax's fold writes no stores");
            self.argmax(out, red, pass, stores);
        } else {
            // One by one: integer sums wrap and extremes are exact.
            let fold = match op {
                ReduceOp::Sum => {
                    let u = unsigned(d);
                    format!("acc{red} = ({t})(({u})acc{red} + ({u})v);")
                }
                ReduceOp::Max => format!("if (v > acc{red}) acc{red} = v;"),
                _ => format!("if (v < acc{red}) acc{red} = v;"),
            };
            let _ = writeln!(
                out,
                "      for (int t = 0; t < m; t += {FOLD_BLOCK}) {{\n        const int n = m - t < {FOLD_BLOCK} ? m - t : {FOLD_BLOCK};"
            );
            block(out, "n");
            let _ = writeln!(
                out,
                "        for (int j = 0; j < n; j++) {{\n          const {t} v = xs[j];\n          {fold}\n        }}\n      }}"
            );
        }
        out.push_str("    }\n");
    }

    /// The body of a chunk of argmax `red`'s fold (as `reduce::fold_float`'s and `fold_int`'s
    /// argmax over a contiguous row): the chunk's values kept in `xc` while their best is folded
    /// in lanes (NaN sticky), then, only if that beats the row's best so far, the first position
    /// holding it (the first NaN): what the one-by-one loop keeps, the first position of a
    /// strictly larger value. A NaN, once the best, sticks: the rest of the row is skipped.
    fn argmax(&self, out: &mut String, red: usize, pass: PassNodes<'_>, stores: &[FoldStore]) {
        let nodes = &self.r.expr.nodes;
        let ExprOp::Reduce(_, x) = nodes[red].op else { unreachable!("phases are reductions") };
        let d = nodes[x as usize].dtype;
        let (t, width, float) = (ctype(d), self.width, d.is_float());
        let f = |a: &str, v: &str| match float {
            true => format!("(({v}) > ({a}) || ({v}) != ({v})) ? ({v}) : ({a})"),
            false => format!("({v}) > ({a}) ? ({v}) : ({a})"),
        };
        if float {
            let _ = writeln!(out, "      if (acc{red} != acc{red}) break;");
        }
        let _ = writeln!(
            out,
            "      {t} xc[{width}] __attribute__((aligned(64)));\n      {t} l[{FOLD_BLOCK}] __attribute__((aligned(64)));\n      for (int j = 0; j < {FOLD_BLOCK}; j++) l[j] = acc{red};\n      int t = 0;\n      for (; t + {FOLD_BLOCK} <= m; t += {FOLD_BLOCK}) {{"
        );
        let _ = writeln!(
            out,
            "        for (int j = 0; j < {FOLD_BLOCK}; j++) {{\n          const long long p = c + t + j;"
        );
        self.position(out, "          ", pass, stores);
        let _ = writeln!(
            out,
            "          xc[t + j] = v{x};\n          l[j] = {};\n        }}\n      }}",
            f("l[j]", &format!("v{x}"))
        );
        let _ =
            writeln!(out, "      {t} s = acc{red};\n      for (; t < m; t++) {{\n        const long long p = c + t;");
        self.position(out, "        ", pass, stores);
        let _ = writeln!(out, "        xc[t] = v{x};\n        s = {};\n      }}", f("s", &format!("v{x}")));
        let _ = writeln!(out, "      for (int j = 0; j < {FOLD_BLOCK}; j++) s = {};", f("s", "l[j]"));
        let _ = writeln!(out, "      int k = -1;");
        if float {
            let _ = writeln!(out, "      if (s != s) for (k = 0; xc[k] == xc[k]; k++) {{}}\n      else");
        }
        let _ = writeln!(
            out,
            "      if (s > acc{red}) for (k = 0; xc[k] != s; k++) {{}}\n      if (k >= 0) {{\n        acc{red} = xc[k];\n        at{red} = c + k;\n      }}"
        );
    }
}

/// The statements computing the per-element nodes `need` (with their expressions `exprs`) at
/// position `p`: kept `fill` nodes first, from the scratch, then keeping the `save` nodes.
pub(super) fn print_elements(
    out: &mut String,
    indent: &str,
    nodes: &[braid_graph::expr::ExprNode],
    exprs: &[String],
    (need, fill, save): PassNodes<'_>,
) {
    for &i in fill {
        let _ = writeln!(out, "{indent}const {} v{i} = k{i}[p];", ctype(nodes[i].dtype));
    }
    for &i in need {
        let _ = writeln!(out, "{indent}const {} v{i} = {};", ctype(nodes[i].dtype), exprs[i]);
    }
    for &i in save {
        let _ = writeln!(out, "{indent}k{i}[p] = v{i};");
    }
}

/// The identity a reduction `op` of operand type `d` starts from.
pub(super) fn reduction_init(op: ReduceOp, d: DType) -> String {
    match (op, d.is_float()) {
        (ReduceOp::Sum | ReduceOp::Mean, true) => float_literal(0.0, d),
        (ReduceOp::Sum | ReduceOp::Mean, false) => "0".into(),
        (ReduceOp::Max | ReduceOp::ArgMax, true) => float_literal(f64::NEG_INFINITY, d),
        (ReduceOp::Min, true) => float_literal(f64::INFINITY, d),
        (ReduceOp::Max | ReduceOp::ArgMax, false) => int_literal(int_bound(d, false), d),
        (ReduceOp::Min, false) => int_literal(int_bound(d, true), d),
    }
}

/// The least (`max` false) or greatest value of integer type `d`.
fn int_bound(d: DType, max: bool) -> i64 {
    match (d, max) {
        (DType::I32, false) => i32::MIN as i64,
        (DType::I32, true) => i32::MAX as i64,
        (DType::I64, false) => i64::MIN,
        (DType::I64, true) => i64::MAX,
        (_, false) => 0,
        (_, true) => 255,
    }
}

/// The unsigned C type integer sums of `d` wrap in.
pub(super) fn unsigned(d: DType) -> &'static str {
    match d {
        DType::I64 => "unsigned long long",
        DType::I32 => "unsigned int",
        _ => "unsigned char",
    }
}
