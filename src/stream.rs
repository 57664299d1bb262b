//! Streams and events as users see them.
//!
//! A [`Stream`] is an ordered queue of work on one device; every recorded op carries the stream
//! that was current on its thread ([`Stream::scope`]). Using a tensor on another stream is always
//! safe: the scheduler inserts the event itself. An [`Event`] marks a point in a stream's order
//! (after everything recorded on it so far); [`Stream::wait_event`] makes later work on another
//! stream wait for it, ordering what data does not.

use crate::device::Device;
use crate::engine::capture;
use crate::error::Result;
use crate::recorder;
use braid_graph::{NodeId, StreamId};
use std::fmt;
use std::sync::Arc;

/// An execution queue of a device (a CPU worker, a CUDA stream, ...). Cheap to clone.
#[derive(Clone)]
pub struct Stream {
    pub(crate) device: Device,
    pub(crate) id: StreamId,
}

impl Stream {
    pub(crate) fn new(device: Device, id: StreamId) -> Stream {
        Stream { device, id }
    }

    /// The stream current on this thread for `device` (its default stream outside any
    /// [`Stream::scope`]).
    pub fn current(device: &Device) -> Stream {
        Stream::new(device.clone(), recorder::current_stream(device.id()))
    }

    /// Runs `f` with this stream current (on this thread, for this stream's device): everything
    /// recorded in `f` goes to it. Scopes nest; the previous stream is current again afterwards,
    /// even if `f` panics.
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        recorder::with_stream(self.device.id(), self.id, f)
    }

    /// Marks the current point of this stream: the event is reached once everything recorded on
    /// the stream so far has run.
    pub fn record_event(&self) -> Event {
        // Recorded all the same (the function goes on), but the capture fails.
        capture::refuse(|| {
            "recording a user event inside a step while it is captured: a replay records no events".into()
        });
        let node = self.device.engine().record_event(self.id);
        Event(Arc::new(EventInner { node, stream: self.clone() }))
    }

    /// Work recorded on this stream from now on runs only after `event` is reached.
    pub fn wait_event(&self, event: &Event) {
        let refused = capture::refuse(|| {
            "waiting for an event inside a step while it is captured: a replay waits for no events".into()
        });
        if refused.is_some() {
            // Not done: a failed capture leaves the stream as it was.
            return;
        }
        let source = event.0.stream.device.engine();
        self.device.engine().wait_event(self.id, source, event.0.node);
    }

    /// Flushes everything pending on this stream and waits for it.
    pub fn synchronize(&self) -> Result<()> {
        capture::refuse_while_capturing("a stream's synchronize")?;
        self.record_event().synchronize()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The stream's number on its device (0 is the default stream).
    pub fn id(&self) -> u32 {
        self.id.0
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Stream) -> bool {
        self.device == other.device && self.id == other.id
    }
}
impl Eq for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream({}:{})", self.device, self.id.0)
    }
}

/// A point in a stream's order. Cheap to clone; clones are the same event.
#[derive(Clone)]
pub struct Event(pub(crate) Arc<EventInner>);

// See `Device`: handles cross `catch_unwind` as they are.
impl std::panic::UnwindSafe for Stream {}
impl std::panic::RefUnwindSafe for Stream {}
impl std::panic::UnwindSafe for Event {}
impl std::panic::RefUnwindSafe for Event {}

pub(crate) struct EventInner {
    /// The event's node in the recorded graph (one handle counted for this event).
    pub(crate) node: NodeId,
    stream: Stream,
}

impl Drop for EventInner {
    fn drop(&mut self) {
        self.stream.device.engine().release(self.node);
    }
}

impl Event {
    /// Flushes what the event depends on and blocks until it is reached.
    pub fn synchronize(&self) -> Result<()> {
        self.0.stream.device.engine().complete(self.0.node)
    }

    /// The stream the event was recorded on.
    pub fn stream(&self) -> &Stream {
        &self.0.stream
    }
}

impl PartialEq for Event {
    fn eq(&self, other: &Event) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for Event {}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Event(n{} on {:?})", self.0.node.index(), self.0.stream)
    }
}
