//! Executing a schedule on the CPU: one worker per stream, truly concurrent, with events as
//! real synchronisation.
//!
//! A single-stream schedule runs on the calling thread (no hand-off latency). With several
//! streams, the first runs on the calling thread and each other one on a persistent worker
//! (`workers`); `Record` sets
//! an event, `Wait` blocks until it is set, and a `Free` gated on events returns its buffer to
//! the pool when the last of them is reached, without blocking its stream. If any stream fails,
//! every event of the flush is failed, so no stream waits forever, and the first error is
//! returned. This module runs steps exactly as planned; it never reorders them.

use super::{CpuBuffer, CpuDevice, map::ArgPtr};
use crate::{Buffer, DeviceError, Input, Job};
use braid_scheduler::{BufferId, Space, Step, StreamSchedule};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

type Callback = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct EventState {
    reached: bool,
    failed: bool,
    callbacks: Vec<Callback>,
}

/// A CPU event: set once by the stream that records it.
#[derive(Default)]
struct CpuEvent {
    state: Mutex<EventState>,
    cv: Condvar,
}

impl CpuEvent {
    fn set(&self) {
        let callbacks = {
            let mut st = lock(&self.state);
            st.reached = true;
            std::mem::take(&mut st.callbacks)
        };
        self.cv.notify_all();
        callbacks.into_iter().for_each(|f| f());
    }

    /// Wakes every waiter with a failure (another stream failed); pending callbacks still run
    /// so that gated buffers return to the pool.
    fn fail(&self) {
        let callbacks = {
            let mut st = lock(&self.state);
            st.failed = true;
            std::mem::take(&mut st.callbacks)
        };
        self.cv.notify_all();
        callbacks.into_iter().for_each(|f| f());
    }

    /// Blocks until the event is set; `false` if the flush failed instead.
    fn wait(&self) -> bool {
        let mut st = lock(&self.state);
        while !st.reached && !st.failed {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.reached
    }

    /// Runs `f` once the event is set (or failed); at once if it already is.
    fn on_reached(&self, f: Callback) {
        let mut st = lock(&self.state);
        if st.reached || st.failed {
            drop(st);
            f();
        } else {
            st.callbacks.push(f);
        }
    }
}

/// State shared by the streams of one flush.
struct Exec<'a, 'j> {
    device: &'a CpuDevice,
    job: &'a Job<'j>,
    /// Buffer of each `BufferId`; shared with the callbacks of gated frees.
    table: Arc<Vec<Mutex<Option<Buffer>>>>,
    /// Host data of inputs uploaded when first used, by `BufferId`.
    uploads: Vec<Mutex<Option<Arc<[u8]>>>>,
    events: Vec<CpuEvent>,
    abort: AtomicBool,
    error: Mutex<Option<DeviceError>>,
    poison: bool,
}

impl Exec<'_, '_> {
    fn fail(&self, e: DeviceError) {
        lock(&self.error).get_or_insert(e);
        self.abort.store(true, Ordering::SeqCst);
        self.events.iter().for_each(CpuEvent::fail);
    }

    /// Runs one stream's steps; any failure (even a panic, which would be a bug in braid) fails
    /// every event of the flush, so no other stream waits forever.
    fn run_stream(&self, stream: &StreamSchedule) {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.steps(stream)));
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.fail(e),
            Err(panic) => {
                let what = crate::panic_message(panic.as_ref());
                self.fail(DeviceError::Internal(format!("stream {} panicked: {what}", stream.stream.0)));
            }
        }
    }

    fn steps(&self, stream: &StreamSchedule) -> Result<(), DeviceError> {
        let s = self.job.schedule;
        for step in &stream.steps {
            if self.abort.load(Ordering::Relaxed) {
                return Ok(());
            }
            match step {
                Step::Alloc(b) => {
                    let plan = &s.buffers[b.index()];
                    let buf = match plan.space {
                        Space::Device if plan.persistent => self.device.alloc_persistent(plan.bytes, self.poison)?,
                        Space::Device => self.device.alloc(plan.bytes, self.poison)?,
                        Space::Host => self.device.alloc_host(plan.bytes, self.poison)?,
                    };
                    *lock(&self.table[b.index()]) = Some(Buffer::Cpu(buf));
                }
                Step::Copy { from, to, .. } => self.copy(*from, *to)?,
                Step::Free { buffer, after } if after.is_empty() => {
                    drop(lock(&self.table[buffer.index()]).take());
                    drop(lock(&self.uploads[buffer.index()]).take());
                }
                Step::Free { buffer, after } => {
                    // The buffer stays in the table (readers on other streams may not have run
                    // yet) and leaves it when the last gating event is reached.
                    let remaining = Arc::new(AtomicUsize::new(after.len()));
                    for e in after {
                        let (remaining, table, b) = (remaining.clone(), self.table.clone(), buffer.index());
                        self.events[e.index()].on_reached(Box::new(move || {
                            if remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                                drop(lock(&table[b]).take());
                            }
                        }));
                    }
                }
                Step::Record(e) => self.events[e.index()].set(),
                Step::Wait(e) => {
                    if !self.events[e.index()].wait() {
                        return Ok(()); // another stream failed; its error is reported
                    }
                }
                Step::Kernel(k) => self.kernel(*k)?,
            }
        }
        Ok(())
    }

    /// The buffer `b` holds now, uploading an input's host data the first time it is used.
    fn buffer(&self, b: BufferId) -> Result<Option<Arc<CpuBuffer>>, DeviceError> {
        let mut slot = lock(&self.table[b.index()]);
        if slot.is_none()
            && let Some(bytes) = lock(&self.uploads[b.index()]).take()
        {
            let buf = self.device.alloc(bytes.len(), self.poison)?;
            // SAFETY: the fresh buffer holds bytes.len() bytes and nobody else has it yet.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.ptr(), bytes.len()) };
            *slot = Some(Buffer::Cpu(buf));
        }
        Ok(slot.as_ref().map(|Buffer::Cpu(buf)| buf.clone()))
    }

    /// Copies a whole buffer into another of the same size (an offload or its way back).
    fn copy(&self, from: BufferId, to: BufferId) -> Result<(), DeviceError> {
        let get = |b: BufferId| {
            self.buffer(b)?
                .ok_or_else(|| DeviceError::Internal(format!("copy {from} -> {to} uses {b}, which is not allocated")))
        };
        let (src, dst) = (get(from)?, get(to)?);
        if src.bytes() != dst.bytes() {
            return Err(DeviceError::Internal(format!(
                "copy {from} -> {to}: {} and {} bytes",
                src.bytes(),
                dst.bytes()
            )));
        }
        // SAFETY: both buffers are held for the copy and hold `bytes` bytes; the validated
        // schedule orders every other access to them around this step.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr(), dst.ptr(), src.bytes()) };
        Ok(())
    }

    fn kernel(&self, k: braid_scheduler::KernelId) -> Result<(), DeviceError> {
        if self.job.fail_at == Some(k) {
            return Err(DeviceError::Kernel(format!("{}: failure injected by a test", (self.job.label)(k))));
        }
        let plan = &self.job.schedule.kernels[k.index()];
        let kernel = &self.job.kernels[k.index()];
        // Hold the argument buffers for the kernel's duration, so a faulty plan can never
        // return memory that a kernel is still using to the pool.
        let mut held: Vec<Arc<CpuBuffer>> = Vec::with_capacity(kernel.args.len());
        let mut args = Vec::with_capacity(kernel.args.len());
        for (b, a) in plan.inputs.iter().chain(&plan.outputs).zip(&kernel.args) {
            let Some(buf) = self.buffer(*b)? else {
                return Err(DeviceError::Internal(format!("{k} uses {b}, which is not allocated")));
            };
            if buf.bytes() != a.len * a.dtype.size() {
                return Err(DeviceError::Internal(format!(
                    "{b} holds {} bytes but {k} expects {} {} elements",
                    buf.bytes(),
                    a.len,
                    a.dtype
                )));
            }
            args.push(ArgPtr { ptr: buf.ptr(), len: a.len, dtype: a.dtype });
            held.push(buf);
        }
        let timed = tracing::enabled!(target: "braid::kernel", tracing::Level::DEBUG);
        let t0 = timed.then(Instant::now);
        self.device.run(kernel, &args).map_err(|e| DeviceError::Kernel(format!("{}: {e}", (self.job.label)(k))))?;
        self.device.kernels.fetch_add(1, Ordering::Relaxed);
        if let Some(t0) = t0 {
            let secs = t0.elapsed().as_secs_f64();
            tracing::debug!(
                target: "braid::kernel",
                "{} s{} {} elems {:.1} us {:.2} GB/s",
                (self.job.label)(k),
                plan.stream.0,
                kernel.output_elements(),
                secs * 1e6,
                kernel.bytes_moved() as f64 / secs.max(1e-9) / 1e9
            );
        }
        Ok(())
    }
}

/// Runs a whole schedule; returns the buffers of `schedule.outputs` and the external buffers
/// still held at the end.
pub(super) fn execute(device: &CpuDevice, mut job: Job<'_>) -> (Result<Vec<Buffer>, DeviceError>, Vec<Option<Buffer>>) {
    let s = job.schedule;
    let externals = std::mem::take(&mut job.externals);
    if externals.len() != s.external_buffers.len() {
        let held = externals
            .into_iter()
            .map(|e| match e {
                Input::Buffer(b) => Some(b),
                Input::Upload(_) => None,
            })
            .collect();
        return (Err(DeviceError::Internal("external buffers do not match the schedule".into())), held);
    }
    let poison = job.poison;
    let exec = Exec {
        device,
        job: &job,
        table: Arc::new((0..s.buffers.len()).map(|_| Mutex::new(None)).collect()),
        uploads: (0..s.buffers.len()).map(|_| Mutex::new(None)).collect(),
        events: (0..s.events.len()).map(|_| CpuEvent::default()).collect(),
        abort: AtomicBool::new(false),
        error: Mutex::new(None),
        poison,
    };
    // The table owns the external buffers: a donated one is freed by the schedule.
    for (b, ext) in s.external_buffers.iter().zip(externals) {
        match ext {
            Input::Buffer(buffer) => *lock(&exec.table[b.index()]) = Some(buffer),
            Input::Upload(bytes) => *lock(&exec.uploads[b.index()]) = Some(bytes),
        }
    }
    match s.streams.as_slice() {
        [] => {}
        [one] => exec.run_stream(one),
        [first, rest @ ..] => {
            let bodies: Vec<Box<dyn Fn() + Sync + '_>> =
                rest.iter().map(|st| Box::new(|| exec.run_stream(st)) as Box<dyn Fn() + Sync + '_>).collect();
            let refs: Vec<&(dyn Fn() + Sync)> = bodies.iter().map(|b| b.as_ref()).collect();
            super::workers::run_all(&|| exec.run_stream(first), &refs);
        }
    }
    let held = s.external_buffers.iter().map(|b| lock(&exec.table[b.index()]).clone()).collect();
    if let Some(e) = lock(&exec.error).take() {
        return (Err(e), held);
    }
    let outputs = s
        .outputs
        .iter()
        .map(|(_, b)| {
            lock(&exec.table[b.index()]).clone().ok_or_else(|| DeviceError::Internal(format!("output {b} was freed")))
        })
        .collect();
    (outputs, held)
}
