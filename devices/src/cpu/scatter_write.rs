//! Running a [`ScatterWriteKernel`] on the CPU: the base copied into the output (not when they
//! are one buffer read as it lies: the scatter written over its base), then each row of the
//! source space (its elements that differ only along the scattered dimension) written in order
//! where its indices name, so a later write to an element wins, as on every device. Elements
//! move as bytes (any dtype). Rows write disjoint output elements, so tasks of whole rows run
//! in parallel.
//!
//! Every view is checked against its argument before any unchecked access, and an index is
//! compared with the output's extent before the output is written at it. This module never
//! allocates device memory.

use super::map::{ArgPtr, SharedArgs, TASK, in_tasks, position, unravel};
use braid_graph::DType;
use braid_lowering::{ScatterWriteKernel, View};
use rayon::prelude::*;

/// Runs one scatter. `args` must match the kernel's argument list.
pub fn run_scatter_write(s: &ScatterWriteKernel, args: &[ArgPtr]) -> Result<(), String> {
    s.check(|a| args.get(a as usize).map(|p| (p.dtype, p.len)))?;
    let shared = SharedArgs(args);
    let width = s.dtype().size();
    let numel: usize = s.out_dims.iter().product();
    let (base, out) = (args[s.base.arg as usize].ptr, args[s.out as usize].ptr);
    if !(s.base_in_place() && std::ptr::eq(base, out)) {
        in_tasks(numel, |start, end| {
            copy_base(s, shared, width, start, end);
            Ok(())
        })?;
    }
    let rows = s.rows();
    if rows == 0 {
        return Ok(());
    }
    let per_task = (TASK / s.dims[s.dim].max(1)).max(1);
    (0..rows.div_ceil(per_task)).into_par_iter().for_each(|t| {
        let (first, last) = (t * per_task, ((t + 1) * per_task).min(rows));
        match s.index.dtype {
            DType::I64 => write_rows::<i64>(s, shared, width, first, last),
            _ => write_rows::<i32>(s, shared, width, first, last),
        }
    });
    Ok(())
}

/// Output elements `start..end` copied from the base.
fn copy_base(s: &ScatterWriteKernel, args: SharedArgs<'_>, width: usize, start: usize, end: usize) {
    let (base, out) = (args.0[s.base.arg as usize].ptr as *const u8, args.0[s.out as usize].ptr);
    let mut at = vec![0; s.out_dims.len()];
    for i in start..end {
        unravel(&s.out_dims, i, &mut at);
        let from = position(&s.base.view, &at) as usize;
        // SAFETY: `check` bounded the base's view within its argument and gave the output
        // `numel` elements; tasks copy disjoint ranges of the output.
        unsafe { std::ptr::copy_nonoverlapping(base.add(from * width), out.add(i * width), width) };
    }
}

/// Rows `first..last` (row-major over the source space without the scattered dimension), each
/// written in order along it.
fn write_rows<I: Copy + Into<i64>>(
    s: &ScatterWriteKernel,
    args: SharedArgs<'_>,
    width: usize,
    first: usize,
    last: usize,
) {
    let (src, index) = (args.0[s.src.arg as usize].ptr as *const u8, args.0[s.index.arg as usize].ptr as *const I);
    let out = args.0[s.out as usize].ptr;
    let dim = s.dim;
    let mut row_dims = s.dims.clone();
    row_dims[dim] = 1;
    let out_view = View::contiguous(&braid_graph::Shape::new(&s.out_dims));
    let (src_along, index_along, out_along) = (s.src.view.strides[dim], s.index.view.strides[dim], s.out_along());
    let extent = s.out_dims[dim] as i64;
    let mut at = vec![0; row_dims.len()];
    for r in first..last {
        unravel(&row_dims, r, &mut at);
        let (src_at, index_at, out_at) =
            (position(&s.src.view, &at), position(&s.index.view, &at), position(&out_view, &at));
        for n in 0..s.dims[dim] as isize {
            // SAFETY: `check` bounded the index's and the source's views within their
            // arguments; `j` is inside the output's extent, so the element is the output's;
            // rows write disjoint elements (they differ along another dimension).
            unsafe {
                let j: i64 = (*index.offset(index_at + n * index_along)).into();
                if (0..extent).contains(&j) {
                    let to = (out_at + j as isize * out_along) as usize;
                    let from = (src_at + n * src_along) as usize;
                    std::ptr::copy(src.add(from * width), out.add(to * width), width);
                }
            }
        }
    }
}
