//! Indexing ops (`gather`, `index_select`, `embedding`, `scatter_add`), `argmin_dim` and
//! `cross_entropy`, recorded as the primitive ops they are made of.
//!
//! # How indices are computed
//! `gather`, `index_select` and `embedding` are recorded as one op each (`Op::Gather`,
//! `Op::IndexSelect`) and run as a **gather kernel**: each output element reads its index,
//! then the one source element it names, so a lookup costs a read per element however large
//! the table (the source and index are read through their views: a transposed table or an
//! expanded index is not copied first). The kernel moves elements whole, so every dtype
//! (bools, halves) gathers as it is.
//!
//! `scatter_add`, and with it the gradient of a lookup, is recorded as one op
//! (`Op::ScatterAdd`) and runs as a **scatter kernel**: the rows of the source (its elements
//! that differ only along the dimension) are added in order to the elements their indices
//! name, each row by one thread, so every element's sum is folded in one order (the same bits
//! at any thread count, no atomics) and the work is one read of the index and the source per
//! element. f16 and bf16 sum in f32 and round once. A cross-entropy reads its target's logit
//! as a **one-hot reduction** (a comparison with the class numbers, a select and a sum) in the
//! row its softmax reads anyway.
//!
//! # Indices out of range
//! Kernels cannot stop a flush for a bad index, and a read from outside a buffer is undefined
//! behaviour, so an index outside `0..n` matches no `j`: a gather reads **0** there and a
//! scatter-add **adds nothing** (the semantics of JAX's `mode="fill"`/`"drop"`, which are each
//! other's transpose, so gradients stay exact). Negative indices do not count from the end.
//! PyTorch raises an error instead; braid cannot, without reading the indices back.

use super::{Dim, Tensor, inferred, misuse, same_device};
use braid_graph::{DType, Op, infer};

/// Misuse of `op` on a device that cannot hold i64 (wgpu): the gather and scatter kernels read
/// i64 indices, `cross_entropy` compares them with an i64 `arange` and `argmin_dim` gives i64.
#[track_caller]
fn needs_i64(op: &str, operands: &[(&str, &Tensor)]) {
    let device = operands[0].1.device();
    if !device.target().dtypes.contains(DType::I64) {
        let problem = format!(
            "{} has no i64, which {op} needs (its kernels read indices as i64); run it on a device with i64 (the CPU, CUDA)",
            device.name()
        );
        misuse(op, &problem, &describe(operands));
    }
}

impl Tensor {
    /// Misuse of `op` unless `index` is an integer tensor; returns it as I64 (what the gather and
    /// scatter kernels read).
    #[track_caller]
    fn index_i64(op: &str, index: &Tensor, operands: &[(&str, &Tensor)]) -> Tensor {
        if !index.dtype().is_int() {
            let problem = format!("the index must be an integer tensor (i64, i32 or u8), not {}", index.dtype());
            misuse(op, &problem, &describe(operands));
        }
        if index.dtype() == DType::I64 { index.clone() } else { index.to_dtype(DType::I64) }
    }

    /// `out[i][j][k] = self[index[i][j][k]][j][k]` for `dim = 0` (and so on for the others),
    /// as PyTorch's `gather`: `index` (integers) has this tensor's rank and, along every other
    /// dimension, at most its size; the result has `index`'s shape. An index outside
    /// `0..self.dims()[dim]` reads 0 (see the [module docs](self)).
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], &cpu);
    /// let i = Tensor::from_vec(vec![1i64, 0, 0, 0], [2, 2], &cpu);
    /// assert_eq!(x.gather(1, &i).to_vec::<f32>().unwrap(), vec![2.0, 1.0, 3.0, 3.0]);
    /// ```
    #[track_caller]
    pub fn gather(&self, dim: impl Dim, index: &Tensor) -> Tensor {
        let operands = [("x", self), ("index", index)];
        same_device("gather", &operands);
        needs_i64("gather", &operands);
        let dim = self.dim("gather", dim);
        let fits =
            index.rank() == self.rank() && (0..self.rank()).all(|d| d == dim || index.dims()[d] <= self.dims()[d]);
        if !fits {
            let problem =
                format!("the index must have the tensor's rank and, along every dimension but {dim}, at most its size");
            misuse("gather", &problem, &describe(&operands));
        }
        let index = Tensor::index_i64("gather", index, &operands);
        self.gather_unchecked(dim, &index)
    }

    /// The gather kernel behind `gather`, `index_select` and `embedding`; `index` is I64 and
    /// fits (see `gather`).
    #[track_caller]
    fn gather_unchecked(&self, dim: usize, index: &Tensor) -> Tensor {
        let mut src = self.clone();
        for d in (0..self.rank()).filter(|&d| d != dim && index.dims()[d] < self.dims()[d]) {
            src = src.narrow(d, 0, index.dims()[d]);
        }
        let operands = [("x", self), ("index", index)];
        let (shape, dtype) = inferred(
            "gather",
            infer::gather((src.shape(), src.dtype()), (index.shape(), index.dtype()), dim),
            &operands,
        );
        Tensor::record(Op::Gather { dim }, dtype, shape, self.device(), &[&src, index])
    }

    /// The slices of this tensor along `dim` that the 1-D integer `index` names, in its order:
    /// the result has this shape with `dim` of size `index.numel()`. An index outside
    /// `0..self.dims()[dim]` selects a slice of zeros (see the [module docs](self)).
    #[track_caller]
    pub fn index_select(&self, dim: impl Dim, index: &Tensor) -> Tensor {
        let operands = [("x", self), ("index", index)];
        same_device("index_select", &operands);
        needs_i64("index_select", &operands);
        let dim = self.dim("index_select", dim);
        if index.rank() != 1 {
            misuse("index_select", "the index must be one-dimensional", &describe(&operands));
        }
        let index = Tensor::index_i64("index_select", index, &operands);
        self.index_select_unchecked(dim, &index)
    }

    /// The gather kernel behind `index_select` and `embedding`: `index` is I64, of any shape.
    #[track_caller]
    fn index_select_unchecked(&self, dim: usize, index: &Tensor) -> Tensor {
        let operands = [("x", self), ("index", index)];
        let (shape, dtype) = inferred(
            "index_select",
            infer::index_select((self.shape(), self.dtype()), (index.shape(), index.dtype()), dim),
            &operands,
        );
        Tensor::record(Op::IndexSelect { dim }, dtype, shape, self.device(), &[self, index])
    }

    /// Looks up rows of `weight` (`[vocabulary, features]`): the result has this integer
    /// tensor's shape followed by `features`, as PyTorch's `F.embedding(ids, weight)`. An id
    /// outside `0..vocabulary` gives a row of zeros (see the [module docs](self)); the gradient
    /// of `weight` adds up the gradients of the rows each id picked.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let w = Tensor::from_vec(vec![0.0f32, 0.5, 1.0, 1.5, 2.0, 2.5], [3, 2], &cpu);
    /// let ids = Tensor::from_vec(vec![2i64, 0], [2], &cpu);
    /// assert_eq!(ids.embedding(&w).to_vec::<f32>().unwrap(), vec![2.0, 2.5, 0.0, 0.5]);
    /// ```
    #[track_caller]
    pub fn embedding(&self, weight: &Tensor) -> Tensor {
        let operands = [("ids", self), ("weight", weight)];
        same_device("embedding", &operands);
        needs_i64("embedding", &operands);
        if weight.rank() != 2 {
            misuse("embedding", "the weight must be [vocabulary, features]", &describe(&operands));
        }
        let ids = Tensor::index_i64("embedding", self, &operands);
        weight.index_select_unchecked(0, &ids)
    }

    /// A copy of this tensor with `src[i][j][k]` added at `[index[i][j][k]][j][k]` for
    /// `dim = 0` (and so on), as PyTorch's `scatter_add`: `index` (integers) and `src` have one
    /// shape, which equals this tensor's along every dimension but `dim`. Each element gets
    /// the sum of the `src` elements aimed at it, in index order, then added to it: the same
    /// bits on every run and at any thread count (f16 and bf16 sum in f32). An index outside
    /// `0..self.dims()[dim]` adds nothing (see the [module docs](self)).
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let x = Tensor::zeros([3], DType::F32, &cpu);
    /// let i = Tensor::from_vec(vec![2i64, 0, 2], [3], &cpu);
    /// let s = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &cpu);
    /// assert_eq!(x.scatter_add(0, &i, &s).to_vec::<f32>().unwrap(), vec![2.0, 0.0, 4.0]);
    /// ```
    #[track_caller]
    pub fn scatter_add(&self, dim: impl Dim, index: &Tensor, src: &Tensor) -> Tensor {
        let operands = [("x", self), ("index", index), ("src", src)];
        same_device("scatter_add", &operands);
        needs_i64("scatter_add", &operands);
        let dim = self.dim("scatter_add", dim);
        let rank = self.rank();
        if !self.dtype().is_numeric() || src.dtype() != self.dtype() {
            misuse("scatter_add", "x and src must have one numeric dtype", &describe(&operands));
        }
        let fits = index.shape() == src.shape()
            && index.rank() == rank
            && (0..rank).all(|d| d == dim || index.dims()[d] == self.dims()[d]);
        if !fits {
            let problem = format!("index and src must have one shape, equal to x's along every dimension but {dim}");
            misuse("scatter_add", &problem, &describe(&operands));
        }
        let index = Tensor::index_i64("scatter_add", index, &operands);
        if matches!(self.dtype(), DType::F16 | DType::BF16) {
            // Summed in f32 and rounded once, as a reduction of halves is.
            let sums = self.to_dtype(DType::F32).scatter_add(dim, &index, &src.to_dtype(DType::F32));
            return sums.to_dtype(self.dtype());
        }
        let (shape, dtype) = inferred(
            "scatter_add",
            infer::scatter_add(
                (self.shape(), self.dtype()),
                (index.shape(), index.dtype()),
                (src.shape(), src.dtype()),
                dim,
            ),
            &operands,
        );
        Tensor::record(Op::ScatterAdd { dim }, dtype, shape, self.device(), &[self, &index, src])
    }

    /// Index (I64) of the first minimum along `dim`; a NaN counts as the minimum (as
    /// `argmax_dim`, whose kernel it shares: the first maximum of an order-reversed copy,
    /// `-x` for floats and `-1 - x` for integers, which never overflows).
    #[track_caller]
    pub fn argmin_dim(&self, dim: impl Dim, keepdim: bool) -> Tensor {
        needs_i64("argmin_dim", &[("x", self)]);
        if let Some(row) = self.scalar_as_row(dim) {
            return row.argmin_dim(0, false);
        }
        let dim = self.dim("argmin_dim", dim);
        let reversed = match self.dtype() {
            d if d.is_float() => -self,
            DType::U8 => 255 - self,
            DType::I32 | DType::I64 => -1 - self,
            d => {
                let problem = format!("argmin_dim needs a numeric dtype, got {d}; convert with to_dtype");
                misuse("argmin_dim", &problem, &[("x", self.describe())])
            }
        };
        reversed.argmax_dim(dim, keepdim)
    }

    /// Mean cross-entropy of `target` classes under these logits: `logits` is `[.., classes]`
    /// (floats) and `target` (integers) has its shape without the last dimension; the result
    /// is the scalar mean of `logsumexp(row) - row[target]`, as PyTorch's `F.cross_entropy`.
    ///
    /// Numerically stable (the row maximum is subtracted before `exp`), and one row kernel
    /// reads the logits once for the maximum, the sum of exponentials and the target's logit.
    /// A target outside `0..classes` picks 0 (see the [module docs](self)), so its row's loss
    /// is `logsumexp(row - max)`.
    #[track_caller]
    pub fn cross_entropy(&self, target: &Tensor) -> Tensor {
        let operands = [("logits", self), ("target", target)];
        same_device("cross_entropy", &operands);
        needs_i64("cross_entropy", &operands);
        let rank = self.rank();
        if !self.dtype().is_float() || rank == 0 || target.dims() != &self.dims()[..rank - 1] {
            let problem = "the logits must be floats of shape [.., classes] and the target their shape without the \
                           last dimension";
            misuse("cross_entropy", problem, &describe(&operands));
        }
        let target = Tensor::index_i64("cross_entropy", target, &operands);
        let classes = self.dims()[rank - 1];
        // Recorded first, so that fusion grows one row kernel from the comparison on (the
        // class numbers are a kernel of their own before it).
        let hit = target.unsqueeze(rank - 1).eq(&Tensor::arange(0, classes as i64, self.device()));
        // f16 and bf16 logits in f32, as in `log_softmax`.
        self.in_f32(|x| {
            // The maximum only shifts the exponentials; the loss does not depend on it.
            let shifted = x - &x.max_dim(rank - 1, true).detach();
            let logsumexp = shifted.exp().sum_dim(rank - 1, false).log();
            let zero = Tensor::zeros((), x.dtype(), x.device());
            let picked = hit.select(&shifted, &zero).sum_dim(rank - 1, false);
            (&logsumexp - &picked).mean()
        })
    }
}

fn describe<'a>(operands: &[(&'a str, &Tensor)]) -> Vec<(&'a str, String)> {
    operands.iter().map(|(n, t)| (*n, t.describe())).collect()
}
