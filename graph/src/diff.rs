//! The algebra derivatives are written in.
//!
//! Each row of the op table ([`crate::table`]) states its derivative once, as a small program
//! over [`Diff`]: elementwise ops of the table, comparisons, `select` and constants, applied to
//! opaque values ([`Dv`]). The `braid` crate implements [`Diff`] by recording tensor ops (so a
//! backward pass is an ordinary lazy graph); this crate's tests implement it on plain `f64`
//! to check every row against finite differences of its reference formula.
//!
//! Derivatives here are elementwise in the output's (broadcast) shape; reducing a gradient to a
//! broadcast operand's shape is the caller's job. This module never records, evaluates or
//! allocates anything itself.

use crate::table::{BinaryOp, CompareOp, UnaryOp};

/// A value in a derivative program (an index the [`Diff`] implementation hands out).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Dv(pub u32);

/// Which forward values an op's derivative reads, so that only those are kept for backward.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Saves {
    /// Only the incoming gradient (and shapes).
    Nothing,
    /// The op's inputs.
    Inputs,
    /// The op's result.
    Output,
    /// Inputs and result.
    InputsAndOutput,
}

impl Saves {
    pub fn inputs(self) -> bool {
        matches!(self, Saves::Inputs | Saves::InputsAndOutput)
    }
    pub fn output(self) -> bool {
        matches!(self, Saves::Output | Saves::InputsAndOutput)
    }
}

/// The operations a derivative may use. Every value has the dtype of the op being
/// differentiated, or f32 between [`widen`](Diff::widen) and [`narrow`](Diff::narrow) for a
/// half-precision op (comparisons give masks usable only by `select`).
pub trait Diff {
    fn unary(&mut self, op: UnaryOp, x: Dv) -> Dv;
    fn binary(&mut self, op: BinaryOp, a: Dv, b: Dv) -> Dv;
    /// `x op s` (or `s op x` when `scalar_first`).
    fn scalar(&mut self, op: BinaryOp, x: Dv, s: f64, scalar_first: bool) -> Dv;
    fn compare(&mut self, op: CompareOp, a: Dv, b: Dv) -> Dv;
    /// `cond ? a : b`.
    fn select(&mut self, cond: Dv, a: Dv, b: Dv) -> Dv;
    /// Zeros shaped like `x`.
    fn zeros_like(&mut self, x: Dv) -> Dv;
    /// `x` in the precision a long derivative of a half-precision op is computed in: `f32` for
    /// an `f16` or `bf16` value, `x` itself otherwise. A rule that widens its inputs computes in
    /// f32 and rounds once, at [`narrow`](Diff::narrow), as PyTorch's `gelu_backward` does;
    /// without it, every step of the rule would round to the op's dtype (GELU's derivative in
    /// bf16 rounded 14 times, and its `1 - tanh^2` lost to cancellation).
    fn widen(&mut self, x: Dv) -> Dv;
    /// `x` back in the dtype of the op being differentiated (undoes [`widen`](Diff::widen)).
    fn narrow(&mut self, x: Dv) -> Dv;
}

/// Shorthands for derivative rows.
impl dyn Diff + '_ {
    pub fn add(&mut self, a: Dv, b: Dv) -> Dv {
        self.binary(BinaryOp::Add, a, b)
    }
    pub fn sub(&mut self, a: Dv, b: Dv) -> Dv {
        self.binary(BinaryOp::Sub, a, b)
    }
    pub fn mul(&mut self, a: Dv, b: Dv) -> Dv {
        self.binary(BinaryOp::Mul, a, b)
    }
    pub fn div(&mut self, a: Dv, b: Dv) -> Dv {
        self.binary(BinaryOp::Div, a, b)
    }
    pub fn neg(&mut self, x: Dv) -> Dv {
        self.unary(UnaryOp::Neg, x)
    }
    pub fn scale(&mut self, x: Dv, s: f64) -> Dv {
        self.scalar(BinaryOp::Mul, x, s, false)
    }
    /// `s - x`.
    pub fn rsub(&mut self, s: f64, x: Dv) -> Dv {
        self.scalar(BinaryOp::Sub, x, s, true)
    }
    /// `g` where `cond`, else zero.
    pub fn mask(&mut self, cond: Dv, g: Dv) -> Dv {
        let z = self.zeros_like(g);
        self.select(cond, g, z)
    }
}

/// `d/dx gelu(x)` for the tanh form, times `g`, computed in f32 for half-precision values and
/// rounded once before the product with `g`.
///
/// With `u = c (x + k x^3)` and `s = 1 / (1 + e^(-2u))` (so that `gelu(x) = x s`, which is how
/// the forward kernel computes it): `gelu'(x) = s + x s (1 - s) 2u'`, `2u' = 2c (1 + 3k x^2)`.
/// `e^(-2u)` is computed from the same operations in the same order as the forward kernel's, so
/// a kernel holding both computes it once (and no `tanh` at all), and `1 - s` never suffers
/// the cancellation of `1 - tanh(u)^2` where `tanh(u)` is near 1. Where `e^(-2u)` overflows,
/// `s` is 0 and the derivative 0.
pub(crate) fn gelu_grad(d: &mut dyn Diff, x: Dv, g: Dv) -> Dv {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let k = 0.044715;
    let x = d.widen(x);
    let x2 = d.unary(UnaryOp::Square, x);
    // -2u = x (-2c - 2ck x^2), as `gelu_kernel` in the table writes it.
    let poly = d.scale(x2, -2.0 * c * k);
    let poly = d.scalar(BinaryOp::Add, poly, -2.0 * c, false);
    let minus_2u = d.mul(x, poly);
    let e = d.unary(UnaryOp::Exp, minus_2u);
    let den = d.scalar(BinaryOp::Add, e, 1.0, false);
    let s = d.unary(UnaryOp::Recip, den);
    let one_minus_s = d.rsub(1.0, s);
    let du = d.scale(x2, 6.0 * c * k);
    let du = d.scalar(BinaryOp::Add, du, 2.0 * c, false);
    let r = d.mul(x, one_minus_s);
    let r = d.mul(r, du);
    let r = d.mul(r, s);
    let total = d.add(r, s);
    let total = d.narrow(total);
    d.mul(g, total)
}

/// `d/da a^b`, times `g`: `g b a^(b-1)`, and 0 where `b == 0` (`a^0` is constant, even at
/// `a == 0` where the formula gives `0 * inf`).
pub(crate) fn pow_grad_base(d: &mut dyn Diff, a: Dv, b: Dv, g: Dv) -> Dv {
    let bm1 = d.scalar(BinaryOp::Sub, b, 1.0, false);
    let p = d.binary(BinaryOp::Pow, a, bm1);
    let bp = d.mul(b, p);
    let r = d.mul(g, bp);
    let zero = d.zeros_like(b);
    let constant = d.compare(CompareOp::Eq, b, zero);
    let z = d.zeros_like(r);
    d.select(constant, z, r)
}

/// `d/db a^b`, times `g`: `g a^b ln a`; 0 at `a == 0` with `b >= 0` (where `a^b` is 0 or 1
/// and `ln a` is -inf), and NaN for negative bases, as in other frameworks.
pub(crate) fn pow_grad_exponent(d: &mut dyn Diff, a: Dv, b: Dv, y: Dv, g: Dv) -> Dv {
    let ln = d.unary(UnaryOp::Log, a);
    let yl = d.mul(y, ln);
    let r = d.mul(g, yl);
    let zero = d.zeros_like(a);
    let at_zero = d.compare(CompareOp::Eq, a, zero);
    let b_nonneg = d.compare(CompareOp::Ge, b, zero);
    let z = d.zeros_like(r);
    let masked = d.select(b_nonneg, z, r);
    d.select(at_zero, masked, r)
}

/// The share of `g` that operand `x` of `maximum(x, y)` (`wins` = `Gt`) or `minimum(x, y)`
/// (`Lt`) gets: all of it where `x` wins, half where the two tie (as PyTorch splits it, so
/// that `maximum(x, x)` passes `g` on whole), none where `y` wins or either is NaN.
pub(crate) fn extremum_grad(d: &mut dyn Diff, wins: CompareOp, x: Dv, y: Dv, g: Dv) -> Dv {
    let won = d.compare(wins, x, y);
    let tie = d.compare(CompareOp::Eq, x, y);
    let half = d.scale(g, 0.5);
    let z = d.zeros_like(g);
    let tied = d.select(tie, half, z);
    d.select(won, g, tied)
}

/// `d/dx |x|` times `g`: the sign of `x` (zero at zero).
pub(crate) fn abs_grad(d: &mut dyn Diff, x: Dv, g: Dv) -> Dv {
    let z = d.zeros_like(x);
    let pos = d.compare(CompareOp::Gt, x, z);
    let neg = d.compare(CompareOp::Lt, x, z);
    let ng = d.neg(g);
    let zg = d.zeros_like(g);
    let inner = d.select(neg, ng, zg);
    d.select(pos, g, inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Diff` on plain f64 values, for checking rows against finite differences.
    struct Scalars(Vec<f64>);

    impl Scalars {
        fn push(&mut self, v: f64) -> Dv {
            self.0.push(v);
            Dv(self.0.len() as u32 - 1)
        }
        fn get(&self, v: Dv) -> f64 {
            self.0[v.0 as usize]
        }
    }

    impl Diff for Scalars {
        fn unary(&mut self, op: UnaryOp, x: Dv) -> Dv {
            let v = (op.def().reference)(self.get(x));
            self.push(v)
        }
        fn binary(&mut self, op: BinaryOp, a: Dv, b: Dv) -> Dv {
            let v = (op.def().reference)(self.get(a), self.get(b));
            self.push(v)
        }
        fn scalar(&mut self, op: BinaryOp, x: Dv, s: f64, scalar_first: bool) -> Dv {
            let x = self.get(x);
            let v = if scalar_first { (op.def().reference)(s, x) } else { (op.def().reference)(x, s) };
            self.push(v)
        }
        fn compare(&mut self, op: CompareOp, a: Dv, b: Dv) -> Dv {
            let v = (op.def().reference)(self.get(a), self.get(b));
            self.push(if v { 1.0 } else { 0.0 })
        }
        fn select(&mut self, cond: Dv, a: Dv, b: Dv) -> Dv {
            let v = if self.get(cond) != 0.0 { self.get(a) } else { self.get(b) };
            self.push(v)
        }
        fn zeros_like(&mut self, _: Dv) -> Dv {
            self.push(0.0)
        }
        fn widen(&mut self, x: Dv) -> Dv {
            x
        }
        fn narrow(&mut self, x: Dv) -> Dv {
            x
        }
    }

    /// Random points away from zero and from kinks, where the derivative is defined.
    fn points(seed: u64) -> Vec<f64> {
        (0..200u64)
            .map(|i| {
                let u = (crate::rng::mix64(seed ^ i.wrapping_mul(0x9E37_79B9)) >> 11) as f64 / (1u64 << 53) as f64;
                let v = -3.0 + 6.0 * u;
                if v.abs() < 0.05 { v + 0.2 } else { v }
            })
            .collect()
    }

    fn close(analytic: f64, numeric: f64) -> bool {
        (analytic - numeric).abs() <= 1e-6 * (1.0 + analytic.abs().max(numeric.abs()))
    }

    #[test]
    fn every_unary_derivative_matches_central_differences() {
        for &op in UnaryOp::ALL {
            let f = op.def().reference;
            for x in points(op as u64) {
                let x = if matches!(op, UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt) { x.abs() } else { x };
                let h = 1e-6 * (1.0 + x.abs());
                let numeric = (f(x + h) - f(x - h)) / (2.0 * h);
                let g = 1.7;
                let mut d = Scalars(Vec::new());
                // Values the row does not declare in `saves` are NaN, so reading one fails.
                let saves = op.def().saves;
                let xv = d.push(if saves.inputs() { x } else { f64::NAN });
                let yv = d.push(if saves.output() { f(x) } else { f64::NAN });
                let gv = d.push(g);
                let out = (op.def().grad)(&mut d as &mut dyn Diff, xv, yv, gv);
                let analytic = d.get(out) / g;
                assert!(close(analytic, numeric), "{}'({x}) = {analytic}, finite differences {numeric}", op.name());
            }
        }
    }

    #[test]
    fn every_binary_derivative_matches_central_differences() {
        for &op in BinaryOp::ALL {
            let f = op.def().reference;
            let xs = points(100 + op as u64);
            for pair in xs.chunks(2) {
                let (mut a, b) = (pair[0], pair[1]);
                if op == BinaryOp::Pow {
                    a = a.abs();
                }
                let g = -0.6;
                let mut d = Scalars(Vec::new());
                let saves = op.def().saves;
                let av = d.push(if saves.inputs() { a } else { f64::NAN });
                let bv = d.push(if saves.inputs() { b } else { f64::NAN });
                let yv = d.push(if saves.output() { f(a, b) } else { f64::NAN });
                let gv = d.push(g);
                let da = (op.def().grad_lhs)(&mut d as &mut dyn Diff, av, bv, yv, gv);
                let db = (op.def().grad_rhs)(&mut d as &mut dyn Diff, av, bv, yv, gv);
                let (da, db) = (d.get(da) / g, d.get(db) / g);
                let ha = 1e-6 * (1.0 + a.abs());
                let hb = 1e-6 * (1.0 + b.abs());
                let na = (f(a + ha, b) - f(a - ha, b)) / (2.0 * ha);
                let nb = (f(a, b + hb) - f(a, b - hb)) / (2.0 * hb);
                assert!(close(da, na), "d{}/da at ({a}, {b}) = {da}, finite differences {na}", op.name());
                assert!(close(db, nb), "d{}/db at ({a}, {b}) = {db}, finite differences {nb}", op.name());
            }
        }
    }
}
