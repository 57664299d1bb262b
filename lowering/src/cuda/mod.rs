//! CUDA C printing of the kernel IR: [`print()`] turns a [`Kernel`] into source text for NVRTC.
//!
//! Each map loop and the row kernel becomes one `extern "C" __global__` function; the caller
//! launches them in the order of [`CudaSource::entries`], each with the shape its [`Launch`]
//! names. A map loop runs one thread per index (a grid-stride loop, so any grid covers it), or
//! where its views are contiguous one thread per chunk of up to 16 bytes of each, read and
//! written with one access (`vector.rs`; the scalar loop does the rest, and all of it when an
//! argument's address is not aligned when the kernel runs). A
//! row kernel runs one block per row, a row being every index that differs only along the axis
//! (the whole space without one): the threads stride over the row folding their elements (float
//! sums compensated, so that a thread folding a long row stays within a few ulps), warp shuffles
//! and one barrier combine them (each warp by shuffles, then the warps' results through a shared
//! array of one entry per warp: `reduce.rs`), phase after phase as the CPU's `rows` module does
//! (reductions in order, per-row values, per-row stores by one thread, per-element stores in a
//! last sweep). A load that several sweeps read is read from global memory by the first and
//! kept in shared memory for the others while the row fits [`ROW_KEEP_BYTES`] (so a short
//! softmax row is read once and written once); longer rows read it again in every sweep. Long
//! rows among few rows (a whole-tensor reduction) are split into segments of [`SEGMENT`], a
//! block each, per reduction a pass of partial results into scratch memory and a pass that
//! combines them per row, then a last pass for the stores (`split.rs`); many short rows share a
//! block, a segment of a warp's lanes a row, combined by shuffles alone (`short_rows.rs`). Fused
//! attention is one
//! entry per pass, blocks of tiles with dynamic shared memory ([`Launch::Tiles`], `attention.rs`:
//! tensor cores for halves, CUDA cores for f32 and f64). A float matrix product is cuBLAS's job: only its epilogue is printed (no entry at
//! all when there is none), and the caller must have written the product before launching it
//! ([`CudaSource::library_product`]). An integer product, which cuBLAS cannot wrap as the CPU
//! does, is printed as a first entry (`product`).
//!
//! The printed code computes what the CPU evaluator computes, bit for bit where IEEE arithmetic
//! allows: integers wrap, integer division by zero gives 0, float `max`/`min` propagate NaN from
//! either side, float-to-int casts truncate and saturate (NaN gives 0), argmax takes the first
//! maximum, random numbers are the counter-based ones of `braid_graph::rng`. Where it cannot:
//! `expf`, `tanhf` and the other math functions are CUDA's (a few ulps from the CPU's), float
//! sums add in another order. Nodes that no store reads are not printed.
//!
//! Compile with [`NVRTC_OPTIONS`] (no contraction of `a * b + c` into a fused multiply-add,
//! which the CPU never does implicitly); a source that uses f16 or bf16 includes `cuda_fp16.h`
//! or `cuda_bf16.h`, which NVRTC finds only with the CUDA include directory on its `-I` path.
//!
//! The printer only prints: it decides nothing about scheduling (streams, grids beyond the
//! suggested shape) or memory (allocation, reuse, aliasing). Arguments are declared without
//! `__restrict__` because the planner may write an output in place over an input.

mod attention; // fused attention: flash-style tiles, tensor cores for halves
mod columns; // row kernels along an axis before the last: neighbouring rows a block
mod first_pass; // a row kernel's reductions that read none folded in one sweep
mod gather; // gathers: a computed index per element
mod loops; // map loops
mod product; // integer matrix products, printed whole
mod quant; // products with quantized weights: few-rows and tiled paths
mod reduce; // one reduction's fold and warp-shuffle combine
mod row_keep; // which values a row kernel keeps in shared memory between its sweeps
mod row_vector; // which of a row kernel's accesses move 16 bytes at a time, and from where
mod rows; // row kernels: sweeps, phases, loads kept in shared memory
mod scatter; // scatter-adds: rows of the source folded in order into the output
mod scatter_write; // scatters: the base copied (unless in place), rows of the source written
mod short_rows; // short rows, several a block: a segment of a warp's lanes a row
mod split; // long rows among few rows: segments, partial results in scratch
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod tests_attention;
#[cfg(test)]
mod tests_gather;
#[cfg(test)]
mod tests_packed;
#[cfg(test)]
mod tests_rows;
mod vector; // 16-byte loads and stores of neighbouring elements, checked for alignment at run time

pub use crate::cexpr::storage_ctype;
use crate::cexpr::*;
pub use attention::{
    AttentionShape, AttentionTiles, MAX_HEAD_DIM, attention_shapes, attention_tiles, attention_tiles_with,
};
pub use columns::COLUMNS;
use loops::*;
use product::print_int_product;
use rows::print_rows;
pub use split::{SEGMENT, SPLIT_BELOW_ROWS};

use crate::kernel::{Body, Kernel, Load, MapLoop, RowKernel, Store, View};
use braid_graph::expr::{Expr, ExprOp, PrimBinary};
use braid_graph::{DType, ReduceOp, Shape};
use std::fmt::Write;

/// Options every printed source is meant to be compiled with.
pub const NVRTC_OPTIONS: &[&str] = &["--std=c++17", "--fmad=false"];
/// Threads per block suggested for map loops.
pub const MAP_BLOCK: u32 = 256;
/// Most threads per block of a row kernel (its shared arrays are sized for its `threads`).
pub const MAX_ROW_THREADS: u32 = 256;
/// Most bytes of shared memory a row kernel spends keeping loaded row elements between its
/// phases (see `rows.rs`): an f32 row of up to 8192 elements is read from global memory once.
pub const ROW_KEEP_BYTES: usize = 32 * 1024;
/// Static shared memory one block may declare (CUDA's limit without a dynamic opt-in).
const STATIC_SHARED_BYTES: usize = 48 * 1024;

/// A printed kernel: its source and its entry points, in launch order.
#[derive(Clone, Debug)]
pub struct CudaSource {
    pub source: String,
    pub entries: Vec<Entry>,
    /// The parameters of every entry point, in order: the kernel's arguments (`a0`, `a1`, ...),
    /// then, for a matrix product without an argument for it, the scratch buffer holding the
    /// product (read by the epilogue), or for a split row kernel its scratch bytes.
    pub params: Vec<DType>,
    /// Whether the caller computes the kernel's matrix product (a float product, through a
    /// library such as cuBLAS) into its `product` parameter before launching the entries.
    /// False for every other kernel, integer products included (their first entry computes it).
    pub library_product: bool,
    /// Bytes of scratch memory a split row or column kernel's entries share, passed as their last
    /// parameter (a `u8` in `params`), or a quantized product's when no argument holds it (of
    /// the product's dtype); 0 for every other kernel (a matrix product's scratch is the
    /// caller's plan).
    pub scratch_bytes: usize,
}

/// One `extern "C" __global__` function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub launch: Launch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    /// `numel` threads' worth of work (the loop's indices, or for a loop with a vector path its
    /// chunks of neighbouring indices), `block` threads per block suggested; the loop strides
    /// over the grid, so a smaller grid is fine. Nothing to launch when `numel` is 0.
    Map { numel: usize, block: u32 },
    /// `rows` blocks (one per row, or per segment of a row in a split row kernel, or a packed
    /// kernel's blocks, shared out among its loops) of `threads` threads (or fewer, a power of
    /// two). Nothing to launch when `rows` is 0.
    Rows { rows: usize, threads: u32 },
    /// `blocks` blocks of exactly `threads` threads, each with `shared_bytes` of dynamic shared
    /// memory (above 48 KiB the launcher opts the function in first); fused attention's tiles.
    /// Nothing to launch when `blocks` is 0.
    Tiles { blocks: usize, threads: u32, shared_bytes: u32 },
    /// A [`Launch::Map`] that copies parameter `from` into `to`: not launched when they are one
    /// address (a scatter's base, when the scheduler wrote the scatter over it).
    Copy { numel: usize, block: u32, from: u16, to: u16 },
}

/// A parameter of the printed entry points.
struct Param {
    dtype: DType,
    len: usize,
    writable: bool,
}

/// Choices of how a kernel is printed that a tuner may vary (`devices/src/cuda/tune.rs`);
/// [`print`] prints the default ones. Each changes only how the work is split, never what is
/// computed, but sums may then add in another order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrintOptions {
    /// Elements per segment of a split row (a long row among few rows: `split.rs`).
    pub segment: usize,
    /// Blocks a column kernel is spread over when its columns are long (`columns.rs`).
    pub column_blocks: usize,
    /// Fused attention on tensor cores tiled otherwise than by its table
    /// ([`attention_shapes`]); `None`: the table's tiling.
    pub attention: Option<AttentionShape>,
    /// The widest vector access a thread makes in map loops and row kernels (`vector.rs`): 16
    /// bytes (CUDA's 128-bit loads and stores) by default; 8 or 4 for narrower ones, 0 for none
    /// (every element accessed on its own).
    pub vector_bytes: usize,
}

impl Default for PrintOptions {
    fn default() -> PrintOptions {
        PrintOptions {
            segment: SEGMENT,
            column_blocks: columns::TARGET_BLOCKS,
            attention: None,
            vector_bytes: vector::VECTOR_BYTES,
        }
    }
}

/// Prints `kernel` as CUDA C; entry points are named after `name` (a C identifier). Errors on
/// IR the CPU would reject too (ill-typed expressions, views outside their arguments) and on
/// views whose dims differ from their loop's.
pub fn print(kernel: &Kernel, name: &str) -> Result<CudaSource, String> {
    print_with(kernel, name, &PrintOptions::default())
}

/// [`print`] with other [`PrintOptions`].
pub fn print_with(kernel: &Kernel, name: &str, options: &PrintOptions) -> Result<CudaSource, String> {
    if options.segment == 0 || options.column_blocks == 0 {
        return Err(format!("{options:?}: segments and blocks must be positive"));
    }
    if !matches!(options.vector_bytes, 0 | 4 | 8 | 16) {
        return Err(format!("{options:?}: vector accesses are 0 (none), 4, 8 or 16 bytes wide"));
    }
    let ident = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !ident {
        return Err(format!("kernel name {name:?} is not a C identifier"));
    }
    let mut params: Vec<Param> = (kernel.args.iter().enumerate())
        .map(|(i, a)| Param { dtype: a.dtype, len: a.len, writable: i >= kernel.inputs })
        .collect();
    let mut body = String::new();
    let mut entries = Vec::new();
    let mut library_product = false;
    let mut scratch_bytes = 0;
    let exprs: Vec<&Expr> = match &kernel.body {
        Body::Collective(c) => return Err(format!("{} is a library call (NCCL), not a printed kernel", c.kind.name())),
        Body::Quantize(q) => return Err(format!("a {} quantization runs on the CPU, not as a CUDA kernel", q.layout)),
        Body::Map(loops) => loops.iter().map(|l| &l.expr).collect(),
        Body::Rows(r) => vec![&r.expr],
        Body::Matmul(m) => m.epilogue.iter().map(|l| &l.expr).collect(),
        Body::QuantMatmul(q) => q.epilogue.iter().map(|l| &l.expr).collect(),
        Body::Gather(_) | Body::Scatter(_) | Body::ScatterWrite(_) | Body::Attention(_) => vec![],
    };
    match &kernel.body {
        Body::Map(loops) if loops.len() > 1 => {
            entries.push(print_packed(&mut body, loops, &format!("{name}_loops"), &params, options.vector_bytes)?)
        }
        Body::Map(loops) => {
            for (k, l) in loops.iter().enumerate() {
                let e = print_map(&mut body, l, &format!("{name}_loop{k}"), &params, options.vector_bytes)?;
                entries.push(e);
            }
        }
        Body::Rows(r) => {
            let (e, scratch) = print_rows(&mut body, r, &format!("{name}_rows"), &mut params, options)?;
            entries.extend(e);
            scratch_bytes = scratch;
        }
        Body::Collective(_) | Body::Quantize(_) => unreachable!("refused above"),
        Body::QuantMatmul(q) => {
            if q.product as usize == params.len() {
                // Scratch memory for the product, written by the printed product.
                params.push(Param { dtype: q.dtype, len: q.numel(), writable: true });
                scratch_bytes = q.numel() * q.dtype.size();
            } else if q.product as usize > params.len() {
                return Err(format!("quantized product in argument {} of {}", q.product, params.len()));
            }
            entries.push(quant::print_quant_product(&mut body, q, &format!("{name}_qproduct"), &params)?);
            if let Some(e) = &q.epilogue {
                entries.push(print_map(&mut body, e, &format!("{name}_epilogue"), &params, options.vector_bytes)?);
            }
        }
        Body::Gather(g) => entries.push(gather::print_gather(&mut body, g, &format!("{name}_gather"), &params)?),
        Body::Scatter(s) => entries.extend(scatter::print_scatter(&mut body, s, &format!("{name}_scatter"), &params)?),
        Body::ScatterWrite(s) => {
            entries.extend(scatter_write::print_scatter_write(&mut body, s, &format!("{name}_scatter"), &params)?)
        }
        Body::Attention(a) => entries.extend(attention::print_attention(&mut body, a, name, &params, options)?),
        Body::Matmul(m) => {
            library_product = m.dtype.is_float();
            if m.product as usize == params.len() {
                // The target provides the scratch: at least the product, or as far as the
                // epilogue reads it (a target may pad the product's rows for its library).
                let read = (m.epilogue.iter().flat_map(|e| &e.loads))
                    .filter(|l| l.arg == m.product)
                    .filter_map(|l| l.view.extent())
                    .filter(|&(lo, hi)| lo >= 0 && hi < isize::MAX)
                    .map(|(_, hi)| hi as usize + 1)
                    .max();
                let len = (m.lhs.batch_offsets.len() * m.m * m.n).max(read.unwrap_or(0));
                // Scratch memory: written by a printed product, else only read.
                params.push(Param { dtype: m.dtype, len, writable: !library_product });
            } else if m.product as usize > params.len() {
                return Err(format!("matmul product in argument {} of {}", m.product, params.len()));
            }
            if !library_product {
                entries.push(print_int_product(&mut body, m, &format!("{name}_product"), &params)?);
            }
            if let Some(e) = &m.epilogue {
                entries.push(print_map(&mut body, e, &format!("{name}_epilogue"), &params, options.vector_bytes)?);
            }
        }
    }
    let mut source = format!("// braid kernel `{name}`: CUDA C for NVRTC ({}).\n", NVRTC_OPTIONS.join(" "));
    let cast_to = |d| exprs.iter().any(|e| e.nodes.iter().any(|n| matches!(n.op, ExprOp::Cast(t, _) if t == d)));
    for (d, header) in [(DType::F16, "cuda_fp16.h"), (DType::BF16, "cuda_bf16.h")] {
        if params.iter().any(|p| p.dtype == d) || cast_to(d) {
            let _ = writeln!(source, "#include <{header}>");
        }
    }
    source.push_str(&helpers("__device__ __forceinline__"));
    source.push_str(&body);
    let params = params.iter().map(|p| p.dtype).collect();
    Ok(CudaSource { source, entries, params, library_product, scratch_bytes })
}

/// [`check_printable`] against the entry points' parameters.
fn check_io(loads: &[Load], stores: &[Store], expr: &Expr, dims: &[usize], params: &[Param]) -> Result<(), String> {
    check_printable(loads, stores, expr, dims, |a| params.get(a as usize).map(|p| (p.dtype, p.len, p.writable)))
}

/// The parameter list shared by all entry points.
fn signature(name: &str, params: &[Param]) -> String {
    format!("extern \"C\" __global__ void {name}({})", param_list(params))
}

/// `const float* a0, float* a1, ...`: the parameters as C declarations.
fn param_list(params: &[Param]) -> String {
    let list: Vec<String> = (params.iter().enumerate()).map(|(i, p)| param_decl(i, p)).collect();
    list.join(", ")
}

fn param_decl(i: usize, p: &Param) -> String {
    format!("{}{}* a{i}", if p.writable { "" } else { "const " }, storage_ctype(p.dtype))
}

/// The parameter list of a packed kernel's loop (see `loops::print_packed`): the entry's
/// parameters it reads or writes (`used`, in increasing order; by their names in the entry),
/// then its first thread and thread count. Only those: a loop taking all of a kernel's
/// hundreds of parameters made NVRTC's time grow with loops x parameters (5 to 9 s for a
/// kernel of 510 loops of one multiplication each, on an H200's host).
fn share_signature(name: &str, params: &[Param], used: &[u16]) -> String {
    let list: Vec<String> = used.iter().map(|&i| param_decl(i as usize, &params[i as usize])).collect();
    format!("__device__ __forceinline__ void {name}({}, long long t0, long long nt)", list.join(", "))
}

/// The grid-stride loop header over `n` items named `i`.
fn grid_loop(out: &mut String, var: &str, n: usize) {
    let _ = writeln!(
        out,
        "  for (long long {var} = (long long)blockIdx.x * blockDim.x + threadIdx.x; {var} < {n}LL; {var} += (long long)gridDim.x * blockDim.x) {{"
    );
}

/// Declares `d<k>` for each dimension of `dims` but `skip` (those of extent > 1), decomposing
/// `var` row-major over them.
fn index_vars(out: &mut String, var: &str, dims: &[usize], skip: Option<usize>) {
    let which: Vec<usize> = (0..dims.len()).filter(|&d| Some(d) != skip).collect();
    decompose(out, "    ", var, dims, &which, &used_dims(dims, &[], true));
}

/// `view`'s element offset at the indices `d<k>` of [`index_vars`], dimension `skip` left out.
fn offset_without(view: &View, skip: Option<usize>) -> String {
    let mut view = view.clone();
    if let Some(d) = skip {
        view.strides[d] = 0;
    }
    offset_expr(&view)
}
