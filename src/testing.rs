//! Test-only hooks (hidden from the docs): they let tests corrupt what the planner produced and
//! watch the engine refuse to run it. Never used by the engine itself.

use crate::device::{Device, lock};
use braid_scheduler::Schedule;
use std::sync::Arc;

/// A function applied to every schedule planned for a device, before validation.
pub type ScheduleHook = Arc<dyn Fn(&mut Schedule) + Send + Sync>;

/// Installs (or with `None` removes) a hook that rewrites every schedule planned for `device`.
pub fn set_schedule_hook(device: &Device, hook: Option<ScheduleHook>) {
    *lock(&device.0.schedule_hook) = hook;
}

/// Makes the next flush that executes on `device` fail when it reaches kernel `kernel`, as a
/// failing kernel would. The injection is used up by that flush whether or not it has that
/// many kernels.
pub fn fail_next_flush_at(device: &Device, kernel: u32) {
    *lock(&device.0.fail_at) = Some(kernel);
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
    use crate::engine::{Value, state};
    use braid_graph::NodeId;
    use hashbrown::HashMap;
    let st = state();
    let mut index: HashMap<NodeId, usize> = HashMap::new();
    let mut program = Vec::new();
    let mut downloads = Vec::new();
    let mut roots = Vec::new();
    for t in targets {
        let mut stack = vec![(t.node(), false)];
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
                    downloads.push((program.len(), buffer.clone(), node.device));
                    RecordedNode::Data { dtype: node.dtype, shape: node.shape.clone(), bytes: Vec::new() }
                }
                Some(Value::InFlight(_) | Value::Done | Value::Lent | Value::Lost(_)) => {
                    return Err(crate::Error::Internal("recorded_program: a value is being computed".into()));
                }
            };
            index.insert(id, program.len());
            program.push(entry);
        }
        roots.push(index[&t.node()]);
    }
    drop(st);
    for (i, buffer, device) in downloads {
        let device = Device::by_id(device);
        let bytes = device.0.backend.download(&buffer).map_err(|e| crate::engine::device_error(&device, e))?;
        if let RecordedNode::Data { bytes: b, .. } = &mut program[i] {
            *b = bytes;
        }
    }
    Ok((program, roots))
}

/// The vector instruction levels CPU kernels are compiled for.
pub use braid_devices::cpu::eval::Simd as CpuSimd;

/// Runs later CPU kernels at most at `level` (never above what the CPU has), in the whole
/// process; returns the level now in effect. Lets a test check that every level computes the
/// same bits.
pub fn limit_cpu_simd(level: CpuSimd) -> CpuSimd {
    braid_devices::cpu::eval::limit_simd(level)
}
