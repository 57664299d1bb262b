//! Initialisers: new parameter tensors (leaves that require gradients) drawn from the device's
//! seeded random numbers (`device.seed(n)` makes them repeatable), as PyTorch's `nn.init`
//! defines them. `fan_in` and `fan_out` are a weight's `[out, in]` dimensions (the last is the
//! input).

use crate::device::Device;
use crate::tensor::Tensor;
use braid_graph::{DType, Shape};

/// `(fan_in, fan_out)` of a weight of `shape` (`[out, in, ...]` as PyTorch lays them out; for a
/// 1-D shape both are its length).
pub fn fans(shape: &Shape) -> (usize, usize) {
    let d = shape.dims();
    match d.len() {
        0 => (1, 1),
        1 => (d[0], d[0]),
        _ => {
            let receptive: usize = d[2..].iter().product();
            (d[1] * receptive, d[0] * receptive)
        }
    }
}

/// A parameter of `shape` filled with `value`.
#[track_caller]
pub fn constant(shape: impl Into<Shape>, value: f64, dtype: DType, device: &Device) -> Tensor {
    Tensor::full(shape, value, dtype, device).detach().requires_grad()
}

/// A parameter of zeros.
#[track_caller]
pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Tensor {
    constant(shape, 0.0, dtype, device)
}

/// A parameter of ones.
#[track_caller]
pub fn ones(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Tensor {
    constant(shape, 1.0, dtype, device)
}

/// Uniform on `[lo, hi)`.
#[track_caller]
pub fn uniform(shape: impl Into<Shape>, lo: f64, hi: f64, dtype: DType, device: &Device) -> Tensor {
    Tensor::rand(shape, lo, hi, dtype, device).detach().requires_grad()
}

/// Normal with mean `mean` and standard deviation `std`.
#[track_caller]
pub fn normal(shape: impl Into<Shape>, mean: f64, std: f64, dtype: DType, device: &Device) -> Tensor {
    crate::no_grad(|| Tensor::randn(shape, dtype, device) * std + mean).requires_grad()
}

/// Kaiming (He) uniform for ReLU networks: bound `sqrt(6 / fan_in)`.
#[track_caller]
pub fn kaiming_uniform(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Tensor {
    let shape = shape.into();
    let bound = (6.0 / fans(&shape).0 as f64).sqrt();
    uniform(shape, -bound, bound, dtype, device)
}

/// Kaiming (He) normal for ReLU networks: std `sqrt(2 / fan_in)`.
#[track_caller]
pub fn kaiming_normal(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Tensor {
    let shape = shape.into();
    let std = (2.0 / fans(&shape).0 as f64).sqrt();
    normal(shape, 0.0, std, dtype, device)
}

/// Xavier (Glorot) uniform: bound `sqrt(6 / (fan_in + fan_out))`.
#[track_caller]
pub fn xavier_uniform(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Tensor {
    let shape = shape.into();
    let (i, o) = fans(&shape);
    let bound = (6.0 / (i + o) as f64).sqrt();
    uniform(shape, -bound, bound, dtype, device)
}

/// Xavier (Glorot) normal: std `sqrt(2 / (fan_in + fan_out))`.
#[track_caller]
pub fn xavier_normal(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Tensor {
    let shape = shape.into();
    let (i, o) = fans(&shape);
    normal(shape, 0.0, (2.0 / (i + o) as f64).sqrt(), dtype, device)
}
