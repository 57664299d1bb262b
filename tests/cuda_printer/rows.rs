//! Row, concatenation and corner cases of the CUDA printer tests (part of [`super`], split off
//! for length): row kernels for every reduction along each axis (short, long and column ones),
//! concatenations, and the corners of the semantics (casts of NaN and out-of-range values,
//! integer division by zero, and more).

use super::*;

/// A row kernel along a random axis (or none): one reduction of each op with a prologue and an
/// epilogue, a softmax, a layer norm, two reductions that read no reduction beside a product
/// that reads none, or an argmax with a one-hot and random numbers. Reads
/// `x`, and `c`, constant along the row; stores per-row and per-element values.
pub(crate) fn rows_case(rng: &mut Rng, n: usize, lib: MathLib) -> Case {
    let rank = 1 + rng.below(3);
    let dims: Vec<usize> = (0..rank).map(|_| *rng.pick(&[1, 2, 3, 4, 6])).collect();
    let axis = if rng.chance(0.25) { None } else { Some(rng.below(rank)) };
    rows_case_over(rng, n, &dims, axis, lib, true)
}

/// A random row kernel (as [`rows_case`]) over `dims` along `axis`; float inputs hold special
/// values only if `specials`.
pub(crate) fn rows_case_over(
    rng: &mut Rng,
    n: usize,
    dims: &[usize],
    axis: Option<usize>,
    lib: MathLib,
    specials: bool,
) -> Case {
    use DType::*;
    let rank = dims.len();
    let on_row = |d: usize| axis.is_none_or(|a| a == d);
    let float = rng.chance(0.6);
    let xd = if float { *rng.pick(&[F32, F32, F64, F16, BF16]) } else { *rng.pick(&[I32, I64, U8]) };
    let template = if float { rng.below(5) } else { 3 * rng.below(2) };
    // Means are of floats only (the op table's rule).
    let all = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax, ReduceOp::Mean];
    let ops = if float { &all[..] } else { &all[..4] };
    let op = *rng.pick(ops);
    let label = format!("rows {n} (template {template}, {op:?}, {xd}, dims {dims:?}, axis {axis:?})");
    let mut c = new_case(label, 2, Body::Map(vec![]));
    let (xv, xlen) = random_view(rng, dims, true);
    let (mut cv, clen) = random_view(rng, dims, true);
    (0..rank).filter(|&d| on_row(d)).for_each(|d| cv.strides[d] = 0);
    let positive = template == 0 && matches!(op, ReduceOp::Sum | ReduceOp::Mean);
    for len in [xlen, clen] {
        c.kernel.args.push(Arg { dtype: xd, len });
        c.init.push(encode(xd, &random_values_with(rng, xd, len, positive, specials)));
    }
    let loads = vec![Load { arg: 0, dtype: xd, view: xv }, Load { arg: 1, dtype: xd, view: cv }];
    let mut b = ExprBuilder::new();
    let (x, cn) = (b.load(0, xd), b.load(1, xd));
    // (value, per row)
    let mut values: Vec<(ExprId, bool)> = vec![];
    let prologue = |b: &mut ExprBuilder, rng: &mut Rng, exp: bool| match rng.below(if exp { 6 } else { 5 }) {
        0 => x,
        1 => b.mul(x, x),
        2 => b.unary(PrimUnary::Abs, x),
        3 => b.add(x, cn),
        4 => b.max(x, cn),
        _ => b.exp(x),
    };
    // The position along the row, from the flat index.
    let position = |b: &mut ExprBuilder| {
        let i = b.index();
        let Some(a) = axis else { return i };
        let inner: usize = dims[a + 1..].iter().product();
        let (inner, len) = (b.int_constant(inner as i64, I64), b.int_constant(dims[a] as i64, I64));
        let q = b.div(i, inner);
        let r = b.div(q, len);
        let r = b.mul(r, len);
        b.sub(q, r)
    };
    match template {
        0 => {
            // No argmax of approximate values: a different ulp may pick another position.
            let exact_exp = lib == MathLib::Host && xd.compute() != F32;
            let p = prologue(&mut b, rng, float && (op != ReduceOp::ArgMax || exact_exp));
            let r = b.reduce(op, p);
            values.push((r, true));
            let e = match (op, rng.below(5)) {
                (ReduceOp::ArgMax, _) => {
                    let pos = position(&mut b);
                    b.cmp(PrimCmp::Eq, pos, r)
                }
                (_, 0) => r,
                (_, 1) => b.sub(x, r),
                (_, 2) => b.mul(x, r),
                (_, 3) if float => b.div(x, r),
                (_, _) if float => {
                    let s = b.sub(x, r);
                    b.exp(s)
                }
                _ => b.max(x, r),
            };
            values.push((e, false));
        }
        1 => {
            let m = b.reduce(ReduceOp::Max, x);
            let s = b.sub(x, m);
            let e = b.exp(s);
            let sum = b.reduce(ReduceOp::Sum, e);
            let y = b.div(e, sum);
            values.extend([(y, false), (sum, true), (m, true)]);
        }
        2 => {
            let mu = b.reduce(ReduceOp::Mean, x);
            let d = b.sub(x, mu);
            let d2 = b.mul(d, d);
            let var = b.reduce(ReduceOp::Mean, d2);
            let eps = b.constant(1e-5, xd);
            let v = b.add(var, eps);
            let sd = b.sqrt(v);
            let y = b.div(d, sd);
            values.extend([(y, false), (mu, true), (var, true)]);
        }
        4 => {
            // Reductions that read no reduction, and a store that reads none (a layer norm's
            // weight and bias gradients with its per-element products): the GPU printers may
            // fold them in one pass; a store that reads one comes after.
            // A mean, not a sum: the CPU adds a long f32 row one element at a time, and its sum
            // of 70,001 values of both signs is off by more than the comparison's tolerance.
            // The store that reads a reduction reads the exact one (no cancellation against an
            // approximate mean: the mean of a row of one large value repeated is exact only on
            // the compensated side).
            let p = b.mul(x, cn);
            let s = b.reduce(ReduceOp::Mean, x);
            let most = b.reduce(ReduceOp::Max, p);
            let y = b.sub(x, most);
            values.extend([(p, false), (s, true), (most, true)]);
            if rng.chance(0.5) {
                values.push((y, false));
            }
        }
        _ => {
            let p = prologue(&mut b, rng, false);
            let a = b.reduce(ReduceOp::ArgMax, p);
            let pos = position(&mut b);
            let hot = b.cmp(PrimCmp::Eq, pos, a);
            let i = b.index();
            let dist = *rng.pick(&[Distribution::Uniform, Distribution::Normal]);
            let u = b.random(rng.next(), dist, i, if float { xd } else { F32 });
            let u = if float { b.add(u, x) } else { u };
            values.extend([(a, true), (hot, false), (u, false)]);
        }
    }
    let row_dims: Vec<usize> = (0..rank).map(|d| if on_row(d) { 1 } else { dims[d] }).collect();
    let mut stores = vec![];
    for (v, per_row) in values {
        let (mut view, len) = random_view(rng, if per_row { &row_dims } else { dims }, false);
        view.dims = dims.into();
        (0..rank).filter(|&d| per_row && on_row(d)).for_each(|d| view.strides[d] = 0);
        let arg = c.kernel.args.len();
        stores.push(output(rng, b.dtype(v), view, len, v, arg, &mut c));
    }
    c.kernel.body = Body::Rows(RowKernel { dims: dims.into(), axis, loads, expr: b.finish(), stores });
    c
}

/// A concatenation along dimension 0 or 1 of 2-3 parts: one loop per part (as lowering does).
pub(crate) fn concat_case(rng: &mut Rng, n: usize) -> Case {
    let d = *rng.pick(&DType::ALL);
    let (dim, other) = (rng.below(2), 1 + rng.below(3));
    let parts: Vec<usize> = (0..2 + rng.below(2)).map(|_| 1 + rng.below(3)).collect();
    let total: usize = parts.iter().sum();
    let out = if dim == 0 { [total, other] } else { [other, total] };
    let mut c = new_case(format!("concat {n}"), parts.len(), Body::Map(vec![]));
    let (mut loops, mut start) = (vec![], 0);
    for (a, &p) in parts.iter().enumerate() {
        let dims = if dim == 0 { [p, other] } else { [other, p] };
        let (view, len) = random_view(rng, &dims, false);
        c.kernel.args.push(Arg { dtype: d, len });
        c.init.push(encode(d, &random_values(rng, d, len, false)));
        let mut b = ExprBuilder::new();
        let v = b.load(0, d);
        let offset = if dim == 0 { start * other } else { start };
        let store = View { dims: dims.as_slice().into(), strides: [out[1] as isize, 1].as_slice().into(), offset };
        let stores = vec![Store { arg: parts.len() as u16, dtype: d, view: store, value: v }];
        loops.push(MapLoop {
            dims: dims.as_slice().into(),
            loads: vec![Load { arg: a as u16, dtype: d, view }],
            expr: b.finish(),
            stores,
        });
        start += p;
    }
    c.kernel.args.push(Arg { dtype: d, len: total * other });
    c.init.push(encode(d, &random_values(rng, d, total * other, false)));
    c.kernel.body = Body::Map(loops);
    c
}

/// The corners of the semantics, every one of them: float-to-int casts of NaN, infinities and
/// out-of-range values, integer division by zero and `MIN / -1`, wrapping negation, NaN in
/// `max`/`min` from either side (the second operand reads the buffer backwards), an i64 that
/// rounds to f32 differently in one step and in two through f64 (2^60 + 2^36 + 1: one rounding
/// gives 2^60 + 2^37, as braid's cast does; two would give 2^60).
pub(crate) fn edges_case() -> Case {
    use DType::*;
    let f = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e10, -1e10, 2147483647.5, -2147483648.9, 300.7];
    let f: Vec<f64> = f.into_iter().chain([-0.5, 255.9, 65519.9, 65520.0, 1e-8, -0.0, 3.5, 2.5]).collect();
    let i = [i32::MIN, i32::MIN, -1, 7, 0, i32::MAX, -7, 5, 100, -100, 3, 1, i32::MIN, 2, -2, 9];
    let j = [-1, 0, 0, 2, 0, -1, 2, -3, 7, 0, 1, -1, 1, 0, 5, -4];
    let l = [(1 << 60) + (1 << 36) + 1, i64::MIN, i64::MAX, -1, 1 << 53, (1 << 53) + 1, -(1 << 40) - 3, 0];
    let l: Vec<i64> = l.into_iter().chain([i64::MIN + 1, 255, 256, -255, 70000, 1 << 31, -(1 << 31) - 1, 5]).collect();
    let mut c = new_case("edges".into(), 4, Body::Map(vec![]));
    c.kernel.args = [F64, I32, I32, I64].map(|dtype| Arg { dtype, len: 16 }).to_vec();
    c.init = vec![encode(F64, &f), encode(I32, &i.map(|v| v as f64)), encode(I32, &j.map(|v| v as f64))];
    c.init.push(l.iter().flat_map(|v| v.to_le_bytes()).collect());
    let view = |s: isize, o: usize| View { dims: [16].as_slice().into(), strides: [s].as_slice().into(), offset: o };
    let loads = vec![
        Load { arg: 0, dtype: F64, view: view(1, 0) },
        Load { arg: 1, dtype: I32, view: view(1, 0) },
        Load { arg: 2, dtype: I32, view: view(1, 0) },
        Load { arg: 0, dtype: F64, view: view(-1, 15) },
        Load { arg: 3, dtype: I64, view: view(1, 0) },
    ];
    let mut b = ExprBuilder::new();
    let (x, a, d, rev, w) = (b.load(0, F64), b.load(1, I32), b.load(2, I32), b.load(3, F64), b.load(4, I64));
    let mut values = vec![b.cast(I32, x), b.cast(I64, x), b.cast(U8, x), b.cast(Bool, x), b.cast(F32, x)];
    let x32 = values[4];
    values.push(b.cast(F16, x32));
    values.extend([b.div(a, d), b.neg(a), b.unary(PrimUnary::Abs, a), b.max(x, rev), b.min(x, rev)]);
    let au8 = b.cast(U8, a);
    let k = b.int_constant(200, U8);
    values.push(b.mul(au8, k));
    let minus_one = b.int_constant(-1, I64);
    values.extend([b.cast(F32, w), b.cast(F64, w), b.cast(I32, w), b.cast(U8, w), b.neg(w), b.div(w, minus_one)]);
    let mut rng = Rng::new(1);
    let stores: Vec<Store> = values
        .iter()
        .enumerate()
        .map(|(n, &v)| output(&mut rng, b.dtype(v), view(1, 0), 16, v, 4 + n, &mut c))
        .collect();
    c.kernel.body = Body::Map(vec![MapLoop { dims: [16].as_slice().into(), loads, expr: b.finish(), stores }]);
    c
}

/// Rows too long to keep in shared memory, of elements of 2 bytes or more, read along the row
/// at random offsets and strides (odd ones too): their vector path starts each row at its own
/// first aligned chunk (`head`), with the positions before it and after the last chunk in
/// scalar sweeps.
pub(crate) fn peeled_row_cases(rng: &mut Rng, first: usize, lib: MathLib) -> Vec<Case> {
    let dims = [braid_lowering::cuda::SPLIT_BELOW_ROWS, braid_lowering::cuda::ROW_KEEP_BYTES / 2 + 101];
    let mut cases = vec![];
    while cases.len() < 4 {
        let mut case = rows_case_over(rng, first + cases.len(), &dims, Some(1), lib, false);
        let along = matches!(&case.kernel.body, Body::Rows(r) if r.loads[0].view.strides[1] == 1);
        if case.kernel.args[0].dtype.size() >= 2 && along {
            case.label = format!("peeled {}", case.label);
            cases.push(case);
        }
    }
    cases
}

/// Many short rows (a segment of a warp's lanes a row, several rows a block: `short_rows.rs`),
/// contiguous or strided, along the last axis or a middle one, with a vector path where the
/// row allows; so many rows that every block walks several turns of them, and a last turn
/// with lanes past the last row.
pub(crate) fn short_row_cases(rng: &mut Rng, first: usize, lib: MathLib) -> Vec<Case> {
    let shapes: [(&[usize], usize); 6] =
        [(&[1031, 8], 1), (&[1027, 64], 1), (&[2053, 5], 1), (&[1100, 32], 1), (&[300, 13, 5], 1), (&[257, 16, 4], 1)];
    let mut cases = vec![];
    for (dims, axis) in shapes {
        let mut case = rows_case_over(rng, first + cases.len(), dims, Some(axis), lib, true);
        case.label = format!("short {}", case.label);
        cases.push(case);
    }
    cases
}

/// The reductions of a row case that read no reduction's value (the GPU printers may fold them
/// in one pass).
pub(crate) fn first_level_reductions(case: &Case) -> usize {
    let Body::Rows(r) = &case.kernel.body else { return 0 };
    let after = braid_lowering::row_passes::after_reductions(&r.expr);
    let first =
        |n: &braid_graph::expr::ExprNode| matches!(n.op, braid_graph::expr::ExprOp::Reduce(_, x) if !after[x as usize]);
    r.expr.nodes.iter().filter(|n| first(n)).count()
}

/// Row kernels with long rows, labelled by the path they take: `multi-pass` (as many rows as
/// `cuda::SPLIT_BELOW_ROWS`, each too long to keep in shared memory: more than
/// `cuda::ROW_KEEP_BYTES` in 8-byte elements) and `split` (few rows of several
/// `cuda::SEGMENT`s). Float inputs not in f32: the CPU's f32 sums of long rows, added one by
/// one, are the less accurate side.
pub(crate) fn long_row_cases(rng: &mut Rng, first: usize) -> Vec<Case> {
    let (rows, len) = (braid_lowering::cuda::SPLIT_BELOW_ROWS, braid_lowering::cuda::ROW_KEEP_BYTES / 8 + 100);
    let split = 2 * braid_lowering::cuda::SEGMENT + 100;
    let shapes = [
        ("multi-pass", vec![rows, len], Some(1)),
        // Long columns among few: a column kernel split into segments.
        ("split-columns", vec![len, rows], Some(0)),
        ("split", vec![3, split], Some(1)),
        ("split", vec![split, 2], Some(0)),
        ("split", vec![split], None),
        ("split", vec![2, 3, split / 5], None),
    ];
    let mut cases = vec![];
    for (path, dims, axis) in shapes {
        for k in 0..3 {
            let mut case = loop {
                let case = rows_case_over(rng, first + cases.len(), &dims, axis, MathLib::Host, false);
                let d = case.kernel.args[0].dtype;
                // The last split kernel of each shape folds two reductions in one pass.
                let merged = !path.starts_with("split") || k < 2 || first_level_reductions(&case) >= 2;
                if d.compute() != DType::F32 && (path == "split" || d.size() == 8) && merged {
                    break case;
                }
            };
            case.label = format!("{path} {}", case.label);
            cases.push(case);
        }
    }
    cases
}

/// Row kernels along an axis before a last dimension of at least 8: printed as
/// column kernels (neighbouring rows a block), a last group of rows partly past the end.
pub(crate) fn column_cases(rng: &mut Rng, first: usize) -> Vec<Case> {
    // The last three have so few columns, and long enough ones, that each column is split into
    // segments (2, 3 and 2 of them) combined through scratch memory.
    let shapes = [
        (vec![9, 8], 0, 3),
        (vec![5, 3, 16], 0, 3),
        (vec![5, 3, 16], 1, 3),
        (vec![4, 33], 0, 3),
        (vec![17, 2, 10], 1, 3),
        (vec![1100, 40], 0, 2),
        (vec![1600, 17], 0, 2),
        (vec![1030, 2, 9], 0, 2),
    ];
    let mut cases = vec![];
    for (dims, axis, count) in shapes {
        for _ in 0..count {
            // Columns of a thousand or more: not summed in f32, whose sums the CPU adds one by
            // one (the less accurate side, by more than the tolerance: 1.1e-5 relative for a
            // mean of 1,600), as in `long_row_cases`.
            let mut case = loop {
                let case = rows_case_over(rng, first + cases.len(), &dims, Some(axis), MathLib::Host, true);
                if dims[axis] < 1000 || case.kernel.args[0].dtype.compute() != DType::F32 {
                    break case;
                }
            };
            case.label = format!("columns {}", case.label);
            cases.push(case);
        }
    }
    cases
}
