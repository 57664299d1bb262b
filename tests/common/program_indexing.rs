//! Random indexing steps of the random programs: `gather`, `index_select`, `embedding`,
//! `scatter_add`, `scatter` (and `scatter_assign`), `argmin_dim` and `cross_entropy` recorded through braid's API, mirrored by
//! the reference's direct definitions ([`IndexOp`]) or, for cross-entropy, its textbook
//! formula one op at a time. Indices are random, about one in eight outside `0..n` (braid
//! reads 0 / adds nothing there), in a random integer dtype the device holds (i32 and u8 on
//! wgpu); `argmin_dim` gives i64 or, through `argmin_dim_as`, i32.

use super::Gen;
use braid::prelude::*;
use braid_graph::reference::{IndexOp, ProgNode};
use braid_graph::table::{BinaryOp, UnaryOp};
use braid_graph::{Op, ReduceOp};

impl Gen<'_> {
    /// One random indexing step reading `x`.
    pub(super) fn indexing(&mut self, x: usize, dtype: DType, shape: &Shape) {
        let rank = shape.rank();
        if rank == 0 {
            return;
        }
        let dim = self.rng.below(rank);
        let n = shape.dims()[dim];
        match self.rng.below(7) {
            0 => {
                let mut dims: Vec<usize> = shape.dims().iter().map(|&d| self.rng.below(d + 1)).collect();
                dims[dim] = self.rng.below(5);
                let index = self.index_leaf(Shape::from(dims.clone()), n);
                let t = self.call(&[x, index], |t| t[0].gather(dim as i64 - rank as i64, t[1]));
                let node = ProgNode::Indexing {
                    op: IndexOp::Gather { dim },
                    dtype,
                    shape: Shape::from(dims),
                    inputs: vec![x, index],
                };
                self.push_result(node, t, "gather");
            }
            1 => {
                let m = self.rng.below(5);
                let index = self.index_leaf(Shape::from([m]), n);
                let t = self.call(&[x, index], |t| t[0].index_select(dim, t[1]));
                let mut at = vec![1; rank];
                at[dim] = m;
                let mut out = shape.dims().to_vec();
                out[dim] = m;
                let wide = self.expanded_index(index, &at, &out);
                let node = ProgNode::Indexing {
                    op: IndexOp::Gather { dim },
                    dtype,
                    shape: Shape::from(out),
                    inputs: vec![x, wide],
                };
                self.push_result(node, t, "index_select");
            }
            2 if rank == 2 => {
                let features = shape.dims()[1];
                let ids_shape = self.random_shape();
                let ids_shape = Shape::from(&ids_shape.dims()[..ids_shape.rank().min(2)]);
                let ids = self.index_leaf(ids_shape.clone(), shape.dims()[0]);
                let t = self.call(&[ids, x], |t| t[0].embedding(t[1]));
                let m = ids_shape.numel();
                let wide = self.expanded_index(ids, &[m, 1], &[m, features]);
                let rows = self.reference_only(ProgNode::Indexing {
                    op: IndexOp::Gather { dim: 0 },
                    dtype,
                    shape: Shape::from([m, features]),
                    inputs: vec![x, wide],
                });
                let mut out = ids_shape.dims().to_vec();
                out.push(features);
                let node = ProgNode::Op { op: Op::Reshape, dtype, shape: Shape::from(out), inputs: vec![rows] };
                self.push_result(node, t, "embedding");
            }
            3 if dtype.is_numeric() => {
                let mut dims = shape.dims().to_vec();
                dims[dim] = self.rng.below(5);
                let index = self.index_leaf(Shape::from(dims.clone()), n);
                let src = self.h.random(&mut self.rng, dtype, Shape::from(dims));
                let t = self.call(&[x, index, src], |t| t[0].scatter_add(dim, t[1], t[2]));
                let node = ProgNode::Indexing {
                    op: IndexOp::ScatterAdd { dim },
                    dtype,
                    shape: shape.clone(),
                    inputs: vec![x, index, src],
                };
                self.push_result(node, t, "scatter_add");
            }
            4 => {
                let keepdim = self.rng.chance(0.5);
                let mut out = shape.dims().to_vec();
                if keepdim {
                    out[dim] = 1;
                } else {
                    out.remove(dim);
                }
                if n == 0 || !dtype.is_numeric() {
                    return;
                }
                let index = *self.rng.pick(&self.index_dtypes(&[DType::I64, DType::I32]));
                let t = match index {
                    DType::I64 if self.rng.chance(0.5) => self.call(&[x], |t| t[0].argmin_dim(dim, keepdim)),
                    _ => self.call(&[x], |t| t[0].argmin_dim_as(dim, keepdim, index)),
                };
                let node = ProgNode::Indexing {
                    op: IndexOp::ArgMin { dim, keepdim },
                    dtype: index,
                    shape: Shape::from(out),
                    inputs: vec![x],
                };
                self.push_result(node, t, "argmin_dim");
            }
            5 if dtype.is_float() && shape.dims()[rank - 1] > 0 => self.cross_entropy(x, dtype, shape),
            6 => {
                // Any dtype; colliding indices too (the last along `dim` wins on every device).
                let mut dims = shape.dims().to_vec();
                dims[dim] = self.rng.below(5);
                let index = self.index_leaf(Shape::from(dims.clone()), n);
                let src = self.h.random(&mut self.rng, dtype, Shape::from(dims));
                let t = if self.rng.chance(0.5) {
                    self.call(&[x, index, src], |t| t[0].scatter(dim, t[1], t[2]))
                } else {
                    // In place, on a new tensor of the same value (`x` keeps its own).
                    self.call(&[x, index, src], |t| {
                        let y = t[0].detach();
                        y.scatter_assign(dim, t[1], t[2]);
                        y
                    })
                };
                let node = ProgNode::Indexing {
                    op: IndexOp::Scatter { dim },
                    dtype,
                    shape: shape.clone(),
                    inputs: vec![x, index, src],
                };
                self.push_result(node, t, "scatter");
            }
            _ => {}
        }
    }

    /// `cross_entropy` through braid; the reference computes `mean(log(sum(exp(x - max))) -
    /// (x - max)[target])` one op at a time.
    fn cross_entropy(&mut self, x: usize, dtype: DType, shape: &Shape) {
        let rank = shape.rank();
        let classes = shape.dims()[rank - 1];
        let rows = Shape::from(&shape.dims()[..rank - 1]);
        let target = self.index_leaf(rows.clone(), classes);
        let t = self.call(&[x, target], |t| t[0].cross_entropy(t[1]));
        let mut kept = shape.dims().to_vec();
        kept[rank - 1] = 1;
        let kept = Shape::from(kept);
        let last = Some(rank - 1);
        let op = |op, shape: &Shape, inputs: Vec<usize>| ProgNode::Op { op, dtype, shape: shape.clone(), inputs };
        let max = self.reference_only(op(Op::Reduce { op: ReduceOp::Max, dim: last, keepdim: true }, &kept, vec![x]));
        let shifted = self.reference_only(op(Op::Binary(BinaryOp::Sub), shape, vec![x, max]));
        let exp = self.reference_only(op(Op::Unary(UnaryOp::Exp), shape, vec![shifted]));
        let sum =
            self.reference_only(op(Op::Reduce { op: ReduceOp::Sum, dim: last, keepdim: false }, &rows, vec![exp]));
        let lse = self.reference_only(op(Op::Unary(UnaryOp::Log), &rows, vec![sum]));
        let target_kept = self.reference_only(ProgNode::Op {
            op: Op::Reshape,
            dtype: self.h.meta(target).0,
            shape: kept.clone(),
            inputs: vec![target],
        });
        let picked = self.reference_only(ProgNode::Indexing {
            op: IndexOp::Gather { dim: rank - 1 },
            dtype,
            shape: kept,
            inputs: vec![shifted, target_kept],
        });
        let picked = self.reference_only(op(Op::Reshape, &rows, vec![picked]));
        let loss = self.reference_only(op(Op::Binary(BinaryOp::Sub), &rows, vec![lse, picked]));
        let node = op(Op::Reduce { op: ReduceOp::Mean, dim: None, keepdim: false }, &Shape::scalar(), vec![loss]);
        self.push_result(node, t, "cross_entropy");
    }

    /// A leaf of random indices for a dimension of size `n`, in a random integer dtype; about
    /// one in eight is out of range (-1 or `n`, or 255 as u8).
    fn index_leaf(&mut self, shape: Shape, n: usize) -> usize {
        let dtype = *self.rng.pick(&self.index_dtypes(&[DType::I64, DType::I32, DType::U8]));
        let values = (0..shape.numel())
            .map(|_| {
                if n == 0 || self.rng.chance(0.125) {
                    *self.rng.pick(&[-1.0, n as f64, 255.0])
                } else {
                    self.rng.below(n) as f64
                }
            })
            // u8 holds neither -1 nor a class number above 255: both become 255 (in range
            // when there are more than 255 classes), as the tensor will hold them.
            .map(|v: f64| if dtype == DType::U8 && !(0.0..=255.0).contains(&v) { 255.0 } else { v })
            .collect();
        let leaf = self.h.data(dtype, shape, values);
        self.live.push(leaf);
        leaf
    }

    /// Those of `dtypes` the device holds (wgpu: no i64).
    fn index_dtypes(&self, dtypes: &[DType]) -> Vec<DType> {
        dtypes.iter().copied().filter(|&d| self.h.dev.target().dtypes.contains(d)).collect()
    }

    /// The reference's copy of `index` reshaped to `at` and expanded to `out` (as braid does
    /// inside `index_select` and `embedding`).
    fn expanded_index(&mut self, index: usize, at: &[usize], out: &[usize]) -> usize {
        let dtype = self.h.meta(index).0;
        let r =
            self.reference_only(ProgNode::Op { op: Op::Reshape, dtype, shape: Shape::from(at), inputs: vec![index] });
        self.reference_only(ProgNode::Op { op: Op::Expand, dtype, shape: Shape::from(out), inputs: vec![r] })
    }

    /// Calls braid's API on the live tensors of program nodes `inputs`, on the harness stream.
    pub(super) fn call(&mut self, inputs: &[usize], api: impl FnOnce(&[&Tensor]) -> Tensor) -> Tensor {
        let handles: Vec<Tensor> =
            inputs.iter().map(|&i| self.h.tensors[i].clone().expect("input is a live version")).collect();
        let refs: Vec<&Tensor> = handles.iter().collect();
        match &self.h.stream {
            Some(s) => s.scope(|| api(&refs)),
            None => api(&refs),
        }
    }

    pub(super) fn reference_only(&mut self, node: ProgNode) -> usize {
        let line = match &node {
            ProgNode::Op { op, inputs, .. } => format!("(reference only) {op:?} {inputs:?}"),
            ProgNode::Indexing { op, inputs, .. } => format!("(reference only) {op:?} {inputs:?}"),
            _ => "(reference only)".into(),
        };
        self.h.push_node(node, None, line)
    }

    pub(super) fn push_result(&mut self, node: ProgNode, t: Tensor, name: &str) {
        let (dtype, shape) = match &node {
            ProgNode::Op { dtype, shape, .. } | ProgNode::Indexing { dtype, shape, .. } => (*dtype, shape.clone()),
            _ => unreachable!("results are ops"),
        };
        assert_eq!((t.dtype(), t.shape()), (dtype, &shape), "API result of {name}");
        let line = format!("{name} {node:?}");
        let id = self.h.push_node(node, Some(t), line);
        self.live.push(id);
    }
}
