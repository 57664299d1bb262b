//! Random attention steps of the random programs: `scaled_dot_product_attention` over a live
//! value as the queries (causal or not, keys of another length, the queries themselves as the
//! keys), mirrored by the reference's `Op::Attention`; and, on fresh leaves, one gradient (of
//! q, k or v) through the backward pass, mirrored by the parts braid records for it (the
//! log-sum-exp, `delta = rowsum(d_out * out)` in f32, then the gradient part).

use super::Gen;
use braid::prelude::*;
use braid_graph::reference::ProgNode;
use braid_graph::table::BinaryOp;
use braid_graph::{AttentionPart, Op, ReduceOp, infer};

impl Gen<'_> {
    /// One random attention step with `x` (of `dtype` and `shape`) as the queries.
    pub(super) fn attention(&mut self, x: usize, dtype: DType, shape: &Shape) {
        let dims = shape.dims();
        let r = dims.len();
        if r < 2 || !dtype.is_float() || dims[r - 1] == 0 {
            return;
        }
        // A kernel of the backward pass binds seven buffers; targets with fewer refuse
        // attention (see `Tensor::scaled_dot_product_attention`).
        if self.h.dev.target().max_kernel_buffers < 7 {
            return;
        }
        let causal = self.rng.chance(0.5);
        let keys = if self.rng.chance(0.3) { dims[r - 2] } else { 1 + self.rng.below(6) };
        let mut kv = dims.to_vec();
        kv[r - 2] = keys;
        if infer::attention((shape, dtype), (&Shape::from(kv.clone()), dtype), (&Shape::from(kv.clone()), dtype))
            .is_err()
        {
            return;
        }
        if self.rng.chance(0.4) {
            return self.attention_gradient(dtype, shape, Shape::from(kv), causal);
        }
        let k = if keys == dims[r - 2] && self.rng.chance(0.4) {
            x
        } else {
            self.h.random(&mut self.rng, dtype, Shape::from(kv.clone()))
        };
        let v = self.h.random(&mut self.rng, dtype, Shape::from(kv));
        self.live.extend([k, v]);
        let inferred = infer::attention((shape, dtype), (&self.h.meta(k).1, dtype), (&self.h.meta(v).1, dtype));
        let Ok((out, _)) = inferred else { return };
        let t = self.call(&[x, k, v], |t| t[0].scaled_dot_product_attention(t[1], t[2], causal));
        let node = ProgNode::Op {
            op: Op::Attention { causal, part: AttentionPart::Out },
            dtype,
            shape: out,
            inputs: vec![x, k, v],
        };
        self.push_result(node, t, "attention");
    }

    /// The gradient of one of fresh leaves q, k, v through `sum(attention(q, k, v) * w)`.
    fn attention_gradient(&mut self, dtype: DType, q_shape: &Shape, kv: Shape, causal: bool) {
        let (q, k, v, w) = (
            self.h.random(&mut self.rng, dtype, q_shape.clone()),
            self.h.random(&mut self.rng, dtype, kv.clone()),
            self.h.random(&mut self.rng, dtype, kv),
            self.h.random(&mut self.rng, dtype, q_shape.clone()),
        );
        // The leaves get gradients, so later steps must not update them in place: they are
        // not live (w is).
        self.live.push(w);
        let part = *self.rng.pick(&[AttentionPart::GradQ, AttentionPart::GradK, AttentionPart::GradV]);
        let which = match part {
            AttentionPart::GradQ => 0,
            AttentionPart::GradK => 1,
            _ => 2,
        };
        let t = self.call(&[q, k, v, w], |t| {
            let leaf = t[which].detach().requires_grad();
            let ins: Vec<&Tensor> = (0..3).map(|i| if i == which { &leaf } else { t[i] }).collect();
            let y = ins[0].scaled_dot_product_attention(ins[1], ins[2], causal);
            let grads = (&y * t[3]).sum().backward().expect("a backward pass records");
            grads.get(&leaf).expect("the leaf's gradient")
        });
        // The reference: the parts braid records for this gradient.
        let stats = infer::attention_stats(dtype);
        let rows = Shape::new(&q_shape.dims()[..q_shape.rank() - 1]);
        let forward = |part| Op::Attention { causal, part };
        let out = self.reference_only(ProgNode::Op {
            op: forward(AttentionPart::Out),
            dtype,
            shape: q_shape.clone(),
            inputs: vec![q, k, v],
        });
        let lse = self.reference_only(ProgNode::Op {
            op: forward(AttentionPart::Lse),
            dtype: stats,
            shape: rows.clone(),
            inputs: vec![q, k, v],
        });
        let widen = |g: &mut Self, x: usize| {
            if dtype == stats {
                x
            } else {
                g.reference_only(ProgNode::Op { op: Op::Cast, dtype: stats, shape: q_shape.clone(), inputs: vec![x] })
            }
        };
        let (gw, ow) = (widen(self, w), widen(self, out));
        let product = self.reference_only(ProgNode::Op {
            op: Op::Binary(BinaryOp::Mul),
            dtype: stats,
            shape: q_shape.clone(),
            inputs: vec![gw, ow],
        });
        let delta = self.reference_only(ProgNode::Op {
            op: Op::Reduce { op: ReduceOp::Sum, dim: Some(q_shape.rank() - 1), keepdim: false },
            dtype: stats,
            shape: rows,
            inputs: vec![product],
        });
        let shape = if which == 0 { q_shape.clone() } else { self.h.meta(k).1 };
        let node = ProgNode::Op { op: forward(part), dtype, shape, inputs: vec![q, k, v, w, lse, delta] };
        self.push_result(node, t, "attention gradient");
    }
}
