//! Collectives over groups of devices, and data-parallel training on top of them.
//!
//! A [`Group`] is a set of devices, each one a *rank*: the devices of this process
//! ([`Group::new`], rank = position in the list), or one device per process, the processes
//! started like `torchrun` starts them and meeting over TCP at rank 0 ([`Group::from_env`]:
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`). A collective takes one tensor per rank and returns one per rank, recorded lazily like
//! any op: each device records its part on its [communication stream](Device::comm_stream), so
//! the scheduler orders it with events, the validator checks it, dumps show it, and compute on
//! other streams overlaps it. It runs when a result is read: the ranks meet at a rendezvous
//! (CPU devices exchange the data there; CUDA devices run NCCL), and a rank whose work was not
//! flushed yet is flushed then, so one thread can drive every rank.
//!
//! Rules a user can rely on:
//! - every rank runs a group's collectives in the order they were recorded;
//! - a collective's results carry no gradient (reduce gradients, don't differentiate through
//!   their reduction);
//! - a rank whose flush fails breaks the group: every rank's read returns an `Err` naming the
//!   failed rank (never a hang), and so does every later collective of the group; make a new
//!   group to go on. A rank that never arrives breaks it after the group's timeout
//!   ([`Group::set_timeout`], `BRAID_COLLECTIVE_TIMEOUT` seconds, 300 by default).
//!
//! One thing to avoid: a value that one rank moves from another rank's device (`to_device`)
//! while both have collectives pending. A flush takes everything its read needs, so rank 0's
//! flush may hold that value *and* wait at a collective for rank 1, whose flush waits for the
//! value: the ranks wait for each other until the timeout breaks the group. Compute such values
//! first (read them, or [`Group::sync`] before recording the step); [`DataParallel`] does so for
//! the replicas it copies and the batch it scatters. And, as with NCCL anywhere: two groups
//! over the same GPUs used from different threads at once may enqueue their collectives in
//! different orders on different GPUs, which then wait for each other forever; use one group
//! per set of GPUs at a time.
//!
//! ```
//! use braid::prelude::*;
//! use braid::dist::{Group, Reduce};
//! let (a, b) = (Device::new_cpu(), Device::new_cpu());
//! let group = Group::new(&[a.clone(), b.clone()]).unwrap();
//! let x = Tensor::from_vec(vec![1.0f32, 2.0], [2], &a);
//! let y = Tensor::from_vec(vec![10.0f32, 20.0], [2], &b);
//! let sums = group.all_reduce(&[x, y], Reduce::Sum);
//! assert_eq!(sums[1].to_vec::<f32>().unwrap(), vec![11.0, 22.0]);
//! ```

mod data_parallel;
mod sharded;

pub use data_parallel::DataParallel;
pub use sharded::{Sharded, ShardedRank};

use crate::device::Device;
use crate::engine::{Engine, NewNode};
use crate::error::{Error, Result};
use crate::tensor::{Tensor, misuse};
use braid_devices::collective;
use braid_graph::{Collective, CollectiveKind, DType, NodeId, Op, ReduceOp, Shape};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How a reducing collective combines the ranks' tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    /// The sum divided by the number of ranks (floating-point tensors only).
    Mean,
    Max,
    Min,
}

impl Reduce {
    fn op(self) -> ReduceOp {
        match self {
            Reduce::Sum => ReduceOp::Sum,
            Reduce::Mean => ReduceOp::Mean,
            Reduce::Max => ReduceOp::Max,
            Reduce::Min => ReduceOp::Min,
        }
    }
}

/// A group of devices that run collectives together; cheap to clone.
#[derive(Clone)]
pub struct Group(Arc<GroupInner>);

struct GroupInner {
    /// This process's devices, and the rank of each.
    devices: Vec<Device>,
    ranks: Vec<u32>,
    /// Ranks in the whole group (more than `devices` when it spans processes).
    size: usize,
    runtime: Arc<collective::RankGroup>,
}

impl Drop for GroupInner {
    fn drop(&mut self) {
        collective::unregister(self.runtime.id());
    }
}

static NEXT_GROUP: AtomicU64 = AtomicU64::new(1);

impl Group {
    /// A group of `devices`, rank `r` being `devices[r]`: distinct CPU devices
    /// ([`Device::new_cpu`]), or distinct CUDA devices (through NCCL). `Err` for other devices,
    /// for a mix, or when NCCL is missing or fails to set up.
    pub fn new(devices: &[Device]) -> Result<Group> {
        if devices.is_empty() {
            return Err(Error::Unavailable("a group needs at least one device".into()));
        }
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(Error::Unavailable(format!(
                    "{d} appears twice in the group; each rank needs a device of its own (Device::new_cpu makes more CPU devices)"
                )));
            }
        }
        let id = NEXT_GROUP.fetch_add(1, Ordering::Relaxed);
        let engines: Vec<Arc<Engine>> = devices.iter().map(|d| d.engine().clone()).collect();
        // A rank late to a collective gets its pending work flushed (on a thread of its own, so
        // that the waiting rank keeps waiting), which is what lets one thread drive a group.
        let nudge: collective::Nudge = Box::new(move |rank: u32| {
            let engine = engines[rank as usize].clone();
            let spawned = std::thread::Builder::new().name(format!("braid-nudge-{rank}")).spawn(move || {
                if let Err(e) = engine.flush_all() {
                    tracing::warn!(target: "braid::dist", "flushing late rank {rank} failed: {e}");
                }
            });
            if let Err(e) = spawned {
                tracing::warn!(target: "braid::dist", "could not start a thread to flush late rank {rank}: {e}");
            }
        });
        let runtime = Arc::new(collective::RankGroup::new(id, devices.len() as u32, Some(nudge)));
        crate::backends::connect_group(devices, &runtime).map_err(|e| match e {
            braid_devices::DeviceError::Unavailable(m) => Error::Unavailable(m),
            other => Error::Device { device: devices[0].name(), source: other },
        })?;
        collective::register(runtime.clone());
        let ranks = (0..devices.len() as u32).collect();
        Ok(Group(Arc::new(GroupInner { devices: devices.to_vec(), ranks, size: devices.len(), runtime })))
    }

    /// A group spanning processes, one rank per process (started like `torchrun` starts them):
    /// this process is rank `RANK` of `WORLD_SIZE` (both required), on `device`; the processes
    /// meet at `MASTER_ADDR:MASTER_PORT` (default `127.0.0.1:29500`), where rank 0 listens. CPU
    /// devices exchange data through rank 0; CUDA devices run NCCL. Every process must call it
    /// (it returns once all have joined, or an `Err` after the timeout).
    pub fn from_env(device: &Device) -> Result<Group> {
        let var = |name: &'static str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let number = |name: &'static str| -> Result<usize> {
            let value = var(name).ok_or_else(|| Error::Environment {
                name,
                value: String::new(),
                reason: "Group::from_env needs RANK and WORLD_SIZE (a launcher such as torchrun sets them)".into(),
            })?;
            value.trim().parse().map_err(|_| Error::Environment { name, value, reason: "not a number".into() })
        };
        let (rank, world) = (number("RANK")?, number("WORLD_SIZE")?);
        let host = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = var("MASTER_PORT").unwrap_or_else(|| "29500".into());
        Group::connect(device, rank, world, &format!("{}:{}", host.trim(), port.trim()))
    }

    /// A group spanning processes: this process is rank `rank` of `world` on `device`, meeting
    /// the others at `addr` (`host:port`), where rank 0 listens. See [`Group::from_env`].
    pub fn connect(device: &Device, rank: usize, world: usize, addr: &str) -> Result<Group> {
        if world == 0 || rank >= world {
            return Err(Error::Unavailable(format!("rank {rank} of a group of {world}: not a rank")));
        }
        let unavailable = |e: braid_devices::DeviceError| match e {
            braid_devices::DeviceError::Unavailable(m) => Error::Unavailable(m),
            other => Error::Device { device: device.name(), source: other },
        };
        let token = device.engine().backend.spanning_token(rank as u32).map_err(unavailable)?;
        let timeout = collective::timeout_from_env();
        let (net, token) =
            collective::net::Net::connect(rank as u32, world as u32, addr, token, timeout).map_err(unavailable)?;
        let id = NEXT_GROUP.fetch_add(1, Ordering::Relaxed);
        let runtime = Arc::new(collective::RankGroup::spanning(id, world as u32, rank as u32, net));
        device.engine().backend.connect_spanning(&runtime, token).map_err(unavailable)?;
        collective::register(runtime.clone());
        Ok(Group(Arc::new(GroupInner {
            devices: vec![device.clone()],
            ranks: vec![rank as u32],
            size: world,
            runtime,
        })))
    }

    /// Number of ranks (in every process of the group).
    pub fn size(&self) -> usize {
        self.0.size
    }

    /// This process's devices (every rank's, unless the group spans processes), in rank order.
    pub fn devices(&self) -> &[Device] {
        &self.0.devices
    }

    /// The rank of each of [`Group::devices`].
    pub fn ranks(&self) -> Vec<usize> {
        self.0.ranks.iter().map(|&r| r as usize).collect()
    }

    /// The rank of `device`, if it is a member.
    pub fn rank_of(&self, device: &Device) -> Option<usize> {
        self.0.devices.iter().position(|d| d == device).map(|i| self.0.ranks[i] as usize)
    }

    /// How long a rank waits at a collective for the others before the group is broken.
    pub fn set_timeout(&self, timeout: Duration) {
        self.0.runtime.set_timeout(timeout);
    }

    /// Why the group is broken (a rank failed, was too late, or ranks disagreed), if it is.
    pub fn broken(&self) -> Option<String> {
        self.0.runtime.broken()
    }

    /// Flushes every rank's pending work at once (each device on a thread of its own) and waits
    /// for all of it, as [`Device::sync`] does for one device: the way to run a data-parallel
    /// step, whose ranks meet at every collective. The first rank's error, if any.
    pub fn sync(&self) -> Result<()> {
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = self.0.devices[1..].iter().map(|d| s.spawn(move || d.sync())).collect();
            let mut results = vec![self.0.devices[0].sync()];
            results.extend(handles.into_iter().map(|h| {
                h.join().unwrap_or_else(|p| {
                    Err(Error::Internal(format!(
                        "a rank's sync panicked: {}",
                        braid_devices::panic_message(p.as_ref())
                    )))
                })
            }));
            results
        });
        results.into_iter().collect()
    }

    /// Every rank gets the reduction of all ranks' tensors (`tensors[r]` on rank `r`'s device,
    /// all of one shape and dtype).
    #[track_caller]
    pub fn all_reduce(&self, tensors: &[Tensor], op: Reduce) -> Vec<Tensor> {
        self.check("all_reduce", tensors, Some(op));
        let shape = tensors[0].shape().clone();
        self.record(CollectiveKind::AllReduce(op.op()), tensors, shape)
    }

    /// Every rank gets all ranks' tensors concatenated along the first dimension, in rank order.
    #[track_caller]
    pub fn all_gather(&self, tensors: &[Tensor]) -> Vec<Tensor> {
        self.check("all_gather", tensors, None);
        let shape = self.first_dim_times("all_gather", tensors, |d| d.checked_mul(self.size()));
        self.record(CollectiveKind::AllGather, tensors, shape)
    }

    /// Rank `r` gets part `r` (along the first dimension, which the group's size must divide)
    /// of the reduction of all ranks' tensors.
    #[track_caller]
    pub fn reduce_scatter(&self, tensors: &[Tensor], op: Reduce) -> Vec<Tensor> {
        self.check("reduce_scatter", tensors, Some(op));
        let size = self.size();
        let shape = self.first_dim_times("reduce_scatter", tensors, |d| d.is_multiple_of(size).then(|| d / size));
        self.record(CollectiveKind::ReduceScatter(op.op()), tensors, shape)
    }

    /// Every rank gets rank `root`'s tensor (the others' tensors give only shape and dtype).
    #[track_caller]
    pub fn broadcast(&self, tensors: &[Tensor], root: usize) -> Vec<Tensor> {
        self.check("broadcast", tensors, None);
        if root >= self.size() {
            misuse("broadcast", &format!("root {root} is not a rank of a group of {}", self.size()), &[]);
        }
        let shape = tensors[0].shape().clone();
        self.record(CollectiveKind::Broadcast { root: root as u32 }, tensors, shape)
    }

    /// Misuse of a collective: one tensor per rank, each on its rank's device, of one shape and
    /// dtype that the reduction (if any) can combine.
    #[track_caller]
    fn check(&self, name: &str, tensors: &[Tensor], op: Option<Reduce>) {
        if let Some(problem) = self.problem(tensors, op) {
            let described: Vec<(String, String)> =
                tensors.iter().enumerate().map(|(r, t)| (format!("tensors[{r}]"), t.describe())).collect();
            let operands: Vec<(&str, String)> = described.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
            misuse(name, &problem, &operands)
        }
    }

    fn problem(&self, tensors: &[Tensor], op: Option<Reduce>) -> Option<String> {
        let local = self.0.devices.len();
        if tensors.len() != local {
            return Some(format!(
                "{} tensors for a group of {} ranks ({local} in this process); pass one per rank of this process, in rank order",
                tensors.len(),
                self.size()
            ));
        }
        for (i, t) in tensors.iter().enumerate() {
            if t.device() != &self.0.devices[i] {
                let rank = self.0.ranks[i];
                return Some(format!("tensors[{i}] is on {}, but rank {rank} is {}", t.device(), self.0.devices[i]));
            }
            if t.shape() != tensors[0].shape() || t.dtype() != tensors[0].dtype() {
                return Some("every rank's tensor must have the same shape and dtype".into());
            }
        }
        let dtype = tensors[0].dtype();
        match op {
            Some(_) if dtype == DType::Bool => Some("bool tensors cannot be reduced; cast them first".into()),
            Some(Reduce::Mean) if !dtype.is_float() => {
                Some("a mean needs floating-point tensors; use Reduce::Sum".into())
            }
            _ => None,
        }
    }

    /// The shape of `tensors[0]` with its first dimension mapped by `f` (misuse when `None`).
    #[track_caller]
    fn first_dim_times(&self, name: &str, tensors: &[Tensor], f: impl Fn(usize) -> Option<usize>) -> Shape {
        let shape = tensors[0].shape();
        let Some(&first) = shape.dims().first() else {
            misuse(
                name,
                "scalars cannot be gathered or scattered; reshape to [1] first",
                &[("tensors[0]", tensors[0].describe())],
            )
        };
        let Some(first) = f(first) else {
            misuse(
                name,
                &format!("the first dimension ({first}) does not split into {} equal parts", self.size()),
                &[("tensors[0]", tensors[0].describe())],
            )
        };
        let mut dims = shape.dims().to_vec();
        dims[0] = first;
        Shape::from(dims)
    }

    /// Records each rank's part on its device's communication stream.
    fn record(&self, kind: CollectiveKind, tensors: &[Tensor], shape: Shape) -> Vec<Tensor> {
        tensors.iter().enumerate().map(|(i, t)| self.record_rank(kind, i, t, shape.clone())).collect()
    }

    /// Records the part of this process's `i`-th rank (`t` on its device, checked by the
    /// caller) on the device's communication stream: every rank must record its parts in the
    /// same order, one rank at a time or all at once.
    fn record_rank(&self, kind: CollectiveKind, i: usize, t: &Tensor, shape: Shape) -> Tensor {
        let size = self.size() as u32;
        let group = self.0.runtime.id();
        let device = t.device();
        let op = Op::Collective(Collective { kind, group, rank: self.0.ranks[i], size });
        let stream = device.comm_stream().id;
        let new = NewNode { op, dtype: t.dtype(), shape: shape.clone(), stream };
        let node = device.engine().record_collective(new, t.cell());
        Tensor::from_node(node, shape, t.dtype(), device.clone())
    }
}

/// Makes the values of `tensors` exist on their devices now: pending ones computed, host data
/// uploaded (a flush that uploads host data holds it until it ends), nothing read back.
fn settle(tensors: &[Tensor]) -> Result<()> {
    // One flush per device for all of its tensors (a flush per tensor cost one plan each).
    let mut done: Vec<&Device> = Vec::new();
    for t in tensors {
        if done.contains(&t.device()) {
            continue;
        }
        done.push(t.device());
        let nodes: Vec<NodeId> = tensors.iter().filter(|u| u.device() == t.device()).map(Tensor::node).collect();
        t.device().engine().flush_nodes(&nodes)?;
    }
    for t in tensors {
        t.materialize()?;
    }
    Ok(())
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.0.devices.iter().map(|d| d.to_string()).collect();
        write!(f, "Group({})", names.join(", "))
    }
}
