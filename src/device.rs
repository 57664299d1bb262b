//! Devices as users see them: a cheap shared handle over a runtime from `braid-devices`, with
//! its random-number state and the schedule of its latest flush.

use crate::dump::ScheduleDump;
use crate::engine;
use crate::error::{Error, Result};
use crate::stream::Stream;
use braid_devices::{Backend, cpu::CpuDevice};
use braid_graph::{DeviceId, StreamId, rng};
use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

pub use braid_devices::{CompileMode, MemoryStats};

/// A device that tensors live on and work runs on. Cheap to clone; clones are the same device.
#[derive(Clone)]
pub struct Device(pub(crate) Arc<DeviceInner>);

pub(crate) struct DeviceInner {
    pub(crate) id: DeviceId,
    pub(crate) backend: Arc<dyn Backend>,
    rng: Mutex<RngState>,
    pub(crate) last_schedule: Mutex<Option<ScheduleDump>>,
    next_stream: AtomicU32,
    /// Streams that default-stream work is spread over (`set_auto_streams`); empty when off.
    auto_streams: Mutex<Vec<StreamId>>,
    /// `set_poison`'s choice; `None` follows `BRAID_POISON`.
    poison: Mutex<Option<bool>>,
    /// `set_fusion`'s choice; `None` follows `BRAID_FUSION`.
    fusion: Mutex<Option<bool>>,
    /// `set_memory_budget`'s cap on planned device memory; `u64::MAX` when none.
    budget: AtomicU64,
    /// Plans of earlier flushes, reused for structurally identical ones.
    pub(crate) plans: Mutex<crate::engine::cache::PlanCache>,
    /// Test-only: rewrites each planned schedule (see `braid::testing`).
    pub(crate) schedule_hook: Mutex<Option<crate::testing::ScheduleHook>>,
    /// Test-only: the next flush fails at this kernel (see `braid::testing`).
    pub(crate) fail_at: Mutex<Option<u32>>,
}

struct RngState {
    seed: u64,
    calls: u64,
}

/// Every device ever created, indexed by `DeviceId` (devices live for the whole program).
static REGISTRY: Mutex<Vec<Device>> = Mutex::new(Vec::new());

static CPU: LazyLock<Device> = LazyLock::new(|| {
    crate::init_logging_from_env();
    Device::register(Arc::new(CpuDevice::new()))
});

/// Locks a mutex whose data stays consistent even if a holder panicked (braid never panics
/// while holding one in the middle of an update).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Device {
    fn register(backend: Arc<dyn Backend>) -> Device {
        let mut reg = lock(&REGISTRY);
        let device = Device(Arc::new(DeviceInner {
            id: DeviceId(reg.len() as u32),
            backend,
            rng: Mutex::new(RngState { seed: 0, calls: 0 }),
            last_schedule: Mutex::new(None),
            next_stream: AtomicU32::new(1),
            auto_streams: Mutex::new(Vec::new()),
            poison: Mutex::new(None),
            fusion: Mutex::new(None),
            budget: AtomicU64::new(u64::MAX),
            plans: Mutex::new(Default::default()),
            schedule_hook: Mutex::new(None),
            fail_at: Mutex::new(None),
        }));
        reg.push(device.clone());
        device
    }

    pub(crate) fn by_id(id: DeviceId) -> Device {
        lock(&REGISTRY)[id.0 as usize].clone()
    }

    /// The CPU: always available, and the same device on every call.
    pub fn cpu() -> Device {
        CPU.clone()
    }

    /// A new, independent CPU device: its own memory pool, statistics and random state.
    /// Tensors move between CPU devices with `to_device`; operands of one op must share a
    /// device. Useful to isolate memory accounting (a data loader, a test).
    pub fn new_cpu() -> Device {
        crate::init_logging_from_env();
        Device::register(Arc::new(CpuDevice::new()))
    }

    /// A CUDA GPU. This build of braid has no CUDA backend yet, so this is always an `Err`
    /// (never a panic).
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Err(Error::Unavailable(format!(
            "cuda:{ordinal} is unavailable: this build of braid has no CUDA backend (use Device::cpu())"
        )))
    }

    /// The first wgpu adapter. This build of braid has no wgpu backend yet, so this is always
    /// an `Err`.
    pub fn wgpu() -> Result<Device> {
        Err(Error::Unavailable(
            "wgpu is unavailable: this build of braid has no wgpu backend (use Device::cpu())".into(),
        ))
    }

    /// The device named by `BRAID_DEVICE` (`cpu`, `cuda`, `cuda:N`, `wgpu`); `cpu` when unset.
    pub fn from_env() -> Result<Device> {
        let value = std::env::var("BRAID_DEVICE").unwrap_or_default();
        let v = value.trim().to_ascii_lowercase();
        match v.as_str() {
            "" | "cpu" => Ok(Device::cpu()),
            "cuda" => Device::cuda(0),
            "wgpu" => Device::wgpu(),
            _ => match v.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Device::cuda(n),
                _ => Err(Error::Environment {
                    name: "BRAID_DEVICE",
                    value,
                    reason: "expected cpu, cuda, cuda:N or wgpu".into(),
                }),
            },
        }
    }

    /// The device's name (`cpu`, ...).
    pub fn name(&self) -> String {
        self.0.backend.name()
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

    /// Flushes everything recorded for this device and waits for it.
    pub fn sync(&self) -> Result<()> {
        engine::flush_device(Some(self.0.id))
    }

    /// Memory of this device's pool: bytes in live buffers, the peak since the last reset, and
    /// bytes reserved from the system.
    pub fn memory(&self) -> MemoryStats {
        self.0.backend.memory()
    }

    /// The part of `memory().in_use` that holds parameters (tensors marked with
    /// `requires_grad` and the versions optimizers write), which live in exact-size memory.
    pub fn persistent_memory(&self) -> u64 {
        self.0.backend.persistent_memory()
    }

    pub fn reset_peak(&self) {
        self.0.backend.reset_peak()
    }

    /// Kernels this device has run since the program started (each fused segment counts once).
    pub fn kernels_launched(&self) -> u64 {
        self.0.backend.kernels_launched()
    }

    /// Sets when this device compiles kernels to machine code; `BRAID_CPU_COMPILE` sets it
    /// when the device is created (`background` by default). The CPU device compiles kernels of
    /// fused elementwise work producing at least 65,536 elements with the system's C compiler
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
        self.0.backend.set_compile_mode(mode)
    }

    /// Kernels this device has run as compiled code (see [`Device::set_compile_mode`]).
    pub fn compiled_kernels_launched(&self) -> u64 {
        self.0.backend.compiled_kernels_launched()
    }

    /// The schedule of the most recent flush on this device.
    pub fn last_schedule(&self) -> Option<ScheduleDump> {
        lock(&self.0.last_schedule).clone()
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

    /// Spreads independent branches of default-stream work over `n` streams (the default
    /// stream and `n - 1` new ones); `n <= 1` turns it off (the default). Results do not change;
    /// only how work overlaps.
    pub fn set_auto_streams(&self, n: usize) {
        let mut streams = lock(&self.0.auto_streams);
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
        *lock(&self.0.poison) = Some(on);
    }

    /// Whether flushes starting now poison freed buffers.
    pub fn poison_enabled(&self) -> bool {
        lock(&self.0.poison).unwrap_or_else(|| std::env::var("BRAID_POISON").is_ok_and(|v| v == "1"))
    }

    /// Turns fusion on or off for this device (overrides `BRAID_FUSION`, which is read at every
    /// flush when this is not called). Off, every op is its own kernel; results do not change.
    pub fn set_fusion(&self, on: bool) {
        *lock(&self.0.fusion) = Some(on);
    }

    /// Whether flushes starting now fuse (`BRAID_FUSION=0` turns fusion off by default).
    pub fn fusion_enabled(&self) -> bool {
        lock(&self.0.fusion).unwrap_or_else(|| !std::env::var("BRAID_FUSION").is_ok_and(|v| v.trim() == "0"))
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
        self.0.budget.store(bytes.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    pub fn memory_budget(&self) -> Option<u64> {
        let b = self.0.budget.load(Ordering::Relaxed);
        (b != u64::MAX).then_some(b)
    }

    pub(crate) fn auto_stream_ids(&self) -> Vec<StreamId> {
        lock(&self.0.auto_streams).clone()
    }

    /// How many flushes reused a cached plan, and how many were planned anew.
    pub fn plan_cache_stats(&self) -> (u64, u64) {
        let c = lock(&self.0.plans);
        (c.hits, c.misses)
    }

    /// Returns cached free memory to the system (the pool keeps freed chunks for reuse).
    pub fn trim_memory(&self) {
        self.0.backend.trim()
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Device) -> bool {
        self.0.id == other.0.id
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
