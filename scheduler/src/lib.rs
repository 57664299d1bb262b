//! # braid-scheduler: from a flush graph to a schedule
//!
//! Given the subgraph of a flush and its fusion segments, decides what runs on which stream in
//! which order, where events go, which buffer holds each value and when it is freed, and how
//! many bytes that needs at the peak. The result is a [`Schedule`], which devices execute,
//! [`validate`] checks and [`dump`] prints. The scheduler never touches device memory and never
//! runs kernels.

pub mod assign;
pub mod dump;
pub mod offload;
pub mod plan;
pub mod schedule;
pub mod validate;

pub use assign::{COPY_STREAM, spread_default_stream, transfers_to_copy_stream};
pub use dump::Dump;
pub use offload::{CostModel, Decision, PeakAt, Unreachable};
pub use plan::{plan, plan_with_offloads};
pub use schedule::{
    BufferId, BufferPlan, BufferSource, EventId, EventPlan, KernelId, KernelPlan, OFFLOAD_STREAM, OffloadPlan,
    Schedule, Space, StreamSchedule, StreamStep,
};
pub use validate::{Hazard, HazardKind, Program, check_reachable, validate};
