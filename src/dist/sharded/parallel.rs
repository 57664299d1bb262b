//! Recording this process's ranks on threads of their own ([`Sharded::record_ranks`]): each
//! rank's forward pass (its gathers) and backward pass (its walk) are recorded on one thread
//! per rank at once, so the host time a step spends recording is one rank's, not the sum over
//! the ranks. Each device's engine has its own lock and each rank records only on its own
//! device, so the threads never wait for each other while recording; each device's
//! collectives stay in its thread's order, the same on every rank. This module only splits the
//! ranks' state among the threads and joins their results.

use super::{RankStep, Sharded, check_not_gathered};
use crate::autograd::Grads;
use crate::error::Result;
use crate::tensor::{Tensor, misuse};

/// One rank of a [`Sharded`] model while its step is recorded on a thread of its own (see
/// [`Sharded::record_ranks`]): gathers its units.
pub struct ShardedRank<'a> {
    sharded: &'a Sharded,
    rank: usize,
    step: RankStep,
}

impl ShardedRank<'_> {
    /// This process's index of the rank (as [`Sharded::gather`] takes it).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// [`Sharded::gather`] of unit `unit` on this rank.
    #[track_caller]
    pub fn gather(&mut self, unit: usize) -> Vec<Tensor> {
        self.sharded.check_rank_unit("ShardedRank::gather", self.rank, unit);
        check_not_gathered(&self.step, self.rank, unit);
        self.sharded.gather_into(&mut self.step, self.rank, unit)
    }
}

impl Sharded {
    /// Records a step of every rank of this process, each on a thread of its own: `forward(r)`
    /// records rank `r`'s forward pass, gathering its units through the [`ShardedRank`] it is
    /// given, and returns its loss; the rank's forward pass is then flushed (it runs on the
    /// device while the thread goes on) and its backward pass recorded on the same thread (as
    /// [`Sharded::backward`] does). Returns each rank's loss and its gradients of its shards, in
    /// rank order. The host's recording time is about one rank's instead of the sum over them
    /// (one thread recorded both ranks of a 2-GPU step in 23-25 ms of 130, BENCHMARKS.md), and
    /// the device does not wait for the backward pass to be recorded and planned before it
    /// starts (GPT-2 medium on one H200: 83-85 ms a step against 102-108, BENCHMARKS.md).
    /// The flush leaves the cheap values autograd saved for the backward pass to compute again
    /// (`Device::set_recompute`), and frees each unit's gathered parameters after their last
    /// reader in the forward pass when the backward pass gathers them again (the default; a
    /// tensor that `forward` returns or keeps elsewhere keeps its copy). BENCHMARKS.md, stop
    /// 67, has the figures.
    ///
    /// The threads start without the caller's scopes (`braid::amp::autocast`, `no_grad`,
    /// stream scopes): set them inside `forward`; the backward pass runs outside them, as it
    /// would after `forward` returned. Errors: the first rank's error (its forward pass's
    /// flush, or its backward pass), in rank order.
    /// Misuse (at the line in `forward`): as [`Sharded::gather`]; a panic in `forward` on any
    /// thread is raised here after every thread ended.
    ///
    /// ```
    /// use braid::prelude::*;
    /// use braid::dist::{Group, Sharded};
    /// use braid::nn::Params;
    /// let devices = [Device::new_cpu(), Device::new_cpu()];
    /// let group = Group::new(&devices).unwrap();
    /// let mut unit = Params::new();
    /// unit.push("w", &Tensor::from_vec(vec![1.0f32, -2.0, 3.0], [3], &devices[0]));
    /// let mut sharded = Sharded::new(&group, &[unit]);
    /// let (losses, grads) = sharded
    ///     .record_ranks(|rank| {
    ///         let w = &rank.gather(0)[0];
    ///         (w * w).sum() * (rank.rank() + 1) as f32
    ///     })
    ///     .unwrap();
    /// // d/dw of the mean over ranks of (r + 1) w^2: 3 w, rank 1's part being w[2..] (padded).
    /// let g = grads[1].get(&sharded.shards(1)[0]).unwrap().to_vec::<f32>().unwrap();
    /// assert_eq!(g, vec![9.0, 0.0]);
    /// assert_eq!(losses[1].item::<f32>().unwrap(), 28.0);
    /// ```
    #[track_caller]
    pub fn record_ranks<F>(&mut self, forward: F) -> Result<(Vec<Tensor>, Vec<Grads>)>
    where
        F: Fn(&mut ShardedRank<'_>) -> Tensor + Sync,
    {
        if self.steps.iter().any(|s| s.gathered.iter().any(Option::is_some)) {
            let problem = "units were gathered with Sharded::gather in the step under way; record a step \
                           either rank by rank or with record_ranks, not both";
            misuse("Sharded::record_ranks", problem, &[]);
        }
        let steps: Vec<RankStep> = self.steps.iter_mut().map(std::mem::take).collect();
        let this: &Sharded = self;
        let forward = &forward;
        let results: Vec<std::thread::Result<Result<(Tensor, Grads)>>> = std::thread::scope(|scope| {
            let threads: Vec<_> = steps
                .into_iter()
                .enumerate()
                .map(|(rank, step)| {
                    let thread = std::thread::Builder::new().name(format!("braid-rank-{rank}"));
                    thread
                        .spawn_scoped(scope, move || {
                            let mut handle = ShardedRank { sharded: this, rank, step };
                            let loss = forward(&mut handle);
                            let engine = loss.device().engine();
                            if this.regather {
                                // The backward pass gathers the parameters again: the flush
                                // frees each unit's forward copy after its last reader.
                                let leaves = handle.step.leaves();
                                engine.supersede(&crate::autograd::hooks::superseded_saved(&loss, &leaves));
                            }
                            // The forward pass runs on the device while this thread records
                            // and plans the backward pass.
                            engine.flush_nodes(&[loss.node()])?;
                            let grads = this.backward_rank(rank, handle.step, &loss)?;
                            Ok((loss, grads))
                        })
                        .expect("a thread to record a rank on")
                })
                .collect();
            threads.into_iter().map(|t| t.join()).collect()
        });
        let (mut losses, mut grads) = (Vec::with_capacity(results.len()), Vec::with_capacity(results.len()));
        for result in results {
            let (loss, g) = result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
            losses.push(loss);
            grads.push(g);
        }
        Ok((losses, grads))
    }
}
