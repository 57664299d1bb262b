//! A small set of layers, initialisers and a parameter collection, so that a training loop
//! reads like the Rust peers' (Burn, candle): `Linear`, `Embedding`, `LayerNorm`, `init`, and
//! [`Params`], which optimizers ([`crate::optim::Optimizer::update`]) and `braid::io` take.
//!
//! Layers are plain structs of parameter tensors (leaves that require gradients, in exact-size
//! parameter memory); `forward` records ops like any other code. Nothing here runs anything.
//!
//! ```
//! use braid::prelude::*;
//! use braid::nn::{Linear, Module};
//! use braid::optim::{Optimizer, Sgd};
//!
//! let cpu = Device::new_cpu();
//! cpu.seed(0);
//! let layer = Linear::new(4, 2, &cpu);
//! let x = Tensor::randn([8, 4], DType::F32, &cpu);
//! let loss = layer.forward(&x).square().mean();
//! let grads = loss.backward().unwrap();
//! Sgd::new(0.1).update(layer.params().iter(), &grads);
//! assert!(layer.forward(&x).square().mean().item::<f32>().unwrap() < loss.item::<f32>().unwrap());
//! ```

pub mod generate;
pub mod init;

use crate::device::Device;
use crate::tensor::Tensor;
use braid_graph::DType;

/// Named parameters, in the order they were added. Names are dotted paths (`blocks.0.ln.weight`)
/// as `braid::io` saves them.
#[derive(Clone, Default, Debug)]
pub struct Params {
    entries: Vec<(String, Tensor)>,
}

impl Params {
    pub fn new() -> Params {
        Params::default()
    }

    /// Adds `t` under `name`.
    pub fn push(&mut self, name: impl Into<String>, t: &Tensor) {
        self.entries.push((name.into(), t.clone()));
    }

    /// Adds every parameter of `other` under `prefix.` (a sub-module's).
    pub fn extend(&mut self, prefix: &str, other: Params) {
        for (name, t) in other.entries {
            self.entries.push((format!("{prefix}.{name}"), t));
        }
    }

    /// The tensors, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Tensor> {
        self.entries.iter().map(|(_, t)| t)
    }

    /// Names and tensors, in order.
    pub fn named(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.entries.iter().map(|(n, t)| (n.as_str(), t))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Elements over all parameters.
    pub fn numel(&self) -> usize {
        self.iter().map(Tensor::numel).sum()
    }

    /// Writes the parameters to a safetensors file (see [`crate::io::save`]).
    pub fn save(&self, path: impl AsRef<std::path::Path>) -> crate::Result<()> {
        let named: Vec<(&str, &Tensor)> = self.named().collect();
        crate::io::save(path, &named)
    }

    /// Sets every parameter to the tensor of the same name in the safetensors file at `path`
    /// (an in-place update of each, so the layers holding them see the loaded values). A
    /// missing name, or a shape or dtype that differs, is an `Err` and nothing is changed.
    pub fn load(&self, path: impl AsRef<std::path::Path>) -> crate::Result<()> {
        // With no parameters the file is still read and checked (onto the CPU, as host data
        // that is never uploaded): a missing or broken file is an `Err` either way.
        let device = self.entries.first().map_or_else(Device::cpu, |(_, t)| t.device().clone());
        let loaded = crate::io::load(path, &device)?;
        for (name, t) in self.named() {
            if t.quant_layout().is_some() {
                return Err(crate::Error::Io(format!(
                    "{name}: a quantized weight is not updated in place; load it with braid::io::load and \
                     build its layer from it"
                )));
            }
            match loaded.get(name) {
                Some(v) if v.shape() == t.shape() && v.dtype() == t.dtype() && v.quant_layout().is_none() => {}
                Some(v) => {
                    return Err(crate::Error::Io(format!(
                        "{name}: the file has {} {}, the parameter is {} {}",
                        v.shape(),
                        v.dtype(),
                        t.shape(),
                        t.dtype()
                    )));
                }
                None => return Err(crate::Error::Io(format!("{name}: not in the file"))),
            }
        }
        crate::no_grad(|| {
            for (name, t) in self.named() {
                t.assign(&loaded[name]);
            }
        });
        Ok(())
    }
}

impl<'a> IntoIterator for &'a Params {
    type Item = &'a Tensor;
    type IntoIter = Box<dyn Iterator<Item = &'a Tensor> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

/// A layer: a function of one tensor with parameters.
pub trait Module {
    fn forward(&self, x: &Tensor) -> Tensor;
    /// The layer's parameters, named.
    fn params(&self) -> Params;
}

/// `y = x W^T + b`, PyTorch's layout: `weight` is `[out, in]`, `bias` `[out]`; both initialised
/// as PyTorch's `nn.Linear` (uniform in `±1/sqrt(in)`).
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// An f32 layer from `inputs` to `outputs` features, with a bias.
    #[track_caller]
    pub fn new(inputs: usize, outputs: usize, device: &Device) -> Linear {
        Linear::with(inputs, outputs, true, DType::F32, device)
    }

    /// A layer of `dtype`, with or without a bias.
    #[track_caller]
    pub fn with(inputs: usize, outputs: usize, bias: bool, dtype: DType, device: &Device) -> Linear {
        let bound = 1.0 / (inputs.max(1) as f64).sqrt();
        Linear {
            weight: init::uniform([outputs, inputs], -bound, bound, dtype, device),
            bias: bias.then(|| init::uniform([outputs], -bound, bound, dtype, device)),
        }
    }
}

impl Linear {
    /// A serving copy of this layer with its weight quantized (see [`crate::quant`]): the
    /// weight `[out, in]` becomes a quantized `[in, out]` (its transpose, channels along `out`,
    /// groups along `in`); the bias stays as it is.
    ///
    /// ```
    /// use braid::prelude::*;
    /// use braid::nn::{Linear, Module};
    /// use braid::quant::Scheme;
    /// let cpu = Device::cpu();
    /// let layer = Linear::new(64, 3, &cpu);
    /// let served = layer.quantize(Scheme::Int4 { group: 64 });
    /// let x = Tensor::randn([2, 64], DType::F32, &cpu);
    /// assert_eq!(braid::no_grad(|| served.forward(&x)).dims(), &[2, 3]);
    /// ```
    #[track_caller]
    pub fn quantize(&self, scheme: crate::quant::Scheme) -> QuantizedLinear {
        let weight = crate::no_grad(|| self.weight.t().quantize(scheme));
        QuantizedLinear { weight, bias: self.bias.as_ref().map(Tensor::detach) }
    }
}

/// `y = x Q + b` with a quantized weight `Q` `[in, out]` (see [`Linear::quantize`]); for
/// serving: it has no gradient.
#[derive(Clone, Debug)]
pub struct QuantizedLinear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Module for QuantizedLinear {
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Tensor {
        let y = x.matmul(&self.weight);
        match &self.bias {
            Some(b) => &y + &b.to_dtype(y.dtype()),
            None => y,
        }
    }

    fn params(&self) -> Params {
        let mut p = Params::new();
        p.push("weight", &self.weight);
        if let Some(b) = &self.bias {
            p.push("bias", b);
        }
        p
    }
}

impl Module for Linear {
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
    }

    fn params(&self) -> Params {
        let mut p = Params::new();
        p.push("weight", &self.weight);
        if let Some(b) = &self.bias {
            p.push("bias", b);
        }
        p
    }
}

/// A lookup table of `vocabulary` learned vectors of `features` each (PyTorch's
/// `nn.Embedding`: weight `[vocabulary, features]` from a standard normal, drawn from the
/// device's seed). `forward` takes integer ids of any shape and returns their rows (see
/// [`Tensor::embedding`], which also says what an id out of range gives).
#[derive(Clone, Debug)]
pub struct Embedding {
    pub weight: Tensor,
}

impl Embedding {
    /// An f32 table.
    #[track_caller]
    pub fn new(vocabulary: usize, features: usize, device: &Device) -> Embedding {
        Embedding::with(vocabulary, features, DType::F32, device)
    }

    /// A table of `dtype`.
    #[track_caller]
    pub fn with(vocabulary: usize, features: usize, dtype: DType, device: &Device) -> Embedding {
        Embedding { weight: init::normal([vocabulary, features], 0.0, 1.0, dtype, device) }
    }
}

impl Module for Embedding {
    #[track_caller]
    fn forward(&self, ids: &Tensor) -> Tensor {
        ids.embedding(&self.weight)
    }

    fn params(&self) -> Params {
        let mut p = Params::new();
        p.push("weight", &self.weight);
        p
    }
}

/// Layer normalisation over the last dimension with a learned scale and shift (PyTorch's
/// `nn.LayerNorm(d)`: weight ones, bias zeros, eps 1e-5).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f64,
}

impl LayerNorm {
    #[track_caller]
    pub fn new(dim: usize, device: &Device) -> LayerNorm {
        LayerNorm {
            weight: init::ones([dim], DType::F32, device),
            bias: init::zeros([dim], DType::F32, device),
            eps: 1e-5,
        }
    }
}

impl Module for LayerNorm {
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Tensor {
        &(x.layer_norm(-1, self.eps) * &self.weight) + &self.bias
    }

    fn params(&self) -> Params {
        let mut p = Params::new();
        p.push("weight", &self.weight);
        p.push("bias", &self.bias);
        p
    }
}
