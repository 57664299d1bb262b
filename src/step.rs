//! [`Step`]: a function of tensors captured once and replayed as one unit, for a loop that runs
//! the same small graph again and again (a training step on tiny tensors, a serving step).

use crate::device::Device;
use crate::engine::capture::{self, Capture, Produced};
use crate::engine::env::FlushEnv;
use crate::error::{Error, Result};
use crate::lock;
use crate::recorder;
use crate::tensor::Tensor;
use braid_devices::Buffer;
use braid_graph::{DType, NodeId, Shape};
use std::sync::{Arc, Mutex};

/// Signatures kept per step; beyond this the oldest capture is dropped.
const MAX_CAPTURES: usize = 32;

/// A function of tensors, recorded and planned once per argument signature and then replayed:
/// each later call with arguments of the same shapes and dtypes binds their values to the kept
/// plan and runs it, without recording, scheduling or looking up a plan for each op. Use it
/// when a loop runs the same graph of many tiny ops, where the per-op cost of recording, not
/// the arithmetic, is the time (like `jax.jit` or a CUDA graph).
///
/// The function must be a pure function of its arguments, as the engine sees it:
/// - it reads only its arguments and tensors it creates itself (constants, `from_vec`);
/// - it does not read values (`to_vec`, `item`, `sync`) while it is recorded;
/// - it returns every tensor it makes that should outlive it (no tensors stored elsewhere, no
///   in-place updates of tensors from outside but its arguments), or updates an argument in
///   place (`assign`, `add_assign`, [`Tensor::scatter_assign`], ...): every replay updates that
///   argument again, as calling the function would. Where nothing but the argument's tensor
///   reads its value, the update is written into the argument's buffer (a key/value cache's new
///   rows, a parameter's SGD update: no copy of the argument); otherwise on a private copy, so
///   that the other readers keep the old value. The function must not return an updated
///   argument's old value, nor update an argument passed twice;
/// - it makes no random tensors (every replay would draw the numbers of the capture: pass
///   them as arguments), and records and waits for no user events.
///
/// A capture that breaks these rules returns [`Error::Capture`] saying which, and keeps
/// nothing; the in-place updates and waits it refuses are not done, and its arguments' updates
/// are undone, so tensors and streams from outside the step are as they were (the device's
/// random sequence too). The outputs carry no gradient history: a step that trains computes
/// its gradients inside, with `backward`, and returns them (or applies them to its
/// arguments). The plan is the one a flush of the same work would run (same kernels, same
/// results), planned under the device's memory budget of the time; a new budget, or arguments
/// of new shapes or dtypes, capture again. Capture a step while no other
/// thread records work on the same device.
///
/// On CUDA the first replay records the plan into a CUDA graph and every later replay is one
/// graph launch (the host's cost of a replay no longer grows with its kernels): the arguments
/// are copied into the graph's own buffers (but an argument passed as the same buffer at the
/// call before the graph is recorded, such as a weight, is read where it is: the graph holds
/// it, and another buffer for it later records the graph again) and the outputs out into fresh
/// ones (but an argument updated in place, passed again as the buffer the last call left it
/// in, is read and written where it is). The graph keeps the memory of the step's
/// intermediates for as long as the step lives (counted in `Device::memory`);
/// `BRAID_CUDA_GRAPHS=0` turns graphs off, and replays under a memory budget, profiled ones and
/// plans over 256 MiB of buffers (those read in place aside) run as flushes.
///
/// ```
/// use braid::prelude::*;
/// use braid::Step;
///
/// let cpu = Device::cpu();
/// // d(x^2 + 3x)/dx, and the value, in one replayed plan.
/// let step = Step::new(|args: &[Tensor]| {
///     let x = args[0].detach().requires_grad();
///     let y = (&x * &x + &x * 3.0).sum();
///     let dx = y.backward().unwrap().get(&x).unwrap();
///     vec![y, dx]
/// });
/// for v in [1.0f32, 2.0, 3.0] {
///     let x = Tensor::from_vec(vec![v, -v], [2], &cpu);
///     let out = step.call(&[x]).unwrap();
///     assert_eq!(out[0].item::<f32>().unwrap(), 2.0 * v * v);
///     assert_eq!(out[1].to_vec::<f32>().unwrap(), vec![2.0 * v + 3.0, 3.0 - 2.0 * v]);
/// }
/// assert_eq!(step.captures(), 1);
/// ```
///
/// A step that updates an argument in place, as a decode step writes its key/value cache: each
/// call writes one row of `cache` where its buffer lies, and returns the rows' sums.
///
/// ```
/// use braid::prelude::*;
/// use braid::Step;
///
/// let cpu = Device::cpu();
/// let step = Step::new(|a: &[Tensor]| {
///     a[0].scatter_assign(0, &a[1], &a[2]); // cache[at[0][j]][j] = row[0][j]
///     vec![a[0].sum_dim(1, false)]
/// });
/// let cache = Tensor::zeros([3, 2], DType::F32, &cpu);
/// for (p, v) in [(0i32, 1.0f32), (2, 5.0), (0, 3.0)] {
///     let at = Tensor::from_vec(vec![p, p], [1, 2], &cpu);
///     let row = Tensor::from_vec(vec![v, -v], [1, 2], &cpu);
///     step.call(&[cache.clone(), at, row]).unwrap();
/// }
/// assert_eq!(cache.to_vec::<f32>().unwrap(), vec![3.0, -3.0, 0.0, 0.0, 5.0, -5.0]);
/// assert_eq!(step.captures(), 1);
/// ```
pub struct Step<F> {
    f: F,
    captures: Mutex<Vec<(Signature, Arc<Capture>)>>,
}

/// What a capture depends on besides the function: the device and its memory budget, and each
/// argument's dtype, shape and which earlier argument (if any) is the same value.
#[derive(PartialEq)]
struct Signature {
    device: Device,
    budget: Option<u64>,
    /// Each argument's dtype, shape, quantized layout (a quantized weight's bytes differ with
    /// it) and alias.
    args: Vec<(DType, Shape, Option<braid_graph::QuantLayout>, Option<usize>)>,
}

impl Signature {
    fn matches(&self, device: &Device, args: &[Tensor], values: &[u64]) -> bool {
        self.device == *device
            && self.budget == device.memory_budget()
            && self.args.len() == args.len()
            && self.args.iter().zip(args).enumerate().all(|(i, ((dtype, shape, quant, alias), a))| {
                *dtype == a.dtype()
                    && shape == a.shape()
                    && *quant == a.quant_layout()
                    && *alias == first_alias(values, i)
            })
    }

    fn of(device: &Device, args: &[Tensor], values: &[u64]) -> Signature {
        let args = (args.iter().enumerate())
            .map(|(i, a)| (a.dtype(), a.shape().clone(), a.quant_layout(), first_alias(values, i)))
            .collect();
        Signature { device: device.clone(), budget: device.memory_budget(), args }
    }
}

/// The first argument before `i` that names the same value as argument `i` (`values` are the
/// arguments' `Tensor::identity`): a capture reads such arguments as one input, so a replay
/// must see the same aliasing.
fn first_alias(values: &[u64], i: usize) -> Option<usize> {
    values[..i].iter().position(|&n| n == values[i])
}

impl<F: Fn(&[Tensor]) -> Vec<Tensor>> Step<F> {
    /// A step that runs `f`. Nothing is recorded until the first [`Step::call`].
    pub fn new(f: F) -> Step<F> {
        Step { f, captures: Mutex::new(Vec::new()) }
    }

    /// Runs the step on `args` (at least one; all on one device): the first call with a new
    /// signature runs `f` and captures it, later ones replay the capture. Returns the outputs
    /// of `f`, computed (reading them flushes nothing).
    ///
    /// Errors: a capture that breaks the rules above ([`Error::Capture`]), and the run-time
    /// failures a flush of the same work could have. The engine stays usable after any of them.
    pub fn call(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        let Some(device) = args.first().map(|a| a.device().clone()) else {
            return Err(Error::Capture("a step needs at least one argument (it gives the device)".into()));
        };
        if let Some(a) = args.iter().find(|a| *a.device() != device) {
            return Err(Error::Capture(format!(
                "the arguments are on different devices ({device} and {})",
                a.device()
            )));
        }
        if let Some(c) = self.find(&device, args) {
            return replay(&device, &c, args);
        }
        // Recorded first (a held value becomes a leaf), as the capture reads them.
        let values: Vec<u64> = args.iter().map(|a| a.node().index() as u64).collect();
        let signature = Signature::of(&device, args, &values);
        let (c, outputs) = capture(&device, args, &values, || (self.f)(args))?;
        let mut captures = lock(&self.captures);
        if captures.len() >= MAX_CAPTURES {
            captures.remove(0);
        }
        captures.push((signature, Arc::new(c)));
        Ok(outputs)
    }

    /// How many signatures are captured.
    pub fn captures(&self) -> usize {
        lock(&self.captures).len()
    }

    /// Kernels a replay with these arguments' signature runs (`None` before it is captured).
    pub fn kernel_count(&self, args: &[Tensor]) -> Option<usize> {
        Some(self.find(args.first()?.device(), args)?.kernel_count())
    }

    /// The capture whose signature `args` on `device` match.
    fn find(&self, device: &Device, args: &[Tensor]) -> Option<Arc<Capture>> {
        let values: smallvec::SmallVec<[u64; 8]> = args.iter().map(Tensor::identity).collect();
        lock(&self.captures).iter().find(|(s, _)| s.matches(device, args, &values)).map(|(_, c)| c.clone())
    }
}

/// Runs `f` (the step's function applied to `args`, whose node ids are `values`) and captures
/// it; returns the capture and this first run's outputs (computed, without gradient history).
/// Arguments `f` updated in place are updated (their new values are extra outputs of the
/// capture); if the capture fails, they are as they were.
fn capture(
    device: &Device,
    args: &[Tensor],
    values: &[u64],
    f: impl FnOnce() -> Vec<Tensor>,
) -> Result<(Capture, Vec<Tensor>)> {
    capture::refuse_while_capturing("capturing another step")?;
    let engine = device.engine();
    // Arguments are computed first, so that the step's flush starts from their values (and
    // dropped before it: a handle of ours would keep an updated argument from being written
    // over in place).
    let addresses: Vec<usize> = args.iter().map(|a| a.materialize().map(|b| b.address())).collect::<Result<_>>()?;
    // Which arguments only their tensors read (an update may write over them in place).
    let sole: Vec<bool> = args.iter().map(|a| engine.sole_value(a.cell(), 0)).collect();
    // The arguments' versions, held until the capture is done: a failed one points the
    // arguments it updated back at them.
    let before: Vec<Tensor> = args.iter().map(Tensor::detach).collect();
    let arg_nodes: Vec<NodeId> = before.iter().map(Tensor::node).collect();
    let start = engine.next_seq();
    let cells: Vec<&std::sync::atomic::AtomicU32> = args.iter().map(Tensor::cell).collect();
    let captured = capture::during(device.id(), start, &cells, f).and_then(|outs| {
        let updated: Vec<usize> = (0..args.len()).filter(|&k| args[k].node() != arg_nodes[k]).collect();
        if let Some(&k) =
            updated.iter().find(|&&k| first_alias(values, k).is_some() || values[k + 1..].contains(&values[k]))
        {
            return Err(Error::Capture(format!(
                "the step updates argument {k} in place, and the same tensor is passed as another argument"
            )));
        }
        if let Some(t) = outs.iter().find(|t| t.device() != device) {
            return Err(Error::Capture(format!("an output is on {}, the arguments on {device}", t.device())));
        }
        let old = |t: &Tensor| updated.iter().find(|&&k| t.node() == arg_nodes[k]).copied();
        if let Some(k) = outs.iter().find_map(old) {
            return Err(Error::Capture(format!(
                "the step returns argument {k}'s value from before it updates the argument in place; \
                 a replay writes over that value"
            )));
        }
        Ok((outs, updated))
    });
    let (outs, updated) = match captured {
        Ok(done) => done,
        Err(e) => {
            undo_updates(engine, args, &before);
            return Err(e);
        }
    };
    // Updated arguments carry no gradient history, as outputs carry none (a replay records
    // none): what autograd kept for it is released.
    for &k in &updated {
        args[k].drop_history();
    }
    // Outputs carry no gradient history (a replay records none): dropping the originals
    // releases what autograd kept for a backward pass the function did not run.
    let detached: Vec<Tensor> = outs.iter().map(Tensor::detach).collect();
    drop(outs);
    // The updated arguments' new versions are the capture's last outputs.
    let out_ids: Vec<NodeId> =
        detached.iter().map(Tensor::node).chain(updated.iter().map(|&k| args[k].node())).collect();
    let c = match engine.capture(start, &arg_nodes, &out_ids, &updated, &sole) {
        Ok(c) => c,
        Err(e) => {
            undo_updates(engine, args, &before);
            return Err(e);
        }
    };
    drop(before);
    c.note_args(&addresses);
    for &k in &updated {
        c.note_arg(k, &args[k].materialize()?);
    }
    Ok((c, detached))
}

/// A copy of `t`'s value in a buffer of its own, made by a copy kernel on its device (for an
/// argument the step updates while something else still reads its value).
fn private_copy(t: &Tensor, poison: Option<bool>) -> Result<Buffer> {
    let copy = Tensor::record(braid_graph::Op::Contiguous, t.dtype(), t.shape().clone(), t.device(), &[t]);
    copy.materialize_with(poison)
}

/// Points the arguments a failed capture updated back at their versions from before it.
fn undo_updates(engine: &crate::engine::Engine, args: &[Tensor], before: &[Tensor]) {
    for (a, b) in args.iter().zip(before) {
        engine.restore_version(a.cell(), b.node());
    }
}

/// Runs a captured step on `args` (matching its signature) and wraps its outputs as tensors;
/// the arguments it updates get their new versions.
fn replay(device: &Device, c: &Capture, args: &[Tensor]) -> Result<Vec<Tensor>> {
    capture::refuse_while_capturing("running a step")?;
    let engine = device.engine();
    // Read once for the whole step: the arguments' uploads and the replay.
    let env = FlushEnv::for_replay()?;
    let poison = Some(engine.poison_under(&env));
    let mut buffers: smallvec::SmallVec<[Buffer; 8]> = if c.runs() {
        args.iter().map(|a| a.materialize_with(poison)).collect::<Result<_>>()?
    } else {
        smallvec::SmallVec::new()
    };
    // An argument the step updates is written over in place when nothing else reads its value
    // (our handle, and the device graph's if it reads it in place, aside); otherwise the step
    // updates a private copy and the argument's old value stays as it is for its readers.
    for &k in c.updated() {
        let ours = 1 + usize::from(c.holds(k, &buffers[k]));
        if !engine.sole_value(args[k].cell(), ours) {
            buffers[k] = private_copy(&args[k], poison)?;
        }
    }
    let mut produced = engine.replay(c, &buffers, &env)?;
    drop(buffers);
    let updates = produced.split_off(produced.len() - c.updated().len());
    for (&k, p) in c.updated().iter().zip(updates) {
        let Produced::Computed { buffer, dtype, shape } = p else {
            return Err(Error::Internal("a step's updated argument is not computed by it".into()));
        };
        c.note_arg(k, &buffer);
        let stream = recorder::current_stream(device.id());
        engine.install_version(args[k].cell(), dtype, shape.clone(), stream, buffer);
        args[k].drop_history();
    }
    // Computed outputs are held by their tensors, outside the graph, unless a memory budget is
    // set (the planner then weighs what the graph holds; see `Tensor::cell`).
    let held = engine.memory_budget().is_none();
    Ok(produced
        .into_iter()
        .map(|p| match p {
            Produced::Computed { buffer, dtype, shape } if held => {
                Tensor::from_computed(buffer, shape.clone(), dtype, device)
            }
            Produced::Computed { buffer, dtype, shape } => {
                let id = recorder::record_ready(engine, dtype, shape.clone(), buffer);
                Tensor::from_node(id, shape.clone(), dtype, device.clone())
            }
            Produced::Arg(k) => args[k].detach(),
            Produced::Host { bytes, dtype, shape } => {
                Tensor::from_host_bytes(bytes.clone(), shape.clone(), dtype, device)
            }
        })
        .collect())
}

impl<F> std::fmt::Debug for Step<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Step({} captured)", lock(&self.captures).len())
    }
}
