//! The kernels the CUDA printer tests print: random map loops over every dtype and view kind,
//! row kernels for every reduction along each axis, concatenations, matrix products with their
//! epilogues and edge cases, each with random inputs (never all zeros). Shared by
//! `tests/cuda_printer.rs` (printed kernels compiled by g++ on the host) and
//! `tests/cuda_kernels.rs` (compiled by NVRTC and run on a GPU); [`MathLib`] says whose math
//! functions the printed code calls, which decides what may differ from the CPU by a few ulps.

use super::common::Rng;
use braid_devices::cpu::map::ArgPtr;
use braid_graph::dtype::{bf16_from_f64, f16_from_f64};
use braid_graph::expr::{Distribution, Expr, ExprBuilder, ExprId, ExprOp, PrimBinary, PrimCmp, PrimUnary};
use braid_graph::{DType, ReduceOp};
use braid_lowering::{Arg, Body, Kernel, Load, MapLoop, MatmulKernel, MatmulOperand, RowKernel, Store, View};
use half::{bf16, f16};

#[path = "products.rs"]
mod products;
// Used by the suites that print products; the map-loop-only ones include this file too.
#[allow(unused_imports)]
pub(crate) use products::*;
#[path = "rows.rs"]
mod rows;
#[allow(unused_imports)]
pub(crate) use rows::*;

pub(crate) struct Case {
    pub(crate) label: String,
    pub(crate) kernel: Kernel,
    /// Per argument: its bytes before the kernel runs.
    pub(crate) init: Vec<Vec<u8>>,
    /// Arguments the printed kernel starts from the CPU's results for (a matmul's product,
    /// which cuBLAS would write).
    pub(crate) from_cpu: Vec<usize>,
}

/// Runs `run` over copies of `init` (one 8-byte-aligned buffer per argument of `k`); returns
/// every argument's bytes after.
pub(crate) fn run_on_copies(
    k: &Kernel,
    init: &[Vec<u8>],
    run: impl FnOnce(&[ArgPtr]) -> Result<(), String>,
) -> Result<Vec<Vec<u8>>, String> {
    let mut bufs: Vec<Vec<u64>> = init.iter().map(|b| vec![0u64; b.len().div_ceil(8).max(1)]).collect();
    let bytes = |v: &mut Vec<u64>, n: usize| -> &mut [u8] {
        // SAFETY: `v` holds at least `n` bytes, and any byte pattern is a valid u64.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, n) }
    };
    for (b, i) in bufs.iter_mut().zip(init) {
        bytes(b, i.len()).copy_from_slice(i);
    }
    let args: Vec<ArgPtr> = (k.args.iter().zip(&mut bufs))
        .map(|(a, b)| ArgPtr { ptr: b.as_mut_ptr() as *mut u8, len: a.len, dtype: a.dtype })
        .collect();
    run(&args)?;
    Ok(bufs.iter_mut().zip(init).map(|(b, i)| bytes(b, i.len()).to_vec()).collect())
}

pub(crate) fn encode(d: DType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * d.size());
    for &v in vals {
        match d {
            DType::F32 => out.extend((v as f32).to_le_bytes()),
            DType::F64 => out.extend(v.to_le_bytes()),
            DType::F16 => out.extend(f16_from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend(bf16_from_f64(v).to_le_bytes()),
            DType::I32 => out.extend((v as i32).to_le_bytes()),
            DType::I64 => out.extend((v as i64).to_le_bytes()),
            DType::U8 | DType::Bool => out.push(v as u8),
        }
    }
    out
}

/// Element `i` of a buffer: a float (as f64) or an integer.
pub(crate) fn element(d: DType, b: &[u8], i: usize) -> Result<f64, i64> {
    let s = &b[i * d.size()..(i + 1) * d.size()];
    match d {
        DType::F32 => Ok(f32::from_le_bytes(s.try_into().unwrap()) as f64),
        DType::F64 => Ok(f64::from_le_bytes(s.try_into().unwrap())),
        DType::F16 => Ok(f16::from_le_bytes(s.try_into().unwrap()).to_f64()),
        DType::BF16 => Ok(bf16::from_le_bytes(s.try_into().unwrap()).to_f64()),
        DType::I32 => Err(i32::from_le_bytes(s.try_into().unwrap()) as i64),
        DType::I64 => Err(i64::from_le_bytes(s.try_into().unwrap())),
        DType::U8 | DType::Bool => Err(s[0] as i64),
    }
}

/// Random contents for an argument, never all zeros (bools also hold bytes other than 0 and 1;
/// floats a few NaNs, infinities, -0 and values that overflow f16).
pub(crate) fn random_values(rng: &mut Rng, d: DType, n: usize, positive: bool) -> Vec<f64> {
    random_values_with(rng, d, n, positive, true)
}

/// As [`random_values`]; floats without the special values unless `specials` (in long rows
/// they would make every result NaN; matrix products are compared relative to their terms).
pub(crate) fn random_values_with(rng: &mut Rng, d: DType, n: usize, positive: bool, specials: bool) -> Vec<f64> {
    let mut v: Vec<f64> = (0..n)
        .map(|_| match d {
            DType::Bool if rng.chance(0.1) => (2 + rng.below(254)) as f64,
            DType::Bool => rng.below(2) as f64,
            DType::U8 => rng.below(256) as f64,
            DType::I32 | DType::I64 => rng.below(101) as f64 - 50.0,
            _ if positive => rng.uniform(0.25, 3.0),
            _ if specials && rng.chance(0.05) => {
                *rng.pick(&[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 1e10, 70000.0])
            }
            _ => rng.uniform(-3.0, 3.0),
        })
        .collect();
    if v.iter().all(|&x| x == 0.0) {
        v[0] = 1.0;
    }
    v
}

/// A view over `dims` into a buffer laid out in a random order (a transpose), with random
/// padding (a narrow), offset and reversed dimensions, broadcast (stride 0) dimensions if
/// `broadcast`; with the buffer length it needs.
pub(crate) fn random_view(rng: &mut Rng, dims: &[usize], broadcast: bool) -> (View, usize) {
    let rank = dims.len();
    let mut order: Vec<usize> = (0..rank).collect();
    if rng.chance(0.4) {
        for i in (1..rank).rev() {
            order.swap(i, rng.below(i + 1));
        }
    }
    let mut strides = vec![0isize; rank];
    let mut acc = 1;
    for &d in order.iter().rev() {
        if broadcast && rng.chance(0.25) {
            continue;
        }
        strides[d] = acc as isize;
        acc *= dims[d] + if rng.chance(0.2) { 1 + rng.below(2) } else { 0 };
    }
    let mut offset = if rng.chance(0.3) { 1 + rng.below(3) } else { 0 };
    for d in 0..rank {
        if strides[d] != 0 && rng.chance(0.15) {
            offset += (dims[d] - 1) * strides[d] as usize;
            strides[d] = -strides[d];
        }
    }
    let reach: usize = (0..rank).filter(|&d| strides[d] > 0).map(|d| (dims[d] - 1) * strides[d] as usize).sum();
    (View { dims: dims.into(), strides: strides.into(), offset }, offset + reach + 1 + rng.below(2))
}

/// Whose math functions the printed code runs with.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[allow(dead_code)] // each test binary uses one of them
pub(crate) enum MathLib {
    /// The host's libm (g++): only f32 `exp` and `tanh` differ from the CPU (braid's own
    /// polynomials there).
    Host,
    /// CUDA's: every transcendental function (`exp`, `log`, `sin`, `cos`, `tanh`, `pow`, in f32
    /// and f64, and so normal random variates, which call `log` and `cos`) is within a few ulps
    /// of the CPU's, not equal. Square roots and divisions are correctly rounded on both.
    Cuda,
}

impl MathLib {
    /// Whether node op `op` of dtype `d` may differ from the CPU's by a few ulps by itself.
    fn approximates(self, op: ExprOp, d: DType) -> bool {
        use PrimUnary::*;
        match (self, op) {
            (_, ExprOp::Reduce(ReduceOp::Sum | ReduceOp::Mean, _)) => d.is_float(),
            (MathLib::Host, ExprOp::Unary(Exp | Tanh, _)) => d == DType::F32,
            (MathLib::Cuda, ExprOp::Unary(Exp | Tanh | Log | Sin | Cos, _)) => true,
            (MathLib::Cuda, ExprOp::Binary(PrimBinary::Pow, ..)) => true,
            (MathLib::Cuda, ExprOp::Random { dist: Distribution::Normal, .. }) => true,
            _ => false,
        }
    }
}

/// Per node: whether its value may differ from the CPU's by a few ulps (see the module docs).
pub(crate) fn approximate(expr: &Expr, lib: MathLib) -> Vec<bool> {
    let mut t = vec![false; expr.nodes.len()];
    for (i, n) in expr.nodes.iter().enumerate() {
        t[i] = lib.approximates(n.op, n.dtype) || n.op.operands().iter().any(|&o| t[o]);
    }
    t
}

/// A random expression DAG, tracking per node whether it is approximate (`taint`) and whether
/// it has at most 20 significant bits (`short`: exact in f32, so casts of it agree however they
/// round).
struct Dag {
    b: ExprBuilder,
    taint: Vec<bool>,
    short: Vec<bool>,
    lib: MathLib,
}

impl Dag {
    fn add(&mut self, id: ExprId, taint: bool, short: bool) -> ExprId {
        // The builder returns an existing node for a rounding of a value just rounded.
        if (id as usize) < self.taint.len() {
            return id;
        }
        assert_eq!(id as usize, self.taint.len());
        self.taint.push(taint);
        self.short.push(short);
        id
    }

    fn pick(&self, rng: &mut Rng, ok: impl Fn(ExprId) -> bool) -> Option<ExprId> {
        let c: Vec<ExprId> = (0..self.taint.len() as ExprId).filter(|&i| ok(i)).collect();
        (!c.is_empty()).then(|| c[rng.below(c.len())])
    }

    fn constant(&mut self, rng: &mut Rng, d: DType) -> ExprId {
        let (id, short) = if d.is_float() {
            let specials = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 1e-40, 1e300, 3e9, 65520.0];
            let v = if rng.chance(0.3) { *rng.pick(&specials) } else { *rng.pick(&[2.0, 0.5, -1.5, 0.1, 1.0 / 3.0]) };
            let held = if d == DType::F32 { v as f32 as f64 } else { v };
            let short = !held.is_finite() || (held == held as f32 as f64 && held.to_bits() & 0xffff_ffff == 0);
            (self.b.constant(v, d), short)
        } else {
            let v = *rng.pick(&match d {
                DType::I32 => [0, 1, -1, 7, -3, 100_000, i32::MAX as i64, i32::MIN as i64],
                DType::I64 => [0, 1, -1, 7, -5, 1 << 40, i64::MAX, i64::MIN],
                DType::U8 => [0, 1, 3, 200, 255, 0, 1, 2],
                _ => [0, 1, 0, 1, 0, 1, 0, 1],
            });
            (self.b.int_constant(v, d), v.unsigned_abs() < 1 << 20)
        };
        self.add(id, false, short)
    }

    fn grow(&mut self, rng: &mut Rng) {
        use DType::*;
        match rng.below(9) {
            0 | 1 => {
                let Some(x) = self.pick(rng, |i| self.b.dtype(i) != Bool) else { return };
                let (d, tx, sx) = (self.b.dtype(x), self.taint[x as usize], self.short[x as usize]);
                use PrimUnary::*;
                let ops: &[PrimUnary] = match (d.is_float(), tx) {
                    (false, _) => &[Neg, Abs],
                    (true, true) => &[Neg, Abs, Exp, Tanh],
                    (true, false) => &[Neg, Exp, Log, Sqrt, Abs, Sin, Cos, Tanh],
                };
                let op = *rng.pick(ops);
                let id = self.b.unary(op, x);
                let t = tx || self.lib.approximates(ExprOp::Unary(op, x), d);
                self.add(id, t, sx && matches!(op, Neg | Abs));
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
                let short = matches!(op, Max | Min) && self.short[x as usize] && self.short[y as usize];
                let id = self.b.binary(op, x, y);
                let t = t || self.lib.approximates(ExprOp::Binary(op, x, y), d);
                self.add(id, t, short);
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
                self.add(id, false, true);
            }
            6 => {
                let Some(c) = self.pick(rng, |i| self.b.dtype(i) == Bool) else { return };
                let Some(a) = self.pick(rng, |_| true) else { return };
                let d = self.b.dtype(a);
                let b = match rng.chance(0.3) {
                    true => self.constant(rng, d),
                    false => self.pick(rng, |i| self.b.dtype(i) == d).unwrap_or(a),
                };
                let (ta, tb) = (self.taint[a as usize], self.taint[b as usize]);
                let short = self.short[a as usize] && self.short[b as usize];
                let id = self.b.select(c, a, b);
                self.add(id, ta || tb, short);
            }
            7 => {
                let Some(x) = self.pick(rng, |_| true) else { return };
                let (from, tx, sx) = (self.b.dtype(x), self.taint[x as usize], self.short[x as usize]);
                let to: Vec<DType> = DType::ALL
                    .into_iter()
                    .filter(|&to| match to {
                        _ if tx => matches!(to, F32 | F64),
                        _ => true,
                    })
                    .collect();
                let to = *rng.pick(&to);
                let short = match to {
                    F16 | BF16 | Bool | U8 => true,
                    F32 | F64 => sx,
                    I32 | I64 => sx && !from.is_float(),
                };
                let id = self.b.cast(to, x);
                self.add(id, tx, short);
            }
            _ => match rng.below(3) {
                0 => {
                    let d = *rng.pick(&[F32, F64, I32, I64, U8, Bool]);
                    self.constant(rng, d);
                }
                1 => {
                    let id = self.b.index();
                    self.add(id, false, true);
                }
                _ => {
                    let operand = match self.pick(rng, |i| self.b.dtype(i) == I64) {
                        Some(i) => i,
                        None => {
                            let id = self.b.index();
                            self.add(id, false, true)
                        }
                    };
                    let dist = *rng.pick(&[Distribution::Uniform, Distribution::Normal]);
                    let seed = rng.next();
                    let d = *rng.pick(&[F32, F64]);
                    let id = self.b.random(seed, dist, operand, d);
                    let t = self.lib.approximates(ExprOp::Random { seed, dist, operand }, d);
                    self.add(id, t, false);
                }
            },
        }
    }
}

/// An output argument for a store of a `value` of compute dtype `d` through a random view
/// (f32 values are stored as f32, f16 or bf16).
pub(crate) fn output(
    rng: &mut Rng,
    d: DType,
    view: View,
    len: usize,
    value: ExprId,
    arg: usize,
    c: &mut Case,
) -> Store {
    let storage = if d == DType::F32 { *rng.pick(&[DType::F32, DType::F16, DType::BF16]) } else { d };
    c.kernel.args.push(Arg { dtype: storage, len });
    c.init.push(encode(storage, &random_values(rng, storage, len, false)));
    Store { arg: arg as u16, dtype: storage, view, value }
}

pub(crate) fn new_case(label: String, inputs: usize, body: Body) -> Case {
    Case { label, kernel: Kernel { args: vec![], inputs, body }, init: vec![], from_cpu: vec![] }
}

/// A random map loop over 1-3 dimensions: 1-3 inputs of any dtype read through 1-2 random views
/// each, a random DAG, its sinks stored through random views (at most 4, the last node always).
pub(crate) fn map_case(rng: &mut Rng, n: usize, lib: MathLib) -> Case {
    let dims: Vec<usize> = (0..1 + rng.below(3)).map(|_| 1 + rng.below(5)).collect();
    map_case_over(rng, n, &dims, lib)
}

/// A random map loop (as [`map_case`]) over `dims`.
pub(crate) fn map_case_over(rng: &mut Rng, n: usize, dims: &[usize], lib: MathLib) -> Case {
    map_case_through(rng, format!("map {n}"), dims, lib, &random_view)
}

/// A random map loop over 2-3 dimensions, the last 16 or 32 long, whose loads and stores go
/// mostly through [`chunked_view`]s: the vector paths of views that walk whole chunks of
/// contiguous rows (a permute of attention's heads, the parts of a concatenation).
pub(crate) fn chunked_map_case(rng: &mut Rng, n: usize, lib: MathLib) -> Case {
    let mut dims: Vec<usize> = (0..1 + rng.below(2)).map(|_| 1 + rng.below(3)).collect();
    dims.push(16 * (1 + rng.below(2)));
    let view = |rng: &mut Rng, dims: &[usize], broadcast: bool| match rng.chance(0.8) {
        true => chunked_view(rng, dims),
        false => random_view(rng, dims, broadcast),
    };
    map_case_through(rng, format!("chunked map {n}"), &dims, lib, &view)
}

/// A random map loop over 2-3 dimensions, the last of an odd length from 17 to 39, whose loads
/// and stores go mostly through views of padded rows ([`chunked_view`]'s, each row's start
/// a multiple of 16 elements): the vector path that starts a chunk at each row and goes
/// through its partial last chunk index by index (a narrow of a padded product's logits).
pub(crate) fn padded_row_map_case(rng: &mut Rng, n: usize, lib: MathLib) -> Case {
    let mut dims: Vec<usize> = (0..1 + rng.below(2)).map(|_| 1 + rng.below(3)).collect();
    dims.push(17 + 2 * rng.below(12));
    let view = |rng: &mut Rng, dims: &[usize], broadcast: bool| match rng.chance(0.8) {
        true => chunked_view(rng, dims),
        false => random_view(rng, dims, broadcast),
    };
    map_case_through(rng, format!("padded-row map {n}"), &dims, lib, &view)
}

/// A view over `dims` whose last dimension is contiguous and whose other dimensions (in a
/// random order, some reversed, some padded) step by multiples of 16 elements from an offset
/// that is one too: a chunk of up to 16 neighbouring indices reads neighbouring elements (rows
/// of a length no multiple of 16 are padded to one).
/// With the buffer length it needs.
pub(crate) fn chunked_view(rng: &mut Rng, dims: &[usize]) -> (View, usize) {
    let last = dims.len() - 1;
    let mut order: Vec<usize> = (0..last).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut strides = vec![0isize; dims.len()];
    strides[last] = 1;
    let mut acc = dims[last].next_multiple_of(16) + 16 * rng.below(2);
    for &d in order.iter().rev() {
        strides[d] = acc as isize;
        acc *= dims[d] + rng.below(2);
    }
    let mut offset = 16 * rng.below(2);
    for d in 0..last {
        if rng.chance(0.2) {
            offset += (dims[d] - 1) * strides[d] as usize;
            strides[d] = -strides[d];
        }
    }
    let reach: usize = (0..dims.len()).filter(|&d| strides[d] > 0).map(|d| (dims[d] - 1) * strides[d] as usize).sum();
    (View { dims: dims.into(), strides: strides.into(), offset }, offset + reach + 1 + rng.below(2))
}

type ViewMaker<'a> = &'a dyn Fn(&mut Rng, &[usize], bool) -> (View, usize);

/// A random map loop over `dims` labelled `label`, its loads and stores through views `view`
/// makes (broadcast dimensions allowed for loads).
fn map_case_through(rng: &mut Rng, label: String, dims: &[usize], lib: MathLib, view: ViewMaker<'_>) -> Case {
    let inputs = 1 + rng.below(3);
    let mut c = new_case(label, inputs, Body::Map(vec![]));
    let mut loads = vec![];
    for a in 0..inputs {
        let d = *rng.pick(&DType::ALL);
        let mut len = 0;
        for _ in 0..1 + rng.below(2) {
            let (view, l) = view(rng, dims, true);
            loads.push(Load { arg: a as u16, dtype: d, view });
            len = len.max(l);
        }
        c.kernel.args.push(Arg { dtype: d, len });
        c.init.push(encode(d, &random_values(rng, d, len, false)));
    }
    let mut dag = Dag { b: ExprBuilder::new(), taint: vec![], short: vec![], lib };
    for (slot, l) in loads.iter().enumerate() {
        let id = dag.b.load(slot as u16, l.dtype);
        dag.add(id, false, !matches!(l.dtype, DType::F32 | DType::F64));
    }
    for _ in 0..3 + rng.below(12) {
        dag.grow(rng);
    }
    // Store the sinks (the nodes nothing reads), so that every node reaches a store.
    let expr = dag.b.finish();
    let mut read = vec![false; expr.nodes.len()];
    expr.nodes.iter().for_each(|n| n.op.operands().into_iter().for_each(|o| read[o] = true));
    let mut sinks: Vec<usize> = (0..read.len()).filter(|&i| !read[i]).collect();
    while sinks.len() > 4 {
        sinks.remove(rng.below(sinks.len() - 1));
    }
    let mut stores = vec![];
    for v in sinks {
        let (view, len) = view(rng, dims, false);
        let arg = c.kernel.args.len();
        stores.push(output(rng, expr.nodes[v].dtype, view, len, v as ExprId, arg, &mut c));
    }
    c.kernel.body = Body::Map(vec![MapLoop { dims: dims.into(), loads, expr, stores }]);
    c
}

/// The first element where a compiled kernel's arguments (`got`) differ from the interpreter's
/// (`want`), bit for bit but for NaN payloads (the compiled CPU kernels' tests; the printer's
/// test has its own tolerances).
#[allow(dead_code)]
pub(crate) fn first_difference(case: &Case, want: &[Vec<u8>], got: &[Vec<u8>]) -> Option<String> {
    for (a, arg) in case.kernel.args.iter().enumerate() {
        for e in 0..arg.len {
            let (w, g) = (element(arg.dtype, &want[a], e), element(arg.dtype, &got[a], e));
            let same = match (w, g) {
                (Ok(w), Ok(g)) => w.to_bits() == g.to_bits() || (w.is_nan() && g.is_nan()),
                (w, g) => w == g,
            };
            if !same {
                return Some(format!(
                    "{}: a{a} ({}) element {e}: interpreted {w:?}, compiled {g:?}",
                    case.label, arg.dtype
                ));
            }
        }
    }
    None
}

/// Whether a compiled CPU kernels' test (`name`) must skip: there is no C compiler (said why).
#[allow(dead_code)]
pub(crate) fn no_compiler(name: &str) -> bool {
    match braid_devices::cpu::native::compiler_available() {
        Ok(()) => false,
        Err(e) => {
            eprintln!("{name}: SKIPPED, no C compiler to compile kernels with: {e}");
            true
        }
    }
}

/// Each case's kernel compiled for the host (`braid_devices::cpu::native`) and run beside the
/// interpreter on copies of its inputs, in parallel: the [`first_difference`] of each that
/// differs.
#[allow(dead_code)]
pub(crate) fn compiled_differences(cases: &[Case]) -> Vec<String> {
    use rayon::prelude::*;
    cases
        .par_iter()
        .filter_map(|case| {
            let k = &case.kernel;
            let native = braid_devices::cpu::native::NativeKernel::build(k)
                .unwrap_or_else(|e| panic!("{}: {e}\n{k:#?}", case.label));
            let want = run_on_copies(k, &case.init, |args| braid_devices::cpu::run_kernel(k, args)).unwrap();
            // SAFETY: `native` was built from `k`.
            let got = run_on_copies(k, &case.init, |args| unsafe { native.run(k, args) }).unwrap();
            first_difference(case, &want, &got)
        })
        .collect()
}
