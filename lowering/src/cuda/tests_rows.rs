//! Printer tests of row kernels that keep computed values and of column kernels (split from
//! `tests.rs`, whose helpers they use).

use super::tests::{args, contiguous, in_order, load, softmax_rows, store, view};
use super::*;
use braid_graph::expr::ExprBuilder;

/// A softmax along rows of [4, 64] f32 storing y and, beside it, node `extra` of (x - max,
/// exp(x - max)).
fn softmax_also_storing(extra: usize) -> Kernel {
    let mut k = softmax_rows(4, 64);
    k.args = args(&[(DType::F32, 256), (DType::F32, 256), (DType::F32, 256)]);
    let Body::Rows(r) = &mut k.body else { unreachable!("a row kernel") };
    r.stores.push(store(2, DType::F32, contiguous(&[4, 64]), [2, 3][extra]));
    k
}

#[test]
fn a_value_kept_over_the_input_still_leaves_every_stored_value_computed() {
    // Softmax that also stores x - max: x - max is kept over x (both later sweeps read it),
    // exp is recomputed from it for the stores, and both stored values are defined there.
    let src = print(&softmax_also_storing(0), "both").unwrap().source;
    assert!(src.contains("float* const keep2 = keep0; // v2, kept over v0 once v0 is read"), "{src}");
    let last = &src[src.rfind("for (int t").unwrap()..];
    in_order(last, &["const float v2 = keep2[t];", "const float v3 = expf(v2);", "a1[", "= v2;"]);
    assert!(!last.contains("v0"), "{src}");
    // Softmax storing exp(x - max) beside y: exp is kept over x and both stores read it back.
    let src = print(&softmax_also_storing(1), "exp").unwrap().source;
    let last = &src[src.rfind("for (int t").unwrap()..];
    in_order(last, &["const float v3 = keep3[t];", "const float v5 = v3 / v4;", "a1[", "a2["]);
    assert!(!last.contains("expf"), "{src}");
}

/// A sum over the first axis of `[len, cols]` f32 (a bias gradient, G2-axis0) as a kernel.
fn column_sum(len: usize, cols: usize) -> Kernel {
    column_sum_storing(len, cols, false)
}

/// [`column_sum`], with `doubled` also storing `2 x` per element: the constant is recorded
/// after the sum (as a derivative's `2` after the reduction beside it), and the store reads no
/// reduction, so a split kernel's first pass writes it.
fn column_sum_storing(len: usize, cols: usize, doubled: bool) -> Kernel {
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let sum = b.reduce(ReduceOp::Sum, x);
    let dims = [len, cols];
    let mut stores = vec![store(1, DType::F32, view(&dims, &[0, 1], 0), sum)];
    let mut arg_list = vec![(DType::F32, len * cols), (DType::F32, cols)];
    if doubled {
        let two = b.constant(2.0, DType::F32);
        stores.push(store(2, DType::F32, contiguous(&dims), b.mul(x, two)));
        arg_list.push((DType::F32, len * cols));
    }
    let loads = vec![load(0, DType::F32, contiguous(&dims))];
    let r = RowKernel { dims: dims.as_slice().into(), axis: Some(0), loads, expr: b.finish(), stores };
    Kernel { args: args(&arg_list), inputs: 1, body: Body::Rows(r) }
}

#[test]
fn a_reduction_over_the_first_axis_reads_neighbouring_rows_together() {
    // G2-axis0, [8192, 4096] summed over axis 0: 4096 rows of 8192 elements, each a stride of
    // 4096 apart. Printed as a column kernel: 32 neighbouring rows a block of 32 lines (128
    // blocks, enough to fill the GPU unsplit), thread `cx` of each line on row `c0 + cx`, so a
    // warp's loads at one position are 32 neighbouring floats, one 128-byte line.
    let p = print(&column_sum(8192, 4096), "g2").unwrap();
    assert_eq!(p.entries, vec![Entry { name: "g2_rows".into(), launch: Launch::Rows { rows: 128, threads: 1024 } }]);
    assert_eq!(p.scratch_bytes, 0);
    in_order(
        &p.source,
        &[
            "__global__ void __launch_bounds__(1024) g2_rows(",
            "const unsigned xw = blockDim.x < 32u ? blockDim.x : 32u;",
            "const long long group = blockIdx.x / 1, seg = blockIdx.x % 1;",
            "for (long long c0 = group * 32LL; c0 < group * 32LL + 32LL && c0 < 4096LL; c0 += xw) {",
            "const long long row = active ? c0 + cx : 4095LL;",
            // A block of the printed size steps by its 32 lines, a constant (so the loop is
            // unrolled); another size by `ys`.
            "if (ys == 32u) {",
            "#pragma unroll 8",
            "for (int t = from; t < end; t += 32) {",
            "const float v0 = a0[d0 * 4096 + d1];",
            "} else {",
            "for (int t = from; t < end; t += ys) {",
            "const float v0 = a0[d0 * 4096 + d1];",
            // The column's partial sums, combined in order of the line.
            "red1[threadIdx.x] = acc1;",
            "for (unsigned k = 1; k < ys; ++k) {",
            "if (active && cy == 0) {",
            "a1[d1] = v1;",
        ],
    );
    assert!(!p.source.contains("__shfl"), "no warp shuffles: each lane has a column of its own");
}

#[test]
fn short_columns_take_blocks_of_as_few_lines_as_they_fill() {
    // A position embedding's gradient, [8, 786432] summed over axis 0: columns of 8 positions
    // fill one line, so a block is the 32 threads of one line (a 32-line block left 31 idle);
    // columns of 64 fill 8 lines, of 256 or more all 32.
    for (len, threads) in [(8, 32), (12, 32), (16, 64), (64, 256), (256, 1024), (8192, 1024)] {
        let p = print(&column_sum(len, 4096), "short").unwrap();
        let launch = Launch::Rows { rows: 128, threads };
        assert_eq!(p.entries, vec![Entry { name: "short_rows".into(), launch }], "columns of {len}");
        let bound = format!("__global__ void __launch_bounds__({threads}) short_rows(");
        in_order(&p.source, &[bound.as_str(), &format!("if (ys == {}u) {{", threads / 32)]);
    }
}

#[test]
fn a_split_columns_first_pass_declares_the_constants_its_stores_read() {
    // The first pass of a split column kernel writes the stores that read no reduction; a
    // constant they read, recorded after the pass's last reduction, is declared there too
    // (it was declared only in later entries: NVRTC refused `v2` as undefined).
    let p = print(&column_sum_storing(4096, 512, true), "twice").unwrap();
    let names: Vec<&str> = p.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["twice_rows_partial1", "twice_rows_combine1"]);
    let partial =
        &p.source[p.source.find("twice_rows_partial1(").unwrap()..p.source.find("twice_rows_combine1(").unwrap()];
    in_order(partial, &["const float v2 = 2.0f;", "const float v3 = v", "* v2;", "acc1"]);
}

#[test]
fn few_long_columns_are_split_into_segments_combined_in_order() {
    // A bias gradient, [4096, 512] summed over axis 0: its 16 groups of 32 columns would leave
    // most of the GPU idle, so each column is split in 8 segments of 512 (128 blocks); the
    // partial sums go to scratch, and a thread per column adds its 8 in segment order and
    // stores the sum (no per-element stores: no third pass).
    let p = print(&column_sum(4096, 512), "bias").unwrap();
    let rows = |rows, threads| Launch::Rows { rows, threads };
    assert_eq!(
        p.entries,
        vec![
            Entry { name: "bias_rows_partial1".into(), launch: rows(128, 1024) },
            Entry { name: "bias_rows_combine1".into(), launch: rows(2, 256) },
        ]
    );
    // 512 x 8 partial sums, then 512 sums.
    assert_eq!(p.scratch_bytes, 512 * 8 * 4 + 512 * 4);
    in_order(
        &p.source,
        &[
            "const long long group = blockIdx.x / 8, seg = blockIdx.x % 8;",
            "const int end = start + 512 < 4096 ? start + 512 : 4096;",
            "for (int t = from; t < end; t += 32) {",
            "if (active && cy == 0) {",
            "((float*)(a2 + 0))[row * 8 + seg] = acc1;",
            "__launch_bounds__(256) bias_rows_combine1(",
            "float acc1 = ((float*)(a2 + 0))[row * 8];",
            "for (int k = 1; k < 8; ++k) {",
            "acc1 = acc1 + b;",
            "((float*)(a2 + 16384))[row] = acc1;",
            "a1[d1] = v1;",
        ],
    );
}

#[test]
fn softmax_rows_move_sixteen_bytes_at_a_time_where_aligned() {
    // Rows of 64 f32: a thread per chunk of 4 (32 threads), every sweep over chunks when the
    // kernel finds its arguments aligned, over single positions otherwise (same threads, same
    // kept positions). The input and the kept values move as `uint4`s, and so do the stores.
    let p = print(&softmax_also_storing(1), "exp").unwrap();
    assert_eq!(p.entries, vec![Entry { name: "exp_rows".into(), launch: Launch::Rows { rows: 4, threads: 32 } }]);
    let src = &p.source;
    let chunk =
        |to: &str, from: &str| format!("*reinterpret_cast<uint4*>({to}) = *reinterpret_cast<const uint4*>({from});");
    in_order(
        src,
        &[
            "__shared__ __align__(16) float keep0[64];",
            "const bool vec = (unsigned long long)a0 % 16u == 0 && (unsigned long long)a1 % 16u == 0 && (unsigned long long)a2 % 16u == 0;",
            // The max: the input a chunk at a time, kept.
            "if (vec) {",
            "for (int t0 = threadIdx.x * 4; t0 < 64LL; t0 += blockDim.x * 4) {",
            &chunk("l0", "a0 + d0 * 64 + d1"),
            "const float v0 = l0[e];",
            &chunk("keep0 + t0", "w0"),
            "} else {",
            "for (int t = threadIdx.x; t < 64LL; t += blockDim.x) {",
            // The sum: x read back, exp(x - max) kept over it.
            &chunk("r0", "keep0 + t0"),
            &chunk("keep3 + t0", "w3"),
            // The stores: exp read back, both outputs a chunk at a time.
            &chunk("r3", "keep3 + t0"),
            "s0[e] = v5;",
            &chunk("a1 + d0 * 64 + d1", "s0"),
            &chunk("a2 + d0 * 64 + d1", "s1"),
        ],
    );
    // A row whose length is not a multiple of 4 has no vector path.
    let mut odd = softmax_also_storing(1);
    let Body::Rows(r) = &mut odd.body else { unreachable!() };
    let dims = [4, 63];
    r.dims = dims.as_slice().into();
    r.loads[0].view = contiguous(&dims);
    r.stores.iter_mut().for_each(|s| s.view = contiguous(&dims));
    assert!(!print(&odd, "odd").unwrap().source.contains("vec"));
}

#[test]
fn long_rows_at_odd_strides_start_their_chunks_at_each_rows_head() {
    // A softmax over rows of 20,001 f32 (too long to keep), the input's rows 20,003 apart from
    // an offset of 1 (a language model's logits at an odd stride): each row's first aligned
    // chunk is at its own `head`, the positions before it and after the last chunk are swept
    // one at a time, and the output (whose rows start at other remainders) is stored so too.
    // (As many rows as keep a row kernel unsplit.)
    let (rows, len) = (SPLIT_BELOW_ROWS, 20_001);
    let mut k = softmax_rows(rows, len);
    k.args = args(&[(DType::F32, 1 + rows * 20_003), (DType::F32, rows * len)]);
    let Body::Rows(r) = &mut k.body else { unreachable!("a row kernel") };
    r.loads[0].view = view(&[rows, len], &[20_003, 1], 1);
    let src = print(&k, "peel").unwrap().source;
    assert!(!src.contains("keep"), "{src}");
    in_order(
        &src,
        &[
            "const bool vec = (unsigned long long)a0 % 16u == 0;",
            "const int head = (int)((4LL - (1 + d0 * 20003) % 4LL) % 4LL);",
            "const int vec_end = head + (20001 - head) / 4 * 4;",
            "if (vec) {",
            "for (int t = threadIdx.x; t < head; t += blockDim.x) {",
            "for (int t0 = head + threadIdx.x * 4; t0 < vec_end; t0 += blockDim.x * 4) {",
            "*reinterpret_cast<uint4*>(l0) = *reinterpret_cast<const uint4*>(a0 + 1 + d0 * 20003 + d1);",
            "for (int t = vec_end + threadIdx.x; t < 20001LL; t += blockDim.x) {",
            "} else {",
            "for (int t = threadIdx.x; t < 20001LL; t += blockDim.x) {",
        ],
    );
}

#[test]
fn a_row_streamed_from_memory_is_chunked_before_a_view_every_row_shares() {
    // Rows of 50,257 bf16 (a language model's logits, one after another at that odd stride)
    // times a vector every row shares, summed: the logits move 8 at a time from each row's
    // head; the shared vector (its rows start at other remainders) is read one at a time.
    let (rows, len) = (SPLIT_BELOW_ROWS, 50_257);
    let mut b = ExprBuilder::new();
    let (x, c) = (b.load(0, DType::BF16), b.load(1, DType::BF16));
    let xc = b.mul(x, c);
    let sum = b.reduce(ReduceOp::Sum, xc);
    let r = RowKernel {
        dims: [rows, len].as_slice().into(),
        axis: Some(1),
        loads: vec![
            load(1, DType::BF16, view(&[rows, len], &[0, 1], 0)),
            load(0, DType::BF16, contiguous(&[rows, len])),
        ],
        expr: b.finish(),
        stores: vec![store(2, DType::F32, view(&[rows, len], &[1, 0], 0), sum)],
    };
    let k = Kernel {
        args: args(&[(DType::BF16, rows * len), (DType::BF16, len), (DType::F32, rows)]),
        inputs: 2,
        body: Body::Rows(r),
    };
    let src = print(&k, "logits").unwrap().source;
    in_order(
        &src,
        &[
            "const bool vec = (unsigned long long)a0 % 16u == 0;",
            "const int head = (int)((8LL - (d0 * 50257) % 8LL) % 8LL);",
            "for (int t0 = head + threadIdx.x * 8; t0 < vec_end; t0 += blockDim.x * 8) {",
            "*reinterpret_cast<uint4*>(l1) = *reinterpret_cast<const uint4*>(a0 + d0 * 50257 + d1);",
            "a1[d1]",
        ],
    );
}

#[test]
fn many_short_rows_share_blocks_a_segment_of_lanes_each() {
    // Attention's delta, rowsum(d_out * out) over [2048, 64] bf16: eight 16-byte chunks a row,
    // so a segment of 8 lanes a row and 32 rows a block of 256, each row combined by shuffles
    // within its segment: no shared memory, no barrier.
    let mut b = ExprBuilder::new();
    let (x, y) = (b.load(0, DType::BF16), b.load(1, DType::BF16));
    let (xf, yf) = (b.cast(DType::F32, x), b.cast(DType::F32, y));
    let prod = b.mul(xf, yf);
    let sum = b.reduce(ReduceOp::Sum, prod);
    let dims = [2048, 64];
    let loads = vec![load(0, DType::BF16, contiguous(&dims)), load(1, DType::BF16, contiguous(&dims))];
    let stores = vec![store(2, DType::F32, view(&dims, &[1, 0], 0), sum)];
    let r = RowKernel { dims: dims.as_slice().into(), axis: Some(1), loads, expr: b.finish(), stores };
    let args = args(&[(DType::BF16, 2048 * 64), (DType::BF16, 2048 * 64), (DType::F32, 2048)]);
    let p = print(&Kernel { args, inputs: 2, body: Body::Rows(r) }, "delta").unwrap();
    assert_eq!(p.entries, vec![Entry { name: "delta_rows".into(), launch: Launch::Rows { rows: 64, threads: 256 } }]);
    in_order(
        &p.source,
        &[
            "// Short rows of [2048, 64] along dim 1 (64 elements): 8 lanes a row.",
            "const unsigned lanes = blockDim.x < 8u ? blockDim.x : 8u;",
            "for (long long first = (long long)blockIdx.x * per_block; first < 2048LL;",
            "const long long row = active ? mine : 2047LL;",
            "const int end = active ? (int)64 : (int)0;",
            "for (int t0 = lane * 8; t0 < end; t0 += lanes * 8) {",
            "__shfl_down_sync(mask, acc5, s, lanes);",
            "acc5 = __shfl_sync(mask, acc5, 0, lanes);",
            "if (active && lane == 0) {",
        ],
    );
    assert!(!p.source.contains("__shared__") && !p.source.contains("__syncthreads"), "{}", p.source);
}

/// `sum(x^2) + sum(y^2)` of two f32 tensors of `len` elements, stored as one value: a gradient
/// norm's sums of squares of two tensors in one kernel.
fn sums_of_squares(len: usize) -> Kernel {
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let x2 = b.mul(x, x);
    let sx = b.reduce(ReduceOp::Sum, x2);
    let y = b.load(1, DType::F32);
    let y2 = b.mul(y, y);
    let sy = b.reduce(ReduceOp::Sum, y2);
    let total = b.add(sx, sy);
    let dims = [len];
    let r = RowKernel {
        dims: dims.as_slice().into(),
        axis: None,
        loads: vec![load(0, DType::F32, contiguous(&dims)), load(1, DType::F32, contiguous(&dims))],
        expr: b.finish(),
        stores: vec![store(2, DType::F32, view(&dims, &[0], 0), total)],
    };
    Kernel { args: args(&[(DType::F32, len), (DType::F32, len), (DType::F32, 1)]), inputs: 2, body: Body::Rows(r) }
}

#[test]
fn reductions_of_a_split_row_that_read_none_share_two_passes() {
    // Two whole-tensor sums of 3 segments: one pass folds each segment into a partial result of
    // both, one block combines both (three launches, not five: in a CUDA graph each dependent
    // launch costs microseconds, which a gradient norm over 148 tensors paid 100 times).
    let p = print(&sums_of_squares(3 * SEGMENT), "norm").unwrap();
    let launches: Vec<(&str, Launch)> = p.entries.iter().map(|e| (e.name.as_str(), e.launch)).collect();
    let (segs, one) = (Launch::Rows { rows: 3, threads: 256 }, Launch::Rows { rows: 1, threads: 256 });
    assert_eq!(launches, [("norm_rows_partial", segs), ("norm_rows_combine", one), ("norm_rows_finish", segs)]);
    assert_eq!(p.scratch_bytes, 2 * (16 + 8), "3 partials and a value per sum, regions of 8 bytes");
    in_order(
        &p.source,
        &[
            "// Reductions v2, v5, pass 1: 3 segments of 4096 per row, a block each.",
            "void norm_rows_partial(",
            "for (int t = seg * 4096LL + threadIdx.x; t < end; t += blockDim.x) {",
            "const float v0 = a0[d0];",
            "const float v3 = a1[d0];",
            "{ const float y = v1 - cmp2;",
            "{ const float y = v4 - cmp5;",
            "if (threadIdx.x == 0) {",
            "((float*)(a3 + 0))[blockIdx.x] = acc2;",
            "((float*)(a3 + 24))[blockIdx.x] = acc5;",
            "// Reductions v2, v5, pass 2: each row's 3 partial results, a block per row.",
            "void norm_rows_combine(",
            "if (threadIdx.x == 0) ((float*)(a3 + 16))[row] = acc2;",
            "if (threadIdx.x == 0) ((float*)(a3 + 40))[row] = acc5;",
            "void norm_rows_finish(",
            "const float v6 = v2 + v5;",
        ],
    );
    let finish = &p.source[p.source.find("void norm_rows_finish(").unwrap()..];
    assert!(!finish.contains("a0[") && !finish.contains("a1["), "the outputs read no input:\n{finish}");
}

#[test]
fn print_options_change_how_long_rows_are_split_and_nothing_else() {
    // Rows of 5 segments of the default length: 3 of 8K elements, or not split at all when a
    // segment would cover half a row; rows short enough to keep whole print as by default.
    let long = softmax_rows(2, 5 * SEGMENT);
    let blocks = |o: PrintOptions| -> Vec<Launch> {
        print_with(&long, "sm", &o).unwrap().entries.iter().map(|e| e.launch).take(1).collect()
    };
    let d = PrintOptions::default();
    assert_eq!(blocks(d), [Launch::Rows { rows: 10, threads: 256 }]);
    assert_eq!(blocks(PrintOptions { segment: 2 * SEGMENT, ..d }), [Launch::Rows { rows: 6, threads: 256 }]);
    assert_eq!(print_with(&long, "sm", &PrintOptions { segment: 3 * SEGMENT, ..d }).unwrap().entries.len(), 1);
    let short = softmax_rows(2, 2047);
    let printed = |o: PrintOptions| print_with(&short, "sm", &o).unwrap().source;
    assert_eq!(printed(d), printed(PrintOptions { segment: 2048, column_blocks: 512, ..d }));
    assert!(print_with(&short, "sm", &PrintOptions { segment: 0, ..d }).is_err());
}

#[test]
fn vector_bytes_narrow_a_row_kernels_chunks_or_leave_none() {
    // Rows of 64 f32 (see softmax_rows_move_sixteen_bytes_at_a_time_where_aligned): 8 bytes
    // move 2 positions a chunk as `uint2`s; 4 bytes hold one f32, so no chunk at all, as 0.
    let k = softmax_also_storing(1);
    let d = PrintOptions::default();
    let printed = |vector_bytes| print_with(&k, "exp", &PrintOptions { vector_bytes, ..d }).unwrap().source;
    let eight = printed(8);
    in_order(
        &eight,
        &[
            "const bool vec = (unsigned long long)a0 % 8u == 0",
            "for (int t0 = threadIdx.x * 2; t0 < 64LL; t0 += blockDim.x * 2) {",
            "*reinterpret_cast<uint2*>(l0) = *reinterpret_cast<const uint2*>(a0 + d0 * 64 + d1);",
        ],
    );
    assert!(!eight.contains("uint4"), "{eight}");
    for none in [printed(4), printed(0)] {
        assert!(!none.contains("vec") && !none.contains("reinterpret_cast"), "{none}");
    }
    assert_eq!(printed(16), print(&k, "exp").unwrap().source);
    assert!(print_with(&k, "exp", &PrintOptions { vector_bytes: 2, ..d }).is_err());
}
