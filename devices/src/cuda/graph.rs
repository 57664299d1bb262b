//! CUDA graphs for replayed steps: a flush's schedule recorded once by stream capture
//! ([`record`]) and then run with one `cuGraphLaunch` per replay ([`CudaGraph`]), so that a
//! step of many small kernels costs the host one launch instead of one per kernel.
//!
//! Recording runs the ordinary walker over a flush in *recording* mode (`super::queue`): the
//! flush's first lane (the *origin*) begins a capture, every other lane joins it by waiting
//! for an event recorded there, and each queue call is captured instead of run. Kernels and
//! cuBLAS calls become graph nodes, the schedule's records and waits become edges, and at the
//! end every lane joins the origin again. Nothing runs on the GPU, no lane counts an
//! operation, and no marker is recorded (the pools learn nothing from a capture).
//!
//! A graph bakes in addresses, so it owns the memory it was recorded with (a [`Recording`]):
//! every buffer allocated while recording, reused only by a later allocation of the same size
//! on the same lane after an ungated free (stream order inside the graph keeps that safe);
//! kernel scratch; the input and output buffers; and the compiled kernels, whose modules stay
//! loaded. An input the caller binds (`record`'s `bound`: a step's weights, the same buffer
//! at every call) is read where it is instead: the graph holds that buffer, and a launch given
//! another one for it is [`GraphRun::Stale`] (recorded again by the caller). The memory is held while the graph lives and counts as in use. cuBLAS workspaces
//! are the lanes' own: once `Device::trim_memory` gives them back, a graph is stale.
//!
//! A launch is ordered like a flush: the origin lane waits for the end of every other lane,
//! the inputs not bound are copied into the graph's input buffers, the graph runs, each output is copied
//! into a fresh buffer (the caller may still hold an earlier launch's outputs; but an output
//! written over a bound input in place, a step's argument it updates, is that input), and a marker at
//! the end tells the pools when it is done. Later flushes wait for that marker.
//!
//! What is not recorded ([`record`] says `None`, and the plan runs as a flush): schedules of
//! one kernel, with collectives, uploads at first use or other devices' buffers, whose
//! buffers total more than [`GRAPH_MAX_BYTES`]; flushes that are profiled or have a failure
//! injected, or whose first replay comes while the device's kernel timeline is on; and any
//! schedule while graphs are off (`BRAID_CUDA_GRAPHS=0`, `CudaBackend::set_graphs`). A graph
//! recorded earlier does not launch while the timeline is on (the plan runs as a flush).
//!
//! While a capture is in progress, context-wide synchronisations of the GPU (any device's on
//! it: `cuCtxSynchronize`, chunk frees) wait for it to end (`Gpu::quiet`), since the driver
//! refuses them during a capture; on the threads issuing the capture they fail at once, which
//! fails the recording (and the plan runs as a flush).
//!
//! Must never: launch a graph whose memory was given back, or let anything but the graph use
//! the memory it owns.

use super::device::CudaBackend;
use super::lanes::{EventPool, LaneId, lock};
use super::launch::CudaKernel;
use super::memory::copy_async;
use super::pools::{CudaBuffer, CudaPools, Mem};
use super::queue::CudaFlush;
use super::{DriverResult, TRACE_TARGET};
use crate::runtime::{Backend, Driver, Graph, GraphRun, Input, Job, execute_on};
use crate::{Buffer, DeviceError};
use braid_scheduler::Space;
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Schedules whose buffers total more than this are not recorded: a graph keeps all its
/// intermediates (not only the plan's peak), and a step of large tensors is bound by its
/// kernels' time, not by launching them.
pub const GRAPH_MAX_BYTES: u64 = 256 << 20;

/// An instantiated graph (`CUgraphExec`), destroyed on drop.
struct Exec(sys::CUgraphExec);

// SAFETY: a graph exec is a driver handle usable from any thread bound to its context; launches
// are serialised by the device's issue lock.
unsafe impl Send for Exec {}
unsafe impl Sync for Exec {}

/// What a flush in recording mode collects: the memory and kernels the graph will own.
pub(crate) struct Recording {
    /// The lane the capture starts and ends on, and graphs are launched on.
    pub(crate) origin: LaneId,
    /// Events of the capture (fork, joins, the schedule's events): never used outside it.
    pub(crate) events: Arc<EventPool>,
    /// Every buffer allocated while recording.
    pub(crate) kept: Mutex<Vec<Arc<CudaBuffer>>>,
    /// Buffers freed without a gate, by lane: a later allocation of the same size on that lane
    /// takes one.
    pub(crate) spare: Mutex<Vec<(LaneId, Arc<CudaBuffer>)>>,
    pub(crate) kernels: Mutex<Vec<Arc<CudaKernel>>>,
    /// The instantiated graph, once the capture ended well.
    exec: Mutex<Option<Exec>>,
}

impl Recording {
    pub(crate) fn new(pools: &CudaPools, origin: LaneId) -> Recording {
        Recording {
            origin,
            events: EventPool::new(&pools.gpu),
            kept: Mutex::new(Vec::new()),
            spare: Mutex::new(Vec::new()),
            kernels: Mutex::new(Vec::new()),
            exec: Mutex::new(None),
        }
    }

    /// A buffer for an allocation on `lane` while recording: a spare one of the same kind, or a
    /// new one the graph keeps.
    pub(crate) fn alloc(
        &self,
        pools: &Arc<CudaPools>,
        lane: LaneId,
        bytes: usize,
        mem: Mem,
        exact: bool,
        poison: bool,
    ) -> Result<Arc<CudaBuffer>, DeviceError> {
        let mut spare = lock(&self.spare);
        let fits = |(l, b): &(LaneId, Arc<CudaBuffer>)| {
            *l == lane && b.bytes() == bytes && b.is_pinned() == (mem == Mem::Pinned) && b.is_exact() == exact
        };
        if let Some(i) = spare.iter().position(fits) {
            return Ok(spare.swap_remove(i).1);
        }
        drop(spare);
        let b = Arc::new(pools.buffer(Some(lane), bytes, mem, exact, poison)?);
        lock(&self.kept).push(b.clone());
        Ok(b)
    }

    /// Ends the capture on `origin` (every other lane of `lanes` joined back first) and
    /// instantiates the graph; `ok` says whether every captured call succeeded.
    pub(crate) fn end(&self, pools: &CudaPools, lanes: &[LaneId], ok: bool) -> Result<(), DeviceError> {
        let origin = pools.stream(self.origin);
        let mut joined = pools.gpu.bind();
        for &l in lanes.iter().filter(|&&l| l != self.origin) {
            let join = self.events.get().and_then(|m| {
                m.event().record(&pools.stream(l))?;
                origin.wait(m.event())
            });
            joined = joined.and(join);
        }
        // SAFETY: the origin stream is alive and capturing (begun by `CudaFlush::record`).
        let ended = unsafe { cu::stream::end_capture(origin.raw()) }.or_device("cuStreamEndCapture");
        // On every path: context-wide synchronisations wait for this count to reach 0.
        pools.gpu.capture_ends();
        let graph = match ended {
            Ok(g) => g,
            Err(e) => return Err(joined.err().unwrap_or(e)),
        };
        let instantiated = if ok && joined.is_ok() {
            // SAFETY: `graph` is the valid graph the capture just produced.
            unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }.or_device("cuGraphInstantiate")
        } else {
            Err(joined.err().unwrap_or_else(|| DeviceError::Internal("a captured step failed".into())))
        };
        // SAFETY: the graph is ours; an instantiated exec does not need it.
        let _ = unsafe { cu::graph::destroy(graph) };
        *lock(&self.exec) = Some(Exec(instantiated?));
        Ok(())
    }
}

/// Where a graph reads one of its inputs.
enum GraphInput {
    /// Its own buffer, which each launch fills with a copy of the input.
    Copied(Arc<CudaBuffer>),
    /// The caller's buffer, read in place (held, so its memory is never reused meanwhile).
    Bound(Arc<CudaBuffer>),
}

/// Where a graph leaves one of its outputs.
enum GraphOutput {
    /// Its own buffer, copied into a fresh one at each launch.
    Own(Arc<CudaBuffer>),
    /// Bound input `i`, written over in place (a step's argument it updates): the output is the
    /// caller's buffer itself, and the graph holds it only as that input (so that the caller can
    /// tell who else holds it).
    Input(usize),
}

/// A recorded schedule: one `cuGraphLaunch` per replay (see the module docs).
pub(crate) struct CudaGraph {
    pools: Arc<CudaPools>,
    exec: Exec,
    origin: LaneId,
    inputs: Vec<GraphInput>,
    outputs: Vec<GraphOutput>,
    /// The memory and kernels the graph refers to (held, never used by anything else).
    _kept: Vec<Arc<CudaBuffer>>,
    _kernels: Vec<Arc<CudaKernel>>,
    /// braid kernels one launch runs (what `kernels_launched` counts).
    kernel_count: u64,
    /// `CudaPools::blas_epoch` when recorded: the workspaces it uses are given back once it moves.
    epoch: u64,
    poison: bool,
}

/// Records `job`'s schedule into a CUDA graph on `backend`, reading input `i` in place from
/// `bound[i]` where given (see the module docs for what is not recorded: `None`).
pub(crate) fn record(
    backend: &CudaBackend,
    job: Job<'_>,
    bound: &[Option<Buffer>],
) -> Option<Result<Box<dyn Graph>, DeviceError>> {
    let s = job.schedule;
    // Bound inputs are the caller's memory, not the graph's.
    let bound_bytes: u64 = (s.external_buffers.iter().zip(bound))
        .filter(|(_, b)| b.is_some())
        .map(|(&b, _)| s.buffers[b.index()].bytes as u64)
        .sum();
    let recordable = backend.graphs.load(Ordering::Relaxed)
        && !backend.timeline.on.load(Ordering::Relaxed)
        && job.profile.is_none()
        && job.fail_at.is_none()
        && s.kernels.len() >= 2
        && !job.kernels.iter().any(|k| matches!(k.body, braid_lowering::Body::Collective(_)))
        && !s.buffers.iter().any(|b| b.upload_at_first_use || b.space == Space::Remote)
        && s.buffers.iter().map(|b| b.bytes as u64).sum::<u64>() - bound_bytes <= GRAPH_MAX_BYTES;
    recordable.then(|| record_now(backend, job, bound))
}

fn record_now(backend: &CudaBackend, job: Job<'_>, bound: &[Option<Buffer>]) -> Result<Box<dyn Graph>, DeviceError> {
    let pools = &backend.pools;
    let s = job.schedule;
    pools.gpu.bind()?;
    let mem = |space: Space| if space == Space::Host { Mem::Pinned } else { Mem::Device };
    let inputs = (s.external_buffers.iter().enumerate().map(|(i, b)| (i, &s.buffers[b.index()])))
        .map(|(i, p)| {
            // A bound input of this device, of the planned size and in device memory.
            let caller = bound.get(i).and_then(Option::as_ref).and_then(|b| b.arc::<CudaBuffer>());
            match caller {
                Some(b) if Arc::ptr_eq(b.pools(), pools) && b.bytes() == p.bytes && p.space != Space::Host => {
                    Ok(GraphInput::Bound(b))
                }
                _ => pools
                    .buffer(None, p.bytes, mem(p.space), false, job.poison)
                    .map(|b| GraphInput::Copied(Arc::new(b))),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let epoch = pools.blas_epoch();
    let flush = CudaFlush::record(backend, s, job.poison)?;
    let externals = inputs.iter().map(|i| Input::Buffer(Buffer::new(i.buffer().clone()))).collect();
    let (outputs, _held) = execute_on(Driver::IssueThreads, &flush, Job { externals, ..job });
    let recording = flush.into_recording();
    let outputs = outputs?
        .into_iter()
        .map(|b| {
            let described = format!("{b:?}");
            b.into_arc::<CudaBuffer>()
                .ok_or_else(|| DeviceError::Internal(format!("a recorded step's output is {described}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let exec = lock(&recording.exec).take().ok_or_else(|| DeviceError::Internal("no graph was recorded".into()))?;
    let kernels = std::mem::take(&mut *lock(&recording.kernels));
    let kept = std::mem::take(&mut *lock(&recording.kept));
    let copied = inputs.iter().filter_map(|i| match i {
        GraphInput::Copied(b) => Some(b),
        GraphInput::Bound(_) => None,
    });
    let bytes: usize = kept.iter().chain(copied).map(|b| b.bytes()).sum();
    tracing::debug!(
        target: TRACE_TARGET,
        kernels = kernels.len(),
        bytes,
        bound = inputs.iter().filter(|i| matches!(i, GraphInput::Bound(_))).count(),
        streams = s.streams.len(),
        "recorded a step into a CUDA graph"
    );
    let outputs = (outputs.into_iter())
        .map(|o| match inputs.iter().position(|i| matches!(i, GraphInput::Bound(b) if Arc::ptr_eq(b, &o))) {
            Some(i) => GraphOutput::Input(i),
            None => GraphOutput::Own(o),
        })
        .collect();
    Ok(Box::new(CudaGraph {
        pools: pools.clone(),
        exec,
        origin: recording.origin,
        inputs,
        outputs,
        kernel_count: kernels.len() as u64,
        _kept: kept,
        _kernels: kernels,
        epoch,
        poison: job.poison,
    }))
}

impl Graph for CudaGraph {
    fn launch(&self, backend: &dyn Backend, inputs: &[Buffer]) -> Result<GraphRun, DeviceError> {
        let backend = match backend.as_any().downcast_ref::<CudaBackend>() {
            Some(b) if Arc::ptr_eq(&b.pools, &self.pools) => b,
            _ => return Err(DeviceError::Internal("a CUDA graph launched on another device".into())),
        };
        if backend.timeline.on.load(Ordering::Relaxed) {
            return Ok(GraphRun::NotNow);
        }
        let pools = &self.pools;
        let _issue = lock(&backend.issue);
        if pools.blas_epoch() != self.epoch {
            return Ok(GraphRun::Stale);
        }
        if inputs.len() != self.inputs.len() {
            return Err(DeviceError::Internal(format!(
                "a graph of {} inputs given {}",
                self.inputs.len(),
                inputs.len()
            )));
        }
        // Another buffer for a bound input: the graph reads the old one; record it again.
        let rebound = self.inputs.iter().zip(inputs).any(|(slot, input)| match slot {
            GraphInput::Bound(b) => !input.get::<CudaBuffer>().is_some_and(|i| std::ptr::eq(i, &**b)),
            GraphInput::Copied(_) => false,
        });
        if rebound {
            return Ok(GraphRun::Stale);
        }
        pools.gpu.bind()?;
        let origin = pools.stream(self.origin);
        let fence = pools.state().lanes.fence(&pools.events)?;
        for (l, m) in &fence {
            if *l != self.origin {
                origin.wait(m.event())?;
            }
        }
        let copy = |to: &CudaBuffer, from: &CudaBuffer| -> Result<(), DeviceError> {
            if to.bytes() == 0 {
                return Ok(());
            }
            // SAFETY: both buffers are live (held by the caller and the graph) and of equal
            // size; the origin lane comes after every earlier user of either (the fence, or
            // stream order for the graph's own buffers and fresh outputs).
            let r = unsafe { copy_async(to.addr(), from.addr(), to.bytes(), origin.raw()) };
            pools.bump(self.origin);
            r
        };
        for (slot, input) in self.inputs.iter().zip(inputs) {
            let GraphInput::Copied(slot) = slot else { continue };
            match input.get::<CudaBuffer>() {
                Some(b) if Arc::ptr_eq(b.pools(), pools) && b.bytes() == slot.bytes() => copy(slot, b)?,
                _ => {
                    return Err(DeviceError::Internal(format!(
                        "a graph input of {} bytes given {input:?}",
                        slot.bytes()
                    )));
                }
            }
        }
        // SAFETY: the exec is alive and its memory is held by `self`; the inputs are in place.
        let launched = unsafe { cu::graph::launch(self.exec.0, origin.raw()) }.or_device("cuGraphLaunch");
        pools.bump(self.origin);
        launched?;
        let mut outputs = Vec::with_capacity(self.outputs.len());
        for slot in &self.outputs {
            let slot = match slot {
                GraphOutput::Own(slot) => slot,
                GraphOutput::Input(i) => {
                    // Written over the caller's buffer, which the caller gave up for it.
                    outputs.push(inputs[*i].clone());
                    continue;
                }
            };
            let mem = if slot.is_pinned() { Mem::Pinned } else { Mem::Device };
            let fresh = pools.buffer(Some(self.origin), slot.bytes(), mem, false, self.poison)?;
            copy(&fresh, slot)?;
            outputs.push(Buffer::new(Arc::new(fresh)));
        }
        // A marker at the end: the pools learn when the graph's memory and the inputs are free.
        let marker = pools.events.get()?;
        pools.state().lanes.record(self.origin, marker)?;
        backend.launched.fetch_add(self.kernel_count, Ordering::Relaxed);
        backend.graph_launches.fetch_add(1, Ordering::Relaxed);
        Ok(GraphRun::Ran(outputs))
    }
}

impl GraphInput {
    fn buffer(&self) -> &Arc<CudaBuffer> {
        match self {
            GraphInput::Copied(b) | GraphInput::Bound(b) => b,
        }
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if self.pools.gpu.bind().is_ok() {
            // SAFETY: the exec is ours; the driver frees it once launches in flight are done,
            // and the memory it uses is gated on every lane's point when dropped after it.
            let _ = unsafe { cu::graph::exec_destroy(self.exec.0) };
        }
    }
}
