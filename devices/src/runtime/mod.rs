//! The device runtime every backend shares: one walker over a [`Schedule`] that handles
//! buffers, uploads of host data, donated inputs, gated frees and failures, over a small
//! [`Queue`] per stream that each backend implements.
//!
//! A backend writes three things: a [`Backend`] (its memory, uploads and downloads, and what it
//! is like: its [`Target`]), a [`Flush`] (the events of one flush) and a [`Queue`] (one stream of
//! one flush: allocate, free, free after events, record, wait, copy, launch a kernel, run a
//! library call). It says how its queues are driven ([`Driver`]): the CPU runs each stream on a
//! thread and its queues do the work before returning; GPU backends' queues only enqueue, each
//! stream issued on a thread of its own (CUDA) or all of them by one thread (wgpu), and a wait
//! is issued only after its event's record. Everything else (which buffer is where, when host data is uploaded, when a
//! gated free may go ahead, what happens when a step fails) is the walker's ([`execute`]), so it
//! is written once and tested once, with a recording queue, for every backend.
//!
//! A backend may also record a schedule into a device graph ([`Backend::record_graph`], CUDA
//! graphs) that a replayed step launches with one call; the walker records it too
//! ([`execute_on`] over a flush in recording mode).
//!
//! The runtime runs what the schedule says, in its order; it never plans, fuses or reorders.

pub mod buffer;
pub mod pool;
pub mod registry;
pub mod tune;
mod walk;
mod workers;

pub use walk::{execute, execute_on};

use crate::collective::RankGroup;
use crate::collective::net::TOKEN_BYTES;
use crate::{Buffer, DeviceError, MemoryStats};
use braid_graph::Target;
use braid_lowering::Kernel;
use braid_scheduler::{BufferPlan, EventId, KernelId, Schedule};
use std::sync::Arc;

/// When a device compiles kernels to machine code (the CPU: through the system's C compiler,
/// `crate::cpu::native`). Compiled or interpreted, a kernel computes the same bits (but for
/// the payload of a NaN). `BRAID_CPU_COMPILE=off|background|blocking` sets it when a CPU device
/// is created (`CompileMode::from_env`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompileMode {
    /// Never: every kernel is interpreted.
    Off,
    /// In the background (the default): a kernel's first runs are interpreted while it
    /// compiles; later runs use the compiled code once it is ready.
    Background,
    /// Before a kernel's first run, which waits for the compiler (for benchmarks and tests).
    Blocking,
}

/// How the walker drives the streams of a flush.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Driver {
    /// Each stream's steps are issued on a thread of their own (the first stream's on the
    /// calling thread), and a queue does its work before returning: a wait blocks until the
    /// event is recorded, and an event is recorded once the work before it is done. The CPU.
    Threads,
    /// One thread issues every stream's steps, in an order where each event's record is issued
    /// before any wait for it; queues enqueue work and return at once (wgpu submissions, whose
    /// one queue takes work from one thread). A wait is issued only after its record.
    Interleaved,
    /// Each stream's steps are issued on a thread of their own (the first stream's on the
    /// calling thread) and queues enqueue work and return at once (CUDA streams); the walker
    /// holds a wait back until its record has been issued. When issuing costs more host time
    /// than the device takes to run the work (many small kernels), streams are issued in
    /// parallel instead of taking turns on one thread.
    IssueThreads,
}

/// A device runtime: its memory, host transfers, and one [`Flush`] per executed schedule.
pub trait Backend: Send + Sync {
    /// The device's name in messages and dumps (`cpu`, `cuda:0`, ...).
    fn name(&self) -> String;
    /// What the device is like, for fusion, scheduling and lowering.
    fn target(&self) -> &Target;
    /// How the walker drives this backend's queues.
    fn driver(&self) -> Driver;
    /// Starts executing `schedule`: its events and one queue per stream. With `poison`, memory
    /// freed by the flush is filled with 0xFF bytes (NaN for floats) before it is reused.
    fn begin<'a>(&'a self, schedule: &'a Schedule, poison: bool) -> Result<Box<dyn Flush + 'a>, DeviceError>;
    /// Copies host bytes into a new device buffer (poisoned when freed if `poison`).
    fn upload(&self, bytes: &[u8], poison: bool) -> Result<Buffer, DeviceError>;
    /// Copies a buffer's bytes to the host, once the work that writes it is done.
    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, DeviceError>;
    /// [`Backend::download`] into `dst` (exactly the buffer's length), without allocating
    /// where the backend can (reading one value, above all).
    fn download_into(&self, buffer: &Buffer, dst: &mut [u8]) -> Result<(), DeviceError> {
        let bytes = self.download(buffer)?;
        if bytes.len() != dst.len() {
            return Err(DeviceError::Internal(format!("a download of {} bytes into {}", bytes.len(), dst.len())));
        }
        dst.copy_from_slice(&bytes);
        Ok(())
    }
    /// Blocks until the work enqueued on the device so far is done, and reports a failure
    /// that happened meanwhile (`Device::sync`, `Event::synchronize`). A backend whose flushes
    /// do their work before they return (the CPU) has nothing to wait for.
    fn synchronize(&self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Device memory: bytes in live buffers, the peak since the last reset, bytes reserved.
    fn memory(&self) -> MemoryStats;
    fn reset_peak(&self);
    /// Kernels run since the device was created.
    fn kernels_launched(&self) -> u64;
    /// Returns cached free memory to the system.
    fn trim(&self);
    /// Bytes of device memory holding parameters (exact-size memory).
    fn persistent_memory(&self) -> u64 {
        0
    }
    /// Sets when the device compiles kernels to machine code, where it has that choice (the
    /// CPU; GPU backends always compile, and ignore it).
    fn set_compile_mode(&self, mode: CompileMode) {
        let _ = mode;
    }
    /// Kernels run as compiled machine code (the CPU's, see [`CompileMode`]; 0 elsewhere).
    fn compiled_kernels_launched(&self) -> u64 {
        0
    }
    /// The backend as `Any`: how a test or a backend's own code reaches its concrete type (the
    /// engine never does).
    fn as_any(&self) -> &dyn std::any::Any;
    /// Sets up the transport of a new collective group of `members` (this backend is the
    /// first; every member is of this backend's type: the caller checked). Errors are
    /// `Unavailable` when the backend runs no collectives (the default) or lacks a library.
    fn connect_group(&self, members: &[&dyn Backend], group: &Arc<RankGroup>) -> Result<(), DeviceError> {
        let _ = (members, group);
        Err(DeviceError::Unavailable(format!("{} runs no collectives", self.name())))
    }
    /// The setup token rank `rank` of a group spanning processes offers the others (rank 0's
    /// reaches every rank; NCCL's unique id). `Unavailable` when the backend runs no
    /// collectives across processes (the default).
    fn spanning_token(&self, rank: u32) -> Result<[u8; TOKEN_BYTES], DeviceError> {
        let _ = rank;
        Err(DeviceError::Unavailable(format!("{} runs no collectives across processes", self.name())))
    }
    /// Sets up this process's transport in `group`, a group spanning processes (this process
    /// holds its one local rank), once every process has joined and rank 0's `token` arrived.
    /// Nothing to do by default: the host exchange is the group's own.
    fn connect_spanning(&self, group: &Arc<RankGroup>, token: [u8; TOKEN_BYTES]) -> Result<(), DeviceError> {
        let _ = (group, token);
        Ok(())
    }
    /// The launch variant the device's tuner chose for `kernel` (`runtime::tune`), for dumps:
    /// `None` for its default, a kernel not prepared here, or a device without variants.
    fn kernel_variant(&self, kernel: &Arc<Kernel>) -> Option<String> {
        let _ = kernel;
        None
    }
    /// Records `job`'s schedule into a [`Graph`] that later runs it again with one call (a
    /// CUDA graph), without running it. `job.externals` is ignored. Input `i` is read in place
    /// from `bound[i]` at every launch when that is `Some` (a launch given another buffer for
    /// it reports [`GraphRun::Stale`]: a step's weights, passed again and again, are never
    /// copied); the graph holds a buffer of its own for each other input, filled at each
    /// [`Graph::launch`]. A backend may copy every input instead (`bound` is a permission).
    /// `None`: this backend records no graph of this schedule (the caller runs the plan as
    /// usual, and does not ask again for it); `Err`: recording failed, nothing ran, and the
    /// device stays usable.
    fn record_graph(&self, job: Job<'_>, bound: &[Option<Buffer>]) -> Option<Result<Box<dyn Graph>, DeviceError>> {
        let _ = (job, bound);
        None
    }
}

/// A schedule recorded once into one device call ([`Backend::record_graph`]): a launch copies
/// the inputs it does not read in place into the graph's own buffers, runs every step of every stream with the
/// schedule's event edges, and copies the outputs into fresh buffers (a caller may still hold
/// an earlier launch's outputs). Launches are ordered after everything enqueued on the device
/// before them, and work enqueued later comes after them, like a flush.
pub trait Graph: Send + Sync {
    /// Runs the graph on `inputs` (in `schedule.external_buffers` order, of the recorded
    /// sizes) on `backend` (the one that recorded it).
    fn launch(&self, backend: &dyn Backend, inputs: &[Buffer]) -> Result<GraphRun, DeviceError>;
}

/// What a [`Graph::launch`] did.
pub enum GraphRun {
    /// It ran: the buffers of `schedule.outputs`, in order.
    Ran(Vec<Buffer>),
    /// It cannot run now (the device is timing each kernel): run the plan instead.
    NotNow,
    /// It can never run again (memory it refers to was given back, by `Device::trim_memory`), or
    /// not on these inputs (another buffer for one it reads in place): drop it, run the plan,
    /// and record a new graph if wanted. Nothing ran.
    Stale,
}

/// One execution of a schedule on a device: its events, and a queue per stream. Shared by the
/// threads of a [`Driver::Threads`] backend.
pub trait Flush: Sync {
    /// The queue of `schedule.streams[stream]`. Called once per stream.
    fn queue(&self, stream: usize) -> Box<dyn Queue + '_>;
    /// Makes buffer `buffer` (freed by a step of stream `stream`) reusable once every event of
    /// `after` is reached on the device *and* `stream` has reached the point where this call
    /// finds it (its own earlier work may still be using the buffer: a GPU backend records an
    /// event there). The walker calls it only once each of those events' records was issued,
    /// and after the free step was issued on `stream`, so a backend can order the reuse after
    /// all of them.
    fn free_after(&self, buffer: Buffer, stream: usize, after: &[EventId]);
    /// A step failed: every wait from now on returns `false` (so no stream waits forever).
    fn fail(&self);
    /// When the device ran each step of the flush, for profiling: `(stream index, step index,
    /// offset from the flush's first step, duration)` per kernel, copy or wait it timed on the
    /// device (CUDA events, say). Asked for after `finish`, only when profiling; `None` (the
    /// default): the walker's own times stand.
    fn device_times(&self) -> Option<Vec<(usize, usize, std::time::Duration, std::time::Duration)>> {
        None
    }
    /// Called once every stream's steps were issued (and, for [`Driver::Threads`], have run).
    /// Submits whatever is still held back. After a failure (`failed`), returns only once the
    /// device has stopped using the flush's buffers, so the walker may drop them.
    fn finish(&self, failed: bool) -> Result<(), DeviceError>;
}

/// One stream of one flush. Calls come in the stream's program order.
pub trait Queue: Send {
    /// A buffer for `plan` (its space: device or offload memory; exact-size for parameters).
    fn alloc(&mut self, plan: &BufferPlan) -> Result<Buffer, DeviceError>;
    /// A device buffer holding `bytes` (host data uploaded at its first use). The schedule
    /// orders no other stream after an upload, so the data must be there for every stream of
    /// the flush that uses the buffer after this call returns (not only for this one).
    fn upload(&mut self, bytes: &[u8]) -> Result<Buffer, DeviceError>;
    /// Gives `buffer` back; nothing on this stream after this point uses it.
    fn free(&mut self, buffer: Buffer);
    /// Records `event`: it is reached once this stream's work so far is done.
    fn record(&mut self, event: EventId);
    /// Makes this stream's later work wait for `event`; `false` if the flush failed instead.
    fn wait(&mut self, event: EventId) -> bool;
    /// Copies `from` into `to` (the same number of bytes): an offload or its way back, or a
    /// transfer from another device's buffer.
    fn copy(&mut self, from: &Buffer, to: &Buffer) -> Result<(), DeviceError>;
    /// Runs a kernel of map loops or a row kernel over `args` (inputs first, then outputs).
    fn launch(&mut self, call: &Call<'_>) -> Result<(), DeviceError>;
    /// Runs a matrix product (a library call on every backend: `gemm`, cuBLAS) and its
    /// epilogue over `args`.
    fn library(&mut self, call: &Call<'_>) -> Result<(), DeviceError>;
    /// Runs this device's part of a collective (`Body::Collective`): argument 0 is its input,
    /// argument 1 its output. Every member of the group runs its part in the same order; see
    /// [`crate::collective`]. A backend without collectives says so.
    fn collective(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        Err(DeviceError::Unavailable(format!("{}: this device runs no collectives", call.describe())))
    }
}

/// One kernel to run: the kernel, its argument buffers (sizes checked by the walker), and how
/// to name it in logs and errors.
pub struct Call<'a> {
    pub id: KernelId,
    pub kernel: &'a Arc<Kernel>,
    pub args: &'a [Buffer],
    /// Describes the kernel (`k3 mul+exp [n12 n13]`), called only when needed.
    pub label: &'a (dyn Fn(KernelId) -> String + Sync),
    /// The stream's id, for logs.
    pub stream: u32,
    /// The flush's number, for logs (kernel lines from stream threads name their flush).
    pub flush: u64,
    /// The kernel's position in its stream's steps (what [`Flush::device_times`] names).
    pub step: usize,
    /// The flush is profiled: a backend whose queues only enqueue times the kernel on the
    /// device, for [`Flush::device_times`].
    pub timed: bool,
}

impl Call<'_> {
    /// The kernel's label.
    pub fn describe(&self) -> String {
        (self.label)(self.id)
    }
}

/// An input of a flush as the runtime receives it.
pub enum Input {
    /// A value on the device (or, for a transfer, on another device).
    Buffer(Buffer),
    /// Host data (of a buffer marked `upload_at_first_use`) that the device uploads when the first
    /// step using it runs.
    Upload(Arc<[u8]>),
}

/// Everything the runtime needs to run one flush.
pub struct Job<'a> {
    pub schedule: &'a Schedule,
    /// `kernels[i]` is the lowered form of `schedule.kernels[i]`.
    pub kernels: &'a [Arc<Kernel>],
    /// The flush's external values, in `schedule.external_buffers` order, handed to the device:
    /// a donated one's memory returns to the pool when the schedule frees it.
    pub externals: Vec<Input>,
    /// Describes a kernel for logs and errors (called only when needed).
    pub label: &'a (dyn Fn(KernelId) -> String + Sync),
    /// Fill buffers with 0xFF bytes (NaN for floats) when they are freed (`BRAID_POISON=1`).
    pub poison: bool,
    /// Fault injection for tests of recovery: fail when this kernel is reached, as a failing
    /// kernel would.
    pub fail_at: Option<KernelId>,
    /// The flush's number, for logs.
    pub flush: u64,
    /// Where to record how long each kernel, copy and wait took (profiling), if anywhere.
    pub profile: Option<&'a std::sync::Mutex<Vec<Span>>>,
}

/// One timed step of a flush (see [`Job::profile`]). With [`Driver::Threads`] the times are
/// when the work ran; with the other drivers they are when it was issued, unless the
/// backend replaces them with device times ([`Flush::device_times`]).
#[derive(Clone, Debug)]
pub struct Span {
    /// The braid stream the step belongs to.
    pub stream: u32,
    /// `kernel`, `copy` or `wait`.
    pub kind: &'static str,
    /// The kernel's label (`k3 mul+exp [n12 n13]`), or `copy b1 -> b4`, or `wait e2`.
    pub name: String,
    pub start: std::time::Instant,
    pub duration: std::time::Duration,
    /// Bytes the step read and wrote.
    pub bytes: usize,
    /// The step's position in its stream's steps.
    pub step: usize,
}

/// What a flush leaves: the buffers of `schedule.outputs` in order (or the error), and the
/// external buffers still held at the end (by position; `None` once the schedule freed one), from
/// which the engine gives donated values back after a failure.
pub type Outcome = (Result<Vec<Buffer>, DeviceError>, Vec<Option<Buffer>>);
