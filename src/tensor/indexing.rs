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
//! # Index dtypes
//! Indices may be i64, i32 or u8 on every device; kernels read i64 and i32 as they are (u8 is
//! converted to i32 first). A device without i64 (wgpu) holds i32: there `argmin_dim_as`,
//! `argmax_dim_as` and `arange_as` give i32 positions, and `cross_entropy` compares its target
//! with class numbers in the target's own dtype, so no i64 tensor is ever made.
//!
//! # Indices out of range
//! Kernels cannot stop a flush for a bad index, and a read from outside a buffer is undefined
//! behaviour, so an index outside `0..n` matches no `j`: a gather reads **0** there and a
//! scatter-add **adds nothing** (the semantics of JAX's `mode="fill"`/`"drop"`, which are each
//! other's transpose, so gradients stay exact). Negative indices do not count from the end.
//! PyTorch raises an error instead; braid cannot, without reading the indices back.

use super::{Dim, Tensor, inferred, misuse, same_device};
use braid_graph::{DType, Op, infer};

/// Misuse of `op`, whose result is i64, on a device that cannot hold i64 (wgpu), pointing to
/// the variant that gives i32 (`instead`); `operands` name what it was called on.
#[track_caller]
pub(super) fn needs_i64(op: &str, instead: &str, device: &crate::Device, operands: &[(&str, String)]) {
    if !device.target().dtypes.contains(DType::I64) {
        let problem = format!("{} has no i64, which {op} gives; ask for i32 with {instead}", device.name());
        misuse(op, &problem, operands);
    }
}

impl Tensor {
    /// Misuse of `op` unless `index` is an integer tensor; returns it as the gather and scatter
    /// kernels read it: i64 and i32 as they are (i32 is what a device without i64, such as
    /// wgpu, holds), u8 as i32.
    #[track_caller]
    fn index_of(op: &str, index: &Tensor, operands: &[(&str, &Tensor)]) -> Tensor {
        match index.dtype() {
            DType::I64 | DType::I32 => index.clone(),
            DType::U8 => index.to_dtype(DType::I32),
            d => {
                let problem = format!("the index must be an integer tensor (i64, i32 or u8), not {d}");
                misuse(op, &problem, &describe(operands))
            }
        }
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
        let dim = self.dim("gather", dim);
        let fits =
            index.rank() == self.rank() && (0..self.rank()).all(|d| d == dim || index.dims()[d] <= self.dims()[d]);
        if !fits {
            let problem =
                format!("the index must have the tensor's rank and, along every dimension but {dim}, at most its size");
            misuse("gather", &problem, &describe(&operands));
        }
        let index = Tensor::index_of("gather", index, &operands);
        self.gather_unchecked(dim, &index)
    }

    /// The gather kernel behind `gather`, `index_select` and `embedding`; `index` is I64 or I32 and
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
        let dim = self.dim("index_select", dim);
        if index.rank() != 1 {
            misuse("index_select", "the index must be one-dimensional", &describe(&operands));
        }
        let index = Tensor::index_of("index_select", index, &operands);
        self.index_select_unchecked(dim, &index)
    }

    /// The gather kernel behind `index_select` and `embedding`: `index` is I64 or I32, of any shape.
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
        if weight.rank() != 2 {
            misuse("embedding", "the weight must be [vocabulary, features]", &describe(&operands));
        }
        let ids = Tensor::index_of("embedding", self, &operands);
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
        let index = Tensor::index_of("scatter_add", index, &operands);
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

    /// This tensor with `src`'s elements written where `index` names along `dim`, as
    /// PyTorch's `scatter(dim, index, src)`: for `dim = 0`, `out[index[i][j]][j] = src[i][j]`.
    /// `index` (integers) and `src` (this tensor's dtype, any dtype) have one shape, equal to
    /// this tensor's along every dimension but `dim`; elements no index names keep their value.
    /// Where several source elements name one element, the last along `dim` wins (on every
    /// device, every run); an index outside `0..self.dims()[dim]` writes nothing. The
    /// gradient of `src` is the output's gradient gathered at `index` (as PyTorch's), of this
    /// tensor the output's gradient where nothing was written.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let x = Tensor::from_vec(vec![0.0f32; 4], [4], &cpu);
    /// let i = Tensor::from_vec(vec![3i64, 1, 3], [3], &cpu);
    /// let s = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &cpu);
    /// assert_eq!(x.scatter(0, &i, &s).to_vec::<f32>().unwrap(), vec![0.0, 2.0, 0.0, 3.0]);
    /// ```
    #[track_caller]
    pub fn scatter(&self, dim: impl Dim, index: &Tensor, src: &Tensor) -> Tensor {
        let (dim, index) = self.scatter_operands("scatter", dim, index, src);
        let shape = self.shape().clone();
        Tensor::record(Op::Scatter { dim }, self.dtype(), shape, self.device(), &[self, &index, src])
    }

    /// [`scatter`](Tensor::scatter) in place: a new version of this tensor (see
    /// [`assign`](Tensor::assign)). Where nothing else reads the old value, the scheduler writes
    /// only `src`'s elements into this tensor's buffer (a key/value cache's new rows, each
    /// token), and otherwise copies it first. Inside a [`Step`](crate::Step), an argument
    /// updated this way is updated in place at every replay.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let cache = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], &cpu);
    /// let at = Tensor::from_vec(vec![2i32, 0], [2, 1], &cpu);
    /// cache.scatter_assign(1, &at, &Tensor::from_vec(vec![-1.0f32, -2.0], [2, 1], &cpu));
    /// assert_eq!(cache.to_vec::<f32>().unwrap(), vec![1.0, 2.0, -1.0, -2.0, 5.0, 6.0]);
    /// ```
    #[track_caller]
    pub fn scatter_assign(&self, dim: impl Dim, index: &Tensor, src: &Tensor) {
        let (dim, index) = self.scatter_operands("scatter_assign", dim, index, src);
        self.record_new_version("scatter_assign", Op::Scatter { dim }, &[self, &index, src]);
    }

    /// The checked dimension and index (as i32 or i64) of a scatter of `src` at `index`.
    #[track_caller]
    fn scatter_operands(&self, op: &str, dim: impl Dim, index: &Tensor, src: &Tensor) -> (usize, Tensor) {
        let operands = [("x", self), ("index", index), ("src", src)];
        same_device(op, &operands);
        let dim = self.dim(op, dim);
        let index = Tensor::index_of(op, index, &operands);
        let checked = infer::scatter(
            (self.shape(), self.dtype()),
            (index.shape(), index.dtype()),
            (src.shape(), src.dtype()),
            dim,
        );
        if let Err(problem) = checked {
            misuse(op, &problem, &describe(&operands));
        }
        (dim, index)
    }

    /// Index (I64) of the first minimum along `dim`; a NaN counts as the minimum (as
    /// `argmax_dim`, whose kernel it shares: the first maximum of an order-reversed copy,
    /// `-x` for floats and `-1 - x` for integers, which never overflows). On a device without
    /// i64 (wgpu), ask for i32 with [`argmin_dim_as`](Tensor::argmin_dim_as).
    #[track_caller]
    pub fn argmin_dim(&self, dim: impl Dim, keepdim: bool) -> Tensor {
        needs_i64("argmin_dim", "argmin_dim_as(dim, keepdim, DType::I32)", self.device(), &[("x", self.describe())]);
        self.argmin_dim_as(dim, keepdim, DType::I64)
    }

    /// [`argmin_dim`](Tensor::argmin_dim) with the positions in `index`: `DType::I64`, or
    /// `DType::I32` (what wgpu holds; the positions must fit in it).
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let x = Tensor::from_vec(vec![3.0f32, 1.0, 2.0, 0.5, 4.0, 0.5], [2, 3], &cpu);
    /// let at = x.argmin_dim_as(1, false, DType::I32);
    /// assert_eq!(at.to_vec::<i32>().unwrap(), vec![1, 0]);
    /// ```
    #[track_caller]
    pub fn argmin_dim_as(&self, dim: impl Dim, keepdim: bool, index: DType) -> Tensor {
        if let Some(row) = self.scalar_as_row(dim) {
            return row.argmin_dim_as(0, false, index);
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
        reversed.argmax_dim_as(dim, keepdim, index)
    }

    /// Mean cross-entropy of `target` classes under these logits: `logits` is `[.., classes]`
    /// (floats) and `target` (integers) has its shape without the last dimension; the result
    /// is the scalar mean of `logsumexp(row) - row[target]`, as PyTorch's `F.cross_entropy`.
    ///
    /// Numerically stable (the row maximum is subtracted before `exp`), and one row kernel
    /// reads the logits for the maximum, the sum of exponentials and the target's logit: the
    /// target's logit is picked from the logits as they are (not shifted by the maximum), so
    /// that a GPU folds it in the maximum's pass over the row.
    /// A target outside `0..classes` picks 0 (see the [module docs](self)), so its row's loss
    /// is `logsumexp(row - max)`.
    #[track_caller]
    pub fn cross_entropy(&self, target: &Tensor) -> Tensor {
        let operands = [("logits", self), ("target", target)];
        same_device("cross_entropy", &operands);
        let rank = self.rank();
        if !self.dtype().is_float() || rank == 0 || target.dims() != &self.dims()[..rank - 1] {
            let problem = "the logits must be floats of shape [.., classes] and the target their shape without the \
                           last dimension";
            misuse("cross_entropy", problem, &describe(&operands));
        }
        let target = Tensor::index_of("cross_entropy", target, &operands);
        let classes = self.dims()[rank - 1];
        // Recorded first, so that fusion grows one row kernel from the comparison on (the
        // class numbers are a kernel of their own before it).
        let class_count = classes;
        let classes = Tensor::arange_as(0, classes as i64, target.dtype(), self.device());
        let hit = target.unsqueeze(rank - 1).eq(&classes);
        // f16 and bf16 logits in f32, as in `log_softmax`.
        self.in_f32(|x| {
            // The maximum only shifts the exponentials; the loss does not depend on it.
            let max = x.max_dim(rank - 1, true).detach();
            let shifted_lse = (x - &max).exp().sum_dim(rank - 1, false).log();
            let zero = Tensor::zeros((), x.dtype(), x.device());
            let picked = hit.select(x, &zero).sum_dim(rank - 1, false);
            // The target's shifted logit, `picked - max`, or 0 for a target out of range (which
            // picks nothing), from the target itself: no pass over the row.
            let (t, d) = (&target, target.dtype());
            let below = t.lt(&Tensor::full((), class_count as f64, d, x.device()));
            let shift = below.select(&max.squeeze(rank - 1), &zero);
            let shift = t.ge(&Tensor::zeros((), d, x.device())).select(&shift, &zero);
            (&shifted_lse - &(&picked - &shift)).mean()
        })
    }
}

fn describe<'a>(operands: &[(&'a str, &Tensor)]) -> Vec<(&'a str, String)> {
    operands.iter().map(|(n, t)| (*n, t.describe())).collect()
}
