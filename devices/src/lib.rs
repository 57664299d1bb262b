//! # braid-devices: runtimes
//!
//! The device layer: a backend-neutral [`runtime`] (the walker that executes a schedule over a
//! small queue per stream, memory pools over chunk allocators, persistent stream workers) and
//! the backends that implement its traits: the CPU, CUDA (behind the `cuda` feature) and wgpu
//! (behind `wgpu`). A device runs what the schedule says; it never
//! plans, fuses or reorders.

pub mod collective;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod runtime;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use runtime::pool::MemoryStats;
pub use runtime::{Backend, Driver, Input, Job};

use braid_graph::MemoryKind;
use std::sync::Arc;

/// A run-time failure of a device. Always returned, never panicked; the device stays usable.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DeviceError {
    #[error("out of memory: requested {requested} bytes with {in_use} in use and {reserved} reserved")]
    OutOfMemory { requested: u64, in_use: u64, reserved: u64 },
    #[error("kernel failed: {0}")]
    Kernel(String),
    #[error("device unavailable: {0}")]
    Unavailable(String),
    /// A collective could not run: its group is broken (a rank failed, was too late, or the
    /// ranks disagreed on what to run), or no longer exists.
    #[error("collective failed: {0}")]
    Collective(String),
    #[error("internal error (a bug in braid): {0}")]
    Internal(String),
}

impl DeviceError {
    /// The error of kernel `label`: kernel and internal errors name it; out of memory and an
    /// unavailable device stand as they are.
    #[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
    pub(crate) fn in_kernel(self, label: &str) -> DeviceError {
        match self {
            DeviceError::Kernel(m) => DeviceError::Kernel(format!("{label}: {m}")),
            DeviceError::Internal(m) => DeviceError::Internal(format!("{label}: {m}")),
            e => e,
        }
    }
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
/// One variant per backend.
#[derive(Clone, Debug)]
pub enum Buffer {
    Cpu(Arc<cpu::CpuBuffer>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<cuda::CudaBuffer>),
    #[cfg(feature = "wgpu")]
    Wgpu(Arc<wgpu::WgpuBuffer>),
}

impl Buffer {
    pub fn bytes(&self) -> usize {
        match self {
            Buffer::Cpu(b) => b.bytes(),
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => b.bytes(),
            #[cfg(feature = "wgpu")]
            Buffer::Wgpu(b) => b.bytes(),
        }
    }

    /// Whether the buffer is parameter memory (exact-size; see `Device::persistent_memory`).
    pub fn is_persistent(&self) -> bool {
        match self {
            Buffer::Cpu(b) => b.is_exact(),
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => b.is_exact(),
            #[cfg(feature = "wgpu")]
            Buffer::Wgpu(b) => b.is_exact(),
        }
    }

    /// Whether the buffer is the device's offload (host) memory rather than its device memory:
    /// a value an offload left there past its flush.
    pub fn is_offloaded(&self) -> bool {
        match self {
            Buffer::Cpu(b) => b.is_host(),
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => b.is_pinned(),
            #[cfg(feature = "wgpu")]
            Buffer::Wgpu(b) => b.is_host(),
        }
    }

    /// Whether another handle to this buffer exists (a download in progress holds one).
    pub fn is_shared(&self) -> bool {
        match self {
            Buffer::Cpu(b) => Arc::strong_count(b) > 1,
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => Arc::strong_count(b) > 1,
            #[cfg(feature = "wgpu")]
            Buffer::Wgpu(b) => Arc::strong_count(b) > 1,
        }
    }

    /// Copies the buffer's bytes into `dst` (exactly `bytes()` long), once the work that writes
    /// them is done: how a device reads another device's value (a transfer's source).
    pub fn read_into(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        if dst.len() != self.bytes() {
            return Err(DeviceError::Internal(format!("a read of {} bytes into {}", self.bytes(), dst.len())));
        }
        match self {
            Buffer::Cpu(b) => {
                // SAFETY: the buffer holds `bytes()` initialised bytes, and the lengths match.
                unsafe { std::ptr::copy_nonoverlapping(b.ptr(), dst.as_mut_ptr(), dst.len()) };
                Ok(())
            }
            // Waits for the work writing it (everything enqueued on its GPU before the call).
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => b.read_into(dst),
            // Submits and waits for the work issued on its device before the call.
            #[cfg(feature = "wgpu")]
            Buffer::Wgpu(b) => b.read_into(dst),
        }
    }

    /// Where the buffer's memory is: whether another device's kernels can read it in place.
    pub fn memory_kind(&self) -> MemoryKind {
        match self {
            Buffer::Cpu(_) => MemoryKind::Host,
            #[cfg(feature = "cuda")]
            Buffer::Cuda(_) => MemoryKind::Device,
            #[cfg(feature = "wgpu")]
            Buffer::Wgpu(_) => MemoryKind::Device,
        }
    }
}
