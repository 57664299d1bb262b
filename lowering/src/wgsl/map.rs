//! Map loops as entry points: one thread per index, [`MAP_THREADS`] per workgroup. Prints
//! only; the loop's checks run first.

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
    let groups = (numel as u64).div_ceil(MAP_THREADS as u64);
    m.begin_entry(
        name,
        groups,
        MAP_THREADS,
        &format!("{numel} indices over dims {:?}, one per thread.", l.dims.as_slice()),
    )?;
    let out = &mut m.body;
    let _ = writeln!(out, "  let i = wg * {MAP_THREADS}u + lid;\n  if (i >= {numel}u) {{ return; }}");
    let all: Vec<usize> = (0..l.dims.len()).collect();
    memory::decompose(out, "  ", "i", &l.dims, &all);
    let live = live(&l.expr, &l.stores);
    let written: Vec<bool> = m.params.iter().map(|p| p.writable).collect();
    for (i, &is_live) in live.iter().enumerate() {
        // Checked even when dead: the CPU evaluates every node.
        check_node(&l.expr, i)?;
        if is_live {
            let_node(out, "  ", &l.expr, &l.loads, &written, i, "i")?;
        }
    }
    for s in &l.stores {
        let _ = writeln!(out, "  {}", memory::store_of(s)?);
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
