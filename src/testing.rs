//! Test-only hooks (hidden from the docs): they let tests corrupt what the planner produced and
//! watch the engine refuse to run it, inject failures, run devices over test backends, and
//! export what was recorded for the reference interpreter. Nothing in braid imports this
//! module; the engine only offers the fault-injection slots it fills.

use crate::device::Device;
use crate::lock;
use braid_scheduler::Schedule;
use std::sync::Arc;

/// A function applied to every schedule planned for a device, before validation.
pub type ScheduleHook = Arc<dyn Fn(&mut Schedule) + Send + Sync>;

/// Installs (or with `None` removes) a hook that rewrites every schedule planned for `device`.
pub fn set_schedule_hook(device: &Device, hook: Option<ScheduleHook>) {
    lock(&device.engine().faults).rewrite = hook;
}

/// Makes the next flush that executes on `device` fail when it reaches kernel `kernel`, as a
/// failing kernel would. The injection is used up by that flush whether or not it has that
/// many kernels.
pub fn fail_next_flush_at(device: &Device, kernel: u32) {
    lock(&device.engine().faults).fail_at = Some(kernel);
}

/// A new device of the kind `BRAID_DEVICE` names (the CPU when unset): the device a suite
/// runs on, so that the same suites check every backend. Panics, naming the reason, when that
/// device is unavailable (the variable asked for it).
pub fn test_device() -> Device {
    Device::new_from_env().unwrap_or_else(|e| panic!("BRAID_DEVICE asks for a device that is unavailable: {e}"))
}

/// A device running on `backend` (a test backend wrapping another for one test: a fault
/// injector). A backend meant to be opened by name registers through
/// [`crate::backends::register`] instead, as the built-in ones do.
pub fn device_with_backend(backend: Arc<dyn braid_devices::Backend>) -> Device {
    Device::with_backend(backend)
}

/// How many nodes `device`'s graph holds (pending work, held values, events still waited on):
/// what a leak test watches.
pub fn graph_nodes(device: &Device) -> usize {
    device.engine().with_state(|st| st.graph.node_ids().count())
}

/// The identity of the buffer that holds `t`'s value (computed first): what an in-place test
/// watches (the same identity after an update means it was written where it lies).
pub fn buffer_identity(t: &crate::Tensor) -> crate::Result<usize> {
    t.materialize().map(|b| b.address())
}

/// Runs `f` while `device`'s engine lock is held by this thread: work on other devices must go
/// on meanwhile (their engines share no lock with this one).
pub fn hold_engine_lock<R>(device: &Device, f: impl FnOnce() -> R) -> R {
    device.engine().with_state(|_| f())
}

/// One node of a recorded program, in the form the reference interpreter takes.
#[derive(Clone, Debug)]
pub enum RecordedNode {
    /// A value that exists already (host data, or a value an earlier flush computed): its
    /// bytes in the dtype's layout.
    Data { dtype: braid_graph::DType, shape: braid_graph::Shape, bytes: Vec<u8> },
    /// A pending op over earlier nodes of the program.
    Op { op: braid_graph::Op, dtype: braid_graph::DType, shape: braid_graph::Shape, inputs: Vec<usize> },
}

/// The recorded (not yet computed) work behind `targets`, in dependency order, with the index
/// of each target. Lets tests evaluate exactly what braid recorded (a backward pass included)
/// with the reference interpreter. Values already computed come back as data.
pub fn recorded_program(targets: &[&crate::Tensor]) -> crate::Result<(Vec<RecordedNode>, Vec<usize>)> {
    use crate::engine::Value;
    use braid_graph::NodeId;
    use hashbrown::HashMap;
    let Some(device) = targets.first().map(|t| t.device().clone()) else { return Ok((Vec::new(), Vec::new())) };
    if targets.iter().any(|t| *t.device() != device) {
        return Err(crate::Error::Internal("recorded_program: the targets are on different devices".into()));
    }
    // Recorded before the lock is taken (a held value becomes a leaf under it).
    let target_nodes: Vec<NodeId> = targets.iter().map(|t| t.node()).collect();
    let engine = device.engine();
    let st = engine.state();
    let mut index: HashMap<NodeId, usize> = HashMap::new();
    let mut program = Vec::new();
    let mut downloads = Vec::new();
    let mut roots = Vec::new();
    for &target in &target_nodes {
        let mut stack = vec![(target, false)];
        while let Some((id, expanded)) = stack.pop() {
            if index.contains_key(&id) {
                continue;
            }
            let node = st.graph.node(id);
            let inputs = st.graph.inputs(id);
            if node.value.is_none() && !expanded {
                stack.push((id, true));
                stack.extend(inputs.iter().map(|&i| (i, false)));
                continue;
            }
            let entry = match &node.value {
                None => RecordedNode::Op {
                    op: node.op.clone(),
                    dtype: node.dtype,
                    shape: node.shape.clone(),
                    inputs: inputs.iter().map(|i| index[i]).collect(),
                },
                Some(Value::Host(bytes)) => {
                    RecordedNode::Data { dtype: node.dtype, shape: node.shape.clone(), bytes: bytes.to_vec() }
                }
                Some(Value::Ready(buffer)) => {
                    downloads.push((program.len(), buffer.clone()));
                    RecordedNode::Data { dtype: node.dtype, shape: node.shape.clone(), bytes: Vec::new() }
                }
                Some(Value::Remote(_)) => {
                    return Err(crate::Error::Internal("recorded_program: the program reads another device".into()));
                }
                Some(Value::InFlight(_) | Value::Done | Value::Lent | Value::Lost(_)) => {
                    return Err(crate::Error::Internal("recorded_program: a value is being computed".into()));
                }
            };
            index.insert(id, program.len());
            program.push(entry);
        }
        roots.push(index[&target]);
    }
    drop(st);
    for (i, buffer) in downloads {
        let bytes = engine.backend.download(&buffer).map_err(|e| engine.device_error(e))?;
        if let RecordedNode::Data { bytes: b, .. } = &mut program[i] {
            *b = bytes;
        }
    }
    Ok((program, roots))
}

/// The runtime under `device` as its own type `B`, when it is one (the CPU's compile and graph
/// statistics, the CUDA backend's kernel timelines, a test backend's log).
pub fn backend<B: braid_devices::Backend + 'static>(device: &Device) -> Option<&B> {
    device.engine().backend.as_any().downcast_ref()
}
