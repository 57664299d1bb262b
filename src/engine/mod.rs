//! The engine: one per device. It holds the graph recorded for its device, records into it,
//! releases what nobody can read any more, and flushes what a read needs (`flush`, `run`) on
//! the device's runtime (`braid_devices::runtime`).
//!
//! Engines of different devices share nothing: each has its own lock, graph, plan cache and
//! settings, so work on independent devices never waits on one another. A value crosses to
//! another device only through a `to_device`, recorded in the destination's graph as a
//! *remote* leaf (a handle on the source's node) that the destination's flush fetches from the
//! source engine when it needs it; a wait for another device's event is a remote leaf too.
//!
//! Invariants kept here:
//! - A node leaves the graph only when no tensor names it, nothing pending depends on it and
//!   it is not being computed; so dropped, never-read tensors are never computed.
//! - A flushed value is kept (never recomputed) while a tensor or pending work needs it.
//! - The lock is never held while a device runs, and misuse is checked before it is taken, so
//!   recording never waits for device work and a caught panic cannot leave the graph
//!   half-updated. An engine holds another engine's lock only while recording a transfer, and
//!   then takes both in the order of their device ids, so locks never deadlock.
//!
//! The engine knows nothing of the API's handles (tensors, devices, streams): it deals in node
//! ids, version cells and its runtime.

pub(crate) mod cache;
pub(crate) mod capture;
mod collective;
pub(crate) mod dump;
pub(crate) mod env;
mod flush;
mod marks;
pub(crate) mod profile;
mod recompute;
mod recompute_copies;
mod run;
mod state;
mod superseded;
mod versions;

use crate::error::{Error, Result};
use crate::lock;
use braid_devices::{Backend, Buffer};
use braid_graph::{DType, DeviceId, Graph, Node, NodeId, Op, Shape, StreamId};
use dump::ScheduleDump;
use hashbrown::HashMap;
pub(crate) use state::{EngineState, Held, HeldValue, Locked, Remote, Ticket, Value, collect, reserve_seq};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Per-device choices that flushes read when they start.
#[derive(Default)]
pub(crate) struct Settings {
    /// `set_poison`'s choice; `None` follows `BRAID_POISON`.
    pub(crate) poison: Mutex<Option<bool>>,
    /// `set_fusion`'s choice; `None` follows `BRAID_FUSION`.
    pub(crate) fusion: Mutex<Option<bool>>,
    /// `set_recompute`'s choice; `None` follows `BRAID_RECOMPUTE`.
    pub(crate) recompute: Mutex<Option<bool>>,
    /// `set_memory_budget`'s cap on planned device memory; `u64::MAX` when none.
    pub(crate) budget: AtomicU64,
    /// Streams that default-stream work is spread over (`set_auto_streams`); empty when off.
    pub(crate) auto_streams: Mutex<Vec<StreamId>>,
    /// `set_profiling`: keep a profile of every flush.
    pub(crate) profiling: std::sync::atomic::AtomicBool,
}

/// A function applied to every schedule planned by an engine, before validation.
pub(crate) type ScheduleRewrite = Arc<dyn Fn(&mut braid_scheduler::Schedule) + Send + Sync>;

/// Fault injection, installed only by `braid::testing`: plans rewritten before validation, and
/// a failure at a given kernel of the next flush.
#[derive(Default)]
pub(crate) struct Faults {
    pub(crate) rewrite: Option<ScheduleRewrite>,
    pub(crate) fail_at: Option<u32>,
}

/// One device's engine.
pub(crate) struct Engine {
    pub(crate) id: DeviceId,
    pub(crate) backend: Arc<dyn Backend>,
    /// The element types the backend computes with (its target's, copied here so that
    /// recording checks a result's dtype without a call through the backend).
    pub(crate) dtypes: braid_graph::DTypes,
    /// The backend's name, made once (every flush's dump carries it).
    pub(crate) name: Arc<str>,
    state: Mutex<EngineState>,
    pub(crate) plans: Mutex<cache::PlanCache>,
    pub(crate) last_schedule: Mutex<Option<ScheduleDump>>,
    pub(crate) last_profile: Mutex<Option<profile::Profile>>,
    pub(crate) settings: Settings,
    pub(crate) faults: Mutex<Faults>,
}

/// Every engine ever created, by `DeviceId` (devices live for the whole program).
static ENGINES: Mutex<Vec<Arc<Engine>>> = Mutex::new(Vec::new());

/// Default for [`max_pending_nodes`].
pub const DEFAULT_MAX_PENDING: usize = 32_768;
static MAX_PENDING: AtomicUsize = AtomicUsize::new(DEFAULT_MAX_PENDING);

/// Sets how many pending nodes may accumulate on a device before recording flushes them
/// without being asked (default [`DEFAULT_MAX_PENDING`]). `0` means no limit.
pub fn set_max_pending_nodes(n: usize) {
    MAX_PENDING.store(n, Ordering::Relaxed);
}

pub fn max_pending_nodes() -> usize {
    MAX_PENDING.load(Ordering::Relaxed)
}

/// Every engine, in creation order.
pub(crate) fn engines() -> Vec<Arc<Engine>> {
    lock(&ENGINES).clone()
}

/// Extra handles taken while recording (autograd keeps the values a derivative reads).
pub(crate) struct Retainer<'a>(&'a mut EngineState);

impl Retainer<'_> {
    /// Marks `id` as a parameter version (its buffer comes from exact-size memory).
    pub(crate) fn mark_persistent(&mut self, id: NodeId) {
        self.0.graph.node_mut(id).persistent = true;
    }

    /// Counts one more handle of `id` for a value autograd keeps for a derivative; the caller
    /// owns it (a tensor made with it releases it when dropped). Returns whether it counts as
    /// a saved one (then it is released with [`Engine::release_saved`], else as any handle).
    pub(crate) fn retain_saved(&mut self, id: NodeId) -> bool {
        let node = self.0.graph.node_mut(id);
        node.handles += 1;
        let counted = node.saved < u8::MAX;
        node.saved += u8::from(counted);
        counted
    }
}

/// Runs under the engine lock after a node is recorded, with the input versions that were read
/// and the new node, so that autograd's bookkeeping agrees with the versions. It must not drop
/// a tensor (that takes the lock): return such things to be dropped afterwards.
pub(crate) type Track<'a> = &'a mut dyn FnMut(&mut Retainer<'_>, &[NodeId], NodeId);

/// What to record: an op, its result's type and stream.
pub(crate) struct NewNode {
    pub(crate) op: Op,
    pub(crate) dtype: DType,
    pub(crate) shape: Shape,
    pub(crate) stream: StreamId,
}

impl Engine {
    /// A new engine over `backend`, registered under the next device id.
    pub(crate) fn create(backend: Arc<dyn Backend>) -> Arc<Engine> {
        let mut engines = lock(&ENGINES);
        let engine = Arc::new(Engine {
            id: DeviceId(engines.len() as u32),
            dtypes: backend.target().dtypes,
            name: backend.name().into(),
            backend,
            state: Mutex::new(EngineState {
                graph: Graph::new(),
                pending: 0,
                auto_flush_after: 0,
                flushes: 0,
                waits: HashMap::new(),
                marks: marks::Marks::default(),
                deferred: Vec::new(),
                last_collective: None,
                backward_marks: Vec::new(),
                recomputing: HashMap::new(),
                superseded: Default::default(),
            }),
            plans: Mutex::new(Default::default()),
            last_schedule: Mutex::new(None),
            last_profile: Mutex::new(None),
            settings: Settings { budget: AtomicU64::new(u64::MAX), ..Default::default() },
            faults: Mutex::new(Faults::default()),
        });
        engines.push(engine.clone());
        engine
    }

    pub(crate) fn state(&self) -> Locked<'_> {
        Locked(Some(lock(&self.state)))
    }

    /// The device's name, for messages.
    pub(crate) fn name(&self) -> String {
        self.name.to_string()
    }

    /// Converts a device failure into the public error.
    pub(crate) fn device_error(&self, e: braid_devices::DeviceError) -> Error {
        Error::Device { device: self.name(), source: e }
    }

    pub(crate) fn poison_enabled(&self) -> bool {
        lock(&self.settings.poison).unwrap_or_else(|| env::flag("BRAID_POISON").ok().flatten().unwrap_or(false))
    }

    pub(crate) fn fusion_enabled(&self) -> bool {
        lock(&self.settings.fusion).unwrap_or_else(|| env::flag("BRAID_FUSION").ok().flatten().unwrap_or(true))
    }

    /// Whether a flush run under `env` poisons freed memory (the device's setting, else the
    /// variable's).
    pub(crate) fn poison_under(&self, env: &env::FlushEnv) -> bool {
        lock(&self.settings.poison).unwrap_or(env.poison.unwrap_or(false))
    }

    /// Whether a flush run under `env` fuses.
    pub(crate) fn fusion_under(&self, env: &env::FlushEnv) -> bool {
        lock(&self.settings.fusion).unwrap_or(env.fusion.unwrap_or(true))
    }

    /// Whether flushes starting now recompute saved values (which needs fusion too).
    pub(crate) fn recompute_enabled(&self) -> bool {
        self.recompute_possible()
            && self.fusion_enabled()
            && lock(&self.settings.recompute)
                .unwrap_or_else(|| env::flag("BRAID_RECOMPUTE").ok().flatten().unwrap_or(true))
    }

    /// Whether a flush run under `env` leaves saved values to be recomputed (`flush::recompute`;
    /// only where it fuses: unfused, every recomputed node would be a kernel of its own).
    pub(crate) fn recompute_under(&self, env: &env::FlushEnv) -> bool {
        self.recompute_possible()
            && self.fusion_under(env)
            && lock(&self.settings.recompute).unwrap_or(env.recompute.unwrap_or(true))
    }

    /// Recomputation changes which values a kernel stores, which must not change results. A
    /// platform whose math is not the op table's (WGSL's compilers may fold arithmetic on a
    /// value they never store: `x - x` is 0 even for a NaN `x`, found by the property suites on
    /// lavapipe) gives results that depend on it, so it runs there never.
    fn recompute_possible(&self) -> bool {
        self.backend.target().math == braid_graph::PlatformMath::TABLE
    }

    pub(crate) fn memory_budget(&self) -> Option<u64> {
        let b = self.settings.budget.load(Ordering::Relaxed);
        (b != u64::MAX).then_some(b)
    }

    /// Records a node over the current versions named by `inputs` and returns it with one
    /// handle counted.
    ///
    /// `inputs` are the tensors' version cells, read under the lock (another thread may be moving a
    /// tensor to a new version). With `version_of`, the new node becomes that tensor's current
    /// version in the same critical section, and the old version loses the handle.
    pub(crate) fn record(
        &self,
        new: NewNode,
        inputs: &[&AtomicU32],
        version_of: Option<&AtomicU32>,
        track: Option<Track<'_>>,
    ) -> NodeId {
        let _span = tracing::trace_span!(target: "braid::record", "record", op = new.op.name()).entered();
        let mut st = self.state();
        let nodes: smallvec::SmallVec<[NodeId; 3]> =
            crate::small(inputs.iter().map(|cell| NodeId::new(cell.load(Ordering::Relaxed) as usize)));
        let id = self.add_recorded(&mut st, new, &nodes, version_of, track);
        self.finish_record(st);
        id
    }

    /// The part of recording done under the lock.
    fn add_recorded(
        &self,
        st: &mut EngineState,
        new: NewNode,
        nodes: &[NodeId],
        version_of: Option<&AtomicU32>,
        track: Option<Track<'_>>,
    ) -> NodeId {
        let stream = new.stream;
        let mut node = Node::new(new.op, new.dtype, new.shape, self.id, stream);
        node.handles = 1;
        let id = st.add(node, nodes);
        st.pending += 1;
        if let Some(track) = track {
            track(&mut Retainer(st), nodes, id);
        }
        if let Some(cell) = version_of {
            // The handle `add` counted is the tensor's, moved from its old version.
            let old = NodeId::new(cell.swap(id.index() as u32, Ordering::Relaxed) as usize);
            st.drop_handle(old);
        }
        if !st.waits.is_empty() {
            st.apply_waits(id, stream);
        }
        id
    }

    /// Lets the lock go and, past the bound on pending nodes, flushes (not inside a capture:
    /// the step's work must stay pending until its own flush). After an automatic flush fails,
    /// the next one waits until twice as many nodes are pending: the work of a failed flush
    /// stays pending (its read reports the error), and flushing it again at every op would make
    /// recording quadratic.
    fn finish_record(&self, st: Locked<'_>) {
        let limit = MAX_PENDING.load(Ordering::Relaxed);
        let over = limit != 0 && st.pending > limit.max(st.auto_flush_after) && !capture::capturing();
        drop(st);
        if over {
            // The new node has its handle counted, so the flush keeps it.
            let failed = self.flush_all().err();
            let mut st = self.state();
            st.auto_flush_after = if failed.is_some() { st.pending.saturating_mul(2) } else { 0 };
            drop(st);
            if let Some(e) = failed {
                tracing::warn!(target: "braid::flush", "automatic flush failed (the read will report it): {e}");
            }
        }
    }

    /// Records `to_device` of the version `source_cell` names on `source` (another engine)
    /// into this engine: a remote leaf holding a handle on that version, and the transfer
    /// over it. Both locks are held (in device-id order), so the version and its gradient
    /// bookkeeping are read together.
    pub(crate) fn record_transfer(
        self: &Arc<Engine>,
        source: &Arc<Engine>,
        source_cell: &AtomicU32,
        new: NewNode,
        track: Option<Track<'_>>,
    ) -> NodeId {
        let (mut mine, mut theirs) = if self.id < source.id {
            let mine = self.state();
            (mine, source.state())
        } else {
            let theirs = source.state();
            (self.state(), theirs)
        };
        let src = NodeId::new(source_cell.load(Ordering::Relaxed) as usize);
        theirs.graph.node_mut(src).handles += 1;
        let (dtype, shape) = (theirs.graph.node(src).dtype, theirs.graph.node(src).shape.clone());
        let mut leaf = Node::new(Op::Input, dtype, shape, self.id, new.stream);
        leaf.value = Some(Value::Remote(Remote {
            source: source.clone(),
            node: src,
            fetched: None,
            reached: false,
            event: false,
        }));
        let leaf = mine.add(leaf, &[]);
        let id = self.add_recorded(&mut mine, new, &[leaf], None, track);
        drop(theirs);
        self.finish_record(mine);
        id
    }

    /// Records a leaf holding a computed buffer (an output of a captured step's replay).
    pub(crate) fn record_ready(&self, dtype: DType, shape: Shape, stream: StreamId, buffer: Buffer) -> NodeId {
        let node = self.leaf(dtype, shape, stream, Value::Ready(buffer));
        self.state().add(node, &[])
    }

    /// A leaf of this device holding `value`, with the handle of the tensor that will name it.
    fn leaf(&self, dtype: DType, shape: Shape, stream: StreamId, value: Value) -> Node<Value> {
        let mut node = Node::new(Op::Input, dtype, shape, self.id, stream);
        node.handles = 1;
        node.value = Some(value);
        node
    }

    /// Records a tensor's held value (see `Tensor::cell`) as a leaf at the place in the
    /// recording order it was made at, and points `cell` at it, unless another thread did
    /// first.
    pub(crate) fn attach_held(&self, cell: &AtomicU32, held: &Mutex<Option<Held>>, dtype: DType, shape: &Shape) {
        let mut st = self.state();
        // Under the engine lock, then the tensor's: the order every taker of both follows.
        let mut held = crate::lock(held);
        if let Some(Held { value, stream, seq }) = held.take() {
            let mut node = self.leaf(dtype, shape.clone(), stream, value.into());
            // Not `EngineState::add`, which would stamp the order of now.
            node.seq = seq;
            let id = st.graph.add(node, &[]);
            cell.store(id.index() as u32, Ordering::Release);
        }
    }

    /// Records a user event on `stream`: a node ordered after every pending or running node
    /// recorded on the stream so far (after those of them that no later node of the stream
    /// depends on, which implies the rest). Returned with one handle counted.
    pub(crate) fn record_event(&self, stream: StreamId) -> NodeId {
        let mut st = self.state();
        // Work on the stream not done yet; not a value a flush left pending for the backward
        // pass to compute again (its readers compute it, after what it reads, which its data
        // edges order; ordering the event after it would hold the event back to those readers).
        let on_stream = |st: &EngineState, n: NodeId| {
            let node = st.graph.node(n);
            node.stream == stream
                && match node.value {
                    None => !st.is_recomputing(n),
                    Some(Value::InFlight(_)) => true,
                    _ => false,
                }
        };
        let tail: Vec<NodeId> = st
            .graph
            .node_ids()
            .filter(|&n| on_stream(&st, n) && !st.graph.successors(n).any(|s| on_stream(&st, s)))
            .collect();
        let mut node = Node::new(Op::Event, DType::Bool, Shape::from([0]), self.id, stream);
        node.handles = 1;
        let id = st.add(node, &[]);
        st.pending += 1;
        for t in tail {
            st.graph.add_control(t, id);
        }
        if !st.waits.is_empty() {
            st.apply_waits(id, stream);
        }
        id
    }

    /// Makes work recorded on `stream` from now on wait for the event node `event` of
    /// `source` (this engine or another one).
    pub(crate) fn wait_event(self: &Arc<Engine>, stream: StreamId, source: &Arc<Engine>, event: NodeId) {
        if Arc::ptr_eq(self, source) {
            let mut st = self.state();
            if matches!(st.graph.node(event).value, Some(Value::Done)) {
                return;
            }
            let list = st.waits.entry(stream).or_default();
            if !list.contains(&event) {
                list.push(event);
                st.graph.node_mut(event).handles += 1;
            }
            return;
        }
        // Another device's event: a remote leaf here, which a flush waits for on the host.
        let src = {
            let mut theirs = source.state();
            if matches!(theirs.graph.node(event).value, Some(Value::Done)) {
                return;
            }
            theirs.graph.node_mut(event).handles += 1;
            event
        };
        let mut st = self.state();
        let mut leaf = Node::new(Op::Event, DType::Bool, Shape::from([0]), self.id, stream);
        leaf.handles = 1; // the wait list's
        leaf.value = Some(Value::Remote(Remote {
            source: source.clone(),
            node: src,
            fetched: None,
            reached: false,
            event: true,
        }));
        let leaf = st.add(leaf, &[]);
        st.waits.entry(stream).or_default().push(leaf);
    }

    /// Runs what a user event depends on and waits until it is reached (on a GPU: until the
    /// GPU has run everything enqueued so far, the event's work among it).
    pub(crate) fn complete(&self, id: NodeId) -> Result<()> {
        loop {
            let st = self.state();
            match &st.graph.node(id).value {
                Some(Value::Done) => {
                    drop(st);
                    return self.backend.synchronize().map_err(|e| self.device_error(e));
                }
                Some(Value::InFlight(t)) => {
                    let t = t.clone();
                    drop(st);
                    let _ = t.wait();
                }
                _ => {
                    drop(st);
                    self.flush_nodes(&[id])?;
                }
            }
        }
    }

    /// Marks an uploaded leaf as ready (unless it is gone or was uploaded meanwhile).
    pub(crate) fn install_upload(st: &mut EngineState, id: NodeId, buffer: &Buffer) {
        if st.graph.contains(id) && matches!(st.graph.node(id).value, Some(Value::Host(_))) {
            st.graph.node_mut(id).value = Some(Value::Ready(buffer.clone()));
        }
    }

    /// Drops one handle of `id` and releases whatever that makes unreachable.
    pub(crate) fn release(&self, id: NodeId) {
        self.state().drop_handle(id);
    }

    /// Drops a handle taken with [`Retainer::retain_saved`].
    pub(crate) fn release_saved(&self, id: NodeId) {
        let mut st = self.state();
        st.graph.node_mut(id).saved -= 1;
        st.drop_handle(id);
    }

    /// The value of `id`, computing it first if needed.
    pub(crate) fn materialize(&self, id: impl Fn() -> NodeId) -> Result<Buffer> {
        self.materialize_with(id, None)
    }

    /// [`Engine::materialize`], an upload poisoning its buffer's memory when freed as `poison`
    /// says (read from the device and the environment when `None`).
    pub(crate) fn materialize_with(&self, id: impl Fn() -> NodeId, poison: Option<bool>) -> Result<Buffer> {
        capture::refuse_while_capturing("a read")?;
        loop {
            let st = self.state();
            let node_id = id();
            match &st.graph.node(node_id).value {
                Some(Value::Ready(b)) => return Ok(b.clone()),
                Some(Value::Host(bytes)) => {
                    let bytes = bytes.clone();
                    drop(st);
                    let buffer = self
                        .backend
                        .upload(&bytes, poison.unwrap_or_else(|| self.poison_enabled()))
                        .map_err(|e| self.device_error(e))?;
                    Engine::install_upload(&mut self.state(), node_id, &buffer);
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
                Some(Value::Done | Value::Lent | Value::Remote(_)) => {
                    return Err(Error::Internal("a read of an event, a donated value or a remote leaf".into()));
                }
                None => {
                    drop(st);
                    self.flush_nodes(&[node_id])?;
                }
            }
        }
    }

    /// Runs `f` on the state under the lock.
    pub(crate) fn with_state<R>(&self, f: impl FnOnce(&mut EngineState) -> R) -> R {
        f(&mut self.state())
    }

    /// Marks the node a version cell names as a parameter (exact-size memory).
    pub(crate) fn mark_persistent(&self, cell: &AtomicU32) {
        self.with_state(|st| st.graph.node_mut(current(cell)).persistent = true)
    }

    /// A second handle of the node a version cell names now (a snapshot that in-place updates
    /// of the tensor do not move).
    pub(crate) fn retain_current(&self, cell: &AtomicU32) -> NodeId {
        self.with_state(|st| {
            let id = current(cell);
            st.graph.node_mut(id).handles += 1;
            id
        })
    }

    /// Marks the node a version cell names for offloading while idle.
    pub(crate) fn hint_offload(&self, cell: &AtomicU32) {
        self.with_state(|st| st.graph.node_mut(current(cell)).offload_hint = true)
    }

    /// The stream of the node a version cell names (read under the lock).
    pub(crate) fn stream_of(&self, cell: &AtomicU32) -> StreamId {
        self.with_state(|st| st.graph.node(current(cell)).stream)
    }

    pub(crate) fn recorded_graph_dot(&self) -> String {
        self.state().graph.to_dot(None)
    }
}

/// The node a version cell names now.
fn current(cell: &AtomicU32) -> NodeId {
    NodeId::new(cell.load(Ordering::Relaxed) as usize)
}
