//! The op table: one row per elementwise op, from which everything about the op comes.
//!
//! A row names the op, its dtype rule, its textbook reference formula (f64, used only by the
//! reference interpreter), its kernel expression (the primitives of [`crate::expr`] that every
//! backend lowers), how input errors propagate through it (for the reference's error bounds) and
//! how much rounding error a device may add. The public tensor methods are generated from the
//! same rows, so adding an elementwise op means adding a row here and tests, nothing else.
//!
//! The rows live in exported macros (`unary_ops!`, `binary_ops!`, `compare_ops!`) that hand
//! them to a callback macro: this crate builds the enums and tables from them, the `braid`
//! crate builds its methods.

#[allow(unused_imports)]
use crate::diff::{Diff, Dv, Saves, abs_grad, extremum_grad, gelu_grad, pow_grad_base, pow_grad_exponent};
use crate::expr::{ExprBuilder, ExprId, PrimBinary, PrimCmp, PrimUnary};

/// Which dtypes an op accepts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum DTypeRule {
    /// f32, f64, f16, bf16.
    Float,
    /// Floats and integers (not bool).
    Numeric,
}

/// How an error in the inputs propagates to the output; the reference interpreter turns this
/// into a sound bound on how far a correct device result may be from the f64 value.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Sensitivity {
    /// `|f(x) - f(y)| <= L |x - y|` everywhere.
    Lipschitz(f64),
    /// Monotone wherever defined: the output interval is spanned by the endpoints; an interval
    /// that leaves the domain (an endpoint gives NaN) or contains zero when `pole_at_zero` is
    /// uncertain.
    Monotone { pole_at_zero: bool },
    /// `x * x`.
    Square,
    /// `a + b`, `a - b`.
    Sum,
    /// `a * b`.
    Product,
    /// `a / b`: uncertain when the divisor's interval contains zero.
    Quotient,
    /// `a ^ b`: corners of the box when the base is positive, otherwise uncertain.
    Power,
    /// `max`, `min`: 1-Lipschitz in the max norm.
    Extremum,
}

/// A unary elementwise op.
pub struct UnaryDef {
    pub name: &'static str,
    pub dtypes: DTypeRule,
    pub reference: fn(f64) -> f64,
    /// Integer semantics (wrapping, computed in i64 and wrapped to the dtype); `None` for
    /// float-only ops.
    pub reference_int: Option<fn(i64) -> i64>,
    pub kernel: fn(&mut ExprBuilder, ExprId) -> ExprId,
    pub sensitivity: Sensitivity,
    /// Rounding error a device may add, in units of the compute dtype's epsilon times
    /// `max(|out|, |in|)`.
    pub ulps: f64,
    /// The derivative: `(d, x, y, g)` gives `g * f'(x)` (`y = f(x)`); it may read only the
    /// values `saves` names.
    pub grad: fn(&mut dyn Diff, Dv, Dv, Dv) -> Dv,
    pub saves: Saves,
}

/// A binary elementwise op with NumPy broadcasting.
pub struct BinaryDef {
    pub name: &'static str,
    pub dtypes: DTypeRule,
    pub reference: fn(f64, f64) -> f64,
    pub reference_int: Option<fn(i64, i64) -> i64>,
    pub kernel: fn(&mut ExprBuilder, ExprId, ExprId) -> ExprId,
    pub sensitivity: Sensitivity,
    pub ulps: f64,
    /// `(d, a, b, y, g)` gives `g * df/da` in the output's shape (`y = f(a, b)`).
    pub grad_lhs: fn(&mut dyn Diff, Dv, Dv, Dv, Dv) -> Dv,
    /// `(d, a, b, y, g)` gives `g * df/db` in the output's shape.
    pub grad_rhs: fn(&mut dyn Diff, Dv, Dv, Dv, Dv) -> Dv,
    pub saves: Saves,
}

/// A comparison (any dtype, result `Bool`).
pub struct CompareDef {
    pub name: &'static str,
    pub reference: fn(f64, f64) -> bool,
    pub prim: PrimCmp,
}

fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) }
}

fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.min(b) }
}

fn gelu_reference(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// GELU's tanh form computed as `x / (1 + e^(-2u))`, `u = sqrt(2/pi) (x + 0.044715 x^3)`: the same
/// function (`(1 + tanh(u)) / 2 = 1 / (1 + e^(-2u))`), with one `exp` instead of a `tanh`, and
/// without the cancellation in `1 + tanh(u)` for negative `u`.
fn gelu_kernel(b: &mut ExprBuilder, x: ExprId) -> ExprId {
    let c = -2.0 * (2.0 / std::f64::consts::PI).sqrt();
    let outer = b.constant_like(x, c);
    let cubic = b.constant_like(x, c * 0.044715);
    let one = b.constant_like(x, 1.0);
    let x2 = b.mul(x, x);
    let kx2 = b.mul(cubic, x2);
    let poly = b.add(outer, kx2);
    let minus_2u = b.mul(x, poly);
    let e = b.exp(minus_2u);
    let den = b.add(one, e);
    b.div(x, den)
}

fn sigmoid_kernel(b: &mut ExprBuilder, x: ExprId) -> ExprId {
    let one = b.constant_like(x, 1.0);
    let nx = b.neg(x);
    let e = b.exp(nx);
    let den = b.add(one, e);
    b.div(one, den)
}

fn int_div(a: i64, b: i64) -> i64 {
    if b == 0 { 0 } else { a.wrapping_div(b) }
}

/// The unary rows. See the module docs for the callback convention.
#[macro_export]
macro_rules! unary_ops {
    ($callback:ident) => {
        $callback! {
            Neg { method: neg, doc: "`-x` (wrapping for integers).", dtypes: Numeric,
                reference: |x| -x, reference_int: Some(|x| x.wrapping_neg()),
                kernel: |b, x| b.neg(x), sensitivity: Lipschitz(1.0), ulps: 0.0,
                grad: |d, _, _, g| d.neg(g), saves: Nothing };
            Exp { method: exp, doc: "`e^x`.", dtypes: Float,
                reference: |x| x.exp(), reference_int: None,
                kernel: |b, x| b.exp(x), sensitivity: Monotone { pole_at_zero: false }, ulps: 4.0,
                grad: |d, _, y, g| d.mul(g, y), saves: Output };
            Log { method: log, doc: "Natural logarithm (NaN below zero, -inf at zero).", dtypes: Float,
                reference: |x| x.ln(), reference_int: None,
                kernel: |b, x| b.unary(PrimUnary::Log, x), sensitivity: Monotone { pole_at_zero: true }, ulps: 4.0,
                grad: |d, x, _, g| d.div(g, x), saves: Inputs };
            Sqrt { method: sqrt, doc: "Square root (NaN below zero).", dtypes: Float,
                reference: |x| x.sqrt(), reference_int: None,
                kernel: |b, x| b.sqrt(x), sensitivity: Monotone { pole_at_zero: true }, ulps: 2.0,
                grad: |d, _, y, g| { let y2 = d.scale(y, 2.0); d.div(g, y2) }, saves: Output };
            Rsqrt { method: rsqrt, doc: "`1 / sqrt(x)`.", dtypes: Float,
                reference: |x| 1.0 / x.sqrt(), reference_int: None,
                kernel: |b, x| { let one = b.constant_like(x, 1.0); let s = b.sqrt(x); b.div(one, s) },
                sensitivity: Monotone { pole_at_zero: true }, ulps: 3.0,
                grad: |d, x, y, g| { let q = d.div(y, x); let q = d.scale(q, -0.5); d.mul(g, q) }, saves: InputsAndOutput };
            Abs { method: abs, doc: "`|x|` (wrapping for the most negative integer).", dtypes: Numeric,
                reference: |x| x.abs(), reference_int: Some(|x| x.wrapping_abs()),
                kernel: |b, x| b.unary(PrimUnary::Abs, x), sensitivity: Lipschitz(1.0), ulps: 0.0,
                grad: |d, x, _, g| abs_grad(d, x, g), saves: Inputs };
            Sin { method: sin, doc: "Sine.", dtypes: Float,
                reference: |x| x.sin(), reference_int: None,
                kernel: |b, x| b.unary(PrimUnary::Sin, x), sensitivity: Lipschitz(1.0), ulps: 4.0,
                grad: |d, x, _, g| { let c = d.unary(UnaryOp::Cos, x); d.mul(g, c) }, saves: Inputs };
            Cos { method: cos, doc: "Cosine.", dtypes: Float,
                reference: |x| x.cos(), reference_int: None,
                kernel: |b, x| b.unary(PrimUnary::Cos, x), sensitivity: Lipschitz(1.0), ulps: 4.0,
                grad: |d, x, _, g| { let s = d.unary(UnaryOp::Sin, x); let s = d.neg(s); d.mul(g, s) }, saves: Inputs };
            Tanh { method: tanh, doc: "Hyperbolic tangent.", dtypes: Float,
                reference: |x| x.tanh(), reference_int: None,
                kernel: |b, x| b.tanh(x), sensitivity: Lipschitz(1.0), ulps: 4.0,
                grad: |d, _, y, g| { let y = d.widen(y); let y2 = d.unary(UnaryOp::Square, y); let s = d.rsub(1.0, y2); let s = d.narrow(s); d.mul(g, s) }, saves: Output };
            Sigmoid { method: sigmoid, doc: "`1 / (1 + e^-x)`.", dtypes: Float,
                reference: |x| 1.0 / (1.0 + (-x).exp()), reference_int: None,
                kernel: sigmoid_kernel, sensitivity: Lipschitz(0.25), ulps: 6.0,
                grad: |d, _, y, g| { let y = d.widen(y); let s = d.rsub(1.0, y); let s = d.mul(y, s); let s = d.narrow(s); d.mul(g, s) }, saves: Output };
            Relu { method: relu, doc: "`max(x, 0)` (NaN stays NaN).", dtypes: Numeric,
                reference: |x| if x.is_nan() { x } else { x.max(0.0) }, reference_int: Some(|x| x.max(0)),
                kernel: |b, x| { let z = b.constant_like(x, 0.0); b.max(x, z) },
                sensitivity: Lipschitz(1.0), ulps: 0.0,
                grad: |d, _, y, g| { let z = d.zeros_like(y); let on = d.compare(CompareOp::Gt, y, z); d.mask(on, g) }, saves: Output };
            Gelu { method: gelu, doc: "GELU, tanh form: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.", dtypes: Float,
                reference: gelu_reference, reference_int: None,
                kernel: gelu_kernel, sensitivity: Lipschitz(1.2), ulps: 12.0,
                grad: |d, x, _, g| gelu_grad(d, x, g), saves: Inputs };
            Recip { method: recip, doc: "`1 / x`.", dtypes: Float,
                reference: |x| 1.0 / x, reference_int: None,
                kernel: |b, x| { let one = b.constant_like(x, 1.0); b.div(one, x) },
                sensitivity: Monotone { pole_at_zero: true }, ulps: 1.0,
                grad: |d, _, y, g| { let y2 = d.unary(UnaryOp::Square, y); let s = d.neg(y2); d.mul(g, s) }, saves: Output };
            Square { method: square, doc: "`x * x` (wrapping for integers).", dtypes: Numeric,
                reference: |x| x * x, reference_int: Some(|x| x.wrapping_mul(x)),
                kernel: |b, x| b.mul(x, x), sensitivity: Square, ulps: 1.0,
                grad: |d, x, _, g| { let s = d.scale(x, 2.0); d.mul(g, s) }, saves: Inputs };
        }
    };
}

/// The binary rows (broadcasting; both operands of one dtype).
#[macro_export]
macro_rules! binary_ops {
    ($callback:ident) => {
        $callback! {
            Add { method: add, doc: "`a + b` with broadcasting (wrapping for integers).", dtypes: Numeric,
                reference: |a, b| a + b, reference_int: Some(|a, b| a.wrapping_add(b)),
                kernel: |bd, a, b| bd.add(a, b), sensitivity: Sum, ulps: 1.0,
                grad_lhs: |_, _, _, _, g| g,
                grad_rhs: |_, _, _, _, g| g, saves: Nothing };
            Sub { method: sub, doc: "`a - b` with broadcasting (wrapping for integers).", dtypes: Numeric,
                reference: |a, b| a - b, reference_int: Some(|a, b| a.wrapping_sub(b)),
                kernel: |bd, a, b| bd.sub(a, b), sensitivity: Sum, ulps: 1.0,
                grad_lhs: |_, _, _, _, g| g,
                grad_rhs: |d, _, _, _, g| d.neg(g), saves: Nothing };
            Mul { method: mul, doc: "`a * b` with broadcasting (wrapping for integers).", dtypes: Numeric,
                reference: |a, b| a * b, reference_int: Some(|a, b| a.wrapping_mul(b)),
                kernel: |bd, a, b| bd.mul(a, b), sensitivity: Product, ulps: 1.0,
                grad_lhs: |d, _, b, _, g| d.mul(g, b),
                grad_rhs: |d, a, _, _, g| d.mul(g, a), saves: Inputs };
            Div { method: div, doc: "`a / b` with broadcasting; integers truncate towards zero and `x / 0 == 0`.", dtypes: Numeric,
                reference: |a, b| a / b, reference_int: Some(int_div),
                kernel: |bd, a, b| bd.div(a, b), sensitivity: Quotient, ulps: 1.0,
                grad_lhs: |d, _, b, _, g| d.div(g, b),
                grad_rhs: |d, a, b, _, g| { let ga = d.mul(g, a); let b2 = d.unary(UnaryOp::Square, b); let q = d.div(ga, b2); d.neg(q) }, saves: Inputs };
            Pow { method: pow, doc: "`a ^ b` with broadcasting (floats).", dtypes: Float,
                reference: |a, b| a.powf(b), reference_int: None,
                kernel: |bd, a, b| bd.binary(PrimBinary::Pow, a, b), sensitivity: Power, ulps: 4.0,
                grad_lhs: |d, a, b, _, g| pow_grad_base(d, a, b, g),
                grad_rhs: |d, a, b, y, g| pow_grad_exponent(d, a, b, y, g), saves: InputsAndOutput };
            Maximum { method: maximum, doc: "Elementwise maximum; NaN if either is NaN.", dtypes: Numeric,
                reference: nan_max, reference_int: Some(|a, b| a.max(b)),
                kernel: |bd, a, b| bd.max(a, b), sensitivity: Extremum, ulps: 0.0,
                grad_lhs: |d, a, b, _, g| extremum_grad(d, CompareOp::Gt, a, b, g),
                grad_rhs: |d, a, b, _, g| extremum_grad(d, CompareOp::Gt, b, a, g), saves: Inputs };
            Minimum { method: minimum, doc: "Elementwise minimum; NaN if either is NaN.", dtypes: Numeric,
                reference: nan_min, reference_int: Some(|a, b| a.min(b)),
                kernel: |bd, a, b| bd.min(a, b), sensitivity: Extremum, ulps: 0.0,
                grad_lhs: |d, a, b, _, g| extremum_grad(d, CompareOp::Lt, a, b, g),
                grad_rhs: |d, a, b, _, g| extremum_grad(d, CompareOp::Lt, b, a, g), saves: Inputs };
        }
    };
}

/// The comparison rows (any dtype, same for both operands; broadcasting; result `Bool`).
#[macro_export]
macro_rules! compare_ops {
    ($callback:ident) => {
        $callback! {
            Eq { method: eq, doc: "`a == b` elementwise.", reference: |a, b| a == b, prim: PrimCmp::Eq };
            Ne { method: ne, doc: "`a != b` elementwise.", reference: |a, b| a != b, prim: PrimCmp::Ne };
            Lt { method: lt, doc: "`a < b` elementwise.", reference: |a, b| a < b, prim: PrimCmp::Lt };
            Le { method: le, doc: "`a <= b` elementwise.", reference: |a, b| a <= b, prim: PrimCmp::Le };
            Gt { method: gt, doc: "`a > b` elementwise.", reference: |a, b| a > b, prim: PrimCmp::Gt };
            Ge { method: ge, doc: "`a >= b` elementwise.", reference: |a, b| a >= b, prim: PrimCmp::Ge };
        }
    };
}

macro_rules! define_table {
    ($enum:ident, $def:ident, $(#[$attr:meta])*
     $($variant:ident { method: $method:ident, doc: $doc:literal, $($field:ident : $value:expr),* $(,)? };)*) => {
        $(#[$attr])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
        pub enum $enum {
            $(#[doc = $doc] $variant,)*
        }

        impl $enum {
            /// Every op of this kind, in table order.
            pub const ALL: &'static [$enum] = &[$($enum::$variant,)*];

            /// This op's row of the table.
            pub fn def(self) -> &'static $def {
                #[allow(unused_imports)]
                use {DTypeRule::*, Saves::*, Sensitivity::*};
                match self {
                    $($enum::$variant => {
                        static ROW: $def = $def { name: stringify!($method), $($field: $value),* };
                        &ROW
                    })*
                }
            }

            pub fn name(self) -> &'static str {
                self.def().name
            }
        }
    };
}

macro_rules! define_unary {
    ($($rows:tt)*) => { define_table!(UnaryOp, UnaryDef, /// A unary elementwise op (a row of the table).
        $($rows)*); };
}
macro_rules! define_binary {
    ($($rows:tt)*) => { define_table!(BinaryOp, BinaryDef, /// A binary elementwise op (a row of the table).
        $($rows)*); };
}
macro_rules! define_compare {
    ($($rows:tt)*) => { define_table!(CompareOp, CompareDef, /// A comparison (a row of the table).
        $($rows)*); };
}

unary_ops!(define_unary);
binary_ops!(define_binary);
compare_ops!(define_compare);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn every_row_builds_a_well_typed_kernel() {
        for &op in UnaryOp::ALL {
            for d in [DType::F32, DType::F64, DType::I32] {
                if op.def().dtypes == DTypeRule::Float && !d.is_float() {
                    continue;
                }
                let mut b = ExprBuilder::new();
                let x = b.load(0, d);
                let y = (op.def().kernel)(&mut b, x);
                assert_eq!(b.dtype(y), d, "{}", op.name());
            }
        }
        for &op in BinaryOp::ALL {
            let mut b = ExprBuilder::new();
            let x = b.load(0, DType::F32);
            let y = b.load(1, DType::F32);
            let z = (op.def().kernel)(&mut b, x, y);
            assert_eq!(b.dtype(z), DType::F32, "{}", op.name());
        }
    }

    #[test]
    fn names_are_the_method_names() {
        assert_eq!(UnaryOp::Gelu.name(), "gelu");
        assert_eq!(BinaryOp::Maximum.name(), "maximum");
        assert_eq!(CompareOp::Ge.name(), "ge");
        assert!((UnaryOp::Gelu.def().reference)(1.0) > 0.84);
        assert_eq!((BinaryOp::Div.def().reference_int.unwrap())(7, 0), 0);
        assert_eq!((BinaryOp::Div.def().reference_int.unwrap())(-7, 2), -3);
    }
}
