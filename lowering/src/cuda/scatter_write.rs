//! Printing of a scatter ([`ScatterWriteKernel`]) as two entries launched in order: the base
//! copied into the output, a thread per element ([`Launch::Copy`]: the launcher skips it when
//! the base and the output are one buffer, the scatter written over its base), then a thread
//! per row of the source space writing the row's elements, in order, where their indices
//! name (a later write wins). Elements move as their storage type (the bits of any dtype).
//! Must never: write an element from two threads, or write outside the output (an index is
//! compared with the extent first).

use super::*;
use crate::kernel::ScatterWriteKernel;

pub(super) fn print_scatter_write(
    out: &mut String,
    s: &ScatterWriteKernel,
    name: &str,
    params: &[Param],
) -> Result<Vec<Entry>, String> {
    s.check(|a| params.get(a as usize).map(|p| (p.dtype, p.len)))?;
    let reads = [&s.src, &s.index, &s.base].map(|l| l.arg);
    if !params[s.out as usize].writable || reads.iter().any(|&a| params[a as usize].writable) {
        return Err("a scatter reads its base, index and source and writes its output".into());
    }
    let numel: usize = s.out_dims.iter().product();
    let (rows, k, dim) = (s.rows(), s.dims[s.dim], s.dim);
    let mut entries = vec![];

    let copy = format!("{name}_base");
    let _ = writeln!(out, "\n// A scatter along dimension {dim}: the base copied.\n{} {{", signature(&copy, params));
    grid_loop(out, "i", numel);
    index_vars(out, "i", &s.out_dims, None);
    let _ = writeln!(out, "    a{}[i] = a{}[{}];\n  }}\n}}", s.out, s.base.arg, offset_without(&s.base.view, None));
    let launch = if s.base_in_place() {
        Launch::Copy { numel, block: MAP_BLOCK, from: s.base.arg, to: s.out }
    } else {
        Launch::Map { numel, block: MAP_BLOCK }
    };
    entries.push(Entry { name: copy, launch });

    let _ = writeln!(
        out,
        "\n// {rows} rows of {k} elements written in order, a thread per row.\n{} {{",
        signature(name, params)
    );
    grid_loop(out, "r", rows);
    index_vars(out, "r", &s.dims, Some(dim));
    let out_strides = braid_graph::Shape::new(&s.out_dims).contiguous_strides();
    let out_view = View { dims: s.dims.clone(), strides: out_strides.into_iter().collect(), offset: 0 };
    let _ = writeln!(out, "    const long long src_at = {};", offset_without(&s.src.view, Some(dim)));
    let _ = writeln!(out, "    const long long index_at = {};", offset_without(&s.index.view, Some(dim)));
    let _ = writeln!(out, "    const long long out_at = {};", offset_without(&out_view, Some(dim)));
    let (index_step, src_step) = (s.index.view.strides[dim], s.src.view.strides[dim]);
    let _ = writeln!(out, "    for (long long n = 0; n < {k}LL; ++n) {{");
    let _ = writeln!(out, "      const long long j = (long long)a{}[index_at + n * {index_step}LL];", s.index.arg);
    let _ = writeln!(
        out,
        "      if (j >= 0 && j < {}LL) a{}[out_at + j * {}LL] = a{}[src_at + n * {src_step}LL];",
        s.out_dims[dim],
        s.out,
        s.out_along(),
        s.src.arg
    );
    out.push_str("    }\n  }\n}\n");
    entries.push(Entry { name: name.into(), launch: Launch::Map { numel: rows, block: MAP_BLOCK } });
    Ok(entries)
}
