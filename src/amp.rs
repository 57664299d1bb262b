//! Mixed precision: [`autocast`] records matrix products in bf16 or f16 while everything that
//! needs range or precision stays in f32, and [`GradScaler`] keeps f16 gradients from
//! underflowing.
//!
//! Inside `autocast(low, || ...)`, on this thread:
//! - `matmul` casts float operands of another dtype to `low` and gives a `low` result; the
//!   products accumulate in f32 on every device (the CPU's and wgpu's kernels add in f32,
//!   cuBLAS is asked for f32 compute), as PyTorch's autocast does. `linear` (and so
//!   `nn::Linear`) adds its bias in `low` too and gives `low`, as PyTorch's `F.linear` and
//!   `addmm` do under autocast.
//! - `softmax`, `log_softmax`, `layer_norm`, `cross_entropy`, `sum`, `mean`, `sum_dim` and
//!   `mean_dim` of f16 or bf16 values compute in f32 and give f32 (outside autocast they round
//!   back to the input's dtype).
//! - Binary ops, comparisons and `select` between floats of different dtypes promote to the
//!   wider one (bf16 with f16 to f32), so `x.matmul(&w) + &bias` adds a bf16 product to an f32
//!   bias in f32 (`x.linear(&w.t(), Some(&bias))` adds it in bf16). Outside autocast mixed
//!   dtypes stay misuse: conversions are explicit.
//! - Parameters stay f32 (master weights): a product reads them through a cast, and the cast's
//!   gradient is the f32 gradient of the f32 parameter, so optimizers see f32 gradients.
//!
//! The backward pass and optimizer updates record as they would outside autocast (gradients
//! keep their forward dtypes), wherever they are called. Autocast is a recording rule, not a
//! device setting: scopes nest, `autocast(DType::F32, ..)` turns it off inside, and it ends
//! with the scope even if the closure panics.
//!
//! Must never: change what is recorded outside a scope, or cast integers or bools.

use crate::autograd::Grads;
use crate::optim::Optimizer;
use crate::tensor::{Tensor, misuse};
use braid_graph::DType;
use std::cell::Cell;

thread_local! {
    /// The low-precision dtype of the innermost `autocast` scope; `None` outside (or inside
    /// `autocast(DType::F32, ..)`).
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
}

/// Runs `f` with mixed-precision recording on this thread: products in `dtype` (`DType::BF16`
/// or `DType::F16`) with f32 accumulation, softmax, norms, reductions and losses in f32 (see
/// the [module docs](self)). `DType::F32` turns autocast off inside an outer scope.
///
/// ```
/// use braid::prelude::*;
/// let cpu = Device::cpu();
/// let x = Tensor::randn([4, 8], DType::F32, &cpu);
/// let w = Tensor::randn([8, 3], DType::F32, &cpu).requires_grad();
/// let (y, loss) = braid::amp::autocast(DType::BF16, || {
///     let y = x.matmul(&w);
///     let loss = y.softmax(-1).square().mean();
///     (y, loss)
/// });
/// assert_eq!((y.dtype(), loss.dtype()), (DType::BF16, DType::F32));
/// let grads = loss.backward().unwrap();
/// assert_eq!(grads.get(&w).unwrap().dtype(), DType::F32);
/// ```
#[track_caller]
pub fn autocast<R>(dtype: DType, f: impl FnOnce() -> R) -> R {
    let low = match dtype {
        DType::BF16 | DType::F16 => Some(dtype),
        DType::F32 => None,
        d => misuse("autocast", &format!("needs bf16 or f16 (or f32 to turn it off), not {d}"), &[]),
    };
    scoped(low, f)
}

/// The low-precision dtype of the `autocast` scope this thread records in, if any.
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(|a| a.get())
}

/// Runs `f` with autocast off (the backward pass, optimizer updates).
pub(crate) fn off<R>(f: impl FnOnce() -> R) -> R {
    scoped(None, f)
}

fn scoped<R>(low: Option<DType>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<DType>);
    impl Drop for Restore {
        fn drop(&mut self) {
            AUTOCAST.with(|a| a.set(self.0));
        }
    }
    let _restore = Restore(AUTOCAST.with(|a| a.replace(low)));
    f()
}

/// The float dtype two floats promote to: the wider, and f32 for f16 with bf16.
fn wider(a: DType, b: DType) -> DType {
    match (a, b) {
        _ if a == b => a,
        (DType::F64, _) | (_, DType::F64) => DType::F64,
        _ => DType::F32,
    }
}

impl Tensor {
    /// Under autocast, this tensor as the operand of a product: a float of another dtype cast
    /// to the scope's low precision. Unchanged outside autocast and for non-floats.
    pub(crate) fn autocast_product_operand(&self) -> Tensor {
        match autocast_dtype() {
            Some(low) if self.dtype().is_float() && self.dtype() != low => self.to_dtype(low),
            _ => self.clone(),
        }
    }

    /// Under autocast, `operands` promoted to one float dtype when they are floats of
    /// different dtypes; `None` when nothing changes (outside autocast, one dtype, integers).
    pub(crate) fn autocast_promoted(operands: &[&Tensor]) -> Option<Vec<Tensor>> {
        autocast_dtype()?;
        let floats = operands.iter().all(|t| t.dtype().is_float());
        let first = operands.first()?.dtype();
        if !floats || operands.iter().all(|t| t.dtype() == first) {
            return None;
        }
        let to = operands.iter().fold(first, |d, t| wider(d, t.dtype()));
        Some(operands.iter().map(|t| t.as_dtype(to)).collect())
    }

    /// Under autocast, an f16 or bf16 tensor as f32 (the input of a reduction, norm or loss
    /// that autocast keeps in f32); this tensor otherwise.
    pub(crate) fn autocast_f32(&self) -> Tensor {
        match (autocast_dtype(), self.dtype()) {
            (Some(_), DType::F16 | DType::BF16) => self.to_dtype(DType::F32),
            _ => self.clone(),
        }
    }
}

/// Dynamic loss scaling for f16 training, as PyTorch's `torch.amp.GradScaler`: the loss is
/// multiplied by a scale (65536 to start) before the backward pass so that small f16 gradients
/// do not flush to zero; the gradients are divided by it before the update; a step whose
/// gradients hold an infinity or a NaN is skipped and the scale halved; after 2000 steps in a
/// row without one the scale doubles.
///
/// Deciding whether to skip reads one value back to the host per step (PyTorch's scaler reads
/// its `found_inf` flag too): a sum of `g * 0` over every gradient, which is NaN exactly when
/// some element is infinite or NaN.
///
/// ```
/// use braid::prelude::*;
/// use braid::amp::GradScaler;
/// use braid::optim::AdamW;
/// let cpu = Device::cpu();
/// let w = Tensor::randn([8, 8], DType::F32, &cpu).requires_grad();
/// let x = Tensor::randn([4, 8], DType::F32, &cpu);
/// // A small starting scale: at 65536 these f16 gradients overflow, and the first steps
/// // would be skipped (halving the scale each time) until it fits.
/// let (mut opt, mut scaler) = (AdamW::new(1e-3), GradScaler::new().init_scale(256.0));
/// let loss = braid::amp::autocast(DType::F16, || x.matmul(&w).square().mean());
/// let grads = scaler.scale(&loss).backward().unwrap();
/// let stepped = scaler.step(&mut opt, [&w], &grads).unwrap();
/// scaler.update();
/// assert!(stepped);
/// ```
#[derive(Debug, Clone)]
pub struct GradScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u32,
    /// Steps in a row without an infinity or NaN.
    good_steps: u32,
    /// Whether the last `step` found an infinity or NaN (`None` before any step since the
    /// last `update`).
    found_inf: Option<bool>,
}

impl Default for GradScaler {
    fn default() -> GradScaler {
        GradScaler::new()
    }
}

impl GradScaler {
    /// PyTorch's defaults: scale 65536, growth 2 every 2000 good steps, backoff 0.5.
    pub fn new() -> GradScaler {
        GradScaler {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            good_steps: 0,
            found_inf: None,
        }
    }

    /// The starting scale (a power of two keeps the scaling exact).
    #[track_caller]
    pub fn init_scale(mut self, scale: f64) -> GradScaler {
        if !(scale.is_finite() && scale > 0.0) {
            misuse("GradScaler::init_scale", &format!("the scale must be finite and positive, not {scale}"), &[]);
        }
        self.scale = scale;
        self
    }

    /// Good steps in a row before the scale grows.
    pub fn growth_interval(mut self, steps: u32) -> GradScaler {
        self.growth_interval = steps.max(1);
        self
    }

    /// The scale the next `scale` multiplies by.
    pub fn get_scale(&self) -> f64 {
        self.scale
    }

    /// `loss` times the scale (in the loss's dtype, lazily).
    #[track_caller]
    pub fn scale(&self, loss: &Tensor) -> Tensor {
        loss * self.scale
    }

    /// The gradients divided by the scale (lazily; what `step` updates with, and what to clip).
    pub fn unscale(&self, grads: &Grads) -> Grads {
        let inverse = 1.0 / self.scale;
        off(|| crate::no_grad(|| grads.map(|g| g * inverse)))
    }

    /// Unscales `grads` (scaled gradients, from the backward pass of [`scale`](Self::scale)'s
    /// loss) and, unless an element is infinite or NaN, has `optimizer` update `params` with
    /// them. Returns whether it stepped; `Err` when the check cannot be read back (the device
    /// failed).
    #[track_caller]
    pub fn step<'a, O: Optimizer>(
        &mut self,
        optimizer: &mut O,
        params: impl IntoIterator<Item = &'a Tensor>,
        grads: &Grads,
    ) -> crate::Result<bool> {
        let params: Vec<&Tensor> = params.into_iter().collect();
        let unscaled = self.unscale(grads);
        let found_inf = !all_finite(&unscaled)?;
        self.found_inf = Some(found_inf);
        if !found_inf {
            optimizer.update(params, &unscaled);
        }
        Ok(!found_inf)
    }

    /// Adjusts the scale after a `step`: halved if it found an infinity or NaN, doubled after
    /// `growth_interval` good steps in a row. Does nothing without a step since the last update.
    pub fn update(&mut self) {
        match self.found_inf.take() {
            Some(true) => {
                self.scale *= self.backoff_factor;
                self.good_steps = 0;
            }
            Some(false) => {
                self.good_steps += 1;
                if self.good_steps >= self.growth_interval {
                    self.scale *= self.growth_factor;
                    self.good_steps = 0;
                }
            }
            None => {}
        }
    }
}

/// Whether every element of every gradient is finite: one value read back (the f32 sum of
/// `g * 0` over all of them, NaN exactly when an element is infinite or NaN).
fn all_finite(grads: &Grads) -> crate::Result<bool> {
    let flags = off(|| {
        crate::no_grad(|| {
            grads.values().map(|g| (&g * 0.0).to_dtype(DType::F32).sum()).reduce(|a, b| {
                let b = if b.device() == a.device() { b } else { b.to_device(a.device()) };
                &a + &b
            })
        })
    });
    match flags {
        None => Ok(true),
        Some(flag) => Ok(flag.item::<f32>()?.is_finite()),
    }
}
