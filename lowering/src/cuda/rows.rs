//! Printing of row kernels as one entry point: one block per row, phases as the CPU's.

use super::reduce::reduction;
use super::*;
use std::cell::RefCell;

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
    let (row_stores, elem_stores): (Vec<&Store>, Vec<&Store>) = r.stores.iter().partition(|s| row_store(s));
    let roots: Vec<usize> = elem_stores.iter().map(|s| s.value as usize).collect();
    let keep = plan_keep(r, &live, threads as usize, len, &needed, &roots);
    // Which kept loads a sweep has already read from global memory (and written to `keep`).
    let kept = RefCell::new(vec![false; nodes.len()]);
    // A sweep over the row: per-element nodes `need`, then `body` (which stores through
    // `stores`); it declares the index variables along the row that these read. A kept load
    // is read from global memory by the first sweep that needs it, from `keep<i>` after.
    let sweep = |out: &mut String, need: &[usize], stores: &[&Store], body: &str| -> Result<(), String> {
        let from_keep = |i: usize| keep[i] && kept.borrow()[i];
        let loads = need.iter().filter(|&&i| !from_keep(i)).filter_map(|&i| match nodes[i].op {
            ExprOp::Load(slot) => Some(&r.loads[slot as usize].view),
            _ => None,
        });
        let views: Vec<&View> = loads.chain(stores.iter().map(|s| &s.view)).collect();
        let flat = need.iter().any(|&i| nodes[i].op == ExprOp::Index);
        let _ = writeln!(out, "  for (long long t = threadIdx.x; t < {len}LL; t += blockDim.x) {{");
        decompose(out, "    ", "t", &r.dims, &row_dims, &used_dims(&r.dims, &views, flat));
        for &i in need {
            let ty = ctype(nodes[i].dtype);
            if from_keep(i) {
                let _ = writeln!(out, "    const {ty} v{i} = keep{i}[t];");
                continue;
            }
            let e = node_expr(Dialect::Cuda, &r.expr, &r.loads, i, &offset_expr, &index)?;
            let _ = writeln!(out, "    const {ty} v{i} = {e};");
            if keep[i] {
                let _ = writeln!(out, "    keep{i}[t] = v{i};");
                kept.borrow_mut()[i] = true;
            }
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
    for i in (0..nodes.len()).filter(|&i| keep[i]) {
        let _ = writeln!(out, "  __shared__ {} keep{i}[{len}]; // v{i}, kept for later phases", ctype(nodes[i].dtype));
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
    if !row_stores.is_empty() {
        let _ = writeln!(out, "  if (threadIdx.x == 0) {{");
        for s in row_stores {
            let _ = writeln!(out, "    {}", store_stmt(s, &offset_expr(&s.view)));
        }
        let _ = writeln!(out, "  }}");
    }
    if !elem_stores.is_empty() {
        let body: String =
            elem_stores.iter().map(|s| format!("    {}\n", store_stmt(s, &offset_expr(&s.view)))).collect();
        sweep(out, &needed(&roots), &elem_stores, &body)?;
    }
    out.push_str("}\n");
    Ok(Entry { name: name.into(), launch: Launch::Rows { rows, threads } })
}

/// Which loaded per-element nodes the kernel keeps in shared memory (`keep<i>[len]`, indexed by
/// the position along the row) between its phases: loads that two or more sweeps read (a
/// reduction's fold and a later one, or the last sweep's stores), in node order, while their
/// arrays fit in [`ROW_KEEP_BYTES`] and, with the reduction trees, in the static shared memory
/// of a block. A row that fits is read from global memory once, however many phases it has.
///
/// Why shared memory and not registers: each thread of every sweep visits the same positions
/// (`t = threadIdx.x; t += blockDim.x`), so a thread reads back only what it wrote, with no
/// barrier, at whatever power-of-two block size the launcher picks; a per-thread register
/// array would need its length, `ceil(len / blockDim.x)`, fixed when printing, so it would hold
/// the row only at the printed block size and need a second, multi-pass path for the others.
/// Shared memory is far faster than the global memory it saves (an f32 row of 4096 elements,
/// 16 KiB, still lets 8 blocks of 256 threads share a multiprocessor of an H100). Longer rows,
/// and the loads that one sweep reads, stay as they were: read from global memory per sweep.
fn plan_keep(
    r: &RowKernel,
    live: &[bool],
    threads: usize,
    len: usize,
    needed: &dyn Fn(&[usize]) -> Vec<usize>,
    roots: &[usize],
) -> Vec<bool> {
    let nodes = &r.expr.nodes;
    let mut sweeps: Vec<Vec<usize>> = vec![];
    let mut tree_bytes = 0;
    for (i, n) in nodes.iter().enumerate() {
        if let ExprOp::Reduce(op, x) = n.op {
            if live[i] {
                sweeps.push(needed(&[x as usize]));
                let idx = if op == ReduceOp::ArgMax { 8 } else { 0 };
                tree_bytes += threads * (nodes[x as usize].dtype.size() + idx);
            }
        }
    }
    if !roots.is_empty() {
        sweeps.push(needed(roots));
    }
    let mut reads = vec![0; nodes.len()];
    sweeps.iter().flatten().for_each(|&i| reads[i] += 1);
    let mut budget = ROW_KEEP_BYTES.min(STATIC_SHARED_BYTES.saturating_sub(tree_bytes));
    let mut keep = vec![false; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        let bytes = len * n.dtype.size();
        if matches!(n.op, ExprOp::Load(_)) && reads[i] >= 2 && len > 0 && bytes <= budget {
            keep[i] = true;
            budget -= bytes;
        }
    }
    keep
}
