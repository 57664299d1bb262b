//! The derivative of each op, recorded as tensor ops.
//!
//! Elementwise ops take their derivative from the op table (`grad`, `grad_lhs`, `grad_rhs`
//! rows, evaluated through [`TensorDiff`]); reductions, matrix products and movement have theirs
//! here, one arm per op. Every result is reduced to its input's shape (undoing broadcasting)
//! and dtype. This module records; it never reads values.

use super::{GradNode, Saved};
use crate::tensor::Tensor;
use braid_graph::diff::{Diff, Dv};
use braid_graph::table::{BinaryOp, CompareOp, UnaryOp};
use braid_graph::{DType, Op, ReduceOp, Shape};
use smallvec::{SmallVec, smallvec};

type InputGrads = SmallVec<[Option<InFlight>; 3]>;

thread_local! {
    /// Gradients the matmul rule made as `own.t()` for a transposed operand: (the node of
    /// `own.t()`, `own`). The transpose's rule takes `own` instead of transposing back (see
    /// `Op::Matmul`); [`forget_transposed`] drops what a pass left.
    static TRANSPOSED: std::cell::RefCell<Vec<(braid_graph::NodeId, Tensor)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether `perm` swaps the last two dimensions and keeps the others.
fn is_last_two_swap(perm: &[usize]) -> bool {
    let n = perm.len();
    n >= 2 && perm[n - 2] == n - 1 && perm[n - 1] == n - 2 && perm[..n - 2].iter().enumerate().all(|(i, &p)| i == p)
}

/// Whether input `i` of `node` is the transpose (of the last two dimensions) of a value with
/// gradient history.
fn transposed_source(node: &GradNode, i: usize) -> bool {
    matches!(&node.inputs[i].source, Some(super::GradSource::Node(p))
        if matches!(&p.op, Op::Permute(perm) if is_last_two_swap(perm)))
}

/// The untransposed gradient the matmul rule made for `g`, if `g` is one of its transposes.
fn take_transposed(g: &Tensor) -> Option<Tensor> {
    TRANSPOSED.with(|t| {
        let mut t = t.borrow_mut();
        let at = t.iter().position(|(id, _)| *id == g.node())?;
        Some(t.swap_remove(at).1)
    })
}

/// Drops the untransposed gradients a backward pass did not take.
pub(super) fn forget_transposed() {
    TRANSPOSED.with(|t| t.borrow_mut().clear());
}

/// The gradients of `node`'s inputs (those with a gradient source) given the gradient `g` of
/// its output. Elementwise derivatives keep constants unrecorded (a loss's seed of 1, its
/// halves and doubles) until an op needs them as tensors; other rules record them first.
pub(super) fn input_grads(node: &GradNode, saved: &Saved, g: InFlight) -> InputGrads {
    // Every rule reads its gradient whole: slices become one tensor here.
    let g = &g.into_val(&node.out_shape, node.out_dtype, &node.device);
    let needs: SmallVec<[bool; 3]> = crate::small(node.inputs.iter().map(|s| s.source.is_some()));
    let input = |i: usize| saved.inputs[i].clone().expect("the derivative's saved input");
    let output = || saved.output.clone().expect("the derivative's saved output");
    let elementwise = |d: &mut TensorDiff, i: usize| d.push_saved(saved.inputs.get(i).cloned().flatten());
    let mut grads: InputGrads = match &node.op {
        Op::Unary(u) => {
            let mut d = TensorDiff::new(node);
            let x = elementwise(&mut d, 0);
            let y = d.push_saved(saved.output.clone());
            let gv = d.push_val(g.clone());
            let r = (u.def().grad)(&mut d, x, y, gv);
            smallvec![Some(InFlight::Val(d.take(r)))]
        }
        Op::Binary(b) => {
            let mut d = TensorDiff::new(node);
            let a = elementwise(&mut d, 0);
            let bb = elementwise(&mut d, 1);
            let y = d.push_saved(saved.output.clone());
            let gv = d.push_val(g.clone());
            let ga = needs[0].then(|| (b.def().grad_lhs)(&mut d, a, bb, y, gv));
            let gb = needs[1].then(|| (b.def().grad_rhs)(&mut d, a, bb, y, gv));
            smallvec![ga.map(|v| InFlight::Val(d.take(v))), gb.map(|v| InFlight::Val(d.take(v)))]
        }
        Op::BinaryScalar { op, scalar, scalar_first } => {
            let mut d = TensorDiff::new(node);
            let x = elementwise(&mut d, 0);
            let s = d.push_val(Val::S(scalar.0));
            let y = d.push_saved(saved.output.clone());
            let gv = d.push_val(g.clone());
            let r = if *scalar_first {
                (op.def().grad_rhs)(&mut d, s, x, y, gv)
            } else {
                (op.def().grad_lhs)(&mut d, x, s, y, gv)
            };
            smallvec![Some(InFlight::Val(d.take(r)))]
        }
        Op::Narrow { dim, start, len } => {
            let g = g.to_tensor(&node.out_shape, node.out_dtype, &node.device);
            let whole = node.inputs[0].shape.dims()[*dim] == *len;
            smallvec![Some(if whole {
                InFlight::Val(Val::T(g))
            } else {
                InFlight::Slices { dim: *dim, parts: vec![(*start, g)] }
            })]
        }
        Op::Attention { causal, .. } => {
            let g = g.to_tensor(&node.out_shape, node.out_dtype, &node.device);
            let (q, k, v) = (input(0), input(1), input(2));
            let needs = [needs[0], needs[1], needs[2]];
            let lse = saved.attention_lse.clone();
            let grads = crate::tensor::attention_grads((&q, &k, &v), &output(), lse, &g, *causal, needs);
            crate::small(grads.into_iter().map(|t| t.map(|t| InFlight::Val(Val::T(t)))))
        }
        _ => {
            let g = g.to_tensor(&node.out_shape, node.out_dtype, &node.device);
            crate::small(
                other_grads(node, &needs, &g, input, output).into_iter().map(|t| t.map(|t| InFlight::Val(Val::T(t)))),
            )
        }
    };
    for (slot, grad) in node.inputs.iter().zip(grads.iter_mut()) {
        *grad = match (slot.source.is_some(), grad.take()) {
            (true, Some(InFlight::Val(Val::T(t)))) => {
                // An elementwise rule applied to a constant gradient can give a result in an
                // operand's shape; what reaches the input is its broadcast to the output, summed.
                let elementwise = matches!(node.op, Op::Unary(_) | Op::Binary(_) | Op::BinaryScalar { .. });
                let t = if elementwise && t.shape() != &node.out_shape { t.expand(node.out_shape.clone()) } else { t };
                Some(InFlight::Val(Val::T(to_input(t, &slot.shape, slot.dtype))))
            }
            // Only a narrow's rule makes slices, in its input's shape and dtype.
            (true, Some(slices @ InFlight::Slices { .. })) => Some(slices),
            (true, Some(InFlight::Val(Val::S(s)))) => {
                // A uniform gradient summed over the positions broadcasting added.
                let copies = node.out_shape.numel() as f64 / slot.shape.numel().max(1) as f64;
                Some(InFlight::Val(Val::S(s * copies)))
            }
            _ => None,
        };
    }
    grads
}

/// The derivatives of reductions, products and movement (`g` recorded, in the output's shape).
fn other_grads(
    node: &GradNode,
    needs: &[bool],
    g: &Tensor,
    input: impl Fn(usize) -> Tensor,
    output: impl Fn() -> Tensor,
) -> SmallVec<[Option<Tensor>; 3]> {
    match &node.op {
        Op::Select => {
            let cond = input(0);
            let zero = Tensor::zeros((), g.dtype(), g.device());
            smallvec![None, needs[1].then(|| cond.select(g, &zero)), needs[2].then(|| cond.select(&zero, g))]
        }
        Op::Clamp { .. } => {
            // Where the value passed through unchanged (NaN compares unequal: no gradient).
            let zero = Tensor::zeros((), g.dtype(), g.device());
            smallvec![Some(output().eq(&input(0)).select(g, &zero))]
        }
        Op::Cast => smallvec![Some(g.to_dtype(node.inputs[0].dtype))],
        Op::Reduce { op, dim, keepdim } => {
            let in_shape = &node.inputs[0].shape;
            let g_keep = keep_reduced_dim(g, *dim, *keepdim, in_shape.rank());
            let r = match op {
                ReduceOp::Sum => g_keep.expand(in_shape.clone()),
                ReduceOp::Mean => {
                    let count = (in_shape.numel() / node.out_shape.numel().max(1)).max(1);
                    g_keep.expand(in_shape.clone()) * (1.0 / count as f64)
                }
                ReduceOp::Max | ReduceOp::Min => {
                    // Shared evenly between the elements equal to the extremum.
                    let y = keep_reduced_dim(&output(), *dim, *keepdim, in_shape.rank());
                    let hit = input(0).eq(&y).to_dtype(g.dtype());
                    let count = match dim {
                        Some(d) => hit.sum_dim(*d, true),
                        None => hit.sum(),
                    };
                    &(&hit / &count) * &g_keep
                }
                ReduceOp::ArgMax => unreachable!("argmax is not differentiable"),
            };
            smallvec![Some(r)]
        }
        Op::Matmul => {
            let rank = |t: &Tensor| t.rank();
            let ga = needs[0].then(|| {
                let b = input(1);
                g.matmul(&b.transpose(rank(&b) - 2, rank(&b) - 1))
            });
            let gb = needs[1].then(|| {
                let a = input(0);
                if rank(&a) == 2 && rank(g) == 2 && transposed_source(node, 1) {
                    // `x.matmul(&w.t())`, as `nn::Linear` computes: `g^T x` is the gradient
                    // in `w`'s own layout, which the transpose's rule passes on as it is, so
                    // that whatever reads it (an optimizer's update) can be the product's
                    // epilogue instead of reading a transposed copy.
                    let own = g.t().matmul(&a);
                    let gb = own.t();
                    TRANSPOSED.with(|t| t.borrow_mut().push((gb.node(), own)));
                    gb
                } else {
                    a.transpose(rank(&a) - 2, rank(&a) - 1).matmul(g)
                }
            });
            smallvec![ga, gb]
        }
        Op::Reshape => smallvec![Some(g.reshape(node.inputs[0].shape.clone()))],
        Op::Permute(perm) => {
            if is_last_two_swap(perm)
                && let Some(own) = take_transposed(g)
            {
                return smallvec![Some(own)];
            }
            let mut inverse = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inverse[p] = i;
            }
            smallvec![Some(g.permute(&inverse))]
        }
        Op::Expand | Op::Contiguous => smallvec![Some(g.clone())],
        Op::Cat { dim } => {
            let mut offset = 0;
            node.inputs
                .iter()
                .map(|slot| {
                    let len = slot.shape.dims()[*dim];
                    let part = slot.source.as_ref().map(|_| g.narrow(*dim, offset, len));
                    offset += len;
                    part
                })
                .collect()
        }
        Op::ToDevice => smallvec![Some(g.to_device(&node.inputs[0].device))],
        Op::Gather { dim } => {
            // Each source element gets the sum of the gradients of the elements that read it.
            let zeros = |dtype| Tensor::zeros(node.inputs[0].shape.clone(), dtype, g.device());
            smallvec![Some(scatter_into_zeros(zeros, *dim, &input(1), g)), None]
        }
        Op::ScatterAdd { dim } => {
            // The base's gradient passes through; each source element's is the gradient of
            // the element it was added to (none where its index was out of range).
            let src = needs[2].then(|| g.gather(*dim, &input(1)));
            smallvec![Some(g.clone()), None, src]
        }
        Op::Scatter { dim } => {
            // The base's elements that were written over get no gradient; each source
            // element gets the gradient of the element it was written to (as PyTorch's, also
            // where a later write replaced it; none where its index was out of range).
            let index = input(1);
            let base = needs[0].then(|| {
                let zeros = Tensor::zeros(index.shape().clone(), g.dtype(), g.device());
                g.scatter(*dim, &index, &zeros)
            });
            let src = needs[2].then(|| g.gather(*dim, &index));
            smallvec![base, None, src]
        }
        Op::IndexSelect { dim } => {
            // The same scatter, the index's dimensions flattened into one and the index
            // repeated along the source's other dimensions.
            let (src, index) = (&node.inputs[0].shape, input(1));
            let mut flat = src.dims().to_vec();
            flat[*dim] = index.numel();
            let mut along = vec![1; src.rank()];
            along[*dim] = index.numel();
            let index = index.reshape(along).expand(flat.clone());
            let zeros = |dtype| Tensor::zeros(src.clone(), dtype, g.device());
            smallvec![Some(scatter_into_zeros(zeros, *dim, &index, &g.reshape(flat))), None]
        }
        op => unreachable!("{} is not differentiable", op.name()),
    }
}

/// `g` scatter-added into zeros (made by `zeros(dtype)`); halves in f32, rounded once, so that
/// the zeros stay a constant the scatter-add folds (no table of zeros is stored).
fn scatter_into_zeros(zeros: impl Fn(DType) -> Tensor, dim: usize, index: &Tensor, g: &Tensor) -> Tensor {
    match g.dtype() {
        d @ (DType::F16 | DType::BF16) => {
            zeros(DType::F32).scatter_add(dim, index, &g.to_dtype(DType::F32)).to_dtype(d)
        }
        d => zeros(d).scatter_add(dim, index, g),
    }
}

/// A reduced gradient with the reduced dimension kept (size 1), so it broadcasts against the
/// input.
fn keep_reduced_dim(g: &Tensor, dim: Option<usize>, keepdim: bool, rank: usize) -> Tensor {
    match dim {
        Some(d) if !keepdim => g.unsqueeze(d),
        Some(_) => g.clone(),
        None => g.reshape(vec![1; rank]),
    }
}

/// Sums a gradient over the dimensions broadcasting added or stretched, and converts it to the
/// input's dtype.
fn to_input(g: Tensor, shape: &Shape, dtype: DType) -> Tensor {
    let mut g = g;
    if g.shape() != shape {
        if shape.numel() == 1 && g.numel() != 1 {
            g = g.sum().reshape(shape.clone());
        } else {
            while g.rank() > shape.rank() {
                g = g.sum_dim(0, false);
            }
            for (d, &n) in shape.dims().iter().enumerate() {
                if n == 1 && g.dims()[d] != 1 {
                    g = g.sum_dim(d, true);
                }
            }
            if g.shape() != shape {
                g = g.reshape(shape.clone());
            }
        }
    }
    if g.dtype() != dtype { g.to_dtype(dtype) } else { g }
}

/// A value of a derivative program: a recorded tensor, or a constant, uniform over its shape,
/// not recorded yet (a loss's seed of 1, the scalar operand of `x * 3.0`, a zero), which ops
/// with a tensor take as a scalar operand.
#[derive(Clone)]
pub(crate) enum Val {
    T(Tensor),
    S(f64),
}

impl Val {
    /// As a tensor of `shape` (a constant is recorded).
    pub(crate) fn to_tensor(&self, shape: &Shape, dtype: DType, device: &crate::device::Device) -> Tensor {
        match self {
            Val::T(t) => t.clone(),
            Val::S(s) => Tensor::full(shape.clone(), *s, dtype, device),
        }
    }

    /// `self + other`, recording only what involves a tensor.
    fn plus(self, other: Val) -> Val {
        match (self, other) {
            (Val::S(a), Val::S(b)) => Val::S(a + b),
            (Val::T(t), Val::S(s)) | (Val::S(s), Val::T(t)) => Val::T(t.binary_scalar(BinaryOp::Add, s, false)),
            (Val::T(a), Val::T(b)) => Val::T(&a + &b),
        }
    }
}

/// A gradient in flight: what the backward pass sums for a value before differentiating the
/// op that made it.
pub(crate) enum InFlight {
    Val(Val),
    /// Zero but for disjoint ranges along `dim`, each holding a narrow's gradient: `(start,
    /// gradient)`. Kept apart until a rule reads the whole, so that the gradients of a tensor
    /// split into parts (attention's q, k and v out of one product) become one concatenation,
    /// not each part padded with zeros to the whole and the padded copies added.
    Slices {
        dim: usize,
        parts: Vec<(usize, Tensor)>,
    },
}

impl InFlight {
    /// As a tensor of `shape` (a constant is recorded; slices are concatenated, with zeros
    /// where no part lies).
    pub(crate) fn to_tensor(&self, shape: &Shape, dtype: DType, device: &crate::device::Device) -> Tensor {
        let (dim, parts) = match self {
            InFlight::Val(v) => return v.to_tensor(shape, dtype, device),
            InFlight::Slices { dim, parts } => (*dim, parts),
        };
        let mut sorted: Vec<&(usize, Tensor)> = parts.iter().collect();
        sorted.sort_by_key(|(start, _)| *start);
        let zeros = |len: usize| {
            let mut dims = shape.dims().to_vec();
            dims[dim] = len;
            Tensor::zeros(dims, dtype, device)
        };
        let (mut whole, mut at) = (Vec::with_capacity(sorted.len() + 2), 0);
        for (start, part) in sorted {
            if *start > at {
                whole.push(zeros(start - at));
            }
            at = start + part.dims()[dim];
            whole.push(part.clone());
        }
        if shape.dims()[dim] > at {
            whole.push(zeros(shape.dims()[dim] - at));
        }
        match whole.as_slice() {
            [only] => only.clone(),
            _ => Tensor::cat(&whole.iter().collect::<Vec<_>>(), dim),
        }
    }

    /// As a value a rule reads (slices concatenated).
    fn into_val(self, shape: &Shape, dtype: DType, device: &crate::device::Device) -> Val {
        match self {
            InFlight::Val(v) => v,
            slices => Val::T(slices.to_tensor(shape, dtype, device)),
        }
    }

    /// `self + other` for a value of `shape`, `dtype` and `device`, recording only what
    /// involves a tensor: slices along one dimension that do not overlap stay slices.
    pub(crate) fn plus(
        self,
        other: InFlight,
        (shape, dtype, device): (&Shape, DType, &crate::device::Device),
    ) -> InFlight {
        match (self, other) {
            (InFlight::Slices { dim, mut parts }, InFlight::Slices { dim: d, parts: more })
                if dim == d && more.iter().all(|m| parts.iter().all(|p| disjoint(p, m, dim))) =>
            {
                parts.extend(more);
                InFlight::Slices { dim, parts }
            }
            (a, b) => InFlight::Val(a.into_val(shape, dtype, device).plus(b.into_val(shape, dtype, device))),
        }
    }
}

/// Whether two slices `(start, part)` along `dim` share no position.
fn disjoint(a: &(usize, Tensor), b: &(usize, Tensor), dim: usize) -> bool {
    a.0 + a.1.dims()[dim] <= b.0 || b.0 + b.1.dims()[dim] <= a.0
}

/// [`Diff`] over tensors and unrecorded constants; a constant is recorded (once per value) only
/// when an op needs it as a tensor.
struct TensorDiff {
    /// On the stack: one derivative rule pushes a handful of values.
    values: SmallVec<[Val; 8]>,
    dtype: DType,
    device: crate::device::Device,
    /// Constants recorded so far, by bits (the zeros of a relu's mask and its select are one).
    recorded: SmallVec<[(u64, Tensor); 2]>,
}

impl TensorDiff {
    fn new(node: &GradNode) -> TensorDiff {
        TensorDiff {
            values: SmallVec::new(),
            dtype: node.out_dtype,
            device: node.device.clone(),
            recorded: SmallVec::new(),
        }
    }

    fn push(&mut self, t: Tensor) -> Dv {
        self.push_val(Val::T(t))
    }

    fn push_val(&mut self, v: Val) -> Dv {
        self.values.push(v);
        Dv(self.values.len() as u32 - 1)
    }

    /// A saved value, or NaN when the row does not read it (the op table's tests check that
    /// rows read only what they save; a NaN would show in every gradient if one did).
    fn push_saved(&mut self, t: Option<Tensor>) -> Dv {
        self.push_val(t.map_or(Val::S(f64::NAN), Val::T))
    }

    /// The value as a tensor (a constant is recorded once, as a one-element tensor, then
    /// reused).
    fn tensor(&mut self, v: Dv, dtype: DType) -> Tensor {
        match self.values[v.0 as usize] {
            Val::T(ref t) => t.clone(),
            Val::S(s) => {
                if let Some((_, t)) = self.recorded.iter().find(|(bits, t)| *bits == s.to_bits() && t.dtype() == dtype)
                {
                    return t.clone();
                }
                let t = Tensor::full((), s, dtype, &self.device);
                self.recorded.push((s.to_bits(), t.clone()));
                t
            }
        }
    }

    /// The dtype constants among `values` are recorded in: the first tensor's (a widened rule
    /// computes in f32), else the op's.
    fn dtype_of(&self, values: &[Dv]) -> DType {
        values
            .iter()
            .find_map(|v| match &self.values[v.0 as usize] {
                Val::T(t) => Some(t.dtype()),
                Val::S(_) => None,
            })
            .unwrap_or(self.dtype)
    }

    fn take(&self, v: Dv) -> Val {
        self.values[v.0 as usize].clone()
    }
}

impl Diff for TensorDiff {
    fn unary(&mut self, op: UnaryOp, x: Dv) -> Dv {
        let v = match &self.values[x.0 as usize] {
            Val::S(s) => Val::S((op.def().reference)(*s)),
            Val::T(t) => Val::T(t.unary(op)),
        };
        self.push_val(v)
    }
    fn binary(&mut self, op: BinaryOp, a: Dv, b: Dv) -> Dv {
        let v = match (&self.values[a.0 as usize], &self.values[b.0 as usize]) {
            (Val::S(x), Val::S(y)) => Val::S((op.def().reference)(*x, *y)),
            // Exact identities that save a node (x^1 = x and x^0 = 1 hold for every x).
            (t @ Val::T(_), Val::S(s)) if op == BinaryOp::Pow && *s == 1.0 => t.clone(),
            (Val::T(_), Val::S(s)) if op == BinaryOp::Pow && *s == 0.0 => Val::S(1.0),
            (Val::T(t), Val::S(s)) => Val::T(t.binary_scalar(op, *s, false)),
            (Val::S(s), Val::T(t)) => Val::T(t.binary_scalar(op, *s, true)),
            (Val::T(x), Val::T(y)) => Val::T(x.binary(op, y)),
        };
        self.push_val(v)
    }
    fn scalar(&mut self, op: BinaryOp, x: Dv, s: f64, scalar_first: bool) -> Dv {
        let v = match &self.values[x.0 as usize] {
            Val::S(v) if scalar_first => Val::S((op.def().reference)(s, *v)),
            Val::S(v) => Val::S((op.def().reference)(*v, s)),
            Val::T(t) => Val::T(t.binary_scalar(op, s, scalar_first)),
        };
        self.push_val(v)
    }
    fn compare(&mut self, op: CompareOp, a: Dv, b: Dv) -> Dv {
        if let (Val::S(x), Val::S(y)) = (&self.values[a.0 as usize], &self.values[b.0 as usize]) {
            // A decided comparison: 1 or 0, which `select` below takes as a constant condition.
            let v = if (op.def().reference)(*x, *y) { 1.0 } else { 0.0 };
            return self.push_val(Val::S(v));
        }
        let dtype = self.dtype_of(&[a, b]);
        let (a, b) = (self.tensor(a, dtype), self.tensor(b, dtype));
        self.push(a.compare(op, &b))
    }
    fn select(&mut self, cond: Dv, a: Dv, b: Dv) -> Dv {
        if let Val::S(c) = self.values[cond.0 as usize] {
            let pick = if c != 0.0 { a } else { b };
            return self.push_val(self.values[pick.0 as usize].clone());
        }
        let dtype = self.dtype_of(&[a, b]);
        let (c, a, b) = (self.tensor(cond, dtype), self.tensor(a, dtype), self.tensor(b, dtype));
        self.push(c.select(&a, &b))
    }
    fn zeros_like(&mut self, _: Dv) -> Dv {
        self.push_val(Val::S(0.0))
    }
    fn widen(&mut self, x: Dv) -> Dv {
        let v = match &self.values[x.0 as usize] {
            Val::T(t) if matches!(t.dtype(), DType::F16 | DType::BF16) => Val::T(t.to_dtype(DType::F32)),
            v => v.clone(),
        };
        self.push_val(v)
    }
    fn narrow(&mut self, x: Dv) -> Dv {
        let v = match &self.values[x.0 as usize] {
            Val::T(t) if t.dtype() != self.dtype => Val::T(t.to_dtype(self.dtype)),
            v => v.clone(),
        };
        self.push_val(v)
    }
}
