//! `g6`: the GPT-2 124M training step (forward, backward, gradient clipping at 1.0 and AdamW:
//! lr 6e-4, betas (0.9, 0.95), weight decay 0.1) on batches of 8 x 1024 tokens under bf16
//! autocast (`examples/common/gpt2.rs`, fused attention), eager and as a captured
//! `braid::Step` (`gpt2::train_step`: the same arithmetic, moments as arguments), against PyTorch in the same
//! command (`benches/peers/gpt2_torch.py`: the same model with `F.scaled_dot_product_attention`,
//! `torch.autocast(bfloat16)`, fused AdamW and `clip_grad_norm_`, eager and `torch.compile`).
//! Both start from the same weights (braid writes them to `$OUT/gpt2_init.safetensors`, the peer
//! reads them) and take the same batches (windows of the bundled text's bytes at the offsets of
//! `gpt2::batch`); each step's loss is read back, so every step computes the loss, all
//! gradients, the clipping and the update before the clock stops.
//!
//! Printed: each step's loss and time, one more eager step profiled (kernels, their time
//! against the step's, the costliest by name), then the median step (steps 5 and later) as ms,
//! tokens/s and MFU (nanoGPT's count: `6 N + 12 L C T` FLOPs a token with N the parameters
//! without the position table, against the H200's 989 TFLOP/s of dense bf16), and the peak
//! device memory. The losses go to `$OUT/gpt2_braid_losses.json` for the peer to print beside
//! its own.
//!
//! Run: `BRAID_DEVICE=cuda cargo bench --bench gpt2_train -- [--steps N] [--out DIR] [--small]`

#[path = "../examples/common/gpt2.rs"]
mod gpt2;

use braid::optim::AdamW;
use braid::prelude::*;
use gpt2::{AdamWConfig, Config, Gpt2};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// One more eager step, profiled: its kernels, their GPU time against the step's wall time (the
/// rest is the host's recording, planning and launching, or waiting), and the kernels that take
/// the most time, summed by name.
fn profile_one_step(
    dev: &Device,
    model: &Gpt2,
    params: &braid::nn::Params,
    opt: &mut AdamW,
    text: &[u8],
    (batch, seq): (usize, usize),
) -> Result<()> {
    let (ids, targets) = gpt2::batch(text, batch, seq, 1000, dev);
    dev.set_profiling(true);
    let start = std::time::Instant::now();
    let loss = gpt2::eager_step(model, params, opt, (&ids, &targets), Some(DType::BF16))?;
    loss.item::<f32>()?;
    dev.sync()?;
    let wall = start.elapsed();
    dev.set_profiling(false);
    let Some(profile) = dev.last_profile() else { return Ok(()) };
    let kernels: Vec<_> = profile.kernels().collect();
    println!(
        "g6 profile of one eager step: {} kernels, {:.1} ms of kernel time in the flush's {:.1} ms ({:.1} ms from recording to the loss read)",
        kernels.len(),
        profile.kernel_time().as_secs_f64() * 1e3,
        profile.wall.as_secs_f64() * 1e3,
        wall.as_secs_f64() * 1e3
    );
    let mut by_name: Vec<(String, f64, usize)> = vec![];
    for k in &kernels {
        let ms = k.duration.as_secs_f64() * 1e3;
        match by_name.iter_mut().find(|(n, ..)| *n == k.name) {
            Some(e) => (e.1, e.2) = (e.1 + ms, e.2 + 1),
            None => by_name.push((k.name.clone(), ms, 1)),
        }
    }
    by_name.sort_by(|a, b| b.1.total_cmp(&a.1));
    for (name, ms, n) in by_name.iter().take(12) {
        println!("  {ms:8.2} ms  {n:4} x  {name}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let small = std::env::args().any(|a| a == "--small");
    let steps: usize = arg("--steps").and_then(|s| s.parse().ok()).unwrap_or(30);
    let out =
        std::path::PathBuf::from(arg("--out").unwrap_or_else(|| std::env::var("OUT").unwrap_or("bench-out".into())));
    std::fs::create_dir_all(&out).map_err(|e| Error::Io(e.to_string()))?;
    let dev = Device::from_env()?;
    let (cfg, batch) = if small { (Config::SMALL, 4) } else { (Config::GPT2_124M, 8) };
    let seq = cfg.context;
    let text = include_bytes!("../examples/data/alice.txt");
    let adamw = AdamWConfig { lr: 6e-4, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
    let tokens = (batch * seq) as f64;
    let mut losses = vec![];
    for captured in [false, true] {
        // Both runs start from the same weights (the same seed).
        let model = Gpt2::new(cfg, &dev, 0);
        let params = model.params();
        if !captured {
            params.save(out.join("gpt2_init.safetensors"))?;
            println!(
                "g6: GPT-2 {:.1}M parameters, batch {batch} x {seq} tokens, bf16 autocast, on {}",
                params.numel() as f64 / 1e6,
                dev.name()
            );
        }
        let mode = if captured { "captured Step" } else { "eager" };
        let mut opt =
            AdamW::new(adamw.lr).betas(adamw.beta1, adamw.beta2).eps(adamw.eps).weight_decay(adamw.weight_decay);
        let mut captured_run = captured.then(|| gpt2::CapturedTraining::new(cfg, &params, Some(DType::BF16), adamw));
        dev.sync()?;
        dev.reset_peak();
        let (mut run_losses, mut times) = (vec![], vec![]);
        for step in 0..steps {
            let start = std::time::Instant::now();
            let (ids, targets) = gpt2::batch(text, batch, seq, step, &dev);
            let loss = match &mut captured_run {
                Some(run) => run.step(ids, targets)?,
                None => gpt2::eager_step(&model, &params, &mut opt, (&ids, &targets), Some(DType::BF16))?,
            };
            let value = loss.item::<f32>()?;
            dev.sync()?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
            println!("braid {mode} step {step:>3}: loss {value:.4}  {ms:.1} ms");
            run_losses.push(value);
            times.push(ms);
        }
        let mut timed: Vec<f64> = times.iter().skip(5).copied().collect();
        timed.sort_by(f64::total_cmp);
        if let Some(&ms) = timed.get(timed.len() / 2) {
            let n = (params.numel() - cfg.context * cfg.width) as f64;
            let flops = (6.0 * n + 12.0 * (cfg.layers * cfg.width * seq) as f64) * tokens;
            println!(
                "g6 braid {mode}: {ms:.1} ms a step, {:.0} tokens/s, MFU {:.1}% (of 989 TFLOP/s), peak {:.2} GiB",
                tokens / ms * 1e3,
                flops / (ms * 1e-3) / 989e12 * 100.0,
                dev.memory().peak as f64 / (1u64 << 30) as f64
            );
        }
        if !captured {
            losses = run_losses;
            profile_one_step(&dev, &model, &params, &mut opt, text, (batch, seq))?;
        }
    }
    let json = serde_json::to_string(&losses).expect("losses serialise");
    std::fs::write(out.join("gpt2_braid_losses.json"), json).map_err(|e| Error::Io(e.to_string()))?;
    Ok(())
}
