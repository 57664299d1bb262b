//! Running a [`MapLoop`] on the CPU: gather the loads of a chunk, evaluate the expression,
//! scatter the stores; chunks of one task run in order, tasks run in parallel on rayon.
//!
//! Buffers arrive as raw pointers. Before anything is read or written, every view is checked
//! against its argument's length, so the unchecked accesses below stay inside their buffers.
//! This module never allocates device memory and never interprets ops (see `eval`).

use super::eval::{Reg, dispatch_simd, eval_node, fit_regs};
use braid_graph::DType;
use braid_graph::expr::Expr;
use braid_graph::expr::ExprOp;
use braid_lowering::{Load, MapLoop, Store, View, check_access};
use half::bf16;
use rayon::prelude::*;

/// Elements evaluated per register pass: the registers of a kernel of a few dozen nodes stay in
/// L1 (32 KiB per core here).
pub(super) const CHUNK: usize = 256;
/// Elements per parallel task (the CPU target's work
/// granularity); loops smaller than two tasks run on the calling thread.
pub(super) const TASK: usize = braid_graph::Target::CPU.work_granularity;

/// A kernel argument as the CPU sees it.
#[derive(Clone, Copy, Debug)]
pub struct ArgPtr {
    pub ptr: *mut u8,
    /// Length in elements.
    pub len: usize,
    pub dtype: DType,
}

/// Shares argument pointers with rayon tasks. Sound because tasks write disjoint elements
/// (different indices of a map loop never store to the same element) and only read inputs.
#[derive(Clone, Copy)]
pub(super) struct SharedArgs<'a>(pub(super) &'a [ArgPtr]);
unsafe impl Send for SharedArgs<'_> {}
unsafe impl Sync for SharedArgs<'_> {}

/// Runs one loop. `args` must match the kernel's argument list.
pub fn run_loop(l: &MapLoop, args: &[ArgPtr]) -> Result<(), String> {
    check_io(&l.loads, &l.stores, &l.expr, args)?;
    let n = l.numel();
    if n == 0 {
        return Ok(());
    }
    let shared = SharedArgs(args);
    in_tasks(n, |start, end| run_range(l, shared, start, end))
}

thread_local! {
    /// Elements per task of the kernel the thread runs now ([`with_task_size`]).
    static TASK_SIZE: std::cell::Cell<usize> = const { std::cell::Cell::new(TASK) };
}

/// Elements (or a row kernel's positions) per parallel task for the kernel this thread runs
/// now: [`TASK`], unless a tuned variant (`super::tune`) set another around it.
pub(super) fn task_size() -> usize {
    TASK_SIZE.with(|t| t.get())
}

/// Runs `f` with tasks of `task` elements on this thread (every size a multiple of
/// [`CHUNK`], so chunks fall where they fall with [`TASK`] and results keep their bits).
pub(super) fn with_task_size<T>(task: usize, f: impl FnOnce() -> T) -> T {
    /// Puts the size back when dropped, also when `f` panics (the engine catches kernel
    /// panics and goes on on this thread).
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            TASK_SIZE.with(|t| t.set(self.0));
        }
    }
    let _restore = Restore(TASK_SIZE.with(|t| t.replace(task)));
    f()
}

/// Runs `f(start, end)` over indices `0..n` split into tasks of [`task_size`] indices, in
/// parallel on rayon; on the calling thread when `n` is under two tasks. Interpreted and
/// compiled loops split alike.
pub(super) fn in_tasks(n: usize, f: impl Fn(usize, usize) -> Result<(), String> + Sync) -> Result<(), String> {
    let task = task_size();
    if n < 2 * task {
        return f(0, n);
    }
    (0..n.div_ceil(task)).into_par_iter().try_for_each(|t| f(t * task, ((t + 1) * task).min(n)))
}

/// The position of `at` (a multi-index over `v`'s dims) in `v`'s argument.
pub(super) fn position(v: &View, at: &[usize]) -> isize {
    v.offset as isize + at.iter().zip(&v.strides).map(|(&i, &s)| i as isize * s).sum::<isize>()
}

/// The multi-index of element `i` of `dims`, row-major.
pub(super) fn unravel(dims: &[usize], mut i: usize, at: &mut [usize]) {
    for d in (0..dims.len()).rev() {
        at[d] = i % dims[d];
        i /= dims[d];
    }
}

/// Checks loads, stores and the expression against the arguments before any unchecked access:
/// dtypes agree, every view lies within its argument, every register has the right type.
pub(super) fn check_io(loads: &[Load], stores: &[Store], expr: &Expr, args: &[ArgPtr]) -> Result<(), String> {
    check_access(loads, stores, expr, |a| args.get(a as usize).map(|p| (p.dtype, p.len)))
}

/// Which expression nodes have the same value for every element (constants, and operations on
/// constants only): they are evaluated once per task, not once per chunk.
pub(super) fn invariant_nodes(expr: &Expr) -> Vec<bool> {
    let mut inv = vec![false; expr.nodes.len()];
    for (i, n) in expr.nodes.iter().enumerate() {
        inv[i] = match n.op {
            ExprOp::Const(_) | ExprOp::ConstInt(_) => true,
            ExprOp::Load(_) | ExprOp::Index | ExprOp::Random { .. } | ExprOp::Reduce(..) => false,
            ExprOp::Unary(_, a) | ExprOp::Cast(_, a) => inv[a as usize],
            ExprOp::Binary(_, a, b) | ExprOp::Cmp(_, a, b) => inv[a as usize] && inv[b as usize],
            ExprOp::Select(c, a, b) => inv[c as usize] && inv[a as usize] && inv[b as usize],
        };
    }
    inv
}

/// Indices `start..end`, compiled for each vector level (see [`dispatch_simd`]).
fn run_range(l: &MapLoop, args: SharedArgs<'_>, start: usize, end: usize) -> Result<(), String> {
    dispatch_simd!(run_range_impl(l: &MapLoop, args: SharedArgs<'_>, start: usize, end: usize) -> Result<(), String>)
}

thread_local! {
    /// Registers kept between runs on this thread: small kernels (a scalar training step runs
    /// hundreds) would otherwise spend more time allocating registers than computing.
    static SCRATCH: std::cell::RefCell<(Vec<Reg>, Vec<isize>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

#[inline(always)]
fn run_range_impl(l: &MapLoop, args: SharedArgs<'_>, start: usize, end: usize) -> Result<(), String> {
    let width = CHUNK.min(end - start);
    let (mut regs, mut offsets) = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    fit_regs(&mut regs, &l.expr.nodes, width, false);
    offsets.resize(offsets.len().max(width), 0);
    let result = run_chunks(l, args, start, end, width, &mut regs, &mut offsets);
    SCRATCH.with(|s| *s.borrow_mut() = (regs, offsets));
    result
}

#[inline(always)]
fn run_chunks(
    l: &MapLoop,
    args: SharedArgs<'_>,
    start: usize,
    end: usize,
    width: usize,
    regs: &mut [Reg],
    offsets: &mut [isize],
) -> Result<(), String> {
    let invariant = invariant_nodes(&l.expr);
    for (i, node) in l.expr.nodes.iter().enumerate() {
        if invariant[i] {
            eval_node(node, i, regs, width, start)?;
        }
    }
    let mut c = start;
    while c < end {
        let m = width.min(end - c);
        let next = c + m;
        if next < end {
            for load in l.loads.iter().filter(|load| load.view.is_contiguous()) {
                prefetch(args.0[load.arg as usize], load.view.offset + next, width.min(end - next));
            }
        }
        for (i, node) in l.expr.nodes.iter().enumerate() {
            if invariant[i] {
                continue;
            }
            if let ExprOp::Load(slot) = node.op {
                let load = &l.loads[slot as usize];
                let arg = args.0[load.arg as usize];
                // SAFETY: the view was checked against the argument's length in `run_loop`.
                unsafe { gather(&load.view, arg, c, m, &mut regs[i], offsets) };
            } else {
                eval_node(node, i, regs, m, c)?;
            }
        }
        for store in &l.stores {
            let arg = args.0[store.arg as usize];
            // SAFETY: as above; different indices write different elements.
            unsafe { scatter(&store.view, arg, c, m, &regs[store.value as usize], offsets) };
        }
        c += m;
    }
    store_fence();
    Ok(())
}

/// Asks the CPU to bring elements `first..first + n` of `arg` into cache while the current
/// chunk computes, so that memory latency overlaps with arithmetic (the hardware prefetcher
/// alone leaves a compute-heavy chunk loop waiting on every new chunk's loads). A hint: it
/// never faults, whatever the addresses.
#[inline(always)]
pub(super) fn prefetch(arg: ArgPtr, first: usize, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let size = arg.dtype.size();
        let base = arg.ptr.wrapping_add(first * size);
        for line in (0..n * size).step_by(64) {
            // SAFETY: prefetching is a hint and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(line) as *const i8) };
        }
    }
}

/// f32 outputs of at least this many bytes are written with non-temporal stores: half the
/// last-level cache (its size as Linux reports it for CPU 0), and at least 4 MiB. An output that
/// large cannot stay in cache beside its inputs, and streaming it skips reading each line
/// before it is overwritten; a smaller one is better left in cache, where its next reader and
/// the next output given the same buffer find it (C2's 8 MiB softmax is about 7% faster
/// written plainly where the cache is 32 MiB). Looked up once per process.
pub fn stream_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        let llc = last_level_cache_bytes();
        let bytes = (llc.unwrap_or(0) / 2).max(4 << 20);
        tracing::debug!(target: "braid", last_level_cache = ?llc, stream_bytes = bytes, "non-temporal stores from this output size");
        bytes
    })
}

/// The size of CPU 0's largest cache (`/sys/devices/system/cpu/cpu0/cache`), if Linux says.
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let size = |path: std::path::PathBuf| -> Option<usize> {
        let text = std::fs::read_to_string(path.join("size")).ok()?;
        let text = text.trim();
        let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
        let scale = match unit {
            "" => 1,
            "K" => 1 << 10,
            "M" => 1 << 20,
            _ => return None,
        };
        digits.parse::<usize>().ok().map(|d| d * scale)
    };
    dir.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("index")).filter_map(|e| size(e.path())).max()
}

/// Copies `src` to `dst` with non-temporal stores where the CPU has them. The caller must call
/// [`store_fence`] before another thread may read what was written.
///
/// # Safety
/// `dst` must be valid for `src.len()` writes.
#[inline(always)]
unsafe fn stream_f32(dst: *mut f32, src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    unsafe {
        use super::eval::{Simd, simd};
        use std::arch::x86_64::{_mm_loadu_ps, _mm_stream_ps};
        /// 16 floats per streaming store (one instruction per cache line).
        #[target_feature(enable = "avx512f")]
        unsafe fn wide(dst: *mut f32, src: *const f32, n: usize) {
            use std::arch::x86_64::{_mm512_loadu_ps, _mm512_stream_ps};
            let mut i = 0;
            while i + 16 <= n {
                unsafe { _mm512_stream_ps(dst.add(i), _mm512_loadu_ps(src.add(i))) };
                i += 16;
            }
        }
        // Plain stores up to a 64-byte boundary (a 16-byte one without AVX-512), then streaming
        // stores of whole vectors, then plain stores for the tail.
        let lanes = if simd() == Simd::Avx512 { 16 } else { 4 };
        let head = dst.align_offset(4 * lanes).min(src.len());
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
        let body = (src.len() - head) / lanes * lanes;
        if lanes == 16 {
            wide(dst.add(head), src.as_ptr().add(head), body);
        } else {
            let mut i = head;
            while i < head + body {
                _mm_stream_ps(dst.add(i), _mm_loadu_ps(src.as_ptr().add(i)));
                i += 4;
            }
        }
        let i = head + body;
        std::ptr::copy_nonoverlapping(src.as_ptr().add(i), dst.add(i), src.len() - i);
    }
    #[cfg(not(target_arch = "x86_64"))]
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
    }
}

/// Orders non-temporal stores before everything after it (they are weakly ordered otherwise).
#[inline(always)]
pub(super) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Fills `out[..m]` with the element offsets of indices `start..start + m` of `view`.
#[inline(always)]
pub(super) fn fill_offsets(view: &View, start: usize, m: usize, out: &mut [isize]) {
    if view.dims.is_empty() {
        out[..m].fill(view.offset as isize);
        return;
    }
    let s_inner = view.strides[view.dims.len() - 1];
    for_each_run(view, start, m, |p, cur, run| {
        for (j, o) in out[p..p + run].iter_mut().enumerate() {
            *o = cur + j as isize * s_inner;
        }
    });
}

/// Splits indices `start..start + m` of `view` (rank >= 1) into runs along the last dimension:
/// calls `each(position in 0..m, offset of the run's first element, run length)`.
#[inline(always)]
fn for_each_run(view: &View, start: usize, m: usize, mut each: impl FnMut(usize, isize, usize)) {
    let rank = view.dims.len();
    let mut idx = [0usize; 8];
    let mut idx_heap;
    let idx: &mut [usize] = if rank <= 8 {
        &mut idx[..rank]
    } else {
        idx_heap = vec![0; rank];
        &mut idx_heap
    };
    let mut rem = start;
    let mut cur = view.offset as isize;
    for d in (0..rank).rev() {
        idx[d] = rem % view.dims[d];
        rem /= view.dims[d];
        cur += idx[d] as isize * view.strides[d];
    }
    let (inner, s_inner) = (view.dims[rank - 1], view.strides[rank - 1]);
    let mut p = 0;
    while p < m {
        let run = (inner - idx[rank - 1]).min(m - p);
        each(p, cur, run);
        p += run;
        cur += run as isize * s_inner;
        idx[rank - 1] += run;
        // Carry into outer dimensions.
        let mut d = rank - 1;
        while idx[d] == view.dims[d] && d > 0 {
            cur -= view.dims[d] as isize * view.strides[d];
            idx[d] = 0;
            d -= 1;
            idx[d] += 1;
            cur += view.strides[d];
        }
    }
}

/// Whether a view's last dimension is contiguous in runs long enough to copy as slices.
#[inline(always)]
fn contiguous_runs(view: &View) -> bool {
    view.dims.last().is_some_and(|&n| n >= 8) && view.strides.last() == Some(&1)
}

/// Reads indices `start..start + m` of `view` from `arg` into `out`, converting storage to
/// compute type.
///
/// # Safety
/// The view must lie within the argument (see [`check_io`]).
#[inline(always)]
pub(super) unsafe fn gather(view: &View, arg: ArgPtr, start: usize, m: usize, out: &mut Reg, offsets: &mut [isize]) {
    unsafe fn go<S: Copy, C: Copy>(
        view: &View,
        base: *const S,
        start: usize,
        out: &mut [C],
        offsets: &mut [isize],
        conv: impl Fn(S) -> C,
    ) {
        let m = out.len();
        unsafe {
            if view.is_contiguous() {
                let src = std::slice::from_raw_parts(base.add(view.offset + start), m);
                for (o, &s) in out.iter_mut().zip(src) {
                    *o = conv(s);
                }
            } else if view.strides.iter().all(|&s| s == 0) {
                out.fill(conv(*base.add(view.offset)));
            } else if contiguous_runs(view) {
                for_each_run(view, start, m, |p, cur, run| {
                    let src = std::slice::from_raw_parts(base.offset(cur), run);
                    for (o, &s) in out[p..p + run].iter_mut().zip(src) {
                        *o = conv(s);
                    }
                });
            } else {
                fill_offsets(view, start, m, offsets);
                for (o, &off) in out.iter_mut().zip(&offsets[..m]) {
                    *o = conv(*base.offset(off));
                }
            }
        }
    }
    unsafe {
        match (arg.dtype, out) {
            (DType::F32, Reg::F32(o)) => go(view, arg.ptr as *const f32, start, &mut o[..m], offsets, |v| v),
            (DType::F16, Reg::F32(o)) => {
                go(view, arg.ptr as *const u16, start, &mut o[..m], offsets, braid_graph::dtype::f32_from_f16_bits)
            }
            (DType::BF16, Reg::F32(o)) => go(view, arg.ptr as *const bf16, start, &mut o[..m], offsets, |v| v.to_f32()),
            (DType::F64, Reg::F64(o)) => go(view, arg.ptr as *const f64, start, &mut o[..m], offsets, |v| v),
            (DType::I32, Reg::I32(o)) => go(view, arg.ptr as *const i32, start, &mut o[..m], offsets, |v| v),
            (DType::I64, Reg::I64(o)) => go(view, arg.ptr as *const i64, start, &mut o[..m], offsets, |v| v),
            (DType::U8, Reg::U8(o)) => go(view, arg.ptr as *const u8, start, &mut o[..m], offsets, |v| v),
            (DType::Bool, Reg::Bool(o)) => go(view, arg.ptr as *const u8, start, &mut o[..m], offsets, |v| v != 0),
            (d, _) => unreachable!("load of {d} into a register of another type (checked by lowering)"),
        }
    }
}

/// Writes `reg[..m]` to indices `start..start + m` of `view` in `arg`, converting compute type
/// to storage.
///
/// # Safety
/// The view must lie within the argument, and no other thread may write these elements.
#[inline(always)]
pub(super) unsafe fn scatter(view: &View, arg: ArgPtr, start: usize, m: usize, reg: &Reg, offsets: &mut [isize]) {
    unsafe fn go<S: Copy, C: Copy>(
        view: &View,
        base: *mut S,
        start: usize,
        src: &[C],
        offsets: &mut [isize],
        conv: impl Fn(C) -> S,
    ) {
        let m = src.len();
        unsafe {
            if view.is_contiguous() {
                let dst = std::slice::from_raw_parts_mut(base.add(view.offset + start), m);
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = conv(s);
                }
            } else if contiguous_runs(view) {
                for_each_run(view, start, m, |p, cur, run| {
                    let dst = std::slice::from_raw_parts_mut(base.offset(cur), run);
                    for (d, &s) in dst.iter_mut().zip(&src[p..p + run]) {
                        *d = conv(s);
                    }
                });
            } else {
                fill_offsets(view, start, m, offsets);
                for (&off, &s) in offsets[..m].iter().zip(src) {
                    *base.offset(off) = conv(s);
                }
            }
        }
    }
    unsafe {
        match (arg.dtype, reg) {
            (DType::F32, Reg::F32(r)) if view.is_contiguous() && arg.len * 4 >= stream_bytes() => {
                stream_f32((arg.ptr as *mut f32).add(view.offset + start), &r[..m])
            }
            (DType::F32, Reg::F32(r)) => go(view, arg.ptr as *mut f32, start, &r[..m], offsets, |v| v),
            (DType::F16, Reg::F32(r)) => {
                go(view, arg.ptr as *mut u16, start, &r[..m], offsets, braid_graph::dtype::f16_bits_from_f32)
            }
            (DType::BF16, Reg::F32(r)) => go(view, arg.ptr as *mut bf16, start, &r[..m], offsets, bf16::from_f32),
            (DType::F64, Reg::F64(r)) => go(view, arg.ptr as *mut f64, start, &r[..m], offsets, |v| v),
            (DType::I32, Reg::I32(r)) => go(view, arg.ptr as *mut i32, start, &r[..m], offsets, |v| v),
            (DType::I64, Reg::I64(r)) => go(view, arg.ptr as *mut i64, start, &r[..m], offsets, |v| v),
            (DType::U8, Reg::U8(r)) => go(view, arg.ptr, start, &r[..m], offsets, |v| v),
            (DType::Bool, Reg::Bool(r)) => go(view, arg.ptr, start, &r[..m], offsets, |v| v as u8),
            (d, _) => unreachable!("store of a register into a {d} argument of another type (checked by lowering)"),
        }
    }
}
