//! Running a [`GatherKernel`] on the CPU: each output element reads its index, then the source
//! element it names (zero outside the gathered dimension), elements moved as unsigned integers
//! of their size so every dtype keeps its bits. Output indices split into rayon tasks as map
//! loops do; within a task, runs along the last dimension step through the views by their
//! strides (an embedding's rows are contiguous copies).
//!
//! Every view is checked against its argument before any unchecked access, and an index is
//! compared with the gathered dimension's extent before the source is read at it. This module
//! never allocates device memory.

use super::map::{ArgPtr, SharedArgs, in_tasks, position, unravel};
use braid_graph::DType;
use braid_lowering::GatherKernel;

/// Runs one gather. `args` must match the kernel's argument list.
pub fn run_gather(g: &GatherKernel, args: &[ArgPtr]) -> Result<(), String> {
    g.check(|a| args.get(a as usize).map(|p| (p.dtype, p.len)))?;
    let numel = g.numel();
    if numel == 0 {
        return Ok(());
    }
    if g.extent == 0 {
        // Every index is out of range; the source (perhaps empty) is never addressed.
        let out = args[g.out as usize].ptr;
        // SAFETY: `check` gave the output `numel` elements.
        unsafe { std::ptr::write_bytes(out, 0, numel * g.src.dtype.size()) };
        return Ok(());
    }
    let shared = SharedArgs(args);
    let wide = g.index.dtype == DType::I64;
    in_tasks(numel, |start, end| {
        match (g.src.dtype.size(), wide) {
            (1, true) => run_range::<u8, i64>(g, shared, start, end),
            (2, true) => run_range::<u16, i64>(g, shared, start, end),
            (4, true) => run_range::<u32, i64>(g, shared, start, end),
            (_, true) => run_range::<u64, i64>(g, shared, start, end),
            (1, false) => run_range::<u8, i32>(g, shared, start, end),
            (2, false) => run_range::<u16, i32>(g, shared, start, end),
            (4, false) => run_range::<u32, i32>(g, shared, start, end),
            (_, false) => run_range::<u64, i32>(g, shared, start, end),
        }
        Ok(())
    })
}

/// Output indices `start..end`, whose elements are `T`s, read at indices of type `I` (i64 or
/// i32, as `check` allows).
fn run_range<T: Copy + Default, I: Copy + Into<i64>>(g: &GatherKernel, args: SharedArgs<'_>, start: usize, end: usize) {
    let dims = &g.dims;
    let rank = dims.len();
    let (src_view, index_view) = (&g.src.view, &g.index.view);
    let src = args.0[g.src.arg as usize].ptr as *const T;
    let index = args.0[g.index.arg as usize].ptr as *const I;
    let out = args.0[g.out as usize].ptr as *mut T;
    let (extent, along) = (g.extent as i64, g.along);
    // A rank-0 gather is one element: a run of one along a dimension of one.
    let last = dims.last().copied().unwrap_or(1);
    let step = |v: &braid_lowering::View| v.strides.last().copied().unwrap_or(0);
    let (index_step, src_step) = (step(index_view), step(src_view));
    // The multi-index of `start`, and the view offsets there.
    let mut at = vec![0usize; rank];
    unravel(dims, start, &mut at);
    let mut i = start;
    while i < end {
        let first = at.last().copied().unwrap_or(0);
        let run = (last - first).min(end - i);
        let (index_at, src_at) = (position(index_view, &at), position(src_view, &at));
        // SAFETY: `check` put every view within its argument, the source's at every index in
        // `0..extent`, so the run's index positions are inside the index buffer and, for an
        // index in `0..extent`, its source positions inside the source's; the run's outputs
        // `i..i + run` lie within `start..end`, which no other task writes.
        unsafe {
            let (index, src, to) = (index.offset(index_at), src.offset(src_at), out.add(i));
            if index_step == 0 {
                // One index for the whole run (an embedding's row, an `index_select` before
                // the last dimension): checked once, then a copy or a fill of zeros.
                let j: i64 = (*index).into();
                if !(0..extent).contains(&j) {
                    std::ptr::write_bytes(to, 0, run);
                } else if src_step == 1 {
                    std::ptr::copy_nonoverlapping(src.offset(j as isize * along), to, run);
                } else {
                    let from = src.offset(j as isize * along);
                    for k in 0..run {
                        *to.add(k) = *from.offset(k as isize * src_step);
                    }
                }
            } else {
                for k in 0..run as isize {
                    let j: i64 = (*index.offset(k * index_step)).into();
                    let inside = (0..extent).contains(&j);
                    *to.offset(k) = if inside { *src.offset(k * src_step + j as isize * along) } else { T::default() };
                }
            }
        }
        i += run;
        // The next run starts at the next row: carry through the dimensions before the last.
        if let Some(l) = at.last_mut() {
            *l = 0;
        }
        for d in (0..rank.saturating_sub(1)).rev() {
            at[d] += 1;
            if at[d] < dims[d] {
                break;
            }
            at[d] = 0;
        }
    }
}
