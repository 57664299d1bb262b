//! CPU graphs for replayed steps: a step's schedule resolved once ([`record`]) into the list of
//! what to do, then run by [`CpuGraph::launch`] on each replay without the walker.
//!
//! The walker (`runtime::walk`) serves any backend and any number of streams: a table of locked
//! slots, event gates, a boxed queue per stream, a panic guard per step. A step of small
//! tensors replayed thousands of times spends more in that machinery than in its kernels, and
//! for a schedule of one stream on the CPU none of it is needed: the steps run in their order on
//! the calling thread, each done before the next starts, so every event is reached when it is
//! recorded and every gated free may go at once. The graph keeps exactly the schedule's steps
//! and order (allocations, frees, kernels, copies); it owns nothing between launches, so it is
//! never stale, and memory is taken from and given back to the pool as a flush would (poisoned
//! when freed if the flush it was recorded from poisoned, as CUDA graphs keep theirs).
//!
//! Not recorded ([`record`] says `None`, and the plan runs through the walker): schedules of
//! several streams (their kernels run at the same time on threads of their own), with
//! collectives, with host data uploaded at first use, or writing over an input's buffer.
//!
//! Must never: reorder steps, run a step of a schedule it did not check, or keep a buffer past
//! the launch.

use super::map::ArgPtr;
use super::{CpuDevice, KeptKernel};
use crate::runtime::{Backend, Graph, GraphRun, Input, Job};
use crate::{Buffer, DeviceError};
use braid_lowering::{Body, Kernel};
use braid_scheduler::{BufferId, BufferPlan, StreamStep};
use smallvec::SmallVec;
use std::sync::Arc;

/// One step of a recorded schedule, with what it needs resolved.
enum GraphStep {
    Alloc { buffer: usize, plan: BufferPlan },
    Free(usize),
    Copy { from: usize, to: usize },
    Kernel(GraphKernel),
}

struct GraphKernel {
    kernel: Arc<Kernel>,
    /// Buffers of the kernel's arguments (inputs, then outputs).
    args: SmallVec<[usize; 8]>,
    /// The kernel's label (`k3 mul+exp [n12 n13]`), for logs and errors.
    label: String,
    /// Its compiled library once it has one, and whether its accesses were checked.
    kept: KeptKernel,
}

/// A step's schedule of one stream, resolved for [`CpuGraph::launch`].
pub struct CpuGraph {
    /// The pool of the device that recorded it (a graph runs only there).
    pool: Arc<super::Pool>,
    buffers: usize,
    /// Buffer of each input, with its size.
    inputs: Vec<(usize, usize)>,
    steps: Vec<GraphStep>,
    outputs: Vec<usize>,
    poison: bool,
    /// The flush it was recorded in and its stream, for logs.
    flush: u64,
    stream: u32,
}

/// The graph of `job`'s schedule on `device`, or `None` when it is not recorded (see the module
/// docs).
pub(super) fn record(device: &CpuDevice, job: Job<'_>) -> Option<Result<Box<dyn Graph>, DeviceError>> {
    let schedule = job.schedule;
    let [stream] = &schedule.streams[..] else { return None };
    if job.externals.iter().any(|e| matches!(e, Input::Upload(_))) || job.fail_at.is_some() || job.profile.is_some() {
        return None;
    }
    let external = |b: &BufferId| schedule.external_buffers.contains(b);
    let mut steps = Vec::with_capacity(stream.steps.len());
    for step in &stream.steps {
        steps.push(match step {
            StreamStep::Alloc(b) => GraphStep::Alloc { buffer: b.index(), plan: schedule.buffers[b.index()].clone() },
            StreamStep::Free { buffer, .. } => GraphStep::Free(buffer.index()),
            // One stream: every event is reached when it is recorded.
            StreamStep::Record(_) | StreamStep::Wait(_) => continue,
            StreamStep::Copy { from, to, .. } => GraphStep::Copy { from: from.index(), to: to.index() },
            StreamStep::Kernel(k) => {
                let (plan, kernel) = (&schedule.kernels[k.index()], &job.kernels[k.index()]);
                if matches!(kernel.body, Body::Collective(_)) || plan.outputs.iter().any(external) {
                    return None;
                }
                let label = (job.label)(*k);
                let args: SmallVec<[usize; 8]> = plan.inputs.iter().chain(&plan.outputs).map(|b| b.index()).collect();
                if args.len() != kernel.args.len() {
                    return Some(Err(DeviceError::Internal(format!(
                        "{label}: the plan gives {} buffers for a kernel of {} arguments",
                        args.len(),
                        kernel.args.len()
                    ))));
                }
                for (&b, a) in args.iter().zip(&kernel.args) {
                    let bytes = schedule.buffers[b].bytes;
                    if bytes != a.len * a.dtype.size() {
                        return Some(Err(DeviceError::Internal(format!(
                            "b{b} holds {bytes} bytes but {label} expects {} {} elements",
                            a.len, a.dtype
                        ))));
                    }
                }
                GraphStep::Kernel(GraphKernel { kernel: kernel.clone(), args, label, kept: KeptKernel::default() })
            }
        });
    }
    let inputs = (schedule.external_buffers.iter()).map(|b| (b.index(), schedule.buffers[b.index()].bytes)).collect();
    Some(Ok(Box::new(CpuGraph {
        pool: device.pool.clone(),
        buffers: schedule.buffers.len(),
        inputs,
        steps,
        outputs: schedule.outputs.iter().map(|(_, b)| b.index()).collect(),
        poison: job.poison,
        flush: job.flush,
        stream: stream.stream.0,
    })))
}

impl Graph for CpuGraph {
    fn launch(&self, backend: &dyn Backend, inputs: &[Buffer]) -> Result<GraphRun, DeviceError> {
        let device = match backend.as_any().downcast_ref::<CpuDevice>() {
            Some(d) if Arc::ptr_eq(&d.pool, &self.pool) => d,
            _ => return Err(DeviceError::Internal("a CPU graph launched on another device".into())),
        };
        if inputs.len() != self.inputs.len() {
            return Err(DeviceError::Internal(format!(
                "a graph of {} inputs given {}",
                self.inputs.len(),
                inputs.len()
            )));
        }
        let mut table: SmallVec<[Option<Buffer>; 16]> = SmallVec::from_elem(None, self.buffers);
        for (&(b, bytes), input) in self.inputs.iter().zip(inputs) {
            if input.bytes() != bytes {
                return Err(DeviceError::Internal(format!("a graph input of {bytes} bytes given {}", input.bytes())));
            }
            table[b] = Some(input.clone());
        }
        let held = |table: &SmallVec<[Option<Buffer>; 16]>, b: usize| {
            table[b].clone().ok_or_else(|| DeviceError::Internal(format!("b{b} is used but not allocated")))
        };
        for step in &self.steps {
            match step {
                GraphStep::Alloc { buffer, plan } => table[*buffer] = Some(device.alloc_planned(plan, self.poison)?),
                GraphStep::Free(b) => table[*b] = None,
                GraphStep::Copy { from, to } => {
                    let (src, dst) = (held(&table, *from)?, held(&table, *to)?);
                    if src.bytes() != dst.bytes() {
                        let (a, b) = (src.bytes(), dst.bytes());
                        return Err(DeviceError::Internal(format!("copy b{from} -> b{to}: {a} and {b} bytes")));
                    }
                    super::queue::copy(&src, &dst)?;
                }
                GraphStep::Kernel(k) => {
                    // The argument buffers stay in the table for the call.
                    let mut args: SmallVec<[ArgPtr; 16]> = SmallVec::with_capacity(k.args.len());
                    for (&b, a) in k.args.iter().zip(&k.kernel.args) {
                        let Some(buffer) = table[b].as_ref().and_then(Buffer::get::<super::CpuBuffer>) else {
                            return Err(DeviceError::Internal(format!("{}: b{b} is not a CPU buffer", k.label)));
                        };
                        args.push(ArgPtr { ptr: buffer.ptr(), len: a.len, dtype: a.dtype });
                    }
                    let (describe, kept) = (|| k.label.clone(), Some(&k.kept));
                    super::queue::run_logged(device, &k.kernel, &args, &describe, self.flush, self.stream, kept)?;
                }
            }
        }
        let outputs = self.outputs.iter().map(|&b| held(&table, b)).collect::<Result<Vec<_>, _>>()?;
        device.graph_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(GraphRun::Ran(outputs))
    }
}
