//! The backward pass of a [`Sharded`] step on one rank: a [`BackwardHook`] that gathers each
//! unit's parameters again as the walk enters the unit (and prefetches the next), hands them to
//! the derivatives that read the parameters, and reduce-scatters the unit's gradients as the
//! walk leaves it.
//!
//! Units are told apart by where their forward pass began in the recording order (the sequence
//! number at their `gather`): the walk runs in decreasing order, so once it reaches an op
//! recorded before a unit's gather, no later derivative adds to that unit's gradients (its
//! parameters did not exist before the gather). This module never reads a value.

use super::{RankStep, Sharded};
use crate::autograd::Grads;
use crate::autograd::hooks::BackwardHook;
use crate::stream::Stream;
use crate::tensor::Tensor;
use hashbrown::HashMap;

pub(super) struct ShardedWalk<'a> {
    sharded: &'a Sharded,
    rank: usize,
    /// The units gathered this step, latest forward first: (where its forward began, unit).
    order: Vec<(u64, usize)>,
    /// Each gathered parameter's leaf: its unit and place in the unit.
    leaves: HashMap<u64, (usize, usize)>,
    /// Per unit: its parameters' leaves (for their gradients), if gathered this step.
    leaf_ids: Vec<Option<Vec<u64>>>,
    /// Per unit: its parameters gathered again for the backward pass.
    again: Vec<Option<Vec<Tensor>>>,
    /// Per unit: its shard's gradient, once reduce-scattered.
    reduced: Vec<Option<Tensor>>,
    /// The position in `order` of the unit the walk is in, and of the first not reduced yet.
    current: Option<usize>,
    next: usize,
}

impl<'a> ShardedWalk<'a> {
    pub(super) fn new(sharded: &'a Sharded, rank: usize, step: RankStep) -> ShardedWalk<'a> {
        let units = sharded.units.len();
        let mut order = Vec::new();
        let mut leaves = HashMap::new();
        let mut leaf_ids = vec![None; units];
        for (u, gathered) in step.gathered.into_iter().enumerate() {
            let Some((start, ids)) = gathered else { continue };
            order.push((start, u));
            for (i, &id) in ids.iter().enumerate() {
                leaves.insert(id, (u, i));
            }
            leaf_ids[u] = Some(ids);
        }
        order.sort_by_key(|&(start, u)| std::cmp::Reverse((start, u)));
        ShardedWalk {
            sharded,
            rank,
            order,
            leaves,
            leaf_ids,
            again: vec![None; units],
            reduced: vec![None; units],
            current: None,
            next: 0,
        }
    }

    /// Unit `unit` gathered again (after `gate`, if it is not yet).
    fn ensure_gathered(&mut self, unit: usize, gate: Option<&crate::stream::Event>) {
        if self.again[unit].is_none() {
            self.again[unit] = Some(self.sharded.all_gather(self.rank, unit, gate));
        }
    }

    /// The walk enters `order[j]`: its parameters are gathered (prefetched, unless it is the
    /// first), and the next units' all-gathers are recorded, gated on the compute stream
    /// reaching this point (so they overlap this unit's derivatives and no earlier ones).
    fn enter(&mut self, j: usize) {
        if !self.sharded.regather {
            return;
        }
        let prefetch = self.sharded.prefetch;
        let last = (j + prefetch).min(self.order.len() - 1);
        let waiting: Vec<usize> = (j..=last).map(|k| self.order[k].1).filter(|&u| self.again[u].is_none()).collect();
        if waiting.is_empty() {
            return;
        }
        let device = self.sharded.group.devices()[self.rank].clone();
        let gate = Stream::current(&device).record_event();
        for u in waiting {
            let gated = u != self.order[j].1 || prefetch == 0;
            self.ensure_gathered(u, gated.then_some(&gate));
        }
    }

    /// Records the reduce-scatter of unit `unit`'s gradients (complete in `grads`).
    fn reduce(&mut self, unit: usize, grads: &Grads) {
        let ids = self.leaf_ids[unit].as_deref().unwrap_or(&[]);
        let full: Vec<Option<Tensor>> =
            (0..self.sharded.units[unit].params.len()).map(|i| ids.get(i).and_then(|&id| grads.of_leaf(id))).collect();
        self.reduced[unit] = Some(self.sharded.reduce_scatter(self.rank, unit, full));
    }

    /// The shards' gradients, once the walk is done: every unit not reduced yet is reduced now
    /// (a unit not gathered this step has a zero gradient, without a collective).
    pub(super) fn finish(mut self, grads: &Grads) -> Grads {
        while self.next < self.order.len() {
            let u = self.order[self.next].1;
            self.reduce(u, grads);
            self.next += 1;
        }
        let mut out = Grads::new();
        for (u, shard) in self.sharded.shards[self.rank].iter().enumerate() {
            let g = self.reduced[u]
                .take()
                .unwrap_or_else(|| Tensor::zeros(shard.shape().clone(), shard.dtype(), shard.device()));
            out.insert(shard, g);
        }
        out
    }
}

impl BackwardHook for ShardedWalk<'_> {
    fn reached(&mut self, seq: u64, grads: &Grads) {
        let target = self.order.iter().position(|&(start, _)| start <= seq).unwrap_or(self.order.len());
        if self.current.is_some_and(|c| target <= c) {
            return;
        }
        while self.next < target {
            let u = self.order[self.next].1;
            self.reduce(u, grads);
            self.next += 1;
        }
        if target < self.order.len() {
            self.enter(target);
        }
        self.current = Some(target);
    }

    fn leaf_value(&mut self, leaf: u64) -> Option<Tensor> {
        if !self.sharded.regather {
            return None;
        }
        let &(unit, i) = self.leaves.get(&leaf)?;
        self.ensure_gathered(unit, None);
        self.again[unit].as_ref().map(|ps| ps[i].clone())
    }
}
