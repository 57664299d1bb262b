//! A test backend that stands for an asynchronous device (a GPU) under the runtime: its queues
//! log every call they receive and only enqueue the work, which a simulated device runs later,
//! a few operations at a time between the host's calls, picking streams at random while
//! keeping each stream's order and every event wait. Memory comes back to the pool only when
//! the simulated device gets to it: an ungated free when its stream reaches it, a gated free
//! once its events are reached and its stream has passed the point where it was handed over.
//! Kernels hold raw pointers, as on a GPU, so a buffer freed too early is poisoned (or reused)
//! under a kernel that still reads it, and the result is wrong.
//!
//! While calls come in, it checks what CUDA and wgpu backends will rely on: every wait is issued
//! after its event's record, and a gated free is handed over only after the records of all its
//! events. Breaches are collected as violations.
//!
//! [`RecordingBackend::single_queue`] models wgpu instead: one in-order queue for every stream,
//! so the simulated device runs work in exactly the order it was issued, and memory that a
//! free (gated or not) gives back returns to the pool at once, as the wgpu backend returns it:
//! its next user is issued, so runs, later. Uploads and poison fills are work in that order
//! too (as the wgpu backend's staging copies and fill copies are), never host writes at issue
//! time. A runtime that issued a gated free before some reader of the buffer would let a later
//! writer clobber it before that reader ran, and the results would be wrong.

use braid_devices::cpu::map::ArgPtr;
use braid_devices::cpu::{CpuBuffer, CpuDevice, run_kernel};
use braid_devices::runtime::{Call, Driver, Flush, Queue};
use braid_devices::{Backend, Buffer, DeviceError, MemoryStats};
use braid_graph::{MemoryKind, Target};
use braid_lowering::Kernel;
use braid_scheduler::{BufferPlan, EventId, Schedule};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the runtime asked for, in the order it asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Logged {
    Begin { streams: usize, events: usize },
    Alloc { stream: usize },
    Upload { stream: usize },
    Free { stream: usize },
    FreeAfter { stream: usize, after: Vec<EventId> },
    Record { stream: usize, event: EventId },
    Wait { stream: usize, event: EventId },
    Copy { stream: usize },
    Launch { stream: usize },
    Finish { failed: bool },
}

/// The fake device.
pub struct RecordingBackend {
    memory: CpuDevice,
    target: Target,
    log: Mutex<Vec<Logged>>,
    violations: Mutex<Vec<String>>,
    seed: AtomicU64,
    kernels: AtomicU64,
    /// One in-order queue for all streams, memory reusable at the free (wgpu's model).
    single: bool,
    /// How the walker drives it: interleaved on one thread, or each stream issued on a
    /// thread of its own (CUDA's model).
    driver: Driver,
}

impl RecordingBackend {
    /// A fake device whose memory is its own (so values from the CPU arrive by transfer copy
    /// steps) with a copy stream; `seed` drives the simulated device's interleaving.
    pub fn new(seed: u64) -> RecordingBackend {
        RecordingBackend {
            memory: CpuDevice::new(),
            target: Target { name: "recording", memory: MemoryKind::Device, copy_stream: true, ..Target::CPU },
            log: Mutex::new(Vec::new()),
            violations: Mutex::new(Vec::new()),
            seed: AtomicU64::new(seed),
            kernels: AtomicU64::new(0),
            single: false,
            driver: Driver::Interleaved,
        }
    }

    /// Each stream issued by a host thread of its own ([`Driver::IssueThreads`], CUDA's model):
    /// the calls of different streams arrive at the same time, in any order.
    pub fn issue_threads(seed: u64) -> RecordingBackend {
        let mut b = RecordingBackend::new(seed);
        b.driver = Driver::IssueThreads;
        b
    }

    /// The fake device with wgpu's ordering (see the module docs): no copy stream, one queue.
    pub fn single_queue(seed: u64) -> RecordingBackend {
        let mut b = RecordingBackend::new(seed);
        b.single = true;
        b.target.copy_stream = false;
        b
    }

    /// Registers the fake device's three flavours as backends (once per process; later calls
    /// do nothing), through the path every backend takes: `recording:N` is
    /// [`RecordingBackend::new`]`(N)`, `recording_one_queue:N` [`RecordingBackend::single_queue`]
    /// and `recording_issue_threads:N` [`RecordingBackend::issue_threads`], `N` the seed of
    /// the simulated device's interleaving (0 without one).
    pub fn register() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            type Make = fn(u64) -> RecordingBackend;
            let flavours: [(&str, Make); 3] = [
                ("recording", RecordingBackend::new),
                ("recording_one_queue", RecordingBackend::single_queue),
                ("recording_issue_threads", RecordingBackend::issue_threads),
            ];
            for (name, make) in flavours {
                let registration = braid::backends::Registration::new(name, move |seed| {
                    Ok(Arc::new(make(seed.unwrap_or(0) as u64)) as Arc<dyn Backend>)
                });
                assert!(braid::backends::register(registration), "{name} was registered by someone else");
            }
        });
    }

    /// The fake device under `dev` (a device opened by one of the names of [`register`]).
    pub fn of(dev: &braid::Device) -> &RecordingBackend {
        braid::testing::backend::<RecordingBackend>(dev).expect("a device of a recording backend")
    }

    /// Every call received so far.
    pub fn log(&self) -> Vec<Logged> {
        lock(&self.log).clone()
    }

    /// Breaches of the runtime's ordering promises seen so far.
    pub fn violations(&self) -> Vec<String> {
        lock(&self.violations).clone()
    }

    fn note(&self, entry: Logged) {
        lock(&self.log).push(entry);
    }

    fn violation(&self, what: String) {
        lock(&self.violations).push(what);
    }
}

impl Backend for RecordingBackend {
    fn name(&self) -> String {
        "recording".into()
    }

    fn target(&self) -> &Target {
        &self.target
    }

    fn driver(&self) -> Driver {
        self.driver
    }

    fn begin<'a>(&'a self, schedule: &'a Schedule, poison: bool) -> Result<Box<dyn Flush + 'a>, DeviceError> {
        let (streams, events) = (schedule.streams.len(), schedule.events.len());
        self.note(Logged::Begin { streams, events });
        let seed = self.seed.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let sim = Sim {
            queues: (0..streams).map(|_| VecDeque::new()).collect(),
            issued: vec![0; streams],
            executed: vec![0; streams],
            record_issued: vec![false; events],
            reached: vec![false; events],
            releases: Vec::new(),
            rng: seed | 1,
            failed: false,
            single: self.single,
        };
        Ok(Box::new(RecordingFlush { backend: self, poison, sim: Mutex::new(sim) }))
    }

    fn upload(&self, bytes: &[u8], poison: bool) -> Result<Buffer, DeviceError> {
        // One queue: a flush that frees it poisons it in issue order (`release_now`).
        self.memory.upload(bytes, poison && !self.single)
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, DeviceError> {
        // Every flush runs to completion in `finish`, so the value is written.
        self.memory.download(buffer)
    }

    fn memory(&self) -> MemoryStats {
        self.memory.memory()
    }

    fn reset_peak(&self) {
        self.memory.reset_peak()
    }

    fn kernels_launched(&self) -> u64 {
        self.kernels.load(Ordering::Relaxed)
    }

    fn trim(&self) {
        self.memory.trim()
    }

    fn persistent_memory(&self) -> u64 {
        self.memory.persistent_memory()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Work a stream has been handed and the simulated device has not done yet.
enum Work {
    Launch {
        kernel: Arc<Kernel>,
        args: Vec<ArgPtr>,
    },
    Copy {
        src: *const u8,
        dst: *mut u8,
        bytes: usize,
    },
    Record(EventId),
    Wait(EventId),
    Free(Buffer),
    /// Host bytes copied in (an upload in issue order).
    Write {
        data: Vec<u8>,
        dst: *mut u8,
    },
    /// A poison fill of freed memory (0xFF bytes), in issue order.
    Fill {
        dst: *mut u8,
        bytes: usize,
    },
}

// SAFETY: the raw pointers point into buffers the schedule keeps alive until the work runs (or
// the simulation exposes the bug that it does not); the simulation runs under a mutex.
unsafe impl Send for Work {}

/// A gated free handed over: its memory returns once `after` are reached and `stream` has
/// done `marker` operations.
struct Release {
    buffer: Buffer,
    after: Vec<EventId>,
    stream: usize,
    marker: u64,
}

/// The simulated device of one flush.
struct Sim {
    queues: Vec<VecDeque<Work>>,
    issued: Vec<u64>,
    executed: Vec<u64>,
    record_issued: Vec<bool>,
    reached: Vec<bool>,
    releases: Vec<Release>,
    rng: u64,
    failed: bool,
    /// Every stream's work goes to queue 0, in issue order.
    single: bool,
}

impl Sim {
    fn random(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn push(&mut self, stream: usize, work: Work) {
        self.queues[if self.single { 0 } else { stream }].push_back(work);
        self.issued[stream] += 1;
    }

    /// Streams whose next work can run now.
    fn runnable(&self) -> Vec<usize> {
        (0..self.queues.len())
            .filter(|&s| match self.queues[s].front() {
                Some(Work::Wait(e)) => self.reached[e.index()],
                Some(_) => true,
                None => false,
            })
            .collect()
    }

    /// Runs the next work of a random runnable stream; `false` when none can run.
    fn step(&mut self, violations: &mut Vec<String>) -> bool {
        let ready = self.runnable();
        if ready.is_empty() {
            return false;
        }
        let s = ready[(self.random() % ready.len() as u64) as usize];
        let work = self.queues[s].pop_front().expect("runnable");
        self.executed[s] += 1;
        match work {
            Work::Launch { kernel, args } => {
                if let Err(e) = run_kernel(&kernel, &args) {
                    violations.push(format!("a kernel failed on the simulated device: {e}"));
                }
            }
            // SAFETY: see `Work`.
            Work::Copy { src, dst, bytes } => unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) },
            Work::Record(e) => self.reached[e.index()] = true,
            Work::Wait(_) => {}
            Work::Free(buffer) => drop(buffer),
            // SAFETY: as for copies.
            Work::Write { data, dst } => unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) },
            Work::Fill { dst, bytes } => unsafe { std::ptr::write_bytes(dst, 0xFF, bytes) },
        }
        self.release_due();
        true
    }

    /// Gated frees whose events are reached and whose stream has passed its point go back.
    fn release_due(&mut self) {
        let (reached, executed) = (&self.reached, &self.executed);
        self.releases.retain(|r| !(r.after.iter().all(|e| reached[e.index()]) && executed[r.stream] >= r.marker));
    }

    /// Lets the device run a little (0 to 3 operations), as a GPU runs while the host issues.
    fn progress(&mut self, violations: &mut Vec<String>) {
        for _ in 0..self.random() % 4 {
            if !self.step(violations) {
                break;
            }
        }
    }
}

struct RecordingFlush<'a> {
    backend: &'a RecordingBackend,
    poison: bool,
    sim: Mutex<Sim>,
}

impl RecordingFlush<'_> {
    /// Applies `f` to the simulation, then lets the device progress.
    fn with(&self, f: impl FnOnce(&mut Sim, &mut Vec<String>)) {
        let mut violations = Vec::new();
        {
            let mut sim = lock(&self.sim);
            f(&mut sim, &mut violations);
            sim.progress(&mut violations);
        }
        for v in violations {
            self.backend.violation(v);
        }
    }
}

impl Flush for RecordingFlush<'_> {
    fn queue(&self, stream: usize) -> Box<dyn Queue + '_> {
        Box::new(RecordingQueue { flush: self, stream })
    }

    fn free_after(&self, buffer: Buffer, stream: usize, after: &[EventId]) {
        self.backend.note(Logged::FreeAfter { stream, after: after.to_vec() });
        let poison = self.poison;
        self.with(|sim, violations| {
            for e in after {
                if !sim.record_issued[e.index()] {
                    violations.push(format!("a free gated on {e} was handed over before {e} was recorded"));
                }
            }
            if sim.single {
                release_now(sim, buffer, poison);
                return;
            }
            let marker = sim.issued[stream];
            sim.releases.push(Release { buffer, after: after.to_vec(), stream, marker });
            sim.release_due();
        });
    }

    fn fail(&self) {
        lock(&self.sim).failed = true;
    }

    fn finish(&self, failed: bool) -> Result<(), DeviceError> {
        self.backend.note(Logged::Finish { failed });
        let mut violations = Vec::new();
        let mut sim = lock(&self.sim);
        while sim.step(&mut violations) {}
        sim.release_due();
        let stuck = sim.queues.iter().map(VecDeque::len).sum::<usize>();
        if stuck > 0 && !failed && !sim.failed {
            violations.push(format!("{stuck} operations could never run (a wait for an event never recorded)"));
        }
        // What a failed flush left is dropped; gated frees whose events never came with it.
        sim.queues.iter_mut().for_each(VecDeque::clear);
        if !failed && !sim.releases.is_empty() {
            violations.push(format!("{} gated frees never became reusable", sim.releases.len()));
        }
        sim.releases.clear();
        drop(sim);
        for v in violations {
            self.backend.violation(v);
        }
        Ok(())
    }
}

struct RecordingQueue<'f, 'a> {
    flush: &'f RecordingFlush<'a>,
    stream: usize,
}

fn cpu_ptr(buffer: &Buffer) -> *mut u8 {
    match buffer.get::<CpuBuffer>() {
        Some(b) => b.ptr(),
        // The fake device's memory is the CPU's; the walker catches this panic as a bug.
        None => panic!("the recording backend was given another device's buffer: {buffer:?}"),
    }
}

/// wgpu's free: the memory goes back to the pool now, its poison fill runs in issue order.
fn release_now(sim: &mut Sim, buffer: Buffer, poison: bool) {
    if poison && !buffer.is_shared() {
        sim.push(0, Work::Fill { dst: cpu_ptr(&buffer), bytes: buffer.bytes() });
    }
    drop(buffer);
}

impl RecordingQueue<'_, '_> {
    fn single(&self) -> bool {
        self.flush.backend.single
    }

    fn enqueue(&mut self, work: Work) {
        let s = self.stream;
        self.flush.with(|sim, _| sim.push(s, work));
    }

    fn launch_work(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        self.flush.backend.note(Logged::Launch { stream: self.stream });
        self.flush.backend.kernels.fetch_add(1, Ordering::Relaxed);
        let args = call
            .args
            .iter()
            .zip(&call.kernel.args)
            .map(|(b, a)| ArgPtr { ptr: cpu_ptr(b), len: a.len, dtype: a.dtype })
            .collect();
        self.enqueue(Work::Launch { kernel: call.kernel.clone(), args });
        Ok(())
    }
}

impl Queue for RecordingQueue<'_, '_> {
    fn alloc(&mut self, plan: &BufferPlan) -> Result<Buffer, DeviceError> {
        self.flush.backend.note(Logged::Alloc { stream: self.stream });
        // One queue: poison fills are issued work (see `release_now`), not done at the drop.
        let poison = self.flush.poison && !self.single();
        self.flush.backend.memory.alloc_planned(plan, poison)
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<Buffer, DeviceError> {
        self.flush.backend.note(Logged::Upload { stream: self.stream });
        if !self.single() {
            return self.flush.backend.memory.upload(bytes, self.flush.poison);
        }
        // The memory may have been freed by work not run yet: written in issue order.
        let b = self.flush.backend.memory.alloc_unwritten(bytes.len(), false)?;
        self.enqueue(Work::Write { data: bytes.to_vec(), dst: cpu_ptr(&b) });
        Ok(b)
    }

    fn free(&mut self, buffer: Buffer) {
        self.flush.backend.note(Logged::Free { stream: self.stream });
        if self.single() {
            let poison = self.flush.poison;
            self.flush.with(|sim, _| release_now(sim, buffer, poison));
            return;
        }
        self.enqueue(Work::Free(buffer));
    }

    fn record(&mut self, event: EventId) {
        self.flush.backend.note(Logged::Record { stream: self.stream, event });
        let s = self.stream;
        self.flush.with(|sim, violations| {
            if std::mem::replace(&mut sim.record_issued[event.index()], true) {
                violations.push(format!("{event} recorded twice"));
            }
            sim.push(s, Work::Record(event));
        });
    }

    fn wait(&mut self, event: EventId) -> bool {
        self.flush.backend.note(Logged::Wait { stream: self.stream, event });
        let s = self.stream;
        let mut ok = true;
        self.flush.with(|sim, violations| {
            if !sim.record_issued[event.index()] {
                violations.push(format!("stream {s} waits for {event} before its record was issued"));
            }
            ok = !sim.failed;
            sim.push(s, Work::Wait(event));
        });
        ok
    }

    fn copy(&mut self, from: &Buffer, to: &Buffer) -> Result<(), DeviceError> {
        self.flush.backend.note(Logged::Copy { stream: self.stream });
        self.enqueue(Work::Copy { src: cpu_ptr(from), dst: cpu_ptr(to), bytes: from.bytes() });
        Ok(())
    }

    fn launch(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        self.launch_work(call)
    }

    fn library(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        self.launch_work(call)
    }
}
