//! The schedule walker: runs one flush's steps on a backend's queues.
//!
//! It keeps the buffer of every `BufferId` in a table (the flush's inputs first), allocates,
//! uploads host data at its first use, checks each kernel's arguments against its buffers,
//! hands ungated frees to the stream's queue at once and gated ones to the flush once every
//! gating event has been recorded, and turns any failure (an `Err`, or a panic, which would be a
//! bug in braid) into one error for the flush while failing every event, so no stream waits
//! forever. Streams are driven as the backend asks ([`Driver`]): on threads of their own (for
//! a backend whose queues only enqueue, a wait is held back until its record was issued), or
//! interleaved on this thread so that every record is issued before its waits.
//!
//! It executes exactly the schedule's steps in each stream's order; it never reorders a stream.

use super::{Backend, Call, Driver, Flush, Input, Job, Outcome, Queue};
use crate::{Buffer, DeviceError};
use braid_scheduler::{BufferId, EventId, StreamSchedule, StreamStep};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A gated free waiting for its events' records.
struct PendingFree {
    buffer: BufferId,
    stream: usize,
    after: Vec<EventId>,
    left: usize,
}

/// Which events were recorded, and the frees waiting for them.
#[derive(Default)]
struct Gates {
    recorded: Vec<bool>,
    pending: Vec<PendingFree>,
}

/// State shared by the streams of one flush.
#[derive(Default)]
struct Slot {
    buffer: Option<Buffer>,
    upload: Option<std::sync::Arc<[u8]>>,
}

struct Walker<'a, 'j> {
    job: &'a Job<'j>,
    flush: &'a dyn Flush,
    /// By `BufferId`: its buffer, and an input's host data until it is uploaded (when first
    /// used).
    table: Vec<Mutex<Slot>>,
    gates: Mutex<Gates>,
    /// Signalled when an event is recorded or the flush fails (for held-back waits).
    gate_changed: Condvar,
    /// Whether a wait is held back until its record was issued ([`Driver::IssueThreads`]).
    hold_waits: bool,
    abort: AtomicBool,
    error: Mutex<Option<DeviceError>>,
}

impl Walker<'_, '_> {
    fn fail(&self, e: DeviceError) {
        lock(&self.error).get_or_insert(e);
        self.abort.store(true, Ordering::SeqCst);
        self.flush.fail();
        // Taken so that a thread between its check and its wait cannot miss the signal.
        drop(lock(&self.gates));
        self.gate_changed.notify_all();
    }

    /// Blocks until event `e`'s record was issued; `false` when the flush failed first.
    fn await_record(&self, e: EventId) -> bool {
        let mut gates = lock(&self.gates);
        while !gates.recorded[e.index()] {
            if self.failed() {
                return false;
            }
            gates = self.gate_changed.wait(gates).unwrap_or_else(|p| p.into_inner());
        }
        true
    }

    fn failed(&self) -> bool {
        self.abort.load(Ordering::Relaxed)
    }

    /// Runs one step, turning a panic (a bug in braid) into an error.
    fn step(&self, stream: &StreamSchedule, s: usize, at: usize, queue: &mut dyn Queue) -> Result<(), ()> {
        let step = &stream.steps[at];
        let t0 = self.job.profile.map(|_| std::time::Instant::now());
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_step(s, at, step, queue)));
        if let (Some(sink), Some(t0)) = (self.job.profile, t0) {
            self.record_span(sink, stream.stream.0, at, step, t0);
        }
        let error = match run {
            Ok(Ok(true)) => return Ok(()),
            Ok(Ok(false)) => return Err(()), // a wait saw another stream fail: its error is reported
            Ok(Err(e)) => e,
            Err(panic) => {
                let what = crate::panic_message(panic.as_ref());
                DeviceError::Internal(format!("stream {} panicked: {what}", stream.stream.0))
            }
        };
        self.fail(error);
        Err(())
    }

    /// Adds the span of a kernel, copy or wait that started at `t0` to `sink`.
    fn record_span(
        &self,
        sink: &Mutex<Vec<super::Span>>,
        stream: u32,
        at: usize,
        step: &StreamStep,
        t0: std::time::Instant,
    ) {
        let schedule = self.job.schedule;
        let (kind, name, bytes) = match step {
            StreamStep::Kernel(k) => ("kernel", (self.job.label)(*k), self.job.kernels[k.index()].bytes_moved()),
            StreamStep::Copy { from, to, .. } => {
                ("copy", format!("copy {from} -> {to}"), 2 * schedule.buffers[from.index()].bytes)
            }
            StreamStep::Wait(e) => ("wait", format!("wait {e}"), 0),
            _ => return,
        };
        let span = super::Span { stream, kind, name, start: t0, duration: t0.elapsed(), bytes, step: at };
        lock(sink).push(span);
    }

    /// Runs `step` of stream `s` on its queue; `Ok(false)` when a wait learns that the flush
    /// failed.
    fn run_step(&self, s: usize, at: usize, step: &StreamStep, queue: &mut dyn Queue) -> Result<bool, DeviceError> {
        let schedule = self.job.schedule;
        match step {
            StreamStep::Alloc(b) => {
                let buffer = queue.alloc(&schedule.buffers[b.index()])?;
                lock(&self.table[b.index()]).buffer = Some(buffer);
            }
            StreamStep::Free { buffer, after } if after.is_empty() => {
                let slot = std::mem::take(&mut *lock(&self.table[buffer.index()]));
                if let Some(b) = slot.buffer {
                    queue.free(b);
                }
            }
            StreamStep::Free { buffer, after } => self.free_after(*buffer, s, after),
            StreamStep::Record(e) => {
                queue.record(*e);
                self.recorded(*e);
            }
            StreamStep::Wait(e) => return Ok((!self.hold_waits || self.await_record(*e)) && queue.wait(*e)),
            StreamStep::Copy { from, to, .. } => {
                let (src, dst) = (self.buffer(*from, queue)?, self.buffer(*to, queue)?);
                if src.bytes() != dst.bytes() {
                    return Err(DeviceError::Internal(format!(
                        "copy {from} -> {to}: {} and {} bytes",
                        src.bytes(),
                        dst.bytes()
                    )));
                }
                queue.copy(&src, &dst)?;
            }
            StreamStep::Kernel(k) => self.kernel(*k, s, at, queue)?,
        }
        Ok(true)
    }

    /// The buffer `b` holds now, uploading an input's host data the first time it is used.
    fn buffer(&self, b: BufferId, queue: &mut dyn Queue) -> Result<Buffer, DeviceError> {
        let mut slot = lock(&self.table[b.index()]);
        if slot.buffer.is_none()
            && let Some(bytes) = slot.upload.take()
        {
            slot.buffer = Some(queue.upload(&bytes)?);
        }
        slot.buffer.clone().ok_or_else(|| DeviceError::Internal(format!("{b} is used but not allocated")))
    }

    /// A free gated on `after`: goes to the flush once every one of them is recorded.
    fn free_after(&self, buffer: BufferId, stream: usize, after: &[EventId]) {
        let mut gates = lock(&self.gates);
        let left = after.iter().filter(|e| !gates.recorded[e.index()]).count();
        if left == 0 {
            drop(gates);
            self.release(buffer, stream, after);
        } else {
            gates.pending.push(PendingFree { buffer, stream, after: after.to_vec(), left });
        }
    }

    /// Event `e` was recorded: frees waiting only for it go ahead.
    fn recorded(&self, e: EventId) {
        let ready: Vec<PendingFree> = {
            let mut gates = lock(&self.gates);
            gates.recorded[e.index()] = true;
            if self.hold_waits {
                self.gate_changed.notify_all();
            }
            let mut ready = Vec::new();
            let mut i = 0;
            while i < gates.pending.len() {
                let p = &mut gates.pending[i];
                if p.after.contains(&e) {
                    p.left -= 1;
                    if p.left == 0 {
                        ready.push(gates.pending.swap_remove(i));
                        continue;
                    }
                }
                i += 1;
            }
            ready
        };
        for p in ready {
            self.release(p.buffer, p.stream, &p.after);
        }
    }

    fn release(&self, buffer: BufferId, stream: usize, after: &[EventId]) {
        let slot = std::mem::take(&mut *lock(&self.table[buffer.index()]));
        if let Some(b) = slot.buffer {
            self.flush.free_after(b, stream, after);
        }
    }

    fn kernel(
        &self,
        k: braid_scheduler::KernelId,
        s: usize,
        at: usize,
        queue: &mut dyn Queue,
    ) -> Result<(), DeviceError> {
        let job = self.job;
        if job.fail_at == Some(k) {
            return Err(DeviceError::Kernel(format!("{}: failure injected by a test", (job.label)(k))));
        }
        let plan = &job.schedule.kernels[k.index()];
        let kernel = &job.kernels[k.index()];
        if plan.inputs.len() + plan.outputs.len() != kernel.args.len() {
            return Err(DeviceError::Internal(format!(
                "{}: the plan gives {} buffers for a kernel of {} arguments",
                (job.label)(k),
                plan.inputs.len() + plan.outputs.len(),
                kernel.args.len()
            )));
        }
        // The argument buffers are held for the call, so a faulty plan can never return memory
        // that a kernel still uses to the pool.
        let mut args: smallvec::SmallVec<[Buffer; 8]> = smallvec::SmallVec::with_capacity(kernel.args.len());
        for (b, a) in plan.inputs.iter().chain(&plan.outputs).zip(&kernel.args) {
            let buffer = self.buffer(*b, queue)?;
            if buffer.bytes() != a.len * a.dtype.size() {
                return Err(DeviceError::Internal(format!(
                    "{b} holds {} bytes but {k} expects {} {} elements",
                    buffer.bytes(),
                    a.len,
                    a.dtype
                )));
            }
            args.push(buffer);
        }
        let stream = job.schedule.streams[s].stream.0;
        let timed = job.profile.is_some();
        let call = Call { id: k, kernel, args: &args, label: job.label, stream, flush: job.flush, step: at, timed };
        match kernel.body {
            braid_lowering::Body::Matmul(_) => queue.library(&call),
            braid_lowering::Body::Collective(_) => queue.collective(&call),
            _ => queue.launch(&call),
        }
    }

    /// Runs one stream's steps to the end, or until the flush fails.
    fn run_stream(&self, s: usize, queue: &mut dyn Queue) {
        let stream = &self.job.schedule.streams[s];
        for at in 0..stream.steps.len() {
            if self.failed() || self.step(stream, s, at, queue).is_err() {
                return;
            }
        }
    }

    /// Issues every stream's steps on this thread: each stream runs until it reaches a wait
    /// whose record was not issued yet, then the next stream takes over.
    fn interleave(&self, queues: &mut [Box<dyn Queue + '_>]) {
        let streams = &self.job.schedule.streams;
        let mut next = vec![0usize; streams.len()];
        loop {
            let mut progress = false;
            for (s, stream) in streams.iter().enumerate() {
                while let Some(step) = stream.steps.get(next[s]) {
                    if let StreamStep::Wait(e) = step
                        && !lock(&self.gates).recorded[e.index()]
                    {
                        break;
                    }
                    if self.step(stream, s, next[s], queues[s].as_mut()).is_err() {
                        return;
                    }
                    next[s] += 1;
                    progress = true;
                }
            }
            if next.iter().zip(streams).all(|(&n, st)| n == st.steps.len()) {
                return;
            }
            if !progress {
                // Schedules are checked before they run, so this is a bug in braid.
                self.fail(DeviceError::Internal("the streams wait for events that are never recorded".into()));
                return;
            }
        }
    }
}

/// The external buffers of a flush that never started, to give back.
fn held_inputs(externals: Vec<Input>) -> Vec<Option<Buffer>> {
    externals
        .into_iter()
        .map(|e| match e {
            Input::Buffer(b) => Some(b),
            Input::Upload(_) => None,
        })
        .collect()
}

fn mismatched(externals: Vec<Input>) -> Outcome {
    (Err(DeviceError::Internal("external buffers do not match the schedule".into())), held_inputs(externals))
}

/// Runs `job` on `backend`: returns the buffers of `schedule.outputs` and the external buffers
/// still held at the end.
pub fn execute(backend: &dyn Backend, mut job: Job<'_>) -> Outcome {
    if job.externals.len() != job.schedule.external_buffers.len() {
        return mismatched(std::mem::take(&mut job.externals));
    }
    match backend.begin(job.schedule, job.poison) {
        Ok(flush) => execute_on(backend.driver(), flush.as_ref(), job),
        Err(e) => (Err(e), held_inputs(std::mem::take(&mut job.externals))),
    }
}

/// Runs `job` on a flush the backend began itself (a flush recorded into a device graph),
/// driving its queues as `driver` says: [`execute`] after `Backend::begin`.
pub fn execute_on(driver: Driver, flush: &dyn Flush, mut job: Job<'_>) -> Outcome {
    let schedule = job.schedule;
    let externals = std::mem::take(&mut job.externals);
    if externals.len() != schedule.external_buffers.len() {
        return mismatched(externals);
    }
    let walker = Walker {
        job: &job,
        flush,
        table: (0..schedule.buffers.len()).map(|_| Mutex::default()).collect(),
        gates: Mutex::new(Gates { recorded: vec![false; schedule.events.len()], pending: Vec::new() }),
        gate_changed: Condvar::new(),
        hold_waits: driver == Driver::IssueThreads,
        abort: AtomicBool::new(false),
        error: Mutex::new(None),
    };
    // The table owns the external buffers: a donated one is freed by the schedule.
    for (b, ext) in schedule.external_buffers.iter().zip(externals) {
        match ext {
            Input::Buffer(buffer) => lock(&walker.table[b.index()]).buffer = Some(buffer),
            Input::Upload(bytes) => lock(&walker.table[b.index()]).upload = Some(bytes),
        }
    }
    let streams = schedule.streams.len();
    let walker = &walker;
    match driver {
        Driver::Interleaved => {
            let mut queues: Vec<Box<dyn Queue + '_>> = (0..streams).map(|s| flush.queue(s)).collect();
            walker.interleave(&mut queues);
        }
        Driver::Threads | Driver::IssueThreads if streams == 1 => walker.run_stream(0, flush.queue(0).as_mut()),
        Driver::Threads | Driver::IssueThreads => {
            let bodies: Vec<Box<dyn Fn() + Sync + '_>> =
                (0..streams).map(|s| Box::new(move || walker.run_stream(s, flush.queue(s).as_mut())) as _).collect();
            let no_thread = || walker.fail(DeviceError::Unavailable("no thread could be started for a stream".into()));
            super::workers::run_all(&bodies, &no_thread);
        }
    }
    let failed = walker.failed();
    if let Err(e) = flush.finish(failed) {
        walker.fail(e);
    }
    if let (Some(sink), Some(times)) = (job.profile, job.profile.and_then(|_| flush.device_times())) {
        // The device's own times replace the issue times of the steps it timed.
        let mut spans = lock(sink);
        let origin = spans.iter().map(|s| s.start).min();
        for (s, at, offset, duration) in times {
            let id = schedule.streams[s].stream.0;
            if let (Some(span), Some(origin)) = (spans.iter_mut().find(|x| x.stream == id && x.step == at), origin) {
                span.start = origin + offset;
                span.duration = duration;
            }
        }
    }
    let held = schedule.external_buffers.iter().map(|b| lock(&walker.table[b.index()]).buffer.clone()).collect();
    if let Some(e) = lock(&walker.error).take() {
        return (Err(e), held);
    }
    let outputs = schedule
        .outputs
        .iter()
        .map(|(_, b)| {
            lock(&walker.table[b.index()])
                .buffer
                .clone()
                .ok_or_else(|| DeviceError::Internal(format!("output {b} was freed")))
        })
        .collect();
    (outputs, held)
}
