//! Printing of a gather ([`GatherKernel`]): one thread per output element in a grid-stride
//! loop, reading its index, then the source element it names (or zero outside the gathered
//! dimension). Elements move as unsigned integers of their size, so the bits are the source's
//! for every dtype (a NaN's payload included). Must never: convert an element, or read the
//! source where the index is out of range.

use super::*;
use crate::kernel::GatherKernel;

/// The unsigned type of an element of `size` bytes.
fn bits_type(size: usize) -> &'static str {
    match size {
        1 => "unsigned char",
        2 => "unsigned short",
        4 => "unsigned int",
        _ => "unsigned long long",
    }
}

pub(super) fn print_gather(out: &mut String, g: &GatherKernel, name: &str, params: &[Param]) -> Result<Entry, String> {
    g.check(|a| params.get(a as usize).map(|p| (p.dtype, p.len)))?;
    if !params[g.out as usize].writable || params[g.src.arg as usize].writable || params[g.index.arg as usize].writable
    {
        return Err("a gather reads its source and index and writes its output".into());
    }
    let dims = &g.dims;
    let numel = g.numel();
    let t = bits_type(g.src.dtype.size());
    let _ = writeln!(
        out,
        "\n// A gather from {} positions over dims {:?}, one element per thread.\n{} {{",
        g.extent,
        dims.as_slice(),
        signature(name, params)
    );
    grid_loop(out, "i", numel);
    index_vars(out, "i", dims, None);
    let (ix, src) = (&g.index.view, &g.src.view);
    let _ = writeln!(out, "    const long long j = a{}[{}];", g.index.arg, offset_without(ix, None));
    let _ = writeln!(out, "    {t} v = 0;");
    let _ = writeln!(
        out,
        "    if (j >= 0 && j < {}LL) v = ((const {t}*)a{})[{} + j * {}LL];",
        g.extent,
        g.src.arg,
        offset_without(src, None),
        g.along
    );
    let _ = writeln!(out, "    (({t}*)a{})[i] = v;\n  }}\n}}", g.out);
    Ok(Entry { name: name.into(), launch: Launch::Map { numel, block: MAP_BLOCK } })
}
