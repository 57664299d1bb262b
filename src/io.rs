//! Saving and loading named tensors in the [safetensors](https://github.com/huggingface/safetensors)
//! format (the `safetensors` crate), which PyTorch, JAX and Hugging Face read and write.
//!
//! Saving reads the tensors (it flushes what they need); loading records host data on the
//! device you name, uploaded when a flush first needs it. A file that is truncated, whose header
//! lies about sizes or offsets, or that holds a dtype braid does not have is an `Err`
//! ([`Error::Io`]) naming the problem; nothing is half-loaded.
//!
//! A quantized weight (`braid::quant`) named `w` is saved as two tensors any reader can open,
//! `w.qweight` (`U8 [n, row_bytes]`: each output channel's packed values, rows padded to 16
//! bytes) and `w.scales` (`F32` or `F16` `[n, groups]`), and one entry of the file's metadata,
//! `braid.quant.w` = `scheme=int4;group=32;k=768;n=3072;dtype=bf16` (`scheme=int8` without a
//! group); loading puts the quantized tensor back under `w`. The byte layout is
//! `braid_graph::quant`'s.
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
use braid_graph::{DType, QuantLayout, Scheme, Shape};
use safetensors::tensor::{Dtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
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
    let mut metadata = HashMap::new();
    for (name, t) in tensors {
        if let Some(layout) = t.quant_layout() {
            let data = t.quant_bytes().raw_bytes()?;
            metadata.insert(format!("{QUANT_KEY}{name}"), describe_layout(&layout, t.dtype()));
            let at = layout.scales_offset();
            let values =
                Bytes { dtype: Dtype::U8, shape: vec![layout.n, layout.row_bytes()], data: data[..at].to_vec() };
            let scale_bytes = layout.n * layout.groups() * layout.scale.size();
            let scales = Bytes {
                dtype: to_file_dtype(layout.scale),
                shape: vec![layout.n, layout.groups()],
                data: data[at..at + scale_bytes].to_vec(),
            };
            named.push((format!("{name}.qweight"), values));
            named.push((format!("{name}.scales"), scales));
        } else {
            let data = t.raw_bytes()?;
            named.push((name.to_string(), Bytes { dtype: to_file_dtype(t.dtype()), shape: t.dims().to_vec(), data }));
        }
    }
    let mut names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::Io(format!("two tensors are named {:?}", w[0])));
    }
    let metadata = (!metadata.is_empty()).then_some(metadata);
    safetensors::serialize(named.iter().map(|(n, b)| (n.as_str(), b)), metadata)
        .map_err(|e| Error::Io(format!("safetensors: {e}")))
}

/// The metadata key prefix naming a quantized weight.
const QUANT_KEY: &str = "braid.quant.";

fn describe_layout(l: &QuantLayout, dtype: DType) -> String {
    let scheme = match l.scheme {
        Scheme::Int8 => "scheme=int8".to_string(),
        Scheme::Int4 { group } => format!("scheme=int4;group={group}"),
    };
    format!("{scheme};k={};n={};dtype={}", l.k, l.n, dtype_name(dtype))
}

fn dtype_name(d: DType) -> String {
    d.to_string().to_lowercase()
}

/// The layout and reported dtype a metadata entry describes (scales' dtype from the file).
fn parse_layout(text: &str, scale: DType) -> std::result::Result<(QuantLayout, DType), String> {
    let field = |key: &str| {
        text.split(';')
            .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
            .ok_or_else(|| format!("no {key} in {text:?}"))
    };
    let number = |key: &str| -> std::result::Result<usize, String> {
        field(key)?.parse().map_err(|_| format!("{key} is not a number in {text:?}"))
    };
    let scheme = match field("scheme")? {
        "int8" => Scheme::Int8,
        "int4" => Scheme::Int4 { group: number("group")? },
        other => return Err(format!("unknown scheme {other:?}")),
    };
    let name = field("dtype")?;
    let dtype = [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .find(|&d| dtype_name(d) == name)
        .ok_or_else(|| format!("dtype {name:?} of a quantized weight"))?;
    Ok((QuantLayout::new(scheme, number("k")?, number("n")?, scale)?, dtype))
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
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| Error::Io(format!("not a valid safetensors file: {e}")))?;
    let mut out = BTreeMap::new();
    let mut parts = std::collections::BTreeSet::new();
    for (key, text) in header.metadata().iter().flatten() {
        let Some(name) = key.strip_prefix(QUANT_KEY) else { continue };
        let quantized = load_quantized(&file, name, text, device)
            .map_err(|e| Error::Io(format!("quantized weight {name:?}: {e}")))?;
        parts.extend([format!("{name}.qweight"), format!("{name}.scales")]);
        out.insert(name.to_string(), quantized);
    }
    for (name, view) in file.tensors() {
        if parts.contains(&name) {
            continue;
        }
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

/// The quantized weight `name` of `file`, its metadata entry reading `text`.
fn load_quantized(
    file: &SafeTensors<'_>,
    name: &str,
    text: &str,
    device: &Device,
) -> std::result::Result<Tensor, String> {
    let tensor = |part: &str| file.tensor(&format!("{name}.{part}")).map_err(|e| format!("{part}: {e}"));
    let (values, scales) = (tensor("qweight")?, tensor("scales")?);
    let scale = from_file_dtype(scales.dtype()).ok_or("scales of a dtype braid does not have")?;
    let (layout, dtype) = parse_layout(text, scale)?;
    if values.dtype() != Dtype::U8 || values.shape() != [layout.n, layout.row_bytes()] {
        return Err(format!(
            "qweight is {:?} {:?}, not U8 [{}, {}]",
            values.dtype(),
            values.shape(),
            layout.n,
            layout.row_bytes()
        ));
    }
    if scales.shape() != [layout.n, layout.groups()] {
        return Err(format!("scales are {:?}, not [{}, {}]", scales.shape(), layout.n, layout.groups()));
    }
    let mut bytes = values.data().to_vec();
    bytes.extend_from_slice(scales.data());
    bytes.resize(layout.bytes(), 0);
    let held = Tensor::from_host_bytes(bytes.into(), Shape::from([layout.bytes()]), DType::U8, device);
    Ok(Tensor::quantized(&held, layout, dtype))
}

/// The tensors of the safetensors file at `path`, by name, on `device`.
pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("cannot read {}: {e}", path.display())))?;
    load_from_bytes(&bytes, device).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}
