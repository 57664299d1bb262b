//! Random products with quantized weights (`Body::QuantMatmul`) for the printer tests, with the
//! error bound each product element is compared within. Backend-neutral: a suite includes this
//! file next to `cases.rs` (as `mod cases`) and `common` (as `mod common`), runs the kernel on
//! its target and compares with `braid_devices::cpu::run_kernel`.
//!
//! Each case: `x [m, k]` of f32, f16 or bf16 (row-major, padded, transposed, rows reversed,
//! offset), a weight of `Int8` or `Int4 { group }` (32, 64, 128) with F32 or F16 scales, packed
//! with `QuantLayout::pack` from random integers over the whole byte range (the extremes
//! `-128`/`127` and `-8`/`7` included, some blocks all zero) and random scales (negative,
//! zero, and f16 subnormals among them; never f32 subnormals, which a GPU may flush); `k` odd
//! and even for `Int8`, a multiple of the group for `Int4`; `n` from 1 to 70; `m` from 1 to 20
//! or 37. Half the products have an epilogue (`unary(product + bias)`, the unary op exact:
//! relu, negation, absolute value or halving; stored once or twice), the product in an output
//! argument or, behind an epilogue, in scratch memory.

use super::cases::{Case, element, encode, new_case, output, random_values, random_values_with};
use super::common::Rng;
use braid_graph::expr::{ExprBuilder, PrimUnary};
use braid_graph::{DType, QuantLayout, Scheme};
use braid_lowering::{Arg, Body, Load, MapLoop, MatmulOperand, QuantMatmulKernel, View};

/// A random quantized product (see the module docs) and, per element of the product (and of
/// every output, each laid out as the product `[m, n]`), how far a target may be from the CPU:
/// two summation orders of `k` f32 products, `k * 2^-23 * sum |x w|`, plus, for an f16 or bf16
/// product, one unit in the last place of the product (f32 results within the first bound may
/// round to neighbouring halves, and an epilogue may store the half product as f32).
pub(crate) fn quant_case(rng: &mut Rng, n: usize) -> (Case, Vec<f64>) {
    let d = *rng.pick(&[DType::F32, DType::F16, DType::BF16]);
    let int4 = |group| Scheme::Int4 { group };
    let scheme = *rng.pick(&[Scheme::Int8, Scheme::Int8, int4(32), int4(64), int4(128)]);
    let scale = *rng.pick(&[DType::F32, DType::F16]);
    let m = if rng.chance(0.15) { 37 } else { 1 + rng.below(20) };
    let k = match scheme {
        Scheme::Int8 => 1 + rng.below(300),
        Scheme::Int4 { group } => group * (1 + rng.below(3)),
    };
    let nn = 1 + rng.below(70);
    quant_case_of(rng, n, d, QuantLayout::new(scheme, k, nn, scale).expect("a valid layout"), m)
}

/// [`quant_case`] of inputs of `d`, `m` rows and a weight of `layout` (the rest drawn).
pub(crate) fn quant_case_of(rng: &mut Rng, n: usize, d: DType, layout: QuantLayout, m: usize) -> (Case, Vec<f64>) {
    let (scheme, scale, k, nn) = (layout.scheme, layout.scale, layout.k, layout.n);
    let epilogue = rng.chance(0.5);
    let scratch = epilogue && rng.chance(0.4);
    let inputs = if epilogue { 3 } else { 2 };
    // x: row-major (padded or not), transposed, or rows reversed; after a few elements.
    let pad = 1 + rng.below(3);
    let (rs, cs): (isize, isize) = match rng.below(5) {
        0 | 1 => (k as isize, 1),
        2 => ((k + pad) as isize, 1),
        3 => (1, (m + pad) as isize),
        _ => (-(k as isize), 1),
    };
    let label =
        format!("quant {n} ({d} x [{m}, {k}] strides [{rs}, {cs}] x {layout}, epilogue {epilogue}, scratch {scratch})");
    let mut c = new_case(label, inputs, Body::Map(vec![]));
    let base = if rs < 0 { (m - 1) * k } else { 0 };
    let pre = rng.below(3);
    let len = pre + (m - 1) * rs.unsigned_abs() + (k - 1) * cs.unsigned_abs() + 1 + rng.below(2);
    c.kernel.args.push(Arg { dtype: d, len });
    c.init.push(encode(d, &random_values_with(rng, d, len, false, false)));
    let lhs = MatmulOperand { arg: 0, batch_offsets: vec![pre + base], rs, cs };

    // The weight: integers channel-major, one scale per (channel, group).
    let (lo, hi) = match scheme {
        Scheme::Int8 => (-128i32, 127i32),
        Scheme::Int4 { .. } => (-8, 7),
    };
    let (group, groups) = (layout.group(), layout.groups());
    let mut values = vec![0i32; k * nn];
    let mut scales = vec![0f32; nn * groups];
    for j in 0..nn {
        for g in 0..groups {
            let block = j * k + g * group..j * k + ((g + 1) * group).min(k);
            match rng.below(10) {
                0 => {} // all zero
                1 => values[block].iter_mut().enumerate().for_each(|(i, v)| *v = [lo, hi, -hi, 0][i % 4]),
                _ => values[block].iter_mut().for_each(|v| *v = lo + rng.below((hi - lo + 1) as usize) as i32),
            }
            scales[j * groups + g] = match rng.below(12) {
                0 => 0.0,
                1 if scale == DType::F16 => rng.uniform(-4e-6, 4e-6) as f32, // f16 subnormals
                2 => -0.0,
                _ => rng.uniform(-0.05, 0.05) as f32,
            };
        }
    }
    let bytes = layout.pack(&values, &scales);
    c.kernel.args.push(Arg { dtype: DType::U8, len: bytes.len() });
    c.init.push(bytes.clone());

    if epilogue {
        c.kernel.args.push(Arg { dtype: d, len: nn });
        c.init.push(encode(d, &random_values_with(rng, d, nn, false, false)));
    }
    let total = m * nn;
    let outputs = if epilogue { 1 + rng.below(2) } else { 0 };
    let product = if scratch {
        (inputs + outputs) as u16
    } else {
        c.kernel.args.push(Arg { dtype: d, len: total });
        c.init.push(encode(d, &random_values(rng, d, total, false)));
        inputs as u16
    };
    let epilogue = epilogue.then(|| {
        let mut b = ExprBuilder::new();
        let (p, bias) = (b.load(0, d), b.load(1, d));
        let s = b.add(p, bias);
        let y = match rng.below(4) {
            0 => {
                let zero = b.constant(0.0, d.compute());
                b.max(s, zero)
            }
            1 => b.neg(s),
            2 => b.unary(PrimUnary::Abs, s),
            _ => {
                let half = b.constant(0.5, d.compute());
                b.mul(s, half)
            }
        };
        let view = |strides: [isize; 2]| View {
            dims: [m, nn].as_slice().into(),
            strides: strides.as_slice().into(),
            offset: 0,
        };
        let loads = vec![
            Load { arg: product, dtype: d, view: view([nn as isize, 1]) },
            Load { arg: 2, dtype: d, view: view([0, 1]) },
        ];
        let mut stores = vec![];
        for v in [y, s].into_iter().take(outputs) {
            let arg = c.kernel.args.len();
            stores.push(output(rng, b.dtype(v), view([nn as isize, 1]), total, v, arg, &mut c));
        }
        MapLoop { dims: [m, nn].as_slice().into(), loads, expr: b.finish(), stores }
    });
    if scratch {
        assert_eq!(product as usize, c.kernel.args.len(), "scratch is one past the last argument");
    }

    // Per product element: sum |x w| over k and the dot product, from the values as stored
    // (each x w is exact in f64; the sum's error there is far below the bound).
    let w = layout.dequantize(&bytes);
    let x = |r: usize, i: usize| {
        let at = (lhs.batch_offsets[0] as isize + r as isize * rs + i as isize * cs) as usize;
        element(d, &c.init[0], at).expect("a float")
    };
    let mut bound = Vec::with_capacity(total);
    for r in 0..m {
        for j in 0..nn {
            let terms = (0..k).map(|i| x(r, i) * w[i * nn + j] as f64);
            let (s, p): (f64, f64) = (terms.clone().map(f64::abs).sum(), terms.sum());
            let mut e = k as f64 * 2f64.powi(-23) * s;
            if d != DType::F32 {
                // An ulp of the half product (both f32 results lie within `e` of `p`, each
                // within `e` of the other): 2 * epsilon relative, or the f16 subnormal step.
                e += 2.0 * d.epsilon() * (p.abs() + 2.0 * e) + if d == DType::F16 { 2f64.powi(-24) } else { 0.0 };
            }
            bound.push(e);
        }
    }
    c.kernel.body = Body::QuantMatmul(QuantMatmulKernel { dtype: d, lhs, weight: 1, layout, product, m, epilogue });
    (c, bound)
}
