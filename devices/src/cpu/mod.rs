//! The CPU device: a memory pool and an executor that runs schedules step by step, with data
//! parallelism inside kernels (rayon) and matrix products through `gemm`.
//!
//! It executes exactly what the schedule says (allocations, kernels, frees, in order); it
//! never reorders steps or decides lifetimes.

pub mod eval;
pub mod map;
pub mod matmul;
pub mod pool;
pub mod reduce;

use crate::{Backend, Buffer, DeviceError, Job, MemoryStats};
use braid_lowering::{Body, Kernel};
use braid_scheduler::{Step, StreamSchedule};
use map::ArgPtr;
use pool::{Pool, Slice};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A buffer of CPU memory taken from the pool; returned to it when dropped.
pub struct CpuBuffer {
    slice: Option<Slice>,
    bytes: usize,
    pool: Arc<Pool>,
}

// SAFETY: the memory is owned by this buffer until it is dropped; concurrent access is ordered
// by the schedule (validated before execution).
unsafe impl Send for CpuBuffer {}
unsafe impl Sync for CpuBuffer {}

impl CpuBuffer {
    /// Start of the buffer (dangling but aligned when it holds zero bytes).
    pub fn ptr(&self) -> *mut u8 {
        self.slice.as_ref().map_or(NonNull::<u64>::dangling().as_ptr() as *mut u8, |s| s.ptr.as_ptr())
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The contents (a copy).
    pub fn read(&self) -> Vec<u8> {
        // SAFETY: the buffer holds `bytes` initialised bytes (every buffer is written by the
        // kernel or upload that produced it before anyone reads it).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.bytes).to_vec() }
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            self.pool.free(s);
        }
    }
}

impl std::fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuBuffer({} B at {:p})", self.bytes, self.ptr())
    }
}

/// The CPU device runtime.
#[derive(Default)]
pub struct CpuDevice {
    pool: Arc<Pool>,
    kernels: AtomicU64,
}

impl CpuDevice {
    pub fn new() -> CpuDevice {
        CpuDevice::default()
    }

    fn alloc(&self, bytes: usize) -> Result<Arc<CpuBuffer>, DeviceError> {
        let slice = if bytes == 0 {
            None
        } else {
            Some(self.pool.alloc(bytes).ok_or_else(|| {
                let s = self.pool.stats();
                DeviceError::OutOfMemory { requested: bytes as u64, in_use: s.in_use, reserved: s.reserved }
            })?)
        };
        Ok(Arc::new(CpuBuffer { slice, bytes, pool: self.pool.clone() }))
    }

    fn run_stream(
        &self,
        job: &Job<'_>,
        stream: &StreamSchedule,
        table: &mut [Option<Buffer>],
    ) -> Result<(), DeviceError> {
        for step in &stream.steps {
            match step {
                Step::Alloc(b) => {
                    let plan = &job.schedule.buffers[b.index()];
                    table[b.index()] = Some(Buffer::Cpu(self.alloc(plan.bytes)?));
                }
                Step::Free { buffer, .. } => table[buffer.index()] = None,
                Step::Kernel(k) => {
                    let plan = &job.schedule.kernels[k.index()];
                    let kernel = &job.kernels[k.index()];
                    let args = plan
                        .inputs
                        .iter()
                        .chain(&plan.outputs)
                        .zip(&kernel.args)
                        .map(|(b, a)| match &table[b.index()] {
                            Some(Buffer::Cpu(buf)) if buf.bytes() == a.len * a.dtype.size() => {
                                Ok(ArgPtr { ptr: buf.ptr(), len: a.len, dtype: a.dtype })
                            }
                            Some(Buffer::Cpu(buf)) => Err(DeviceError::Internal(format!(
                                "{b} holds {} bytes but {k} expects {} {} elements",
                                buf.bytes(),
                                a.len,
                                a.dtype
                            ))),
                            None => Err(DeviceError::Internal(format!("{k} uses {b}, which is not allocated"))),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    let timed = tracing::enabled!(target: "braid::kernel", tracing::Level::DEBUG);
                    let t0 = timed.then(Instant::now);
                    run_kernel(kernel, &args).map_err(|e| DeviceError::Kernel(format!("{}: {e}", (job.label)(*k))))?;
                    self.kernels.fetch_add(1, Ordering::Relaxed);
                    if let Some(t0) = t0 {
                        let secs = t0.elapsed().as_secs_f64();
                        tracing::debug!(
                            target: "braid::kernel",
                            "{} {} elems {:.1} us {:.2} GB/s",
                            (job.label)(*k),
                            kernel.output_elements(),
                            secs * 1e6,
                            kernel.bytes_moved() as f64 / secs.max(1e-9) / 1e9
                        );
                    }
                }
                Step::Record(_) | Step::Wait(_) => {
                    return Err(DeviceError::Internal("events need the multi-stream executor".into()));
                }
            }
        }
        Ok(())
    }
}

/// Runs one kernel over its arguments.
pub fn run_kernel(kernel: &Kernel, args: &[ArgPtr]) -> Result<(), String> {
    if args.len() != kernel.args.len() {
        return Err(format!("{} arguments for a kernel of {}", args.len(), kernel.args.len()));
    }
    match &kernel.body {
        Body::Map(loops) => loops.iter().try_for_each(|l| map::run_loop(l, args)),
        Body::Reduce(r) => reduce::run_reduce(r, args),
        Body::Matmul(m) => matmul::run_matmul(m, args),
    }
}

impl Backend for CpuDevice {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn upload(&self, bytes: &[u8]) -> Result<Buffer, DeviceError> {
        let buf = self.alloc(bytes.len())?;
        // SAFETY: the fresh buffer holds bytes.len() bytes and nobody else has it yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.ptr(), bytes.len()) };
        Ok(Buffer::Cpu(buf))
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, DeviceError> {
        match buffer {
            Buffer::Cpu(b) => Ok(b.read()),
        }
    }

    fn execute(&self, job: Job<'_>) -> Result<Vec<Buffer>, DeviceError> {
        let s = job.schedule;
        let mut table: Vec<Option<Buffer>> = vec![None; s.buffers.len()];
        if job.externals.len() != s.external_buffers.len() {
            return Err(DeviceError::Internal("external buffers do not match the schedule".into()));
        }
        for (b, ext) in s.external_buffers.iter().zip(job.externals) {
            table[b.index()] = Some(ext.clone());
        }
        match s.streams.as_slice() {
            [] => {}
            [one] => self.run_stream(&job, one, &mut table)?,
            _ => {
                return Err(DeviceError::Internal(
                    "schedules with several streams need the multi-stream executor".into(),
                ));
            }
        }
        s.outputs
            .iter()
            .map(|(_, b)| {
                table[b.index()].clone().ok_or_else(|| DeviceError::Internal(format!("output {b} was freed")))
            })
            .collect()
    }

    fn memory(&self) -> MemoryStats {
        self.pool.stats()
    }

    fn reset_peak(&self) {
        self.pool.reset_peak()
    }

    fn kernels_launched(&self) -> u64 {
        self.kernels.load(Ordering::Relaxed)
    }

    fn trim(&self) {
        self.pool.trim()
    }
}
