//! Printing of a scatter-add ([`ScatterKernel`]) as three entries launched in order: the output
//! zeroed; threads for each row of the source space (its elements that differ only along the
//! scattered dimension: [`ScatterKernel::parts_per_row`] of them, each owning the output elements whose index
//! is its own modulo their count) adding the row's elements, in order, to the output elements
//! their indices name, a batch of indices and values loaded ahead ([`print_row_fold`]; every
//! output element has one thread, so no atomics, and each sum is folded in one order: the bits
//! of every run), or, when every row reads the same indices (an embedding's gradient), a warp
//! per 32 rows and part that reads each index once for its lanes ([`print_shared_index`]);
//! then the base added, one thread per output element (no entry for a base of
//! zeros). Integers add as unsigned types, so they wrap like the CPU's. Must never: write an
//! output element from two threads, change the order of a sum's adds, or read outside the
//! views `check` bounded (an output element only where its index is in range).

use super::*;
use crate::kernel::ScatterKernel;

/// `a + b` in dtype `d`'s arithmetic (wrapping for integers).
fn add(d: DType, a: &str, b: &str) -> String {
    match d {
        DType::I32 => format!("(int)((unsigned int)({a}) + (unsigned int)({b}))"),
        DType::I64 => format!("(long long)((unsigned long long)({a}) + (unsigned long long)({b}))"),
        DType::U8 => format!("(unsigned char)({a} + {b})"),
        _ => format!("{a} + {b}"),
    }
}

pub(super) fn print_scatter(
    out: &mut String,
    s: &ScatterKernel,
    name: &str,
    params: &[Param],
) -> Result<Vec<Entry>, String> {
    s.check(|a| params.get(a as usize).map(|p| (p.dtype, p.len)))?;
    let mut reads = [Some(&s.src), Some(&s.index), s.base.as_ref()].into_iter().flatten().map(|l| l.arg);
    if !params[s.out as usize].writable || reads.any(|a| params[a as usize].writable) {
        return Err("a scatter-add reads its base, index and source and writes its output".into());
    }
    let d = s.dtype();
    let numel: usize = s.out_dims.iter().product();
    let dim = s.dim;
    let mut entries = vec![];
    let _ = writeln!(
        out,
        "\n// A scatter-add along dimension {dim}: the output zeroed.\n{} {{",
        signature(&format!("{name}_zero"), params)
    );
    grid_loop(out, "i", numel);
    let _ = writeln!(out, "    a{}[i] = 0;\n  }}\n}}", s.out);
    entries.push(Entry { name: format!("{name}_zero"), launch: Launch::Map { numel, block: MAP_BLOCK } });

    if shares_index(s) {
        print_shared_index(out, s, &format!("{name}_scatter"), params, &mut entries);
    } else {
        print_rows_scatter(out, s, &format!("{name}_scatter"), params, &mut entries);
    }

    let Some(bl) = &s.base else { return Ok(entries) };
    let _ = writeln!(out, "\n// The base added to the sums.\n{} {{", signature(&format!("{name}_base"), params));
    grid_loop(out, "i", numel);
    index_vars(out, "i", &s.out_dims, None);
    let base = format!("a{}[{}]", bl.arg, offset_without(&bl.view, None));
    let _ = writeln!(out, "    a{}[i] = {};\n  }}\n}}", s.out, add(d, &base, &format!("a{}[i]", s.out)));
    entries.push(Entry { name: format!("{name}_base"), launch: Launch::Map { numel, block: MAP_BLOCK } });
    Ok(entries)
}

/// The scatter entry of a kernel whose rows read indices of their own: threads for each row.
fn print_rows_scatter(out: &mut String, s: &ScatterKernel, name: &str, params: &[Param], entries: &mut Vec<Entry>) {
    let (rows, k, dim) = (s.rows(), s.dims[s.dim], s.dim);
    let parts = s.parts_per_row();
    let _ = writeln!(
        out,
        "\n// {rows} rows of {k} elements, {parts} threads per row, each its indices modulo {parts}, in order.\n{} {{",
        signature(name, params)
    );
    grid_loop(out, "t", rows * parts);
    let _ = writeln!(
        out,
        "    const long long r = t % {}LL;\n    const long long part = t / {}LL;",
        rows.max(1),
        rows.max(1)
    );
    index_vars(out, "r", &s.dims, Some(dim));
    // The output's strides over the source space (the same dims but along `dim`, left out).
    let out_strides = braid_graph::Shape::new(&s.out_dims).contiguous_strides();
    let out_view = View { dims: s.dims.clone(), strides: out_strides.into_iter().collect(), offset: 0 };
    let (sv, iv) = (&s.src.view, &s.index.view);
    let _ = writeln!(out, "    const long long src_at = {};", offset_without(sv, Some(dim)));
    let _ = writeln!(out, "    const long long index_at = {};", offset_without(iv, Some(dim)));
    let _ = writeln!(out, "    const long long out_at = {};", offset_without(&out_view, Some(dim)));
    print_row_fold(out, s, ctype(s.dtype()), parts);
    entries.push(Entry { name: name.into(), launch: Launch::Map { numel: rows * parts, block: MAP_BLOCK } });
}

/// Elements of a row each thread handles at once (see [`print_row_fold`]).
const SCATTER_BATCH: usize = 16;

/// Rows a warp of the shared-index path works on: a lane each.
const WARP_ROWS: usize = 32;

/// Warps the shared-index path aims for (about 32 on each of an H200's 132 multiprocessors):
/// its groups of rows times its parts.
const SHARED_INDEX_WARPS: usize = 4096;

/// Hits a lane adds at once in the shared-index path: their old sums loaded together, as in
/// [`print_row_fold`].
const HIT_BATCH: usize = 8;

/// Chunks of a warp's lanes' worth of indices the shared-index path reads at once (so many
/// loads in flight, then a ballot each).
const INDEX_CHUNKS: usize = 16;

/// Whether every row of `s`'s source space reads the same indices (the index's strides are 0
/// across rows): an embedding's gradient, whose index is the token ids broadcast over the
/// width.
fn shares_index(s: &ScatterKernel) -> bool {
    (0..s.dims.len()).all(|d| d == s.dim || s.dims[d] <= 1 || s.index.view.strides[d] == 0)
}

/// The scatter entry of a kernel whose rows share their indices ([`shares_index`]): a warp per
/// group of [`WARP_ROWS`] rows and part (parts as in [`ScatterKernel::parts_per_row`], here a
/// power of two for about [`SHARED_INDEX_WARPS`] warps), a lane per row. The warp reads
/// [`INDEX_CHUNKS`] chunks of indices at once, a lane's index of each, finds this part's among
/// them with a ballot per chunk, and walks them in order, gathering [`HIT_BATCH`] hits at a time
/// (across chunks): each lane then loads its row's source elements and old sums for the batch
/// at once, adds in order and stores. Each sum is still folded by one lane in the order of the
/// source positions, as in [`print_rows_scatter`], but each index is read once per warp, not
/// once per thread, and the round trips to memory are a batch's, not a hit's: GPT-2's
/// embedding gradient (768 rows of 8,192 elements) took 0.98 ms on an H200 with a thread per
/// row and part, every one reading all 8,192 indices, 0.36 ms with a chunk and a round trip
/// per ballot, and 0.33 ms as printed here: its ids are bytes, so a few parts (ids modulo the
/// parts: the space's, `e`'s) hold most positions, and their warps add some 1,500 each, a batch
/// at a time (balancing parts by the ids' counts is what is left). Blocks are one warp (or fewer lanes, a power of two: a lane then walks the
/// group's rows in turns); the loops around the ballots and shuffles are the same for every
/// lane.
fn print_shared_index(out: &mut String, s: &ScatterKernel, name: &str, params: &[Param], entries: &mut Vec<Entry>) {
    let (rows, k, dim, d) = (s.rows(), s.dims[s.dim], s.dim, s.dtype());
    let t = ctype(d);
    let extent = s.out_dims[dim];
    let groups = rows.div_ceil(WARP_ROWS);
    let most = (SHARED_INDEX_WARPS / groups.max(1)).clamp(1, 64).min(extent.max(1));
    let parts = 1usize << most.ilog2();
    let index_step = s.index.view.strides[dim];
    let (u, b) = (INDEX_CHUNKS, HIT_BATCH);
    let _ = writeln!(
        out,
        "\n// {rows} rows of {k} elements sharing their indices: a warp per {WARP_ROWS} rows and part ({parts} parts, \
         each the indices modulo {parts}), a lane per row, the part's indices in order.\n{} {{",
        signature(name, params)
    );
    out.push_str("  const unsigned lanes = blockDim.x;\n");
    out.push_str("  const unsigned mask = lanes >= 32u ? 0xffffffffu : (1u << lanes) - 1u;\n");
    let _ = writeln!(out, "  const long long group = blockIdx.x % {groups}LL, part = blockIdx.x / {groups}LL;");
    let _ = writeln!(out, "  long long hit_j[{b}], hit_n[{b}];\n  int count = 0;");
    let _ = writeln!(out, "  for (long long n0 = 0; n0 < {k}LL; n0 += (long long)lanes * {u}) {{");
    let _ = writeln!(out, "    long long j[{u}];\n    unsigned hits[{u}];");
    let _ = writeln!(out, "    #pragma unroll\n    for (int u = 0; u < {u}; ++u) {{");
    out.push_str("      const long long n = n0 + (long long)u * lanes + threadIdx.x;\n");
    let _ = writeln!(
        out,
        "      j[u] = n < {k}LL ? (long long)a{}[{}LL + n * {index_step}LL] : -1;\n    }}",
        s.index.arg, s.index.view.offset
    );
    let mine = if parts > 1 { format!(" && (j[u] & {}LL) == part", parts - 1) } else { String::new() };
    let _ = writeln!(
        out,
        "    #pragma unroll\n    for (int u = 0; u < {u}; ++u) hits[u] = __ballot_sync(mask, j[u] >= 0 && j[u] < {extent}LL{mine});"
    );
    let _ = writeln!(out, "    #pragma unroll\n    for (int u = 0; u < {u}; ++u) {{");
    out.push_str("      while (hits[u] != 0u) {\n");
    out.push_str("        const int lane = __ffs(hits[u]) - 1;\n        hits[u] &= hits[u] - 1u;\n");
    out.push_str("        const long long hj = __shfl_sync(mask, j[u], lane);\n");
    // Registers, not local memory: the batch's slot by comparison, not by a run-time index.
    let _ = writeln!(
        out,
        "        #pragma unroll\n        for (int b = 0; b < {b}; ++b) if (b == count) {{ hit_j[b] = hj; hit_n[b] = n0 + (long long)u * lanes + lane; }}"
    );
    let _ = writeln!(out, "        if (++count == {b}) {{");
    add_hits(out, s, t, "          ");
    out.push_str("          count = 0;\n        }\n      }\n    }\n  }\n");
    add_hits(out, s, t, "  ");
    out.push_str("}\n");
    let threads = WARP_ROWS as u32;
    entries.push(Entry { name: name.into(), launch: Launch::Rows { rows: groups * parts, threads } });
}

/// Prints the adds of a batch of `count` hits (`hit_j`, `hit_n`) in the shared-index path: for
/// each of this lane's rows of the group, the batch's source elements and old sums loaded at
/// once, each hit added in order (one whose element an earlier hit of the batch named adds to
/// that one's new sum), then stored in order.
fn add_hits(out: &mut String, s: &ScatterKernel, t: &str, pad: &str) {
    let (b, dim, rows) = (HIT_BATCH, s.dim, s.rows());
    let (src_step, along) = (s.src.view.strides[dim], s.out_along());
    let _ = writeln!(out, "{pad}for (long long turn = threadIdx.x; turn < {WARP_ROWS}LL; turn += lanes) {{");
    let _ = writeln!(out, "{pad}  const long long r = group * {WARP_ROWS}LL + turn;");
    let _ = writeln!(out, "{pad}  if (r >= {rows}LL) break;");
    index_vars(out, "r", &s.dims, Some(dim));
    let out_strides = braid_graph::Shape::new(&s.out_dims).contiguous_strides();
    let out_view = View { dims: s.dims.clone(), strides: out_strides.into_iter().collect(), offset: 0 };
    let _ = writeln!(out, "{pad}  const long long src_at = {};", offset_without(&s.src.view, Some(dim)));
    let _ = writeln!(out, "{pad}  const long long out_at = {};", offset_without(&out_view, Some(dim)));
    let _ = writeln!(out, "{pad}  {t} v[{b}], sum[{b}];");
    let at = format!("a{}[out_at + hit_j[b] * {along}LL]", s.out);
    let _ = writeln!(
        out,
        "{pad}  #pragma unroll\n{pad}  for (int b = 0; b < {b}; ++b) if (b < count) {{ v[b] = a{}[src_at + hit_n[b] * {src_step}LL]; sum[b] = {at}; }}",
        s.src.arg
    );
    let _ = writeln!(out, "{pad}  #pragma unroll\n{pad}  for (int b = 0; b < {b}; ++b) if (b < count) {{");
    let _ = writeln!(
        out,
        "{pad}    #pragma unroll\n{pad}    for (int c = 0; c < b; ++c) if (hit_j[c] == hit_j[b]) sum[b] = sum[c];"
    );
    let _ = writeln!(out, "{pad}    sum[b] = {};\n{pad}  }}", add(s.dtype(), "sum[b]", "v[b]"));
    let _ = writeln!(out, "{pad}  #pragma unroll\n{pad}  for (int b = 0; b < {b}; ++b) if (b < count) {at} = sum[b];");
    let _ = writeln!(out, "{pad}}}");
}

/// The loop of a row's thread (its `src_at`, `index_at`, `out_at` and `part` declared): the
/// row's elements in batches of [`SCATTER_BATCH`], each batch's indices and values loaded one
/// batch ahead (a value only where the index is this thread's). With several threads per row,
/// each of a batch's elements that is this thread's is added in turn. With one, the batch's old
/// sums are loaded at once, then added in order in registers (an element whose index an
/// earlier element of the batch named adds to that element's new sum, not to the value loaded),
/// then stored in order, so a later store to the same element wins: one round trip to memory
/// per batch instead of one per element (a row whose indices all name one element). Either way
/// each sum is folded in exactly the order of one add at a time. Positions past the row's end
/// take index -1 and read nothing.
fn print_row_fold(out: &mut String, s: &ScatterKernel, t: &str, parts: usize) {
    let (k, d) = (s.dims[s.dim], s.dtype());
    // A row shorter than a batch is one batch of its length.
    let b = k.clamp(1, SCATTER_BATCH);
    let (index_step, src_step) = (s.index.view.strides[s.dim], s.src.view.strides[s.dim]);
    let (extent, along) = (s.out_dims[s.dim], s.out_along());
    // This thread's share of the row: the elements whose index is `part` modulo `parts`.
    let mine = |j: &str| if parts > 1 { format!(" && ({j} & {}LL) == part", parts - 1) } else { String::new() };
    let load_batch = |out: &mut String, pad: &str, first: &str| {
        let _ = writeln!(out, "{pad}#pragma unroll\n{pad}for (int b = 0; b < {b}; ++b) {{");
        let _ = writeln!(out, "{pad}  const long long n = {first} + b;");
        let _ = writeln!(out, "{pad}  next_j[b] = n < {k}LL ? a{}[index_at + n * {index_step}LL] : -1;", s.index.arg);
        let _ = writeln!(
            out,
            "{pad}  next_v[b] = n < {k}LL{} ? a{}[src_at + n * {src_step}LL] : ({t})0;",
            mine("next_j[b]"),
            s.src.arg
        );
        let _ = writeln!(out, "{pad}}}");
    };
    let _ = writeln!(out, "    long long next_j[{b}];\n    {t} next_v[{b}];");
    load_batch(out, "    ", "0LL");
    let _ = writeln!(out, "    for (long long n0 = 0; n0 < {k}LL; n0 += {b}) {{");
    let sums = if parts > 1 { String::new() } else { format!(", sum[{b}]") };
    let _ = writeln!(out, "      long long j[{b}];\n      {t} v[{b}]{sums};");
    let _ = writeln!(
        out,
        "      #pragma unroll\n      for (int b = 0; b < {b}; ++b) {{ j[b] = next_j[b]; v[b] = next_v[b]; }}"
    );
    // The next batch's indices and values, in flight while this one adds.
    load_batch(out, "      ", &format!("n0 + {b}"));
    let inside = format!("j[b] >= 0 && j[b] < {extent}LL{}", mine("j[b]"));
    let at = format!("a{}[out_at + j[b] * {along}LL]", s.out);
    if parts > 1 {
        // A share of the row: few of a batch's elements are this thread's, so each adds in
        // turn (the batch's loads are what is in flight); many threads hide the round trips.
        let _ = writeln!(
            out,
            "      #pragma unroll\n      for (int b = 0; b < {b}; ++b) if ({inside}) {at} = {};",
            add(d, &at, "v[b]")
        );
        out.push_str("    }\n  }\n}\n");
        return;
    }
    let _ =
        writeln!(out, "      #pragma unroll\n      for (int b = 0; b < {b}; ++b) sum[b] = {inside} ? {at} : ({t})0;");
    let _ = writeln!(out, "      #pragma unroll\n      for (int b = 0; b < {b}; ++b) {{");
    out.push_str("        #pragma unroll\n        for (int c = 0; c < b; ++c) if (j[c] == j[b]) sum[b] = sum[c];\n");
    let _ = writeln!(out, "        sum[b] = {};\n      }}", add(d, "sum[b]", "v[b]"));
    let _ = writeln!(out, "      #pragma unroll\n      for (int b = 0; b < {b}; ++b) if ({inside}) {at} = sum[b];");
    out.push_str("    }\n  }\n}\n");
}
