//! A hand-written row kernel for the combines of the printed reductions across lanes and warps:
//! rows of 300 elements (the printed block is 256 threads, 8 warps) whose maxima tie, or are
//! NaN, at positions that fall to other lanes and other warps at each block size (31 and 32,
//! 63 and 64, 255 and 256...), so that the first-index and NaN rules must survive every step of
//! the combine. Shared by `tests/cuda_printer.rs` (which runs it with more than one warp in
//! the emulation, too) and `tests/cuda_kernels.rs` (every block size on a GPU).

use super::cases::{Case, encode, new_case};
use braid_graph::expr::ExprBuilder;
use braid_graph::{DType, ReduceOp};
use braid_lowering::{Arg, Body, Load, RowKernel, Store, View};

/// Rows of the case, and their length.
const ROWS: usize = 6;
const LEN: usize = 300;

/// Per row and position: f32 `x`, i32 `n`, u8 `u`, i64 `w`, f64 `z`.
fn values(row: usize, p: usize) -> [f64; 5] {
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    let mut x = (p % 7) as f64 - 3.0;
    let mut n = (p * 37 % 101) as f64 - 50.0;
    let u = (p * 13 % 256) as f64;
    let mut w = ((p * 7919 % 1000) as f64 - 500.0) * (1u64 << 40) as f64;
    let mut z = p as f64 * 0.25 - 30.0;
    match row {
        // Ties everywhere: position 0 wins.
        0 => [x, n, w, z] = [1.0, 7.0, -5.0, 0.5],
        // Equal maxima in other lanes and warps; the first (31 or 63) wins.
        1 => {
            if [31, 32, 77, 130, 290].contains(&p) {
                x = 50.0;
            }
            if [63, 64, 200, 256].contains(&p) {
                [n, w] = [i32::MAX as f64, i64::MAX as f64];
            }
            if [95, 96, 288].contains(&p) {
                z = 1e300;
            }
        }
        // NaN wins over infinity and sticks: the first NaN (99) wins.
        2 => {
            if p == 10 {
                x = inf;
            }
            if [99, 160, 260].contains(&p) {
                x = nan;
            }
            if [150, 40].contains(&p) {
                [n, w] = [i32::MIN as f64, i64::MIN as f64];
            }
            if [33, 257].contains(&p) {
                z = nan;
            }
        }
        // All -inf but a NaN in the last position.
        3 => {
            x = if p == LEN - 1 { nan } else { -inf };
            z = -inf;
        }
        // All -inf: the first wins; the sum is -inf.
        4 => [x, z] = [-inf, -inf],
        // Infinities of both signs: the sum is NaN, the maximum +inf at 128.
        _ => {
            if p == 128 || p == 129 {
                x = inf;
            }
            if p == 1 {
                x = -inf;
            }
        }
    }
    [x, n, u, w, z]
}

/// The case: per row the argmax, max and sum of `x`, the argmax and min of `n`, the (wrapping)
/// sum of `u`, the argmax and max of `w`, the mean and min of `z`; per element `x - max`.
pub(crate) fn warps_case() -> Case {
    use DType::*;
    let dtypes = [F32, I32, U8, I64, F64];
    let mut c = new_case(format!("warps (rows of {LEN}, ties and NaN across lanes and warps)"), 5, Body::Map(vec![]));
    let dims = [ROWS, LEN];
    let view =
        |strides: [isize; 2]| View { dims: dims.as_slice().into(), strides: strides.as_slice().into(), offset: 0 };
    let (elements, per_row) = (view([LEN as isize, 1]), view([1, 0]));
    let mut loads = vec![];
    for (a, &d) in dtypes.iter().enumerate() {
        let vals: Vec<f64> = (0..ROWS * LEN).map(|i| values(i / LEN, i % LEN)[a]).collect();
        c.kernel.args.push(Arg { dtype: d, len: ROWS * LEN });
        c.init.push(encode(d, &vals));
        loads.push(Load { arg: a as u16, dtype: d, view: elements.clone() });
    }
    let mut b = ExprBuilder::new();
    let [x, n, u, w, z] = [0, 1, 2, 3, 4].map(|a| b.load(a, dtypes[a as usize]));
    let reductions = [
        (ReduceOp::ArgMax, x),
        (ReduceOp::Max, x),
        (ReduceOp::Sum, x),
        (ReduceOp::ArgMax, n),
        (ReduceOp::Min, n),
        (ReduceOp::Sum, u),
        (ReduceOp::ArgMax, w),
        (ReduceOp::Max, w),
        (ReduceOp::Mean, z),
        (ReduceOp::Min, z),
    ];
    let mut stores = vec![];
    for (op, v) in reductions {
        let r = b.reduce(op, v);
        let d = b.dtype(r);
        let arg = c.kernel.args.len();
        c.kernel.args.push(Arg { dtype: d, len: ROWS });
        c.init.push(encode(d, &[3.0; ROWS]));
        stores.push(Store { arg: arg as u16, dtype: d, view: per_row.clone(), value: r });
    }
    // Every thread of every warp needs the row's maximum.
    let m = b.reduce(ReduceOp::Max, x);
    let y = b.sub(x, m);
    c.kernel.args.push(Arg { dtype: F32, len: ROWS * LEN });
    c.init.push(encode(F32, &vec![3.0; ROWS * LEN]));
    stores.push(Store { arg: c.kernel.args.len() as u16 - 1, dtype: F32, view: elements, value: y });
    let r = RowKernel { dims: dims.as_slice().into(), axis: Some(1), loads, expr: b.finish(), stores };
    c.kernel.body = Body::Rows(r);
    c
}
