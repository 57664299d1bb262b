//! Quantized weights (`braid::quant`): quantizing a weight, building one from its parts,
//! multiplying by one, moving and reading one. A quantized tensor names the layout's bytes
//! (see `braid_graph::quant`) and reports the weight's shape `[k, n]` and the dtype it was
//! quantized from; only a product (`x.matmul(&q)`) and a move (`to_device`) read it.

use super::{Tensor, misuse, same_device};
use crate::device::Device;
use crate::error::{Error, Result};
use braid_graph::{DType, Op, QuantLayout, Scheme, Shape, infer};

/// Misuse: `op` read a quantized weight, which only products read.
#[track_caller]
pub(super) fn refuse(op: &str, inputs: &[&Tensor]) -> ! {
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("inputs[{i}]")).collect();
    let operands: Vec<(&str, String)> =
        names.iter().map(String::as_str).zip(inputs.iter().map(|t| t.describe())).collect();
    misuse(
        op,
        "a quantized weight is read only as the right operand of a product (x.matmul(&q)) or moved \
         with to_device; dequantize() it for anything else",
        &operands,
    )
}

impl Tensor {
    /// This float `[k, n]` weight quantized (symmetric, weight-only; see [`crate::quant`]), as the
    /// right operand of a product: `x.matmul(&w.quantize(scheme))` computes `x.matmul(&w)`
    /// with each weight rounded to its scheme's levels. One scale per output channel (a column)
    /// for [`Scheme::Int8`], one per `group` inputs of a channel for [`Scheme::Int4`]; scales
    /// in f32 for an f32 weight, in f16 for f16 and bf16 weights ([`Tensor::quantize_with`]
    /// chooses). Quantizing runs on the CPU when the value is computed (a weight on another
    /// device goes there and back); the result is on this tensor's device.
    ///
    /// ```
    /// use braid::prelude::*;
    /// use braid::quant::Scheme;
    /// let cpu = Device::cpu();
    /// cpu.seed(1);
    /// let w = Tensor::randn([64, 8], DType::F32, &cpu);
    /// let x = Tensor::randn([2, 64], DType::F32, &cpu);
    /// let q = w.quantize(Scheme::Int4 { group: 32 });
    /// let (exact, approx) = (x.matmul(&w).to_vec::<f32>().unwrap(), x.matmul(&q).to_vec::<f32>().unwrap());
    /// let mean = exact.iter().map(|v| v.abs()).sum::<f32>() / exact.len() as f32;
    /// let worst = exact.iter().zip(&approx).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / mean;
    /// assert!(worst < 1.0, "int4 error {worst} of the mean magnitude");
    /// ```
    #[track_caller]
    pub fn quantize(&self, scheme: Scheme) -> Tensor {
        let scale = if self.dtype() == DType::F32 { DType::F32 } else { DType::F16 };
        self.quantize_with(scheme, scale)
    }

    /// [`Tensor::quantize`] with scales of `scale` (`F32` or `F16`).
    #[track_caller]
    pub fn quantize_with(&self, scheme: Scheme, scale: DType) -> Tensor {
        let operands = [("weight", self.describe())];
        if self.0.quant.is_some() {
            misuse("quantize", "the weight is quantized already", &operands);
        }
        let [k, n] = self.dims() else { misuse("quantize", "a weight to quantize is a [k, n] matrix", &operands) };
        // (Matches, not closures: a closure would report its own line, not the caller's.)
        let layout = match QuantLayout::new(scheme, *k, *n, scale) {
            Ok(l) => l,
            Err(e) => misuse("quantize", &e, &operands),
        };
        let (shape, dtype) = match infer::quantize((self.shape(), self.dtype()), &layout) {
            Ok(r) => r,
            Err(e) => misuse("quantize", &e, &operands),
        };
        let on_cpu = self.device().target().name == "cpu";
        let cpu = if on_cpu { self.device().clone() } else { Device::cpu() };
        let bytes = crate::no_grad(|| {
            let w = if on_cpu { self.clone() } else { self.to_device(&cpu) };
            let bytes = Tensor::record(Op::Quantize(Box::new(layout)), dtype, shape, &cpu, &[&w]);
            if on_cpu { bytes } else { bytes.to_device(self.device()) }
        });
        Tensor::quantized(&bytes, layout, self.dtype())
    }

    /// A quantized weight from its parts on `device`: the integer `values` channel by channel
    /// (`values[j * k + i]` is input `i` of output channel `j`, in the scheme's range: `±127`
    /// for int8, `-8..=7` for int4) and the `scales` (`n x groups`, rounded to `scale`'s dtype),
    /// reporting `dtype` as the weight's. What [`crate::io`] loads; also how to bring weights
    /// quantized elsewhere.
    #[track_caller]
    pub fn from_quantized(
        layout: QuantLayout,
        values: &[i32],
        scales: &[f32],
        dtype: DType,
        device: &Device,
    ) -> Tensor {
        let operands = [];
        if values.len() != layout.k * layout.n || scales.len() != layout.n * layout.groups() {
            let problem = format!(
                "a {layout} weight has {} values and {} scales, not {} and {}",
                layout.k * layout.n,
                layout.n * layout.groups(),
                values.len(),
                scales.len()
            );
            misuse("from_quantized", &problem, &operands);
        }
        let top = layout.scheme.max_level();
        let (lo, hi) = if layout.scheme == Scheme::Int8 { (-top, top) } else { (-8, 7) };
        if let Some(v) = values.iter().find(|&&v| v < lo || v > hi) {
            misuse("from_quantized", &format!("value {v} is outside {lo}..={hi} of {}", layout.scheme), &operands);
        }
        if !dtype.is_float() {
            misuse("from_quantized", &format!("a quantized weight's dtype is a float, not {dtype}"), &operands);
        }
        let bytes = layout.pack(values, scales);
        let bytes = Tensor::from_host_bytes(bytes.into(), Shape::from([layout.bytes()]), DType::U8, device);
        Tensor::quantized(&bytes, layout, dtype)
    }

    /// The quantized weight whose bytes `bytes` holds (a `U8` tensor of the layout's bytes).
    pub(crate) fn quantized(bytes: &Tensor, layout: QuantLayout, dtype: DType) -> Tensor {
        let q = Tensor::from_node(bytes.retained(), Shape::from([layout.k, layout.n]), dtype, bytes.device().clone());
        Tensor::with_quant(q, layout)
    }

    fn with_quant(mut t: Tensor, layout: QuantLayout) -> Tensor {
        std::sync::Arc::get_mut(&mut t.0).expect("a new tensor").quant = Some(layout);
        t
    }

    /// A new handle of this value's node (recorded first if held), counted.
    fn retained(&self) -> braid_graph::NodeId {
        self.device().engine().retain_current(self.cell())
    }

    /// A quantized weight's bytes as a plain `U8` tensor (the same value).
    pub(crate) fn quant_bytes(&self) -> Tensor {
        let (dtype, shape) = self.value_meta();
        Tensor::from_node(self.retained(), shape, dtype, self.device().clone())
    }

    /// This quantized weight on `device` (its bytes moved).
    pub(super) fn quantized_to_device(&self, layout: QuantLayout, device: &Device) -> Tensor {
        Tensor::quantized(&self.quant_bytes().to_device(device), layout, self.dtype())
    }

    /// The weight a quantized tensor stands for, `[k, n]` in f32 (each element `value * scale`,
    /// as products compute it), on its device. Reads the bytes (a flush): `Err` when the device
    /// fails; misuse on a tensor that is not quantized.
    #[track_caller]
    pub fn dequantize(&self) -> Result<Tensor> {
        let Some(layout) = self.0.quant else {
            misuse("dequantize", "the tensor is not quantized", &[("x", self.describe())])
        };
        let bytes = self.quant_bytes().raw_bytes()?;
        Ok(Tensor::from_vec(layout.dequantize(&bytes), [layout.k, layout.n], self.device()))
    }

    /// `x [.., m, k]` times this quantized `[k, n]` weight (what [`Tensor::matmul`] records for a
    /// quantized right operand): the rows flattened into one `[rows, k]` product, which
    /// accumulates in f32 and returns x's dtype (autocast's when it is on).
    #[track_caller]
    pub(super) fn quant_product(&self, q: &Tensor, layout: QuantLayout) -> Tensor {
        let x = if crate::amp::autocast_dtype().is_some() { self.autocast_product_operand() } else { self.clone() };
        let operands = [("lhs", self), ("rhs", q)];
        same_device("matmul", &operands);
        let describe = || operands.map(|(n, t)| (n, t.describe()));
        if x.rank() < 2 {
            misuse("matmul", "both operands need at least 2 dimensions", &describe());
        }
        if x.needs_grad() && crate::autograd::grad_enabled() {
            misuse(
                "matmul",
                "a product with a quantized weight has no gradient: run it under braid::no_grad (quantized \
                 weights are for serving)",
                &describe(),
            );
        }
        // One `[rows, k]` product (x as it is when its last dimension is not `k`: inference
        // names the mismatch).
        let rows: usize = x.dims()[..x.rank() - 1].iter().product();
        let flatten = x.rank() > 2 && x.dims().last() == Some(&layout.k);
        let x2 = if flatten { x.reshape([rows, layout.k]) } else { x.clone() };
        let (bytes_dtype, bytes_shape) = q.value_meta();
        let (shape, dtype) = match infer::quant_matmul((x2.shape(), x2.dtype()), (&bytes_shape, bytes_dtype), &layout) {
            Ok(r) => r,
            Err(e) => misuse("matmul", &e, &describe()),
        };
        let y = Tensor::record(Op::QuantMatmul(Box::new(layout)), dtype, shape, self.device(), &[&x2, q]);
        if !flatten {
            // No view over the product: an elementwise op after it fuses as its epilogue.
            return y;
        }
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("rank >= 2") = layout.n;
        y.reshape(dims)
    }
}

/// The error of reading a quantized tensor's elements.
pub(super) fn read_error(t: &Tensor) -> Error {
    Error::Quantized(format!("{} holds packed bytes; dequantize() it to read its values", t.describe()))
}
