//! Quantized weights on the CPU: quantizing them (`Body::Quantize`, only ever run here) and
//! products with them (`Body::QuantMatmul`): each task takes a block of
//! output channels and, one channel at a time, dequantizes that channel's weights into a buffer
//! of `k` f32 values (never the whole weight), then takes its dot product with every row of
//! `x` (widened to f32 once). The product is rounded to its dtype once; the epilogue follows as
//! for any product. Results do not depend on the thread count (each element is one task's dot
//! product, summed in a fixed order).
//!
//! This module only computes; it never allocates device memory or decides what runs.

use super::map::ArgPtr;
use super::matmul::product_target;
use braid_graph::{DType, QuantLayout, Scheme};
use braid_lowering::{MapLoop, QuantMatmulKernel, QuantizeKernel};
use half::{bf16, f16};
use rayon::prelude::*;

/// Multiply-adds below which a product runs on the calling thread.
const PAR_FLOPS: usize = 1 << 20;

/// Runs a quantized product: checks its operands, computes the product into its argument (or
/// scratch memory), then runs the epilogue with `epilogue(loop, args)`, where `args` are the
/// kernel's arguments followed, when the product goes to scratch memory, by that scratch.
pub fn run_quant_matmul_with(
    k: &QuantMatmulKernel,
    args: &[ArgPtr],
    epilogue: impl FnOnce(&MapLoop, &[ArgPtr]) -> Result<(), String>,
) -> Result<(), String> {
    k.check_operands(|i| args.get(i as usize).map(|a| (a.dtype, a.len)))?;
    let (x, w) = (args[k.lhs.arg as usize], args[k.weight as usize]);
    let mut scratch = Vec::new();
    let (product, all) = product_target(args, k.product, k.numel(), k.dtype, &mut scratch)?;
    // SAFETY: `check_operands` proved that every row of x lies in its argument (of the
    // product's dtype) and that the weight argument holds the layout's bytes; `product_target`
    // that the product holds `m x n` elements of the product's dtype.
    unsafe {
        let weight = std::slice::from_raw_parts(w.ptr as *const u8, w.len);
        let rows = widen_rows(k, x);
        product_of(&k.layout, weight, &rows, k.m, product);
    }
    if let Some(l) = &k.epilogue {
        epilogue(l, &all)?;
    }
    drop(scratch);
    Ok(())
}

/// The `m` rows of x as f32, row-major `[m, k]`.
///
/// # Safety
/// Every element of x's operand lies inside `x`, which holds the kernel's dtype.
unsafe fn widen_rows(q: &QuantMatmulKernel, x: ArgPtr) -> Vec<f32> {
    let (k, off) = (q.layout.k, q.lhs.batch_offsets[0] as isize);
    let at = |r: usize, i: usize| (off + r as isize * q.lhs.rs + i as isize * q.lhs.cs) as usize;
    let mut rows = Vec::with_capacity(q.m * k);
    for r in 0..q.m {
        for i in 0..k {
            // SAFETY: the caller's promise.
            rows.push(unsafe {
                match q.dtype {
                    DType::F16 => (*(x.ptr as *const f16).add(at(r, i))).to_f32(),
                    DType::BF16 => (*(x.ptr as *const bf16).add(at(r, i))).to_f32(),
                    _ => *(x.ptr as *const f32).add(at(r, i)),
                }
            });
        }
    }
    rows
}

/// Output pointer shared by the tasks, each of which writes its own channels' elements.
#[derive(Clone, Copy)]
struct Out(ArgPtr);
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// `out[r, j] = Σ_i rows[r, i] * weight(i, j)` for every channel `j`, in blocks of channels.
///
/// # Safety
/// `out` holds `m x n` elements of its dtype (f32, f16 or bf16) and `weight` the layout's bytes.
unsafe fn product_of(layout: &QuantLayout, weight: &[u8], rows: &[f32], m: usize, out: ArgPtr) {
    let (k, n) = (layout.k, layout.n);
    let out = Out(out);
    let channels = |block: std::ops::Range<usize>| {
        let mut w = vec![0f32; k];
        for j in block {
            dequantize_channel(layout, weight, j, &mut w);
            for r in 0..m {
                let v = dot(&rows[r * k..(r + 1) * k], &w);
                let o = out;
                // SAFETY: element (r, j) is inside the product and written by this task alone.
                unsafe {
                    match o.0.dtype {
                        DType::F16 => *(o.0.ptr as *mut f16).add(r * n + j) = f16::from_f32(v),
                        DType::BF16 => *(o.0.ptr as *mut bf16).add(r * n + j) = bf16::from_f32(v),
                        _ => *(o.0.ptr as *mut f32).add(r * n + j) = v,
                    }
                }
            }
        }
    };
    const BLOCK: usize = 16;
    let blocks = n.div_ceil(BLOCK);
    if m * n * k < PAR_FLOPS || blocks < 2 {
        channels(0..n);
    } else {
        (0..blocks).into_par_iter().for_each(|b| channels(b * BLOCK..((b + 1) * BLOCK).min(n)));
    }
}

/// Channel `j`'s `k` weights, `value * scale` in f32, into `w`.
fn dequantize_channel(layout: &QuantLayout, weight: &[u8], j: usize, w: &mut [f32]) {
    let row = &weight[j * layout.row_bytes()..];
    let group = layout.group();
    for g in 0..layout.groups() {
        let s = layout.scale_at(weight, j, g);
        let span = g * group..((g + 1) * group).min(layout.k);
        match layout.scheme {
            Scheme::Int8 => {
                for i in span {
                    w[i] = row[i] as i8 as f32 * s;
                }
            }
            Scheme::Int4 { .. } => {
                // Whole bytes: groups are even, so a group never splits a byte.
                for (pair, &b) in w[span.clone()].chunks_exact_mut(2).zip(&row[span.start / 2..span.end / 2]) {
                    pair[0] = ((b << 4) as i8 >> 4) as f32 * s;
                    pair[1] = (b as i8 >> 4) as f32 * s;
                }
            }
        }
    }
}

/// A dot product in f32 over eight interleaved partial sums (which the compiler vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Quantizes a weight (`Body::Quantize`): reads the `[k, n]` source in f32 and writes the
/// layout's bytes (`QuantLayout::quantize`, the one definition of the rounding).
pub fn run_quantize(q: &QuantizeKernel, args: &[ArgPtr]) -> Result<(), String> {
    q.check_operands(|i| args.get(i as usize).map(|a| (a.dtype, a.len)))?;
    let (src, out) = (args[q.src.arg as usize], args[q.out as usize]);
    let (k, n) = (q.layout.k, q.layout.n);
    let off = q.src.batch_offsets[0] as isize;
    let at = |i: usize, j: usize| (off + i as isize * q.src.rs + j as isize * q.src.cs) as usize;
    // SAFETY: `check_operands` proved every element of the source inside its argument of the
    // kernel's dtype, and the output the layout's bytes.
    let w: Vec<f32> = unsafe {
        (0..k)
            .flat_map(|i| (0..n).map(move |j| at(i, j)))
            .map(|e| match q.dtype {
                DType::F16 => (*(src.ptr as *const f16).add(e)).to_f32(),
                DType::BF16 => (*(src.ptr as *const bf16).add(e)).to_f32(),
                _ => *(src.ptr as *const f32).add(e),
            })
            .collect()
    };
    let bytes = q.layout.quantize(&w);
    // SAFETY: as above; the output holds exactly `bytes.len()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.ptr, bytes.len()) };
    Ok(())
}
