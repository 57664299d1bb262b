//! The wgpu device runtime: [`WgpuBackend`] implements the runtime's [`Backend`] on the first
//! wgpu adapter, driven [`Driver::Interleaved`]: one host thread issues every braid stream's
//! steps, and they all go, in that order, onto wgpu's single queue (`super::queue`).
//!
//! What a device has: the adapter's context, opened once per process and shared by every
//! wgpu device of the process (so pipelines compile once); its own memory and open command
//! encoder (`super::memory`); an issue lock, so that two threads flushing the same device take
//! turns; the kernels it has printed and compiled, by the identity of the engine's interned
//! kernels, with their launch variants (`super::tune`: map loops in other workgroup sizes,
//! timed at a kernel's first launch and kept on disk); and its [`Target`], built from the
//! adapter's real limits.
//!
//! Element types: f32, f16, bf16, i32, u8 and bool (what the WGSL printer holds: f16 and bf16
//! are packed in u32 words and converted in integer arithmetic, so they need no
//! `shader-f16`). f64 and i64 are **not emulated**: WGSL has neither, so the target leaves
//! them out and the engine refuses such a tensor at the call that records it, with a message
//! naming the dtype and wgpu (`argmax_dim`, `argmin_dim` and `arange`, which make i64, are
//! refused too, pointing to `argmax_dim_as`, `argmin_dim_as` and `arange_as`, which give i32).
//! Indices are i32 here: the gather and scatter kernels read i32 (or i64 elsewhere).
//!
//! Must never: plan, fuse or reorder anything; submit work out of the order it was issued in;
//! panic on a run-time failure (every wgpu error is an `Err`, and the device stays usable).

use super::WgpuContext;
use super::kernels::WgslKernel;
use super::memory::{WgpuMemory, lock};
use super::queue::WgpuFlush;
use super::tune::Variants;
use crate::runtime::{Backend, Driver, Flush};
use crate::{Buffer, DeviceBuffer, DeviceError, MemoryStats};
use braid_graph::{CostModel, DType, DTypes, MemoryKind, Target};
use braid_lowering::Kernel;
use braid_scheduler::Schedule;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The most nodes one wgpu kernel holds: every kernel is compiled by the driver (LLVM on
/// lavapipe), whose time grows with its size, and a long chain (a loop of 100,000 additions)
/// would otherwise become one kernel that takes minutes to compile.
const MAX_KERNEL_NODES: usize = 512;

/// Most kernels prepared per device before the table starts over (pipelines stay cached by
/// source in the context).
const MAX_PREPARED: usize = 4096;

/// Kernels ready to encode, by the address of the engine's interned kernel (held, so the
/// address is not reused while it is a key).
type Prepared = HashMap<usize, (Arc<Kernel>, PreparedKernel)>;

/// One prepared kernel: its default printing compiled, and its variants if it has any.
pub(crate) type PreparedKernel = (Arc<WgslKernel>, Option<Arc<Variants>>);

/// The runtime of one wgpu device (see the module docs).
pub struct WgpuBackend {
    pub(crate) shared: Arc<WgpuMemory>,
    target: Target,
    /// Held by a flush from `begin` to its end.
    pub(crate) issue: Mutex<()>,
    prepared: Mutex<Prepared>,
    pub(crate) launched: AtomicU64,
}

/// The context of the first adapter, opened once per process (a failure is not kept: the next
/// call tries again).
fn open_context() -> Result<Arc<WgpuContext>, DeviceError> {
    static OPEN: Mutex<Option<Arc<WgpuContext>>> = Mutex::new(None);
    let mut open = lock(&OPEN);
    if let Some(ctx) = open.as_ref()
        && ctx.check_alive().is_ok()
    {
        return Ok(ctx.clone());
    }
    let ctx = Arc::new(WgpuContext::new()?);
    tracing::debug!(target: "braid", "wgpu device on {}", ctx.describe());
    *open = Some(ctx.clone());
    Ok(ctx)
}

/// 1 when the first adapter opens (kept open for the device that follows), else 0.
pub(crate) fn adapter_count() -> usize {
    usize::from(open_context().is_ok())
}

/// The target of a wgpu adapter with `ctx`'s limits.
///
/// Kernel inputs: every input, output and scratch buffer of a kernel is a storage binding, so
/// inputs are limited to the adapter's storage buffers per stage less 8 (room for
/// the outputs of a horizontally fused kernel and a split reduction's scratch), at most 16
/// like the other devices; all its buffers (inputs, outputs and one scratch buffer) at most
/// the adapter's limit (`Features::max_storage_buffers_per_stage`: 32 on lavapipe, 28 on Metal,
/// whose 29 buffers of a stage include the kernel's uniform). Kernels hold at most [`MAX_KERNEL_NODES`] nodes. The speeds are rough estimates, not measurements: a software
/// adapter (lavapipe) is taken to be CPU-like, any other a GPU's order of magnitude; offload
/// copies to host memory wait for the device (wgpu has no host memory the device writes
/// while the host works), so they are costed as slow.
pub fn wgpu_target(ctx: &WgpuContext, align: u64) -> Target {
    let storage = ctx.features.max_storage_buffers_per_stage as usize;
    let max_kernel_inputs = storage.saturating_sub(8).clamp(1, 16);
    let dtypes: Vec<DType> =
        DType::ALL.into_iter().filter(|&d| braid_lowering::wgsl::supports(d, &ctx.features).is_ok()).collect();
    let software = ctx.info.device_type == wgpu::DeviceType::Cpu;
    let cost = if software {
        CostModel {
            copy_bytes_per_sec: 2e9,
            kernel_bytes_per_sec: 5e9,
            flops_per_sec: 20e9,
            kernel_overhead_secs: 20e-6,
            allocation_granularity: align,
        }
    } else {
        CostModel {
            copy_bytes_per_sec: 10e9,
            kernel_bytes_per_sec: 1e12,
            flops_per_sec: 10e12,
            kernel_overhead_secs: 10e-6,
            allocation_granularity: align,
        }
    };
    Target {
        name: "wgpu",
        max_kernel_inputs,
        max_row_reductions: 4,
        cost,
        work_granularity: 256,
        memory: MemoryKind::Device,
        // One queue: a copy stream would only be interleaved with the others.
        copy_stream: false,
        dtypes: DTypes::of(&dtypes),
        max_kernel_nodes: MAX_KERNEL_NODES,
        // Room for the one scratch buffer a kernel may add (`wgsl::print`'s bindings).
        max_kernel_buffers: storage.saturating_sub(1).max(2),
        // Not measured on a GPU: the row kernel reads the view as it is.
        copies_transposed_rows: false,
        math: braid_graph::PlatformMath::wgsl(!software),
        // One queue runs every stream's work in issue order.
        streams_overlap: false,
        // braid's own product kernels: no library that prefers aligned dimensions.
        product_padding: None,
    }
}

impl WgpuBackend {
    /// A new device on the first adapter of the backends `WGPU_BACKEND` names (all compiled in
    /// when unset): `Err(Unavailable)` naming the backends tried, or the limit too small.
    pub fn open() -> Result<WgpuBackend, DeviceError> {
        let ctx = open_context()?;
        let shared = WgpuMemory::new(ctx.clone());
        let target = wgpu_target(&ctx, shared.align);
        Ok(WgpuBackend {
            shared,
            target,
            issue: Mutex::new(()),
            prepared: Mutex::new(HashMap::new()),
            launched: AtomicU64::new(0),
        })
    }

    /// Whether the adapter is a software rasteriser (lavapipe), whose math builtins are the
    /// host's rather than a GPU's.
    pub fn is_software(&self) -> bool {
        self.context().info.device_type == wgpu::DeviceType::Cpu
    }

    /// The adapter's context (limits, features, pipeline cache).
    pub fn context(&self) -> &Arc<WgpuContext> {
        &self.shared.ctx
    }

    /// `kernel` printed and compiled, once per interned kernel, with its variants
    /// (`super::tune`: printed now, compiled when first run).
    pub(crate) fn prepared(&self, kernel: &Arc<Kernel>) -> Result<PreparedKernel, DeviceError> {
        let key = Arc::as_ptr(kernel) as usize;
        if let Some((_, k)) = lock(&self.prepared).get(&key) {
            return Ok(k.clone());
        }
        let compiled = self.shared.ctx.kernel(kernel)?;
        let variants = super::tune::variants(kernel, &compiled, &self.shared.ctx.features).map(Arc::new);
        let mut prepared = lock(&self.prepared);
        if prepared.len() >= MAX_PREPARED {
            prepared.clear();
        }
        prepared.insert(key, (kernel.clone(), (compiled.clone(), variants.clone())));
        Ok((compiled, variants))
    }

    /// Whether `buffer` is a buffer of this device.
    pub(crate) fn owns(&self, buffer: &Buffer) -> Option<Arc<super::WgpuBuffer>> {
        buffer.arc::<super::WgpuBuffer>().filter(|b| Arc::ptr_eq(b.shared(), &self.shared))
    }
}

impl Backend for WgpuBackend {
    fn name(&self) -> String {
        "wgpu".into()
    }

    fn target(&self) -> &Target {
        &self.target
    }

    fn driver(&self) -> Driver {
        Driver::Interleaved
    }

    fn begin<'a>(&'a self, schedule: &'a Schedule, poison: bool) -> Result<Box<dyn Flush + 'a>, DeviceError> {
        self.shared.ctx.check_alive()?;
        Ok(Box::new(WgpuFlush::begin(self, poison, schedule.memory_budget.is_some())))
    }

    fn upload(&self, bytes: &[u8], poison: bool) -> Result<Buffer, DeviceError> {
        Ok(Buffer::new(Arc::new(self.shared.upload(bytes, poison)?)))
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, DeviceError> {
        match self.owns(buffer) {
            Some(b) => {
                let mut bytes = vec![0u8; b.bytes()];
                b.read_into(&mut bytes)?;
                Ok(bytes)
            }
            None => Err(DeviceError::Internal(format!("wgpu cannot download a buffer of another device ({buffer:?})"))),
        }
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.shared.synchronize()
    }

    fn memory(&self) -> MemoryStats {
        let (in_use, peak, reserved) = self.shared.stats();
        MemoryStats { in_use, peak, reserved }
    }

    fn reset_peak(&self) {
        self.shared.reset_peak()
    }

    fn kernels_launched(&self) -> u64 {
        self.launched.load(Ordering::Relaxed)
    }

    fn trim(&self) {
        let _issue = lock(&self.issue);
        if let Err(e) = self.shared.trim() {
            tracing::warn!(target: "braid", "trimming the wgpu device: {e}");
        }
    }

    fn persistent_memory(&self) -> u64 {
        self.shared.persistent()
    }

    fn kernel_variant(&self, kernel: &Arc<Kernel>) -> Option<String> {
        let key = Arc::as_ptr(kernel) as usize;
        let variants = lock(&self.prepared).get(&key)?.1.1.clone()?;
        variants.chosen_name(&self.shared.ctx)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
