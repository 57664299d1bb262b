//! Printing of map loops as entry points: one thread per index in a grid-stride loop (see the
//! module above). Must never: assume a grid or block size (any grid covers the loop).

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
