//! Map loops as entry points: one thread per index, [`MAP_THREADS`] per workgroup by default;
//! [`WgslOptions`] print other workgroup sizes, and several indices per thread (a loop in the
//! entry, each index computed by the same statements as in the default). Prints only; the
//! loop's checks run first.

use super::*;

pub(super) fn print_loop(m: &mut Module<'_>, l: &crate::kernel::MapLoop, name: &str) -> Result<(), String> {
    m.check(&l.loads, &l.stores, &l.expr, &l.dims)?;
    let numel = l.numel();
    if numel == 0 {
        // Nothing to compute; still checked, like the CPU's.
        return (0..l.expr.nodes.len()).try_for_each(|i| check_node(&l.expr, i));
    }
    if numel as u64 >= 1 << 32 {
        return Err(format!("a loop of {numel} indices: wgpu kernels index with u32"));
    }
    let WgslOptions { map_threads: threads, map_elements: per } = m.options;
    let span = threads as u64 * per as u64;
    if per > 1 && numel as u64 + span >= 1 << 32 {
        return Err(format!("a loop of {numel} indices in spans of {span}: its last index passes u32"));
    }
    let groups = (numel as u64).div_ceil(span);
    let comment = match per {
        1 => format!("{numel} indices over dims {:?}, one per thread.", l.dims.as_slice()),
        _ => format!("{numel} indices over dims {:?}, {per} per thread.", l.dims.as_slice()),
    };
    m.begin_entry(name, groups, threads, &comment)?;
    let out = &mut m.body;
    let indent = if per == 1 {
        let _ = writeln!(out, "  let i = wg * {threads}u + lid;\n  if (i >= {numel}u) {{ return; }}");
        "  "
    } else {
        let _ = writeln!(
            out,
            "  for (var k = 0u; k < {per}u; k = k + 1u) {{\n    let i = (wg * {per}u + k) * {threads}u + lid;\n    \
             if (i >= {numel}u) {{ break; }}"
        );
        "    "
    };
    let all: Vec<usize> = (0..l.dims.len()).collect();
    memory::decompose(out, indent, "i", &l.dims, &all);
    let live = live(&l.expr, &l.stores);
    let written: Vec<bool> = m.params.iter().map(|p| p.writable).collect();
    for (i, &is_live) in live.iter().enumerate() {
        // Checked even when dead: the CPU evaluates every node.
        check_node(&l.expr, i)?;
        if is_live {
            let_node(out, indent, &l.expr, &l.loads, &written, i, "i")?;
        }
    }
    for s in &l.stores {
        let _ = writeln!(out, "{indent}{}", memory::store_of(s)?);
    }
    if per > 1 {
        out.push_str("  }\n");
    }
    out.push_str("}\n");
    Ok(())
}

/// Whether node `i` is one the printer can print (loads are checked by `check_printable`).
pub(super) fn check_node(expr: &Expr, i: usize) -> Result<(), String> {
    match expr.nodes[i].op {
        ExprOp::Load(_) => scalar::reg_type(expr.nodes[i].dtype).map(drop),
        ExprOp::Reduce(..) => Err(format!("node {i}: reductions only run in row kernels")),
        _ => scalar::node_expr(expr, i, "i").map(drop),
    }
}
