//! A device's recorded graph under its lock: the value state of each node ([`Value`]), the
//! bookkeeping of recording ([`EngineState`]), the guard that releases other engines' handles after
//! the lock is let go ([`Locked`]), and the collection of nodes nobody can read any more
//! ([`collect`]).
//!
//! Must never: run device work or take another engine's lock (see the engine's invariants in
//! `mod.rs`); a node leaves the graph here only when no handle, dependent or flush needs it.

use super::Engine;
use super::marks;
use crate::error::Result;
use crate::lock;
use braid_devices::Buffer;
use braid_graph::{Graph, Node, NodeId, StreamId};
use hashbrown::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

// Graph nodes are moved whole when added and removed (the graph hands a removed node back by
// value); at 128 bytes or less those moves are a few vector copies, above it a call to memcpy
// on every record and every release.
const _: () = assert!(std::mem::size_of::<Node<Value>>() <= 128);

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
    /// A value or event of another device (see [`Remote`]).
    Remote(Remote),
}

/// A leaf standing for a node of another engine: the input of a `to_device`, or an event of
/// another device that a stream of this one waits for. Until it is resolved (its buffer
/// fetched, its event reached) it holds one handle on the source node, released through the
/// engine's deferred releases, never under this engine's lock.
pub(crate) struct Remote {
    pub(crate) source: Arc<Engine>,
    pub(crate) node: NodeId,
    /// The source's buffer once fetched (`None` for an event, or before).
    pub(crate) fetched: Option<Buffer>,
    /// For an event: whether it was reached.
    pub(crate) reached: bool,
    pub(crate) event: bool,
}

impl Remote {
    /// Whether the flush can go ahead without asking the source engine again.
    pub(super) fn resolved(&self) -> bool {
        self.fetched.is_some() || self.reached
    }
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

/// One device's recorded graph and its bookkeeping.
pub(crate) struct EngineState {
    pub(crate) graph: Graph<Value>,
    /// Nodes whose value is neither computed nor being computed.
    pub(crate) pending: usize,
    /// While automatic flushes fail: the pending count the next one waits for (0 otherwise).
    pub(crate) auto_flush_after: usize,
    pub(crate) flushes: u64,
    /// Per stream: nodes of events (each with a handle counted for this list) that work
    /// recorded on it from now on must wait for.
    pub(super) waits: HashMap<StreamId, Vec<NodeId>>,
    /// Scratch of the flush being walked and extracted.
    pub(super) marks: marks::Marks,
    /// Handles on other engines' nodes to release once this lock is let go.
    pub(super) deferred: Vec<(Arc<Engine>, NodeId)>,
    /// The latest collective recorded here (of any group), with its recording order (see
    /// `collective.rs`).
    pub(super) last_collective: Option<(NodeId, u64)>,
    /// The latest backward passes recorded here (see `recompute_copies.rs`).
    pub(super) backward_marks: Vec<super::recompute_copies::BackwardMark>,
    /// Nodes a flush left pending for the backward pass to compute again (`recompute.rs`),
    /// with their place in the recording order (a vacated node id is reused). Entries whose
    /// node was computed or dropped since are pruned at each flush.
    pub(super) recomputing: HashMap<NodeId, u64>,
    /// Saved values a backward pass reads from elsewhere (`superseded.rs`).
    pub(super) superseded: super::superseded::Superseded,
}

impl EngineState {
    /// Whether `id` is pending because a flush left it for the backward pass to compute again.
    pub(super) fn is_recomputing(&self, id: NodeId) -> bool {
        let node = self.graph.node(id);
        node.value.is_none() && self.recomputing.get(&id) == Some(&node.seq)
    }
}

/// The engine's state under its lock. Handles on other engines' nodes that were dropped
/// meanwhile are released when the guard goes, after the lock is let go.
pub(crate) struct Locked<'a>(pub(super) Option<MutexGuard<'a, EngineState>>);

impl std::ops::Deref for Locked<'_> {
    type Target = EngineState;
    fn deref(&self) -> &EngineState {
        self.0.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut EngineState {
        self.0.as_mut().expect("held until dropped")
    }
}

impl Drop for Locked<'_> {
    #[inline]
    fn drop(&mut self) {
        let Some(mut guard) = self.0.take() else { return };
        if guard.deferred.is_empty() {
            return;
        }
        let deferred = std::mem::take(&mut guard.deferred);
        drop(guard);
        for (engine, node) in deferred {
            engine.release(node);
        }
    }
}

/// The recording order (program order) of every device's nodes: one counter for all engines,
/// so that a tensor made without taking its engine's lock (`Tensor::from_vec`, a replayed
/// step's output) can take its place in the order when it is made and keep it when it is
/// recorded later. Only comparisons within one engine mean anything.
static SEQ: AtomicU64 = AtomicU64::new(1);

/// The recording order the next node gets.
pub(crate) fn next_seq() -> u64 {
    SEQ.load(Ordering::Relaxed)
}

/// Takes a place in the recording order for a node recorded later (see [`SEQ`]).
pub(crate) fn reserve_seq() -> u64 {
    SEQ.fetch_add(1, Ordering::Relaxed)
}

/// Takes `n` places in the recording order at once; returns the first.
pub(crate) fn reserve_seqs(n: u64) -> u64 {
    SEQ.fetch_add(n, Ordering::Relaxed)
}

/// A value a tensor holds itself, without a node (see `Tensor::cell`): host data or a
/// computed buffer, with the stream and the place in the recording order it was made at.
pub(crate) struct Held {
    pub(crate) value: HeldValue,
    pub(crate) stream: StreamId,
    pub(crate) seq: u64,
}

/// What a tensor can hold without a node: the two values a leaf can have.
#[derive(Clone)]
pub(crate) enum HeldValue {
    /// Host data not yet on the device (as [`Value::Host`]).
    Host(Arc<[u8]>),
    /// A computed buffer (as [`Value::Ready`]).
    Ready(Buffer),
}

impl From<HeldValue> for Value {
    fn from(held: HeldValue) -> Value {
        match held {
            HeldValue::Host(bytes) => Value::Host(bytes),
            HeldValue::Ready(buffer) => Value::Ready(buffer),
        }
    }
}

impl EngineState {
    /// Adds a node, stamping its recording order.
    pub(super) fn add(&mut self, mut node: Node<Value>, inputs: &[NodeId]) -> NodeId {
        node.seq = reserve_seq();
        self.graph.add(node, inputs)
    }

    /// Whether event node `e` can never be reached: it was ordered after work a failed flush
    /// lost for good (a broken group's collectives). Waiting for it would poison its stream;
    /// the lost work's readers report the failure instead.
    fn lost(&self, e: NodeId) -> bool {
        matches!(self.graph.node(e).value, Some(Value::Lost(_)))
    }

    /// Whether event node `e` (this device's, or a remote leaf for another's) is reached.
    fn reached(&self, e: NodeId) -> bool {
        match &self.graph.node(e).value {
            Some(Value::Done) => true,
            Some(Value::Remote(r)) => r.reached,
            _ => false,
        }
    }

    /// Forgets the waits of every stream on events already reached (waiting for one orders
    /// nothing), releasing the handles the wait lists hold: a stream that waited and then
    /// recorded nothing more would otherwise keep its events forever.
    pub(super) fn forget_reached_waits(&mut self) {
        let mut done = Vec::new();
        let waits = std::mem::take(&mut self.waits);
        for (stream, events) in waits {
            let (reached, waiting): (Vec<NodeId>, Vec<NodeId>) =
                events.into_iter().partition(|&e| self.reached(e) || self.lost(e));
            done.extend(reached);
            if !waiting.is_empty() {
                self.waits.insert(stream, waiting);
            }
        }
        for e in done {
            self.drop_handle(e);
        }
    }

    /// Orders node `id` (just recorded on `stream`) after the events its stream waits for.
    /// Events already reached are forgotten.
    pub(super) fn apply_waits(&mut self, id: NodeId, stream: StreamId) {
        let Some(events) = self.waits.remove(&stream) else { return };
        let (done, waiting): (Vec<NodeId>, Vec<NodeId>) =
            events.into_iter().partition(|&e| self.reached(e) || self.lost(e));
        for &e in &waiting {
            self.graph.add_control(e, id);
        }
        if !waiting.is_empty() {
            self.waits.insert(stream, waiting);
        }
        for e in done {
            self.drop_handle(e);
        }
    }

    /// Drops one handle of `id` and releases whatever that makes unreachable.
    pub(super) fn drop_handle(&mut self, id: NodeId) {
        self.graph.node_mut(id).handles -= 1;
        collect(self, [id]);
    }
}

/// Removes every node reachable from `start` (towards inputs) that nobody can read any more:
/// no handle, no dependent node, not in flight. Freed buffers go back to their pool; handles
/// on other engines' nodes are released once the lock is let go.
pub(crate) fn collect(st: &mut EngineState, start: impl IntoIterator<Item = NodeId>) {
    let mut candidates: smallvec::SmallVec<[NodeId; 16]> = crate::small(start);
    while let Some(id) = candidates.pop() {
        if !st.graph.contains(id) {
            continue;
        }
        let node = st.graph.node(id);
        if node.handles > 0 || matches!(node.value, Some(Value::InFlight(_))) || st.graph.has_successors(id) {
            continue;
        }
        // Pushed one by one: `extend` reserves for the iterator's size hint first, which costs
        // more than the push itself for the zero or two inputs a node usually has.
        for p in st.graph.predecessors(id) {
            candidates.push(p);
        }
        // The value taken out first: the node itself (128 bytes) is dropped where the graph
        // hands it back, rather than moved up the stack.
        let value = st.graph.node_mut(id).value.take();
        st.graph.remove(id);
        match value {
            None => st.pending -= 1,
            Some(Value::Remote(r)) if !r.resolved() => st.deferred.push((r.source, r.node)),
            _ => {}
        }
    }
}
