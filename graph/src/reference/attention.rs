//! Scaled dot-product attention ([`Op::Attention`](crate::Op::Attention)) in the reference
//! interpreter: exact f64 formulas, and bounds that cover every way a fused kernel may compute
//! them.
//!
//! What a device may do, and what the bounds allow for:
//! - scores `s = (q . k) / sqrt(d)`, each dot accumulated in the compute dtype `c` in any order
//!   (as a matmul's), the scale applied in `c` (or folded with `log2 e` into an `exp2`);
//! - an online softmax: a running maximum, rescaled partial sums (at most one rescaling per key,
//!   whatever the tile size), `exp` within the platform's allowance;
//! - the probabilities (and, backward, `ds`) rounded to the inputs' dtype before they are
//!   multiplied with `v` (or `q`, `k`), as tensor-core kernels do; the products accumulated in
//!   `c`;
//! - backward, the probabilities recomputed as `exp(s - lse)` from the saved log-sum-exp, whose
//!   own error (an input's bound) is carried through.
//!
//! An element whose row reads a non-finite or uncertain input is uncertain.

use super::RefValue;
use super::bounds::{SumAcc, UNCERTAIN, finish, gamma, read_err};
use crate::dtype::DType;
use crate::op::AttentionPart;
use crate::shape::Shape;

/// The geometry of one attention node: batches, query and key rows, head dimension.
struct Dims {
    batch: usize,
    sq: usize,
    sk: usize,
    d: usize,
}

/// One batch's scores with their bounds, `[sq, sk]` row-major; masked entries are `None`.
struct Scores {
    s: Vec<Option<(f64, f64)>>,
}

/// Adds the term `w x` to a sum: `w` within `we` (already as a device reads it), `x` an input
/// element with its bound (a device may read a subnormal as zero).
fn add_product(acc: &mut SumAcc, (w, we): (f64, f64), (x, xe): (f64, f64), c: DType) {
    let xe = read_err(x, xe, c);
    acc.add(w * x, w.abs() * xe + we * (x.abs() + xe), (w.abs() + we) * (x.abs() + xe));
}

/// The relative error `exp` may add at argument `x` on this platform, beyond the argument's.
fn exp_relative(x: f64, c: DType) -> f64 {
    let wgsl = if super::platform_scales_exp() { 3.0 + 2.0 * x.abs() } else { 0.0 };
    (super::allowance("exp", 4.0) + wgsl) * c.epsilon()
}

fn scores(q: &RefValue, k: &RefValue, dims: &Dims, b: usize, causal: bool, c: DType) -> Scores {
    let Dims { sq, sk, d, .. } = *dims;
    let scale = 1.0 / (d as f64).sqrt();
    let mut s = Vec::with_capacity(sq * sk);
    for i in 0..sq {
        for j in 0..sk {
            if causal && j > i {
                s.push(None);
                continue;
            }
            let mut acc = SumAcc::new(c);
            for t in 0..d {
                let (qa, qe) = q.float_at((b * sq + i) * d + t);
                add_product(&mut acc, (qa, read_err(qa, qe, c)), k.float_at((b * sk + j) * d + t), c);
            }
            let (z, p) = acc.finish();
            let value = z * scale;
            let bound = match p {
                Some(p) if value.is_finite() => p * scale + 3.0 * c.epsilon() * value.abs(),
                _ => UNCERTAIN,
            };
            s.push(Some((value, bound)));
        }
    }
    Scores { s }
}

/// Evaluates attention part `part` (see [`AttentionPart`] for its inputs).
pub(super) fn eval(part: AttentionPart, causal: bool, dtype: DType, shape: &Shape, ins: &[&RefValue]) -> RefValue {
    let qd = ins[0].shape.dims();
    let r = qd.len();
    let dims =
        Dims { batch: qd[..r - 2].iter().product(), sq: qd[r - 2], sk: ins[1].shape.dims()[r - 2], d: qd[r - 1] };
    let c = ins[0].dtype.compute();
    let mut values = vec![0.0; shape.numel()];
    let mut bounds = vec![0.0; shape.numel()];
    for b in 0..dims.batch {
        let sc = scores(ins[0], ins[1], &dims, b, causal, c);
        match part {
            AttentionPart::Out | AttentionPart::Lse => {
                forward(part, dtype, ins, &dims, b, &sc, &mut values, &mut bounds)
            }
            _ => backward(part, dtype, ins, &dims, b, &sc, &mut values, &mut bounds),
        }
    }
    RefValue::from_floats(dtype, shape.clone(), values, bounds)
}

/// One batch of the output or the log-sum-exp.
#[allow(clippy::too_many_arguments)]
fn forward(
    part: AttentionPart,
    dtype: DType,
    ins: &[&RefValue],
    dims: &Dims,
    b: usize,
    sc: &Scores,
    values: &mut [f64],
    bounds: &mut [f64],
) {
    let Dims { sq, sk, d, .. } = *dims;
    let (v, c) = (ins[2], ins[0].dtype.compute());
    let (eps_c, eps_s) = (c.epsilon(), ins[0].dtype.epsilon());
    for i in 0..sq {
        let row: Vec<(usize, f64, f64)> = (0..sk).filter_map(|j| sc.s[i * sk + j].map(|(s, e)| (j, s, e))).collect();
        let m = row.iter().map(|r| r.1).fold(f64::NEG_INFINITY, f64::max);
        let e_max = row.iter().map(|r| r.2).fold(0.0, f64::max);
        let n = row.len();
        let p: Vec<f64> = row.iter().map(|&(_, s, _)| (s - m).exp()).collect();
        let l: f64 = p.iter().sum();
        // The relative error of each probability, then of the normalised weights.
        // Every rescaling of the running sums (at most one per key) multiplies by one `exp`.
        let rescale = n as f64 * (exp_relative(0.0, c) + 2.0 * eps_c);
        let rho = row
            .iter()
            .map(|&(_, s, e)| (e + e_max).exp_m1() + 8.0 * eps_c * (s.abs() + m.abs()) + exp_relative(s - m, c) + eps_s)
            .fold(0.0, f64::max)
            + rescale;
        let g = gamma(n, c);
        let certain = rho.is_finite() && rho < 0.25 && g.is_some() && m.is_finite();
        let g = g.unwrap_or(0.0);
        let omega = (1.0 + rho) / (1.0 - rho) - 1.0 + g + 2.0 * eps_c;
        let at = b * sq + i;
        if part == AttentionPart::Lse {
            let log_l = l.ln();
            let z = m + log_l;
            let err = e_max - (1.0 - rho - g).ln()
                + eps_c * (4.0 * m.abs() + (4.0 + super::allowance("log", 4.0)) * log_l.abs() + 4.0);
            let (value, bound) = finish(dtype, z, certain.then_some(err), 2.0, z.abs());
            values[at] = value;
            bounds[at] = bound;
            continue;
        }
        for t in 0..d {
            let (mut z, mut err, mut mag) = (0.0, 0.0, 0.0);
            let mut finite = certain;
            for (&(j, _, _), &pj) in row.iter().zip(&p) {
                let (vv, ve) = v.float_at((b * sk + j) * d + t);
                let ve = read_err(vv, ve, c);
                finite &= vv.is_finite() && ve.is_finite();
                let w = pj / l;
                z += w * vv;
                err += w * (1.0 + omega) * ve + omega * w * vv.abs();
                mag += w * (1.0 + omega) * (vv.abs() + ve);
            }
            let p = finite.then_some(err + g * mag);
            let (value, bound) = finish(dtype, z, p, 2.0, mag);
            values[at * d + t] = value;
            bounds[at * d + t] = bound;
        }
    }
}

/// One batch of a gradient: `dv = P^T do`, `dq = ds k / sqrt(d)`, `dk = ds^T q / sqrt(d)` with
/// `P = exp(s - lse)` and `ds = P (do v^T - delta)`.
#[allow(clippy::too_many_arguments)]
fn backward(
    part: AttentionPart,
    dtype: DType,
    ins: &[&RefValue],
    dims: &Dims,
    b: usize,
    sc: &Scores,
    values: &mut [f64],
    bounds: &mut [f64],
) {
    let Dims { sq, sk, d, .. } = *dims;
    let (q, k, v, d_out, lse, delta) = (ins[0], ins[1], ins[2], ins[3], ins[4], ins[5]);
    let c = q.dtype.compute();
    let (eps_c, eps_s) = (c.epsilon(), q.dtype.epsilon());
    let scale = 1.0 / (d as f64).sqrt();
    // Per (i, j): P, its relative error, ds and its absolute error (None where masked).
    let mut cells: Vec<Option<(f64, f64, f64, f64)>> = Vec::with_capacity(sq * sk);
    for i in 0..sq {
        let (ll, le) = lse.float_at(b * sq + i);
        let (dd, de) = delta.float_at(b * sq + i);
        for j in 0..sk {
            let Some((s, e)) = sc.s[i * sk + j] else {
                cells.push(None);
                continue;
            };
            let p = (s - ll).exp();
            let rho = (e + le).exp_m1() + 8.0 * eps_c * (s.abs() + ll.abs()) + exp_relative(s - ll, c) + eps_s;
            let mut acc = SumAcc::new(c);
            for t in 0..d {
                let (oa, oe) = d_out.float_at((b * sq + i) * d + t);
                add_product(&mut acc, (oa, read_err(oa, oe, c)), v.float_at((b * sk + j) * d + t), c);
            }
            let (dp, dpe) = acc.finish();
            let x = dp - dd;
            let ex = dpe.unwrap_or(UNCERTAIN) + de + eps_c * (dp.abs() + dd.abs());
            let ds = p * x;
            let dse =
                p * (1.0 + rho) * ex + rho * p * x.abs() + (2.0 * eps_c + eps_s) * p * (1.0 + rho) * (x.abs() + ex);
            let ok = rho.is_finite() && rho < 0.25 && ll.is_finite() && dd.is_finite() && dse.is_finite();
            cells.push(Some((p, if ok { rho } else { UNCERTAIN }, ds, if ok { dse } else { UNCERTAIN })));
        }
    }
    // Sums of `weight(i, j) * x(row, t)` over the free index, in c.
    let mut write = |at: usize, acc: SumAcc, scale_by: f64, ulps: f64| {
        let (z, p) = acc.finish();
        let (z, p) = (z * scale_by, p.map(|p| p * scale_by + 2.0 * eps_c * (z * scale_by).abs()));
        let (value, bound) = finish(dtype, z, p, ulps, 0.0);
        values[at] = value;
        bounds[at] = bound;
    };
    match part {
        AttentionPart::GradV => {
            for j in 0..sk {
                for t in 0..d {
                    let mut acc = SumAcc::new(c);
                    for i in 0..sq {
                        let Some((p, rho, _, _)) = cells[i * sk + j] else { continue };
                        add_product(&mut acc, (p, rho * p), d_out.float_at((b * sq + i) * d + t), c);
                    }
                    write((b * sk + j) * d + t, acc, 1.0, 1.0);
                }
            }
        }
        AttentionPart::GradQ => {
            for i in 0..sq {
                for t in 0..d {
                    let mut acc = SumAcc::new(c);
                    for j in 0..sk {
                        let Some((_, _, ds, dse)) = cells[i * sk + j] else { continue };
                        add_product(&mut acc, (ds, dse), k.float_at((b * sk + j) * d + t), c);
                    }
                    write((b * sq + i) * d + t, acc, scale, 2.0);
                }
            }
        }
        AttentionPart::GradK => {
            for j in 0..sk {
                for t in 0..d {
                    let mut acc = SumAcc::new(c);
                    for i in 0..sq {
                        let Some((_, _, ds, dse)) = cells[i * sk + j] else { continue };
                        add_product(&mut acc, (ds, dse), q.float_at((b * sq + i) * d + t), c);
                    }
                    write((b * sk + j) * d + t, acc, scale, 2.0);
                }
            }
        }
        AttentionPart::Out | AttentionPart::Lse => unreachable!("forward parts are not gradients"),
    }
}
