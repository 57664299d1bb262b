//! # The reference interpreter, with error bounds (tests only)
//!
//! What every device is compared against (invariant 4 of the brief): a program of
//! [`ProgNode`]s is evaluated one op at a time, in f64, with the textbook formulas of the op
//! table ([`crate::table`]), no streams, no fusion, no scheduling. It must stay small and
//! obviously right, and it must **never be used by the engine**: it exists for tests (the
//! `reference` feature), and it depends on nothing but the IR's descriptions of ops.
//!
//! Devices compute in f32, f16 and friends, so next to each element's value the interpreter
//! computes a **sound error bound**: how far a correct device result may be from it. An element
//! whose bound cannot be known (say, `a < b` for two values whose error intervals overlap) is
//! **uncertain** (bound `+inf`) and skipped by [`RefValue::check`]. A bound must never be too
//! small (that fails CI on a correct device) and should be tight enough to catch real bugs.
//!
//! ## Values
//! Float elements are stored **rounded to the node's dtype** after every op (an f32 tensor holds
//! f32 values); integer and bool elements are exact `i64`s, and integer arithmetic is i64
//! arithmetic (wrapping) followed by [`DType::wrap_int`].
//!
//! ## The stated tolerance: how bounds are computed
//! Let `ε(d)` be [`DType::epsilon`] (f64 2^-53, f32 2^-24, f16 2^-11, bf16 2^-8, 0 for
//! integers), `s` the node's dtype, `c = s.compute()` (f16 and bf16 compute in f32), and
//! `mn(c)` the smallest normal of `c` (devices may flush subnormals to zero). A float result's
//! bound is the **propagated** input error plus an **allowance** for the device's own rounding:
//!
//! `allowance = (ulps + 1) ε(c) scale + (ulps + 2) mn(c)`, plus, when `s != c`,
//! `2 ε(s) (|z| + bound so far) + (ulps + 2) min_subnormal(s)` for the rounding to storage,
//!
//! with `z` the f64 result and `scale = max(|z| + p, |x_i| + e_i)` over the finite inputs (`p`
//! the propagated error). `ulps` is the error a device may add, in units of `ε(c) scale` (ε is
//! half an ulp: a correctly rounded op has `ulps = 1`); the `+ 1` is the reference's own
//! rounding. It comes from the op's table row; it is 0 for clamp, max/min reductions and sums
//! (whose rounding is in γ below), 1 for float casts, 2 for int→float casts and mean, 5 for
//! `rand` (scale `max(|lo|, |hi|)`) and 64 for `randn` (scale `max(|v|, 6)`), which devices
//! compute in f32. Movement ops and `select` move values and bounds unchanged. A nonzero
//! subnormal input counts as `|x|` more error (a device may read it as zero). The storage term
//! also covers a device that skips the rounding to `s` between fused ops, and contracting
//! `a * b + c` into an FMA stays within the bounds; accumulating an f16 matmul in f16, or an
//! f32 one in TF32, does not.
//!
//! Propagation through a table op follows the row's [`crate::Sensitivity`]:
//! `Lipschitz(L)`: `L e` (`L (ea + eb)` for two operands); `Monotone`: the largest change of `f`
//! at the corners of the input box, uncertain if `pole_at_zero` and an interval contains 0;
//! `Square`: `2|x|e + e²`; `Sum`: `ea + eb`; `Product`: `|a|eb + |b|ea + ea eb`; `Quotient`:
//! corners, uncertain when `|b| <= eb` with `eb > 0`; `Power`: corners when `a - ea > 0` (or both
//! exact), otherwise uncertain; `Extremum`: `max(ea, eb)`. For every elementwise op, the values
//! at the corners of the input box must stay in the class of the result (all finite, or all the
//! same NaN/infinity), otherwise the result is uncertain; a non-finite result that passes is
//! certain (bound 0: the device must produce the same NaN or infinity). A result whose interval
//! `z ± bound` reaches overflow in `s` is uncertain unless the whole interval overflows to the
//! same infinity (then it is certain). Any uncertain input makes the result uncertain, except in
//! `select`, which reads only the chosen branch when the condition is certain.
//!
//! - **Compare**: certain when both inputs are exact, when one is NaN, or when the intervals
//!   `a ± ea` and `b ± eb` are disjoint (then every comparison is decided); otherwise uncertain.
//!   A node compared with itself (`x >= x`) is certain whenever its bound is finite.
//! - **Select** with an uncertain condition: `max(e_chosen, |chosen - other| + e_other)` when both
//!   branches are finite and certain (0 for equal integers or equal non-finite values), else
//!   uncertain.
//! - **Cast**: float→float: `e` plus the allowance (ulps 1) of the target; float→int: certain iff
//!   both ends of `x ± e` convert (truncate, saturate) to the same integer; float→bool: certain
//!   iff `x ± e` does not contain 0; int→float: 0 if the integer is representable, else the
//!   allowance; int→int and bool→anything: exact; a cast to the same dtype: unchanged.
//! - **Sum** of `n` terms: `Σ e_i + (γ_n(c) + γ_n(f64)) Σ (|x_i| + e_i)`, `γ_n = nε/(1 - nε)`
//!   (uncertain once `nε >= 1/2`), plus the allowance with ulps 0; uncertain when
//!   `Σ (|x_i| + e_i) > max_finite(c)` (intermediate overflow depends on the order). **Mean**: the
//!   sum's value and bound divided by `n`, plus the allowance with ulps 2. An empty sum is
//!   exactly 0, an empty mean exactly NaN. **Max/Min**: `max e_i`
//!   plus the allowance with ulps 0. **ArgMax**: certain iff the winner `w` beats every other
//!   element by its interval (`x_j + e_j < x_w - e_w` before `w`, `<=` after); a NaN winner
//!   (the first NaN) is always certain.
//! - **Matmul**: each dot product is a sum of the terms `a b`, each with bound
//!   `|a| eb + |b| ea + ea eb` and magnitude `(|a| + ea)(|b| + eb)`, bounded like Sum.
//! - **Attention** (`Op::Attention`): the exact formulas, with bounds for any way a fused kernel
//!   may tile it (online softmax, probabilities rounded to the inputs' dtype before they
//!   multiply values, the backward pass recomputing them from the saved log-sum-exp); stated
//!   in `attention.rs`.
//! - Integers are exact (bound 0) unless an input is uncertain.

mod attention;
mod bounds;
mod elementwise;
mod indexing;
mod movement;
mod reduce;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_bounds;

pub use indexing::IndexOp;

use crate::dtype::DType;
use crate::op::Op;
use crate::shape::Shape;
use std::fmt::Write as _;

/// One node of a program for the reference interpreter.
#[derive(Clone, Debug)]
pub enum ProgNode {
    /// A leaf with exact values (already representable in dtype; bools as 0/1; ints exact as
    /// f64).
    Data { dtype: DType, shape: Shape, values: Vec<f64> },
    /// A leaf of integers given exactly (for i64 values beyond 2^53); wrapped to `dtype`.
    IntData { dtype: DType, shape: Shape, values: Vec<i64> },
    /// An op applied to earlier nodes (indices into the program). `dtype` and `shape` are the
    /// result's, as [`crate::infer`] computes them.
    Op { op: Op, dtype: DType, shape: Shape, inputs: Vec<usize> },
    /// An indexing op (gather, scatter-add, argmin), defined directly rather than as the
    /// primitive ops braid records for it.
    Indexing { op: IndexOp, dtype: DType, shape: Shape, inputs: Vec<usize> },
}

/// Element storage: floats rounded to the dtype, or exact integers.
#[derive(Clone, Debug, PartialEq)]
enum Values {
    Float(Vec<f64>),
    Int(Vec<i64>),
}

/// The reference result of one node: values and per-element error bounds.
#[derive(Clone, Debug)]
pub struct RefValue {
    pub dtype: DType,
    pub shape: Shape,
    values: Values,
    /// Per element: 0 = exact, `+inf` = uncertain, otherwise the largest allowed `|device - value|`.
    bounds: Vec<f64>,
}

/// What a successful [`RefValue::check`] looked at.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CheckStats {
    /// Elements compared.
    pub checked: usize,
    /// Elements skipped because their bound is unknowable.
    pub uncertain: usize,
}

thread_local! {
    /// The math library of the device whose results an evaluation bounds ([`evaluate_on`]):
    /// set for the call, on the evaluating thread (the interpreter runs on one thread).
    static PLATFORM: std::cell::Cell<crate::PlatformMath> = const { std::cell::Cell::new(crate::PlatformMath::TABLE) };
}

fn platform() -> crate::PlatformMath {
    PLATFORM.with(|p| p.get())
}

/// Whether the platform's builtins are a GPU's: `exp` then also gets WGSL's `2|x|` ulps.
pub(crate) fn platform_is_gpu() -> bool {
    platform().gpu_builtins
}

/// Whether `exp` and `pow` get WGSL's argument-scaled bounds: a WGSL platform, or a GPU.
pub(crate) fn platform_scales_exp() -> bool {
    let p = platform();
    p.wgsl_bounds || p.gpu_builtins
}

/// An arithmetic result `(v, bound)` as the platform keeps it: a NaN carried over from a NaN
/// operand (`from_nan`) is uncertain where arithmetic may fold NaNs away
/// (`PlatformMath::nan_may_fold`: `x - x` is 0 there for a NaN `x`). A NaN the op makes from
/// numbers (`sqrt(-1)`) is certain: no identity folds it away.
pub(crate) fn arithmetic((v, bound): (f64, f64), from_nan: bool) -> (f64, f64) {
    if v.is_nan() && from_nan && platform().nan_may_fold { (v, f64::INFINITY) } else { (v, bound) }
}

/// The extra absolute allowance of op `name` (only `sin` and `cos` have one).
pub(crate) fn absolute_allowance(name: &str) -> f64 {
    if matches!(name, "sin" | "cos") && platform().gpu_builtins { platform().sin_cos_absolute } else { 0.0 }
}

/// A table row's allowance plus the platform math allowance if op `name` is platform math.
pub(crate) fn allowance(name: &str, ulps: f64) -> f64 {
    let builtin = matches!(name, "exp" | "log" | "sin" | "cos" | "tanh" | "sigmoid" | "gelu" | "pow");
    if builtin {
        ulps + platform().extra_half_ulps
    } else if name == "div" && platform_is_gpu() {
        // WGSL's float division is 2.5 ulps on a GPU (NVIDIA's was 2 ulps off); in half ulps.
        ulps + 5.0
    } else {
        ulps
    }
}

/// Evaluates a program with bounds for a device whose math library is `math` (its target's:
/// [`crate::Target::math`]); one [`RefValue`] per node, in order.
pub fn evaluate_on(program: &[ProgNode], math: &crate::PlatformMath) -> Vec<RefValue> {
    /// Puts the caller's setting back, on every way out.
    struct Restore(crate::PlatformMath);
    impl Drop for Restore {
        fn drop(&mut self) {
            PLATFORM.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(PLATFORM.with(|p| p.replace(*math)));
    evaluate(program)
}

/// Evaluates a program; one [`RefValue`] per node, in order, with the bounds of a math library
/// within the op table's allowances (or, inside [`evaluate_on`], of that call's). Panics on a
/// malformed program (an input index that is not earlier, a wrong number of inputs,
/// `Op::Input`): programs come from tests.
pub fn evaluate(program: &[ProgNode]) -> Vec<RefValue> {
    let mut out: Vec<RefValue> = Vec::with_capacity(program.len());
    for (n, node) in program.iter().enumerate() {
        let value = match node {
            ProgNode::Data { dtype, shape, values } => {
                assert_eq!(values.len(), shape.numel(), "node {n}: {} values for shape {shape}", values.len());
                RefValue::data(*dtype, shape, values)
            }
            ProgNode::IntData { dtype, shape, values } => {
                assert_eq!(values.len(), shape.numel(), "node {n}: {} values for shape {shape}", values.len());
                assert!(!dtype.is_float(), "node {n}: IntData needs an integer dtype, got {dtype}");
                let ints = values.iter().map(|&v| dtype.wrap_int(v)).collect();
                RefValue::from_ints(*dtype, shape.clone(), ints, vec![0.0; values.len()])
            }
            ProgNode::Op { op, dtype, shape, inputs } => {
                let ins: Vec<&RefValue> = inputs
                    .iter()
                    .map(|&i| {
                        assert!(i < n, "node {n} ({}): input {i} is not an earlier node", op.name());
                        &out[i]
                    })
                    .collect();
                let v = eval_op(op, *dtype, shape, &ins);
                assert_eq!(v.numel(), shape.numel(), "node {n} ({}): result size", op.name());
                v
            }
            ProgNode::Indexing { op, dtype, shape, inputs } => {
                assert!(inputs.iter().all(|&i| i < n), "node {n} ({op:?}): inputs must be earlier nodes");
                let ins: Vec<&RefValue> = inputs.iter().map(|&i| &out[i]).collect();
                let v = indexing::eval(*op, *dtype, shape, &ins);
                assert_eq!(v.numel(), shape.numel(), "node {n} ({op:?}): result size");
                v
            }
        };
        out.push(value);
    }
    out
}

fn eval_op(op: &Op, dtype: DType, shape: &Shape, ins: &[&RefValue]) -> RefValue {
    let arity = match op {
        Op::Input | Op::Full(_) | Op::Arange { .. } | Op::Rand { .. } | Op::Randn { .. } => 0,
        Op::Binary(_)
        | Op::Compare(_)
        | Op::Matmul
        | Op::QuantMatmul(_)
        | Op::Gather { .. }
        | Op::IndexSelect { .. } => 2,
        Op::Select | Op::ScatterAdd { .. } | Op::Scatter { .. } => 3,
        Op::Cat { .. } => ins.len().max(1),
        Op::Attention { part, .. } if part.is_backward() => 6,
        Op::Attention { .. } => 3,
        _ => 1,
    };
    assert_eq!(ins.len(), arity, "{}: expected {arity} inputs, got {}", op.name(), ins.len());
    match op {
        Op::Input => panic!("Op::Input never appears in a reference program; use ProgNode::Data"),
        Op::Event => panic!("user events carry no data and never appear in a reference program"),
        Op::Collective(_) => panic!("a collective spans devices; the reference runs one device's program"),
        Op::Full(v) => elementwise::full(dtype, shape, v.0),
        Op::Arange { start } => elementwise::arange(dtype, shape, *start),
        Op::Rand { lo, hi, seed } => elementwise::rand(dtype, shape, lo.0, hi.0, *seed),
        Op::Randn { seed } => elementwise::randn(dtype, shape, *seed),
        Op::Unary(u) => elementwise::unary(*u, dtype, shape, ins[0]),
        Op::Binary(b) => elementwise::binary(*b, dtype, shape, ins[0], ins[1]),
        Op::BinaryScalar { op, scalar, scalar_first } => {
            elementwise::binary_scalar(*op, dtype, ins[0], scalar.0, *scalar_first)
        }
        Op::Compare(c) => elementwise::compare(*c, shape, ins[0], ins[1]),
        Op::Select => elementwise::select(dtype, shape, ins[0], ins[1], ins[2]),
        Op::Clamp { lo, hi } => elementwise::clamp(dtype, ins[0], lo.0, hi.0),
        Op::Cast => elementwise::cast(dtype, ins[0]),
        Op::Reduce { op, dim, .. } => reduce::reduce(*op, *dim, dtype, shape, ins[0]),
        Op::Matmul => reduce::matmul(dtype, shape, ins[0], ins[1]),
        Op::QuantMatmul(layout) => reduce::matmul(dtype, shape, ins[0], &dequantized(layout, ins[1])),
        Op::Quantize(layout) => quantized(layout, ins[0]),
        Op::Gather { dim } => indexing::eval(indexing::IndexOp::Gather { dim: *dim }, dtype, shape, ins),
        Op::IndexSelect { dim } => indexing::eval(indexing::IndexOp::IndexSelect { dim: *dim }, dtype, shape, ins),
        Op::ScatterAdd { dim } => indexing::eval(indexing::IndexOp::ScatterAdd { dim: *dim }, dtype, shape, ins),
        Op::Scatter { dim } => indexing::eval(indexing::IndexOp::Scatter { dim: *dim }, dtype, shape, ins),
        Op::Reshape | Op::Contiguous | Op::ToDevice => movement::reshape(ins[0], shape),
        Op::Permute(perm) => movement::permute(ins[0], perm, shape),
        Op::Expand => movement::expand(ins[0], shape),
        Op::Narrow { dim, start, len } => movement::narrow(ins[0], *dim, *start, *len, shape),
        Op::Cat { dim } => movement::cat(ins, *dim, shape),
        Op::Attention { causal, part } => attention::eval(*part, *causal, dtype, shape, ins),
    }
}

/// A quantized weight's `[k, n]` f32 elements (`crate::quant`), each with a bound of half an
/// f32 ulp: a kernel may apply a scale to a sum of `value x input` terms instead of to each
/// value, which rounds differently by at most that much a term.
fn dequantized(layout: &crate::quant::QuantLayout, bytes: &RefValue) -> RefValue {
    let raw: Vec<u8> = (0..bytes.numel()).map(|i| bytes.int_at(i).0 as u8).collect();
    let values: Vec<f64> = layout.dequantize(&raw).into_iter().map(f64::from).collect();
    let half_ulp = DType::F32.epsilon();
    let bounds = values.iter().map(|v| v.abs() * half_ulp).collect();
    RefValue::from_floats(DType::F32, Shape::from([layout.k, layout.n]), values, bounds)
}

/// A weight's quantized bytes: exact when every element is, else all uncertain (rounding to a
/// level is discontinuous, and one element moves its whole block's scale).
fn quantized(layout: &crate::quant::QuantLayout, w: &RefValue) -> RefValue {
    let values: Vec<f32> = (0..w.numel()).map(|i| w.float_at(i).0 as f32).collect();
    let exact = (0..w.numel()).all(|i| w.float_at(i).1 == 0.0);
    let bytes: Vec<i64> = layout.quantize(&values).into_iter().map(i64::from).collect();
    let bounds = vec![if exact { 0.0 } else { bounds::UNCERTAIN }; bytes.len()];
    RefValue::from_ints(DType::U8, Shape::from([bytes.len()]), bytes, bounds)
}

impl RefValue {
    fn data(dtype: DType, shape: &Shape, values: &[f64]) -> RefValue {
        let bounds = vec![0.0; values.len()];
        if dtype.is_float() {
            let v = values.iter().map(|&v| dtype.round_f64(v)).collect();
            RefValue::from_floats(dtype, shape.clone(), v, bounds)
        } else {
            let v = values.iter().map(|&v| dtype.int_from_f64(v)).collect();
            RefValue::from_ints(dtype, shape.clone(), v, bounds)
        }
    }

    fn from_floats(dtype: DType, shape: Shape, values: Vec<f64>, bounds: Vec<f64>) -> RefValue {
        assert!(dtype.is_float() && values.len() == bounds.len());
        RefValue { dtype, shape, values: Values::Float(values), bounds }
    }

    fn from_ints(dtype: DType, shape: Shape, values: Vec<i64>, bounds: Vec<f64>) -> RefValue {
        assert!(!dtype.is_float() && values.len() == bounds.len());
        RefValue { dtype, shape, values: Values::Int(values), bounds }
    }

    /// A float element and its bound (panics on an integer tensor).
    fn float_at(&self, i: usize) -> (f64, f64) {
        match &self.values {
            Values::Float(v) => (v[i], self.bounds[i]),
            Values::Int(_) => panic!("float element of a {} tensor", self.dtype),
        }
    }

    /// An integer element and its bound (panics on a float tensor).
    fn int_at(&self, i: usize) -> (i64, f64) {
        match &self.values {
            Values::Int(v) => (v[i], self.bounds[i]),
            Values::Float(_) => panic!("integer element of a {} tensor", self.dtype),
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.bounds.len()
    }

    /// The reference value of element `i` (row-major; integers as f64).
    pub fn value(&self, i: usize) -> f64 {
        match &self.values {
            Values::Float(v) => v[i],
            Values::Int(v) => v[i] as f64,
        }
    }

    /// The exact value of element `i` of an integer or bool tensor; `None` for floats.
    pub fn value_i64(&self, i: usize) -> Option<i64> {
        match &self.values {
            Values::Int(v) => Some(v[i]),
            Values::Float(_) => None,
        }
    }

    /// The error bound of element `i`: 0 = exact, `f64::INFINITY` = uncertain.
    pub fn bound(&self, i: usize) -> f64 {
        self.bounds[i]
    }

    /// Whether element `i` is uncertain (skipped by the checks).
    pub fn is_uncertain(&self, i: usize) -> bool {
        self.bounds[i] == f64::INFINITY
    }

    /// All values as f64, row-major.
    pub fn values_f64(&self) -> Vec<f64> {
        (0..self.numel()).map(|i| self.value(i)).collect()
    }

    /// All bounds, row-major.
    pub fn bounds(&self) -> &[f64] {
        &self.bounds
    }

    /// Compares a device's result (converted to f64; exact for integer dtypes) element by
    /// element: a NaN or infinite reference must be matched exactly, a finite one to within its
    /// bound; uncertain elements are skipped. The error lists up to 5 mismatches.
    pub fn check(&self, actual: &[f64]) -> Result<CheckStats, String> {
        self.compare_with(actual.len(), |i| {
            let (v, b, a) = (self.value(i), self.bounds[i], actual[i]);
            let ok = if v.is_nan() {
                a.is_nan()
            } else if v.is_infinite() {
                a == v
            } else {
                a.is_finite() && (a - v).abs() <= b
            };
            (ok, format!("{a:e}"))
        })
    }

    /// Exact comparison for integer and bool tensors (for i64 values beyond 2^53).
    pub fn check_i64(&self, actual: &[i64]) -> Result<CheckStats, String> {
        let Values::Int(values) = &self.values else {
            return Err(format!("check_i64 on a {} tensor of shape {}; use check", self.dtype, self.shape));
        };
        self.compare_with(actual.len(), |i| (actual[i] == values[i], actual[i].to_string()))
    }

    /// The shared loop of the checks: `agrees(i)` says whether element `i` matches and how to
    /// print the actual value.
    fn compare_with(&self, len: usize, agrees: impl Fn(usize) -> (bool, String)) -> Result<CheckStats, String> {
        let (dtype, shape) = (self.dtype, &self.shape);
        if len != self.numel() {
            return Err(format!("{dtype} tensor of shape {shape}: expected {} elements, got {len}", self.numel()));
        }
        let mut stats = CheckStats::default();
        let mut bad = Vec::new();
        let mut n_bad = 0;
        for i in 0..len {
            if self.is_uncertain(i) {
                stats.uncertain += 1;
                continue;
            }
            stats.checked += 1;
            let (ok, actual) = agrees(i);
            if !ok {
                n_bad += 1;
                if bad.len() < 5 {
                    bad.push((i, actual));
                }
            }
        }
        if n_bad == 0 {
            return Ok(stats);
        }
        let mut msg = format!(
            "{dtype} tensor of shape {shape}: {n_bad} of {} checked elements differ from the reference \
             ({} uncertain ones skipped):",
            stats.checked, stats.uncertain
        );
        for (i, actual) in bad {
            let (v, b) = (self.describe(i), self.bounds[i]);
            let _ = write!(msg, "\n  element {i} at {:?}: reference {v} ± {b:e}, actual {actual}", unravel(shape, i));
        }
        if n_bad > 5 {
            let _ = write!(msg, "\n  ... and {} more", n_bad - 5);
        }
        Err(msg)
    }

    fn describe(&self, i: usize) -> String {
        match &self.values {
            Values::Float(v) => format!("{:e}", v[i]),
            Values::Int(v) => v[i].to_string(),
        }
    }
}

/// The multi-index of linear (row-major) index `i` in `shape`.
pub fn unravel(shape: &Shape, mut i: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.rank()];
    for (slot, &d) in idx.iter_mut().zip(shape.dims()).rev() {
        *slot = i % d.max(1);
        i /= d.max(1);
    }
    idx
}
