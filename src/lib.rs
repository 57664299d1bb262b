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
//! Logging: with `RUST_LOG=braid=debug` (and no subscriber installed by the program), braid
//! prints one line per executed kernel with its time and bandwidth.

pub(crate) mod autograd;
mod device;
pub mod dump;
mod engine;
mod error;
pub mod optim;
pub mod prelude;
mod step;
mod stream;
mod tensor;
#[doc(hidden)]
pub mod testing;

pub use autograd::{Grads, grad_enabled, no_grad};
pub use device::{CompileMode, Device, MemoryStats};
pub use dump::ScheduleDump;
pub use engine::{DEFAULT_MAX_PENDING, max_pending_nodes, set_max_pending_nodes};
pub use error::{Error, Result};
pub use step::Step;
pub use stream::{Event, Stream};
pub use tensor::Tensor;

pub use braid_graph::{DType, Element, Shape};

/// Flushes everything pending on every device. (On the CPU the work runs on the calling
/// thread; with several streams it will be handed to the stream workers.)
pub fn flush() -> Result<()> {
    engine::flush_device(None)
}

/// Installs a `tracing` subscriber that prints to stderr, filtered by `RUST_LOG`, if the
/// variable is set and the program has not installed a subscriber itself. Called when the first
/// device is created.
pub(crate) fn init_logging_from_env() {
    if std::env::var_os("RUST_LOG").is_some() {
        use std::io::IsTerminal;
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .try_init();
    }
}

/// The README's code blocks are compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
