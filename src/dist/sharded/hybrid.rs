//! Hybrid sharding (HSDP): the ranks form `replicas` groups of `N / replicas`; each group
//! shards the units among its ranks (as [`Sharded::new`] over the whole group would), and the
//! ranks that hold the same part in different groups all-reduce its gradient after the
//! reduce-scatter. All-gathers and reduce-scatters stay within a replica (a host's fast links,
//! say), and only one part a rank crosses between replicas; each rank holds `replicas / N` of
//! the model instead of `1 / N`.
//!
//! Rank `g` of the whole group is part `g % S` of replica `g / S` (`S = N / replicas`), so a
//! replica is `S` consecutive ranks (one host's GPUs, as `torchrun` numbers them). This module
//! only builds the groups and each rank's [`Placement`]; sharding, gathering and reducing are
//! `mod.rs`'s.

use super::{Placement, Sharded};
use crate::dist::Group;
use crate::error::Result;
use crate::nn::Params;
use crate::tensor::misuse;

impl Sharded {
    /// Hybrid sharding over `group`, a group of this process's devices ([`Group::new`]): its `N`
    /// ranks split into `replicas` replicas of `N / replicas` consecutive ranks, each sharding
    /// `units` among its ranks; gradients are reduce-scattered within a replica and their
    /// parts averaged across the replicas (PyTorch's HSDP). `replicas = 1` shards over every
    /// rank as [`Sharded::new`]; `replicas = N` replicates as data parallelism does. Makes the
    /// replicas' groups (an `Err` where [`Group::new`] fails). Misuse: a group spanning
    /// processes (use [`Sharded::hybrid_across`]), or `replicas` not dividing `N`.
    ///
    /// ```
    /// use braid::prelude::*;
    /// use braid::dist::{Group, Sharded};
    /// use braid::nn::Params;
    /// let devices: Vec<Device> = (0..4).map(|_| Device::new_cpu()).collect();
    /// let group = Group::new(&devices).unwrap();
    /// let mut unit = Params::new();
    /// unit.push("w", &Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [4], &devices[0]));
    /// // Two replicas of two ranks: each rank holds half of the weights.
    /// let mut sharded = Sharded::hybrid(&group, 2, &[unit]).unwrap();
    /// assert_eq!(sharded.shards(3)[0].to_vec::<f32>().unwrap(), vec![3.0, 4.0]);
    /// let losses: Vec<Tensor> = (0..4).map(|r| (&sharded.gather(r, 0)[0] * (r + 1) as f32).sum()).collect();
    /// let grads = sharded.backward(&losses).unwrap();
    /// // The mean over all four ranks of d(loss)/dw = r + 1: 2.5 everywhere.
    /// assert_eq!(grads[3].get(&sharded.shards(3)[0]).unwrap().to_vec::<f32>().unwrap(), vec![2.5, 2.5]);
    /// ```
    #[track_caller]
    pub fn hybrid(group: &Group, replicas: usize, units: &[Params]) -> Result<Sharded> {
        let n = group.size();
        if group.devices().len() < n {
            let problem = "the group spans processes: build its replicas' groups there and use Sharded::hybrid_across";
            misuse("Sharded::hybrid", problem, &[]);
        }
        if replicas == 0 || !n.is_multiple_of(replicas) {
            misuse("Sharded::hybrid", &format!("{replicas} replicas do not divide a group of {n} ranks"), &[]);
        }
        let devices = group.devices();
        let parts = n / replicas;
        let mut shard_groups = Vec::with_capacity(replicas);
        for r in 0..replicas {
            shard_groups.push(Group::new(&devices[r * parts..(r + 1) * parts])?);
        }
        let mut replica_groups = Vec::with_capacity(parts);
        for k in 0..parts {
            let same_part: Vec<_> = (0..replicas).map(|r| devices[r * parts + k].clone()).collect();
            replica_groups.push(Group::new(&same_part)?);
        }
        let placements = (0..n)
            .map(|g| Placement {
                shard: shard_groups[g / parts].clone(),
                at: g % parts,
                replica: (replicas > 1).then(|| (replica_groups[g % parts].clone(), g / parts)),
            })
            .collect();
        Ok(Sharded::build(group, placements, units))
    }

    /// Hybrid sharding across processes (one device each, as [`Group::from_env`] makes them):
    /// this process's rank shards `units` with the ranks of `shard` (its replica) and averages
    /// its part's gradient with the ranks of `replica` (those holding the same part in the other
    /// replicas). Every process calls it with its two groups, both over its one device (made
    /// with [`Group::connect`], at an address per group); a replica's parts are numbered by
    /// their ranks in `shard`, the replicas by their ranks in `replica`, and every rank starts
    /// from the values of part 0 of replica 0. Misuse: groups over other devices than this
    /// process's one.
    #[track_caller]
    pub fn hybrid_across(shard: &Group, replica: &Group, units: &[Params]) -> Sharded {
        if shard.devices().len() != 1 || replica.devices() != shard.devices() {
            let problem = "both groups must hold this process's one device (groups spanning processes)";
            let groups = [("shard", format!("{shard:?}")), ("replica", format!("{replica:?}"))];
            misuse("Sharded::hybrid_across", problem, &groups);
        }
        let place = Placement { shard: shard.clone(), at: 0, replica: Some((replica.clone(), 0)) };
        Sharded::build(shard, vec![place], units)
    }
}
