//! One AdamW step (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01) over GPT-2
//! small's 148 parameter tensors (124M f32 values: embeddings, 12 blocks of attention, MLP and
//! layer norms), from gradients held beforehand: braid's update (every parameter, both moments,
//! the bias corrections) recorded and flushed (`Device::sync`), against PyTorch's `AdamW` in
//! the same command (`python3 benches/peers/optim_torch.py --device cuda`: `foreach` and
//! `fused`), which updates the same tensors in place. Both sides compute every update; braid
//! writes its parameters and moments in place too (the dump's "in place" lists are checked).
//!
//! Printed: milliseconds per step (median of 21 after 3 warm-ups), the kernels of braid's step
//! and its effective bandwidth (28 bytes a parameter: p, g, m, v read, p, m, v written) beside
//! the bandwidth of an in-place pass over as many values measured in the same run (8 bytes a
//! value; a figure far above it would mean skipped work). On the CPU the model is GPT-2's shapes at a quarter of the width and 4 blocks.
//!
//! Run: `BRAID_DEVICE=cuda cargo bench --bench optim_step`.

use braid::Grads;
use braid::optim::{AdamW, Optimizer};
use braid::prelude::*;
#[path = "common/timing.rs"]
mod timing;
use timing::median_ms;

/// GPT-2's parameter shapes at `width`, `layers` blocks, `vocabulary` tokens, 1024 positions.
fn gpt2_shapes(width: usize, layers: usize, vocabulary: usize) -> Vec<Vec<usize>> {
    let mut shapes = vec![vec![vocabulary, width], vec![1024, width]];
    for _ in 0..layers {
        shapes.extend([vec![width], vec![width], vec![width, 3 * width], vec![3 * width], vec![width, width]]);
        shapes.extend([vec![width], vec![width], vec![width], vec![width, 4 * width], vec![4 * width]]);
        shapes.extend([vec![4 * width, width], vec![width]]);
    }
    shapes.extend([vec![width], vec![width]]);
    shapes
}

fn main() {
    let dev = Device::from_env().expect("the device BRAID_DEVICE names");
    let on_cpu = dev.name().starts_with("cpu");
    let shapes = if on_cpu { gpt2_shapes(192, 4, 50257) } else { gpt2_shapes(768, 12, 50257) };
    let numel: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    dev.seed(1);
    let params: Vec<Tensor> =
        shapes.iter().map(|s| (Tensor::randn(s.clone(), DType::F32, &dev) * 0.02).detach().requires_grad()).collect();
    let mut grads = Grads::new();
    for p in &params {
        grads.insert(p, Tensor::randn(p.dims().to_vec(), DType::F32, &dev) * 1e-3);
    }
    dev.sync().unwrap();
    let mut opt = AdamW::new(1e-3);
    let ms = median_ms(3, 21, || {
        opt.update(&params, &grads);
        dev.sync().unwrap();
    });
    let dump = dev.last_schedule().unwrap();
    let text = dump.to_text();
    let kernels = text.lines().filter(|l| l.trim_start().starts_with('k')).count();
    let in_place: usize =
        text.lines().filter_map(|l| l.split("(in place: ").nth(1)).map(|l| l.split(' ').count()).sum();
    assert_eq!(in_place, 3 * params.len(), "every parameter and both moments in place:\n{text}");
    // The device's bandwidth, measured now: an in-place negation of a buffer of the
    // parameters' size (read and written, as the update's buffers are: no fresh pages).
    let mut src = Tensor::randn([numel], DType::F32, &dev);
    dev.sync().unwrap();
    let copy_ms = median_ms(3, 21, || {
        src *= -1.0;
        dev.sync().unwrap();
    });
    let copy_gbs = (8 * numel) as f64 / copy_ms / 1e6;
    let gbs = (28 * numel) as f64 / ms / 1e6;
    println!(
        "optim_step on {}: AdamW over {} tensors, {} values: {ms:.3} ms a step in {kernels} kernels; \
         {gbs:.0} GB/s effective (an in-place pass {copy_gbs:.0} GB/s in the same run)",
        dev.name(),
        params.len(),
        numel
    );
}
