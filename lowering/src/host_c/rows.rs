//! Host C printing of row kernels whose rows are walked with one stride (reductions along an
//! axis, or over a whole tensor whose views merge into one dimension; positions after the axis,
//! if any, merged into one more stride and printed by [`super::columns`]): one entry point
//! `void NAME_rows(unsigned char *const *args, long long from, long long to, unsigned char *scratch)`
//! that computes rows `from..to`, so the caller spreads rows over threads as it likes.
//!
//! Each row runs the passes of [`crate::row_passes`] as the CPU interpreter does: the per-row
//! values as scalars, one pass per reduction, then the per-element stores; values a later pass
//! needs are kept in `scratch` (as many bytes per running call as [`print_rows`] returns) instead of
//! recomputed. A pass folds its row in the interpreter's chunks ([`chunk_width`]), each chunk
//! as [`super::fold`] prints it (in the interpreter's lanes), so the bits are the interpreter's.
//! [`Walk`], the checks and the pieces every row entry point shares, also serves the split form
//! ([`super::split`]).
//!
//! Not printed (an `Err`, and the CPU interprets the kernel): views whose positions do not
//! merge into one stride along the axis and one after it, more than
//! [`super::columns::MAX_INNER`] positions after the axis, means of integers, reductions of
//! bools.

use super::fold::{PassNodes, Printer};
use super::{along, array_ctype, columns};
use crate::cexpr::*;
use crate::kernel::{Kernel, Load, RowKernel, View};
use crate::row_passes::{KEEP_ROW, KeepPlan, RowPasses, WHOLE_ROW, chunk_width, keep_plan};
use braid_graph::expr::ExprOp;
use braid_graph::{DType, ReduceOp};
use std::fmt::Write;

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

/// A row kernel whose rows are walked with one stride, checked for printing: what printing it
/// row by row ([`print_rows`]) or split across threads ([`super::split`]) needs.
pub(super) struct Walk<'a> {
    pub(super) r: &'a RowKernel,
    pub(super) kernel: &'a Kernel,
    /// Positions along the axis (every position when there is none), positions after it, and
    /// the extents before it (one row per index).
    pub(super) len: usize,
    pub(super) inner: usize,
    pub(super) outer_dims: &'a [usize],
    /// Per load and per store: its stride along the row.
    pub(super) load_strides: Vec<isize>,
    pub(super) store_strides: Vec<isize>,
    /// Per load, then per store: its one stride across the positions after the axis (0 without).
    inner_strides: Vec<isize>,
    pub(super) passes: RowPasses,
    /// Per node: whether a store needs it.
    pub(super) live: Vec<bool>,
}

impl<'a> Walk<'a> {
    /// Checks row kernel `r` of `kernel` for printing; an `Err` names what is not printed.
    pub(super) fn new(r: &'a RowKernel, kernel: &'a Kernel) -> Result<Walk<'a>, String> {
        let arg = |a: u16| kernel.args.get(a as usize).map(|p| (p.dtype, p.len, a as usize >= kernel.inputs));
        check_printable(&r.loads, &r.stores, &r.expr, &r.dims, arg)?;
        if let Some(x) = r.loads.iter().find(|x| x.arg as usize >= kernel.inputs) {
            return Err(format!("load from argument {}, an output", x.arg));
        }
        let (len, inner, outer_dims): (usize, usize, &[usize]) = match r.axis {
            Some(d) if d < r.dims.len() => (r.dims[d], r.dims[d + 1..].iter().product(), &r.dims[..d]),
            Some(d) => return Err(format!("axis {d} of a {}-dimensional row kernel", r.dims.len())),
            None => (r.dims.iter().product(), 1, &[]),
        };
        if inner > columns::MAX_INNER {
            return Err(format!("rows with {inner} positions after the axis (interpreted)"));
        }
        let views: Vec<&View> = r.loads.iter().map(|l| &l.view).chain(r.stores.iter().map(|s| &s.view)).collect();
        let mut load_strides: Vec<isize> = (views.iter())
            .map(|v| row_stride(v, r).ok_or_else(|| format!("view {v:?} does not walk the row with one stride")))
            .collect::<Result<_, _>>()?;
        let store_strides = load_strides.split_off(r.loads.len());
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
        Ok(Walk { r, kernel, len, inner, outer_dims, load_strides, store_strides, inner_strides, passes, live })
    }

    /// Errs on a reduction among `phases` (reduction nodes) that the CPU does not fold: bools
    /// (rejected when recorded) and means of integers.
    pub(super) fn check_reductions(&self, phases: &[usize]) -> Result<(), String> {
        let nodes = &self.r.expr.nodes;
        for &q in phases {
            let ExprOp::Reduce(op, x) = nodes[q].op else { unreachable!("phases are reductions") };
            match nodes[x as usize].dtype {
                DType::Bool => return Err("a reduction of bools (rejected when recorded)".into()),
                d if op == ReduceOp::Mean && !d.is_float() => return Err(format!("a mean of {d}")),
                _ => {}
            }
        }
        Ok(())
    }

    /// Declares argument `i` as `a{i}`: inputs `const`, outputs `restrict`.
    pub(super) fn declare_args(&self, out: &mut String) {
        // A row kernel never writes over one of its inputs (the planner writes in place only
        // for elementwise kernels, `braid_scheduler`'s `in_place_candidate`), so gcc vectorises
        // the element pass's direct stores without checking for overlap at run time.
        let kernel = self.kernel;
        for (i, a) in kernel.args.iter().enumerate() {
            let (c, q) = if i < kernel.inputs { ("const ", "") } else { ("", "restrict ") };
            let t = storage_ctype(a.dtype);
            let _ = writeln!(out, "  {c}{t} *{q}const a{i} = ({c}{t} *)args[{i}];");
        }
    }

    /// Declares row `o`'s index along each dimension before the axis (`r{d}`), and where each
    /// load (`o{slot}`) and store (`w{s}`) starts in it.
    pub(super) fn declare_row_starts(&self, out: &mut String, indent: &str) {
        let r = self.r;
        if !self.outer_dims.is_empty() {
            let _ = writeln!(out, "{indent}long long rest = o;");
            for d in (0..self.outer_dims.len()).rev() {
                if d == 0 {
                    let _ = writeln!(out, "{indent}const long long r0 = rest;");
                } else {
                    let e = self.outer_dims[d];
                    let _ = writeln!(out, "{indent}const long long r{d} = rest % {e}LL;\n{indent}rest /= {e}LL;");
                }
            }
            let _ = writeln!(out, "{indent}(void)rest;");
        }
        for (slot, load) in r.loads.iter().enumerate() {
            let _ = writeln!(out, "{indent}const long long o{slot} = {};", row_start(&load.view, r));
        }
        for (s, store) in r.stores.iter().enumerate() {
            let _ = writeln!(out, "{indent}const long long w{s} = {};", row_start(&store.view, r));
        }
    }

    /// Each node's C expression at position `p` of row `o` (empty for reductions: their
    /// accumulators print them); loads `widened` holds for read the row widened into `h{slot}`.
    /// Every node is checked, even a dead one: the CPU evaluates every node.
    pub(super) fn exprs(&self, widened: impl Fn(usize) -> bool) -> Result<Vec<String>, String> {
        let r = self.r;
        // Loads through equal views share one row start, whatever their arguments.
        let offset = |v: &View| {
            let slot = r.loads.iter().position(|x| &x.view == v).expect("a load's own view");
            along(&format!("o{slot}"), "p", self.load_strides[slot])
        };
        let index = format!("(o * {}LL + p)", self.len);
        (r.expr.nodes.iter().enumerate())
            .map(|(i, n)| match n.op {
                ExprOp::Reduce(..) => Ok(String::new()),
                ExprOp::Load(slot) if widened(slot as usize) => Ok(format!("h{slot}[p]")),
                _ => node_expr(Dialect::Host, &r.expr, &r.loads, i, &offset, &index),
            })
            .collect()
    }

    /// Whether store `s` is a large f32 output written contiguously (at least `stream_bytes`),
    /// which leaves the cache: written from blocks with non-temporal stores.
    pub(super) fn streams(&self, s: usize, stream_bytes: usize) -> bool {
        let store = &self.r.stores[s];
        store.dtype == DType::F32
            && self.store_strides[s] == 1
            && self.kernel.args[store.arg as usize].len * 4 >= stream_bytes
    }

    /// The statement storing store `s`'s value at row position `p`.
    pub(super) fn store_at_p(&self, s: usize) -> String {
        store_stmt(&self.r.stores[s], &along(&format!("w{s}"), "p", self.store_strides[s]))
    }

    /// Whether node `i` is a per-row value a row computes as a scalar: live, constant along the
    /// row, not a reduction (whose accumulator gives it).
    pub(super) fn per_row_value(&self, i: usize) -> bool {
        self.passes.per_row[i] && self.live[i] && !matches!(self.r.expr.nodes[i].op, ExprOp::Reduce(..))
    }

    /// Prints the pass of per-element stores `elem` over row positions `from..to` (C
    /// expressions), computing `pass`'s nodes with `p`; returns whether it streams (its caller
    /// then fences).
    pub(super) fn element_pass(
        &self,
        out: &mut String,
        p: &Printer,
        (pass, elem): (PassNodes<'_>, &[usize]),
        (from, to): (&str, &str),
        stream_bytes: usize,
    ) -> bool {
        let (r, nodes) = (self.r, &self.r.expr.nodes);
        // Large f32 outputs written contiguously go out with non-temporal stores, from a block
        // computed into a local array; the others are stored as they are computed (a copy
        // through a local array costs about 7% of a softmax's time).
        let streamed = |s: usize| self.streams(s, stream_bytes);
        // f16 outputs written contiguously are narrowed a block at a time (as loads are widened).
        let narrowed = |s: usize| r.stores[s].dtype == DType::F16 && self.store_strides[s] == 1;
        let blocked = |s: usize| streamed(s) || narrowed(s);
        if elem.is_empty() {
            return false;
        }
        let _ = writeln!(
            out,
            "    for (long long c = {from}; c < {to}; c += {BLOCK}) {{\n      const int m = {to} - c < {BLOCK} ? (int)({to} - c) : {BLOCK};",
            BLOCK = super::BLOCK
        );
        for &s in elem.iter().filter(|&&s| blocked(s)) {
            let t = array_ctype(nodes[r.stores[s].value as usize].dtype);
            let _ = writeln!(out, "      {t} t{s}[{}] __attribute__((aligned(64)));", super::BLOCK);
        }
        out.push_str("      for (int j = 0; j < m; j++) {\n        const long long p = c + j;\n");
        p.elements(out, "        ", pass);
        for &s in elem {
            if blocked(s) {
                let _ = writeln!(out, "        t{s}[j] = v{};", r.stores[s].value);
            } else {
                let _ = writeln!(out, "        {}", self.store_at_p(s));
            }
        }
        out.push_str("      }\n");
        for &s in elem.iter().filter(|&&s| blocked(s)) {
            let f = if narrowed(s) { "braid_narrow_f16" } else { "braid_stream_f32" };
            let _ = writeln!(out, "      {f}(a{} + w{s} + c, t{s}, m);", r.stores[s].arg);
        }
        out.push_str("    }\n");
        elem.iter().any(|&s| streamed(s))
    }
}

/// Prints row kernel `r` of `kernel` as the entry point `name`; returns the bytes of scratch
/// each running call needs (kept values, 64-byte aligned; 0 when none).
pub(super) fn print_rows(
    out: &mut String,
    r: &RowKernel,
    kernel: &Kernel,
    name: &str,
    stream_bytes: usize,
) -> Result<usize, String> {
    let w = Walk::new(r, kernel)?;
    let (nodes, len, inner) = (&r.expr.nodes, w.len, w.inner);
    let (passes, live) = (&w.passes, &w.live);
    // Passes: the live reductions in order, then the per-element stores.
    let phases: Vec<usize> = passes.phases.iter().map(|&(q, _)| q).filter(|&q| live[q]).collect();
    w.check_reductions(&phases)?;
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
    w.declare_args(out);
    let mut scratch = 0;
    for &i in &keep.kept {
        let t = array_ctype(nodes[i].dtype);
        let _ = writeln!(out, "  {t} *const k{i} = ({t} *)(scratch + {scratch});");
        scratch += (len * inner * nodes[i].dtype.compute().size()).next_multiple_of(64);
    }
    // f16 loads along a row (of at most `WIDENED_ROW` positions) are widened to f32 once per
    // row into scratch (F16C's conversions where the CPU has them; gcc does not vectorise one
    // conversion per element), and every pass reads the widened row.
    let read = |slot: usize| (nodes.iter().zip(live)).any(|(n, &on)| on && n.op == ExprOp::Load(slot as u16));
    let widened = |slot: usize| {
        inner == 1 && r.loads[slot].dtype == DType::F16 && w.load_strides[slot] == 1 && len <= WIDENED_ROW && read(slot)
    };
    for slot in (0..r.loads.len()).filter(|&slot| widened(slot)) {
        let _ = writeln!(out, "  float *const h{slot} = (float *)(scratch + {scratch});");
        scratch += (len * 4).next_multiple_of(64);
    }
    if scratch == 0 {
        out.push_str("  (void)scratch;\n");
    }
    out.push_str("  for (long long o = from; o < to; o++) {\n");
    w.declare_row_starts(out, "    ");
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
            w.load_strides[*s] == 1 && l.view.is_contiguous() && len * l.dtype.size() >= 1024 && len <= WHOLE_ROW
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
        let (load_strides, store_strides) = (&w.load_strides[..], &w.store_strides[..]);
        let c = columns::Columns { r, len, inner, load_strides, store_strides, inner_strides: &w.inner_strides };
        c.body(out, passes, live, &phases, &keep)?;
        out.push_str("  }\n}\n");
        return Ok(scratch);
    }
    let exprs = w.exprs(widened)?;
    let p = Printer { r, exprs: &exprs, len, width: chunk_width(len) };
    // Per-row values as soon as their reductions are done, as the interpreter computes them.
    let mut next = 0;
    let mut per_row_values = |out: &mut String, upto: usize| {
        for i in (next..upto).filter(|&i| w.per_row_value(i)) {
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
    let elem: Vec<usize> = (0..r.stores.len()).filter(|&s| !passes.row_stores[s]).collect();
    let streams = w.element_pass(out, &p, (pass(phases.len()), &elem), ("0", &format!("{len}LL")), stream_bytes);
    out.push_str("  }\n");
    if streams {
        // Non-temporal stores are weakly ordered: fence them before the caller reports done.
        out.push_str("#if defined(__SSE__)\n  _mm_sfence();\n#endif\n");
    }
    out.push_str("}\n");
    Ok(scratch)
}
