//! The fold and the shared-memory tree of one reduction in a row kernel ([`reduction`]), with
//! the CPU's identities and its NaN and first-index rules. Must never: depend on the block size
//! (the tree is correct for any power of two up to the printed one), or read the row itself
//! (the caller's sweep prints the loop and the values folded).

use super::*;

/// The identity of a reduction over dtype `d`.
fn identity(op: ReduceOp, d: DType) -> String {
    let (lo, hi) = match d {
        DType::F32 | DType::F64 => (float_literal(f64::NEG_INFINITY, d), float_literal(f64::INFINITY, d)),
        DType::I32 => (int_literal(i32::MIN as i64, d), int_literal(i32::MAX as i64, d)),
        DType::I64 => (int_literal(i64::MIN, d), int_literal(i64::MAX, d)),
        _ => ("0".into(), "255".into()),
    };
    match op {
        ReduceOp::Sum | ReduceOp::Mean if d.is_float() => float_literal(0.0, d),
        ReduceOp::Sum | ReduceOp::Mean => "0".into(),
        ReduceOp::Max | ReduceOp::ArgMax => lo,
        ReduceOp::Min => hi,
    }
}

/// Whether candidate `b` (at row position `ib`) replaces the running `a` (at `ia`): the CPU's
/// rules (NaN wins and sticks; the first of equal maxima wins), order-independent so that the
/// tree can combine partial results in any order.
fn wins(op: ReduceOp, d: DType, [a, b, ia, ib]: [&str; 4]) -> String {
    let better = if op == ReduceOp::Min { format!("{b} < {a}") } else { format!("{b} > {a}") };
    match (op, d.is_float()) {
        (ReduceOp::ArgMax, true) => {
            format!(
                "isnan({b}) ? !isnan({a}) || {ib} < {ia} : !isnan({a}) && ({better} || ({b} == {a} && {ib} < {ia}))"
            )
        }
        (ReduceOp::ArgMax, false) => format!("{better} || ({b} == {a} && {ib} < {ia})"),
        (_, true) => format!("!isnan({a}) && ({better} || isnan({b}))"),
        (_, false) => better,
    }
}

/// Prints reduction node `i` (`op` of node `x`, of dtype `d`) over a row of `len` elements by a
/// block of up to `threads` threads: each thread folds the elements it strides over (`sweep`
/// prints that loop around the fold), then a tree in shared memory combines the threads'
/// results. Returns the expression of the row's result.
pub(super) fn reduction(
    out: &mut String,
    i: usize,
    op: ReduceOp,
    x: usize,
    d: DType,
    [len, threads]: [usize; 2],
    sweep: &dyn Fn(&mut String, &str) -> Result<(), String>,
) -> Result<String, String> {
    let (ty, arg) = (ctype(d), op == ReduceOp::ArgMax);
    let _ = writeln!(out, "  // Reduction: v{i} = {} of v{x} along the row.", op.name());
    let _ = writeln!(out, "  __shared__ {ty} red{i}[{threads}];\n  {ty} acc{i} = {};", identity(op, d));
    if arg {
        let _ = writeln!(out, "  __shared__ long long idx{i}[{threads}];\n  long long arg{i} = 0;");
    }
    let (acc, v, at) = (format!("acc{i}"), format!("v{x}"), format!("arg{i}"));
    // Float sums are compensated (Kahan): a thread may fold a million elements of a long row,
    // and a plain running sum would lose about sqrt(n) ulps. The compensation `cmp` is what the
    // last addition lost (negated); it stays 0 once the sum is infinite or NaN.
    let kahan = matches!(op, ReduceOp::Sum | ReduceOp::Mean) && d.is_float();
    if kahan {
        let _ = writeln!(out, "  {ty} cmp{i} = {};", identity(op, d));
    }
    let fold = match op {
        ReduceOp::Sum | ReduceOp::Mean if kahan => format!(
            "    {{ const {ty} y = {v} - cmp{i}; const {ty} s = {acc} + y; cmp{i} = isfinite(s) ? (s - {acc}) - y : {zero}; {acc} = s; }}\n",
            zero = identity(op, d)
        ),
        ReduceOp::Sum | ReduceOp::Mean => format!("    {acc} = {};\n", binary(PrimBinary::Add, d, &acc, &v)?),
        ReduceOp::ArgMax => {
            format!("    if ({}) {{ {acc} = {v}; {at} = t; }}\n", wins(op, d, [&acc, &v, &at, "t"]))
        }
        _ => format!("    if ({}) {{ {acc} = {v}; }}\n", wins(op, d, [&acc, &v, "", ""])),
    };
    sweep(out, &fold)?;
    let _ = writeln!(
        out,
        "  red{i}[threadIdx.x] = acc{i}{};{}\n  __syncthreads();",
        if kahan { format!(" - cmp{i}") } else { String::new() },
        if arg { format!(" idx{i}[threadIdx.x] = arg{i};") } else { String::new() }
    );
    let _ = writeln!(out, "  for (unsigned s = blockDim.x / 2; s > 0; s /= 2) {{\n    if (threadIdx.x < s) {{");
    let (a, b) = (format!("red{i}[threadIdx.x]"), format!("red{i}[threadIdx.x + s]"));
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            let _ = writeln!(out, "      {a} = {};", binary(PrimBinary::Add, d, &a, &b)?);
        }
        _ => {
            let (ia, ib) = (format!("idx{i}[threadIdx.x]"), format!("idx{i}[threadIdx.x + s]"));
            let take = if arg { format!(" {ia} = {ib};") } else { String::new() };
            let w = wins(op, d, [&a, &b, if arg { &ia } else { "0" }, if arg { &ib } else { "0" }]);
            let _ = writeln!(out, "      if ({w}) {{ {a} = {b};{take} }}");
        }
    }
    let _ = writeln!(out, "    }}\n    __syncthreads();\n  }}");
    // The CPU divides float means by the length and leaves integer "means" as sums.
    Ok(match op {
        ReduceOp::ArgMax => format!("idx{i}[0]"),
        ReduceOp::Mean if d.is_float() => format!("red{i}[0] / {}", float_literal(len as f64, d)),
        _ => format!("red{i}[0]"),
    })
}
