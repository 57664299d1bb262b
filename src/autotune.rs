//! Autotuning: kernels that can launch in several ways are timed in each on their real
//! arguments the first time they run, checked against their default's outputs, and run in the
//! fastest from then on; the choices are kept per device in the kernel cache directory, so a
//! second process on the same machine times nothing.
//!
//! What has variants: on CUDA, map loops (threads a block, blocks a multiprocessor), row
//! kernels (threads a row), large row kernels printed with other splits of their long rows
//! or columns (compiled only when timed), large map loops and row kernels printed with
//! narrower vector accesses (8 bytes a thread's access, or none, for the default's 16: the
//! same bits for map loops, another order of adds for rows; timed only when `exhaustive`,
//! each compiled first), fused attention on tensor cores printed with other
//! tilings (warps, slabs and register caps over the same tiles: the same bits; other tile
//! sizes: another order of adds; timed only when `exhaustive`, each compiled first) and large float products made in one cuBLAS call
//! (cuBLASLt's algorithms for the same call, which add in other orders); on wgpu, map kernels
//! printed with other workgroup sizes and indices a thread (the same bits, but for the sign
//! of a NaN, which a driver may set otherwise in another printing); on the CPU, the elements
//! or rows one parallel task takes (or one thread). A variant that adds in another order than
//! the default agrees with it within the tolerance of `braid_devices::runtime::tune::tolerance`
//! and is used only outside deterministic mode.
//! Deterministic mode is the default: every result keeps its bits as with tuning off, so a
//! flush under a memory budget, with fusion off or recomputing, and a replayed step give the
//! bits of the plain eager run, as braid promises; `BRAID_DETERMINISTIC=0` lets tuning choose
//! the reordering variants too (faster where they win; two plans of one program may then
//! differ in the last bits).
//!
//! Settings: `BRAID_AUTOTUNE=on|off|exhaustive` (default `on`: a short list of variants;
//! `exhaustive` times every one) and `BRAID_DETERMINISTIC=1|0` (default `1`), or [`set_mode`]
//! and [`set_deterministic`] for the rest of the process. With a `tracing` subscriber,
//! `RUST_LOG=braid::autotune=debug` logs each tuning with its times and choice; rejected
//! variants and unusable tuning files are warnings. A dump names each tuned kernel's variant
//! (`variant` in the JSON, `[variant: ...]` in the text) when it is not the default.
//!
//! ```
//! use braid::autotune;
//! use braid::prelude::*;
//!
//! // Results bit for bit as with tuning off (the default; `false` allows reordered sums):
//! autotune::set_deterministic(true);
//! let cpu = Device::cpu();
//! let x = Tensor::from_vec((0..4096).map(|i| i as f32).collect(), [64, 64], &cpu);
//! let s = x.sum_dim(1, false);
//! assert_eq!(s.to_vec::<f32>().unwrap()[0], (0..64).sum::<i32>() as f32);
//! // Tuning time so far, in this process, on every device:
//! println!("{} kernels tuned in {:.3} s ({:?})", autotune::tunings(), autotune::tuning_seconds(), autotune::mode());
//! ```

pub use braid_devices::runtime::tune::{
    Mode, deterministic, mode, set_deterministic, set_mode, tuning_seconds, tunings,
};
