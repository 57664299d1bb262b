//! Rows too long for one thread: a whole-tensor reduction, or a few very long rows, are split
//! into fixed segments of row positions that run across rayon's threads. Each reduction pass
//! folds every segment into its own accumulator and combines them in segment order; the
//! per-element outputs are written segment by segment. The segments depend on the row's length
//! only, so the result is the same at any number of threads.
//!
//! A row runs interpreted ([`run_row`]: the phases `rows` planned, exactly as `rows` would on
//! one thread, only split) or compiled ([`run_row_compiled`]: each segment's fold and stores
//! are the kernel's split form printed by `braid_lowering::host_c::print_split`, folding the
//! same chunks in the same lanes); both cut the same segments and combine their accumulators
//! here, with `reduce::Acc::merge`, so a row gives the same bits either way. This module never
//! changes what a kernel computes beyond the order of a sum, and never lets that order depend
//! on the number of threads.

use super::eval::{Reg, dispatch_simd};
use super::map::{CHUNK, SharedArgs, scatter, store_fence};
use super::native::SplitCode;
use super::reduce::Acc;
use super::rows::{Plan, eval_row_values, fold_load, row_offset, row_view, scatter_simd, sweep};
use braid_graph::expr::ExprOp;
use braid_lowering::row_passes::SPLIT_CHUNK;
use braid_lowering::{RowKernel, Store, View};
use rayon::prelude::*;

/// Row positions per segment at least (a multiple of the chunk, so chunks line up as on one
/// thread).
const SEGMENT: usize = 64 * CHUNK;
const _: () = assert!(SEGMENT.is_multiple_of(SPLIT_CHUNK));

/// The segment length for a row of `row` positions: at least [`SEGMENT`], and long rows in
/// about 256 segments (up to 16 x [`SEGMENT`]) so that a task's fixed cost stays small next to
/// its work. A function of the row's length only, never of the number of threads.
fn segment_len(row: usize) -> usize {
    (row / 256).clamp(SEGMENT, 16 * SEGMENT) / SPLIT_CHUNK * SPLIT_CHUNK
}

/// The segments of a row of `row` positions, in order: `(start, end)`, every start a multiple
/// of [`SPLIT_CHUNK`].
fn segments(row: usize) -> Vec<(usize, usize)> {
    let seg = segment_len(row);
    (0..row).step_by(seg).map(|a| (a, (a + seg).min(row))).collect()
}

/// The segments' accumulators of one reduction combined in segment order: the same order,
/// so the same bits, at any number of threads.
fn combine(partials: Vec<Acc>) -> Acc {
    let mut partials = partials.into_iter();
    let mut acc = partials.next().expect("a row has at least one segment");
    partials.for_each(|later| acc.merge(&later));
    acc
}

/// Runs row `o` of a row kernel split across threads.
pub(super) fn run_row(k: &RowKernel, p: &Plan, args: SharedArgs<'_>, o: usize) -> Result<(), String> {
    let nodes = &k.expr.nodes;
    let segments = segments(p.len * p.inner);
    let mut rowv: Vec<Reg> = nodes.iter().map(|n| Reg::new(n.dtype, p.inner)).collect();
    let mut done = vec![false; nodes.len()];
    let mut offsets = vec![0isize; p.inner.max(1)];
    // The per-element stores, those the first pass writes (`Plan::early`) and the others.
    let early = |s: usize| p.early.as_ref().is_some_and(|e| e.stores.contains(&s));
    let (mut first_stores, mut last_stores): (Vec<StoreView>, Vec<StoreView>) = (vec![], vec![]);
    for (s, store) in k.stores.iter().enumerate().filter(|&(s, _)| !p.row_stores[s]) {
        let view = row_view(&store.view, k.axis, o, &p.outer_dims, true);
        if early(s) { &mut first_stores } else { &mut last_stores }.push((store, view));
    }
    for (q, (r, need)) in p.phases.iter().enumerate() {
        eval_row_values(k, p, args, o, *r, &mut rowv, &mut done, &mut offsets)?;
        let ExprOp::Reduce(op, x) = nodes[*r].op else { unreachable!("phases are reductions") };
        let operand = nodes[x as usize].dtype;
        let (rowv_ref, done_ref) = (&rowv[..], &done[..]);
        let (need, stores) = match &p.early {
            Some(e) if q == 0 => (&e.first_pass[..], &first_stores[..]),
            _ => (&need[..], &[][..]),
        };
        let partials = segments
            .par_iter()
            .map(|&range| {
                let mut acc = Acc::new(op, operand, p.inner);
                let sweep = (need, rowv_ref, done_ref, range);
                reduce_segment(k, p, args, o, sweep, &mut acc, x as usize, stores)?;
                Ok(acc)
            })
            .collect::<Result<Vec<Acc>, String>>()?;
        combine(partials).finish(p.len, &mut rowv[*r]);
        done[*r] = true;
    }
    eval_row_values(k, p, args, o, nodes.len(), &mut rowv, &mut done, &mut offsets)?;
    let mut store_offsets = vec![0isize; p.inner.max(1)];
    for s in k.stores.iter().zip(&p.row_stores).filter(|(_, r)| **r).map(|(s, _)| s) {
        let view = row_view(&s.view, k.axis, o, &p.outer_dims, false);
        // SAFETY: checked by `rows::run_rows` (`check_io`); one row writes its own elements.
        unsafe { scatter(&view, args.0[s.arg as usize], 0, p.inner, &rowv[s.value as usize], &mut store_offsets) };
    }
    if !last_stores.is_empty() {
        let need = p.early.as_ref().map_or(&p.last_phase[..], |e| &e.last_pass[..]);
        let (rowv, done, stores) = (&rowv[..], &done[..], &last_stores[..]);
        let pass = |range| (need, rowv, done, range);
        segments.par_iter().try_for_each(|&range| store_segment(k, p, args, o, pass(range), stores))?;
    }
    Ok(())
}

/// Runs row `o` of a row kernel split across threads as compiled code: `code`, printed from
/// `k` in its split form, folds each segment and writes each segment's stores; the segments,
/// their spread over rayon's threads and the ordered combine of their accumulators are
/// [`run_row`]'s, so the bits are too.
pub(super) fn run_row_compiled(k: &RowKernel, p: &Plan, code: &SplitCode<'_>, o: usize) {
    let nodes = &k.expr.nodes;
    let segments = segments(p.len * p.inner);
    // Each finished reduction, as the code reads it back (in node order).
    let mut results = vec![0u64; p.phases.len()];
    for (q, (r, _)) in p.phases.iter().enumerate() {
        let ExprOp::Reduce(op, x) = nodes[*r].op else { unreachable!("phases are reductions") };
        let operand = nodes[x as usize].dtype;
        let done = &results;
        let partials: Vec<Acc> =
            segments.par_iter().map(|&range| Acc::from_parts(op, operand, code.fold(q, o, range, done))).collect();
        let mut value = Reg::new(nodes[*r].dtype, 1);
        combine(partials).finish(p.len, &mut value);
        results[q] = scalar_bits(&value);
    }
    code.row_stores(o, &results);
    let early = |s: usize| p.early.as_ref().is_some_and(|e| e.stores.contains(&s));
    if (0..k.stores.len()).any(|s| !p.row_stores[s] && !early(s)) {
        segments.par_iter().for_each(|&range| code.element_stores(o, range, &results));
    }
}

/// The one value of `reg` as its bits in the low bytes of a `u64` (how compiled split code
/// reads a finished reduction).
fn scalar_bits(reg: &Reg) -> u64 {
    match reg {
        Reg::F32(v) => v[0].to_bits() as u64,
        Reg::F64(v) => v[0].to_bits(),
        Reg::I32(v) => v[0] as u32 as u64,
        Reg::I64(v) => v[0] as u64,
        Reg::U8(v) => v[0] as u64,
        Reg::Bool(v) => v[0] as u64,
    }
}

/// The views of row `o`'s per-element loads.
fn load_views(k: &RowKernel, p: &Plan, o: usize) -> Vec<Option<View>> {
    k.expr
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| match n.op {
            ExprOp::Load(slot) if !p.per_row[i] => {
                let mut v = row_view(&k.loads[slot as usize].view, k.axis, 0, &p.outer_dims, true);
                v.offset = row_offset(&k.loads[slot as usize].view, k.axis, o, &p.outer_dims);
                Some(v)
            }
            _ => None,
        })
        .collect()
}

/// A per-element store and its view over the row.
type StoreView<'a> = (&'a Store, View);

/// What one pass over a segment computes: the per-element nodes it needs, the row's per-row
/// values and which of them are done, and the segment's row positions.
type Pass<'a> = (&'a [usize], &'a [Reg], &'a [bool], (usize, usize));

/// One reduction pass over a segment's row positions into `acc`, writing `stores` (the first
/// pass's early stores) as it computes them, compiled for each vector level.
#[allow(clippy::too_many_arguments)]
fn reduce_segment(
    k: &RowKernel,
    p: &Plan,
    args: SharedArgs<'_>,
    o: usize,
    pass: Pass<'_>,
    acc: &mut Acc,
    x: usize,
    stores: &[StoreView],
) -> Result<(), String> {
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn go(
        k: &RowKernel,
        p: &Plan,
        args: SharedArgs<'_>,
        o: usize,
        (need, rowv, done, range): Pass<'_>,
        acc: &mut Acc,
        x: usize,
        stores: &[StoreView],
    ) -> Result<(), String> {
        let nodes = &k.expr.nodes;
        let views = load_views(k, p, o);
        if stores.is_empty() && fold_load(k, args, need, x, &views, acc, range, p.inner, SPLIT_CHUNK) {
            return Ok(());
        }
        let mut chunk: Vec<Reg> = nodes.iter().map(|n| Reg::new(n.dtype, SPLIT_CHUNK)).collect();
        let (mut offsets, mut store_offsets) = (vec![0isize; SPLIT_CHUNK], vec![0isize; SPLIT_CHUNK]);
        let mut fresh = vec![false; nodes.len()];
        let scratch = (&mut chunk[..], &mut offsets[..], &views[..]);
        sweep(k, p, args, o, need, scratch, rowv, &mut fresh, done, range, None, |c, m, regs| {
            acc.add(&regs[x], c, m, p.inner);
            store_chunk(args, stores, c, m, regs, &mut store_offsets);
        })?;
        if !stores.is_empty() {
            // Streaming stores are weakly ordered: visible before the task reports done.
            store_fence();
        }
        Ok(())
    }
    dispatch_simd!(go(k: &RowKernel, p: &Plan, args: SharedArgs<'_>, o: usize, pass: Pass<'_>, acc: &mut Acc, x: usize, stores: &[StoreView]) -> Result<(), String>)
}

/// Writes `stores` of the chunk of row positions `c..c + m` whose values are in `regs`.
#[inline(always)]
fn store_chunk(args: SharedArgs<'_>, stores: &[StoreView], c: usize, m: usize, regs: &[Reg], offsets: &mut [isize]) {
    for (s, view) in stores {
        // SAFETY: checked by `rows::run_rows`; segments write disjoint row positions.
        unsafe { scatter_simd(view, args.0[s.arg as usize], c, m, &regs[s.value as usize], offsets) };
    }
}

/// The per-element outputs `stores` of a segment's row positions, compiled for each vector
/// level.
fn store_segment(
    k: &RowKernel,
    p: &Plan,
    args: SharedArgs<'_>,
    o: usize,
    pass: Pass<'_>,
    stores: &[StoreView],
) -> Result<(), String> {
    #[inline(always)]
    fn go(
        k: &RowKernel,
        p: &Plan,
        args: SharedArgs<'_>,
        o: usize,
        (need, rowv, done, range): Pass<'_>,
        stores: &[StoreView],
    ) -> Result<(), String> {
        let nodes = &k.expr.nodes;
        let mut chunk: Vec<Reg> = nodes.iter().map(|n| Reg::new(n.dtype, SPLIT_CHUNK)).collect();
        let (mut offsets, mut store_offsets) = (vec![0isize; SPLIT_CHUNK], vec![0isize; SPLIT_CHUNK]);
        let mut fresh = vec![false; nodes.len()];
        let views = load_views(k, p, o);
        let scratch = (&mut chunk[..], &mut offsets[..], &views[..]);
        sweep(k, p, args, o, need, scratch, rowv, &mut fresh, done, range, None, |c, m, regs| {
            store_chunk(args, stores, c, m, regs, &mut store_offsets)
        })?;
        // Streaming stores are weakly ordered: visible before the task reports done.
        store_fence();
        Ok(())
    }
    dispatch_simd!(go(k: &RowKernel, p: &Plan, args: SharedArgs<'_>, o: usize, pass: Pass<'_>, stores: &[StoreView]) -> Result<(), String>)
}
