//! `Tensor`: a shared handle to the current version of a recorded value.
//!
//! Every operation validates its operands first (a panic at the caller's line on misuse),
//! then records one node and returns a new handle at once; nothing computes until a read.
//! In-place operations record a new node and move the handle (and all its clones) to it.

mod create;
mod elementwise;
mod movement;
mod operators;
mod read;
mod reduce;

use crate::device::Device;
use crate::engine;
use crate::stream::{Stream, current_stream};
use braid_graph::{DType, NodeId, Op, Shape};
use std::fmt;
use std::panic::Location;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// A lazily computed n-dimensional array on a device.
///
/// Cloning is cheap and gives the same tensor (in-place updates through one clone are seen by
/// all). Methods take `&self`, so tensors move freely into closures and across threads.
#[derive(Clone)]
pub struct Tensor(Arc<TensorInner>);

struct TensorInner {
    /// The node of the current version. Written only under the engine lock.
    node: AtomicU32,
    shape: Shape,
    dtype: DType,
    device: Device,
}

impl Drop for TensorInner {
    fn drop(&mut self) {
        engine::release(NodeId::new(self.node.load(Ordering::Relaxed) as usize));
    }
}

impl Tensor {
    /// Wraps a freshly recorded node (whose handle is already counted).
    pub(crate) fn from_node(node: NodeId, shape: Shape, dtype: DType, device: Device) -> Tensor {
        Tensor(Arc::new(TensorInner { node: AtomicU32::new(node.index() as u32), shape, dtype, device }))
    }

    /// The node of the current version.
    pub(crate) fn node(&self) -> NodeId {
        NodeId::new(self.0.node.load(Ordering::Relaxed) as usize)
    }

    /// Records `op` over `inputs` (validated by the caller) and returns its tensor. A result
    /// too large to address is misuse, reported here.
    #[track_caller]
    pub(crate) fn record(op: Op, dtype: DType, shape: Shape, device: &Device, inputs: &[&Tensor]) -> Tensor {
        let addressable = shape
            .dims()
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .is_some_and(|b| b <= isize::MAX as usize);
        if !addressable {
            misuse(op.name(), &format!("a result of shape {shape} and dtype {dtype} is too large to address"), &[]);
        }
        let cells: smallvec::SmallVec<[&AtomicU32; 3]> = inputs.iter().map(|t| &t.0.node).collect();
        let id = engine::record(op, dtype, shape.clone(), device, current_stream(device.0.id), &cells, None);
        Tensor::from_node(id, shape, dtype, device.clone())
    }

    /// Makes `self` (and every clone) name a new version computed by `op` over `inputs`;
    /// readers recorded earlier keep the old one.
    pub(crate) fn record_new_version(&self, op: Op, inputs: &[&Tensor]) {
        let cells: smallvec::SmallVec<[&AtomicU32; 3]> = inputs.iter().map(|t| &t.0.node).collect();
        let device = &self.0.device;
        let stream = current_stream(device.0.id);
        engine::record(op, self.0.dtype, self.0.shape.clone(), device, stream, &cells, Some(&self.0.node));
    }

    pub fn shape(&self) -> &Shape {
        &self.0.shape
    }

    /// Shorthand for `shape().dims()`.
    pub fn dims(&self) -> &[usize] {
        self.0.shape.dims()
    }

    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    pub fn device(&self) -> &Device {
        &self.0.device
    }

    pub fn rank(&self) -> usize {
        self.0.shape.rank()
    }

    pub fn numel(&self) -> usize {
        self.0.shape.numel()
    }

    /// The stream that produces the current version.
    pub fn stream(&self) -> Stream {
        Stream::new(self.0.device.clone(), engine::stream_of(&self.0.node))
    }

    /// `[2, 3] f32 on cpu`, as misuse messages print an operand.
    fn describe(&self) -> String {
        format!("{} {} on {}", self.0.shape, self.0.dtype, self.0.device)
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({})", self.describe())
    }
}

/// Panics with braid's misuse message: the operation, what is wrong, every operand, and the
/// caller's location.
#[track_caller]
pub(crate) fn misuse(op: &str, problem: &str, operands: &[(&str, String)]) -> ! {
    let at = Location::caller();
    // Inference messages start with the op's name, which the prefix already gives.
    let problem = problem.strip_prefix(op).and_then(|p| p.strip_prefix(": ")).unwrap_or(problem);
    let operands: Vec<String> = operands.iter().map(|(name, d)| format!("{name}: {d}")).collect();
    panic!(
        "braid: invalid {op} at {}:{}:{}: {problem}\n  operands: {}",
        at.file(),
        at.line(),
        at.column(),
        operands.join(", ")
    );
}

/// Checks that every tensor is on `first`'s device.
#[track_caller]
pub(crate) fn same_device(op: &str, tensors: &[(&str, &Tensor)]) {
    let first = tensors[0].1.device();
    if tensors.iter().any(|(_, t)| t.device() != first) {
        let operands: Vec<(&str, String)> = tensors.iter().map(|(n, t)| (*n, t.describe())).collect();
        misuse(op, "operands are on different devices; move one with to_device", &operands);
    }
}

/// Unwraps an inference result, panicking with the operands on error.
#[track_caller]
pub(crate) fn inferred<T>(op: &str, r: Result<T, String>, operands: &[(&str, &Tensor)]) -> T {
    match r {
        Ok(v) => v,
        Err(problem) => {
            let operands: Vec<(&str, String)> = operands.iter().map(|(n, t)| (*n, t.describe())).collect();
            misuse(op, &problem, &operands)
        }
    }
}
