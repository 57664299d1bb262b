//! Kernels for the WGSL test that the CUDA printer's generators do not make: random map loops
//! over the dtypes wgpu holds (f32, f16, bf16, i32, u8, bool arguments; i64 values inside),
//! whose DAGs treat every function WGSL leaves approximate as approximate; semantic corners;
//! row kernels at many lengths along every axis and over the whole tensor; batched, strided
//! and transposed matrix products of every supported dtype with epilogues; and large
//! kernels (2^20-element reductions, a dispatch of more than 65,535 workgroups).

use super::cases::{Case, encode, new_case, output, random_values, random_view};
use super::common::Rng;
use braid_graph::expr::{Distribution, Expr, ExprBuilder, ExprId, ExprNode, ExprOp, PrimBinary, PrimCmp, PrimUnary};
use braid_graph::{DType, ReduceOp};
use braid_lowering::{Arg, Body, Load, MapLoop, MatmulKernel, MatmulOperand, RowKernel, Store, View};

/// Argument dtypes the wgpu kernels hold.
pub const STORED: [DType; 6] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::U8, DType::Bool];

/// Whether a kernel's arguments are all of dtypes wgpu holds (other generators' cases are
/// filtered with it).
pub fn storable(c: &Case) -> bool {
    c.kernel.args.iter().all(|a| STORED.contains(&a.dtype))
}

/// Per node: whether its value may differ from the CPU's (see the test's module docs).
pub fn approximate(expr: &Expr) -> Vec<bool> {
    let mut t = vec![false; expr.nodes.len()];
    for (i, n) in expr.nodes.iter().enumerate() {
        t[i] = match n.op {
            ExprOp::Unary(PrimUnary::Exp | PrimUnary::Tanh | PrimUnary::Log | PrimUnary::Sin | PrimUnary::Cos, _) => {
                true
            }
            ExprOp::Binary(PrimBinary::Pow, ..) => true,
            ExprOp::Random { dist: Distribution::Normal, .. } => true,
            ExprOp::Reduce(ReduceOp::Sum | ReduceOp::Mean, _) if n.dtype.is_float() => true,
            op => op.operands().iter().any(|&o| t[o]),
        };
    }
    t
}

/// A random DAG over what WGSL kernels compute, tracking per node whether it is approximate.
struct Dag {
    b: ExprBuilder,
    taint: Vec<bool>,
}

impl Dag {
    fn add(&mut self, id: ExprId, taint: bool) -> ExprId {
        // The builder returns an existing node for a rounding of a value just rounded.
        if (id as usize) < self.taint.len() {
            return id;
        }
        assert_eq!(id as usize, self.taint.len());
        self.taint.push(taint);
        id
    }

    fn pick(&self, rng: &mut Rng, ok: impl Fn(ExprId) -> bool) -> Option<ExprId> {
        let c: Vec<ExprId> = (0..self.taint.len() as ExprId).filter(|&i| ok(i)).collect();
        (!c.is_empty()).then(|| c[rng.below(c.len())])
    }

    fn constant(&mut self, rng: &mut Rng, d: DType) -> ExprId {
        let id = if d.is_float() {
            let specials = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 1e-40, 1e300, 3e9, 65520.0];
            let v = if rng.chance(0.3) { *rng.pick(&specials) } else { *rng.pick(&[2.0, 0.5, -1.5, 0.1, 1.0 / 3.0]) };
            self.b.constant(v, d)
        } else {
            let v = *rng.pick(&match d {
                DType::I32 => [0, 1, -1, 7, -3, 100_000, i32::MAX as i64, i32::MIN as i64],
                DType::I64 => [0, 1, -1, 7, -5, 1 << 40, i64::MAX, i64::MIN],
                DType::U8 => [0, 1, 3, 200, 255, 0, 1, 2],
                _ => [0, 1, 0, 1, 0, 1, 0, 1],
            });
            self.b.int_constant(v, d)
        };
        self.add(id, false)
    }

    fn grow(&mut self, rng: &mut Rng) {
        use DType::*;
        match rng.below(9) {
            0 | 1 => {
                let Some(x) = self.pick(rng, |i| self.b.dtype(i) != Bool) else { return };
                let (d, tx) = (self.b.dtype(x), self.taint[x as usize]);
                use PrimUnary::*;
                let ops: &[PrimUnary] = match (d.is_float(), tx) {
                    (false, _) => &[Neg, Abs],
                    // No exp of an approximate value: it turns lavapipe's relative error into
                    // an absolute one and amplifies it by the argument.
                    (true, true) => &[Neg, Abs, Tanh],
                    (true, false) => &[Neg, Exp, Log, Sqrt, Abs, Sin, Cos, Tanh],
                };
                let op = *rng.pick(ops);
                // WGSL bounds sin and cos only on [-pi, pi] (and lavapipe's reduce large
                // arguments poorly): their arguments are clamped first.
                let x = if matches!(op, Sin | Cos) {
                    let (lo, hi) = (self.b.constant(-8.0, d), self.b.constant(8.0, d));
                    self.add(lo, false);
                    self.add(hi, false);
                    let m = self.b.max(x, lo);
                    self.add(m, tx);
                    let m = self.b.min(m, hi);
                    self.add(m, tx)
                } else {
                    x
                };
                let id = self.b.unary(op, x);
                self.add(id, tx || matches!(op, Exp | Tanh | Log | Sin | Cos));
            }
            2..=4 => {
                let Some(x) = self.pick(rng, |i| self.b.dtype(i) != Bool) else { return };
                let d = self.b.dtype(x);
                let y = match rng.chance(0.3) {
                    true => self.constant(rng, d),
                    false => self.pick(rng, |i| self.b.dtype(i) == d).unwrap_or(x),
                };
                let t = self.taint[x as usize] || self.taint[y as usize];
                use PrimBinary::*;
                let ops: &[PrimBinary] = match (d.is_float(), t) {
                    (false, _) => &[Add, Sub, Mul, Div, Max, Min],
                    (true, true) => &[Mul, Max, Min],
                    (true, false) => &[Add, Sub, Mul, Div, Pow, Max, Min],
                };
                let op = *rng.pick(ops);
                let id = self.b.binary(op, x, y);
                self.add(id, t || op == Pow);
            }
            5 => {
                let Some(x) = self.pick(rng, |i| !self.taint[i as usize]) else { return };
                let d = self.b.dtype(x);
                let y = match rng.chance(0.3) {
                    true => self.constant(rng, d),
                    false => self.pick(rng, |i| self.b.dtype(i) == d && !self.taint[i as usize]).unwrap_or(x),
                };
                use PrimCmp::*;
                let id = self.b.cmp(*rng.pick(&[Eq, Ne, Lt, Le, Gt, Ge]), x, y);
                self.add(id, false);
            }
            6 => {
                let Some(c) = self.pick(rng, |i| self.b.dtype(i) == Bool) else { return };
                let Some(a) = self.pick(rng, |_| true) else { return };
                let d = self.b.dtype(a);
                let b = match rng.chance(0.3) {
                    true => self.constant(rng, d),
                    false => self.pick(rng, |i| self.b.dtype(i) == d).unwrap_or(a),
                };
                let t = self.taint[a as usize] || self.taint[b as usize];
                let id = self.b.select(c, a, b);
                self.add(id, t);
            }
            7 => {
                let Some(x) = self.pick(rng, |_| true) else { return };
                let tx = self.taint[x as usize];
                let to = if tx { F32 } else { *rng.pick(&[F32, F16, BF16, I32, I64, U8, Bool]) };
                let id = self.b.cast(to, x);
                self.add(id, tx);
            }
            _ => match rng.below(3) {
                0 => {
                    let d = *rng.pick(&[F32, I32, I64, U8, Bool]);
                    self.constant(rng, d);
                }
                1 => {
                    let id = self.b.index();
                    self.add(id, false);
                }
                _ => {
                    let operand = match self.pick(rng, |i| self.b.dtype(i) == I64) {
                        Some(i) => i,
                        None => {
                            let id = self.b.index();
                            self.add(id, false)
                        }
                    };
                    let dist = *rng.pick(&[Distribution::Uniform, Distribution::Normal]);
                    let id = self.b.random(rng.next(), dist, operand, F32);
                    self.add(id, dist == Distribution::Normal);
                }
            },
        }
    }
}

/// A random map loop over `dims` (as the CUDA test's, with wgpu's dtypes): i64 sinks are
/// stored through a cast to i32.
pub fn map_case(rng: &mut Rng, n: usize, dims: &[usize]) -> Case {
    let inputs = 1 + rng.below(3);
    let mut c = new_case(format!("map {n} over {dims:?}"), inputs, Body::Map(vec![]));
    let mut loads = vec![];
    for a in 0..inputs {
        let d = *rng.pick(&STORED);
        let mut len = 0;
        for _ in 0..1 + rng.below(2) {
            let (view, l) = random_view(rng, dims, true);
            loads.push(Load { arg: a as u16, dtype: d, view });
            len = len.max(l);
        }
        c.kernel.args.push(Arg { dtype: d, len });
        c.init.push(encode(d, &random_values(rng, d, len, false)));
    }
    let mut dag = Dag { b: ExprBuilder::new(), taint: vec![] };
    for (slot, l) in loads.iter().enumerate() {
        let id = dag.b.load(slot as u16, l.dtype);
        dag.add(id, false);
    }
    for _ in 0..3 + rng.below(12) {
        dag.grow(rng);
    }
    let mut expr = dag.b.finish();
    let mut read = vec![false; expr.nodes.len()];
    expr.nodes.iter().for_each(|n| n.op.operands().into_iter().for_each(|o| read[o] = true));
    let mut sinks: Vec<ExprId> = (0..read.len()).filter(|&i| !read[i]).map(|i| i as ExprId).collect();
    while sinks.len() > 4 {
        sinks.remove(rng.below(sinks.len() - 1));
    }
    for v in sinks.iter_mut() {
        if expr.nodes[*v as usize].dtype == DType::I64 {
            expr.nodes.push(ExprNode { op: ExprOp::Cast(DType::I32, *v), dtype: DType::I32 });
            *v = expr.root();
        }
    }
    let mut stores = vec![];
    for v in sinks {
        let (view, len) = random_view(rng, dims, false);
        let arg = c.kernel.args.len();
        stores.push(output(rng, expr.nodes[v as usize].dtype, view, len, v, arg, &mut c));
    }
    c.kernel.body = Body::Map(vec![MapLoop { dims: dims.into(), loads, expr, stores }]);
    c
}

/// A row kernel over `dims` along `axis` of a value `x` of dtype `xd` (and `c`, constant along
/// the row): template 0 one reduction `op` of `x` with per-row and per-element outputs, 1 a
/// softmax, 2 an argmax with a one-hot and random numbers. Sums read positive values (so that
/// another summation order stays within a relative tolerance).
pub fn rows_over(
    rng: &mut Rng,
    label: String,
    dims: &[usize],
    axis: Option<usize>,
    xd: DType,
    template: usize,
    op: ReduceOp,
) -> Case {
    use DType::*;
    let rank = dims.len();
    let on_row = |d: usize| axis.is_none_or(|a| a == d);
    let mut c = new_case(label, 2, Body::Map(vec![]));
    let (xv, xlen) = random_view(rng, dims, false);
    let (mut cv, clen) = random_view(rng, dims, true);
    (0..rank).filter(|&d| on_row(d)).for_each(|d| cv.strides[d] = 0);
    let positive = template == 1 || matches!(op, ReduceOp::Sum | ReduceOp::Mean);
    for len in [xlen, clen] {
        c.kernel.args.push(Arg { dtype: xd, len });
        c.init.push(encode(xd, &random_values(rng, xd, len, positive)));
    }
    let loads = vec![Load { arg: 0, dtype: xd, view: xv }, Load { arg: 1, dtype: xd, view: cv }];
    let mut b = ExprBuilder::new();
    let (x, cn) = (b.load(0, xd), b.load(1, xd));
    let mut values: Vec<(ExprId, bool)> = vec![];
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
            let r = b.reduce(op, x);
            values.push((r, true));
            let e = match op {
                ReduceOp::ArgMax => {
                    // i64 values are stored as i32 (wgpu holds no i64 tensor).
                    values[0].0 = b.cast(I32, r);
                    let pos = position(&mut b);
                    b.cmp(PrimCmp::Eq, pos, r)
                }
                _ => {
                    let s = b.add(cn, r);
                    b.max(x, s)
                }
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
        _ => {
            let a = b.reduce(ReduceOp::ArgMax, x);
            let pos = position(&mut b);
            let hot = b.cmp(PrimCmp::Eq, pos, a);
            let i = b.index();
            let u = b.random(rng.next(), Distribution::Uniform, i, F32);
            let a32 = b.cast(I32, a);
            values.extend([(a32, true), (hot, false), (u, false)]);
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

/// Values a matrix product is compared with: per element of the product, the bound on the
/// difference of two summation orders, `k * 2^-23 * sum |a b|` (zero for integers).
pub struct Bound(pub Vec<f64>);

/// `epilogue(a @ b + bias)` over `batches` with random strides (transposed, padded, offset
/// operands; the rhs shared by every batch half the time), of `d`; the product goes to an
/// output argument (compared too) or to scratch.
pub fn matmul_case(rng: &mut Rng, n: usize, d: DType, [batches, m, k, nn]: [usize; 4]) -> (Case, Bound) {
    let mut c = new_case(format!("matmul {n} ({d}, {batches} x [{m} x {k}] x [{k} x {nn}])"), 3, Body::Map(vec![]));
    let values = |rng: &mut Rng, len: usize| -> Vec<f64> {
        (0..len).map(|_| if d.is_float() { rng.uniform(-3.0, 3.0) } else { rng.below(41) as f64 - 20.0 }).collect()
    };
    let values = |rng: &mut Rng, len: usize| {
        if d == DType::U8 { (0..len).map(|_| rng.below(256) as f64).collect() } else { values(rng, len) }
    };
    // An operand: its matrices one after another (with padding), rows or columns first.
    let operand = |rng: &mut Rng, rows: usize, cols: usize, shared: bool| -> (MatmulOperand, Vec<f64>) {
        let pad = rng.below(3);
        let (rs, cs) = if rng.chance(0.5) { ((cols + pad) as isize, 1) } else { (1, (rows + pad) as isize) };
        let size = rows.max(1) * cols.max(1) + pad * rows.max(cols).max(1) + 1;
        let offset = rng.below(3);
        let mats = if shared { 1 } else { batches };
        let batch_offsets = (0..batches).map(|b| offset + if shared { 0 } else { b * size }).collect();
        let v = values(rng, offset + mats * size);
        (MatmulOperand { arg: 0, batch_offsets, rs, cs }, v)
    };
    let (mut lhs, a) = operand(rng, m, k, false);
    let shared = rng.chance(0.5);
    let (mut rhs, bv) = operand(rng, k, nn, shared);
    rhs.arg = 1;
    lhs.arg = 0;
    let bias = values(rng, nn);
    for v in [&a, &bv, &bias] {
        c.kernel.args.push(Arg { dtype: d, len: v.len() });
        c.init.push(encode(d, v));
    }
    // Per product element: sum |a b| over k.
    let at = |o: &MatmulOperand, vals: &[f64], b: usize, r: usize, col: usize| {
        vals[(o.batch_offsets[b] as isize + r as isize * o.rs + col as isize * o.cs) as usize]
    };
    let mut bound = vec![];
    for b in 0..batches {
        for i in 0..m {
            for j in 0..nn {
                let s: f64 = (0..k).map(|p| (at(&lhs, &a, b, i, p) * at(&rhs, &bv, b, p, j)).abs()).sum();
                bound.push(if d.is_float() { k as f64 * 2f64.powi(-23) * s } else { 0.0 });
            }
        }
    }
    let total = batches * m * nn;
    let to_output = rng.chance(0.6);
    let product = if to_output {
        c.kernel.args.push(Arg { dtype: d, len: total });
        c.init.push(encode(d, &random_values(rng, d, total, false)));
        3
    } else {
        4
    };
    let view = |strides: [isize; 2]| View {
        dims: [batches * m, nn].as_slice().into(),
        strides: strides.as_slice().into(),
        offset: 0,
    };
    let mut eb = ExprBuilder::new();
    let (p, bias_v) = (eb.load(0, d), eb.load(1, d));
    let s = eb.add(p, bias_v);
    let zero = eb.constant(0.0, d);
    let y = eb.max(s, zero);
    let loads = vec![
        Load { arg: product, dtype: d, view: view([nn as isize, 1]) },
        Load { arg: 2, dtype: d, view: view([0, 1]) },
    ];
    let arg = c.kernel.args.len();
    let store = output(rng, d.compute(), view([nn as isize, 1]), total, y, arg, &mut c);
    let epilogue = MapLoop { dims: [batches * m, nn].as_slice().into(), loads, expr: eb.finish(), stores: vec![store] };
    c.kernel.body = Body::Matmul(MatmulKernel { dtype: d, lhs, rhs, product, m, n: nn, k, epilogue: Some(epilogue) });
    (c, Bound(bound))
}

/// A map loop of `numel` indices (more than 65,535 workgroups of 256 when numel passes
/// 16,776,960): u8 in, u8 and bool out, neighbouring threads writing neighbouring bytes.
pub fn wide_case(rng: &mut Rng, numel: usize) -> Case {
    use DType::*;
    let mut c = new_case(format!("wide map of {numel} bytes"), 1, Body::Map(vec![]));
    c.kernel.args.push(Arg { dtype: U8, len: numel });
    c.init.push(encode(U8, &random_values(rng, U8, numel, false)));
    let mut b = ExprBuilder::new();
    let x = b.load(0, U8);
    let three = b.int_constant(3, U8);
    let i = b.index();
    let i8 = b.cast(U8, i);
    let t = b.mul(x, three);
    let y = b.add(t, i8);
    let lim = b.int_constant(100, U8);
    let big = b.cmp(PrimCmp::Gt, y, lim);
    let contiguous = View { dims: [numel].as_slice().into(), strides: [1].as_slice().into(), offset: 0 };
    let mut stores = vec![];
    for (v, d) in [(y, U8), (big, Bool)] {
        let arg = c.kernel.args.len();
        c.kernel.args.push(Arg { dtype: d, len: numel });
        c.init.push(encode(d, &random_values(rng, d, numel, false)));
        stores.push(Store { arg: arg as u16, dtype: d, view: contiguous.clone(), value: v });
    }
    let loads = vec![Load { arg: 0, dtype: U8, view: contiguous.clone() }];
    c.kernel.body = Body::Map(vec![MapLoop { dims: [numel].as_slice().into(), loads, expr: b.finish(), stores }]);
    c
}

/// The corners of the semantics on wgpu's dtypes: float-to-int casts of NaN, infinities and
/// out-of-range values, integer division by zero and `MIN / -1` (i32 and i64), wrapping
/// negation, NaN in `max`/`min` from either side, u8 wrapping, f16/bf16 rounding at their
/// limits, i64 values that round to f32 differently in one step and in two (2^60 + 2^36 + 1),
/// and i64 products and quotients beyond 32 bits.
pub fn edges_case() -> Case {
    use DType::*;
    let f = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e10, -1e10, 2147483647.5, -2147483648.9, 300.7];
    let f: Vec<f64> = f.into_iter().chain([-0.5, 255.9, 65519.9, 65520.0, 1e-8, -0.0, 3.5, 2.5]).collect();
    let i = [i32::MIN, i32::MIN, -1, 7, 0, i32::MAX, -7, 5, 100, -100, 3, 1, i32::MIN, 2, -2, 9];
    let j = [-1, 0, 0, 2, 0, -1, 2, -3, 7, 0, 1, -1, 1, 0, 5, -4];
    let mut c = new_case("edges".into(), 3, Body::Map(vec![]));
    c.kernel.args = [F32, I32, I32].map(|dtype| Arg { dtype, len: 16 }).to_vec();
    c.init = vec![encode(F32, &f), encode(I32, &i.map(|v| v as f64)), encode(I32, &j.map(|v| v as f64))];
    let view = |s: isize, o: usize| View { dims: [16].as_slice().into(), strides: [s].as_slice().into(), offset: o };
    let loads = vec![
        Load { arg: 0, dtype: F32, view: view(1, 0) },
        Load { arg: 1, dtype: I32, view: view(1, 0) },
        Load { arg: 2, dtype: I32, view: view(1, 0) },
        Load { arg: 0, dtype: F32, view: view(-1, 15) },
    ];
    let mut b = ExprBuilder::new();
    let (x, a, d, rev) = (b.load(0, F32), b.load(1, I32), b.load(2, I32), b.load(3, F32));
    let mut values = vec![b.cast(I32, x), b.cast(U8, x), b.cast(Bool, x), b.cast(F16, x), b.cast(BF16, x)];
    let xl = b.cast(I64, x);
    values.push(b.cast(I32, xl));
    values.extend([b.div(a, d), b.neg(a), b.unary(PrimUnary::Abs, a), b.max(x, rev), b.min(x, rev)]);
    let au8 = b.cast(U8, a);
    let k = b.int_constant(200, U8);
    values.push(b.mul(au8, k));
    // i64: (a << 40 via a product) / d, MIN / -1, and the one-rounding cast.
    let (al, dl) = (b.cast(I64, a), b.cast(I64, d));
    let big = b.int_constant(1 << 40, I64);
    let p = b.mul(al, big);
    let q = b.div(p, dl);
    values.extend([b.cast(F32, p), b.cast(F32, q)]);
    let back = b.div(q, big);
    values.push(b.cast(I32, back));
    let min = b.int_constant(i64::MIN, I64);
    let minus_one = b.int_constant(-1, I64);
    let w = b.div(min, minus_one);
    values.push(b.cast(F32, w));
    let odd = b.int_constant((1 << 60) + (1 << 36) + 1, I64);
    let sum = b.add(odd, al);
    values.extend([b.cast(F32, sum), b.cast(F16, sum), b.cast(BF16, sum)]);
    let neg = b.neg(sum);
    values.extend([b.cast(F32, neg), b.cast(I32, neg)]);
    let mut rng = Rng::new(1);
    let stores: Vec<Store> = values
        .iter()
        .enumerate()
        .map(|(n, &v)| output(&mut rng, b.dtype(v), view(1, 0), 16, v, 3 + n, &mut c))
        .collect();
    c.kernel.body = Body::Map(vec![MapLoop { dims: [16].as_slice().into(), loads, expr: b.finish(), stores }]);
    c
}
