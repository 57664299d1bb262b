//! Reading values (which flushes what they need) and in-place updates (new versions).

use super::{Tensor, inferred, misuse, same_device};
use crate::engine::HeldValue;
use crate::error::{Error, Result};
use braid_devices::Buffer;
use braid_graph::table::BinaryOp;
use braid_graph::{Element, Op, Scalar, infer};

impl Tensor {
    /// The elements in row-major order. Runs what this value needs (and only that), waits for
    /// it, and copies it out. `Err` if `T` is not the tensor's dtype or the device failed.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &cpu);
    /// assert_eq!((&x * 2.0).to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
    /// assert!(x.to_vec::<f64>().is_err());
    /// ```
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.quant_layout().is_some() {
            return Err(super::quant::read_error(self));
        }
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch { tensor: self.dtype(), requested: T::DTYPE });
        }
        Ok(T::read_bytes(&self.raw_bytes()?))
    }

    /// The elements' bytes in the dtype's little-endian layout (computed first if needed).
    pub(crate) fn raw_bytes(&self) -> Result<Vec<u8>> {
        if let Some(bytes) = self.held_host_bytes()? {
            return Ok(bytes.to_vec());
        }
        let buffer = self.materialize()?;
        let engine = self.device().engine();
        engine.backend.download(&buffer).map_err(|e| engine.device_error(e))
    }

    /// The single element of a one-element tensor.
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.quant_layout().is_some() {
            return Err(super::quant::read_error(self));
        }
        if self.numel() != 1 {
            return Err(Error::NotAScalar { shape: self.shape().clone(), numel: self.numel() });
        }
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch { tensor: self.dtype(), requested: T::DTYPE });
        }
        if let Some(bytes) = self.held_host_bytes()? {
            return Ok(T::read_one(&bytes));
        }
        let buffer = self.materialize()?;
        let engine = self.device().engine();
        // Every dtype is at most 8 bytes: read into the stack, not a vector.
        let mut bytes = [0u8; 8];
        let bytes = &mut bytes[..self.dtype().size()];
        engine.backend.download_into(&buffer, bytes).map_err(|e| engine.device_error(e))?;
        Ok(T::read_one(bytes))
    }

    /// The host data this tensor holds, if it holds host data (see `Tensor::held`): a read of
    /// it needs no upload, so it is read where it is.
    fn held_host_bytes(&self) -> Result<Option<std::sync::Arc<[u8]>>> {
        match self.held() {
            Some((HeldValue::Host(bytes), _)) => {
                crate::engine::capture::refuse_while_capturing("a read")?;
                Ok(Some(bytes))
            }
            _ => Ok(None),
        }
    }

    /// Computes the current version (if needed) and returns its buffer.
    pub(crate) fn materialize(&self) -> Result<Buffer> {
        self.materialize_with(None)
    }

    /// [`Tensor::materialize`], an upload poisoning its buffer's memory when freed as `poison`
    /// says (read from the device and the environment when `None`).
    pub(crate) fn materialize_with(&self, poison: Option<bool>) -> Result<Buffer> {
        match self.held() {
            Some((HeldValue::Ready(buffer), _)) => {
                crate::engine::capture::refuse_while_capturing("a read")?;
                return Ok(buffer);
            }
            Some((HeldValue::Host(bytes), _)) => {
                crate::engine::capture::refuse_while_capturing("a read")?;
                let engine = self.device().engine();
                let poison = poison.unwrap_or_else(|| engine.poison_enabled());
                let buffer = engine.backend.upload(&bytes, poison).map_err(|e| engine.device_error(e))?;
                self.keep_upload(&buffer);
                return Ok(buffer);
            }
            None => {}
        }
        // Not held, so the cell names a node (a value is never held again once recorded).
        self.device().engine().materialize_with(|| self.version(), poison)
    }

    /// Replaces the value with `src` (broadcast to this shape); earlier readers keep the old
    /// value.
    #[track_caller]
    pub fn assign(&self, src: &Tensor) {
        let operands = [("self", self), ("src", src)];
        same_device("assign", &operands);
        if src.dtype() != self.dtype() || !src.shape().broadcasts_to(self.shape()) {
            misuse(
                "assign",
                "the source must have this tensor's dtype and broadcast to its shape",
                &[("self", self.describe()), ("src", src.describe())],
            );
        }
        self.record_new_version("assign", Op::Expand, &[src]);
    }

    /// `self += other` as a new version (see [`Tensor::assign`]).
    #[track_caller]
    pub fn add_assign(&self, other: &Tensor) {
        self.update_with(BinaryOp::Add, other)
    }

    /// `self -= other` as a new version.
    #[track_caller]
    pub fn sub_assign(&self, other: &Tensor) {
        self.update_with(BinaryOp::Sub, other)
    }

    /// `self *= other` as a new version.
    #[track_caller]
    pub fn mul_assign(&self, other: &Tensor) {
        self.update_with(BinaryOp::Mul, other)
    }

    /// `self /= other` as a new version.
    #[track_caller]
    pub fn div_assign(&self, other: &Tensor) {
        self.update_with(BinaryOp::Div, other)
    }

    #[track_caller]
    pub(crate) fn update_with(&self, op: BinaryOp, other: &Tensor) {
        let name = format!("{}_assign", op.name());
        let operands = [("self", self), ("other", other)];
        same_device(&name, &operands);
        let r = infer::binary(op, (self.shape(), self.dtype()), (other.shape(), other.dtype()));
        let (shape, _) = inferred(&name, r, &operands);
        if &shape != self.shape() {
            misuse(
                &name,
                &format!("the update would change the shape to {shape}"),
                &[("self", self.describe()), ("other", other.describe())],
            );
        }
        self.record_new_version(&name, Op::Binary(op), &[self, other]);
    }

    #[track_caller]
    pub(crate) fn update_with_scalar(&self, op: BinaryOp, scalar: f64) {
        let name = format!("{}_assign", op.name());
        inferred(&name, infer::binary_scalar(op, self.shape(), self.dtype(), scalar), &[("self", self)]);
        self.record_new_version(&name, Op::BinaryScalar { op, scalar: Scalar(scalar), scalar_first: false }, &[self]);
    }
}
