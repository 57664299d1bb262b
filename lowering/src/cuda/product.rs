//! Printing of integer matrix products (see the module above): cuBLAS has no wrapping integer
//! product, so an `i32`, `i64` or `u8` product is printed as one more map entry, one thread per
//! element of the `[batch, m, n]` product, each a dot product of length `k` in unsigned
//! arithmetic of the element's width, which wraps exactly as the CPU's `wrapping_mul` and
//! `wrapping_add` do. It is a plain loop (integer products are rare in models; the fast path
//! of float products is the library's). It runs before the epilogue, on the same stream.

use super::*;
use crate::kernel::{MatmulKernel, MatmulOperand};

/// The C expression of batch `b`'s element offset of `op`: `first + b * step` when the offsets
/// are an arithmetic progression, else a table printed into `out` as `table`.
fn batch_offset(out: &mut String, op: &MatmulOperand, table: &str) -> String {
    let o = &op.batch_offsets;
    // No batch at all: never evaluated.
    let first = o.first().map_or(0, |&x| x as i128);
    let step = if o.len() > 1 { o[1] as i128 - first } else { 0 };
    if o.iter().enumerate().all(|(b, &x)| x as i128 == first + b as i128 * step) {
        return format!("({first}LL + b * {step}LL)");
    }
    let list: Vec<String> = o.iter().map(|x| format!("{x}LL")).collect();
    let _ = writeln!(out, "__device__ const long long {table}[{}] = {{{}}};", o.len(), list.join(", "));
    format!("{table}[b]")
}

/// Prints the product of `m` (an integer dtype) into parameter `m.product` as entry `name`.
pub(super) fn print_int_product(
    out: &mut String,
    m: &MatmulKernel,
    name: &str,
    params: &[Param],
) -> Result<Entry, String> {
    let (unsigned, ty) = match m.dtype {
        DType::I32 => ("unsigned", "int"),
        DType::I64 => ("unsigned long long", "long long"),
        // Products of bytes fit an unsigned int; wrapping it mod 2^32, then mod 2^8 when
        // stored, is wrapping mod 2^8 all along.
        DType::U8 => ("unsigned", "unsigned char"),
        d => return Err(format!("a printed matrix product of {d} (only integer products are printed)")),
    };
    m.check_operands(|i| params.get(i as usize).map(|p| (p.dtype, p.len)))?;
    let batches = m.lhs.batch_offsets.len();
    let total = batches * m.m * m.n;
    match params.get(m.product as usize) {
        Some(p) if p.writable && p.dtype == m.dtype && p.len == total => {}
        _ => {
            return Err(format!(
                "matmul product of {total} {} into argument {} that cannot hold it",
                m.dtype, m.product
            ));
        }
    }
    let _ =
        writeln!(out, "\n// Integer matrix product: {batches} x [{}, {}] x [{}, {}], wrapping.", m.m, m.k, m.k, m.n);
    let lo = batch_offset(out, &m.lhs, &format!("{name}_lhs_offsets"));
    let ro = batch_offset(out, &m.rhs, &format!("{name}_rhs_offsets"));
    let _ = writeln!(out, "{} {{", signature(name, params));
    // (Divisors of at least 1: with an empty product the loop never runs.)
    let (mn, n, k) = ((m.m * m.n).max(1), m.n.max(1), m.k);
    let _ = writeln!(
        out,
        "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {total}LL; i += (long long)gridDim.x * blockDim.x) {{"
    );
    let _ = writeln!(out, "    const long long b = i / {mn}LL, row = i / {n}LL % {}LL, col = i % {n}LL;", m.m.max(1));
    let _ = writeln!(out, "    const long long l = {lo} + row * {}LL, r = {ro} + col * {}LL;", m.lhs.rs, m.rhs.cs);
    let _ = writeln!(out, "    {unsigned} acc = 0;");
    let _ = writeln!(
        out,
        "    for (long long p = 0; p < {k}LL; ++p) acc += ({unsigned})a{}[l + p * {}LL] * ({unsigned})a{}[r + p * {}LL];",
        m.lhs.arg, m.lhs.cs, m.rhs.arg, m.rhs.rs
    );
    let _ = writeln!(out, "    a{}[i] = ({ty})acc;\n  }}\n}}", m.product);
    Ok(Entry { name: name.into(), launch: Launch::Map { numel: total, block: MAP_BLOCK } })
}
