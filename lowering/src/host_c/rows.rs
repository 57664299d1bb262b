//! Host C printing of row kernels whose rows are walked with one stride (reductions along an
//! axis, or over a whole tensor whose views merge into one dimension; positions after the axis,
//! if any, merged into one more stride and printed by [`super::columns`]): one entry point
//! `void NAME_rows(unsigned char *const *args, long long from, long long to, unsigned char *scratch)`
//! that computes rows `from..to`, so the caller spreads rows over threads as it likes.
//!
//! Each row runs the passes of [`crate::row_passes`] as the CPU interpreter does: the per-row
//! values as scalars, one pass per reduction, then the per-element stores; values a later pass
//! needs are kept in `scratch` (as many bytes per running call as [`print_rows`] returns) instead of
//! recomputed. A pass folds its row in the interpreter's chunks ([`chunk_width`]) and each chunk
//! in its lanes (four accumulators of 16 lanes, then the lanes in order, then the chunk added
//! to the row's sum with compensation), so float sums, maxima and minima come out bit for bit
//! as interpreted; argmax and integer reductions are exact in any order and fold one by one.
//!
//! Not printed (an `Err`, and the CPU interprets the kernel): views whose positions do not
//! merge into one stride along the axis and one after it, more than
//! [`super::columns::MAX_INNER`] positions after the axis, means of integers, reductions of
//! bools.

use super::{along, array_ctype, columns};
use crate::cexpr::*;
use crate::kernel::{Kernel, Load, RowKernel, View};
use crate::row_passes::{KEEP_ROW, KeepPlan, RowPasses, WHOLE_ROW, chunk_width, keep_plan};
use braid_graph::expr::ExprOp;
use braid_graph::{DType, ReduceOp};
use std::fmt::Write;

/// Positions computed per block of a pass (the lanes' four accumulators of 16 take one block).
const FOLD_BLOCK: usize = 64;
/// Lanes per accumulator (as `braid_devices::cpu::reduce::fold_lanes`).
const LANES: usize = 16;

/// The stride along the row of `view` (rows walked with one stride), or `None` when its row
/// positions are not one stride apart.
fn row_stride(view: &View, r: &RowKernel) -> Option<isize> {
    match r.axis {
        Some(d) => Some(view.strides[d]),
        None => merged_stride(&r.dims, &view.strides),
    }
}

/// The one stride that walks row-major positions over `dims` with `strides`, when the
/// dimensions of extent > 1 nest contiguously.
fn merged_stride(dims: &[usize], strides: &[isize]) -> Option<isize> {
    let walked: Vec<(usize, isize)> =
        dims.iter().zip(strides).filter(|(e, _)| **e > 1).map(|(&e, &s)| (e, s)).collect();
    let ok = walked.windows(2).all(|w| w[0].1 == w[1].1 * w[1].0 as isize);
    ok.then(|| walked.last().map_or(0, |w| w.1))
}

/// The element offset of `view` at position 0 of row `o`, in terms of the row's indices
/// `r0, r1, ...` along the dimensions before the axis.
fn row_start(view: &View, r: &RowKernel) -> String {
    let mut s = view.offset.to_string();
    for d in 0..r.axis.unwrap_or(0) {
        let st = view.strides[d];
        if r.dims[d] > 1 && st != 0 {
            let _ = write!(s, " {} r{d} * {}", if st < 0 { '-' } else { '+' }, st.unsigned_abs());
        }
    }
    s
}

/// Longest row (in positions) whose f16 loads are widened once per row into scratch (256 KiB of
/// f32, which stays in the second-level cache); longer rows convert as they read.
const WIDENED_ROW: usize = 1 << 16;

/// Prints row kernel `r` of `kernel` as the entry point `name`; returns the bytes of scratch
/// each running call needs (kept values, 64-byte aligned; 0 when none).
pub(super) fn print_rows(
    out: &mut String,
    r: &RowKernel,
    kernel: &Kernel,
    name: &str,
    stream_bytes: usize,
) -> Result<usize, String> {
    let arg = |a: u16| kernel.args.get(a as usize).map(|p| (p.dtype, p.len, a as usize >= kernel.inputs));
    check_printable(&r.loads, &r.stores, &r.expr, &r.dims, arg)?;
    if let Some(x) = r.loads.iter().find(|x| x.arg as usize >= kernel.inputs) {
        return Err(format!("load from argument {}, an output", x.arg));
    }
    let nodes = &r.expr.nodes;
    let (len, inner, outer_dims): (usize, usize, &[usize]) = match r.axis {
        Some(d) if d < r.dims.len() => (r.dims[d], r.dims[d + 1..].iter().product(), &r.dims[..d]),
        Some(d) => return Err(format!("axis {d} of a {}-dimensional row kernel", r.dims.len())),
        None => (r.dims.iter().product(), 1, &[]),
    };
    if inner > columns::MAX_INNER {
        return Err(format!("rows with {inner} positions after the axis (interpreted)"));
    }
    let views: Vec<&View> = r.loads.iter().map(|l| &l.view).chain(r.stores.iter().map(|s| &s.view)).collect();
    let strides: Vec<isize> = (views.iter())
        .map(|v| row_stride(v, r).ok_or_else(|| format!("view {v:?} does not walk the row with one stride")))
        .collect::<Result<_, _>>()?;
    let (load_strides, store_strides) = strides.split_at(r.loads.len());
    // With positions after the axis: each view's stride along those (merged into one).
    let inner_strides: Vec<isize> = match r.axis {
        Some(d) if inner > 1 => (views.iter())
            .map(|v| {
                let dims = &r.dims[d + 1..];
                merged_stride(dims, &v.strides[d + 1..])
                    .ok_or_else(|| format!("view {v:?} does not walk the positions after the axis with one stride"))
            })
            .collect::<Result<_, _>>()?,
        _ => vec![0; views.len()],
    };
    // Two rows writing one element would race across tasks.
    for s in &r.stores {
        let repeats = (0..r.dims.len()).any(|d| Some(d) != r.axis && r.dims[d] > 1 && s.view.strides[d] == 0);
        if repeats && r.axis.is_some() {
            return Err(format!("store through {:?}, which writes one element from several rows", s.view));
        }
    }
    let passes = RowPasses::of(r);
    let (live, _) = live(&r.expr, &r.loads, &r.stores);
    // Passes: the live reductions in order, then the per-element stores.
    let phases: Vec<usize> = passes.phases.iter().map(|&(q, _)| q).filter(|&q| live[q]).collect();
    for &q in &phases {
        let ExprOp::Reduce(op, x) = nodes[q].op else { unreachable!("phases are reductions") };
        match nodes[x as usize].dtype {
            DType::Bool => return Err("a reduction of bools (rejected when recorded)".into()),
            d if op == ReduceOp::Mean && !d.is_float() => return Err(format!("a mean of {d}")),
            _ => {}
        }
    }
    let roots = passes.roots(r, |q| live[q]);
    // Without kept values, every pass evaluates all it needs.
    let keep =
        (if len * inner <= KEEP_ROW { keep_plan(r, &passes.per_row, &roots) } else { None }).unwrap_or_else(|| {
            let need = (passes.phases.iter().filter(|(q, _)| live[*q]).map(|(_, n)| n.clone()))
                .chain([passes.last_phase.clone()])
                .collect();
            KeepPlan { need, fill: vec![vec![]; roots.len()], save: vec![vec![]; roots.len()], kept: vec![] }
        });
    let pass = |q: usize| (&keep.need[q][..], &keep.fill[q][..], &keep.save[q][..]);
    let _ = writeln!(
        out,
        "\n// rows of {len} positions over dims {:?} along axis {:?}, in chunks of {}.",
        r.dims.as_slice(),
        r.axis,
        chunk_width(len)
    );
    let _ = writeln!(
        out,
        "void {name}(unsigned char *const *args, long long from, long long to, unsigned char *scratch) {{"
    );
    // Outputs are `restrict`: a row kernel never writes over one of its inputs (the planner
    // writes in place only for elementwise kernels, `braid_scheduler`'s `in_place_candidate`), so
    // gcc vectorises the element pass's direct stores without checking for overlap at run time.
    for (i, a) in kernel.args.iter().enumerate() {
        let (c, q) = if i < kernel.inputs { ("const ", "") } else { ("", "restrict ") };
        let t = storage_ctype(a.dtype);
        let _ = writeln!(out, "  {c}{t} *{q}const a{i} = ({c}{t} *)args[{i}];");
    }
    let mut scratch = 0;
    for &i in &keep.kept {
        let t = array_ctype(nodes[i].dtype);
        let _ = writeln!(out, "  {t} *const k{i} = ({t} *)(scratch + {scratch});");
        scratch += (len * inner * nodes[i].dtype.compute().size()).next_multiple_of(64);
    }
    // f16 loads along a row (of at most `WIDENED_ROW` positions) are widened to f32 once per
    // row into scratch (F16C's conversions where the CPU has them; gcc does not vectorise one
    // conversion per element), and every pass reads the widened row.
    let read = |slot: usize| (nodes.iter().zip(&live)).any(|(n, &on)| on && n.op == ExprOp::Load(slot as u16));
    let widened = |slot: usize| {
        inner == 1 && r.loads[slot].dtype == DType::F16 && load_strides[slot] == 1 && len <= WIDENED_ROW && read(slot)
    };
    for slot in (0..r.loads.len()).filter(|&slot| widened(slot)) {
        let _ = writeln!(out, "  float *const h{slot} = (float *)(scratch + {scratch});");
        scratch += (len * 4).next_multiple_of(64);
    }
    if scratch == 0 {
        out.push_str("  (void)scratch;\n");
    }
    out.push_str("  for (long long o = from; o < to; o++) {\n");
    // The row's index along each dimension before the axis.
    if !outer_dims.is_empty() {
        out.push_str("    long long rest = o;\n");
        for d in (0..outer_dims.len()).rev() {
            if d == 0 {
                out.push_str("    const long long r0 = rest;\n");
            } else {
                let _ = writeln!(out, "    const long long r{d} = rest % {0}LL;\n    rest /= {0}LL;", outer_dims[d]);
            }
        }
        out.push_str("    (void)rest;\n");
    }
    for (slot, load) in r.loads.iter().enumerate() {
        let _ = writeln!(out, "    const long long o{slot} = {};", row_start(&load.view, r));
    }
    for (s, store) in r.stores.iter().enumerate() {
        let _ = writeln!(out, "    const long long w{s} = {};", row_start(&store.view, r));
    }
    for (slot, load) in r.loads.iter().enumerate().filter(|&(slot, _)| widened(slot)) {
        let _ = writeln!(out, "    braid_widen_f16(h{slot}, a{} + o{slot}, {len});", load.arg);
    }
    if inner == 1 {
        // The next row's lines requested now (the interpreter, `cpu::rows`, does so for every
        // row): this row's later passes read the cache only, and the hardware's streamer, which
        // runs ahead of the reads it sees, would otherwise find the next row only as its first
        // pass reads it (C2's rows of 4 KiB: about 7% faster). Rows under 1 KiB are left to the
        // streamer, and rows past `WHOLE_ROW` positions too (their passes are long streams of
        // their own, and the next row would not stay in cache).
        let prefetched = |(s, l): &(usize, &Load)| {
            load_strides[*s] == 1 && l.view.is_contiguous() && len * l.dtype.size() >= 1024 && len <= WHOLE_ROW
        };
        for (slot, load) in r.loads.iter().enumerate().filter(prefetched) {
            let step = 64 / load.dtype.size();
            let _ = writeln!(
                out,
                "    if (o + 1 < to) for (long long q = 0; q < {len}LL; q += {step}) __builtin_prefetch(a{} + o{slot} + {len}LL + q);",
                load.arg
            );
        }
    }
    if inner > 1 {
        let c = columns::Columns { r, len, inner, load_strides, store_strides, inner_strides: &inner_strides };
        c.body(out, &passes, &live, &phases, &keep)?;
        out.push_str("  }\n}\n");
        return Ok(scratch);
    }
    // Loads through equal views share one row start, whatever their arguments.
    let offset = |v: &View| {
        let slot = r.loads.iter().position(|x| &x.view == v).expect("a load's own view");
        along(&format!("o{slot}"), "p", load_strides[slot])
    };
    let index = format!("(o * {len}LL + p)");
    // Checked even when dead: the CPU evaluates every node.
    let exprs: Vec<String> = (nodes.iter().enumerate())
        .map(|(i, n)| match n.op {
            ExprOp::Reduce(..) => Ok(String::new()),
            ExprOp::Load(slot) if widened(slot as usize) => Ok(format!("h{slot}[p]")),
            _ => node_expr(Dialect::Host, &r.expr, &r.loads, i, &offset, &index),
        })
        .collect::<Result<_, _>>()?;
    let p = Printer { r, exprs: &exprs, len };
    let per_row = |i: usize| passes.per_row[i] && live[i] && !matches!(nodes[i].op, ExprOp::Reduce(..));
    // Per-row values as soon as their reductions are done, as the interpreter computes them.
    let mut next = 0;
    let mut per_row_values = |out: &mut String, upto: usize| {
        for i in (next..upto).filter(|&i| per_row(i)) {
            let _ = writeln!(out, "    const {} v{i} = {};", ctype(nodes[i].dtype), exprs[i]);
        }
        next = next.max(upto);
    };
    for (q, &red) in phases.iter().enumerate() {
        per_row_values(out, red);
        p.reduction(out, red, pass(q));
    }
    per_row_values(out, nodes.len());
    for (s, store) in r.stores.iter().enumerate().filter(|&(s, _)| passes.row_stores[s]) {
        let _ = writeln!(out, "    {}", store_stmt(store, &format!("w{s}")));
    }
    let q = phases.len();
    let elem: Vec<usize> = (0..r.stores.len()).filter(|&s| !passes.row_stores[s]).collect();
    // Large f32 outputs written contiguously go out with non-temporal stores, from a block
    // computed into a local array; the others are stored as they are computed (a copy through a
    // local array costs about 7% of a softmax's time).
    let streamed = |s: usize| {
        let store = &r.stores[s];
        store.dtype == DType::F32 && store_strides[s] == 1 && kernel.args[store.arg as usize].len * 4 >= stream_bytes
    };
    // f16 outputs written contiguously are narrowed a block at a time (as loads are widened).
    let narrowed = |s: usize| r.stores[s].dtype == DType::F16 && store_strides[s] == 1;
    let blocked = |s: usize| streamed(s) || narrowed(s);
    let streams = elem.iter().any(|&s| streamed(s));
    if !elem.is_empty() {
        let _ = writeln!(
            out,
            "    for (long long c = 0; c < {len}LL; c += {BLOCK}) {{\n      const int m = {len}LL - c < {BLOCK} ? (int)({len}LL - c) : {BLOCK};",
            BLOCK = super::BLOCK
        );
        for &s in elem.iter().filter(|&&s| blocked(s)) {
            let t = array_ctype(nodes[r.stores[s].value as usize].dtype);
            let _ = writeln!(out, "      {t} t{s}[{}] __attribute__((aligned(64)));", super::BLOCK);
        }
        out.push_str("      for (int j = 0; j < m; j++) {\n        const long long p = c + j;\n");
        p.elements(out, "        ", pass(q));
        for &s in &elem {
            let store = &r.stores[s];
            if blocked(s) {
                let _ = writeln!(out, "        t{s}[j] = v{};", store.value);
            } else {
                let at = along(&format!("w{s}"), "p", store_strides[s]);
                let _ = writeln!(out, "        {}", store_stmt(store, &at));
            }
        }
        out.push_str("      }\n");
        for &s in elem.iter().filter(|&&s| blocked(s)) {
            let f = if narrowed(s) { "braid_narrow_f16" } else { "braid_stream_f32" };
            let _ = writeln!(out, "      {f}(a{} + w{s} + c, t{s}, m);", r.stores[s].arg);
        }
        out.push_str("    }\n");
    }
    out.push_str("  }\n");
    if streams {
        // Non-temporal stores are weakly ordered: fence them before the caller reports done.
        out.push_str("#if defined(__SSE__)\n  _mm_sfence();\n#endif\n");
    }
    out.push_str("}\n");
    Ok(scratch)
}

/// Prints the passes of one row kernel.
struct Printer<'a> {
    r: &'a RowKernel,
    /// Each node's C expression (empty for reductions: their accumulators print them).
    exprs: &'a [String],
    len: usize,
}

impl Printer<'_> {
    fn elements(&self, out: &mut String, indent: &str, pass: (&[usize], &[usize], &[usize])) {
        print_elements(out, indent, &self.r.expr.nodes, self.exprs, pass);
    }

    /// A pass folding reduction node `red` over the row, then declaring `v{red}`.
    fn reduction(&self, out: &mut String, red: usize, pass: (&[usize], &[usize], &[usize])) {
        let nodes = &self.r.expr.nodes;
        let ExprOp::Reduce(op, x) = nodes[red].op else { unreachable!("phases are reductions") };
        let d = nodes[x as usize].dtype;
        let (t, len, width) = (ctype(d), self.len, chunk_width(self.len));
        let float = d.is_float();
        let init = reduction_init(op, d);
        let _ = writeln!(out, "    {t} acc{red} = {init}, comp{red} = 0;\n    long long at{red} = 0;");
        let _ = writeln!(
            out,
            "    for (long long c = 0; c < {len}LL; c += {width}) {{\n      const int m = {len}LL - c < {width} ? (int)({len}LL - c) : {width};\n      {t} xs[{FOLD_BLOCK}] __attribute__((aligned(64)));"
        );
        // Computes xs[0..n] for positions c + t.. of the chunk.
        let block = |out: &mut String, n: &str| {
            let _ = writeln!(out, "        for (int j = 0; j < {n}; j++) {{\n          const long long p = c + t + j;");
            self.elements(out, "          ", pass);
            let _ = writeln!(out, "          xs[j] = v{x};\n        }}");
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
            self.elements(out, "          ", pass);
            let _ = writeln!(out, "          l[j] = {};\n        }}", f("l[j]", &format!("v{x}")));
            // Chunks of whole blocks (a row and its chunks of multiples of 64) leave no rest.
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
        } else {
            // One by one: integer sums wrap and extremes are exact; an argmax keeps the first
            // position of a strictly larger value (the first NaN, which then sticks).
            let fold = match op {
                ReduceOp::Sum => {
                    let u = unsigned(d);
                    format!("acc{red} = ({t})(({u})acc{red} + ({u})v);")
                }
                ReduceOp::Max => format!("if (v > acc{red}) acc{red} = v;"),
                ReduceOp::Min => format!("if (v < acc{red}) acc{red} = v;"),
                ReduceOp::ArgMax if float => {
                    format!(
                        "if (acc{red} == acc{red} && (v > acc{red} || v != v)) {{ acc{red} = v; at{red} = c + t + j; }}"
                    )
                }
                _ => format!("if (v > acc{red}) {{ acc{red} = v; at{red} = c + t + j; }}"),
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
        let rt = ctype(nodes[red].dtype);
        let value = match op {
            ReduceOp::ArgMax => format!("at{red}"),
            ReduceOp::Mean => format!("acc{red} / ({t}){len}LL"),
            _ => format!("acc{red}"),
        };
        let _ = writeln!(out, "    const {rt} v{red} = {value};\n    (void)comp{red};\n    (void)at{red};");
    }
}

/// The statements computing the per-element nodes `need` (with their expressions `exprs`) at
/// position `p`: kept `fill` nodes first, from the scratch, then keeping the `save` nodes.
pub(super) fn print_elements(
    out: &mut String,
    indent: &str,
    nodes: &[braid_graph::expr::ExprNode],
    exprs: &[String],
    (need, fill, save): (&[usize], &[usize], &[usize]),
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
