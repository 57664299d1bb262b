//! The kernel IR: what one kernel launch does, independent of any target.
//!
//! A kernel reads and writes numbered buffer arguments through strided [`View`]s. Its body is
//! either a set of map loops (an index space, loads, an expression DAG from
//! [`braid_graph::expr`], stores), a reduction, or a matrix product. Targets interpret it (the
//! CPU) or print it (CUDA C, WGSL); none of them needs to know which graph ops it came from.
//! The IR holds no buffers and no data, so kernels can be cached by structure.

use braid_graph::expr::Expr;
use braid_graph::{DType, ReduceOp, Shape};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// Strides and offset, in elements, that map an index space onto a buffer argument.
/// `dims[i]` is the extent of index dimension `i`; `strides[i]` may be 0 (broadcast).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct View {
    pub dims: SmallVec<[usize; 4]>,
    pub strides: SmallVec<[isize; 4]>,
    pub offset: usize,
}

impl View {
    /// The row-major contiguous view of `shape`.
    pub fn contiguous(shape: &Shape) -> View {
        View { dims: shape.dims().into(), strides: shape.contiguous_strides(), offset: 0 }
    }

    /// A view of a contiguous tensor of shape `from`, broadcast (NumPy rules) to `to`.
    pub fn broadcast(from: &Shape, to: &Shape) -> View {
        let pad = to.rank() - from.rank();
        let src = from.contiguous_strides();
        let strides = (0..to.rank())
            .map(|i| if i < pad || from.dims()[i - pad] != to.dims()[i] { 0 } else { src[i - pad] })
            .collect();
        View { dims: to.dims().into(), strides, offset: 0 }
    }

    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// Whether element `i` of the index space is element `offset + i` of the buffer.
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1isize;
        for (&d, &s) in self.dims.iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc *= d as isize;
        }
        true
    }
}

/// Reads argument `arg` (stored as `dtype`) through `view`; referenced by `ExprOp::Load(slot)`
/// where `slot` is the load's position in its loop.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Load {
    pub arg: u16,
    pub dtype: DType,
    pub view: View,
}

/// Writes expression node `value` to argument `arg` (stored as `dtype`) through `view`.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Store {
    pub arg: u16,
    pub dtype: DType,
    pub view: View,
    pub value: u32,
}

/// One loop over an index space of `dims`: for each index, evaluate `expr` over the loads and
/// write the stores. Different indices never write the same element.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct MapLoop {
    pub dims: SmallVec<[usize; 4]>,
    pub loads: Vec<Load>,
    pub expr: Expr,
    pub stores: Vec<Store>,
}

impl MapLoop {
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// Merges neighbouring index dimensions that every view walks contiguously, and drops
    /// dimensions of extent 1, so that targets see the fewest, longest loops.
    pub fn simplify(&mut self) {
        let mut views: Vec<&mut View> =
            self.loads.iter_mut().map(|l| &mut l.view).chain(self.stores.iter_mut().map(|s| &mut s.view)).collect();
        let mut dims: SmallVec<[usize; 4]> = SmallVec::new();
        let mut strides: Vec<SmallVec<[isize; 4]>> = vec![SmallVec::new(); views.len()];
        for d in 0..self.dims.len() {
            let extent = self.dims[d];
            if extent == 1 {
                continue;
            }
            let mergeable = !dims.is_empty()
                && views.iter().zip(&strides).all(|(v, s)| *s.last().unwrap() == v.strides[d] * extent as isize);
            if mergeable {
                *dims.last_mut().unwrap() *= extent;
                for (v, s) in views.iter().zip(strides.iter_mut()) {
                    *s.last_mut().unwrap() = v.strides[d];
                }
            } else {
                dims.push(extent);
                for (v, s) in views.iter().zip(strides.iter_mut()) {
                    s.push(v.strides[d]);
                }
            }
        }
        if self.dims.contains(&0) {
            dims = SmallVec::from_slice(&[0]);
            strides.iter_mut().for_each(|s| *s = SmallVec::from_slice(&[1]));
        }
        for (v, s) in views.iter_mut().zip(strides) {
            v.dims = dims.clone();
            v.strides = s;
        }
        self.dims = dims;
    }
}

/// A reduction of a contiguous `[outer, len, inner]` input along the middle dimension into a
/// contiguous `[outer, inner]` output.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct ReduceKernel {
    pub op: ReduceOp,
    pub input: u16,
    pub in_dtype: DType,
    pub output: u16,
    pub out_dtype: DType,
    pub outer: usize,
    pub len: usize,
    pub inner: usize,
}

/// Batched matrix product of contiguous operands `[.., m, k] x [.., k, n] -> [.., m, n]`; the
/// output batch index `b` reads `lhs` at element offset `lhs_offsets[b]` and `rhs` at
/// `rhs_offsets[b]` (broadcast batches repeat offsets).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct MatmulKernel {
    pub dtype: DType,
    pub lhs: u16,
    pub rhs: u16,
    pub output: u16,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lhs_offsets: Vec<usize>,
    pub rhs_offsets: Vec<usize>,
}

#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Body {
    /// Loops run one after another (a concatenation is one loop per part).
    Map(Vec<MapLoop>),
    Reduce(ReduceKernel),
    Matmul(MatmulKernel),
}

/// A buffer argument: its dtype and length in elements. Arguments `0..inputs` are read, the
/// rest are written.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Arg {
    pub dtype: DType,
    pub len: usize,
}

/// One kernel: its arguments (inputs first) and body.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Kernel {
    pub args: Vec<Arg>,
    pub inputs: usize,
    pub body: Body,
}

impl Kernel {
    /// Elements produced (for logs and bandwidth figures).
    pub fn output_elements(&self) -> usize {
        self.args[self.inputs..].iter().map(|a| a.len).sum()
    }

    /// Bytes read and written, counting each argument once.
    pub fn bytes_moved(&self) -> usize {
        self.args.iter().map(|a| a.len * a.dtype.size()).sum()
    }
}
