//! The `Schedule`: what a flush will do, step by step, on each stream.
//!
//! Plain data produced by the planner and consumed by devices (which execute it), the
//! validator and the dumps. It names buffers, kernels and events by small integers; it holds
//! no device resources.

use braid_fusion::Fusion;
use braid_graph::{DType, StreamId};
use std::fmt;

macro_rules! id_type {
    ($name:ident, $prefix:literal) => {
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
        pub struct $name(pub u32);
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
        impl $name {
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }
    };
}

id_type!(BufferId, "b");
id_type!(KernelId, "k");
id_type!(EventId, "e");

/// Where a buffer lives.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Space {
    /// The device's (budgeted) memory.
    Device,
    /// Host memory used for offloads.
    Host,
    /// Another device's memory: an input of the flush that a transfer copies from, or that this
    /// device's kernels read in place (another CPU device's buffer). It takes none of this
    /// device's memory, and this device never writes, frees or offloads it.
    Remote,
}

/// What a buffer holds when the flush starts or when it is first written.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BufferSource {
    /// `FlushGraph::externals[i]`, already materialised.
    External(usize),
    /// The value of `FlushGraph::nodes[i]`, written by a kernel of this flush.
    Value(usize),
    /// A copy of `FlushGraph::externals[i]` (offloaded), written by a copy step.
    CopyOf(usize),
}

#[derive(Clone, Debug)]
pub struct BufferPlan {
    pub id: BufferId,
    pub dtype: DType,
    /// Length in elements.
    pub len: usize,
    pub bytes: usize,
    pub space: Space,
    pub source: BufferSource,
    /// Holds a parameter: allocated from the device's exact-size memory.
    pub persistent: bool,
    /// An input whose data the device uploads when its first reader runs (donated host data);
    /// device memory from then on.
    pub upload_at_first_use: bool,
}

#[derive(Clone, Debug)]
pub struct KernelPlan {
    pub id: KernelId,
    pub stream: StreamId,
    /// Index into `fusion.segments`.
    pub segment: usize,
    /// Input buffers, in the order of the segment's inputs (the kernel's input arguments).
    pub inputs: Vec<BufferId>,
    /// Output buffers, in the order of the segment's outputs.
    pub outputs: Vec<BufferId>,
    /// Outputs written in place over an input's buffer: (output position, input position).
    pub in_place: Vec<(usize, usize)>,
    /// Why an input that could have been overwritten in place was not (another stream may still
    /// read it), so a fresh buffer was picked instead.
    pub note: Option<String>,
}

#[derive(Clone, Debug)]
pub struct EventPlan {
    pub id: EventId,
    pub stream: StreamId,
    /// Inserted by braid (a cross-stream read or free) rather than recorded by the user.
    pub auto: bool,
    /// The flush node of the user event this event realises (`None` for automatic ones).
    pub user_node: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamStep {
    /// Run a kernel.
    Kernel(KernelId),
    /// Take a buffer from the pool.
    Alloc(BufferId),
    /// Give a buffer back once every listed event has been reached.
    Free { buffer: BufferId, after: Vec<EventId> },
    /// Mark a point in this stream's order.
    Record(EventId),
    /// Wait until an event (of another stream) is reached.
    Wait(EventId),
    /// Copy a whole buffer into another: a value (of this flush, or a donated input) to host
    /// memory and back (an offload), or another device's value into this device's memory (a
    /// transfer, `to_device`). `value` is what `to` holds afterwards; `from` holds the value
    /// its buffer plan names (the same one for offloads, the transferred input for transfers).
    Copy { from: BufferId, to: BufferId, value: braid_graph::ValueRef },
}

/// The stream offload copies run on (a device's copy engine; a worker on the CPU).
pub const OFFLOAD_STREAM: StreamId = StreamId(u32::MAX);

/// A value moved out of device memory while idle and brought back before its next use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadPlan {
    /// The value (a flush node, or a donated input).
    pub value: braid_graph::ValueRef,
    /// Its device buffer before the offload (freed once the copy out completes).
    pub device: BufferId,
    /// The host copy.
    pub host: BufferId,
    /// The device buffer it returns to (`None`: it stays in host memory past the flush, which
    /// it outlives; `host` is then the value the flush leaves, and a later flush that reads it
    /// copies it into device memory first).
    pub back: Option<BufferId>,
    /// The kernel that needs it back (`None`: the end of the flush, for a value that
    /// outlives it).
    pub back_before: Option<KernelId>,
}

#[derive(Clone, Debug)]
pub struct StreamSchedule {
    pub stream: StreamId,
    pub steps: Vec<StreamStep>,
}

/// The plan of one flush on one device.
#[derive(Clone, Debug, Default)]
pub struct Schedule {
    pub streams: Vec<StreamSchedule>,
    pub buffers: Vec<BufferPlan>,
    pub kernels: Vec<KernelPlan>,
    pub events: Vec<EventPlan>,
    pub fusion: Fusion,
    /// Buffer of each external value (`FlushGraph::externals[i]`).
    pub external_buffers: Vec<BufferId>,
    /// Values that outlive the flush: (flush node, buffer holding it at the end).
    pub outputs: Vec<(usize, BufferId)>,
    /// Highest total of bytes alive at once (the flush's inputs plus what it allocates),
    /// with streams advancing in the order the steps were planned. Exact for one stream; with
    /// several, streams running ahead of one another can hold more at the same moment.
    pub planned_peak_bytes: u64,
    /// Values offloaded to host memory during the flush (to keep the peak under a budget).
    pub offloads: Vec<OffloadPlan>,
    /// The device memory budget the flush was planned under, if any: a runtime then allocates
    /// nothing the plan does not (it does not time kernel variants, which needs memory of its
    /// own).
    pub memory_budget: Option<u64>,
}

impl Schedule {
    pub fn kernel_count(&self) -> usize {
        self.kernels.len()
    }

    /// This schedule with every stream renamed by `rename`, a one-to-one map that keeps the
    /// order of stream ids: the plan of the same graph on those streams (the engine reuses a
    /// plan for a program that makes new streams every step).
    pub fn with_streams_renamed(&self, rename: &dyn Fn(StreamId) -> StreamId) -> Schedule {
        let mut renamed = self.clone();
        for s in &mut renamed.streams {
            s.stream = rename(s.stream);
        }
        for k in &mut renamed.kernels {
            k.stream = rename(k.stream);
        }
        for e in &mut renamed.events {
            e.stream = rename(e.stream);
        }
        for r in &mut renamed.fusion.refused {
            if let Some((a, b)) = braid_fusion::Refusal::streams_of(&r.reason) {
                r.reason = braid_fusion::Refusal::different_streams(rename(a), rename(b));
            }
        }
        renamed
    }

    /// Kernel `k`'s plan and the fused segment it runs.
    pub fn kernel_and_segment(&self, k: KernelId) -> (&KernelPlan, &braid_fusion::Segment) {
        let plan = &self.kernels[k.index()];
        (plan, &self.fusion.segments[plan.segment])
    }
}
