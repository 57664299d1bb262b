//! The fold and the combine of one reduction in a row kernel ([`reduction`]), with the CPU's
//! identities and its NaN and first-index rules. The combine: each warp folds its lanes' partial
//! results by `__shfl_down_sync` (no barrier), lane 0 of each warp writes the warp's result to a
//! shared array of one entry per warp, one `__syncthreads()`, then every warp folds those
//! entries by shuffles the same way and broadcasts its lane 0's value to its lanes, so that
//! every thread holds the row's result (`acc<i>`, and `arg<i>` for argmax). A block of one warp
//! or less skips the shared array and the barrier.
//!
//! A column kernel's reductions ([`column_reduction`]) combine the partial results of a column's
//! threads through a shared array of an entry per thread, in order.
//!
//! Must never: depend on the block size beyond its being a power of two from 1 to the printed
//! one (a partial warp shuffles with a mask of exactly its lanes and a width of its size), let
//! only some threads of a block reach a shuffle or the barrier (every branch of the combine is
//! on `blockDim.x`, the same for the whole block), combine in an order that changes from run to
//! run (the order is a fixed tree), or read the row itself (the caller's sweep prints the loop
//! and the values folded).

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
/// combine may pair partial results in any order.
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

/// A warp shuffle (`__shfl_sync` or `__shfl_<kind>_sync`, with the combine's `mask` and `lanes`) of `x` of dtype
/// `d`: types narrower than 32 bits (CUDA's shuffles take 32- and 64-bit values) go through
/// `unsigned` and back.
fn shuffle(kind: &str, d: DType, x: &str, arg: &str) -> String {
    let kind = if kind.is_empty() { String::new() } else { format!("_{kind}") };
    let call = |x: &str| format!("__shfl{kind}_sync(mask, {x}, {arg}, lanes)");
    if d.is_float() || d.size() >= 4 { call(x) } else { format!("({})({})", ctype(d), call(&format!("(unsigned){x}"))) }
}

/// Prints reduction node `i` (`op` of node `x`, of dtype `d`) over a row of `len` elements by a
/// block of up to `threads` threads: each thread folds the elements it strides over (`sweep`
/// prints that loop around the fold), then warp shuffles and one shared array of an entry per
/// warp combine the threads' results (see the module docs). Every thread ends with the row's
/// result in `acc<i>` (a mean's sum), and for argmax its position in `arg<i>`; returns the
/// expression of the reduction's value.
pub(super) fn reduction(
    out: &mut String,
    i: usize,
    op: ReduceOp,
    x: usize,
    d: DType,
    [len, threads]: [usize; 2],
    sweep: &dyn Fn(&mut String, &str) -> Result<(), String>,
) -> Result<String, String> {
    let mut values = reductions(out, &[(i, op, x, d)], [len, threads], sweep)?;
    Ok(values.remove(0))
}

/// [`reduction`] of several reductions, none of which reads another's value, folded in one
/// sweep (`sweep` prints the loop around their folds, concatenated), then combined one after
/// another: the row is read once for all of them. Returns their values' expressions, in order.
pub(super) fn reductions(
    out: &mut String,
    reductions: &[(usize, ReduceOp, usize, DType)],
    [len, threads]: [usize; 2],
    sweep: &dyn Fn(&mut String, &str) -> Result<(), String>,
) -> Result<Vec<String>, String> {
    let (folds, compensated) = start_folds(out, reductions, threads.div_ceil(32), "")?;
    sweep(out, &folds)?;
    let mut values = vec![];
    for (&(i, op, _, d), kahan) in reductions.iter().zip(compensated) {
        combine(out, (i, op, d), kahan)?;
        values.push(reduced_value(i, op, d, len));
    }
    Ok(values)
}

/// Declares each of `reductions`' shared arrays of `entries` partial results (and positions, for
/// argmax) and what its threads fold into ([`fold_start`]); returns their folds of one
/// position, concatenated for one sweep, and which sums are compensated.
fn start_folds(
    out: &mut String,
    reductions: &[(usize, ReduceOp, usize, DType)],
    entries: usize,
    per: &str,
) -> Result<(String, Vec<bool>), String> {
    let mut folds = String::new();
    let mut compensated = vec![];
    for &(i, op, x, d) in reductions {
        let _ = writeln!(out, "  // Reduction: v{i} = {} of v{x} along the row{per}.", op.name());
        let _ = writeln!(out, "  __shared__ {} red{i}[{entries}];", ctype(d));
        if op == ReduceOp::ArgMax {
            let _ = writeln!(out, "  __shared__ long long idx{i}[{entries}];");
        }
        let (fold, kahan) = fold_start(out, i, op, x, d)?;
        folds.push_str(&fold);
        compensated.push(kahan);
    }
    Ok((folds, compensated))
}

/// The combine of reduction `i`'s threads' results (see the module docs), in a scope of its
/// own; `kahan`: its sum is compensated.
fn combine(out: &mut String, (i, op, d): (usize, ReduceOp, DType), kahan: bool) -> Result<(), String> {
    let arg = op == ReduceOp::ArgMax;
    let (acc, at) = (format!("acc{i}"), format!("arg{i}"));
    // `lanes`: the warp's threads (fewer than 32 in a block of fewer); `mask`: exactly those
    // lanes.
    let _ = writeln!(out, "  {{");
    if kahan {
        let _ = writeln!(out, "    {acc} = {acc} - cmp{i};");
    }
    out.push_str("    const int lanes = blockDim.x < 32u ? (int)blockDim.x : 32;\n");
    out.push_str("    const unsigned mask = blockDim.x >= 32u ? 0xffffffffu : (1u << blockDim.x) - 1u;\n");
    let step = combine_step(i, op, d)?;
    let tree = |out: &mut String, pad: &str, levels: &str| shuffle_tree(out, (i, op, d), &step, pad, levels);
    tree(out, "    ", "lanes");
    // More than one warp (a power of two of them): each warp's lane 0 writes its warp's value,
    // and every warp folds them in the same order (lane `l` starts from entry `l % warps`).
    let _ = writeln!(out, "    if (blockDim.x > 32u) {{");
    let _ = writeln!(
        out,
        "      if (threadIdx.x % 32u == 0) {{ red{i}[threadIdx.x / 32u] = {acc};{} }}",
        if arg { format!(" idx{i}[threadIdx.x / 32u] = {at};") } else { String::new() }
    );
    let _ = writeln!(out, "      __syncthreads();\n      const unsigned warps = blockDim.x / 32u;");
    let _ = writeln!(out, "      {acc} = red{i}[threadIdx.x & (warps - 1u)];");
    if arg {
        let _ = writeln!(out, "      {at} = idx{i}[threadIdx.x & (warps - 1u)];");
    }
    tree(out, "      ", "warps");
    out.push_str("    }\n");
    // Every lane takes lane 0's value.
    let _ = writeln!(out, "    {acc} = {};", shuffle("", d, &acc, "0"));
    if arg {
        let _ = writeln!(out, "    {at} = {};", shuffle("", DType::I64, &at, "0"));
    }
    out.push_str("  }\n");
    Ok(())
}

/// A fixed tree by `__shfl_down_sync` over `levels` values (`mask` and `lanes` in scope): lane 0
/// of each segment of `lanes` ends with their fold, the lower lanes' values on the left.
fn shuffle_tree(out: &mut String, (i, op, d): (usize, ReduceOp, DType), step: &str, pad: &str, levels: &str) {
    let (acc, at) = (format!("acc{i}"), format!("arg{i}"));
    let _ = writeln!(out, "{pad}for (int s = (int){levels} / 2; s > 0; s /= 2) {{");
    let _ = writeln!(out, "{pad}  const {} b = {};", ctype(d), shuffle("down", d, &acc, "s"));
    if op == ReduceOp::ArgMax {
        let _ = writeln!(out, "{pad}  const long long ib = {};", shuffle("down", DType::I64, &at, "s"));
    }
    let _ = writeln!(out, "{pad}  {step}\n{pad}}}");
}

/// Prints reduction node `i` over a row held by one segment of `lanes` lanes of a warp (a
/// short-row kernel's, `super::short_rows`; `lanes` and `mask` are the kernel's, and every lane
/// of the warp runs the combine together): each lane folds the positions it strides over, the
/// segment's fixed shuffle tree folds the lanes' results into its first lane, which every lane
/// of the segment then reads. No shared memory and no barrier. Returns the value's expression.
pub(super) fn segment_reduction(
    out: &mut String,
    i: usize,
    op: ReduceOp,
    x: usize,
    d: DType,
    len: usize,
    sweep: &dyn Fn(&mut String, &str) -> Result<(), String>,
) -> Result<String, String> {
    let _ = writeln!(out, "  // Reduction: v{i} = {} of v{x} along the row, by the row's lanes.", op.name());
    let (acc, at) = (format!("acc{i}"), format!("arg{i}"));
    let kahan = fold(out, i, op, x, d, sweep)?;
    if kahan {
        let _ = writeln!(out, "  {acc} = {acc} - cmp{i};");
    }
    shuffle_tree(out, (i, op, d), &combine_step(i, op, d)?, "  ", "lanes");
    let _ = writeln!(out, "  {acc} = {};", shuffle("", d, &acc, "0"));
    if op == ReduceOp::ArgMax {
        let _ = writeln!(out, "  {at} = {};", shuffle("", DType::I64, &at, "0"));
    }
    Ok(reduced_value(i, op, d, len))
}

/// The statement folding a partial result `b` (at position `ib`, for argmax) into reduction
/// `i`'s `acc<i>` (and `arg<i>`): one step of both combines.
pub(super) fn combine_step(i: usize, op: ReduceOp, d: DType) -> Result<String, String> {
    let (acc, at, arg) = (format!("acc{i}"), format!("arg{i}"), op == ReduceOp::ArgMax);
    Ok(match op {
        ReduceOp::Sum | ReduceOp::Mean => format!("{acc} = {};", binary(PrimBinary::Add, d, &acc, "b")?),
        _ => {
            let w = wins(op, d, [&acc, "b", if arg { &at } else { "0" }, if arg { "ib" } else { "0" }]);
            format!("if ({w}) {{ {acc} = b;{} }}", if arg { format!(" {at} = ib;") } else { String::new() })
        }
    })
}

/// The expression of reduction `i`'s value once `acc<i>` (and `arg<i>`) hold the row's result:
/// the CPU divides float means by the length and leaves integer "means" as sums.
pub(super) fn reduced_value(i: usize, op: ReduceOp, d: DType, len: usize) -> String {
    match op {
        ReduceOp::ArgMax => format!("arg{i}"),
        ReduceOp::Mean if d.is_float() => format!("acc{i} / {}", float_literal(len as f64, d)),
        _ => format!("acc{i}"),
    }
}

/// Declares reduction `i`'s accumulators (`acc<i>`, `arg<i>` for argmax, `cmp<i>` for a float
/// sum) and prints the thread's fold of the elements it visits (`sweep` prints the loop around
/// it). Returns whether the sum is compensated (`acc<i> - cmp<i>` is then its value).
fn fold(
    out: &mut String,
    i: usize,
    op: ReduceOp,
    x: usize,
    d: DType,
    sweep: &dyn Fn(&mut String, &str) -> Result<(), String>,
) -> Result<bool, String> {
    let (body, kahan) = fold_start(out, i, op, x, d)?;
    sweep(out, &body)?;
    Ok(kahan)
}

/// Declares what a thread of reduction `i` folds into (`acc<i>`, `arg<i>` for argmax, the
/// compensation `cmp<i>` of a float sum) and returns the fold of one position (`v<x>`, at `t`)
/// for a sweep to print, and whether the sum is compensated. Several reductions' folds may
/// share one sweep ([`column_reductions`]).
fn fold_start(out: &mut String, i: usize, op: ReduceOp, x: usize, d: DType) -> Result<(String, bool), String> {
    let ty = ctype(d);
    let _ = writeln!(out, "  {ty} acc{i} = {};", identity(op, d));
    if op == ReduceOp::ArgMax {
        let _ = writeln!(out, "  long long arg{i} = 0;");
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
    Ok((fold, kahan))
}

/// Prints reduction node `i` of a column kernel (`super::columns`): the `ys` threads of a
/// column (`cy` = 0..ys) fold the positions they stride over (`sweep`), write their partial
/// results to a shared array of an entry per thread, and after a barrier each thread folds its
/// column's entries in order of `cy` (a fixed order), so every thread of the column holds the
/// row's result; a second barrier lets the array be written again. Returns the value's
/// expression.
pub(super) fn column_reduction(
    out: &mut String,
    i: usize,
    op: ReduceOp,
    x: usize,
    d: DType,
    [len, threads]: [usize; 2],
    sweep: &dyn Fn(&mut String, &str) -> Result<(), String>,
) -> Result<String, String> {
    let mut values = column_reductions(out, &[(i, op, x, d)], [len, threads], sweep)?;
    Ok(values.remove(0))
}

/// [`column_reduction`] of several reductions, none of which reads another's value, folded in
/// one sweep (`sweep` prints the loop around their folds, concatenated): a column is read once
/// for all of them. Returns their values' expressions, in order.
pub(super) fn column_reductions(
    out: &mut String,
    reductions: &[(usize, ReduceOp, usize, DType)],
    [len, threads]: [usize; 2],
    sweep: &dyn Fn(&mut String, &str) -> Result<(), String>,
) -> Result<Vec<String>, String> {
    let (folds, compensated) = start_folds(out, reductions, threads, ", per column")?;
    sweep(out, &folds)?;
    let mut values = vec![];
    for (&(i, op, _, d), kahan) in reductions.iter().zip(compensated) {
        let (ty, arg) = (ctype(d), op == ReduceOp::ArgMax);
        let (acc, at) = (format!("acc{i}"), format!("arg{i}"));
        if kahan {
            let _ = writeln!(out, "  {acc} = {acc} - cmp{i};");
        }
        let _ = writeln!(
            out,
            "  red{i}[threadIdx.x] = {acc};{}\n  __syncthreads();",
            if arg { format!(" idx{i}[threadIdx.x] = {at};") } else { String::new() }
        );
        let step = combine_step(i, op, d)?;
        let _ =
            writeln!(out, "  {acc} = red{i}[cx];{}", if arg { format!(" {at} = idx{i}[cx];") } else { String::new() });
        let _ = writeln!(out, "  for (unsigned k = 1; k < ys; ++k) {{");
        let _ = writeln!(out, "    const {ty} b = red{i}[k * xw + cx];");
        if arg {
            let _ = writeln!(out, "    const long long ib = idx{i}[k * xw + cx];");
        }
        let _ = writeln!(out, "    {step}\n  }}\n  __syncthreads();");
        values.push(reduced_value(i, op, d, len));
    }
    Ok(values)
}
