//! Captured steps ([`crate::Step`]): a function of tensors recorded and planned once, then
//! replayed with new arguments without recording, walking or planning anything again.
//!
//! A capture runs the function on the arguments as usual and flushes what its outputs need in
//! one flush. It keeps that flush's graph and plan, where each input of the flush comes from
//! (an argument, or host data the function created), and where each output comes from. A replay
//! binds the arguments' buffers to those inputs, runs the plan, and wraps the outputs as new
//! computed tensors.
//!
//! This module must never keep a plan whose replay could differ from running the function
//! again. A capture fails with [`Error::Capture`] (and nothing is kept) when the function reads
//! a value while it is recorded, needs a tensor that is not an argument, keeps a tensor it does
//! not return, or records an event.

use super::flush::{self, ExternalData, Planned};
use super::{State, Value, device_error, materialize, state};
use crate::device::{Device, lock};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use braid_devices::{Buffer, Input, Job};
use braid_graph::{DType, Node, NodeId, Op, Shape};
use braid_scheduler::KernelId;
use std::cell::Cell;
use std::sync::Arc;

thread_local! {
    /// How many captures are running on this thread (reads and flushes are refused inside).
    static CAPTURING: Cell<u32> = const { Cell::new(0) };
    /// The first thing refused inside the running capture: the capture fails with it even if
    /// the function ignored the `Err`.
    static REFUSED: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Whether this thread is inside a capture.
pub(crate) fn capturing() -> bool {
    CAPTURING.with(|c| c.get() > 0)
}

/// `Err` inside a capture: `what` (a read, a sync, a flush) would make the step depend on a
/// value of this one run.
pub(crate) fn refuse_while_capturing(what: &str) -> Result<()> {
    if capturing() {
        let message = format!(
            "{what} inside a step while it is captured: a replay would not do it again, so the step's \
             work must not depend on it (read values outside the step, or pass them as arguments)"
        );
        REFUSED.with(|r| r.borrow_mut().get_or_insert_with(|| message.clone()).clone());
        return Err(Error::Capture(message));
    }
    Ok(())
}

/// Where an input of the captured flush comes from at a replay.
enum Source {
    Arg(usize),
    /// Host data the function created (`from_vec` inside it): uploaded again at each replay.
    Host(Arc<[u8]>),
}

/// Where an output comes from at a replay.
enum Output {
    /// `schedule.outputs[pos]`.
    Computed { pos: usize, dtype: DType, shape: Shape },
    /// An argument returned as it is.
    Arg(usize),
    /// Host data the function created and returned as it is.
    Host { bytes: Arc<[u8]>, dtype: DType, shape: Shape },
}

/// One captured signature of a step.
pub(crate) struct Capture {
    device: Device,
    /// `None` when no output needs work (every output is an argument or host data).
    planned: Option<Planned>,
    sources: Vec<Source>,
    outputs: Vec<Output>,
}

impl Capture {
    /// Kernels one replay runs.
    pub(crate) fn kernel_count(&self) -> usize {
        self.planned.as_ref().map_or(0, |p| p.schedule.kernels.len())
    }
}

/// Runs `f` (the step's function applied to `args`) and captures it; returns the capture and
/// this first run's outputs (computed, without gradient history).
pub(crate) fn capture(
    device: &Device,
    args: &[Tensor],
    f: impl FnOnce() -> Vec<Tensor>,
) -> Result<(Capture, Vec<Tensor>)> {
    refuse_while_capturing("capturing another step")?;
    // Arguments are computed first, so that the step's flush starts from their values.
    for a in args {
        materialize(|| a.node())?;
    }
    let arg_nodes: Vec<NodeId> = args.iter().map(Tensor::node).collect();
    let start = state().seq;
    let outs = {
        struct Restore;
        impl Drop for Restore {
            fn drop(&mut self) {
                CAPTURING.with(|c| c.set(c.get() - 1));
            }
        }
        CAPTURING.with(|c| c.set(c.get() + 1));
        REFUSED.with(|r| r.borrow_mut().take());
        let _restore = Restore;
        f()
    };
    if let Some(refused) = REFUSED.with(|r| r.borrow_mut().take()) {
        return Err(Error::Capture(refused));
    }
    if let Some(t) = outs.iter().find(|t| t.device() != device) {
        return Err(Error::Capture(format!("an output is on {}, the arguments on {device}", t.device())));
    }
    // Outputs carry no gradient history (a replay records none): dropping the originals
    // releases what autograd kept for a backward pass the function did not run.
    let detached: Vec<Tensor> = outs.iter().map(Tensor::detach).collect();
    drop(outs);
    let out_ids: Vec<NodeId> = detached.iter().map(Tensor::node).collect();
    loop {
        let mut st = state();
        let (order, waits, lost) = flush::walk(&mut st, &out_ids);
        if let Some((_, reason)) = lost.into_iter().next() {
            return Err(Error::ValueLost(reason));
        }
        if !waits.is_empty() {
            drop(st);
            for t in waits {
                let _ = t.wait();
            }
            continue;
        }
        check_leaks(&st, start, &out_ids, device)?;
        check_work(&st, &order, start, &arg_nodes, device)?;
        let outputs = classify_outputs(&st, &out_ids, start, &arg_nodes)?;
        if order.is_empty() {
            drop(st);
            let outputs = outputs.into_iter().map(|o| o.expect("no work, so nothing is computed")).collect();
            return Ok((Capture { device: device.clone(), planned: None, sources: Vec::new(), outputs }, detached));
        }
        let mut ex = flush::extract(&mut st, &order);
        drop(st);
        // Inputs stay with the step: nothing of them is handed to the flush to free.
        let mut sources = Vec::with_capacity(ex.graph.externals.len());
        for (meta, data) in ex.graph.externals.iter_mut().zip(&ex.externals) {
            meta.donated = false;
            meta.on_host = false;
            meta.overwritable = false;
            sources.push(match (arg_nodes.iter().position(|&a| a == meta.id), data) {
                (Some(k), _) => Source::Arg(k),
                (None, ExternalData::Host(bytes)) => Source::Host(bytes.clone()),
                (None, _) => unreachable!("check_work admits only arguments and host data"),
            });
        }
        let planned = flush::run(ex)?;
        let outputs = outputs
            .into_iter()
            .zip(&out_ids)
            .map(|(o, &id)| match o {
                Some(o) => Ok(o),
                None => {
                    let i = planned.graph.nodes.iter().position(|n| n.id == id);
                    let pos = i.and_then(|i| planned.schedule.outputs.iter().position(|&(n, _)| n == i));
                    let node = i.map(|i| &planned.graph.nodes[i]);
                    match (pos, node) {
                        (Some(pos), Some(n)) => Ok(Output::Computed { pos, dtype: n.dtype, shape: n.shape.clone() }),
                        _ => Err(Error::Internal("a captured output is not among the flush's outputs".into())),
                    }
                }
            })
            .collect::<Result<Vec<Output>>>()?;
        let capture = Capture { device: device.clone(), planned: Some(planned), sources, outputs };
        return Ok((capture, detached));
    }
}

/// A tensor the function recorded and kept without returning it (stored outside, or an
/// in-place update of an argument or another tensor) would not be updated by a replay.
fn check_leaks(st: &State, start: u64, out_ids: &[NodeId], device: &Device) -> Result<()> {
    for id in st.graph.node_ids() {
        let n = st.graph.node(id);
        if n.seq >= start && n.device == device.0.id && n.value.is_none() && n.handles > 0 && !out_ids.contains(&id) {
            return Err(Error::Capture(format!(
                "the step keeps a tensor it does not return ({} {} {}: stored outside the function, or an \
                 in-place update); a replay would not update it, so return it as an output",
                n.op.name(),
                n.shape,
                n.dtype
            )));
        }
    }
    Ok(())
}

/// The work of the step's flush must all be recorded by the function, on `device`, without
/// events, and read only the arguments and host data the function created.
fn check_work(st: &State, order: &[NodeId], start: u64, arg_nodes: &[NodeId], device: &Device) -> Result<()> {
    let describe = |n: &Node<Value>| format!("{} {} {}", n.op.name(), n.shape, n.dtype);
    for &id in order {
        let n = st.graph.node(id);
        if n.seq < start {
            return Err(Error::Capture(format!(
                "the step needs pending work recorded before it ({}); pass that tensor as an argument",
                describe(n)
            )));
        }
        if n.device != device.0.id {
            return Err(Error::Capture(format!("the step records work on another device ({})", describe(n))));
        }
        if n.op == Op::Event {
            return Err(Error::Capture("a step cannot record user events".into()));
        }
        for p in st.graph.in_edges(id).0 {
            let pn = st.graph.node(p);
            let created_host = pn.seq >= start && matches!(pn.value, Some(Value::Host(_)));
            if pn.value.is_some() && !arg_nodes.contains(&p) && !created_host {
                return Err(Error::Capture(format!(
                    "the step reads a tensor that is not one of its arguments ({}); a replay would reuse \
                     its value from the capture, so pass it as an argument",
                    describe(pn)
                )));
            }
        }
    }
    Ok(())
}

/// Outputs that need no work: arguments and host data; `None` for computed ones.
fn classify_outputs(st: &State, out_ids: &[NodeId], start: u64, arg_nodes: &[NodeId]) -> Result<Vec<Option<Output>>> {
    out_ids
        .iter()
        .map(|&id| {
            let n = st.graph.node(id);
            match &n.value {
                None => Ok(None),
                _ if arg_nodes.contains(&id) => {
                    Ok(Some(Output::Arg(arg_nodes.iter().position(|&a| a == id).expect("checked"))))
                }
                Some(Value::Host(bytes)) if n.seq >= start => {
                    Ok(Some(Output::Host { bytes: bytes.clone(), dtype: n.dtype, shape: n.shape.clone() }))
                }
                _ => Err(Error::Capture(format!(
                    "the step returns a value computed outside it ({} {} {}); pass it as an argument",
                    n.op.name(),
                    n.shape,
                    n.dtype
                ))),
            }
        })
        .collect()
}

/// Runs a captured step on `args` (matching its signature): one execution of the kept plan.
pub(crate) fn replay(c: &Capture, args: &[Tensor]) -> Result<Vec<Tensor>> {
    refuse_while_capturing("running a step")?;
    let mut computed: Vec<Buffer> = Vec::new();
    if let Some(planned) = &c.planned {
        let buffers = args.iter().map(|a| materialize(|| a.node())).collect::<Result<Vec<Buffer>>>()?;
        let backend = &c.device.0.backend;
        let poison = c.device.poison_enabled();
        let externals = c
            .sources
            .iter()
            .map(|s| match s {
                Source::Arg(k) => Ok(Input::Buffer(buffers[*k].clone())),
                Source::Host(bytes) => {
                    backend.upload(bytes, poison).map(Input::Buffer).map_err(|e| device_error(&c.device, e))
                }
            })
            .collect::<Result<Vec<Input>>>()?;
        drop(buffers);
        let fail_at = lock(&c.device.0.fail_at).take().map(KernelId);
        let label = |k: KernelId| flush::kernel_label(&planned.schedule, &planned.graph, k);
        let job =
            Job { schedule: &planned.schedule, kernels: &planned.kernels, externals, label: &label, poison, fail_at };
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.execute(job).0));
        computed = match run {
            Ok(result) => result.map_err(|e| device_error(&c.device, e))?,
            Err(panic) => {
                let what = braid_devices::panic_message(panic.as_ref());
                return Err(Error::Internal(format!("a step's replay panicked (a bug in braid): {what}")));
            }
        };
        let number = {
            let mut st = state();
            st.flushes += 1;
            st.flushes
        };
        flush::publish_dump(&c.device, &planned.schedule, &planned.graph, number);
    }
    Ok(c.outputs
        .iter()
        .map(|o| match o {
            Output::Computed { pos, dtype, shape } => {
                let id = super::record_ready(*dtype, shape.clone(), &c.device, computed[*pos].clone());
                Tensor::from_node(id, shape.clone(), *dtype, c.device.clone())
            }
            Output::Arg(k) => args[*k].detach(),
            Output::Host { bytes, dtype, shape } => {
                let id = super::record_host(*dtype, shape.clone(), &c.device, bytes.clone());
                Tensor::from_node(id, shape.clone(), *dtype, c.device.clone())
            }
        })
        .collect())
}
