//! Row kernels whose rows are split into segments: long rows among too few rows to fill the
//! GPU (a whole-tensor reduction, the column sums of a tall matrix), which one block per row
//! would leave to a few multiprocessors.
//!
//! Per live reduction, in order: `partial<i>` runs one block per (row, segment) and folds the
//! segment (float sums compensated per thread, as in one block) into a partial result in
//! scratch memory; `combine<i>` runs one block per row, folds the row's partials (argmax with
//! their positions, so the first maximum still wins) and writes the reduction's value to
//! scratch. Later entries read those values and recompute the per-row values they feed. A last
//! entry, `finish`, runs one block per (row, segment) again: one thread writes the per-row
//! stores, every block its segment's per-element stores.
//!
//! Scratch is the last parameter, bytes: per reduction, the partial values, the partial argmax
//! positions, and the row values, each region aligned to 8 bytes. No entry reads a byte an
//! earlier entry did not write, so the caller may hand over any memory. Must never: keep loads
//! in shared memory (each entry reads its segment once per phase it needs), or rely on the
//! order in which blocks of one entry run.

use super::reduce::reduction;
use super::rows::RowPlan;
use super::*;

/// Elements per segment of a split row.
pub const SEGMENT: usize = 4096;
/// Rows below which rows of at least two segments are split (an H100 has 132 multiprocessors).
pub const SPLIT_BELOW_ROWS: usize = 128;

/// Whether `p` is printed split.
pub(super) fn splits(p: &RowPlan<'_>) -> bool {
    p.rows < SPLIT_BELOW_ROWS && p.len >= 2 * SEGMENT
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
    let segments = len.div_ceil(SEGMENT);
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
    for (i, op, x, d) in p.reductions() {
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
        let value = reduction(out, i, op, x, d, [len, threads as usize], &|out, body| {
            let _ = writeln!(out, "  for (long long k = threadIdx.x; k < {segments}LL; k += blockDim.x) {{");
            let _ = writeln!(out, "    const {} v{x} = {}[row * {segments} + k];", ctype(d), scratch.partials(i, d));
            if arg {
                let _ = writeln!(out, "    const long long t = {}[row * {segments} + k];", scratch.positions(i));
            }
            let _ = writeln!(out, "{body}  }}");
            Ok(())
        })?;
        let _ = writeln!(out, "  if (threadIdx.x == 0) {}[row] = {value};\n}}", scratch.results(i, nodes[i].dtype));
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
