//! Reductions and matrix products: each output element from a set of input elements.

use super::RefValue;
use super::bounds::{SumAcc, UNCERTAIN, finish, propagate_binary, read_err};
use super::movement::broadcast_map;
use crate::dtype::DType;
use crate::op::ReduceOp;
use crate::shape::Shape;
use crate::table::Sensitivity;

/// `ulps` of mean's final division (or multiplication by a rounded `1/n`).
const MEAN_ULPS: f64 = 2.0;

/// The input indices each output element of a reduction reads, output in row-major order:
/// viewing the input as `[outer, n, inner]` around `dim` (everything when `dim` is `None`).
fn reduction_sets(shape: &Shape, dim: Option<usize>) -> Vec<Vec<usize>> {
    let dims = shape.dims();
    let (outer, n, inner) = match dim {
        None => (1, shape.numel(), 1),
        Some(d) => (dims[..d].iter().product(), dims[d], dims[d + 1..].iter().product()),
    };
    let mut sets = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            sets.push((0..n).map(|j| (o * n + j) * inner + i).collect());
        }
    }
    sets
}

pub(super) fn reduce(op: ReduceOp, dim: Option<usize>, dtype: DType, shape: &Shape, x: &RefValue) -> RefValue {
    let sets = reduction_sets(&x.shape, dim);
    assert_eq!(sets.len(), shape.numel(), "{}: result shape {shape} for input {}", op.name(), x.shape);
    if op == ReduceOp::ArgMax {
        let (values, bounds) = sets.iter().map(|set| argmax(x, set)).unzip();
        // The node's dtype: I64, or I32 on request (positions fit: `infer::argmax` checks).
        return RefValue::from_ints(dtype, shape.clone(), values, bounds);
    }
    if !dtype.is_float() {
        let (values, bounds) = sets
            .iter()
            .map(|set| {
                let vals = set.iter().map(|&i| x.int_at(i).0);
                let v = match op {
                    ReduceOp::Sum => vals.fold(0i64, i64::wrapping_add),
                    ReduceOp::Max => vals.max().unwrap_or(i64::MIN),
                    ReduceOp::Min => vals.min().unwrap_or(i64::MAX),
                    ReduceOp::Mean | ReduceOp::ArgMax => panic!("{} of integers", op.name()),
                };
                let bound = if set.iter().any(|&i| x.bound(i).is_infinite()) { UNCERTAIN } else { 0.0 };
                (dtype.wrap_int(v), bound)
            })
            .unzip();
        return RefValue::from_ints(dtype, shape.clone(), values, bounds);
    }
    let c = dtype.compute();
    let (values, bounds) = sets
        .iter()
        .map(|set| {
            let elems = set.iter().map(|&i| {
                let (v, e) = x.float_at(i);
                (v, read_err(v, e, c))
            });
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    let mut acc = SumAcc::new(c);
                    for (v, e) in elems {
                        acc.add(v, e, v.abs() + e);
                    }
                    let (z, p) = acc.finish();
                    if set.is_empty() {
                        // Exactly 0, and 0 / 0: a NaN of two constants, which a platform's
                        // arithmetic may fold as it folds one from a NaN.
                        if op == ReduceOp::Sum { (0.0, 0.0) } else { super::arithmetic((f64::NAN, 0.0), true) }
                    } else if op == ReduceOp::Sum {
                        finish(dtype, z, p, 0.0, 0.0)
                    } else {
                        let n = set.len() as f64;
                        finish(dtype, z / n, p.map(|p| p / n), MEAN_ULPS, 0.0)
                    }
                }
                ReduceOp::Max | ReduceOp::Min => {
                    let pick = if op == ReduceOp::Max { f64::max } else { f64::min };
                    let mut z = if op == ReduceOp::Max { f64::NEG_INFINITY } else { f64::INFINITY };
                    let mut p = Some(0.0f64);
                    for (v, e) in elems {
                        z = if z.is_nan() || v.is_nan() { f64::NAN } else { pick(z, v) };
                        p = p.filter(|_| e.is_finite()).map(|p| p.max(e));
                    }
                    if set.is_empty() {
                        p = None;
                    }
                    finish(dtype, z, p, 0.0, 0.0)
                }
                ReduceOp::ArgMax => unreachable!("handled above"),
            }
        })
        .unzip();
    RefValue::from_floats(dtype, shape.clone(), values, bounds)
}

/// The index (within `set`) of the first maximum, NaN counting as the largest value, and
/// whether every correct device finds the same one.
fn argmax(x: &RefValue, set: &[usize]) -> (i64, f64) {
    if set.iter().any(|&i| x.bound(i).is_infinite()) || set.is_empty() {
        return (0, UNCERTAIN);
    }
    if !x.dtype.is_float() {
        // Exact integers: the first maximum (max_by_key would return the last).
        let vals: Vec<i64> = set.iter().map(|&i| x.int_at(i).0).collect();
        let best = vals.iter().copied().max().expect("non-empty");
        return (vals.iter().position(|&v| v == best).expect("present") as i64, 0.0);
    }
    let c = x.dtype.compute();
    let elems: Vec<(f64, f64)> = set
        .iter()
        .map(|&i| {
            let (v, e) = x.float_at(i);
            (v, read_err(v, e, c))
        })
        .collect();
    if let Some(w) = elems.iter().position(|(v, _)| v.is_nan()) {
        // A NaN reference value is certain, and no finite-bounded element before it can be NaN.
        return (w as i64, 0.0);
    }
    let mut w = 0;
    for (j, &(v, _)) in elems.iter().enumerate() {
        if v > elems[w].0 {
            w = j;
        }
    }
    let floor = elems[w].0 - elems[w].1;
    let certain =
        elems.iter().enumerate().all(|(j, &(v, e))| j == w || (j < w && v + e < floor) || (j > w && v + e <= floor));
    (w as i64, if certain { 0.0 } else { UNCERTAIN })
}

/// `[.., m, k] x [.., k, n]` with broadcast batch dimensions.
pub(super) fn matmul(dtype: DType, shape: &Shape, a: &RefValue, b: &RefValue) -> RefValue {
    let (da, db, dout) = (a.shape.dims(), b.shape.dims(), shape.dims());
    let (m, k, n) = (da[da.len() - 2], da[da.len() - 1], db[db.len() - 1]);
    assert_eq!(db[db.len() - 2], k, "matmul: inner dimensions of {} and {}", a.shape, b.shape);
    let batch = Shape::new(&dout[..dout.len() - 2]);
    let batch_a = broadcast_map(&Shape::new(&da[..da.len() - 2]), &batch);
    let batch_b = broadcast_map(&Shape::new(&db[..db.len() - 2]), &batch);
    // For every output element: the (a index, b index) pairs of its dot product.
    let dots = (0..batch.numel()).flat_map(|bi| {
        let (oa, ob) = (batch_a[bi] * m * k, batch_b[bi] * k * n);
        (0..m).flat_map(move |i| (0..n).map(move |j| (0..k).map(move |t| (oa + i * k + t, ob + t * n + j))))
    });
    if !dtype.is_float() {
        let (values, bounds) = dots
            .map(|pairs| {
                let mut sum = 0i64;
                let mut bound = 0.0;
                for (ia, ib) in pairs {
                    let ((va, ea), (vb, eb)) = (a.int_at(ia), b.int_at(ib));
                    sum = sum.wrapping_add(va.wrapping_mul(vb));
                    if ea.is_infinite() || eb.is_infinite() {
                        bound = UNCERTAIN;
                    }
                }
                (dtype.wrap_int(sum), bound)
            })
            .unzip();
        return RefValue::from_ints(dtype, shape.clone(), values, bounds);
    }
    let c = dtype.compute();
    let mul = |x: f64, y: f64| x * y;
    let (values, bounds) = dots
        .map(|pairs| {
            let mut acc = SumAcc::new(c);
            for (ia, ib) in pairs {
                let ((va, ea), (vb, eb)) = (a.float_at(ia), b.float_at(ib));
                let (ea, eb) = (read_err(va, ea, c), read_err(vb, eb, c));
                let t = va * vb;
                let e = propagate_binary(Sensitivity::Product, &mul, (va, ea), (vb, eb), t).unwrap_or(UNCERTAIN);
                acc.add(t, e, (va.abs() + ea) * (vb.abs() + eb));
            }
            let (z, p) = acc.finish();
            finish(dtype, z, p, 0.0, 0.0)
        })
        .unzip();
    RefValue::from_floats(dtype, shape.clone(), values, bounds)
}
