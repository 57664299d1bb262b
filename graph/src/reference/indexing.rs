//! Indexing ops, defined directly, element by element: an output element reads the element its
//! index names, independently of braid's gather and scatter kernels (which walk views and rows),
//! so the tests compare two independent definitions. A scatter-add of f16/bf16 is modelled as
//! the sum rounded to the type, then the add; braid sums and adds in f32 and rounds once, which
//! the bounds cover.
//!
//! Semantics (as `braid::Tensor::gather` documents them): an index outside `0..n` reads 0 in a
//! gather and adds nothing in a scatter-add. Bounds: a gather moves a value and its bound; a
//! scatter-add is the sum of the chosen terms (bounded like a `Sum` reduction, which also
//! covers the device's zero terms, added exactly) followed by an `Add` of the table; an
//! scatter moves values and bounds, the last write to an element winning; an
//! argmin is the argmax of the order-reversed values (`-x`, or `-1 - x` for integers), with
//! its certainty rule. An uncertain index makes every element it could reach uncertain.

use super::bounds::{SumAcc, UNCERTAIN, finish, read_err};
use super::{RefValue, Values, elementwise, reduce, unravel};
use crate::dtype::DType;
use crate::op::ReduceOp;
use crate::shape::Shape;
use crate::table::BinaryOp;

/// An indexing op of a reference program (see [`super::ProgNode::Indexing`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum IndexOp {
    /// Inputs `[src, index]`; the result has the index's shape.
    Gather { dim: usize },
    /// Inputs `[src, index]`; the result is the source's shape with `dim` replaced by the
    /// index's shape.
    IndexSelect { dim: usize },
    /// Inputs `[base, index, src]`; the result has the base's shape.
    ScatterAdd { dim: usize },
    /// Inputs `[base, index, src]`; the result has the base's shape.
    Scatter { dim: usize },
    /// Input `[x]`; the first minimum's index along `dim` (in the node's dtype, I64 or I32), NaN
    /// counting as the smallest.
    ArgMin { dim: usize, keepdim: bool },
}

fn ravel(shape: &Shape, idx: &[usize]) -> usize {
    idx.iter().zip(shape.dims()).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// The index at element `i` of `index` when certain and inside `0..n` (`Ok(None)` outside),
/// `Err` when uncertain.
fn target(index: &RefValue, i: usize, n: usize) -> Result<Option<usize>, ()> {
    let (j, e) = index.int_at(i);
    if e.is_infinite() {
        return Err(());
    }
    Ok((0..n as i64).contains(&j).then_some(j as usize))
}

pub(super) fn eval(op: IndexOp, dtype: DType, shape: &Shape, ins: &[&RefValue]) -> RefValue {
    match op {
        IndexOp::Gather { dim } => gather(dim, dtype, shape, ins[0], ins[1]),
        IndexOp::IndexSelect { dim } => index_select(dim, dtype, shape, ins[0], ins[1]),
        IndexOp::ScatterAdd { dim } => scatter_add(dim, dtype, shape, ins[0], ins[1], ins[2]),
        IndexOp::Scatter { dim } => scatter(dim, shape, ins[0], ins[1], ins[2]),
        IndexOp::ArgMin { dim, keepdim: _ } => argmin(dim, dtype, shape, ins[0]),
    }
}

fn gather(dim: usize, dtype: DType, shape: &Shape, src: &RefValue, index: &RefValue) -> RefValue {
    assert_eq!(shape, &index.shape, "gather: the result has the index's shape");
    let at = |i: usize, j: usize| {
        let mut at = unravel(shape, i);
        at[dim] = j;
        ravel(&src.shape, &at)
    };
    pick(dtype, shape, src, |i| target(index, i, src.shape.dims()[dim]).map(|j| j.map(|j| at(i, j))))
}

/// `out[pre.., i.., post..] = src[pre.., index[i..], post..]`.
fn index_select(dim: usize, dtype: DType, shape: &Shape, src: &RefValue, index: &RefValue) -> RefValue {
    let (k, rank) = (index.shape.rank(), src.shape.rank());
    assert_eq!(shape.rank(), rank - 1 + k, "index_select: the result's rank");
    let at = |i: usize| {
        let out = unravel(shape, i);
        let index_at = ravel(&index.shape, &out[dim..dim + k]);
        (out, index_at)
    };
    pick(dtype, shape, src, |i| {
        let (out, index_at) = at(i);
        target(index, index_at, src.shape.dims()[dim]).map(|j| {
            j.map(|j| {
                let pos: Vec<usize> =
                    out[..dim].iter().copied().chain([j]).chain(out[dim + k..].iter().copied()).collect();
                ravel(&src.shape, &pos)
            })
        })
    })
}

/// The result of reading, for each output element `i`, the source element `position(i)` names
/// (zero where it names none, uncertain where the index is).
fn pick(
    dtype: DType,
    shape: &Shape,
    src: &RefValue,
    position: impl Fn(usize) -> Result<Option<usize>, ()>,
) -> RefValue {
    let picks: Vec<Result<Option<usize>, ()>> = (0..shape.numel()).map(position).collect();
    let bound = |p: &Result<Option<usize>, ()>| match p {
        Err(()) => UNCERTAIN,
        Ok(None) => 0.0,
        Ok(Some(s)) => src.bound(*s),
    };
    let bounds: Vec<f64> = picks.iter().map(bound).collect();
    match &src.values {
        Values::Float(v) => {
            let values = picks.iter().map(|p| p.ok().flatten().map_or(0.0, |s| v[s])).collect();
            RefValue::from_floats(dtype, shape.clone(), values, bounds)
        }
        Values::Int(v) => {
            let values = picks.iter().map(|p| p.ok().flatten().map_or(0, |s| v[s])).collect();
            RefValue::from_ints(dtype, shape.clone(), values, bounds)
        }
    }
}

fn scatter_add(dim: usize, dtype: DType, shape: &Shape, base: &RefValue, index: &RefValue, src: &RefValue) -> RefValue {
    assert_eq!(shape, &base.shape, "scatter_add: the result has the base's shape");
    let n = shape.dims()[dim];
    // For each output element, the source elements aimed at it, in order.
    let mut sets: Vec<Vec<usize>> = vec![Vec::new(); shape.numel()];
    let mut uncertain = vec![false; shape.numel()];
    for c in 0..src.numel() {
        let mut at = unravel(&src.shape, c);
        match target(index, c, n) {
            Ok(Some(j)) => {
                at[dim] = j;
                sets[ravel(shape, &at)].push(c);
            }
            Ok(None) => {}
            Err(()) => {
                for j in 0..n {
                    at[dim] = j;
                    uncertain[ravel(shape, &at)] = true;
                }
            }
        }
    }
    let contribution = if dtype.is_float() {
        let c = dtype.compute();
        let (values, bounds): (Vec<f64>, Vec<f64>) = sets
            .iter()
            .zip(&uncertain)
            .map(|(set, &u)| {
                let mut acc = SumAcc::new(c);
                for &s in set {
                    let (v, e) = src.float_at(s);
                    let e = read_err(v, e, c);
                    acc.add(v, e, v.abs() + e);
                }
                let (z, p) = acc.finish();
                let (v, b) = if set.is_empty() { (0.0, 0.0) } else { finish(dtype, z, p, 0.0, 0.0) };
                (v, if u { UNCERTAIN } else { b })
            })
            .unzip();
        RefValue::from_floats(dtype, shape.clone(), values, bounds)
    } else {
        let (values, bounds): (Vec<i64>, Vec<f64>) = sets
            .iter()
            .zip(&uncertain)
            .map(|(set, &u)| {
                let sum = set.iter().fold(0i64, |a, &s| a.wrapping_add(src.int_at(s).0));
                let b = if u || set.iter().any(|&s| src.bound(s).is_infinite()) { UNCERTAIN } else { 0.0 };
                (dtype.wrap_int(sum), b)
            })
            .unzip();
        RefValue::from_ints(dtype, shape.clone(), values, bounds)
    };
    elementwise::binary(BinaryOp::Add, dtype, shape, base, &contribution)
}

/// The base with each source element moved to where its index names, in order (a later write
/// to an element replaces an earlier one, value and bound).
fn scatter(dim: usize, shape: &Shape, base: &RefValue, index: &RefValue, src: &RefValue) -> RefValue {
    assert_eq!(shape, &base.shape, "scatter: the result has the base's shape");
    let n = shape.dims()[dim];
    let mut out = base.clone();
    let mut uncertain = vec![false; shape.numel()];
    for c in 0..src.numel() {
        let mut at = unravel(&src.shape, c);
        match target(index, c, n) {
            Ok(Some(j)) => {
                at[dim] = j;
                let o = ravel(shape, &at);
                match (&mut out.values, &src.values) {
                    (Values::Float(o_v), Values::Float(s_v)) => o_v[o] = s_v[c],
                    (Values::Int(o_v), Values::Int(s_v)) => o_v[o] = s_v[c],
                    _ => panic!("scatter: the source's dtype is the base's"),
                }
                out.bounds[o] = src.bound(c);
            }
            Ok(None) => {}
            Err(()) => {
                for j in 0..n {
                    at[dim] = j;
                    uncertain[ravel(shape, &at)] = true;
                }
            }
        }
    }
    for (b, _) in out.bounds.iter_mut().zip(&uncertain).filter(|(_, u)| **u) {
        *b = UNCERTAIN;
    }
    out
}

fn argmin(dim: usize, dtype: DType, shape: &Shape, x: &RefValue) -> RefValue {
    let reversed = match &x.values {
        Values::Float(v) => {
            RefValue::from_floats(x.dtype, x.shape.clone(), v.iter().map(|v| -v).collect(), x.bounds.clone())
        }
        Values::Int(v) => {
            let r = v.iter().map(|&v| if x.dtype == DType::U8 { 255 - v } else { -1 - v }).collect();
            RefValue::from_ints(x.dtype, x.shape.clone(), r, x.bounds.clone())
        }
    };
    reduce::reduce(ReduceOp::ArgMax, Some(dim), dtype, shape, &reversed)
}
