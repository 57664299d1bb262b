//! Row kernels on the CPU: reductions along one axis with the elementwise work around them.
//!
//! For each row (every index except the axis fixed; the whole space when the axis is `None`)
//! the kernel runs one pass over the row per reduction, evaluating the per-element nodes that
//! reduction needs a chunk at a time, then one pass for per-element outputs. Values that are
//! constant along the row (reductions, and what depends only on them, on constants or on loads
//! with stride 0 along the axis) are computed once per row, for each position across the row's
//! inner dimensions. A row of a softmax is read three times, from cache; on rows longer than
//! one chunk, per-element values a later pass needs are kept in a per-thread scratch (`keep`)
//! rather than recomputed, and a reduction of a contiguous load alone folds straight from the
//! buffer. Rows are spread across rayon's threads; fewer than [`MIN_ROWS`] long rows are each
//! split across them (`split`); a kernel may run in another order of its index space
//! ([`super::tile::row_kernel`]: transposed rows, few rows along a non-last axis). Nothing here
//! plans or allocates device memory, and nothing here may make a result depend on the number
//! of threads.

use super::eval::{Reg, dispatch_simd, eval_node, fit_regs};
use super::keep;
use super::map::{ArgPtr, CHUNK, SharedArgs, check_io, gather, prefetch, scatter, store_fence};
use super::reduce::Acc;
use braid_graph::DType;
use braid_graph::expr::ExprOp;
use braid_lowering::row_passes::{EarlyStores, KeepPlan, RowPasses, early_stores, keep_plan};
use braid_lowering::{RowKernel, View};
use rayon::prelude::*;

/// Row elements per parallel task (rows are grouped until a task has about this much work: the CPU target's
/// work granularity).
pub(super) const TASK: usize = braid_graph::Target::CPU.work_granularity;

/// What a kernel's expression looks like from a row's point of view (computed once per kernel
/// and kept by the device).
pub struct Plan {
    /// Per expression node: constant along the row.
    pub(super) per_row: Vec<bool>,
    /// Per store: its view is constant along the row (written once per row).
    pub(super) row_stores: Vec<bool>,
    /// The reductions, in order, each with the per-element nodes its operand needs.
    pub(super) phases: Vec<(usize, Vec<usize>)>,
    /// Per-element nodes that per-element stores need.
    pub(super) last_phase: Vec<usize>,
    /// Per-row nodes read by per-element nodes (broadcast into chunks).
    broadcast: Vec<usize>,
    pub(super) outer_dims: Vec<usize>,
    /// Extent of the axis (the whole space when `None`) and of the dimensions after it.
    pub(super) len: usize,
    pub(super) inner: usize,
    /// The kernel to run instead of the one planned (see [`super::tile::row_kernel`]).
    retiled: Option<Box<RowKernel>>,
    /// Rows longer than a chunk and up to [`keep::KEEP_ROW`] positions: values kept from pass to
    /// pass instead of recomputed.
    keep: Option<KeepPlan>,
    /// Rows split across threads ([`Plan::splits`]): the per-element stores their first pass
    /// writes (see `braid_lowering::row_passes::EarlyStores`).
    pub(super) early: Option<EarlyStores>,
}

fn plan_for(k: &RowKernel) -> Plan {
    let nodes = &k.expr.nodes;
    let d = k.axis;
    let passes = RowPasses::of(k);
    let roots = passes.roots(k, |_| true);
    let early = early_stores(k, &passes);
    let RowPasses { per_row, row_stores, phases, elem_roots, last_phase } = passes;
    // Per-row values read by per-element nodes, reduced themselves (a value constant along the
    // axis, like a broadcast load), or stored over the whole row are broadcast into each chunk.
    let mut broadcast: Vec<usize> = elem_roots.iter().copied().filter(|&v| per_row[v]).collect();
    broadcast.dedup();
    for (i, n) in nodes.iter().enumerate() {
        let reads_rows = !per_row[i] || matches!(n.op, ExprOp::Reduce(..));
        if !reads_rows {
            continue;
        }
        for o in n.op.operands() {
            if per_row[o] && !broadcast.contains(&o) {
                broadcast.push(o);
            }
        }
    }
    let (outer_dims, len, inner): (Vec<usize>, usize, usize) = match d {
        Some(d) => (k.dims[..d].to_vec(), k.dims[d], k.dims[d + 1..].iter().product()),
        None => (Vec::new(), k.dims.iter().product(), 1),
    };
    let row = len * inner;
    let keep = if row > WHOLE_ROW && row <= keep::KEEP_ROW && !phases.is_empty() {
        keep_plan(k, &per_row, &roots)
    } else {
        None
    };
    let mut plan =
        Plan { per_row, row_stores, phases, last_phase, broadcast, outer_dims, len, inner, retiled: None, keep, early };
    if !plan.splits() {
        plan.early = None;
    }
    plan
}

impl Plan {
    /// The kernel this plan runs: `k` (the kernel planned) or its re-tiled form.
    pub fn kernel<'a>(&'a self, k: &'a RowKernel) -> &'a RowKernel {
        self.retiled.as_deref().unwrap_or(k)
    }

    /// Whether its rows are few and long enough to be split across threads (see `split`):
    /// such kernels run interpreted or compiled in their split form, segment by segment, the
    /// segments always combined by `split` (the interpreter's combine).
    pub fn splits(&self) -> bool {
        self.outer_dims.iter().product::<usize>() < MIN_ROWS && self.len * self.inner >= 2 * TASK
    }
}

/// Plans a row kernel, first choosing the order its index space runs in (see
/// [`super::tile::row_kernel`]).
pub fn plan(k: &RowKernel) -> Plan {
    match super::tile::row_kernel(k) {
        Some(tiled) => Plan { retiled: Some(Box::new(tiled.clone())), ..plan_for(&tiled) },
        None => plan_for(k),
    }
}

/// Rows needed before a kernel is left as it is: enough to keep every thread busy.
pub(super) const MIN_ROWS: usize = 16;

/// The part of `view` that row `o` covers: the axis and what follows it (`row = true`), or only
/// what follows it at axis position 0 (`row = false`, for per-row values).
pub(super) fn row_view(view: &View, axis: Option<usize>, o: usize, outer_dims: &[usize], whole_row: bool) -> View {
    let offset = row_offset(view, axis, o, outer_dims);
    let Some(d) = axis else {
        return if whole_row {
            view.clone()
        } else {
            View { dims: Default::default(), strides: Default::default(), offset }
        };
    };
    let from = if whole_row { d } else { d + 1 };
    View { dims: view.dims[from..].into(), strides: view.strides[from..].into(), offset }
}

/// The offset of [`row_view`]`(view, axis, o, ..)`: the only part of it that changes from row
/// to row.
#[inline(always)]
pub(super) fn row_offset(view: &View, axis: Option<usize>, o: usize, outer_dims: &[usize]) -> usize {
    let Some(d) = axis else { return view.offset };
    let mut offset = view.offset as isize;
    let mut rest = o;
    for i in (0..d).rev() {
        offset += (rest % outer_dims[i]) as isize * view.strides[i];
        rest /= outer_dims[i];
    }
    offset as usize
}

/// For [`sweep`]: the values a pass copies from and into the scratch of kept values (fill,
/// save, the scratch registers), if any.
pub(super) type Kept<'a> = Option<(&'a [usize], &'a [usize], &'a mut [Reg])>;

/// Runs a row kernel with its plan (from [`plan`]).
pub fn run_rows(k: &RowKernel, p: &Plan, args: &[ArgPtr]) -> Result<(), String> {
    let k = p.retiled.as_deref().unwrap_or(k);
    check_io(&k.loads, &k.stores, &k.expr, args)?;
    for n in &k.expr.nodes {
        if let ExprOp::Reduce(_, x) = n.op
            && k.expr.nodes[x as usize].dtype == DType::Bool
        {
            return Err("reductions of bool are rejected when recorded".into());
        }
    }
    let outer: usize = p.outer_dims.iter().product();
    // No rows, or rows with no per-row positions: nothing to write. (An empty axis with
    // positions left is fine: sums are 0, means NaN; max/min/argmax of it are rejected.)
    if outer == 0 || p.inner == 0 {
        return Ok(());
    }
    let shared = SharedArgs(args);
    let row = p.len * p.inner;
    if p.splits() {
        // Few long rows (a whole-tensor reduction, a long softmax row): each row is split
        // across threads instead (the split depends on sizes only, so results do not depend on
        // the number of threads).
        return (0..outer).try_for_each(|o| super::split::run_row(k, p, shared, o));
    }
    let per_task = (super::map::task_size() / row.max(1)).max(1);
    if outer <= per_task {
        return run_range(k, p, shared, 0, outer);
    }
    (0..outer.div_ceil(per_task))
        .into_par_iter()
        .try_for_each(|t| run_range(k, p, shared, t * per_task, ((t + 1) * per_task).min(outer)))
}

/// Rows are folded in chunks ([`chunk_width`]) of up to [`WHOLE_ROW`] positions (the whole row:
/// values computed for one reduction stay in registers for the next) or of [`LONG_CHUNK`]: wider
/// than a map loop's chunk, since each chunk pays per-node costs (dispatch, broadcasts), and
/// narrow enough that a softmax's registers stay in the first-level cache.
pub(super) use braid_lowering::row_passes::{LONG_CHUNK, WHOLE_ROW, chunk_width};
const _: () = assert!(LONG_CHUNK == 4 * CHUNK);

/// Rows `from..to`, compiled for each vector level (the loops in here vectorise; see
/// [`dispatch_simd`]).
fn run_range(k: &RowKernel, p: &Plan, args: SharedArgs<'_>, from: usize, to: usize) -> Result<(), String> {
    dispatch_simd!(run_range_impl(k: &RowKernel, p: &Plan, args: SharedArgs<'_>, from: usize, to: usize) -> Result<(), String>)
}

thread_local! {
    /// The registers of the last row kernel run on this thread (a chunk's, a row's), reused
    /// by the next where their dtypes and lengths match: a small model's step runs dozens of
    /// row kernels over short rows, each of which would otherwise allocate two registers per
    /// node.
    static ROW_REGS: std::cell::RefCell<(Vec<Reg>, Vec<Reg>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

#[inline(always)]
fn run_range_impl(k: &RowKernel, p: &Plan, args: SharedArgs<'_>, from: usize, to: usize) -> Result<(), String> {
    let nodes = &k.expr.nodes;
    let row = p.len * p.inner;
    let width = chunk_width(row);
    let (mut chunk, mut rowv) = ROW_REGS.with(|s| std::mem::take(&mut *s.borrow_mut()));
    // Exact lengths: a reduction's result is copied into its whole per-row register.
    fit_regs(&mut chunk, nodes, width, true);
    fit_regs(&mut rowv, nodes, p.inner, true);
    let result = run_rows_with(k, p, args, (from, to), width, &mut chunk, &mut rowv);
    ROW_REGS.with(|s| *s.borrow_mut() = (chunk, rowv));
    result
}

/// [`run_range_impl`] with its registers: `chunk` (`width` values per node) and `rowv` (a row's
/// per-row values, `p.inner` per node).
#[inline(always)]
fn run_rows_with(
    k: &RowKernel,
    p: &Plan,
    args: SharedArgs<'_>,
    (from, to): (usize, usize),
    width: usize,
    chunk: &mut [Reg],
    rowv: &mut [Reg],
) -> Result<(), String> {
    let nodes = &k.expr.nodes;
    let row = p.len * p.inner;
    let mut kept = p.keep.as_ref().map(|kp| keep::take(k, kp, row));
    let mut offsets = vec![0isize; width.max(p.inner)];
    let mut store_offsets = vec![0isize; width.max(p.inner)];
    let mut done = vec![false; nodes.len()];
    let mut fresh = vec![false; nodes.len()];
    let elem_stores: Vec<_> = k.stores.iter().zip(&p.row_stores).filter(|(_, r)| !**r).map(|(s, _)| s).collect();
    // Per-row scratch, allocated once per task rather than once per row.
    let mut accs: Vec<Acc> = p
        .phases
        .iter()
        .map(|(r, _)| {
            let ExprOp::Reduce(op, x) = nodes[*r].op else { unreachable!("phases are reductions") };
            Acc::new(op, nodes[x as usize].dtype, p.inner)
        })
        .collect();
    // The views of a row, per load node read per element and per per-element store: only
    // their offsets change from row to row.
    let mut load_views: Vec<Option<View>> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| match n.op {
            ExprOp::Load(slot) if !p.per_row[i] => {
                Some(row_view(&k.loads[slot as usize].view, k.axis, 0, &p.outer_dims, true))
            }
            _ => None,
        })
        .collect();
    let mut store_views: Vec<View> =
        elem_stores.iter().map(|s| row_view(&s.view, k.axis, 0, &p.outer_dims, true)).collect();
    for o in from..to {
        for (view, n) in load_views.iter_mut().zip(nodes) {
            if let (Some(view), ExprOp::Load(slot)) = (view, n.op) {
                let load = &k.loads[slot as usize];
                view.offset = row_offset(&load.view, k.axis, o, &p.outer_dims);
                if o + 1 < to && view.is_contiguous() {
                    // Bring the next row's loads into cache while this row computes.
                    prefetch(args.0[load.arg as usize], row_offset(&load.view, k.axis, o + 1, &p.outer_dims), row);
                }
            }
        }
        for (view, s) in store_views.iter_mut().zip(&elem_stores) {
            view.offset = row_offset(&s.view, k.axis, o, &p.outer_dims);
        }
        done.iter_mut().for_each(|d| *d = false);
        fresh.iter_mut().for_each(|f| *f = false);
        for (q, ((r, need), acc)) in p.phases.iter().zip(&mut accs).enumerate() {
            let (need, keeping) = match (&p.keep, kept.as_deref_mut()) {
                (Some(kp), Some(regs)) => (&kp.need[q][..], Some((&kp.fill[q][..], &kp.save[q][..], regs))),
                _ => (&need[..], None),
            };
            // The per-row values this reduction's operand may use.
            eval_row_values(k, p, args, o, *r, rowv, &mut done, &mut offsets)?;
            let ExprOp::Reduce(_, x) = nodes[*r].op else { unreachable!("phases are reductions") };
            acc.reset();
            let saves = keeping.as_ref().is_some_and(|(_, save, _)| !save.is_empty());
            if row > WHOLE_ROW
                && !saves
                && fold_load(k, args, need, x as usize, &load_views, acc, (0, row), p.inner, width)
            {
                acc.finish(p.len, &mut rowv[*r]);
                done[*r] = true;
                continue;
            }
            let scratch = (&mut chunk[..], &mut offsets[..], &load_views[..]);
            sweep(k, p, args, o, need, scratch, rowv, &mut fresh, &done, (0, row), keeping, |c, m, regs| {
                acc.add(&regs[x as usize], c, m, p.inner);
            })?;
            acc.finish(p.len, &mut rowv[*r]);
            done[*r] = true;
        }
        eval_row_values(k, p, args, o, nodes.len(), rowv, &mut done, &mut offsets)?;
        for s in k.stores.iter().zip(&p.row_stores).filter(|(_, r)| **r).map(|(s, _)| s) {
            let view = row_view(&s.view, k.axis, o, &p.outer_dims, false);
            // SAFETY: checked by `check_io`; different rows write different elements.
            unsafe { scatter(&view, args.0[s.arg as usize], 0, p.inner, &rowv[s.value as usize], &mut store_offsets) };
        }
        if !elem_stores.is_empty() {
            let scratch = (&mut chunk[..], &mut offsets[..], &load_views[..]);
            let q = p.phases.len();
            let (need, keeping) = match (&p.keep, kept.as_deref_mut()) {
                (Some(kp), Some(regs)) => (&kp.need[q][..], Some((&kp.fill[q][..], &kp.save[q][..], regs))),
                _ => (&p.last_phase[..], None),
            };
            sweep(k, p, args, o, need, scratch, rowv, &mut fresh, &done, (0, row), keeping, |c, m, regs| {
                for (s, view) in elem_stores.iter().zip(&store_views) {
                    // SAFETY: as above.
                    unsafe {
                        scatter_simd(view, args.0[s.arg as usize], c, m, &regs[s.value as usize], &mut store_offsets)
                    };
                }
            })?;
        }
    }
    if let Some(regs) = kept {
        keep::give_back(regs);
    }
    // Streaming stores (large outputs) are weakly ordered: make them visible before the task
    // reports done.
    store_fence();
    Ok(())
}

/// A reduction whose operand is a load alone, through a view contiguous along the row, folds
/// row positions `from..to` straight from the buffer, `width` at a time: the same chunks and
/// the same bits as through a gather, without the copy. False when it does not apply (nothing
/// folded).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn fold_load(
    k: &RowKernel,
    args: SharedArgs<'_>,
    need: &[usize],
    x: usize,
    views: &[Option<View>],
    acc: &mut Acc,
    (from, to): (usize, usize),
    inner: usize,
    width: usize,
) -> bool {
    let (ExprOp::Load(slot), [only], Some(view)) = (k.expr.nodes[x].op, need, &views[x]) else { return false };
    if *only != x || !view.is_contiguous() {
        return false;
    }
    let arg = args.0[k.loads[slot as usize].arg as usize];
    // SAFETY: `check_io` checked the view against the buffer's length, so the row's positions
    // `from..to` are in bounds; the buffer holds `arg.dtype` elements.
    unsafe {
        let start = arg.ptr.add((view.offset + from) * arg.dtype.size());
        acc.add_contiguous((start, arg.dtype), from, to - from, inner, width)
    }
}

/// Computes the per-row nodes (other than reductions) below `limit` that are not done yet; all
/// of their operands are (nodes are in topological order, and every reduction below `limit`
/// is done).
#[allow(clippy::too_many_arguments)]
pub(super) fn eval_row_values(
    k: &RowKernel,
    p: &Plan,
    args: SharedArgs<'_>,
    o: usize,
    limit: usize,
    rowv: &mut [Reg],
    done: &mut [bool],
    offsets: &mut [isize],
) -> Result<(), String> {
    for i in 0..limit.min(k.expr.nodes.len()) {
        if !p.per_row[i] || done[i] || matches!(k.expr.nodes[i].op, ExprOp::Reduce(..)) {
            continue;
        }
        if let ExprOp::Load(slot) = k.expr.nodes[i].op {
            let load = &k.loads[slot as usize];
            let view = row_view(&load.view, k.axis, o, &p.outer_dims, false);
            // SAFETY: checked by `check_io`.
            unsafe { gather(&view, args.0[load.arg as usize], 0, p.inner, &mut rowv[i], offsets) };
        } else {
            eval_node(&k.expr.nodes[i], i, rowv, p.inner, 0)?;
        }
        done[i] = true;
    }
    Ok(())
}

/// One pass over row `o`: evaluates `need` (per-element nodes) a chunk at a time, with per-row
/// operands broadcast, and hands each chunk to `each(start, len, registers)`. `views` holds
/// row `o`'s view for each load node read per element. With `keeping = (fill, save, scratch)`,
/// the `fill` nodes of each chunk are copied from the row-sized `scratch` first and the `save`
/// nodes copied into it after (see `keep`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn sweep(
    k: &RowKernel,
    p: &Plan,
    args: SharedArgs<'_>,
    o: usize,
    need: &[usize],
    (chunk, offsets, views): (&mut [Reg], &mut [isize], &[Option<View>]),
    rowv: &[Reg],
    fresh: &mut [bool],
    done: &[bool],
    (from, to): (usize, usize),
    mut keeping: Kept<'_>,
    mut each: impl FnMut(usize, usize, &[Reg]),
) -> Result<(), String> {
    let row = p.len * p.inner;
    let width = chunk.first().map_or(0, Reg::len);
    // With the whole row in one chunk, a value computed by an earlier pass is still there.
    let whole = width >= row;
    let mut c = from;
    while c < to {
        let m = width.min(to - c);
        // Per-row values not computed yet are not read by this pass.
        for &b in p.broadcast.iter().filter(|&&b| done[b]) {
            if !(whole && fresh[b]) {
                broadcast(&rowv[b], &mut chunk[b], c, m, p.inner);
                fresh[b] = whole;
            }
        }
        if let Some((fill, _, scratch)) = keeping.as_ref() {
            for &i in fill.iter() {
                keep::copy(&scratch[i], c, &mut chunk[i], 0, m);
            }
        }
        for &i in need {
            if whole && fresh[i] {
                continue;
            }
            fresh[i] = whole;
            match (&views[i], k.expr.nodes[i].op) {
                (Some(view), ExprOp::Load(slot)) => {
                    let arg = args.0[k.loads[slot as usize].arg as usize];
                    // SAFETY: checked by `check_io`.
                    unsafe { gather(view, arg, c, m, &mut chunk[i], offsets) };
                }
                _ => eval_node(&k.expr.nodes[i], i, chunk, m, o * row + c)?,
            }
        }
        if let Some((_, save, scratch)) = keeping.as_mut() {
            for &i in save.iter() {
                keep::copy(&chunk[i], 0, &mut scratch[i], c, m);
            }
        }
        each(c, m, chunk);
        c += m;
    }
    Ok(())
}

/// [`scatter`], compiled for each vector level: it is called from a closure, and closures do
/// not inherit their caller's target features.
///
/// # Safety
/// As for [`scatter`].
pub(super) unsafe fn scatter_simd(view: &View, arg: ArgPtr, start: usize, m: usize, reg: &Reg, offsets: &mut [isize]) {
    #[inline(always)]
    fn go(view: &View, arg: ArgPtr, start: usize, m: usize, reg: &Reg, offsets: &mut [isize]) {
        // SAFETY: the caller of `scatter_simd` meets `scatter`'s contract.
        unsafe { scatter(view, arg, start, m, reg, offsets) }
    }
    dispatch_simd!(go(view: &View, arg: ArgPtr, start: usize, m: usize, reg: &Reg, offsets: &mut [isize]) -> ())
}

/// Fills `out[..m]` with the per-row value for flat row positions `c..c + m` (position `f` is
/// inner index `f % inner`).
#[inline(always)]
fn broadcast(row: &Reg, out: &mut Reg, c: usize, m: usize, inner: usize) {
    macro_rules! go {
        ($r:expr, $o:expr) => {
            if inner == 1 {
                $o[..m].fill($r[0]);
            } else {
                inner_runs(c, m, inner, |t, j, run| $o[t..t + run].copy_from_slice(&$r[j..j + run]));
            }
        };
    }
    match (row, out) {
        (Reg::F32(r), Reg::F32(o)) => go!(r, o),
        (Reg::F64(r), Reg::F64(o)) => go!(r, o),
        (Reg::I32(r), Reg::I32(o)) => go!(r, o),
        (Reg::I64(r), Reg::I64(o)) => go!(r, o),
        (Reg::U8(r), Reg::U8(o)) => go!(r, o),
        (Reg::Bool(r), Reg::Bool(o)) => go!(r, o),
        _ => unreachable!("the registers of one node have one type"),
    }
}

/// Splits flat row positions `c..c + m` into runs of consecutive inner positions: calls
/// `each(offset in 0..m, first inner position, run length)`.
#[inline(always)]
pub(super) fn inner_runs(c: usize, m: usize, inner: usize, mut each: impl FnMut(usize, usize, usize)) {
    let (mut t, mut j) = (0, c % inner);
    while t < m {
        let run = (inner - j).min(m - t);
        each(t, j, run);
        t += run;
        j = 0;
    }
}
