//! Lowering of a segment of the flush graph into a [`Kernel`].
//!
//! Each op says here how it becomes loads, an expression and stores (or a reduction, or a
//! matrix product). Elementwise ops take their expression from the op table, never from code in
//! this file. Lowering is pure: it never allocates buffers or runs anything.

use crate::kernel::{Arg, Body, Kernel, Load, MapLoop, MatmulKernel, ReduceKernel, Store, View};
use braid_fusion::Segment;
use braid_graph::expr::{Distribution, ExprBuilder, ExprId};
use braid_graph::{DType, FlushGraph, FlushNode, Op, ReduceOp, Shape, ValueRef};
use smallvec::SmallVec;

/// Lowers `segment` of `graph`. Arguments are the segment's inputs, then its outputs.
pub fn lower_segment(graph: &FlushGraph, segment: &Segment) -> Kernel {
    assert_eq!(segment.nodes.len(), 1, "fusion is a pass-through: one node per segment");
    let node = &graph.nodes[segment.nodes[0]];
    let mut args: Vec<Arg> = segment
        .inputs
        .iter()
        .map(|&v| {
            let (dtype, shape) = graph.meta(v);
            Arg { dtype, len: shape.numel() }
        })
        .collect();
    args.push(Arg { dtype: node.dtype, len: node.shape.numel() });
    let arg_of = |v: ValueRef| segment.inputs.iter().position(|&x| x == v).expect("input of segment") as u16;
    let input_args: SmallVec<[u16; 3]> = node.inputs.iter().map(|&v| arg_of(v)).collect();
    let input_shapes: SmallVec<[&Shape; 3]> = node.inputs.iter().map(|&v| graph.meta(v).1).collect();
    let input_dtypes: SmallVec<[DType; 3]> = node.inputs.iter().map(|&v| graph.meta(v).0).collect();
    let out = segment.inputs.len() as u16;
    let body = lower_node(node, &input_args, &input_shapes, &input_dtypes, out);
    Kernel { args, inputs: segment.inputs.len(), body }
}

fn lower_node(node: &FlushNode, args: &[u16], shapes: &[&Shape], dtypes: &[DType], out: u16) -> Body {
    let shape = &node.shape;
    // A map over the output's index space whose loads broadcast every input to it.
    let elementwise = |build: &dyn Fn(&mut ExprBuilder, &[ExprId]) -> ExprId| {
        let mut b = ExprBuilder::new();
        let loads: Vec<Load> = args
            .iter()
            .zip(shapes)
            .zip(dtypes)
            .map(|((&arg, s), &dtype)| Load { arg, dtype, view: View::broadcast(s, shape) })
            .collect();
        let ids: Vec<ExprId> = loads.iter().enumerate().map(|(i, l)| b.load(i as u16, l.dtype)).collect();
        let root = build(&mut b, &ids);
        map(shape, loads, b, root, out, node.dtype)
    };
    match &node.op {
        Op::Input => unreachable!("inputs are materialised when recorded"),
        Op::Event => unreachable!("user events run no kernel; the planner never lowers them"),
        Op::Full(v) => elementwise(&|b, _| b.constant(v.0, node.dtype)),
        Op::Arange { start } => elementwise(&|b, _| {
            let i = b.index();
            let s = b.int_constant(*start, DType::I64);
            b.add(i, s)
        }),
        Op::Rand { lo, hi, seed } => elementwise(&|b, _| {
            let i = b.index();
            let u = b.random(*seed, Distribution::Uniform, i, node.dtype);
            let low = b.constant(lo.0, node.dtype);
            let range = b.constant(hi.0 - lo.0, node.dtype);
            let scaled = b.mul(range, u);
            b.add(low, scaled)
        }),
        Op::Randn { seed } => elementwise(&|b, _| {
            let i = b.index();
            b.random(*seed, Distribution::Normal, i, node.dtype)
        }),
        Op::Unary(u) => elementwise(&|b, x| (u.def().kernel)(b, x[0])),
        Op::Binary(op) => elementwise(&|b, x| (op.def().kernel)(b, x[0], x[1])),
        Op::BinaryScalar { op, scalar, scalar_first } => elementwise(&|b, x| {
            let s = b.constant_like(x[0], scalar.0);
            if *scalar_first { (op.def().kernel)(b, s, x[0]) } else { (op.def().kernel)(b, x[0], s) }
        }),
        Op::Compare(c) => elementwise(&|b, x| b.cmp(c.def().prim, x[0], x[1])),
        Op::Select => elementwise(&|b, x| b.select(x[0], x[1], x[2])),
        Op::Clamp { lo, hi } => elementwise(&|b, x| {
            let lo = b.constant_like(x[0], lo.0);
            let hi = b.constant_like(x[0], hi.0);
            let m = b.max(x[0], lo);
            b.min(m, hi)
        }),
        Op::Cast => elementwise(&|b, x| b.cast(node.dtype, x[0])),
        Op::Reshape | Op::Contiguous | Op::ToDevice => {
            copy(View::contiguous(shape), args[0], dtypes[0], shape, out, node.dtype)
        }
        Op::Expand => copy(View::broadcast(shapes[0], shape), args[0], dtypes[0], shape, out, node.dtype),
        Op::Permute(perm) => {
            let src = shapes[0].contiguous_strides();
            let view = View { dims: shape.dims().into(), strides: perm.iter().map(|&p| src[p]).collect(), offset: 0 };
            copy(view, args[0], dtypes[0], shape, out, node.dtype)
        }
        Op::Narrow { dim, start, .. } => {
            let src = shapes[0].contiguous_strides();
            let view = View { dims: shape.dims().into(), strides: src.clone(), offset: start * src[*dim] as usize };
            copy(view, args[0], dtypes[0], shape, out, node.dtype)
        }
        Op::Cat { dim } => {
            let out_strides = shape.contiguous_strides();
            let mut offset = 0;
            let loops = args
                .iter()
                .zip(shapes)
                .map(|(&arg, s)| {
                    let mut b = ExprBuilder::new();
                    let x = b.load(0, node.dtype);
                    let load = Load { arg, dtype: node.dtype, view: View::contiguous(s) };
                    let store_view = View { dims: s.dims().into(), strides: out_strides.clone(), offset };
                    offset += s.dims()[*dim] * out_strides[*dim] as usize;
                    let mut l = MapLoop {
                        dims: s.dims().into(),
                        loads: vec![load],
                        expr: b.finish(),
                        stores: vec![Store { arg: out, dtype: node.dtype, view: store_view, value: x }],
                    };
                    l.simplify();
                    l
                })
                .collect();
            Body::Map(loops)
        }
        Op::Reduce { op, dim, .. } => {
            let dims = shapes[0].dims();
            let (outer, len, inner) = match dim {
                None => (1, shapes[0].numel(), 1),
                Some(d) => (dims[..*d].iter().product(), dims[*d], dims[d + 1..].iter().product()),
            };
            Body::Reduce(ReduceKernel {
                op: *op,
                input: args[0],
                in_dtype: dtypes[0],
                output: out,
                out_dtype: if *op == ReduceOp::ArgMax { DType::I64 } else { node.dtype },
                outer,
                len,
                inner,
            })
        }
        Op::Matmul => Body::Matmul(matmul(shapes[0], shapes[1], shape, args, out, node.dtype)),
    }
}

fn map(shape: &Shape, loads: Vec<Load>, b: ExprBuilder, root: ExprId, out: u16, dtype: DType) -> Body {
    let mut l = MapLoop {
        dims: shape.dims().into(),
        loads,
        expr: b.finish(),
        stores: vec![Store { arg: out, dtype, view: View::contiguous(shape), value: root }],
    };
    l.simplify();
    Body::Map(vec![l])
}

/// A map that copies argument `arg` read through `view` into a contiguous output.
fn copy(view: View, arg: u16, in_dtype: DType, shape: &Shape, out: u16, dtype: DType) -> Body {
    let mut b = ExprBuilder::new();
    let x = b.load(0, in_dtype);
    map(shape, vec![Load { arg, dtype: in_dtype, view }], b, x, out, dtype)
}

fn matmul(a: &Shape, b: &Shape, out: &Shape, args: &[u16], output: u16, dtype: DType) -> MatmulKernel {
    let (ra, rb, ro) = (a.rank(), b.rank(), out.rank());
    let (m, k, n) = (a.dims()[ra - 2], a.dims()[ra - 1], b.dims()[rb - 1]);
    let batch = Shape::new(&out.dims()[..ro - 2]);
    let batch_a = Shape::new(&a.dims()[..ra - 2]);
    let batch_b = Shape::new(&b.dims()[..rb - 2]);
    let offsets = |bs: &Shape, matrix: usize| -> Vec<usize> {
        let v = View::broadcast(bs, &batch);
        let mut offs = Vec::with_capacity(batch.numel());
        let mut idx = vec![0usize; batch.rank()];
        for _ in 0..batch.numel() {
            let off: isize = idx.iter().zip(&v.strides).map(|(&i, &s)| i as isize * s).sum();
            offs.push(off as usize * matrix);
            for d in (0..batch.rank()).rev() {
                idx[d] += 1;
                if idx[d] < batch.dims()[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        offs
    };
    MatmulKernel {
        dtype,
        lhs: args[0],
        rhs: args[1],
        output,
        m,
        n,
        k,
        lhs_offsets: offsets(&batch_a, m * k),
        rhs_offsets: offsets(&batch_b, k * n),
    }
}
