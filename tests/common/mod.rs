//! Shared test support: a random generator, typed data helpers, the mapping from IR ops to the
//! public API, and a harness that records a program through braid and through the reference
//! interpreter at once, then compares every value read.
#![allow(dead_code)]

pub mod program;
pub mod recording;

use braid::prelude::*;
use braid_graph::reference::{CheckStats, ProgNode, RefValue};
use braid_graph::{Op, ReduceOp};
use half::{bf16, f16};

/// `n` values uniform in `[-bound, bound)` from `seed` (random inputs for tests that only need
/// floats, never all zeros).
pub fn uniform_f32(n: usize, seed: u64, bound: f32) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.uniform(-bound as f64, bound as f64) as f32).collect()
}

/// The CUDA test harness on GPU 0, or `None` after printing why `test` is skipped (no GPU, no
/// driver or NVRTC); a GPU that is there but unusable fails the test.
pub fn cuda_harness(test: &str) -> Option<braid_devices::cuda::Harness> {
    match braid_devices::cuda::Harness::new(0, None) {
        Ok(h) => Some(h),
        Err(braid_devices::DeviceError::Unavailable(why)) => {
            eprintln!("skipped: {test}: {why}");
            None
        }
        Err(e) => panic!("{test}: the GPU is there but unusable: {e}"),
    }
}

/// A small deterministic generator (SplitMix64), so a failing case is reproducible from its
/// seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x05EE_D0FB_4A1D)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        braid_graph::rng::mix64(self.0)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next() >> 11) as f64 / (1u64 << 53) as f64)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        self.uniform(0.0, 1.0) < p
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Random values for `dtype`, already exactly representable in it (never all zeros).
/// Whether `dev` holds i64 (the indexing ops need it; wgpu has none); prints why `test` is
/// skipped when not.
pub fn skip_without_i64(dev: &Device, test: &str) -> bool {
    let lacks = !dev.target().dtypes.contains(DType::I64);
    if lacks {
        eprintln!("skipped: {test}: {} has no i64, which the indexing ops need", dev.name());
    }
    lacks
}

pub fn random_values(rng: &mut Rng, dtype: DType, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| match dtype {
            DType::Bool => rng.below(2) as f64,
            DType::U8 => rng.below(60) as f64,
            DType::I32 | DType::I64 => rng.below(101) as f64 - 50.0,
            _ => dtype.round_f64(rng.uniform(-3.0, 3.0)),
        })
        .collect()
}

/// A tensor holding `values` (exact in `dtype`).
pub fn tensor_from_f64(values: &[f64], shape: &Shape, dtype: DType, dev: &Device) -> Tensor {
    fn typed<T: Element>(values: &[f64], shape: &Shape, dev: &Device) -> Tensor {
        Tensor::from_vec(values.iter().map(|&v| T::from_f64(v)).collect::<Vec<T>>(), shape.clone(), dev)
    }
    match dtype {
        DType::F32 => typed::<f32>(values, shape, dev),
        DType::F64 => typed::<f64>(values, shape, dev),
        DType::F16 => typed::<f16>(values, shape, dev),
        DType::BF16 => typed::<bf16>(values, shape, dev),
        DType::I32 => typed::<i32>(values, shape, dev),
        DType::I64 => typed::<i64>(values, shape, dev),
        DType::U8 => typed::<u8>(values, shape, dev),
        DType::Bool => typed::<bool>(values, shape, dev),
    }
}

/// What a device returned for a read.
#[derive(Clone, Debug)]
pub enum Actual {
    Float(Vec<f64>),
    Int(Vec<i64>),
}

/// Reads a tensor of any dtype.
pub fn read(t: &Tensor) -> Result<Actual> {
    fn f<T: Element>(t: &Tensor) -> Result<Actual> {
        Ok(Actual::Float(t.to_vec::<T>()?.into_iter().map(Element::to_f64).collect()))
    }
    Ok(match t.dtype() {
        DType::F32 => f::<f32>(t)?,
        DType::F64 => f::<f64>(t)?,
        DType::F16 => f::<f16>(t)?,
        DType::BF16 => f::<bf16>(t)?,
        DType::I32 => Actual::Int(t.to_vec::<i32>()?.into_iter().map(i64::from).collect()),
        DType::I64 => Actual::Int(t.to_vec::<i64>()?),
        DType::U8 => Actual::Int(t.to_vec::<u8>()?.into_iter().map(i64::from).collect()),
        DType::Bool => Actual::Int(t.to_vec::<bool>()?.into_iter().map(i64::from).collect()),
    })
}

/// Compares a read against the reference.
pub fn check(reference: &RefValue, actual: &Actual) -> Result<CheckStats, String> {
    match actual {
        Actual::Float(v) => reference.check(v),
        Actual::Int(v) => reference.check_i64(v),
    }
}

/// Records `op` over `inputs` through the public API (the op's shape and dtype as the program
/// states them). `variant` picks between equivalent spellings (methods, operators).
pub fn call(op: &Op, inputs: &[&Tensor], shape: &Shape, dtype: DType, dev: &Device, variant: usize) -> Tensor {
    use braid_graph::table::BinaryOp as B;
    match op {
        Op::Input | Op::Event => unreachable!("leaves are data; events carry no data"),
        Op::Collective(_) => unreachable!("random programs run on one device; tests/dist.rs checks collectives"),
        Op::Attention { causal, part: braid_graph::AttentionPart::Out } => {
            inputs[0].scaled_dot_product_attention(inputs[1], inputs[2], *causal)
        }
        Op::Attention { .. } => unreachable!("attention's other parts are recorded by its backward pass"),
        Op::Full(v) => Tensor::full(shape.clone(), v.0, dtype, dev),
        Op::Arange { start } if dtype == DType::I64 && variant.is_multiple_of(2) => {
            Tensor::arange(*start, *start + shape.numel() as i64, dev)
        }
        Op::Arange { start } => Tensor::arange_as(*start, *start + shape.numel() as i64, dtype, dev),
        Op::Rand { lo, hi, .. } => Tensor::rand(shape.clone(), lo.0, hi.0, dtype, dev),
        Op::Randn { .. } => Tensor::randn(shape.clone(), dtype, dev),
        Op::Unary(u) => inputs[0].unary(*u),
        Op::Binary(b) => {
            let (x, y) = (inputs[0], inputs[1]);
            match (b, variant % 3) {
                (B::Add, 0) => x + y,
                (B::Sub, 0) => x - y,
                (B::Mul, 0) => x * y,
                (B::Div, 0) => x / y,
                (B::Add, 1) => x.clone() + y.clone(),
                (B::Mul, 1) => x.mul(y),
                _ => x.binary(*b, y),
            }
        }
        Op::BinaryScalar { op: b, scalar, scalar_first } => {
            let (x, s) = (inputs[0], scalar.0);
            match (b, scalar_first, variant % 2) {
                (B::Add, false, 0) => x + s,
                (B::Sub, false, 0) => x - s,
                (B::Mul, false, 0) => x * s,
                (B::Div, false, 0) => x / s,
                (B::Add, true, 0) => s + x,
                (B::Sub, true, 0) => s - x,
                (B::Mul, true, 0) => s * x,
                (B::Div, true, 0) => s / x,
                (B::Pow, false, 0) => x.powf(s),
                _ => x.binary_scalar(*b, s, *scalar_first),
            }
        }
        Op::Compare(c) => inputs[0].compare(*c, inputs[1]),
        Op::Select => inputs[0].select(inputs[1], inputs[2]),
        Op::Clamp { lo, hi } => inputs[0].clamp(lo.0, hi.0),
        Op::Cast => inputs[0].to_dtype(dtype),
        Op::Reduce { op, dim, keepdim } => {
            let x = inputs[0];
            match (op, dim) {
                (ReduceOp::Sum, None) => x.sum(),
                (ReduceOp::Mean, None) => x.mean(),
                (ReduceOp::Sum, Some(d)) => x.sum_dim(*d, *keepdim),
                (ReduceOp::Mean, Some(d)) => x.mean_dim(*d, *keepdim),
                (ReduceOp::Max, Some(d)) => x.max_dim(*d, *keepdim),
                (ReduceOp::Min, Some(d)) => x.min_dim(*d, *keepdim),
                (ReduceOp::ArgMax, Some(d)) if dtype == DType::I64 && variant.is_multiple_of(2) => {
                    x.argmax_dim(*d, *keepdim)
                }
                (ReduceOp::ArgMax, Some(d)) => x.argmax_dim_as(*d, *keepdim, dtype),
                (op, None) => unreachable!("the API has no {op:?} over everything"),
            }
        }
        Op::Matmul => inputs[0].matmul(inputs[1]),
        Op::QuantMatmul(_) | Op::Quantize(_) => {
            unreachable!("random programs draw no quantized weights (tests/quant.rs checks them)")
        }
        Op::Gather { dim } => inputs[0].gather(*dim, inputs[1]),
        Op::IndexSelect { dim } if inputs[1].rank() == 1 => inputs[0].index_select(*dim, inputs[1]),
        Op::IndexSelect { dim: 0 } => inputs[1].embedding(inputs[0]),
        Op::IndexSelect { .. } => unreachable!("the API selects along other dimensions with a 1-D index only"),
        Op::ScatterAdd { dim } => inputs[0].scatter_add(*dim, inputs[1], inputs[2]),
        Op::Scatter { dim } => inputs[0].scatter(*dim, inputs[1], inputs[2]),
        Op::Reshape => inputs[0].reshape(shape.clone()),
        Op::Permute(p) => {
            let x = inputs[0];
            let swapped: Vec<usize> = (0..p.len()).filter(|&i| p[i] != i).collect();
            if variant.is_multiple_of(2) && swapped.len() == 2 && p[swapped[0]] == swapped[1] {
                if x.rank() == 2 { x.t() } else { x.transpose(swapped[0], swapped[1]) }
            } else {
                x.permute(p)
            }
        }
        Op::Expand => inputs[0].expand(shape.clone()),
        Op::Narrow { dim, start, len } => inputs[0].narrow(*dim, *start, *len),
        Op::Cat { dim } => Tensor::cat(inputs, *dim),
        Op::Contiguous => inputs[0].contiguous(),
        Op::ToDevice => inputs[0].to_device(dev),
    }
}

/// A program recorded through braid and the reference at once.
pub struct Harness {
    pub dev: Device,
    pub prog: Vec<ProgNode>,
    /// The tensor whose current version is program node `i`, if any.
    pub tensors: Vec<Option<Tensor>>,
    /// Values read from braid: (program node, what came back).
    pub reads: Vec<(usize, Actual)>,
    /// A readable listing, printed when a check fails.
    pub listing: Vec<String>,
    /// The stream new work is recorded on (`None`: the thread's current stream).
    pub stream: Option<Stream>,
}

impl Harness {
    pub fn new(dev: &Device) -> Harness {
        Harness {
            dev: dev.clone(),
            prog: Vec::new(),
            tensors: Vec::new(),
            reads: Vec::new(),
            listing: Vec::new(),
            stream: None,
        }
    }

    /// Runs `f` with the harness's stream current.
    fn on_stream<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.stream {
            Some(s) => s.scope(f),
            None => f(),
        }
    }

    /// Appends a program node (with braid's tensor for it, if any) and its listing line.
    pub fn push_node(&mut self, node: ProgNode, tensor: Option<Tensor>, line: String) -> usize {
        self.push(node, tensor, line)
    }

    fn push(&mut self, node: ProgNode, tensor: Option<Tensor>, line: String) -> usize {
        let on = self.stream.as_ref().map_or(String::new(), |s| format!(" @s{}", s.id()));
        self.listing.push(format!("%{} = {line}{on}", self.prog.len()));
        self.prog.push(node);
        self.tensors.push(tensor);
        self.prog.len() - 1
    }

    pub fn meta(&self, i: usize) -> (DType, Shape) {
        match &self.prog[i] {
            ProgNode::Data { dtype, shape, .. } | ProgNode::IntData { dtype, shape, .. } => (*dtype, shape.clone()),
            ProgNode::Op { dtype, shape, .. } | ProgNode::Indexing { dtype, shape, .. } => (*dtype, shape.clone()),
        }
    }

    /// A leaf with the given values.
    pub fn data(&mut self, dtype: DType, shape: Shape, values: Vec<f64>) -> usize {
        let t = self.on_stream(|| tensor_from_f64(&values, &shape, dtype, &self.dev));
        let line = format!("data {dtype} {shape}");
        self.push(ProgNode::Data { dtype, shape, values }, Some(t), line)
    }

    /// A leaf with random values.
    pub fn random(&mut self, rng: &mut Rng, dtype: DType, shape: Shape) -> usize {
        let values = random_values(rng, dtype, shape.numel());
        self.data(dtype, shape, values)
    }

    /// Records `op` over program nodes `inputs` (validated by the caller) through the API.
    /// Random ops must be given the seed the device will use (see [`SeedMirror`]).
    pub fn op(&mut self, op: Op, dtype: DType, shape: Shape, inputs: &[usize], variant: usize) -> usize {
        let handles: Vec<Tensor> =
            inputs.iter().map(|&i| self.tensors[i].clone().expect("input is a live version")).collect();
        let refs: Vec<&Tensor> = handles.iter().collect();
        let t = self.on_stream(|| call(&op, &refs, &shape, dtype, &self.dev, variant));
        assert_eq!((t.dtype(), t.shape()), (dtype, &shape), "API result of {op:?}");
        let line = format!("{op:?} {inputs:?} -> {dtype} {shape}");
        self.push(ProgNode::Op { op, dtype, shape, inputs: inputs.to_vec() }, Some(t), line)
    }

    /// An in-place update of the tensor at node `target`: `kind` is assign (`None`) or a binary
    /// op; the tensor then names the new node, which is returned.
    pub fn in_place(&mut self, target: usize, kind: Option<braid_graph::table::BinaryOp>, src: usize) -> usize {
        use braid_graph::table::BinaryOp as B;
        let t = self.tensors[target].take().expect("live target");
        let s = self.tensors[src].clone().expect("live source");
        let (dtype, shape) = self.meta(target);
        let (op, inputs) = self.on_stream(|| match kind {
            None => {
                t.assign(&s);
                (Op::Expand, vec![src])
            }
            Some(b) => {
                match b {
                    B::Add => t.add_assign(&s),
                    B::Sub => t.sub_assign(&s),
                    B::Mul => t.mul_assign(&s),
                    B::Div => t.div_assign(&s),
                    other => panic!("no in-place {other:?}"),
                }
                (Op::Binary(b), vec![target, src])
            }
        });
        let line = format!("in-place {kind:?} of %{target} with %{src}");
        self.push(ProgNode::Op { op, dtype, shape, inputs }, Some(t), line)
    }

    /// Reads node `i` now (flushing what it needs) and remembers the result.
    pub fn read(&mut self, i: usize) -> Result<()> {
        let t = self.tensors[i].as_ref().expect("live");
        let actual = read(t)?;
        self.listing.push(format!("read %{i}"));
        self.reads.push((i, actual));
        Ok(())
    }

    /// Drops braid's handle of node `i` (the reference keeps computing it).
    pub fn drop_tensor(&mut self, i: usize) {
        self.tensors[i] = None;
        self.listing.push(format!("drop %{i}"));
    }

    /// Evaluates the reference and checks every read; returns totals.
    pub fn check(&self) -> Result<CheckStats, String> {
        let reference = braid_graph::reference::evaluate_on(&self.prog, &self.dev.target().math);
        let mut total = CheckStats::default();
        for (i, actual) in &self.reads {
            let s = check(&reference[*i], actual).map_err(|e| {
                format!("read of %{i} differs from the reference:\n{e}\nprogram:\n{}", self.listing.join("\n"))
            })?;
            total.checked += s.checked;
            total.uncertain += s.uncertain;
        }
        Ok(total)
    }
}

/// Predicts the seeds `rand`/`randn` take from a device after `device.seed(s)`: call `n` gets
/// `rng::bits(s, n)`. Only valid while no other thread draws from the device.
pub struct SeedMirror {
    seed: u64,
    calls: u64,
}

impl SeedMirror {
    pub fn reseed(dev: &Device, seed: u64) -> SeedMirror {
        dev.seed(seed);
        SeedMirror { seed, calls: 0 }
    }
    pub fn next(&mut self) -> u64 {
        self.calls += 1;
        braid_graph::rng::bits(self.seed, self.calls)
    }
}

/// Converts what braid recorded (see `braid::testing::recorded_program`) into a program for the
/// reference interpreter.
pub fn reference_program(nodes: Vec<braid::testing::RecordedNode>) -> Vec<ProgNode> {
    use braid::testing::RecordedNode as R;
    fn floats<T: Element>(bytes: &[u8]) -> Vec<f64> {
        T::read_bytes(bytes).into_iter().map(Element::to_f64).collect()
    }
    fn ints<T: Element>(bytes: &[u8]) -> Vec<i64> {
        T::read_bytes(bytes).into_iter().map(|v| v.to_f64() as i64).collect()
    }
    nodes
        .into_iter()
        .map(|n| match n {
            R::Op { op, dtype, shape, inputs } => ProgNode::Op { op, dtype, shape, inputs },
            R::Data { dtype, shape, bytes } => match dtype {
                DType::F32 => ProgNode::Data { dtype, shape, values: floats::<f32>(&bytes) },
                DType::F64 => ProgNode::Data { dtype, shape, values: floats::<f64>(&bytes) },
                DType::F16 => ProgNode::Data { dtype, shape, values: floats::<f16>(&bytes) },
                DType::BF16 => ProgNode::Data { dtype, shape, values: floats::<bf16>(&bytes) },
                DType::I32 => ProgNode::IntData { dtype, shape, values: ints::<i32>(&bytes) },
                DType::I64 => ProgNode::IntData { dtype, shape, values: i64::read_bytes(&bytes) },
                DType::U8 => ProgNode::IntData { dtype, shape, values: ints::<u8>(&bytes) },
                DType::Bool => ProgNode::IntData { dtype, shape, values: ints::<bool>(&bytes) },
            },
        })
        .collect()
}

/// Evaluates what braid recorded for `targets` with the reference interpreter, then reads the
/// targets from braid and checks them against it. (Under a memory budget the flush cannot
/// meet, the budget is raised to the lowest reachable peak.)
pub fn check_recorded(targets: &[&Tensor]) -> Result<CheckStats, String> {
    let (nodes, roots) = braid::testing::recorded_program(targets).map_err(|e| e.to_string())?;
    // The bounds of the device's math library (its target's: WGSL's builtins are looser).
    let math = targets.first().map_or(braid_graph::PlatformMath::TABLE, |t| t.device().target().math);
    let reference = braid_graph::reference::evaluate_on(&reference_program(nodes), &math);
    // Everything in one flush (the last schedule then shows all of it). Under a memory budget
    // out of reach nothing runs: flush again with the lowest peak the error names.
    if let Some(dev) = targets.first().map(|t| t.device()) {
        loop {
            match dev.sync() {
                Err(Error::MemoryBudget { budget, min_peak, .. }) if min_peak > budget => {
                    dev.set_memory_budget(Some(min_peak));
                }
                r => break r.map_err(|e| e.to_string())?,
            }
        }
    }
    let mut total = CheckStats::default();
    for (t, &root) in targets.iter().zip(&roots) {
        let actual = read(t).map_err(|e| e.to_string())?;
        let s = check(&reference[root], &actual).map_err(|e| format!("target {root}: {e}"))?;
        total.checked += s.checked;
        total.uncertain += s.uncertain;
    }
    Ok(total)
}

/// The `Backend` methods a test backend over the CPU device in its field `cpu` passes straight
/// on (all but `name`, `begin` and whatever the test changes): use inside its `impl Backend`;
/// `cpu_backend_methods!(but_target)` leaves out `target` too, for a backend of another target.
#[allow(unused_macros)]
macro_rules! cpu_backend_methods {
    () => {
        fn target(&self) -> &braid_graph::Target {
            self.cpu.target()
        }
        $crate::common::cpu_backend_methods!(but_target);
    };
    (but_target) => {
        fn driver(&self) -> braid_devices::runtime::Driver {
            self.cpu.driver()
        }
        fn upload(&self, bytes: &[u8], poison: bool) -> Result<braid_devices::Buffer, braid_devices::DeviceError> {
            self.cpu.upload(bytes, poison)
        }
        fn download(&self, buffer: &braid_devices::Buffer) -> Result<Vec<u8>, braid_devices::DeviceError> {
            self.cpu.download(buffer)
        }
        fn memory(&self) -> braid_devices::MemoryStats {
            self.cpu.memory()
        }
        fn reset_peak(&self) {
            self.cpu.reset_peak()
        }
        fn kernels_launched(&self) -> u64 {
            self.cpu.kernels_launched()
        }
        fn trim(&self) {
            self.cpu.trim()
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    };
}
#[allow(unused_imports)]
pub(crate) use cpu_backend_methods;
