//! Creating tensors: from host data, constants, ranges and random numbers.

use super::{Tensor, misuse};
use crate::device::Device;
use crate::engine::{Held, HeldValue, reserve_seq};
use crate::recorder;
use braid_devices::Buffer;
use braid_graph::{DType, Element, Op, Scalar, Shape};
use std::sync::Arc;

impl Tensor {
    /// A tensor holding `data` (row-major) with `shape`. The data moves to the device when a
    /// flush first needs it.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], &Device::cpu());
    /// assert_eq!(t.dims(), &[2, 2]);
    /// ```
    #[track_caller]
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>, device: &Device) -> Tensor {
        Tensor::from_slice(&data, shape, device)
    }

    /// Like [`Tensor::from_vec`], copying from a slice.
    #[track_caller]
    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>, device: &Device) -> Tensor {
        let shape = shape.into();
        if data.len() != shape.numel() {
            misuse(
                "from_vec",
                &format!("{} values cannot fill shape {shape} ({} elements)", data.len(), shape.numel()),
                &[("data", format!("{} {} values", data.len(), T::DTYPE))],
            );
        }
        super::supported("from_vec", T::DTYPE, device);
        Tensor::from_host_bytes(T::to_bytes(data), shape, T::DTYPE, device)
    }

    /// A tensor of host data (`bytes` in the dtype's layout, checked by the caller) made on the
    /// current stream, held by the tensor until something needs a node (see `Tensor::cell`).
    pub(crate) fn from_host_bytes(bytes: Arc<[u8]>, shape: Shape, dtype: DType, device: &Device) -> Tensor {
        Tensor::made_holding(HeldValue::Host(bytes), shape, dtype, device)
    }

    /// A tensor of a buffer computed outside the graph (a replayed step's output), made on the
    /// current stream and held as [`Tensor::from_host_bytes`] holds host data.
    pub(crate) fn from_computed(buffer: Buffer, shape: Shape, dtype: DType, device: &Device) -> Tensor {
        Tensor::made_holding(HeldValue::Ready(buffer), shape, dtype, device)
    }

    fn made_holding(value: HeldValue, shape: Shape, dtype: DType, device: &Device) -> Tensor {
        let held = Held { value, stream: recorder::current_stream(device.id()), seq: reserve_seq() };
        Tensor::from_held(held, shape, dtype, device.clone())
    }

    /// Every element equal to `value` (which must be representable in `dtype`).
    #[track_caller]
    pub fn full(shape: impl Into<Shape>, value: f64, dtype: DType, device: &Device) -> Tensor {
        let shape = shape.into();
        if !dtype.represents(value) {
            misuse("full", &format!("{value} is not representable in {dtype}"), &[("shape", shape.to_string())]);
        }
        Tensor::record(Op::Full(Scalar(value)), dtype, shape, device, &[])
    }

    #[track_caller]
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Tensor {
        Tensor::full(shape, 0.0, dtype, device)
    }

    #[track_caller]
    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Tensor {
        Tensor::full(shape, 1.0, dtype, device)
    }

    /// `start, start + 1, ..., end - 1` as I64 (empty when `end <= start`). On a device without
    /// i64 (wgpu), ask for i32 with [`arange_as`](Tensor::arange_as).
    #[track_caller]
    pub fn arange(start: i64, end: i64, device: &Device) -> Tensor {
        let operands = [("start", start.to_string()), ("end", end.to_string())];
        super::indexing::needs_i64("arange", "arange_as(start, end, DType::I32, device)", device, &operands);
        Tensor::arange_as(start, end, DType::I64, device)
    }

    /// `start, start + 1, ..., end - 1` in `dtype` (empty when `end <= start`): computed as
    /// i64 in the kernel and converted as stored (integers wrap, floats round to nearest), so
    /// `DType::I32` positions need no i64 tensor (what wgpu holds).
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let at = Tensor::arange_as(2, 6, DType::I32, &cpu);
    /// assert_eq!(at.to_vec::<i32>().unwrap(), vec![2, 3, 4, 5]);
    /// ```
    #[track_caller]
    pub fn arange_as(start: i64, end: i64, dtype: DType, device: &Device) -> Tensor {
        if !dtype.is_numeric() {
            misuse("arange", &format!("needs a numeric dtype, got {dtype}"), &[("start", start.to_string())]);
        }
        let len = end.saturating_sub(start).max(0) as usize;
        Tensor::record(Op::Arange { start }, dtype, Shape::from([len]), device, &[])
    }

    /// Uniform on `[lo, hi)`, from the device's seeded generator (see [`Device::seed`]).
    #[track_caller]
    pub fn rand(shape: impl Into<Shape>, lo: f64, hi: f64, dtype: DType, device: &Device) -> Tensor {
        let shape = shape.into();
        if !dtype.is_float() || !lo.is_finite() || !hi.is_finite() || lo > hi {
            misuse(
                "rand",
                &format!("needs a float dtype and finite lo <= hi, got {dtype} and [{lo}, {hi})"),
                &[("shape", shape.to_string())],
            );
        }
        let seed = seed_outside_capture("rand", device);
        Tensor::record(Op::Rand { lo: Scalar(lo), hi: Scalar(hi), seed }, dtype, shape, device, &[])
    }

    /// Standard normal, from the device's seeded generator.
    #[track_caller]
    pub fn randn(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Tensor {
        let shape = shape.into();
        if !dtype.is_float() {
            misuse("randn", &format!("needs a float dtype, got {dtype}"), &[("shape", shape.to_string())]);
        }
        let seed = seed_outside_capture("randn", device);
        Tensor::record(Op::Randn { seed }, dtype, shape, device, &[])
    }
}

/// The device's next seed, or inside a step's capture a refusal (every replay would draw the
/// capture's numbers) and a seed that leaves the device's sequence as it was.
fn seed_outside_capture(op: &str, device: &Device) -> u64 {
    let refused = crate::engine::capture::refuse(|| {
        format!(
            "{op} inside a step while it is captured: every replay would draw the numbers of the capture; \
             make random tensors outside the step and pass them as arguments"
        )
    });
    if refused.is_some() { 0 } else { device.next_seed() }
}
