//! Checkpoints of a [`Sharded`] model: each rank writes its shard (safetensors, one file per
//! rank: every parameter's part under the parameter's name, flat; under HSDP one file per
//! part, from the first replica's ranks), rank 0 an index
//! (`sharded-index.json`: the group's size and every unit's parameters, names, shapes and
//! dtypes). Loading reads every rank's file (a directory all processes see) and shards again
//! for the loading group, whatever its size.
//!
//! [`Sharded::save_with_optimizers`] also writes each rank's Adam/AdamW moments (its part of
//! every parameter's, beside the parameter's part: `optim.exp_avg/NAME`, `optim.exp_avg_sq/NAME`)
//! and step counts (`optim.step/unitU`); [`Sharded::load_optimizers`] shards them again for the
//! loading group, so a run continues as if it had not stopped.

use super::{Sharded, by_rank};
use crate::device::Device;
use crate::dist::Group;
use crate::error::{Error, Result};
use crate::nn::Params;
use crate::optim::{Adam, AdamState};
use crate::tensor::{Tensor, misuse};
use braid_graph::{DType, Shape};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

/// The index's file name in a checkpoint directory.
pub const INDEX: &str = "sharded-index.json";

/// Rank `rank`'s file of a group of `world`.
fn shard_file(rank: usize, world: usize) -> String {
    format!("shard-{rank:05}-of-{world:05}.safetensors")
}

/// Names of the optimizer's tensors in a rank's file: the moments' parts by parameter name,
/// the step count by unit.
const EXP_AVG: &str = "optim.exp_avg/";
const EXP_AVG_SQ: &str = "optim.exp_avg_sq/";
const STEP: &str = "optim.step/unit";

impl Sharded {
    /// Writes this process's ranks' shards into `dir` (created if missing), and the index from
    /// rank 0. Reads the shards (a flush of what they need on each rank).
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.write(dir.as_ref(), &[])
    }

    /// [`Sharded::save`] with the optimizers' states: `optimizers[i]` (an [`Adam`] or
    /// [`crate::optim::AdamW`]) steps this process's `i`-th rank's shards
    /// ([`Sharded::shards_mut`]); a unit it has not updated yet is saved without a state.
    /// Misuse: not one optimizer per rank of this process.
    ///
    /// ```
    /// use braid::prelude::*;
    /// use braid::dist::{Group, Sharded};
    /// use braid::nn::Params;
    /// use braid::optim::AdamW;
    /// let devices = [Device::new_cpu(), Device::new_cpu()];
    /// let group = Group::new(&devices).unwrap();
    /// let mut unit = Params::new();
    /// unit.push("w", &Tensor::from_vec(vec![0.5f32, -1.0, 2.0], [3], &devices[0]));
    /// let mut sharded = Sharded::new(&group, &[unit]);
    /// let losses: Vec<Tensor> = (0..2).map(|r| sharded.gather(r, 0)[0].square().sum()).collect();
    /// let grads = sharded.backward(&losses).unwrap();
    /// let mut opts = vec![AdamW::new(0.1), AdamW::new(0.1)];
    /// for (r, opt) in opts.iter_mut().enumerate() {
    ///     opt.step(sharded.shards_mut(r), &grads[r]);
    /// }
    /// let dir = std::env::temp_dir().join(format!("braid-doc-sharded-{}", std::process::id()));
    /// sharded.save_with_optimizers(&dir, &opts).unwrap();
    /// // On one rank: the parameters and the moments, resharded.
    /// let one = Group::new(&devices[..1]).unwrap();
    /// let loaded = Sharded::load(&one, &dir).unwrap();
    /// let mut restored = vec![AdamW::new(0.1)];
    /// loaded.load_optimizers(&dir, &mut restored).unwrap();
    /// assert_eq!(restored[0].state(&loaded.shards(0)[0]).unwrap().step, 1);
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// ```
    #[track_caller]
    pub fn save_with_optimizers<O: AsRef<Adam>>(&self, dir: impl AsRef<Path>, optimizers: &[O]) -> Result<()> {
        self.check_optimizers("Sharded::save_with_optimizers", optimizers.len());
        let adams: Vec<&Adam> = optimizers.iter().map(AsRef::as_ref).collect();
        self.write(dir.as_ref(), &adams)
    }

    /// Reads the optimizer states of the checkpoint in `dir` (written by
    /// [`Sharded::save_with_optimizers`] on any number of ranks) into `optimizers`, one per rank
    /// of this process as there, each rank's part of every moment sharded for this group; a
    /// unit saved without a state is left as it is. Call it on the `Sharded` that
    /// [`Sharded::load`] read from the same checkpoint. A checkpoint without optimizer states,
    /// or with other units, is an `Err`. Misuse: not one optimizer per rank of this process.
    #[track_caller]
    pub fn load_optimizers<O: AsMut<Adam>>(&self, dir: impl AsRef<Path>, optimizers: &mut [O]) -> Result<()> {
        self.check_optimizers("Sharded::load_optimizers", optimizers.len());
        let dir = dir.as_ref();
        let n = self.placements[0].shard.size();
        // Every file read once, for the moments and the step counts.
        let checkpoint = Checkpoint::read(dir)?;
        let (exp_avg, exp_avg_sq) = (checkpoint.units(EXP_AVG)?, checkpoint.units(EXP_AVG_SQ)?);
        let steps = checkpoint.steps()?;
        if exp_avg.len() != self.units.len() || steps.len() != self.units.len() {
            return Err(Error::Io(format!("{}: not this model's units", dir.join(INDEX).display())));
        }
        if steps.iter().all(Option::is_none) {
            return Err(Error::Io(format!("{}: no optimizer states (saved with `save`)", dir.display())));
        }
        for (u, lay) in self.units.iter().enumerate() {
            let (Some(m), Some(v), Some(step)) = (&exp_avg[u], &exp_avg_sq[u], steps[u]) else { continue };
            let (m, v) = (by_rank(m, lay, n), by_rank(v, lay, n));
            for (i, place) in self.placements.iter().enumerate() {
                let (device, part) = (&self.group.devices()[i], place.part());
                let take = |rows: &Tensor| rows.narrow(0, part, 1).reshape([lay.len]).to_device(device).contiguous();
                let state = AdamState { exp_avg: take(&m), exp_avg_sq: take(&v), step };
                optimizers[i].as_mut().set_state(&self.shards[i][u], state);
            }
        }
        Ok(())
    }

    #[track_caller]
    fn check_optimizers(&self, op: &str, count: usize) {
        let ranks = self.group.devices().len();
        if count != ranks {
            let problem = format!("one optimizer per rank of this process: {ranks}, not {count}");
            misuse(op, &problem, &[]);
        }
    }

    /// Writes the shards and, where `optimizers` holds one per rank, their states.
    fn write(&self, dir: &Path, optimizers: &[&Adam]) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Io(format!("cannot create {}: {e}", dir.display())))?;
        let world = self.placements[0].shard.size();
        for (i, place) in self.placements.iter().enumerate() {
            // One file per part: replica 0's ranks write them (the other replicas hold the same).
            if place.replica_index() != 0 {
                continue;
            }
            let rank = place.part();
            let mut parts: Vec<(String, Tensor)> = Vec::new();
            for (u, lay) in self.units.iter().enumerate() {
                let shard = &self.shards[i][u];
                let state = optimizers.get(i).and_then(|o| o.state(shard));
                for p in &lay.params {
                    parts.push((p.name.clone(), shard.detach().narrow(0, p.offset, p.part)));
                    if let Some(s) = &state {
                        parts.push((format!("{EXP_AVG}{}", p.name), s.exp_avg.narrow(0, p.offset, p.part)));
                        parts.push((format!("{EXP_AVG_SQ}{}", p.name), s.exp_avg_sq.narrow(0, p.offset, p.part)));
                    }
                }
                if let Some(s) = &state {
                    parts.push((format!("{STEP}{u}"), Tensor::from_vec(vec![s.step], [1], &Device::cpu())));
                }
            }
            let named: Vec<(&str, &Tensor)> = parts.iter().map(|(n, t)| (n.as_str(), t)).collect();
            crate::io::save(dir.join(shard_file(rank, world)), &named)?;
            if rank == 0 {
                let units: Vec<Value> = self
                    .units
                    .iter()
                    .map(|lay| {
                        let params: Vec<Value> = lay
                            .params
                            .iter()
                            .map(|p| json!({ "name": p.name, "shape": p.shape.dims(), "dtype": lay.dtype.name() }))
                            .collect();
                        Value::Array(params)
                    })
                    .collect();
                let index = json!({ "format": "braid-sharded", "version": 1, "world": world, "units": units });
                let text = serde_json::to_string_pretty(&index).expect("a JSON value prints");
                let path = dir.join(INDEX);
                std::fs::write(&path, text).map_err(|e| Error::Io(format!("cannot write {}: {e}", path.display())))?;
            }
        }
        Ok(())
    }

    /// Reads the checkpoint in `dir` (written by [`Sharded::save`] on any number of ranks) and
    /// shards it over `group` (see [`Sharded::new`]). Every file is read on the host: the
    /// whole model passes through this process's memory once. A missing or inconsistent file
    /// is an `Err` naming it.
    pub fn load(group: &Group, dir: impl AsRef<Path>) -> Result<Sharded> {
        Ok(Sharded::new(group, &Sharded::read_checkpoint(dir)?))
    }

    /// The units of the checkpoint in `dir` (written by [`Sharded::save`] on any number of
    /// ranks), each parameter whole, on the CPU: for [`Sharded::hybrid`] and
    /// [`Sharded::hybrid_across`], or to use the model elsewhere. Errors as [`Sharded::load`].
    pub fn read_checkpoint(dir: impl AsRef<Path>) -> Result<Vec<Params>> {
        let units = Checkpoint::read(dir.as_ref())?.units("")?;
        Ok(units.into_iter().map(|u| u.expect("every parameter is in every file")).collect())
    }
}

/// A checkpoint's index and every rank's file, read from disk once.
struct Checkpoint<'a> {
    dir: &'a Path,
    index: Value,
    world: usize,
    files: Vec<BTreeMap<String, Tensor>>,
}

impl<'a> Checkpoint<'a> {
    /// The checkpoint in `dir`: its index checked, every rank's file read onto the CPU.
    fn read(dir: &'a Path) -> Result<Checkpoint<'a>> {
        let bad = |what: String| Error::Io(format!("{}: {what}", dir.join(INDEX).display()));
        let path = dir.join(INDEX);
        let text =
            std::fs::read_to_string(&path).map_err(|e| Error::Io(format!("cannot read {}: {e}", path.display())))?;
        let index: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        if index["format"] != "braid-sharded" || index["version"] != 1 {
            return Err(bad("not a braid sharded checkpoint index (format braid-sharded, version 1)".into()));
        }
        let world = index["world"].as_u64().filter(|&w| w > 0).ok_or_else(|| bad("no world size".into()))? as usize;
        let host = Device::cpu();
        let files =
            (0..world).map(|r| crate::io::load(dir.join(shard_file(r, world)), &host)).collect::<Result<Vec<_>>>()?;
        Ok(Checkpoint { dir, index, world, files })
    }

    /// Each unit's step count (rank 0's file; `None` for a unit saved without an optimizer
    /// state).
    fn steps(&self) -> Result<Vec<Option<i32>>> {
        let units = self.index["units"].as_array().map_or(0, Vec::len);
        let step = |u: usize| self.files[0].get(&format!("{STEP}{u}")).map(|t| Ok(t.to_vec::<i32>()?[0])).transpose();
        (0..units).map(step).collect()
    }

    /// The units, each parameter whole, on the CPU: the tensors named `prefix` + the
    /// parameter's name in every rank's file (`None` for a unit whose first parameter has
    /// none; then it has none on any rank).
    fn units(&self, prefix: &str) -> Result<Vec<Option<Params>>> {
        let (dir, index, world, files) = (self.dir, &self.index, self.world, &self.files);
        let bad = |what: String| Error::Io(format!("{}: {what}", dir.join(INDEX).display()));
        let units = index["units"].as_array().ok_or_else(|| bad("no units".into()))?;
        units
            .iter()
            .map(|unit| {
                let list = unit.as_array().ok_or_else(|| bad("a unit is not a list".into()))?;
                let first = list.first().and_then(|p| p["name"].as_str()).map(|n| format!("{prefix}{n}"));
                if !prefix.is_empty() && first.is_none_or(|k| !files[0].contains_key(k.as_str())) {
                    return Ok(None);
                }
                let mut params = Params::new();
                for p in list {
                    let name = p["name"].as_str().ok_or_else(|| bad("a parameter without a name".into()))?;
                    let key = format!("{prefix}{name}");
                    let dims: Vec<usize> = p["shape"]
                        .as_array()
                        .and_then(|d| d.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
                        .ok_or_else(|| bad(format!("{name}: no shape")))?;
                    let dtype = p["dtype"]
                        .as_str()
                        .and_then(|n| DType::ALL.into_iter().find(|d| d.name() == n))
                        .ok_or_else(|| bad(format!("{name}: no dtype")))?;
                    let shape = Shape::new(&dims);
                    let part = shape.numel().div_ceil(world).max(1);
                    let mut pieces = Vec::with_capacity(world);
                    for (r, file) in files.iter().enumerate() {
                        let piece = file.get(key.as_str()).ok_or_else(|| {
                            Error::Io(format!("{}: no tensor {key:?}", dir.join(shard_file(r, world)).display()))
                        })?;
                        if piece.dims() != [part] || piece.dtype() != dtype {
                            return Err(Error::Io(format!(
                                "{}: {key:?} is {}, not {dtype} [{part}]",
                                dir.join(shard_file(r, world)).display(),
                                piece.describe()
                            )));
                        }
                        pieces.push(piece.clone());
                    }
                    let whole = Tensor::cat(&pieces.iter().collect::<Vec<_>>(), 0);
                    params.push(name, &whole.narrow(0, 0, shape.numel()).reshape(shape));
                }
                Ok(Some(params))
            })
            .collect()
    }
}
