//! Indexing ops (`gather`, `index_select`, `embedding`, `scatter_add`), `argmin_dim` and
//! `cross_entropy`, recorded as the primitive ops they are made of.
//!
//! # How indices are computed
//! A gather is recorded as a **one-hot reduction**: for each output element, the sum over
//! `j < n` of `select(index == j, src[.., j, ..], 0)`, where `n` is the source's size along
//! the gathered dimension. Fusion makes this one row kernel (the comparison, the select and the
//! sum, with the index and source read through their loads' views), so it runs on every
//! backend through the kernel IR that already exists, and the derivative comes from the
//! primitives: the gradient of a gather is the same one-hot reduction the other way round, a
//! deterministic scatter-add (a fixed-order sum per output element, no atomics: the same bits
//! at any thread count). The price is `n` reads per output element instead of one, which is
//! what an embedding table of a few hundred rows or a cross-entropy over its classes (a row the
//! softmax reads anyway) can afford; a gather from a table of tens of thousands of rows wants a
//! load with a computed index in the kernel IR, which does not exist yet.
//!
//! # Indices out of range
//! Kernels cannot stop a flush for a bad index, and a read from outside a buffer is undefined
//! behaviour, so an index outside `0..n` matches no `j`: a gather reads **0** there and a
//! scatter-add **adds nothing** (the semantics of JAX's `mode="fill"`/`"drop"`, which are each
//! other's transpose, so gradients stay exact). Negative indices do not count from the end.
//! PyTorch raises an error instead; braid cannot, without reading the indices back.

use super::{Dim, Tensor, misuse, same_device};
use braid_graph::DType;

/// Misuse of `op` on a device that cannot hold i64 (wgpu): the indexing ops compare indices
/// with an i64 `arange` (and `argmin_dim` gives i64), so they need it.
#[track_caller]
fn needs_i64(op: &str, operands: &[(&str, &Tensor)]) {
    let device = operands[0].1.device();
    if !device.target().dtypes.contains(DType::I64) {
        let problem = format!(
            "{} has no i64, which {op} needs (it compares indices as i64); run it on a device with i64 (the CPU, CUDA)",
            device.name()
        );
        misuse(op, &problem, &describe(operands));
    }
}

impl Tensor {
    /// Misuse of `op` unless `index` is an integer tensor; returns it as I64 (what the one-hot
    /// comparison uses).
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

    /// The one-hot reduction behind every gather; `index` is I64 and fits (see `gather`).
    #[track_caller]
    fn gather_unchecked(&self, dim: usize, index: &Tensor) -> Tensor {
        if self.dtype() == DType::Bool {
            // Sums have no bool: gather the bytes.
            return self.to_dtype(DType::U8).gather_unchecked(dim, index).to_dtype(DType::Bool);
        }
        let (rank, n) = (self.rank(), self.dims()[dim]);
        let mut src = self.clone();
        for d in (0..rank).filter(|&d| d != dim && index.dims()[d] < self.dims()[d]) {
            src = src.narrow(d, 0, index.dims()[d]);
        }
        // [.., k, .., n]: the source with `dim` moved last, repeated along the index's `dim`.
        let mut perm: Vec<usize> = (0..rank).filter(|&d| d != dim).collect();
        perm.push(dim);
        let mut wide = index.dims().to_vec();
        wide.push(n);
        let src = src.permute(&perm).unsqueeze(dim).expand(wide.as_slice());
        let hit = index.unsqueeze(rank).eq(&Tensor::arange(0, n as i64, self.device()));
        let zero = Tensor::zeros((), self.dtype(), self.device());
        hit.select(&src, &zero).sum_dim(rank, false)
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
        let mut at = vec![1; self.rank()];
        at[dim] = index.numel();
        let mut out = self.dims().to_vec();
        out[dim] = index.numel();
        self.gather_unchecked(dim, &index.reshape(at).expand(out))
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
        if weight.dtype() == DType::Bool {
            return ids.embedding(&weight.to_dtype(DType::U8)).to_dtype(DType::Bool);
        }
        // The one-hot reduction over [.., features, vocabulary] directly (not an index_select
        // of the flattened ids, whose result would need a reshaping copy).
        let (rank, vocabulary) = (ids.rank(), weight.dims()[0]);
        let mut wide = ids.dims().to_vec();
        wide.extend([weight.dims()[1], vocabulary]);
        let table = weight.permute(&[1, 0]).expand(wide.as_slice());
        let classes = Tensor::arange(0, vocabulary as i64, self.device());
        // Over the full shape (the ids repeated per feature), so that one kernel holds the
        // comparison, the select and the sum.
        let mut per_feature = wide.clone();
        per_feature[rank + 1] = 1;
        let hit = ids.unsqueeze(rank).unsqueeze(rank + 1).expand(per_feature).eq(&classes);
        let zero = Tensor::zeros((), weight.dtype(), self.device());
        hit.select(&table, &zero).sum_dim(rank + 1, false)
    }

    /// A copy of this tensor with `src[i][j][k]` added at `[index[i][j][k]][j][k]` for
    /// `dim = 0` (and so on), as PyTorch's `scatter_add`: `index` (integers) and `src` have one
    /// shape, which equals this tensor's along every dimension but `dim`. Each element gets
    /// the sum of the `src` elements aimed at it, in index order, then added to it: the same
    /// bits on every run. An index outside `0..self.dims()[dim]` adds nothing (see the
    /// [module docs](self)).
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
        let n = self.dims()[dim];
        // [.., n, .., k]: for each target position along `dim`, every source position.
        let mut perm: Vec<usize> = (0..rank).filter(|&d| d != dim).collect();
        perm.push(dim);
        let moved = |t: &Tensor| t.permute(&perm).unsqueeze(dim);
        let mut along = vec![1; rank + 1];
        along[dim] = n;
        let targets = Tensor::arange(0, n as i64, self.device()).reshape(along);
        let hit = moved(&index).eq(&targets);
        let zero = Tensor::zeros((), self.dtype(), self.device());
        self + &hit.select(&moved(src), &zero).sum_dim(rank, false)
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
