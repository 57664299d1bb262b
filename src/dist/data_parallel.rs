//! Data-parallel training: every rank holds a replica of the parameters, runs forward and
//! backward on its shard of the batch, and the gradients are averaged over the group in
//! buckets, as PyTorch's DDP does.
//!
//! Buckets hold parameters in reverse order (the last layer's gradients are the first that
//! backward computes) up to a byte size. Each bucket's all-reduce is recorded on the
//! communication stream and reads only its own gradients, so the schedule starts it as soon as
//! they are computed and the rest of backward runs beside it on the compute stream; the
//! optimizer updates read the reduced buckets through views (no copy back). The helper never
//! steps the optimizer and never reads a value: the caller's read runs the step.

use super::{Group, Reduce};
use crate::autograd::{Grads, no_grad};
use crate::error::Result;
use crate::tensor::{Tensor, misuse};

/// Parameters replicated over a [`Group`], with gradients averaged across it.
///
/// ```
/// use braid::prelude::*;
/// use braid::dist::{DataParallel, Group};
/// use braid::optim::Sgd;
/// let devices = [Device::new_cpu(), Device::new_cpu()];
/// let group = Group::new(&devices).unwrap();
/// let w = Tensor::from_vec(vec![0.5f32, -1.0], [2, 1], &devices[0]);
/// let mut dp = DataParallel::new(&group, &[w]);
/// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [4, 2], &devices[0]);
/// let shards = dp.scatter(&x); // two rows per rank
/// let losses: Vec<Tensor> = (0..2).map(|r| shards[r].matmul(&dp.params(r)[0]).square().mean()).collect();
/// let grads = dp.backward(&losses).unwrap();
/// let mut opts: Vec<Sgd> = (0..2).map(|_| Sgd::new(0.01)).collect();
/// for r in 0..2 {
///     opts[r].step(dp.params_mut(r), &grads[r]);
/// }
/// // The replicas stay identical.
/// assert_eq!(dp.params(0)[0].to_vec::<f32>().unwrap(), dp.params(1)[0].to_vec::<f32>().unwrap());
/// ```
pub struct DataParallel {
    group: Group,
    /// `params[r]`: rank `r`'s replica, leaves that require gradients.
    params: Vec<Vec<Tensor>>,
    bucket_bytes: usize,
}

/// Default bucket size: PyTorch DDP's 25 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

impl DataParallel {
    /// Replicates `params` onto every device of `group` in this process: a rank whose device
    /// holds a parameter already uses it (marked to require gradients), the others get copies,
    /// computed here. In a group spanning processes every process calls it and every rank
    /// starts from rank 0's values (broadcast). Every rank starts from the same values.
    #[track_caller]
    pub fn new(group: &Group, params: &[Tensor]) -> DataParallel {
        for p in params {
            if !p.dtype().is_float() {
                misuse("DataParallel::new", "parameters must be floating-point tensors", &[("param", p.describe())]);
            }
        }
        let spanning = group.devices().len() < group.size();
        let replicas = group
            .devices()
            .iter()
            .map(|device| {
                params
                    .iter()
                    .map(|p| {
                        if p.device() == device && !spanning {
                            if p.needs_grad() { p.clone() } else { p.requires_grad() }
                        } else {
                            no_grad(|| p.to_device(device))
                        }
                    })
                    .collect()
            })
            .collect::<Vec<Vec<Tensor>>>();
        // Across processes, every process starts from rank 0's values (as DDP does).
        let replicas: Vec<Vec<Tensor>> = if spanning {
            let mut out = vec![Vec::new(); replicas.len()];
            for i in 0..params.len() {
                let column: Vec<Tensor> = replicas.iter().map(|r| r[i].clone()).collect();
                for (r, t) in group.broadcast(&column, 0).into_iter().enumerate() {
                    out[r].push(t);
                }
            }
            out
        } else {
            replicas
        };
        let replicas: Vec<Vec<Tensor>> = replicas
            .into_iter()
            .map(|r| r.into_iter().map(|p| if p.needs_grad() { p } else { p.requires_grad() }).collect())
            .collect();
        // Computed now, so that no flush of a step that meets at collectives waits for a value
        // another rank's flush computes (see the module docs of `braid::dist`). A failure here
        // is reported by the first read that needs the value.
        for replica in &replicas {
            let _ = super::settle(replica);
        }
        DataParallel { group: group.clone(), params: replicas, bucket_bytes: DEFAULT_BUCKET_BYTES }
    }

    /// Gradients are all-reduced in buckets of about this many bytes (default 25 MiB): smaller
    /// buckets start communicating earlier, larger ones make fewer calls.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> DataParallel {
        self.bucket_bytes = bytes.max(1);
        self
    }

    pub fn group(&self) -> &Group {
        &self.group
    }

    /// The parameters of this process's `i`-th rank (`group.devices()[i]`; rank `i` unless the
    /// group spans processes), in the order given to [`DataParallel::new`].
    pub fn params(&self, rank: usize) -> &[Tensor] {
        &self.params[rank]
    }

    /// Rank `rank`'s parameters, for its optimizer's `step`.
    pub fn params_mut(&mut self, rank: usize) -> &mut [Tensor] {
        &mut self.params[rank]
    }

    /// Splits `batch` along its first dimension into one equal shard per rank (of the whole
    /// group) and returns this process's ranks' shards, each moved to
    /// its rank's device now (computing `batch` first if it is pending).
    #[track_caller]
    pub fn scatter(&self, batch: &Tensor) -> Vec<Tensor> {
        let size = self.group.size();
        let rows = batch.shape().dims().first().copied().unwrap_or(0);
        if !rows.is_multiple_of(size) || rows == 0 {
            misuse(
                "DataParallel::scatter",
                &format!("the first dimension ({rows}) must split into {size} equal, non-empty shards"),
                &[("batch", batch.describe())],
            );
        }
        let shard = rows / size;
        let shards: Vec<Tensor> = (self.group.devices().iter().zip(self.group.ranks()))
            .map(|(d, r)| batch.narrow(0, r * shard, shard).to_device(d))
            .collect();
        // Moved now, before the step's collectives are recorded (see `DataParallel::new`).
        let _ = super::settle(&shards);
        shards
    }

    /// Records backward from every rank's loss (`losses[r]` on rank `r`) and the averaging of
    /// the gradients over the group, bucket by bucket. Returns each rank's averaged gradients
    /// (a parameter a rank's loss does not depend on counts as a zero gradient there). Nothing
    /// runs until something is read.
    #[track_caller]
    pub fn backward(&self, losses: &[Tensor]) -> Result<Vec<Grads>> {
        let size = self.group.devices().len();
        if losses.len() != size {
            misuse(
                "DataParallel::backward",
                &format!(
                    "{} losses for {size} ranks in this process; pass one per rank of this process, in rank order",
                    losses.len()
                ),
                &[],
            );
        }
        let local: Vec<Grads> = losses.iter().map(|l| l.backward()).collect::<Result<_>>()?;
        let mut averaged = vec![Grads::new(); size];
        no_grad(|| {
            for bucket in self.buckets() {
                let flats: Vec<Tensor> = (0..size)
                    .map(|r| {
                        let device = self.group.devices()[r].clone();
                        let grad = |i: usize| {
                            let p = &self.params[r][i];
                            local[r].get(p).unwrap_or_else(|| Tensor::zeros(p.shape().clone(), p.dtype(), &device))
                        };
                        if let [only] = bucket[..] {
                            return grad(only);
                        }
                        device.comm_stream().scope(|| {
                            let parts: Vec<Tensor> = bucket.iter().map(|&i| grad(i).flatten()).collect();
                            Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)
                        })
                    })
                    .collect();
                let reduced = self.group.all_reduce(&flats, Reduce::Mean);
                for (r, flat) in reduced.into_iter().enumerate() {
                    let mut offset = 0;
                    for &i in &bucket {
                        let p = &self.params[r][i];
                        let g = if bucket.len() == 1 {
                            flat.clone()
                        } else {
                            let n = p.numel();
                            offset += n;
                            flat.narrow(0, offset - n, n).reshape(p.shape().clone())
                        };
                        averaged[r].insert(p, g);
                    }
                }
            }
        });
        Ok(averaged)
    }

    /// Parameter indices by bucket: reverse order, one dtype per bucket, about `bucket_bytes`.
    fn buckets(&self) -> Vec<Vec<usize>> {
        let params = &self.params[0];
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut bytes = 0;
        for i in (0..params.len()).rev() {
            let p = &params[i];
            let fits = buckets.last().is_some_and(|b: &Vec<usize>| {
                params[b[0]].dtype() == p.dtype() && bytes + p.numel() * p.dtype().size() <= self.bucket_bytes
            });
            if !fits {
                buckets.push(Vec::new());
                bytes = 0;
            }
            bytes += p.numel() * p.dtype().size();
            buckets.last_mut().expect("pushed").push(i);
        }
        buckets
    }
}
