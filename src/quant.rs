//! Weight-only quantization for serving: a weight's values rounded to 8 or 4 bits with f32 or
//! f16 scales, multiplied without ever being written back in full precision.
//!
//! [`Tensor::quantize`](crate::Tensor::quantize) turns a float `[k, n]` weight (the right
//! operand of a product: `k` inputs, `n` output channels) into a quantized tensor;
//! `x.matmul(&q)` then reads the packed values and scales and dequantizes them inside the
//! product, accumulating in f32 (CUDA, the CPU and wgpu each have kernels for it; an epilogue,
//! such as a bias and an activation, fuses with it as with any product).
//! [`nn::Linear::quantize`](crate::nn::Linear::quantize) makes a serving layer of a trained
//! one, and [`crate::io`] saves and loads quantized weights.
//!
//! - [`Scheme::Int8`]: one scale per output channel, values in `±127`.
//! - [`Scheme::Int4`]: one scale per `group` (32, 64 or 128) inputs of a channel, values in
//!   `±7`, two a byte.
//!
//! The reference (what every device is checked against) is dequantize-then-multiply in f32;
//! `QuantLayout` (from `braid_graph::quant`) documents the bytes. A quantized weight is read
//! by products only, has no gradient, and is moved with `to_device`; anything else is misuse at
//! the caller's line, and `to_vec` on it is an `Err` (use
//! [`Tensor::dequantize`](crate::Tensor::dequantize)).
//!
//! ```
//! use braid::prelude::*;
//! use braid::quant::Scheme;
//! let cpu = Device::cpu();
//! cpu.seed(3);
//! let w = Tensor::randn([256, 16], DType::F32, &cpu);
//! let q = w.quantize(Scheme::Int8);
//! assert_eq!(q.dims(), &[256, 16]);
//! let x = Tensor::randn([4, 256], DType::F32, &cpu);
//! let approx = x.matmul(&q).to_vec::<f32>().unwrap();
//! // The f32 product of the dequantized weight, up to the order of the sums...
//! let of_dequantized = x.matmul(&q.dequantize().unwrap()).to_vec::<f32>().unwrap();
//! for (a, b) in approx.iter().zip(&of_dequantized) {
//!     assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0));
//! }
//! // ...and near the product of the weight itself (int8 keeps about two decimal digits).
//! let exact = x.matmul(&w).to_vec::<f32>().unwrap();
//! let mean = exact.iter().map(|v| v.abs()).sum::<f32>() / exact.len() as f32;
//! let worst = exact.iter().zip(&approx).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / mean;
//! assert!(worst < 0.1, "int8 error {worst} of the mean magnitude");
//! ```

pub use braid_graph::quant::{QuantLayout, Scheme};
