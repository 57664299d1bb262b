//! Gathers ([`GatherKernel`]) and scatter-adds ([`ScatterKernel`]) as WGSL entries, for indices
//! in i32 (wgpu holds no i64; the engine refuses an i64 tensor there when it is recorded).
//!
//! - A gather is one entry, one thread per output element: it reads its index, then the source
//!   element it names, moving the element's bits unconverted (a half's or a NaN's bits stay
//!   as they are), or zero bits where the index is outside `0..extent`.
//! - A scatter-add is up to three entries, dispatched in order: the output zeroed; threads for
//!   each row of the source space (its elements that differ only along the scattered
//!   dimension), each owning the output elements whose index is its own modulo their count
//!   ([`ScatterKernel::parts_per_row`], as on CUDA), adding the row's elements to them in order; the base added. Every
//!   output element is written by one thread in one order of adds, as on the CPU and CUDA: no
//!   atomics on values, the same bits on every run (sub-word outputs use the packed atomic
//!   stores of [`memory`], which only keep neighbouring threads' bytes apart).
//!
//! - A scatter is two entries: the base's bits copied into the output (skipped by the runtime
//!   when they are one buffer: [`Entry::copy`]), then a thread per row of the source space
//!   writing the row's elements in order where their indices name (a later write wins).
//!
//! Offsets are u32 with wrapping arithmetic, as everywhere in this printer. Must never: read
//! the source or write the output at an index outside its range, or add a row's elements out
//! of order.

use super::*;
use crate::kernel::{GatherKernel, ScatterKernel, ScatterWriteKernel, View};

/// ` + var * stride` (or ` - ...` for a negative stride) in wrapping u32 arithmetic.
fn term(var: &str, stride: isize) -> String {
    let sign = if stride < 0 { '-' } else { '+' };
    format!(" {sign} {var} * {}u", stride.unsigned_abs())
}

/// `view`'s offset with dimension `skip` left out (its index variable is not declared).
fn offset_without(view: &View, skip: usize) -> String {
    let mut v = view.clone();
    v.dims[skip] = 1;
    memory::offset(&v)
}

/// The index-dtype and extent checks both kernels share.
fn check_index(index: DType, extent: usize) -> Result<(), String> {
    if index != DType::I32 {
        return Err(format!("{}: wgpu kernels read i32 indices", super::refusal(index)));
    }
    if extent as u64 >= 1 << 31 {
        return Err(format!("an indexed dimension of {extent} elements: i32 indices reach 2^31 - 1"));
    }
    Ok(())
}

pub(super) fn print_gather(m: &mut Module<'_>, g: &GatherKernel) -> Result<(), String> {
    g.check(|a| m.params.get(a as usize).map(|p| (p.dtype, p.len)))?;
    check_index(g.index.dtype, g.extent)?;
    let numel = g.numel();
    if numel == 0 {
        return Ok(());
    }
    if numel as u64 >= 1 << 32 {
        return Err(format!("a gather of {numel} elements: wgpu kernels index with u32"));
    }
    let written = m.written();
    let groups = (numel as u64).div_ceil(MAP_THREADS as u64);
    let comment = format!("A gather from {} positions over dims {:?}, one element per thread.", g.extent, &g.dims[..]);
    m.begin_entry("gather", groups, MAP_THREADS, &comment)?;
    let out = &mut m.body;
    let _ = writeln!(out, "  let i = wg * {MAP_THREADS}u + lid;\n  if (i >= {numel}u) {{ return; }}");
    let all: Vec<usize> = (0..g.dims.len()).collect();
    memory::decompose(out, "  ", "i", &g.dims, &all);
    let index = memory::load(g.index.arg, DType::I32, false, &memory::offset(&g.index.view))?;
    let _ = writeln!(out, "  let j = {index};\n  var bits = 0u;");
    let at = format!("{}{}", memory::offset(&g.src.view), term("u32(j)", g.along));
    let _ = writeln!(
        out,
        "  if (j >= 0 && u32(j) < {}u) {{ bits = {}; }}",
        g.extent,
        memory::load_bits(g.src.arg, g.src.dtype, written[g.src.arg as usize], &at)?
    );
    let _ = writeln!(out, "  {}\n}}", memory::store_bits(g.out, g.src.dtype, "i", "bits")?);
    Ok(())
}

/// `a + b` in `d`'s arithmetic (integers wrap; a u8 register is a u32 kept below 256).
fn add(d: DType, a: &str, b: &str) -> String {
    match d {
        DType::U8 => format!("(({a} + {b}) & 0xffu)"),
        _ => format!("({a} + {b})"),
    }
}

pub(super) fn print_scatter(m: &mut Module<'_>, s: &ScatterKernel) -> Result<(), String> {
    s.check(|a| m.params.get(a as usize).map(|p| (p.dtype, p.len)))?;
    let (d, dim) = (s.dtype(), s.dim);
    check_index(s.index.dtype, s.out_dims[dim])?;
    let numel: usize = s.out_dims.iter().product();
    if numel == 0 {
        return Ok(());
    }
    let (rows, k) = (s.rows(), s.dims[dim]);
    let parts = s.parts_per_row();
    if numel as u64 >= 1 << 32 || (rows * parts) as u64 >= 1 << 32 {
        return Err(format!("a scatter-add into {numel} elements: wgpu kernels index with u32"));
    }
    let written = m.written();
    let groups = |n: usize| (n as u64).div_ceil(MAP_THREADS as u64);
    let out_view = View::contiguous(&braid_graph::Shape::new(&s.out_dims));

    m.begin_entry("scatter_zero", groups(numel), MAP_THREADS, "A scatter-add: the output zeroed.")?;
    let _ = writeln!(m.body, "  let i = wg * {MAP_THREADS}u + lid;\n  if (i >= {numel}u) {{ return; }}");
    let _ = writeln!(m.body, "  {}\n}}", memory::store(s.out, d, "i", &zero(d))?);

    if rows > 0 && k > 0 {
        let threads = rows * parts;
        let comment = format!("{rows} rows of {k} elements, {parts} threads per row, each its indices modulo {parts}.");
        m.begin_entry("scatter_rows", groups(threads), MAP_THREADS, &comment)?;
        let out = &mut m.body;
        let _ = writeln!(out, "  let t = wg * {MAP_THREADS}u + lid;\n  if (t >= {threads}u) {{ return; }}");
        let _ = writeln!(out, "  let r = t % {rows}u;\n  let part = t / {rows}u;");
        let which: Vec<usize> = (0..s.dims.len()).filter(|&x| x != dim).collect();
        memory::decompose(out, "  ", "r", &s.dims, &which);
        // The output's strides over the source space (its dims but along `dim`).
        let out_strides = View { dims: s.dims.clone(), ..out_view.clone() };
        let _ = writeln!(out, "  let src_at = {};", offset_without(&s.src.view, dim));
        let _ = writeln!(out, "  let index_at = {};", offset_without(&s.index.view, dim));
        let _ = writeln!(out, "  let out_at = {};", offset_without(&out_strides, dim));
        let _ = writeln!(out, "  for (var n = 0u; n < {k}u; n++) {{");
        let j =
            memory::load(s.index.arg, DType::I32, false, &format!("index_at{}", term("n", s.index.view.strides[dim])))?;
        let _ = writeln!(out, "    let j = {j};");
        let _ = writeln!(
            out,
            "    if (j < 0 || u32(j) >= {}u || (u32(j) & {}u) != part) {{ continue; }}",
            s.out_dims[dim],
            parts - 1
        );
        let at = format!("out_at{}", term("u32(j)", s.out_along()));
        let v = memory::load(
            s.src.arg,
            d,
            written[s.src.arg as usize],
            &format!("src_at{}", term("n", s.src.view.strides[dim])),
        )?;
        let old = memory::load(s.out, d, true, &at)?;
        // The sum is taken before the store: a packed store clears the element's bits first.
        let _ = writeln!(out, "    let sum = {};", add(d, &old, &v));
        let _ = writeln!(out, "    {}\n  }}\n}}", memory::store(s.out, d, &at, "sum")?);
    }

    if let Some(b) = &s.base {
        m.begin_entry("scatter_base", groups(numel), MAP_THREADS, "The base added to the sums.")?;
        let out = &mut m.body;
        let _ = writeln!(out, "  let i = wg * {MAP_THREADS}u + lid;\n  if (i >= {numel}u) {{ return; }}");
        let all: Vec<usize> = (0..s.out_dims.len()).collect();
        memory::decompose(out, "  ", "i", &s.out_dims, &all);
        let base = memory::load_of(b, &written)?;
        let sum = memory::load(s.out, d, true, "i")?;
        let _ = writeln!(out, "  let total = {};", add(d, &base, &sum));
        let _ = writeln!(out, "  {}\n}}", memory::store(s.out, d, "i", "total")?);
    }
    Ok(())
}

pub(super) fn print_scatter_write(m: &mut Module<'_>, s: &ScatterWriteKernel) -> Result<(), String> {
    s.check(|a| m.params.get(a as usize).map(|p| (p.dtype, p.len)))?;
    let (d, dim) = (s.dtype(), s.dim);
    check_index(s.index.dtype, s.out_dims[dim])?;
    let numel: usize = s.out_dims.iter().product();
    let (rows, k) = (s.rows(), s.dims[dim]);
    if numel as u64 >= 1 << 32 || rows as u64 >= 1 << 32 {
        return Err(format!("a scatter into {numel} elements: wgpu kernels index with u32"));
    }
    if numel == 0 {
        return Ok(());
    }
    let written = m.written();
    let groups = |n: usize| (n as u64).div_ceil(MAP_THREADS as u64);
    m.begin_entry("scatter_base", groups(numel), MAP_THREADS, "A scatter: the base copied.")?;
    if s.base_in_place() {
        m.skip_when_one_buffer(s.base.arg, s.out);
    }
    let out = &mut m.body;
    let _ = writeln!(out, "  let i = wg * {MAP_THREADS}u + lid;\n  if (i >= {numel}u) {{ return; }}");
    let all: Vec<usize> = (0..s.out_dims.len()).collect();
    memory::decompose(out, "  ", "i", &s.out_dims, &all);
    let bits = memory::load_bits(s.base.arg, d, written[s.base.arg as usize], &memory::offset(&s.base.view))?;
    let _ = writeln!(out, "  {}\n}}", memory::store_bits(s.out, d, "i", &bits)?);

    if rows > 0 && k > 0 {
        let comment = format!("{rows} rows of {k} elements written in order, a thread per row.");
        m.begin_entry("scatter_rows", groups(rows), MAP_THREADS, &comment)?;
        let out = &mut m.body;
        let _ = writeln!(out, "  let r = wg * {MAP_THREADS}u + lid;\n  if (r >= {rows}u) {{ return; }}");
        let which: Vec<usize> = (0..s.dims.len()).filter(|&x| x != dim).collect();
        memory::decompose(out, "  ", "r", &s.dims, &which);
        let out_view = View::contiguous(&braid_graph::Shape::new(&s.out_dims));
        let out_strides = View { dims: s.dims.clone(), ..out_view };
        let _ = writeln!(out, "  let src_at = {};", offset_without(&s.src.view, dim));
        let _ = writeln!(out, "  let index_at = {};", offset_without(&s.index.view, dim));
        let _ = writeln!(out, "  let out_at = {};", offset_without(&out_strides, dim));
        let _ = writeln!(out, "  for (var n = 0u; n < {k}u; n++) {{");
        let j =
            memory::load(s.index.arg, DType::I32, false, &format!("index_at{}", term("n", s.index.view.strides[dim])))?;
        let _ = writeln!(out, "    let j = {j};");
        let _ = writeln!(out, "    if (j < 0 || u32(j) >= {}u) {{ continue; }}", s.out_dims[dim]);
        let from = format!("src_at{}", term("n", s.src.view.strides[dim]));
        let bits = memory::load_bits(s.src.arg, d, written[s.src.arg as usize], &from)?;
        let at = format!("out_at{}", term("u32(j)", s.out_along()));
        let _ = writeln!(out, "    {}\n  }}\n}}", memory::store_bits(s.out, d, &at, &bits)?);
    }
    Ok(())
}

/// A zero register of `d` (a scatter-add's dtype: f32, i32 or u8 on wgpu).
fn zero(d: DType) -> String {
    match d {
        DType::F32 => "0.0".into(),
        DType::I32 => "0i".into(),
        _ => "0u".into(),
    }
}
