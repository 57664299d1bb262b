//! Elementwise operations. The unary, binary and comparison methods are generated from the op
//! table (`braid_graph::table`), so an op added there appears here without further code.

use super::{Tensor, inferred, same_device};
use braid_graph::table::{BinaryOp, CompareOp, UnaryOp};
use braid_graph::{DType, Op, Scalar, infer};

macro_rules! unary_methods {
    ($($variant:ident { method: $method:ident, doc: $doc:literal, $($rest:tt)* };)*) => {
        impl Tensor {
            $(
                #[doc = $doc]
                #[track_caller]
                pub fn $method(&self) -> Tensor {
                    self.unary(UnaryOp::$variant)
                }
            )*
        }
    };
}

macro_rules! binary_methods {
    ($($variant:ident { method: $method:ident, doc: $doc:literal, $($rest:tt)* };)*) => {
        impl Tensor {
            $(
                #[doc = $doc]
                #[track_caller]
                pub fn $method(&self, other: &Tensor) -> Tensor {
                    self.binary(BinaryOp::$variant, other)
                }
            )*
        }
    };
}

macro_rules! compare_methods {
    ($($variant:ident { method: $method:ident, doc: $doc:literal, $($rest:tt)* };)*) => {
        impl Tensor {
            $(
                #[doc = $doc]
                #[doc = ""]
                #[doc = "Both operands have one dtype; shapes broadcast; the result is `Bool`."]
                #[track_caller]
                pub fn $method(&self, other: &Tensor) -> Tensor {
                    self.compare(CompareOp::$variant, other)
                }
            )*
        }
    };
}

braid_graph::unary_ops!(unary_methods);
braid_graph::binary_ops!(binary_methods);
braid_graph::compare_ops!(compare_methods);

impl Tensor {
    /// Applies a unary op of the table.
    #[track_caller]
    pub fn unary(&self, op: UnaryOp) -> Tensor {
        let (shape, dtype) = inferred(op.name(), infer::unary(op, self.shape(), self.dtype()), &[("x", self)]);
        Tensor::record(Op::Unary(op), dtype, shape, self.device(), &[self])
    }

    /// Applies a binary op of the table, with NumPy broadcasting.
    #[track_caller]
    pub fn binary(&self, op: BinaryOp, other: &Tensor) -> Tensor {
        if let Some(p) = Tensor::autocast_promoted(&[self, other]) {
            return p[0].binary(op, &p[1]);
        }
        let operands = [("lhs", self), ("rhs", other)];
        same_device(op.name(), &operands);
        let r = infer::binary(op, (self.shape(), self.dtype()), (other.shape(), other.dtype()));
        let (shape, dtype) = inferred(op.name(), r, &operands);
        Tensor::record(Op::Binary(op), dtype, shape, self.device(), &[self, other])
    }

    /// `self op scalar`, or `scalar op self` when `scalar_first`. The scalar is converted to
    /// the tensor's dtype (it must be representable in an integer dtype).
    #[track_caller]
    pub fn binary_scalar(&self, op: BinaryOp, scalar: f64, scalar_first: bool) -> Tensor {
        let r = infer::binary_scalar(op, self.shape(), self.dtype(), scalar);
        let (shape, dtype) = inferred(op.name(), r, &[("x", self)]);
        Tensor::record(
            Op::BinaryScalar { op, scalar: Scalar(scalar), scalar_first },
            dtype,
            shape,
            self.device(),
            &[self],
        )
    }

    /// Applies a comparison of the table.
    #[track_caller]
    pub fn compare(&self, op: CompareOp, other: &Tensor) -> Tensor {
        if let Some(p) = Tensor::autocast_promoted(&[self, other]) {
            return p[0].compare(op, &p[1]);
        }
        let operands = [("lhs", self), ("rhs", other)];
        same_device(op.name(), &operands);
        let r = infer::compare(op.name(), (self.shape(), self.dtype()), (other.shape(), other.dtype()));
        let (shape, dtype) = inferred(op.name(), r, &operands);
        Tensor::record(Op::Compare(op), dtype, shape, self.device(), &[self, other])
    }

    /// `where(self, a, b)`: `a` where `self` is true, else `b` (all three broadcast).
    #[track_caller]
    pub fn select(&self, a: &Tensor, b: &Tensor) -> Tensor {
        if let Some(p) = Tensor::autocast_promoted(&[a, b]) {
            return self.select(&p[0], &p[1]);
        }
        let operands = [("cond", self), ("a", a), ("b", b)];
        same_device("select", &operands);
        let r = infer::select((self.shape(), self.dtype()), (a.shape(), a.dtype()), (b.shape(), b.dtype()));
        let (shape, dtype) = inferred("select", r, &operands);
        Tensor::record(Op::Select, dtype, shape, self.device(), &[self, a, b])
    }

    /// `value` where `mask` (Bool, broadcast to this shape) is true, else this tensor's element.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &cpu);
    /// let y = x.masked_fill(&x.gt(&Tensor::full((), 1.5, DType::F32, &cpu)), f64::NEG_INFINITY);
    /// assert_eq!(y.to_vec::<f32>().unwrap(), vec![1.0, f32::NEG_INFINITY, f32::NEG_INFINITY]);
    /// ```
    #[track_caller]
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Tensor {
        let operands = [("x", self), ("mask", mask)];
        same_device("masked_fill", &operands);
        if mask.dtype() != DType::Bool || !mask.shape().broadcasts_to(self.shape()) {
            let problem = "the mask must be a Bool tensor that broadcasts to the tensor's shape";
            super::misuse("masked_fill", problem, &[("x", self.describe()), ("mask", mask.describe())]);
        }
        if !self.dtype().represents(value) {
            super::misuse(
                "masked_fill",
                &format!("{value} is not representable in {}", self.dtype()),
                &[("x", self.describe())],
            );
        }
        let fill = Tensor::full((), value, self.dtype(), self.device());
        mask.select(&fill, self)
    }

    /// `min(max(x, lo), hi)`; NaN stays NaN. An infinite bound (`f64::NEG_INFINITY`,
    /// `f64::INFINITY`) clamps on one side only, integer tensors included.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let i = Tensor::from_vec(vec![-3i64, 5, i64::MAX], [3], &cpu);
    /// assert_eq!(i.clamp(0.0, f64::INFINITY).to_vec::<i64>().unwrap(), vec![0, 5, i64::MAX]);
    /// ```
    #[track_caller]
    pub fn clamp(&self, lo: f64, hi: f64) -> Tensor {
        // An integer dtype has no infinity to pass to the kernels: one side is a maximum or a
        // minimum with the other bound (both compare exactly, as the clamp does).
        let d = self.dtype();
        let bound = |v: f64, open: f64| v == open || d.represents(v);
        let one_sided = lo == f64::NEG_INFINITY || hi == f64::INFINITY;
        if d.is_int() && one_sided && lo <= hi && bound(lo, f64::NEG_INFINITY) && bound(hi, f64::INFINITY) {
            return match (lo.is_finite(), hi.is_finite()) {
                (true, false) => self.binary_scalar(BinaryOp::Maximum, lo, false),
                (false, true) => self.binary_scalar(BinaryOp::Minimum, hi, false),
                _ => self.to_dtype(self.dtype()),
            };
        }
        let (shape, dtype) = inferred("clamp", infer::clamp(self.shape(), self.dtype(), lo, hi), &[("x", self)]);
        Tensor::record(Op::Clamp { lo: Scalar(lo), hi: Scalar(hi) }, dtype, shape, self.device(), &[self])
    }

    /// `x ^ exponent` for a scalar exponent.
    #[track_caller]
    pub fn powf(&self, exponent: f64) -> Tensor {
        self.binary_scalar(BinaryOp::Pow, exponent, false)
    }

    /// Conversion to `dtype`: floats round to nearest; float to integer truncates towards zero
    /// and saturates (NaN gives 0); integers wrap; to bool is `x != 0`; bool is 0 or 1. The
    /// result is always a new value, even for the same dtype (so in-place updates of one never
    /// reach the other).
    #[track_caller]
    pub fn to_dtype(&self, dtype: DType) -> Tensor {
        Tensor::record(Op::Cast, dtype, self.shape().clone(), self.device(), &[self])
    }

    /// This tensor in `dtype`: a handle of the same value when it has that dtype already (as
    /// PyTorch's `x.to(dtype)`), else [`Tensor::to_dtype`]'s conversion. Where a cast is only
    /// there to match dtypes, this records nothing for a tensor that matches (a copy of a
    /// broadcast operand would be a kernel of its own).
    #[track_caller]
    pub fn as_dtype(&self, dtype: DType) -> Tensor {
        if self.dtype() == dtype { self.clone() } else { self.to_dtype(dtype) }
    }

    /// Shorthand for `self.to_dtype(DType::F32)`.
    #[track_caller]
    pub fn to_f32(&self) -> Tensor {
        self.to_dtype(DType::F32)
    }
}
