//! Lowering of a fused segment into a [`Kernel`].
//!
//! Each node's expression comes from the op table; folded movement becomes the view of a load
//! and folded constants become constants of the expression. Map segments become one loop over
//! their index space, Rows segments a row kernel, Matmul segments a matrix product with its
//! epilogue, Attention segments a pass of fused attention, and the rest (Single segments) copies, gathers or scatter-adds. Lowering is pure: it
//! never allocates buffers or runs anything.

use crate::kernel::{
    Arg, Body, GatherKernel, Kernel, Load, MapLoop, MatmulKernel, MatmulOperand, QuantMatmulKernel, QuantizeKernel,
    RowKernel, ScatterKernel, ScatterWriteKernel, Store,
};
use braid_fusion::{FoldedRead as Source, Fusion, Segment, SegmentKind};
use braid_graph::expr::{Distribution, ExprBuilder, ExprId};
use braid_graph::{DType, FlushGraph, Op, ReduceOp, Shape, ValueRef, View};
use smallvec::SmallVec;

mod cat;

/// Rounds `e` to f16/bf16 when `dtype` is one (values of those types live in f32 registers).
fn round_half(b: &mut ExprBuilder, dtype: DType, e: ExprId) -> ExprId {
    match dtype {
        DType::F16 | DType::BF16 => b.cast(dtype, e),
        _ => e,
    }
}

/// Lowers the segments of one flush.
pub struct Lowering<'a> {
    graph: &'a FlushGraph,
    folded: Vec<bool>,
}

/// An expression under construction with its (deduplicated) loads.
struct Builder {
    b: ExprBuilder,
    loads: Vec<Load>,
    load_ids: Vec<ExprId>,
}

impl Builder {
    fn new() -> Builder {
        Builder { b: ExprBuilder::new(), loads: Vec::new(), load_ids: Vec::new() }
    }

    fn load(&mut self, arg: u16, dtype: DType, view: View) -> ExprId {
        if let Some(i) = self.loads.iter().position(|l| l.arg == arg && l.view == view) {
            return self.load_ids[i];
        }
        let id = self.b.load(self.loads.len() as u16, dtype);
        self.loads.push(Load { arg, dtype, view });
        self.load_ids.push(id);
        id
    }
}

impl<'a> Lowering<'a> {
    pub fn new(graph: &'a FlushGraph, fusion: &Fusion) -> Lowering<'a> {
        let mut folded = vec![false; graph.nodes.len()];
        for &n in &fusion.folded {
            folded[n] = true;
        }
        Lowering { graph, folded }
    }

    /// What a read of `v` loads, through folded constants and movement.
    fn source(&self, v: ValueRef) -> Source {
        braid_fusion::folded_read(self.graph, &self.folded, v)
    }

    /// Lowers `seg`. Arguments are the segment's inputs, then its outputs.
    pub fn segment(&self, seg: &Segment) -> Kernel {
        let g = self.graph;
        let mut args: Vec<Arg> = seg
            .inputs
            .iter()
            .map(|&v| {
                let (dtype, shape) = g.meta(v);
                Arg { dtype, len: shape.numel() }
            })
            .collect();
        args.extend(seg.outputs.iter().map(|&n| Arg { dtype: g.nodes[n].dtype, len: g.nodes[n].shape.numel() }));
        let body = match &seg.kind {
            SegmentKind::Map => Body::Map(self.map(seg, &seg.nodes)),
            SegmentKind::PackedMaps { parts, .. } => {
                let mut first = 0;
                let loops = parts.iter().flat_map(|&n| {
                    first += n;
                    self.map(seg, &seg.nodes[first - n..first])
                });
                Body::Map(loops.collect())
            }
            SegmentKind::Rows { full, axis } => Body::Rows(self.rows(seg, full, *axis)),
            SegmentKind::Matmul => self.matmul(seg, args.len()),
            SegmentKind::Attention => Body::Attention(Box::new(self.attention(seg))),
            // A transfer is a copy step, not a kernel; as a kernel it would be this same copy.
            SegmentKind::Single if matches!(g.nodes[seg.nodes[0]].op, Op::Collective(_)) => {
                let Op::Collective(c) = g.nodes[seg.nodes[0]].op else { unreachable!() };
                Body::Collective(c)
            }
            SegmentKind::Single | SegmentKind::Transfer => self.single(seg),
        };
        Kernel { args, inputs: seg.inputs.len(), body }
    }

    fn arg_of(seg: &Segment, u: ValueRef) -> u16 {
        seg.inputs.iter().position(|&x| x == u).expect("value is an input of its segment") as u16
    }

    fn out_arg(seg: &Segment, n: usize) -> u16 {
        (seg.inputs.len() + seg.outputs.iter().position(|&o| o == n).expect("an output")) as u16
    }

    /// The expression of node `i` over its operands `x`. A value stored as f16 or bf16 is
    /// rounded to that format even inside a kernel, so that fusing never changes a result
    /// (rounding, or overflow to infinity) compared with running the ops one by one.
    fn node_expr(&self, b: &mut ExprBuilder, i: usize, x: &[ExprId]) -> ExprId {
        let e = self.node_expr_unrounded(b, i, x);
        round_half(b, self.graph.nodes[i].dtype, e)
    }

    fn node_expr_unrounded(&self, b: &mut ExprBuilder, i: usize, x: &[ExprId]) -> ExprId {
        let node = &self.graph.nodes[i];
        match &node.op {
            Op::Full(v) => b.constant(node.dtype.round_f64(v.0), node.dtype),
            Op::Arange { start } => {
                let idx = b.index();
                let s = b.int_constant(*start, DType::I64);
                let at = b.add(idx, s);
                if node.dtype == DType::I64 { at } else { b.cast(node.dtype, at) }
            }
            Op::Rand { lo, hi, seed } => {
                let idx = b.index();
                let u = b.random(*seed, Distribution::Uniform, idx, node.dtype);
                let low = b.constant(lo.0, node.dtype);
                let range = b.constant(hi.0 - lo.0, node.dtype);
                let scaled = b.mul(range, u);
                b.add(low, scaled)
            }
            Op::Randn { seed } => {
                let idx = b.index();
                b.random(*seed, Distribution::Normal, idx, node.dtype)
            }
            Op::Unary(u) => (u.def().kernel)(b, x[0]),
            Op::Binary(op) => (op.def().kernel)(b, x[0], x[1]),
            Op::BinaryScalar { op, scalar, scalar_first } => {
                let s = b.constant_like(x[0], scalar.0);
                if *scalar_first { (op.def().kernel)(b, s, x[0]) } else { (op.def().kernel)(b, x[0], s) }
            }
            Op::Compare(c) => b.cmp(c.def().prim, x[0], x[1]),
            Op::Select => b.select(x[0], x[1], x[2]),
            Op::Clamp { lo, hi } => {
                let lo = b.constant_like(x[0], lo.0);
                let hi = b.constant_like(x[0], hi.0);
                let m = b.max(x[0], lo);
                b.min(m, hi)
            }
            Op::Cast => b.cast(node.dtype, x[0]),
            other => unreachable!("{} is not elementwise", other.name()),
        }
    }

    /// The operands of node `i`: internal values from `map`, the rest loaded (through `view_for`,
    /// which maps a view over the node's own shape onto the kernel's index space) or constant.
    fn operands(
        &self,
        seg: &Segment,
        bld: &mut Builder,
        map: &[Option<ExprId>],
        i: usize,
        view_for: &dyn Fn(View, &Shape) -> View,
    ) -> SmallVec<[ExprId; 3]> {
        let node = &self.graph.nodes[i];
        node.inputs
            .iter()
            .map(|&v| match v {
                ValueRef::Node(j) if map[j].is_some() => map[j].expect("checked"),
                _ => match self.source(v) {
                    Source::Const(x, dtype) => bld.b.constant(x, dtype),
                    // A value of this kernel read through a view fusion found to read it as a
                    // direct read would (a row kernel's reduced value expanded along its rows).
                    Source::Value(ValueRef::Node(j), view) if map[j].is_some() => {
                        let own = &self.graph.nodes[j].shape;
                        debug_assert_eq!(view_for(view, &node.shape), view_for(View::contiguous(own), own));
                        map[j].expect("checked")
                    }
                    Source::Value(u, view) => {
                        let dtype = self.graph.meta(u).0;
                        let arg = Self::arg_of(seg, u);
                        bld.load(arg, dtype, view_for(view, &node.shape))
                    }
                },
            })
            .collect()
    }

    /// The loop of `nodes` (all of `seg`'s, or one part of packed maps), storing the segment's
    /// outputs among them; a concatenation among them (see `cat.rs`) takes the values the loop
    /// computes as stores into its regions, and the loops filling its other regions follow.
    fn map(&self, seg: &Segment, nodes: &[usize]) -> Vec<MapLoop> {
        let g = self.graph;
        let is_cat = |i: usize| matches!(g.nodes[i].op, Op::Cat { .. });
        let space = g.nodes[nodes[0]].shape.clone();
        let mut bld = Builder::new();
        let mut map: Vec<Option<ExprId>> = vec![None; g.nodes.len()];
        for &i in nodes.iter().filter(|&&i| !is_cat(i)) {
            let x = self.operands(seg, &mut bld, &map, i, &|v, s| v.broadcast_to(s));
            map[i] = Some(self.node_expr(&mut bld.b, i, &x));
        }
        let mut stores: Vec<Store> = seg
            .outputs
            .iter()
            .filter(|o| map[**o].is_some())
            .map(|&o| Store {
                arg: Self::out_arg(seg, o),
                dtype: g.nodes[o].dtype,
                view: View::contiguous(&space),
                value: bld.b.stored(map[o].expect("output is in its segment"), g.nodes[o].dtype),
            })
            .collect();
        let computed = |v: ValueRef| matches!(v, ValueRef::Node(j) if map[j].is_some());
        let cats: Vec<usize> = nodes.iter().copied().filter(|&c| is_cat(c)).collect();
        for &c in &cats {
            for (k, &v) in g.nodes[c].inputs.iter().enumerate() {
                if let ValueRef::Node(j) = v
                    && let Some(value) = map[j]
                {
                    let dtype = g.nodes[c].dtype;
                    let view = braid_fusion::cat_region(g, c, k);
                    stores.push(Store { arg: Self::out_arg(seg, c), dtype, view, value: bld.b.stored(value, dtype) });
                }
            }
        }
        let mut l = MapLoop { dims: space.dims().into(), loads: bld.loads, expr: bld.b.finish(), stores };
        l.simplify();
        let mut loops = vec![l];
        for &c in &cats {
            loops.extend(self.cat_loops(seg, c, &computed));
        }
        loops
    }

    fn rows(&self, seg: &Segment, full: &Shape, axis: Option<usize>) -> RowKernel {
        let g = self.graph;
        // A view over a node's shape, as seen from the full index space.
        let to_full = |v: View, s: &Shape| braid_fusion::row_view(v, s, full, axis);
        let mut bld = Builder::new();
        let mut map: Vec<Option<ExprId>> = vec![None; g.nodes.len()];
        for &i in &seg.nodes {
            map[i] = Some(match g.nodes[i].op {
                // A reduction reads its operand over the full space.
                Op::Reduce { op, .. } => {
                    let x = self.operands(seg, &mut bld, &map, i, &|v, _| v.broadcast_to(full));
                    let r = bld.b.reduce(op, x[0]);
                    match op {
                        // Positions are found as i64; an I32 argmax converts them as it stores.
                        ReduceOp::ArgMax if g.nodes[i].dtype != DType::I64 => bld.b.cast(g.nodes[i].dtype, r),
                        _ => round_half(&mut bld.b, g.nodes[i].dtype, r),
                    }
                }
                _ => {
                    let x = self.operands(seg, &mut bld, &map, i, &to_full);
                    self.node_expr(&mut bld.b, i, &x)
                }
            });
        }
        let stores = seg
            .outputs
            .iter()
            .map(|&o| Store {
                arg: Self::out_arg(seg, o),
                dtype: g.nodes[o].dtype,
                view: to_full(View::contiguous(&g.nodes[o].shape), &g.nodes[o].shape),
                value: bld.b.stored(map[o].expect("output is in its segment"), g.nodes[o].dtype),
            })
            .collect();
        RowKernel { dims: full.dims().into(), axis, loads: bld.loads, expr: bld.b.finish(), stores }
    }

    fn matmul(&self, seg: &Segment, nargs: usize) -> Body {
        let g = self.graph;
        let mm = seg.nodes[0];
        let node = &g.nodes[mm];
        let out = &node.shape;
        let r = out.rank();
        let (m, n) = (out.dims()[r - 2], out.dims()[r - 1]);
        let k = g.meta(node.inputs[0]).1.dims().last().copied().unwrap_or(0);
        let batch = Shape::new(&out.dims()[..r - 2]);
        let operand = |v: ValueRef, rows: usize, cols: usize| -> MatmulOperand {
            let Source::Value(u, view) = self.source(v) else { unreachable!("constants never fold into a matmul") };
            let mut dims = batch.dims().to_vec();
            dims.extend([rows, cols]);
            let view = view.broadcast_to(&Shape::from(dims));
            let mut offsets = Vec::with_capacity(batch.numel());
            let mut idx = vec![0usize; r];
            for _ in 0..batch.numel() {
                offsets.push(view.offset_of(&idx) as usize);
                for d in (0..r - 2).rev() {
                    idx[d] += 1;
                    if idx[d] < batch.dims()[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
            MatmulOperand {
                arg: Self::arg_of(seg, u),
                batch_offsets: offsets,
                rs: view.strides[r - 2],
                cs: view.strides[r - 1],
            }
        };
        let lhs = operand(node.inputs[0], m, k);
        let (product, epilogue) = self.product_and_epilogue(seg, nargs);
        if let Op::QuantMatmul(layout) = &node.op {
            let Source::Value(u, _) = self.source(node.inputs[1]) else {
                unreachable!("a quantized weight is a value")
            };
            let weight = Self::arg_of(seg, u);
            let layout = **layout;
            return Body::QuantMatmul(QuantMatmulKernel {
                dtype: node.dtype,
                lhs,
                weight,
                layout,
                product,
                m,
                epilogue,
            });
        }
        let rhs = operand(node.inputs[1], k, n);
        Body::Matmul(MatmulKernel { dtype: node.dtype, lhs, rhs, product, m, n, k, epilogue })
    }

    /// Where a product segment's product goes (its own output, another output of its dtype,
    /// or scratch: one past the last argument) and its epilogue, which reads the product.
    fn product_and_epilogue(&self, seg: &Segment, nargs: usize) -> (u16, Option<MapLoop>) {
        let g = self.graph;
        let mm = seg.nodes[0];
        let node = &g.nodes[mm];
        let out = &node.shape;
        let product = if seg.outputs.contains(&mm) {
            Self::out_arg(seg, mm)
        } else {
            match seg.outputs.iter().find(|&&o| g.nodes[o].dtype == node.dtype) {
                Some(&o) => Self::out_arg(seg, o),
                None => nargs as u16, // a scratch buffer
            }
        };
        let epilogue = (seg.nodes.len() > 1).then(|| {
            let mut bld = Builder::new();
            let mut map: Vec<Option<ExprId>> = vec![None; g.nodes.len()];
            map[mm] = Some(bld.load(product, node.dtype, View::contiguous(out)));
            for &i in &seg.nodes[1..] {
                let x = self.operands(seg, &mut bld, &map, i, &|v, s| v.broadcast_to(s));
                map[i] = Some(self.node_expr(&mut bld.b, i, &x));
            }
            let stores = seg
                .outputs
                .iter()
                .filter(|&&o| o != mm)
                .map(|&o| Store {
                    arg: Self::out_arg(seg, o),
                    dtype: g.nodes[o].dtype,
                    view: View::contiguous(out),
                    value: bld.b.stored(map[o].expect("output is in its segment"), g.nodes[o].dtype),
                })
                .collect();
            let mut l = MapLoop { dims: out.dims().into(), loads: bld.loads, expr: bld.b.finish(), stores };
            l.simplify();
            l
        });
        (product, epilogue)
    }

    /// The kernel of an attention segment: its parts' shared operands as views, each part's
    /// output argument where its value leaves the kernel.
    fn attention(&self, seg: &Segment) -> crate::attention::AttentionKernel {
        let g = self.graph;
        let first = &g.nodes[seg.nodes[0]];
        let Op::Attention { causal, .. } = first.op else { unreachable!("an attention segment starts with attention") };
        let loads = (first.inputs.iter())
            .map(|&v| {
                let Source::Value(u, view) = self.source(v) else {
                    unreachable!("constants never fold into attention")
                };
                Load { arg: Self::arg_of(seg, u), dtype: g.meta(u).0, view }
            })
            .collect();
        let parts: Vec<crate::attention::PartOut> = (seg.nodes.iter())
            .map(|&n| {
                let Op::Attention { part, .. } = g.nodes[n].op else { unreachable!("only attention parts join") };
                crate::attention::PartOut { part, arg: seg.outputs.contains(&n).then(|| Self::out_arg(seg, n)) }
            })
            .collect();
        crate::attention::attention_kernel(causal, loads, &parts)
    }

    /// Kernels that are not fused: concatenation and materialised movement (copies), gathers and
    /// scatter-adds.
    fn single(&self, seg: &Segment) -> Body {
        let g = self.graph;
        let i = seg.nodes[0];
        let node = &g.nodes[i];
        let out = Self::out_arg(seg, i);
        let value_view = |v: ValueRef| -> (u16, DType, View) {
            let Source::Value(u, view) = self.source(v) else {
                unreachable!("constants fold only into expressions, scatter-add bases and concatenations")
            };
            (Self::arg_of(seg, u), g.meta(u).0, view)
        };
        let load = |v: ValueRef| {
            let (arg, dtype, view) = value_view(v);
            Load { arg, dtype, view }
        };
        let copy = |arg: u16, dtype: DType, load: View, store: View| -> MapLoop {
            let mut b = ExprBuilder::new();
            let x = b.load(0, dtype);
            let dims = load.dims.clone();
            let mut l = MapLoop {
                dims,
                loads: vec![Load { arg, dtype, view: load }],
                expr: b.finish(),
                stores: vec![Store { arg: out, dtype: node.dtype, view: store, value: x }],
            };
            l.simplify();
            l
        };
        match &node.op {
            Op::Quantize(layout) => {
                let (arg, dtype, view) = value_view(node.inputs[0]);
                let src = MatmulOperand {
                    arg,
                    batch_offsets: vec![view.offset_of(&[0, 0]) as usize],
                    rs: view.strides[0],
                    cs: view.strides[1],
                };
                Body::Quantize(QuantizeKernel { dtype, src, layout: **layout, out })
            }
            Op::Gather { .. } | Op::IndexSelect { .. } => {
                let (src_arg, src_dtype, src_view) = value_view(node.inputs[0]);
                let (index_arg, index_dtype, index_view) = value_view(node.inputs[1]);
                Body::Gather(gather_kernel(
                    &node.op,
                    Load { arg: src_arg, dtype: src_dtype, view: src_view },
                    Load { arg: index_arg, dtype: index_dtype, view: index_view },
                    &node.shape,
                    out,
                ))
            }
            Op::ScatterAdd { dim } => {
                // A base of zeros is folded (fusion folds only zeros into a scatter-add).
                let base = match self.source(node.inputs[0]) {
                    Source::Const(..) => None,
                    Source::Value(..) => Some(load(node.inputs[0])),
                };
                let (index, src) = (load(node.inputs[1]), load(node.inputs[2]));
                Body::Scatter(ScatterKernel {
                    dims: index.view.dims.clone(),
                    dim: *dim,
                    src,
                    index,
                    base,
                    out_dims: node.shape.dims().into(),
                    out,
                })
            }
            Op::Scatter { dim } => {
                let (base, index, src) = (load(node.inputs[0]), load(node.inputs[1]), load(node.inputs[2]));
                Body::ScatterWrite(ScatterWriteKernel {
                    dims: index.view.dims.clone(),
                    dim: *dim,
                    src,
                    index,
                    base,
                    out_dims: node.shape.dims().into(),
                    out,
                })
            }
            Op::Cat { .. } => Body::Map(self.cat_loops(seg, i, &|_| false)),
            op => {
                let (arg, dtype, view) = value_view(node.inputs[0]);
                let moved = match op {
                    Op::Permute(p) => Some(view.permute(p)),
                    Op::Expand => Some(view.broadcast_to(&node.shape)),
                    Op::Narrow { dim, start, len } => Some(view.narrow(*dim, *start, *len)),
                    Op::Reshape | Op::Contiguous | Op::ToDevice => view.reshape(&node.shape),
                    other => unreachable!("{} does not lower to a copy", other.name()),
                };
                match moved {
                    Some(v) => Body::Map(vec![copy(arg, dtype, v, View::contiguous(&node.shape))]),
                    // A reshape of a strided view: copy in the input's order (the same row-major
                    // order as the output's).
                    None => {
                        let store = View::contiguous(&view.shape());
                        Body::Map(vec![copy(arg, dtype, view, store)])
                    }
                }
            }
        }
    }
}

/// The kernel of a gather (`Op::Gather`) or an index selection (`Op::IndexSelect`) over the
/// output's shape `dims`: `src` and `index` arrive as views over their own shapes and leave as
/// views over `dims`, each with stride 0 along the other's dimensions.
fn gather_kernel(op: &Op, mut src: Load, mut index: Load, shape: &Shape, out: u16) -> GatherKernel {
    let dims: SmallVec<[usize; 4]> = shape.dims().into();
    let (along, extent) = match *op {
        Op::Gather { dim } | Op::IndexSelect { dim } => (src.view.strides[dim], src.view.dims[dim]),
        _ => unreachable!("{} is not a gather", op.name()),
    };
    match *op {
        Op::Gather { dim } => src.view.strides[dim] = 0,
        Op::IndexSelect { dim } => {
            let k = index.view.dims.len();
            let strides = std::mem::take(&mut src.view.strides);
            let (pre, post) = (&strides[..dim], &strides[dim + 1..]);
            src.view.strides =
                pre.iter().copied().chain(std::iter::repeat_n(0, k)).chain(post.iter().copied()).collect();
            index.view.strides = std::iter::repeat_n(0, dim)
                .chain(index.view.strides.iter().copied())
                .chain(std::iter::repeat_n(0, post.len()))
                .collect();
        }
        _ => unreachable!(),
    }
    src.view.dims = dims.clone();
    index.view.dims = dims.clone();
    GatherKernel { dims, src, along, extent, index, out }
}
