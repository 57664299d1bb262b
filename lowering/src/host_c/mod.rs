//! Host C printing of the kernel IR: [`print()`] turns a kernel of map loops into C99 (with GNU
//! attributes) for the system's C compiler, one entry point per loop, so that the CPU device can
//! run fused elementwise work as compiled, vectorised machine code instead of interpreting it.
//!
//! An entry point `void NAME_loopK(unsigned char *const *args, long long start, long long end)`
//! computes indices `start..end` of loop `K` (`args[i]` is the start of argument `i`), so the
//! caller splits a loop into parallel tasks as it likes. The loop walks the index space in runs
//! along its last dimension; within a run, blocks of [`BLOCK`] elements are computed into local
//! arrays by one loop the compiler vectorises (loads straight from the arguments, the whole
//! expression per element, in registers), then written out: large contiguous f32 outputs with
//! non-temporal stores, which skip reading each line before overwriting it. As the CPU
//! evaluator does a chunk at a time, every load of a block happens before its stores, so an
//! output written in place over an input reads the input's old values. A loop whose arithmetic
//! outweighs its memory traffic at the target's vector width ([`compute_bound`]) stores its
//! large outputs directly from the vectorised loop instead: the stores then drain while the
//! next elements are computed, where a burst of streaming stores per block stalls the
//! arithmetic (C1's chain on an AVX2 machine: about 10% faster). Each element's loads still
//! come before its store, which is all an in-place update needs (the planner writes in place
//! over an input read at the output's own indices only).
//!
//! The printed code computes what the CPU evaluator computes, **bit for bit** except for the
//! payload of a NaN (the compiler may swap the operands of `+` and `*`, and the result of two NaN
//! operands carries the first one's payload), so that a kernel
//! gives the same result whether it runs interpreted or compiled: f32 `exp` and `tanh` are
//! braid's own polynomials printed from [`crate::vmath`]'s constants with the same fused
//! multiply-adds (`__builtin_fmaf`), other math functions are the same libm calls the
//! evaluator makes, and [`CC_OPTIONS`] forbid the compiler to contract `a * b + c`, to assume
//! no NaNs, or to evaluate math functions itself. `tests/native_kernels.rs` compiles about 150
//! random kernels and compares every output bit with the evaluator's (NaN payloads aside).
//!
//! A loop that transposes (a view walks its last two dimensions column-major) computes whole
//! tiles at a time instead of runs (`tiles`). Row kernels whose rows are walked with one stride
//! are printed by `rows` (one entry point over a range of rows; `columns` for positions after
//! the axis), or, for the CPU's few long rows split across threads (a whole-tensor reduction),
//! by `split` ([`print_split`]: entry points that each compute one segment of a row, the caller
//! combining the segments); both fold reductions as `fold` prints them.
//!
//! f16 and bf16 values are stored as their bits and live in f32 registers, converted by the
//! branch-free functions of `HALVES` (under the CUDA printer's names, so `cexpr`
//! prints both); f16 runs along the last dimension are widened and narrowed a block at a time,
//! with F16C's instructions where the CPU has them.
//!
//! Not printed (an `Err`, and the CPU interprets the kernel): other row kernels (see `rows` and
//! `split`) and matrix products. The printer only prints: compiling, caching and loading are the
//! device's (`braid_devices::cpu::native`).

mod columns;
mod fold;
mod rows;
mod split;
#[cfg(test)]
mod tests;
mod tiles;

use crate::cexpr::*;
use crate::kernel::{Body, Kernel, MapLoop, Store, View};
use crate::vmath;
use braid_graph::DType;
use braid_graph::expr::ExprOp;
use std::fmt::Write;

/// Compiler options the printed source needs (with `-shared -fPIC` to build a library, and the
/// target's instruction-set flags): no contraction of `a * b + c` into a fused multiply-add
/// (which the evaluator never does implicitly), no built-in evaluation of math functions (gcc
/// would fold or replace some, such as `pow(x, 2)`, with results that can differ in the last
/// bit from libm's), no `errno` from square roots (so they are one instruction, as the
/// evaluator's are). None of them changes a result.
pub const CC_OPTIONS: &[&str] =
    &["-std=gnu11", "-O3", "-ffp-contract=off", "-fno-builtin", "-fno-math-errno", "-fno-trapping-math", "-w"];

/// Elements computed per block into the local arrays (they stay in L1).
pub const BLOCK: usize = 256;

/// A printed kernel: its source and its entry points, one per map loop, in order, or one for a
/// row kernel.
#[derive(Clone, Debug)]
pub struct HostSource {
    pub source: String,
    pub entries: Vec<String>,
    /// For a row kernel, the bytes of scratch each running call of its entry point needs (see
    /// `rows`); `None` for map loops and split rows.
    pub row_scratch: Option<usize>,
    /// A row kernel printed split ([`print_split`]): its entries are one fold per reduction,
    /// then the row stores, then the element stores.
    pub split_rows: bool,
}

pub use split::SPLIT_SLOT;

/// The machine the printed code is tuned for (never what it computes: every target gives the
/// same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostTarget {
    /// f32 outputs of at least this many bytes written contiguously are not kept in cache:
    /// streamed (non-temporal stores), or stored directly by a [`compute_bound`] loop.
    pub stream_bytes: usize,
    /// f32 lanes of the vector level the code is compiled for (8 for AVX2, 16 for AVX-512).
    pub f32_lanes: usize,
}

/// Prints `kernel` (map loops, or a row kernel `rows` prints) as host C; entry points are named after `name` (a C
/// identifier), the code tuned for `target`. Errors on what is not printed (see the module
/// docs) and on IR the CPU would reject too.
pub fn print(kernel: &Kernel, name: &str, target: HostTarget) -> Result<HostSource, String> {
    check_name(name)?;
    let mut body = String::new();
    let mut entries = vec![];
    let mut row_scratch = None;
    match &kernel.body {
        Body::Map(loops) => {
            for (k, l) in loops.iter().enumerate() {
                let entry = format!("{name}_loop{k}");
                print_loop(&mut body, l, &entry, kernel, target)?;
                entries.push(entry);
            }
        }
        Body::Rows(r) => {
            let entry = format!("{name}_rows");
            row_scratch = Some(rows::print_rows(&mut body, r, kernel, &entry, target.stream_bytes)?);
            entries.push(entry);
        }
        _ => return Err("only map loops and row kernels are printed for the host".into()),
    }
    Ok(HostSource { source: with_prelude(name, &body), entries, row_scratch, split_rows: false })
}

/// Prints row kernel `kernel` split across threads (the CPU's form for its few long rows, such
/// as a whole-tensor reduction): entry points that compute one segment of a row each, which
/// the caller runs and combines (see `split`). Errors on what is not printed, as [`print`].
pub fn print_split(kernel: &Kernel, name: &str, target: HostTarget) -> Result<HostSource, String> {
    check_name(name)?;
    let Body::Rows(r) = &kernel.body else { return Err("only row kernels are printed split".into()) };
    let mut body = String::new();
    let entries = split::print_split(&mut body, r, kernel, name, target.stream_bytes)?;
    Ok(HostSource { source: with_prelude(name, &body), entries, row_scratch: None, split_rows: true })
}

/// Errs unless `name` is a C identifier.
fn check_name(name: &str) -> Result<(), String> {
    let ident = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ident { Ok(()) } else { Err(format!("kernel name {name:?} is not a C identifier")) }
}

/// The whole source of kernel `name`: the options it needs, the prelude, then `body`.
fn with_prelude(name: &str, body: &str) -> String {
    let mut source = format!("// braid kernel `{name}`: host C ({}).\n", CC_OPTIONS.join(" "));
    source.push_str(&prelude());
    source.push_str(body);
    source
}

/// Headers, bit casts, braid's conversions and random numbers, `exp` and `tanh`, and the
/// streaming copy.
fn prelude() -> String {
    let f = |v: f32| float_literal(v as f64, DType::F32);
    let [lo, hi] = vmath::EXP_RANGE.map(f);
    let (log2e, round) = (f(std::f32::consts::LOG2_E), f(vmath::ROUND));
    let (ln2_hi, ln2_lo) = (f(vmath::LN2_HI), f(vmath::LN2_LO));
    let horner = |coeffs: &[f32], var: &str| {
        let mut p = f(coeffs[0]);
        for &c in &coeffs[1..] {
            p = format!("__builtin_fmaf({p}, {var}, {})", f(c));
        }
        p
    };
    let (exp_poly, tanh_poly) = (horner(&vmath::EXP_POLY, "r"), horner(&vmath::TANH_POLY, "z"));
    let small = f(vmath::TANH_SMALL);
    format!(
        r#"#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif
static inline float __int_as_float(int b) {{ float f; __builtin_memcpy(&f, &b, 4); return f; }}
static inline double __longlong_as_double(long long b) {{ double f; __builtin_memcpy(&f, &b, 8); return f; }}
{halves}
{transpose}{helpers}
// braid's f32 exp and tanh (braid_lowering::vmath), step for step. Every helper is inlined
// (a kernel of many nodes is past gcc's inlining limits, and a call per element would keep its
// loop from being vectorised).
static inline __attribute__((always_inline)) float braid_expf(float x) {{
  const float t = __builtin_fmaf(x, {log2e}, {round});
  const float n = t - {round};
  uint32_t ni;
  __builtin_memcpy(&ni, &t, 4);
  ni -= 0x4B400000u;
  const float r = __builtin_fmaf(-n, {ln2_lo}, __builtin_fmaf(-n, {ln2_hi}, x));
  const float p = {exp_poly};
  const float e = p * (r * r) + r + 1.0f;
  const uint32_t n1 = (uint32_t)((int32_t)ni >> 1), n2 = ni - n1;
  const uint32_t b1 = (n1 + 127u) << 23, b2 = (n2 + 127u) << 23;
  float p1, p2;
  __builtin_memcpy(&p1, &b1, 4);
  __builtin_memcpy(&p2, &b2, 4);
  const float y = e * p1 * p2;
  const float y_hi = x > {hi} ? __builtin_inff() : y;
  return x < {lo} ? 0.0f : y_hi;
}}
static inline __attribute__((always_inline)) float braid_tanhf(float x) {{
  const float a = __builtin_fabsf(x), z = x * x;
  const float p = {tanh_poly};
  const float small = __builtin_copysignf(__builtin_fmaf(x * z, p, x), x);
  const float e = braid_expf(2.0f * a);
  const float large = __builtin_copysignf(1.0f - 2.0f / (e + 1.0f), x);
  return a < {small} ? small : large;
}}
// dst[0..n] = src[0..n] with non-temporal stores of whole vectors where dst is aligned.
static inline void braid_stream_f32(float *dst, const float *src, int n) {{
  int i = 0;
#if defined(__AVX512F__)
  for (; i < n && ((uintptr_t)(dst + i) & 63); i++) dst[i] = src[i];
  for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#elif defined(__SSE__)
  for (; i < n && ((uintptr_t)(dst + i) & 15); i++) dst[i] = src[i];
  for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
#endif
  for (; i < n; i++) dst[i] = src[i];
}}
"#,
        halves = HALVES,
        transpose = tiles::TRANSPOSE,
        helpers = helpers("static inline __attribute__((always_inline))")
    )
}

/// f16 and bf16 values, stored as their bits, under the names the CUDA printer's expressions
/// use ([`crate::cexpr`]), converted as `braid_graph::dtype` and the `half` crate convert: to
/// nearest, ties to even, one rounding from f64 (through f32 rounded to odd), NaN stays NaN
/// (the f16 ones are `braid_graph::dtype::f16_bits_from_f32` and `f32_from_f16_bits`, step for
/// step, which the interpreter runs).
/// Written without branches, as integer operations on the bits, so that gcc vectorises the
/// loops that call them (gcc 12 converts `_Float16` one element at a time, even with F16C).
/// `tests/native_kernels.rs` checks them against the interpreter; every f32 bit pattern was
/// checked against F16C's conversion when they were written.
const HALVES: &str = r#"typedef uint16_t __half;
typedef uint16_t __nv_bfloat16;
#define BRAID_INLINE static inline __attribute__((always_inline))
BRAID_INLINE uint32_t braid_f32_bits(float f) { uint32_t b; __builtin_memcpy(&b, &f, 4); return b; }
BRAID_INLINE float braid_float(uint32_t b) { float f; __builtin_memcpy(&f, &b, 4); return f; }
BRAID_INLINE float __half2float(__half h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  // Normal numbers rebias the exponent (15 -> 127), infinities and NaNs keep all ones (NaNs
  // made quiet), and subnormals are m * 2^-24, exact in f32.
  const uint32_t normal = sign | ((e + 112u) << 23) | (m << 13);
  const uint32_t special = sign | 0x7f800000u | (m != 0u ? 0x400000u : 0u) | (m << 13);
  const uint32_t sub = sign | braid_f32_bits((float)m * 0x1p-24f);
  const uint32_t bits = e == 0u ? sub : e == 31u ? special : normal;
  return braid_float(bits);
}
BRAID_INLINE __half __float2half_rn(float f) {
  const uint32_t x = braid_f32_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  // A NaN stays quiet with its payload's top bits; from 65520 on (half way from the largest
  // f16, 65504, to 2^16) the value rounds to infinity.
  const uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu), inf = 0x7c00u;
  // Normal f16 (from 2^-14): rebias the exponent (127 -> 15) and round off 13 bits, ties to
  // even; a carry steps the exponent.
  const uint32_t rebiased = a - 0x38000000u;
  const uint32_t normal = (rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13;
  // Subnormal f16 (below 2^-14): adding 0.5 leaves the value's multiples of 2^-24, rounded to
  // nearest even, in the low bits.
  const uint32_t sub = braid_f32_bits(braid_float(a) + 0.5f) - 0x3f000000u;
  const uint32_t bits = a > 0x7f800000u ? nan : a >= 0x477ff000u ? inf : a >= 0x38800000u ? normal : sub;
  return (__half)(sign | bits);
}
// n f16 values to f32 and back, F16C's conversions 8 at a time where the CPU has them (the
// same bits as the functions above: both round to nearest even and keep NaNs quiet).
static inline void braid_widen_f16(float *dst, const __half *src, int n) {
  int i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
  for (; i < n; i++) dst[i] = __half2float(src[i]);
}
static inline void braid_narrow_f16(__half *dst, const float *src, int n) {
  int i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; i++) dst[i] = __float2half_rn(src[i]);
}
BRAID_INLINE float __bfloat162float(__nv_bfloat16 b) { return braid_float((uint32_t)b << 16); }
BRAID_INLINE __nv_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t x = braid_f32_bits(f);
  const uint32_t nan = (x >> 16) | 0x40u, rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return (__nv_bfloat16)((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
// v rounded to f32 "to odd" (truncated, the last bit set when inexact): rounding that to f16 or
// bf16 rounds v once.
BRAID_INLINE float braid_f32_odd(double v) {
  const float near = (float)v;
  const uint32_t b = braid_f32_bits(near);
  const uint32_t truncated = __builtin_fabs((double)near) > __builtin_fabs(v) ? b - 1u : b;
  const float odd = braid_float(truncated | 1u);
  return isnan(v) || (double)near == v ? near : odd;
}
BRAID_INLINE __half __double2half(double v) { return __float2half_rn(braid_f32_odd(v)); }
BRAID_INLINE __nv_bfloat16 __double2bfloat16(double v) { return __float2bfloat16_rn(braid_f32_odd(v)); }
"#;

/// The C type of an array of `d` values in a block or a row's scratch: a compute type, but bytes
/// for bools (gcc does not vectorise a loop that stores into a `bool` array).
fn array_ctype(d: DType) -> &'static str {
    if d == DType::Bool { "unsigned char" } else { ctype(d) }
}

/// `base + k * stride`: element `k` of a run starting at `base`.
fn along(base: &str, k: &str, stride: isize) -> String {
    match stride {
        0 => base.to_string(),
        1 => format!("{base} + {k}"),
        -1 => format!("{base} - {k}"),
        s if s < 0 => format!("{base} - {k} * {}", s.unsigned_abs()),
        s => format!("{base} + {k} * {s}"),
    }
}

/// Indices the printed loop computes between two index decompositions: a whole tile where
/// it computes `l` a tile at a time (a transposing loop, see `tiles`), else a run along the
/// last dimension. The CPU compiles loops of short runs only once they have run many times
/// (their index arithmetic per run eats the gain).
pub fn run_length(l: &MapLoop) -> usize {
    tiles::tile_of(l).map_or_else(|| l.dims.last().copied().unwrap_or(1), |(a, b)| a * b)
}

/// Whether `l`'s arithmetic per element outweighs its memory traffic on a machine of `f32_lanes`
/// lanes: vector operations per element (an `exp` about 25, a `tanh` 40, a division or square
/// root 4, a libm call, which runs one element at a time, 200) over the lanes, against half
/// the bytes loaded and stored per element. Fitted to two measurements of C1's chain (about 70
/// operations, 12 bytes): compute-bound with AVX2's 8 lanes (streaming its output: about 10% slower),
/// at the memory floor with AVX-512's 16 (stop 30, BENCHMARKS.md).
pub fn compute_bound(l: &MapLoop, f32_lanes: usize) -> bool {
    use braid_graph::expr::{PrimBinary, PrimUnary};
    let ops: usize = (l.expr.nodes.iter())
        .map(|n| match n.op {
            ExprOp::Load(_) | ExprOp::Const(_) | ExprOp::ConstInt(_) => 0,
            ExprOp::Unary(PrimUnary::Exp, _) if n.dtype == DType::F32 => 25,
            ExprOp::Unary(PrimUnary::Tanh, _) if n.dtype == DType::F32 => 40,
            ExprOp::Unary(PrimUnary::Exp | PrimUnary::Tanh | PrimUnary::Log | PrimUnary::Sin | PrimUnary::Cos, _) => {
                200
            }
            ExprOp::Binary(PrimBinary::Pow, ..) => 200,
            ExprOp::Unary(PrimUnary::Sqrt, _) | ExprOp::Binary(PrimBinary::Div, ..) => 4,
            // Normal variates call libm's `logf`, `cosf` and `sqrtf`; uniform ones are integer
            // mixing, about 20 operations.
            ExprOp::Random { dist: braid_graph::expr::Distribution::Normal, .. } => 200,
            ExprOp::Random { .. } => 20,
            _ => 1,
        })
        .sum();
    let bytes: usize = l.loads.iter().map(|x| x.dtype.size()).chain(l.stores.iter().map(|s| s.dtype.size())).sum();
    2 * ops >= f32_lanes * bytes
}

fn print_loop(out: &mut String, l: &MapLoop, name: &str, kernel: &Kernel, target: HostTarget) -> Result<(), String> {
    let arg = |a: u16| kernel.args.get(a as usize).map(|p| (p.dtype, p.len, a as usize >= kernel.inputs));
    check_printable(&l.loads, &l.stores, &l.expr, &l.dims, arg)?;
    // Lowering never produces these; both would make results depend on how indices are split
    // into blocks and tasks.
    if let Some(x) = l.loads.iter().find(|x| x.arg as usize >= kernel.inputs) {
        return Err(format!("load from argument {}, an output", x.arg));
    }
    let repeats = |v: &View| v.dims.iter().zip(&v.strides).any(|(&d, &s)| d > 1 && s == 0);
    if let Some(s) = l.stores.iter().find(|s| repeats(&s.view)) {
        return Err(format!("store through {:?}, which writes one element from several indices", s.view));
    }
    // A loop of rank 0 (one element) is walked as one run of length 1.
    let rank = l.dims.len().max(1);
    let dim = |d: usize| l.dims.get(d).copied().unwrap_or(1);
    let inner_stride = |v: &View| v.strides.get(rank - 1).copied().unwrap_or(0);
    let (live, _) = live(&l.expr, &l.loads, &l.stores);
    let read = |slot: usize| (l.expr.nodes.iter().zip(&live)).any(|(n, &on)| on && n.op == ExprOp::Load(slot as u16));
    let _ = writeln!(out, "\n// {} indices over dims {:?}.", l.numel(), l.dims.as_slice());
    let _ = writeln!(out, "void {name}(unsigned char *const *args, long long start, long long end) {{");
    // Only the arguments this loop reads or writes: a kernel of many loops (a cat of 512
    // parts) would otherwise declare every argument in every loop, source quadratic in parts.
    let mut used: Vec<u16> = l.loads.iter().map(|x| x.arg).chain(l.stores.iter().map(|s| s.arg)).collect();
    used.sort_unstable();
    used.dedup();
    for i in used.into_iter().map(usize::from) {
        let c = if i < kernel.inputs { "const " } else { "" };
        let t = storage_ctype(kernel.args[i].dtype);
        let _ = writeln!(out, "  {c}{t} *const a{i} = ({c}{t} *)args[{i}];");
    }
    let _ = writeln!(out, "  long long i = start;\n  while (i < end) {{");
    // The index of `i` along each dimension, the innermost last.
    let inner = dim(rank - 1);
    let _ = writeln!(out, "    const long long d{} = i % {inner}LL;", rank - 1);
    if rank > 1 {
        let _ = writeln!(out, "    long long rest = i / {inner}LL;");
        for d in (0..rank - 1).rev() {
            if d == 0 {
                let _ = writeln!(out, "    const long long d0 = rest;");
            } else {
                let _ = writeln!(out, "    const long long d{d} = rest % {}LL;\n    rest /= {}LL;", dim(d), dim(d));
            }
        }
    }
    let _ =
        writeln!(out, "    const long long run = {inner}LL - d{0} < end - i ? {inner}LL - d{0} : end - i;", rank - 1);
    for (slot, load) in l.loads.iter().enumerate() {
        let _ = writeln!(out, "    const long long o{slot} = {};", offset_expr(&load.view));
    }
    for (s, store) in l.stores.iter().enumerate() {
        let _ = writeln!(out, "    const long long w{s} = {};", offset_expr(&store.view));
    }
    if let Some(tile) = tiles::tile_of(l) {
        tiles::print_whole_tile(out, l, &live, tile)?;
    }
    let _ = writeln!(
        out,
        "    for (long long jb = 0; jb < run; jb += {BLOCK}) {{\n      const int n = run - jb < {BLOCK} ? (int)(run - jb) : {BLOCK};"
    );
    // Large contiguous f32 outputs leave the cache: streamed after each block, or stored
    // directly by a loop whose arithmetic hides the stores.
    let large = |s: &Store| {
        s.dtype == DType::F32 && s.view.is_contiguous() && kernel.args[s.arg as usize].len * 4 >= target.stream_bytes
    };
    let direct = compute_bound(l, target.f32_lanes);
    let direct = |s: &Store| direct && large(s);
    for (s, store) in l.stores.iter().enumerate().filter(|(_, s)| !direct(s)) {
        let t = array_ctype(l.expr.nodes[store.value as usize].dtype);
        let _ = writeln!(out, "      {t} t{s}[{BLOCK}] __attribute__((aligned(64)));");
    }
    if l.stores.iter().any(direct) {
        // An output may be an input updated in place (read at the same index only): each
        // element's loads come before its store, in vector lanes too.
        out.push_str("      #pragma GCC ivdep\n");
    }
    // f16 loads read along the run are widened a block at a time (F16C's conversion where the
    // CPU has it: gcc does not vectorise one conversion per element).
    let widened = |slot: usize| l.loads[slot].dtype == DType::F16 && inner_stride(&l.loads[slot].view) == 1;
    for (slot, x) in l.loads.iter().enumerate().filter(|&(slot, _)| widened(slot) && read(slot)) {
        let _ = writeln!(out, "      float h{slot}[{BLOCK}] __attribute__((aligned(64)));");
        let _ = writeln!(out, "      braid_widen_f16(h{slot}, a{} + o{slot} + jb, n);", x.arg);
    }
    let _ = writeln!(out, "      for (int jj = 0; jj < n; jj++) {{\n        const long long k = jb + jj;");
    // Loads through equal views share one base offset, whatever their arguments.
    let offset = |v: &View| {
        let slot = l.loads.iter().position(|x| &x.view == v).expect("a load's own view");
        along(&format!("o{slot}"), "k", inner_stride(v))
    };
    for (i, n) in l.expr.nodes.iter().enumerate() {
        // Checked even when dead: the CPU evaluates every node.
        let mut e = node_expr(Dialect::Host, &l.expr, &l.loads, i, &offset, "(i + k)")?;
        if let ExprOp::Load(slot) = n.op
            && widened(slot as usize)
        {
            e = format!("h{slot}[jj]");
        }
        if live[i] {
            let _ = writeln!(out, "        const {} v{i} = {e};", ctype(n.dtype));
        }
    }
    for (s, store) in l.stores.iter().enumerate() {
        if direct(store) {
            let _ = writeln!(out, "        a{}[w{s} + k] = v{};", store.arg, store.value);
        } else {
            let _ = writeln!(out, "        t{s}[jj] = v{};", store.value);
        }
    }
    out.push_str("      }\n");
    let mut streams = false;
    for (s, store) in l.stores.iter().enumerate().filter(|(_, s)| !direct(s)) {
        let a = store.arg;
        if large(store) {
            streams = true;
            let _ = writeln!(out, "      braid_stream_f32(a{a} + w{s} + jb, t{s}, n);");
        } else {
            if store.dtype == DType::F16 && inner_stride(&store.view) == 1 {
                let _ = writeln!(out, "      braid_narrow_f16(a{a} + w{s} + jb, t{s}, n);");
                continue;
            }
            let at = along(&format!("w{s}"), "(jb + jj)", inner_stride(&store.view));
            let value = storage_value(store.dtype, &format!("t{s}[jj]"));
            let _ = writeln!(out, "      for (int jj = 0; jj < n; jj++) a{a}[{at}] = {value};");
        }
    }
    out.push_str("    }\n    i += run;\n  }\n");
    if streams {
        // Non-temporal stores are weakly ordered: fence them before the caller reports done.
        out.push_str("#if defined(__SSE__)\n  _mm_sfence();\n#endif\n");
    }
    out.push_str("}\n");
    Ok(())
}
