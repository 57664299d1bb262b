//! Random programs: graphs of random ops over random shapes and dtypes (broadcasting,
//! movement, reductions, matrix products), with in-place updates, reads in the middle and
//! dropped tensors, recorded through braid and the reference at once by a [`Harness`].

#[path = "program_indexing.rs"]
mod indexing;
#[path = "program_attention.rs"]
mod program_attention;

use super::{Harness, Rng, SeedMirror};
use braid::prelude::*;
use braid::{Event, Stream};
use braid_graph::reference::{CheckStats, ProgNode};
use braid_graph::table::{BinaryOp, CompareOp, UnaryOp};
use braid_graph::{Op, ReduceOp, Scalar, infer};

/// What a generated program may contain.
#[derive(Clone, Debug)]
pub struct Config {
    pub max_ops: usize,
    pub dtypes: Vec<DType>,
    pub in_place: bool,
    pub reads_in_middle: bool,
    pub drops: bool,
    pub random_sources: bool,
    /// Largest rank and dimension of generated shapes.
    pub max_rank: usize,
    pub max_dim: usize,
    /// Streams besides the default one that work is recorded on (0: default stream only).
    pub streams: usize,
    /// User events: record on one stream, wait on another, synchronize.
    pub events: bool,
    /// A random device memory budget per program and random `offload_hint`s; a read the
    /// budget cannot allow is retried with the lowest peak the error names.
    pub budgets: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            max_ops: 14,
            dtypes: DType::ALL.to_vec(),
            in_place: true,
            reads_in_middle: true,
            drops: true,
            random_sources: true,
            max_rank: 4,
            max_dim: 5,
            streams: 0,
            events: false,
            budgets: false,
        }
    }
}

struct Gen<'a> {
    rng: Rng,
    h: Harness,
    live: Vec<usize>,
    cfg: &'a Config,
    seeds: Option<SeedMirror>,
    streams: Vec<Stream>,
    events: Vec<Event>,
}

/// Generates and runs one program from `seed`; returns what was compared, or a description of
/// the first mismatch with the program listing.
pub fn run(seed: u64, dev: &Device, cfg: &Config) -> Result<CheckStats, String> {
    let seeds = cfg.random_sources.then(|| SeedMirror::reseed(dev, seed));
    let streams = std::iter::once(dev.default_stream()).chain((0..cfg.streams).map(|_| dev.new_stream())).collect();
    let mut g =
        Gen { rng: Rng::new(seed), h: Harness::new(dev), live: Vec::new(), cfg, seeds, streams, events: Vec::new() };
    let first = g.random_dtype();
    let shape = g.random_shape();
    let leaf = g.h.random(&mut g.rng, first, shape);
    g.live.push(leaf);
    let ops = 1 + g.rng.below(cfg.max_ops);
    for _ in 0..ops {
        g.step().map_err(|e| format!("read failed: {e}\nprogram:\n{}", g.h.listing.join("\n")))?;
    }
    // Read everything still alive (at least the first value), newest first so that the first
    // read flushes a large graph, in order otherwise.
    let mut to_read: Vec<usize> = g.live.clone();
    if to_read.is_empty() {
        to_read.push(leaf);
    }
    if g.rng.chance(0.7) {
        to_read.reverse();
    }
    for i in to_read {
        if g.h.tensors[i].is_some() {
            g.read(i).map_err(|e| format!("read failed: {e}\nprogram:\n{}", g.h.listing.join("\n")))?;
        }
    }
    // A replayed seed (`BRAID_PROPTEST_SEED`) shows its program, checked or not.
    if std::env::var_os("BRAID_PROPTEST_SEED").is_some() {
        println!("program:\n{}", g.h.listing.join("\n"));
    }
    g.h.check()
}

/// For `budgets` suites: reads whose flush offloaded, budgets found out of reach, reads whose
/// flush left a value in host memory for a later flush, and reads whose flush copied such a
/// value back in.
pub static BUDGET_STATS: [std::sync::atomic::AtomicUsize; 4] = [const { std::sync::atomic::AtomicUsize::new(0) }; 4];

impl Gen<'_> {
    /// A dtype the config allows and the device computes with.
    fn random_dtype(&mut self) -> DType {
        let supported = self.h.dev.target().dtypes;
        let dtypes: Vec<DType> = self.cfg.dtypes.iter().copied().filter(|&d| supported.contains(d)).collect();
        *self.rng.pick(&dtypes)
    }

    fn random_shape(&mut self) -> Shape {
        let rank = self.rng.below(self.cfg.max_rank + 1);
        let max_dim = self.cfg.max_dim;
        let dims: Vec<usize> =
            (0..rank).map(|_| if self.rng.chance(0.02) { 0 } else { 1 + self.rng.below(max_dim) }).collect();
        Shape::from(dims)
    }

    /// A shape that broadcasts with `s`: some dimensions set to 1, some leading ones dropped,
    /// sometimes a new leading dimension.
    fn partner_shape(&mut self, s: &Shape) -> Shape {
        let mut dims: Vec<usize> = s.dims().iter().map(|&d| if self.rng.chance(0.25) { 1 } else { d }).collect();
        if !dims.is_empty() && self.rng.chance(0.3) {
            let drop = self.rng.below(dims.len() + 1);
            dims.drain(..drop);
        }
        if dims.len() < 4 && self.rng.chance(0.15) {
            dims.insert(0, 1 + self.rng.below(3));
        }
        Shape::from(dims)
    }

    fn pick_live(&mut self) -> Option<usize> {
        (!self.live.is_empty()).then(|| self.live[self.rng.below(self.live.len())])
    }

    /// A live value of `dtype` whose shape broadcasts with `s`, or a new leaf.
    fn partner(&mut self, dtype: DType, s: &Shape) -> usize {
        let candidates: Vec<usize> = self
            .live
            .iter()
            .copied()
            .filter(|&i| {
                let (d, sh) = self.h.meta(i);
                d == dtype && sh.broadcast(s).is_some()
            })
            .collect();
        if !candidates.is_empty() && self.rng.chance(0.5) {
            return *self.rng.pick(&candidates);
        }
        let shape = self.partner_shape(s);
        let leaf = self.h.random(&mut self.rng, dtype, shape);
        self.live.push(leaf);
        leaf
    }

    /// Reads node `i` (counting flushes that offloaded, and budgets out of reach, in
    /// [`BUDGET_STATS`]); under a budget the flush cannot meet, raises the budget to the lowest
    /// peak the error names (the engine must stay usable) and reads again.
    fn read(&mut self, i: usize) -> Result<()> {
        self.under_budget(|g| g.h.read(i))
    }

    /// Runs `f` (a read or a synchronize). In a `budgets` suite: first sets a random budget;
    /// when the flush reports it out of reach, raises it to the lowest peak the error names
    /// (nothing ran, the engine must stay usable) and runs `f` again; after a flush, checks
    /// that its planned peak is within the budget.
    fn under_budget(&mut self, f: impl Fn(&mut Self) -> Result<()>) -> Result<()> {
        if !self.cfg.budgets {
            return f(self);
        }
        let budget = self.rng.chance(0.8).then(|| self.rng.below(6_000) as u64);
        self.h.dev.set_memory_budget(budget);
        let before = self.h.dev.last_schedule().map(|s| s.flush());
        loop {
            match f(self) {
                Err(Error::MemoryBudget { budget, min_peak, .. }) if min_peak > budget => {
                    BUDGET_STATS[1].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.h.listing.push(format!("budget {budget} B raised to {min_peak} B"));
                    self.h.dev.set_memory_budget(Some(min_peak));
                }
                r => {
                    let last = self.h.dev.last_schedule();
                    if let (Ok(()), Some(s)) = (&r, &last)
                        && Some(s.flush()) != before
                    {
                        let json = s.to_json();
                        let count = |i: usize| BUDGET_STATS[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if json.contains("\"d2h\"") {
                            count(0);
                        }
                        if json.contains(braid::dump::LATER_FLUSH) {
                            count(2);
                        }
                        let dump: serde_json::Value = serde_json::from_str(&json).expect("a dump is JSON");
                        let external_on_host = |b: &serde_json::Value| b["external"] == true && b["space"] == "host";
                        if dump["buffers"].as_array().is_some_and(|bs| bs.iter().any(external_on_host)) {
                            count(3);
                        }
                        let problems = s.dump().inconsistencies();
                        if !problems.is_empty() {
                            return Err(Error::Internal(format!("the dump contradicts itself: {problems:?}")));
                        }
                        if let Some(b) = self.h.dev.memory_budget()
                            && s.planned_peak_bytes() > b
                        {
                            return Err(Error::Internal(format!(
                                "planned peak {} over the budget {b}:\n{}",
                                s.planned_peak_bytes(),
                                s.to_text()
                            )));
                        }
                    }
                    return r;
                }
            }
        }
    }

    fn add(&mut self, op: Op, inferred: Result<(Shape, DType), String>, inputs: &[usize]) -> Option<usize> {
        let (shape, dtype) = inferred.ok()?;
        // Results the device cannot hold (i64 of arange and argmax, casts to f64 on wgpu) are
        // refused at recording; the misuse suites test that, so programs leave them out.
        if !self.h.dev.target().dtypes.contains(dtype) {
            return None;
        }
        let variant = self.rng.below(6);
        let id = self.h.op(op, dtype, shape, inputs, variant);
        if self.cfg.budgets
            && self.rng.chance(0.1)
            && let Some(t) = &self.h.tensors[id]
        {
            t.offload_hint();
        }
        self.live.push(id);
        // Often nothing else names an input any more: it becomes an intermediate whose buffer
        // the plan frees or reuses.
        if self.cfg.drops {
            for &i in inputs {
                if self.live.contains(&i) && self.rng.chance(0.4) {
                    self.h.drop_tensor(i);
                    self.live.retain(|&l| l != i);
                }
            }
        }
        Some(id)
    }

    /// Makes a float value safe for ops with a restricted domain: `|x| + 0.5`.
    fn positive(&mut self, x: usize) -> usize {
        let (dtype, shape) = self.h.meta(x);
        let a = self.h.op(Op::Unary(UnaryOp::Abs), dtype, shape.clone(), &[x], 0);
        let b = self.h.op(
            Op::BinaryScalar { op: BinaryOp::Add, scalar: Scalar(0.5), scalar_first: false },
            dtype,
            shape,
            &[a],
            self.rng.below(2),
        );
        self.h.drop_tensor(a);
        self.live.push(b);
        b
    }

    fn scalar(&mut self, dtype: DType) -> f64 {
        match dtype {
            DType::U8 => self.rng.below(6) as f64,
            DType::I32 | DType::I64 => self.rng.below(11) as f64 - 5.0,
            _ => dtype.compute().round_f64(self.rng.uniform(-3.0, 3.0)),
        }
    }

    /// Switches streams, records an event, makes a stream wait for one, synchronizes one, or
    /// reads one value on two streams and drops it (so its free must wait for both).
    fn stream_action(&mut self) -> Result<()> {
        match self.rng.below(8) {
            6 | 7 => {
                let Some(x) = self.pick_live() else { return Ok(()) };
                let (dtype, shape) = self.h.meta(x);
                let saved = self.h.stream.clone();
                if !dtype.is_numeric() {
                    return Ok(());
                }
                for _ in 0..2 {
                    self.h.stream = Some(self.rng.pick(&self.streams).clone());
                    let id = self.h.op(Op::Unary(UnaryOp::Neg), dtype, shape.clone(), &[x], 0);
                    self.live.push(id);
                }
                self.h.stream = saved;
                if self.live.contains(&x) {
                    self.h.drop_tensor(x);
                    self.live.retain(|&l| l != x);
                }
            }
            0..=2 => {
                let s = self.rng.pick(&self.streams).clone();
                self.h.listing.push(format!("switch to s{}", s.id()));
                self.h.stream = Some(s);
            }
            3 if self.cfg.events => {
                let s = self.h.stream.clone().unwrap_or_else(|| self.streams[0].clone());
                self.h.listing.push(format!("e{} = s{}.record_event()", self.events.len(), s.id()));
                self.events.push(s.record_event());
            }
            4 if self.cfg.events && !self.events.is_empty() => {
                let i = self.rng.below(self.events.len());
                let s = self.rng.pick(&self.streams).clone();
                self.h.listing.push(format!("s{}.wait_event(e{i})", s.id()));
                s.wait_event(&self.events[i]);
            }
            5 if self.cfg.events && !self.events.is_empty() => {
                let i = self.rng.below(self.events.len());
                self.h.listing.push(format!("e{i}.synchronize()"));
                let event = self.events[i].clone();
                self.under_budget(|_| event.synchronize())?;
            }
            _ => {}
        }
        Ok(())
    }

    fn step(&mut self) -> Result<()> {
        if self.streams.len() > 1 && self.rng.chance(0.35) {
            return self.stream_action();
        }
        let Some(x) = self.pick_live() else {
            let d = self.random_dtype();
            let s = self.random_shape();
            let leaf = self.h.random(&mut self.rng, d, s);
            self.live.push(leaf);
            return Ok(());
        };
        let (dtype, shape) = self.h.meta(x);
        match self.rng.below(109) {
            0..=5 => self.source(),
            6..=23 => {
                let op = *self.rng.pick(UnaryOp::ALL);
                let restricted = matches!(op, UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip);
                let x = if restricted && dtype.is_float() && self.rng.chance(0.7) { self.positive(x) } else { x };
                self.add(Op::Unary(op), infer::unary(op, &shape, dtype), &[x]);
            }
            24..=39 => {
                let op = *self.rng.pick(BinaryOp::ALL);
                let base =
                    if op == BinaryOp::Pow && dtype.is_float() && self.rng.chance(0.8) { self.positive(x) } else { x };
                let y = self.partner(dtype, &shape);
                let (a, b) = if self.rng.chance(0.5) { (base, y) } else { (y, base) };
                let r = infer::binary(op, (&self.h.meta(a).1, dtype), (&self.h.meta(b).1, dtype));
                self.add(Op::Binary(op), r, &[a, b]);
            }
            40..=47 => {
                let op = *self.rng.pick(BinaryOp::ALL);
                let s =
                    if op == BinaryOp::Pow { *self.rng.pick(&[2.0, 0.5, -1.0, 3.0, 1.5]) } else { self.scalar(dtype) };
                let x =
                    if op == BinaryOp::Pow && dtype.is_float() && self.rng.chance(0.7) { self.positive(x) } else { x };
                let first = op != BinaryOp::Pow && self.rng.chance(0.4);
                let r = infer::binary_scalar(op, &shape, dtype, s);
                self.add(Op::BinaryScalar { op, scalar: Scalar(s), scalar_first: first }, r, &[x]);
            }
            48..=53 => {
                let op = *self.rng.pick(CompareOp::ALL);
                let y = self.partner(dtype, &shape);
                let r = infer::compare(op.name(), (&shape, dtype), (&self.h.meta(y).1, dtype));
                self.add(Op::Compare(op), r, &[x, y]);
            }
            54..=57 => {
                let y = self.partner(dtype, &shape);
                let cond = self.partner(DType::Bool, &shape);
                let (cs, ys) = (self.h.meta(cond).1, self.h.meta(y).1);
                self.add(Op::Select, infer::select((&cs, DType::Bool), (&shape, dtype), (&ys, dtype)), &[cond, x, y]);
            }
            58..=60 => {
                let (a, b) = (self.scalar(dtype), self.scalar(dtype));
                let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
                self.add(Op::Clamp { lo: Scalar(lo), hi: Scalar(hi) }, infer::clamp(&shape, dtype, lo, hi), &[x]);
            }
            61..=65 => {
                let to = *self.rng.pick(&DType::ALL);
                self.add(Op::Cast, Ok((shape, to)), &[x]);
            }
            66..=75 => {
                let op =
                    *self.rng.pick(&[ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax]);
                let all = matches!(op, ReduceOp::Sum | ReduceOp::Mean) && self.rng.chance(0.3);
                let dim = if all || shape.rank() == 0 { None } else { Some(self.rng.below(shape.rank())) };
                if dim.is_none() && !all {
                    return Ok(());
                }
                let keepdim = self.rng.chance(0.5);
                let inferred = match op {
                    // Positions in i64 or i32 (`argmax_dim_as`).
                    ReduceOp::ArgMax => {
                        let index = *self.rng.pick(&[DType::I64, DType::I32]);
                        infer::argmax(&shape, dtype, dim, keepdim, index)
                    }
                    _ => infer::reduce(op, &shape, dtype, dim, keepdim && !all),
                };
                self.add(Op::Reduce { op, dim, keepdim: keepdim && !all }, inferred, &[x]);
            }
            76..=80 => self.matmul(x, dtype, &shape),
            81..=89 => self.movement(x, dtype, &shape),
            90..=93 if self.cfg.in_place => {
                let kind = *self.rng.pick(&[
                    None,
                    Some(BinaryOp::Add),
                    Some(BinaryOp::Sub),
                    Some(BinaryOp::Mul),
                    Some(BinaryOp::Div),
                ]);
                let mut s = self.partner_shape(&shape);
                if !s.broadcasts_to(&shape) {
                    s = shape.clone();
                }
                if kind.is_some() && !dtype.is_numeric() {
                    return Ok(());
                }
                let src = self.h.random(&mut self.rng, dtype, s);
                let new = self.h.in_place(x, kind, src);
                self.live.retain(|&i| i != x);
                self.live.push(new);
            }
            94..=96 if self.cfg.reads_in_middle => self.read(x)?,
            97..=99 if self.cfg.drops && self.live.len() > 1 => {
                self.h.drop_tensor(x);
                self.live.retain(|&i| i != x);
            }
            // Indices in every integer dtype the device holds (i32 and u8 on wgpu).
            100..=105 => self.indexing(x, dtype, &shape),
            106..=108 => self.attention(x, dtype, &shape),
            _ => {}
        }
        Ok(())
    }

    fn source(&mut self) {
        let dtype = self.random_dtype();
        let shape = self.random_shape();
        match self.rng.below(4) {
            0 => {
                let v = self.scalar(dtype);
                let v = if dtype == DType::Bool { (v != 0.0) as u8 as f64 } else { v };
                self.add(Op::Full(Scalar(v)), Ok((shape, dtype)), &[]);
            }
            1 => {
                let start = self.rng.below(21) as i64 - 10;
                let len = self.rng.below(8);
                // `arange` (i64) or `arange_as` another numeric dtype.
                let dtype = *self.rng.pick(&[DType::I64, DType::I64, DType::I32, DType::F32, DType::U8]);
                self.add(Op::Arange { start }, Ok((Shape::from([len]), dtype)), &[]);
            }
            r if dtype.is_float() && self.seeds.is_some() => {
                let seed = self.seeds.as_mut().expect("checked").next();
                let op = if r == 2 {
                    let lo = self.rng.uniform(-2.0, 1.0);
                    Op::Rand { lo: Scalar(lo), hi: Scalar(lo + self.rng.uniform(0.5, 3.0)), seed }
                } else {
                    Op::Randn { seed }
                };
                self.add(op, Ok((shape, dtype)), &[]);
            }
            _ => {
                let leaf = self.h.random(&mut self.rng, dtype, shape);
                self.live.push(leaf);
            }
        }
    }

    fn matmul(&mut self, x: usize, dtype: DType, shape: &Shape) {
        if shape.rank() < 2 || !dtype.is_numeric() {
            return;
        }
        let d = shape.dims();
        let k = d[d.len() - 1];
        let n = 1 + self.rng.below(5);
        let mut rhs: Vec<usize> = vec![k, n];
        // Batch dimensions: none, the same, or broadcast ones.
        let batch = &d[..d.len() - 2];
        if !batch.is_empty() && self.rng.chance(0.5) {
            let mut b: Vec<usize> = batch.iter().map(|&x| if self.rng.chance(0.3) { 1 } else { x }).collect();
            b.extend(rhs);
            rhs = b;
        }
        let y = self.h.random(&mut self.rng, dtype, Shape::from(rhs));
        self.live.push(y);
        let (a, b) = (x, y);
        let r = infer::matmul((shape, dtype), (&self.h.meta(b).1, dtype));
        if dtype == DType::F32 && self.rng.chance(0.3) {
            return self.autocast_matmul(a, b, r);
        }
        self.add(Op::Matmul, r, &[a, b]);
    }

    /// `a.matmul(b)` of f32 operands under `braid::amp::autocast` to bf16 or f16; the
    /// reference casts both operands and multiplies in the low dtype (f32 accumulation).
    fn autocast_matmul(&mut self, a: usize, b: usize, inferred: Result<(Shape, DType), String>) {
        let Ok((shape, _)) = inferred else { return };
        let low = *self.rng.pick(&[DType::BF16, DType::F16]);
        if !self.h.dev.target().dtypes.contains(low) {
            return;
        }
        let cast = |g: &mut Self, x: usize| {
            let node = ProgNode::Op { op: Op::Cast, dtype: low, shape: g.h.meta(x).1, inputs: vec![x] };
            g.reference_only(node)
        };
        let (la, lb) = (cast(self, a), cast(self, b));
        let t = self.call(&[a, b], |t| braid::amp::autocast(low, || t[0].matmul(t[1])));
        let node = ProgNode::Op { op: Op::Matmul, dtype: low, shape, inputs: vec![la, lb] };
        self.push_result(node, t, "matmul under autocast");
    }

    fn movement(&mut self, x: usize, dtype: DType, shape: &Shape) {
        let rank = shape.rank();
        match self.rng.below(6) {
            0 => {
                // Reshape into a random factorisation of the element count.
                let n = shape.numel();
                let mut dims = Vec::new();
                let mut rest = n;
                for f in [2usize, 3, 5, 7] {
                    while rest.is_multiple_of(f) && rest > 1 {
                        rest /= f;
                        if dims.is_empty() || self.rng.chance(0.5) {
                            dims.push(f);
                        } else {
                            let i = self.rng.below(dims.len());
                            dims[i] *= f;
                        }
                    }
                }
                if rest > 1 || n == 0 {
                    dims.push(rest);
                }
                if self.rng.chance(0.3) {
                    dims.insert(self.rng.below(dims.len() + 1), 1);
                }
                let to = Shape::from(dims);
                self.add(Op::Reshape, infer::reshape(shape, &to).map(|s| (s, dtype)), &[x]);
            }
            1 if rank >= 2 => {
                let mut perm: Vec<usize> = (0..rank).collect();
                for i in (1..rank).rev() {
                    perm.swap(i, self.rng.below(i + 1));
                }
                self.add(Op::Permute(perm.as_slice().into()), infer::permute(shape, &perm).map(|s| (s, dtype)), &[x]);
            }
            2 => {
                let mut dims: Vec<usize> =
                    shape.dims().iter().map(|&d| if d == 1 { 1 + self.rng.below(4) } else { d }).collect();
                if dims.len() < 4 && self.rng.chance(0.5) {
                    dims.insert(0, 1 + self.rng.below(3));
                }
                let to = Shape::from(dims);
                self.add(Op::Expand, infer::expand(shape, &to).map(|s| (s, dtype)), &[x]);
            }
            3 if rank >= 1 => {
                let dim = self.rng.below(rank);
                let size = shape.dims()[dim];
                let start = self.rng.below(size + 1);
                let len = self.rng.below(size - start + 1);
                self.add(
                    Op::Narrow { dim, start, len },
                    infer::narrow(shape, dim, start, len).map(|s| (s, dtype)),
                    &[x],
                );
            }
            4 if rank >= 1 => {
                let dim = self.rng.below(rank);
                let parts = 1 + self.rng.below(3);
                let mut inputs = vec![x];
                for _ in 0..parts {
                    let mut dims = shape.dims().to_vec();
                    dims[dim] = self.rng.below(4);
                    let leaf = self.h.random(&mut self.rng, dtype, Shape::from(dims));
                    inputs.push(leaf);
                }
                let n = inputs.len();
                inputs.swap(0, self.rng.below(n));
                let metas: Vec<(Shape, DType)> = inputs.iter().map(|&i| (self.h.meta(i).1, dtype)).collect();
                let parts: Vec<(&Shape, DType)> = metas.iter().map(|(s, d)| (s, *d)).collect();
                let r = infer::cat(&parts, dim);
                self.add(Op::Cat { dim }, r, &inputs);
            }
            _ => {
                self.add(Op::Contiguous, Ok((shape.clone(), dtype)), &[x]);
            }
        }
    }
}
