//! Reductions, matrix products and composite ops (softmax, log_softmax, layer_norm), the
//! latter recorded as the primitive ops they are made of.

use super::{Dim, Tensor, inferred, same_device};
use braid_graph::{DType, Op, ReduceOp, Shape, infer};

impl Tensor {
    #[track_caller]
    fn reduce(&self, op: ReduceOp, dim: Option<usize>, keepdim: bool) -> Tensor {
        // Autocast keeps sums and means in f32 (see `crate::amp`).
        let widened;
        let x = match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                widened = self.autocast_f32();
                &widened
            }
            _ => self,
        };
        x.reduce_as_is(op, dim, keepdim)
    }

    #[track_caller]
    fn reduce_as_is(&self, op: ReduceOp, dim: Option<usize>, keepdim: bool) -> Tensor {
        let r = infer::reduce(op, self.shape(), self.dtype(), dim, keepdim);
        let (shape, dtype) = inferred(op.name(), r, &[("x", self)]);
        Tensor::record(Op::Reduce { op, dim, keepdim }, dtype, shape, self.device(), &[self])
    }

    /// Sum of all elements (a scalar tensor). Integers wrap.
    #[track_caller]
    pub fn sum(&self) -> Tensor {
        self.reduce(ReduceOp::Sum, None, false)
    }

    /// Mean of all elements (floats).
    #[track_caller]
    pub fn mean(&self) -> Tensor {
        self.reduce(ReduceOp::Mean, None, false)
    }

    /// Maximum of all elements (a scalar tensor); NaN if any element is NaN.
    #[track_caller]
    pub fn max(&self) -> Tensor {
        // One reduction over the whole index space: a flatten first would copy a strided
        // view, and cut the elementwise work before it out of the reduction's kernel.
        self.reduce(ReduceOp::Max, None, false)
    }

    /// Minimum of all elements (a scalar tensor); NaN if any element is NaN.
    #[track_caller]
    pub fn min(&self) -> Tensor {
        // One reduction over the whole index space: a flatten first would copy a strided
        // view, and cut the elementwise work before it out of the reduction's kernel.
        self.reduce(ReduceOp::Min, None, false)
    }

    /// Sum along `dim`; `keepdim` keeps it with size 1.
    #[track_caller]
    pub fn sum_dim(&self, dim: impl Dim, keepdim: bool) -> Tensor {
        if let Some(row) = self.scalar_as_row(dim) {
            return row.sum_dim(0, false);
        }
        let dim = self.dim("sum_dim", dim);
        self.reduce(ReduceOp::Sum, Some(dim), keepdim)
    }

    /// Mean along `dim` (floats).
    #[track_caller]
    pub fn mean_dim(&self, dim: impl Dim, keepdim: bool) -> Tensor {
        if let Some(row) = self.scalar_as_row(dim) {
            return row.mean_dim(0, false);
        }
        let dim = self.dim("mean_dim", dim);
        self.reduce(ReduceOp::Mean, Some(dim), keepdim)
    }

    /// Maximum along `dim`; NaN if any element is NaN.
    #[track_caller]
    pub fn max_dim(&self, dim: impl Dim, keepdim: bool) -> Tensor {
        if let Some(row) = self.scalar_as_row(dim) {
            return row.max_dim(0, false);
        }
        let dim = self.dim("max_dim", dim);
        self.reduce(ReduceOp::Max, Some(dim), keepdim)
    }

    /// Minimum along `dim`; NaN if any element is NaN.
    #[track_caller]
    pub fn min_dim(&self, dim: impl Dim, keepdim: bool) -> Tensor {
        if let Some(row) = self.scalar_as_row(dim) {
            return row.min_dim(0, false);
        }
        let dim = self.dim("min_dim", dim);
        self.reduce(ReduceOp::Min, Some(dim), keepdim)
    }

    /// Index (I64) of the first maximum along `dim`; a NaN counts as the maximum. On a device
    /// without i64 (wgpu), ask for i32 with [`argmax_dim_as`](Tensor::argmax_dim_as).
    #[track_caller]
    pub fn argmax_dim(&self, dim: impl Dim, keepdim: bool) -> Tensor {
        let operands = [("x", self.describe())];
        super::indexing::needs_i64("argmax_dim", "argmax_dim_as(dim, keepdim, DType::I32)", self.device(), &operands);
        self.argmax_dim_as(dim, keepdim, DType::I64)
    }

    /// [`argmax_dim`](Tensor::argmax_dim) with the positions in `index`: `DType::I64`, or
    /// `DType::I32` (what wgpu holds; the positions must fit in it). Kernels find the position
    /// as an i64 and convert it as they store it, so no i64 tensor is ever made.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let x = Tensor::from_vec(vec![3.0f32, 1.0, 2.0, 0.5, 4.0, 4.0], [2, 3], &cpu);
    /// let at = x.argmax_dim_as(1, false, DType::I32);
    /// assert_eq!(at.to_vec::<i32>().unwrap(), vec![0, 1]);
    /// ```
    #[track_caller]
    pub fn argmax_dim_as(&self, dim: impl Dim, keepdim: bool, index: DType) -> Tensor {
        if let Some(row) = self.scalar_as_row(dim) {
            return row.argmax_dim_as(0, false, index);
        }
        let dim = self.dim("argmax_dim", dim);
        let r = infer::argmax(self.shape(), self.dtype(), Some(dim), keepdim, index);
        let (shape, dtype) = inferred("argmax_dim", r, &[("x", self)]);
        Tensor::record(
            Op::Reduce { op: ReduceOp::ArgMax, dim: Some(dim), keepdim },
            dtype,
            shape,
            self.device(),
            &[self],
        )
    }

    /// Matrix product `[.., m, k] x [.., k, n] -> [.., m, n]`; batch dimensions broadcast.
    #[track_caller]
    pub fn matmul(&self, other: &Tensor) -> Tensor {
        if let Some(layout) = other.quant_layout() {
            return self.quant_product(other, layout);
        }
        if crate::amp::autocast_dtype().is_some() {
            // Autocast: both operands in its low precision (see `crate::amp`).
            let (a, b) = (self.autocast_product_operand(), other.autocast_product_operand());
            return crate::amp::off(|| a.matmul(&b));
        }
        let operands = [("lhs", self), ("rhs", other)];
        same_device("matmul", &operands);
        let r = infer::matmul((self.shape(), self.dtype()), (other.shape(), other.dtype()));
        let (shape, dtype) = inferred("matmul", r, &operands);
        if let Some(padded) = self.padded_product(other, &shape) {
            return padded;
        }
        Tensor::record(Op::Matmul, dtype, shape, self.device(), &[self, other])
    }

    /// The inner and output dimensions (`k`, `n`) a product of `m x n x k` (over all its
    /// batches) in `dtype` on this tensor's device is recorded on: rounded up to the alignment the device wants for large products
    /// ([`braid_graph::ProductPadding`]), or `None` when it is recorded as written (a small or
    /// aligned product, an integer one, a device without the preference).
    fn padded_dims(&self, dtype: DType, (m, n, k): (usize, usize, usize)) -> Option<(usize, usize)> {
        let padding = self.device().target().product_padding?;
        let per = (padding.bytes / dtype.size()).max(1);
        let (kp, np) = (k.next_multiple_of(per), n.next_multiple_of(per));
        let flops = 2.0 * m as f64 * n as f64 * k as f64;
        let large = flops >= padding.min_flops && m > 0 && n > 0;
        (dtype.is_float() && large && (kp, np) != (k, n)).then_some((kp, np))
    }

    /// This product recorded padded, when [`Self::padded_dims`] says so: `k` padded with zeros
    /// on both operands, `n` on the right-hand side's last dimension, and the result a narrow
    /// of the padded product. The zeros add exact zeros; readers read the narrowed view in
    /// place; the backward pass runs on the padded shapes.
    fn padded_product(&self, other: &Tensor, out: &Shape) -> Option<Tensor> {
        let (a, b) = (self.dims(), other.dims());
        if a.len() < 2 || b.len() < 2 {
            return None;
        }
        let (k, n) = (b[b.len() - 2], b[b.len() - 1]);
        let (kp, np) = self.padded_dims(self.dtype(), (out.numel() / n.max(1), n, k))?;
        let lhs = if kp > k { self.with_zeros(a.len() - 1, kp - k) } else { self.clone() };
        let rhs = if kp > k { other.with_zeros(b.len() - 2, kp - k) } else { other.clone() };
        let rhs = if np > n { rhs.with_zeros(b.len() - 1, np - n) } else { rhs };
        let y = lhs.matmul(&rhs);
        Some(if np > n { y.narrow(y.rank() - 1, 0, n) } else { y })
    }

    /// This tensor followed along `dim` by `extra` zeros.
    fn with_zeros(&self, dim: usize, extra: usize) -> Tensor {
        let mut dims = self.dims().to_vec();
        dims[dim] = extra;
        Tensor::cat(&[self, &Tensor::zeros(dims, self.dtype(), self.device())], dim)
    }

    /// `self W^T + bias` for `weight` `[out, in]` and `bias` `[out]`, over the last dimension
    /// of `self` (`[.., in] -> [.., out]`): PyTorch's `F.linear`, and `nn::Linear`'s forward.
    ///
    /// Under [`autocast`](crate::amp::autocast) the bias joins the product in the low
    /// precision and the result is low too, as PyTorch's autocast runs `linear` and `addmm`;
    /// `self.matmul(&weight.t()) + bias` would add the low product to an f32 bias in f32.
    /// Outside autocast the two are the same.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], &cpu);
    /// let w = Tensor::from_vec(vec![1.0f32, 0.0, 1.0, 1.0, 0.0, -1.0], [3, 2], &cpu);
    /// let b = Tensor::from_vec(vec![0.5f32, 0.0, 1.0], [3], &cpu);
    /// let y = x.linear(&w, Some(&b));
    /// assert_eq!(y.to_vec::<f32>().unwrap(), vec![1.5, 3.0, -1.0, 3.5, 7.0, -3.0]);
    /// let low = braid::amp::autocast(DType::BF16, || x.linear(&w, Some(&b)));
    /// assert_eq!(low.dtype(), DType::BF16);
    /// ```
    #[track_caller]
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
        let inputs = self.dims().last().copied();
        let describe = || {
            let mut operands = vec![("x", self.describe()), ("weight", weight.describe())];
            operands.extend(bias.map(|b| ("bias", b.describe())));
            operands
        };
        if weight.quant_layout().is_some() {
            let problem = "takes a float weight [out, in]; a quantized weight [in, out] multiplies as x.matmul(&q) \
                           (nn::Linear::quantize makes a layer of one)";
            super::misuse("linear", problem, &describe());
        }
        if weight.dims().len() != 2 || inputs != Some(weight.dims()[1]) {
            super::misuse("linear", "needs x [.., in] and weight [out, in]", &describe());
        }
        if bias.is_some_and(|b| b.dims() != [weight.dims()[0]]) {
            super::misuse("linear", "needs a bias [out] for weight [out, in]", &describe());
        }
        // Where the device wants large products aligned, the weight is padded by rows in its
        // own layout (cast to the product's precision first, then joined with zeros): the
        // product reads the transpose in place and the weight's gradient comes back in the
        // weight's layout, a narrow of its rows. Otherwise the product casts `weight.t()`, a
        // view (of the layer's own weight when it is itself a transpose, as GPT-2's Conv1D's).
        let (out, inputs) = (weight.dims()[0], weight.dims()[1]);
        let rows = self.shape().numel() / inputs.max(1);
        // The product's dtype: autocast's low precision for floats under autocast.
        let dtype = match crate::amp::autocast_dtype() {
            Some(low) if weight.dtype().is_float() => low,
            _ => weight.dtype(),
        };
        let y = match weight.padded_dims(dtype, (rows, out, inputs)) {
            Some((_, padded)) if padded > out => {
                let w = weight.autocast_product_operand();
                let y = self.matmul(&w.with_zeros(0, padded - out).t());
                y.narrow(y.rank() - 1, 0, out)
            }
            _ => self.matmul(&weight.t()),
        };
        // Under autocast the bias in the product's precision (unchanged outside autocast).
        match bias {
            None => y,
            Some(b) => &y + &b.autocast_product_operand(),
        }
    }

    /// A dimension of a composite op over floats: misuse (named after the composite, not the
    /// primitives it records) unless the tensor is floating-point and the dimension exists.
    #[track_caller]
    fn float_dim(&self, op: &str, dim: impl Dim) -> usize {
        if !self.dtype().is_float() {
            super::misuse(
                op,
                &format!("needs a floating-point tensor, not {}", self.dtype()),
                &[("x", self.describe())],
            );
        }
        self.dim(op, dim)
    }

    /// `exp(x - max) / sum(exp(x - max))` along `dim` (floats), computed as
    /// `exp(x - max) * recip(sum(...))`: one division per row and a product per element, as
    /// PyTorch's softmax does (within an ulp or two of dividing each element). f16 and bf16
    /// are computed in f32 and rounded once (see [`Tensor::layer_norm`]).
    #[track_caller]
    pub fn softmax(&self, dim: impl Dim) -> Tensor {
        if let Some(row) = self.scalar_as_row(dim) {
            return row.softmax(0).reshape(());
        }
        let dim = self.float_dim("softmax", dim);
        if self.shape().dims()[dim] == 0 {
            return self.empty_result();
        }
        self.in_f32(|x| {
            let shifted = x - &x.max_dim(dim, true);
            let e = shifted.exp();
            &e * &e.sum_dim(dim, true).recip()
        })
    }

    /// `x - max - log(sum(exp(x - max)))` along `dim` (floats; f16 and bf16 computed in f32).
    #[track_caller]
    pub fn log_softmax(&self, dim: impl Dim) -> Tensor {
        if let Some(row) = self.scalar_as_row(dim) {
            return row.log_softmax(0).reshape(());
        }
        let dim = self.float_dim("log_softmax", dim);
        if self.shape().dims()[dim] == 0 {
            return self.empty_result();
        }
        self.in_f32(|x| {
            let shifted = x - &x.max_dim(dim, true);
            &shifted - &shifted.exp().sum_dim(dim, true).log()
        })
    }

    /// `(x - mean) / sqrt(var + eps)` along `dim`, with the biased variance (no affine
    /// parameters; multiply and add them yourself). f16 and bf16 are computed in f32 and the
    /// result rounded once, as PyTorch does: in f16 a squared deviation above 256 is infinite
    /// (and the whole row 0), and a bf16 mean keeps 8 bits.
    #[track_caller]
    pub fn layer_norm(&self, dim: impl Dim, eps: f64) -> Tensor {
        if let Some(row) = self.scalar_as_row(dim) {
            return row.layer_norm(0, eps).reshape(());
        }
        let dim = self.float_dim("layer_norm", dim);
        self.in_f32(|x| {
            let centered = x - &x.mean_dim(dim, true);
            let var = centered.square().mean_dim(dim, true);
            &centered * &(var + eps).rsqrt()
        })
    }

    /// A scalar as a row of one value when `dim` names its dimension as PyTorch counts it (`0`
    /// or `-1`: dimension-wise ops treat a scalar as one-dimensional there); `None` otherwise.
    #[track_caller]
    pub(super) fn scalar_as_row(&self, dim: impl Dim) -> Option<Tensor> {
        (self.rank() == 0 && dim.resolve(1, false).is_some()).then(|| self.reshape([1]))
    }

    /// `f` of this tensor, in f32 when it is f16 or bf16 (the result rounded back once).
    /// Under autocast the result stays f32 (see `crate::amp`).
    pub(super) fn in_f32(&self, f: impl FnOnce(&Tensor) -> Tensor) -> Tensor {
        match self.dtype() {
            DType::F16 | DType::BF16 if crate::amp::autocast_dtype().is_some() => f(&self.to_dtype(DType::F32)),
            DType::F16 | DType::BF16 => f(&self.to_dtype(DType::F32)).to_dtype(self.dtype()),
            _ => f(self),
        }
    }

    /// The result of a row-wise composite over rows of no values: as empty as `self` (a new
    /// tensor, so that updating it in place leaves `self` alone).
    fn empty_result(&self) -> Tensor {
        self * 1.0
    }
}
