//! Printing of map loops as entry points: one thread per index in a grid-stride loop (see the
//! module above), and where contiguous views allow, a vector path before it: one thread per
//! chunk of `width` neighbouring indices, its contiguous loads and stores one access each
//! (`vector.rs`), the indices a chunk does not cover (the tail, or all of them when an argument
//! is not aligned at run time) left to the scalar loop. Must never: assume a grid or block size
//! (any grid covers the loop).

use super::vector::{Vector, aligned, copy_chunk, declare_chunk, read_chunk, width};
use super::*;

/// The vector path of `l`, if it has one: the contiguous live loads and the contiguous
/// stores, at least one, whose offsets are multiples of the width (the largest element
/// fills 16 bytes), over at least one chunk of indices.
fn plan_vector(l: &MapLoop, live: &[bool]) -> Option<Vector> {
    let nodes = &l.expr.nodes;
    let load_of = |i: usize| match nodes[i].op {
        ExprOp::Load(slot) if live[i] && l.loads[slot as usize].view.is_contiguous() => Some(&l.loads[slot as usize]),
        _ => None,
    };
    let sizes = (0..nodes.len()).filter_map(|i| load_of(i).map(|ld| ld.dtype.size()));
    let contiguous = |s: &Store| s.view.is_contiguous();
    let width = width(sizes.chain(l.stores.iter().filter(|s| contiguous(s)).map(|s| s.dtype.size())))?;
    let loads: Vec<bool> =
        (0..nodes.len()).map(|i| load_of(i).is_some_and(|ld| ld.view.offset.is_multiple_of(width))).collect();
    let stores: Vec<bool> = l.stores.iter().map(|s| contiguous(s) && s.view.offset.is_multiple_of(width)).collect();
    let any = loads.iter().chain(&stores).any(|&v| v);
    (any && width > 1 && l.numel() >= width).then_some(Vector { width, loads, stores })
}

pub(super) fn print_map(out: &mut String, l: &MapLoop, name: &str, params: &[Param]) -> Result<Entry, String> {
    check_io(&l.loads, &l.stores, &l.expr, &l.dims, params)?;
    let numel = l.numel();
    let (live, views) = live(&l.expr, &l.loads, &l.stores);
    let strided: Vec<&View> = views.into_iter().filter(|v| !v.is_contiguous()).collect();
    let used = used_dims(&l.dims, &strided, false);
    let vector = plan_vector(l, &live);
    let _ = writeln!(
        out,
        "\n// {numel} indices over dims {:?}, one per thread{}.\n{} {{",
        l.dims.as_slice(),
        match &vector {
            Some(v) => format!(" ({} per thread where the arguments are aligned)", v.width),
            None => String::new(),
        },
        signature(name, params)
    );
    let first = match &vector {
        Some(v) => {
            print_vector_path(out, l, v, &live, &used)?;
            "vec_end"
        }
        None => "0",
    };
    let _ = writeln!(
        out,
        "  for (long long i = {first} + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {numel}LL; i += (long long)gridDim.x * blockDim.x) {{"
    );
    let scalar = Vector { width: 1, loads: vec![false; live.len()], stores: vec![false; l.stores.len()] };
    print_index(out, "    ", l, &scalar, &live, &used)?;
    out.push_str("  }\n}\n");
    // A vector path wants a thread per chunk; the scalar loop strides over whatever grid runs.
    let threads = vector.map_or(numel, |v| numel.div_ceil(v.width));
    Ok(Entry { name: name.into(), launch: Launch::Map { numel: threads, block: MAP_BLOCK } })
}

/// Prints the vector path: `vec` tests the arguments' alignment once, `vec_end` is the first
/// index it leaves to the scalar loop (0 when they are not aligned).
fn print_vector_path(out: &mut String, l: &MapLoop, v: &Vector, live: &[bool], used: &[bool]) -> Result<(), String> {
    let (w, numel, nodes) = (v.width, l.numel(), &l.expr.nodes);
    let _ = writeln!(out, "  const bool vec = {};", aligned(&v.args(&l.expr, &l.loads, &l.stores)));
    let _ = writeln!(out, "  const long long vec_end = vec ? {}LL : 0LL;", numel / w * w);
    let _ = writeln!(
        out,
        "  for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c * {w} < vec_end; c += (long long)gridDim.x * blockDim.x) {{"
    );
    let _ = writeln!(out, "    const long long i0 = c * {w};");
    for (i, _) in v.loads.iter().enumerate().filter(|&(_, &x)| x) {
        let ExprOp::Load(slot) = nodes[i].op else { unreachable!("planned from loads") };
        let ld = &l.loads[slot as usize];
        let from = chunk_at(ld.arg, ld.view.offset);
        read_chunk(out, "    ", &format!("l{i}"), (storage_ctype(ld.dtype), ld.dtype.size()), w, &from);
    }
    for (k, s) in l.stores.iter().enumerate().filter(|&(k, _)| v.stores[k]) {
        declare_chunk(out, "    ", &format!("s{k}"), storage_ctype(s.dtype), w);
    }
    let _ = writeln!(out, "    #pragma unroll\n    for (int e = 0; e < {w}; ++e) {{");
    let _ = writeln!(out, "      const long long i = i0 + e;");
    print_index(out, "      ", l, v, live, used)?;
    out.push_str("    }\n");
    for (k, s) in l.stores.iter().enumerate().filter(|&(k, _)| v.stores[k]) {
        let to = chunk_at(s.arg, s.view.offset);
        copy_chunk(out, "    ", &to, &format!("s{k}"), s.dtype.size() * w);
    }
    out.push_str("  }\n");
    Ok(())
}

/// The work of index `i`: its index variables, its nodes (a vectorised load reads element `e`
/// of its chunk `l<node>`) and its stores (a vectorised one writes element `e` of `s<store>`).
fn print_index(
    out: &mut String,
    pad: &str,
    l: &MapLoop,
    v: &Vector,
    live: &[bool],
    used: &[bool],
) -> Result<(), String> {
    // Contiguous views read element `offset + i` directly.
    let offset = |v: &View| {
        if v.is_contiguous() {
            format!("{}i", if v.offset > 0 { format!("{} + ", v.offset) } else { String::new() })
        } else {
            offset_expr(v)
        }
    };
    decompose(out, pad, "i", &l.dims, &(0..l.dims.len()).collect::<Vec<_>>(), used);
    for (i, n) in l.expr.nodes.iter().enumerate() {
        // Checked even when dead: the CPU evaluates every node.
        let mut e = node_expr(Dialect::Cuda, &l.expr, &l.loads, i, &offset, "i")?;
        if let (ExprOp::Load(slot), true) = (n.op, v.loads[i]) {
            e = load_value(l.loads[slot as usize].dtype, &format!("l{i}[e]"));
        }
        if live[i] {
            let _ = writeln!(out, "{pad}const {} v{i} = {e};", ctype(n.dtype));
        }
    }
    for (k, s) in l.stores.iter().enumerate() {
        let _ = match v.stores[k] {
            true => writeln!(out, "{pad}s{k}[e] = {};", stored_value(s)),
            false => writeln!(out, "{pad}{}", store_stmt(s, &offset(&s.view))),
        };
    }
    Ok(())
}

/// The address of the chunk at index `i0` of argument `arg` through a contiguous view from `offset`.
fn chunk_at(arg: u16, offset: usize) -> String {
    if offset > 0 { format!("a{arg} + {offset} + i0") } else { format!("a{arg} + i0") }
}
