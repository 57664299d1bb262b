//! Rows too long for one thread: a whole-tensor reduction, or a few very long rows, are split
//! into fixed segments of row positions that run across rayon's threads. Each reduction pass
//! folds every segment into its own accumulator and combines them in segment order; the
//! per-element outputs are written segment by segment. The segments depend on the row's length
//! only, so the result is the same at any number of threads.
//!
//! It runs the phases `rows` planned, exactly as `rows` would on one thread, only split; it
//! never changes what a kernel computes beyond the order of a sum.

use super::eval::{Reg, dispatch_simd};
use super::map::{CHUNK, Shared, scatter, store_fence};
use super::reduce::Acc;
use super::rows::{LONG_CHUNK, Plan, eval_row_values, fold_load, row_offset, row_view, scatter_simd, sweep};
use braid_graph::expr::ExprOp;
use braid_lowering::{RowKernel, Store, View};
use rayon::prelude::*;

/// Row positions per segment at least (a multiple of the chunk, so chunks line up as on one
/// thread).
const SEGMENT: usize = 64 * CHUNK;

/// Row positions per chunk of a segment (as for long rows on one thread).
const SPLIT_CHUNK: usize = LONG_CHUNK;

/// The segment length for a row of `row` positions: at least [`SEGMENT`], and long rows in
/// about 256 segments (up to 16 x [`SEGMENT`]) so that a task's fixed cost stays small next to
/// its work. A function of the row's length only, never of the number of threads.
fn segment_len(row: usize) -> usize {
    (row / 256).clamp(SEGMENT, 16 * SEGMENT) / SPLIT_CHUNK * SPLIT_CHUNK
}

/// Runs row `o` of a row kernel split across threads.
pub(super) fn run_row(k: &RowKernel, p: &Plan, args: Shared<'_>, o: usize) -> Result<(), String> {
    let nodes = &k.expr.nodes;
    let row = p.len * p.inner;
    let seg = segment_len(row);
    let segments: Vec<(usize, usize)> = (0..row).step_by(seg).map(|a| (a, (a + seg).min(row))).collect();
    let mut rowv: Vec<Reg> = nodes.iter().map(|n| Reg::new(n.dtype, p.inner)).collect();
    let mut done = vec![false; nodes.len()];
    let mut offsets = vec![0isize; p.inner.max(1)];
    for (r, need) in &p.phases {
        eval_row_values(k, p, args, o, *r, &mut rowv, &mut done, &mut offsets)?;
        let ExprOp::Reduce(op, x) = nodes[*r].op else { unreachable!("phases are reductions") };
        let operand = nodes[x as usize].dtype;
        let (rowv_ref, done_ref) = (&rowv, &done);
        let partials = segments
            .par_iter()
            .map(|&range| {
                let mut acc = Acc::new(op, operand, p.inner);
                reduce_segment(k, p, args, o, need, rowv_ref, done_ref, range, &mut acc, x as usize)?;
                Ok(acc)
            })
            .collect::<Result<Vec<Acc>, String>>()?;
        let mut partials = partials.into_iter();
        let mut acc = partials.next().expect("a row has at least one segment");
        partials.for_each(|later| acc.merge(&later));
        acc.finish(p.len, &mut rowv[*r]);
        done[*r] = true;
    }
    eval_row_values(k, p, args, o, nodes.len(), &mut rowv, &mut done, &mut offsets)?;
    let mut store_offsets = vec![0isize; p.inner.max(1)];
    for s in k.stores.iter().zip(&p.row_stores).filter(|(_, r)| **r).map(|(s, _)| s) {
        let view = row_view(&s.view, k.axis, o, &p.outer_dims, false);
        // SAFETY: checked by `rows::run_rows` (`check_io`); one row writes its own elements.
        unsafe { scatter(&view, args.0[s.arg as usize], 0, p.inner, &rowv[s.value as usize], &mut store_offsets) };
    }
    let elem_stores: Vec<(&Store, View)> = k
        .stores
        .iter()
        .zip(&p.row_stores)
        .filter(|(_, r)| !**r)
        .map(|(s, _)| (s, row_view(&s.view, k.axis, o, &p.outer_dims, true)))
        .collect();
    if !elem_stores.is_empty() {
        let (rowv, done, stores) = (&rowv, &done, &elem_stores[..]);
        segments.par_iter().try_for_each(|&range| store_segment(k, p, args, o, rowv, done, range, stores))?;
    }
    Ok(())
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

/// One reduction pass over row positions `range` into `acc`, compiled for each vector level.
#[allow(clippy::too_many_arguments)]
fn reduce_segment(
    k: &RowKernel,
    p: &Plan,
    args: Shared<'_>,
    o: usize,
    need: &[usize],
    rowv: &[Reg],
    done: &[bool],
    range: (usize, usize),
    acc: &mut Acc,
    x: usize,
) -> Result<(), String> {
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn go(
        k: &RowKernel,
        p: &Plan,
        args: Shared<'_>,
        o: usize,
        need: &[usize],
        rowv: &[Reg],
        done: &[bool],
        range: (usize, usize),
        acc: &mut Acc,
        x: usize,
    ) -> Result<(), String> {
        let nodes = &k.expr.nodes;
        let views = load_views(k, p, o);
        if fold_load(k, args, need, x, &views, acc, range, p.inner, SPLIT_CHUNK) {
            return Ok(());
        }
        let mut chunk: Vec<Reg> = nodes.iter().map(|n| Reg::new(n.dtype, SPLIT_CHUNK)).collect();
        let mut offsets = vec![0isize; SPLIT_CHUNK];
        let mut fresh = vec![false; nodes.len()];
        let scratch = (&mut chunk[..], &mut offsets[..], &views[..]);
        sweep(k, p, args, o, need, scratch, rowv, &mut fresh, done, range, None, |c, m, regs| {
            acc.add(&regs[x], c, m, p.inner)
        })
    }
    dispatch_simd!(go(k: &RowKernel, p: &Plan, args: Shared<'_>, o: usize, need: &[usize], rowv: &[Reg], done: &[bool], range: (usize, usize), acc: &mut Acc, x: usize) -> Result<(), String>)
}

/// The per-element outputs of row positions `range`, compiled for each vector level.
#[allow(clippy::too_many_arguments)]
fn store_segment(
    k: &RowKernel,
    p: &Plan,
    args: Shared<'_>,
    o: usize,
    rowv: &[Reg],
    done: &[bool],
    range: (usize, usize),
    stores: &[(&Store, View)],
) -> Result<(), String> {
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn go(
        k: &RowKernel,
        p: &Plan,
        args: Shared<'_>,
        o: usize,
        rowv: &[Reg],
        done: &[bool],
        range: (usize, usize),
        stores: &[(&Store, View)],
    ) -> Result<(), String> {
        let nodes = &k.expr.nodes;
        let mut chunk: Vec<Reg> = nodes.iter().map(|n| Reg::new(n.dtype, SPLIT_CHUNK)).collect();
        let (mut offsets, mut store_offsets) = (vec![0isize; SPLIT_CHUNK], vec![0isize; SPLIT_CHUNK]);
        let mut fresh = vec![false; nodes.len()];
        let views = load_views(k, p, o);
        let scratch = (&mut chunk[..], &mut offsets[..], &views[..]);
        sweep(k, p, args, o, &p.last_phase, scratch, rowv, &mut fresh, done, range, None, |c, m, regs| {
            for (s, view) in stores {
                // SAFETY: checked by `rows::run_rows`; segments write disjoint row positions.
                unsafe {
                    scatter_simd(view, args.0[s.arg as usize], c, m, &regs[s.value as usize], &mut store_offsets)
                };
            }
        })?;
        // Streaming stores are weakly ordered: visible before the task reports done.
        store_fence();
        Ok(())
    }
    dispatch_simd!(go(k: &RowKernel, p: &Plan, args: Shared<'_>, o: usize, rowv: &[Reg], done: &[bool], range: (usize, usize), stores: &[(&Store, View)]) -> Result<(), String>)
}
