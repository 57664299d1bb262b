//! Row kernels on the CPU: reductions along one axis with the elementwise work around them.
//!
//! For each row (every index except the axis fixed; the whole space when the axis is `None`)
//! the kernel runs one pass over the row per reduction, evaluating the per-element nodes that
//! reduction needs a chunk at a time, then one pass for per-element outputs. Values that are
//! constant along the row (reductions, and what depends only on them, on constants or on loads
//! with stride 0 along the axis) are computed once per row, for each position across the row's
//! inner dimensions. A row of a softmax is read three times, from cache. Rows are split across
//! rayon. Nothing here plans or allocates device memory.

use super::eval::{Reg, eval_node};
use super::map::{ArgPtr, CHUNK, Shared, check_io, gather, scatter};
use braid_graph::expr::ExprOp;
use braid_graph::{DType, ReduceOp};
use braid_lowering::{RowKernel, Store, View};
use rayon::prelude::*;
use smallvec::SmallVec;

/// Row elements per parallel task (rows are grouped until a task has about this much work).
const TASK: usize = 32 * 1024;

/// What a kernel's expression looks like from a row's point of view (computed once per kernel
/// and kept by the device).
pub struct Plan {
    /// Per expression node: constant along the row.
    per_row: Vec<bool>,
    /// Per store: its view is constant along the row (written once per row).
    row_stores: Vec<bool>,
    /// The reductions, in order, each with the per-element nodes its operand needs.
    phases: Vec<(usize, Vec<usize>)>,
    /// Per-element nodes that per-element stores need.
    last_phase: Vec<usize>,
    /// Per-row nodes read by per-element nodes (broadcast into chunks).
    broadcast: Vec<usize>,
    outer_dims: Vec<usize>,
    /// Extent of the axis (the whole space when `None`) and of the dimensions after it.
    len: usize,
    inner: usize,
    /// The kernel to run instead of the one planned (see [`retile`]).
    retiled: Option<Box<RowKernel>>,
}

fn plan_for(k: &RowKernel) -> Plan {
    let nodes = &k.expr.nodes;
    let d = k.axis;
    let mut per_row = vec![false; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        per_row[i] = match n.op {
            ExprOp::Load(slot) => {
                let v = &k.loads[slot as usize].view;
                match d {
                    Some(d) => v.strides[d] == 0,
                    None => v.strides.iter().all(|&s| s == 0),
                }
            }
            ExprOp::Const(_) | ExprOp::ConstInt(_) | ExprOp::Reduce(..) => true,
            ExprOp::Index => false,
            ExprOp::Random { operand, .. } => per_row[operand as usize],
            ExprOp::Unary(_, a) | ExprOp::Cast(_, a) => per_row[a as usize],
            ExprOp::Binary(_, a, b) | ExprOp::Cmp(_, a, b) => per_row[a as usize] && per_row[b as usize],
            ExprOp::Select(c, a, b) => per_row[c as usize] && per_row[a as usize] && per_row[b as usize],
        };
    }
    // The per-element nodes needed to compute `roots`, in order.
    let needed = |roots: &[usize]| -> Vec<usize> {
        let mut need = vec![false; nodes.len()];
        let mut stack: Vec<usize> = roots.iter().copied().filter(|&r| !per_row[r]).collect();
        while let Some(i) = stack.pop() {
            if std::mem::replace(&mut need[i], true) {
                continue;
            }
            for o in operands(&nodes[i].op) {
                if !per_row[o] {
                    stack.push(o);
                }
            }
        }
        (0..nodes.len()).filter(|&i| need[i]).collect()
    };
    let phases: Vec<(usize, Vec<usize>)> = nodes
        .iter()
        .enumerate()
        .filter_map(|(i, n)| match n.op {
            ExprOp::Reduce(_, x) => Some((i, needed(&[x as usize]))),
            _ => None,
        })
        .collect();
    // Written once per row: a per-row value through a view constant along the row. (A
    // per-element value through such a view only happens when rows have one element.)
    let row_store = |s: &Store| {
        per_row[s.value as usize]
            && match d {
                Some(d) => s.view.strides[d] == 0,
                None => s.view.strides.iter().all(|&x| x == 0),
            }
    };
    let row_stores: Vec<bool> = k.stores.iter().map(row_store).collect();
    let elem_roots: Vec<usize> = k.stores.iter().filter(|s| !row_store(s)).map(|s| s.value as usize).collect();
    let last_phase = needed(&elem_roots);
    // Per-row values read by per-element nodes, reduced themselves (a value constant along the
    // axis, like a broadcast load), or stored over the whole row are broadcast into each chunk.
    let mut broadcast: Vec<usize> = elem_roots.iter().copied().filter(|&v| per_row[v]).collect();
    broadcast.dedup();
    for (i, n) in nodes.iter().enumerate() {
        let reads_rows = !per_row[i] || matches!(n.op, ExprOp::Reduce(..));
        if !reads_rows {
            continue;
        }
        for o in operands(&n.op) {
            if per_row[o] && !broadcast.contains(&o) {
                broadcast.push(o);
            }
        }
    }
    let (outer_dims, len, inner) = match d {
        Some(d) => (k.dims[..d].to_vec(), k.dims[d], k.dims[d + 1..].iter().product()),
        None => (Vec::new(), k.dims.iter().product(), 1),
    };
    Plan { per_row, row_stores, phases, last_phase, broadcast, outer_dims, len, inner, retiled: None }
}

/// Plans a row kernel, first re-tiling it when it has too few rows to split across threads
/// (see [`retile`]).
pub fn plan(k: &RowKernel) -> Plan {
    match retile(k) {
        Some(tiled) => Plan { retiled: Some(Box::new(tiled.clone())), ..plan_for(&tiled) },
        None => plan_for(k),
    }
}

/// Rows needed before a kernel is left as it is: enough to keep every thread busy.
const MIN_ROWS: usize = 16;

/// A reduction along an axis with few rows before it and a wide last dimension (the column sums
/// of a bias gradient: `[batch, n]` summed over the batch is one row of `batch x n` elements,
/// run on one thread and too long to stay in cache) is the same kernel over the index space
/// with the last dimension split into `blocks x width` and the blocks moved in front of the
/// axis: every block is an independent row of `len x width` elements. Views are strided, so
/// this only rewrites dims and strides. Kernels that use the flat element index (random
/// numbers) keep their index space.
fn retile(k: &RowKernel) -> Option<RowKernel> {
    let d = k.axis?;
    let last = k.dims.len() - 1;
    if d == last || k.expr.nodes.iter().any(|n| matches!(n.op, ExprOp::Index | ExprOp::Random { .. })) {
        return None;
    }
    let outer: usize = k.dims[..d].iter().product();
    let inner: usize = k.dims[d + 1..].iter().product();
    let cols = k.dims[last];
    if outer >= MIN_ROWS || inner < 64 {
        return None;
    }
    // The widest block (a multiple of 8 lanes) that leaves enough rows and, where possible,
    // rows that fit one chunk.
    let rest = k.dims[d] * (inner / cols);
    let width = [64usize, 32, 16, 8]
        .into_iter()
        .filter(|&w| cols.is_multiple_of(w) && outer * (cols / w) >= MIN_ROWS)
        .find(|&w| rest * w <= WHOLE_ROW)
        .or_else(|| [8usize, 16, 32, 64].into_iter().find(|&w| cols.is_multiple_of(w) && cols / w >= 2))?;
    let blocks = cols / width;
    let split = |v: &View| -> View {
        let s = v.strides[last];
        let mut dims: SmallVec<[usize; 4]> = v.dims[..d].into();
        let mut strides: SmallVec<[isize; 4]> = v.strides[..d].into();
        dims.push(blocks);
        strides.push(s * width as isize);
        dims.extend_from_slice(&v.dims[d..last]);
        strides.extend_from_slice(&v.strides[d..last]);
        dims.push(width);
        strides.push(s);
        View { dims, strides, offset: v.offset }
    };
    let mut tiled = k.clone();
    tiled.dims = split(&View { dims: k.dims.clone(), strides: k.dims.iter().map(|_| 0).collect(), offset: 0 }).dims;
    tiled.axis = Some(d + 1);
    tiled.loads.iter_mut().for_each(|l| l.view = split(&l.view));
    tiled.stores.iter_mut().for_each(|s| s.view = split(&s.view));
    Some(tiled)
}

fn operands(op: &ExprOp) -> Vec<usize> {
    match *op {
        ExprOp::Load(_) | ExprOp::Const(_) | ExprOp::ConstInt(_) | ExprOp::Index => vec![],
        ExprOp::Random { operand, .. } => vec![operand as usize],
        ExprOp::Unary(_, a) | ExprOp::Cast(_, a) | ExprOp::Reduce(_, a) => vec![a as usize],
        ExprOp::Binary(_, a, b) | ExprOp::Cmp(_, a, b) => vec![a as usize, b as usize],
        ExprOp::Select(c, a, b) => vec![c as usize, a as usize, b as usize],
    }
}

/// The part of `view` that row `o` covers: the axis and what follows it (`row = true`), or only
/// what follows it at axis position 0 (`row = false`, for per-row values).
fn row_view(view: &View, axis: Option<usize>, o: usize, outer_dims: &[usize], whole_row: bool) -> View {
    let Some(d) = axis else {
        return if whole_row {
            view.clone()
        } else {
            View { dims: Default::default(), strides: Default::default(), offset: view.offset }
        };
    };
    let mut offset = view.offset as isize;
    let mut rest = o;
    for i in (0..d).rev() {
        offset += (rest % outer_dims[i]) as isize * view.strides[i];
        rest /= outer_dims[i];
    }
    let from = if whole_row { d } else { d + 1 };
    View { dims: view.dims[from..].into(), strides: view.strides[from..].into(), offset: offset as usize }
}

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
    let shared = Shared(args);
    let row = p.len * p.inner;
    let per_task = (TASK / row.max(1)).max(1);
    if outer <= per_task {
        return run_range(k, p, shared, 0, outer);
    }
    (0..outer.div_ceil(per_task))
        .into_par_iter()
        .try_for_each(|t| run_range(k, p, shared, t * per_task, ((t + 1) * per_task).min(outer)))
}

/// Rows up to this many elements are evaluated as one chunk, so values computed for one
/// reduction stay in registers for the next (no recomputation).
const WHOLE_ROW: usize = 4096;

/// Rows `from..to`, compiled with AVX2 where the CPU has it (the loops in here vectorise).
fn run_range(k: &RowKernel, p: &Plan, args: Shared<'_>, from: usize, to: usize) -> Result<(), String> {
    #[cfg(target_arch = "x86_64")]
    if super::eval::avx2() {
        // SAFETY: the CPU has AVX2.
        return unsafe { run_range_avx2(k, p, args, from, to) };
    }
    run_range_impl(k, p, args, from, to)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn run_range_avx2(k: &RowKernel, p: &Plan, args: Shared<'_>, from: usize, to: usize) -> Result<(), String> {
    run_range_impl(k, p, args, from, to)
}

#[inline(always)]
fn run_range_impl(k: &RowKernel, p: &Plan, args: Shared<'_>, from: usize, to: usize) -> Result<(), String> {
    let nodes = &k.expr.nodes;
    let row = p.len * p.inner;
    let width = if row <= WHOLE_ROW { row.max(1) } else { CHUNK };
    let mut chunk: Vec<Reg> = nodes.iter().map(|n| Reg::new(n.dtype, width)).collect();
    let mut rowv: Vec<Reg> = nodes.iter().map(|n| Reg::new(n.dtype, p.inner)).collect();
    let mut offsets = vec![0isize; width.max(p.inner)];
    let mut store_offsets = vec![0isize; width.max(p.inner)];
    let mut done = vec![false; nodes.len()];
    let mut fresh = vec![false; nodes.len()];
    let elem_stores: Vec<_> = k.stores.iter().zip(&p.row_stores).filter(|(_, r)| !**r).map(|(s, _)| s).collect();
    for o in from..to {
        done.iter_mut().for_each(|d| *d = false);
        fresh.iter_mut().for_each(|f| *f = false);
        for (r, need) in &p.phases {
            // The per-row values this reduction's operand may use.
            eval_row_values(k, p, args, o, *r, &mut rowv, &mut done, &mut offsets)?;
            let ExprOp::Reduce(op, x) = nodes[*r].op else { unreachable!("phases are reductions") };
            let mut acc = Acc::new(op, nodes[x as usize].dtype, p.inner);
            sweep(k, p, args, o, need, &mut chunk, &rowv, &mut offsets, &mut fresh, &done, |c, m, regs| {
                acc.add(&regs[x as usize], c, m, p.inner);
            })?;
            acc.finish(p.len, &mut rowv[*r]);
            done[*r] = true;
        }
        eval_row_values(k, p, args, o, nodes.len(), &mut rowv, &mut done, &mut offsets)?;
        for s in k.stores.iter().zip(&p.row_stores).filter(|(_, r)| **r).map(|(s, _)| s) {
            let view = row_view(&s.view, k.axis, o, &p.outer_dims, false);
            // SAFETY: checked by `check_io`; different rows write different elements.
            unsafe { scatter(&view, args.0[s.arg as usize], 0, p.inner, &rowv[s.value as usize], &mut store_offsets) };
        }
        if !elem_stores.is_empty() {
            let views: Vec<View> =
                elem_stores.iter().map(|s| row_view(&s.view, k.axis, o, &p.outer_dims, true)).collect();
            sweep(k, p, args, o, &p.last_phase, &mut chunk, &rowv, &mut offsets, &mut fresh, &done, |c, m, regs| {
                for (s, view) in elem_stores.iter().zip(&views) {
                    // SAFETY: as above.
                    unsafe { scatter(view, args.0[s.arg as usize], c, m, &regs[s.value as usize], &mut store_offsets) };
                }
            })?;
        }
    }
    Ok(())
}

/// Computes the per-row nodes (other than reductions) below `limit` that are not done yet; all
/// of their operands are (nodes are in topological order, and every reduction below `limit`
/// is done).
#[allow(clippy::too_many_arguments)]
fn eval_row_values(
    k: &RowKernel,
    p: &Plan,
    args: Shared<'_>,
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
/// operands broadcast, and hands each chunk to `each(start, len, registers)`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn sweep(
    k: &RowKernel,
    p: &Plan,
    args: Shared<'_>,
    o: usize,
    need: &[usize],
    chunk: &mut [Reg],
    rowv: &[Reg],
    offsets: &mut [isize],
    fresh: &mut [bool],
    done: &[bool],
    mut each: impl FnMut(usize, usize, &[Reg]),
) -> Result<(), String> {
    let row = p.len * p.inner;
    let width = chunk.first().map_or(0, Reg::len);
    // With the whole row in one chunk, a value computed by an earlier pass is still there.
    let whole = width >= row;
    let views: Vec<Option<View>> = need
        .iter()
        .map(|&i| match k.expr.nodes[i].op {
            ExprOp::Load(slot) => Some(row_view(&k.loads[slot as usize].view, k.axis, o, &p.outer_dims, true)),
            _ => None,
        })
        .collect();
    let mut c = 0;
    while c < row {
        let m = width.min(row - c);
        // Per-row values not computed yet are not read by this pass.
        for &b in p.broadcast.iter().filter(|&&b| done[b]) {
            if !(whole && fresh[b]) {
                broadcast(&rowv[b], &mut chunk[b], c, m, p.inner);
                fresh[b] = whole;
            }
        }
        for (&i, view) in need.iter().zip(&views) {
            if whole && fresh[i] {
                continue;
            }
            fresh[i] = whole;
            match (view, k.expr.nodes[i].op) {
                (Some(view), ExprOp::Load(slot)) => {
                    let arg = args.0[k.loads[slot as usize].arg as usize];
                    // SAFETY: checked by `check_io`.
                    unsafe { gather(view, arg, c, m, &mut chunk[i], offsets) };
                }
                _ => eval_node(&k.expr.nodes[i], i, chunk, m, o * row + c)?,
            }
        }
        each(c, m, chunk);
        c += m;
    }
    Ok(())
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
fn inner_runs(c: usize, m: usize, inner: usize, mut each: impl FnMut(usize, usize, usize)) {
    let (mut t, mut j) = (0, c % inner);
    while t < m {
        let run = (inner - j).min(m - t);
        each(t, j, run);
        t += run;
        j = 0;
    }
}

/// A running reduction for every inner position of a row, in the operand's type.
struct Acc {
    op: ReduceOp,
    vals: Reg,
    /// ArgMax: the axis position of the best value so far.
    idx: Vec<i64>,
}

/// Folds `v[..m]` (flat row positions `c..`) into float accumulators.
#[inline(always)]
fn fold_float<T: Copy + PartialOrd + std::ops::Add<Output = T> + Default>(
    op: ReduceOp,
    acc: &mut [T],
    idx: &mut [i64],
    v: &[T],
    c: usize,
    inner: usize,
    is_nan: impl Fn(T) -> bool,
) {
    match op {
        ReduceOp::Sum | ReduceOp::Mean if inner == 1 => {
            // Eight partial sums: a loop the compiler vectorises.
            let mut parts = [T::default(); 8];
            let mut it = v.chunks_exact(8);
            for ch in &mut it {
                for (p, &x) in parts.iter_mut().zip(ch) {
                    *p = *p + x;
                }
            }
            let mut s = it.remainder().iter().fold(T::default(), |a, &x| a + x);
            for p in parts {
                s = s + p;
            }
            acc[0] = acc[0] + s;
        }
        ReduceOp::Sum | ReduceOp::Mean => {
            // Runs of consecutive inner positions: loops the compiler vectorises.
            inner_runs(c, v.len(), inner, |t, j, run| {
                for (a, &x) in acc[j..j + run].iter_mut().zip(&v[t..t + run]) {
                    *a = *a + x;
                }
            });
        }
        ReduceOp::Max | ReduceOp::Min if inner == 1 => {
            // Eight running extremes (NaN-propagating), then one.
            let pick = |a: T, x: T| {
                let better = if op == ReduceOp::Min { x < a } else { x > a };
                if better || is_nan(x) || is_nan(a) { if is_nan(a) { a } else { x } } else { a }
            };
            let mut parts = [acc[0]; 8];
            let mut it = v.chunks_exact(8);
            for ch in &mut it {
                for (p, &x) in parts.iter_mut().zip(ch) {
                    *p = pick(*p, x);
                }
            }
            let mut m = it.remainder().iter().fold(acc[0], |a, &x| pick(a, x));
            for p in parts {
                m = pick(m, p);
            }
            acc[0] = m;
        }
        ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax => {
            let better = |x: T, a: T| if op == ReduceOp::Min { x < a } else { x > a };
            for (t, &x) in v.iter().enumerate() {
                let j = (c + t) % inner;
                if !is_nan(acc[j]) && (better(x, acc[j]) || is_nan(x)) {
                    acc[j] = x;
                    idx[j] = ((c + t) / inner) as i64;
                }
            }
        }
    }
}

/// Folds `v[..m]` into integer accumulators (sums wrap).
#[inline(always)]
fn fold_int<T: Copy + Ord>(
    op: ReduceOp,
    acc: &mut [T],
    idx: &mut [i64],
    v: &[T],
    c: usize,
    inner: usize,
    wrapping_add: impl Fn(T, T) -> T,
) {
    for (t, &x) in v.iter().enumerate() {
        let j = (c + t) % inner;
        match op {
            ReduceOp::Sum | ReduceOp::Mean => acc[j] = wrapping_add(acc[j], x),
            ReduceOp::Max => acc[j] = acc[j].max(x),
            ReduceOp::Min => acc[j] = acc[j].min(x),
            ReduceOp::ArgMax => {
                if x > acc[j] {
                    acc[j] = x;
                    idx[j] = ((c + t) / inner) as i64;
                }
            }
        }
    }
}

impl Acc {
    fn new(op: ReduceOp, operand: DType, inner: usize) -> Acc {
        let mut vals = Reg::new(operand, inner);
        macro_rules! init {
            ($v:expr, $zero:expr, $lo:expr, $hi:expr) => {
                $v.fill(match op {
                    ReduceOp::Sum | ReduceOp::Mean => $zero,
                    ReduceOp::Max | ReduceOp::ArgMax => $lo,
                    ReduceOp::Min => $hi,
                })
            };
        }
        match &mut vals {
            Reg::F32(v) => init!(v, 0.0, f32::NEG_INFINITY, f32::INFINITY),
            Reg::F64(v) => init!(v, 0.0, f64::NEG_INFINITY, f64::INFINITY),
            Reg::I32(v) => init!(v, 0, i32::MIN, i32::MAX),
            Reg::I64(v) => init!(v, 0, i64::MIN, i64::MAX),
            Reg::U8(v) => init!(v, 0, u8::MIN, u8::MAX),
            Reg::Bool(_) => {}
        }
        Acc { op, vals, idx: vec![0; inner] }
    }

    #[inline(always)]
    fn add(&mut self, v: &Reg, c: usize, m: usize, inner: usize) {
        let (op, idx) = (self.op, &mut self.idx);
        match (&mut self.vals, v) {
            (Reg::F32(a), Reg::F32(v)) => fold_float(op, a, idx, &v[..m], c, inner, f32::is_nan),
            (Reg::F64(a), Reg::F64(v)) => fold_float(op, a, idx, &v[..m], c, inner, f64::is_nan),
            (Reg::I32(a), Reg::I32(v)) => fold_int(op, a, idx, &v[..m], c, inner, i32::wrapping_add),
            (Reg::I64(a), Reg::I64(v)) => fold_int(op, a, idx, &v[..m], c, inner, i64::wrapping_add),
            (Reg::U8(a), Reg::U8(v)) => fold_int(op, a, idx, &v[..m], c, inner, u8::wrapping_add),
            _ => unreachable!("the accumulator has the operand's type"),
        }
    }

    /// Writes the results into the reduction node's per-row register.
    fn finish(self, len: usize, out: &mut Reg) {
        match (self.op, self.vals, out) {
            (ReduceOp::ArgMax, _, Reg::I64(o)) => o.copy_from_slice(&self.idx),
            (ReduceOp::Mean, Reg::F32(v), Reg::F32(o)) => o.iter_mut().zip(v).for_each(|(o, v)| *o = v / len as f32),
            (ReduceOp::Mean, Reg::F64(v), Reg::F64(o)) => o.iter_mut().zip(v).for_each(|(o, v)| *o = v / len as f64),
            (_, Reg::F32(v), Reg::F32(o)) => o.copy_from_slice(&v),
            (_, Reg::F64(v), Reg::F64(o)) => o.copy_from_slice(&v),
            (_, Reg::I32(v), Reg::I32(o)) => o.copy_from_slice(&v),
            (_, Reg::I64(v), Reg::I64(o)) => o.copy_from_slice(&v),
            (_, Reg::U8(v), Reg::U8(o)) => o.copy_from_slice(&v),
            _ => unreachable!("a reduction's register has its result type"),
        }
    }
}
