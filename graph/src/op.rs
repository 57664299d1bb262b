//! The operations a graph node can hold.
//!
//! Elementwise ops are rows of the op table ([`crate::table`]); this enum adds sources,
//! reductions, matrix products and movement. An `Op` is pure description: its result's shape
//! and dtype live on the node, and how it runs is decided by lowering.

use crate::quant::QuantLayout;
use crate::table::{BinaryOp, CompareOp, UnaryOp};
use serde::{Deserialize, Serialize};
use std::fmt;

/// An f64 that is compared and hashed by its bits, so that ops holding scalars can key caches.
#[derive(Clone, Copy, Serialize, Deserialize)]
pub struct Scalar(pub f64);

impl PartialEq for Scalar {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}
impl Eq for Scalar {}
impl std::hash::Hash for Scalar {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state)
    }
}
impl fmt::Debug for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Reductions along one dimension (or over everything).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
    /// Index of the first maximum (NaN counts as the largest value); the result is the node's
    /// dtype, `I64` or `I32` (kernels find it as an i64 and convert it when they store it).
    ArgMax,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
        }
    }
}

/// What a node computes. The node's shape and dtype complete the description (for example
/// `Reshape` takes its target shape from the node).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Op {
    /// Data supplied by the user (`from_vec`): a leaf, materialised when recorded.
    Input,
    /// Every element equal to a constant.
    Full(Scalar),
    /// `start, start + 1, ...` along the single dimension, computed as i64 and converted to the
    /// node's dtype (I64 unless asked otherwise).
    Arange {
        start: i64,
    },
    /// Uniform on `[lo, hi)` from the counter-based generator of [`crate::rng`].
    Rand {
        lo: Scalar,
        hi: Scalar,
        seed: u64,
    },
    /// Standard normal from the counter-based generator.
    Randn {
        seed: u64,
    },
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// A binary op with a scalar operand: `x op s`, or `s op x` when `scalar_first`.
    BinaryScalar {
        op: BinaryOp,
        scalar: Scalar,
        scalar_first: bool,
    },
    Compare(CompareOp),
    /// `cond.select(a, b)`: inputs are cond, a, b.
    Select,
    /// `min(max(x, lo), hi)`.
    Clamp {
        lo: Scalar,
        hi: Scalar,
    },
    /// Conversion to the node's dtype.
    Cast,
    /// Reduction along `dim`, or over all elements when `dim` is `None`.
    Reduce {
        op: ReduceOp,
        dim: Option<usize>,
        keepdim: bool,
    },
    /// `[.., m, k] x [.., k, n]` with broadcast batch dimensions.
    Matmul,
    /// `x [m, k]` times a quantized weight `[k, n]`: inputs `[x, weight]`, the weight a `U8`
    /// value of the layout's bytes ([`crate::quant`]). Each weight element is dequantized in
    /// f32, the dot products accumulate in f32, and the result `[m, n]` has x's (float) dtype.
    /// (Boxed, as `Permute`.)
    QuantMatmul(Box<QuantLayout>),
    /// A float `[k, n]` weight quantized to the layout's bytes (a `U8` value; see
    /// [`crate::quant`] for the rounding). Recorded on CPU devices only: quantizing is a
    /// load-time step, and a device's weights travel to the CPU and back for it.
    Quantize(Box<QuantLayout>),
    /// Same elements, the node's shape.
    Reshape,
    /// The node's dimension `i` is input dimension `perm[i]`. (Boxed: the largest variant sets
    /// the size of every recorded node, and graph nodes are moved whole.)
    Permute(Box<[usize]>),
    /// Broadcast to the node's shape.
    Expand,
    Narrow {
        dim: usize,
        start: usize,
        len: usize,
    },
    Cat {
        dim: usize,
    },
    /// `out[p] = src[p with dimension `dim` replaced by index[p]]`: inputs `[src, index]`, the
    /// index `I64` or `I32` with the node's shape, which equals the source's along every other
    /// dimension. An index outside `0..src.dims[dim]` reads zero (every dtype's zero bits).
    Gather {
        dim: usize,
    },
    /// `out[pre.., i.., post..] = src[pre.., index[i..], post..]`: inputs `[src, index]`, the
    /// index `I64` or `I32` of any shape, the result the source's shape with dimension `dim` replaced by
    /// the index's dimensions (`index_select`, `embedding`). An index outside
    /// `0..src.dims[dim]` reads zero.
    IndexSelect {
        dim: usize,
    },
    /// `base` plus, at each element, the sum in order along `dim` of the `src` elements whose
    /// index names it: inputs `[base, index, src]`, the index `I64` or `I32` of the source's shape, which
    /// equals the base's along every other dimension (`scatter_add`). An index outside
    /// `0..base.dims[dim]` adds nothing.
    ScatterAdd {
        dim: usize,
    },
    /// `base` with, for each source element in order along `dim`, `src[p]` written at `p` with
    /// dimension `dim` replaced by `j = index[p]` (the last write to an element wins): inputs
    /// `[base, index, src]`, shaped as `ScatterAdd`'s, any dtype. An index outside
    /// `0..base.dims[dim]` writes nothing (`scatter`, a key/value cache's new rows). The
    /// scheduler writes it over the base's buffer when it may (then only the source's elements
    /// are stored).
    Scatter {
        dim: usize,
    },
    /// A contiguous copy.
    Contiguous,
    /// A copy to the node's device.
    ToDevice,
    /// A user event: a point in its stream's order, after the work recorded on the stream
    /// before it (its control inputs). Carries no data and runs no kernel.
    Event,
    /// This device's part of a collective over a group of devices (`braid::dist`).
    Collective(Collective),
    /// One part of scaled dot-product attention over `q [.., sq, d]`, `k [.., sk, d]` and
    /// `v [.., sk, d]` (the same leading dimensions), with scores `s = q k^T / sqrt(d)` and,
    /// when `causal`, query `i` seeing keys `j <= i` (PyTorch's `is_causal`: the top-left
    /// triangle). See [`AttentionPart`] for the parts and their inputs. The parts share inputs
    /// so that fusion runs the siblings of one pass as one kernel (the output with its
    /// log-sum-exp; the key gradient with the value gradient); the `[sq, sk]` scores are never
    /// a value of the graph.
    Attention {
        causal: bool,
        part: AttentionPart,
    },
}

/// What an [`Op::Attention`] node computes. The forward parts read `[q, k, v]`; the backward
/// parts read `[q, k, v, d_out, lse, delta]`, where `lse` is the `Lse` part and `delta` is
/// `rowsum(d_out * out)` (both in the statistics dtype: f64 for f64 inputs, f32 otherwise).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum AttentionPart {
    /// `softmax(s) v`: `[.., sq, d]` in the inputs' dtype.
    Out,
    /// The log-sum-exp of each query's scores, `[.., sq]` in the statistics dtype.
    Lse,
    /// The gradient of `q`: `[.., sq, d]`.
    GradQ,
    /// The gradient of `k`: `[.., sk, d]`.
    GradK,
    /// The gradient of `v`: `[.., sk, d]`.
    GradV,
}

impl AttentionPart {
    pub fn name(self) -> &'static str {
        match self {
            AttentionPart::Out => "attention",
            AttentionPart::Lse => "attention_lse",
            AttentionPart::GradQ => "attention_grad_q",
            AttentionPart::GradK => "attention_grad_k",
            AttentionPart::GradV => "attention_grad_v",
        }
    }

    /// Whether the part is one of the backward pass's (it reads six inputs).
    pub fn is_backward(self) -> bool {
        matches!(self, AttentionPart::GradQ | AttentionPart::GradK | AttentionPart::GradV)
    }

    /// Whether two parts run as one kernel when they read the same inputs: the forward pair,
    /// and the key and value gradients (which walk the same tiles). The query gradient walks the
    /// other way and runs alone (no float atomics, so every result is reproducible).
    pub fn runs_with(self, other: AttentionPart) -> bool {
        use AttentionPart::*;
        matches!((self, other), (Out | Lse, Out | Lse) | (GradK | GradV, GradK | GradV))
    }
}

/// One device's part of a collective operation over a group of devices: every member records
/// the same kind, in the same order, on tensors of the same shape. Runs on the device's
/// communication stream as a library call (NCCL on CUDA, a host rendezvous between CPU
/// devices), never fused.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Collective {
    pub kind: CollectiveKind,
    /// The group's id (unique in the process).
    pub group: u64,
    /// This device's rank in the group, and the group's size.
    pub rank: u32,
    pub size: u32,
}

/// What a collective computes; gathering and scattering split along the first dimension.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// Every rank gets the reduction (sum, mean, max or min) of all ranks' tensors.
    AllReduce(ReduceOp),
    /// Every rank gets all ranks' tensors concatenated in rank order.
    AllGather,
    /// Rank `r` gets part `r` (of `size` equal parts) of the reduction of all ranks' tensors.
    ReduceScatter(ReduceOp),
    /// Every rank gets rank `root`'s tensor.
    Broadcast { root: u32 },
}

impl CollectiveKind {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce(_) => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter(_) => "reduce_scatter",
            CollectiveKind::Broadcast { .. } => "broadcast",
        }
    }
}

impl Op {
    /// Short name for dumps and messages.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input => "input",
            Op::Full(_) => "full",
            Op::Arange { .. } => "arange",
            Op::Rand { .. } => "rand",
            Op::Randn { .. } => "randn",
            Op::Unary(u) => u.name(),
            Op::Binary(b) | Op::BinaryScalar { op: b, .. } => b.name(),
            Op::Compare(c) => c.name(),
            Op::Select => "select",
            Op::Clamp { .. } => "clamp",
            Op::Cast => "cast",
            Op::Reduce { op, .. } => op.name(),
            Op::Matmul => "matmul",
            Op::QuantMatmul(_) => "quant_matmul",
            Op::Quantize(_) => "quantize",
            Op::Reshape => "reshape",
            Op::Permute(_) => "permute",
            Op::Expand => "expand",
            Op::Narrow { .. } => "narrow",
            Op::Cat { .. } => "cat",
            Op::Gather { .. } => "gather",
            Op::IndexSelect { .. } => "index_select",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::Scatter { .. } => "scatter",
            Op::Contiguous => "contiguous",
            Op::ToDevice => "to_device",
            Op::Event => "event",
            Op::Collective(c) => c.kind.name(),
            Op::Attention { part, .. } => part.name(),
        }
    }

    /// Elementwise ops: output element `i` depends only on input elements at the same
    /// (broadcast) position. These are what fusion chains.
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_)
                | Op::Binary(_)
                | Op::BinaryScalar { .. }
                | Op::Compare(_)
                | Op::Select
                | Op::Clamp { .. }
                | Op::Cast
        )
    }
}
