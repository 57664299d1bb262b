//! Row kernels whose rows are split into segments: for rows too long for one workgroup among
//! too few rows to fill the GPU (a whole-tensor reduction, the column sums of a tall matrix).
//!
//! Per reduction, in order: `partial{i}` runs one workgroup per (row, segment) and folds the
//! segment into a partial result in scratch memory; `combine{i}` runs one workgroup per row,
//! combines the row's partials in a tree and writes the reduction's value to scratch. Per-row
//! values that later phases read are recomputed from those values wherever needed. A last
//! entry, `finish`, runs one workgroup per (row, segment) again: one thread writes the per-row
//! stores, every workgroup its segment's per-element stores.
//!
//! Scratch is one `array<u32>` binding: per reduction, the partial values (two words for an
//! i64), the partial argmax positions, and the row results. Nothing reads a word before an
//! earlier entry wrote it, so the caller may hand over any memory.

use super::rows::{self, RowPlan, SEGMENT};
use super::*;
use braid_graph::ReduceOp;

/// Where one reduction keeps its words in scratch.
struct Slots {
    node: usize,
    op: ReduceOp,
    operand: usize,
    dtype: DType,
    partials: u64,
    positions: u64,
    results: u64,
}

/// Words per value of dtype `d` in scratch.
fn width(d: DType) -> u64 {
    if d == DType::I64 { 2 } else { 1 }
}

/// The scratch words of register `v` (of `d`).
fn to_words(d: DType, v: &str) -> Vec<String> {
    match d {
        DType::F32 | DType::I32 => vec![format!("bitcast<u32>({v})")],
        DType::I64 => vec![format!("{v}.x"), format!("{v}.y")],
        _ => vec![v.to_string()],
    }
}

/// The register of dtype `d` held at word `at` (a u32 expression) of scratch binding `b`.
fn from_words(d: DType, b: usize, at: &str) -> String {
    match d {
        DType::F32 => format!("bitcast<f32>(a{b}[{at}])"),
        DType::I32 => format!("bitcast<i32>(a{b}[{at}])"),
        DType::I64 => format!("vec2<u32>(a{b}[{at}], a{b}[({at}) + 1u])"),
        _ => format!("a{b}[{at}]"),
    }
}

pub(super) fn print_split(m: &mut Module<'_>, p: &RowPlan<'_>) -> Result<(), String> {
    let segments = p.len.div_ceil(SEGMENT);
    let seg_len = p.len.div_ceil(segments);
    let (rows, threads) = (p.rows as u64, rows::MAX_ROW_THREADS);
    let scratch = m.params.len() + m.words.len();
    let written = m.written();
    let mut slots = vec![];
    let mut words = 0u64;
    for (node, op, operand, dtype) in p.reductions() {
        let w = width(dtype);
        let partials = words;
        words += rows * segments as u64 * w;
        let positions = words;
        if op == ReduceOp::ArgMax {
            words += rows * segments as u64;
        }
        let results = words;
        words += rows * if op == ReduceOp::ArgMax { 1 } else { w };
        slots.push(Slots { node, op, operand, dtype, partials, positions, results });
    }
    m.words.push(words);
    let nodes = &p.r.expr.nodes;
    // The value of every reduction before node `upto`, read from scratch, then the per-row
    // values they feed.
    let row_values = |out: &mut String, upto: usize| -> Result<(), String> {
        let mut printed = vec![false; nodes.len()];
        for s in slots.iter().filter(|s| s.node < upto) {
            let value = match s.op {
                ReduceOp::ArgMax => format!("vec2<u32>(a{scratch}[{}u + row], 0u)", s.results),
                _ => from_words(s.dtype, scratch, &format!("{}u + row * {}u", s.results, width(s.dtype))),
            };
            let _ = writeln!(out, "  let v{}: {} = {value};", s.node, scalar::reg_type(nodes[s.node].dtype)?);
            printed[s.node] = true;
        }
        p.per_row_values(out, &written, upto, &mut printed)
    };
    let segment_range = [format!("seg * {seg_len}u"), format!("min(seg * {seg_len}u + {seg_len}u, {}u)", p.len)];
    let segment_range = [segment_range[0].as_str(), segment_range[1].as_str()];
    let mut shared = String::new();
    let mut bodies = String::new();
    for s in &slots {
        let (i, d) = (s.node, s.dtype);
        rows::declare_shared(&mut shared, i, s.op, d, threads)?;
        // Partial results of each segment.
        let mut out = String::new();
        let groups = rows * segments as u64;
        let _ = writeln!(out, "  let row = wg / {segments}u;\n  let seg = wg % {segments}u;");
        p.decompose_position(&mut out, "row");
        row_values(&mut out, i)?;
        rows::fold(&mut out, p, &written, i, s.op, s.operand, d, segment_range, threads)?;
        rows::tree(&mut out, i, s.op, d, threads)?;
        let _ = writeln!(out, "  if (lid == 0u) {{");
        for (k, w) in to_words(d, &format!("red{i}[0]")).iter().enumerate() {
            let _ = writeln!(out, "    a{scratch}[{}u + wg * {}u + {k}u] = {w};", s.partials, width(d));
        }
        if s.op == ReduceOp::ArgMax {
            let _ = writeln!(out, "    a{scratch}[{}u + wg] = ridx{i}[0];", s.positions);
        }
        let _ = writeln!(out, "  }}\n}}");
        let name = format!("partial{i}");
        let comment = format!("Reduction v{i}, pass 1: {segments} segments of {seg_len} per row, one workgroup each.");
        entry(m, &mut bodies, &name, groups, threads, &comment, &out)?;
        // The row's result from its partials.
        let mut out = String::new();
        let _ =
            writeln!(out, "  let row = wg;\n  var acc{i}: {} = {};", scalar::reg_type(d)?, scalar::identity(s.op, d)?);
        if s.op == ReduceOp::ArgMax {
            let _ = writeln!(out, "  var arg{i}: u32 = 0u;");
        }
        let _ = writeln!(out, "  for (var k = lid; k < {segments}u; k = k + {threads}u) {{");
        let part = from_words(d, scratch, &format!("{}u + (row * {segments}u + k) * {}u", s.partials, width(d)));
        let _ = writeln!(out, "    let v = {part};");
        let (acc, arg) = (format!("acc{i}"), format!("arg{i}"));
        match s.op {
            ReduceOp::Sum | ReduceOp::Mean => {
                let _ = writeln!(out, "    {acc} = {};", scalar::binary(PrimBinary::Add, d, &acc, "v")?);
            }
            ReduceOp::ArgMax => {
                let _ = writeln!(out, "    let at = a{scratch}[{}u + row * {segments}u + k];", s.positions);
                let _ = writeln!(
                    out,
                    "    if ({}) {{ {acc} = v; {arg} = at; }}",
                    rows::wins(s.op, d, [&acc, "v", &arg, "at"])
                );
            }
            _ => {
                let _ = writeln!(out, "    if ({}) {{ {acc} = v; }}", rows::wins(s.op, d, [&acc, "v", "0u", "0u"]));
            }
        }
        let _ = writeln!(out, "  }}");
        rows::tree(&mut out, i, s.op, d, threads)?;
        let _ = writeln!(out, "  if (lid == 0u) {{");
        match s.op {
            ReduceOp::ArgMax => {
                let _ = writeln!(out, "    a{scratch}[{}u + row] = ridx{i}[0];", s.results);
            }
            op => {
                let mean = op == ReduceOp::Mean && d == DType::F32;
                let v = if mean && p.len == 0 {
                    "bitcast<f32>(braid_opaque(0x7fc00000u))".to_string()
                } else if mean {
                    format!("red{i}[0] / {}", scalar::f32_const(p.len as f64))
                } else {
                    format!("red{i}[0]")
                };
                for (k, w) in to_words(d, &v).iter().enumerate() {
                    let _ = writeln!(out, "    a{scratch}[{}u + row * {}u + {k}u] = {w};", s.results, width(d));
                }
            }
        }
        let _ = writeln!(out, "  }}\n}}");
        let name = format!("combine{i}");
        let comment = format!("Reduction v{i}, pass 2: each row's {segments} partial results, one workgroup per row.");
        entry(m, &mut bodies, &name, rows, threads, &comment, &out)?;
    }
    // The outputs.
    let mut out = String::new();
    let _ = writeln!(out, "  let row = wg / {segments}u;\n  let seg = wg % {segments}u;");
    p.decompose_position(&mut out, "row");
    row_values(&mut out, nodes.len())?;
    rows::stores(&mut out, p, &written, segment_range, threads, "seg == 0u && lid == 0u")?;
    out.push_str("}\n");
    let comment = format!("The outputs: {segments} segments of {seg_len} per row, one workgroup each.");
    entry(m, &mut bodies, "finish", rows * segments as u64, threads, &comment, &out)?;
    rows::check_shared(m, &shared, threads)?;
    m.body = format!("{shared}{}{bodies}", m.body);
    Ok(())
}

/// Adds entry `name` with body `out` (after the header `begin_entry` prints) to `bodies`.
#[allow(clippy::too_many_arguments)]
fn entry(
    m: &mut Module<'_>,
    bodies: &mut String,
    name: &str,
    groups: u64,
    threads: u32,
    comment: &str,
    out: &str,
) -> Result<(), String> {
    let before = std::mem::take(&mut m.body);
    m.begin_entry(name, groups, threads, comment)?;
    bodies.push_str(&m.body);
    bodies.push_str(out);
    m.body = before;
    Ok(())
}

use braid_graph::expr::PrimBinary;
