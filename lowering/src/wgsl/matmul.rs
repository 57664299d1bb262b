//! Matrix products: a tiled product, then the epilogue (a map loop over the product).
//!
//! Each workgroup computes a 16 x 16 tile of one batch's `m x n` product, one output per
//! thread: it walks `k` in steps of 16, each thread loading one element of each operand's
//! tile into workgroup memory, and adds the tile's products in order of `k`. Operands are
//! read through their strides and per-batch offsets (an arithmetic progression of offsets is
//! computed, any other list is a table in the shader). f32 (and f16/bf16 widened to f32)
//! accumulate in f32; i32 and u8 wrap. The product is written contiguously (`[batch, m, n]`)
//! to its argument or to a scratch binding, rounded to its storage type.

use super::*;
use crate::kernel::{MatmulKernel, MatmulOperand};

const TILE: usize = 16;

/// Checks that every matrix of an operand lies inside its argument (as the CPU does).
fn check_operand(op: &MatmulOperand, m: &Module<'_>, rows: usize, cols: usize, dtype: DType) -> Result<(), String> {
    let p = m
        .params
        .get(op.arg as usize)
        .ok_or_else(|| format!("matmul operand of argument {}, which does not exist", op.arg))?;
    if p.dtype != dtype {
        return Err(format!("matmul operand of {} where {dtype} was expected", p.dtype));
    }
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    for &off in &op.batch_offsets {
        let (mut lo, mut hi) = (off as i128, off as i128);
        for (extent, stride) in [(rows, op.rs), (cols, op.cs)] {
            let span = (extent as i128 - 1) * stride as i128;
            if span < 0 { lo += span } else { hi += span }
        }
        if lo < 0 || hi >= p.len as i128 {
            return Err(format!("matmul operand reaches elements {lo}..={hi} of an argument of {}", p.len));
        }
    }
    Ok(())
}

/// The element offset of batch `b`'s matrix: a formula for an arithmetic progression, else a
/// lookup in a table declared in `decls`.
fn batch_offset(decls: &mut String, name: &str, offsets: &[usize]) -> String {
    let step = offsets.get(1).map_or(0, |&o| o as i128 - offsets[0] as i128);
    let progression = offsets.windows(2).all(|w| w[1] as i128 - w[0] as i128 == step);
    if progression {
        match step {
            0 => format!("{}u", offsets[0]),
            s if s > 0 => format!("({}u + b * {s}u)", offsets[0]),
            s => format!("({}u - b * {}u)", offsets[0], -s),
        }
    } else {
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
    if mm.rhs.batch_offsets.len() != batches {
        return Err("matmul operands have different batch counts".into());
    }
    if !matches!(mm.dtype, DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::U8) {
        return Err(match mm.dtype {
            DType::Bool => "matmul of bool is rejected when recorded".into(),
            d => refusal(d),
        });
    }
    check_operand(&mm.lhs, m, mm.m, mm.k, mm.dtype)?;
    check_operand(&mm.rhs, m, mm.k, mm.n, mm.dtype)?;
    let total = batches * mm.m * mm.n;
    if mm.product as usize == m.params.len() {
        m.params.push(Param { dtype: mm.dtype, len: total, writable: true });
    } else if mm.product as usize > m.params.len() {
        return Err(format!("matmul product in argument {} of {}", mm.product, m.params.len()));
    }
    let p = &m.params[mm.product as usize];
    if p.len != total || p.dtype != mm.dtype || !p.writable {
        return Err(format!("matmul product of {total} {} into an argument of {} {}", mm.dtype, p.len, p.dtype));
    }
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
