//! Saving and loading named tensors in the [safetensors](https://github.com/huggingface/safetensors)
//! format (the `safetensors` crate), which PyTorch, JAX and Hugging Face read and write.
//!
//! Saving reads the tensors (it flushes what they need); loading records host data on the
//! device you name, uploaded when a flush first needs it. A file that is truncated, whose header
//! lies about sizes or offsets, or that holds a dtype braid does not have is an `Err`
//! ([`Error::Io`]) naming the problem; nothing is half-loaded.
//!
//! ```
//! use braid::prelude::*;
//! let cpu = Device::cpu();
//! let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], &cpu);
//! let bytes = braid::io::save_to_bytes(&[("layer.weight", &w)]).unwrap();
//! let loaded = braid::io::load_from_bytes(&bytes, &cpu).unwrap();
//! assert_eq!(loaded["layer.weight"].to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
//! ```

use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use braid_graph::{DType, Shape};
use safetensors::tensor::{Dtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

/// One tensor's bytes, as the safetensors writer takes them.
struct Bytes {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Bytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn to_file_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
    }
}

fn from_file_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool,
        _ => return None,
    })
}

/// The tensors' values in the safetensors format (their current versions; reading them flushes
/// what they need). Names must be unique.
pub fn save_to_bytes(tensors: &[(&str, &Tensor)]) -> Result<Vec<u8>> {
    let mut named: Vec<(String, Bytes)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if named.iter().any(|(n, _)| n == name) {
            return Err(Error::Io(format!("two tensors are named {name:?}")));
        }
        let data = t.raw_bytes()?;
        named.push((name.to_string(), Bytes { dtype: to_file_dtype(t.dtype()), shape: t.dims().to_vec(), data }));
    }
    safetensors::serialize(named.iter().map(|(n, b)| (n.as_str(), b)), None)
        .map_err(|e| Error::Io(format!("safetensors: {e}")))
}

/// Writes the tensors to `path` in the safetensors format (see [`save_to_bytes`]).
pub fn save(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let path = path.as_ref();
    let bytes = save_to_bytes(tensors)?;
    std::fs::write(path, bytes).map_err(|e| Error::Io(format!("cannot write {}: {e}", path.display())))
}

/// The tensors of a safetensors file's bytes, by name, on `device`.
pub fn load_from_bytes(bytes: &[u8], device: &Device) -> Result<BTreeMap<String, Tensor>> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| Error::Io(format!("not a valid safetensors file: {e}")))?;
    let mut out = BTreeMap::new();
    for (name, view) in file.tensors() {
        let dtype = from_file_dtype(view.dtype()).ok_or_else(|| {
            Error::Io(format!("tensor {name:?} has dtype {:?}, which braid does not have", view.dtype()))
        })?;
        device.target().check_dtype(dtype).map_err(|e| Error::Io(format!("tensor {name:?}: {e}")))?;
        let shape = Shape::new(view.shape());
        let data = view.data();
        if data.len() != shape.numel() * dtype.size() {
            return Err(Error::Io(format!("tensor {name:?}: {} bytes for shape {shape} of {dtype}", data.len())));
        }
        if dtype == DType::Bool && data.iter().any(|&b| b > 1) {
            return Err(Error::Io(format!("tensor {name:?}: a bool byte other than 0 or 1")));
        }
        out.insert(name, Tensor::from_host_bytes(data.to_vec().into(), shape, dtype, device));
    }
    Ok(out)
}

/// The tensors of the safetensors file at `path`, by name, on `device`.
pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("cannot read {}: {e}", path.display())))?;
    load_from_bytes(&bytes, device).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}
