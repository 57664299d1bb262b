//! Printing of products with quantized weights ([`QuantMatmulKernel`]) as CUDA C: the fixed
//! device code of `quant_matmul.cu`, then one entry calling its few-rows path (`qm_gemv`: up
//! to [`GEMV_ROWS`] rows, a warp per few output channels, every weight byte read once and
//! streamed) or its tiled path (`qm_tiled`), launched as [`Launch::Tiles`]. The epilogue is a
//! map entry after it, as for any product. No dequantized weight is ever written to memory.
//!
//! This module only prints; it never decides where a product runs.

use super::*;
use crate::kernel::QuantMatmulKernel;
use braid_graph::Scheme;

const QUANT: &str = include_str!("quant_matmul.cu");

/// The most rows the few-rows path takes (each row's accumulators live in registers).
pub const GEMV_ROWS: usize = 16;

/// Prints the product of `q` into parameter `q.product` as entry `name`.
pub(super) fn print_quant_product(
    out: &mut String,
    q: &QuantMatmulKernel,
    name: &str,
    params: &[Param],
) -> Result<Entry, String> {
    q.check_operands(|i| params.get(i as usize).map(|p| (p.dtype, p.len)))?;
    match params.get(q.product as usize) {
        Some(p) if p.writable && p.dtype == q.dtype && p.len == q.numel() => {}
        _ => {
            return Err(format!(
                "quantized product of {} {} into argument {} that cannot hold it",
                q.numel(),
                q.dtype,
                q.product
            ));
        }
    }
    let xk = match q.dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        d => return Err(format!("a quantized product of {d} inputs")),
    };
    let sk = if q.layout.scale == DType::F16 { 1 } else { 0 };
    let int4 = matches!(q.layout.scheme, Scheme::Int4 { .. });
    let l = &q.layout;
    let (m, k, n) = (q.m, l.k, l.n);
    let (off, rs, cs) = (q.lhs.batch_offsets[0], q.lhs.rs, q.lhs.cs);
    out.push('\n');
    out.push_str(QUANT);
    let common = format!("a{}, {off}LL, {rs}LL, {cs}LL, a{}, a{}", q.lhs.arg, q.weight, q.product);
    let (call, blocks, threads) = if m <= GEMV_ROWS {
        // Channels a warp (the inputs it reads serve them all): four for one row of int4
        // values, where converting the inputs is a large share of the work; two otherwise (more
        // would spill registers with many rows). Each lane keeps sixteen chunks of 16 bytes in
        // flight over its channels.
        let c = if m == 1 && int4 { 4 } else { 2 };
        let ahead = 16 / c;
        // Warps sharing a channel's row: enough warps to fill the GPU (about 8,192), as long as
        // each still has a chunk a lane.
        let (values, warps) = (if int4 { 32 } else { 16 }, n.div_ceil(c));
        let chunks = k.div_ceil(values);
        let split = [4, 2, 1].into_iter().find(|&s| warps * s <= 8192 && chunks >= 32 * s).unwrap_or(1);
        // Eight inputs at a time with one vector load: contiguous rows aligned to 16 bytes.
        let per = (16 / q.dtype.size()) as isize;
        let vecx = cs == 1 && (off as isize) % per == 0 && rs % per == 0;
        let group = if int4 { l.group() } else { 1 };
        let tail = format!("{}LL, {}LL, {}", l.row_bytes(), l.scales_offset(), l.groups());
        let call = format!(
            "qm_gemv<{m}, {c}, {ahead}, {split}, {xk}, {sk}, {int4}, {vecx}, {k}, {group}>({common}, {n}, {tail})"
        );
        (call, n.div_ceil(c * (4 / split)), 128)
    } else {
        let tail = format!("{}LL, {}LL, {}, {}", l.row_bytes(), l.scales_offset(), l.groups(), l.group());
        let call = format!("qm_tiled<{xk}, {sk}, {int4}>({common}, {m}, {k}, {n}, {tail})");
        (call, m.div_ceil(64) * n.div_ceil(64), 256)
    };
    let _ = writeln!(
        out,
        "\n// {l} product: [{m}, {k}] x [{k}, {n}].\nextern \"C\" __global__ void __launch_bounds__({threads}) {name}({}) {{\n  {call};\n}}",
        param_list(params)
    );
    let blocks = if m == 0 || n == 0 { 0 } else { blocks };
    Ok(Entry { name: name.into(), launch: Launch::Tiles { blocks, threads, shared_bytes: 0 } })
}
