//! # braid-devices: runtimes
//!
//! Each device owns its memory (a pool of buffers) and executes schedules: allocations,
//! kernels of the kernel IR, frees, and (with streams) events and copies. The CPU device is
//! here; CUDA and wgpu arrive with their own issues behind the same [`Backend`] trait. A device
//! runs what the schedule says; it never plans, fuses or reorders.

pub mod cpu;
#[cfg(feature = "wgpu")]
pub mod wgpu;

use braid_lowering::Kernel;
use braid_scheduler::{KernelId, Schedule};
use std::sync::Arc;

pub use cpu::pool::MemoryStats;

/// A run-time failure of a device. Always returned, never panicked; the device stays usable.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DeviceError {
    #[error("out of memory: requested {requested} bytes with {in_use} in use and {reserved} reserved")]
    OutOfMemory { requested: u64, in_use: u64, reserved: u64 },
    #[error("kernel failed: {0}")]
    Kernel(String),
    #[error("device unavailable: {0}")]
    Unavailable(String),
    #[error("internal error (a bug in braid): {0}")]
    Internal(String),
}

/// The message of a caught panic (for errors that report a bug instead of hanging or crashing).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// A device buffer; cloning shares it, and the memory returns to its pool with the last clone.
#[derive(Clone, Debug)]
pub enum Buffer {
    Cpu(Arc<cpu::CpuBuffer>),
}

impl Buffer {
    pub fn bytes(&self) -> usize {
        match self {
            Buffer::Cpu(b) => b.bytes(),
        }
    }

    /// Whether the buffer is parameter memory (exact-size; see `Device::persistent_memory`).
    pub fn is_persistent(&self) -> bool {
        match self {
            Buffer::Cpu(b) => b.is_exact(),
        }
    }

    /// Whether another handle to this buffer exists (a download in progress holds one).
    pub fn is_shared(&self) -> bool {
        match self {
            Buffer::Cpu(b) => Arc::strong_count(b) > 1,
        }
    }
}

/// An input of a flush as the device receives it.
pub enum Input {
    /// A value on the device.
    Buffer(Buffer),
    /// Host data (of a buffer marked `upload_at_first_use`) that the device uploads when the first
    /// step using it runs.
    Upload(Arc<[u8]>),
}

/// Everything a device needs to run one flush.
pub struct Job<'a> {
    pub schedule: &'a Schedule,
    /// `kernels[i]` is the lowered form of `schedule.kernels[i]`.
    pub kernels: &'a [Arc<Kernel>],
    /// The flush's external values, in `schedule.external_buffers` order, handed to the device:
    /// a donated one's memory returns to the pool when the schedule frees it.
    pub externals: Vec<Input>,
    /// Describes a kernel for logs and errors (called only when needed).
    pub label: &'a (dyn Fn(KernelId) -> String + Sync),
    /// Fill buffers with 0xFF bytes (NaN for floats) when they are freed (`BRAID_POISON=1`).
    pub poison: bool,
    /// Test-only: fail when this kernel is reached (as a failing kernel would), to exercise
    /// recovery from a flush that fails part-way.
    pub fail_at: Option<KernelId>,
}

/// When a device compiles kernels to machine code (today the CPU device, through the system's C
/// compiler; see `cpu::native`). Compiled or interpreted, a kernel computes the same bits (but
/// for the payload of a NaN).
/// `BRAID_CPU_COMPILE=off|background|blocking` sets it when a device is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompileMode {
    /// Never: every kernel is interpreted.
    Off,
    /// In the background (the default): a kernel's first runs are interpreted while it
    /// compiles; later runs use the compiled code once it is ready.
    Background,
    /// Before a kernel's first run, which waits for the compiler (for benchmarks and tests).
    Blocking,
}

impl CompileMode {
    /// The mode `BRAID_CPU_COMPILE` asks for (unset or unknown values give `Background`).
    pub fn from_env() -> CompileMode {
        match std::env::var("BRAID_CPU_COMPILE").map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            Ok("0" | "off" | "false") => CompileMode::Off,
            Ok("blocking") => CompileMode::Blocking,
            _ => CompileMode::Background,
        }
    }
}

/// A device runtime.
pub trait Backend: Send + Sync {
    fn name(&self) -> String;
    /// Copies host bytes into a new device buffer (poisoned when freed if `poison`).
    fn upload(&self, bytes: &[u8], poison: bool) -> Result<Buffer, DeviceError>;
    /// Copies a buffer's bytes to the host.
    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, DeviceError>;
    /// Runs a schedule to completion; returns the buffers of `schedule.outputs`, in order, and
    /// the external buffers still held at the end (by position; `None` once the schedule freed
    /// one), from which the engine gives donated values back after a failure.
    fn execute(&self, job: Job<'_>) -> (Result<Vec<Buffer>, DeviceError>, Vec<Option<Buffer>>);
    fn memory(&self) -> MemoryStats;
    fn reset_peak(&self);
    /// Kernels run since the device was created.
    fn kernels_launched(&self) -> u64;
    /// Returns cached free memory to the system.
    fn trim(&self);
    /// Bytes of device memory holding parameters (exact-size memory).
    fn persistent_memory(&self) -> u64 {
        0
    }
    /// Sets when kernels are compiled (devices that only interpret ignore it).
    fn set_compile_mode(&self, _mode: CompileMode) {}
    /// Kernels run as compiled code since the device was created.
    fn compiled_kernels_launched(&self) -> u64 {
        0
    }
    /// How fast this device computes and copies, for placing offloads.
    fn cost_model(&self) -> braid_scheduler::CostModel {
        braid_scheduler::CostModel::CPU
    }
}
