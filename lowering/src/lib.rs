//! # braid-lowering: from segments to kernels
//!
//! Turns each segment chosen by fusion into a [`Kernel`] of the target-independent kernel IR
//! ([`kernel`]): strided loads, an expression DAG whose primitives come from the op table,
//! stores, reductions and matrix products. Every backend consumes this IR: the CPU device
//! interprets it; CUDA C and WGSL printers (their own issues) print it. Lowering never touches
//! buffers, streams or devices.

pub mod kernel;
pub mod lower;

pub use kernel::{Arg, Body, Kernel, Load, MapLoop, MatmulKernel, MatmulOperand, RowKernel, Store, View};
pub use lower::Lowering;
