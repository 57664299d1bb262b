//! Running a [`ScatterKernel`] on the CPU: the output zeroed, then the rows of the source space
//! (its elements that differ only along the scattered dimension) added in order to the output
//! elements their indices name, in rayon tasks of whole rows (rows write disjoint output
//! elements, and each element's sum is folded by one task in order: the same bits at any
//! number of threads), then the base added. Within a task the rows advance together, one
//! position along the dimension at a time, so an embedding's gradient (rows along the
//! features) reads and writes whole table rows.
//!
//! Every view is checked against its argument before any unchecked access, and an index is
//! compared with the output's extent before the output is written at it. This module never
//! allocates device memory.

use super::map::{ArgPtr, SharedArgs, TASK, in_tasks, position, unravel};
use braid_graph::DType;
use braid_lowering::{Load, ScatterKernel, View};
use rayon::prelude::*;

/// Addition in a dtype's own arithmetic (wrapping for integers).
trait Add: Copy + Default + Send + Sync {
    fn add(self, other: Self) -> Self;
}

impl Add for f32 {
    fn add(self, other: f32) -> f32 {
        self + other
    }
}
impl Add for f64 {
    fn add(self, other: f64) -> f64 {
        self + other
    }
}
macro_rules! wrapping_add {
    ($($t:ty),*) => {$(
        impl Add for $t {
            fn add(self, other: $t) -> $t {
                self.wrapping_add(other)
            }
        }
    )*};
}
wrapping_add!(i32, i64, u8);

/// Runs one scatter-add. `args` must match the kernel's argument list.
pub fn run_scatter(s: &ScatterKernel, args: &[ArgPtr]) -> Result<(), String> {
    s.check(|a| args.get(a as usize).map(|p| (p.dtype, p.len)))?;
    let shared = SharedArgs(args);
    match s.dtype() {
        DType::F32 => run::<f32>(s, shared),
        DType::F64 => run::<f64>(s, shared),
        DType::I32 => run::<i32>(s, shared),
        DType::I64 => run::<i64>(s, shared),
        DType::U8 => run::<u8>(s, shared),
        d => return Err(format!("a scatter-add of {d}")),
    }
    Ok(())
}

fn run<T: Add>(s: &ScatterKernel, args: SharedArgs<'_>) {
    match s.index.dtype {
        DType::I64 => run_indexed::<T, i64>(s, args),
        _ => run_indexed::<T, i32>(s, args),
    }
}

/// The scatter-add of `T`s at indices of type `I` (i64 or i32, as `check` allows).
fn run_indexed<T: Add, I: Copy + Into<i64>>(s: &ScatterKernel, args: SharedArgs<'_>) {
    let numel: usize = s.out_dims.iter().product();
    let _ = in_tasks(numel, |start, end| {
        zero::<T>(s, args, start, end);
        Ok(())
    });
    let rows = s.rows();
    if rows > 0 {
        // Whole rows per task, about a task's worth of elements each.
        let per_task = (TASK / s.dims[s.dim]).max(1);
        (0..rows.div_ceil(per_task))
            .into_par_iter()
            .for_each(|t| scatter_rows::<T, I>(s, args, t * per_task, ((t + 1) * per_task).min(rows)));
    }
    if let Some(base) = &s.base {
        let _ = in_tasks(numel, |start, end| {
            add_base::<T>(s, base, args, start, end);
            Ok(())
        });
    }
}

/// Output elements `start..end` set to zero.
fn zero<T: Add>(s: &ScatterKernel, args: SharedArgs<'_>, start: usize, end: usize) {
    let out = args.0[s.out as usize].ptr as *mut T;
    // SAFETY: `check` gave the output its elements, `end` at most their number; tasks zero
    // disjoint ranges.
    unsafe { std::ptr::write_bytes(out.add(start), 0, end - start) };
}

/// Rows `first..last` (row-major over the source space without the scattered dimension).
fn scatter_rows<T: Add, I: Copy + Into<i64>>(s: &ScatterKernel, args: SharedArgs<'_>, first: usize, last: usize) {
    let (src, index) = (args.0[s.src.arg as usize].ptr as *const T, args.0[s.index.arg as usize].ptr as *const I);
    let out = args.0[s.out as usize].ptr as *mut T;
    let dim = s.dim;
    let mut row_dims = s.dims.clone();
    row_dims[dim] = 1;
    let out_view = View::contiguous(&braid_graph::Shape::new(&s.out_dims));
    // Each row's positions at index 0 along the dimension.
    let mut at = vec![0; row_dims.len()];
    let starts: Vec<(isize, isize, isize)> = (first..last)
        .map(|r| {
            unravel(&row_dims, r, &mut at);
            (position(&s.src.view, &at), position(&s.index.view, &at), position(&out_view, &at))
        })
        .collect();
    let (src_along, index_along, out_along) = (s.src.view.strides[dim], s.index.view.strides[dim], s.out_along());
    let extent = s.out_dims[dim] as i64;
    // Rows that share their index and lie side by side in the source and the output (an
    // embedding's gradient, its rows along the features): each position along the dimension
    // adds one contiguous slice, in the same order per element.
    let (src0, index0, out0) = starts[0];
    let lanes = starts.iter().enumerate().all(|(r, &(src_at, index_at, out_at))| {
        index_at == index0 && src_at == src0 + r as isize && out_at == out0 + r as isize
    });
    if lanes {
        let width = starts.len();
        for n in 0..s.dims[dim] as isize {
            // SAFETY: as below, for the `width` rows of this task.
            unsafe {
                let j: i64 = (*index.offset(index0 + n * index_along)).into();
                if (0..extent).contains(&j) {
                    let to = out.offset(out0 + j as isize * out_along);
                    let from = src.offset(src0 + n * src_along);
                    for r in 0..width {
                        *to.add(r) = (*to.add(r)).add(*from.add(r));
                    }
                }
            }
        }
        return;
    }
    for n in 0..s.dims[dim] as isize {
        for &(src_at, index_at, out_at) in &starts {
            // SAFETY: `check` put the source and index views within their arguments at every
            // element of the source space, and the output is contiguous over `out_dims`, so
            // for `j` in `0..extent` the element is inside it; rows of other tasks write other
            // output elements (they differ outside the scattered dimension).
            unsafe {
                let j: i64 = (*index.offset(index_at + n * index_along)).into();
                if (0..extent).contains(&j) {
                    let to = out.offset(out_at + j as isize * out_along);
                    *to = (*to).add(*src.offset(src_at + n * src_along));
                }
            }
        }
    }
}

/// Output elements `start..end`: the base added to their sums, a run along the last dimension
/// at a time.
fn add_base<T: Add>(s: &ScatterKernel, base_load: &Load, args: SharedArgs<'_>, start: usize, end: usize) {
    let base = args.0[base_load.arg as usize].ptr as *const T;
    let out = args.0[s.out as usize].ptr as *mut T;
    let dims = &s.out_dims;
    let last = *dims.last().expect("a scatter-add has a dimension");
    let step = *base_load.view.strides.last().expect("a view over the output's dims");
    let mut at = vec![0; dims.len()];
    let mut i = start;
    while i < end {
        unravel(dims, i, &mut at);
        let run = (last - at[dims.len() - 1]).min(end - i);
        let from = position(&base_load.view, &at);
        for k in 0..run {
            // SAFETY: `check` put the base's view within its argument, so the run's positions
            // are inside it; `i + k < end <= numel`, and tasks write disjoint output elements.
            unsafe {
                let to = out.add(i + k);
                *to = (*base.offset(from + k as isize * step)).add(*to);
            }
        }
        i += run;
    }
}
