//! The CPU's queues: each runs a step the moment the runtime issues it, on the stream's own
//! thread ([`Driver::Threads`](crate::runtime::Driver::Threads)), so an event is recorded once
//! the work before it is done and a wait blocks until the event is recorded (or the flush
//! fails). Memory a gated free releases goes back to the pool at once: by then every gating
//! event was recorded, so the readers it names have finished.
//!
//! A queue never decides what runs; it only does what it is handed.

use super::{CpuBuffer, CpuDevice, map::ArgPtr};
use crate::runtime::{Call, Flush, Queue};
use crate::{Buffer, DeviceError};
use braid_scheduler::{BufferPlan, EventId, Schedule};
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A CPU event: set once by the stream that records it, or failed with the flush.
#[derive(Default)]
struct CpuEvent {
    /// (reached, failed)
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl CpuEvent {
    fn set(&self, failed: bool) {
        let mut st = lock(&self.state);
        if failed {
            st.1 = true
        } else {
            st.0 = true
        }
        self.cv.notify_all();
    }

    /// Blocks until the event is set; `false` if the flush failed instead.
    fn wait(&self) -> bool {
        let mut st = lock(&self.state);
        while !st.0 && !st.1 {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.0
    }
}

/// One flush on the CPU: its events.
pub(super) struct CpuFlush<'a> {
    device: &'a CpuDevice,
    events: Vec<CpuEvent>,
    poison: bool,
}

impl<'a> CpuFlush<'a> {
    pub(super) fn new(device: &'a CpuDevice, schedule: &Schedule, poison: bool) -> CpuFlush<'a> {
        CpuFlush { device, events: (0..schedule.events.len()).map(|_| CpuEvent::default()).collect(), poison }
    }
}

impl Flush for CpuFlush<'_> {
    fn queue(&self, _stream: usize) -> Box<dyn Queue + '_> {
        Box::new(CpuQueue { flush: self })
    }

    fn free_after(&self, buffer: Buffer, _stream: usize, _after: &[EventId]) {
        // Every gating event was recorded, and on the CPU a record means the work before it
        // is done: the memory may go back to the pool now (poisoned if asked).
        drop(buffer);
    }

    fn fail(&self) {
        self.events.iter().for_each(|e| e.set(true));
    }

    fn finish(&self, _failed: bool) -> Result<(), DeviceError> {
        Ok(()) // every step ran before it returned
    }
}

/// One stream of a CPU flush.
struct CpuQueue<'f, 'a> {
    flush: &'f CpuFlush<'a>,
}

/// The CPU buffer `buffer` is; another device's buffer is an error (kernels and copies read
/// another device's memory only through a transfer's copy step, [`Buffer::read_into`]).
pub(crate) fn cpu_buffer(buffer: &Buffer) -> Result<&CpuBuffer, DeviceError> {
    buffer.get().ok_or_else(|| {
        DeviceError::Internal(format!("a CPU kernel or copy given another device's buffer ({buffer:?})"))
    })
}

impl CpuQueue<'_, '_> {
    /// Runs a kernel (interpreted, compiled, or a matrix product through `gemm`) and logs it.
    fn run(&self, call: &Call<'_>) -> Result<(), DeviceError> {
        let args: SmallVec<[ArgPtr; 16]> = (call.args.iter().zip(&call.kernel.args))
            .map(|(b, a)| cpu_buffer(b).map(|b| ArgPtr { ptr: b.ptr(), len: a.len, dtype: a.dtype }))
            .collect::<Result<_, _>>()?;
        run_logged(self.flush.device, call.kernel, &args, &|| call.describe(), call.flush, call.stream, None)
    }
}

/// Runs `kernel` over `args` on `device` (keeping its compiled library in `kept`, if given:
/// see `CpuDevice::run_keeping`), counts it, and logs its time at
/// `RUST_LOG=braid::kernel=debug` (`describe` names it).
pub(super) fn run_logged(
    device: &CpuDevice,
    kernel: &Arc<braid_lowering::Kernel>,
    args: &[ArgPtr],
    describe: &dyn Fn() -> String,
    flush: u64,
    stream: u32,
    kept: Option<&super::KeptKernel>,
) -> Result<(), DeviceError> {
    let timed = tracing::enabled!(target: "braid::kernel", tracing::Level::DEBUG);
    let t0 = timed.then(Instant::now);
    let ran = match kept {
        Some(kept) => device.run_keeping(kernel, args, kept),
        None => device.run(kernel, args),
    };
    ran.map_err(|e| DeviceError::Kernel(format!("{}: {e}", describe())))?;
    device.kernels.fetch_add(1, Ordering::Relaxed);
    if let Some(t0) = t0 {
        let secs = t0.elapsed().as_secs_f64();
        tracing::debug!(
            target: "braid::kernel",
            "flush {flush} {} s{stream} {} elems {:.1} us {:.2} GB/s",
            describe(),
            kernel.output_elements(),
            secs * 1e6,
            kernel.bytes_moved() as f64 / secs.max(1e-9) / 1e9
        );
    }
    Ok(())
}

/// Copies `from` (a CPU buffer, or another device's for a transfer) into the CPU buffer `to`,
/// of as many bytes (the caller checks).
pub(super) fn copy(from: &Buffer, to: &Buffer) -> Result<(), DeviceError> {
    let dst = cpu_buffer(to)?;
    // SAFETY: the destination is held for the copy and nothing else accesses it now (the
    // validated schedule orders every other access around this step); it holds as many
    // bytes as the source.
    let dst = unsafe { std::slice::from_raw_parts_mut(dst.ptr(), dst.bytes()) };
    // Another device's buffer (a transfer) or one of ours: read where it is.
    from.read_into(dst)
}

impl Queue for CpuQueue<'_, '_> {
    fn alloc(&mut self, plan: &BufferPlan) -> Result<Buffer, DeviceError> {
        self.flush.device.alloc_planned(plan, self.flush.poison)
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<Buffer, DeviceError> {
        self.flush.device.upload_bytes(bytes, self.flush.poison).map(Buffer::new)
    }

    fn free(&mut self, buffer: Buffer) {
        drop(buffer);
    }

    fn record(&mut self, event: EventId) {
        self.flush.events[event.index()].set(false);
    }

    fn wait(&mut self, event: EventId) -> bool {
        self.flush.events[event.index()].wait()
    }

    fn copy(&mut self, from: &Buffer, to: &Buffer) -> Result<(), DeviceError> {
        copy(from, to)
    }

    fn launch(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        self.run(call)
    }

    fn library(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        self.run(call)
    }

    fn collective(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        let braid_lowering::Body::Collective(c) = &call.kernel.body else {
            return Err(DeviceError::Internal(format!("{} is not a collective", call.describe())));
        };
        let group = crate::collective::group(c)?;
        let (input, output) = (cpu_buffer(&call.args[0])?, cpu_buffer(&call.args[1])?);
        // SAFETY: the schedule orders every other access to these buffers around this step
        // (validated), and the walker checked their lengths against the kernel's arguments.
        let (input, output) = unsafe {
            (
                std::slice::from_raw_parts(input.ptr() as *const u8, input.bytes()),
                std::slice::from_raw_parts_mut(output.ptr(), output.bytes()),
            )
        };
        crate::collective::host::run(&group, c, call.kernel.args[0].dtype, input, output)
            .map_err(|e| e.in_kernel(&call.describe()))?;
        self.flush.device.kernels.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
