//! Matrix products: a tiled product, then the epilogue (a map loop over the product).
//!
//! Each workgroup computes a 16 x 16 tile of one batch's `m x n` product, one output per
//! thread: it walks `k` in steps of 16, each thread loading one element of each operand's
//! tile into workgroup memory, and adds the tile's products in order of `k`. Operands are
//! read through their strides and per-batch offsets, computed from the batch index (the
//! broadcast batch dimensions, recovered from the offsets the lowering lists). f32 (and
//! f16/bf16 widened to f32) accumulate in f32; i32 and u8 wrap. The product is written contiguously (`[batch, m, n]`)
//! to its argument or to a scratch binding, rounded to its storage type.

use super::*;
use crate::kernel::MatmulKernel;

const TILE: usize = 16;

/// The element offset of batch `b`'s matrix: a formula (see [`batch_levels`]), else, for a
/// list no formula gives (never produced by braid's lowering), a lookup in a table declared
/// in `decls`.
pub(super) fn batch_offset(decls: &mut String, name: &str, offsets: &[usize]) -> String {
    if let Some((first, levels)) = batch_levels(offsets) {
        let mut e = format!("({first}u");
        for (div, n, step) in levels {
            let index = match (div, div * n == offsets.len()) {
                (1, true) => "b".to_string(),
                (1, false) => format!("(b % {n}u)"),
                (d, true) => format!("(b / {d}u)"),
                (d, false) => format!("((b / {d}u) % {n}u)"),
            };
            let sign = if step < 0 { '-' } else { '+' };
            let _ = write!(e, " {sign} {index} * {}u", step.unsigned_abs());
        }
        return e + ")";
    }
    let list: Vec<String> = offsets.iter().map(|o| format!("{o}u")).collect();
    let _ = writeln!(
        decls,
        "var<private> {name}: array<u32, {}> = array<u32, {}>({});",
        offsets.len(),
        offsets.len(),
        list.join(", ")
    );
    format!("{name}[b]")
}

/// One level of batch offsets: `((b / div) % n) * step`.
pub(super) type BatchLevel = (usize, usize, i128);

/// `offsets` as `first + sum of ((b / div) % n) * step` over levels `(div, n, step)`, innermost
/// first: the batch dimensions of a broadcast product (a `[n, 1]` batch against a `[1, n]`
/// one reads `[0, 0, .., 4, 4, ..]` and `[0, 4, 8, .., 0, 4, ..]`), recovered from the offsets
/// the lowering lists, so that the shader computes them instead of copying a table of one
/// entry per batch into every invocation's private memory (which made a product of 900
/// batches lose the device). `None` when no such levels give the list.
pub(super) fn batch_levels(offsets: &[usize]) -> Option<(usize, Vec<BatchLevel>)> {
    let first = *offsets.first()?;
    // The offsets at b = j * div, for the levels not yet found, relative to the first.
    let mut starts: Vec<i128> = offsets.iter().map(|&o| o as i128 - first as i128).collect();
    let (mut levels, mut div) = (Vec::new(), 1usize);
    while starts.len() > 1 {
        let len = starts.len();
        let step = starts[1] - starts[0];
        // The innermost level left: the longest blocks that each step by `step` (the whole
        // list when it is one progression; a shorter block that works would split one batch
        // dimension into several levels).
        let evenly =
            |n: usize| starts.chunks(n).all(|c| c.iter().enumerate().all(|(i, &v)| v - c[0] == i as i128 * step));
        let n = (2..=len).rev().find(|&n| len.is_multiple_of(n) && evenly(n))?;
        if step != 0 {
            levels.push((div, n, step));
        }
        starts = starts.iter().step_by(n).copied().collect();
        div *= n;
    }
    Some((first, levels))
}

/// The offset of element (`row`, `col`) from `base` with strides `rs`, `cs` (u32, wrapping).
fn element(base: &str, row: &str, rs: isize, col: &str, cs: isize) -> String {
    let term = |v: &str, s: isize| match s {
        0 => String::new(),
        s if s > 0 => format!(" + {v} * {s}u"),
        s => format!(" - {v} * {}u", s.unsigned_abs()),
    };
    format!("{base}{}{}", term(row, rs), term(col, cs))
}

pub(super) fn print_matmul(m: &mut Module<'_>, mm: &MatmulKernel) -> Result<(), String> {
    let batches = mm.lhs.batch_offsets.len();
    if !matches!(mm.dtype, DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::U8) {
        return Err(match mm.dtype {
            DType::Bool => "matmul of bool is rejected when recorded".into(),
            d => refusal(d),
        });
    }
    mm.check_operands(|i| m.params.get(i as usize).map(|p| (p.dtype, p.len)))?;
    let total = batches * mm.m * mm.n;
    product_param(m, mm.product, mm.dtype, total, "matmul")?;
    if total as u64 >= 1 << 32 || (mm.m * mm.k.max(1)) as u64 >= 1 << 32 {
        return Err(format!("a product of {total} elements: wgpu kernels index with u32"));
    }
    if total > 0 {
        print_product(m, mm, batches)?;
    }
    if let Some(e) = &mm.epilogue {
        map::print_loop(m, e, "epilogue")?;
    }
    Ok(())
}

/// The parameter a product of `total` elements of `dtype` is written to: argument `product`,
/// or scratch memory added as a parameter when `product` is one past the last argument; `Err`
/// when that argument cannot hold it. `what` names the product in messages.
pub(super) fn product_param(
    m: &mut Module<'_>,
    product: u16,
    dtype: DType,
    total: usize,
    what: &str,
) -> Result<(), String> {
    if product as usize == m.params.len() {
        m.params.push(Param { dtype, len: total, writable: true });
    } else if product as usize > m.params.len() {
        return Err(format!("{what} product in argument {product} of {}", m.params.len()));
    }
    let p = &m.params[product as usize];
    if p.len != total || p.dtype != dtype || !p.writable {
        return Err(format!("{what} product of {total} {dtype} into an argument of {} {}", p.len, p.dtype));
    }
    Ok(())
}

fn print_product(m: &mut Module<'_>, mm: &MatmulKernel, batches: usize) -> Result<(), String> {
    let (tm, tn) = (mm.m.div_ceil(TILE), mm.n.div_ceil(TILE));
    let groups = (batches * tm * tn) as u64;
    let written = m.written();
    let reg = scalar::reg_type(mm.dtype.compute())?;
    let mut decls = String::new();
    let lbase = batch_offset(&mut decls, "lhs_batch", &mm.lhs.batch_offsets);
    let rbase = batch_offset(&mut decls, "rhs_batch", &mm.rhs.batch_offsets);
    let _ = writeln!(
        decls,
        "var<workgroup> tile_a: array<{reg}, {}>;\nvar<workgroup> tile_b: array<{reg}, {}>;",
        TILE * TILE,
        TILE * TILE
    );
    let zero = match mm.dtype {
        DType::I32 => "0i",
        DType::U8 => "0u",
        _ => "0.0",
    };
    let comment = format!(
        "[{batches} x {} x {}] = [{} x {}] x [{} x {}]: one {TILE} x {TILE} tile per workgroup.",
        mm.m, mm.n, mm.m, mm.k, mm.k, mm.n
    );
    m.begin_entry("product", groups, (TILE * TILE) as u32, &comment)?;
    let out = &mut m.body;
    let _ =
        writeln!(out, "  let b = wg / {}u;\n  let tile_m = (wg / {tn}u) % {tm}u;\n  let tile_n = wg % {tn}u;", tm * tn);
    let _ = writeln!(out, "  let ty = lid / {TILE}u;\n  let tx = lid % {TILE}u;");
    let _ = writeln!(out, "  let row = tile_m * {TILE}u + ty;\n  let col = tile_n * {TILE}u + tx;");
    let _ = writeln!(out, "  let lhs_base = {lbase};\n  let rhs_base = {rbase};\n  var acc: {reg} = {zero};");
    let _ = writeln!(out, "  for (var k0 = 0u; k0 < {}u; k0 = k0 + {TILE}u) {{", mm.k);
    // lhs tile: (row, k0 + tx); rhs tile: (k0 + ty, col); zero outside the matrices.
    let a_off = element("lhs_base", "row", mm.lhs.rs, "(k0 + tx)", mm.lhs.cs);
    let b_off = element("rhs_base", "(k0 + ty)", mm.rhs.rs, "col", mm.rhs.cs);
    let a = memory::load(mm.lhs.arg, mm.dtype, written[mm.lhs.arg as usize], &a_off)?;
    let b = memory::load(mm.rhs.arg, mm.dtype, written[mm.rhs.arg as usize], &b_off)?;
    let _ = writeln!(out, "    var a: {reg} = {zero};\n    if (row < {}u && k0 + tx < {}u) {{ a = {a}; }}", mm.m, mm.k);
    let _ =
        writeln!(out, "    var bv: {reg} = {zero};\n    if (k0 + ty < {}u && col < {}u) {{ bv = {b}; }}", mm.k, mm.n);
    let _ = writeln!(out, "    tile_a[lid] = a;\n    tile_b[lid] = bv;\n    workgroupBarrier();");
    let step = match mm.dtype {
        DType::U8 => format!("acc = (acc + tile_a[ty * {TILE}u + kk] * tile_b[kk * {TILE}u + tx]) & 0xffu;"),
        _ => format!("acc = acc + tile_a[ty * {TILE}u + kk] * tile_b[kk * {TILE}u + tx];"),
    };
    // Only k < K: a padded 0 * inf would be NaN, and adding +0 would change a -0 sum.
    let _ = writeln!(
        out,
        "    let kn = min({TILE}u, {}u - k0);\n    for (var kk = 0u; kk < kn; kk = kk + 1u) {{\n      {step}\n    }}",
        mm.k
    );
    let _ = writeln!(out, "    workgroupBarrier();\n  }}");
    let off = format!("b * {}u + row * {}u + col", mm.m * mm.n, mm.n);
    let store = memory::store(mm.product, mm.dtype, &off, "acc")?;
    let _ = writeln!(out, "  if (row < {}u && col < {}u) {{\n    {store}\n  }}\n}}", mm.m, mm.n);
    m.body = format!("{decls}{}", m.body);
    Ok(())
}
