//! Sources and elementwise ops: each output element from the input elements at the same
//! (broadcast) position, with the formulas of the op table.

use super::RefValue;
use super::bounds::{UNCERTAIN, finish, magnitude, propagate_binary, propagate_unary, read_err, same_nonfinite};
use super::movement::broadcast_map;
use crate::dtype::DType;
use crate::rng;
use crate::shape::Shape;
use crate::table::{BinaryOp, CompareOp, Sensitivity, UnaryOp};

/// `ulps` of `rand`'s `lo + (hi - lo) u` in the compute dtype (the constants' rounding, the
/// subtraction, the product, the sum), in units of `ε max(|lo|, |hi|)`.
const RAND_ULPS: f64 = 5.0;
/// `ulps` of `randn`'s Box-Muller formula in f32, in units of `ε max(|v|, 6)`: the argument
/// `2π u2` alone is off by up to `2ε 2π`, which the radius (up to 5.8) multiplies.
const RANDN_ULPS: f64 = 64.0;

/// The bound of an integer result: exact unless an input is uncertain.
fn int_bound(inputs: &[f64]) -> f64 {
    if inputs.iter().any(|e| e.is_infinite()) { UNCERTAIN } else { 0.0 }
}

/// A float `f(x)` stored as dtype `s`, with its bound (see [`super::bounds::finish`]).
pub(super) fn float_unary(
    s: DType,
    f: &dyn Fn(f64) -> f64,
    sens: Sensitivity,
    ulps: f64,
    (x, e): (f64, f64),
) -> (f64, f64) {
    let e = read_err(x, e, s.compute());
    let z = f(x);
    let p = propagate_unary(sens, f, x, e, z);
    finish(s, z, p, ulps, magnitude(x, e))
}

/// A float `f(a, b)` stored as dtype `s`, with its bound.
pub(super) fn float_binary(
    s: DType,
    f: &dyn Fn(f64, f64) -> f64,
    sens: Sensitivity,
    ulps: f64,
    (a, ea): (f64, f64),
    (b, eb): (f64, f64),
) -> (f64, f64) {
    let c = s.compute();
    let (ea, eb) = (read_err(a, ea, c), read_err(b, eb, c));
    let z = f(a, b);
    let p = propagate_binary(sens, f, (a, ea), (b, eb), z);
    finish(s, z, p, ulps, magnitude(a, ea).max(magnitude(b, eb)))
}

/// Applies `elem` to every element index, building a float tensor.
fn floats(dtype: DType, shape: &Shape, elem: impl Fn(usize) -> (f64, f64)) -> RefValue {
    let (values, bounds) = (0..shape.numel()).map(elem).unzip();
    RefValue::from_floats(dtype, shape.clone(), values, bounds)
}

/// Applies `elem` to every element index, building an integer (or bool) tensor.
fn ints(dtype: DType, shape: &Shape, elem: impl Fn(usize) -> (i64, f64)) -> RefValue {
    let (values, bounds) = (0..shape.numel()).map(elem).unzip();
    RefValue::from_ints(dtype, shape.clone(), values, bounds)
}

pub(super) fn full(dtype: DType, shape: &Shape, v: f64) -> RefValue {
    if dtype.is_float() {
        floats(dtype, shape, |_| (dtype.round_f64(v), 0.0))
    } else {
        ints(dtype, shape, |_| (dtype.int_from_f64(v), 0.0))
    }
}

/// `start + i` (I64); another dtype gets the I64 values cast to it.
pub(super) fn arange(dtype: DType, shape: &Shape, start: i64) -> RefValue {
    let v = ints(DType::I64, shape, |i| (start.wrapping_add(i as i64), 0.0));
    if dtype == DType::I64 { v } else { cast(dtype, &v) }
}

pub(super) fn rand(dtype: DType, shape: &Shape, lo: f64, hi: f64, seed: u64) -> RefValue {
    assert!(dtype.is_float(), "rand needs a float dtype, got {dtype}");
    let scale = lo.abs().max(hi.abs());
    floats(dtype, shape, |i| {
        let u = rng::uniform(seed, i as u64, dtype.compute());
        finish(dtype, lo + (hi - lo) * u, Some(0.0), RAND_ULPS, scale)
    })
}

pub(super) fn randn(dtype: DType, shape: &Shape, seed: u64) -> RefValue {
    assert!(dtype.is_float(), "randn needs a float dtype, got {dtype}");
    floats(dtype, shape, |i| {
        let v = rng::normal_f64(seed, i as u64, dtype.compute());
        finish(dtype, v, Some(0.0), RANDN_ULPS, v.abs().max(6.0))
    })
}

pub(super) fn unary(op: UnaryOp, dtype: DType, shape: &Shape, x: &RefValue) -> RefValue {
    let def = op.def();
    if dtype.is_float() {
        let ulps = super::allowance(def.name, def.ulps);
        let abs = super::absolute_allowance(def.name);
        // WGSL's `exp` is bounded to 3 + 2|x| ulps (its argument is scaled by log2(e) in f32
        // first): the |x| part on top of the platform allowance, on any WGSL platform.
        let exp_scaled = def.name == "exp" && super::platform_scales_exp();
        let eps = dtype.compute().epsilon();
        floats(dtype, shape, |i| {
            let (xv, xe) = x.float_at(i);
            let (v, bound) = float_unary(dtype, &def.reference, def.sensitivity, ulps, (xv, xe));
            let scaled = if exp_scaled { 2.0 * (xv.abs() + xe) * eps * v.abs() } else { 0.0 };
            // An infinite (uncertain) part times a zero is NaN: still uncertain.
            let bound = bound + abs + scaled;
            super::arithmetic((v, if bound.is_nan() { f64::INFINITY } else { bound }), xv.is_nan())
        })
    } else {
        let f = def.reference_int.unwrap_or_else(|| panic!("{} has no integer form ({dtype})", def.name));
        ints(dtype, shape, |i| {
            let (v, e) = x.int_at(i);
            (dtype.wrap_int(f(v)), int_bound(&[e]))
        })
    }
}

pub(super) fn binary(op: BinaryOp, dtype: DType, shape: &Shape, a: &RefValue, b: &RefValue) -> RefValue {
    let def = op.def();
    let (ia, ib) = (broadcast_map(&a.shape, shape), broadcast_map(&b.shape, shape));
    if dtype.is_float() {
        let ulps = super::allowance(def.name, def.ulps);
        let pow_scaled = def.name == "pow" && super::platform_scales_exp();
        floats(dtype, shape, |i| {
            let (x, y) = (a.float_at(ia[i]), b.float_at(ib[i]));
            let r = float_binary(dtype, &def.reference, def.sensitivity, ulps, x, y);
            let from_nan = x.0.is_nan() || y.0.is_nan();
            super::arithmetic(if pow_scaled { gpu_pow_bound(dtype, r, x, y) } else { r }, from_nan)
        })
    } else {
        let f = def.reference_int.unwrap_or_else(|| panic!("{} has no integer form ({dtype})", def.name));
        ints(dtype, shape, |i| {
            let ((va, ea), (vb, eb)) = (a.int_at(ia[i]), b.int_at(ib[i]));
            (dtype.wrap_int(f(va, vb)), int_bound(&[ea, eb]))
        })
    }
}

/// `x op s`, or `s op x` when `scalar_first`; the scalar is first rounded to the compute dtype.
pub(super) fn binary_scalar(op: BinaryOp, dtype: DType, x: &RefValue, s: f64, scalar_first: bool) -> RefValue {
    let def = op.def();
    let shape = &x.shape;
    if dtype.is_float() {
        let sc = (dtype.compute().round_f64(s), 0.0);
        let (f, sens, ulps) = (&def.reference, def.sensitivity, super::allowance(def.name, def.ulps));
        let pow_scaled = def.name == "pow" && super::platform_scales_exp();
        floats(dtype, shape, |i| {
            let xi = x.float_at(i);
            let (l, r) = if scalar_first { (sc, xi) } else { (xi, sc) };
            let result = float_binary(dtype, f, sens, ulps, l, r);
            super::arithmetic(if pow_scaled { gpu_pow_bound(dtype, result, l, r) } else { result }, xi.0.is_nan())
        })
    } else {
        let f = def.reference_int.unwrap_or_else(|| panic!("{} has no integer form ({dtype})", def.name));
        let s = dtype.int_from_f64(s);
        ints(dtype, shape, |i| {
            let (v, e) = x.int_at(i);
            let r = if scalar_first { f(s, v) } else { f(v, s) };
            (dtype.wrap_int(r), int_bound(&[e]))
        })
    }
}

/// `pow(x, y)` on a GPU: WGSL computes it as `exp2(y * log2(x))`, whose `exp2` is bounded to
/// `3 + 2|t|` ulps of its argument `t = y * log2(|x|)` (the `log2` error, scaled by `|y|`,
/// shows up the same way). The `2|t|` part is added to the bound `float_binary` gave.
fn gpu_pow_bound(dtype: DType, (v, bound): (f64, f64), (x, ex): (f64, f64), (y, ey): (f64, f64)) -> (f64, f64) {
    if x == 0.0 || !v.is_finite() {
        return (v, bound);
    }
    let t = (y.abs() + ey) * (x.abs().log2().abs() + ex / x.abs());
    let extra = 2.0 * t * dtype.compute().epsilon() * v.abs();
    let bound = bound + extra;
    (v, if bound.is_nan() { f64::INFINITY } else { bound })
}

/// Whether a comparison of `x ± ex` with `y ± ey` is decided: both exact, a NaN (every
/// comparison with NaN is fixed), or disjoint intervals (the order of any pair is fixed).
fn comparison_certain((x, ex): (f64, f64), (y, ey): (f64, f64)) -> bool {
    if ex.is_infinite() || ey.is_infinite() {
        return false;
    }
    x.is_nan() || y.is_nan() || (ex == 0.0 && ey == 0.0) || x + ex < y - ey || y + ey < x - ex
}

/// `a op b` elementwise. A value compared with itself (`x >= x`: both operands are one node,
/// so one buffer) is decided whenever the value is bounded, however wide its interval: the
/// device compares each element with its own bits.
pub(super) fn compare(op: CompareOp, shape: &Shape, a: &RefValue, b: &RefValue) -> RefValue {
    let f = op.def().reference;
    let (ia, ib) = (broadcast_map(&a.shape, shape), broadcast_map(&b.shape, shape));
    let c = a.dtype.compute();
    let itself = std::ptr::eq(a, b);
    ints(DType::Bool, shape, |i| {
        if a.dtype.is_float() {
            let ((x, ex), (y, ey)) = (a.float_at(ia[i]), b.float_at(ib[i]));
            let (ex, ey) = (read_err(x, ex, c), read_err(y, ey, c));
            let certain = if itself { ex.is_finite() } else { comparison_certain((x, ex), (y, ey)) };
            (f(x, y) as i64, if certain { 0.0 } else { UNCERTAIN })
        } else {
            // Exact for any i64: a comparison depends only on the order of its operands.
            let ((x, ex), (y, ey)) = (a.int_at(ia[i]), b.int_at(ib[i]));
            let order = x.cmp(&y) as i8 as f64;
            (f(order, 0.0) as i64, int_bound(&[ex, ey]))
        }
    })
}

/// `cond ? a : b`. With a certain condition the chosen element moves unchanged; with an
/// uncertain one the result is still bounded when both branches are (see the module docs).
pub(super) fn select(dtype: DType, shape: &Shape, cond: &RefValue, a: &RefValue, b: &RefValue) -> RefValue {
    let ic = broadcast_map(&cond.shape, shape);
    let (ia, ib) = (broadcast_map(&a.shape, shape), broadcast_map(&b.shape, shape));
    // Per element: whether the condition is certain, the chosen branch and the other one.
    let branches = |i: usize| {
        let (c, ce) = cond.int_at(ic[i]);
        let (chosen, other) = if c != 0 { ((a, ia[i]), (b, ib[i])) } else { ((b, ib[i]), (a, ia[i])) };
        (ce.is_finite(), chosen, other)
    };
    if dtype.is_float() {
        floats(dtype, shape, |i| {
            let (certain, (t, j), (u, k)) = branches(i);
            let ((v, e), (w, f)) = (t.float_at(j), u.float_at(k));
            let bound = if certain || e.is_infinite() {
                e
            } else if f.is_infinite() {
                UNCERTAIN
            } else if v.is_finite() && w.is_finite() {
                e.max((v - w).abs() + f)
            } else if same_nonfinite(v, w) {
                0.0
            } else {
                UNCERTAIN
            };
            (v, bound)
        })
    } else {
        ints(dtype, shape, |i| {
            let (certain, (t, j), (u, k)) = branches(i);
            let ((v, e), (w, f)) = (t.int_at(j), u.int_at(k));
            let bound = if certain {
                e
            } else if v == w {
                int_bound(&[e, f])
            } else {
                UNCERTAIN
            };
            (v, bound)
        })
    }
}

/// `min(max(x, lo), hi)` with `lo`, `hi` rounded to the compute dtype; NaN stays NaN.
pub(super) fn clamp(dtype: DType, x: &RefValue, lo: f64, hi: f64) -> RefValue {
    let shape = &x.shape;
    if dtype.is_float() {
        let c = dtype.compute();
        let (lo, hi) = (c.round_f64(lo), c.round_f64(hi));
        let f = move |v: f64| if v.is_nan() { v } else { v.max(lo).min(hi) };
        floats(dtype, shape, |i| float_unary(dtype, &f, Sensitivity::Lipschitz(1.0), 0.0, x.float_at(i)))
    } else {
        let (lo, hi) = (dtype.int_from_f64(lo), dtype.int_from_f64(hi));
        ints(dtype, shape, |i| {
            let (v, e) = x.int_at(i);
            (v.max(lo).min(hi), e)
        })
    }
}

/// Conversion to `to` (the rules are in the module docs).
pub(super) fn cast(to: DType, x: &RefValue) -> RefValue {
    let (from, shape) = (x.dtype, &x.shape);
    if from == to {
        return x.clone();
    }
    match (from.is_float(), to.is_float()) {
        (true, true) => floats(to, shape, |i| {
            let (v, e) = x.float_at(i);
            let e = read_err(v, e, from.compute());
            float_unary(to, &|v| v, Sensitivity::Lipschitz(1.0), 1.0, (v, e))
        }),
        (true, false) => ints(to, shape, |i| {
            let (v, e) = x.float_at(i);
            let e = read_err(v, e, from.compute());
            let certain = if e == 0.0 {
                true
            } else if e.is_infinite() {
                false
            } else if to == DType::Bool {
                !(v - e <= 0.0 && 0.0 <= v + e)
            } else {
                // Truncation and saturation are monotone: equal ends mean a constant interval.
                to.int_from_f64(v - e) == to.int_from_f64(v + e)
            };
            (to.int_from_f64(v), if certain { 0.0 } else { UNCERTAIN })
        }),
        (false, true) => floats(to, shape, |i| {
            let (v, e) = x.int_at(i);
            let z = v as f64;
            if e.is_infinite() {
                (to.round_f64(z), UNCERTAIN)
            } else if to.round_f64(z) as i128 == v as i128 {
                (z, 0.0) // representable: every correct conversion is exact
            } else {
                finish(to, z, Some(0.0), 2.0, z.abs())
            }
        }),
        (false, false) => ints(to, shape, |i| {
            let (v, e) = x.int_at(i);
            (to.wrap_int(v), e)
        }),
    }
}
