//! Printing of column kernels: row kernels along an axis that is not the last (a sum over the
//! batch axis, a softmax over axis 0), where a row's elements lie a stride apart and the rows
//! themselves are neighbours in memory. One block per group of [`COLUMNS`] rows ("columns"):
//! thread `cx` of each of the block's `ys` lines works on column `cx`, striding along it from
//! position `cy`, so the threads of a warp read neighbouring addresses (whole 32-byte sectors)
//! instead of one element per sector each. Each reduction combines a column's `ys` partial
//! results in shared memory (`reduce::column_reduction`); the phases are the CPU's, as in
//! `rows.rs`, and nothing is kept between them (each phase reads the column again, mostly
//! from L2).
//!
//! Must never: depend on the block size beyond its being a power of two no larger than the
//! printed one (a block of fewer than [`COLUMNS`] threads walks the group's columns in
//! turns), or let some threads of a block skip a barrier (every thread runs every group and
//! every phase; threads past the last row only read a valid row and store nothing).

use super::reduce::column_reduction;
use super::rows::RowPlan;
use super::*;

/// Rows (columns) per block: 8 f32 of neighbouring rows fill a 32-byte sector.
pub const COLUMNS: usize = 8;

/// Threads per block printed (fewer where the reductions' shared arrays would not fit): 64
/// lines of 8 columns. Measured on the H200 for a sum over axis 0 of [8192, 4096] f32: 256
/// threads 0.130 ms, 512 0.079 ms, 1024 0.088 ms (each thread's fold is a chain of dependent
/// loads; more lines shorten it, until blocks no longer fill the SMs).
const COLUMN_THREADS: u32 = 512;

/// Whether `p` is printed as a column kernel: along an axis before the last, with rows that are
/// neighbours along a last dimension of at least [`COLUMNS`].
pub(super) fn columns(p: &RowPlan<'_>) -> bool {
    let rank = p.r.dims.len();
    p.r.axis.is_some_and(|a| a + 1 < rank) && p.r.dims[rank - 1] >= COLUMNS && p.rows > 0
}

/// Prints `p` as one column-kernel entry; returns it (no scratch memory).
pub(super) fn print_columns(
    out: &mut String,
    p: &mut RowPlan<'_>,
    name: &str,
    params: &[Param],
) -> Result<(Vec<Entry>, usize), String> {
    // Each reduction's combine takes an entry per thread in shared memory.
    let per_thread: usize =
        p.reductions().iter().map(|&(_, op, _, d)| d.size() + if op == ReduceOp::ArgMax { 8 } else { 0 }).sum();
    let threads = [COLUMN_THREADS, 256, 128, 64]
        .into_iter()
        .find(|&t| t as usize * per_thread <= STATIC_SHARED_BYTES)
        .unwrap_or(32);
    let (len, rows) = (p.len, p.rows);
    let groups = rows.div_ceil(COLUMNS);
    if groups > i32::MAX as usize {
        return Err(format!("{rows} rows: more blocks than one launch has"));
    }
    p.step = "ys";
    let dims = p.r.dims.as_slice();
    let axis = p.r.axis.unwrap_or(0);
    let _ = writeln!(
        out,
        "\n// Columns: rows of {dims:?} along dim {axis} ({len} elements each), {COLUMNS} neighbouring rows a block."
    );
    let _ = writeln!(out, "{} {{", signature(name, params));
    let _ = writeln!(out, "  const unsigned xw = blockDim.x < {COLUMNS}u ? blockDim.x : {COLUMNS}u;");
    out.push_str("  const unsigned cx = threadIdx.x % xw, cy = threadIdx.x / xw, ys = blockDim.x / xw;\n");
    let _ = writeln!(out, "  for (long long g = blockIdx.x; g * xw < {rows}LL; g += gridDim.x) {{");
    let _ = writeln!(out, "  const bool active = g * xw + cx < {rows}LL;");
    let _ = writeln!(out, "  const long long row = active ? g * xw + cx : {}LL;", rows - 1);
    p.position(out, "row");
    let _ = writeln!(out, "  const long long from = active ? (long long)cy : {len}LL;");
    let end = format!("{len}LL");
    let range = ["from", end.as_str()];
    let plan = &*p;
    plan.per_row_values(out, plan.r.expr.nodes.len(), &mut |out, i, op, x, d| {
        column_reduction(out, i, op, x, d, [len, threads as usize], &|out, body| {
            plan.sweep(out, range, &[x], &[], body, None)
        })
    })?;
    plan.print_stores(out, "active && cy == 0", range, None)?;
    out.push_str("  }\n}\n");
    Ok((vec![Entry { name: name.into(), launch: Launch::Rows { rows: groups, threads } }], 0))
}
