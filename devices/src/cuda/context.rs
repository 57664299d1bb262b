//! Finding CUDA, opening a GPU, and the handles work is ordered with: non-blocking streams
//! and raw events.
//!
//! [`available`] checks that the driver (libcuda), NVRTC (libnvrtc) and cuBLAS (libcublas) can
//! be loaded before anything touches cudarc, which panics when a library is missing; every
//! other entry point here calls it first. [`Gpu::open`] retains a GPU's primary context through
//! cudarc's `CudaContext` (with its event tracking turned off: braid's schedule orders all
//! work) and reads what kernels are compiled and launched for: compute capability,
//! multiprocessors, memory, driver version.
//!
//! Must never: create or use the legacy default (NULL) stream, block the host (but in
//! [`Gpu::synchronize`], [`Stream::synchronize`] and [`Event::synchronize`], which a caller
//! asks for), or panic.

use super::{DriverResult, TRACE_TARGET};
use crate::DeviceError;
use cudarc::driver::result as cu;
use cudarc::driver::sys::{self, CUdevice_attribute, CUevent, CUevent_flags, CUstream};
use cudarc::driver::{CudaContext, DriverError};
use std::cell::Cell;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Whether the CUDA libraries braid needs can be loaded: `Err(Unavailable)` naming each one
/// missing. Checked once per process.
pub fn available() -> Result<(), DeviceError> {
    static CHECK: OnceLock<Result<(), String>> = OnceLock::new();
    CHECK
        .get_or_init(|| {
            // SAFETY: these only try to open the libraries (dlopen) and close them again.
            let found = unsafe {
                [
                    ("the CUDA driver (libcuda.so)", sys::is_culib_present()),
                    ("NVRTC (libnvrtc.so)", cudarc::nvrtc::sys::is_culib_present()),
                    ("cuBLAS (libcublas.so)", cudarc::cublas::sys::is_culib_present()),
                ]
            };
            let missing: Vec<&str> = found.iter().filter(|(_, ok)| !ok).map(|(name, _)| *name).collect();
            if missing.is_empty() {
                return Ok(());
            }
            Err(format!(
                "CUDA is not usable: cannot load {} (looked for libcuda, libnvrtc and libcublas on the \
                 library path, LD_LIBRARY_PATH included)",
                missing.join(", ")
            ))
        })
        .clone()
        .map_err(DeviceError::Unavailable)
}

/// The number of CUDA GPUs (0 when the driver finds none).
pub fn device_count() -> Result<usize, DeviceError> {
    available()?;
    match cu::init() {
        Ok(()) => {}
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => return Ok(0),
        Err(e) => return Err(unavailable("cuInit", e)),
    }
    Ok(cu::device::get_count().map_err(|e| unavailable("cuDeviceGetCount", e))?.max(0) as usize)
}

fn unavailable(what: &str, e: DriverError) -> DeviceError {
    DeviceError::Unavailable(format!("{what} failed: {e}"))
}

/// One GPU: its primary context (retained while this lives) and its properties.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    pub ordinal: usize,
    pub name: String,
    /// (major, minor), e.g. (9, 0) for an H100.
    pub compute_capability: (i32, i32),
    pub multiprocessors: u32,
    pub total_memory: u64,
    /// As `cuDriverGetVersion` gives it: 1000 * major + 10 * minor (13000 for CUDA 13.0).
    pub driver_version: i32,
    /// Stream captures in progress on this GPU's context (recording CUDA graphs), which a
    /// context-wide synchronisation must not overlap ([`Gpu::quiet`]).
    captures: Mutex<u32>,
    capture_ended: Condvar,
}

thread_local! {
    /// Queues of a capture this thread is issuing (see [`issuing_capture`]).
    static ISSUING_CAPTURE: Cell<u32> = const { Cell::new(0) };
}

/// Marks (or unmarks) the calling thread as issuing the queue of a stream capture: a
/// context-wide synchronisation on it fails at once instead of waiting for the capture it is
/// part of.
pub(crate) fn issuing_capture(on: bool) {
    ISSUING_CAPTURE.with(|c| c.set(if on { c.get() + 1 } else { c.get().saturating_sub(1) }));
}

impl Gpu {
    /// Opens GPU `ordinal`: `Err(Unavailable)` when the libraries are missing, the driver
    /// finds no GPU, or there is no GPU `ordinal` (the message says how many there are).
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, DeviceError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(DeviceError::Unavailable(match count {
                0 => format!("no CUDA GPU {ordinal}: the driver finds no GPU"),
                1 => format!("no CUDA GPU {ordinal}: there is 1 GPU (ordinal 0)"),
                n => format!("no CUDA GPU {ordinal}: there are {n} GPUs (ordinals 0 to {})", n - 1),
            }));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable("retaining the primary context", e))?;
        // SAFETY: braid holds no cudarc stream or slice whose safety relies on the tracking:
        // every buffer is a raw address ordered by the schedule's events.
        unsafe { ctx.disable_event_tracking() };
        let attr = |a: CUdevice_attribute| ctx.attribute(a).map_err(|e| unavailable("cuDeviceGetAttribute", e));
        let compute_capability = (
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let multiprocessors = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32;
        let device = ctx.cu_device();
        let name = cu::device::get_name(device).unwrap_or_else(|_| format!("CUDA GPU {ordinal}"));
        // SAFETY: `device` came from the driver for this ordinal.
        let total_memory = unsafe { cu::device::total_mem(device) }.map_err(|e| unavailable("cuDeviceTotalMem", e))?;
        let mut driver_version = 0;
        // SAFETY: the out-pointer is valid for the call.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(|e| unavailable("cuDriverGetVersion", e))?;
        let gpu = Gpu {
            ctx,
            ordinal,
            name,
            compute_capability,
            multiprocessors,
            total_memory: total_memory as u64,
            driver_version,
            captures: Mutex::new(0),
            capture_ended: Condvar::new(),
        };
        tracing::debug!(target: TRACE_TARGET, gpu = %gpu.name, ordinal, ?compute_capability, driver_version, "opened");
        Ok(Arc::new(gpu))
    }

    /// Makes this GPU's context current on the calling thread (every raw call needs it; the
    /// functions of this module that take a `&Gpu` do it themselves).
    pub fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().or_device("binding the CUDA context to this thread")
    }

    /// Waits for all work on every stream of this GPU; reports the first asynchronous error.
    /// Waits first for stream captures in progress on other threads to end (a context-wide
    /// synchronisation would break them); on a thread issuing a capture, it is an `Err`.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.quiet("synchronizing the GPU", || {
            self.bind()?;
            cu::ctx::synchronize().or_device("synchronizing the GPU")
        })
    }

    /// Runs `f` (`what`: something the driver refuses while a stream of the context is
    /// capturing, such as a context-wide synchronisation) once no capture is in progress, and
    /// lets none begin until it returns.
    pub(crate) fn quiet<T>(&self, what: &str, f: impl FnOnce() -> Result<T, DeviceError>) -> Result<T, DeviceError> {
        if ISSUING_CAPTURE.with(|c| c.get() > 0) {
            return Err(DeviceError::Unavailable(format!("{what} while this thread records a CUDA graph")));
        }
        let mut captures = self.captures.lock().unwrap_or_else(|p| p.into_inner());
        while *captures > 0 {
            captures = self.capture_ended.wait(captures).unwrap_or_else(|p| p.into_inner());
        }
        f()
    }

    /// Counts a stream capture beginning on this context (waits while [`Gpu::quiet`] runs).
    pub(crate) fn capture_begins(&self) {
        *self.captures.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }

    /// Counts a stream capture ended (whether or not it gave a graph).
    pub(crate) fn capture_ends(&self) {
        let mut captures = self.captures.lock().unwrap_or_else(|p| p.into_inner());
        *captures = captures.saturating_sub(1);
        self.capture_ended.notify_all();
    }

    /// (free, total) device memory in bytes, as the driver sees it (all processes).
    pub fn memory_info(&self) -> Result<(u64, u64), DeviceError> {
        self.bind()?;
        let (free, total) = cu::mem_get_info().or_device("cuMemGetInfo")?;
        Ok((free as u64, total as u64))
    }

    /// The cudarc context (for phase-2 code that needs it; its event tracking is off).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// A non-blocking CUDA stream (never synchronises with the legacy default stream). Dropping it
/// returns immediately; the driver releases it once its queued work is done.
#[derive(Debug)]
pub struct Stream {
    raw: CUstream,
    gpu: Arc<Gpu>,
}

// SAFETY: a CUstream is a driver handle usable from any thread whose current context is its
// GPU's; the methods bind that context first.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(gpu: &Arc<Gpu>) -> Result<Stream, DeviceError> {
        gpu.bind()?;
        let raw = cu::stream::create(cu::stream::StreamKind::NonBlocking).or_device("cuStreamCreate")?;
        Ok(Stream { raw, gpu: gpu.clone() })
    }

    /// The raw handle, for the raw functions of [`super::memory`], [`super::launch`] and
    /// [`super::blas`]. Valid while this `Stream` lives.
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Blocks the host until every operation queued on this stream is done.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.gpu.bind()?;
        // SAFETY: the stream is alive.
        unsafe { cu::stream::synchronize(self.raw) }.or_device("cuStreamSynchronize")
    }

    /// Makes later work on this stream wait (on the device) for `event`'s last record.
    pub fn wait(&self, event: &Event) -> Result<(), DeviceError> {
        self.gpu.bind()?;
        // SAFETY: both handles are alive and belong to this GPU's context.
        unsafe { cu::stream::wait_event(self.raw, event.raw, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .or_device("cuStreamWaitEvent")
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: the stream is alive; pending work completes before the driver frees it.
            let _ = unsafe { cu::stream::destroy(self.raw) };
        }
    }
}

/// A raw CUDA event: [`Event::new`] for ordering only (`CU_EVENT_DISABLE_TIMING`, the cheap
/// kind), [`Event::timing`] for measuring time between two records (profiling).
#[derive(Debug)]
pub struct Event {
    raw: CUevent,
    gpu: Arc<Gpu>,
}

// SAFETY: as for `Stream`.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn new(gpu: &Arc<Gpu>) -> Result<Event, DeviceError> {
        Event::with_flags(gpu, CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    pub fn timing(gpu: &Arc<Gpu>) -> Result<Event, DeviceError> {
        Event::with_flags(gpu, CUevent_flags::CU_EVENT_DEFAULT)
    }

    fn with_flags(gpu: &Arc<Gpu>, flags: CUevent_flags) -> Result<Event, DeviceError> {
        gpu.bind()?;
        let raw = cu::event::create(flags).or_device("cuEventCreate")?;
        Ok(Event { raw, gpu: gpu.clone() })
    }

    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// Records the event at the current end of `stream`'s queue.
    pub fn record(&self, stream: &Stream) -> Result<(), DeviceError> {
        self.gpu.bind()?;
        // SAFETY: both handles are alive and belong to this GPU's context.
        unsafe { cu::event::record(self.raw, stream.raw) }.or_device("cuEventRecord")
    }

    /// Whether the work before the last record is done (true if never recorded).
    pub fn is_done(&self) -> Result<bool, DeviceError> {
        self.gpu.bind()?;
        // SAFETY: the event is alive.
        match unsafe { cu::event::query(self.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(e).or_device("cuEventQuery"),
        }
    }

    /// Blocks the host until the work before the last record is done.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.gpu.bind()?;
        // SAFETY: the event is alive.
        unsafe { cu::event::synchronize(self.raw) }.or_device("cuEventSynchronize")
    }

    /// Milliseconds between the records of `start` and `self` (both [`Event::timing`] events,
    /// both complete).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32, DeviceError> {
        self.gpu.bind()?;
        // SAFETY: both events are alive.
        unsafe { cu::event::elapsed(start.raw, self.raw) }.or_device("cuEventElapsedTime")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: the event is alive; the driver defers the release until it completes.
            let _ = unsafe { cu::event::destroy(self.raw) };
        }
    }
}
