//! `Tensor`: a shared handle to the current version of a recorded value.
//!
//! Every operation validates its operands first (a panic at the caller's line on misuse),
//! then records one node and returns a new handle at once; nothing computes until a read.
//! In-place operations record a new node and move the handle (and all its clones) to it.

mod attention;
mod create;
mod dims;
mod elementwise;
mod indexing;
mod movement;
mod operators;
mod print;
mod quant;
mod read;
mod reduce;

use crate::autograd::{self, GradSource, Tracker};
use crate::device::Device;
use crate::engine::capture;
use crate::recorder::{self, Retainer, Track, current_stream};
use crate::stream::Stream;
pub(crate) use attention::grads as attention_grads;
pub use dims::Dim;
pub use operators::Scalar;

use crate::engine::{Held, HeldValue};
use braid_devices::Buffer;
use braid_graph::{DType, NodeId, Op, Shape};
use std::fmt;
use std::panic::Location;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// A lazily computed n-dimensional array on a device.
///
/// Cloning is cheap and gives the same tensor (in-place updates through one clone are seen by
/// all). Methods take `&self`, so tensors move freely into closures and across threads.
#[derive(Clone)]
pub struct Tensor(Arc<TensorInner>);

// See `Device`: handles cross `catch_unwind` as they are.
impl std::panic::UnwindSafe for Tensor {}
impl std::panic::RefUnwindSafe for Tensor {}

struct TensorInner {
    /// The node of the current version, or [`HELD`] while the tensor holds its value itself.
    /// Written only under the engine lock.
    node: AtomicU32,
    /// A value no recorded op has read yet (host data from `from_vec`, a replayed step's
    /// output), held here instead of as a leaf of the graph: making it, reading it and
    /// dropping it touch neither the graph nor the engine's lock. Anything that needs a node
    /// (an op reading it, an in-place update, `detach`, marks) records it as a leaf first, at
    /// the place in the recording order it was made at ([`Tensor::cell`]); it is never held
    /// again after that. Moved into the graph under the engine lock (the lock order is engine,
    /// then this; whoever takes this lock alone takes no other while holding it).
    held: Mutex<Option<Held>>,
    shape: Shape,
    dtype: DType,
    device: Device,
    /// Gradient bookkeeping of the current version; read and written only under the engine
    /// lock, like `node` (see `crate::autograd`).
    grad: Mutex<Option<GradSource>>,
    /// A value autograd keeps for a derivative (its handle counts in the node's `saved`).
    saved: bool,
    /// For a quantized weight (`braid::quant`): its layout. Then `shape` and `dtype` are the
    /// weight's (`[k, n]`, the dtype it was quantized from) while the value (node or held) is
    /// the layout's `U8` bytes; only a quantized product reads it (`Tensor::record` refuses
    /// every other op).
    quant: Option<braid_graph::QuantLayout>,
}

/// The version cell of a tensor that holds its value and has no node yet.
const HELD: u32 = u32::MAX;

impl Drop for TensorInner {
    fn drop(&mut self) {
        // A held value's buffer goes back to its pool with the tensor.
        let node = *self.node.get_mut();
        if node != HELD && self.saved {
            self.device.engine().release_saved(NodeId::new(node as usize));
        } else if node != HELD {
            self.device.engine().release(NodeId::new(node as usize));
        }
        // The bookkeeping goes with the tensor (autograd counts the tensors that have some).
        autograd::replace_meta(self.grad.get_mut().unwrap_or_else(|p| p.into_inner()), None);
    }
}

impl Tensor {
    /// Wraps a freshly recorded node (whose handle is already counted).
    pub(crate) fn from_node(node: NodeId, shape: Shape, dtype: DType, device: Device) -> Tensor {
        Tensor::over_node(node, shape, dtype, device, false)
    }

    /// [`Tensor::from_node`] for a value autograd keeps for a derivative; `saved`: its handle
    /// counts in the node's saved ones (what `Retainer::retain_saved` returned).
    pub(crate) fn saved_from_node(node: NodeId, shape: Shape, dtype: DType, device: Device, saved: bool) -> Tensor {
        Tensor::over_node(node, shape, dtype, device, saved)
    }

    fn over_node(node: NodeId, shape: Shape, dtype: DType, device: Device, saved: bool) -> Tensor {
        Tensor(Arc::new(TensorInner {
            node: AtomicU32::new(node.index() as u32),
            held: Mutex::new(None),
            shape,
            dtype,
            device,
            grad: Mutex::new(None),
            saved,
            quant: None,
        }))
    }

    /// A tensor holding `held` (host data or a computed buffer) without a node until
    /// something needs one.
    pub(crate) fn from_held(held: Held, shape: Shape, dtype: DType, device: Device) -> Tensor {
        Tensor(Arc::new(TensorInner {
            node: AtomicU32::new(HELD),
            held: Mutex::new(Some(held)),
            shape,
            dtype,
            device,
            grad: Mutex::new(None),
            saved: false,
            quant: None,
        }))
    }

    /// What the tensor holds itself (and the stream that made it), when it has no node.
    pub(crate) fn held(&self) -> Option<(HeldValue, braid_graph::StreamId)> {
        if self.0.node.load(Ordering::Acquire) != HELD {
            return None;
        }
        crate::lock(&self.0.held).as_ref().map(|h| (h.value.clone(), h.stream))
    }

    /// Keeps `buffer`, the upload of the host data this tensor holds, unless it no longer holds
    /// that data (recorded meanwhile: the graph's leaf uploads it on its own).
    pub(crate) fn keep_upload(&self, buffer: &Buffer) {
        if let Some(h) = crate::lock(&self.0.held).as_mut()
            && matches!(h.value, HeldValue::Host(_))
        {
            h.value = HeldValue::Ready(buffer.clone());
        }
    }

    pub(crate) fn grad_meta(&self) -> &Mutex<Option<GradSource>> {
        &self.0.grad
    }

    /// The cell naming the current version (read under the engine lock when recording),
    /// recording a held value as a leaf first. Never called under the engine's lock.
    pub(crate) fn cell(&self) -> &AtomicU32 {
        if self.0.node.load(Ordering::Acquire) == HELD {
            self.attach();
        }
        &self.0.node
    }

    /// The node of the current version (a held value is recorded as a leaf first). Never
    /// called under the engine's lock.
    pub(crate) fn node(&self) -> NodeId {
        NodeId::new(self.cell().load(Ordering::Relaxed) as usize)
    }

    /// The node of the current version as the cell names it, recording nothing: for closures
    /// run under the engine's lock, once the tensor is known to hold no value itself.
    pub(crate) fn version(&self) -> NodeId {
        NodeId::new(self.0.node.load(Ordering::Relaxed) as usize)
    }

    /// Records the held value (if it is still held) as a leaf and points the cell at it.
    fn attach(&self) {
        let inner = &*self.0;
        let (dtype, shape) = self.value_meta();
        inner.device.engine().attach_held(&inner.node, &inner.held, dtype, &shape);
    }

    /// The dtype and shape of the value itself: the tensor's, or a quantized weight's bytes.
    pub(crate) fn value_meta(&self) -> (DType, Shape) {
        match &self.0.quant {
            Some(layout) => (DType::U8, Shape::from([layout.bytes()])),
            None => (self.0.dtype, self.0.shape.clone()),
        }
    }

    /// The layout of a quantized weight (`None` for every other tensor).
    pub fn quant_layout(&self) -> Option<braid_graph::QuantLayout> {
        self.0.quant
    }

    /// Who this tensor's value is, for telling arguments that are the same value apart
    /// without recording anything: its node, or for a held value the handle itself (held
    /// values are never shared between handles that are not clones).
    pub(crate) fn identity(&self) -> u64 {
        match self.0.node.load(Ordering::Acquire) {
            HELD => (1 << 63) | Arc::as_ptr(&self.0) as u64,
            node => node as u64,
        }
    }

    /// Records `op` over `inputs` (validated by the caller) and returns its tensor. A result
    /// too large to address is misuse, reported here.
    #[track_caller]
    pub(crate) fn record(op: Op, dtype: DType, shape: Shape, device: &Device, inputs: &[&Tensor]) -> Tensor {
        if !matches!(op, Op::QuantMatmul(_)) && inputs.iter().any(|t| t.0.quant.is_some()) {
            quant::refuse(op.name(), inputs);
        }
        let addressable = shape
            .dims()
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .is_some_and(|b| b <= isize::MAX as usize);
        if !addressable || !device.engine().dtypes.contains(dtype) {
            let names: Vec<String> = (0..inputs.len()).map(|i| format!("inputs[{i}]")).collect();
            let operands: Vec<(&str, String)> =
                names.iter().map(String::as_str).zip(inputs.iter().map(|t| t.describe())).collect();
            if !addressable {
                let problem = format!("a result of shape {shape} and dtype {dtype} is too large to address");
                misuse(op.name(), &problem, &operands);
            }
            if let Err(problem) = device.target().check_dtype(dtype) {
                misuse(op.name(), &format!("{problem}: {device} cannot hold this result"), &operands);
            }
        }
        let stream = current_stream(device.id());
        let mut tracker = Tracker::new(&op, inputs, None, (&shape, dtype, device, stream));
        let mut track =
            tracker.as_mut().map(|t| move |r: &mut Retainer<'_>, ids: &[NodeId], out: NodeId| t.run(r, ids, out));
        let track = track.as_mut().map(|c| c as Track<'_>);
        let id = match (&op, inputs) {
            // Another device's value arrives through a remote leaf of this device's graph.
            (Op::ToDevice, [src]) if src.device() != device => recorder::record_transfer(
                device.engine(),
                src.device().engine(),
                src.cell(),
                dtype,
                shape.clone(),
                track,
            ),
            _ => {
                let cells: smallvec::SmallVec<[&AtomicU32; 3]> = crate::small(inputs.iter().map(|t| t.cell()));
                recorder::record(device.engine(), stream, op, dtype, shape.clone(), &cells, None, track)
            }
        };
        let t = Tensor::from_node(id, shape, dtype, device.clone());
        if let Some(tracker) = tracker {
            let mut meta = t.0.grad.lock().unwrap_or_else(|p| p.into_inner());
            autograd::replace_meta(&mut meta, tracker.into_result());
        }
        t
    }

    /// Makes `self` (and every clone) name a new version computed by `op` over `inputs`;
    /// readers recorded earlier keep the old one.
    #[track_caller]
    pub(crate) fn record_new_version(&self, name: &str, op: Op, inputs: &[&Tensor]) {
        if self.0.quant.is_some() || inputs.iter().any(|t| t.0.quant.is_some()) {
            quant::refuse(name, &[&[self], inputs].concat());
        }
        if let Err(problem) = autograd::check_in_place(self) {
            misuse(name, problem, &[("self", self.describe())]);
        }
        // A step's argument may be updated: a replay updates it again (see `Step`).
        if capture::from_outside(self.0.device.engine(), self.cell()) && !capture::is_argument(self.cell()) {
            // Not recorded: a failed capture leaves the tensor as it was.
            capture::refuse(|| {
                format!(
                    "an in-place update ({name}) of a tensor from outside the step that is not one of its \
                     arguments: a replay would not update it; pass it as an argument, or return the new \
                     value as an output and assign it outside the step"
                )
            });
            return;
        }
        let cells: smallvec::SmallVec<[&AtomicU32; 3]> = crate::small(inputs.iter().map(|t| t.cell()));
        let device = &self.0.device;
        let stream = current_stream(device.id());
        let (shape, dtype) = (&self.0.shape, self.0.dtype);
        let mut tracker = Tracker::new(&op, inputs, Some(self), (shape, dtype, device, stream));
        let mut track =
            tracker.as_mut().map(|t| move |r: &mut Retainer<'_>, ids: &[NodeId], out: NodeId| t.run(r, ids, out));
        let track = track.as_mut().map(|c| c as Track<'_>);
        recorder::record(device.engine(), stream, op, dtype, shape.clone(), &cells, Some(self.cell()), track);
    }

    /// Marks this tensor as a leaf whose gradient `backward` computes, and returns it (the
    /// same tensor: clones share the mark). Only floating-point tensors without recorded
    /// history can be marked.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let cpu = Device::cpu();
    /// let w = Tensor::from_vec(vec![1.0f64, -2.0, 3.0], [3], &cpu).requires_grad();
    /// let loss = (&w * &w).sum();
    /// let grads = loss.backward().unwrap();
    /// assert_eq!(grads.get(&w).unwrap().to_vec::<f64>().unwrap(), vec![2.0, -4.0, 6.0]);
    /// ```
    #[track_caller]
    pub fn requires_grad(&self) -> Tensor {
        if let Err(problem) = autograd::mark_leaf(self) {
            misuse("requires_grad", problem, &[("x", self.describe())]);
        }
        self.0.device.engine().mark_persistent(self.cell());
        self.clone()
    }

    /// Whether gradients flow back through this tensor's current version (a marked leaf or
    /// the result of ops on one, recorded with gradients enabled).
    pub fn needs_grad(&self) -> bool {
        autograd::source_of(self).is_some()
    }

    /// Forgets the gradient history of the op that made this tensor's current version (a
    /// step's argument it updated in place: a replay records no history), keeping a leaf's
    /// `requires_grad` mark. What the history kept for derivatives is released here, after
    /// the lock is let go.
    pub(crate) fn drop_history(&self) {
        let old = {
            let mut meta = self.0.grad.lock().unwrap_or_else(|p| p.into_inner());
            match *meta {
                Some(GradSource::Node(_)) => autograd::replace_meta(&mut meta, None),
                _ => None,
            }
        };
        drop(old);
    }

    /// Asks the scheduler to move this value (its current version) to host memory while it is
    /// idle within a flush, and to bring it back in time for its next use, with or without a
    /// memory budget. Typical for activations saved for the backward pass. Returns the tensor.
    pub fn offload_hint(&self) -> Tensor {
        self.0.device.engine().hint_offload(self.cell());
        self.clone()
    }

    /// A new tensor naming the current value without gradient history (later in-place
    /// updates of either do not reach the other).
    pub fn detach(&self) -> Tensor {
        // A held value is recorded first, and the copy names its node as for any tensor.
        let id = self.0.device.engine().retain_current(self.cell());
        Tensor::from_node(id, self.0.shape.clone(), self.0.dtype, self.0.device.clone())
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
        let stream = match self.held() {
            Some((_, stream)) => stream,
            None => self.0.device.engine().stream_of(self.cell()),
        };
        Stream::new(self.0.device.clone(), stream)
    }

    /// The dimension `d` names (negative counts from the end); misuse of `op` when out of range.
    #[track_caller]
    pub(crate) fn dim(&self, op: &str, d: impl Dim) -> usize {
        self.resolve_dim(op, d, false)
    }

    /// Like [`Tensor::dim`], also accepting one past the last dimension (where `unsqueeze` adds
    /// one; `-1` means there).
    #[track_caller]
    pub(crate) fn dim_or_end(&self, op: &str, d: impl Dim) -> usize {
        self.resolve_dim(op, d, true)
    }

    #[track_caller]
    fn resolve_dim(&self, op: &str, d: impl Dim, extra: bool) -> usize {
        match d.resolve(self.rank(), extra) {
            Some(d) => d,
            None => {
                let problem = format!("dimension {} is out of range for a tensor of rank {}", d.written(), self.rank());
                misuse(op, &problem, &[("x", self.describe())])
            }
        }
    }

    /// `[2, 3] f32 on cpu`, as misuse messages print an operand.
    pub(crate) fn describe(&self) -> String {
        match &self.0.quant {
            Some(l) => format!("{} {} quantized {} on {}", self.0.shape, self.0.dtype, l.scheme, self.0.device),
            None => format!("{} {} on {}", self.0.shape, self.0.dtype, self.0.device),
        }
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
    // An op of no operands (a creation) has no operand line.
    let list: Vec<String> = operands.iter().map(|(name, d)| format!("{name}: {d}")).collect();
    let operands = if list.is_empty() { String::new() } else { format!("\n  operands: {}", list.join(", ")) };
    panic!("braid: invalid {op} at {}:{}:{}: {problem}{operands}", at.file(), at.line(), at.column());
}

/// Misuse unless `device` computes with `dtype` (a GPU may lack f64, say).
#[track_caller]
pub(crate) fn supported(op: &str, dtype: DType, device: &Device) {
    if let Err(problem) = device.target().check_dtype(dtype) {
        misuse(op, &format!("{problem}: {device} cannot hold this result"), &[]);
    }
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
