//! Printer tests of row kernels that keep computed values and of column kernels (split from
//! `tests.rs`, whose helpers they use).

use super::tests::{args, contiguous, in_order, load, store, view};
use super::*;
use braid_graph::expr::ExprBuilder;

/// A softmax along rows of [4, 64] f32 storing y and, beside it, node `extra` of (x - max,
/// exp(x - max)).
fn softmax_also_storing(extra: usize) -> Kernel {
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let m = b.reduce(ReduceOp::Max, x);
    let s = b.sub(x, m);
    let e = b.exp(s);
    let sum = b.reduce(ReduceOp::Sum, e);
    let y = b.div(e, sum);
    let dims = [4, 64];
    let r = RowKernel {
        dims: dims.as_slice().into(),
        axis: Some(1),
        loads: vec![load(0, DType::F32, contiguous(&dims))],
        expr: b.finish(),
        stores: vec![
            store(1, DType::F32, contiguous(&dims), y),
            store(2, DType::F32, contiguous(&dims), [s, e][extra]),
        ],
    };
    Kernel { args: args(&[(DType::F32, 256), (DType::F32, 256), (DType::F32, 256)]), inputs: 1, body: Body::Rows(r) }
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

#[test]
fn a_reduction_over_the_first_axis_reads_neighbouring_rows_together() {
    // A sum over the batch axis of [4096, 512] (a bias gradient): 512 rows of 4096 elements,
    // each a stride of 512 apart. Printed as a column kernel: 8 neighbouring rows a block (64
    // blocks), thread `cx` of each line of 8 on row `g * 8 + cx`, so a warp's loads at one
    // position are 4 runs of 8 neighbouring floats (32-byte sectors), not 32 sectors.
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::F32);
    let sum = b.reduce(ReduceOp::Sum, x);
    let dims = [4096, 512];
    let r = RowKernel {
        dims: dims.as_slice().into(),
        axis: Some(0),
        loads: vec![load(0, DType::F32, contiguous(&dims))],
        expr: b.finish(),
        stores: vec![store(1, DType::F32, view(&dims, &[0, 1], 0), sum)],
    };
    let k = Kernel { args: args(&[(DType::F32, 4096 * 512), (DType::F32, 512)]), inputs: 1, body: Body::Rows(r) };
    let p = print(&k, "bias").unwrap();
    assert_eq!(p.entries, vec![Entry { name: "bias_rows".into(), launch: Launch::Rows { rows: 64, threads: 512 } }]);
    in_order(
        &p.source,
        &[
            "const unsigned xw = blockDim.x < 8u ? blockDim.x : 8u;",
            "for (long long g = blockIdx.x; g * xw < 512LL; g += gridDim.x) {",
            "const long long row = active ? g * xw + cx : 511LL;",
            "for (int t = from; t < 4096LL; t += ys) {",
            "const float v0 = a0[d0 * 512 + d1];",
            // The column's partial sums, combined in order of the line.
            "red1[threadIdx.x] = acc1;",
            "for (unsigned k = 1; k < ys; ++k) {",
            "if (active && cy == 0) {",
            "a1[d1] = v1;",
        ],
    );
    assert!(!p.source.contains("__shfl"), "no warp shuffles: a warp spans several columns");
}
