//! Errors returned at run time (reads, syncs, device creation). Misuse at recording time is a
//! panic at the caller's line instead (see the crate docs).

use braid_devices::DeviceError;
use braid_graph::{DType, Shape};

/// A run-time failure. The engine stays usable after any of them.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// `to_vec::<T>()` / `item::<T>()` with a `T` that is not the tensor's dtype.
    #[error("dtype mismatch: the tensor holds {tensor}, but {requested} was requested (convert with to_dtype first)")]
    DTypeMismatch { tensor: DType, requested: DType },
    /// `item()` on a tensor that does not have exactly one element.
    #[error("item() needs exactly one element, but the tensor has shape {shape} ({numel} elements)")]
    NotAScalar { shape: Shape, numel: usize },
    /// A device could not do what a flush asked (out of memory, a failed kernel, ...).
    #[error("device {device}: {source}")]
    Device {
        device: String,
        #[source]
        source: DeviceError,
    },
    /// A backend that is not compiled in, or hardware that is absent.
    #[error("{0}")]
    Unavailable(String),
    /// A `BRAID_*` environment variable with a value braid does not understand.
    #[error("environment variable {name}={value:?}: {reason}")]
    Environment { name: &'static str, value: String, reason: String },
    /// A wait that can never finish, reported instead of hanging.
    #[error("deadlock avoided: {0}")]
    Deadlock(String),
    /// Something inside braid failed that should not (a bug); the engine recovered.
    #[error("internal error: {0}")]
    Internal(String),
    /// The device's memory budget (`Device::set_memory_budget`) is below what offloading can
    /// reach for this flush; nothing ran. Raise the budget (at least to `min_peak`) and read
    /// again.
    #[error(
        "memory budget of {budget} bytes cannot be met: offloading idle values gets the peak down to {min_peak} bytes at best, reached at {at}"
    )]
    MemoryBudget { budget: u64, min_peak: u64, at: String },
    /// A flush may free, or write a new version over, an input that no tensor names and nothing
    /// else reads (an old parameter version under its update); if that flush then fails, the
    /// work that needed the input cannot run again. Reads of that work report this.
    #[error("a value this read needs was lost: {0}")]
    ValueLost(String),
    /// A [`crate::Step`] could not be captured: its function does something a replay would
    /// not repeat (reads a value, reads a tensor that is not an argument, keeps a tensor it
    /// does not return, records an event). Nothing is kept; the engine stays usable.
    #[error("step capture: {0}")]
    Capture(String),
    /// Saving or loading tensors failed: the file could not be read or written, or its
    /// contents are not a valid safetensors file braid can load (the message says which).
    #[error("{0}")]
    Io(String),
    /// A read of a quantized weight's elements (`to_vec`, `item`): it holds packed bytes;
    /// `dequantize()` it first (saving it with `braid::io` is fine).
    #[error("{0}")]
    Quantized(String),
    /// The validator found a hazard in a schedule (a bug in braid); nothing ran.
    #[error("invalid schedule (a bug in braid; nothing ran): {0}")]
    InvalidSchedule(String),
}

/// `Result` with braid's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
