//! Recording: how an API call becomes a node in its device's engine. It knows which stream is
//! current on this thread for each device (the scopes [`crate::Stream::scope`] opens) and
//! records ops and transfers between devices on that stream (host data and a replayed step's
//! outputs are held by their tensors and recorded when first needed: `Tensor::cell`).
//!
//! The recorder sits between the tensor API (which validates operands and keeps the handles)
//! and the engine (which owns the graphs). It never validates, never flushes by itself, and
//! knows nothing of tensors: it deals in engines, version cells and node ids.

use crate::engine::{Engine, NewNode};
pub(crate) use crate::engine::{Retainer, Track};
use braid_graph::{DType, DeviceId, NodeId, Op, Shape, StreamId};
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

thread_local! {
    /// The streams made current by scopes on this thread, innermost last.
    static SCOPES: RefCell<Vec<(DeviceId, StreamId)>> = const { RefCell::new(Vec::new()) };
}

/// The stream work recorded now on this thread goes to, on `device`.
#[inline]
pub(crate) fn current_stream(device: DeviceId) -> StreamId {
    SCOPES.with(|s| s.borrow().iter().rev().find(|(d, _)| *d == device).map_or(StreamId(0), |&(_, st)| st))
}

/// Runs `f` with `stream` of `device` current on this thread; the previous stream is current
/// again afterwards, even if `f` panics.
pub(crate) fn with_stream<R>(device: DeviceId, stream: StreamId, f: impl FnOnce() -> R) -> R {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            SCOPES.with(|s| s.borrow_mut().pop());
        }
    }
    SCOPES.with(|s| s.borrow_mut().push((device, stream)));
    let _pop = Pop;
    f()
}

/// Records `op` over the versions `inputs` name on `stream` of `engine` (the caller's
/// [`current_stream`], looked up once for its gradient bookkeeping too); with `version_of`, the
/// new node becomes that tensor's version. Returns the node with one handle. (Inlined: the op
/// and shape are moved once, into the engine's node.)
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    engine: &Engine,
    stream: StreamId,
    op: Op,
    dtype: DType,
    shape: Shape,
    inputs: &[&AtomicU32],
    version_of: Option<&AtomicU32>,
    track: Option<Track<'_>>,
) -> NodeId {
    engine.record(NewNode { op, dtype, shape, stream }, inputs, version_of, track)
}

/// Records `to_device` of the version `source_cell` names on `source` into `dest`.
pub(crate) fn record_transfer(
    dest: &Arc<Engine>,
    source: &Arc<Engine>,
    source_cell: &AtomicU32,
    dtype: DType,
    shape: Shape,
    track: Option<Track<'_>>,
) -> NodeId {
    let stream = current_stream(dest.id);
    dest.record_transfer(source, source_cell, NewNode { op: Op::ToDevice, dtype, shape, stream }, track)
}

/// Records a leaf holding a computed buffer on `engine`'s current stream.
pub(crate) fn record_ready(engine: &Engine, dtype: DType, shape: Shape, buffer: braid_devices::Buffer) -> NodeId {
    engine.record_ready(dtype, shape, current_stream(engine.id), buffer)
}
