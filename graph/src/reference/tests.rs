//! Hand-written cases: semantics (broadcasting, wrapping, casts, reductions, matmul, layout,
//! random numbers) and the checks' behaviour.

use super::*;
use crate::op::{ReduceOp, Scalar};
use crate::rng;
use crate::table::{BinaryOp, CompareOp, UnaryOp};

/// A program under construction.
pub(super) struct Prog(pub Vec<ProgNode>);

impl Prog {
    pub fn new() -> Prog {
        Prog(Vec::new())
    }

    pub fn data(&mut self, dtype: DType, dims: &[usize], values: &[f64]) -> usize {
        self.0.push(ProgNode::Data { dtype, shape: Shape::new(dims), values: values.to_vec() });
        self.0.len() - 1
    }

    pub fn op(&mut self, op: Op, dtype: DType, dims: &[usize], inputs: &[usize]) -> usize {
        self.0.push(ProgNode::Op { op, dtype, shape: Shape::new(dims), inputs: inputs.to_vec() });
        self.0.len() - 1
    }

    /// Evaluates and returns node `n`.
    pub fn eval(&self, n: usize) -> RefValue {
        evaluate(&self.0).swap_remove(n)
    }
}

fn reduce(op: ReduceOp, dim: Option<usize>, keepdim: bool) -> Op {
    Op::Reduce { op, dim, keepdim }
}

#[test]
fn broadcast_add_aligns_from_the_right() {
    let mut p = Prog::new();
    let a = p.data(DType::F32, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let b = p.data(DType::F32, &[3], &[10.0, 20.0, 30.0]);
    let c = p.data(DType::F32, &[2, 1], &[100.0, 200.0]);
    let ab = p.op(Op::Binary(BinaryOp::Add), DType::F32, &[2, 3], &[a, b]);
    let cb = p.op(Op::Binary(BinaryOp::Add), DType::F32, &[2, 3], &[c, b]);
    let r = evaluate(&p.0);
    assert_eq!(r[ab].values_f64(), [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
    assert_eq!(r[cb].values_f64(), [110.0, 120.0, 130.0, 210.0, 220.0, 230.0]);
    // Exact inputs: only the rounding allowance, a few f32 ulps.
    assert!(r[ab].bounds().iter().all(|&b| b > 0.0 && b < 1e-5), "{:?}", r[ab].bounds());
}

#[test]
fn integers_wrap_and_divide_by_zero_gives_zero() {
    let mut p = Prog::new();
    let i = p.data(DType::I32, &[3], &[i32::MAX as f64, i32::MIN as f64, 7.0]);
    let one = p.data(DType::I32, &[3], &[1.0, -1.0, 0.0]);
    let add = p.op(Op::Binary(BinaryOp::Add), DType::I32, &[3], &[i, one]);
    let div = p.op(Op::Binary(BinaryOp::Div), DType::I32, &[3], &[i, one]);
    let u = p.data(DType::U8, &[2], &[5.0, 0.0]);
    let neg = p.op(Op::Unary(UnaryOp::Neg), DType::U8, &[2], &[u]);
    let sub =
        p.op(Op::BinaryScalar { op: BinaryOp::Sub, scalar: Scalar(6.0), scalar_first: false }, DType::U8, &[2], &[u]);
    let r = evaluate(&p.0);
    assert_eq!(r[add].values_f64(), [i32::MIN as f64, i32::MAX as f64, 7.0]);
    // i32::MIN / -1 overflows to i32::MIN; 7 / 0 == 0.
    assert_eq!(r[div].values_f64(), [i32::MAX as f64, i32::MIN as f64, 0.0]);
    assert_eq!(r[neg].values_f64(), [251.0, 0.0]);
    assert_eq!(r[sub].values_f64(), [255.0, 250.0]);
    assert!(r[add].bounds().iter().chain(r[div].bounds()).all(|&b| b == 0.0));
}

#[test]
fn i64_is_exact_beyond_2_pow_53() {
    let mut p = Prog::new();
    p.0.push(ProgNode::IntData { dtype: DType::I64, shape: Shape::new(&[2]), values: vec![i64::MAX, (1 << 53) + 1] });
    let one = p.data(DType::I64, &[1], &[1.0]);
    let add = p.op(Op::Binary(BinaryOp::Add), DType::I64, &[2], &[0, one]);
    let eq = p.op(Op::Compare(CompareOp::Eq), DType::Bool, &[2], &[0, add]);
    let r = evaluate(&p.0);
    assert_eq!(r[add].check_i64(&[i64::MIN, (1 << 53) + 2]), Ok(CheckStats { checked: 2, uncertain: 0 }));
    assert!(r[add].check_i64(&[i64::MIN, (1 << 53) + 1]).is_err());
    // 2^53 + 1 and 2^53 + 2 are the same f64, but compare as different integers.
    assert_eq!(r[eq].values_f64(), [0.0, 0.0]);
}

#[test]
fn casts_truncate_and_saturate() {
    let mut p = Prog::new();
    let x = p.data(DType::F32, &[6], &[300.0, -5.0, f64::NAN, 2.9, -2.9, 1e10]);
    let to_u8 = p.op(Op::Cast, DType::U8, &[6], &[x]);
    let to_i32 = p.op(Op::Cast, DType::I32, &[6], &[x]);
    let to_bool = p.op(Op::Cast, DType::Bool, &[6], &[x]);
    let i = p.data(DType::I32, &[3], &[300.0, -1.0, 16_777_217.0]);
    let i_u8 = p.op(Op::Cast, DType::U8, &[3], &[i]);
    let i_f32 = p.op(Op::Cast, DType::F32, &[3], &[i]);
    let r = evaluate(&p.0);
    assert_eq!(r[to_u8].values_f64(), [255.0, 0.0, 0.0, 2.0, 0.0, 255.0]);
    assert_eq!(r[to_i32].values_f64(), [300.0, -5.0, 0.0, 2.0, -2.0, i32::MAX as f64]);
    assert_eq!(r[to_bool].values_f64(), [1.0; 6]);
    assert_eq!(r[i_u8].values_f64(), [44.0, 255.0, 1.0]);
    // 2^24 + 1 is not an f32: it rounds, with a bound; the others convert exactly.
    assert_eq!(r[i_f32].values_f64(), [300.0, -1.0, 16_777_216.0]);
    assert_eq!(&r[i_f32].bounds()[..2], [0.0, 0.0]);
    assert!(r[i_f32].bound(2) >= 1.0 && r[i_f32].bound(2) < 10.0);
}

#[test]
fn reductions_along_dims_with_keepdim() {
    let mut p = Prog::new();
    let x = p.data(DType::F64, &[2, 3], &[1.0, 5.0, 3.0, 4.0, 2.0, 6.0]);
    let s0 = p.op(reduce(ReduceOp::Sum, Some(0), true), DType::F64, &[1, 3], &[x]);
    let s1 = p.op(reduce(ReduceOp::Sum, Some(1), false), DType::F64, &[2], &[x]);
    let all = p.op(reduce(ReduceOp::Mean, None, false), DType::F64, &[], &[x]);
    let mx = p.op(reduce(ReduceOp::Max, Some(1), true), DType::F64, &[2, 1], &[x]);
    let mn = p.op(reduce(ReduceOp::Min, Some(0), false), DType::F64, &[3], &[x]);
    let am0 = p.op(reduce(ReduceOp::ArgMax, Some(0), false), DType::I64, &[3], &[x]);
    let am = p.op(reduce(ReduceOp::ArgMax, None, false), DType::I64, &[], &[x]);
    let r = evaluate(&p.0);
    assert_eq!(r[s0].values_f64(), [5.0, 7.0, 9.0]);
    assert_eq!(r[s1].values_f64(), [9.0, 12.0]);
    assert_eq!(r[all].values_f64(), [3.5]);
    assert_eq!(r[mx].values_f64(), [5.0, 6.0]);
    assert_eq!(r[mn].values_f64(), [1.0, 2.0, 3.0]);
    assert_eq!(r[am0].values_f64(), [1.0, 0.0, 1.0]);
    assert_eq!(r[am].values_f64(), [5.0]);
    assert_eq!(r[am].bound(0), 0.0);
    assert_eq!(r[s0].shape, Shape::new(&[1, 3]));
}

#[test]
fn argmax_takes_the_first_maximum_and_the_first_nan() {
    let mut p = Prog::new();
    let ties = p.data(DType::F32, &[4], &[1.0, 3.0, 3.0, 2.0]);
    let nans = p.data(DType::F32, &[4], &[1.0, f64::NAN, 5.0, f64::NAN]);
    let ints = p.data(DType::I32, &[2, 3], &[7.0, 7.0, 1.0, -1.0, 0.0, 0.0]);
    let a = p.op(reduce(ReduceOp::ArgMax, None, false), DType::I64, &[], &[ties]);
    let b = p.op(reduce(ReduceOp::ArgMax, Some(0), true), DType::I64, &[1], &[nans]);
    let c = p.op(reduce(ReduceOp::ArgMax, Some(1), false), DType::I64, &[2], &[ints]);
    let mx = p.op(reduce(ReduceOp::Max, None, false), DType::F32, &[], &[nans]);
    let r = evaluate(&p.0);
    assert_eq!((r[a].values_f64(), r[a].bound(0)), (vec![1.0], 0.0));
    assert_eq!((r[b].values_f64(), r[b].bound(0)), (vec![1.0], 0.0));
    assert_eq!(r[c].values_f64(), [0.0, 1.0]);
    assert!(r[mx].value(0).is_nan() && r[mx].bound(0) == 0.0);
}

#[test]
fn integer_sums_wrap_to_the_dtype() {
    let mut p = Prog::new();
    let x = p.data(DType::U8, &[3], &[200.0, 100.0, 1.0]);
    let s = p.op(reduce(ReduceOp::Sum, None, false), DType::U8, &[], &[x]);
    let e = p.data(DType::F32, &[0, 2], &[]);
    let es = p.op(reduce(ReduceOp::Sum, Some(0), false), DType::F32, &[2], &[e]);
    let em = p.op(reduce(ReduceOp::Mean, Some(0), false), DType::F32, &[2], &[e]);
    let r = evaluate(&p.0);
    assert_eq!(r[s].values_f64(), [45.0]);
    assert_eq!((r[es].values_f64(), r[es].bound(0)), (vec![0.0, 0.0], 0.0));
    assert!(r[em].value(0).is_nan() && r[em].bound(0) == 0.0);
}

#[test]
fn matmul_broadcasts_batch_dimensions() {
    let mut p = Prog::new();
    // a: [2, 1, 2, 3], b: [3, 3, 2] -> [2, 3, 2, 2].
    let av: Vec<f64> = (0..12).map(|i| i as f64).collect();
    let bv: Vec<f64> = (0..18).map(|i| (i as f64) - 9.0).collect();
    let a = p.data(DType::F32, &[2, 1, 2, 3], &av);
    let b = p.data(DType::F32, &[3, 3, 2], &bv);
    let c = p.op(Op::Matmul, DType::F32, &[2, 3, 2, 2], &[a, b]);
    let ai = p.data(DType::I32, &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let bi = p.data(DType::I32, &[2, 1], &[i32::MAX as f64, 1.0]);
    let ci = p.op(Op::Matmul, DType::I32, &[2, 1], &[ai, bi]);
    let r = evaluate(&p.0);
    let naive = |x: usize, y: usize, i: usize, j: usize| -> f64 {
        (0..3).map(|t| av[x * 6 + i * 3 + t] * bv[y * 6 + t * 2 + j]).sum()
    };
    for (n, idx) in (0..24).map(|n| (n, unravel(&Shape::new(&[2, 3, 2, 2]), n))) {
        assert_eq!(r[c].value(n), naive(idx[0], idx[1], idx[2], idx[3]), "at {idx:?}");
    }
    // Wrapping: MAX + 2 and 3 MAX + 4 = 3 * 2^31 + 1 in i32.
    assert_eq!(r[ci].values_f64(), [(i32::MIN + 1) as f64, (i32::MIN + 1) as f64]);
}

#[test]
fn movement_ops_follow_row_major_layout() {
    let mut p = Prog::new();
    let x = p.data(DType::I32, &[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let t = p.op(Op::Permute([1, 0].into_iter().collect()), DType::I32, &[3, 2], &[x]);
    let n = p.op(Op::Narrow { dim: 1, start: 1, len: 2 }, DType::I32, &[2, 2], &[x]);
    let y = p.data(DType::I32, &[2, 1], &[10.0, 11.0]);
    let c = p.op(Op::Cat { dim: 1 }, DType::I32, &[2, 4], &[x, y]);
    let c0 = p.op(Op::Cat { dim: 0 }, DType::I32, &[4, 3], &[x, x]);
    let e = p.op(Op::Expand, DType::I32, &[2, 2, 1], &[y]);
    let rs = p.op(Op::Reshape, DType::I32, &[3, 2], &[x]);
    let z = p.data(DType::I32, &[2, 3, 4], &(0..24).map(f64::from).collect::<Vec<_>>());
    let zp = p.op(Op::Permute([2, 0, 1].into_iter().collect()), DType::I32, &[4, 2, 3], &[z]);
    let r = evaluate(&p.0);
    assert_eq!(r[t].values_f64(), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    assert_eq!(r[n].values_f64(), [1.0, 2.0, 4.0, 5.0]);
    assert_eq!(r[c].values_f64(), [0.0, 1.0, 2.0, 10.0, 3.0, 4.0, 5.0, 11.0]);
    assert_eq!(r[c0].values_f64(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(r[e].values_f64(), [10.0, 11.0, 10.0, 11.0]);
    assert_eq!(r[rs].values_f64(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    // out[i, j, k] = z[j, k, i] = 12 j + 4 k + i.
    for n in 0..24 {
        let [i, j, k] = unravel(&r[zp].shape, n)[..] else { unreachable!() };
        assert_eq!(r[zp].value(n), (12 * j + 4 * k + i) as f64);
    }
}

#[test]
fn bounds_move_with_their_elements() {
    let mut p = Prog::new();
    let x = p.data(DType::F32, &[2, 2], &[1.0, 10.0, 100.0, 1000.0]);
    let e = p.op(Op::Unary(UnaryOp::Sqrt), DType::F32, &[2, 2], &[x]);
    let t = p.op(Op::Permute([1, 0].into_iter().collect()), DType::F32, &[2, 2], &[e]);
    let r = evaluate(&p.0);
    let b = r[e].bounds();
    assert!(b[0] < b[1] && b[1] < b[2] && b[2] < b[3]);
    assert_eq!(r[t].bounds(), [b[0], b[2], b[1], b[3]]);
    assert_eq!(r[t].values_f64(), [r[e].value(0), r[e].value(2), r[e].value(1), r[e].value(3)]);
}

#[test]
fn rand_is_reproducible_and_in_range() {
    let mut p = Prog::new();
    let rand = |seed| Op::Rand { lo: Scalar(-2.0), hi: Scalar(3.0), seed };
    let a = p.op(rand(7), DType::F32, &[1000], &[]);
    let b = p.op(rand(7), DType::F32, &[1000], &[]);
    let c = p.op(rand(8), DType::F32, &[1000], &[]);
    let n = p.op(Op::Randn { seed: 7 }, DType::F64, &[1000], &[]);
    let r = evaluate(&p.0);
    assert_eq!(r[a].values_f64(), r[b].values_f64());
    assert_ne!(r[a].values_f64(), r[c].values_f64());
    assert!(r[a].values_f64().iter().all(|v| (-2.0..=3.0).contains(v)));
    assert_eq!(r[a].value(3), (-2.0 + 5.0 * rng::uniform(7, 3, DType::F32)) as f32 as f64);
    let mean = r[a].values_f64().iter().sum::<f64>() / 1000.0;
    assert!((mean - 0.5).abs() < 0.2, "mean {mean}");
    assert_eq!(r[n].value(5), rng::normal_f64(7, 5, DType::F64));
    // Devices computing the formulas in f32 pass (and in f32 rounded to f16).
    let count = 20_000;
    let normal: Vec<f64> = (0..count).map(|i| rng::normal_f32(7, i) as f64).collect();
    let (lo, hi) = (0.1f32, 0.7f32);
    let uniform: Vec<f64> =
        (0..count).map(|i| (lo + (hi - lo) * rng::uniform(9, i, DType::F32) as f32) as f64).collect();
    for d in [DType::F32, DType::F16, DType::BF16] {
        let mut p = Prog::new();
        let n = p.op(Op::Randn { seed: 7 }, d, &[count as usize], &[]);
        let u = p.op(Op::Rand { lo: Scalar(0.1), hi: Scalar(0.7), seed: 9 }, d, &[count as usize], &[]);
        let r = evaluate(&p.0);
        let on = |v: &[f64]| v.iter().map(|&x| d.round_f64(x)).collect::<Vec<_>>();
        assert_eq!(r[n].check(&on(&normal)).map(|s| s.checked), Ok(count as usize), "{d}");
        assert_eq!(r[u].check(&on(&uniform)).map(|s| s.checked), Ok(count as usize), "{d}");
    }
}

#[test]
fn lt_of_nearly_equal_inexact_values_is_uncertain() {
    let mut p = Prog::new();
    let a = p.data(DType::F32, &[3], &[0.1, 0.1, 0.1]);
    let a3 =
        p.op(Op::BinaryScalar { op: BinaryOp::Mul, scalar: Scalar(3.0), scalar_first: false }, DType::F32, &[3], &[a]);
    let b = p.data(DType::F32, &[3], &[0.3, 5.0, -1.0]);
    let lt = p.op(Op::Compare(CompareOp::Lt), DType::Bool, &[3], &[a3, b]);
    let exact = p.op(Op::Compare(CompareOp::Lt), DType::Bool, &[3], &[a, b]);
    let r = evaluate(&p.0);
    assert!(r[lt].is_uncertain(0), "0.1 * 3 against 0.3 within the error");
    assert_eq!((r[lt].value(1), r[lt].bound(1)), (1.0, 0.0));
    assert_eq!((r[lt].value(2), r[lt].bound(2)), (0.0, 0.0));
    assert_eq!(r[exact].bounds(), [0.0; 3]);
    assert_eq!(r[lt].check(&[0.0, 1.0, 0.0]), Ok(CheckStats { checked: 2, uncertain: 1 }));
}

#[test]
fn an_inexact_value_compared_with_itself_is_certain_unless_unbounded() {
    let mut p = Prog::new();
    let a = p.data(DType::F32, &[3], &[0.1, 3.0, 2.0]);
    let scale = Op::BinaryScalar { op: BinaryOp::Mul, scalar: Scalar(3.0), scalar_first: false };
    let x = p.op(scale, DType::F32, &[3], &[a]);
    let b = p.data(DType::F32, &[3], &[0.3, 1.0, 1.0]);
    let d = p.op(Op::Binary(BinaryOp::Sub), DType::F32, &[3], &[x, b]);
    // log of 0.1 * 3 - 0.3, an interval around 0: unbounded.
    let y = p.op(Op::Unary(UnaryOp::Log), DType::F32, &[3], &[d]);
    let ge = p.op(Op::Compare(CompareOp::Ge), DType::Bool, &[3], &[x, x]);
    let ne = p.op(Op::Compare(CompareOp::Ne), DType::Bool, &[3], &[y, y]);
    let other = p.op(Op::Compare(CompareOp::Ge), DType::Bool, &[3], &[x, b]);
    let r = evaluate(&p.0);
    assert!(r[x].bound(0) > 0.0 && r[y].bound(1) > 0.0, "inexact values");
    assert!(r[y].is_uncertain(0) && !r[y].is_uncertain(1));
    assert_eq!(r[ge].check(&[1.0, 1.0, 1.0]), Ok(CheckStats { checked: 3, uncertain: 0 }));
    assert!(r[ge].check(&[0.0, 1.0, 1.0]).is_err(), "x >= x is true for a bounded x");
    assert_eq!(r[ne].check(&[1.0, 0.0, 0.0]), Ok(CheckStats { checked: 2, uncertain: 1 }));
    assert!(r[ne].check(&[0.0, 1.0, 0.0]).is_err(), "y != y is false for a bounded y");
    // Two different nodes are still compared through their intervals.
    assert!(r[other].is_uncertain(0) && !r[other].is_uncertain(1));
}

#[test]
fn check_accepts_within_the_bound_and_explains_mismatches() {
    let mut p = Prog::new();
    let x = p.data(DType::F32, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let y = p.op(Op::Unary(UnaryOp::Exp), DType::F32, &[2, 3], &[x]);
    let r = p.eval(y);
    let mut dev: Vec<f64> = (0..6).map(|i| r.value(i) + 0.9 * r.bound(i)).collect();
    assert_eq!(r.check(&dev), Ok(CheckStats { checked: 6, uncertain: 0 }));
    dev[4] = r.value(4) + 2.0 * r.bound(4) + 1e-3;
    dev[5] = f64::NAN;
    let msg = r.check(&dev).unwrap_err();
    for part in ["f32", "[2, 3]", "2 of 6", "element 4 at [1, 1]", "element 5 at [1, 2]", "NaN"] {
        assert!(msg.contains(part), "{part:?} missing from {msg}");
    }
    assert!(msg.contains(&format!("{:e}", r.value(4))), "{msg}");
    assert!(r.check(&dev[..5]).unwrap_err().contains("expected 6 elements, got 5"));
    // NaN and infinities must match exactly.
    let mut p = Prog::new();
    let x = p.data(DType::F32, &[3], &[-1.0, 0.0, -0.0]);
    let s = p.op(Op::Unary(UnaryOp::Sqrt), DType::F32, &[3], &[x]);
    let q = p.op(Op::Unary(UnaryOp::Recip), DType::F32, &[3], &[x]);
    let r = evaluate(&p.0);
    assert!(r[s].check(&[f64::NAN, 0.0, 0.0]).is_ok());
    assert!(r[s].check(&[0.0, 0.0, 0.0]).is_err());
    assert!(r[q].check(&[-1.0, f64::INFINITY, f64::NEG_INFINITY]).is_ok());
    assert!(r[q].check(&[-1.0, f64::INFINITY, f64::INFINITY]).is_err());
}

#[test]
fn f16_values_are_stored_rounded() {
    let mut p = Prog::new();
    let x = p.data(DType::F16, &[2], &[1.0, 0.1]);
    let y =
        p.op(Op::BinaryScalar { op: BinaryOp::Add, scalar: Scalar(1e-4), scalar_first: false }, DType::F16, &[2], &[x]);
    let big =
        p.op(Op::BinaryScalar { op: BinaryOp::Mul, scalar: Scalar(1e5), scalar_first: false }, DType::F16, &[2], &[x]);
    let r = evaluate(&p.0);
    assert_eq!(r[x].value(1), half::f16::from_f64(0.1).to_f64());
    // 1 + 1e-4 is 1 in f16 (its ulp at 1 is 2^-10); the bound allows about one f16 ulp.
    assert_eq!(r[y].value(0), 1.0);
    assert!(r[y].bound(0) > 2f64.powi(-11) && r[y].bound(0) < 2f64.powi(-9), "{}", r[y].bound(0));
    assert!(r[y].check(&[1.0 + 2f64.powi(-10), r[y].value(1)]).is_ok());
    // 1e5 overflows f16 (max 65504) for every device: a certain infinity; 1e4 does not.
    assert_eq!((r[big].value(0), r[big].bound(0)), (f64::INFINITY, 0.0));
    assert!(r[big].value(1).is_finite());
}

#[test]
fn gather_and_index_select_read_the_named_elements_and_zero_outside() {
    let mut p = Prog::new();
    // x = [[0, 1, 2], [3, 4, 5]]
    let x = p.data(DType::F32, &[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let i = p.0.len();
    p.0.push(ProgNode::IntData { dtype: DType::I64, shape: Shape::new(&[2, 2]), values: vec![2, -1, 0, 3] });
    let g = p.op(Op::Gather { dim: 1 }, DType::F32, &[2, 2], &[x, i]);
    // Along dimension 1 at a [2, 2] index: out[r, a, b] = x[r, i[a, b]].
    let s = p.op(Op::IndexSelect { dim: 1 }, DType::F32, &[2, 2, 2], &[x, i]);
    // Along dimension 0: rows of x, the index's shape first.
    let rows = p.op(Op::IndexSelect { dim: 0 }, DType::F32, &[2, 2, 3], &[x, i]);
    let r = evaluate(&p.0);
    assert_eq!(r[g].values_f64(), [2.0, 0.0, 3.0, 0.0]);
    assert_eq!(r[s].values_f64(), [2.0, 0.0, 0.0, 0.0, 5.0, 0.0, 3.0, 0.0]);
    assert_eq!(r[rows].values_f64(), [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0]);
}

#[test]
fn a_nan_arithmetic_gives_is_uncertain_where_the_platform_may_fold_it() {
    // sqrt(-1) - sqrt(-1) and argmax over it: a certain NaN and its position with the op
    // table's math; uncertain on WGSL, whose compilers fold `x - x` to 0 (lavapipe does).
    let mut p = Prog::new();
    let x = p.data(DType::F32, &[2, 1], &[4.0, -1.0]);
    let root = p.op(
        Op::BinaryScalar { op: BinaryOp::Pow, scalar: Scalar(0.5), scalar_first: false },
        DType::F32,
        &[2, 1],
        &[x],
    );
    let zero = p.op(Op::Binary(BinaryOp::Sub), DType::F32, &[2, 1], &[root, root]);
    let at = p.op(reduce(ReduceOp::ArgMax, Some(0), false), DType::I64, &[1], &[zero]);
    let table = evaluate(&p.0);
    assert!(table[zero].values_f64()[1].is_nan() && table[zero].bounds()[1] == 0.0);
    assert_eq!((table[at].values_f64(), table[at].bounds()), (vec![1.0], &[0.0][..]));
    let wgsl = evaluate_on(&p.0, &crate::PlatformMath::wgsl(false));
    assert!(wgsl[zero].bounds()[0].is_finite(), "a number stays certain");
    assert!(wgsl[root].values_f64()[1].is_nan() && wgsl[root].bounds()[1] == 0.0, "sqrt(-1) is made, not carried");
    assert!(wgsl[zero].bounds()[1].is_infinite() && wgsl[at].bounds()[0].is_infinite());
}
