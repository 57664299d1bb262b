//! Memory for braid's pools, and stream-ordered copies and fills over raw addresses.
//!
//! Chunks, not buffers: braid's pools (one per stream, over a chunk allocator) cut buffers out
//! of large chunks and decide when memory may be reused (after the events of every stream that
//! read it). So this module only takes chunks from the driver and gives them back:
//!
//! - Device chunks come from `cuMemAlloc` and go back through `cuMemFree`, not from
//!   `cuMemAllocAsync` on a driver memory pool. Braid's pool already orders reuse by the
//!   schedule's events (a free on one stream gated on the events of the others); a driver pool
//!   would be a second cache under it, with its own stream-ordered reuse rules and memory braid
//!   cannot count. With plain allocations, reserved memory is exactly the chunks braid holds
//!   (what `memory()` reports), and out of memory is known at the call, where braid can
//!   release its cached chunks and retry.
//! - Returning a chunk ([`free_device_chunk`], [`free_host_chunk`]) first waits for the whole
//!   GPU (`cuCtxSynchronize`): the pool frees chunks only when trimming or retrying after out
//!   of memory, and a chunk's last user may be queued on any stream. That is the one place
//!   where this module blocks the host.
//! - Pinned host chunks (`cuMemHostAlloc`, portable) for staging uploads and downloads and for
//!   offloaded values: copies from and to them are truly asynchronous.
//!
//! Must never: free memory the caller did not ask to free, allocate on its own behalf, or
//! touch the legacy default stream. Copies and fills are `unsafe`: the caller guarantees the
//! addresses are live for the bytes named until the stream reaches the operation.

use super::context::Gpu;
use super::{DriverResult, driver_error};
use crate::DeviceError;
use cudarc::driver::result as cu;
use cudarc::driver::sys::{self, CUdeviceptr, CUstream};

/// A device out-of-memory error for `bytes`, with what the driver reports in use on the GPU
/// (every process) and its capacity as `in_use` and `reserved`; braid's pools report their own.
fn out_of_memory(gpu: &Gpu, bytes: u64) -> DeviceError {
    let (free, total) = gpu.memory_info().unwrap_or((0, gpu.total_memory));
    DeviceError::OutOfMemory { requested: bytes, in_use: total.saturating_sub(free), reserved: total }
}

/// A new device chunk of `bytes` (at least 1), aligned to 256 bytes or more: its address.
/// `Err(OutOfMemory)` when the GPU has no room.
pub fn alloc_device_chunk(gpu: &Gpu, bytes: u64) -> Result<CUdeviceptr, DeviceError> {
    gpu.bind()?;
    let size = usize::try_from(bytes.max(1)).map_err(|_| out_of_memory(gpu, bytes))?;
    // SAFETY: a plain allocation in the current context.
    match unsafe { cu::malloc_sync(size) } {
        Ok(ptr) => Ok(ptr),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(out_of_memory(gpu, bytes)),
        Err(e) => Err(driver_error("cuMemAlloc", e, bytes)),
    }
}

/// Gives a device chunk back to the driver, after waiting for all work on the GPU.
///
/// # Safety
/// `ptr` came from [`alloc_device_chunk`] on this GPU and is not used afterwards.
pub unsafe fn free_device_chunk(gpu: &Gpu, ptr: CUdeviceptr) -> Result<(), DeviceError> {
    gpu.synchronize()?;
    // SAFETY: the caller's contract; nothing queued can still use it after the synchronize.
    gpu.quiet("returning device memory", || unsafe { cu::free_sync(ptr) }.or_device("cuMemFree"))
}

/// A new pinned (page-locked) host chunk of `bytes` (at least 1), visible to every context.
pub fn alloc_host_chunk(gpu: &Gpu, bytes: u64) -> Result<*mut u8, DeviceError> {
    gpu.bind()?;
    let size = usize::try_from(bytes.max(1)).map_err(|_| out_of_memory(gpu, bytes))?;
    // SAFETY: a plain allocation in the current context.
    match unsafe { cu::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) } {
        Ok(ptr) => Ok(ptr as *mut u8),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            Err(DeviceError::OutOfMemory { requested: bytes, in_use: 0, reserved: 0 })
        }
        Err(e) => Err(driver_error("cuMemHostAlloc", e, bytes)),
    }
}

/// Gives a pinned host chunk back, after waiting for all work on the GPU.
///
/// # Safety
/// `ptr` came from [`alloc_host_chunk`] and is not used afterwards.
pub unsafe fn free_host_chunk(gpu: &Gpu, ptr: *mut u8) -> Result<(), DeviceError> {
    gpu.synchronize()?;
    // SAFETY: the caller's contract; nothing queued can still use it after the synchronize.
    gpu.quiet("returning pinned memory", || {
        unsafe { cu::free_host(ptr as *mut std::ffi::c_void) }.or_device("cuMemFreeHost")
    })
}

/// Queues a copy of `bytes` from host memory at `src` to device address `dst` on `stream`.
/// From pinned memory the copy is asynchronous; from pageable memory the driver stages it and
/// the call returns once `src` may be reused.
///
/// # Safety
/// The GPU's context is current; `src` is readable and `dst` writable for `bytes` until the
/// stream reaches the copy; `stream` is alive.
pub unsafe fn copy_host_to_device(
    dst: CUdeviceptr,
    src: *const u8,
    bytes: usize,
    stream: CUstream,
) -> Result<(), DeviceError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const std::ffi::c_void, bytes, stream) }
        .result()
        .or_device("cuMemcpyHtoDAsync")
}

/// Queues a copy of `bytes` from device address `src` to host memory at `dst` on `stream`.
/// The host may read `dst` only after the stream (or an event recorded after the copy) is
/// synchronised.
///
/// # Safety
/// As [`copy_host_to_device`], with `dst` writable host memory.
pub unsafe fn copy_device_to_host(
    dst: *mut u8,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> Result<(), DeviceError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut std::ffi::c_void, src, bytes, stream) }
        .result()
        .or_device("cuMemcpyDtoHAsync")
}

/// Queues a device-to-device copy of `bytes` on `stream`.
///
/// # Safety
/// As [`copy_host_to_device`], both addresses on the device, the ranges not overlapping.
pub unsafe fn copy_device_to_device(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> Result<(), DeviceError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { cu::memcpy_dtod_async(dst, src, bytes, stream) }.or_device("cuMemcpyDtoDAsync")
}

/// Queues filling `bytes` at device address `dst` with `byte` on `stream` (poison mode fills
/// freed buffers with 0xFF; a matrix product with `k == 0` zeroes its product).
///
/// # Safety
/// As [`copy_host_to_device`].
pub unsafe fn fill_device(dst: CUdeviceptr, byte: u8, bytes: usize, stream: CUstream) -> Result<(), DeviceError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { cu::memset_d8_async(dst, byte, bytes, stream) }.or_device("cuMemsetD8Async")
}

/// Queues filling `height` lines of `width` bytes, `pitch` bytes apart from `dst` on, with
/// `byte` on `stream` (the padding of a padded matrix).
///
/// # Safety
/// As [`copy_host_to_device`]; `width <= pitch`.
pub unsafe fn fill_device_2d(
    dst: CUdeviceptr,
    pitch: usize,
    byte: u8,
    width: usize,
    height: usize,
    stream: CUstream,
) -> Result<(), DeviceError> {
    if width == 0 || height == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemsetD2D8Async(dst, pitch, byte, width, height, stream) }.result().or_device("cuMemsetD2D8Async")
}

/// Queues a copy of `height` lines of `width` bytes from `src` (lines `src_pitch` bytes apart)
/// to `dst` (`dst_pitch` apart), both device memory, on `stream` (an operand copied into the
/// padded lines of a padded matrix).
///
/// # Safety
/// As [`copy_async`]; `width` at most either pitch.
pub unsafe fn copy_device_2d(
    (dst, dst_pitch): (CUdeviceptr, usize),
    (src, src_pitch): (CUdeviceptr, usize),
    width: usize,
    height: usize,
    stream: CUstream,
) -> Result<(), DeviceError> {
    if width == 0 || height == 0 {
        return Ok(());
    }
    let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: device,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: device,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    };
    // SAFETY: the caller's contract; the descriptor lives for the call.
    unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) }.result().or_device("cuMemcpy2DAsync")
}

/// Queues a copy of `bytes` from `src` to `dst` on `stream`, each device memory or pinned host
/// memory (one address space: the driver finds out which). Offloads, their way back, and the
/// staged halves of host transfers.
///
/// # Safety
/// As [`copy_host_to_device`], both ranges live and not overlapping.
pub unsafe fn copy_async(dst: u64, src: u64, bytes: usize, stream: CUstream) -> Result<(), DeviceError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream) }.result().or_device("cuMemcpyAsync")
}
