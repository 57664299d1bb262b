//! Movement ops: every output element is some input element, found by index arithmetic on
//! row-major layouts. Values and bounds move together; nothing is added to a bound.

use super::{RefValue, Values};
use crate::shape::Shape;

/// Linear index `offset + Σ idx_d * strides[d]` of every element of `dims` (row-major order),
/// where `idx` is the element's multi-index.
fn strided_map(dims: &[usize], strides: &[usize], offset: usize) -> Vec<usize> {
    let n: usize = dims.iter().product();
    (0..n)
        .map(|i| {
            let (mut rem, mut pos) = (i, offset);
            for (&d, &s) in dims.iter().zip(strides).rev() {
                pos += (rem % d) * s;
                rem /= d;
            }
            pos
        })
        .collect()
}

/// Row-major strides of `dims`, in elements.
fn contiguous(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; dims.len()];
    let mut acc = 1;
    for (s, &d) in strides.iter_mut().zip(dims).rev() {
        *s = acc;
        acc *= d;
    }
    strides
}

/// For every element of `out` (row-major), the linear index of the element of `input` that it
/// reads when `input` is broadcast to `out` (NumPy: right-aligned, dimensions of 1 stretch).
pub(super) fn broadcast_map(input: &Shape, out: &Shape) -> Vec<usize> {
    let (inp, o) = (input.dims(), out.dims());
    assert!(input.broadcasts_to(out), "shape {input} does not broadcast to {out}");
    let lead = o.len() - inp.len();
    let in_strides = contiguous(inp);
    let strides: Vec<usize> =
        (0..o.len()).map(|j| if j < lead || inp[j - lead] == 1 { 0 } else { in_strides[j - lead] }).collect();
    strided_map(o, &strides, 0)
}

/// The elements of `x` at `map`, as a tensor of `shape` (same dtype).
pub(super) fn gather(x: &RefValue, map: &[usize], shape: &Shape) -> RefValue {
    let values = match &x.values {
        Values::Float(v) => Values::Float(map.iter().map(|&i| v[i]).collect()),
        Values::Int(v) => Values::Int(map.iter().map(|&i| v[i]).collect()),
    };
    let bounds = map.iter().map(|&i| x.bounds[i]).collect();
    RefValue { dtype: x.dtype, shape: shape.clone(), values, bounds }
}

/// Reshape, contiguous, to_device: the same elements in the same order.
pub(super) fn reshape(x: &RefValue, shape: &Shape) -> RefValue {
    assert_eq!(x.numel(), shape.numel(), "reshape of {} to {shape}", x.shape);
    RefValue { shape: shape.clone(), ..x.clone() }
}

/// Output dimension `i` is input dimension `perm[i]`.
pub(super) fn permute(x: &RefValue, perm: &[usize], shape: &Shape) -> RefValue {
    let strides = contiguous(x.shape.dims());
    let out_strides: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    gather(x, &strided_map(shape.dims(), &out_strides, 0), shape)
}

pub(super) fn expand(x: &RefValue, shape: &Shape) -> RefValue {
    gather(x, &broadcast_map(&x.shape, shape), shape)
}

/// Elements `start..start + len` along `dim`.
pub(super) fn narrow(x: &RefValue, dim: usize, start: usize, len: usize, shape: &Shape) -> RefValue {
    let strides = contiguous(x.shape.dims());
    assert_eq!(shape.dims()[dim], len, "narrow: result shape {shape}");
    gather(x, &strided_map(shape.dims(), &strides, start * strides[dim]), shape)
}

/// The parts side by side along `dim`, in order.
pub(super) fn cat(parts: &[&RefValue], dim: usize, shape: &Shape) -> RefValue {
    // Row-major: for each index of the dimensions before `dim`, each part contributes one
    // contiguous block of (its size along dim) x (elements after dim).
    let outer: usize = shape.dims()[..dim].iter().product();
    let inner: usize = shape.dims()[dim + 1..].iter().product();
    let mut values = match &parts[0].values {
        Values::Float(_) => Values::Float(Vec::with_capacity(shape.numel())),
        Values::Int(_) => Values::Int(Vec::with_capacity(shape.numel())),
    };
    let mut bounds = Vec::with_capacity(shape.numel());
    for o in 0..outer {
        for p in parts {
            let block = p.shape.dims()[dim] * inner;
            let range = o * block..(o + 1) * block;
            match (&mut values, &p.values) {
                (Values::Float(out), Values::Float(v)) => out.extend_from_slice(&v[range.clone()]),
                (Values::Int(out), Values::Int(v)) => out.extend_from_slice(&v[range.clone()]),
                _ => panic!("cat of tensors with different dtypes"),
            }
            bounds.extend_from_slice(&p.bounds[range]);
        }
    }
    RefValue { dtype: parts[0].dtype, shape: shape.clone(), values, bounds }
}
