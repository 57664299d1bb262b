//! Optimizers: they record parameter updates as in-place ops (new versions of the parameter
//! tensors), inside [`crate::no_grad`], like everything else lazily.
//!
//! Per-parameter state (momentum, Adam's moments) is kept by the leaf's identity, so it
//! follows a parameter across its versions. Values that change every step (Adam's bias
//! corrections) enter as small host tensors rather than as constants baked into the ops, so
//! every step records the same structure and replays the cached schedule.
//!
//! ```
//! use braid::prelude::*;
//! use braid::optim::Sgd;
//!
//! let cpu = Device::cpu();
//! let w = Tensor::from_vec(vec![1.0f32, -1.0], [2], &cpu).requires_grad();
//! let mut opt = Sgd::new(0.1).momentum(0.9);
//! for _ in 0..3 {
//!     let loss = (&w * &w).sum();
//!     let grads = loss.backward().unwrap();
//!     opt.step(&mut [w.clone()], &grads);
//! }
//! let v = w.to_vec::<f32>().unwrap();
//! assert!(v[0].abs() < 1.0 && v[1].abs() < 1.0);
//! ```

use crate::autograd::{GradSource, Grads, no_grad, source_of};
use crate::device::Device;
use crate::tensor::{Tensor, misuse};
use braid_graph::DType;
use braid_graph::table::BinaryOp;
use hashbrown::HashMap;

/// An optimizer: records the update of parameters from their gradients. Parameters come as any
/// iterator of tensors (a `&[Tensor]`, a `Vec`, [`crate::nn::Params::iter`], a module's
/// parameters), since updates are in place through the shared handles.
///
/// ```
/// use braid::prelude::*;
/// use braid::optim::{Optimizer, Sgd};
/// let cpu = Device::cpu();
/// let params = [Tensor::from_vec(vec![2.0f32], [1], &cpu).requires_grad()];
/// let loss = params[0].square().sum();
/// Sgd::new(0.25).update(&params, &loss.backward().unwrap());
/// assert_eq!(params[0].to_vec::<f32>().unwrap(), vec![1.0]);
/// ```
pub trait Optimizer {
    /// Records the update of every parameter that has a gradient in `grads` (others are left
    /// alone). Panics at the caller's line if a parameter is not a leaf.
    fn update<'a>(&mut self, params: impl IntoIterator<Item = &'a Tensor>, grads: &Grads);
}

/// The identity optimizers key their state by: the parameter's leaf.
#[track_caller]
fn leaf_of(p: &Tensor, optimizer: &str) -> u64 {
    match source_of(p) {
        Some(GradSource::Leaf(id)) => id,
        _ => misuse(optimizer, "parameters must be leaves marked with requires_grad", &[("param", format!("{p:?}"))]),
    }
}

/// A one-element tensor of `dtype` holding `v` (host data: not part of the graph's structure).
fn host_scalar(v: f64, dtype: DType, device: &Device) -> Tensor {
    match dtype {
        DType::F64 => Tensor::from_vec(vec![v], (), device),
        DType::F16 => Tensor::from_vec(vec![braid_graph::dtype::f16_from_f64(v)], (), device),
        DType::BF16 => Tensor::from_vec(vec![braid_graph::dtype::bf16_from_f64(v)], (), device),
        _ => Tensor::from_vec(vec![v as f32], (), device),
    }
}

/// Stochastic gradient descent with optional momentum (heavy ball or Nesterov), dampening and
/// L2 weight decay, as in PyTorch's `SGD`:
/// `g += wd p; b = m b + (1 - dampening) g; p -= lr (nesterov ? g + m b : b)`.
#[derive(Debug, Clone)]
pub struct Sgd {
    lr: f64,
    momentum: f64,
    dampening: f64,
    weight_decay: f64,
    nesterov: bool,
    velocity: HashMap<u64, Tensor>,
}

impl Sgd {
    pub fn new(lr: f64) -> Sgd {
        Sgd { lr, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false, velocity: HashMap::new() }
    }

    pub fn momentum(mut self, momentum: f64) -> Sgd {
        self.momentum = momentum;
        self
    }

    pub fn dampening(mut self, dampening: f64) -> Sgd {
        self.dampening = dampening;
        self
    }

    pub fn weight_decay(mut self, weight_decay: f64) -> Sgd {
        self.weight_decay = weight_decay;
        self
    }

    pub fn nesterov(mut self, on: bool) -> Sgd {
        self.nesterov = on;
        self
    }

    pub fn lr(&self) -> f64 {
        self.lr
    }

    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// Records the update of every parameter that has a gradient in `grads` (others are left
    /// alone). Panics at the caller's line if a parameter is not a leaf.
    #[track_caller]
    pub fn step(&mut self, params: &mut [Tensor], grads: &Grads) {
        self.update(params.iter(), grads)
    }
}

impl Optimizer for Sgd {
    #[track_caller]
    fn update<'a>(&mut self, params: impl IntoIterator<Item = &'a Tensor>, grads: &Grads) {
        let params: Vec<&Tensor> = params.into_iter().collect();
        let ids: Vec<u64> = params.iter().map(|p| leaf_of(p, "Sgd::step")).collect();
        // Updates keep the parameters' dtypes wherever they are called (see `crate::amp`).
        crate::amp::off(|| {
            no_grad(|| {
                for (&p, id) in params.iter().zip(ids) {
                    let Some(mut g) = grads.get(p) else { continue };
                    if self.weight_decay != 0.0 {
                        g = &g + &(p * self.weight_decay);
                    }
                    if self.momentum != 0.0 {
                        let b = match self.velocity.remove(&id) {
                            Some(b) => &(&b * self.momentum) + &(&g * (1.0 - self.dampening)),
                            None => g.clone(),
                        };
                        g = if self.nesterov { &g + &(&b * self.momentum) } else { b.clone() };
                        self.velocity.insert(id, b);
                    }
                    p.sub_assign(&(&g * self.lr));
                }
            })
        });
    }
}

/// Adam (and, with decoupled weight decay, AdamW), as in PyTorch:
/// `m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
///  p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`.
#[derive(Debug, Clone)]
pub struct Adam {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    /// AdamW: decay the parameter directly instead of adding `wd p` to the gradient.
    decoupled: bool,
    state: HashMap<u64, Moments>,
}

/// What Adam's bias corrections depend on: the step count, and the dtype and device of the
/// parameters that read them.
type CorrectionKey = (i32, DType, Device);

#[derive(Debug, Clone)]
struct Moments {
    m: Tensor,
    v: Tensor,
    steps: i32,
}

impl Adam {
    /// Betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn new(lr: f64) -> Adam {
        Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false, state: HashMap::new() }
    }

    pub fn betas(mut self, beta1: f64, beta2: f64) -> Adam {
        self.beta1 = beta1;
        self.beta2 = beta2;
        self
    }

    pub fn eps(mut self, eps: f64) -> Adam {
        self.eps = eps;
        self
    }

    /// L2 weight decay added to the gradient (for `AdamW`, the decoupled decay rate).
    pub fn weight_decay(mut self, weight_decay: f64) -> Adam {
        self.weight_decay = weight_decay;
        self
    }

    pub fn lr(&self) -> f64 {
        self.lr
    }

    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// Records the update of every parameter that has a gradient in `grads`.
    #[track_caller]
    pub fn step(&mut self, params: &mut [Tensor], grads: &Grads) {
        self.update(params.iter(), grads)
    }

    /// The moments and step count kept for `param` (PyTorch's `exp_avg`, `exp_avg_sq` and
    /// `step`), for a checkpoint; `None` before its first update. Misuse: `param` is not a
    /// leaf.
    #[track_caller]
    pub fn state(&self, param: &Tensor) -> Option<AdamState> {
        let s = self.state.get(&leaf_of(param, "Adam::state"))?;
        Some(AdamState { exp_avg: s.m.clone(), exp_avg_sq: s.v.clone(), step: s.steps })
    }

    /// Continues `param` from `state` (read from a checkpoint): its next update is step
    /// `state.step + 1`. Misuse: `param` is not a leaf, or the moments' shape, dtype or device
    /// are not `param`'s.
    #[track_caller]
    pub fn set_state(&mut self, param: &Tensor, state: AdamState) {
        let id = leaf_of(param, "Adam::set_state");
        for (what, m) in [("exp_avg", &state.exp_avg), ("exp_avg_sq", &state.exp_avg_sq)] {
            let fits = m.dims() == param.dims() && m.dtype() == param.dtype() && m.device() == param.device();
            if !fits {
                let detail = [("param", format!("{param:?}")), (what, format!("{m:?}"))];
                misuse("Adam::set_state", "moments must have the parameter's shape, dtype and device", &detail);
            }
        }
        let moments = Moments { m: state.exp_avg.detach(), v: state.exp_avg_sq.detach(), steps: state.step };
        self.state.insert(id, moments);
    }
}

/// One parameter's state in [`Adam`] and [`AdamW`] (see [`Adam::state`]).
#[derive(Debug, Clone)]
pub struct AdamState {
    /// The first moment (running mean of the gradients).
    pub exp_avg: Tensor,
    /// The second moment (running mean of the squared gradients).
    pub exp_avg_sq: Tensor,
    /// Updates done so far (the bias corrections' exponent).
    pub step: i32,
}

impl Optimizer for Adam {
    #[track_caller]
    fn update<'a>(&mut self, params: impl IntoIterator<Item = &'a Tensor>, grads: &Grads) {
        let params: Vec<&Tensor> = params.into_iter().collect();
        let name = if self.decoupled { "AdamW::step" } else { "Adam::step" };
        let ids: Vec<u64> = params.iter().map(|p| leaf_of(p, name)).collect();
        // The bias corrections as host scalars, one pair per step count, dtype and device
        // (parameters updated together share them: two uploads a step, not two a parameter).
        let mut corrections: Vec<(CorrectionKey, (Tensor, Tensor))> = vec![];
        crate::amp::off(|| {
            no_grad(|| {
                for (&p, id) in params.iter().zip(ids) {
                    let Some(mut g) = grads.get(p) else { continue };
                    if self.weight_decay != 0.0 {
                        if self.decoupled {
                            p.update_with_scalar(BinaryOp::Mul, 1.0 - self.lr * self.weight_decay);
                        } else {
                            g = &g + &(p * self.weight_decay);
                        }
                    }
                    let (b1, b2) = (self.beta1, self.beta2);
                    let moments = match self.state.remove(&id) {
                        Some(s) => Moments {
                            m: &(&s.m * b1) + &(&g * (1.0 - b1)),
                            v: &(&s.v * b2) + &(&g.square() * (1.0 - b2)),
                            steps: s.steps + 1,
                        },
                        None => Moments { m: &g * (1.0 - b1), v: &g.square() * (1.0 - b2), steps: 1 },
                    };
                    let key = (moments.steps, p.dtype(), p.device().clone());
                    let (step_size, inv_sqrt_bc2) = match corrections.iter().find(|(k, _)| *k == key) {
                        Some((_, c)) => c.clone(),
                        None => {
                            let step_size = self.lr / (1.0 - b1.powi(moments.steps));
                            let inv_sqrt_bc2 = 1.0 / (1.0 - b2.powi(moments.steps)).sqrt();
                            let c = (
                                host_scalar(step_size, p.dtype(), p.device()),
                                host_scalar(inv_sqrt_bc2, p.dtype(), p.device()),
                            );
                            corrections.push((key, c.clone()));
                            c
                        }
                    };
                    let denom = &(&moments.v.sqrt() * &inv_sqrt_bc2) + self.eps;
                    p.sub_assign(&(&(&moments.m * &step_size) / &denom));
                    self.state.insert(id, moments);
                }
            })
        });
    }
}

/// Adam with decoupled weight decay (default 0.01), as in PyTorch's `AdamW`.
#[derive(Debug, Clone)]
pub struct AdamW(Adam);

impl AdamW {
    pub fn new(lr: f64) -> AdamW {
        AdamW(Adam { decoupled: true, weight_decay: 0.01, ..Adam::new(lr) })
    }

    pub fn betas(self, beta1: f64, beta2: f64) -> AdamW {
        AdamW(self.0.betas(beta1, beta2))
    }

    pub fn eps(self, eps: f64) -> AdamW {
        AdamW(self.0.eps(eps))
    }

    pub fn weight_decay(self, weight_decay: f64) -> AdamW {
        AdamW(self.0.weight_decay(weight_decay))
    }

    pub fn lr(&self) -> f64 {
        self.0.lr
    }

    pub fn set_lr(&mut self, lr: f64) {
        self.0.lr = lr;
    }

    #[track_caller]
    pub fn step(&mut self, params: &mut [Tensor], grads: &Grads) {
        self.0.step(params, grads)
    }

    /// See [`Adam::state`].
    #[track_caller]
    pub fn state(&self, param: &Tensor) -> Option<AdamState> {
        self.0.state(param)
    }

    /// See [`Adam::set_state`].
    #[track_caller]
    pub fn set_state(&mut self, param: &Tensor, state: AdamState) {
        self.0.set_state(param, state)
    }
}

/// AdamW is Adam with decoupled weight decay: code that reads or restores Adam's states
/// (checkpoints, `braid::dist::Sharded::save_with_optimizers`) takes either.
impl AsRef<Adam> for AdamW {
    fn as_ref(&self) -> &Adam {
        &self.0
    }
}

impl AsMut<Adam> for AdamW {
    fn as_mut(&mut self) -> &mut Adam {
        &mut self.0
    }
}

impl AsRef<Adam> for Adam {
    fn as_ref(&self) -> &Adam {
        self
    }
}

impl AsMut<Adam> for Adam {
    fn as_mut(&mut self) -> &mut Adam {
        self
    }
}

impl Optimizer for AdamW {
    #[track_caller]
    fn update<'a>(&mut self, params: impl IntoIterator<Item = &'a Tensor>, grads: &Grads) {
        self.0.update(params, grads)
    }
}

/// Gradients of at most this many elements are joined into one vector for
/// [`clip_grad_norm`]'s sum of squares.
const SMALL_GRADIENT: usize = 1 << 16;

/// Scales the gradients of `params` in `grads` so that their total L2 norm (over all of them,
/// as one vector) is at most `max_norm`, as PyTorch's `clip_grad_norm_`: each gradient is
/// multiplied by `min(1, max_norm / (total + 1e-6))`. Returns the total norm before clipping
/// (an f32 scalar on the first parameter's device). Everything is recorded lazily: nothing is
/// read back, and parameters without a gradient are skipped. Sums of squares are taken in f32
/// (in f64 for f64 gradients).
///
/// ```
/// use braid::prelude::*;
/// let cpu = Device::cpu();
/// let w = Tensor::from_vec(vec![3.0f32, 4.0], [2], &cpu).requires_grad();
/// let mut grads = (&w * &w).sum().backward().unwrap(); // gradient [6, 8], norm 10
/// let norm = braid::optim::clip_grad_norm([&w], &mut grads, 5.0);
/// assert_eq!(norm.item::<f32>().unwrap(), 10.0);
/// let g = grads.get(&w).unwrap().to_vec::<f32>().unwrap();
/// assert!((g[0] - 3.0).abs() < 1e-5 && (g[1] - 4.0).abs() < 1e-5);
/// ```
#[track_caller]
pub fn clip_grad_norm<'a>(params: impl IntoIterator<Item = &'a Tensor>, grads: &mut Grads, max_norm: f64) -> Tensor {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        misuse("clip_grad_norm", &format!("max_norm must be finite and positive, not {max_norm}"), &[]);
    }
    let params: Vec<&Tensor> = params.into_iter().collect();
    crate::amp::off(|| {
        no_grad(|| {
            let with_grads: Vec<(&Tensor, Tensor)> =
                params.iter().filter_map(|&p| grads.get(p).map(|g| (p, g))).collect();
            let Some(device) = with_grads.first().map(|(p, _)| p.device().clone()) else {
                let device = params.first().map(|p| p.device().clone()).unwrap_or_else(Device::cpu);
                return Tensor::zeros((), DType::F32, &device);
            };
            let wide = |g: &Tensor| if g.dtype() == DType::F64 { g.clone() } else { g.to_dtype(DType::F32) };
            // Small gradients on the first device (biases, norms' scales: a GPT-2 has about a
            // hundred) are joined into one vector and summed once; a reduction each would be a
            // kernel each. The others are summed one by one.
            let joined = |g: &Tensor| g.device() == &device && g.dtype() != DType::F64 && g.numel() <= SMALL_GRADIENT;
            let (small, large): (Vec<&Tensor>, Vec<&Tensor>) =
                with_grads.iter().map(|(_, g)| g).partition(|g| joined(g));
            let mut squares: Vec<Tensor> = large
                .iter()
                .map(|g| {
                    let s = wide(g).square().sum().to_dtype(DType::F32);
                    if s.device() == &device { s } else { s.to_device(&device) }
                })
                .collect();
            if !small.is_empty() {
                let flat: Vec<Tensor> = small.iter().map(|g| wide(g).reshape([g.numel()])).collect();
                squares.push(Tensor::cat(&flat.iter().collect::<Vec<_>>(), 0).square().sum());
            }
            let total = squares.into_iter().reduce(|a, b| &a + &b).expect("one gradient at least").sqrt();
            let coef = (&(&total + 1e-6).recip() * max_norm).clamp(0.0, 1.0);
            for (p, g) in with_grads {
                let c = if g.device() == &device { coef.clone() } else { coef.to_device(g.device()) };
                let c = if g.dtype() == DType::F32 { c } else { c.to_dtype(g.dtype()) };
                grads.insert(p, &g * &c);
            }
            total
        })
    })
}
