//! Row kernels whose rows are split into segments: long rows among too few rows to fill the
//! GPU (a whole-tensor reduction, the column sums of a tall matrix), which one block per row
//! would leave to a few multiprocessors.
//!
//! First the reductions that read no reduction's value, when there are two or more (the
//! kernel's first pass, `first_pass.rs`: a gradient norm's sums of squares of several tensors):
//! `partial` runs one block per (row, segment) and folds the segment into a partial result of
//! each of them (float sums compensated per thread, as in one block) in scratch memory;
//! `combine` runs one block per row, folds the row's partials of each (argmax with their
//! positions, so the first maximum still wins) and writes their values to scratch. Then per
//! later live reduction, in order, `partial<i>` and `combine<i>` do the same for it alone,
//! reading the values before it and recomputing the per-row values they feed. A last
//! entry, `finish`, runs one block per (row, segment) again: one thread writes the per-row
//! stores, every block its segment's per-element stores.
//!
//! Scratch is the last parameter, bytes: per reduction, the partial values, the partial argmax
//! positions, and the row values, each region aligned to 8 bytes. No entry reads a byte an
//! earlier entry did not write, so the caller may hand over any memory. Must never: keep loads
//! in shared memory (each entry reads its segment once per phase it needs), or rely on the
//! order in which blocks of one entry run.

use super::first_pass::Reduction;
use super::reduce::{reduction, reductions};
use super::rows::RowPlan;
use super::*;

/// Elements per segment of a split row.
pub const SEGMENT: usize = 4096;
/// Rows below which rows of at least two segments are split (an H100 has 132 multiprocessors).
pub const SPLIT_BELOW_ROWS: usize = 128;

/// Whether `p` is printed split (segments of [`SEGMENT`] elements, or as its options say).
pub(super) fn splits(p: &RowPlan<'_>) -> bool {
    p.rows < SPLIT_BELOW_ROWS && p.len >= 2 * p.options.segment
}

/// Where a split kernel's reductions keep their values in scratch memory, its last parameter
/// (bytes): per live reduction, the partial value of each (row, segment), their argmax
/// positions, and each row's value, each region aligned to 8 bytes. Shared with the split
/// column kernels (`columns.rs`).
pub(super) struct Scratch {
    /// Per node: the byte offsets of a reduction's (partials, positions, results).
    slots: Vec<Option<(usize, usize, usize)>>,
    /// Its parameter (`a<param>`).
    param: usize,
    pub bytes: usize,
}

impl Scratch {
    /// Lays out the scratch of `p` split into `segments` per row, and adds its parameter.
    pub(super) fn new(p: &RowPlan<'_>, segments: usize, params: &mut Vec<Param>) -> Scratch {
        let nodes = &p.r.expr.nodes;
        let mut slots = vec![None; nodes.len()];
        let mut bytes = 0;
        let mut region = |n: usize| {
            let at = bytes;
            bytes += n.div_ceil(8) * 8;
            at
        };
        for (i, op, _, d) in p.reductions() {
            let partials = region(p.rows * segments * d.size());
            let positions = if op == ReduceOp::ArgMax { region(p.rows * segments * 8) } else { 0 };
            slots[i] = Some((partials, positions, region(p.rows * nodes[i].dtype.size())));
        }
        params.push(Param { dtype: DType::U8, len: bytes, writable: true });
        Scratch { slots, param: params.len() - 1, bytes }
    }

    /// A typed view of the region at byte `offset`.
    fn view(&self, d: DType, offset: usize) -> String {
        format!("(({}*)(a{} + {offset}))", ctype(d), self.param)
    }

    fn slot(&self, i: usize) -> (usize, usize, usize) {
        self.slots[i].expect("a live reduction")
    }

    /// Reduction `i`'s partial values (of its operand's dtype `d`), by (row, segment).
    pub(super) fn partials(&self, i: usize, d: DType) -> String {
        self.view(d, self.slot(i).0)
    }

    /// Reduction `i`'s partial argmax positions, by (row, segment).
    pub(super) fn positions(&self, i: usize) -> String {
        self.view(DType::I64, self.slot(i).1)
    }

    /// Reduction `i`'s values (of its dtype `d`), by row.
    pub(super) fn results(&self, i: usize, d: DType) -> String {
        self.view(d, self.slot(i).2)
    }
}

pub(super) fn print_split(
    out: &mut String,
    p: &RowPlan<'_>,
    name: &str,
    params: &mut Vec<Param>,
) -> Result<(Vec<Entry>, usize), String> {
    let (rows, len, threads) = (p.rows, p.len, p.threads);
    let segments = len.div_ceil(p.options.segment);
    let seg_len = len.div_ceil(segments);
    let blocks = rows * segments;
    let nodes = &p.r.expr.nodes;
    let scratch = Scratch::new(p, segments, params);
    // The reductions' values before node `upto` from scratch, and the per-row values.
    let row_values = |out: &mut String, upto: usize| {
        p.per_row_values(out, upto, &mut |_, i, _, _, _| Ok(format!("{}[row]", scratch.results(i, nodes[i].dtype))))
    };
    let segment = |out: &mut String| {
        let _ = writeln!(out, "  const long long row = blockIdx.x / {segments};");
        let _ = writeln!(out, "  const long long seg = blockIdx.x % {segments};");
        p.position(out, "row");
    };
    // A segment's positions: from `seg * seg_len` to `end`.
    let from = format!("seg * {seg_len}LL + threadIdx.x");
    let range = [from.as_str(), "end"];
    let end = format!(
        "  const long long end = seg * {seg_len}LL + {seg_len}LL < {len}LL ? seg * {seg_len}LL + {seg_len}LL : {len}LL;"
    );
    let mut entries = vec![];
    let mut entry = |out: &mut String, entry: &str, grid: usize, comment: String| {
        let name = format!("{name}_{entry}");
        let _ = writeln!(out, "\n// {comment}\n{} {{", signature(&name, params));
        if grid > i32::MAX as usize {
            return Err(format!("{grid} blocks: more than one launch has"));
        }
        entries.push(Entry { name, launch: Launch::Rows { rows: grid, threads } });
        Ok(())
    };
    // The reductions that read none (a gradient norm's sums of squares of several tensors):
    // one pass for all of their partial results, one for all of their values.
    let first = p.first_pass();
    if !first.is_empty() {
        let names: Vec<String> = first.iter().map(|&(i, ..)| format!("v{i}")).collect();
        let names = names.join(", ");
        let comment = format!("Reductions {names}, pass 1: {segments} segments of {seg_len} per row, a block each.");
        entry(out, "partial", blocks, comment)?;
        segment(out);
        p.per_row_values_before_first_pass(out)?;
        let _ = writeln!(out, "{end}");
        let roots: Vec<usize> = first.iter().map(|&(_, _, x, _)| x).collect();
        reductions(out, &first, [len, threads as usize], &|out, body| p.sweep(out, range, &roots, &[], body, None))?;
        let _ = writeln!(out, "  if (threadIdx.x == 0) {{");
        for &(i, op, _, d) in &first {
            let _ = writeln!(out, "    {}[blockIdx.x] = acc{i};", scratch.partials(i, d));
            if op == ReduceOp::ArgMax {
                let _ = writeln!(out, "    {}[blockIdx.x] = arg{i};", scratch.positions(i));
            }
        }
        let _ = writeln!(out, "  }}\n}}");
        let comment = format!("Reductions {names}, pass 2: each row's {segments} partial results, a block per row.");
        entry(out, "combine", rows, comment)?;
        let _ = writeln!(out, "  const long long row = blockIdx.x;");
        for &(i, op, x, d) in &first {
            combine_partials(out, &scratch, (i, op, x, d), [len, segments, threads as usize])?;
        }
        out.push_str("}\n");
    }
    for (i, op, x, d) in p.reductions().into_iter().filter(|r| !first.contains(r)) {
        let arg = op == ReduceOp::ArgMax;
        // Pass 1: each segment's partial result.
        let comment = format!("Reduction v{i}, pass 1: {segments} segments of {seg_len} per row, a block each.");
        entry(out, &format!("partial{i}"), blocks, comment)?;
        segment(out);
        row_values(out, i)?;
        let _ = writeln!(out, "{end}");
        reduction(out, i, op, x, d, [len, threads as usize], &|out, body| p.sweep(out, range, &[x], &[], body, None))?;
        let _ = writeln!(out, "  if (threadIdx.x == 0) {{");
        // Every thread holds the segment's result (a mean's sum, undivided) after `reduction`.
        let _ = writeln!(out, "    {}[blockIdx.x] = acc{i};", scratch.partials(i, d));
        if arg {
            let _ = writeln!(out, "    {}[blockIdx.x] = arg{i};", scratch.positions(i));
        }
        let _ = writeln!(out, "  }}\n}}");
        // Pass 2: the row's value from its partials (their positions stand for `t`).
        let comment = format!("Reduction v{i}, pass 2: each row's {segments} partial results, a block per row.");
        entry(out, &format!("combine{i}"), rows, comment)?;
        let _ = writeln!(out, "  const long long row = blockIdx.x;");
        combine_partials(out, &scratch, (i, op, x, d), [len, segments, threads as usize])?;
        out.push_str("}\n");
    }
    // The outputs.
    let comment = format!("The outputs: {segments} segments of {seg_len} per row, a block each.");
    entry(out, "finish", blocks, comment)?;
    segment(out);
    row_values(out, nodes.len())?;
    let _ = writeln!(out, "{end}");
    p.print_stores(out, "seg == 0 && threadIdx.x == 0", range, None)?;
    out.push_str("}\n");
    Ok((entries, scratch.bytes))
}

/// Prints the fold of reduction `i`'s partial results of row `row` (their positions stand for
/// `t`) into its value in scratch, by the block: pass 2 of a split row.
fn combine_partials(
    out: &mut String,
    scratch: &Scratch,
    (i, op, x, d): Reduction,
    [len, segments, threads]: [usize; 3],
) -> Result<(), String> {
    let value = reduction(out, i, op, x, d, [len, threads], &|out, body| {
        let _ = writeln!(out, "  for (long long k = threadIdx.x; k < {segments}LL; k += blockDim.x) {{");
        let _ = writeln!(out, "    const {} v{x} = {}[row * {segments} + k];", ctype(d), scratch.partials(i, d));
        if op == ReduceOp::ArgMax {
            let _ = writeln!(out, "    const long long t = {}[row * {segments} + k];", scratch.positions(i));
        }
        let _ = writeln!(out, "{body}  }}");
        Ok(())
    })?;
    let dtype = if op == ReduceOp::ArgMax { DType::I64 } else { d };
    let _ = writeln!(out, "  if (threadIdx.x == 0) {}[row] = {value};", scratch.results(i, dtype));
    Ok(())
}
