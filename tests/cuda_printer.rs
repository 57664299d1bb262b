//! The CUDA C printer against the CPU runner, with no GPU: random kernels are printed, compiled
//! on the host by g++ through a small header that emulates the CUDA built-ins they use, run on
//! random inputs, and compared with `braid_devices::cpu::run_kernel` on the same inputs.
//!
//! All kernels go into one C++ file and one g++ run (7 to 20 s on 2 cores). Map loops run with 8
//! threads per block and at most 3 blocks, so the grid-stride loop wraps; row kernels run three
//! times, with 1, 4 and 32 threads per block ([`ROW_BLOCKS`]; column kernels also at their
//! printed size, where their sweeps step by a constant): one thread checks the index math,
//! the expressions and the phases alone; 4 and 32 run the threads of a block as real host
//! threads meeting at `__syncthreads` (a barrier; warp shuffles are emulated through it), so the
//! combines of partial results run as on a GPU and the row elements a kernel keeps in shared
//! memory between phases are read back at a block size other than the printed one; the `warps`
//! case (ties and NaN across lanes and warps) also runs with 64 and 256, more than one warp
//! (`tests/cuda_kernels.rs` runs them on a GPU at every block size, with rows of a million
//! elements). The random rows are short, so they keep
//! their loads in shared memory; [`long_row_cases`] are too long for that budget and take the
//! multi-pass path, or, being few, are split into segments through scratch memory;
//! [`column_cases`] run along an axis before the last, as column kernels. Kernels with vector
//! paths (16-byte accesses of neighbouring elements) take them for even case numbers, whose
//! arguments start 16-byte aligned, and their scalar paths for odd ones ([`layout`]). Integer
//! matrix products are printed whole (cuBLAS cannot wrap them); float ones start from the
//! CPU's product, as they would from cuBLAS's. Gathers ([`gathers`]: every element size,
//! strided, broadcast and reversed views, indices out of range on both sides) must move the
//! CPU's bits exactly, and scatter-adds ([`scatters`]: every dtype, many source elements to one
//! output element, views as the gathers', with a base or none) fold each sum in the CPU's order,
//! to its bits.
//!
//! Comparison: integers and bools exactly, floats bit for bit (NaN equals NaN) unless they
//! derive from f32 `exp`/`tanh` (the CPU's own polynomials, a few ulps from libm's) or from a
//! float sum (another summation order): those within 1e-5 relative or 4 ulps of their storage
//! type, whichever is looser (row kernels: relative to at least 1, for `x - mean`). So that an
//! ulp stays an ulp, random DAGs never feed such values to comparisons, casts to integers or
//! half types, division, subtraction, logs and the like, and the row kernels' templates divide
//! only by sums of positive values. Casts to f16 and bf16 round once on both sides (this test
//! found that the CPU's, through the `half` crate's f64 conversions, could round twice; they
//! now go through `braid_graph::dtype::{f16_from_f64, bf16_from_f64}`).

#[path = "cuda_printer/cases.rs"]
mod cases;
mod common;
#[path = "cuda_printer/gathers.rs"]
mod gathers;
#[path = "cuda_printer/quant_cases.rs"]
mod quant_cases;
#[path = "cuda_printer/scatters.rs"]
mod scatters;
#[path = "cuda_printer/warps.rs"]
mod warps;

use cases::*;

use braid_devices::cpu::run_kernel;
use braid_graph::{DType, QuantLayout, Scheme};
use braid_lowering::cuda::{self, Launch};
use braid_lowering::{Body, Kernel, MapLoop, RowKernel};
use common::Rng;
use std::fmt::Write;
use std::process::Command;

/// What the printed kernels need from CUDA, for g++: qualifiers, thread coordinates as host
/// globals, barriers, warp shuffles and ballots, bit casts, and correctly rounded f16/bf16 conversions.
const HEADER: &str = r#"#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
using std::isnan;
using std::isfinite;
#define __global__
#define __launch_bounds__(...)
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct braid_dim3 { unsigned x, y, z; };
static thread_local braid_dim3 blockIdx, threadIdx;
static braid_dim3 blockDim, gridDim;
// `__syncthreads` for the `n` threads of the block being run (reusable, one generation a use).
struct braid_barrier {
  std::mutex m;
  std::condition_variable cv;
  unsigned n = 1, waiting = 0, generation = 0;
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    unsigned g = generation;
    if (++waiting == n) { waiting = 0; ++generation; cv.notify_all(); return; }
    cv.wait(lock, [&] { return generation != g; });
  }
};
static braid_barrier braid_block;
static inline void __syncthreads() { braid_block.wait(); }
// Warp shuffles, for a block whose threads all call them together (the printed combines do):
// each thread writes its value to its slot, meets the others at the barrier, reads its source
// lane's slot and meets them again before the slots are reused. Aborts where CUDA leaves the
// result undefined: a lane outside `mask` calling, or reading a lane outside it.
static unsigned long long braid_slots[1024];
template <class T> static T braid_shuffle(unsigned mask, T v, unsigned src) {
  static_assert(sizeof(T) <= 8, "a shuffle moves at most 64 bits");
  unsigned lane = threadIdx.x % 32;
  if (!(mask >> lane & 1) || !(mask >> src % 32 & 1) || src >= blockDim.x) {
    std::fprintf(stderr, "shuffle by lane %u of lane %u outside mask %x\n", lane, src % 32, mask);
    std::abort();
  }
  std::memcpy(&braid_slots[threadIdx.x], &v, sizeof(T));
  __syncthreads();
  T r;
  std::memcpy(&r, &braid_slots[src], sizeof(T));
  __syncthreads();
  return r;
}
// `width` splits the warp into segments of that many lanes (a power of two up to 32).
template <class T> static T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  unsigned in_segment = threadIdx.x % 32 % (unsigned)width;
  return braid_shuffle(mask, v, in_segment + delta < (unsigned)width ? threadIdx.x + delta : threadIdx.x);
}
template <class T> static T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  unsigned in_segment = threadIdx.x % 32 % (unsigned)width;
  return braid_shuffle(mask, v, threadIdx.x - in_segment + (unsigned)src % (unsigned)width);
}
// A ballot of the lanes in `mask` of the calling warp (all of the block's threads call it
// together, as the shuffles).
static unsigned __ballot_sync(unsigned mask, int pred) {
  unsigned lane = threadIdx.x % 32, first = threadIdx.x - lane;
  if (!(mask >> lane & 1)) {
    std::fprintf(stderr, "ballot by lane %u outside mask %x\n", lane, mask);
    std::abort();
  }
  braid_slots[threadIdx.x] = pred != 0;
  __syncthreads();
  unsigned bits = 0;
  for (unsigned l = 0; l < 32 && first + l < blockDim.x; ++l)
    if (mask >> l & 1 && braid_slots[first + l]) bits |= 1u << l;
  __syncthreads();
  return bits;
}
template <class T> static T __shfl_xor_sync(unsigned mask, T v, int lanes) {
  return braid_shuffle(mask, v, threadIdx.x ^ (unsigned)lanes);
}
static inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
struct alignas(16) float4 { float x, y, z, w; };
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
template <class T> static T __ldg(const T* p) { return *p; }
template <class T> static T __ldcs(const T* p) { return *p; }
// Byte n of the result is byte (s >> 4n) & 7 of the eight bytes of x (0-3) and y (4-7).
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned long long b = (unsigned long long)y << 32 | x, r = 0;
  for (int n = 0; n < 4; ++n) r |= (b >> (8 * ((s >> (4 * n)) & 7)) & 0xff) << (8 * n);
  return (unsigned)r;
}
static inline float __uint_as_float(unsigned b) { float f; std::memcpy(&f, &b, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned b; std::memcpy(&b, &f, 4); return b; }
using std::fmaf;
using std::rintf;
static inline float __int_as_float(int b) { float f; std::memcpy(&f, &b, 4); return f; }
static inline double __longlong_as_double(long long b) { double f; std::memcpy(&f, &b, 8); return f; }
// x rounded to nearest-even with p significant bits and smallest normal exponent emin.
static inline double braid_round(double x, int p, int emin) {
  if (!std::isfinite(x) || x == 0) return x;
  int e;
  std::frexp(x, &e);
  int q = (e - 1 > emin ? e - 1 : emin) - (p - 1);
  return std::ldexp(std::nearbyint(std::ldexp(x, -q)), q);
}
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
static inline __half __double2half(double x) {
  double r = braid_round(x, 11, -14), a = std::fabs(r);
  unsigned short s = std::signbit(r) ? 0x8000 : 0;
  if (std::isnan(r)) return {0x7e00};
  if (a > 65504.0) return {(unsigned short)(s | 0x7c00)};
  if (a < 0x1p-14) return {(unsigned short)(s | (unsigned short)(a * 0x1p24))};
  int e;
  double m = std::frexp(a, &e);
  return {(unsigned short)(s | (e + 14) << 10 | (unsigned short)((m * 2 - 1) * 1024))};
}
static inline __half __float2half_rn(float x) { return __double2half(x); }
static inline float __half2float(__half h) {
  int e = h.x >> 10 & 31, m = h.x & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(m + 1024, e - 25);
  return (float)(h.x & 0x8000 ? -v : v);
}
static inline __nv_bfloat16 __double2bfloat16(double x) {
  if (std::isnan(x)) return {0x7fc0};
  float f = (float)braid_round(x, 8, -126);
  unsigned int b;
  std::memcpy(&b, &f, 4);
  return {(unsigned short)(b >> 16)};
}
static inline __nv_bfloat16 __float2bfloat16_rn(float x) { return __double2bfloat16(x); }
static inline float __bfloat162float(__nv_bfloat16 h) {
  unsigned int b = (unsigned int)h.x << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
// A case's file in memory, aligned as a device allocation is (to more than a vector access).
struct alignas(16) braid_line { unsigned char bytes[16]; };
static std::vector<braid_line> braid_read(const std::string& path, size_t bytes) {
  std::vector<braid_line> mem(bytes / 16 + 1);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(mem.data(), 1, bytes, f) != bytes) { std::fprintf(stderr, "cannot read %s\n", path.c_str()); std::exit(2); }
  std::fclose(f);
  return mem;
}
static void braid_write(const std::string& path, const std::vector<braid_line>& mem, size_t bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(mem.data(), 1, bytes, f) != bytes) { std::fprintf(stderr, "cannot write %s\n", path.c_str()); std::exit(2); }
  std::fclose(f);
}
// Runs f as every thread of every block, one after another.
template <class F> static void braid_launch(unsigned grid, unsigned block, F f) {
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  for (unsigned b = 0; b < grid; ++b)
    for (unsigned t = 0; t < block; ++t) {
      blockIdx = {b, 0, 0};
      threadIdx = {t, 0, 0};
      f();
    }
}
// Runs f as every thread of every block: blocks one after another, the threads of a block as
// concurrent host threads, so that they meet at __syncthreads and share the `__shared__` (static)
// arrays as a block does.
template <class F> static void braid_launch_threads(unsigned grid, unsigned block, F f) {
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  braid_block.n = block;
  for (unsigned b = 0; b < grid; ++b) {
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; ++t)
      threads.emplace_back([b, t, &f] {
        blockIdx = {b, 0, 0};
        threadIdx = {t, 0, 0};
        f();
      });
    for (auto& t : threads) t.join();
  }
  braid_block.n = 1;
}
"#;

/// Runs `k` on the CPU over copies of `init`; returns every argument's bytes after.
fn run_cpu(k: &Kernel, init: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, String> {
    run_on_copies(k, init, |args| run_kernel(k, args))
}

/// Byte offsets of each argument in case `n`'s file, and the total: for even `n` each argument
/// starts at a multiple of 16 bytes (the printed vector paths run), for odd `n` 8 bytes past one
/// (no argument is aligned for a vector access, so the kernels' scalar paths run alone).
fn layout(init: &[Vec<u8>], n: usize) -> (Vec<usize>, usize) {
    let skew = if n % 2 == 1 { 8 } else { 0 };
    let mut at = 0;
    let mut offsets = vec![];
    for b in init {
        offsets.push(at + skew);
        at += (skew + b.len()).div_ceil(16) * 16;
    }
    (offsets, at)
}

/// Whether the printed kernel's `got` passes for the CPU's `want`.
fn close(want: f64, got: f64, storage: DType, approx: bool, floor: f64) -> bool {
    if want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()) {
        return true;
    }
    let tol = 1e-5f64.max(8.0 * storage.epsilon()); // epsilon() is half an ulp
    approx && (want - got).abs() <= tol * want.abs().max(got.abs()).max(floor)
}

/// The first element where the printed kernel's arguments after the run (`got`, the case's
/// file) differ from the CPU's (`cpu`), if any.
/// `bound`: per element of a product (and of each output laid out as it), how far the printed
/// kernel may be from the CPU (a quantized product sums in another order).
fn compare(case: &Case, n: usize, cpu: &[Vec<u8>], got: &[u8], bound: Option<&[f64]>) -> Option<String> {
    let (offsets, _) = layout(&case.init, n);
    let (loops, rows): (Vec<&MapLoop>, Option<&RowKernel>) = match &case.kernel.body {
        Body::Map(l) => (l.iter().collect(), None),
        Body::Rows(r) => (vec![], Some(r)),
        Body::Matmul(m) => (m.epilogue.iter().collect(), None),
        Body::QuantMatmul(q) => (q.epilogue.iter().collect(), None),
        Body::Quantize(_) => unreachable!("the generators make no quantizations (the CPU runs them)"),
        Body::Gather(_) | Body::Scatter(_) | Body::ScatterWrite(_) => return gathers::differ(case, &offsets, cpu, got),
        Body::Collective(_) => unreachable!("the generators make no collectives"),
        Body::Attention(_) => unreachable!("the generators make no attention kernels (tests/attention.rs checks them)"),
    };
    let mut approx = vec![false; case.kernel.args.len()];
    for (expr, stores) in loops.iter().map(|l| (&l.expr, &l.stores)).chain(rows.map(|r| (&r.expr, &r.stores))) {
        let t = approximate(expr, MathLib::Host);
        stores.iter().for_each(|s| approx[s.arg as usize] |= t[s.value as usize]);
    }
    for a in case.kernel.inputs..case.kernel.args.len() {
        let d = case.kernel.args[a].dtype;
        let got = &got[offsets[a]..offsets[a] + case.init[a].len()];
        for e in 0..case.kernel.args[a].len {
            let (w, g) = (element(d, &cpu[a], e), element(d, got, e));
            let within = |w: f64, g: f64| {
                let extra = bound.and_then(|b| b.get(e)).copied().unwrap_or(-1.0);
                extra >= 0.0 && (w - g).abs() <= extra + 4.0 * d.epsilon() * w.abs().max(g.abs())
            };
            let ok = match (w, g) {
                (Ok(w), Ok(g)) => close(w, g, d, approx[a], if rows.is_some() { 1.0 } else { 0.0 }) || within(w, g),
                (w, g) => w == g,
            };
            if !ok {
                return Some(format!("{}: argument a{a} ({d}) element {e}: cpu {w:?}, printed {g:?}", case.label));
            }
        }
    }
    None
}

/// Threads per block the emulated row kernels run with, each run from the case's inputs.
const ROW_BLOCKS: [u32; 3] = [1, 4, 32];
/// The same for the `warps` case, which also combines across warps (slow in the emulation: a
/// shuffle is two barriers of every thread of the block).
const WARP_BLOCKS: [u32; 5] = [1, 4, 32, 64, 256];

/// The runs of a case: for a row kernel one per [`ROW_BLOCKS`] (`Some(threads)`), else one.
fn runs_of(case: &Case, src: &cuda::CudaSource) -> Vec<Option<u32>> {
    let rows = src.entries.iter().any(|e| matches!(e.launch, Launch::Rows { .. }));
    let mut blocks = if case.label.starts_with("warps") { WARP_BLOCKS.to_vec() } else { ROW_BLOCKS.to_vec() };
    // Column kernels also at their printed size (512 threads: 16 lines of 32), where their
    // sweeps step by a constant (a loop of its own in the printed code).
    let printed = src.entries.iter().find_map(|e| match e.launch {
        Launch::Rows { threads, .. } if src.source.contains("// Columns:") => Some(threads),
        _ => None,
    });
    blocks.extend(printed.filter(|t| !blocks.contains(t)));
    if rows { blocks.iter().map(|&t| Some(t)).collect() } else { vec![None] }
}

/// The file a run of case `n` writes its arguments to.
fn out_name(n: usize, run: Option<u32>) -> String {
    match run {
        Some(t) => format!("case{n}.t{t}.out"),
        None => format!("case{n}.out"),
    }
}

/// The C++ function that runs case `n` (printed as `src`) over the contents of its file
/// (`total` bytes, argument `a` at `offsets[a]`) and writes them back, once per run.
fn cpp_runner(n: usize, case: &Case, src: &cuda::CudaSource, offsets: &[usize], total: usize) -> String {
    let mut f = format!("namespace case{n} {{\n{}}}\n", src.source);
    let _ = writeln!(f, "static void run_case{n}(const std::string& dir) {{\n  std::fputs(\"case{n}\\n\", stderr);");
    for run in runs_of(case, src) {
        let _ = writeln!(
            f,
            "  {{\n  auto mem = braid_read(dir + \"/case{n}.bin\", {total});\n  auto p = (unsigned char*)mem.data();"
        );
        for (a, d) in src.params.iter().enumerate() {
            match offsets.get(a) {
                Some(o) => _ = writeln!(f, "  auto a{a} = ({}*)(p + {o});", cuda::storage_ctype(*d)),
                // Scratch memory (a split row kernel's, or a quantized product's), filled with
                // garbage.
                None => {
                    let words = src.scratch_bytes / 8 + 1;
                    let _ =
                        writeln!(f, "  std::vector<unsigned long long> scratch{a}({words}, 0xBAD0BAD0BAD0BAD0ULL);");
                    let _ = writeln!(f, "  auto a{a} = ({}*)scratch{a}.data();", cuda::storage_ctype(*d));
                }
            }
        }
        let params: Vec<String> = (0..src.params.len()).map(|a| format!("a{a}")).collect();
        for e in &src.entries {
            let (launcher, grid, block) = match (e.launch, run) {
                (Launch::Map { numel, .. } | Launch::Copy { numel, .. }, _) => {
                    ("braid_launch", numel.div_ceil(8).min(3), 8)
                }
                (Launch::Rows { rows, .. }, Some(t)) if t > 1 => ("braid_launch_threads", rows, t),
                (Launch::Rows { rows, .. }, _) => ("braid_launch", rows, 1),
                // Quantized products (attention kernels are not generated): whole blocks of host
                // threads, which meet at barriers and shuffles.
                (Launch::Tiles { blocks, threads, .. }, _) => ("braid_launch_threads", blocks, threads),
            };
            let (name, params) = (&e.name, params.join(", "));
            let _ = writeln!(f, "  {launcher}({grid}, {block}, [&] {{ case{n}::{name}({params}); }});");
        }
        let _ = writeln!(f, "  braid_write(dir + \"/{}\", mem, {total});\n  }}", out_name(n, run));
    }
    f.push_str("}\n");
    f
}

#[test]
fn printed_kernels_compute_what_the_cpu_computes() {
    if Command::new("g++").arg("--version").output().is_err() {
        eprintln!("cuda_printer: SKIPPED, no g++ on PATH to compile the printed kernels with");
        return;
    }
    let start = std::time::Instant::now();
    let mut rng = Rng::new(0xC0DA);
    let mut cases = vec![edges_case(), warps::warps_case()];
    cases.extend((0..300).map(|n| map_case(&mut rng, n, MathLib::Host)));
    cases.extend((0..150).map(|n| rows_case(&mut rng, n, MathLib::Host)));
    cases.extend(long_row_cases(&mut rng, 150));
    cases.extend(column_cases(&mut rng, 170));
    cases.extend((0..6).map(|n| concat_case(&mut rng, n)));
    cases.extend((0..16).map(|n| matmul_case(&mut rng, n)));
    cases.extend(gathers::gather_cases(&mut rng, 40));
    cases.extend(scatters::scatter_cases(&mut rng, 40));
    cases.extend(scatters::scatter_write_cases(&mut Rng::new(0x5CA7), 40));
    // Their own random sequence, so that the cases above stay the ones their checks expect.
    let mut more = Rng::new(0xC4C5);
    cases.extend((0..40).map(|n| chunked_map_case(&mut more, n, MathLib::Host)));
    cases.extend(peeled_row_cases(&mut more, 1000, MathLib::Host));
    cases.extend(short_row_cases(&mut Rng::new(0x5407), 1100, MathLib::Host));
    cases.extend((0..40).map(|n| padded_row_map_case(&mut Rng::new(0x9AD0 + n as u64), n, MathLib::Host)));
    // Products with quantized weights, with the bound of each product element.
    let mut bounds: Vec<Option<Vec<f64>>> = vec![None; cases.len()];
    let mut quant = Rng::new(0x9A47);
    for n in 0..40 {
        let (c, b) = quant_cases::quant_case(&mut quant, n);
        cases.push(c);
        bounds.push(Some(b));
    }
    // Rows long enough for warps to share a channel (the few-rows path's split).
    for (n, (scheme, m, k)) in [(Scheme::Int4 { group: 32 }, 1, 4096), (Scheme::Int8, 3, 2048)].into_iter().enumerate()
    {
        let layout = QuantLayout::new(scheme, k, 5, DType::F16).unwrap();
        let (c, b) = quant_cases::quant_case_of(&mut quant, 40 + n, DType::BF16, layout, m);
        cases.push(c);
        bounds.push(Some(b));
    }
    let dir = std::env::temp_dir().join(format!("braid_cuda_printer_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for h in ["cuda_fp16.h", "cuda_bf16.h"] {
        std::fs::write(dir.join(h), "// the emulation header defines the half types\n").unwrap();
    }
    let mut main = format!("{HEADER}\n");
    let mut runs = String::new();
    let mut cpu = vec![];
    let mut printed = vec![];
    let (mut short_rows, mut padded_rows) = (0, 0);
    for (n, case) in cases.iter().enumerate() {
        let after =
            run_cpu(&case.kernel, &case.init).unwrap_or_else(|e| panic!("{}: the CPU rejects it: {e}", case.label));
        let src = cuda::print(&case.kernel, &format!("case{n}")).unwrap_or_else(|e| panic!("{}: {e}", case.label));
        // Only the short-row cases take the short-row path (those with a vector path or rows of
        // at most 16 positions; counted below).
        let short = src.source.contains("// Short rows of");
        assert!(!short || case.label.starts_with("short"), "{}:\n{}", case.label, src.source);
        short_rows += usize::from(short);
        // (Random map cases may walk rows too.)
        let padded = src.source.contains("chunks starting each row of");
        padded_rows += usize::from(padded && case.label.starts_with("padded-row"));
        let mut init = case.init.clone();
        case.from_cpu.iter().for_each(|&a| init[a] = after[a].clone());
        let (offsets, total) = layout(&init, n);
        let mut file = vec![0u8; total];
        for (o, b) in offsets.iter().zip(&init) {
            file[*o..*o + b.len()].copy_from_slice(b);
        }
        std::fs::write(dir.join(format!("case{n}.bin")), file).unwrap();
        main.push_str(&cpp_runner(n, case, &src, &offsets, total));
        let _ = writeln!(runs, "  run_case{n}(dir);");
        cpu.push(after);
        printed.push(src);
    }
    assert!(short_rows >= 3, "{short_rows} of the short-row cases take the short-row path");
    assert!(padded_rows >= 10, "{padded_rows} of the padded-row map cases walk chunks from each row's start");
    let _ = writeln!(
        main,
        "int main(int argc, char** argv) {{\n  if (argc < 2) return 2;\n  std::string dir = argv[1];\n{runs}  return 0;\n}}"
    );
    std::fs::write(dir.join("main.cpp"), &main).unwrap();
    let generated = start.elapsed();
    let exe = dir.join("emulated");
    let out = Command::new("g++")
        .args([
            "-O1",
            "-std=c++17",
            "-pthread",
            "-fno-builtin",
            "-ffp-contract=off",
            "-fno-strict-aliasing",
            "-w",
            "-I",
        ])
        .arg(&dir)
        // Opt-in: also catch out-of-bounds accesses and undefined behaviour such as signed
        // overflow in the printed code (makes g++ about three times slower).
        .args(std::env::var_os("BRAID_CUDA_TEST_SANITIZE").map(|_| "-fsanitize=address,undefined"))
        .args(std::env::var_os("BRAID_CUDA_TEST_SANITIZE").map(|_| "-fno-sanitize-recover=all"))
        .arg("-o")
        .arg(&exe)
        .arg(dir.join("main.cpp"))
        .output()
        .unwrap();
    assert!(out.status.success(), "g++ failed on {}:\n{}", dir.display(), String::from_utf8_lossy(&out.stderr));
    let compiled = start.elapsed();
    let out = Command::new(&exe).arg(&dir).output().unwrap();
    if !out.status.success() {
        // Each case names itself on stderr before it runs.
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().rfind(|l| l.starts_with("case")).and_then(|l| l[4..].parse::<usize>().ok());
        if let Some(n) = last {
            eprintln!("--- {}\n{:#?}\n{}", cases[n].label, cases[n].kernel, printed[n].source);
        }
        panic!(
            "the emulated kernels failed ({}), in {}:\n{}",
            out.status,
            dir.display(),
            err.lines().last().unwrap_or("")
        );
    }
    let mut failures = vec![];
    for (n, case) in cases.iter().enumerate() {
        for run in runs_of(case, &printed[n]) {
            let got = std::fs::read(dir.join(out_name(n, run))).unwrap();
            if let Some(f) = compare(case, n, &cpu[n], &got, bounds[n].as_deref()) {
                if failures.len() < 3 {
                    eprintln!("--- {} ({run:?} threads)\n{:#?}\n{}", case.label, case.kernel, printed[n].source);
                }
                failures.push(format!("{f} ({run:?} threads per row)"));
                break;
            }
        }
    }
    // Both row paths ran: rows kept in shared memory between phases, and rows read per phase.
    let rows: Vec<&str> = (printed.iter())
        .filter(|p| p.entries.iter().any(|e| matches!(e.launch, Launch::Rows { .. })))
        .map(|p| p.source.as_str())
        .collect();
    let keeps = |s: &str| s.contains("__shared__") && s.contains(" keep");
    let kept = rows.iter().filter(|s| keeps(s)).count();
    eprintln!("cuda_printer: {} row kernels, {kept} keep loads in shared memory", rows.len());
    assert!(kept >= 50, "{kept} of {} row kernels keep their loads", rows.len());
    // Vector paths were printed (and run by the even cases, whose arguments are aligned).
    let vector = printed.iter().filter(|p| p.source.contains("const bool vec = ")).count();
    eprintln!("cuda_printer: {vector} kernels with a vector path");
    assert!(vector >= 100, "{vector} of {} kernels have a vector path", printed.len());
    // Some walk strided views a chunk at a time (`at_` is where such a chunk starts).
    let chunked = printed.iter().filter(|p| p.source.contains("at_l") || p.source.contains("at_s")).count();
    eprintln!("cuda_printer: {chunked} kernels with chunks of strided views");
    assert!(chunked >= 20, "{chunked} of {} kernels walk strided views in chunks", printed.len());
    let path = |p: &str| (0..cases.len()).filter(|&n| cases[n].label.starts_with(p)).collect::<Vec<_>>();
    let (multi, split, columns) = (path("multi-pass "), path("split "), path("split-columns "));
    let one = |n: &usize| !keeps(&printed[*n].source) && printed[*n].entries.len() == 1;
    assert!(multi.len() == 3 && multi.iter().all(one), "long rows among many: one entry, nothing kept");
    let peeled = path("peeled ");
    let heads = peeled.iter().filter(|&&n| printed[n].source.contains("const int head = ")).count();
    eprintln!("cuda_printer: {heads} of {} peeled row cases start their rows' chunks at a head", peeled.len());
    assert!(heads >= 2, "{heads} of the peeled row cases print a head");
    let segments = |n: &usize| printed[*n].entries.len() >= 2 && printed[*n].scratch_bytes > 0;
    assert!(split.len() == 12 && split.iter().all(segments), "long rows among few: split");
    let split_columns = |n: &usize| segments(n) && printed[*n].source.contains("// Columns:");
    assert!(columns.len() == 3 && columns.iter().all(split_columns), "long columns among few: split");
    let split_column_cases = path("columns ").into_iter().filter(split_columns).count();
    assert!(split_column_cases == 6, "{split_column_cases} of the short column cases split (want 6)");
    eprintln!(
        "cuda_printer: {} kernels; generated in {:.2?}, g++ {:.2?}, run and compared {:.2?}",
        cases.len(),
        generated,
        compiled - generated,
        start.elapsed() - compiled
    );
    assert!(
        failures.is_empty(),
        "{} of {} kernels differ (files in {}):\n{}",
        failures.len(),
        cases.len(),
        dir.display(),
        failures.join("\n")
    );
    match std::env::var_os("BRAID_CUDA_TEST_KEEP") {
        Some(_) => eprintln!("cuda_printer: kept {}", dir.display()),
        None => drop(std::fs::remove_dir_all(&dir)),
    }
}
