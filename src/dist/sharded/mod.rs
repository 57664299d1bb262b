//! Sharded data parallel (ZeRO-3, PyTorch's FSDP): each rank holds `1/N` of every parameter,
//! of its gradient and of its optimizer state, and gathers a unit's full parameters only while
//! the unit runs.
//!
//! The user groups parameters into *units* (a transformer block each, the embeddings and the
//! final norm in one more) and calls [`Sharded::gather`] where a unit's forward pass starts.
//! Each unit's shard is one flat vector per rank: every parameter flattened, padded with zeros
//! to a multiple of `N` and split into `N` equal parts, rank `r` holding part `r` of each, one
//! after another. Per step and rank:
//! - **forward**: `gather(rank, u)` records the unit's all-gather on the rank's communication
//!   stream and the copy out of the gathered vector into the parameters' shapes there; the
//!   all-gather waits on an event the compute stream reached when unit `u - d` was gathered
//!   (`d` the [prefetch distance](Sharded::with_prefetch), 1 by default): unit `u + 1` is
//!   gathered while unit `u` computes, never earlier (an all-gather's buffer is taken when it
//!   runs). The gathered parameters are leaves: their gradients are what backward computes.
//! - **backward** ([`Sharded::backward`]): derivatives that read a unit's parameters (or their
//!   transposes and casts) read them from a second all-gather, recorded as the walk enters the
//!   unit and prefetched one unit ahead the same way (FSDP's `reshard_after_forward`;
//!   [`Sharded::with_regather`] turns it off); when the walk leaves a unit its gradients are
//!   reduce-scattered (mean over ranks) on the communication stream, one call for the unit.
//!   The result is each rank's gradient of its shard, for its optimizer.
//! - the optimizer steps the shards only ([`Sharded::shards_mut`]), the padding staying zero.
//!
//! Memory: the shards, the shards' gradients and the optimizer's states are `1/N` of the
//! model's; a unit's full gradients are freed once reduce-scattered, and each gathered copy
//! of a unit's parameters after its last reader (gated on the events of every stream that read
//! it): the forward pass's copies after their last reader in the forward pass when the
//! backward pass gathers again (also where [`Sharded::record_ranks`] flushes the forward pass
//! while autograd still holds them: the backward pass reads the second gather instead), so a
//! step holds about two units' full parameters at a time beside the states.
//! A schedule dump shows the `all_gather` and `reduce_scatter` steps on the communication
//! stream and its waits on the compute stream's events (the prefetch distance). Mixed
//! precision: [`Sharded::with_param_dtype`] gathers in a low
//! precision (the shards, the reduction and the optimizer stay in the parameters' dtype).
//! Hybrid sharding (HSDP, [`Sharded::hybrid`], [`Sharded::hybrid_across`]): replicas of ranks
//! each shard the model among their ranks, and each part's gradient is averaged across the
//! replicas after its reduce-scatter (one more all-reduce per unit, on the same stream).
//! [`Sharded::record_ranks`] records every rank's step at once, a thread per rank (the host's
//! recording time is then about one rank's).
//! Checkpoints: [`Sharded::save`] writes one safetensors file per rank and an index;
//! [`Sharded::load`] reads them on any number of ranks. [`Sharded::save_with_optimizers`] and
//! [`Sharded::load_optimizers`] add each rank's Adam/AdamW moments, resharded the same way.
//!
//! A `Sharded` step records user events, so it is not captured as a `braid::Step`. Every rank
//! must make the same calls in the same order (the collectives pair up by order, as everywhere
//! in [`crate::dist`]). This module records; it never reads a value (but [`Sharded::save`],
//! which writes the shards).
//!
//! ```
//! use braid::prelude::*;
//! use braid::dist::{Group, Sharded};
//! use braid::nn::Params;
//! use braid::optim::Sgd;
//! let devices = [Device::new_cpu(), Device::new_cpu()];
//! let group = Group::new(&devices).unwrap();
//! let mut unit = Params::new();
//! unit.push("w", &Tensor::from_vec(vec![0.5f32, -1.0, 2.0], [3, 1], &devices[0]));
//! let mut sharded = Sharded::new(&group, &[unit]);
//! // Each rank's rows of the batch, made on its device (not moved from another rank's).
//! let rows = [vec![1.0f32, 2.0, 3.0], vec![4.0, 5.0, 6.0]];
//! let losses: Vec<Tensor> = (0..2)
//!     .map(|r| {
//!         let w = &sharded.gather(r, 0)[0];
//!         Tensor::from_vec(rows[r].clone(), [1, 3], &devices[r]).matmul(w).square().mean()
//!     })
//!     .collect();
//! let grads = sharded.backward(&losses).unwrap();
//! let mut opts: Vec<Sgd> = (0..2).map(|_| Sgd::new(0.01)).collect();
//! for r in 0..2 {
//!     opts[r].step(sharded.shards_mut(r), &grads[r]);
//! }
//! group.sync().unwrap();
//! // Each rank holds two of the four (padded) elements; gathered, both see the same weights.
//! assert_eq!(sharded.shards(0)[0].dims(), &[2]);
//! let full = sharded.params();
//! assert_eq!(full[0].named().next().unwrap().1.to_vec::<f32>().unwrap(), full[1].named().next().unwrap().1.to_vec::<f32>().unwrap());
//! ```

mod checkpoint;
mod hybrid;
mod parallel;
mod walk;

pub use parallel::ShardedRank;

use super::{Group, Reduce};
use crate::autograd::{Grads, no_grad};
use crate::error::Result;
use crate::nn::Params;
use crate::stream::{Event, Stream};
use crate::tensor::{Tensor, misuse};
use braid_graph::{CollectiveKind, DType, Shape};
use std::collections::VecDeque;

/// One parameter's place in its unit's shard.
#[derive(Clone, Debug)]
struct ParamLayout {
    name: String,
    shape: Shape,
    /// Elements of each rank's part (the parameter's elements padded to a multiple of the
    /// group's size, divided by it).
    part: usize,
    /// Where the part starts in the rank's shard of the unit.
    offset: usize,
}

/// A unit's parameters and its shard's length.
#[derive(Clone, Debug)]
struct UnitLayout {
    params: Vec<ParamLayout>,
    dtype: DType,
    /// Elements of each rank's shard of the unit.
    len: usize,
}

/// What one rank of this process recorded in the step under way.
#[derive(Default)]
struct RankStep {
    /// Events of the compute stream at the last gathers, oldest first (the gates of the next).
    gates: VecDeque<Event>,
    /// Per unit gathered this step: where its forward pass began (the recording sequence
    /// number) and its gathered parameters' leaves.
    gathered: Vec<Option<(u64, Vec<u64>)>>,
}

impl RankStep {
    /// The leaves of every parameter gathered this step.
    fn leaves(&self) -> hashbrown::HashSet<u64> {
        self.gathered.iter().flatten().flat_map(|(_, ids)| ids.iter().copied()).collect()
    }
}

/// Where this process's `i`-th rank shards and replicates its units.
#[derive(Clone)]
struct Placement {
    /// The ranks that share the units (each holding a part), and this rank's index among this
    /// process's devices of that group.
    shard: Group,
    at: usize,
    /// HSDP ([`Sharded::hybrid`]): the ranks holding the same part in the other replicas, and
    /// this rank's index there.
    replica: Option<(Group, usize)>,
}

impl Placement {
    /// The rank's part: its rank in the shard group.
    fn part(&self) -> usize {
        self.shard.ranks()[self.at]
    }

    /// Which replica the rank is in (0 without replicas).
    fn replica_index(&self) -> usize {
        self.replica.as_ref().map_or(0, |(g, j)| g.ranks()[*j])
    }
}

/// Parameters, gradients and optimizer states sharded over a [`Group`]. See the module docs.
pub struct Sharded {
    /// This process's ranks (`devices()[i]` is rank `i` of the calls taking a rank).
    group: Group,
    /// Per rank of this process: where it shards and replicates.
    placements: Vec<Placement>,
    units: Vec<UnitLayout>,
    /// `shards[i][u]`: this process's `i`-th rank's shard of unit `u`, a flat leaf.
    shards: Vec<Vec<Tensor>>,
    param_dtype: Option<DType>,
    prefetch: usize,
    regather: bool,
    steps: Vec<RankStep>,
}

impl Sharded {
    /// Shards `units` (each a group of parameters gathered together; in the order the forward
    /// pass uses them) over `group`: every rank of this process gets its part of every
    /// parameter, computed now. In a group spanning processes every process calls it and
    /// every rank starts from rank 0's values. Misuse: an empty unit, a parameter that is not
    /// floating-point, or a unit mixing dtypes.
    #[track_caller]
    pub fn new(group: &Group, units: &[Params]) -> Sharded {
        let placements =
            (0..group.devices().len()).map(|at| Placement { shard: group.clone(), at, replica: None }).collect();
        Sharded::build(group, placements, units)
    }

    /// Shards `units` for this process's ranks (`group`'s devices) as `placements` say.
    #[track_caller]
    fn build(group: &Group, placements: Vec<Placement>, units: &[Params]) -> Sharded {
        let n = placements[0].shard.size();
        // A loop, not a closure: misuse is reported at the caller's line.
        let mut layouts: Vec<UnitLayout> = Vec::with_capacity(units.len());
        for unit in units {
            layouts.push(layout(unit, n));
        }
        let spans = |g: &Group| g.devices().len() < g.size();
        let shards: Vec<Vec<Tensor>> = no_grad(|| {
            let mut shards = vec![Vec::with_capacity(units.len()); group.devices().len()];
            for (unit, lay) in units.iter().zip(&layouts) {
                // `[N, len]`: row `r` is part `r`.
                let rows = by_rank(unit, lay, n);
                for (i, (p, device)) in placements.iter().zip(group.devices()).enumerate() {
                    // Across processes every rank starts from rank 0's values: replica 0's
                    // across the replicas, then part 0's across the parts.
                    let mut full = rows.to_device(device);
                    if let Some((replica, _)) = p.replica.as_ref().filter(|(g, _)| spans(g)) {
                        full = replica.broadcast(&[full], 0).remove(0);
                    }
                    if spans(&p.shard) {
                        full = p.shard.broadcast(&[full], 0).remove(0);
                    }
                    shards[i].push(full.narrow(0, p.part(), 1).reshape([lay.len]).contiguous().requires_grad());
                }
            }
            shards
        });
        // Computed now, so that no flush of a step that meets at collectives waits for a value
        // another rank's flush computes (see `braid::dist`); a failure is reported by the
        // first read that needs the value.
        for s in &shards {
            let _ = super::settle(s);
        }
        let steps = group.devices().iter().map(|_| RankStep::default()).collect();
        Sharded {
            group: group.clone(),
            placements,
            units: layouts,
            shards,
            param_dtype: None,
            prefetch: 1,
            regather: true,
            steps,
        }
    }

    /// Gathers parameters in `dtype` (bf16 or f16 under `braid::amp::autocast`: half the
    /// bytes on the wire and in memory); shards, gradients' reduction and the optimizer stay
    /// in the parameters' dtype. Default: the parameters' dtype.
    #[track_caller]
    pub fn with_param_dtype(mut self, dtype: DType) -> Sharded {
        if !dtype.is_float() {
            misuse("Sharded::with_param_dtype", &format!("{dtype} is not a floating-point dtype"), &[]);
        }
        self.param_dtype = Some(dtype);
        self
    }

    /// How many units ahead of the compute stream an all-gather may run (default 1: the next
    /// unit's, while this one computes; 0 waits for the previous unit to finish). More hides
    /// slower links and holds more units' full parameters at once.
    pub fn with_prefetch(mut self, units: usize) -> Sharded {
        self.prefetch = units;
        self
    }

    /// Whether the backward pass gathers each unit's parameters again (default `true`, as
    /// FSDP's `reshard_after_forward`: about two units' full parameters at a time) or reads the
    /// forward pass's copies (one all-gather per unit and step instead of two, and every unit's
    /// full parameters held from its forward pass to its backward pass).
    pub fn with_regather(mut self, on: bool) -> Sharded {
        self.regather = on;
        self
    }

    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Number of units.
    pub fn units(&self) -> usize {
        self.units.len()
    }

    /// The shards of this process's `i`-th rank (`group.devices()[i]`), one flat leaf per
    /// unit: what its optimizer steps.
    pub fn shards(&self, rank: usize) -> &[Tensor] {
        &self.shards[rank]
    }

    /// This process's `i`-th rank's shards, for its optimizer's `step`.
    pub fn shards_mut(&mut self, rank: usize) -> &mut [Tensor] {
        &mut self.shards[rank]
    }

    /// Bytes of parameters one rank holds (its shards: about the parameters' bytes over `N`).
    pub fn shard_bytes(&self) -> usize {
        self.units.iter().map(|u| u.len * u.dtype.size()).sum()
    }

    /// Records the all-gather of unit `unit` on this process's `rank`-th rank (call it where the
    /// unit's forward pass starts: its all-gather is gated on the compute stream reaching the
    /// gather `prefetch` units before) and returns its parameters, in the unit's order and
    /// shapes: leaves whose gradients [`Sharded::backward`] reduces. Gather every unit a step
    /// uses, each step.
    #[track_caller]
    pub fn gather(&mut self, rank: usize, unit: usize) -> Vec<Tensor> {
        self.check_rank_unit("Sharded::gather", rank, unit);
        check_not_gathered(&self.steps[rank], rank, unit);
        let mut step = std::mem::take(&mut self.steps[rank]);
        let params = self.gather_into(&mut step, rank, unit);
        self.steps[rank] = step;
        params
    }

    /// [`Sharded::gather`] with the rank's step state `step` held apart (so that ranks can
    /// record on threads of their own, `parallel.rs`); the caller checked the rank and unit.
    fn gather_into(&self, step: &mut RankStep, rank: usize, unit: usize) -> Vec<Tensor> {
        let device = self.group.devices()[rank].clone();
        let compute = Stream::current(&device);
        // The gate of unit `u` is the event recorded at the gather of unit `u - prefetch`
        // (with prefetch 0: now, after unit `u - 1`'s forward pass).
        step.gates.push_back(compute.record_event());
        let gate = if step.gates.len() > self.prefetch { step.gates.pop_front() } else { None };
        let params = no_grad(|| self.all_gather(rank, unit, gate.as_ref()));
        // Fresh floating-point values without history: always leaves.
        let leaves =
            params.iter().map(|p| crate::autograd::mark_leaf(p).expect("a gathered parameter can be a leaf")).collect();
        step.gathered.resize_with(self.units.len(), || None);
        step.gathered[unit] = Some((crate::autograd::next_seq(), leaves));
        params
    }

    /// Every unit's full parameters on each rank of this process (named as given to
    /// [`Sharded::new`]; no gradient history): for evaluation, export or comparison. A
    /// collective: every rank calls it.
    pub fn params(&self) -> Vec<Params> {
        no_grad(|| {
            (0..self.group.devices().len())
                .map(|rank| {
                    let mut out = Params::new();
                    for (u, lay) in self.units.iter().enumerate() {
                        for (p, t) in lay.params.iter().zip(self.all_gather(rank, u, None)) {
                            out.push(p.name.clone(), &t);
                        }
                    }
                    out
                })
                .collect()
        })
    }

    /// Records backward from every rank's loss (`losses[i]` on this process's `i`-th rank):
    /// each unit's parameters gathered again as the walk enters it (prefetched), its gradients
    /// reduce-scattered (averaged over the group) as it leaves. Returns each rank's gradients of
    /// its [shards](Sharded::shards) (a unit the loss does not depend on gets zeros). Nothing
    /// runs until something is read.
    #[track_caller]
    pub fn backward(&mut self, losses: &[Tensor]) -> Result<Vec<Grads>> {
        let local = self.group.devices().len();
        if losses.len() != local {
            misuse(
                "Sharded::backward",
                &format!("{} losses for {local} ranks in this process; pass one per rank, in rank order", losses.len()),
                &[],
            );
        }
        let mut out = Vec::with_capacity(local);
        for (rank, loss) in losses.iter().enumerate() {
            let step = std::mem::take(&mut self.steps[rank]);
            out.push(self.backward_rank(rank, step, loss)?);
        }
        Ok(out)
    }

    /// Rank `rank`'s backward pass from `loss`, given what its forward pass gathered (`step`):
    /// the gradients of its shards.
    fn backward_rank(&self, rank: usize, step: RankStep, loss: &Tensor) -> Result<Grads> {
        let mut walk = walk::ShardedWalk::new(self, rank, step);
        let mut full = Grads::new();
        loss.backward_hooked(&mut full, false, Some(&mut walk))?;
        Ok(walk.finish(&full))
    }

    #[track_caller]
    fn check_rank_unit(&self, call: &str, rank: usize, unit: usize) {
        let local = self.group.devices().len();
        if rank >= local {
            misuse(call, &format!("rank {rank}: this process has {local} ranks (0..{local})"), &[]);
        }
        if unit >= self.units.len() {
            misuse(call, &format!("unit {unit}: there are {} units", self.units.len()), &[]);
        }
    }

    /// Records unit `unit`'s all-gather on this process's `rank`-th rank after `gate` (on its
    /// communication stream, with the copy out into the parameters) and returns the parameters.
    fn all_gather(&self, rank: usize, unit: usize, gate: Option<&Event>) -> Vec<Tensor> {
        let lay = &self.units[unit];
        let place = &self.placements[rank];
        let n = place.shard.size();
        let device = &self.group.devices()[rank];
        let comm = device.comm_stream();
        if let Some(gate) = gate {
            comm.wait_event(gate);
        }
        comm.scope(|| {
            let dtype = self.param_dtype.unwrap_or(lay.dtype);
            let shard = self.shards[rank][unit].as_dtype(dtype);
            let whole =
                place.shard.record_rank(CollectiveKind::AllGather, place.at, &shard, Shape::from([n * lay.len]));
            let rows = whole.reshape([n, lay.len]);
            lay.params
                .iter()
                .map(|p| {
                    if lay.params.len() == 1 {
                        return whole.narrow(0, 0, p.shape.numel()).reshape(p.shape.clone());
                    }
                    // The copy out of the gathered vector, here on the communication stream.
                    let flat = rows.narrow(1, p.offset, p.part).contiguous().flatten();
                    flat.narrow(0, 0, p.shape.numel()).reshape(p.shape.clone())
                })
                .collect()
        })
    }

    /// Records the reduce-scatter (mean) of unit `unit`'s gradients `grads` (full shapes, any
    /// float dtype, `None` for zeros) on this process's `rank`-th rank, then (HSDP) the
    /// all-reduce (mean) of its part across the replicas: its shard's gradient.
    fn reduce_scatter(&self, rank: usize, unit: usize, grads: Vec<Option<Tensor>>) -> Tensor {
        let lay = &self.units[unit];
        let place = &self.placements[rank];
        let n = place.shard.size();
        let device = &self.group.devices()[rank];
        device.comm_stream().scope(|| {
            let parts: Vec<Tensor> = lay
                .params
                .iter()
                .zip(grads)
                .map(|(p, g)| {
                    let g = match g {
                        Some(g) => g.as_dtype(lay.dtype).flatten(),
                        None => Tensor::zeros([p.shape.numel()], lay.dtype, device),
                    };
                    pad(&g, n * p.part).reshape([n, p.part])
                })
                .collect();
            let rows =
                if let [one] = &parts[..] { one.clone() } else { Tensor::cat(&parts.iter().collect::<Vec<_>>(), 1) };
            let kind = CollectiveKind::ReduceScatter(Reduce::Mean.op());
            let part = place.shard.record_rank(kind, place.at, &rows.reshape([n * lay.len]), Shape::from([lay.len]));
            match &place.replica {
                Some((replica, j)) => {
                    let kind = CollectiveKind::AllReduce(Reduce::Mean.op());
                    replica.record_rank(kind, *j, &part, Shape::from([lay.len]))
                }
                None => part,
            }
        })
    }
}

/// Misuse: unit `unit` gathered already in `step` (rank `rank`'s step under way).
#[track_caller]
fn check_not_gathered(step: &RankStep, rank: usize, unit: usize) {
    if step.gathered.get(unit).is_some_and(Option::is_some) {
        let problem = format!(
            "unit {unit} was gathered already in this step on rank {rank} (its gradients would be lost); \
             gather each unit once a step and reuse its tensors"
        );
        misuse("Sharded::gather", &problem, &[]);
    }
}

/// `t` (flat) with zeros appended to `len` elements.
fn pad(t: &Tensor, len: usize) -> Tensor {
    let extra = len - t.numel();
    if extra == 0 {
        return t.clone();
    }
    Tensor::cat(&[t, &Tensor::zeros([extra], t.dtype(), t.device())], 0)
}

/// The layout of `unit` over `n` ranks (misuse for an empty unit, integer or mixed dtypes).
#[track_caller]
fn layout(unit: &Params, n: usize) -> UnitLayout {
    let Some(first) = unit.iter().next() else { misuse("Sharded::new", "a unit needs at least one parameter", &[]) };
    let dtype = first.dtype();
    let mut params = Vec::with_capacity(unit.len());
    let mut offset = 0;
    for (name, p) in unit.named() {
        if !p.dtype().is_float() || p.quant_layout().is_some() {
            misuse("Sharded::new", "parameters must be floating-point tensors", &[(name, p.describe())]);
        }
        if p.dtype() != dtype {
            misuse(
                "Sharded::new",
                "the parameters of a unit share one dtype (make a unit per dtype)",
                &[(name, p.describe()), ("first", first.describe())],
            );
        }
        let part = p.numel().div_ceil(n).max(1);
        params.push(ParamLayout { name: name.to_string(), shape: p.shape().clone(), part, offset });
        offset += part;
    }
    UnitLayout { params, dtype, len: offset }
}

/// `unit`'s values as `[n, len]`, row `r` being rank `r`'s shard (on the first parameter's
/// device).
fn by_rank(unit: &Params, lay: &UnitLayout, n: usize) -> Tensor {
    let device = unit.iter().next().expect("a unit is not empty").device().clone();
    let parts: Vec<Tensor> = unit
        .iter()
        .zip(&lay.params)
        .map(|(t, p)| {
            let flat = t.detach().flatten();
            let flat = if flat.device() == &device { flat } else { flat.to_device(&device) };
            pad(&flat, n * p.part).reshape([n, p.part])
        })
        .collect();
    if let [one] = &parts[..] { one.clone() } else { Tensor::cat(&parts.iter().collect::<Vec<_>>(), 1) }
}

impl std::fmt::Debug for Sharded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sharded({} units over {:?}, {} bytes a rank)", self.units.len(), self.group, self.shard_bytes())
    }
}
