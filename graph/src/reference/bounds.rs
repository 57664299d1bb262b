//! Error-bound arithmetic: how far a correct device result may be from the reference value.
//!
//! Every function here works on one element. A bound is an `f64`: `0` means exact (the device
//! must match bit for bit, up to the sign of zero), [`UNCERTAIN`] (`+inf`) means the reference
//! cannot say (checks skip the element). A non-finite reference value (NaN, ±inf) always has
//! bound `0` or [`UNCERTAIN`]: either every correct device produces that same value, or the
//! element is skipped. The rules are stated in the [module docs](super).

use crate::dtype::DType;
use crate::table::Sensitivity;

/// The bound of an element the reference cannot vouch for.
pub(super) const UNCERTAIN: f64 = f64::INFINITY;

/// Smallest positive normal number of a compute dtype. Devices that flush subnormals to zero
/// (GPUs in their default modes) may be off by this much near zero.
pub(super) fn min_normal(c: DType) -> f64 {
    match c {
        DType::F64 => f64::MIN_POSITIVE,
        DType::F32 => f32::MIN_POSITIVE as f64,
        DType::F16 => half::f16::MIN_POSITIVE.to_f64(),
        DType::BF16 => half::bf16::MIN_POSITIVE.to_f64(),
        _ => 0.0,
    }
}

/// The error of a float input as a device reads it in compute dtype `c`: a device that treats
/// subnormals as zero reads a nonzero subnormal `x` as `0`, which is `|x|` further away.
pub(super) fn read_err(x: f64, e: f64, c: DType) -> f64 {
    if x != 0.0 && x.abs() < min_normal(c) { e + x.abs() } else { e }
}

/// `γ_n = nε / (1 - nε)`, the classic bound on the relative error of a sum of `n` terms in
/// any order (Higham, *Accuracy and Stability*, §3.1). `None` once `nε >= 1/2`.
pub(super) fn gamma(n: usize, c: DType) -> Option<f64> {
    let ne = n as f64 * c.epsilon();
    if ne >= 0.5 { None } else { Some(ne / (1.0 - ne)) }
}

/// The magnitude a device value of an input can have: `|x| + e` (0 for non-finite inputs,
/// which contribute nothing to a rounding allowance).
pub(super) fn magnitude(x: f64, e: f64) -> f64 {
    if x.is_finite() { x.abs() + e } else { 0.0 }
}

/// Whether `a` and `b` are the same non-finite value (both NaN, or the same infinity).
pub(super) fn same_nonfinite(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || (a.is_infinite() && a == b)
}

/// Whether the values at the corners of the input box stay in the class of the centre value
/// `z`: all finite when `z` is, all the same NaN/infinity when it is not.
pub(super) fn corners_agree(z: f64, corners: &[f64]) -> bool {
    if z.is_finite() { corners.iter().all(|c| c.is_finite()) } else { corners.iter().all(|&c| same_nonfinite(z, c)) }
}

/// Whether the interval `[x - e, x + e]` (with `e > 0`) contains zero.
fn straddles_zero(x: f64, e: f64) -> bool {
    e > 0.0 && x - e <= 0.0 && 0.0 <= x + e
}

fn spread(z: f64, corners: &[f64]) -> f64 {
    corners.iter().map(|c| (c - z).abs()).fold(0.0, f64::max)
}

/// Propagates an input error `e` through a unary `f` with centre value `z = f(x)`: a bound on
/// `|f(x') - z|` over `|x' - x| <= e` (`Some(0.0)` for a certain non-finite `z`), or `None`
/// when the input interval makes the result uncertain.
pub(super) fn propagate_unary(sens: Sensitivity, f: &dyn Fn(f64) -> f64, x: f64, e: f64, z: f64) -> Option<f64> {
    if e == 0.0 {
        return Some(0.0);
    }
    if !e.is_finite() {
        return None;
    }
    let corners = [f(x - e), f(x + e)];
    if !corners_agree(z, &corners) {
        return None;
    }
    let p = match sens {
        Sensitivity::Lipschitz(l) => l * e,
        Sensitivity::Monotone { pole_at_zero } => {
            if pole_at_zero && straddles_zero(x, e) {
                return None;
            }
            spread(z, &corners)
        }
        Sensitivity::Square => 2.0 * x.abs() * e + e * e,
        // Rules for two operands say nothing about a unary op; a test checks the table.
        Sensitivity::Sum
        | Sensitivity::Product
        | Sensitivity::Quotient
        | Sensitivity::Power
        | Sensitivity::Extremum => return None,
    };
    Some(if z.is_finite() { p } else { 0.0 })
}

/// The binary counterpart of [`propagate_unary`], for `z = f(a, b)` with input errors `ea`,
/// `eb`.
pub(super) fn propagate_binary(
    sens: Sensitivity,
    f: &dyn Fn(f64, f64) -> f64,
    (a, ea): (f64, f64),
    (b, eb): (f64, f64),
    z: f64,
) -> Option<f64> {
    if ea == 0.0 && eb == 0.0 {
        return Some(0.0);
    }
    if !ea.is_finite() || !eb.is_finite() {
        return None;
    }
    let corners = [f(a - ea, b - eb), f(a - ea, b + eb), f(a + ea, b - eb), f(a + ea, b + eb)];
    if !corners_agree(z, &corners) {
        return None;
    }
    let p = match sens {
        Sensitivity::Lipschitz(l) => l * (ea + eb),
        // Monotone in each operand: the extremes over the box are at its corners.
        Sensitivity::Monotone { pole_at_zero } => {
            if pole_at_zero && (straddles_zero(a, ea) || straddles_zero(b, eb)) {
                return None;
            }
            spread(z, &corners)
        }
        Sensitivity::Sum => ea + eb,
        Sensitivity::Product => a.abs() * eb + b.abs() * ea + ea * eb,
        Sensitivity::Quotient => {
            if eb > 0.0 && b.abs() <= eb {
                return None;
            }
            spread(z, &corners)
        }
        Sensitivity::Power => {
            if a - ea > 0.0 {
                spread(z, &corners)
            } else {
                return None;
            }
        }
        Sensitivity::Extremum => ea.max(eb),
        Sensitivity::Square => return None,
    };
    Some(if z.is_finite() { p } else { 0.0 })
}

/// Stores a float result of dtype `s`: rounds the f64 value `z` to `s` and turns the
/// propagated input error `p` into the element's bound by adding the rounding allowance
///
/// `(ulps + 1) ε(c) scale + (ulps + 2) min_normal(c)` and, when `s != c`,
/// `2 ε(s) (|z| + that) + (ulps + 2) min_subnormal(s)`,
///
/// where `c = s.compute()` and `scale` is at least `|z| + p`. The result is uncertain when
/// `p` is `None` or when the device's value may overflow where the reference's does not (or
/// the other way round). A non-finite `z` with `p` given is certain (bound 0): the caller has
/// established that every correct device produces it.
pub(super) fn finish(s: DType, z: f64, p: Option<f64>, ulps: f64, scale: f64) -> (f64, f64) {
    let stored = s.round_f64(z);
    let Some(p) = p else {
        return (stored, UNCERTAIN);
    };
    if !z.is_finite() {
        return (stored, 0.0);
    }
    let c = s.compute();
    let scale = scale.max(z.abs() + p);
    let mut bound = p + (ulps + 1.0) * c.epsilon() * scale + (ulps + 2.0) * min_normal(c);
    if s != c {
        bound += 2.0 * s.epsilon() * (z.abs() + bound) + (ulps + 2.0) * s.min_subnormal();
    }
    if !bound.is_finite() {
        return (stored, UNCERTAIN);
    }
    // Every correct device result lies between these two (rounding is monotone).
    let (lo, hi) = (s.round_f64(z - bound), s.round_f64(z + bound));
    if lo.is_finite() && hi.is_finite() {
        (stored, bound)
    } else if lo == hi {
        (stored, 0.0) // the whole interval overflows to the same infinity
    } else {
        (stored, UNCERTAIN)
    }
}

/// Accumulates the terms of a sum (a reduction or one dot product of a matmul) with their
/// error bounds, in f64.
pub(super) struct SumAcc {
    c: DType,
    n: usize,
    sum: f64,
    /// Σ of the magnitudes the device's finite terms can have.
    abs: f64,
    /// Σ of the finite terms' error bounds.
    err: f64,
    uncertain: bool,
    nonfinite: bool,
}

impl SumAcc {
    /// An empty sum computed by devices in compute dtype `c`.
    pub(super) fn new(c: DType) -> SumAcc {
        SumAcc { c, n: 0, sum: 0.0, abs: 0.0, err: 0.0, uncertain: false, nonfinite: false }
    }

    /// Adds a term with reference value `v`, error bound `e` and a bound `m` on the magnitude
    /// of the device's term.
    pub(super) fn add(&mut self, v: f64, e: f64, m: f64) {
        self.n += 1;
        self.sum += v;
        if !e.is_finite() {
            self.uncertain = true;
        } else if v.is_finite() {
            self.abs += m;
            self.err += e;
        } else {
            self.nonfinite = true;
        }
    }

    /// The reference sum and the propagated error bound before the final rounding:
    /// `Σ e_i + (γ_n(c) + γ_n(f64)) Σ |x_i|` (the device's and the reference's own summation
    /// errors, in any order). `None` when a term is uncertain or an intermediate sum may
    /// overflow. A non-finite sum is certain when it comes from non-finite terms alone.
    pub(super) fn finish(&self) -> (f64, Option<f64>) {
        if self.uncertain || self.abs > self.c.max_finite() {
            return (self.sum, None);
        }
        if !self.sum.is_finite() {
            return (self.sum, if self.nonfinite { Some(0.0) } else { None });
        }
        let g = gamma(self.n, self.c).zip(gamma(self.n, DType::F64)).map(|(a, b)| a + b);
        (self.sum, g.map(|g| self.err + g * self.abs))
    }
}
