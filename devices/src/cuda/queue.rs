//! One flush on a CUDA device: the runtime's [`Flush`] and [`Queue`] over lanes
//! (`super::lanes`). Every call only enqueues: a kernel launch (printed entries through
//! [`CudaKernel::launch`], float products through the lane's cuBLAS handle), a copy, an event
//! record or wait. The walker issues each stream's steps on a host thread of its own
//! ([`crate::runtime::Driver::IssueThreads`]), a wait only after its record; the state the
//! queues share (the device's lanes and pools, the flush's events) is behind locks.
//!
//! A flush holds the device's issue lock from `begin` to its end. At `begin`, each stream of
//! the flush waits (on the GPU) for markers at the end of every other lane, so the flush comes
//! after everything enqueued before it (earlier flushes, uploads): the schedule orders only
//! its own steps. At `finish`, a marker at the end of each of its lanes lets the host learn
//! when its work is done (for memory reuse); after a failure, the host waits for the GPU
//! before the walker drops the flush's buffers.
//!
//! Frees: a free step gives the buffer back at its lane's current point (reused at once by
//! that lane, by others once the point is reached); a gated free also waits for the points
//! where its events were recorded (see `super::pools`). A buffer someone else still holds is
//! only let go of; its last holder's drop frees it.
//!
//! A flush opened by [`CudaFlush::record`] captures instead (`super::graph`): the same calls
//! become nodes and edges of a CUDA graph, nothing is counted on a lane, memory the flush
//! allocates or frees stays with the graph, and what a graph cannot hold (uploads, copies from
//! another device, collectives) fails the recording.
//!
//! With `RUST_LOG=braid=debug`, each kernel logs one line (target `braid::kernel`) when it is
//! issued: its label, stream, elements and the time the host took to issue it (the GPU runs it
//! later; [`super::CudaBackend::set_timeline`] measures GPU time).
//!
//! Must never: run anything the schedule does not say, in another order on a stream, or
//! block the host (but after a failure, or when out of memory).

use super::DriverResult;
use super::context::{Event, Stream};
use super::device::CudaBackend;
use super::graph::Recording;
use super::lanes::{LaneId, Marker, Point, lock};
use super::launch::{CudaKernel, LaunchOptions};
use super::memory::copy_async;
use super::pools::{CudaBuffer, Mem};
use crate::runtime::{Backend as _, Call, Flush, Queue};
use crate::{Buffer, DeviceError};
use braid_scheduler::{BufferPlan, EventId, Schedule, Space};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// How a recorded flush captures: relaxed, so that other threads may allocate and query
/// events recorded outside the capture meanwhile.
const CAPTURE_MODE: cudarc::driver::sys::CUstreamCaptureMode =
    cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;

/// One flush: its lanes (by schedule stream), its events, and what went wrong.
pub(crate) struct CudaFlush<'a> {
    backend: &'a CudaBackend,
    _issue: MutexGuard<'a, ()>,
    lanes: Vec<LaneId>,
    events: Vec<Arc<Marker>>,
    /// Where each event was recorded.
    recorded: Mutex<Vec<Option<Point>>>,
    poison: bool,
    failed: AtomicBool,
    error: Mutex<Option<DeviceError>>,
    /// Timing events around each kernel of a profiled flush: (stream index, step, start, end).
    times: Mutex<Vec<(usize, usize, Event, Event)>>,
    /// Set when the flush is recorded into a CUDA graph instead of run (`super::graph`).
    recording: Option<Recording>,
    /// Whether it was planned under a memory budget (it then times no kernel variants, whose
    /// comparison needs memory the plan does not count).
    budgeted: bool,
}

impl<'a> CudaFlush<'a> {
    pub(crate) fn begin(
        backend: &'a CudaBackend,
        schedule: &Schedule,
        poison: bool,
    ) -> Result<CudaFlush<'a>, DeviceError> {
        CudaFlush::open(backend, schedule, poison, false)
    }

    /// A flush whose calls are captured into a CUDA graph rather than run: after the usual
    /// fence, the first lane begins a capture and every other lane joins it (`super::graph`).
    pub(crate) fn record(
        backend: &'a CudaBackend,
        schedule: &Schedule,
        poison: bool,
    ) -> Result<CudaFlush<'a>, DeviceError> {
        let flush = CudaFlush::open(backend, schedule, poison, true)?;
        let rec = flush.recording.as_ref().expect("opened for recording");
        let pools = &backend.pools;
        let origin = pools.stream(rec.origin);
        // Context-wide synchronisations (other devices' on this GPU included) wait until the
        // capture ends (`Recording::end`).
        pools.gpu.capture_begins();
        // SAFETY: the stream is alive; relaxed mode, so that other threads' allocations and
        // queries (of events recorded outside the capture) go on meanwhile.
        let begun = unsafe { cudarc::driver::result::stream::begin_capture(origin.raw(), CAPTURE_MODE) }
            .or_device("cuStreamBeginCapture");
        if let Err(e) = begun {
            pools.gpu.capture_ends();
            return Err(e);
        }
        let fork = rec.events.get();
        let joined = fork.and_then(|fork| {
            fork.event().record(&origin)?;
            for &l in flush.lanes.iter().filter(|&&l| l != rec.origin) {
                pools.stream(l).wait(fork.event())?;
            }
            Ok(())
        });
        if let Err(e) = joined {
            let _ = rec.end(pools, &[], false);
            return Err(e);
        }
        Ok(flush)
    }

    /// The recording of a flush opened by [`CudaFlush::record`], after `finish`.
    pub(crate) fn into_recording(self) -> Recording {
        self.recording.expect("opened for recording")
    }

    fn open(backend: &'a CudaBackend, schedule: &Schedule, poison: bool, recording: bool) -> Result<Self, DeviceError> {
        let issue = lock(&backend.issue);
        let pools = &backend.pools;
        pools.gpu.bind()?;
        let ids: Vec<u32> = schedule.streams.iter().map(|s| s.stream.0).collect();
        let lanes = pools.state().lanes.of_streams(&pools.gpu, &ids)?;
        let recording = recording.then(|| Recording::new(pools, lanes[0]));
        // A capture's events never serve outside it: its own, dropped with it.
        let pool = recording.as_ref().map_or(&pools.events, |r| &r.events);
        let events = (0..schedule.events.len()).map(|_| pool.get()).collect::<Result<Vec<_>, _>>()?;
        let fence = pools.state().lanes.fence(&pools.events)?;
        for &l in &lanes {
            let stream = pools.stream(l);
            for (other, marker) in &fence {
                if *other != l {
                    stream.wait(marker.event())?;
                }
            }
        }
        Ok(CudaFlush {
            backend,
            _issue: issue,
            lanes,
            recorded: Mutex::new(vec![None; events.len()]),
            events,
            poison,
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            times: Mutex::new(Vec::new()),
            recording,
            budgeted: schedule.memory_budget.is_some(),
        })
    }

    /// Keeps the first error for `finish` and fails the flush.
    fn note(&self, e: DeviceError) {
        lock(&self.error).get_or_insert(e);
        self.failed.store(true, Ordering::SeqCst);
    }
}

impl Flush for CudaFlush<'_> {
    fn queue(&self, stream: usize) -> Box<dyn Queue + '_> {
        // The queue is made on the thread that issues its stream: the context is bound there.
        if let Err(e) = self.backend.pools.gpu.bind() {
            self.note(e);
        }
        let lane = self.lanes[stream];
        let braid = self.backend.pools.state().lanes.lanes[lane].braid.unwrap_or(u32::MAX);
        if self.recording.is_some() {
            super::context::issuing_capture(true); // until the queue drops
        }
        Box::new(CudaQueue { flush: self, index: stream, lane, braid, stream: self.backend.pools.stream(lane) })
    }

    fn free_after(&self, buffer: Buffer, stream: usize, after: &[EventId]) {
        if self.recording.is_some() {
            return; // the graph keeps it (reused by nothing: other lanes still read it)
        }
        let Some(b) = buffer.into_arc::<CudaBuffer>() else { return };
        // Another holder frees it when it lets go (gated on everything enqueued by then).
        let Ok(b) = Arc::try_unwrap(b) else { return };
        let recorded = lock(&self.recorded);
        let gate: Option<Vec<(Point, &Marker)>> =
            after.iter().map(|e| recorded[e.index()].map(|p| (p, &*self.events[e.index()]))).collect();
        drop(recorded);
        match gate {
            Some(gate) => {
                if let Err(e) = self.backend.pools.free_on(self.lanes[stream], b, &gate) {
                    self.note(e);
                }
            }
            // The walker hands gated frees over after their records; were one missing, the
            // drop gates the memory on everything enqueued so far instead.
            None => drop(b),
        }
    }

    fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
    }

    /// The GPU times of the kernels of a profiled flush, from their CUDA timing events: waits
    /// for the last of them (profiling makes the read that flushed wait for the GPU).
    fn device_times(&self) -> Option<Vec<(usize, usize, std::time::Duration, std::time::Duration)>> {
        let times = std::mem::take(&mut *lock(&self.times));
        let (_, _, first, _) = times.first()?;
        let ms = |e: &Event| e.elapsed_ms_since(first).ok().map(|ms| f64::from(ms.max(0.0)));
        times.iter().try_for_each(|(_, _, _, end)| end.synchronize()).ok()?;
        let secs = |ms: f64| std::time::Duration::from_secs_f64(ms / 1e3);
        let spans = times.iter().filter_map(|(s, at, start, end)| {
            let (from, to) = (ms(start)?, ms(end)?);
            Some((*s, *at, secs(from), secs((to - from).max(0.0))))
        });
        Some(spans.collect())
    }

    fn finish(&self, failed: bool) -> Result<(), DeviceError> {
        let pools = &self.backend.pools;
        // Choices this flush made go to the GPU's file (nothing is written when none was).
        self.backend.tuner.save();
        if let Some(rec) = &self.recording {
            // Nothing ran: the capture ends (always, so the lanes leave capture mode).
            let ok = !failed && !self.failed.load(Ordering::SeqCst);
            let ended = rec.end(pools, &self.lanes, ok);
            if let Some(e) = lock(&self.error).take() {
                return Err(e);
            }
            return ended;
        }
        let mut ended = Ok(());
        for &l in &self.lanes {
            let marker = pools.events.get().and_then(|m| pools.state().lanes.record(l, m));
            if let Err(e) = marker {
                ended = Err(e);
            }
        }
        if failed || self.failed.load(Ordering::SeqCst) || ended.is_err() {
            // The walker drops the flush's buffers next: nothing queued may still use them.
            let waited = pools.quiesce();
            if let Some(e) = lock(&self.error).take() {
                return Err(e);
            }
            ended?;
            return waited;
        }
        Ok(())
    }
}

/// One stream of a flush: its lane.
struct CudaQueue<'f, 'a> {
    flush: &'f CudaFlush<'a>,
    /// The schedule stream this queue issues.
    index: usize,
    lane: LaneId,
    braid: u32,
    stream: Arc<Stream>,
}

impl Drop for CudaQueue<'_, '_> {
    fn drop(&mut self) {
        if self.flush.recording.is_some() {
            super::context::issuing_capture(false);
        }
    }
}

/// The CUDA buffer of this device that `buffer` is.
fn cuda_buffer<'b>(flush: &CudaFlush<'_>, buffer: &'b Buffer) -> Result<&'b CudaBuffer, DeviceError> {
    match buffer.get::<CudaBuffer>() {
        Some(b) if Arc::ptr_eq(b.pools(), &flush.backend.pools) => Ok(b),
        _ => Err(DeviceError::Internal(format!("a kernel or copy of {} given {buffer:?}", flush.backend.name()))),
    }
}

impl CudaQueue<'_, '_> {
    /// Launches a kernel (printed entries, a cuBLAS product first for a float product) and
    /// logs it.
    fn run(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        let backend = self.flush.backend;
        let pools = &backend.pools;
        let label = || call.describe();
        let compiled = backend.prepared(call.kernel).map_err(|e| e.in_kernel(&label()))?;
        let args =
            call.args.iter().map(|b| cuda_buffer(self.flush, b).map(|b| b.addr())).collect::<Result<Vec<u64>, _>>()?;
        let blas = if compiled.needs_blas() { Some(pools.blas(self.lane)?) } else { None };
        pools.gpu.bind()?;
        if let Some(rec) = &self.flush.recording {
            return self.capture(rec, call, &compiled, blas.as_deref(), &args);
        }
        let options = match compiled.variants() {
            None => LaunchOptions::default(),
            Some(v) => {
                let tuning = super::tune::Tuning {
                    may_time: !self.flush.budgeted,
                    tuner: &backend.tuner,
                    compiler: &backend.compiler,
                    pools,
                    lane: self.lane,
                    stream: &self.stream,
                };
                // While tuning, a cuBLASLt algorithm that cannot run is a rejected candidate.
                let _strict = super::blas_lt::Strict::enter();
                // SAFETY: every argument is a live buffer of this device holding the kernel's
                // length (the walker checked the sizes and holds them for the call); the
                // schedule's events order every other access to them around this point of the
                // stream. Tuning launches the kernel on them (and its own scratch) first.
                unsafe { super::tune::options(&tuning, &compiled, v, blas.as_deref(), &args) }
            }
        };
        compiled.prepare(&backend.compiler, options).map_err(|e| e.in_kernel(&label()))?;
        let logged = tracing::enabled!(target: "braid::kernel", tracing::Level::DEBUG);
        let t0 = logged.then(Instant::now);
        let span = if call.timed || backend.timeline.on.load(Ordering::Relaxed) {
            let (start, end) = (Event::timing(&pools.gpu)?, Event::timing(&pools.gpu)?);
            start.record(&self.stream)?;
            Some((start, end))
        } else {
            None
        };
        // Taken last, so that no error leaves it unreturned.
        let scratch = match compiled.scratch_bytes_with(options) {
            0 => None,
            n => Some(pools.slice(Some(self.lane), n, Mem::Device, false)?),
        };
        let addr = scratch.as_ref().map_or(0, |s| s.addr);
        // SAFETY: as above; the scratch slice is the kernel's until the stream passes the
        // launch.
        let launched = unsafe { compiled.launch(self.stream.raw(), blas.as_deref(), &args, addr, options) };
        pools.bump(self.lane);
        if let Some(s) = scratch {
            let gate = vec![pools.state().lanes.point(self.lane)];
            pools.give(s, Mem::Device, false, gate, false);
        }
        launched.map_err(|e| e.in_kernel(&label()))?;
        if let Some((start, end)) = span {
            end.record(&self.stream)?;
            if call.timed {
                lock(&self.flush.times).push((self.index, call.step, start, end));
            } else {
                lock(&backend.timeline.spans).push((label(), self.braid, start, end));
            }
        }
        backend.launched.fetch_add(1, Ordering::Relaxed);
        if let Some(t0) = t0 {
            tracing::debug!(
                target: "braid::kernel",
                "{} s{} {} elems issued in {:.1} us (cuda: host issue time; the GPU runs it later)",
                label(),
                call.stream,
                call.kernel.output_elements(),
                t0.elapsed().as_secs_f64() * 1e6,
            );
        }
        Ok(())
    }

    /// Captures a kernel into the flush's graph: its scratch is kept by the graph, and nothing
    /// is counted (it runs when the graph is launched).
    fn capture(
        &self,
        rec: &Recording,
        call: &Call<'_>,
        compiled: &Arc<CudaKernel>,
        blas: Option<&super::Blas>,
        args: &[u64],
    ) -> Result<(), DeviceError> {
        let backend = self.flush.backend;
        let pools = &backend.pools;
        // A graph runs the variant chosen already (the capture's eager flush tuned it).
        let options = (compiled.variants())
            .map_or(LaunchOptions::default(), |v| v.options[backend.tuner.chosen(&v.key, &v.variants)]);
        compiled.prepare(&backend.compiler, options).map_err(|e| e.in_kernel(&call.describe()))?;
        let scratch = match compiled.scratch_bytes_with(options) {
            0 => 0,
            n => rec.alloc(pools, self.lane, n, Mem::Device, false, false)?.addr(),
        };
        // SAFETY: as for a launch; the stream is capturing, so this only adds graph nodes, and
        // the graph keeps the argument and scratch memory for as long as it lives.
        unsafe { compiled.launch(self.stream.raw(), blas, args, scratch, options) }
            .map_err(|e| e.in_kernel(&call.describe()))?;
        lock(&rec.kernels).push(compiled.clone());
        Ok(())
    }

    /// `Err` for what a recorded flush cannot do.
    fn not_while_recording(&self, what: &str) -> Result<(), DeviceError> {
        match self.flush.recording {
            Some(_) => Err(DeviceError::Unavailable(format!("{what} cannot be recorded into a CUDA graph"))),
            None => Ok(()),
        }
    }
}

impl Queue for CudaQueue<'_, '_> {
    fn alloc(&mut self, plan: &BufferPlan) -> Result<Buffer, DeviceError> {
        let mem = match plan.space {
            Space::Device => Mem::Device,
            Space::Host => Mem::Pinned,
            Space::Remote => {
                return Err(DeviceError::Internal("another device's buffer is never allocated here".into()));
            }
        };
        let exact = plan.persistent && mem == Mem::Device;
        let pools = &self.flush.backend.pools;
        if let Some(rec) = &self.flush.recording {
            return Ok(Buffer::new(rec.alloc(pools, self.lane, plan.bytes, mem, exact, self.flush.poison)?));
        }
        let b = pools.buffer(Some(self.lane), plan.bytes, mem, exact, self.flush.poison)?;
        Ok(Buffer::new(Arc::new(b)))
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<Buffer, DeviceError> {
        self.not_while_recording("host data uploaded at its first use")?;
        let pools = &self.flush.backend.pools;
        let b = pools.buffer(Some(self.lane), bytes.len(), Mem::Device, false, self.flush.poison)?;
        pools.write(self.lane, b.addr(), bytes.len(), |dst| {
            dst.copy_from_slice(bytes);
            Ok(())
        })?;
        // Host data is uploaded by the stream that uses it first, and the schedule orders no
        // other stream after that copy: every other lane of the flush waits for it here, so
        // its later work (the reads, issued once the walker hands it this buffer) comes after.
        // Without this, a read on another lane could see the pool's poison (found on the H100:
        // a scalar read by two streams came back NaN).
        if self.flush.lanes.len() > 1 {
            let marker = pools.events.get()?;
            pools.state().lanes.record(self.lane, marker.clone())?;
            for &l in self.flush.lanes.iter().filter(|&&l| l != self.lane) {
                pools.stream(l).wait(marker.event())?;
            }
        }
        Ok(Buffer::new(Arc::new(b)))
    }

    fn free(&mut self, buffer: Buffer) {
        let Some(b) = buffer.into_arc::<CudaBuffer>() else { return };
        if let Some(rec) = &self.flush.recording {
            // Only this lane used it: a later allocation on the lane may take it.
            lock(&rec.spare).push((self.lane, b));
            return;
        }
        let Ok(b) = Arc::try_unwrap(b) else { return };
        if let Err(e) = self.flush.backend.pools.free_on(self.lane, b, &[]) {
            self.flush.note(e);
        }
    }

    fn record(&mut self, event: EventId) {
        let marker = self.flush.events[event.index()].clone();
        if self.flush.recording.is_some() {
            // An edge of the graph: no marker for the pools (the capture runs nothing).
            if let Err(e) = marker.event().record(&self.stream) {
                self.flush.note(e);
            }
            return;
        }
        let mut st = self.flush.backend.pools.state();
        let point = st.lanes.point(self.lane);
        let recorded = st.lanes.record(self.lane, marker);
        drop(st);
        match recorded {
            Ok(()) => lock(&self.flush.recorded)[event.index()] = Some(point),
            Err(e) => self.flush.note(e),
        }
    }

    fn wait(&mut self, event: EventId) -> bool {
        if self.flush.failed.load(Ordering::SeqCst) {
            return false;
        }
        match self.stream.wait(self.flush.events[event.index()].event()) {
            Ok(()) => true,
            Err(e) => {
                self.flush.note(e);
                false
            }
        }
    }

    fn copy(&mut self, from: &Buffer, to: &Buffer) -> Result<(), DeviceError> {
        let pools = &self.flush.backend.pools;
        let dst = cuda_buffer(self.flush, to)?;
        match from.get::<CudaBuffer>() {
            Some(src) if Arc::ptr_eq(src.pools(), pools) => {
                pools.gpu.bind()?;
                // SAFETY: both buffers are live (held by the walker for the step), of equal
                // size (checked by the walker), and the schedule orders their other accesses
                // around this point of the stream.
                let r = unsafe { copy_async(dst.addr(), src.addr(), dst.bytes(), self.stream.raw()) };
                if self.flush.recording.is_none() {
                    pools.bump(self.lane);
                }
                r
            }
            // Another device's buffer: read (once its writer is done) into pinned staging,
            // then copied up on this stream.
            _ => {
                self.not_while_recording("a copy from another device")?;
                pools.write(self.lane, dst.addr(), dst.bytes(), |staging| from.read_into(staging))
            }
        }
    }

    fn launch(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        self.run(call)
    }

    fn library(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        self.run(call)
    }

    /// NCCL, on this stream's lane, once every rank has arrived at the group's rendezvous.
    #[cfg(feature = "nccl")]
    fn collective(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        let braid_lowering::Body::Collective(c) = &call.kernel.body else {
            return Err(DeviceError::Internal(format!("{} is not a collective", call.describe())));
        };
        self.not_while_recording("a collective")?;
        let group = crate::collective::group(c)?;
        let (input, output) = (cuda_buffer(self.flush, &call.args[0])?, cuda_buffer(self.flush, &call.args[1])?);
        let dtype = call.kernel.args[0].dtype;
        let count = call.kernel.args[0].len;
        let arrival = group.arrive(c.rank, c, dtype, count, (input.addr() as usize, input.bytes()))?;
        // NCCL moves the data on the GPUs: the host reads no rank's input. Ranks in other
        // processes say they arrived (or failed) through the group's connection first.
        group.finish(arrival.seq);
        if let Some(net) = group.net() {
            net.exchange(arrival.seq, &[]).inspect_err(|e| group.break_with(e.to_string()))?;
        }
        let pools = &self.flush.backend.pools;
        pools.gpu.bind()?;
        let span = if call.timed {
            let (start, end) = (Event::timing(&pools.gpu)?, Event::timing(&pools.gpu)?);
            start.record(&self.stream)?;
            Some((start, end))
        } else {
            None
        };
        // SAFETY: both buffers are live (held by the walker for the step) with the lengths the
        // collective implies (checked by the walker against the kernel's arguments); the
        // schedule orders every other access to them around this point of the stream.
        let r =
            unsafe { super::nccl::enqueue(&group, c, dtype, count, input.addr(), output.addr(), self.stream.raw()) };
        pools.bump(self.lane);
        r.map_err(|e| e.in_kernel(&call.describe()))?;
        if let Some((start, end)) = span {
            end.record(&self.stream)?;
            lock(&self.flush.times).push((self.index, call.step, start, end));
        }
        self.flush.backend.launched.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
