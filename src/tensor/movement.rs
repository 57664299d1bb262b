//! Movement: reshape, permute, transpose, expand, narrow, cat, and copies to a layout, dtype
//! or device. Every result is a new value (never an alias that in-place updates could reach).

use super::{Dim, Tensor, inferred, misuse, same_device};
use crate::device::Device;
use braid_graph::{Op, Shape, infer};

impl Tensor {
    /// The same elements (row-major) with another shape of the same size.
    #[track_caller]
    pub fn reshape(&self, shape: impl Into<Shape>) -> Tensor {
        let to = shape.into();
        let shape = inferred("reshape", infer::reshape(self.shape(), &to), &[("x", self)]);
        Tensor::record(Op::Reshape, self.dtype(), shape, self.device(), &[self])
    }

    /// Reorders dimensions: result dimension `i` is input dimension `perm[i]`.
    #[track_caller]
    pub fn permute(&self, perm: &[usize]) -> Tensor {
        let shape = inferred("permute", infer::permute(self.shape(), perm), &[("x", self)]);
        Tensor::record(Op::Permute(perm.into()), self.dtype(), shape, self.device(), &[self])
    }

    /// Swaps two dimensions.
    #[track_caller]
    pub fn transpose(&self, d0: impl Dim, d1: impl Dim) -> Tensor {
        let (d0, d1) = (self.dim("transpose", d0), self.dim("transpose", d1));
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(d0, d1);
        self.permute(&perm)
    }

    /// The transpose of a 2-D tensor.
    #[track_caller]
    pub fn t(&self) -> Tensor {
        if self.rank() != 2 {
            misuse("t", "needs a 2-D tensor (use transpose for others)", &[("x", self.describe())]);
        }
        self.transpose(0, 1)
    }

    /// Broadcasts to `shape` (NumPy rules: size-1 dimensions stretch, new ones are added on the
    /// left).
    #[track_caller]
    pub fn expand(&self, shape: impl Into<Shape>) -> Tensor {
        let to = shape.into();
        let shape = inferred("expand", infer::expand(self.shape(), &to), &[("x", self)]);
        Tensor::record(Op::Expand, self.dtype(), shape, self.device(), &[self])
    }

    /// Elements `start..start + len` along `dim`.
    #[track_caller]
    pub fn narrow(&self, dim: impl Dim, start: usize, len: usize) -> Tensor {
        let dim = self.dim("narrow", dim);
        let shape = inferred("narrow", infer::narrow(self.shape(), dim, start, len), &[("x", self)]);
        Tensor::record(Op::Narrow { dim, start, len }, self.dtype(), shape, self.device(), &[self])
    }

    /// Concatenates tensors of one dtype and device along `dim` (other dimensions must match).
    /// On a device that limits the buffers one kernel binds (wgpu, CUDA), many parts are joined in
    /// pieces, one kernel each, then the pieces.
    #[track_caller]
    pub fn cat(tensors: &[&Tensor], dim: impl Dim) -> Tensor {
        let Some(first) = tensors.first() else {
            misuse("cat", "needs at least one tensor", &[]);
        };
        let dim = first.dim("cat", dim);
        let names: Vec<String> = (0..tensors.len()).map(|i| format!("tensors[{i}]")).collect();
        let operands: Vec<(&str, &Tensor)> = names.iter().map(String::as_str).zip(tensors.iter().copied()).collect();
        same_device("cat", &operands);
        let parts: Vec<_> = tensors.iter().map(|t| (t.shape(), t.dtype())).collect();
        let (shape, dtype) = inferred("cat", infer::cat(&parts, dim), &operands);
        // A kernel binds its parts and its result: where the device limits that, more parts
        // are joined in pieces first (the values are the same; the pieces cost a copy).
        let per_kernel = first.device().target().max_kernel_buffers.saturating_sub(1).max(2);
        if tensors.len() > per_kernel {
            let pieces: Vec<Tensor> = tensors.chunks(per_kernel).map(|c| Tensor::cat(c, dim)).collect();
            return Tensor::cat(&pieces.iter().collect::<Vec<_>>(), dim);
        }
        Tensor::record(Op::Cat { dim }, dtype, shape, first.device(), tensors)
    }

    /// Stacks tensors of one shape, dtype and device along a new dimension `dim` (`0..=rank`;
    /// negative counts from the end of the result's dimensions).
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let (a, b) = (Tensor::from_vec(vec![1i64, 2], [2], &cpu), Tensor::from_vec(vec![3i64, 4], [2], &cpu));
    /// let s = Tensor::stack(&[&a, &b], -1);
    /// assert_eq!(s.dims(), &[2, 2]);
    /// assert_eq!(s.to_vec::<i64>().unwrap(), vec![1, 3, 2, 4]);
    /// ```
    #[track_caller]
    pub fn stack(tensors: &[&Tensor], dim: impl Dim) -> Tensor {
        let Some(first) = tensors.first() else {
            misuse("stack", "needs at least one tensor", &[]);
        };
        if let Some(t) = tensors.iter().find(|t| t.shape() != first.shape()) {
            misuse(
                "stack",
                "every tensor must have the same shape",
                &[("tensors[0]", first.describe()), ("other", t.describe())],
            );
        }
        let dim = first.dim_or_end("stack", dim);
        let parts: Vec<Tensor> = tensors.iter().map(|t| t.unsqueeze(dim)).collect();
        Tensor::cat(&parts.iter().collect::<Vec<_>>(), dim)
    }

    /// A copy. (braid values are always stored contiguously; this exists for code written
    /// against APIs with strided views.)
    #[track_caller]
    pub fn contiguous(&self) -> Tensor {
        Tensor::record(Op::Contiguous, self.dtype(), self.shape().clone(), self.device(), &[self])
    }

    /// A copy on `device` (lazy: nothing synchronises now).
    #[track_caller]
    pub fn to_device(&self, device: &Device) -> Tensor {
        if let Some(layout) = self.quant_layout() {
            return self.quantized_to_device(layout, device);
        }
        Tensor::record(Op::ToDevice, self.dtype(), self.shape().clone(), device, &[self])
    }

    /// Inserts a dimension of size 1 at `dim`.
    #[track_caller]
    pub fn unsqueeze(&self, dim: impl Dim) -> Tensor {
        let dim = self.dim_or_end("unsqueeze", dim);
        let mut d = self.dims().to_vec();
        d.insert(dim, 1);
        self.reshape(d)
    }

    /// Removes dimension `dim`, which must have size 1.
    #[track_caller]
    pub fn squeeze(&self, dim: impl Dim) -> Tensor {
        let dim = self.dim("squeeze", dim);
        if self.dims()[dim] != 1 {
            misuse(
                "squeeze",
                &format!("dimension {dim} has size {}, not 1", self.dims()[dim]),
                &[("x", self.describe())],
            );
        }
        let mut d = self.dims().to_vec();
        d.remove(dim);
        self.reshape(d)
    }

    /// All elements in one dimension.
    #[track_caller]
    pub fn flatten(&self) -> Tensor {
        self.reshape([self.numel()])
    }
}
