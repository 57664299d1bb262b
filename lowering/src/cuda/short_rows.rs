//! Short rows: a row kernel whose rows take few threads (attention's `rowsum(d_out * out)` over
//! rows of 64 bf16: eight 16-byte chunks) runs several rows a block, a segment of `lanes`
//! neighbouring lanes of a warp a row, instead of a block a row. A block a row would run 32
//! threads of which 24 idle, one row per block (98,304 blocks of one warp for GPT-2's attention
//! backward); here a block of [`SHORT_ROW_THREADS`] threads folds `blockDim.x / lanes` rows at
//! once and combines each row by shuffles within its segment (`reduce::segment_reduction`): no
//! shared memory, no barrier.
//!
//! Blocks walk the rows in turns (`first` steps by the grid's rows), so any grid and any
//! power-of-two block up to the printed one computes every row (a block smaller than `lanes`
//! gives each row the whole block). Every lane of a warp runs every turn and every shuffle:
//! a lane past the last row reads that last row's per-row values only (its sweeps are empty,
//! `end` is 0) and stores nothing.
//!
//! Must never: keep values in shared memory (a block holds several rows), let a lane past the
//! last row load a row's elements or store anything, or let only some lanes of a warp reach a
//! shuffle.

use super::reduce::segment_reduction;
use super::row_vector::plan_vector;
use super::rows::RowPlan;
use super::*;

/// Threads per block printed: eight warps.
pub const SHORT_ROW_THREADS: u32 = 256;

/// Rows that a segment of at most this many lanes covers (a thread a chunk, or a position
/// where there is no vector path) are short; longer ones keep a block a row, whose 32 threads
/// or more are all busy.
const MAX_LANES: usize = 16;

/// Rows below this many keep a block a row: the GPU holds all their blocks at once (an H100 or
/// H200 holds 32 blocks on each of 132 multiprocessors), so sharing blocks would not put more
/// rows in flight.
const MIN_ROWS: usize = 1024;

/// Prints `p` as a short-row kernel and returns its entry, or `None` (leaving `p` as it was)
/// when its rows are not short (more than [`MAX_LANES`] lanes' worth) or not many (fewer than
/// [`MIN_ROWS`]).
pub(super) fn print_short_rows(
    out: &mut String,
    p: &mut RowPlan<'_>,
    name: &str,
    params: &[Param],
) -> Result<Option<(Vec<Entry>, usize)>, String> {
    if p.rows < MIN_ROWS || p.len == 0 {
        return Ok(None);
    }
    // Nothing is kept (a block holds several rows), and rows that start at other alignments
    // take the scalar path (a peel's head and tail would not be empty past the last row).
    let vector = plan_vector(p, &vec![false; p.r.expr.nodes.len()]);
    let lanes = p.len.div_ceil(vector.as_ref().map_or(1, |v| v.width)).next_power_of_two();
    if lanes > MAX_LANES {
        return Ok(None);
    }
    let blocks = p.rows.div_ceil(SHORT_ROW_THREADS as usize / lanes);
    if blocks > i32::MAX as usize {
        return Err(format!("{} rows: more blocks than one launch has", p.rows));
    }
    (p.vector, p.peel, p.lane, p.step) = (vector, None, "lane", "lanes");
    let (r, len, rows, ty) = (p.r, p.len, p.rows, p.position_type());
    let dims = r.dims.as_slice();
    let axis = r.axis.map_or("all dims".to_string(), |a| format!("dim {a}"));
    let _ = writeln!(out, "\n// Short rows of {dims:?} along {axis} ({len} elements): {lanes} lanes a row.");
    let _ = writeln!(out, "{} {{", signature(name, params));
    let _ = writeln!(out, "  const unsigned lanes = blockDim.x < {lanes}u ? blockDim.x : {lanes}u;");
    out.push_str("  const unsigned mask = blockDim.x >= 32u ? 0xffffffffu : (1u << blockDim.x) - 1u;\n");
    let _ = writeln!(out, "  const {ty} lane = ({ty})(threadIdx.x % lanes);");
    out.push_str("  const long long per_block = blockDim.x / lanes;\n");
    let _ = writeln!(
        out,
        "  for (long long first = (long long)blockIdx.x * per_block; first < {rows}LL; first += (long long)gridDim.x * per_block) {{"
    );
    out.push_str("  const long long mine = first + threadIdx.x / lanes;\n");
    let _ = writeln!(out, "  const bool active = mine < {rows}LL;");
    let _ = writeln!(out, "  const long long row = active ? mine : {}LL;", rows - 1);
    let _ = writeln!(out, "  const {ty} end = active ? ({ty}){len} : ({ty})0;");
    p.position(out, "row");
    p.declare_vector_path(out);
    let plan = &*p;
    let whole = ["lane", "end"];
    plan.per_row_values(out, r.expr.nodes.len(), &mut |out, i, op, x, d| {
        segment_reduction(out, i, op, x, d, len, &|out, body| plan.sweep(out, whole, &[x], &[], body, None))
    })?;
    plan.print_stores(out, "active && lane == 0", whole, None)?;
    out.push_str("  }\n}\n");
    let launch = Launch::Rows { rows: blocks, threads: SHORT_ROW_THREADS };
    Ok(Some((vec![Entry { name: name.into(), launch }], 0)))
}
