//! # The CUDA pieces of the device runtime (cudarc 0.19, libraries loaded at run time)
//!
//! What a CUDA queue needs, as plain functions over raw handles, so that the backend-neutral
//! runtime (one host thread walking a schedule, one queue per braid stream) can drive them:
//!
//! - [`context`]: whether the driver, NVRTC and cuBLAS libraries exist ([`available`]), a GPU's
//!   primary context ([`Gpu`]), non-blocking streams ([`Stream`]) and raw events ([`Event`]).
//! - [`memory`]: device and pinned host chunks for braid's pools, stream-ordered copies and
//!   fills over raw addresses.
//! - [`compile`] (with [`nvrtc`] and [`disk_cache`]): printed CUDA C compiled for the GPU's
//!   architecture, cached in memory by source and on disk (rkyv).
//! - [`launch`]: a compiled [`Kernel`](braid_lowering::Kernel) ([`CudaKernel`]): its printed
//!   entries launched in order, a matrix product through cuBLAS first ([`blas`], [`matmul`];
//!   cuBLASLt's algorithms as tuning variants: [`blas_lt`], `tune_products`),
//!   long lines copied as they are through the driver's 2-D copies ([`line_copies`]).
//! - [`harness`]: upload, run, download of one kernel, for tests.
//! - [`CudaBackend`] (`device`, with `queue`, `pools` and `lanes`): the device runtime the
//!   engine runs on: lanes of CUDA streams and what the host knows of their progress, memory
//!   pools whose freed slices wait for the GPU, and the runtime's flush and queues; `graph`:
//!   replayed steps recorded into CUDA graphs.
//!
//! Rules every file here keeps: nothing panics on a run-time failure (every CUDA error becomes
//! a [`DeviceError`]); no cudarc call is made before [`available`] said its library is there
//! (cudarc panics on a missing library); work goes on streams the caller chose, never on the
//! legacy default stream; cudarc's safe wrappers are used for the context only, with their
//! event tracking off, and no cudarc type owns device memory, so nothing frees or synchronises
//! behind braid's back. Memory is freed only when the caller says so. Library events go through
//! `tracing` (target `braid::cuda`); no subscriber is installed here.

pub mod blas;
pub mod blas_lt;
pub mod compile;
pub mod context;
mod device;
pub mod disk_cache;
mod graph;
pub mod harness;
mod lanes;
pub mod launch;
pub mod line_copies;
pub mod matmul;
pub mod memory;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod nvrtc;
mod pools;
mod queue;
mod row_padding;
pub mod tune;
mod tune_products;

pub use blas::{BLAS_WORKSPACE_BYTES, Blas};
pub use compile::{CompileStats, Compiler};
pub use context::{Event, Gpu, Stream, available, device_count};
pub use device::{CUDA_TARGET, CudaBackend, KernelSpan};
pub use harness::{Harness, compare_on_gpu, run_compiled_on_gpu, run_kernel_on_gpu, run_kernel_on_gpu_with};
pub use launch::{CudaKernel, LaunchOptions};
pub use pools::CudaBuffer;

/// CUDA as the engine's registry knows it: `cuda` and `cuda:N` open GPU 0 and GPU `N`.
pub fn registration() -> crate::Registration {
    crate::Registration::new("cuda", |ordinal| Ok(std::sync::Arc::new(CudaBackend::open(ordinal.unwrap_or(0))?)))
        .with_count(|| device_count().unwrap_or(0))
}

use crate::DeviceError;
use cudarc::driver::DriverError;
use cudarc::driver::sys::CUresult;

/// The tracing target of every event this module emits.
pub const TRACE_TARGET: &str = "braid::cuda";

/// A driver error as a device error: out of memory as [`DeviceError::OutOfMemory`] (with
/// `requested` bytes), everything else as a kernel error naming what failed (`what`).
pub(crate) fn driver_error(what: &str, e: DriverError, requested: u64) -> DeviceError {
    if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return DeviceError::OutOfMemory { requested, in_use: 0, reserved: 0 };
    }
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    DeviceError::Kernel(format!("{what}: {name} ({text})"))
}

/// `Result<T, DriverError>` to `Result<T, DeviceError>` with what failed.
pub(crate) trait DriverResult<T> {
    fn or_device(self, what: &str) -> Result<T, DeviceError>;
}

impl<T> DriverResult<T> for Result<T, DriverError> {
    fn or_device(self, what: &str) -> Result<T, DeviceError> {
        self.map_err(|e| driver_error(what, e, 0))
    }
}
