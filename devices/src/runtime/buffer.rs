//! Device buffers as the runtime and the engine see them: a [`Buffer`] is a shared handle over
//! whatever memory a backend allocates, behind the small [`DeviceBuffer`] trait, so that a new
//! backend brings its own buffer type without editing a central list. A backend gets its own
//! type back with [`Buffer::get`] or [`Buffer::arc`] (`None` for another backend's buffer).
//!
//! This module never allocates or frees memory: the backend's buffer type does both (its
//! memory returns to its pool when the last handle is dropped).

use crate::DeviceError;
use braid_graph::MemoryKind;
use std::any::Any;
use std::sync::Arc;

/// What every backend's buffer type tells the runtime and the engine.
pub trait DeviceBuffer: Any + Send + Sync + std::fmt::Debug {
    /// Its length in bytes.
    fn bytes(&self) -> usize;
    /// Whether it is parameter memory (exact-size; see `Device::persistent_memory`).
    fn is_persistent(&self) -> bool;
    /// Whether it is the device's offload (host) memory rather than its device memory: a value
    /// an offload left there past its flush.
    fn is_offloaded(&self) -> bool;
    /// Where its memory is: whether another device's kernels can read it in place.
    fn memory_kind(&self) -> MemoryKind;
    /// Copies its bytes into `dst` (exactly `bytes()` long) once the work that writes them is
    /// done: how a device reads another device's value (a transfer's source).
    fn read_into(&self, dst: &mut [u8]) -> Result<(), DeviceError>;
}

/// A device buffer; cloning shares it, and the memory returns to its pool with the last clone.
#[derive(Clone, Debug)]
pub struct Buffer(Arc<dyn DeviceBuffer>);

impl Buffer {
    /// A handle over `buffer` (the same allocation: [`Buffer::arc`] gives it back).
    pub fn new<B: DeviceBuffer>(buffer: Arc<B>) -> Buffer {
        Buffer(buffer)
    }

    /// Whether both handles name one allocation.
    pub fn same(&self, other: &Buffer) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.0), Arc::as_ptr(&other.0))
    }

    /// An identity of the allocation while it lives (its address: a later allocation may
    /// reuse it, so this says only "probably the same" once the buffer is gone).
    pub fn address(&self) -> usize {
        Arc::as_ptr(&self.0) as *const () as usize
    }

    /// The backend's buffer, when it is one of type `B`.
    pub fn get<B: DeviceBuffer>(&self) -> Option<&B> {
        let any: &dyn Any = self.0.as_ref();
        any.downcast_ref()
    }

    /// Another handle to the backend's buffer, when it is one of type `B` (it counts as a
    /// clone of this handle: [`Buffer::is_shared`] sees it).
    pub fn arc<B: DeviceBuffer>(&self) -> Option<Arc<B>> {
        let any: Arc<dyn Any + Send + Sync> = self.0.clone();
        any.downcast().ok()
    }

    /// The backend's buffer this handle is, when it is one of type `B` (no other handle is
    /// made: with none elsewhere, `Arc::try_unwrap` takes the buffer itself).
    pub fn into_arc<B: DeviceBuffer>(self) -> Option<Arc<B>> {
        let any: Arc<dyn Any + Send + Sync> = self.0;
        any.downcast().ok()
    }

    pub fn bytes(&self) -> usize {
        self.0.bytes()
    }

    /// Whether the buffer is parameter memory (exact-size; see `Device::persistent_memory`).
    pub fn is_persistent(&self) -> bool {
        self.0.is_persistent()
    }

    /// Whether the buffer is the device's offload (host) memory rather than its device memory.
    pub fn is_offloaded(&self) -> bool {
        self.0.is_offloaded()
    }

    /// Whether another handle to this buffer exists (a download in progress holds one).
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.0) > 1
    }

    /// How many handles to this buffer exist, this one included (those [`Buffer::arc`] made
    /// count too).
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Copies the buffer's bytes into `dst` (exactly `bytes()` long), once the work that writes
    /// them is done.
    pub fn read_into(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        if dst.len() != self.bytes() {
            return Err(DeviceError::Internal(format!("a read of {} bytes into {}", self.bytes(), dst.len())));
        }
        self.0.read_into(dst)
    }

    /// Where the buffer's memory is: whether another device's kernels can read it in place.
    pub fn memory_kind(&self) -> MemoryKind {
        self.0.memory_kind()
    }
}
