//! Unit tests on the printed text; `tests/native_kernels.rs` compiles and runs printed kernels.

use super::*;
use crate::kernel::{Arg, Load, Store};
use braid_graph::expr::{ExprBuilder, PrimUnary};
use smallvec::smallvec;

fn contiguous(n: usize) -> View {
    View { dims: smallvec![n], strides: smallvec![1], offset: 0 }
}

/// An AVX2 machine whose outputs of `stream_bytes` or more leave the cache.
fn at(stream_bytes: usize) -> HostTarget {
    HostTarget { stream_bytes, f32_lanes: 8 }
}

/// `y = exp(x) * 2` over `n` f32s.
fn exp_kernel(n: usize) -> Kernel {
    let mut b = ExprBuilder::default();
    let x = b.load(0, DType::F32);
    let e = b.unary(PrimUnary::Exp, x);
    let two = b.constant(2.0, DType::F32);
    let y = b.binary(braid_graph::expr::PrimBinary::Mul, e, two);
    let l = MapLoop {
        dims: smallvec![n],
        loads: vec![Load { arg: 0, dtype: DType::F32, view: contiguous(n) }],
        expr: b.finish(),
        stores: vec![Store { arg: 1, dtype: DType::F32, view: contiguous(n), value: y }],
    };
    let args = vec![Arg { dtype: DType::F32, len: n }; 2];
    Kernel { args, inputs: 1, body: Body::Map(vec![l]) }
}

#[test]
fn one_entry_per_loop_with_braids_exp_and_streaming_stores_when_large() {
    let src = print(&exp_kernel(1 << 20), "k7", at(4 << 20)).unwrap();
    assert_eq!(src.entries, ["k7_loop0"]);
    let s = &src.source;
    assert!(s.contains("void k7_loop0(unsigned char *const *args, long long start, long long end)"), "{s}");
    assert!(s.contains("braid_expf(v0)"), "{s}");
    assert!(s.contains("braid_stream_f32(a1 + w0 + jb, t0, n);"), "{s}");
    assert!(s.contains("_mm_sfence()"), "{s}");
    // The polynomial's constants are vmath's, as hexadecimal floats.
    assert!(s.contains(&float_literal(vmath::EXP_POLY[0] as f64, DType::F32)), "{s}");
    // Below the threshold: plain stores, no fence.
    let small = print(&exp_kernel(1000), "k", at(4 << 20)).unwrap().source;
    assert!(small.contains("a1[w0 + (jb + jj)] = t0[jj];") && !small.contains("_mm_sfence();\n#endif\n}"), "{small}");
}

#[test]
fn f16_runs_are_widened_and_narrowed_a_block_at_a_time() {
    let half = |dtype: DType| {
        let mut k = exp_kernel(1000);
        k.args.iter_mut().for_each(|a| a.dtype = dtype);
        let Body::Map(loops) = &mut k.body else { unreachable!() };
        loops[0].loads[0].dtype = dtype;
        loops[0].stores[0].dtype = dtype;
        print(&k, "k", at(1 << 20)).unwrap().source
    };
    let s = half(DType::F16);
    assert!(s.contains("braid_widen_f16(h0, a0 + o0 + jb, n);") && s.contains("v0 = h0[jj];"), "{s}");
    assert!(s.contains("braid_narrow_f16(a1 + w0 + jb, t0, n);"), "{s}");
    // bf16 converts as it goes (a shift).
    let s = half(DType::BF16);
    assert!(s.contains("v0 = __bfloat162float(a0[o0 + k]);") && s.contains("= __float2bfloat16_rn(t0[jj]);"), "{s}");
}

#[test]
fn what_is_not_printed_is_an_error() {
    let mut k = exp_kernel(16);
    k.args[0].dtype = DType::F16;
    assert!(print(&k, "k", at(1 << 20)).unwrap_err().contains("load of f32 through argument 0 of f16"));
    assert!(print(&exp_kernel(16), "9k", at(1 << 20)).unwrap_err().contains("identifier"));
    let mut k = exp_kernel(16);
    let Body::Map(loops) = &mut k.body else { unreachable!() };
    loops[0].loads[0].view.offset = 1; // one past the end
    assert!(print(&k, "k", at(1 << 20)).unwrap_err().contains("reaches elements"));
}

#[test]
fn a_softmax_row_kernel_keeps_exp_folds_in_the_interpreters_lanes_and_streams_its_output() {
    let k = crate::cuda::tests::softmax_rows(2048, 1024);
    let src = print(&k, "c2", at(4 << 20)).unwrap();
    assert_eq!(src.entries, ["c2_rows"]);
    // exp(x - max), kept for the last pass: one row of 1024 f32 of scratch.
    assert_eq!(src.row_scratch, Some(4096));
    let s = &src.source;
    let in_order = |parts: &[&str]| {
        let mut at = 0;
        for p in parts {
            let found = s[at..].find(p).unwrap_or_else(|| panic!("{p:?} not after byte {at} of:\n{s}"));
            at += found + p.len();
        }
    };
    in_order(&[
        "void c2_rows(unsigned char *const *args, long long from, long long to, unsigned char *scratch)",
        "float *const k3 = (float *)(scratch + 0);",
        // The next row's 64 lines requested before this row's passes.
        "if (o + 1 < to) for (long long q = 0; q < 1024LL; q += 16) __builtin_prefetch(a0 + o0 + 1024LL + q);",
        // Pass 1: the max, folded in 64 lanes as it is loaded (NaN sticky).
        "l[j] = ((v0) > (l[j]) || (v0) != (v0)) ? (v0) : (l[j]);",
        "const float v1 = acc1;",
        // Pass 2: exp(x - max) computed, kept and summed; the chunk's sum added with compensation.
        "const float v3 = braid_expf(v2);",
        "k3[p] = v3;",
        "l[j] = l[j] + v3;",
        "comp4 = __builtin_isfinite(sum) ? (sum - acc4) - y : 0;",
        // Last pass: exp read back, divided, streamed out.
        "const float v3 = k3[p];",
        "const float v5 = v3 / v4;",
        "braid_stream_f32(a1 + w0 + c, t0, m);",
        "_mm_sfence();",
    ]);
    assert_eq!(s.matches("braid_expf(v2)").count(), 1, "exp computed once per element:\n{s}");
    // Rows of 64 f32 (256 bytes) and rows past 4,096 positions are left to the hardware's streamer.
    for (rows, len) in [(2048, 64), (16, 1 << 16)] {
        let s = print(&crate::cuda::tests::softmax_rows(rows, len), "k", at(4 << 20)).unwrap().source;
        assert!(!s.contains("__builtin_prefetch(a0"), "{s}");
    }

    // Below the streaming size: stored as computed, into an output declared `restrict`.
    let s = print(&k, "c2", at(16 << 20)).unwrap().source;
    assert!(s.contains("float *restrict const a1 = (float *)args[1];"), "{s}");
    assert!(
        s.contains("a1[w0 + p] = v5;") && !s.contains("braid_stream_f32(a1") && !s.contains("_mm_sfence();\n}"),
        "{s}"
    );
}

#[test]
fn row_kernels_along_a_non_last_axis_step_along_it_and_across_the_positions_after_it() {
    // A softmax over dim 0 of [8, 16]: 16 positions after the axis, per-row values as arrays.
    let along_dim0 = |rows: usize, cols: usize| {
        let mut k = crate::cuda::tests::softmax_rows(rows, cols);
        let Body::Rows(r) = &mut k.body else { unreachable!() };
        r.axis = Some(0);
        for v in r.loads.iter_mut().map(|l| &mut l.view).chain(r.stores.iter_mut().map(|s| &mut s.view)) {
            v.strides[0] = cols as isize;
        }
        k
    };
    let s = print(&along_dim0(8, 16), "k", at(1 << 20)).unwrap().source;
    for part in [
        "float acc1[16];",
        "for (long long a = 0; a < 8LL; a++) {",
        "for (int ii = 0; ii < 16; ii++) {",
        "pr1[ii] = acc1[ii];",
    ] {
        assert!(s.contains(part), "{part:?} in:\n{s}");
    }
    // More positions after the axis than per-row arrays hold on the stack: interpreted.
    let err = print(&along_dim0(2, columns::MAX_INNER + 1), "k", at(1 << 20)).unwrap_err();
    assert!(err.contains("positions after the axis"), "{err}");
}

#[test]
fn bools_are_computed_into_byte_blocks() {
    // `y = x > 0` over f32s into a bool output: gcc leaves a loop that stores into a `bool`
    // array scalar, so the block a loop computes into holds bytes.
    let mut b = ExprBuilder::default();
    let x = b.load(0, DType::F32);
    let zero = b.constant(0.0, DType::F32);
    let y = b.cmp(braid_graph::expr::PrimCmp::Gt, x, zero);
    let n = 4096;
    let l = MapLoop {
        dims: smallvec![n],
        loads: vec![Load { arg: 0, dtype: DType::F32, view: contiguous(n) }],
        expr: b.finish(),
        stores: vec![Store { arg: 1, dtype: DType::Bool, view: contiguous(n), value: y }],
    };
    let args = vec![Arg { dtype: DType::F32, len: n }, Arg { dtype: DType::Bool, len: n }];
    let k = Kernel { args, inputs: 1, body: Body::Map(vec![l]) };
    let s = print(&k, "m", at(4 << 20)).unwrap().source;
    assert!(s.contains("unsigned char t0[256]") && !s.contains("bool t0["), "{s}");
}

/// C1's chain, `gelu(x * w + 1) * sigmoid(x)` as braid composes it (two `exp`s, two divisions),
/// over `n` f32s.
fn chain_kernel(n: usize) -> Kernel {
    use braid_graph::expr::PrimBinary::{Add, Div, Mul};
    let mut b = ExprBuilder::default();
    let (x, w) = (b.load(0, DType::F32), b.load(1, DType::F32));
    let c = |b: &mut ExprBuilder, v: f64| b.constant(v, DType::F32);
    let (one, k1, k3) = (c(&mut b, 1.0), c(&mut b, -1.5957691), c(&mut b, -0.0713548));
    let xw = b.binary(Mul, x, w);
    let u = b.binary(Add, xw, one);
    let uu = b.binary(Mul, u, u);
    let t = b.binary(Mul, k3, uu);
    let t = b.binary(Add, k1, t);
    let z = b.binary(Mul, u, t);
    let e = b.unary(PrimUnary::Exp, z);
    let d = b.binary(Add, one, e);
    let gelu = b.binary(Div, u, d);
    let nx = b.unary(PrimUnary::Neg, x);
    let e2 = b.unary(PrimUnary::Exp, nx);
    let d2 = b.binary(Add, one, e2);
    let sig = b.binary(Div, one, d2);
    let y = b.binary(Mul, gelu, sig);
    let l = MapLoop {
        dims: smallvec![n],
        loads: vec![
            Load { arg: 0, dtype: DType::F32, view: contiguous(n) },
            Load { arg: 1, dtype: DType::F32, view: contiguous(n) },
        ],
        expr: b.finish(),
        stores: vec![Store { arg: 2, dtype: DType::F32, view: contiguous(n), value: y }],
    };
    Kernel { args: vec![Arg { dtype: DType::F32, len: n }; 3], inputs: 2, body: Body::Map(vec![l]) }
}

#[test]
fn a_compute_bound_chain_stores_its_large_output_directly_at_eight_lanes_and_streams_it_at_sixteen() {
    let k = chain_kernel(1 << 22);
    let Body::Map(loops) = &k.body else { unreachable!() };
    assert!(compute_bound(&loops[0], 8) && !compute_bound(&loops[0], 16));
    // One exp and a product per element: memory-bound at either width.
    let Body::Map(light) = exp_kernel(16).body else { unreachable!() };
    assert!(!compute_bound(&light[0], 8) && !compute_bound(&light[0], 16));
    // Normal variates (libm calls per element): compute-bound at either width; uniform ones
    // (integer mixing) at 8 lanes only.
    for (dist, at_16) in
        [(braid_graph::expr::Distribution::Normal, true), (braid_graph::expr::Distribution::Uniform, false)]
    {
        let mut b = ExprBuilder::default();
        let i = b.index();
        let r = b.random(7, dist, i, DType::F32);
        let store = Store { arg: 0, dtype: DType::F32, view: contiguous(16), value: r };
        let l = MapLoop { dims: smallvec![16], loads: vec![], expr: b.finish(), stores: vec![store] };
        assert!(compute_bound(&l, 8) && compute_bound(&l, 16) == at_16, "{dist:?}");
    }

    let avx2 = print(&k, "c1", at(4 << 20)).unwrap().source;
    assert!(avx2.contains("#pragma GCC ivdep") && avx2.contains("a2[w0 + k] = v"), "{avx2}");
    assert!(
        !avx2.contains("braid_stream_f32(a2") && !avx2.contains("t0[") && !avx2.contains("_mm_sfence();\n#endif\n}")
    );
    let avx512 = print(&k, "c1", HostTarget { stream_bytes: 4 << 20, f32_lanes: 16 }).unwrap().source;
    assert!(avx512.contains("braid_stream_f32(a2 + w0 + jb, t0, n);") && !avx512.contains("ivdep"), "{avx512}");
    // Below the streaming size the output stays in cache, written from the block as before.
    let small = print(&chain_kernel(1000), "c1", at(4 << 20)).unwrap().source;
    assert!(small.contains("a2[w0 + (jb + jj)] = t0[jj];") && !small.contains("ivdep"), "{small}");
}

#[test]
fn each_loop_declares_only_the_arguments_it_reads_and_writes() {
    // A cat of 3 parts: three copy loops into one output. Declaring every argument in every
    // loop made a cat of 512 parts 14.5 MB of C (31 s of compiling).
    let loops = (0..3u16)
        .map(|k| {
            let mut b = ExprBuilder::default();
            let x = b.load(0, DType::F32);
            let view = View { dims: smallvec![4], strides: smallvec![1], offset: 4 * k as usize };
            MapLoop {
                dims: smallvec![4],
                loads: vec![Load { arg: k, dtype: DType::F32, view: contiguous(4) }],
                expr: b.finish(),
                stores: vec![Store { arg: 3, dtype: DType::F32, view, value: x }],
            }
        })
        .collect();
    let mut args = vec![Arg { dtype: DType::F32, len: 4 }; 3];
    args.push(Arg { dtype: DType::F32, len: 12 });
    let src = print(&Kernel { args, inputs: 3, body: Body::Map(loops) }, "cat", at(usize::MAX)).unwrap();
    let s = &src.source;
    let loop1 = &s[s.find("void cat_loop1").unwrap()..s.find("void cat_loop2").unwrap()];
    assert!(loop1.contains("*)args[1];") && loop1.contains("*)args[3];"), "{loop1}");
    assert!(!loop1.contains("*)args[0];") && !loop1.contains("*)args[2];"), "{loop1}");
}

#[test]
fn a_transposing_loop_is_computed_a_whole_tile_at_a_time() {
    // `exp` of x.t() for x a contiguous [256, 1024], as the CPU tiles it: [1024 / 64, 256 / 16, 64,
    // 16], the load contiguous along the tile's columns (second to last), the store along its rows.
    let transposed = |mut k: Kernel, load: bool| {
        let Body::Map(loops) = &mut k.body else { unreachable!() };
        let l = &mut loops[0];
        l.dims = smallvec![16, 16, 64, 16];
        let column_major = View { dims: l.dims.clone(), strides: smallvec![64, 16 * 1024, 1, 1024], offset: 0 };
        let row_major = View { dims: l.dims.clone(), strides: smallvec![64 * 256, 16, 256, 1], offset: 0 };
        (l.loads[0].view, l.stores[0].view) = if load { (column_major, row_major) } else { (row_major, column_major) };
        (run_length(l), print(&k, "k", at(1 << 30)).unwrap().source)
    };
    let (run, s) = transposed(exp_kernel(1 << 18), true);
    assert_eq!(run, 1024, "a whole tile between index decompositions");
    assert!(s.contains("if (d3 == 0 && d2 == 0 && end - i >= 1024LL) {"), "{s}");
    // Read in place along the columns, computed into a local array, transposed out.
    assert!(s.contains("const float v0 = a0[o0 + q * 1024 + p];"), "{s}");
    assert!(s.contains("r0[k] = v3;"), "{s}");
    assert!(s.contains("braid_transpose32(a1 + w0, 256, r0, 64, 16, 64);"), "{s}");
    // The transposed store instead: the load transposed in, the store copied out by columns.
    let (_, s) = transposed(exp_kernel(1 << 18), false);
    assert!(s.contains("braid_transpose32(l0, 64, a0 + o0, 256, 64, 16);"), "{s}");
    assert!(s.contains("const float v0 = l0[k];"), "{s}");
    assert!(s.contains("a1[w0 + q * 1024 + p] = r0[q * 64 + p];"), "{s}");
    // Loads and stores whose tile arrays would take more than 256 KiB of stack: runs instead.
    let mut many = exp_kernel(1 << 18);
    let Body::Map(loops) = &mut many.body else { unreachable!() };
    let l = &mut loops[0];
    l.dims = smallvec![16, 16, 64, 16];
    l.loads[0].view = View { dims: l.dims.clone(), strides: smallvec![64, 16 * 1024, 1, 1024], offset: 0 };
    l.stores[0].view = View { dims: l.dims.clone(), strides: smallvec![64 * 256, 16, 256, 1], offset: 0 };
    assert_eq!(run_length(l), 1024);
    l.loads = vec![l.loads[0].clone(); 40];
    assert_eq!(run_length(l), 16, "40 loads and a store of 1024 elements: 328 KiB");
    // Nothing transposed: runs along the last dimension, as before.
    let plain = exp_kernel(1 << 18);
    let Body::Map(loops) = &plain.body else { unreachable!() };
    assert_eq!(run_length(&loops[0]), 1 << 18);
    assert!(!print(&plain, "k", at(1 << 30)).unwrap().source.contains("A whole"));
}

#[test]
fn a_split_softmax_row_folds_one_segment_per_call_and_writes_each_accumulator() {
    let k = crate::cuda::tests::softmax_rows(1, 70_001);
    let src = print_split(&k, "s", at(4 << 20)).unwrap();
    assert_eq!(src.entries, ["s_fold0", "s_fold1", "s_row", "s_elements"]);
    assert!(src.split_rows && src.row_scratch.is_none());
    let s = &src.source;
    let in_order = |parts: &[&str]| {
        let mut at = 0;
        for p in parts {
            let found = s[at..].find(p).unwrap_or_else(|| panic!("{p:?} not after byte {at} of:\n{s}"));
            at += found + p.len();
        }
    };
    in_order(&[
        "void s_fold0(unsigned char *const *args, long long o, long long from, long long to, const unsigned char *results, unsigned char *state)",
        // The max over the segment, from its first position, in the chunks of a split row.
        "for (long long c = from; c < to; c += 1024) {",
        "l[j] = ((v0) > (l[j]) || (v0) != (v0)) ? (v0) : (l[j]);",
        "__builtin_memcpy(state, &acc1, sizeof(float));",
        "__builtin_memcpy(state + 16, &at1, 8);",
        // The sum of exp(x - max), the max read back from the results.
        "void s_fold1(",
        "__builtin_memcpy(&v1, results + 0, sizeof(float));",
        "const float v3 = braid_expf(v2);",
        "comp4 = __builtin_isfinite(sum) ? (sum - acc4) - y : 0;",
        "__builtin_memcpy(state + 8, &comp4, sizeof(float));",
        // No per-row store; the element stores of a segment, both reductions read back.
        "void s_row(",
        "void s_elements(",
        "__builtin_memcpy(&v4, results + 8, sizeof(float));",
        "for (long long c = from; c < to; c += 256) {",
        "const float v5 = v3 / v4;",
    ]);
    // Positions after the axis stay with the interpreter's split.
    let mut cols = crate::cuda::tests::softmax_rows(70_000, 2);
    let Body::Rows(r) = &mut cols.body else { unreachable!() };
    r.axis = Some(0);
    let err = print_split(&cols, "s", at(4 << 20)).unwrap_err();
    assert!(err.contains("2 positions after the axis"), "{err}");
}

#[test]
fn an_argmax_finds_a_chunks_best_in_lanes_and_then_its_first_position() {
    let mut b = ExprBuilder::default();
    let x = b.load(0, DType::F32);
    let a = b.reduce(braid_graph::ReduceOp::ArgMax, x);
    let n = 5000;
    let r = crate::kernel::RowKernel {
        dims: smallvec![n],
        axis: None,
        loads: vec![Load { arg: 0, dtype: DType::F32, view: contiguous(n) }],
        expr: b.finish(),
        stores: vec![Store {
            arg: 1,
            dtype: DType::I64,
            view: View { dims: smallvec![n], strides: smallvec![0], offset: 0 },
            value: a,
        }],
    };
    let k = Kernel {
        args: vec![Arg { dtype: DType::F32, len: n }, Arg { dtype: DType::I64, len: 1 }],
        inputs: 1,
        body: Body::Rows(r),
    };
    let s = print(&k, "am", at(4 << 20)).unwrap().source;
    for part in [
        // A NaN best sticks: the rest of the row is skipped.
        "if (acc1 != acc1) break;",
        "xc[t + j] = v0;",
        "l[j] = ((v0) > (l[j]) || (v0) != (v0)) ? (v0) : (l[j]);",
        // Only a better chunk is searched, for its first NaN or its first best value.
        "if (s != s) for (k = 0; xc[k] == xc[k]; k++) {}",
        "if (s > acc1) for (k = 0; xc[k] != s; k++) {}",
        "at1 = c + k;",
    ] {
        assert!(s.contains(part), "{part:?} in:\n{s}");
    }
}

#[test]
fn a_split_sum_stores_the_prologue_it_keeps_as_its_first_fold_computes_it() {
    // sum(3x), 3x kept: stored by the fold (streamed a block at a time past the streaming
    // size), so no element pass computes it again.
    let n = 1 << 20;
    let mut b = ExprBuilder::default();
    let x = b.load(0, DType::F32);
    let three = b.constant(3.0, DType::F32);
    let thrice = b.binary(braid_graph::expr::PrimBinary::Mul, x, three);
    let sum = b.reduce(braid_graph::ReduceOp::Sum, thrice);
    let one = View { dims: smallvec![n], strides: smallvec![0], offset: 0 };
    let r = crate::kernel::RowKernel {
        dims: smallvec![n],
        axis: None,
        loads: vec![Load { arg: 0, dtype: DType::F32, view: contiguous(n) }],
        expr: b.finish(),
        stores: vec![
            Store { arg: 1, dtype: DType::F32, view: one, value: sum },
            Store { arg: 2, dtype: DType::F32, view: contiguous(n), value: thrice },
        ],
    };
    let args =
        vec![Arg { dtype: DType::F32, len: n }, Arg { dtype: DType::F32, len: 1 }, Arg { dtype: DType::F32, len: n }];
    let k = Kernel { args, inputs: 1, body: Body::Rows(r) };
    for (stream_bytes, streamed) in [(1 << 20, true), (64 << 20, false)] {
        let s = print_split(&k, "k", at(stream_bytes)).unwrap().source;
        let fold = &s[s.find("void k_fold0(").unwrap()..s.find("void k_row(").unwrap()];
        let elements = &s[s.find("void k_elements(").unwrap()..];
        if streamed {
            for part in ["float t1[64]", "t1[j] = v2;", "braid_stream_f32(a2 + w1 + c + t, t1, 64);", "_mm_sfence();"] {
                assert!(fold.contains(part), "{part:?} in:\n{fold}");
            }
        } else {
            assert!(fold.contains("a2[w1 + p] = v2;") && !fold.contains("braid_stream_f32"), "{fold}");
        }
        assert!(!elements.contains("v0 * v1") && !elements.contains("a2["), "{elements}");
    }
}
