//! Caches that make a repeated graph cheap: whole plans (the schedule and its lowered kernels)
//! keyed by the structure of the flushed subgraph, and lowered kernels interned by their IR.
//!
//! The structural key covers what the plan depends on: every node's op (with its constants),
//! dtype, shape, stream, inputs, control edges and whether it is kept or hinted for offload; the externals'
//! dtypes, shapes, streams and whether they are donated; whether fusion is on and the device's memory budget. Data never
//! enters the key, so the second and later iterations of a training loop skip fusion, planning,
//! validation and lowering. (A graph with `rand`/`randn` carries fresh seeds each time and is
//! planned anew.) The key is 128 bits from two independent hashers; entries are evicted oldest
//! first beyond a fixed count.

use braid_graph::FlushGraph;
use braid_lowering::Kernel;
use braid_scheduler::Schedule;
use hashbrown::HashMap;
use std::collections::VecDeque;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

const MAX_PLANS: usize = 512;
const MAX_KERNELS: usize = 4096;

/// A validated schedule and its kernels, ready to run again.
pub(crate) struct Plan {
    pub(crate) schedule: Arc<Schedule>,
    pub(crate) kernels: Arc<[Arc<Kernel>]>,
}

pub(crate) type Key = (u64, u64);

#[derive(Default)]
pub(crate) struct PlanCache {
    hashers: (hashbrown::DefaultHashBuilder, hashbrown::DefaultHashBuilder),
    plans: HashMap<Key, Arc<Plan>>,
    order: VecDeque<Key>,
    kernels: HashMap<Arc<Kernel>, ()>,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
}

impl PlanCache {
    /// The structural key of a flush graph.
    pub(crate) fn key(&self, graph: &FlushGraph, fusion: bool, budget: Option<u64>) -> Key {
        let (mut a, mut b) = (self.hashers.0.build_hasher(), self.hashers.1.build_hasher());
        let mut both = |f: &dyn Fn(&mut dyn Hasher)| {
            f(&mut a);
            f(&mut b);
        };
        both(&|h| {
            fusion.hash(&mut HashTo(h));
            budget.hash(&mut HashTo(h));
            graph.nodes.len().hash(&mut HashTo(h));
            graph.externals.len().hash(&mut HashTo(h));
        });
        for n in &graph.nodes {
            both(&|h| {
                let mut h = HashTo(h);
                n.op.hash(&mut h);
                n.dtype.hash(&mut h);
                n.shape.hash(&mut h);
                n.device.hash(&mut h);
                n.stream.hash(&mut h);
                n.inputs.hash(&mut h);
                n.after.hash(&mut h);
                n.keep.hash(&mut h);
                n.offload_hint.hash(&mut h);
                n.persistent.hash(&mut h);
            });
        }
        for e in &graph.externals {
            both(&|h| {
                let mut h = HashTo(h);
                e.dtype.hash(&mut h);
                e.shape.hash(&mut h);
                e.stream.hash(&mut h);
                e.donated.hash(&mut h);
            });
        }
        (a.finish(), b.finish())
    }

    pub(crate) fn get(&mut self, key: Key) -> Option<Arc<Plan>> {
        let hit = self.plans.get(&key).cloned();
        if hit.is_some() {
            self.hits += 1
        } else {
            self.misses += 1
        }
        hit
    }

    pub(crate) fn insert(&mut self, key: Key, plan: Arc<Plan>) {
        if self.plans.insert(key, plan).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > MAX_PLANS {
            if let Some(old) = self.order.pop_front() {
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

/// Lets `Hash` impls write into a `dyn Hasher`.
struct HashTo<'a>(&'a mut dyn Hasher);

impl Hasher for HashTo<'_> {
    fn finish(&self) -> u64 {
        self.0.finish()
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes)
    }
    fn write_u8(&mut self, i: u8) {
        self.0.write_u8(i)
    }
    fn write_u32(&mut self, i: u32) {
        self.0.write_u32(i)
    }
    fn write_u64(&mut self, i: u64) {
        self.0.write_u64(i)
    }
    fn write_usize(&mut self, i: usize) {
        self.0.write_usize(i)
    }
}
