//! Printing of map loops and row kernels as entry points (see the module above).

use super::*;

pub(super) fn print_map(out: &mut String, l: &MapLoop, name: &str, params: &[Param]) -> Result<Entry, String> {
    check_io(&l.loads, &l.stores, &l.expr, &l.dims, params)?;
    let numel = l.numel();
    let (live, views) = live(&l.expr, &l.loads, &l.stores);
    let strided: Vec<&View> = views.into_iter().filter(|v| !v.is_contiguous()).collect();
    let used = used_dims(&l.dims, &strided, false);
    // Contiguous views read element `offset + i` directly.
    let offset = |v: &View| {
        if v.is_contiguous() {
            format!("{}i", if v.offset > 0 { format!("{} + ", v.offset) } else { String::new() })
        } else {
            offset_expr(v)
        }
    };
    let _ = writeln!(
        out,
        "\n// {numel} indices over dims {:?}, one per thread.\n{} {{",
        l.dims.as_slice(),
        signature(name, params)
    );
    let _ = writeln!(
        out,
        "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {numel}LL; i += (long long)gridDim.x * blockDim.x) {{"
    );
    decompose(out, "    ", "i", &l.dims, &(0..l.dims.len()).collect::<Vec<_>>(), &used);
    for (i, n) in l.expr.nodes.iter().enumerate() {
        // Checked even when dead: the CPU evaluates every node.
        let e = node_expr(Dialect::Cuda, &l.expr, &l.loads, i, &offset, "i")?;
        if live[i] {
            let _ = writeln!(out, "    const {} v{i} = {e};", ctype(n.dtype));
        }
    }
    for s in &l.stores {
        let _ = writeln!(out, "    {}", store_stmt(s, &offset(&s.view)));
    }
    out.push_str("  }\n}\n");
    Ok(Entry { name: name.into(), launch: Launch::Map { numel, block: MAP_BLOCK } })
}

/// The identity of a reduction over dtype `d`.
pub(super) fn identity(op: ReduceOp, d: DType) -> String {
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
pub(super) fn wins(op: ReduceOp, d: DType, [a, b, ia, ib]: [&str; 4]) -> String {
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

pub(super) fn print_rows(out: &mut String, r: &RowKernel, name: &str, params: &[Param]) -> Result<Entry, String> {
    check_io(&r.loads, &r.stores, &r.expr, &r.dims, params)?;
    let (nodes, rank) = (&r.expr.nodes, r.dims.len());
    let row_dims: Vec<usize> = match r.axis {
        Some(a) if a < rank => vec![a],
        Some(a) => return Err(format!("axis {a} of a rank-{rank} row kernel")),
        None => (0..rank).collect(),
    };
    let pos_dims: Vec<usize> = (0..rank).filter(|d| !row_dims.contains(d)).collect();
    let len: usize = row_dims.iter().map(|&d| r.dims[d]).product();
    let rows: usize = pos_dims.iter().map(|&d| r.dims[d]).product();
    if rows > i32::MAX as usize {
        return Err(format!("{rows} rows: more blocks than one launch has"));
    }
    let threads = (len.next_power_of_two() as u32).clamp(32, MAX_ROW_THREADS);
    // Constant along the row: the CPU's plan, node by node and store by store.
    let along = |v: &View| row_dims.iter().all(|&d| v.strides[d] == 0);
    let mut per_row = vec![false; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        per_row[i] = match n.op {
            ExprOp::Load(slot) => along(&r.loads[slot as usize].view),
            ExprOp::Const(_) | ExprOp::ConstInt(_) | ExprOp::Reduce(..) => true,
            ExprOp::Index => false,
            op => op.operands().iter().all(|&o| per_row[o]),
        };
    }
    let needed = |roots: &[usize]| -> Vec<usize> {
        let mut need = vec![false; nodes.len()];
        let mut stack: Vec<usize> = roots.iter().copied().filter(|&x| !per_row[x]).collect();
        while let Some(i) = stack.pop() {
            if !std::mem::replace(&mut need[i], true) {
                stack.extend(nodes[i].op.operands().into_iter().filter(|&o| !per_row[o]));
            }
        }
        (0..nodes.len()).filter(|&i| need[i]).collect()
    };
    let row_store = |s: &Store| per_row[s.value as usize] && along(&s.view);
    let (live, views) = live(&r.expr, &r.loads, &r.stores);
    let has_index = nodes.iter().zip(&live).any(|(n, &l)| l && n.op == ExprOp::Index);
    let used = used_dims(&r.dims, &views, has_index);
    let flat = View { dims: r.dims.clone(), strides: Shape::new(&r.dims).contiguous_strides(), offset: 0 };
    let index = if r.axis.is_none() { "t".to_string() } else { offset_expr(&flat) };
    // A sweep over the row: per-element nodes `need`, then `body` (which stores through
    // `stores`); it declares the index variables along the row that these read.
    let sweep = |out: &mut String, need: &[usize], stores: &[&Store], body: &str| -> Result<(), String> {
        let loads = need.iter().filter_map(|&i| match nodes[i].op {
            ExprOp::Load(slot) => Some(&r.loads[slot as usize].view),
            _ => None,
        });
        let views: Vec<&View> = loads.chain(stores.iter().map(|s| &s.view)).collect();
        let flat = need.iter().any(|&i| nodes[i].op == ExprOp::Index);
        let _ = writeln!(out, "  for (long long t = threadIdx.x; t < {len}LL; t += blockDim.x) {{");
        decompose(out, "    ", "t", &r.dims, &row_dims, &used_dims(&r.dims, &views, flat));
        for &i in need {
            let e = node_expr(Dialect::Cuda, &r.expr, &r.loads, i, &offset_expr, &index)?;
            let _ = writeln!(out, "    const {} v{i} = {e};", ctype(nodes[i].dtype));
        }
        let _ = writeln!(out, "{body}  }}");
        Ok(())
    };
    let dims = r.dims.as_slice();
    let _ = match r.axis {
        Some(a) => writeln!(out, "\n// One block per row of {dims:?} along dim {a} ({len} elements)."),
        None => writeln!(out, "\n// One block: all of {dims:?} is one row ({len} elements)."),
    };
    let _ = writeln!(out, "{} {{", signature(name, params));
    if pos_dims.iter().any(|&d| used[d]) {
        let _ = writeln!(out, "  const long long row = blockIdx.x;");
        decompose(out, "  ", "row", &r.dims, &pos_dims, &used);
    }
    for (i, n) in nodes.iter().enumerate() {
        let ExprOp::Reduce(op, x) = n.op else {
            if per_row[i] {
                // Checked even when dead: the CPU evaluates every per-row node.
                let e = node_expr(Dialect::Cuda, &r.expr, &r.loads, i, &offset_expr, &index)?;
                if live[i] {
                    let _ = writeln!(out, "  const {} v{i} = {e};", ctype(n.dtype));
                }
            }
            continue;
        };
        let d = nodes[x as usize].dtype;
        if d == DType::Bool || n.dtype != if op == ReduceOp::ArgMax { DType::I64 } else { d } {
            return Err(format!("node {i}: {op:?} of {d} giving {}", n.dtype));
        }
        if !live[i] {
            continue;
        }
        let value = reduction(out, i, op, x as usize, d, [len, threads as usize], &|out, body| {
            sweep(out, &needed(&[x as usize]), &[], body)
        })?;
        let _ = writeln!(out, "  const {} v{i} = {value};", ctype(n.dtype));
    }
    let (row_stores, elem_stores): (Vec<&Store>, Vec<&Store>) = r.stores.iter().partition(|s| row_store(s));
    if !row_stores.is_empty() {
        let _ = writeln!(out, "  if (threadIdx.x == 0) {{");
        for s in row_stores {
            let _ = writeln!(out, "    {}", store_stmt(s, &offset_expr(&s.view)));
        }
        let _ = writeln!(out, "  }}");
    }
    if !elem_stores.is_empty() {
        let roots: Vec<usize> = elem_stores.iter().map(|s| s.value as usize).collect();
        let body: String =
            elem_stores.iter().map(|s| format!("    {}\n", store_stmt(s, &offset_expr(&s.view)))).collect();
        sweep(out, &needed(&roots), &elem_stores, &body)?;
    }
    out.push_str("}\n");
    Ok(Entry { name: name.into(), launch: Launch::Rows { rows, threads } })
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
