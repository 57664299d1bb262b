//! The engine: the one recorded graph shared by every thread, recording into it, releasing
//! what nobody can read any more, and flushing what a read needs (`flush`).
//!
//! Invariants kept here:
//! - A node leaves the graph only when no tensor names it, nothing pending depends on it and
//!   it is not being computed; so dropped, never-read tensors are never computed.
//! - A flushed value is kept (never recomputed) while a tensor or pending work needs it.
//! - The lock is never held while a device runs, and misuse is checked before it is taken, so
//!   recording never waits for device work and a caught panic cannot leave the graph
//!   half-updated.

pub(crate) mod cache;
pub(crate) mod capture;
mod flush;
mod marks;

pub(crate) use flush::{flush_device, flush_nodes};

use crate::device::{Device, lock};
use crate::error::{Error, Result};
use crate::stream::Event;
use braid_devices::Buffer;
use braid_graph::{DType, DeviceId, Graph, Node, NodeId, Op, Shape, StreamId};
use hashbrown::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex};

/// The value state of a node (`None` in the graph means pending).
pub(crate) enum Value {
    /// Host data not yet on the device (`from_vec`); uploaded by the first flush or read that
    /// needs it, so recording never waits for the device.
    Host(Arc<[u8]>),
    /// Being computed by a flush; wait on the ticket.
    InFlight(Arc<Ticket>),
    /// Computed.
    Ready(Buffer),
    /// A user event that has been reached.
    Done,
    /// A device value donated to a running flush (nothing else reads it): the flush owns the
    /// buffer and frees it after its last reader, or writes a new version over it in place.
    /// (Donated host data keeps `Host`.)
    Lent,
    /// Donated to a flush that failed after freeing or overwriting it: the pending work that needed it cannot
    /// run again (reads of it report this reason).
    Lost(String),
}

/// Completion of one flush: readers of its values wait here.
#[derive(Default)]
pub(crate) struct Ticket {
    done: Mutex<Option<Result<()>>>,
    cv: Condvar,
}

impl Ticket {
    pub(crate) fn finish(&self, result: Result<()>) {
        *lock(&self.done) = Some(result);
        self.cv.notify_all();
    }

    pub(crate) fn wait(&self) -> Result<()> {
        let mut done = lock(&self.done);
        while done.is_none() {
            done = self.cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
        done.clone().expect("checked")
    }
}

pub(crate) struct State {
    pub(crate) graph: Graph<Value>,
    /// Nodes whose value is neither computed nor being computed.
    pub(crate) pending: usize,
    pub(crate) flushes: u64,
    /// Recording order of the next node.
    seq: u64,
    /// Per stream: events that work recorded on it from now on must wait for.
    waits: HashMap<(DeviceId, StreamId), Vec<Event>>,
    /// Scratch of the flush being walked and extracted.
    marks: marks::Marks,
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(|| {
    Mutex::new(State {
        graph: Graph::new(),
        pending: 0,
        flushes: 0,
        seq: 0,
        waits: HashMap::new(),
        marks: marks::Marks::default(),
    })
});

impl State {
    /// Adds a node, stamping its recording order.
    fn add(&mut self, mut node: Node<Value>, inputs: &[NodeId]) -> NodeId {
        node.seq = self.seq;
        self.seq += 1;
        self.graph.add(node, inputs)
    }
}

/// Default for [`max_pending_nodes`].
pub const DEFAULT_MAX_PENDING: usize = 32_768;
static MAX_PENDING: AtomicUsize = AtomicUsize::new(DEFAULT_MAX_PENDING);

pub(crate) fn state() -> std::sync::MutexGuard<'static, State> {
    lock(&STATE)
}

/// Sets how many pending nodes may accumulate before recording flushes them without being
/// asked (default [`DEFAULT_MAX_PENDING`]). `0` means no limit.
pub fn set_max_pending_nodes(n: usize) {
    MAX_PENDING.store(n, Ordering::Relaxed);
}

pub fn max_pending_nodes() -> usize {
    MAX_PENDING.load(Ordering::Relaxed)
}

/// Extra handles taken while recording (autograd keeps the values a derivative reads).
pub(crate) struct Retainer<'a>(&'a mut State);

impl Retainer<'_> {
    /// Marks `id` as a parameter version (its buffer comes from exact-size memory).
    pub(crate) fn mark_persistent(&mut self, id: NodeId) {
        self.0.graph.node_mut(id).persistent = true;
    }

    /// Counts one more handle of `id`; the caller owns it (a `Tensor` made with
    /// `Tensor::from_node` releases it when dropped).
    pub(crate) fn retain(&mut self, id: NodeId) {
        self.0.graph.node_mut(id).handles += 1;
    }
}

/// Runs under the engine lock after a node is recorded, with the input versions that were read
/// and the new node, so that autograd's bookkeeping agrees with the versions. It must not drop
/// a `Tensor` (that takes the lock): return such things to be dropped afterwards.
pub(crate) type Track<'a> = &'a mut dyn FnMut(&mut Retainer<'_>, &[NodeId], NodeId);

/// Records a node and returns it with one handle counted. `inputs` are current versions.
///
/// `inputs` are the tensors' version cells, read under the lock (another thread may be moving a
/// tensor to a new version). With `version_of`, the new node becomes that tensor's current
/// version in the same critical section, and the old version loses the handle.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    op: Op,
    dtype: DType,
    shape: Shape,
    device: &Device,
    stream: StreamId,
    inputs: &[&AtomicU32],
    version_of: Option<&AtomicU32>,
    track: Option<Track<'_>>,
) -> NodeId {
    let _span = tracing::trace_span!(target: "braid::record", "record", op = op.name()).entered();
    let mut st = state();
    let nodes: smallvec::SmallVec<[NodeId; 3]> =
        inputs.iter().map(|cell| NodeId::new(cell.load(Ordering::Relaxed) as usize)).collect();
    let mut node = Node::new(op, dtype, shape, device.0.id, stream);
    node.handles = 1;
    let id = st.add(node, &nodes);
    st.pending += 1;
    if let Some(track) = track {
        track(&mut Retainer(&mut st), &nodes, id);
    }
    if let Some(cell) = version_of {
        // The handle `add` counted is the tensor's, moved from its old version.
        let old = NodeId::new(cell.swap(id.index() as u32, Ordering::Relaxed) as usize);
        st.graph.node_mut(old).handles -= 1;
        collect(&mut st, [old]);
    }
    let reached = if st.waits.is_empty() { Vec::new() } else { apply_waits(&mut st, id, device.0.id, stream) };
    let limit = MAX_PENDING.load(Ordering::Relaxed);
    // Not inside a capture: the step's work must stay pending until its own flush.
    let over = limit != 0 && st.pending > limit && !capture::capturing();
    drop(st);
    drop(reached);
    if over {
        // The new node has its handle counted, so the flush keeps it.
        if let Err(e) = flush_device(None) {
            tracing::warn!(target: "braid::flush", "automatic flush failed (the read will report it): {e}");
        }
    }
    id
}

/// Records a leaf holding host data (`from_vec`).
pub(crate) fn record_host(dtype: DType, shape: Shape, device: &Device, bytes: Arc<[u8]>) -> NodeId {
    let stream = crate::stream::current_stream(device.0.id);
    let mut node = Node::new(Op::Input, dtype, shape, device.0.id, stream);
    node.handles = 1;
    node.value = Some(Value::Host(bytes));
    state().add(node, &[])
}

/// Records a leaf holding a computed buffer (an output of a captured step's replay).
pub(crate) fn record_ready(dtype: DType, shape: Shape, device: &Device, buffer: Buffer) -> NodeId {
    let stream = crate::stream::current_stream(device.0.id);
    let mut node = Node::new(Op::Input, dtype, shape, device.0.id, stream);
    node.handles = 1;
    node.value = Some(Value::Ready(buffer));
    state().add(node, &[])
}

/// Orders node `id` (just recorded on `stream`) after the events its stream waits for. Events
/// already reached are forgotten: they are returned, to be dropped once the lock is released
/// (dropping an event takes the lock).
#[must_use]
fn apply_waits(st: &mut State, id: NodeId, device: DeviceId, stream: StreamId) -> Vec<Event> {
    let Some(events) = st.waits.remove(&(device, stream)) else { return Vec::new() };
    let (reached, waiting): (Vec<Event>, Vec<Event>) =
        events.into_iter().partition(|e| matches!(st.graph.node(e.0.node).value, Some(Value::Done)));
    for e in &waiting {
        st.graph.add_control(e.0.node, id);
    }
    if !waiting.is_empty() {
        st.waits.insert((device, stream), waiting);
    }
    reached
}

/// Records a user event on `stream`: a node ordered after every pending or running node
/// recorded on the stream so far (after those of them that no later node of the stream
/// depends on, which implies the rest).
pub(crate) fn record_event(device: DeviceId, stream: StreamId) -> NodeId {
    let mut st = state();
    let on_stream = |st: &State, n: NodeId| {
        let node = st.graph.node(n);
        node.device == device && node.stream == stream && matches!(node.value, None | Some(Value::InFlight(_)))
    };
    let tail: Vec<NodeId> = st
        .graph
        .node_ids()
        .filter(|&n| on_stream(&st, n) && !st.graph.successors(n).any(|s| on_stream(&st, s)))
        .collect();
    let mut node = Node::new(Op::Event, DType::Bool, Shape::from([0]), device, stream);
    node.handles = 1;
    let id = st.add(node, &[]);
    st.pending += 1;
    for t in tail {
        st.graph.add_control(t, id);
    }
    let reached = if st.waits.is_empty() { Vec::new() } else { apply_waits(&mut st, id, device, stream) };
    drop(st);
    drop(reached);
    id
}

/// Makes work recorded on `stream` from now on wait for `event`.
pub(crate) fn wait_event(device: DeviceId, stream: StreamId, event: &Event) {
    let mut st = state();
    if matches!(st.graph.node(event.0.node).value, Some(Value::Done)) {
        return;
    }
    let list = st.waits.entry((device, stream)).or_default();
    if !list.contains(event) {
        list.push(event.clone());
    }
}

/// Runs what a user event depends on and waits until it is reached.
pub(crate) fn complete(id: NodeId) -> Result<()> {
    loop {
        let st = state();
        match &st.graph.node(id).value {
            Some(Value::Done) => return Ok(()),
            Some(Value::InFlight(t)) => {
                let t = t.clone();
                drop(st);
                let _ = t.wait();
            }
            _ => {
                drop(st);
                flush_nodes(&[id])?;
            }
        }
    }
}

/// Marks an uploaded leaf as ready (unless it is gone or was uploaded meanwhile).
pub(crate) fn install_upload(st: &mut State, id: NodeId, buffer: &Buffer) {
    if st.graph.contains(id) && matches!(st.graph.node(id).value, Some(Value::Host(_))) {
        st.graph.node_mut(id).value = Some(Value::Ready(buffer.clone()));
    }
}

/// Drops one handle of `id` and releases whatever that makes unreachable.
pub(crate) fn release(id: NodeId) {
    let mut st = state();
    st.graph.node_mut(id).handles -= 1;
    collect(&mut st, [id]);
}

/// Removes every node reachable from `candidates` (towards inputs) that nobody can read any
/// more: no handle, no dependent node, not in flight. Freed buffers go back to their pool.
pub(crate) fn collect(st: &mut State, start: impl IntoIterator<Item = NodeId>) {
    let mut candidates: smallvec::SmallVec<[NodeId; 16]> = start.into_iter().collect();
    while let Some(id) = candidates.pop() {
        if !st.graph.contains(id) {
            continue;
        }
        let node = st.graph.node(id);
        if node.handles > 0 || matches!(node.value, Some(Value::InFlight(_))) || st.graph.has_successors(id) {
            continue;
        }
        candidates.extend(st.graph.predecessors(id));
        let node = st.graph.remove(id).expect("checked");
        if node.value.is_none() {
            st.pending -= 1;
        }
    }
}

/// The value of `id`, computing it first if needed.
pub(crate) fn materialize(id: impl Fn() -> NodeId) -> Result<Buffer> {
    capture::refuse_while_capturing("a read")?;
    loop {
        let st = state();
        let node_id = id();
        match &st.graph.node(node_id).value {
            Some(Value::Ready(b)) => return Ok(b.clone()),
            Some(Value::Host(bytes)) => {
                let bytes = bytes.clone();
                let device = Device::by_id(st.graph.node(node_id).device);
                drop(st);
                let buffer =
                    device.0.backend.upload(&bytes, device.poison_enabled()).map_err(|e| device_error(&device, e))?;
                install_upload(&mut state(), node_id, &buffer);
                return Ok(buffer);
            }
            Some(Value::InFlight(t)) => {
                let t = t.clone();
                drop(st);
                // A failed flush reverts its nodes to pending; the loop then computes them
                // here and reports this thread's own error.
                let _ = t.wait();
            }
            Some(Value::Lost(reason)) => return Err(Error::ValueLost(reason.clone())),
            Some(Value::Done | Value::Lent) => {
                unreachable!("tensors never name event nodes, and donated values have no tensor")
            }
            None => {
                drop(st);
                flush_nodes(&[node_id])?;
            }
        }
    }
}

/// Marks the node a version cell names as a parameter (exact-size memory).
pub(crate) fn mark_persistent(cell: &AtomicU32) {
    let mut st = state();
    let id = NodeId::new(cell.load(Ordering::Relaxed) as usize);
    st.graph.node_mut(id).persistent = true;
}

/// Runs `f` under the engine lock (autograd reads and writes its per-version bookkeeping only
/// there). `f` must not drop a `Tensor`.
pub(crate) fn locked<R>(f: impl FnOnce() -> R) -> R {
    let _st = state();
    f()
}

/// A second handle of the node a version cell names now (a snapshot that in-place updates
/// of the tensor do not move).
pub(crate) fn retain_current(cell: &AtomicU32) -> NodeId {
    let mut st = state();
    let id = NodeId::new(cell.load(Ordering::Relaxed) as usize);
    st.graph.node_mut(id).handles += 1;
    id
}

/// Marks the node a version cell names for offloading while idle.
pub(crate) fn hint_offload(cell: &AtomicU32) {
    let mut st = state();
    let id = NodeId::new(cell.load(Ordering::Relaxed) as usize);
    st.graph.node_mut(id).offload_hint = true;
}

/// The stream of the node a version cell names (read under the lock).
pub(crate) fn stream_of(cell: &AtomicU32) -> StreamId {
    let st = state();
    st.graph.node(NodeId::new(cell.load(Ordering::Relaxed) as usize)).stream
}

pub(crate) fn recorded_graph_dot() -> String {
    state().graph.to_dot(None)
}

/// Converts a device failure into the public error.
pub(crate) fn device_error(device: &Device, e: braid_devices::DeviceError) -> Error {
    Error::Device { device: device.name(), source: e }
}
