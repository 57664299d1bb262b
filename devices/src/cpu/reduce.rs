//! Running reductions for row kernels: one accumulator per inner position of a row, folded a
//! chunk at a time. Sums, extremes, argmax and integer reductions over contiguous rows fold in
//! many independent lanes so the loops vectorise and do not wait on one register; float sums
//! are compensated (Kahan) chunk by chunk; `merge` is the ordered combine of a row split across
//! threads. Every fold gives what the element-by-element loop gives (the first index of a
//! maximum, NaN sticky), up to the order of a float sum. This module reads buffers only through
//! `add_contiguous`, whose caller checked the run, and never decides what to reduce (see
//! `rows`).

use super::eval::{Reg, dispatch_simd};
use super::rows::inner_runs;
use braid_graph::{DType, ReduceOp};

/// A running reduction for every inner position of a row, in the operand's type.
pub(super) struct Acc {
    op: ReduceOp,
    vals: Reg,
    /// Float sums over contiguous rows: the running compensation (Kahan) of `vals`, so a sum of
    /// millions of elements stays within a few ulps instead of drifting by one rounding per
    /// chunk.
    comp: Reg,
    /// ArgMax: the axis position of the best value so far.
    idx: Vec<i64>,
}

/// Adds `x` to `acc` with Kahan compensation `comp`; an infinite or NaN sum drops the
/// compensation (which would turn it into NaN) and stays as IEEE addition makes it.
#[inline(always)]
fn kahan_add<T: Copy + std::ops::Add<Output = T> + std::ops::Sub<Output = T> + Default>(
    acc: &mut T,
    comp: &mut T,
    x: T,
    finite: impl Fn(T) -> bool,
) {
    let y = x - *comp;
    let t = *acc + y;
    *comp = if finite(t) { (t - *acc) - y } else { T::default() };
    *acc = t;
}

/// Folds `v` with `f` (associative and commutative, up to rounding) starting from `init` in
/// each of many independent lanes, then folds the lanes: the loops vectorise, and several
/// vector registers of partial results hide the latency of each step (one register would make
/// every step wait for the previous one).
#[inline(always)]
fn fold_lanes<T: Copy>(v: &[T], init: T, f: impl Fn(T, T) -> T) -> T {
    // Four accumulators of 16 lanes, kept as separate small arrays so they stay in registers.
    const LANES: usize = 16;
    let (mut a0, mut a1, mut a2, mut a3) = ([init; LANES], [init; LANES], [init; LANES], [init; LANES]);
    let step = |acc: &mut [T; LANES], xs: &[T]| {
        for (p, &x) in acc.iter_mut().zip(xs) {
            *p = f(*p, x);
        }
    };
    let mut it = v.chunks_exact(4 * LANES);
    for ch in &mut it {
        step(&mut a0, &ch[..LANES]);
        step(&mut a1, &ch[LANES..2 * LANES]);
        step(&mut a2, &ch[2 * LANES..3 * LANES]);
        step(&mut a3, &ch[3 * LANES..]);
    }
    let mut it = it.remainder().chunks_exact(LANES);
    for ch in &mut it {
        step(&mut a0, ch);
    }
    step(&mut a0, &a1);
    step(&mut a2, &a3);
    step(&mut a0, &a2);
    it.remainder().iter().chain(&a0).fold(init, |a, &x| f(a, x))
}

/// Folds `v[..m]` (flat row positions `c..`) into float accumulators.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fold_float<T: Copy + PartialOrd + std::ops::Add<Output = T> + std::ops::Sub<Output = T> + Default>(
    op: ReduceOp,
    acc: &mut [T],
    comp: &mut [T],
    idx: &mut [i64],
    v: &[T],
    c: usize,
    inner: usize,
    is_nan: impl Fn(T) -> bool,
    finite: impl Fn(T) -> bool,
) {
    match op {
        ReduceOp::Sum | ReduceOp::Mean if inner == 1 => {
            // A chunk's sum in independent lanes, then added to the row's with compensation.
            let s = fold_lanes(v, T::default(), |a, x| a + x);
            kahan_add(&mut acc[0], &mut comp[0], s, finite);
        }
        ReduceOp::Sum | ReduceOp::Mean => {
            // Runs of consecutive inner positions: loops the compiler vectorises.
            inner_runs(c, v.len(), inner, |t, j, run| {
                for (a, &x) in acc[j..j + run].iter_mut().zip(&v[t..t + run]) {
                    *a = *a + x;
                }
            });
        }
        ReduceOp::Max | ReduceOp::Min if inner == 1 => {
            // Running extremes (NaN-propagating) in independent lanes, then one.
            // A NaN is sticky: no comparison with it is true, so it is kept once picked.
            let m = if op == ReduceOp::Min {
                fold_lanes(v, acc[0], |a, x| if x < a || is_nan(x) { x } else { a })
            } else {
                fold_lanes(v, acc[0], |a, x| if x > a || is_nan(x) { x } else { a })
            };
            acc[0] = m;
        }
        ReduceOp::ArgMax if inner == 1 => {
            // The best value in lanes first (NaN sticky), then, only if it beats the row's so
            // far, the first position holding it: what the one-by-one loop below picks (the
            // first NaN, else the first occurrence of a strictly larger maximum).
            if is_nan(acc[0]) {
                return;
            }
            let m = fold_lanes(v, acc[0], |a, x| if x > a || is_nan(x) { x } else { a });
            let at = if is_nan(m) {
                v.iter().position(|&x| is_nan(x))
            } else if m > acc[0] {
                v.iter().position(|&x| x == m)
            } else {
                None
            };
            if let Some(t) = at {
                acc[0] = v[t];
                idx[0] = (c + t) as i64;
            }
        }
        ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax => {
            let better = |x: T, a: T| if op == ReduceOp::Min { x < a } else { x > a };
            for (t, &x) in v.iter().enumerate() {
                let j = (c + t) % inner;
                if !is_nan(acc[j]) && (better(x, acc[j]) || is_nan(x)) {
                    acc[j] = x;
                    idx[j] = ((c + t) / inner) as i64;
                }
            }
        }
    }
}

/// Folds `v[..m]` into integer accumulators (sums wrap).
#[inline(always)]
fn fold_int<T: Copy + Ord + Default>(
    op: ReduceOp,
    acc: &mut [T],
    idx: &mut [i64],
    v: &[T],
    c: usize,
    inner: usize,
    wrapping_add: impl Fn(T, T) -> T + Copy,
) {
    if inner == 1 {
        // In lanes: integer sums wrap and extremes are exact, so any order gives the same value.
        match op {
            ReduceOp::Sum | ReduceOp::Mean => acc[0] = wrapping_add(acc[0], fold_lanes(v, T::default(), wrapping_add)),
            ReduceOp::Max => acc[0] = fold_lanes(v, acc[0], |a, x| a.max(x)),
            ReduceOp::Min => acc[0] = fold_lanes(v, acc[0], |a, x| a.min(x)),
            ReduceOp::ArgMax => {
                // The first occurrence of a strictly larger maximum, as in the loop below.
                let m = fold_lanes(v, acc[0], |a, x| a.max(x));
                if m > acc[0]
                    && let Some(t) = v.iter().position(|&x| x == m)
                {
                    acc[0] = m;
                    idx[0] = (c + t) as i64;
                }
            }
        }
        return;
    }
    for (t, &x) in v.iter().enumerate() {
        let j = (c + t) % inner;
        match op {
            ReduceOp::Sum | ReduceOp::Mean => acc[j] = wrapping_add(acc[j], x),
            ReduceOp::Max => acc[j] = acc[j].max(x),
            ReduceOp::Min => acc[j] = acc[j].min(x),
            ReduceOp::ArgMax => {
                if x > acc[j] {
                    acc[j] = x;
                    idx[j] = ((c + t) / inner) as i64;
                }
            }
        }
    }
}

impl Acc {
    pub(super) fn new(op: ReduceOp, operand: DType, inner: usize) -> Acc {
        let mut acc = Acc { op, vals: Reg::new(operand, inner), comp: Reg::new(operand, inner), idx: vec![0; inner] };
        acc.reset();
        acc
    }

    /// The accumulator of one segment of a split row as compiled code left it (see
    /// `braid_lowering::host_c::print_split`), for rows of one position per step along the axis:
    /// its value and a float sum's compensation as the bits of the operand's compute type (in
    /// the low bytes), and an argmax's position. Merged and finished as the interpreter's own
    /// segments are, so the combine stays the interpreter's.
    pub(super) fn from_parts(op: ReduceOp, operand: DType, [value, comp, idx]: [u64; 3]) -> Acc {
        let mut acc = Acc::new(op, operand, 1);
        match (&mut acc.vals, &mut acc.comp) {
            (Reg::F32(v), Reg::F32(c)) => (v[0], c[0]) = (f32::from_bits(value as u32), f32::from_bits(comp as u32)),
            (Reg::F64(v), Reg::F64(c)) => (v[0], c[0]) = (f64::from_bits(value), f64::from_bits(comp)),
            (Reg::I32(v), _) => v[0] = value as u32 as i32,
            (Reg::I64(v), _) => v[0] = value as i64,
            (Reg::U8(v), _) => v[0] = value as u8,
            _ => unreachable!("reductions of bools are rejected when recorded"),
        }
        acc.idx[0] = idx as i64;
        acc
    }

    /// Back to the reduction's identity, for the next row.
    pub(super) fn reset(&mut self) {
        let op = self.op;
        self.idx.fill(0);
        match &mut self.comp {
            Reg::F32(c) => c.fill(0.0),
            Reg::F64(c) => c.fill(0.0),
            _ => {}
        }
        macro_rules! init {
            ($v:expr, $zero:expr, $lo:expr, $hi:expr) => {
                $v.fill(match op {
                    ReduceOp::Sum | ReduceOp::Mean => $zero,
                    ReduceOp::Max | ReduceOp::ArgMax => $lo,
                    ReduceOp::Min => $hi,
                })
            };
        }
        match &mut self.vals {
            Reg::F32(v) => init!(v, 0.0, f32::NEG_INFINITY, f32::INFINITY),
            Reg::F64(v) => init!(v, 0.0, f64::NEG_INFINITY, f64::INFINITY),
            Reg::I32(v) => init!(v, 0, i32::MIN, i32::MAX),
            Reg::I64(v) => init!(v, 0, i64::MIN, i64::MAX),
            Reg::U8(v) => init!(v, 0, u8::MIN, u8::MAX),
            Reg::Bool(_) => {}
        }
    }

    /// Writes the results into the reduction node's per-row register.
    pub(super) fn finish(&self, len: usize, out: &mut Reg) {
        match (self.op, &self.vals, out) {
            (ReduceOp::ArgMax, _, Reg::I64(o)) => o.copy_from_slice(&self.idx),
            (ReduceOp::Mean, Reg::F32(v), Reg::F32(o)) => {
                o.iter_mut().zip(v.iter()).for_each(|(o, v)| *o = v / len as f32)
            }
            (ReduceOp::Mean, Reg::F64(v), Reg::F64(o)) => {
                o.iter_mut().zip(v.iter()).for_each(|(o, v)| *o = v / len as f64)
            }
            (_, Reg::F32(v), Reg::F32(o)) => o.copy_from_slice(v),
            (_, Reg::F64(v), Reg::F64(o)) => o.copy_from_slice(v),
            (_, Reg::I32(v), Reg::I32(o)) => o.copy_from_slice(v),
            (_, Reg::I64(v), Reg::I64(o)) => o.copy_from_slice(v),
            (_, Reg::U8(v), Reg::U8(o)) => o.copy_from_slice(v),
            _ => unreachable!("a reduction's register has its result type"),
        }
    }

    /// Folds `later`, the accumulator of the row positions after this one's, into this one: the
    /// combine of a row split across threads. Its order is fixed (segment by segment), so the
    /// result does not depend on how many threads there are.
    pub(super) fn merge(&mut self, later: &Acc) {
        let op = self.op;
        macro_rules! float {
            ($a:expr, $k:expr, $idx:expr, $b:expr, $bk:expr, $bidx:expr, $t:ty) => {
                for j in 0..$a.len() {
                    match op {
                        ReduceOp::Sum | ReduceOp::Mean => {
                            kahan_add(&mut $a[j], &mut $k[j], $b[j], <$t>::is_finite);
                            kahan_add(&mut $a[j], &mut $k[j], -$bk[j], <$t>::is_finite);
                        }
                        // NaN is sticky and the first extreme wins.
                        _ if $a[j].is_nan() => {}
                        _ => {
                            let better = if op == ReduceOp::Min { $b[j] < $a[j] } else { $b[j] > $a[j] };
                            if better || $b[j].is_nan() {
                                $a[j] = $b[j];
                                $idx[j] = $bidx[j];
                            }
                        }
                    }
                }
            };
        }
        macro_rules! int {
            ($a:expr, $idx:expr, $b:expr, $bidx:expr) => {
                for j in 0..$a.len() {
                    match op {
                        ReduceOp::Sum | ReduceOp::Mean => $a[j] = $a[j].wrapping_add($b[j]),
                        ReduceOp::Max => $a[j] = $a[j].max($b[j]),
                        ReduceOp::Min => $a[j] = $a[j].min($b[j]),
                        ReduceOp::ArgMax => {
                            if $b[j] > $a[j] {
                                $a[j] = $b[j];
                                $idx[j] = $bidx[j];
                            }
                        }
                    }
                }
            };
        }
        let idx = &mut self.idx;
        match (&mut self.vals, &mut self.comp, &later.vals, &later.comp) {
            (Reg::F32(a), Reg::F32(k), Reg::F32(b), Reg::F32(bk)) => float!(a, k, idx, b, bk, later.idx, f32),
            (Reg::F64(a), Reg::F64(k), Reg::F64(b), Reg::F64(bk)) => float!(a, k, idx, b, bk, later.idx, f64),
            (Reg::I32(a), _, Reg::I32(b), _) => int!(a, idx, b, later.idx),
            (Reg::I64(a), _, Reg::I64(b), _) => int!(a, idx, b, later.idx),
            (Reg::U8(a), _, Reg::U8(b), _) => int!(a, idx, b, later.idx),
            _ => unreachable!("accumulators of one reduction have one type"),
        }
    }

    /// Folds the `m` elements of a buffer at `ptr` (flat row positions `c..c + m`, contiguous
    /// in memory) in, `chunk` at a time: exactly the folds [`add`](Acc::add) makes after
    /// gathering chunks of that width, so the same bits, without the copy into a register.
    /// Returns false (and folds nothing) when the buffer's type is not the accumulator's (a
    /// half-precision load is widened by a gather).
    ///
    /// # Safety
    /// `ptr` must point at `m` readable elements of type `dtype`.
    pub(super) unsafe fn add_contiguous(
        &mut self,
        (ptr, dtype): (*const u8, DType),
        c: usize,
        m: usize,
        inner: usize,
        chunk: usize,
    ) -> bool {
        // SAFETY: the caller promises `m` elements of type `dtype` at `ptr`.
        let v = unsafe {
            match dtype {
                DType::F32 => Slice::F32(std::slice::from_raw_parts(ptr as *const f32, m)),
                DType::F64 => Slice::F64(std::slice::from_raw_parts(ptr as *const f64, m)),
                DType::I32 => Slice::I32(std::slice::from_raw_parts(ptr as *const i32, m)),
                DType::I64 => Slice::I64(std::slice::from_raw_parts(ptr as *const i64, m)),
                DType::U8 => Slice::U8(std::slice::from_raw_parts(ptr, m)),
                _ => return false,
            }
        };
        let acc = self;
        dispatch_simd!(fold_contiguous(acc: &mut Acc, v: Slice<'_>, c: usize, inner: usize, chunk: usize) -> bool)
    }

    /// Folds `v[..m]` (flat row positions `c..`) in, compiled for each vector level: it is
    /// called from a closure, and closures do not inherit their caller's target features.
    pub(super) fn add(&mut self, v: &Reg, c: usize, m: usize, inner: usize) {
        let acc = self;
        dispatch_simd!(acc_add(acc: &mut Acc, v: &Reg, c: usize, m: usize, inner: usize) -> ())
    }
}

/// The body of [`Acc::add`].
#[inline(always)]
fn acc_add(acc: &mut Acc, v: &Reg, c: usize, m: usize, inner: usize) {
    let (op, idx) = (acc.op, &mut acc.idx);
    match (&mut acc.vals, &mut acc.comp, v) {
        (Reg::F32(a), Reg::F32(k), Reg::F32(v)) => {
            fold_float(op, a, k, idx, &v[..m], c, inner, f32::is_nan, f32::is_finite)
        }
        (Reg::F64(a), Reg::F64(k), Reg::F64(v)) => {
            fold_float(op, a, k, idx, &v[..m], c, inner, f64::is_nan, f64::is_finite)
        }
        (Reg::I32(a), _, Reg::I32(v)) => fold_int(op, a, idx, &v[..m], c, inner, i32::wrapping_add),
        (Reg::I64(a), _, Reg::I64(v)) => fold_int(op, a, idx, &v[..m], c, inner, i64::wrapping_add),
        (Reg::U8(a), _, Reg::U8(v)) => fold_int(op, a, idx, &v[..m], c, inner, u8::wrapping_add),
        _ => unreachable!("the accumulator has the operand's type"),
    }
}

/// A run of buffer elements, borrowed in their own type.
enum Slice<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    I32(&'a [i32]),
    I64(&'a [i64]),
    U8(&'a [u8]),
}

/// The body of [`Acc::add_contiguous`].
#[inline(always)]
fn fold_contiguous(acc: &mut Acc, v: Slice<'_>, c: usize, inner: usize, chunk: usize) -> bool {
    let (op, idx) = (acc.op, &mut acc.idx);
    let chunk = chunk.max(1);
    macro_rules! each_chunk {
        ($all:expr, |$v:ident, $at:ident| $fold:expr) => {{
            for (k, $v) in $all.chunks(chunk).enumerate() {
                let $at = c + k * chunk;
                $fold;
            }
            true
        }};
    }
    match (&mut acc.vals, &mut acc.comp, v) {
        (Reg::F32(a), Reg::F32(k), Slice::F32(v)) => {
            each_chunk!(v, |v, at| fold_float(op, a, k, idx, v, at, inner, f32::is_nan, f32::is_finite))
        }
        (Reg::F64(a), Reg::F64(k), Slice::F64(v)) => {
            each_chunk!(v, |v, at| fold_float(op, a, k, idx, v, at, inner, f64::is_nan, f64::is_finite))
        }
        (Reg::I32(a), _, Slice::I32(v)) => {
            each_chunk!(v, |v, at| fold_int(op, a, idx, v, at, inner, i32::wrapping_add))
        }
        (Reg::I64(a), _, Slice::I64(v)) => {
            each_chunk!(v, |v, at| fold_int(op, a, idx, v, at, inner, i64::wrapping_add))
        }
        (Reg::U8(a), _, Slice::U8(v)) => each_chunk!(v, |v, at| fold_int(op, a, idx, v, at, inner, u8::wrapping_add)),
        _ => false,
    }
}
