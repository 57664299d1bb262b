//! Printing of column kernels: row kernels along an axis that is not the last (a sum over the
//! batch axis, a softmax over axis 0), where a row's elements lie a stride apart and the rows
//! themselves are neighbours in memory. A block works on a group of [`COLUMNS`] rows
//! ("columns"): thread `cx` of each of the block's `ys` lines works on column `cx`, striding
//! along it from position `cy`, so the 32 threads of a warp read 32 neighbouring elements (whole
//! 128-byte lines) at each step. Each reduction combines a column's `ys` partial results in
//! shared memory (`reduce::column_reduction`); the phases are the CPU's, as in `rows.rs`, and
//! nothing is kept between them (each phase reads the column again, mostly from L2).
//!
//! When the groups are too few to fill the GPU (a [8192, 4096] sum over axis 0 has 128), each
//! column is also split into `segments` ([`segments`]): per live reduction, `partial<i>` runs a
//! block per (group, segment) and writes each column's partial result to scratch memory, and
//! `combine<i>` runs a thread per column, folding its segments' partial results in order (argmax
//! with their positions, so the first maximum still wins) into the reduction's value, also in
//! scratch, which later entries read; `finish` then runs a block per (group, segment) for the
//! per-element stores (and the per-row ones), or, when there are none per element, the last
//! `combine` makes the per-row stores itself. Scratch is laid out as in `split.rs`.
//!
//! Measured on an H200 for a sum over axis 0 of [8192, 4096] f32 (a standalone program of the
//! variants, CUDA events, one process): the earlier layout of 8 columns a block (each warp
//! reading four 32-byte sectors a step) 0.070 ms; 32 columns a block of 32 lines, the sweep
//! stepping by the constant 32 (so unrolled: eight loads in flight a thread), 0.036 ms (3.8 TB/s
//! read, the device's copy rate); 16 lines split in 4, 0.035 ms for the partial sums and 0.003
//! to combine them, a second launch; PyTorch's `x.sum(0)` 0.047 ms.
//!
//! Must never: depend on the block size beyond its being a power of two no larger than the
//! printed one (a block of fewer than [`COLUMNS`] threads walks its group's columns in turns,
//! and a combine's threads stride over the columns), let some threads of a block skip a barrier
//! (every thread runs every turn and every phase; threads past the last column only read a
//! valid column and store nothing), or combine segments in an order that depends on the launch.

use super::reduce::{column_reduction, column_reductions, combine_step, reduced_value};
use super::rows::RowPlan;
use super::split::Scratch;
use super::*;

/// Columns per group (a block's): the 32 threads of a warp's line read 32 neighbouring f32, a
/// whole 128-byte line.
pub const COLUMNS: usize = 32;

/// Threads per block printed (fewer where the reductions' shared arrays would not fit): 32
/// lines of 32 columns, declared to the compiler (`__launch_bounds__`), which then keeps a
/// thread within the registers a full block allows. Measured on an H200 for a [8192, 4096]
/// sum over axis 0 (128 blocks): 0.036 ms with the bound, 0.043 without; 16 lines, 0.069.
const COLUMN_THREADS: u32 = 1024;

/// Blocks a column kernel is spread over when its columns are long enough: one block of
/// [`COLUMN_THREADS`] (64 warps' worth of loads in flight, eight per thread) on about each of an
/// H100's or H200's 132 multiprocessors. G2-axis0's 128 groups need no split.
pub(super) const TARGET_BLOCKS: usize = 128;

/// Positions of a column per segment at least (16 per thread of a block's 32 lines).
const MIN_SEGMENT: usize = 512;

/// Threads per block of a `combine` entry (a thread per column).
const COMBINE_THREADS: u32 = 256;

/// Positions of a column each line's thread folds at least, when columns are short: a block
/// has no more lines than that leaves work for.
const LINE_POSITIONS: usize = 8;

/// Lines a block of a column kernel needs for columns of `len` positions: a power of two, at
/// most 32, with [`LINE_POSITIONS`] for each. A gradient summed over a batch of 8 (GPT-2's
/// position embedding: [8, 1024, 768] over axis 0) had 24 of a 32-line block's lines idle:
/// 0.25 ms on an H200 for 31 MB.
fn lines_for(len: usize) -> u32 {
    let lines = (len / LINE_POSITIONS).clamp(1, 32);
    1 << lines.ilog2()
}

/// Whether `p` is printed as a column kernel: along an axis before the last, with rows that are
/// neighbours along a last dimension of at least 8 (a 32-byte sector's worth of f32).
pub(super) fn columns(p: &RowPlan<'_>) -> bool {
    let rank = p.r.dims.len();
    p.r.axis.is_some_and(|a| a + 1 < rank) && p.r.dims[rank - 1] >= 8 && p.rows > 0
}

/// The segments each column of `p` is split into: enough blocks for [`TARGET_BLOCKS`] (or as
/// its options say), none shorter than [`MIN_SEGMENT`] positions.
pub(super) fn segments(p: &RowPlan<'_>) -> usize {
    let groups = p.rows.div_ceil(COLUMNS);
    (p.options.column_blocks / groups).clamp(1, (p.len / MIN_SEGMENT).max(1))
}

/// Prints `p` as column-kernel entries; returns them and the scratch bytes they need.
pub(super) fn print_columns(
    out: &mut String,
    p: &mut RowPlan<'_>,
    name: &str,
    params: &mut Vec<Param>,
) -> Result<(Vec<Entry>, usize), String> {
    // Each reduction's combine takes an entry per thread in shared memory.
    let per_thread: usize =
        p.reductions().iter().map(|&(_, op, _, d)| d.size() + if op == ReduceOp::ArgMax { 8 } else { 0 }).sum();
    let threads = [COLUMN_THREADS, 512, 256, 128, 64]
        .into_iter()
        .find(|&t| t as usize * per_thread <= STATIC_SHARED_BYTES)
        .unwrap_or(32)
        .min(COLUMNS as u32 * lines_for(p.len));
    p.step = "ys";
    // Eight loads in flight per thread: a column's thread folds a long chain of them. Only a
    // loop stepping by a constant is unrolled (a step known at run time left one load in
    // flight: 0.058 ms instead of 0.035 for G2-axis0's partial sums), so the sweeps also have
    // a copy for a block of the printed size, whose lines are known.
    p.unroll = 8;
    let lines = (threads as usize / COLUMNS).max(1);
    p.constant_step = Some((format!("ys == {lines}u"), format!("{lines}")));
    let segments = segments(p);
    let blocks = p.rows.div_ceil(COLUMNS) * segments;
    if blocks > i32::MAX as usize {
        return Err(format!("{} rows: more blocks than one launch has", p.rows));
    }
    let dims = p.r.dims.as_slice();
    let (axis, len) = (p.r.axis.unwrap_or(0), p.len);
    let _ = writeln!(
        out,
        "\n// Columns: rows of {dims:?} along dim {axis} ({len} elements each), {COLUMNS} neighbouring rows a block, \
         in {segments} segment(s)."
    );
    if segments == 1 {
        let _ = writeln!(out, "{} {{", bounded(signature(name, params), threads));
        turns(out, p, 1);
        let range = ["from", "end"];
        let plan = &*p;
        plan.per_row_values(out, plan.r.expr.nodes.len(), &mut |out, i, op, x, d| {
            column_reduction(out, i, op, x, d, [len, threads as usize], &|out, body| {
                plan.sweep(out, range, &[x], &[], body, None)
            })
        })?;
        plan.print_stores(out, "active && cy == 0", range, None)?;
        out.push_str("  }\n}\n");
        return Ok((vec![Entry { name: name.into(), launch: Launch::Rows { rows: blocks, threads } }], 0));
    }
    print_split(out, p, name, params, [segments, threads as usize])
}

/// `signature` declared to run blocks of at most `threads` threads.
fn bounded(signature: String, threads: u32) -> String {
    signature.replacen("__global__ void", &format!("__global__ void __launch_bounds__({threads})"), 1)
}

/// Opens the loop of a block's turns over its group's columns (`xw` at a time) and declares
/// what a turn works on: `row` (its thread's column, or the last valid one), `active`, the
/// index variables across rows, and `from`/`end`, its thread's first position and the end of
/// its segment (`from` past the end for an inactive thread). The caller closes the loop.
fn turns(out: &mut String, p: &RowPlan<'_>, segments: usize) {
    let (rows, len) = (p.rows, p.len);
    let seg_len = len.div_ceil(segments);
    let _ = writeln!(out, "  const unsigned xw = blockDim.x < {COLUMNS}u ? blockDim.x : {COLUMNS}u;");
    out.push_str("  const unsigned cx = threadIdx.x % xw, cy = threadIdx.x / xw, ys = blockDim.x / xw;\n");
    let _ = writeln!(out, "  const long long group = blockIdx.x / {segments}, seg = blockIdx.x % {segments};");
    // Positions in the sweeps' type (`int` where the column allows): a loop comparing an `int`
    // position with a `long long` end was not unrolled.
    let ty = if len <= i32::MAX as usize { "int" } else { "long long" };
    let _ = writeln!(out, "  const {ty} start = ({ty})seg * {seg_len};");
    let _ = writeln!(out, "  const {ty} end = start + {seg_len} < {len} ? start + {seg_len} : {len};");
    let _ = writeln!(
        out,
        "  for (long long c0 = group * {COLUMNS}LL; c0 < group * {COLUMNS}LL + {COLUMNS}LL && c0 < {rows}LL; c0 += xw) {{"
    );
    let _ = writeln!(out, "  const bool active = c0 + cx < {rows}LL;");
    let _ = writeln!(out, "  const long long row = active ? c0 + cx : {}LL;", rows - 1);
    p.position(out, "row");
    let _ = writeln!(out, "  const {ty} from = active ? start + ({ty})cy : end;");
}

/// Prints the entries of a column kernel split into `segments` (see the module docs). The
/// reductions that read no reduction's value fold in one `partial` pass and one `combine`
/// (a column read once for all of them), with the per-element stores that read none either;
/// each later reduction takes a pass and a combine of its own, and `finish` writes the
/// per-element stores that read reductions. A layer norm's weight and bias gradients with
/// their per-element products (GPT-2's backward, [8192, 768]): one pass instead of three.
fn print_split(
    out: &mut String,
    p: &RowPlan<'_>,
    name: &str,
    params: &mut Vec<Param>,
    [segments, threads]: [usize; 2],
) -> Result<(Vec<Entry>, usize), String> {
    let (rows, len) = (p.rows, p.len);
    let nodes = &p.r.expr.nodes;
    let blocks = rows.div_ceil(COLUMNS) * segments;
    let reductions = p.reductions();
    let scratch = Scratch::new(p, segments, params);
    let after = crate::row_passes::after_reductions(&p.r.expr);
    // The reductions' values before node `upto`: from scratch once `done` holds them (0 before:
    // nothing that runs reads those), and the per-row values.
    let row_values = |out: &mut String, upto: usize, done: &dyn Fn(usize) -> bool| {
        p.per_row_values(out, upto, &mut |_, i, _, _, _| {
            Ok(if done(i) { format!("{}[row]", scratch.results(i, nodes[i].dtype)) } else { "0".into() })
        })
    };
    let (_, elem_stores) = p.stores();
    let free = |s: &Store| !after[s.value as usize];
    let late_stores = elem_stores.iter().any(|s| !free(s));
    let (first, later): (Vec<_>, Vec<_>) = reductions.iter().copied().partition(|&(_, _, x, _)| !after[x]);
    let first_stores = !first.is_empty() && elem_stores.iter().any(|s| free(s));
    let mut passes: Vec<Vec<(usize, ReduceOp, usize, DType)>> = vec![];
    if !first.is_empty() {
        passes.push(first);
    }
    passes.extend(later.into_iter().map(|r| vec![r]));
    let combine_blocks = rows.div_ceil(COMBINE_THREADS as usize);
    let mut entries = vec![];
    let mut entry = |out: &mut String, entry: &str, launch: Launch, comment: String| {
        let name = format!("{name}_{entry}");
        let Launch::Rows { threads, .. } = launch else { unreachable!("column entries launch blocks") };
        let _ = writeln!(out, "\n// {comment}\n{} {{", bounded(signature(&name, params), threads));
        entries.push(Entry { name, launch });
    };
    let range = ["from", "end"];
    let mut done: Vec<usize> = vec![];
    for (k, pass) in passes.iter().enumerate() {
        let ids: Vec<String> = pass.iter().map(|&(i, ..)| i.to_string()).collect();
        let (label, with_stores) = (ids.join("_"), k == 0 && first_stores);
        let launch = Launch::Rows { rows: blocks, threads: threads as u32 };
        let what = if with_stores { " and the stores that read none" } else { "" };
        let comment = format!("Reductions v{}{what}, pass 1: a block per group and segment.", ids.join(", v"));
        entry(out, &format!("partial{label}"), launch, comment);
        turns(out, p, segments);
        let stores: Vec<&Store> = elem_stores.iter().copied().filter(|s| with_stores && free(s)).collect();
        let roots: Vec<usize> =
            (pass.iter().map(|&(_, _, x, _)| x)).chain(stores.iter().map(|s| s.value as usize)).collect();
        // The per-row values the sweep reads: those before the pass's last reduction, and
        // those before the last value it stores (a constant recorded after the reduction, as
        // a derivative's `2`); a reduction among them that has not run reads as 0, and
        // nothing this pass computes reads it (the stores here read none).
        let upto = (pass.iter().map(|&(i, ..)| i).max().unwrap_or(0))
            .max(stores.iter().map(|s| s.value as usize + 1).max().unwrap_or(0));
        row_values(out, upto, &|i| done.contains(&i))?;
        // Every thread of a column holds its segment's results (a mean's sum, undivided).
        column_reductions(out, pass, [len, threads], &|out, body| p.sweep(out, range, &roots, &stores, body, None))?;
        let _ = writeln!(out, "  if (active && cy == 0) {{");
        for &(i, op, _, d) in pass {
            let _ = writeln!(out, "    {}[row * {segments} + seg] = acc{i};", scratch.partials(i, d));
            if op == ReduceOp::ArgMax {
                let _ = writeln!(out, "    {}[row * {segments} + seg] = arg{i};", scratch.positions(i));
            }
        }
        out.push_str("  }\n  }\n}\n");
        // Pass 2: each column's values from their partials, in segment order.
        let launch = Launch::Rows { rows: combine_blocks, threads: COMBINE_THREADS };
        let comment = format!(
            "Reductions v{}, pass 2: each column's {segments} partial results, a thread per column.",
            ids.join(", v")
        );
        entry(out, &format!("combine{label}"), launch, comment);
        out.push_str("  const long long stride = (long long)gridDim.x * blockDim.x;\n");
        let _ = writeln!(
            out,
            "  for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < {rows}LL; row += stride) {{"
        );
        for &(i, op, _, d) in pass {
            combine_partials(out, &scratch, (i, op, d), [segments, len], nodes[i].dtype)?;
            done.push(i);
        }
        if k + 1 == passes.len() && !late_stores {
            // No per-element stores left: the per-row ones here, with every reduction done.
            p.position(out, "row");
            row_values(out, nodes.len(), &|_| true)?;
            p.print_stores_of(out, "true", range, None, &|_| false)?;
        }
        out.push_str("  }\n}\n");
    }
    if late_stores || reductions.is_empty() {
        let launch = Launch::Rows { rows: blocks, threads: threads as u32 };
        entry(out, "finish", launch, "The outputs: a block per group and segment.".into());
        turns(out, p, segments);
        row_values(out, nodes.len(), &|_| true)?;
        let elem = |s: &Store| !first_stores || !free(s);
        p.print_stores_of(out, "active && cy == 0 && seg == 0", range, None, &elem)?;
        out.push_str("  }\n}\n");
    }
    Ok((entries, scratch.bytes))
}

/// Prints, in a combine's thread of column `row`, reduction `i`'s value from its `segments`
/// partial results: the first as it is, then the others in segment order, as a block's combine
/// folds its lines' partial results; stored to scratch for later entries.
fn combine_partials(
    out: &mut String,
    scratch: &Scratch,
    (i, op, d): (usize, ReduceOp, DType),
    [segments, len]: [usize; 2],
    value_dtype: DType,
) -> Result<(), String> {
    let arg = op == ReduceOp::ArgMax;
    let _ = writeln!(out, "  {{\n  {} acc{i} = {}[row * {segments}];", ctype(d), scratch.partials(i, d));
    if arg {
        let _ = writeln!(out, "  long long arg{i} = {}[row * {segments}];", scratch.positions(i));
    }
    let _ = writeln!(out, "  for (int k = 1; k < {segments}; ++k) {{");
    let _ = writeln!(out, "    const {} b = {}[row * {segments} + k];", ctype(d), scratch.partials(i, d));
    if arg {
        let _ = writeln!(out, "    const long long ib = {}[row * {segments} + k];", scratch.positions(i));
    }
    let _ = writeln!(out, "    {}\n  }}", combine_step(i, op, d)?);
    let _ = writeln!(out, "  {}[row] = {};\n  }}", scratch.results(i, value_dtype), reduced_value(i, op, d, len));
    Ok(())
}
