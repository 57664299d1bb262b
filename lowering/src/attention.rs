//! The attention kernel of the IR ([`AttentionKernel`]) and its lowering from an attention
//! segment (`SegmentKind::Attention`).
//!
//! One kernel runs one pass of scaled dot-product attention over `batch` independent problems:
//! the forward pass (the output and/or the log-sum-exp), the query gradient, or the key and/or
//! value gradients. What it computes is `Op::Attention`'s definition (the reference interpreter
//! states the numeric contract: scores and products accumulated in the compute dtype,
//! probabilities rounded to the inputs' dtype before they multiply values). Targets choose the
//! tiling; none may store the `[sq, sk]` scores in memory that outlives a tile.

use crate::kernel::{Load, Store, View, check_args};
use braid_graph::{AttentionPart, DType, Shape};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// The backward pass's extra inputs: views over `[batch.., sq, d]` (the output's gradient) and
/// `[batch.., sq]` (the log-sum-exp and `delta = rowsum(d_out * out)`, in the statistics dtype).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct AttentionGradInputs {
    pub d_out: Load,
    pub lse: Load,
    pub delta: Load,
}

/// Which pass a kernel runs, and the arguments it writes (contiguous, `None`: not wanted).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum AttentionPass {
    /// `out [batch, sq, d]` and `lse [batch, sq]`.
    Forward { out: Option<u16>, lse: Option<u16> },
    /// `dq [batch, sq, d]`: one query tile against every key tile.
    GradQ { grads: AttentionGradInputs, dq: u16 },
    /// `dk` and `dv [batch, sk, d]`: one key tile against every query tile.
    GradKv { grads: AttentionGradInputs, dk: Option<u16>, dv: Option<u16> },
}

/// Scaled dot-product attention (`Op::Attention`) over `q [batch.., sq, d]` and `k`, `v
/// [batch.., sk, d]`, read through views (any strides: a head split by a permute is read where
/// it lies), with scale `1/sqrt(d)` and, when `causal`, query `i` seeing keys `j <= i`.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct AttentionKernel {
    /// The dtype of q, k, v, the output and the gradients.
    pub dtype: DType,
    pub causal: bool,
    /// The leading dimensions (batch, heads, ...); their product is the number of problems.
    pub batch: SmallVec<[usize; 4]>,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub q: Load,
    pub k: Load,
    pub v: Load,
    pub pass: AttentionPass,
}

impl AttentionKernel {
    /// Independent problems (the product of the leading dimensions).
    pub fn problems(&self) -> usize {
        self.batch.iter().product()
    }

    /// The dtype of the log-sum-exp and delta: f64 for f64 inputs, f32 otherwise.
    pub fn stats_dtype(&self) -> DType {
        braid_graph::infer::attention_stats(self.dtype)
    }

    /// `1/sqrt(d)`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.d as f64).sqrt()
    }

    fn dims(&self, rows: usize, cols: Option<usize>) -> SmallVec<[usize; 4]> {
        let mut dims = self.batch.clone();
        dims.push(rows);
        dims.extend(cols);
        dims
    }

    /// The checks every target runs before touching memory: float dtypes as the op states
    /// them, views over the right shapes, outputs their own contiguous arguments, and every
    /// access within its argument.
    pub fn check(&self, arg: impl Fn(u16) -> Option<(DType, usize)>) -> Result<(), String> {
        let (dtype, stats) = (self.dtype, self.stats_dtype());
        if !dtype.is_float() || self.d == 0 || self.sk == 0 {
            return Err(format!("attention of {dtype} with head dimension {} over {} keys", self.d, self.sk));
        }
        let mut loads = vec![(&self.q, self.sq, true), (&self.k, self.sk, true), (&self.v, self.sk, true)];
        let mut stores: Vec<Store> = Vec::new();
        let store = |arg: u16, dtype: DType, dims: SmallVec<[usize; 4]>| Store {
            arg,
            dtype,
            view: View::contiguous(&Shape::new(&dims)),
            value: 0,
        };
        let grads = match &self.pass {
            AttentionPass::Forward { out, lse } => {
                stores.extend(out.map(|a| store(a, dtype, self.dims(self.sq, Some(self.d)))));
                stores.extend(lse.map(|a| store(a, stats, self.dims(self.sq, None))));
                None
            }
            AttentionPass::GradQ { grads, dq } => {
                stores.push(store(*dq, dtype, self.dims(self.sq, Some(self.d))));
                Some(grads)
            }
            AttentionPass::GradKv { grads, dk, dv } => {
                for a in [dk, dv].into_iter().flatten() {
                    stores.push(store(*a, dtype, self.dims(self.sk, Some(self.d))));
                }
                Some(grads)
            }
        };
        if stores.is_empty() {
            return Err("an attention kernel that writes nothing".into());
        }
        if let Some(g) = grads {
            loads.extend([(&g.d_out, self.sq, true), (&g.lse, self.sq, false), (&g.delta, self.sq, false)]);
        }
        for (i, &(load, rows, matrix)) in loads.iter().enumerate() {
            let want = if i >= 4 { stats } else { dtype };
            let dims = self.dims(rows, matrix.then_some(self.d));
            if load.dtype != want || load.view.dims != dims || load.view.strides.len() != dims.len() {
                return Err(format!(
                    "attention operand {i} is {} over {:?}, not {want} over {dims:?}",
                    load.dtype, load.view.dims
                ));
            }
        }
        if stores.iter().any(|s| loads.iter().any(|(l, ..)| l.arg == s.arg)) {
            return Err("an attention kernel's outputs need arguments of their own".into());
        }
        let loads: Vec<Load> = loads.into_iter().map(|(l, ..)| l.clone()).collect();
        check_args(&loads, &stores, arg)
    }
}

/// What one attention node of a segment contributes: its part and its output argument (when
/// its value leaves the kernel).
pub(crate) struct PartOut {
    pub part: AttentionPart,
    pub arg: Option<u16>,
}

/// The kernel of an attention segment, given its parts and its operands' loads (`q, k, v`, then
/// for a backward pass `d_out, lse, delta`).
pub(crate) fn attention_kernel(causal: bool, loads: Vec<Load>, parts: &[PartOut]) -> AttentionKernel {
    let qd = &loads[0].view.dims;
    let r = qd.len();
    let (batch, sq, d, sk) = (SmallVec::from_slice(&qd[..r - 2]), qd[r - 2], qd[r - 1], loads[1].view.dims[r - 2]);
    let arg = |want: AttentionPart| parts.iter().find(|p| p.part == want).and_then(|p| p.arg);
    let mut loads = loads.into_iter();
    let (q, k, v) = (loads.next().unwrap(), loads.next().unwrap(), loads.next().unwrap());
    let mut grads = || AttentionGradInputs {
        d_out: loads.next().expect("d_out"),
        lse: loads.next().expect("lse"),
        delta: loads.next().expect("delta"),
    };
    let pass = match parts[0].part {
        AttentionPart::Out | AttentionPart::Lse => {
            AttentionPass::Forward { out: arg(AttentionPart::Out), lse: arg(AttentionPart::Lse) }
        }
        AttentionPart::GradQ => {
            AttentionPass::GradQ { grads: grads(), dq: arg(AttentionPart::GradQ).expect("a query gradient is read") }
        }
        AttentionPart::GradK | AttentionPart::GradV => {
            AttentionPass::GradKv { grads: grads(), dk: arg(AttentionPart::GradK), dv: arg(AttentionPart::GradV) }
        }
    };
    AttentionKernel { dtype: q.dtype, causal, batch, sq, sk, d, q, k, v, pass }
}
