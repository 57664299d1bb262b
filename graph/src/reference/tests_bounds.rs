//! Bounds: simulated devices that round as the stated tolerance allows must pass the checks,
//! and the cases the reference cannot decide must be uncertain.

use super::bounds::{propagate_binary, propagate_unary};
use super::tests::Prog;
use super::*;
use crate::op::{ReduceOp, Scalar};
use crate::rng;
use crate::table::{BinaryOp, CompareOp, DTypeRule, UnaryOp};

/// Deterministic uniforms in [0, 1).
struct Noise(u64, u64);

impl Noise {
    fn next(&mut self) -> f64 {
        self.1 += 1;
        rng::uniform(self.0, self.1, DType::F64)
    }
    /// Uniform in [-1, 1).
    fn sym(&mut self) -> f64 {
        2.0 * self.next() - 1.0
    }
}

/// A simulated device: `z = f(inputs)` computed with the largest error the row's `ulps` allows
/// (`|y - z| <= ulps ε(c) scale`, in a random direction, `y` a value of the compute dtype `c`),
/// then rounded to storage.
fn device(s: DType, ulps: f64, noise: &mut Noise, inputs: &[f64], z: f64) -> f64 {
    let c = s.compute();
    let scale = inputs.iter().filter(|x| x.is_finite()).fold(z.abs(), |m, x| m.max(x.abs()));
    let budget = ulps * c.epsilon() * scale;
    let sign = if noise.next() < 0.5 { -1.0 } else { 1.0 };
    let mut y = c.round_f64(z + sign * budget);
    if !z.is_finite() || (y - z).abs() > budget {
        y = c.round_f64(z); // the far end is out of budget: correctly rounded
    }
    s.round_f64(y)
}

fn scalar_mul(k: f64) -> Op {
    Op::BinaryScalar { op: BinaryOp::Mul, scalar: Scalar(k), scalar_first: false }
}

#[test]
fn every_table_row_has_a_sensitivity_for_its_arity() {
    for &op in UnaryOp::ALL {
        let d = op.def();
        let p = propagate_unary(d.sensitivity, &d.reference, 0.5, 1e-3, (d.reference)(0.5));
        assert!(p.is_some_and(|p| p > 0.0 && p < 1.0), "{}: {p:?}", d.name);
    }
    for &op in BinaryOp::ALL {
        let d = op.def();
        let p = propagate_binary(d.sensitivity, &d.reference, (2.0, 1e-3), (3.0, 1e-3), (d.reference)(2.0, 3.0));
        assert!(p.is_some_and(|p| p > 0.0 && p < 1.0), "{}: {p:?}", d.name);
    }
}

/// `unary2(binary(unary1(x), y))` for every combination of float table ops, on a simulated
/// device per float dtype: every certain element must pass, and most must be certain.
#[test]
fn simulated_devices_pass_chains_of_every_table_op() {
    let mut noise = Noise(11, 0);
    let n = 48;
    for s in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let xs: Vec<f64> = (0..n).map(|_| s.round_f64(3.0 * noise.sym())).collect();
        let ys: Vec<f64> = (0..n).map(|_| s.round_f64(3.0 * noise.sym())).collect();
        let (mut checked, mut total) = (0, 0);
        for &u1 in UnaryOp::ALL {
            for &b in BinaryOp::ALL {
                for u2 in [UnaryOp::Exp, UnaryOp::Sqrt, UnaryOp::Tanh, UnaryOp::Square, UnaryOp::Recip] {
                    let mut p = Prog::new();
                    let x = p.data(s, &[n], &xs);
                    let y = p.data(s, &[n], &ys);
                    let a = p.op(Op::Unary(u1), s, &[n], &[x]);
                    let ab = p.op(Op::Binary(b), s, &[n], &[a, y]);
                    let out = p.op(Op::Unary(u2), s, &[n], &[ab]);
                    let r = evaluate(&p.0);
                    let (d1, db, d2) = (u1.def(), b.def(), u2.def());
                    let mut dev = vec![vec![]; 3];
                    for i in 0..n {
                        let va = device(s, d1.ulps, &mut noise, &[xs[i]], (d1.reference)(xs[i]));
                        let vab = device(s, db.ulps, &mut noise, &[va, ys[i]], (db.reference)(va, ys[i]));
                        let vo = device(s, d2.ulps, &mut noise, &[vab], (d2.reference)(vab));
                        dev[0].push(va);
                        dev[1].push(vab);
                        dev[2].push(vo);
                    }
                    for (node, d) in [a, ab, out].into_iter().zip(&dev) {
                        let what = format!("{s}: {} / {} / {}", u1.name(), b.name(), u2.name());
                        let stats = r[node].check(d).unwrap_or_else(|e| panic!("{what}: {e}"));
                        checked += stats.checked;
                        total += stats.checked + stats.uncertain;
                    }
                }
            }
        }
        assert!(checked as f64 > 0.7 * total as f64, "{s}: only {checked} of {total} certain");
    }
}

#[test]
fn sums_in_any_order_pass() {
    let mut noise = Noise(5, 0);
    for s in [DType::F32, DType::F16, DType::BF16] {
        let xs: Vec<f64> = (0..2000).map(|_| s.round_f64(10f64.powf(4.0 * noise.sym()) * noise.sym())).collect();
        let mut p = Prog::new();
        let x = p.data(s, &[2000], &xs);
        let sum = p.op(Op::Reduce { op: ReduceOp::Sum, dim: None, keepdim: false }, s, &[], &[x]);
        let mean = p.op(Op::Reduce { op: ReduceOp::Mean, dim: None, keepdim: false }, s, &[], &[x]);
        let r = evaluate(&p.0);
        let f32_sum = |it: &mut dyn Iterator<Item = &f64>| it.fold(0f32, |acc, &v| acc + v as f32);
        let forward = f32_sum(&mut xs.iter());
        let backward = f32_sum(&mut xs.iter().rev());
        let pairwise = xs.chunks(2).map(|c| c.iter().map(|&v| v as f32).sum::<f32>()).sum::<f32>();
        for d in [forward, backward, pairwise] {
            assert!(r[sum].check(&[s.round_f64(d as f64)]).is_ok(), "{s}: {d} vs {:?}", r[sum]);
            let m = s.round_f64((d / 2000.0) as f64);
            assert!(r[mean].check(&[m]).is_ok(), "{s}: {m} vs {:?}", r[mean]);
        }
        assert!(r[sum].bound(0) < 1e-2 * xs.iter().map(|v| v.abs()).sum::<f64>());
    }
}

#[test]
fn f32_matmul_passes_and_is_tight() {
    let mut noise = Noise(9, 0);
    let (m, k, n) = (5, 300, 4);
    let av: Vec<f64> = (0..m * k).map(|_| noise.sym() as f32 as f64).collect();
    let bv: Vec<f64> = (0..k * n).map(|_| noise.sym() as f32 as f64).collect();
    let mut p = Prog::new();
    let a = p.data(DType::F32, &[m, k], &av);
    let b = p.data(DType::F32, &[k, n], &bv);
    let c = p.op(Op::Matmul, DType::F32, &[m, n], &[a, b]);
    let r = p.eval(c);
    let dev: Vec<f64> = (0..m * n)
        .map(|o| (0..k).fold(0f32, |acc, t| acc + av[(o / n) * k + t] as f32 * bv[t * n + o % n] as f32) as f64)
        .collect();
    assert_eq!(r.check(&dev), Ok(CheckStats { checked: m * n, uncertain: 0 }));
    // An error of 1% of a typical entry is caught (the bound is γ_k Σ|a b|, about 1e-3 here).
    let wrong: Vec<f64> = (0..m * n).map(|o| dev[o] + 1e-2 * (o % 2) as f64).collect();
    assert!(r.check(&wrong).is_err());
}

#[test]
fn undecidable_results_are_uncertain() {
    let mut p = Prog::new();
    let one = p.data(DType::F32, &[1], &[1.0]);
    let near1 = p.op(scalar_mul(1.0), DType::F32, &[1], &[one]); // 1 with a bound
    let zero = p.op(Op::Binary(BinaryOp::Sub), DType::F32, &[1], &[near1, one]); // 0 ± ε
    let log = p.op(Op::Unary(UnaryOp::Log), DType::F32, &[1], &[zero]);
    let recip = p.op(Op::Unary(UnaryOp::Recip), DType::F32, &[1], &[zero]);
    let sqrt = p.op(Op::Unary(UnaryOp::Sqrt), DType::F32, &[1], &[zero]);
    let div = p.op(Op::Binary(BinaryOp::Div), DType::F32, &[1], &[one, zero]);
    let neg = p.op(Op::Unary(UnaryOp::Neg), DType::F32, &[1], &[near1]);
    let pow = p.op(Op::Binary(BinaryOp::Pow), DType::F32, &[1], &[neg, near1]);
    let to_bool = p.op(Op::Cast, DType::Bool, &[1], &[zero]);
    let two = p.op(scalar_mul(2.0), DType::F32, &[1], &[near1]);
    let to_int = p.op(Op::Cast, DType::I32, &[1], &[two]);
    let r = evaluate(&p.0);
    assert!(r[zero].bound(0) > 0.0 && r[zero].bound(0) < 1e-6);
    for (node, name) in [(log, "log"), (recip, "recip"), (sqrt, "sqrt"), (div, "div"), (pow, "pow")] {
        assert!(r[node].is_uncertain(0), "{name} of an interval around its pole: {:?}", r[node]);
    }
    assert!(r[to_bool].is_uncertain(0) && r[to_int].is_uncertain(0));
    // Away from the edges the same ops are certain.
    let mut p = Prog::new();
    let x = p.data(DType::F32, &[2], &[2.5, -2.0]);
    let y = p.op(scalar_mul(1.0), DType::F32, &[2], &[x]);
    let to_int = p.op(Op::Cast, DType::I32, &[2], &[y]);
    let pow = p.op(Op::Binary(BinaryOp::Pow), DType::F32, &[2], &[x, x]);
    let r = evaluate(&p.0);
    assert_eq!((r[to_int].values_f64(), r[to_int].bounds()), (vec![2.0, -2.0], &[0.0, f64::INFINITY][..]));
    // Exact operands: (-2)^-2 is certain even with a negative base.
    assert_eq!(r[pow].value(1), 0.25);
    assert!(r[pow].bound(0).is_finite() && r[pow].bound(1).is_finite());
}

#[test]
fn overflow_is_certain_only_when_every_device_overflows() {
    let mut p = Prog::new();
    let x = p.data(DType::F32, &[3], &[88.0, 88.72283, 89.0]);
    let y = p.op(scalar_mul(1.0), DType::F32, &[3], &[x]);
    let e = p.op(Op::Unary(UnaryOp::Exp), DType::F32, &[3], &[y]);
    let inf_plus = p.op(Op::Binary(BinaryOp::Add), DType::F32, &[3], &[e, y]);
    let big = p.data(DType::F32, &[3], &[3e38, 3e38, -3e38]);
    let sum = p.op(Op::Reduce { op: ReduceOp::Sum, dim: None, keepdim: false }, DType::F32, &[], &[big]);
    let r = evaluate(&p.0);
    assert!(r[e].value(0).is_finite() && r[e].bound(0).is_finite());
    assert!(r[e].is_uncertain(1), "exp near the f32 maximum: {:?}", r[e]);
    assert_eq!((r[e].value(2), r[e].bound(2)), (f64::INFINITY, 0.0));
    assert_eq!((r[inf_plus].value(2), r[inf_plus].bound(2)), (f64::INFINITY, 0.0));
    assert!(r[sum].is_uncertain(0), "the order decides whether 3e38 + 3e38 overflows");
}

#[test]
fn comparisons_selects_and_argmax_near_ties() {
    let mut p = Prog::new();
    let x = p.data(DType::F32, &[2, 2], &[1.0, 1.0 + f32::EPSILON as f64, 1.0, 2.0]);
    let y = p.op(scalar_mul(1.0), DType::F32, &[2, 2], &[x]);
    let am = p.op(Op::Reduce { op: ReduceOp::ArgMax, dim: Some(1), keepdim: false }, DType::I64, &[2], &[y]);
    let z = p.data(DType::F32, &[2, 1], &[1.0, 0.0]);
    let gt = p.op(Op::Compare(CompareOp::Gt), DType::Bool, &[2, 2], &[y, z]);
    let lt = p.op(Op::Compare(CompareOp::Lt), DType::Bool, &[2, 2], &[y, z]);
    let sel = p.op(Op::Select, DType::F32, &[2, 2], &[gt, y, z]);
    let tiny = p.data(DType::F32, &[1], &[1e-40]);
    let zero = p.data(DType::F32, &[1], &[0.0]);
    let eq = p.op(Op::Compare(CompareOp::Eq), DType::Bool, &[1], &[tiny, zero]);
    let r = evaluate(&p.0);
    assert_eq!(r[am].value(1), 1.0);
    assert!(r[am].is_uncertain(0) && !r[am].is_uncertain(1));
    // y[0, 0] == 1 against 1: uncertain either way; y[1, 1] = 2 > 0 certainly.
    assert!(r[gt].is_uncertain(0) && r[lt].is_uncertain(0));
    assert_eq!((r[gt].value(3), r[gt].bound(3)), (1.0, 0.0));
    // select with an uncertain condition: both branches are about 1, so the bound stays small.
    assert!(r[sel].bound(0) < 1e-6, "{:?}", r[sel]);
    assert_eq!(r[sel].bound(3), r[y].bound(3));
    // A subnormal may be read as zero (flush-to-zero devices).
    assert!(r[eq].is_uncertain(0));
}

#[test]
fn nonfinite_results_are_certain_when_every_device_agrees() {
    let mut p = Prog::new();
    let inf = p.data(DType::F32, &[3], &[f64::INFINITY, f64::INFINITY, f64::NAN]);
    let x = p.data(DType::F32, &[3], &[2.0, 0.0, 1.0]);
    let y = p.op(scalar_mul(1.0), DType::F32, &[3], &[x]);
    let prod = p.op(Op::Binary(BinaryOp::Mul), DType::F32, &[3], &[inf, y]);
    let mm_a = p.data(DType::F32, &[1, 2], &[f64::INFINITY, 1.0]);
    let mm_b = p.data(DType::F32, &[2, 3], &[1.0, 0.0, -1.0, 2.0, 2.0, 2.0]);
    let mm = p.op(Op::Matmul, DType::F32, &[1, 3], &[mm_a, mm_b]);
    let r = evaluate(&p.0);
    // inf * (2 ± e) = inf; inf * (0 ± e) could be ±inf or NaN; NaN * anything = NaN.
    assert_eq!((r[prod].value(0), r[prod].bound(0)), (f64::INFINITY, 0.0));
    assert!(r[prod].is_uncertain(1));
    assert!(r[prod].value(2).is_nan() && r[prod].bound(2) == 0.0);
    // [inf, 1] x [[1, 0, -1], [2, 2, 2]] = [inf, NaN, -inf], all certain (exact inputs).
    let v = r[mm].values_f64();
    assert!(v[0] == f64::INFINITY && v[1].is_nan() && v[2] == f64::NEG_INFINITY);
    assert_eq!(r[mm].bounds(), [0.0; 3]);
}

#[test]
fn only_float_rows_lack_integer_forms() {
    for &op in UnaryOp::ALL {
        let d = op.def();
        assert_eq!(d.reference_int.is_some(), d.dtypes == DTypeRule::Numeric, "{}", d.name);
    }
    for &op in BinaryOp::ALL {
        let d = op.def();
        assert_eq!(d.reference_int.is_some(), d.dtypes == DTypeRule::Numeric, "{}", d.name);
    }
}

/// exp -> clamp -> cast to f16 -> (sum, max, cast to i32, matmul with its transpose), on a
/// simulated device that sums in f32 in its own order.
#[test]
fn simulated_devices_pass_clamps_casts_reductions_and_matmuls() {
    let mut noise = Noise(21, 0);
    let (rows, cols) = (4, 16);
    let xs: Vec<f64> = (0..rows * cols).map(|_| (2.0 * noise.sym()) as f32 as f64).collect();
    let mut p = Prog::new();
    let x = p.data(DType::F32, &[rows, cols], &xs);
    let e = p.op(Op::Unary(UnaryOp::Exp), DType::F32, &[rows, cols], &[x]);
    let cl = p.op(Op::Clamp { lo: Scalar(0.5), hi: Scalar(3.0) }, DType::F32, &[rows, cols], &[e]);
    let h = p.op(Op::Cast, DType::F16, &[rows, cols], &[cl]);
    let sum = p.op(Op::Reduce { op: ReduceOp::Sum, dim: Some(1), keepdim: true }, DType::F16, &[rows, 1], &[h]);
    let max = p.op(Op::Reduce { op: ReduceOp::Max, dim: Some(1), keepdim: false }, DType::F16, &[rows], &[h]);
    let int = p.op(Op::Cast, DType::I32, &[rows, cols], &[h]);
    let ht = p.op(Op::Permute([1, 0].into_iter().collect()), DType::F16, &[cols, rows], &[h]);
    let mm = p.op(Op::Matmul, DType::F16, &[rows, rows], &[h, ht]);
    let r = evaluate(&p.0);

    let f16 = |v: f64| DType::F16.round_f64(v);
    let dev_e: Vec<f64> = xs.iter().map(|&v| device(DType::F32, 4.0, &mut noise, &[v], v.exp())).collect();
    let dev_h: Vec<f64> = dev_e.iter().map(|&v| f16(v.clamp(0.5, 3.0))).collect();
    let row = |i: usize| &dev_h[i * cols..(i + 1) * cols];
    let dev_sum: Vec<f64> =
        (0..rows).map(|i| f16(row(i).iter().rev().fold(0f32, |a, &v| a + v as f32) as f64)).collect();
    let dev_max: Vec<f64> = (0..rows).map(|i| row(i).iter().copied().fold(f64::MIN, f64::max)).collect();
    let dev_int: Vec<f64> = dev_h.iter().map(|v| v.trunc()).collect();
    let dot = |i: usize, j: usize| row(i).iter().zip(row(j)).fold(0f32, |a, (&u, &v)| a + u as f32 * v as f32);
    let dev_mm: Vec<f64> = (0..rows * rows).map(|o| f16(dot(o / rows, o % rows) as f64)).collect();
    for (node, dev) in [(e, &dev_e), (h, &dev_h), (sum, &dev_sum), (max, &dev_max), (int, &dev_int), (mm, &dev_mm)] {
        let stats = r[node].check(dev).unwrap_or_else(|m| panic!("node {node}: {m}"));
        assert!(stats.checked > 0, "node {node}");
    }
    // The f16 sums are bounded to within a few f16 ulps of values around 20.
    assert!(r[sum].bounds().iter().all(|&b| b < 0.1), "{:?}", r[sum].bounds());
}
