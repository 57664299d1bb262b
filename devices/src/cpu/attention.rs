//! Running an [`AttentionKernel`] on the CPU: tiled scaled dot-product attention that never
//! holds more than a `[QUERY_TILE, KEY_TILE]` block of scores.
//!
//! The forward pass walks each query tile across the key tiles with an online softmax (a
//! running maximum and rescaled sums, as FlashAttention does); the key/value gradients walk
//! each key tile across the query tiles, recomputing the probabilities from the saved
//! log-sum-exp; the query gradient walks each query tile across the key tiles. Every tile is
//! one rayon task that alone writes its rows, so results do not depend on the thread count.
//! Values are widened to f32 (f64 for f64 inputs) when a tile is loaded; sums run in that type.
//!
//! Every view is checked against its argument before any unchecked access. This module never
//! allocates device memory.

use super::map::{ArgPtr, SharedArgs, in_tasks};
use braid_graph::DType;
use braid_lowering::{AttentionKernel, AttentionPass, Load};
use half::{bf16, f16};

/// Query rows per task and per tile.
const QUERY_TILE: usize = 32;
/// Key rows per tile.
const KEY_TILE: usize = 64;

/// The arithmetic a pass runs in: f32, or f64 for f64 inputs.
trait Real: Copy + Default + PartialOrd + Send + Sync + 'static {
    fn from_f64(x: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn read(dtype: DType, p: *const u8, i: isize) -> Self;
    fn write(self, dtype: DType, p: *mut u8, i: usize);
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn sub(self, o: Self) -> Self {
                self - o
            }
            fn mul(self, o: Self) -> Self {
                self * o
            }
            fn div(self, o: Self) -> Self {
                self / o
            }
            fn read(dtype: DType, p: *const u8, i: isize) -> Self {
                // SAFETY: callers pass positions that `AttentionKernel::check` put inside the
                // argument, whose elements are `dtype`.
                unsafe {
                    match dtype {
                        DType::F32 => *(p as *const f32).offset(i) as $t,
                        DType::F64 => *(p as *const f64).offset(i) as $t,
                        DType::F16 => (*(p as *const f16).offset(i)).to_f32() as $t,
                        _ => (*(p as *const bf16).offset(i)).to_f32() as $t,
                    }
                }
            }
            fn write(self, dtype: DType, p: *mut u8, i: usize) {
                // SAFETY: as in `read`; element `i` of a contiguous output only this task writes.
                unsafe {
                    match dtype {
                        DType::F32 => *(p as *mut f32).add(i) = self as f32,
                        DType::F64 => *(p as *mut f64).add(i) = self as f64,
                        DType::F16 => *(p as *mut f16).add(i) = f16::from_f64(self as f64),
                        _ => *(p as *mut bf16).add(i) = bf16::from_f64(self as f64),
                    }
                }
            }
        }
    };
}
real!(f32);
real!(f64);

/// Runs one attention pass. `args` must match the kernel's argument list.
pub fn run_attention(a: &AttentionKernel, args: &[ArgPtr]) -> Result<(), String> {
    a.check(|i| args.get(i as usize).map(|p| (p.dtype, p.len)))?;
    // No queries still means key and value gradients of zeros: the passes write them.
    if a.problems() == 0 {
        return Ok(());
    }
    match a.dtype {
        DType::F64 => run::<f64>(a, SharedArgs(args)),
        _ => run::<f32>(a, SharedArgs(args)),
    }
}

/// Where operand rows live: the first element of row `r` of problem `b`, and the column stride.
struct Rows<'a> {
    load: &'a Load,
    ptr: *const u8,
}

impl Rows<'_> {
    fn new<'a>(load: &'a Load, args: SharedArgs<'_>) -> Rows<'a> {
        Rows { load, ptr: args.0[load.arg as usize].ptr as *const u8 }
    }

    /// The element offset of `(problem b, row r, column c)` (`c` ignored for a vector).
    fn at(&self, batch: &[usize], b: usize, r: usize, c: usize) -> isize {
        let v = &self.load.view;
        let n = batch.len();
        let mut off = v.offset as isize;
        let mut rest = b;
        for d in (0..n).rev() {
            off += (rest % batch[d]) as isize * v.strides[d];
            rest /= batch[d];
        }
        off += r as isize * v.strides[n];
        if v.strides.len() > n + 1 {
            off += c as isize * v.strides[n + 1];
        }
        off
    }

    /// Rows `r0..r0 + n` of problem `b` as a `[n, d]` block of `R`.
    fn block<R: Real>(&self, batch: &[usize], b: usize, r0: usize, n: usize, d: usize, out: &mut Vec<R>) {
        out.clear();
        let cs = self.load.view.strides.last().copied().unwrap_or(0);
        for r in r0..r0 + n {
            let base = self.at(batch, b, r, 0);
            out.extend((0..d).map(|c| R::read(self.load.dtype, self.ptr, base + c as isize * cs)));
        }
    }

    /// Elements `r0..r0 + n` of problem `b` of a `[batch.., rows]` vector.
    fn vector<R: Real>(&self, batch: &[usize], b: usize, r0: usize, n: usize, out: &mut Vec<R>) {
        out.clear();
        out.extend((r0..r0 + n).map(|r| R::read(self.load.dtype, self.ptr, self.at(batch, b, r, 0))));
    }
}

// SAFETY: the pointers are read-only views of buffers that outlive the kernel run.
unsafe impl Send for Rows<'_> {}
unsafe impl Sync for Rows<'_> {}

/// One task's tile buffers (reused across its tiles).
struct Tiles<R> {
    q: Vec<R>,
    o: Vec<R>,
    lse: Vec<R>,
    delta: Vec<R>,
    k: Vec<R>,
    v: Vec<R>,
    s: Vec<R>,
}

impl<R> Default for Tiles<R> {
    fn default() -> Self {
        Tiles { q: vec![], o: vec![], lse: vec![], delta: vec![], k: vec![], v: vec![], s: vec![] }
    }
}

/// `a . b`, summed in order.
fn dot<R: Real>(a: &[R], b: &[R]) -> R {
    a.iter().zip(b).fold(R::default(), |acc, (&x, &y)| acc.add(x.mul(y)))
}

/// `s[i][j] = scale * q[i] . k[j]` for a tile, `None`-masked as `-inf`.
#[allow(clippy::too_many_arguments)]
fn scores<R: Real>(q: &[R], k: &[R], d: usize, scale: R, q0: usize, k0: usize, causal: bool, s: &mut Vec<R>) {
    let (nq, nk) = (q.len() / d, k.len() / d);
    s.clear();
    for i in 0..nq {
        let qi = &q[i * d..(i + 1) * d];
        for j in 0..nk {
            if causal && k0 + j > q0 + i {
                s.push(R::from_f64(f64::NEG_INFINITY));
                continue;
            }
            let kj = &k[j * d..(j + 1) * d];
            let dot = dot(qi, kj);
            s.push(dot.mul(scale));
        }
    }
}

fn run<R: Real>(a: &AttentionKernel, args: SharedArgs<'_>) -> Result<(), String> {
    let (sq, sk, d) = (a.sq, a.sk, a.d);
    let (q, k, v) = (Rows::new(&a.q, args), Rows::new(&a.k, args), Rows::new(&a.v, args));
    let out_ptr = |arg: u16| args.0[arg as usize].ptr as usize;
    let scale = R::from_f64(a.scale());
    let batch = &a.batch;
    let (dtype, stats) = (a.dtype, a.stats_dtype());
    let neg_inf = R::from_f64(f64::NEG_INFINITY);
    match &a.pass {
        AttentionPass::Forward { out, lse } => {
            let (out, lse) = (out.map(out_ptr), lse.map(out_ptr));
            let tiles = sq.div_ceil(QUERY_TILE);
            in_tasks(a.problems() * tiles, |start, end| {
                let (mut qt, mut kt, mut vt, mut s) = (vec![], vec![], vec![], vec![]);
                for task in start..end {
                    let (b, q0) = (task / tiles, (task % tiles) * QUERY_TILE);
                    let nq = QUERY_TILE.min(sq - q0);
                    q.block(batch, b, q0, nq, d, &mut qt);
                    let mut m = vec![neg_inf; nq];
                    let mut l = vec![R::default(); nq];
                    let mut acc = vec![R::default(); nq * d];
                    let last_key = if a.causal { (q0 + nq).min(sk) } else { sk };
                    for k0 in (0..last_key).step_by(KEY_TILE) {
                        let nk = KEY_TILE.min(last_key - k0);
                        k.block(batch, b, k0, nk, d, &mut kt);
                        v.block(batch, b, k0, nk, d, &mut vt);
                        scores(&qt, &kt, d, scale, q0, k0, a.causal, &mut s);
                        for i in 0..nq {
                            let row = &s[i * nk..(i + 1) * nk];
                            let tile_max = row.iter().copied().fold(neg_inf, |x, y| if y > x { y } else { x });
                            if tile_max == neg_inf {
                                continue; // every key of the tile is masked for this query
                            }
                            let new_m = if tile_max > m[i] { tile_max } else { m[i] };
                            let alpha = m[i].sub(new_m).exp();
                            let acc_i = &mut acc[i * d..(i + 1) * d];
                            acc_i.iter_mut().for_each(|x| *x = x.mul(alpha));
                            let mut sum = l[i].mul(alpha);
                            for (j, x) in row.iter().enumerate() {
                                if *x == neg_inf {
                                    continue; // masked: reads nothing of the value row
                                }
                                let p = x.sub(new_m).exp();
                                sum = sum.add(p);
                                let vj = &vt[j * d..(j + 1) * d];
                                acc_i.iter_mut().zip(vj).for_each(|(o, &y)| *o = o.add(p.mul(y)));
                            }
                            l[i] = sum;
                            m[i] = new_m;
                        }
                    }
                    for i in 0..nq {
                        let row = b * sq + q0 + i;
                        if let Some(p) = out {
                            for t in 0..d {
                                acc[i * d + t].div(l[i]).write(dtype, p as *mut u8, row * d + t);
                            }
                        }
                        if let Some(p) = lse {
                            m[i].add(l[i].ln()).write(stats, p as *mut u8, row);
                        }
                    }
                }
                Ok(())
            })
        }
        AttentionPass::GradQ { grads, dq } => {
            let dq = out_ptr(*dq);
            let (d_out, lse, delta) =
                (Rows::new(&grads.d_out, args), Rows::new(&grads.lse, args), Rows::new(&grads.delta, args));
            let tiles = sq.div_ceil(QUERY_TILE);
            in_tasks(a.problems() * tiles, |start, end| {
                let Tiles { q: mut qt, o: mut ot, lse: mut lt, delta: mut dt, k: mut kt, v: mut vt, mut s } =
                    Tiles::<R>::default();
                for task in start..end {
                    let (b, q0) = (task / tiles, (task % tiles) * QUERY_TILE);
                    let nq = QUERY_TILE.min(sq - q0);
                    q.block(batch, b, q0, nq, d, &mut qt);
                    d_out.block(batch, b, q0, nq, d, &mut ot);
                    lse.vector(batch, b, q0, nq, &mut lt);
                    delta.vector(batch, b, q0, nq, &mut dt);
                    let mut acc = vec![R::default(); nq * d];
                    let last_key = if a.causal { (q0 + nq).min(sk) } else { sk };
                    for k0 in (0..last_key).step_by(KEY_TILE) {
                        let nk = KEY_TILE.min(last_key - k0);
                        k.block(batch, b, k0, nk, d, &mut kt);
                        v.block(batch, b, k0, nk, d, &mut vt);
                        scores(&qt, &kt, d, scale, q0, k0, a.causal, &mut s);
                        for i in 0..nq {
                            let oi = &ot[i * d..(i + 1) * d];
                            for j in 0..nk {
                                let x = s[i * nk + j];
                                if x == neg_inf {
                                    continue;
                                }
                                let p = x.sub(lt[i]).exp();
                                let vj = &vt[j * d..(j + 1) * d];
                                let dp = dot(oi, vj);
                                let ds = p.mul(dp.sub(dt[i]));
                                let kj = &kt[j * d..(j + 1) * d];
                                acc[i * d..(i + 1) * d].iter_mut().zip(kj).for_each(|(o, &y)| *o = o.add(ds.mul(y)));
                            }
                        }
                    }
                    for i in 0..nq {
                        for t in 0..d {
                            acc[i * d + t].mul(scale).write(dtype, dq as *mut u8, (b * sq + q0 + i) * d + t);
                        }
                    }
                }
                Ok(())
            })
        }
        AttentionPass::GradKv { grads, dk, dv } => {
            let (dk, dv) = (dk.map(out_ptr), dv.map(out_ptr));
            let (d_out, lse, delta) =
                (Rows::new(&grads.d_out, args), Rows::new(&grads.lse, args), Rows::new(&grads.delta, args));
            let tiles = sk.div_ceil(KEY_TILE);
            in_tasks(a.problems() * tiles, |start, end| {
                let Tiles { q: mut qt, o: mut ot, lse: mut lt, delta: mut dt, k: mut kt, v: mut vt, mut s } =
                    Tiles::<R>::default();
                for task in start..end {
                    let (b, k0) = (task / tiles, (task % tiles) * KEY_TILE);
                    let nk = KEY_TILE.min(sk - k0);
                    k.block(batch, b, k0, nk, d, &mut kt);
                    v.block(batch, b, k0, nk, d, &mut vt);
                    let (mut dk_acc, mut dv_acc) = (vec![R::default(); nk * d], vec![R::default(); nk * d]);
                    // Causal: queries before the tile's first key see none of it.
                    let first_query = if a.causal { k0.min(sq) } else { 0 };
                    let first_tile = first_query / QUERY_TILE * QUERY_TILE;
                    for q0 in (first_tile..sq).step_by(QUERY_TILE) {
                        let nq = QUERY_TILE.min(sq - q0);
                        q.block(batch, b, q0, nq, d, &mut qt);
                        d_out.block(batch, b, q0, nq, d, &mut ot);
                        lse.vector(batch, b, q0, nq, &mut lt);
                        delta.vector(batch, b, q0, nq, &mut dt);
                        scores(&qt, &kt, d, scale, q0, k0, a.causal, &mut s);
                        for i in 0..nq {
                            let (qi, oi) = (&qt[i * d..(i + 1) * d], &ot[i * d..(i + 1) * d]);
                            for j in 0..nk {
                                let x = s[i * nk + j];
                                if x == neg_inf {
                                    continue;
                                }
                                let p = x.sub(lt[i]).exp();
                                let vj = &vt[j * d..(j + 1) * d];
                                dv_acc[j * d..(j + 1) * d].iter_mut().zip(oi).for_each(|(o, &y)| *o = o.add(p.mul(y)));
                                let dp = dot(oi, vj);
                                let ds = p.mul(dp.sub(dt[i]));
                                dk_acc[j * d..(j + 1) * d].iter_mut().zip(qi).for_each(|(o, &y)| *o = o.add(ds.mul(y)));
                            }
                        }
                    }
                    for j in 0..nk {
                        for t in 0..d {
                            let at = (b * sk + k0 + j) * d + t;
                            if let Some(p) = dk {
                                dk_acc[j * d + t].mul(scale).write(dtype, p as *mut u8, at);
                            }
                            if let Some(p) = dv {
                                dv_acc[j * d + t].write(dtype, p as *mut u8, at);
                            }
                        }
                    }
                }
                Ok(())
            })
        }
    }
}
