//! The kernel IR: what one kernel launch does, independent of any target.
//!
//! A kernel reads and writes numbered buffer arguments through strided [`View`]s. Its body is
//! either a set of map loops (an index space, loads, an expression DAG from
//! [`braid_graph::expr`], stores), a row kernel (reductions with the elementwise work around
//! them), a matrix product (of float or quantized weights) with an elementwise epilogue, a gather, a scatter-add, a pass of
//! fused attention, or a collective (a library call). Targets interpret it (the
//! CPU) or print it (CUDA C, WGSL); none of them needs to know which graph ops it came from.
//! The IR holds no buffers and no data, so kernels can be cached by structure.

pub use braid_graph::View;
use braid_graph::expr::{Expr, ExprOp};
use braid_graph::{DType, QuantLayout};
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

impl RowKernel {
    /// The dimensions a row runs along (`axis`, or all of them) and the others, which name
    /// a row (its position), in increasing order; `Err` for an axis past the rank.
    pub fn row_and_position_dims(&self) -> Result<(Vec<usize>, Vec<usize>), String> {
        let rank = self.dims.len();
        let row: Vec<usize> = match self.axis {
            Some(a) if a < rank => vec![a],
            Some(a) => return Err(format!("axis {a} of a rank-{rank} row kernel")),
            None => (0..rank).collect(),
        };
        let position = (0..rank).filter(|d| !row.contains(d)).collect();
        Ok((row, position))
    }
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

impl MatmulKernel {
    /// The checks every target runs before touching an operand: both operands have the same
    /// number of batches, and every matrix of each (`m x k`, `k x n`) lies inside its argument,
    /// which holds the product's dtype. `arg(i)` is argument `i`'s dtype and length.
    pub fn check_operands(&self, arg: impl Fn(u16) -> Option<(DType, usize)>) -> Result<(), String> {
        if self.rhs.batch_offsets.len() != self.lhs.batch_offsets.len() {
            return Err("matmul operands have different batch counts".into());
        }
        self.lhs.check(self.m, self.k, self.dtype, &arg)?;
        self.rhs.check(self.k, self.n, self.dtype, &arg)
    }
}

/// A product with a quantized weight (`Op::QuantMatmul`): `x [m, k]` (operand `lhs`, one
/// batch, a float dtype) times the `[k, n]` weight of `layout` held in argument `weight` (`U8`,
/// the layout's bytes; see `braid_graph::quant`), each weight element dequantized in f32 and
/// the dot products accumulated in f32, written contiguously (`[m, n]`, `dtype`) to argument
/// `product` (one past the last argument: a scratch buffer the target provides), then the
/// optional epilogue, as in [`MatmulKernel`]. No target ever writes a dequantized weight.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct QuantMatmulKernel {
    pub dtype: DType,
    pub lhs: MatmulOperand,
    pub weight: u16,
    pub layout: QuantLayout,
    pub product: u16,
    pub m: usize,
    pub epilogue: Option<MapLoop>,
}

impl QuantMatmulKernel {
    /// The checks every target runs before touching an operand: `x` lies inside its argument of
    /// the product's dtype, and the weight argument holds the layout's bytes.
    pub fn check_operands(&self, arg: impl Fn(u16) -> Option<(DType, usize)>) -> Result<(), String> {
        if self.lhs.batch_offsets.len() != 1 {
            return Err(format!("a quantized product of {} batches (one is lowered)", self.lhs.batch_offsets.len()));
        }
        let l = &self.layout;
        QuantLayout::new(l.scheme, l.k, l.n, l.scale)?;
        self.lhs.check(self.m, self.layout.k, self.dtype, &arg)?;
        match arg(self.weight) {
            Some((DType::U8, len)) if len == self.layout.bytes() => Ok(()),
            Some((dtype, len)) => Err(format!(
                "a quantized {} weight is {} bytes, its argument {len} of {dtype}",
                self.layout,
                self.layout.bytes()
            )),
            None => Err(format!("quantized weight of argument {}, which does not exist", self.weight)),
        }
    }

    /// The product's length in elements.
    pub fn numel(&self) -> usize {
        self.m * self.layout.n
    }
}

/// Quantization of a float `[k, n]` weight (`Op::Quantize`): operand `src` (one batch, of
/// `dtype`), read as `k x n`, becomes the layout's bytes in argument `out` (`U8`). Only the CPU
/// runs it (quantizing is a load-time step the recorder places there); printers refuse it.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct QuantizeKernel {
    pub dtype: DType,
    pub src: MatmulOperand,
    pub layout: QuantLayout,
    pub out: u16,
}

impl QuantizeKernel {
    /// The source lies inside its argument of `dtype`; the output holds the layout's bytes.
    pub fn check_operands(&self, arg: impl Fn(u16) -> Option<(DType, usize)>) -> Result<(), String> {
        if self.src.batch_offsets.len() != 1 {
            return Err("a quantized weight is one matrix".into());
        }
        let l = &self.layout;
        QuantLayout::new(l.scheme, l.k, l.n, l.scale)?;
        self.src.check(self.layout.k, self.layout.n, self.dtype, &arg)?;
        match arg(self.out) {
            Some((DType::U8, len)) if len == self.layout.bytes() => Ok(()),
            _ => Err(format!("a quantized {} weight needs {} bytes of output", self.layout, self.layout.bytes())),
        }
    }
}

impl MatmulOperand {
    /// Every `rows x cols` matrix of the operand lies inside its argument, of `dtype`.
    fn check(
        &self,
        rows: usize,
        cols: usize,
        dtype: DType,
        arg: impl Fn(u16) -> Option<(DType, usize)>,
    ) -> Result<(), String> {
        let (held, len) =
            arg(self.arg).ok_or_else(|| format!("matmul operand of argument {}, which does not exist", self.arg))?;
        if held != dtype {
            return Err(format!("matmul operand of {held} where {dtype} was expected"));
        }
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        for &off in &self.batch_offsets {
            let (mut lo, mut hi) = (off as i128, off as i128);
            for (extent, stride) in [(rows, self.rs), (cols, self.cs)] {
                let span = (extent as i128 - 1) * stride as i128;
                if span < 0 { lo += span } else { hi += span }
            }
            if lo < 0 || hi >= len as i128 {
                return Err(format!("matmul operand reaches elements {lo}..={hi} of an argument of {len}"));
            }
        }
        Ok(())
    }
}

/// A gather (`Op::Gather`, `Op::IndexSelect`): over the output's index space `dims`, element
/// `p` reads the index `j = index[p]`, then the source element at `src`'s position for `p` plus
/// `j * along`, or zero (every dtype's zero bits) where `j` is outside `0..extent`. Both loads
/// are views over `dims` (the source's with stride 0 where the output's dimensions are the
/// index's, the index's with stride 0 where they are the source's); the index is `I64` or
/// `I32`; the output (argument `out`) is contiguous. Elements are moved whole, never
/// converted, so one kernel serves every dtype, and the work is one read of the index and one
/// of the source per element, however long the gathered dimension.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct GatherKernel {
    pub dims: SmallVec<[usize; 4]>,
    pub src: Load,
    pub along: isize,
    pub extent: usize,
    pub index: Load,
    pub out: u16,
}

impl GatherKernel {
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// The checks every target runs before touching memory: the index is `I64` or `I32`, both
    /// views are over `dims`, the output has the source's dtype and the output's length, and
    /// every view lies within its argument (the source's at every index in `0..extent`).
    pub fn check(&self, arg: impl Fn(u16) -> Option<(DType, usize)>) -> Result<(), String> {
        if !matches!(self.index.dtype, DType::I64 | DType::I32) {
            return Err(format!("a gather's index is {}, not i64 or i32", self.index.dtype));
        }
        let views = [&self.src.view, &self.index.view];
        if views.iter().any(|v| v.strides.len() != v.dims.len()) || [self.src.arg, self.index.arg].contains(&self.out) {
            return Err("a gather's views need a stride per dimension, and its output its own argument".into());
        }
        if self.src.view.dims != self.dims || self.index.view.dims != self.dims {
            return Err(format!(
                "a gather over {:?} reads views over {:?} and {:?}",
                self.dims, self.src.view.dims, self.index.view.dims
            ));
        }
        // The source at every index it may read: one more dimension, the gathered one.
        let mut src = self.src.clone();
        src.view.dims.push(self.extent);
        src.view.strides.push(self.along);
        let out = Store {
            arg: self.out,
            dtype: self.src.dtype,
            view: View::contiguous(&braid_graph::Shape::new(&self.dims)),
            value: 0,
        };
        match arg(self.out) {
            Some((_, len)) if len != self.numel() => Err(format!("a gather of {} elements into {len}", self.numel())),
            _ => check_args(&[src, self.index.clone()], &[out], arg),
        }
    }
}

/// A scatter-add (`Op::ScatterAdd`): the output (argument `out`, contiguous over `out_dims`)
/// is `base + sums`, where each element's sum adds, in order along `dim`, the source elements
/// whose index names it. Over the source space `dims` (the index's and the source's shape,
/// equal to `out_dims` but along `dim`), element `p` adds `src[p]` to the sum at `p` with
/// dimension `dim` replaced by `j = index[p]`, and nothing where `j` is outside
/// `0..out_dims[dim]`. Sums start from zero and the base is added last (a base of zeros, a
/// folded constant, is `None`: the sums are the result); each sum is folded by
/// one thread in order, so the bits do not depend on how many threads run. The dtype (source,
/// base and output) is one whose arithmetic is its storage's: F32, F64, I32, I64 (wrapping) or
/// U8 (wrapping); the `scatter_add` of halves runs in F32.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct ScatterKernel {
    pub dims: SmallVec<[usize; 4]>,
    pub dim: usize,
    pub src: Load,
    pub index: Load,
    pub base: Option<Load>,
    pub out_dims: SmallVec<[usize; 4]>,
    pub out: u16,
}

impl ScatterKernel {
    pub fn dtype(&self) -> DType {
        self.src.dtype
    }

    /// Rows of the source space: its elements that differ only along `dim`.
    pub fn rows(&self) -> usize {
        source_rows(&self.dims, self.dim)
    }

    /// Threads per row of a GPU scatter-add: enough for about 64Ki threads in all, at most 64
    /// and at most the output's extent along the dimension, a power of two (a thread's share is
    /// a mask of the index, not a 64-bit division). Each adds, in order, only the row's elements
    /// whose index is its own modulo the count, so every output element still has one thread
    /// and one order of adds. An embedding's gradient (256 rows of 2,048 elements) on an H200:
    /// 313 us with one thread per row, 168 us with 64, 232 us with 256 (each thread reads all
    /// of its row's indices).
    pub fn parts_per_row(&self) -> usize {
        let most = (65_536 / self.rows().max(1)).clamp(1, 64).min(self.out_dims[self.dim].max(1));
        1 << most.ilog2()
    }

    /// The output's stride along `dim` (it is contiguous).
    pub fn out_along(&self) -> isize {
        self.out_dims[self.dim + 1..].iter().product::<usize>() as isize
    }

    /// The checks every target runs before touching memory: the dtype, the shapes, and every
    /// view within its argument (the output contiguous, of the output's length).
    pub fn check(&self, arg: impl Fn(u16) -> Option<(DType, usize)>) -> Result<(), String> {
        let dtype = self.dtype();
        let base_dtype = self.base.as_ref().map_or(dtype, |b| b.dtype);
        if !matches!(dtype, DType::F32 | DType::F64 | DType::I32 | DType::I64 | DType::U8) || base_dtype != dtype {
            return Err(format!("a scatter-add of {dtype} into {base_dtype}"));
        }
        if !matches!(self.index.dtype, DType::I64 | DType::I32) {
            return Err(format!("a scatter-add's index is {}, not i64 or i32", self.index.dtype));
        }
        let loads = [Some(&self.src), Some(&self.index), self.base.as_ref()].into_iter().flatten();
        if loads.clone().any(|l| l.view.strides.len() != l.view.dims.len() || l.arg == self.out) {
            return Err("a scatter-add's views need a stride per dimension, and its output its own argument".into());
        }
        let (d, o) = (&self.dims, &self.out_dims);
        let shapes = self.dim < d.len()
            && d.len() == o.len()
            && (0..d.len()).all(|i| i == self.dim || d[i] == o[i])
            && self.src.view.dims == *d
            && self.index.view.dims == *d
            && self.base.as_ref().is_none_or(|b| b.view.dims == *o);
        if !shapes {
            return Err(format!("a scatter-add along {} of {d:?} into {o:?}", self.dim));
        }
        let numel: usize = o.iter().product();
        let out = Store { arg: self.out, dtype, view: View::contiguous(&braid_graph::Shape::new(o)), value: 0 };
        match arg(self.out) {
            Some((_, len)) if len != numel => Err(format!("a scatter-add of {numel} elements into {len}")),
            _ => {
                let loads: Vec<Load> =
                    [Some(&self.src), Some(&self.index), self.base.as_ref()].into_iter().flatten().cloned().collect();
                check_args(&loads, &[out], arg)
            }
        }
    }
}

/// Rows of a scatter's source space `dims`: its elements that differ only along `dim`.
fn source_rows(dims: &[usize], dim: usize) -> usize {
    dims.iter().product::<usize>().checked_div(dims[dim]).unwrap_or(0)
}

/// A scatter (`Op::Scatter`): the output (argument `out`, contiguous over `out_dims`) is the
/// base with, for each row of the source space `dims` (the index's and the source's shape; a
/// row is its elements that differ only along `dim`), the row's elements written in order at
/// the positions along `dim` their indices name (a later one wins; an index outside
/// `0..out_dims[dim]` writes nothing). Two steps: the base copied into the output, then one
/// thread per row. The copy is skipped when the base and the output are one buffer and the
/// base is read as it lies (`base_in_place`): the scheduler wrote the scatter over its base,
/// and only the source's elements are stored (a key/value cache's new rows). Any dtype: the
/// elements move as bits.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct ScatterWriteKernel {
    pub dims: SmallVec<[usize; 4]>,
    pub dim: usize,
    pub src: Load,
    pub index: Load,
    pub base: Load,
    pub out_dims: SmallVec<[usize; 4]>,
    pub out: u16,
}

impl ScatterWriteKernel {
    pub fn dtype(&self) -> DType {
        self.src.dtype
    }

    /// Rows of the source space: its elements that differ only along `dim`.
    pub fn rows(&self) -> usize {
        source_rows(&self.dims, self.dim)
    }

    /// The output's stride along `dim` (it is contiguous).
    pub fn out_along(&self) -> isize {
        self.out_dims[self.dim + 1..].iter().product::<usize>() as isize
    }

    /// Whether the base is read as the output lies (contiguous from element 0): then, bound to
    /// the output's buffer, it is already the output's first step, and the copy is skipped.
    pub fn base_in_place(&self) -> bool {
        self.base.view == View::contiguous(&braid_graph::Shape::new(&self.out_dims))
    }

    /// The checks every target runs before touching memory: the dtypes, the shapes, and every
    /// view within its argument (the output contiguous, of the output's length).
    pub fn check(&self, arg: impl Fn(u16) -> Option<(DType, usize)>) -> Result<(), String> {
        let dtype = self.dtype();
        if self.base.dtype != dtype {
            return Err(format!("a scatter of {dtype} into {}", self.base.dtype));
        }
        if !matches!(self.index.dtype, DType::I64 | DType::I32) {
            return Err(format!("a scatter's index is {}, not i64 or i32", self.index.dtype));
        }
        let loads = [&self.src, &self.index, &self.base];
        if loads.iter().any(|l| l.view.strides.len() != l.view.dims.len() || l.arg == self.out) {
            return Err("a scatter's views need a stride per dimension, and its output its own argument".into());
        }
        let (d, o) = (&self.dims, &self.out_dims);
        let shapes = self.dim < d.len()
            && d.len() == o.len()
            && (0..d.len()).all(|i| i == self.dim || d[i] == o[i])
            && self.src.view.dims == *d
            && self.index.view.dims == *d
            && self.base.view.dims == *o;
        if !shapes {
            return Err(format!("a scatter along {} of {d:?} into {o:?}", self.dim));
        }
        let numel: usize = o.iter().product();
        let out = Store { arg: self.out, dtype, view: View::contiguous(&braid_graph::Shape::new(o)), value: 0 };
        match arg(self.out) {
            Some((_, len)) if len != numel => Err(format!("a scatter of {numel} elements into {len}")),
            _ => check_args(&loads.map(Load::clone), &[out], arg),
        }
    }
}

#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Body {
    /// Loops run one after another (a concatenation is one loop per part).
    Map(Vec<MapLoop>),
    Rows(RowKernel),
    Matmul(MatmulKernel),
    QuantMatmul(QuantMatmulKernel),
    Quantize(QuantizeKernel),
    Gather(GatherKernel),
    Scatter(ScatterKernel),
    ScatterWrite(ScatterWriteKernel),
    /// Boxed: the largest variant would set the size of every kernel body.
    Attention(Box<crate::attention::AttentionKernel>),
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
