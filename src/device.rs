//! Devices as users see them: a cheap shared handle over a runtime from `braid-devices`, with
//! its random-number state and the schedule of its latest flush.

use crate::backends::DeviceName;
use crate::engine::Engine;
use crate::engine::dump::ScheduleDump;
use crate::error::{Error, Result};
use crate::lock;
use crate::stream::Stream;
use braid_devices::Backend;
use braid_graph::{DeviceId, StreamId, Target, rng};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

pub use braid_devices::CompileMode;
pub use braid_devices::MemoryStats;

/// A device that tensors live on and work runs on. Cheap to clone; clones are the same device.
#[derive(Clone)]
pub struct Device(pub(crate) Arc<DeviceInner>);

// Handles may cross `catch_unwind` as they are: a caught panic leaves the engine usable (misuse
// panics before anything is recorded, and the engine's locks recover from poisoning), as the
// API promises. The same holds for `Tensor`, `Stream` and `Event`.
impl std::panic::UnwindSafe for Device {}
impl std::panic::RefUnwindSafe for Device {}

pub(crate) struct DeviceInner {
    /// The device's engine: its recorded graph, flushes and runtime.
    pub(crate) engine: Arc<Engine>,
    rng: Mutex<RngState>,
    next_stream: AtomicU32,
    /// The stream collectives run on, made at the first one.
    comm_stream: std::sync::OnceLock<StreamId>,
}

struct RngState {
    seed: u64,
    calls: u64,
}

/// The CPU device of `Device::cpu()`, opened through the registry like every other device.
static CPU: LazyLock<Device> = LazyLock::new(|| {
    let name = DeviceName { backend: "cpu".into(), ordinal: None };
    Device::register(name.open().unwrap_or_else(|e| panic!("the CPU backend is always registered: {e}")))
});

impl Device {
    /// A device over `backend` (test backends come in through `braid::testing`).
    pub(crate) fn with_backend(backend: Arc<dyn Backend>) -> Device {
        Device::register(backend)
    }

    fn register(backend: Arc<dyn Backend>) -> Device {
        Device(Arc::new(DeviceInner {
            engine: Engine::create(backend),
            rng: Mutex::new(RngState { seed: 0, calls: 0 }),
            next_stream: AtomicU32::new(1),
            comm_stream: std::sync::OnceLock::new(),
        }))
    }

    /// The engine of this device.
    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.0.engine
    }

    pub(crate) fn id(&self) -> DeviceId {
        self.0.engine.id
    }

    /// The CPU: always available, and the same device on every call.
    pub fn cpu() -> Device {
        CPU.clone()
    }

    /// A new, independent CPU device: its own engine, memory pool, statistics and random state,
    /// named `cpu:1`, `cpu:2`, ... in messages and dumps.
    /// Tensors move between CPU devices with `to_device`; operands of one op must share a
    /// device. Useful to isolate memory accounting (a data loader, a test).
    pub fn new_cpu() -> Device {
        static COUNT: AtomicU32 = AtomicU32::new(1);
        let ordinal = Some(COUNT.fetch_add(1, Ordering::Relaxed) as usize);
        let name = DeviceName { backend: "cpu".into(), ordinal };
        Device::register(name.open().unwrap_or_else(|e| panic!("the CPU backend is always registered: {e}")))
    }

    /// CUDA GPU `ordinal`: the same device on every call for that ordinal. An `Err` (never a
    /// panic) when this build has no CUDA backend, the CUDA libraries are missing, or there is
    /// no such GPU; the message says what was looked for.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        shared(DeviceName { backend: "cuda".into(), ordinal: Some(ordinal) })
    }

    /// A new, independent device on CUDA GPU `ordinal`: its own engine, memory pools and
    /// statistics (like [`Device::new_cpu`]).
    pub fn new_cuda(ordinal: usize) -> Result<Device> {
        Device::new(&format!("cuda:{ordinal}"))
    }

    /// The first wgpu adapter (Vulkan, Metal, DX12; lavapipe in CI): the same device on every
    /// call. An `Err` naming what was tried when there is none.
    pub fn wgpu() -> Result<Device> {
        shared(DeviceName { backend: "wgpu".into(), ordinal: None })
    }

    /// A new, independent device on the first wgpu adapter.
    pub fn new_wgpu() -> Result<Device> {
        Device::new("wgpu")
    }

    /// A new, independent device of a registered backend (see [`crate::backends`]), named as
    /// `BRAID_DEVICE` names one: `cpu`, `cuda`, `cuda:1`, `wgpu`, or a backend the program
    /// registered. An `Err` when no backend has that name, or the device is unavailable.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let dev = Device::new("cpu:7").unwrap();
    /// assert_eq!(dev.name(), "cpu:7");
    /// assert!(Device::new("abacus").is_err());
    /// ```
    pub fn new(name: &str) -> Result<Device> {
        let parsed = DeviceName::parse(name).map_err(Error::Unavailable)?;
        Ok(Device::register(parsed.open()?))
    }

    /// How many devices of the registered backend `name` this machine has (`cpu`: 1; 0 for
    /// a backend this build lacks, a missing library, or a name nobody registered).
    ///
    /// ```
    /// use braid::prelude::*;
    /// assert_eq!(Device::count("cpu"), 1);
    /// println!("{} CUDA GPUs", Device::count("cuda"));
    /// ```
    pub fn count(name: &str) -> usize {
        crate::backends::get(name).map_or(0, |r| r.count())
    }

    /// The device named by `BRAID_DEVICE` (`cpu`, `cuda`, `cuda:N`, `wgpu`, or the name of a
    /// registered backend, see [`crate::backends`]); `cpu` when unset.
    pub fn from_env() -> Result<Device> {
        shared(name_from_env()?)
    }

    /// A new, independent device of the kind `BRAID_DEVICE` names (`cpu` when unset): what test
    /// suites run on, so that one suite runs on every device.
    pub fn new_from_env() -> Result<Device> {
        let name = name_from_env()?;
        match (name.backend.as_str(), name.ordinal) {
            // Numbered, so that messages tell the suite's devices apart.
            ("cpu", None) => Ok(Device::new_cpu()),
            _ => Ok(Device::register(name.open()?)),
        }
    }

    /// The device's name (`cpu`, ...).
    pub fn name(&self) -> String {
        self.0.engine.name()
    }

    /// Seeds `rand`/`randn` on this device: the same seed and the same sequence of calls give
    /// the same numbers. The initial seed is 0.
    pub fn seed(&self, seed: u64) {
        *lock(&self.0.rng) = RngState { seed, calls: 0 };
    }

    /// The seed for the next random tensor (one per call, so results do not depend on how
    /// the work is split).
    pub(crate) fn next_seed(&self) -> u64 {
        let mut st = lock(&self.0.rng);
        st.calls += 1;
        rng::bits(st.seed, st.calls)
    }

    /// Flushes everything recorded for this device and waits for it (on a GPU: until the GPU
    /// has run it).
    pub fn sync(&self) -> Result<()> {
        let engine = &self.0.engine;
        engine.flush_all()?;
        engine.backend.synchronize().map_err(|e| engine.device_error(e))
    }

    /// Memory of this device's pool: bytes in live buffers, the peak since the last reset, and
    /// bytes reserved from the system.
    pub fn memory(&self) -> MemoryStats {
        self.0.engine.backend.memory()
    }

    /// The part of `memory().in_use` that holds parameters (tensors marked with
    /// `requires_grad` and the versions optimizers write), which live in exact-size memory.
    pub fn persistent_memory(&self) -> u64 {
        self.0.engine.backend.persistent_memory()
    }

    pub fn reset_peak(&self) {
        self.0.engine.backend.reset_peak()
    }

    /// Kernels this device has run since the program started (each fused segment counts once).
    pub fn kernels_launched(&self) -> u64 {
        self.0.engine.backend.kernels_launched()
    }

    /// Sets when this device compiles kernels to machine code; `BRAID_CPU_COMPILE` sets it
    /// when the device is created (`background` by default). The CPU device compiles kernels of
    /// fused elementwise work producing at least 65,536 elements and reductions over at least
    /// 65,536 positions (smaller ones once they have run 64 times, as a replayed
    /// [`Step`](crate::Step)'s do; never kernels of more than 1,024 expression nodes) with the system's C compiler
    /// (`cc`, or `BRAID_CC`), keeping the libraries in a disk cache (`BRAID_KERNEL_CACHE`, else
    /// `~/.cache/braid/kernels`); without a compiler, every kernel is interpreted. Compiled or
    /// interpreted, a kernel computes the same bits (but for the payload of a NaN), so the mode
    /// changes speed, never results.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let dev = Device::new_cpu();
    /// // Wait for the compiler before a kernel's first run (for benchmarks).
    /// dev.set_compile_mode(CompileMode::Blocking);
    /// let x = Tensor::randn([1 << 16], DType::F32, &dev);
    /// let y = (x.exp() * 2.0).to_vec::<f32>().unwrap();
    /// assert_eq!(y.len(), 1 << 16);
    /// // 1 when a C compiler was found, 0 when the kernel was interpreted.
    /// assert!(dev.compiled_kernels_launched() <= 1);
    /// ```
    pub fn set_compile_mode(&self, mode: CompileMode) {
        self.0.engine.backend.set_compile_mode(mode)
    }

    /// Kernels this device has run as compiled code (see [`Device::set_compile_mode`]).
    pub fn compiled_kernels_launched(&self) -> u64 {
        self.0.engine.backend.compiled_kernels_launched()
    }

    /// Keeps a [`Profile`](crate::profile::Profile) of every flush on this device (off by
    /// default; `BRAID_TRACE` also profiles). The cost is two clock reads per step.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let dev = Device::new_cpu();
    /// dev.set_profiling(true);
    /// let x = Tensor::randn([256, 256], DType::F32, &dev);
    /// x.matmul(&x).tanh().sum().item::<f32>().unwrap();
    /// let p = dev.last_profile().unwrap();
    /// assert_eq!(p.kernels().count(), dev.last_schedule().unwrap().kernel_count());
    /// println!("{}", p.to_text());
    /// ```
    pub fn set_profiling(&self, on: bool) {
        self.0.engine.settings.profiling.store(on, Ordering::Relaxed);
    }

    /// The profile of the most recent flush on this device that was profiled.
    pub fn last_profile(&self) -> Option<crate::profile::Profile> {
        lock(&self.0.engine.last_profile).clone()
    }

    /// The schedule of the most recent flush on this device.
    pub fn last_schedule(&self) -> Option<ScheduleDump> {
        lock(&self.0.engine.last_schedule).clone()
    }

    /// The stream work goes to unless a [`Stream::scope`] says otherwise.
    pub fn default_stream(&self) -> Stream {
        Stream::new(self.clone(), StreamId(0))
    }

    /// A new, independent execution queue on this device (on the CPU: its own worker thread
    /// while a flush runs).
    pub fn new_stream(&self) -> Stream {
        Stream::new(self.clone(), StreamId(self.0.next_stream.fetch_add(1, Ordering::Relaxed)))
    }

    /// The stream this device's collectives ([`crate::dist`]) run on: one per device, made at
    /// its first use, so communication overlaps the compute of the other streams. Work that
    /// reads a collective's result waits for it through an event, like any cross-stream read.
    pub fn comm_stream(&self) -> Stream {
        let id = *self.0.comm_stream.get_or_init(|| self.new_stream().id);
        Stream::new(self.clone(), id)
    }

    /// Spreads independent branches of default-stream work over `n` streams (the default
    /// stream and `n - 1` new ones); `n <= 1` turns it off (the default). Results do not change;
    /// only how work overlaps.
    pub fn set_auto_streams(&self, n: usize) {
        let mut streams = lock(&self.0.engine.settings.auto_streams);
        streams.clear();
        if n > 1 {
            streams.push(StreamId(0));
            streams.extend((1..n).map(|_| self.new_stream().id));
        }
    }

    /// Poison mode for this device: freed buffers are filled with NaN / 0xFF bytes before the
    /// pool reuses them, so a use after free shows up as a wrong result. Overrides
    /// `BRAID_POISON=1` (which is read at every flush when this is not called).
    pub fn set_poison(&self, on: bool) {
        *lock(&self.0.engine.settings.poison) = Some(on);
    }

    /// Whether flushes starting now poison freed buffers.
    pub fn poison_enabled(&self) -> bool {
        self.0.engine.poison_enabled()
    }

    /// Turns fusion on or off for this device (overrides `BRAID_FUSION`, which is read at every
    /// flush when this is not called). Off, every op is its own kernel; results do not change.
    pub fn set_fusion(&self, on: bool) {
        *lock(&self.0.engine.settings.fusion) = Some(on);
    }

    /// Whether flushes starting now fuse (`BRAID_FUSION=0` turns fusion off by default).
    pub fn fusion_enabled(&self) -> bool {
        self.0.engine.fusion_enabled()
    }

    /// Turns recomputation of saved values on or off for this device (overrides
    /// `BRAID_RECOMPUTE`, which is read at every flush when this is not called; on by default).
    /// On, a flush that reads a forward pass before its backward pass is recorded (an eager
    /// training step's loss read) leaves a value autograd saved uncomputed when it is a cheap
    /// elementwise function of values that cost fewer bytes to keep, and the backward pass
    /// computes it again inside its own kernels: a language model's cross-entropy then keeps
    /// its bf16 logits instead of `exp(logits - max)` in f32 and a one-hot mask. Results do not
    /// change; only what is kept between flushes and what is computed twice. Never on a device
    /// whose math is not the op table's (wgpu: its compilers may fold arithmetic on values a
    /// kernel does not store, so what is stored could change a NaN).
    ///
    /// ```
    /// use braid::prelude::*;
    /// let dev = Device::new_cpu();
    /// dev.set_recompute(false);
    /// assert!(!dev.recompute_enabled());
    /// ```
    pub fn set_recompute(&self, on: bool) {
        *lock(&self.0.engine.settings.recompute) = Some(on);
    }

    /// Whether flushes starting now recompute saved values (`BRAID_RECOMPUTE=0` turns it off
    /// by default; it also needs fusion).
    pub fn recompute_enabled(&self) -> bool {
        self.0.engine.recompute_enabled()
    }

    /// Caps the device memory a flush may plan for: when the planned peak (the flush's inputs
    /// plus everything it allocates) would exceed `bytes`, the scheduler moves values that sit
    /// idle at the peak to host memory on an offload stream and brings them back before their
    /// next use, with events at both ends (shown in dumps as copy steps and `offloads`). A
    /// budget below what that can reach makes the read that needed the flush return
    /// `Error::MemoryBudget` naming the lowest reachable peak. `None` removes the cap.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let dev = Device::new_cpu();
    /// dev.set_memory_budget(Some(1 << 30));
    /// assert_eq!(dev.memory_budget(), Some(1 << 30));
    /// ```
    pub fn set_memory_budget(&self, bytes: Option<u64>) {
        self.0.engine.settings.budget.store(bytes.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    pub fn memory_budget(&self) -> Option<u64> {
        self.0.engine.memory_budget()
    }

    /// How many flushes reused a cached plan, and how many were planned anew.
    pub fn plan_cache_stats(&self) -> (u64, u64) {
        let c = lock(&self.0.engine.plans);
        (c.hits, c.misses)
    }

    /// What this device is like, as fusion, scheduling and lowering see it (kernel limits,
    /// cost model, memory, element types).
    pub fn target(&self) -> &Target {
        self.0.engine.backend.target()
    }

    /// Returns cached free memory to the system (the pool keeps freed chunks for reuse: the
    /// CPU up to a cap, CUDA all of them until this call or until an allocation finds no room,
    /// since giving a chunk back waits for the whole GPU).
    pub fn trim_memory(&self) {
        self.0.engine.backend.trim()
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Device) -> bool {
        self.id() == other.id()
    }
}
impl Eq for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.name())
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// Every device's recorded graph (pending and materialised nodes that are still alive) as
/// Graphviz DOT, one after another.
pub(crate) fn recorded_graph_dot() -> String {
    crate::engine::engines().iter().map(|e| e.recorded_graph_dot()).collect::<Vec<_>>().join("\n")
}

/// The device `BRAID_DEVICE` names (`cpu` when unset).
fn name_from_env() -> Result<DeviceName> {
    let value = std::env::var("BRAID_DEVICE").unwrap_or_default();
    if value.trim().is_empty() {
        return Ok(DeviceName { backend: "cpu".into(), ordinal: None });
    }
    DeviceName::parse(&value).map_err(|reason| Error::Environment { name: "BRAID_DEVICE", value, reason })
}

/// The shared device of each name, created on first use (a failure is not kept: a later call
/// tries again). `name` and `name:0` are one device, but for the CPU, whose bare `cpu` is
/// [`Device::cpu`].
fn shared(name: DeviceName) -> Result<Device> {
    static SHARED: Mutex<Vec<(DeviceName, Device)>> = Mutex::new(Vec::new());
    if name.backend == "cpu" && name.ordinal.is_none() {
        return Ok(Device::cpu());
    }
    let key = DeviceName { ordinal: Some(name.ordinal.unwrap_or(0)), ..name.clone() };
    let mut devices = lock(&SHARED);
    if let Some((_, d)) = devices.iter().find(|(k, _)| *k == key) {
        return Ok(d.clone());
    }
    let device = Device::register(name.open()?);
    devices.push((key, device.clone()));
    Ok(device)
}
