//! Printing of map loops as entry points: one thread per index in a grid-stride loop (see the
//! module above), and where the views allow, a vector path before it: one thread per chunk of
//! `width` neighbouring indices, its loads and stores one access each (`vector.rs`) where
//! they are contiguous or walk whole chunks of contiguous rows (a permute of attention's heads,
//! the parts of a concatenation: [`chunked`]), the indices a chunk does not cover (the tail, or
//! all of them when an argument is not aligned at run time) left to the scalar loop. Rows whose
//! length is no multiple of the width but whose starts are aligned (a narrow of padded rows:
//! logits over 50,257 classes in rows of 50,304) are walked row by row instead ([`plan_rows`]):
//! each row's chunks start at its first index and its partial last chunk goes index by index.
//! Must never: assume a grid or block size (any grid covers the loop).

use super::vector::{Vector, aligned, copy_chunk, declare_chunk, read_chunk, width};
use super::*;

/// How a vector path numbers its chunks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Walk {
    /// Chunk `c` is indices `c * width ..`: the loop's indices in order.
    Flat,
    /// Rows of `n` indices (`n` no multiple of the width): each row's chunks start at its
    /// first index, and its last chunk is partial (its indices one by one).
    Rows(usize),
}

/// The vector path of `l`, if it has one, and how it walks: [`plan_flat`]'s, else
/// [`plan_rows`]'s.
fn plan_vector(l: &MapLoop, live: &[bool], bytes: usize) -> Option<(Vector, Walk)> {
    match plan_flat(l, live, bytes) {
        Some(v) => Some((v, Walk::Flat)),
        None => plan_rows(l, live, bytes),
    }
}

/// The live loads and the stores with a contiguous last dimension (the candidates a chunk
/// could walk), and the width their largest element gives (it fills `bytes`).
fn candidates(l: &MapLoop, live: &[bool], bytes: usize) -> Option<usize> {
    let nodes = &l.expr.nodes;
    let candidate =
        |v: &View| v.is_contiguous() || (v.dims.last().is_some_and(|&d| d > 1) && v.strides.last() == Some(&1));
    let loads = (0..nodes.len()).filter_map(|i| match nodes[i].op {
        ExprOp::Load(slot) if live[i] && candidate(&l.loads[slot as usize].view) => {
            Some(l.loads[slot as usize].dtype.size())
        }
        _ => None,
    });
    width(bytes, loads.chain(l.stores.iter().filter(|s| candidate(&s.view)).map(|s| s.dtype.size())))
}

/// The vector path over rows whose length `n` is no multiple of the width (a narrow of padded
/// rows: a language model's logits over a vocabulary of 50,257 in rows of 50,304): the live
/// loads and the stores, at least one, whose last dimension is contiguous and whose other
/// dimensions and offset step by multiples of the width, so that every row starts a chunk.
fn plan_rows(l: &MapLoop, live: &[bool], bytes: usize) -> Option<(Vector, Walk)> {
    let (last, n) = (l.dims.len().checked_sub(1)?, *l.dims.last()?);
    let width = candidates(l, live, bytes)?;
    if width <= 1 || n < width || n.is_multiple_of(width) {
        return None;
    }
    let walks = |v: &View| {
        v.strides.last() == Some(&1)
            && v.offset.is_multiple_of(width)
            && (0..last).all(|d| v.dims[d] <= 1 || v.strides[d].unsigned_abs().is_multiple_of(width))
    };
    let nodes = &l.expr.nodes;
    let loads: Vec<bool> = (0..nodes.len())
        .map(|i| matches!(nodes[i].op, ExprOp::Load(slot) if live[i] && walks(&l.loads[slot as usize].view)))
        .collect();
    let stores: Vec<bool> = l.stores.iter().map(|s| walks(&s.view)).collect();
    let any = loads.iter().chain(&stores).any(|&v| v);
    any.then_some((Vector { width, loads, stores }, Walk::Rows(n)))
}

/// The flat vector path of `l`, if it has one: the live loads and the stores, at least one, that
/// are contiguous or [`chunked`], whose offsets are multiples of the width (the largest
/// element fills `bytes`), over at least one chunk of indices.
fn plan_flat(l: &MapLoop, live: &[bool], bytes: usize) -> Option<Vector> {
    let nodes = &l.expr.nodes;
    // Views a chunk could walk: contiguous ones, and those whose last dimension is.
    let candidate =
        |v: &View| v.is_contiguous() || (v.dims.last().is_some_and(|&d| d > 1) && v.strides.last() == Some(&1));
    let load_of = |i: usize| match nodes[i].op {
        ExprOp::Load(slot) if live[i] && candidate(&l.loads[slot as usize].view) => Some(&l.loads[slot as usize]),
        _ => None,
    };
    let sizes = (0..nodes.len()).filter_map(|i| load_of(i).map(|ld| ld.dtype.size()));
    let width = width(bytes, sizes.chain(l.stores.iter().filter(|s| candidate(&s.view)).map(|s| s.dtype.size())))?;
    let walks = |v: &View| (v.is_contiguous() || chunked(v, width)) && v.offset.is_multiple_of(width);
    let loads: Vec<bool> = (0..nodes.len()).map(|i| load_of(i).is_some_and(|ld| walks(&ld.view))).collect();
    let stores: Vec<bool> = l.stores.iter().map(|s| walks(&s.view)).collect();
    let any = loads.iter().chain(&stores).any(|&v| v);
    (any && width > 1 && l.numel() >= width).then_some(Vector { width, loads, stores })
}

/// Whether a chunk of `width` neighbouring indices starting at a multiple of `width` reads
/// `width` neighbouring elements of `view`, starting at a multiple of `width` past its offset:
/// its last dimension is contiguous and a multiple of `width` long, and every other dimension
/// steps by a multiple of `width`. (A transpose of whole rows, a narrow of whole columns, a
/// permute of attention's heads.)
fn chunked(view: &View, width: usize) -> bool {
    let last = view.dims.len().saturating_sub(1);
    view.strides.get(last) == Some(&1)
        && view.dims[last].is_multiple_of(width)
        && (0..last).all(|d| view.dims[d] <= 1 || view.strides[d].unsigned_abs().is_multiple_of(width))
}

/// How a loop's threads are numbered: a whole launch's grid (an entry point of its own), or a
/// share of the blocks of a packed kernel (a device function given its first thread `t0` and
/// thread count `nt`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Grid {
    Launch,
    Share,
}

impl Grid {
    fn first(self) -> &'static str {
        match self {
            Grid::Launch => "(long long)blockIdx.x * blockDim.x + threadIdx.x",
            Grid::Share => "t0",
        }
    }

    fn stride(self) -> &'static str {
        match self {
            Grid::Launch => "(long long)gridDim.x * blockDim.x",
            Grid::Share => "nt",
        }
    }
}

/// Prints map loop `l` as an entry point, its vector accesses at most `vector_bytes` wide
/// (`PrintOptions::vector_bytes`).
pub(super) fn print_map(
    out: &mut String,
    l: &MapLoop,
    name: &str,
    params: &[Param],
    vector_bytes: usize,
) -> Result<Entry, String> {
    print_loop(out, l, name, params, Grid::Launch, vector_bytes)
}

/// [`print_map`] as an entry point (`Grid::Launch`) or as the device function of one loop of
/// a packed kernel (`Grid::Share`, see [`print_packed`]).
fn print_loop(
    out: &mut String,
    l: &MapLoop,
    name: &str,
    params: &[Param],
    grid: Grid,
    vector_bytes: usize,
) -> Result<Entry, String> {
    check_io(&l.loads, &l.stores, &l.expr, &l.dims, params)?;
    let numel = l.numel();
    let (live, views) = live(&l.expr, &l.loads, &l.stores);
    let strided: Vec<&View> = views.into_iter().filter(|v| !v.is_contiguous()).collect();
    let used = used_dims(&l.dims, &strided, false);
    let vector = plan_vector(l, &live, vector_bytes);
    let _ = writeln!(
        out,
        "\n// {numel} indices over dims {:?}, one per thread{}.\n{} {{",
        l.dims.as_slice(),
        match &vector {
            Some((v, Walk::Flat)) => format!(" ({} per thread where the arguments are aligned)", v.width),
            Some((v, Walk::Rows(n))) => {
                format!(" ({} per thread where the arguments are aligned, chunks starting each row of {n})", v.width)
            }
            None => String::new(),
        },
        match grid {
            Grid::Launch => signature(name, params),
            Grid::Share => share_signature(name, params, &loop_args(l)),
        }
    );
    let first = match &vector {
        Some((v, walk)) => {
            print_vector_path(out, l, v, *walk, &live, &used, grid)?;
            "vec_end"
        }
        None => "0",
    };
    let _ = writeln!(out, "  for (long long i = {first} + {}; i < {numel}LL; i += {}) {{", grid.first(), grid.stride());
    let scalar = Vector { width: 1, loads: vec![false; live.len()], stores: vec![false; l.stores.len()] };
    print_index(out, "    ", l, &scalar, &live, &used)?;
    out.push_str("  }\n}\n");
    // A vector path wants a thread per chunk; the scalar loop strides over whatever grid runs.
    let threads = match vector {
        None => numel,
        Some((v, Walk::Flat)) => numel.div_ceil(v.width),
        Some((v, Walk::Rows(n))) => numel / n * n.div_ceil(v.width),
    };
    Ok(Entry { name: name.into(), launch: Launch::Map { numel: threads, block: MAP_BLOCK } })
}

/// Prints the vector path: `vec` tests the arguments' alignment once, `vec_end` is the first
/// index it leaves to the scalar loop (0 when they are not aligned). Walking rows, chunk `c`
/// is chunk `c % per_row` of row `c / per_row`; a row's last, partial chunk goes index by index.
fn print_vector_path(
    out: &mut String,
    l: &MapLoop,
    v: &Vector,
    walk: Walk,
    live: &[bool],
    used: &[bool],
    grid: Grid,
) -> Result<(), String> {
    let (w, numel, nodes) = (v.width, l.numel(), &l.expr.nodes);
    let _ = writeln!(out, "  const bool vec = {};", aligned(&v.args(&l.expr, &l.loads, &l.stores)));
    match walk {
        Walk::Flat => {
            let _ = writeln!(out, "  const long long vec_end = vec ? {}LL : 0LL;", numel / w * w);
            let _ =
                writeln!(out, "  for (long long c = {}; c * {w} < vec_end; c += {}) {{", grid.first(), grid.stride());
            let _ = writeln!(out, "    const long long i0 = c * {w};");
        }
        Walk::Rows(n) => {
            let (per_row, full) = (n.div_ceil(w), n / w);
            let _ = writeln!(out, "  const long long vec_end = vec ? {numel}LL : 0LL;");
            let _ = writeln!(
                out,
                "  for (long long c = {}; vec && c < {}LL; c += {}) {{",
                grid.first(),
                numel / n * per_row,
                grid.stride()
            );
            let _ = writeln!(out, "    const long long row = c / {per_row}LL, k = c % {per_row}LL;");
            let _ = writeln!(out, "    const long long i0 = row * {n}LL + k * {w};");
            let _ = writeln!(out, "    if (k == {full}LL) {{");
            let _ = writeln!(out, "      for (long long i = i0; i < row * {n}LL + {n}LL; ++i) {{");
            let scalar = Vector { width: 1, loads: vec![false; live.len()], stores: vec![false; l.stores.len()] };
            print_index(out, "        ", l, &scalar, live, used)?;
            out.push_str(
                "      }
      continue;
    }
",
            );
        }
    }
    // Where the chunks of strided views start: their offsets at index `i0`, worked out in a
    // scope of their own (the indices' variables are declared again per element below).
    let loads = v.loads.iter().enumerate().filter(|&(_, &x)| x).map(|(i, _)| match nodes[i].op {
        ExprOp::Load(slot) => (format!("l{i}"), &l.loads[slot as usize]),
        _ => unreachable!("planned from loads"),
    });
    let loads: Vec<(String, &Load)> = loads.collect();
    let stores: Vec<(String, &Store)> =
        l.stores.iter().enumerate().filter(|&(k, _)| v.stores[k]).map(|(k, s)| (format!("s{k}"), s)).collect();
    let strided: Vec<(&str, &View)> = (loads.iter().map(|(n, ld)| (n.as_str(), &ld.view)))
        .chain(stores.iter().map(|(n, s)| (n.as_str(), &s.view)))
        .filter(|(_, view)| !view.is_contiguous())
        .collect();
    if !strided.is_empty() {
        let names: Vec<String> = strided.iter().map(|(n, _)| format!("at_{n}")).collect();
        let _ = writeln!(out, "    long long {};\n    {{", names.join(", "));
        decompose(out, "      ", "i0", &l.dims, &(0..l.dims.len()).collect::<Vec<_>>(), used);
        for (name, view) in &strided {
            let _ = writeln!(out, "      at_{name} = {};", offset_expr(view));
        }
        out.push_str("    }\n");
    }
    let chunk_at = |name: &str, arg: u16, view: &View| match view.is_contiguous() {
        true if view.offset > 0 => format!("a{arg} + {} + i0", view.offset),
        true => format!("a{arg} + i0"),
        false => format!("a{arg} + at_{name}"),
    };
    for (name, ld) in &loads {
        let from = chunk_at(name, ld.arg, &ld.view);
        read_chunk(out, "    ", name, (storage_ctype(ld.dtype), ld.dtype.size()), w, &from);
    }
    for (name, s) in &stores {
        declare_chunk(out, "    ", name, storage_ctype(s.dtype), w);
    }
    let _ = writeln!(out, "    #pragma unroll\n    for (int e = 0; e < {w}; ++e) {{");
    let _ = writeln!(out, "      const long long i = i0 + e;");
    print_index(out, "      ", l, v, live, used)?;
    out.push_str("    }\n");
    for (name, s) in &stores {
        copy_chunk(out, "    ", &chunk_at(name, s.arg, &s.view), name, s.dtype.size() * w);
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

/// The arguments a loop reads or writes, in increasing order: the parameters of its device
/// function in a packed kernel.
fn loop_args(l: &MapLoop) -> Vec<u16> {
    let mut args: Vec<u16> = l.loads.iter().map(|ld| ld.arg).chain(l.stores.iter().map(|s| s.arg)).collect();
    args.sort_unstable();
    args.dedup();
    args
}

/// The most blocks one loop of a packed kernel gets: its threads stride over the rest, as a
/// map loop's grid does (an H200's 132 multiprocessors take 32 blocks each in `launch.rs`).
const PACKED_BLOCKS_PER_LOOP: usize = 4096;

/// Several map loops as one entry point (a packed kernel: a multi-tensor update): each loop is
/// a device function, and the entry gives each loop a range of its blocks (as many as its
/// threads need, at most [`PACKED_BLOCKS_PER_LOOP`]), in which the loop strides as it would over
/// a grid of its own. One launch instead of one per loop; any block size covers every loop.
pub(super) fn print_packed(
    out: &mut String,
    loops: &[MapLoop],
    name: &str,
    params: &[Param],
    vector_bytes: usize,
) -> Result<Entry, String> {
    let mut ranges = vec![];
    let mut blocks = 0usize;
    for (k, l) in loops.iter().enumerate() {
        let loop_name = format!("{name}_part{k}");
        let entry = print_loop(out, l, &loop_name, params, Grid::Share, vector_bytes)?;
        let Launch::Map { numel: threads, block } = entry.launch else { unreachable!("a loop launches as a map") };
        if threads == 0 {
            continue;
        }
        let own = threads.div_ceil(block as usize).min(PACKED_BLOCKS_PER_LOOP);
        ranges.push((loop_name, k, blocks, own));
        blocks += own;
    }
    let _ = writeln!(
        out,
        "\n// {} loops, one launch: each a range of the blocks.\n{} {{",
        ranges.len(),
        signature(name, params)
    );
    out.push_str("  const long long b = blockIdx.x;\n");
    for (loop_name, k, first, own) in &ranges {
        let args: String = loop_args(&loops[*k]).iter().map(|a| format!("a{a}, ")).collect();
        let _ = writeln!(
            out,
            "  if (b < {}LL) {{ {loop_name}({args}(b - {first}LL) * blockDim.x + threadIdx.x, {own}LL * blockDim.x); return; }}",
            first + own
        );
    }
    out.push_str("}\n");
    Ok(Entry { name: name.into(), launch: Launch::Rows { rows: blocks, threads: MAP_BLOCK } })
}
