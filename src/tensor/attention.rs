//! Scaled dot-product attention: `softmax(q k^T / sqrt(d)) v` as one graph op
//! ([`Op::Attention`]), so that no device ever writes the `[seq, seq]` scores.
//!
//! The forward pass records the output part and, when an operand has gradient history, the
//! log-sum-exp part over the same inputs, which autograd keeps for the backward pass (fusion
//! runs both in one kernel, so the scores are not computed again just to find it); the backward
//! pass ([`grads`]) records `delta = rowsum(d_out * out)` as ordinary ops and the gradient
//! parts. Under autocast the operands are cast to the low precision, as a
//! product's are. This module validates and records; it never computes.

use super::{Tensor, inferred, same_device};
use crate::autograd::{self, GradSource};
use braid_graph::{AttentionPart, Op, infer};

impl Tensor {
    /// Scaled dot-product attention: `softmax(q k^T / sqrt(head_dim)) v` over `q [.., seq_q,
    /// head_dim]` (this tensor), `k` and `v` `[.., seq_k, head_dim]` with the same leading
    /// dimensions (batch, heads) and float dtype. With `causal`, query `i` attends to keys
    /// `0..=i` (PyTorch's `is_causal`, the top-left triangle). The result is `[.., seq_q,
    /// head_dim]`.
    ///
    /// One op with its own backward: devices run it as a fused kernel that never stores the
    /// `[seq_q, seq_k]` scores, and the backward pass recomputes them from the saved
    /// log-sum-exp. Under [`autocast`](crate::amp::autocast) it runs in the low precision with
    /// f32 statistics. Misuse (other shapes or dtypes, different devices) panics here.
    ///
    /// ```
    /// use braid::{DType, Device, Tensor};
    /// let dev = Device::cpu();
    /// let (q, k, v) = (
    ///     Tensor::randn([2, 4, 8, 16], DType::F32, &dev),
    ///     Tensor::randn([2, 4, 8, 16], DType::F32, &dev),
    ///     Tensor::randn([2, 4, 8, 16], DType::F32, &dev),
    /// );
    /// let y = q.scaled_dot_product_attention(&k, &v, true);
    /// assert_eq!(y.shape().dims(), &[2, 4, 8, 16]);
    /// // The first query sees only the first key: its output is the first value row.
    /// let first = y.narrow(2, 0, 1).to_vec::<f32>().unwrap();
    /// let v0 = v.narrow(2, 0, 1).to_vec::<f32>().unwrap();
    /// assert!(first.iter().zip(&v0).all(|(a, b)| (a - b).abs() < 1e-6));
    /// ```
    #[track_caller]
    pub fn scaled_dot_product_attention(&self, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
        if crate::amp::autocast_dtype().is_some() {
            let (q, k, v) =
                (self.autocast_product_operand(), k.autocast_product_operand(), v.autocast_product_operand());
            return crate::amp::off(|| q.scaled_dot_product_attention(&k, &v, causal));
        }
        let operands = [("q", self), ("k", k), ("v", v)];
        same_device("scaled_dot_product_attention", &operands);
        let r = infer::attention((self.shape(), self.dtype()), (k.shape(), k.dtype()), (v.shape(), v.dtype()));
        let (shape, dtype) = inferred("scaled_dot_product_attention", r, &operands);
        // A kernel binds q, k, v and its outputs; one of the backward pass binds seven buffers.
        let needs = if operands.iter().any(|(_, t)| t.needs_grad()) { 7 } else { 4 };
        let binds = self.device().target().max_kernel_buffers;
        if binds < needs {
            let problem = format!("a kernel of attention binds {needs} buffers; {} binds {binds}", self.device());
            let described: Vec<(&str, String)> = operands.iter().map(|(n, t)| (*n, t.describe())).collect();
            super::misuse("scaled_dot_product_attention", &problem, &described);
        }
        let out = Tensor::record(
            Op::Attention { causal, part: AttentionPart::Out },
            dtype,
            shape,
            self.device(),
            &[self, k, v],
        );
        if let Some(GradSource::Node(node)) = autograd::source_of(&out) {
            node.save_attention_lse(autograd::no_grad(|| part(AttentionPart::Lse, causal, &[self, k, v])));
        }
        out
    }
}

/// Records attention part `part` over `ins` (validated by inference: a failure here is a bug).
fn part(part: AttentionPart, causal: bool, ins: &[&Tensor]) -> Tensor {
    let metas: Vec<_> = ins.iter().map(|t| (t.shape(), t.dtype())).collect();
    let (shape, dtype) = infer::attention_part(part, &metas).unwrap_or_else(|e| panic!("attention backward: {e}"));
    Tensor::record(Op::Attention { causal, part }, dtype, shape, ins[0].device(), ins)
}

/// The gradients of `q`, `k` and `v` (those `needs` asks for) given the output `out`, its
/// log-sum-exp when the forward pass recorded it, and the output's gradient `g`.
pub(crate) fn grads(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &Tensor,
    lse: Option<Tensor>,
    g: &Tensor,
    causal: bool,
    needs: [bool; 3],
) -> [Option<Tensor>; 3] {
    let g = g.as_dtype(q.dtype());
    let stats = infer::attention_stats(q.dtype());
    let lse = lse.unwrap_or_else(|| part(AttentionPart::Lse, causal, &[q, k, v]));
    let widen = |t: &Tensor| t.as_dtype(stats);
    let delta = (&widen(&g) * &widen(out)).sum_dim(-1, false);
    let ins = [q, k, v, &g, &lse, &delta];
    let [nq, nk, nv] = needs;
    [
        nq.then(|| part(AttentionPart::GradQ, causal, &ins)),
        nk.then(|| part(AttentionPart::GradK, causal, &ins)),
        nv.then(|| part(AttentionPart::GradV, causal, &ins)),
    ]
}
