//! Checkpoints of a [`Sharded`] model: each rank writes its shard (safetensors, one file per
//! rank: every parameter's part under the parameter's name, flat), rank 0 an index
//! (`sharded-index.json`: the group's size and every unit's parameters, names, shapes and
//! dtypes). Loading reads every rank's file (a directory all processes see) and shards again
//! for the loading group, whatever its size.
//!
//! Parameters only: optimizer states stay with the optimizers (a restarted run's AdamW starts
//! its moments from zero).

use super::Sharded;
use crate::device::Device;
use crate::dist::Group;
use crate::error::{Error, Result};
use crate::nn::Params;
use crate::tensor::Tensor;
use braid_graph::{DType, Shape};
use serde_json::{Value, json};
use std::path::Path;

/// The index's file name in a checkpoint directory.
pub const INDEX: &str = "sharded-index.json";

/// Rank `rank`'s file of a group of `world`.
fn shard_file(rank: usize, world: usize) -> String {
    format!("shard-{rank:05}-of-{world:05}.safetensors")
}

impl Sharded {
    /// Writes this process's ranks' shards into `dir` (created if missing), and the index from
    /// rank 0. Reads the shards (a flush of what they need on each rank).
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| Error::Io(format!("cannot create {}: {e}", dir.display())))?;
        let world = self.group.size();
        for (i, rank) in self.group.ranks().into_iter().enumerate() {
            let mut parts: Vec<(String, Tensor)> = Vec::new();
            for (u, lay) in self.units.iter().enumerate() {
                for p in &lay.params {
                    parts.push((p.name.clone(), self.shards[i][u].detach().narrow(0, p.offset, p.part)));
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
        let units = read(dir.as_ref())?;
        Ok(Sharded::new(group, &units))
    }
}

/// The units of the checkpoint in `dir`, each parameter whole, on the CPU.
fn read(dir: &Path) -> Result<Vec<Params>> {
    let bad = |what: String| Error::Io(format!("{}: {what}", dir.join(INDEX).display()));
    let path = dir.join(INDEX);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Io(format!("cannot read {}: {e}", path.display())))?;
    let index: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    if index["format"] != "braid-sharded" || index["version"] != 1 {
        return Err(bad("not a braid sharded checkpoint index (format braid-sharded, version 1)".into()));
    }
    let world = index["world"].as_u64().filter(|&w| w > 0).ok_or_else(|| bad("no world size".into()))? as usize;
    let host = Device::cpu();
    let files =
        (0..world).map(|r| crate::io::load(dir.join(shard_file(r, world)), &host)).collect::<Result<Vec<_>>>()?;
    let units = index["units"].as_array().ok_or_else(|| bad("no units".into()))?;
    units
        .iter()
        .map(|unit| {
            let mut params = Params::new();
            for p in unit.as_array().ok_or_else(|| bad("a unit is not a list".into()))? {
                let name = p["name"].as_str().ok_or_else(|| bad("a parameter without a name".into()))?;
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
                    let piece = file.get(name).ok_or_else(|| {
                        Error::Io(format!("{}: no tensor {name:?}", dir.join(shard_file(r, world)).display()))
                    })?;
                    if piece.dims() != [part] || piece.dtype() != dtype {
                        return Err(Error::Io(format!(
                            "{}: {name:?} is {}, not {dtype} [{part}]",
                            dir.join(shard_file(r, world)).display(),
                            piece.describe()
                        )));
                    }
                    pieces.push(piece.clone());
                }
                let whole = Tensor::cat(&pieces.iter().collect::<Vec<_>>(), 0);
                params.push(name, &whole.narrow(0, 0, shape.numel()).reshape(shape));
            }
            Ok(params)
        })
        .collect()
}
