//! Recomputation of saved values (`Device::set_recompute`): a flush that reads a forward pass
//! before its backward pass is recorded leaves cheap saved values uncomputed and keeps what they
//! are computed from; the backward pass computes them again. Pinned here: a language model's
//! cross-entropy under bf16 autocast keeps its bf16 logits instead of `exp` in f32 and a one-hot
//! mask, and its gradients are the bits recomputation off gives; values a tensor holds are
//! never left uncomputed. Every gradient check of `tests/autodiff.rs` reads its loss before
//! the backward pass as well, with the same results as without the read.

mod common;

use braid::prelude::*;
use common::Rng;

/// `n` standard-normal-ish values (uniform in [-2, 2], never all zeros).
fn normal_vec(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(-2.0, 2.0) as f32).collect()
}

/// A fresh device of the kind under test (its own memory statistics).
fn device() -> Device {
    Device::new_from_env().expect("BRAID_DEVICE names an available device")
}

/// Whether `dev` recomputes at all (not where its math is not the op table's: wgpu), else
/// prints why `test` is skipped.
fn recomputes(dev: &Device, test: &str) -> bool {
    let on = dev.recompute_enabled();
    if !on {
        println!("skipped: {test}: {} never recomputes (its math is not the op table's, or it is off)", dev.name());
    }
    on
}

/// The low precision of the test device when it recomputes and computes in bf16 or f16; else
/// prints why `test` is skipped.
fn recomputing_low_precision(test: &str) -> Option<DType> {
    let dev = device();
    if !recomputes(&dev, test) {
        return None;
    }
    let low = low_precision(&dev);
    if low.is_none() {
        println!("skipped: {test}: {} computes in neither bf16 nor f16", dev.name());
    }
    low
}

/// The low precision this device computes products in, if any.
fn low_precision(dev: &Device) -> Option<DType> {
    [DType::BF16, DType::F16].into_iter().find(|&d| dev.target().dtypes.contains(d))
}

/// What an eager language-model step keeps between its loss read and its backward pass, and
/// the gradients that backward pass gives: `(bytes in use after the loss read, loss, dW)`.
/// With `backward_first`, the backward pass is recorded before the loss is read (as
/// `examples/common/gpt2.rs`'s eager step does): then the pending backward pass, not autograd's
/// handles, is what needs the saved values.
fn lm_head_step(dev: &Device, low: DType, recompute: bool, backward_first: bool) -> (u64, f32, Vec<f32>) {
    dev.set_recompute(recompute);
    let (rows, width, vocab) = (64, 32, 1001);
    let mut rng = Rng::new(3);
    let h = Tensor::from_vec(normal_vec(&mut rng, rows * width), [rows, width], dev);
    let w = Tensor::from_vec(normal_vec(&mut rng, width * vocab), [width, vocab], dev).requires_grad();
    let targets: Vec<i64> = (0..rows).map(|_| rng.below(vocab) as i64).collect();
    let target = Tensor::from_vec(targets, [rows], dev);
    dev.sync().unwrap();
    let before = dev.memory().in_use;
    let logits = braid::amp::autocast(low, || h.matmul(&w));
    assert_eq!(logits.dtype(), low);
    let loss = logits.cross_entropy(&target);
    drop(logits);
    let early = backward_first.then(|| loss.backward().unwrap());
    let value = loss.to_dtype(DType::F32).item::<f32>().unwrap();
    let kept = dev.memory().in_use - before;
    let grads = early.unwrap_or_else(|| loss.backward().unwrap());
    let dw = grads.get(&w).expect("a gradient for the weights").to_vec::<f32>().unwrap();
    (kept, value, dw)
}

#[test]
fn cross_entropy_keeps_its_low_precision_logits_instead_of_f32_exponentials() {
    let dev = device();
    if !recomputes(&dev, "cross_entropy_keeps_its_low_precision_logits_instead_of_f32_exponentials") {
        return;
    }
    let Some(low) = low_precision(&dev) else {
        println!("skipped: {} computes in neither bf16 nor f16", dev.name());
        return;
    };
    for backward_first in [false, true] {
        cross_entropy_step(&dev, low, backward_first);
    }
}

fn cross_entropy_step(dev: &Device, low: DType, backward_first: bool) {
    let (kept_off, loss_off, dw_off) = lm_head_step(dev, low, false, backward_first);
    let (kept_on, loss_on, dw_on) = lm_head_step(&device(), low, true, backward_first);
    let (rows, vocab) = (64u64, 1001u64);
    let (exponentials, mask) = (rows * vocab * 4, rows * vocab);
    let logits = rows * vocab * low.size() as u64;
    println!(
        "kept between the loss read and the backward pass (recorded {}): {kept_off} B recomputation off, {kept_on} B on",
        if backward_first { "first" } else { "after" }
    );
    // Off: the f32 exponentials and the one-hot mask wait for the backward pass. On: the
    // low-precision logits do instead (besides what both keep: the operands' casts the
    // product's derivative reads, per-row values).
    assert!(kept_off >= exponentials + mask, "off keeps exp(logits - max) in f32 and the mask: {kept_off} B");
    let saved = kept_off.saturating_sub(kept_on);
    assert!(
        saved + 4096 >= exponentials + mask - logits,
        "on keeps {kept_on} B, off {kept_off} B: {saved} B less, not the exponentials and the mask less the logits"
    );
    assert_eq!(loss_on.to_bits(), loss_off.to_bits(), "the loss");
    assert_eq!(dw_on.len(), dw_off.len());
    for (i, (a, b)) in dw_on.iter().zip(&dw_off).enumerate() {
        assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "dW[{i}]: {a} recomputed vs {b} kept");
    }
}

#[test]
fn a_value_a_tensor_holds_is_computed_and_kept_by_the_flush_that_needs_it() {
    let dev = device();
    let mut rng = Rng::new(5);
    let x = Tensor::from_vec(normal_vec(&mut rng, 4096), [64, 64], &dev).requires_grad();
    dev.sync().unwrap();
    // `y` is saved by `exp`'s derivative and held by the program too.
    let y = x.exp();
    let loss = (&y * 2.0).sum();
    loss.item::<f32>().unwrap();
    let launched = dev.kernels_launched();
    let values = y.to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched(), launched, "reading y ran kernels: it was not kept");
    assert_eq!(values.len(), 4096);
    let g = loss.backward().unwrap().get(&x).unwrap().to_vec::<f32>().unwrap();
    for (gi, yi) in g.iter().zip(&values) {
        assert!((gi - 2.0 * yi).abs() <= 1e-5 * yi.abs().max(1.0), "d(2 sum exp x)/dx = 2 exp x: {gi} vs {yi}");
    }
}

#[test]
fn recomputation_follows_the_setting_and_the_variable() {
    let dev = Device::new_cpu();
    assert!(dev.recompute_enabled() || std::env::var("BRAID_RECOMPUTE").is_ok_and(|v| v.trim() == "0"));
    dev.set_recompute(false);
    assert!(!dev.recompute_enabled());
    dev.set_recompute(true);
    dev.set_fusion(false);
    assert!(!dev.recompute_enabled(), "unfused, every recomputed node would be a kernel of its own");
}

/// A small language model's step read eagerly (the loss first, then the backward pass): a
/// layer norm, causal attention, a GELU MLP and the cross-entropy over a vocabulary, all of
/// whose saved elementwise values are candidates. Recomputing keeps fewer bytes between the
/// two flushes, and the gradients equal the reference interpreter's evaluation of exactly what
/// braid recorded.
#[test]
fn an_eager_step_with_recomputed_values_equals_the_reference() {
    let name = "an_eager_step_with_recomputed_values_equals_the_reference";
    if common::skip_without_i64(&device(), name) || !recomputes(&device(), name) {
        return;
    }
    let kept_off = eager_step(false);
    let kept_on = eager_step(true);
    println!("kept between the loss read and the backward pass: {kept_off} B recomputation off, {kept_on} B on");
    assert!(kept_on < kept_off, "recomputation kept {kept_on} B, more than {kept_off} B");
}

/// Runs the step on a fresh device, checks its gradients against the reference; returns the
/// bytes kept between the loss read and the backward pass.
fn eager_step(recompute: bool) -> u64 {
    let dev = device();
    dev.set_recompute(recompute);
    dev.seed(17);
    let (t, d, vocab) = (8, 16, 37);
    let p = |shape: &[usize]| (Tensor::randn(shape.to_vec(), DType::F32, &dev) * 0.3).detach().requires_grad();
    let x = Tensor::randn([t, d], DType::F32, &dev);
    let (wq, wk, wv, w1, w2, head) =
        (p(&[d, d]), p(&[d, d]), p(&[d, d]), p(&[d, 4 * d]), p(&[4 * d, d]), p(&[d, vocab]));
    let mut rng = Rng::new(9);
    let target = Tensor::from_vec((0..t).map(|_| rng.below(vocab) as i64).collect::<Vec<_>>(), [t], &dev);
    dev.sync().unwrap();
    let before = dev.memory().in_use;
    let h = x.layer_norm(1, 1e-5);
    let att = h.matmul(&wq).scaled_dot_product_attention(&h.matmul(&wk), &h.matmul(&wv), true);
    let x2 = &x + &att;
    let mlp = x2.layer_norm(1, 1e-5).matmul(&w1).gelu().matmul(&w2);
    let logits = (&x2 + &mlp).layer_norm(1, 1e-5).matmul(&head);
    let loss = logits.cross_entropy(&target);
    drop((h, att, x2, mlp, logits));
    assert!(loss.item::<f32>().unwrap().is_finite());
    let kept = dev.memory().in_use - before;
    let grads = loss.backward().unwrap();
    let targets: Vec<Tensor> = [&wq, &wk, &wv, &w1, &w2, &head].iter().map(|w| grads.get(w).unwrap()).collect();
    let refs: Vec<&Tensor> = targets.iter().collect();
    let stats = common::check_recorded(&refs).unwrap();
    assert!(stats.checked > 1000, "{stats:?}");
    kept
}

/// Attention's query, key and value split by views from one product (GPT-2's `c_attn`: narrow,
/// reshape, permute), with the backward pass recorded before the loss read: recomputing, the
/// read keeps the product and leaves the three views pending (the attention kernels of both
/// flushes read through them) instead of writing each out as a copy kernel; the bytes kept are
/// no more, and the gradients equal the reference interpreter's.
#[test]
fn attention_heads_split_from_one_product_are_not_copied_for_the_backward_pass() {
    let name = "attention_heads_split_from_one_product_are_not_copied_for_the_backward_pass";
    if !recomputes(&device(), name) {
        return;
    }
    let (kernels_off, kept_off) = split_heads_step(false);
    let (kernels_on, kept_on) = split_heads_step(true);
    println!("the loss read: {kernels_off} kernels and {kept_off} B kept off, {kernels_on} and {kept_on} B on");
    assert_eq!(kernels_on + 3, kernels_off, "on, q, k and v are not copied");
    assert!(kept_on <= kept_off, "on keeps {kept_on} B, off {kept_off} B");
}

/// The step on a fresh device: (kernels the loss read ran, bytes it kept for the backward pass).
fn split_heads_step(recompute: bool) -> (u64, u64) {
    let dev = device();
    dev.set_recompute(recompute);
    dev.seed(23);
    let (b, t, heads, hd) = (2, 12, 3, 8);
    let c = heads * hd;
    let x = Tensor::randn([b * t, c], DType::F32, &dev);
    let w = (Tensor::randn([c, 3 * c], DType::F32, &dev) * 0.3).detach().requires_grad();
    dev.sync().unwrap();
    let before = (dev.memory().in_use, dev.kernels_launched());
    let qkv = x.matmul(&w);
    let head = |at: usize| qkv.narrow(1, at, c).reshape([b, t, heads, hd]).permute(&[0, 2, 1, 3]);
    let y = head(0).scaled_dot_product_attention(&head(c), &head(2 * c), true);
    let loss = y.square().mean();
    drop((qkv, y));
    let grads = loss.backward().unwrap();
    assert!(loss.item::<f32>().unwrap().is_finite());
    let read = (dev.memory().in_use - before.0, dev.kernels_launched() - before.1);
    let dw = grads.get(&w).unwrap();
    let stats = common::check_recorded(&[&dw]).unwrap();
    assert!(stats.checked >= c * 3 * c, "{stats:?}");
    (read.1, read.0)
}

/// A language-model head's step flushed whole (forward and backward passes in one flush, as a
/// captured `Step` runs them): recomputing, the cross-entropy's f32 exponentials are computed
/// again inside the backward kernel from the low-precision logits instead of written by the
/// forward kernel and read back, so the flush's planned peak is lower; the gradients are the
/// bits recomputation off gives, and the reference interpreter's.
#[test]
fn a_step_flushed_whole_computes_its_saved_exponentials_again_in_the_backward_kernel() {
    let Some(low) =
        recomputing_low_precision("a_step_flushed_whole_computes_its_saved_exponentials_again_in_the_backward_kernel")
    else {
        return;
    };
    let (peak_off, dw_off) = whole_step(low, false);
    let (peak_on, dw_on) = whole_step(low, true);
    let (rows, vocab) = (64u64, 1001u64);
    println!("planned peak of the flush: {peak_off} B recomputation off, {peak_on} B on");
    // Off, the exponentials (f32) live from the forward kernel to the backward one; on, the
    // low-precision logits do.
    assert!(peak_off >= peak_on + rows * vocab * (4 - low.size() as u64), "{peak_off} B off, {peak_on} B on");
    assert_eq!(dw_on, dw_off, "the same bits with and without recomputation");
    // The same step captured as a `Step` (its capture copies the same way), replayed twice.
    let dev = device();
    let (h, w, target) = head_inputs(&dev);
    let step = braid::Step::new(move |args: &[Tensor]| {
        let w = args[1].detach().requires_grad();
        let loss = braid::amp::autocast(low, || args[0].matmul(&w)).cross_entropy(&args[2]);
        vec![loss.backward().unwrap().get(&w).unwrap()]
    });
    for _ in 0..2 {
        let dw = step.call(&[h.clone(), w.clone(), target.clone()]).unwrap().remove(0);
        let bits: Vec<u32> = dw.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, dw_off, "the captured step's gradient");
        let text = dev.last_schedule().unwrap().to_text();
        assert!(text.contains("+exp+select+"), "{text}");
    }
}

/// The head's inputs: `h [64, 32]`, `w [32, 1001]` and 64 targets.
fn head_inputs(dev: &Device) -> (Tensor, Tensor, Tensor) {
    let (rows, width, vocab) = (64, 32, 1001);
    let mut rng = Rng::new(3);
    let h = Tensor::from_vec(normal_vec(&mut rng, rows * width), [rows, width], dev);
    let w = Tensor::from_vec(normal_vec(&mut rng, width * vocab), [width, vocab], dev);
    let targets: Vec<i64> = (0..rows).map(|_| rng.below(vocab) as i64).collect();
    (h, w, Tensor::from_vec(targets, [rows], dev))
}

/// The step of `lm_head_step` recorded whole, then its weight gradient read (one flush, checked
/// against the reference): (the flush's planned peak, dW's bits).
fn whole_step(low: DType, recompute: bool) -> (u64, Vec<u32>) {
    let dev = device();
    dev.set_recompute(recompute);
    let (width, vocab) = (32, 1001);
    let (h, w, target) = head_inputs(&dev);
    let w = w.requires_grad();
    dev.sync().unwrap();
    let loss = braid::amp::autocast(low, || h.matmul(&w)).cross_entropy(&target);
    let dw = loss.backward().unwrap().get(&w).unwrap();
    let bits = dw.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
    let schedule = dev.last_schedule().unwrap();
    let dump: serde_json::Value = serde_json::from_str(&schedule.to_json()).unwrap();
    // The backward kernel computes the exponentials again, or reads them.
    let text = schedule.to_text();
    assert_eq!(text.contains("+exp+select+"), recompute, "{text}");
    let stats = common::check_recorded(&[&dw]).unwrap();
    assert!(stats.checked >= width * vocab, "{stats:?}");
    (dump["planned_peak_bytes"].as_u64().unwrap(), bits)
}

#[test]
fn a_training_step_ended_by_a_sync_computes_its_normalized_rows_and_exponentials_again() {
    let Some(low) = recomputing_low_precision(
        "a_training_step_ended_by_a_sync_computes_its_normalized_rows_and_exponentials_again",
    ) else {
        return;
    };
    let (peak_off, grads_off) = normed_step(low, false);
    let (peak_on, grads_on) = normed_step(low, true);
    println!("planned peak of the step's flush: {peak_off} B recomputation off, {peak_on} B on");
    let (rows, width, vocab, layers) = (64u64, 48u64, 1001u64, 3u64);
    // Off, each layer norm's normalized rows (f32) and the cross-entropy's exponentials (f32)
    // live from the forward kernels to the backward ones; on, what they are computed from does.
    let saved = layers * rows * width * 4 + rows * vocab * (4 - low.size() as u64);
    assert!(peak_off >= peak_on + saved, "{peak_off} B off, {peak_on} B on: expected {saved} B less");
    assert_eq!(grads_on, grads_off, "the same bits with and without recomputation");
}

/// A step of `layers` pre-norm residual layers and a head under low-precision autocast,
/// recorded whole and ended by `Device::sync` (nothing read before it), its gradients checked
/// against the reference: (the flush's planned peak, every gradient's bits).
fn normed_step(low: DType, recompute: bool) -> (u64, Vec<Vec<u32>>) {
    let dev = device();
    dev.set_recompute(recompute);
    let (rows, width, vocab, layers) = (64, 48, 1001, 3);
    let model = NormedModel::new(&dev, (rows, width, vocab, layers), 5);
    dev.sync().unwrap();
    let loss = model.loss(low);
    let grads = loss.backward().unwrap();
    let all = model.gradients(&grads);
    drop((loss, grads));
    dev.sync().unwrap();
    let schedule = dev.last_schedule().unwrap();
    let dump: serde_json::Value = serde_json::from_str(&schedule.to_json()).unwrap();
    let bits = all.iter().map(|g| g.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()).collect();
    let stats = common::check_recorded(&all.iter().collect::<Vec<_>>()).unwrap();
    assert!(stats.checked >= width * vocab, "{stats:?}");
    (dump["planned_peak_bytes"].as_u64().unwrap(), bits)
}

#[test]
fn a_step_read_before_its_backward_pass_computes_each_layers_normalized_rows_near_their_readers() {
    let test = "a_step_read_before_its_backward_pass_computes_each_layers_normalized_rows_near_their_readers";
    let Some(low) = recomputing_low_precision(test) else { return };
    let (peak_off, grads_off) = read_then_backward_step(low, false);
    let (peak_on, grads_on) = read_then_backward_step(low, true);
    println!("peak of the step: {peak_off} B recomputation off, {peak_on} B on");
    let (rows, width, layers) = (READ_STEP.0 as u64, READ_STEP.1 as u64, READ_STEP.3 as u64);
    // Off, every layer norm's normalized rows (f32) are stored by the loss read and live until
    // the backward pass reads them; on, each is computed inside (or right before) its readers,
    // so at most one layer's are live at a time, and the cross-entropy's exponentials never.
    let saved = (layers - 1) * rows * width * 4;
    assert!(peak_off >= peak_on + saved, "{peak_off} B off, {peak_on} B on: expected {saved} B less");
    assert_eq!(grads_on, grads_off, "the same bits with and without recomputation");
}

/// Rows, width, vocabulary and layers of `read_then_backward_step` (the layers' values
/// outweigh the head's).
const READ_STEP: (usize, usize, usize, usize) = (64, 192, 251, 6);

/// A step of `layers` pre-norm residual layers and a head under low-precision autocast whose
/// loss is read before its backward pass is recorded; at the start of the backward pass an
/// event gates work on another stream (as a sharded step's next all-gathers are gated). The
/// event waits for the forward pass, never for the values the read left to compute again: its
/// flush runs no kernel. Returns the device's peak over the step and every gradient's bits,
/// the gradients checked against the reference.
fn read_then_backward_step(low: DType, recompute: bool) -> (u64, Vec<Vec<u32>>) {
    let dev = device();
    dev.set_recompute(recompute);
    let (_, width, vocab, _) = READ_STEP;
    let model = NormedModel::new(&dev, READ_STEP, 9);
    dev.sync().unwrap();
    dev.reset_peak();
    let loss = model.loss(low);
    assert!(loss.item::<f32>().unwrap().is_finite());
    let gate = Stream::current(&dev).record_event();
    gate.synchronize().unwrap();
    let dump: serde_json::Value = serde_json::from_str(&dev.last_schedule().unwrap().to_json()).unwrap();
    let kernels = dump["streams"].as_array().unwrap().iter().flat_map(|s| s["steps"].as_array().unwrap());
    assert_eq!(kernels.filter(|s| s["kind"] == "kernel").count(), 0, "the event waited for work: {dump}");
    let side = dev.new_stream();
    side.wait_event(&gate);
    let scaled = side.scope(|| &model.head * 0.5);
    let grads = loss.backward().unwrap();
    let all = model.gradients(&grads);
    drop((loss, grads, gate));
    dev.sync().unwrap();
    assert_eq!(scaled.to_vec::<f32>().unwrap()[0], model.head.to_vec::<f32>().unwrap()[0] * 0.5);
    let peak = dev.memory().peak;
    let bits = all.iter().map(|g| g.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()).collect();
    let stats = common::check_recorded(&all.iter().collect::<Vec<_>>()).unwrap();
    assert!(stats.checked >= width * vocab, "{stats:?}");
    (peak, bits)
}

/// `layers` pre-norm residual layers (`h + (norm(h) * g) W`) and a language-model head, with
/// random parameters, input rows and targets.
struct NormedModel {
    weights: Vec<Tensor>,
    gains: Vec<Tensor>,
    head: Tensor,
    x: Tensor,
    target: Tensor,
}

impl NormedModel {
    fn new(dev: &Device, (rows, width, vocab, layers): (usize, usize, usize, usize), seed: u64) -> NormedModel {
        let mut rng = Rng::new(seed);
        let mut param = |dims: [usize; 2]| {
            let values = normal_vec(&mut rng, dims[0] * dims[1]).iter().map(|v| v * 0.3).collect();
            Tensor::from_vec(values, dims, dev).requires_grad()
        };
        let weights: Vec<Tensor> = (0..layers).map(|_| param([width, width])).collect();
        let gains: Vec<Tensor> = (0..layers).map(|_| param([1, width])).collect();
        let head = param([width, vocab]);
        let x = Tensor::from_vec(normal_vec(&mut rng, rows * width), [rows, width], dev);
        let targets: Vec<i64> = (0..rows).map(|_| rng.below(vocab) as i64).collect();
        let target = Tensor::from_vec(targets, [rows], dev);
        NormedModel { weights, gains, head, x, target }
    }

    /// The cross-entropy loss under `low`-precision autocast.
    fn loss(&self, low: DType) -> Tensor {
        braid::amp::autocast(low, || {
            let mut h = self.x.clone();
            for (w, g) in self.weights.iter().zip(&self.gains) {
                h = &h + &(&h.layer_norm(-1, 1e-5) * g).matmul(w);
            }
            h.layer_norm(-1, 1e-5).matmul(&self.head).cross_entropy(&self.target)
        })
    }

    /// Every parameter's gradient in `grads`.
    fn gradients(&self, grads: &Grads) -> Vec<Tensor> {
        let params = self.weights.iter().chain(&self.gains).chain([&self.head]);
        params.map(|p| grads.get(p).expect("a gradient")).collect()
    }
}
