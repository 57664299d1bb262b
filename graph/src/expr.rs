//! The scalar expression language in which the op table states each elementwise op's kernel.
//!
//! An expression is a small DAG of primitives over the values loaded for one element (`Load`),
//! constants, the element's index and counter-based random numbers. Every backend evaluates or
//! prints these primitives, so an op defined here once runs everywhere. This module only builds
//! expressions; evaluating them is a device's job.

use crate::dtype::DType;
use crate::op::ReduceOp;
use serde::{Deserialize, Serialize};

/// Index of a node inside an [`Expr`].
pub type ExprId = u32;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum PrimUnary {
    Neg,
    Exp,
    Log,
    Sqrt,
    Abs,
    Sin,
    Cos,
    Tanh,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum PrimBinary {
    Add,
    Sub,
    Mul,
    /// Floats: IEEE division. Integers: truncating, wrapping, and `x / 0 == 0`.
    Div,
    Pow,
    /// NaN-propagating maximum (NumPy `maximum`).
    Max,
    /// NaN-propagating minimum (NumPy `minimum`).
    Min,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum PrimCmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// Distribution of a [`ExprOp::Random`] primitive.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Distribution {
    /// Uniform on `[0, 1)`.
    Uniform,
    /// Standard normal.
    Normal,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum ExprOp {
    /// The value of load slot `n` at this element (converted to its compute type).
    Load(u16),
    /// A constant, stored as f64 bits (integers are exact up to 2^53; wider ones use
    /// `ConstInt`).
    Const(u64),
    /// An integer constant (exact for every integer dtype).
    ConstInt(i64),
    /// The element's linear index in the kernel's index space (an `I64`).
    Index,
    /// A counter-based random number for the `I64` operand (see [`crate::rng`]).
    Random {
        seed: u64,
        dist: Distribution,
        operand: ExprId,
    },
    Unary(PrimUnary, ExprId),
    Binary(PrimBinary, ExprId, ExprId),
    Cmp(PrimCmp, ExprId, ExprId),
    /// `cond ? a : b` with a `Bool` condition.
    Select(ExprId, ExprId, ExprId),
    /// Conversion to the storage dtype named here (f16/bf16 round but stay in f32 registers).
    Cast(DType, ExprId),
    /// The reduction of `operand` along a row kernel's axis (only in row kernels): one value per
    /// row, broadcast to every element of the row where later nodes use it.
    Reduce(ReduceOp, ExprId),
}

impl ExprOp {
    /// The nodes this node reads, in order (for dependency walks).
    pub fn operands(&self) -> Vec<usize> {
        match *self {
            ExprOp::Load(_) | ExprOp::Const(_) | ExprOp::ConstInt(_) | ExprOp::Index => vec![],
            ExprOp::Random { operand, .. } => vec![operand as usize],
            ExprOp::Unary(_, a) | ExprOp::Cast(_, a) | ExprOp::Reduce(_, a) => vec![a as usize],
            ExprOp::Binary(_, a, b) | ExprOp::Cmp(_, a, b) => vec![a as usize, b as usize],
            ExprOp::Select(c, a, b) => vec![c as usize, a as usize, b as usize],
        }
    }
}

/// One node: an operation and the compute dtype of its result (never F16/BF16).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct ExprNode {
    pub op: ExprOp,
    pub dtype: DType,
}

/// An expression DAG in topological order (operands always precede their users).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Default, Serialize, Deserialize)]
pub struct Expr {
    pub nodes: Vec<ExprNode>,
}

/// Builds expressions; each helper checks operand dtypes, so the op table cannot describe an
/// ill-typed kernel.
#[derive(Default, Debug)]
pub struct ExprBuilder {
    expr: Expr,
}

impl ExprBuilder {
    pub fn new() -> ExprBuilder {
        ExprBuilder::default()
    }

    pub fn finish(self) -> Expr {
        self.expr
    }

    pub fn dtype(&self, id: ExprId) -> DType {
        self.expr.nodes[id as usize].dtype
    }

    fn push(&mut self, op: ExprOp, dtype: DType) -> ExprId {
        debug_assert!(!matches!(dtype, DType::F16 | DType::BF16), "compute dtypes only");
        self.expr.nodes.push(ExprNode { op, dtype });
        (self.expr.nodes.len() - 1) as ExprId
    }

    /// Loads slot `slot`, stored as `storage`; the value lives in `storage.compute()`.
    pub fn load(&mut self, slot: u16, storage: DType) -> ExprId {
        self.push(ExprOp::Load(slot), storage.compute())
    }

    /// A constant of compute dtype `dtype` (integers and bools are converted exactly; the
    /// caller has validated that `v` is representable).
    pub fn constant(&mut self, v: f64, dtype: DType) -> ExprId {
        let dtype = dtype.compute();
        if dtype.is_float() {
            self.push(ExprOp::Const(v.to_bits()), dtype)
        } else {
            self.push(ExprOp::ConstInt(v as i64), dtype)
        }
    }

    /// A constant with the dtype of `like`.
    pub fn constant_like(&mut self, like: ExprId, v: f64) -> ExprId {
        let d = self.dtype(like);
        self.constant(v, d)
    }

    pub fn int_constant(&mut self, v: i64, dtype: DType) -> ExprId {
        assert!(!dtype.is_float());
        self.push(ExprOp::ConstInt(v), dtype)
    }

    pub fn index(&mut self) -> ExprId {
        self.push(ExprOp::Index, DType::I64)
    }

    pub fn random(&mut self, seed: u64, dist: Distribution, operand: ExprId, dtype: DType) -> ExprId {
        assert_eq!(self.dtype(operand), DType::I64, "random numbers are indexed by an i64");
        assert!(dtype.is_float());
        self.push(ExprOp::Random { seed, dist, operand }, dtype.compute())
    }

    pub fn unary(&mut self, op: PrimUnary, x: ExprId) -> ExprId {
        let d = self.dtype(x);
        self.push(ExprOp::Unary(op, x), d)
    }

    pub fn binary(&mut self, op: PrimBinary, a: ExprId, b: ExprId) -> ExprId {
        let d = self.dtype(a);
        assert_eq!(d, self.dtype(b), "binary primitive {op:?} on different dtypes");
        self.push(ExprOp::Binary(op, a, b), d)
    }

    pub fn cmp(&mut self, op: PrimCmp, a: ExprId, b: ExprId) -> ExprId {
        assert_eq!(self.dtype(a), self.dtype(b), "comparison {op:?} on different dtypes");
        self.push(ExprOp::Cmp(op, a, b), DType::Bool)
    }

    pub fn select(&mut self, cond: ExprId, a: ExprId, b: ExprId) -> ExprId {
        assert_eq!(self.dtype(cond), DType::Bool);
        let d = self.dtype(a);
        assert_eq!(d, self.dtype(b), "select branches of different dtypes");
        self.push(ExprOp::Select(cond, a, b), d)
    }

    /// A reduction over a row kernel's axis: `ArgMax` gives i64, the others keep the dtype.
    pub fn reduce(&mut self, op: ReduceOp, x: ExprId) -> ExprId {
        let d = if op == ReduceOp::ArgMax { DType::I64 } else { self.dtype(x) };
        self.push(ExprOp::Reduce(op, x), d)
    }

    /// `x` converted to `to` (rounded to it and kept in its compute dtype, for f16 and bf16). A
    /// rounding to a half type of a value just rounded to it is `x` itself (the same bits).
    pub fn cast(&mut self, to: DType, x: ExprId) -> ExprId {
        let half = matches!(to, DType::F16 | DType::BF16);
        if half && matches!(self.expr.nodes[x as usize].op, ExprOp::Cast(t, _) if t == to) {
            return x;
        }
        self.push(ExprOp::Cast(to, x), to.compute())
    }

    /// The node a store of `value` as `storage` may store instead: the f32 operand of a
    /// rounding to the same half type (storing rounds it once, the same bits as rounding it,
    /// widening it back and rounding again); otherwise `value`.
    pub fn stored(&self, value: ExprId, storage: DType) -> ExprId {
        match self.expr.nodes[value as usize].op {
            ExprOp::Cast(to, a)
                if to == storage && matches!(to, DType::F16 | DType::BF16) && self.dtype(a) == DType::F32 =>
            {
                a
            }
            _ => value,
        }
    }

    // Shorthands used by the op table.
    pub fn add(&mut self, a: ExprId, b: ExprId) -> ExprId {
        self.binary(PrimBinary::Add, a, b)
    }
    pub fn sub(&mut self, a: ExprId, b: ExprId) -> ExprId {
        self.binary(PrimBinary::Sub, a, b)
    }
    pub fn mul(&mut self, a: ExprId, b: ExprId) -> ExprId {
        self.binary(PrimBinary::Mul, a, b)
    }
    pub fn div(&mut self, a: ExprId, b: ExprId) -> ExprId {
        self.binary(PrimBinary::Div, a, b)
    }
    pub fn max(&mut self, a: ExprId, b: ExprId) -> ExprId {
        self.binary(PrimBinary::Max, a, b)
    }
    pub fn min(&mut self, a: ExprId, b: ExprId) -> ExprId {
        self.binary(PrimBinary::Min, a, b)
    }
    pub fn neg(&mut self, x: ExprId) -> ExprId {
        self.unary(PrimUnary::Neg, x)
    }
    pub fn exp(&mut self, x: ExprId) -> ExprId {
        self.unary(PrimUnary::Exp, x)
    }
    pub fn tanh(&mut self, x: ExprId) -> ExprId {
        self.unary(PrimUnary::Tanh, x)
    }
    pub fn sqrt(&mut self, x: ExprId) -> ExprId {
        self.unary(PrimUnary::Sqrt, x)
    }
}

impl Expr {
    /// The id of the last node, which is the expression's result by convention.
    pub fn root(&self) -> ExprId {
        (self.nodes.len() - 1) as ExprId
    }
}
