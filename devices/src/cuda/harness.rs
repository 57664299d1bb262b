//! Running one kernel on a GPU from host bytes, for tests: upload every argument, launch,
//! download every argument, wait. The engine's runtime does none of this one kernel at a time;
//! tests compare what comes back with the CPU's [`crate::cpu::run_kernel`].
//!
//! Must never: be used by the engine (it synchronises after every kernel and allocates per
//! run), or leak device memory on an error path.

use super::blas::{BLAS_WORKSPACE_BYTES, Blas};
use super::compile::Compiler;
use super::context::{Gpu, Stream};
use super::disk_cache::DiskCache;
use super::launch::{CudaKernel, LaunchOptions};
use super::memory::{alloc_device_chunk, copy_device_to_host, copy_host_to_device, free_device_chunk};
use crate::DeviceError;
use braid_lowering::Kernel;
use cudarc::driver::sys::CUdeviceptr;
use std::sync::Arc;

/// A GPU, one stream with its cuBLAS handle and workspace, and a compiler.
pub struct Harness {
    pub gpu: Arc<Gpu>,
    pub stream: Stream,
    pub compiler: Compiler,
    blas: Option<Blas>,
    workspace: CUdeviceptr,
}

impl Harness {
    /// Opens GPU `ordinal` with a compiler whose disk cache is `disk` (`None`: memory only).
    pub fn new(ordinal: usize, disk: Option<DiskCache>) -> Result<Harness, DeviceError> {
        let gpu = Gpu::open(ordinal)?;
        let stream = Stream::new(&gpu)?;
        let compiler = Compiler::with_cache(&gpu, disk)?;
        let workspace = alloc_device_chunk(&gpu, BLAS_WORKSPACE_BYTES as u64)?;
        // SAFETY: the stream and the workspace live as long as the handle (dropped first).
        match unsafe { Blas::new(&gpu, stream.raw(), workspace, BLAS_WORKSPACE_BYTES, false) } {
            Ok(blas) => Ok(Harness { gpu, stream, compiler, blas: Some(blas), workspace }),
            Err(e) => {
                // SAFETY: allocated above, used by nothing.
                let _ = unsafe { free_device_chunk(&gpu, workspace) };
                Err(e)
            }
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        drop(self.blas.take());
        // SAFETY: the workspace's only user, the handle, is gone; the free waits for the GPU.
        let _ = unsafe { free_device_chunk(&self.gpu, self.workspace) };
    }
}

/// [`run_kernel_on_gpu_with`] with the printed launch shapes.
pub fn run_kernel_on_gpu(h: &Harness, kernel: &Kernel, args: &mut [Vec<u8>]) -> Result<(), DeviceError> {
    run_kernel_on_gpu_with(h, kernel, args, LaunchOptions::default())
}

/// Runs `kernel` on the harness's GPU over `args` (one byte vector per kernel argument, each at
/// least the argument's length): uploads them all, launches, and writes every argument's bytes
/// after the run back into `args`.
pub fn run_kernel_on_gpu_with(
    h: &Harness,
    kernel: &Kernel,
    args: &mut [Vec<u8>],
    options: LaunchOptions,
) -> Result<(), DeviceError> {
    let compiled = h.compiler.kernel(kernel)?;
    run_compiled_on_gpu(h, &compiled, args, options)
}

/// As [`run_kernel_on_gpu_with`], for a kernel compiled already (by any compiler of the
/// harness's GPU).
pub fn run_compiled_on_gpu(
    h: &Harness,
    compiled: &CudaKernel,
    args: &mut [Vec<u8>],
    options: LaunchOptions,
) -> Result<(), DeviceError> {
    let kernel = compiled.kernel();
    if args.len() != kernel.args.len() {
        return Err(DeviceError::Internal(format!(
            "{} buffers for a kernel of {} arguments",
            args.len(),
            kernel.args.len()
        )));
    }
    for (i, (a, bytes)) in kernel.args.iter().zip(args.iter()).enumerate() {
        if bytes.len() < a.len * a.dtype.size() {
            return Err(DeviceError::Internal(format!(
                "argument {i}: {} bytes for {} {}",
                bytes.len(),
                a.len,
                a.dtype
            )));
        }
    }
    // One chunk for every argument and the scratch memory, each part aligned to 256 bytes
    // (the arguments `options.skew` bytes past that).
    let mut offsets = vec![];
    let mut total = 0usize;
    for bytes in args.iter() {
        offsets.push(total + options.skew);
        total += (options.skew + bytes.len()).next_multiple_of(256);
    }
    compiled.prepare(&h.compiler, options)?;
    let scratch_at = total;
    total += compiled.scratch_bytes_with(options);
    let chunk = alloc_device_chunk(&h.gpu, total as u64)?;
    let stream = h.stream.raw();
    let ptrs: Vec<CUdeviceptr> = offsets.iter().map(|&o| chunk + o as u64).collect();
    let mut run = || -> Result<(), DeviceError> {
        // SAFETY: every copy stays inside the chunk (sized above) and the host vectors, which
        // outlive the stream synchronisation below; the launch reads and writes inside the
        // chunk, whose parts hold at least each argument's length and the scratch bytes.
        unsafe {
            for (bytes, &p) in args.iter().zip(&ptrs) {
                copy_host_to_device(p, bytes.as_ptr(), bytes.len(), stream)?;
            }
            compiled.launch(stream, h.blas.as_ref(), &ptrs, chunk + scratch_at as u64, options)?;
            for (bytes, &p) in args.iter_mut().zip(&ptrs) {
                copy_device_to_host(bytes.as_mut_ptr(), p, bytes.len(), stream)?;
            }
        }
        h.stream.synchronize()
    };
    let result = run();
    // SAFETY: the chunk's only users were the operations above; the free waits for the GPU.
    let freed = unsafe { free_device_chunk(&h.gpu, chunk) };
    result.and(freed)
}

/// Compares `got` with `want` (the bytes of elements of `dtype`) on the harness's GPU as the
/// tuner compares a candidate's outputs with the default's (`super::tune::compare_at`):
/// `Ok(Err(why))` when they disagree. Tests check it against the host's rules
/// (`crate::runtime::tune::agree`).
pub fn compare_on_gpu(
    h: &Harness,
    dtype: braid_graph::DType,
    want: &[u8],
    got: &[u8],
    bitwise: bool,
) -> Result<Result<(), String>, DeviceError> {
    if want.len() != got.len() || !want.len().is_multiple_of(dtype.size()) {
        return Err(DeviceError::Internal("outputs of different lengths".into()));
    }
    let module = super::tune::compare_module(&h.compiler)?;
    let n = want.len().next_multiple_of(256);
    let chunk = alloc_device_chunk(&h.gpu, (2 * n + 256) as u64)?;
    let stream = h.stream.raw();
    let run = || -> Result<Result<(), String>, DeviceError> {
        // SAFETY: both copies and the comparison stay inside the chunk (two parts of `n`
        // bytes, then the counters); the host slices outlive the synchronisation in
        // `compare_at`.
        unsafe {
            copy_host_to_device(chunk, want.as_ptr(), want.len(), stream)?;
            copy_host_to_device(chunk + n as u64, got.as_ptr(), got.len(), stream)?;
            let outputs = [(dtype, want.len() / dtype.size(), chunk + n as u64)];
            super::tune::compare_at(&module, &h.stream, &outputs, chunk, chunk + 2 * n as u64, bitwise)
        }
    };
    let result = run();
    // SAFETY: the chunk's only users were the operations above; the free waits for the GPU.
    let freed = unsafe { free_device_chunk(&h.gpu, chunk) };
    freed.and(result)
}
