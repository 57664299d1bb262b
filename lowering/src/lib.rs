//! # braid-lowering: from segments to kernels
//!
//! Turns each segment chosen by fusion into a [`Kernel`] of the target-independent kernel IR
//! ([`kernel`]): strided loads, an expression DAG whose primitives come from the op table,
//! stores, reductions and matrix products. Every backend consumes this IR: the CPU device
//! interprets it; [`cuda`] prints it as CUDA C (checked by `tests/cuda_printer.rs`, which
//! compiles the printed kernels on the host and compares them with the CPU); [`wgsl`] prints it as
//! WGSL for the wgpu device (checked on a Vulkan adapter by `tests/wgsl_kernels.rs`). Lowering never touches buffers, streams or devices.

pub mod attention;
mod cexpr;
pub mod cuda;
pub mod host_c;
pub mod kernel;
pub mod lower;
pub mod row_passes;
pub mod vmath;
pub mod wgsl;

pub use attention::{AttentionGradInputs, AttentionKernel, AttentionPass};
pub use kernel::{
    Arg, Body, GatherKernel, Kernel, Load, MapLoop, MatmulKernel, MatmulOperand, QuantMatmulKernel, QuantizeKernel,
    RowKernel, ScatterKernel, ScatterWriteKernel, Store, View, check_access, check_args,
};
pub use lower::Lowering;
