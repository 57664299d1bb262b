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

pub use runtime::buffer::{Buffer, DeviceBuffer};
pub use runtime::pool::MemoryStats;
pub use runtime::registry::Registration;
pub use runtime::{Backend, CompileMode, Driver, Input, Job};

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
