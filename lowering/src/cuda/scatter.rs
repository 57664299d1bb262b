//! Printing of a scatter-add ([`ScatterKernel`]) as three entries launched in order: the output
//! zeroed; one thread per row of the source space (its elements that differ only along the
//! scattered dimension) adding the row's elements, in order, to the output elements their
//! indices name (rows write disjoint output elements, so no atomics, and each sum is folded in
//! one order: the bits of every run); then the base added, one thread per output element
//! (no entry for a base of zeros).
//! Integers add as unsigned types, so they wrap like the CPU's. Must never: write an output
//! element from two threads, or read the source where the index is out of range.

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
    let (d, t) = (s.dtype(), ctype(s.dtype()));
    let numel: usize = s.out_dims.iter().product();
    let (rows, k, dim) = (s.rows(), s.dims[s.dim], s.dim);
    let mut entries = vec![];
    let _ = writeln!(
        out,
        "\n// A scatter-add along dimension {dim}: the output zeroed.\n{} {{",
        signature(&format!("{name}_zero"), params)
    );
    grid_loop(out, "i", numel);
    let _ = writeln!(out, "    a{}[i] = 0;\n  }}\n}}", s.out);
    entries.push(Entry { name: format!("{name}_zero"), launch: Launch::Map { numel, block: MAP_BLOCK } });

    let _ = writeln!(
        out,
        "\n// {rows} rows of {k} elements, one per thread, added in order.\n{} {{",
        signature(&format!("{name}_scatter"), params)
    );
    grid_loop(out, "r", rows);
    index_vars(out, "r", &s.dims, Some(dim));
    // The output's strides over the source space (the same dims but along `dim`, left out).
    let out_strides = braid_graph::Shape::new(&s.out_dims).contiguous_strides();
    let out_view = View { dims: s.dims.clone(), strides: out_strides.into_iter().collect(), offset: 0 };
    let (sv, iv) = (&s.src.view, &s.index.view);
    let _ = writeln!(out, "    const long long src_at = {};", offset_without(sv, Some(dim)));
    let _ = writeln!(out, "    const long long index_at = {};", offset_without(iv, Some(dim)));
    let _ = writeln!(out, "    const long long out_at = {};", offset_without(&out_view, Some(dim)));
    let _ = writeln!(out, "    for (long long n = 0; n < {k}LL; ++n) {{");
    let _ = writeln!(out, "      const long long j = a{}[index_at + n * {}LL];", s.index.arg, iv.strides[dim]);
    let _ = writeln!(out, "      if (j < 0 || j >= {}LL) continue;", s.out_dims[dim]);
    let _ = writeln!(out, "      {t}* to = a{} + out_at + j * {}LL;", s.out, s.out_along());
    let _ =
        writeln!(out, "      *to = {};", add(d, "*to", &format!("a{}[src_at + n * {}LL]", s.src.arg, sv.strides[dim])));
    out.push_str("    }\n  }\n}\n");
    entries.push(Entry { name: format!("{name}_scatter"), launch: Launch::Map { numel: rows, block: MAP_BLOCK } });

    let Some(bl) = &s.base else { return Ok(entries) };
    let _ = writeln!(out, "\n// The base added to the sums.\n{} {{", signature(&format!("{name}_base"), params));
    grid_loop(out, "i", numel);
    index_vars(out, "i", &s.out_dims, None);
    let base = format!("a{}[{}]", bl.arg, offset_without(&bl.view, None));
    let _ = writeln!(out, "    a{}[i] = {};\n  }}\n}}", s.out, add(d, &base, &format!("a{}[i]", s.out)));
    entries.push(Entry { name: format!("{name}_base"), launch: Launch::Map { numel, block: MAP_BLOCK } });
    Ok(entries)
}
