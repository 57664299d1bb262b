//! Products with a quantized weight (`Body::QuantMatmul`): `x [m, k]` times the `[k, n]`
//! weight of a `braid_graph::quant` layout, read from its packed bytes, then the epilogue.
//!
//! One entry, one thread per product element `(r, j)` (row-major, so the product is stored
//! contiguously), 256 a workgroup: the thread walks channel `j`'s row of values a u32 word at a
//! time (the bytes are little-endian: value `e` of a word is bits `e * bits..`, sign-extended
//! by an arithmetic shift), one scale per group (an F32 scale is the bits of its word, an F16
//! one converted exactly in integer arithmetic, so no `shader-f16` is needed), and reads `x`
//! through its strides (any sign, an offset; f16 and bf16 widened exactly). Each weight element
//! is `f32(value) * scale`, rounded once in f32 and laundered (see `LAUNDER`) so that no
//! compiler reassociates it with `x`; the dot product adds in order of `k` in f32 from a +0
//! (the GPU may fuse `acc + x * w`, which the definition's "any order" allows) and is rounded
//! once to the product's dtype. The epilogue is a map loop over `[m, n]`, as a matrix
//! product's. Where it cannot agree with the CPU: another summation order, and an f32 scale
//! or value the GPU flushes as subnormal.
//!
//! This prints only: it decides nothing about buffers or scheduling. The printed kernel must
//! never write a dequantized weight (or any buffer but the product and the epilogue's
//! outputs), nor read outside the weight's layout (an int8 row's last word may hold padding,
//! which is read and ignored).

use super::*;
use crate::kernel::QuantMatmulKernel;
use braid_graph::Scheme;

/// Threads per workgroup of the product entry.
const THREADS: u32 = 256;

pub(super) fn print_quant_matmul(m: &mut Module<'_>, q: &QuantMatmulKernel) -> Result<(), String> {
    if !matches!(q.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(format!("a quantized product of {}: x is f32, f16 or bf16", q.dtype));
    }
    // (`check_operands` also refuses a layout `QuantLayout::new` would: its fields are public.)
    let l = &q.layout;
    q.check_operands(|i| m.params.get(i as usize).map(|p| (p.dtype, p.len)))?;
    let total = q.numel();
    super::matmul::product_param(m, q.product, q.dtype, total, "quantized")?;
    if total as u64 >= 1 << 32 || l.bytes() as u64 >= 1 << 32 {
        return Err(format!(
            "a quantized product of {total} elements over {} weight bytes: wgpu kernels index with u32",
            l.bytes()
        ));
    }
    if total > 0 {
        print_product(m, q)?;
    }
    if let Some(e) = &q.epilogue {
        map::print_loop(m, e, "epilogue")?;
    }
    Ok(())
}

/// `{base} ± {var} * |stride|` (u32, wrapping: exact for every element a checked operand reaches).
fn stepped(base: &str, var: &str, stride: isize) -> String {
    match stride {
        0 => base.to_string(),
        1 => format!("{base} + {var}"),
        s if s > 0 => format!("{base} + {var} * {s}u"),
        s => format!("{base} - {var} * {}u", s.unsigned_abs()),
    }
}

fn print_product(m: &mut Module<'_>, q: &QuantMatmulKernel) -> Result<(), String> {
    let l = &q.layout;
    let (k, n, total) = (l.k, l.n, q.numel());
    let written = m.written();
    let w = q.weight;
    let word = |idx: &str| match written[w as usize] {
        true => format!("atomicLoad(&a{w}[{idx}])"),
        false => format!("a{w}[{idx}]"),
    };
    // Values a word, their width, and per group: whole words and values in a last partial one
    // (only Int8's single group of `k` values ends inside a word).
    let (per_word, bits) = match l.scheme {
        Scheme::Int8 => (4, 8),
        Scheme::Int4 { .. } => (8, 4),
    };
    let (groups, group) = (l.groups(), l.group());
    let (full, tail) = (group / per_word, group % per_word);
    let row_words = l.row_bytes() / 4;
    // Scale `si` (a u32 expression: `j * groups + g`) of the layout's dtype, as f32.
    let scale = match l.scale {
        DType::F32 => format!("bitcast<f32>({})", word(&format!("{}u + si", l.scales_offset() / 4))),
        DType::F16 => format!(
            "braid_f16_to_f32(braid_get_half({}, {}u + si))",
            word(&format!("({}u + si) >> 1u", l.scales_offset() / 2)),
            l.scales_offset() / 2
        ),
        d => return Err(format!("quantized scales of {d}")),
    };
    // The terms of the first `count` values of `word` (value `e` is element `i + e` of the row).
    let x_written = written[q.lhs.arg as usize];
    let terms = |out: &mut String, indent: &str, count: usize| -> Result<(), String> {
        for e in 0..count {
            let at = stepped("x0", &format!("(i + {e}u)"), q.lhs.cs);
            let x = memory::load(q.lhs.arg, q.dtype, x_written, &at)?;
            let (up, down) = (32 - bits * (e + 1), 32 - bits);
            let _ = writeln!(
                out,
                "{indent}acc = acc + {x} * braid_launder(f32(bitcast<i32>(word << {up}u) >> {down}u) * s);"
            );
        }
        Ok(())
    };
    let comment =
        format!("[{} x {n}] = [{} x {k}] x {l}: one output element per thread, {THREADS} a workgroup.", q.m, q.m);
    m.begin_entry("product", (total as u64).div_ceil(THREADS as u64), THREADS, &comment)?;
    let out = &mut m.body;
    let _ = writeln!(out, "  let t = wg * {THREADS}u + lid;\n  if (t >= {total}u) {{ return; }}");
    let _ = writeln!(out, "  let r = t / {n}u;\n  let j = t % {n}u;");
    let _ = writeln!(out, "  let x0 = {};", stepped(&format!("{}u", q.lhs.batch_offsets[0]), "r", q.lhs.rs));
    // The sum starts from a +0 the compiler cannot see: with a literal 0.0 Mesa folds `0.0 + a`
    // to `a`, which turns a sum of -0 terms into -0 where the CPU's is +0.
    let _ = writeln!(out, "  let w0 = j * {row_words}u;\n  var acc: f32 = bitcast<f32>(braid_zero);");
    if k > 0 {
        let _ = writeln!(out, "  for (var g = 0u; g < {groups}u; g = g + 1u) {{");
        let _ = writeln!(out, "    let si = j * {groups}u + g;\n    let s = {scale};");
        let _ = writeln!(out, "    for (var c = 0u; c < {full}u; c = c + 1u) {{");
        let _ = writeln!(out, "      let word = {};", word(&format!("w0 + g * {full}u + c")));
        let _ = writeln!(out, "      let i = (g * {full}u + c) * {per_word}u;");
        terms(out, "      ", per_word)?;
        let _ = writeln!(out, "    }}");
        if tail > 0 {
            let _ = writeln!(out, "    let word = {};", word(&format!("w0 + g * {full}u + {full}u")));
            let _ = writeln!(out, "    let i = (g * {full}u + {full}u) * {per_word}u;");
            terms(out, "    ", tail)?;
        }
        let _ = writeln!(out, "  }}");
    }
    let store = memory::store(q.product, q.dtype, "t", "acc")?;
    let _ = writeln!(out, "  {store}\n}}");
    Ok(())
}
