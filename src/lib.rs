//! # braid: a lazy graph execution engine for tensors
//!
//! Code looks eager; every call only records a node in a dataflow graph, and values are
//! computed when they are read:
//!
//! ```
//! use braid::prelude::*;
//!
//! let cpu = Device::cpu();
//! let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.0, -4.0], [2, 2], &cpu);
//! let w = Tensor::from_vec(vec![0.5f32, 1.0, -1.0, 0.25], [2, 2], &cpu);
//! let y = x.matmul(&w).relu() + 1.0; // recorded, not computed
//! assert_eq!(y.to_vec::<f32>().unwrap(), vec![3.5, 1.5, 6.5, 3.0]); // computed now
//! ```
//!
//! Ground rules:
//! - `Tensor`, `Device` are cheap shared handles (`Clone + Send + Sync`); methods take `&self`.
//! - Misuse (shape, dtype or device mismatch, a bad dimension) panics **at the call that
//!   recorded it**, naming the operation, every operand and the caller's file and line. A
//!   caught panic leaves the engine fully usable on every thread.
//! - Run-time failures (out of memory, a failing kernel) are `Err` from the read or `sync`
//!   that needed the work; the engine stays usable.
//! - Only what a read needs runs; a tensor dropped unread is never computed; a computed value
//!   is kept while a tensor refers to it. The pending graph is bounded
//!   ([`set_max_pending_nodes`]).
//! - Integer arithmetic wraps; integer division truncates and `x / 0 == 0`; float-only ops
//!   (`exp`, `mean`, ...) reject integer tensors (convert with `to_dtype`).
//!
//! Logging: braid emits `tracing` events and never installs a subscriber; with one installed
//! by the program (as the examples and the `braid` binary do, filtered by `RUST_LOG`),
//! `RUST_LOG=braid=debug` shows one line per executed kernel with its time and bandwidth.

pub mod amp;
pub(crate) mod autograd;
pub mod autotune;
pub mod backends;
mod device;
pub mod dist;
mod engine;
mod error;
pub mod io;
pub mod nn;
pub mod optim;
pub mod prelude;
pub mod quant;
mod recorder;
mod step;
mod stream;
mod tensor;
#[doc(hidden)]
pub mod testing;

pub use autograd::{Grads, grad_enabled, no_grad};
pub use device::{CompileMode, Device, MemoryStats};
pub use engine::dump::ScheduleDump;
pub use engine::{DEFAULT_MAX_PENDING, max_pending_nodes, set_max_pending_nodes};
pub use error::{Error, Result};
pub use step::Step;
pub use stream::{Event, Stream};
pub use tensor::{Dim, Scalar, Tensor};

pub use braid_graph::{DType, Element, Shape, Target};

/// Inspecting scheduled graphs: [`ScheduleDump`] (what `device.last_schedule()` returns), dump
/// files (`BRAID_DUMP=DIR` or [`dump::set_dir`]) and the recorded graph as DOT.
pub mod dump {
    pub use crate::engine::dump::{ScheduleDump, file_stem, set_dir};
    /// An offload's `back_before` in a dump when the value stays in host memory past its flush
    /// (a later flush that reads it copies it back into device memory first).
    pub use braid_scheduler::dump::LATER_FLUSH;

    /// Every device's recorded graph (pending and materialised nodes that are still alive) as
    /// Graphviz DOT.
    pub fn recorded_graph_dot() -> String {
        crate::device::recorded_graph_dot()
    }
}

/// Where time went: per-flush profiles (`device.set_profiling(true)`, `device.last_profile()`)
/// and Chrome/Perfetto trace files (`BRAID_TRACE=file.json` or [`profile::set_trace_file`]),
/// one track per stream.
pub mod profile {
    pub use crate::engine::profile::{Profile, ProfileStep, set_trace_file};
}

/// Flushes everything pending on every device: the work is handed to the devices (the CPU runs
/// it on the calling thread and its stream workers before this returns).
pub fn flush() -> Result<()> {
    let mut first_error = None;
    for engine in engine::engines() {
        if let Err(e) = engine.flush_all() {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// Locks a mutex whose data stays consistent even if a holder panicked (braid never panics
/// while holding one in the middle of an update).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Collects into a `SmallVec` element by element: `collect` reserves for the iterator's size
/// hint first, out of line, which costs more than pushing the one to three inputs of an op
/// (a recorded op collects several such lists).
#[inline]
pub(crate) fn small<A: smallvec::Array>(items: impl IntoIterator<Item = A::Item>) -> smallvec::SmallVec<A> {
    let mut v = smallvec::SmallVec::new();
    for item in items {
        v.push(item);
    }
    v
}

/// The README's code blocks are compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
