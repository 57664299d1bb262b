//! Unit tests of the CUDA C printer: the text a reader wants to see for typical kernels.

use super::*;
use crate::cexpr::*;
use crate::kernel::{Arg, MatmulKernel, MatmulOperand};
use braid_graph::expr::{ExprBuilder, ExprId, PrimCmp};

pub(super) fn view(dims: &[usize], strides: &[isize], offset: usize) -> View {
    View { dims: dims.into(), strides: strides.into(), offset }
}

pub(super) fn contiguous(dims: &[usize]) -> View {
    View::contiguous(&Shape::new(dims))
}

pub(super) fn args(a: &[(DType, usize)]) -> Vec<Arg> {
    a.iter().map(|&(dtype, len)| Arg { dtype, len }).collect()
}

/// A kernel of one loop over `dims`.
fn map(
    a: &[(DType, usize)],
    inputs: usize,
    dims: &[usize],
    loads: Vec<Load>,
    b: ExprBuilder,
    stores: Vec<Store>,
) -> Kernel {
    let l = MapLoop { dims: dims.into(), loads, expr: b.finish(), stores };
    Kernel { args: args(a), inputs, body: Body::Map(vec![l]) }
}

pub(super) fn load(arg: u16, dtype: DType, view: View) -> Load {
    Load { arg, dtype, view }
}

pub(super) fn store(arg: u16, dtype: DType, view: View, value: ExprId) -> Store {
    Store { arg, dtype, view, value }
}

/// Asserts that `text` contains each of `parts`, in this order.
pub(super) fn in_order(text: &str, parts: &[&str]) {
    let mut at = 0;
    for p in parts {
        match text[at..].find(p) {
            Some(i) => at += i + p.len(),
            None => panic!("{p:?} missing (or out of order) in:\n{text}"),
        }
    }
}

#[test]
fn a_contiguous_map_is_one_thread_per_chunk_of_sixteen_bytes() {
    // y = x * 2 + 1
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let two = b.constant(2.0, DType::F32);
    let m = b.mul(x, two);
    let one = b.constant(1.0, DType::F32);
    let y = b.add(m, one);
    let (x, out) = (load(0, DType::F32, contiguous(&[4])), store(1, DType::F32, contiguous(&[4]), y));
    let k = map(&[(DType::F32, 4), (DType::F32, 4)], 1, &[4], vec![x], b, vec![out]);
    let p = print(&k, "axpb").unwrap();
    assert_eq!(p.params, vec![DType::F32, DType::F32]);
    assert!(!p.source.contains("#include"), "no half types, no headers");
    in_order(
        &p.source,
        &[
            "extern \"C\" __global__ void axpb_loop0(const float* a0, float* a1) {",
            // Contiguous f32: a vector path of 4 indices per thread, x and y a `uint4` each,
            // when both are aligned; the scalar loop takes whatever it leaves.
            "const bool vec = (unsigned long long)a0 % 16u == 0 && (unsigned long long)a1 % 16u == 0;",
            "const long long vec_end = vec ? 4LL : 0LL;",
            "*reinterpret_cast<uint4*>(l0) = *reinterpret_cast<const uint4*>(a0 + i0);",
            "const float v0 = l0[e];",
            "s0[e] = v4;",
            "*reinterpret_cast<uint4*>(a1 + i0) = *reinterpret_cast<const uint4*>(s0);",
            "for (long long i = vec_end + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < 4LL; i += (long long)gridDim.x * blockDim.x) {",
            "const float v0 = a0[i];",
            "const float v1 = 2.0f;",
            "const float v2 = v0 * v1;",
            "const float v4 = v2 + v3;",
            "a1[i] = v4;",
        ],
    );
    // A thread per chunk of 4 (the scalar loop strides over whatever grid runs).
    assert_eq!(p.entries, vec![Entry { name: "axpb_loop0".into(), launch: Launch::Map { numel: 1, block: 256 } }]);
    // Three elements: no chunk, no vector path; one thread per element.
    let mut k3 = k.clone();
    let Body::Map(loops) = &mut k3.body else { unreachable!() };
    loops[0].dims = [3].as_slice().into();
    loops[0].loads[0].view = contiguous(&[3]);
    loops[0].stores[0].view = contiguous(&[3]);
    let p = print(&k3, "axpb").unwrap();
    assert!(!p.source.contains("vec"), "{}", p.source);
    assert_eq!(p.entries[0].launch, Launch::Map { numel: 3, block: 256 });
}

#[test]
fn views_fold_their_strides_into_the_offsets() {
    // [2, 3]: a row broadcast down (stride 0), a transposed [3, 2] buffer, rows reversed
    // from an offset (a negative stride).
    let mut b = ExprBuilder::new();
    let (r, t, v) = (b.load(0, DType::F32), b.load(1, DType::F32), b.load(2, DType::F32));
    let s = b.add(r, t);
    let y = b.add(s, v);
    let loads = vec![
        load(0, DType::F32, view(&[2, 3], &[0, 1], 0)),
        load(1, DType::F32, view(&[2, 3], &[1, 2], 0)),
        load(2, DType::F32, view(&[2, 3], &[-3, 1], 4)),
    ];
    let a = [(DType::F32, 3), (DType::F32, 6), (DType::F32, 7), (DType::F32, 6)];
    let k = map(&a, 3, &[2, 3], loads, b, vec![store(3, DType::F32, contiguous(&[2, 3]), y)]);
    let src = print(&k, "views").unwrap().source;
    in_order(
        &src,
        &[
            "const long long d0 = (long long)((unsigned int)i / 3u);",
            "const long long d1 = (long long)((unsigned int)i % 3u);",
            "const float v0 = a0[d1];",
            "const float v1 = a1[d0 + d1 * 2];",
            "const float v2 = a2[4 - d0 * 3 + d1];",
            "a3[i] = v4;",
        ],
    );
}

#[test]
fn compare_select_and_max_keep_the_cpu_semantics() {
    let mut b = ExprBuilder::new();
    let (x, y) = (b.load(0, DType::F64), b.load(1, DType::F64));
    let lt = b.cmp(PrimCmp::Lt, x, y);
    let sel = b.select(lt, x, y);
    let max = b.max(x, y);
    let dead = b.neg(x);
    let out = |arg, dtype, value| store(arg, dtype, contiguous(&[5]), value);
    let stores = vec![out(2, DType::Bool, lt), out(3, DType::F64, sel), out(4, DType::F64, max)];
    let a = [(DType::F64, 5), (DType::F64, 5), (DType::Bool, 5), (DType::F64, 5), (DType::F64, 5)];
    let (l0, l1) = (load(0, DType::F64, contiguous(&[5])), load(1, DType::F64, contiguous(&[5])));
    let src = print(&map(&a, 2, &[5], vec![l0, l1], b, stores), "k").unwrap().source;
    in_order(
        &src,
        &[
            "(const double* a0, const double* a1, unsigned char* a2, double* a3, double* a4)",
            "const bool v2 = v0 < v1;",
            "const double v3 = v2 ? v0 : v1;",
            // NaN from either side: a NaN `v0` is kept, a NaN `v1` wins every comparison.
            "const double v4 = (v0 > v1 || isnan(v0)) ? v0 : v1;",
            "a2[i] = (unsigned char)v2;",
        ],
    );
    assert!(!src.contains(&format!("v{dead} =")), "no store reads it");
}

#[test]
fn casts_and_integer_division_follow_the_cpu() {
    let mut b = ExprBuilder::new();
    let (x, w, n, d) = (b.load(0, DType::F32), b.load(1, DType::I64), b.load(2, DType::I32), b.load(3, DType::I32));
    let u8 = b.cast(DType::U8, x);
    let f = b.cast(DType::F32, w);
    let h = b.cast(DType::F16, x);
    let q = b.div(n, d);
    let stores = vec![
        store(4, DType::U8, contiguous(&[3]), u8),
        store(5, DType::F32, contiguous(&[3]), f),
        store(6, DType::F16, contiguous(&[3]), h),
        store(7, DType::I32, contiguous(&[3]), q),
    ];
    let dt = [DType::F32, DType::I64, DType::I32, DType::I32, DType::U8, DType::F32, DType::F16, DType::I32];
    let loads = (0..4).map(|i| load(i, dt[i as usize], contiguous(&[3]))).collect();
    let a: Vec<(DType, usize)> = dt.iter().map(|&d| (d, 3)).collect();
    let src = print(&map(&a, 4, &[3], loads, b, stores), "casts").unwrap().source;
    in_order(
        &src,
        &[
            "#include <cuda_fp16.h>",
            "unsigned char* a4, float* a5, __half* a6, int* a7",
            // Truncates and saturates, NaN gives 0.
            "const unsigned char v4 = braid_f2u8(v0);",
            // One rounding, as the CPU's.
            "const float v5 = (float)v1;",
            "const float v6 = __half2float(__float2half_rn(v0));",
            // x / 0 == 0; MIN / -1 wraps (C would trap).
            "const int v7 = v3 == 0 ? 0 : v3 == -1 ? (int)((unsigned)0 - (unsigned)v2) : v2 / v3;",
            "a6[i] = __float2half_rn(v6);",
        ],
    );
}

#[test]
fn a_softmax_row_kernel_runs_the_cpu_phases() {
    // [3, 5] along 1: max, exp(x - max), sum, divide; the sum is also stored per row.
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let m = b.reduce(ReduceOp::Max, x);
    let s = b.sub(x, m);
    let e = b.exp(s);
    let sum = b.reduce(ReduceOp::Sum, e);
    let y = b.div(e, sum);
    let stores =
        vec![store(1, DType::F16, contiguous(&[3, 5]), y), store(2, DType::F32, view(&[3, 5], &[1, 0], 0), sum)];
    let loads = vec![load(0, DType::F32, contiguous(&[3, 5]))];
    let r = RowKernel { dims: [3, 5].as_slice().into(), axis: Some(1), loads, expr: b.finish(), stores };
    let k =
        Kernel { args: args(&[(DType::F32, 15), (DType::F16, 15), (DType::F32, 3)]), inputs: 1, body: Body::Rows(r) };
    let p = print(&k, "softmax").unwrap();
    assert_eq!(p.entries, vec![Entry { name: "softmax_rows".into(), launch: Launch::Rows { rows: 3, threads: 32 } }]);
    in_order(
        &p.source,
        &[
            "void softmax_rows(const float* a0, __half* a1, float* a2) {",
            "const long long d0 = (long long)((unsigned int)row);",
            // Phase 1: the max, each thread striding over the row, then warp shuffles (a mask of
            // exactly the block's lanes when it is less than a warp) and, with more than one
            // warp, one entry per warp in shared memory and one barrier.
            "__shared__ float red1[1];",
            "for (int t = threadIdx.x; t < 5LL; t += blockDim.x) {",
            "const float v0 = a0[d0 * 5 + d1];",
            "if (!isnan(acc1) && (v0 > acc1 || isnan(v0))) { acc1 = v0; }",
            "const int lanes = blockDim.x < 32u ? (int)blockDim.x : 32;",
            "const unsigned mask = blockDim.x >= 32u ? 0xffffffffu : (1u << blockDim.x) - 1u;",
            "for (int s = (int)lanes / 2; s > 0; s /= 2) {",
            "const float b = __shfl_down_sync(mask, acc1, s, lanes);",
            "if (!isnan(acc1) && (b > acc1 || isnan(b))) { acc1 = b; }",
            "if (blockDim.x > 32u) {",
            "if (threadIdx.x % 32u == 0) { red1[threadIdx.x / 32u] = acc1; }",
            "__syncthreads();",
            "acc1 = red1[threadIdx.x & (warps - 1u)];",
            "for (int s = (int)warps / 2; s > 0; s /= 2) {",
            "acc1 = __shfl_sync(mask, acc1, 0, lanes);",
            "const float v1 = acc1;",
            // Phase 2: the sum of exp(x - max), compensated (Kahan) per thread, the
            // compensation left out once the sum is infinite.
            "float cmp4 = 0.0f;",
            "const float v3 = expf(v2);",
            "{ const float y = v3 - cmp4; const float s = acc4 + y; cmp4 = isfinite(s) ? (s - acc4) - y : 0.0f; acc4 = s; }",
            "acc4 = acc4 - cmp4;",
            "const float b = __shfl_down_sync(mask, acc4, s, lanes);",
            "acc4 = acc4 + b;",
            "acc4 = __shfl_sync(mask, acc4, 0, lanes);",
            "const float v4 = acc4;",
            // Per-row stores by one thread, then per-element ones in a last sweep.
            "if (threadIdx.x == 0) {",
            "a2[d0] = v4;",
            "const float v5 = v3 / v4;",
            "a1[d0 * 5 + d1] = __float2half_rn(v5);",
        ],
    );
    // exp(x - max) is computed once and kept over the input, whose last reader is the sum's
    // sweep: the last sweep reads it back (the same bits the CPU gets by recomputing it).
    assert_eq!(p.source.matches("expf(v2)").count(), 1, "{}", p.source);
    in_order(
        &p.source,
        &[
            "float* const keep3 = keep0; // v3, kept over v0 once v0 is read",
            "const float v0 = keep0[t];",
            "const float v3 = expf(v2);",
            "keep3[t] = v3;",
            "const float v3 = keep3[t];",
            "const float v5 = v3 / v4;",
        ],
    );
}

/// A softmax written as max, sub, exp, sum, div along rows of `len` f32 (its output f32).
/// A softmax along rows of [rows, len] f32 as composed ops: nodes x (0), max (1), x - max (2),
/// exp (3), sum (4), y (5); y stored to argument 1.
pub(crate) fn softmax_rows(rows: usize, len: usize) -> Kernel {
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let m = b.reduce(ReduceOp::Max, x);
    let s = b.sub(x, m);
    let e = b.exp(s);
    let sum = b.reduce(ReduceOp::Sum, e);
    let y = b.div(e, sum);
    let (dims, n) = ([rows, len], rows * len);
    let r = RowKernel {
        dims: dims.as_slice().into(),
        axis: Some(1),
        loads: vec![load(0, DType::F32, contiguous(&dims))],
        expr: b.finish(),
        stores: vec![store(1, DType::F32, contiguous(&dims), y)],
    };
    Kernel { args: args(&[(DType::F32, n), (DType::F32, n)]), inputs: 1, body: Body::Rows(r) }
}

#[test]
fn a_short_softmax_row_reads_its_input_once_and_a_long_one_per_phase() {
    // G2's rows (4096 f32, 16 KiB) fit the budget: the first phase reads each element from
    // global memory once and keeps it in shared memory; the sum and the stores read it there.
    let src = print(&softmax_rows(8192, 4096), "g2").unwrap().source;
    assert_eq!(src.matches("a0[").count(), 1, "one global load of the input:\n{src}");
    assert_eq!(src.matches("a1[").count(), 1, "one global store of the output");
    in_order(
        &src,
        &[
            "__shared__ __align__(16) float keep0[4096]; // v0, kept for later phases",
            // Phase 1 (max): loaded and kept.
            "for (int t = threadIdx.x; t < 4096LL; t += blockDim.x) {",
            "const float v0 = a0[d0 * 4096 + d1];",
            "keep0[t] = v0;",
            "red1[threadIdx.x / 32u] = acc1;",
            // Phase 2 (sum of exp(x - max)) from shared memory, exp kept over x; the stores
            // read exp back (four positions in flight per thread in every sweep).
            "#pragma unroll 4",
            "for (int t = threadIdx.x; t < 4096LL; t += blockDim.x) {",
            "const float v0 = keep0[t];",
            "const float v3 = expf(v2);",
            "keep3[t] = v3;",
            "for (int t = threadIdx.x; t < 4096LL; t += blockDim.x) {",
            "const float v3 = keep3[t];",
            "a1[d0 * 4096 + d1] = v5;",
        ],
    );
    assert_eq!(src.matches("keep0[t] = v0;").count(), 1, "written once");
    // Two reductions, a barrier each (for the per-warp entries); the rest is warp shuffles.
    assert_eq!(src.matches("__syncthreads();").count(), 2, "{src}");
    assert!(src.contains("__shared__ float red1[8];"), "an entry per warp of 256 threads");
    // At the budget (8192 f32 = 32 KiB) still kept; one element more, every phase reads the
    // row from global memory, as before.
    let src = print(&softmax_rows(SPLIT_BELOW_ROWS, ROW_KEEP_BYTES / 4), "edge").unwrap().source;
    assert_eq!(src.matches("a0[").count(), 1, "{src}");
    // (Rows of that odd length start at every remainder: each phase reads a row's head, its
    // tail and the whole row when unaligned one element at a time, its aligned middle in chunks.)
    let src = print(&softmax_rows(SPLIT_BELOW_ROWS, ROW_KEEP_BYTES / 4 + 1), "long").unwrap().source;
    assert!(!src.contains("keep"), "{src}");
    assert_eq!((src.matches("a0[").count(), src.matches("(a0 + ").count()), (9, 3), "{src}");
}

#[test]
fn long_rows_among_few_rows_are_split_into_segments() {
    // Two rows of 3 segments: per reduction, partial results per segment and a combination per
    // row, through scratch memory; then the stores, a block per segment.
    let len = 2 * SEGMENT + 1;
    let p = print(&softmax_rows(2, len), "sm").unwrap();
    let launches: Vec<(&str, Launch)> = p.entries.iter().map(|e| (e.name.as_str(), e.launch)).collect();
    let (segs, t) = (Launch::Rows { rows: 6, threads: 256 }, Launch::Rows { rows: 2, threads: 256 });
    assert_eq!(
        launches,
        [
            ("sm_rows_partial1", segs),
            ("sm_rows_combine1", t),
            ("sm_rows_partial4", segs),
            ("sm_rows_combine4", t),
            ("sm_rows_finish", segs)
        ]
    );
    // Scratch: 6 partials and 2 values per reduction, regions aligned to 8 bytes.
    assert_eq!(p.scratch_bytes, 2 * (24 + 8));
    assert_eq!(p.params, [DType::F32, DType::F32, DType::U8]);
    in_order(
        &p.source,
        &[
            "void sm_rows_partial1(const float* a0, float* a1, unsigned char* a2) {",
            "const long long row = blockIdx.x / 3;",
            "const long long seg = blockIdx.x % 3;",
            "const long long end = seg * 2731LL + 2731LL < 8193LL ? seg * 2731LL + 2731LL : 8193LL;",
            "for (int t = seg * 2731LL + threadIdx.x; t < end; t += blockDim.x) {",
            "if (threadIdx.x == 0) {",
            "((float*)(a2 + 0))[blockIdx.x] = acc1;",
            "void sm_rows_combine1(",
            "for (long long k = threadIdx.x; k < 3LL; k += blockDim.x) {",
            "const float v0 = ((float*)(a2 + 0))[row * 3 + k];",
            "if (threadIdx.x == 0) ((float*)(a2 + 24))[row] = acc1;",
            "void sm_rows_partial4(",
            "const float v1 = ((float*)(a2 + 24))[row];",
            "const float v3 = expf(v2);",
            "((float*)(a2 + 32))[blockIdx.x] = acc4;",
            "void sm_rows_combine4(",
            "if (threadIdx.x == 0) ((float*)(a2 + 56))[row] = acc4;",
            "void sm_rows_finish(",
            "const float v1 = ((float*)(a2 + 24))[row];",
            "const float v4 = ((float*)(a2 + 56))[row];",
            "a1[",
        ],
    );
    assert!(!p.source.contains("keep"), "segments read their input per phase");
    // As many rows as the GPU has multiprocessors, or short rows: one block per row.
    assert_eq!(print(&softmax_rows(SPLIT_BELOW_ROWS, len), "many").unwrap().entries.len(), 1);
    assert_eq!(print(&softmax_rows(1, 2 * SEGMENT - 1), "short").unwrap().entries.len(), 1);
}

#[test]
fn whole_space_reductions_use_one_row() {
    // Mean over everything (f64) and the first maximum of an i32 ([2, 3], axis None), in one
    // sweep.
    let mut b = ExprBuilder::new();
    let (x, n) = (b.load(0, DType::F64), b.load(1, DType::I32));
    let mean = b.reduce(ReduceOp::Mean, x);
    let arg = b.reduce(ReduceOp::ArgMax, n);
    let row = view(&[2, 3], &[0, 0], 0);
    let stores = vec![store(2, DType::F64, row.clone(), mean), store(3, DType::I64, row, arg)];
    let loads = vec![load(0, DType::F64, contiguous(&[2, 3])), load(1, DType::I32, view(&[2, 3], &[1, 2], 0))];
    let r = RowKernel { dims: [2, 3].as_slice().into(), axis: None, loads, expr: b.finish(), stores };
    let a = args(&[(DType::F64, 6), (DType::I32, 6), (DType::F64, 1), (DType::I64, 1)]);
    let p = print(&Kernel { args: a, inputs: 2, body: Body::Rows(r) }, "all").unwrap();
    assert_eq!(p.entries[0].launch, Launch::Rows { rows: 1, threads: 32 });
    // Neither reads the other: both fold in one sweep, then combine one after the other.
    in_order(
        &p.source,
        &[
            "double acc2 = 0.0;",
            "long long arg3 = 0;",
            "for (int t = threadIdx.x; t < 6LL; t += blockDim.x) {",
            "const long long d0 = (long long)((unsigned int)t / 3u);",
            "const long long d1 = (long long)((unsigned int)t % 3u);",
            "const int v1 = a1[d0 + d1 * 2];",
            "acc2 = s; }",
            // The first of equal maxima wins, whatever order the combine pairs them in: the
            // positions travel with the values through the shuffles and the per-warp entries.
            "if (v1 > acc3 || (v1 == acc3 && t < arg3)) { acc3 = v1; arg3 = t; }",
            "acc2 = __shfl_sync(mask, acc2, 0, lanes);",
            "const long long ib = __shfl_down_sync(mask, arg3, s, lanes);",
            "if (b > acc3 || (b == acc3 && ib < arg3)) { acc3 = b; arg3 = ib; }",
            "idx3[threadIdx.x / 32u] = arg3;",
            "arg3 = idx3[threadIdx.x & (warps - 1u)];",
            "arg3 = __shfl_sync(mask, arg3, 0, lanes);",
            "const double v2 = acc2 / 6.0;",
            "const long long v3 = arg3;",
            "a2[0] = v2;",
            "a3[0] = v3;",
        ],
    );
    assert_eq!(p.source.matches("for (int t = ").count(), 1, "one sweep");
}

#[test]
fn narrow_integers_shuffle_as_unsigned() {
    // A u8 sum along rows of 40 (it wraps as the CPU's): CUDA has no 8-bit shuffles.
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::U8);
    let sum = b.reduce(ReduceOp::Sum, x);
    let r = RowKernel {
        dims: [2, 40].as_slice().into(),
        axis: Some(1),
        loads: vec![load(0, DType::U8, contiguous(&[2, 40]))],
        expr: b.finish(),
        stores: vec![store(1, DType::U8, view(&[2, 40], &[1, 0], 0), sum)],
    };
    let k = Kernel { args: args(&[(DType::U8, 80), (DType::U8, 2)]), inputs: 1, body: Body::Rows(r) };
    let p = print(&k, "bytes").unwrap();
    assert_eq!(p.entries[0].launch, Launch::Rows { rows: 2, threads: 64 });
    in_order(
        &p.source,
        &[
            "__shared__ unsigned char red1[2];",
            "const unsigned char b = (unsigned char)(__shfl_down_sync(mask, (unsigned)acc1, s, lanes));",
            "acc1 = (unsigned char)((int)acc1 + (int)b);",
            "acc1 = (unsigned char)(__shfl_sync(mask, (unsigned)acc1, 0, lanes));",
            "const unsigned char v1 = acc1;",
        ],
    );
}

#[test]
fn constants_round_trip() {
    assert_eq!(float_literal(2.0, DType::F32), "2.0f");
    assert_eq!(float_literal(-0.0, DType::F64), "-0.0");
    assert_eq!(float_literal(1e15, DType::F64), "1000000000000000.0");
    assert_eq!(float_literal(0.1, DType::F32), "0x1.99999ap-4f");
    assert_eq!(float_literal(0.1, DType::F64), "0x1.999999999999ap-4");
    assert_eq!(float_literal(f64::NAN, DType::F32), "__int_as_float(0x7fc00000)");
    assert_eq!(float_literal(f64::NEG_INFINITY, DType::F64), "-__longlong_as_double(0x7ff0000000000000LL)");
    assert_eq!(float_literal(f64::from_bits(1), DType::F64), "0x0.0000000000001p-1022");
    assert_eq!(int_literal(i64::MIN, DType::I64), "(-9223372036854775807LL - 1)");
    assert_eq!(int_literal(-1, DType::U8), "255");
    // Hexadecimal digits scaled by a power of two give the value back exactly.
    for v in [0.1, -1.0 / 3.0, 6.02e23, 1e-300, f32::MAX as f64, 1.5] {
        let h = hex_float(v);
        let (m, e) = h.trim_start_matches('-').trim_start_matches("0x").split_once('p').unwrap();
        let (lead, frac) = m.split_once('.').unwrap_or((m, ""));
        let digits = u64::from_str_radix(&format!("{lead}{frac}"), 16).unwrap() as f64;
        let e: i32 = e.parse().unwrap();
        let back = digits * 2f64.powi(-4 * frac.len() as i32) * 2f64.powi(e);
        assert_eq!(back, v.abs(), "{v} printed as {h}");
    }
}

#[test]
fn a_matmul_prints_only_its_epilogue() {
    let mm = |epilogue| MatmulKernel {
        dtype: DType::F32,
        lhs: MatmulOperand { arg: 0, batch_offsets: vec![0], rs: 2, cs: 1 },
        rhs: MatmulOperand { arg: 1, batch_offsets: vec![0], rs: 2, cs: 1 },
        product: 3,
        m: 2,
        n: 2,
        k: 2,
        epilogue,
    };
    let a = args(&[(DType::F32, 4), (DType::F32, 4), (DType::F32, 2)]);
    let bare = Kernel { args: a.clone(), inputs: 2, body: Body::Matmul(MatmulKernel { product: 2, ..mm(None) }) };
    let p = print(&bare, "mm").unwrap();
    assert!(p.entries.is_empty() && !p.source.contains("extern \"C\""), "nothing to launch after cuBLAS");
    // The product in scratch memory (argument 3 of 3): a fourth, read-only parameter.
    let mut b = ExprBuilder::new();
    let (prod, bias) = (b.load(0, DType::F32), b.load(1, DType::F32));
    let y = b.add(prod, bias);
    let loads = vec![load(3, DType::F32, contiguous(&[2, 2])), load(0, DType::F32, view(&[2, 2], &[0, 1], 0))];
    let e = MapLoop {
        dims: [2, 2].as_slice().into(),
        loads,
        expr: b.finish(),
        stores: vec![store(2, DType::F32, contiguous(&[2, 2]), y)],
    };
    let a = args(&[(DType::F32, 4), (DType::F32, 4), (DType::F32, 4)]);
    let p = print(&Kernel { args: a, inputs: 2, body: Body::Matmul(mm(Some(e))) }, "mm").unwrap();
    assert_eq!(p.params, vec![DType::F32; 4]);
    assert_eq!(p.entries[0].name, "mm_epilogue");
    assert!(p.source.contains("void mm_epilogue(const float* a0, const float* a1, float* a2, const float* a3)"));
}

#[test]
fn rejects_what_the_cpu_rejects() {
    let k = |op: &dyn Fn(&mut ExprBuilder, ExprId) -> ExprId, dt: DType, len: usize, out: u16| {
        let mut b = ExprBuilder::new();
        let x = b.load(0, dt);
        let y = op(&mut b, x);
        let stores = vec![store(out, b.dtype(y), contiguous(&[4]), y)];
        map(&[(dt, 4), (b.dtype(y), len)], 1, &[4], vec![load(0, dt, contiguous(&[4]))], b, stores)
    };
    let id = |_: &mut ExprBuilder, x| x;
    assert!(print(&k(&id, DType::F32, 4, 1), "2d").unwrap_err().contains("not a C identifier"));
    assert!(print(&k(&id, DType::F32, 3, 1), "k").unwrap_err().contains("reaches elements 0..=3"));
    assert!(print(&k(&id, DType::F32, 4, 0), "k").unwrap_err().contains("store of f32 to argument 0"));
    let pow = |b: &mut ExprBuilder, x| b.binary(PrimBinary::Pow, x, x);
    assert!(print(&k(&pow, DType::I32, 4, 1), "k").unwrap_err().contains("pow has no integer form"));
    let sum = |b: &mut ExprBuilder, x| b.reduce(ReduceOp::Sum, x);
    assert!(print(&k(&sum, DType::F32, 4, 1), "k").unwrap_err().contains("only run in row kernels"));
}

/// Every index variable `dK` an entry reads is declared in it (NVRTC rejects the source
/// otherwise, even where the code never runs).
fn declared_before_use(source: &str) {
    for entry in source.split("__global__").skip(1) {
        let mut at = 0;
        while let Some(i) = entry[at..].find('d') {
            let start = at + i;
            at = start + 1;
            let before = entry[..start].chars().next_back().unwrap_or(' ');
            let digits: String = entry[start + 1..].chars().take_while(char::is_ascii_digit).collect();
            let after = entry[start + 1 + digits.len()..].chars().next().unwrap_or(' ');
            if digits.is_empty() || before.is_ascii_alphanumeric() || before == '_' || after.is_ascii_alphanumeric() {
                continue;
            }
            let decl = format!("const long long d{digits} =");
            assert!(entry.contains(&decl), "d{digits} is used but not declared in:\n{entry}");
        }
    }
}

#[test]
fn kernels_over_empty_dimensions_declare_every_index_they_name() {
    // A sum along dim 1 of [0, 4] (no rows) and of [2, 0] (empty rows), and a map over [3, 0].
    for (dims, axis) in [([0usize, 4], 1usize), ([2, 0], 1), ([2, 0], 0), ([0, 4], 0)] {
        let n = dims[0] * dims[1];
        let out_dims = if axis == 1 { [dims[0], 1] } else { [1, dims[1]] };
        let mut b = ExprBuilder::new();
        let x = b.load(0, DType::U8);
        let s = b.reduce(ReduceOp::Sum, x);
        let strides: [isize; 2] = if axis == 1 { [1, 0] } else { [0, 1] };
        let stores = vec![store(1, DType::U8, view(&dims, &strides, 0), s)];
        let loads = vec![load(0, DType::U8, view(&dims, &[dims[1] as isize, 1], 0))];
        let r = RowKernel { dims: dims.as_slice().into(), axis: Some(axis), loads, expr: b.finish(), stores };
        let a = args(&[(DType::U8, n), (DType::U8, out_dims[0] * out_dims[1])]);
        let p = print(&Kernel { args: a, inputs: 1, body: Body::Rows(r) }, "empty").unwrap();
        declared_before_use(&p.source);
    }
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let y = b.neg(x);
    let loads = vec![load(0, DType::F32, view(&[3, 0], &[1, 3], 0))];
    let stores = vec![store(1, DType::F32, contiguous(&[3, 0]), y)];
    let p = print(&map(&[(DType::F32, 0), (DType::F32, 0)], 1, &[3, 0], loads, b, stores), "empty").unwrap();
    declared_before_use(&p.source);
}

#[test]
fn an_integer_product_without_batches_prints() {
    let operand = |arg| MatmulOperand { arg, rs: 1, cs: 1, batch_offsets: vec![] };
    let m = MatmulKernel {
        dtype: DType::I32,
        m: 2,
        n: 2,
        k: 2,
        lhs: operand(0),
        rhs: operand(1),
        product: 2,
        epilogue: None,
    };
    let k =
        Kernel { args: args(&[(DType::I32, 0), (DType::I32, 0), (DType::I32, 0)]), inputs: 2, body: Body::Matmul(m) };
    let p = print(&k, "empty").unwrap();
    declared_before_use(&p.source);
}
