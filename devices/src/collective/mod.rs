//! Collectives: the groups of devices that reduce, gather, scatter and broadcast together, and
//! the rendezvous every member's part of a collective goes through.
//!
//! A group is registered here under a process-wide id by `braid::dist::Group`; each member
//! device's flush runs its part of a collective (`Body::Collective`, on the device's
//! communication stream) through [`Queue::collective`](crate::runtime::Queue::collective).
//! Members meet by *sequence number*: the `k`-th collective a rank runs pairs with the `k`-th of
//! every other rank (as with NCCL), which holds because every rank records the same collectives
//! in the same order and a device runs its collectives in recording order.
//!
//! The rendezvous is where failure and lateness are handled, for every transport:
//! - a rank that has not arrived after a short while is *nudged* (the engine flushes that
//!   device's pending work, so that one thread can drive every device of a group);
//! - a rank that does not arrive within the group's timeout, or whose flush failed
//!   ([`RankGroup::abort`]), breaks the group: every rank waiting, and every later collective of
//!   the group, returns an `Err` naming the rank and the collective, never hangs;
//! - ranks that disagree on what the `k`-th collective is (kind, dtype, length) break it too.
//!
//! CPU devices exchange the data here ([`host`]); CUDA devices only meet here and move the data
//! with NCCL on their streams. This module never plans, and never touches an engine.

pub mod host;
pub mod net;

use crate::DeviceError;
use braid_graph::{Collective, DType};
use hashbrown::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a rank waits at a collective for the others before the group is broken, unless
/// the group sets another ([`RankGroup::set_timeout`]) or `BRAID_COLLECTIVE_TIMEOUT` (seconds) does.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// `BRAID_COLLECTIVE_TIMEOUT` (seconds) if set and positive, else [`DEFAULT_TIMEOUT`].
pub fn timeout_from_env() -> Duration {
    std::env::var("BRAID_COLLECTIVE_TIMEOUT")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64)
}

/// How long a rank waits for a late one before nudging it.
const NUDGE_AFTER: Duration = Duration::from_millis(20);

/// Called with a late rank's number: makes that rank's device run its pending work.
pub type Nudge = Box<dyn Fn(u32) + Send + Sync>;

/// What one rank says the `k`-th collective is: ranks must agree.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Shape {
    kind: braid_graph::CollectiveKind,
    dtype: DType,
    input_len: usize,
}

/// One collective in progress: who arrived (with their input, for host transports), who is
/// done with everyone's inputs.
struct Round {
    shape: Shape,
    inputs: Vec<Option<(usize, usize)>>,
    arrived: u32,
    finished: u32,
    nudged: bool,
}

#[derive(Default)]
struct RendezvousState {
    /// Per rank: the sequence number of its next collective.
    next: Vec<u64>,
    rounds: HashMap<u64, Round>,
    /// Why the group is broken (a rank failed, was too late, or disagreed).
    broken: Option<String>,
}

/// A group of ranks that run collectives together (one per member device in this process).
pub struct RankGroup {
    id: u64,
    size: u32,
    /// The ranks this process holds (every rank, unless the group spans processes).
    local: Vec<u32>,
    /// The connection to the other processes of a group that spans processes.
    net: Option<net::Net>,
    timeout: Mutex<Duration>,
    state: Mutex<RendezvousState>,
    cv: Condvar,
    nudge: Option<Nudge>,
    /// What a backend set up for the group (NCCL communicators), for its queues to find.
    transport: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
}

/// A rank's place in a collective once every rank has arrived: the sequence number, and (for
/// the host transport) every rank's input.
pub struct Arrival {
    pub seq: u64,
    inputs: Vec<(usize, usize)>,
}

impl RankGroup {
    /// A group of `size` ranks. `nudge` is called (from a waiting rank's thread) with a rank
    /// that is late to a collective.
    pub fn new(id: u64, size: u32, nudge: Option<Nudge>) -> RankGroup {
        RankGroup::with_ranks(id, size, (0..size).collect(), None, nudge)
    }

    /// A group of `size` ranks spread over processes, of which this process holds rank `rank`
    /// and talks to the others through `net`.
    pub fn spanning(id: u64, size: u32, rank: u32, net: net::Net) -> RankGroup {
        RankGroup::with_ranks(id, size, vec![rank], Some(net), None)
    }

    fn with_ranks(id: u64, size: u32, local: Vec<u32>, net: Option<net::Net>, nudge: Option<Nudge>) -> RankGroup {
        let timeout = timeout_from_env();
        if let Some(net) = &net {
            net.set_timeout(timeout);
        }
        RankGroup {
            id,
            size,
            local,
            net,
            timeout: Mutex::new(timeout),
            state: Mutex::new(RendezvousState { next: vec![0; size as usize], ..Default::default() }),
            cv: Condvar::new(),
            nudge,
            transport: std::sync::OnceLock::new(),
        }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn size(&self) -> u32 {
        self.size
    }

    /// How long a rank waits for the others at one collective before the group is broken.
    pub fn set_timeout(&self, timeout: Duration) {
        *lock(&self.timeout) = timeout;
        if let Some(net) = &self.net {
            net.set_timeout(timeout);
        }
    }

    /// The connection to the other processes, for a group that spans processes.
    pub fn net(&self) -> Option<&net::Net> {
        self.net.as_ref()
    }

    /// The ranks held by this process.
    pub fn local_ranks(&self) -> &[u32] {
        &self.local
    }

    /// Keeps what a backend set up for this group (set once, when the group is made).
    pub fn set_transport(&self, transport: Box<dyn std::any::Any + Send + Sync>) {
        let _ = self.transport.set(transport);
    }

    /// What a backend set up for this group, if it is a `T`.
    pub fn transport<T: 'static>(&self) -> Option<&T> {
        self.transport.get().and_then(|t| t.downcast_ref())
    }

    /// Why the group is broken, if it is.
    pub fn broken(&self) -> Option<String> {
        lock(&self.state).broken.clone()
    }

    /// Breaks the group because rank `rank` failed (its flush returned `reason`): every rank
    /// waiting at a collective, and every later collective, returns an `Err` saying so.
    pub fn abort(&self, rank: u32, reason: &str) {
        let reason = format!("rank {rank} failed: {reason}");
        if let Some(net) = &self.net {
            net.abort(&reason);
        }
        self.break_with(reason);
    }

    /// Breaks the group for `reason` (a failure seen by this process).
    pub fn break_with(&self, reason: String) {
        let mut st = lock(&self.state);
        if st.broken.is_none() {
            tracing::warn!(target: "braid::dist", "group {} is broken: {reason}", self.id);
            st.broken = Some(reason);
        }
        drop(st);
        self.cv.notify_all();
    }

    fn error(&self, what: &str, reason: &str) -> DeviceError {
        DeviceError::Collective(format!("{what} of group {}: the group is broken ({reason})", self.id))
    }

    /// Rank `rank` arrives at its next collective `c` over `input` (its address and length in
    /// bytes, read by the other ranks of a host transport until they [`finish`](Self::finish)).
    /// Returns once every rank has arrived, or an `Err` when the group breaks first.
    pub fn arrive(
        &self,
        rank: u32,
        c: &Collective,
        dtype: DType,
        input_len: usize,
        input: (usize, usize),
    ) -> Result<Arrival, DeviceError> {
        let shape = Shape { kind: c.kind, dtype, input_len };
        let timeout = *lock(&self.timeout);
        let start = Instant::now();
        let mut st = lock(&self.state);
        let seq = st.next[rank as usize];
        let what = format!("{} #{seq}", c.kind.name());
        if let Some(reason) = &st.broken {
            return Err(self.error(&what, reason));
        }
        st.next[rank as usize] += 1;
        let size = self.size as usize;
        let round = st.rounds.entry(seq).or_insert_with(|| Round {
            shape,
            inputs: vec![None; size],
            arrived: 0,
            finished: 0,
            nudged: false,
        });
        if round.shape != shape {
            let theirs = round.shape;
            drop(st);
            let reason = format!(
                "ranks disagree on {what}: rank {rank} runs {} of {} {} elements, another {} of {} {} elements",
                c.kind.name(),
                input_len,
                dtype,
                theirs.kind.name(),
                theirs.input_len,
                theirs.dtype
            );
            self.break_with(reason.clone());
            return Err(self.error(&what, &reason));
        }
        round.inputs[rank as usize] = Some(input);
        round.arrived += 1;
        self.cv.notify_all();
        loop {
            if let Some(reason) = &st.broken {
                return Err(self.error(&what, reason));
            }
            let round = st.rounds.get_mut(&seq).expect("a round stays until every rank finished");
            if round.arrived as usize == self.local.len() {
                let inputs = round.inputs.iter().flatten().copied().collect();
                return Ok(Arrival { seq, inputs });
            }
            let waited = start.elapsed();
            if waited >= timeout {
                let missing: Vec<String> =
                    self.local.iter().filter(|&&r| round.inputs[r as usize].is_none()).map(|r| r.to_string()).collect();
                let reason = format!(
                    "rank {rank} waited {:.1} s at {what} for rank(s) {} (BRAID_COLLECTIVE_TIMEOUT, RankGroup::set_timeout)",
                    waited.as_secs_f64(),
                    missing.join(", ")
                );
                drop(st);
                self.break_with(reason.clone());
                return Err(self.error(&what, &reason));
            }
            if waited >= NUDGE_AFTER && !round.nudged {
                round.nudged = true;
                let late: Vec<u32> =
                    self.local.iter().copied().filter(|&r| round.inputs[r as usize].is_none()).collect();
                drop(st);
                if let Some(nudge) = &self.nudge {
                    for r in late {
                        nudge(r);
                    }
                }
                st = lock(&self.state);
                continue;
            }
            let wait = (timeout - waited).min(if round.nudged { timeout } else { NUDGE_AFTER - waited });
            st = self.cv.wait_timeout(st, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Rank `rank` is done reading the other ranks' inputs of collective `seq`; returns once
    /// every rank is (so that no rank frees an input another still reads).
    pub fn finish(&self, seq: u64) {
        let mut st = lock(&self.state);
        let Some(round) = st.rounds.get_mut(&seq) else { return };
        round.finished += 1;
        if round.finished as usize == self.local.len() {
            st.rounds.remove(&seq);
            drop(st);
            self.cv.notify_all();
            return;
        }
        self.cv.notify_all();
        // Every rank has arrived, so every rank is running its part and finishes it.
        while st.rounds.contains_key(&seq) && st.broken.is_none() {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Every group in the process, by id.
static GROUPS: Mutex<Vec<(u64, Arc<RankGroup>)>> = Mutex::new(Vec::new());

/// Makes `group` known to the devices' queues.
pub fn register(group: Arc<RankGroup>) {
    lock(&GROUPS).push((group.id, group));
}

/// Forgets group `id` (its collectives that run later fail with a clear error).
pub fn unregister(id: u64) {
    lock(&GROUPS).retain(|(g, _)| *g != id);
}

/// The group a collective names.
pub fn group(c: &Collective) -> Result<Arc<RankGroup>, DeviceError> {
    lock(&GROUPS).iter().find(|(g, _)| *g == c.group).map(|(_, g)| g.clone()).ok_or_else(|| {
        DeviceError::Collective(format!(
            "{} of group {}: the group no longer exists (it was dropped)",
            c.kind.name(),
            c.group
        ))
    })
}
