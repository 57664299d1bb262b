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
//! Row kernels whose rows are walked with one stride are printed by `rows` (one entry point
//! over a range of rows; `columns` for positions after the axis).
//!
//! Not printed (an `Err`, and the CPU interprets the kernel): other row kernels (see `rows`),
//! matrix products, and kernels touching f16 or bf16. The printer only prints: compiling, caching and loading
//! are the device's (`braid_devices::cpu::native`).

mod columns;
mod rows;
#[cfg(test)]
mod tests;

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
    /// `rows`); `None` for map loops.
    pub row_scratch: Option<usize>,
}

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
    let ident = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !ident {
        return Err(format!("kernel name {name:?} is not a C identifier"));
    }
    let half = |d: DType| matches!(d, DType::F16 | DType::BF16);
    if let Some(a) = kernel.args.iter().find(|a| half(a.dtype)) {
        return Err(format!("an argument of {} (half types are not printed for the host)", a.dtype));
    }
    let half_cast =
        |e: &braid_graph::expr::Expr| e.nodes.iter().any(|n| matches!(n.op, ExprOp::Cast(to, _) if half(to)));
    let mut body = String::new();
    let mut entries = vec![];
    let mut row_scratch = None;
    match &kernel.body {
        Body::Map(loops) => {
            for (k, l) in loops.iter().enumerate() {
                if half_cast(&l.expr) {
                    return Err("a cast to a half type (not printed for the host)".into());
                }
                let entry = format!("{name}_loop{k}");
                print_loop(&mut body, l, &entry, kernel, target)?;
                entries.push(entry);
            }
        }
        Body::Rows(r) => {
            if half_cast(&r.expr) {
                return Err("a cast to a half type (not printed for the host)".into());
            }
            let entry = format!("{name}_rows");
            row_scratch = Some(rows::print_rows(&mut body, r, kernel, &entry, target.stream_bytes)?);
            entries.push(entry);
        }
        _ => return Err("only map loops and row kernels are printed for the host".into()),
    }
    let mut source = format!("// braid kernel `{name}`: host C ({}).\n", CC_OPTIONS.join(" "));
    source.push_str(&prelude());
    source.push_str(&body);
    Ok(HostSource { source, entries, row_scratch })
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
{helpers}
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
        helpers = helpers("static inline __attribute__((always_inline))")
    )
}

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
    let _ = writeln!(out, "      for (int jj = 0; jj < n; jj++) {{\n        const long long k = jb + jj;");
    // Loads through equal views share one base offset, whatever their arguments.
    let offset = |v: &View| {
        let slot = l.loads.iter().position(|x| &x.view == v).expect("a load's own view");
        along(&format!("o{slot}"), "k", inner_stride(v))
    };
    for (i, n) in l.expr.nodes.iter().enumerate() {
        // Checked even when dead: the CPU evaluates every node.
        let e = node_expr(Dialect::Host, &l.expr, &l.loads, i, &offset, "(i + k)")?;
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
            let conv = if store.dtype == DType::Bool { "(unsigned char)" } else { "" };
            let at = along(&format!("w{s}"), "(jb + jj)", inner_stride(&store.view));
            let _ = writeln!(out, "      for (int jj = 0; jj < n; jj++) a{a}[{at}] = {conv}t{s}[jj];");
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
