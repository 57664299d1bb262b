//! Evaluation of kernel expressions on the CPU, a chunk of elements at a time.
//!
//! Every expression node owns a register: a typed vector, aligned to 64 bytes, holding its value
//! for each element of the current chunk. Nodes are evaluated in order, each as one tight loop
//! over the chunk, so dispatch costs once per node per chunk, not per element, and the loops
//! vectorise. This module computes; it never decides what to compute and never touches buffers
//! (see `map`).

use super::vmath;
use braid_graph::dtype::{bf16_from_f64, f16_bits_from_f32, f16_from_f64, f32_from_f16_bits};
use braid_graph::expr::{Distribution, ExprNode, ExprOp, PrimBinary, PrimCmp, PrimUnary};
use braid_graph::{DType, rng};

/// The values of one expression node over a chunk. Floats stored as f16/bf16 compute in `F32`.
pub enum Reg {
    F32(Lanes<f32>),
    F64(Lanes<f64>),
    I32(Lanes<i32>),
    I64(Lanes<i64>),
    U8(Lanes<u8>),
    Bool(Lanes<bool>),
}

/// A register's storage: values starting at a 64-byte boundary, so that vector loads and
/// stores never straddle two cache lines (which makes simple nodes nearly twice as slow).
pub struct Lanes<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Default> Lanes<T> {
    /// `n` default values (zeros).
    pub fn new(n: usize) -> Lanes<T> {
        let pad = 64 / std::mem::size_of::<T>();
        let buf = vec![T::default(); n + pad];
        let start = buf.as_ptr().align_offset(64).min(pad);
        Lanes { buf, start, len: n }
    }
}

impl<T> std::ops::Deref for Lanes<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T> std::ops::DerefMut for Lanes<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

impl Reg {
    pub fn len(&self) -> usize {
        match self {
            Reg::F32(v) => v.len(),
            Reg::F64(v) => v.len(),
            Reg::I32(v) => v.len(),
            Reg::I64(v) => v.len(),
            Reg::U8(v) => v.len(),
            Reg::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether this register holds compute dtype `dtype` with room for `n` elements.
    pub fn fits(&self, dtype: DType, n: usize) -> bool {
        let same = matches!(
            (self, dtype.compute()),
            (Reg::F32(_), DType::F32)
                | (Reg::F64(_), DType::F64)
                | (Reg::I32(_), DType::I32)
                | (Reg::I64(_), DType::I64)
                | (Reg::U8(_), DType::U8)
                | (Reg::Bool(_), DType::Bool)
        );
        same && self.len() >= n
    }

    /// A register for compute dtype `dtype`, with room for `n` elements.
    pub fn new(dtype: DType, n: usize) -> Reg {
        match dtype.compute() {
            DType::F32 => Reg::F32(Lanes::new(n)),
            DType::F64 => Reg::F64(Lanes::new(n)),
            DType::I32 => Reg::I32(Lanes::new(n)),
            DType::I64 => Reg::I64(Lanes::new(n)),
            DType::U8 => Reg::U8(Lanes::new(n)),
            DType::Bool => Reg::Bool(Lanes::new(n)),
            DType::F16 | DType::BF16 => unreachable!("compute() never returns a half type"),
        }
    }
}

/// Applies `f` elementwise from `x` into `out`.
#[inline(always)]
fn map1<A: Copy, B>(x: &[A], out: &mut [B], f: impl Fn(A) -> B) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f(v);
    }
}

#[inline(always)]
fn map2<A: Copy, B>(x: &[A], y: &[A], out: &mut [B], f: impl Fn(A, A) -> B) {
    for ((o, &a), &b) in out.iter_mut().zip(x).zip(y) {
        *o = f(a, b);
    }
}

macro_rules! float_unary {
    ($op:expr, $x:expr, $out:expr, $exp:expr, $tanh:expr) => {
        match $op {
            PrimUnary::Neg => map1($x, $out, |v| -v),
            PrimUnary::Exp => map1($x, $out, $exp),
            PrimUnary::Log => map1($x, $out, |v| v.ln()),
            PrimUnary::Sqrt => map1($x, $out, |v| v.sqrt()),
            PrimUnary::Abs => map1($x, $out, |v| v.abs()),
            PrimUnary::Sin => map1($x, $out, |v| v.sin()),
            PrimUnary::Cos => map1($x, $out, |v| v.cos()),
            PrimUnary::Tanh => map1($x, $out, $tanh),
        }
    };
}

macro_rules! int_unary {
    ($op:expr, $x:expr, $out:expr) => {
        match $op {
            PrimUnary::Neg => map1($x, $out, |v| v.wrapping_neg()),
            PrimUnary::Abs => map1($x, $out, |v| v.wrapping_abs()),
            other => return Err(format!("{other:?} has no integer form")),
        }
    };
}

macro_rules! float_binary {
    ($op:expr, $a:expr, $b:expr, $out:expr) => {
        match $op {
            PrimBinary::Add => map2($a, $b, $out, |x, y| x + y),
            PrimBinary::Sub => map2($a, $b, $out, |x, y| x - y),
            PrimBinary::Mul => map2($a, $b, $out, |x, y| x * y),
            PrimBinary::Div => map2($a, $b, $out, |x, y| x / y),
            PrimBinary::Pow => map2($a, $b, $out, |x, y| x.powf(y)),
            PrimBinary::Max => map2($a, $b, $out, |x, y| if x > y || x.is_nan() { x } else { y }),
            PrimBinary::Min => map2($a, $b, $out, |x, y| if x < y || x.is_nan() { x } else { y }),
        }
    };
}

macro_rules! int_binary {
    ($op:expr, $a:expr, $b:expr, $out:expr) => {
        match $op {
            PrimBinary::Add => map2($a, $b, $out, |x, y| x.wrapping_add(y)),
            PrimBinary::Sub => map2($a, $b, $out, |x, y| x.wrapping_sub(y)),
            PrimBinary::Mul => map2($a, $b, $out, |x, y| x.wrapping_mul(y)),
            PrimBinary::Div => map2($a, $b, $out, |x, y| if y == 0 { 0 } else { x.wrapping_div(y) }),
            PrimBinary::Max => map2($a, $b, $out, |x, y| x.max(y)),
            PrimBinary::Min => map2($a, $b, $out, |x, y| x.min(y)),
            PrimBinary::Pow => return Err("pow has no integer form".into()),
        }
    };
}

macro_rules! compare {
    ($op:expr, $a:expr, $b:expr, $out:expr) => {
        match $op {
            PrimCmp::Eq => map2($a, $b, $out, |x, y| x == y),
            PrimCmp::Ne => map2($a, $b, $out, |x, y| x != y),
            PrimCmp::Lt => map2($a, $b, $out, |x, y| x < y),
            PrimCmp::Le => map2($a, $b, $out, |x, y| x <= y),
            PrimCmp::Gt => map2($a, $b, $out, |x, y| x > y),
            PrimCmp::Ge => map2($a, $b, $out, |x, y| x >= y),
        }
    };
}

/// Converts register `x` into `out` (a register of `to.compute()`), with braid's cast
/// semantics: floats round, float-to-int truncates and saturates (NaN gives 0), int-to-int
/// wraps, anything-to-bool is `!= 0`, bool is 0/1; an f16/bf16 target rounds to that format.
fn cast(to: DType, x: &Reg, out: &mut Reg, n: usize) {
    macro_rules! from_any {
        ($o:expr, $conv:expr) => {
            match x {
                Reg::F32(v) => map1(&v[..n], $o, |a| $conv(a as f64, false)),
                Reg::F64(v) => map1(&v[..n], $o, |a| $conv(a, false)),
                Reg::I32(v) => map1(&v[..n], $o, |a| $conv(a as f64, true)),
                Reg::I64(v) => map1(&v[..n], $o, |a| $conv(a as f64, true)),
                Reg::U8(v) => map1(&v[..n], $o, |a| $conv(a as f64, true)),
                Reg::Bool(v) => map1(&v[..n], $o, |a| $conv(a as u8 as f64, true)),
            }
        };
    }
    // Integer sources are exact in f64 up to 2^53; i64 -> i64 / i32 / u8 must wrap exactly, so
    // integer-to-integer casts go through i64, not f64.
    let as_i64 = |x: &Reg, i: usize| -> Option<i64> {
        match x {
            Reg::I32(v) => Some(v[i] as i64),
            Reg::I64(v) => Some(v[i]),
            Reg::U8(v) => Some(v[i] as i64),
            Reg::Bool(v) => Some(v[i] as i64),
            _ => None,
        }
    };
    match out {
        Reg::F32(o) => match to {
            // From f32 in one rounding, without the detour through f64 (the same bits).
            DType::F16 => match x {
                Reg::F32(v) => map1(&v[..n], &mut o[..n], |a| f32_from_f16_bits(f16_bits_from_f32(a))),
                _ => from_any!(&mut o[..n], |a: f64, _| f16_from_f64(a).to_f32()),
            },
            DType::BF16 => from_any!(&mut o[..n], |a: f64, _| bf16_from_f64(a).to_f32()),
            // An i64 beyond 2^53 would round twice through f64.
            _ => match x {
                Reg::I64(v) => map1(&v[..n], &mut o[..n], |a| a as f32),
                _ => from_any!(&mut o[..n], |a: f64, _| a as f32),
            },
        },
        Reg::F64(o) => match x {
            Reg::I64(v) => map1(&v[..n], &mut o[..n], |a| a as f64),
            _ => from_any!(&mut o[..n], |a: f64, _| a),
        },
        Reg::Bool(o) => from_any!(&mut o[..n], |a: f64, _| a != 0.0),
        Reg::I32(o) => {
            if matches!(x, Reg::F32(_) | Reg::F64(_)) {
                from_any!(&mut o[..n], |a: f64, _| a as i32)
            } else {
                (0..n).for_each(|i| o[i] = as_i64(x, i).expect("integer register") as i32)
            }
        }
        Reg::I64(o) => {
            if matches!(x, Reg::F32(_) | Reg::F64(_)) {
                from_any!(&mut o[..n], |a: f64, _| a as i64)
            } else {
                (0..n).for_each(|i| o[i] = as_i64(x, i).expect("integer register"))
            }
        }
        Reg::U8(o) => {
            if matches!(x, Reg::F32(_) | Reg::F64(_)) {
                from_any!(&mut o[..n], |a: f64, _| a as u8)
            } else {
                (0..n).for_each(|i| o[i] = as_i64(x, i).expect("integer register") as u8)
            }
        }
    }
}

/// The widest vector instructions the CPU has, among those the loops are compiled for.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Simd {
    Baseline,
    /// AVX2 with FMA.
    Avx2,
    /// AVX-512 F/VL/BW/DQ with FMA: twice the lanes of AVX2 (`exp` and `tanh` run about twice as fast).
    Avx512,
}

/// The level the loops run at: the CPU's, or lower if [`limit_simd`] asked for it.
pub fn simd() -> Simd {
    use std::sync::atomic::Ordering;
    let limit = match LIMIT.load(Ordering::Relaxed) {
        0 => Simd::Baseline,
        1 => Simd::Avx2,
        _ => Simd::Avx512,
    };
    detected().min(limit)
}

/// 0, 1, 2: the highest level [`simd`] may return.
static LIMIT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// Runs later kernels at most at `level` (never above what the CPU has), process-wide; returns
/// the level now in effect. For tests: every level must give the same bits.
pub fn limit_simd(level: Simd) -> Simd {
    LIMIT.store(level as u8, std::sync::atomic::Ordering::Relaxed);
    simd()
}

/// The CPU's vector level (checked once).
fn detected() -> Simd {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<Simd> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            // Both levels compute `mul_add` with the FMA instructions.
            if !has!("fma") {
                return Simd::Baseline;
            }
            if has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") {
                return Simd::Avx512;
            }
            if has!("avx2") {
                return Simd::Avx2;
            }
        }
        Simd::Baseline
    })
}

/// Compiles `$impl` (a function with the given arguments) once per vector level and calls the
/// variant the CPU supports: `$impl` must be `#[inline(always)]` so each copy is vectorised for
/// its level.
macro_rules! dispatch_simd {
    ($impl:ident($($arg:ident: $ty:ty),*) -> $ret:ty) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2($($arg: $ty),*) -> $ret {
            $impl($($arg),*)
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,fma")]
        unsafe fn avx512($($arg: $ty),*) -> $ret {
            $impl($($arg),*)
        }
        match $crate::cpu::eval::simd() {
            // SAFETY: the CPU has these features (checked at run time by `simd`).
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::eval::Simd::Avx512 => unsafe { avx512($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::eval::Simd::Avx2 => unsafe { avx2($($arg),*) },
            _ => $impl($($arg),*),
        }
    }};
}
pub(super) use dispatch_simd;

/// Makes `regs` one register per node of `nodes` (of the node's dtype) with room for `n` values
/// (exactly `n` with `exact`), keeping those that already are: kernels reuse the registers of
/// the last kernel run on their thread instead of allocating them every run (small kernels run
/// by the hundred per training step).
pub(super) fn fit_regs(regs: &mut Vec<Reg>, nodes: &[ExprNode], n: usize, exact: bool) {
    regs.truncate(nodes.len());
    for (i, node) in nodes.iter().enumerate() {
        match regs.get_mut(i) {
            Some(r) if r.fits(node.dtype, n) && (!exact || r.len() == n) => {}
            Some(r) => *r = Reg::new(node.dtype, n),
            None => regs.push(Reg::new(node.dtype, n)),
        }
    }
}

/// Evaluates node `node` (at position `idx`) over the first `n` elements. `regs[..idx]` hold
/// the operands; loads have been filled by the caller. `start` is the chunk's first linear
/// index. Errors only on an ill-typed expression, which lowering never produces.
///
/// The loops are compiled three times, for the baseline x86-64, with AVX2 and with AVX-512 (each
/// with FMA), and the CPU picks at run time. The code is the same, so are the results: the only
/// fused multiply-adds are explicit `mul_add`s, which every level rounds once (the FMA
/// instructions, or libm's exact `fmaf` on the baseline).
pub fn eval_node(node: &ExprNode, idx: usize, regs: &mut [Reg], n: usize, start: usize) -> Result<(), String> {
    dispatch_simd!(eval_node_impl(node: &ExprNode, idx: usize, regs: &mut [Reg], n: usize, start: usize) -> Result<(), String>)
}

#[inline(always)]
fn eval_node_impl(node: &ExprNode, idx: usize, regs: &mut [Reg], n: usize, start: usize) -> Result<(), String> {
    let (operands, rest) = regs.split_at_mut(idx);
    let out = &mut rest[0];
    match node.op {
        ExprOp::Load(_) => {}
        ExprOp::Const(bits) => {
            let v = f64::from_bits(bits);
            match out {
                Reg::F32(o) => o[..n].fill(v as f32),
                Reg::F64(o) => o[..n].fill(v),
                _ => return Err("float constant in an integer register".into()),
            }
        }
        ExprOp::ConstInt(v) => match out {
            Reg::I32(o) => o[..n].fill(v as i32),
            Reg::I64(o) => o[..n].fill(v),
            Reg::U8(o) => o[..n].fill(v as u8),
            Reg::Bool(o) => o[..n].fill(v != 0),
            _ => return Err("integer constant in a float register".into()),
        },
        ExprOp::Index => match out {
            Reg::I64(o) => o[..n].iter_mut().enumerate().for_each(|(i, x)| *x = (start + i) as i64),
            _ => return Err("index must be i64".into()),
        },
        ExprOp::Random { seed, dist, operand } => {
            let Reg::I64(ix) = &operands[operand as usize] else { return Err("random operand must be i64".into()) };
            match (out, dist) {
                (Reg::F32(o), Distribution::Uniform) => {
                    map1(&ix[..n], &mut o[..n], |i| rng::uniform(seed, i as u64, DType::F32) as f32)
                }
                (Reg::F32(o), Distribution::Normal) => map1(&ix[..n], &mut o[..n], |i| rng::normal_f32(seed, i as u64)),
                (Reg::F64(o), Distribution::Uniform) => {
                    map1(&ix[..n], &mut o[..n], |i| rng::uniform(seed, i as u64, DType::F64))
                }
                (Reg::F64(o), Distribution::Normal) => {
                    map1(&ix[..n], &mut o[..n], |i| rng::normal_f64(seed, i as u64, DType::F64))
                }
                _ => return Err("random numbers are floats".into()),
            }
        }
        ExprOp::Unary(op, x) => match (&operands[x as usize], out) {
            (Reg::F32(x), Reg::F32(o)) => float_unary!(op, &x[..n], &mut o[..n], vmath::exp, vmath::tanh),
            (Reg::F64(x), Reg::F64(o)) => float_unary!(op, &x[..n], &mut o[..n], f64::exp, f64::tanh),
            (Reg::I32(x), Reg::I32(o)) => int_unary!(op, &x[..n], &mut o[..n]),
            (Reg::I64(x), Reg::I64(o)) => int_unary!(op, &x[..n], &mut o[..n]),
            (Reg::U8(x), Reg::U8(o)) => match op {
                PrimUnary::Neg => map1(&x[..n], &mut o[..n], |v| v.wrapping_neg()),
                PrimUnary::Abs => o[..n].copy_from_slice(&x[..n]),
                other => return Err(format!("{other:?} has no integer form")),
            },
            _ => return Err(format!("{op:?} on an unsupported register")),
        },
        ExprOp::Binary(op, a, b) => match (&operands[a as usize], &operands[b as usize], out) {
            (Reg::F32(a), Reg::F32(b), Reg::F32(o)) => float_binary!(op, &a[..n], &b[..n], &mut o[..n]),
            (Reg::F64(a), Reg::F64(b), Reg::F64(o)) => float_binary!(op, &a[..n], &b[..n], &mut o[..n]),
            (Reg::I32(a), Reg::I32(b), Reg::I32(o)) => int_binary!(op, &a[..n], &b[..n], &mut o[..n]),
            (Reg::I64(a), Reg::I64(b), Reg::I64(o)) => int_binary!(op, &a[..n], &b[..n], &mut o[..n]),
            (Reg::U8(a), Reg::U8(b), Reg::U8(o)) => int_binary!(op, &a[..n], &b[..n], &mut o[..n]),
            _ => return Err(format!("{op:?} on mismatched registers")),
        },
        ExprOp::Cmp(op, a, b) => {
            let Reg::Bool(o) = out else { return Err("comparisons produce bool".into()) };
            let o = &mut o[..n];
            match (&operands[a as usize], &operands[b as usize]) {
                (Reg::F32(a), Reg::F32(b)) => compare!(op, &a[..n], &b[..n], o),
                (Reg::F64(a), Reg::F64(b)) => compare!(op, &a[..n], &b[..n], o),
                (Reg::I32(a), Reg::I32(b)) => compare!(op, &a[..n], &b[..n], o),
                (Reg::I64(a), Reg::I64(b)) => compare!(op, &a[..n], &b[..n], o),
                (Reg::U8(a), Reg::U8(b)) => compare!(op, &a[..n], &b[..n], o),
                (Reg::Bool(a), Reg::Bool(b)) => compare!(op, &a[..n], &b[..n], o),
                _ => return Err(format!("{op:?} on mismatched registers")),
            }
        }
        ExprOp::Select(c, a, b) => {
            let Reg::Bool(c) = &operands[c as usize] else { return Err("select needs a bool condition".into()) };
            let c = &c[..n];
            macro_rules! sel {
                ($a:expr, $b:expr, $o:expr) => {
                    for i in 0..n {
                        $o[i] = if c[i] { $a[i] } else { $b[i] };
                    }
                };
            }
            match (&operands[a as usize], &operands[b as usize], out) {
                (Reg::F32(a), Reg::F32(b), Reg::F32(o)) => sel!(a, b, o),
                (Reg::F64(a), Reg::F64(b), Reg::F64(o)) => sel!(a, b, o),
                (Reg::I32(a), Reg::I32(b), Reg::I32(o)) => sel!(a, b, o),
                (Reg::I64(a), Reg::I64(b), Reg::I64(o)) => sel!(a, b, o),
                (Reg::U8(a), Reg::U8(b), Reg::U8(o)) => sel!(a, b, o),
                (Reg::Bool(a), Reg::Bool(b), Reg::Bool(o)) => sel!(a, b, o),
                _ => return Err("select on mismatched registers".into()),
            }
        }
        ExprOp::Cast(to, x) => cast(to, &operands[x as usize], out, n),
        ExprOp::Reduce(..) => return Err("reductions are evaluated by row kernels".into()),
    }
    Ok(())
}
