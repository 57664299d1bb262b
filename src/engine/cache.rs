//! Caches that make a repeated graph cheap: whole plans (the schedule and its lowered kernels)
//! keyed by the structure of the flushed subgraph, and lowered kernels interned by their IR.
//!
//! The structural key covers what the plan depends on: every node's op (with its constants),
//! dtype, shape, stream, inputs, control edges and whether it is kept, hinted for offload or a
//! parameter; the externals' dtypes, shapes, streams and whether they are donated (uploaded at
//! their first use or not), parameters, or another device's (copied by a transfer, or read in
//! place); whether fusion is on and the device's memory budget. Data never enters the key, so
//! the second and later iterations of a training loop skip fusion, planning, validation and
//! lowering. (A graph with `rand`/`randn` carries fresh seeds each time and is planned anew.) The
//! key is that structure written out as bytes and compared whole, so two different graphs never
//! share a plan; plans are evicted oldest first beyond a count and a total key size.
//!
//! A user's streams enter the key by their rank among the graph's streams, not by their ids
//! (the default stream and the engine's copy and offload streams by their ids): a program that
//! makes new streams every step reuses its plan, renamed to the new streams
//! ([`Plan::on_streams`]).

use braid_graph::{FlushGraph, StreamId};
use braid_lowering::Kernel;
use braid_scheduler::{COPY_STREAM, OFFLOAD_STREAM, Schedule};
use hashbrown::HashMap;
use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

const MAX_PLANS: usize = 512;
/// Total bytes of the keys kept (a key takes on the order of 100 bytes per node).
const MAX_KEY_BYTES: usize = 64 << 20;
const MAX_KERNELS: usize = 4096;

/// A validated schedule and its kernels, ready to run again.
pub(crate) struct Plan {
    pub(crate) schedule: Arc<Schedule>,
    pub(crate) kernels: Arc<[Arc<Kernel>]>,
    /// The user streams it was planned on ([`user_streams`]).
    pub(crate) streams: Vec<StreamId>,
}

impl Plan {
    /// The schedule for a graph of the same key on `streams` (its [`user_streams`]): this
    /// plan's, with its streams renamed when they were others.
    pub(crate) fn on_streams(&self, streams: &[StreamId]) -> Arc<Schedule> {
        if self.streams == streams {
            return self.schedule.clone();
        }
        let rename = |s: StreamId| self.streams.iter().position(|&p| p == s).map_or(s, |i| streams[i]);
        Arc::new(self.schedule.with_streams_renamed(&rename))
    }
}

/// Whether `s` is one of the streams whose id means something to the planner: the default
/// stream, the copy stream and the offload stream.
fn is_engine_stream(s: StreamId) -> bool {
    s == StreamId(0) || s == COPY_STREAM || s == OFFLOAD_STREAM
}

/// The other streams of `graph` (the user's), in increasing order of id.
pub(crate) fn user_streams(graph: &FlushGraph) -> Vec<StreamId> {
    let all = graph.nodes.iter().map(|n| n.stream).chain(graph.externals.iter().map(|e| e.stream));
    let mut streams: Vec<StreamId> = all.filter(|&s| !is_engine_stream(s)).collect();
    streams.sort_unstable();
    streams.dedup();
    streams
}

/// The structure of a flush graph, written out (kept shared once a plan is stored under it).
type Key = Arc<[u8]>;

#[derive(Default)]
pub(crate) struct PlanCache {
    plans: HashMap<Key, Arc<Plan>>,
    order: VecDeque<Key>,
    key_bytes: usize,
    kernels: HashMap<Arc<Kernel>, ()>,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
}

impl PlanCache {
    /// The structural key of a flush graph whose user streams are `streams`
    /// ([`user_streams`]; a lookup needs only the key's bytes: a hit, the usual case, copies it
    /// nowhere).
    pub(crate) fn key(graph: &FlushGraph, fusion: bool, budget: Option<u64>, streams: &[StreamId]) -> Vec<u8> {
        // An engine stream by its id, a user's by its rank (ids are below u32::MAX - 1).
        let stream = |s: StreamId| match streams.binary_search(&s) {
            Ok(rank) if !is_engine_stream(s) => (1u8, rank as u32),
            _ => (0u8, s.0),
        };
        let mut w = KeyWriter(Vec::with_capacity(64 + 112 * graph.nodes.len() + 48 * graph.externals.len()));
        fusion.hash(&mut w);
        budget.hash(&mut w);
        graph.nodes.len().hash(&mut w);
        graph.externals.len().hash(&mut w);
        for n in &graph.nodes {
            n.op.hash(&mut w);
            n.dtype.hash(&mut w);
            n.shape.hash(&mut w);
            n.device.hash(&mut w);
            stream(n.stream).hash(&mut w);
            n.inputs.hash(&mut w);
            n.after.hash(&mut w);
            (n.keep, n.offload_hint, n.persistent, n.recomputed).hash(&mut w);
        }
        for e in &graph.externals {
            e.dtype.hash(&mut w);
            e.shape.hash(&mut w);
            stream(e.stream).hash(&mut w);
            (e.donated, e.on_host, e.offloaded, e.persistent, e.overwritable, e.remote, e.foreign).hash(&mut w);
        }
        w.0
    }

    pub(crate) fn get(&mut self, key: &[u8]) -> Option<Arc<Plan>> {
        let hit = self.plans.get(key).cloned();
        if hit.is_some() {
            self.hits += 1
        } else {
            self.misses += 1
        }
        hit
    }

    pub(crate) fn insert(&mut self, key: Vec<u8>, plan: Arc<Plan>) {
        let key: Key = key.into();
        if self.plans.insert(key.clone(), plan).is_none() {
            self.key_bytes += key.len();
            self.order.push_back(key);
        }
        while self.order.len() > MAX_PLANS || (self.key_bytes > MAX_KEY_BYTES && self.order.len() > 1) {
            if let Some(old) = self.order.pop_front() {
                self.key_bytes -= old.len();
                self.plans.remove(&old);
            }
        }
    }

    /// The shared copy of a kernel with this IR (one copy per distinct kernel).
    pub(crate) fn intern(&mut self, kernel: Kernel) -> Arc<Kernel> {
        if let Some((k, _)) = self.kernels.get_key_value(&kernel) {
            return k.clone();
        }
        if self.kernels.len() >= MAX_KERNELS {
            self.kernels.clear();
        }
        let k = Arc::new(kernel);
        self.kernels.insert(k.clone(), ());
        k
    }
}

/// Writes what `Hash` impls feed it as bytes (a structural key, not a hash).
struct KeyWriter(Vec<u8>);

impl Hasher for KeyWriter {
    fn finish(&self) -> u64 {
        unreachable!("a key is its bytes")
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes)
    }
}
