//! The kernel IR: what one kernel launch does, independent of any target.
//!
//! A kernel reads and writes numbered buffer arguments through strided [`View`]s. Its body is
//! either a set of map loops (an index space, loads, an expression DAG from
//! [`braid_graph::expr`], stores), a row kernel (reductions with the elementwise work around
//! them), or a matrix product with an elementwise epilogue. Targets interpret it (the
//! CPU) or print it (CUDA C, WGSL); none of them needs to know which graph ops it came from.
//! The IR holds no buffers and no data, so kernels can be cached by structure.

use braid_graph::DType;
pub use braid_graph::View;
use braid_graph::expr::{Expr, ExprOp};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

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

/// Reductions along one axis of an index space (`dims`), one row at a time: a row is every
/// index that differs only along `axis` (with `axis` `None`, the whole space is one row). The
/// expression mixes per-element nodes and per-row nodes (`ExprOp::Reduce` and whatever depends
/// only on reductions, constants or loads that are constant along the row). Loads and stores are
/// views over `dims`; a per-row value is stored through a view with stride 0 along the row.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct RowKernel {
    pub dims: SmallVec<[usize; 4]>,
    pub axis: Option<usize>,
    pub loads: Vec<Load>,
    pub expr: Expr,
    pub stores: Vec<Store>,
}

/// One operand of a batched matrix product: batch `b` is the matrix at element offset
/// `batch_offsets[b]` of argument `arg`, with row stride `rs` and column stride `cs` (a
/// transposed operand is just other strides).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct MatmulOperand {
    pub arg: u16,
    pub batch_offsets: Vec<usize>,
    pub rs: isize,
    pub cs: isize,
}

/// Batched matrix product `[.., m, k] x [.., k, n]`, written contiguously (`[batch, m, n]`) to
/// argument `product` (one past the last argument means a scratch buffer the target provides),
/// then an optional elementwise epilogue over the product's index space, which reads the product
/// through a load of `product` and writes the kernel's outputs.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct MatmulKernel {
    pub dtype: DType,
    pub lhs: MatmulOperand,
    pub rhs: MatmulOperand,
    pub product: u16,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub epilogue: Option<MapLoop>,
}

#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Body {
    /// Loops run one after another (a concatenation is one loop per part).
    Map(Vec<MapLoop>),
    Rows(RowKernel),
    Matmul(MatmulKernel),
    /// This device's part of a collective over a group of devices, reading argument 0 (the
    /// whole buffer, contiguous) and writing argument 1: a library call (NCCL, or the host
    /// rendezvous between CPU devices), never printed as a kernel.
    Collective(braid_graph::Collective),
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

/// Checks one loop's loads, stores and expression against its kernel's arguments, as every
/// target must before touching memory: each load and store names an existing argument of its
/// dtype through a view that lies within it, each load slot the expression reads exists with
/// the dtype the expression expects, and each stored node has the dtype its store converts.
/// `arg(i)` gives argument `i`'s dtype and length in elements.
pub fn check_access(
    loads: &[Load],
    stores: &[Store],
    expr: &Expr,
    arg: impl Fn(u16) -> Option<(DType, usize)>,
) -> Result<(), String> {
    check_args(loads, stores, arg)?;
    for node in &expr.nodes {
        if let ExprOp::Load(slot) = node.op {
            let load = loads.get(slot as usize).ok_or("expression reads a missing load slot")?;
            if node.dtype != load.dtype.compute() {
                return Err(format!("load slot {slot} holds {} but the expression reads {}", load.dtype, node.dtype));
            }
        }
    }
    for store in stores {
        let node = expr.nodes.get(store.value as usize).ok_or("store of a missing expression node")?;
        if node.dtype != store.dtype.compute() {
            return Err(format!("store of a {} value to a {} argument", node.dtype, store.dtype));
        }
    }
    Ok(())
}

/// The part of [`check_access`] that depends on the arguments: each load and store names an
/// existing argument of its dtype through a view that lies within it. Enough before running
/// code printed from a loop that passed [`check_access`] (compiled code never reads the
/// expression again).
pub fn check_args(loads: &[Load], stores: &[Store], arg: impl Fn(u16) -> Option<(DType, usize)>) -> Result<(), String> {
    let access = |what: &str, a: u16, dtype: DType, view: &View| -> Result<(), String> {
        let (have, len) = arg(a).ok_or_else(|| format!("{what} of argument {a}, which does not exist"))?;
        if have != dtype {
            return Err(format!("{what} of {dtype} through argument {a} of {have}"));
        }
        match view.extent() {
            Some((lo, hi)) if lo < 0 || hi >= len as isize => {
                Err(format!("{what} view {view:?} reaches elements {lo}..={hi} of argument {a} of {len} elements"))
            }
            _ => Ok(()),
        }
    };
    loads.iter().try_for_each(|l| access("load", l.arg, l.dtype, &l.view))?;
    stores.iter().try_for_each(|s| access("store", s.arg, s.dtype, &s.view))
}
