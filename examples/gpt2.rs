//! Trains GPT-2 small (124M parameters: 12 layers, 12 heads, width 768, context 1024, a
//! vocabulary of 50,257, tied embeddings, GELU, pre-norm) with fused attention, AdamW and
//! gradient clipping, in mixed precision by default, on bytes of a bundled text as tokens.
//! Prints the loss, tokens per second and peak device memory; `--save` writes the weights as
//! safetensors under Hugging Face GPT-2's names and `--load` reads them (a downloaded GPT-2
//! `model.safetensors` loads too).
//!
//! Run: `cargo run --release --example gpt2 -- --device cuda --steps 50`
//!      `cargo run --release --example gpt2 -- --small --steps 20` (a small model, for a CPU)

#[path = "common/gpt2.rs"]
mod gpt2;
#[path = "common/logging.rs"]
mod logging;

use braid::amp::{GradScaler, autocast};
use braid::optim::{AdamW, clip_grad_norm};
use braid::prelude::*;
use clap::Parser;
use gpt2::{AdamWConfig, Config, Gpt2};

#[derive(Parser)]
#[command(about = "Train GPT-2 on braid")]
struct Args {
    /// cpu, cuda, cuda:N or wgpu (default: BRAID_DEVICE, else the CPU).
    #[arg(long)]
    device: Option<String>,
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence (default: the model's context).
    #[arg(long)]
    seq: Option<usize>,
    /// Mixed precision: bf16, f16 (with dynamic loss scaling) or off.
    #[arg(long, default_value = "bf16")]
    amp: String,
    /// A small model (2 layers, width 64, context 64, bytes as the vocabulary) instead of 124M.
    #[arg(long)]
    small: bool,
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    /// Weights to start from (safetensors, Hugging Face GPT-2 names).
    #[arg(long)]
    load: Option<String>,
    /// Where to write the trained weights (safetensors, Hugging Face GPT-2 names).
    #[arg(long)]
    save: Option<String>,
    /// Run each step as a captured `braid::Step` (recorded and planned once, then replayed;
    /// the optimizer's moments are the step's arguments and results). Not with `--amp f16`,
    /// whose loss scaling reads every step's gradients back.
    #[arg(long)]
    capture: bool,
}

fn device(name: Option<&str>) -> Result<Device> {
    match name {
        None => Device::from_env(),
        Some("cpu") => Ok(Device::cpu()),
        Some("wgpu") => Device::wgpu(),
        Some("cuda") => Device::cuda(0),
        Some(other) => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Device::cuda(n),
            None => Err(Error::Io(format!("unknown device {other:?}: cpu, cuda, cuda:N or wgpu"))),
        },
    }
}

fn main() -> Result<()> {
    logging::init();
    let args = Args::parse();
    let low = match args.amp.as_str() {
        "bf16" => Some(DType::BF16),
        "f16" => Some(DType::F16),
        "off" => None,
        other => return Err(Error::Io(format!("--amp {other}: bf16, f16 or off"))),
    };
    let device = device(args.device.as_deref())?;
    let cfg = if args.small { Config::SMALL } else { Config::GPT2_124M };
    let seq = args.seq.unwrap_or(cfg.context).min(cfg.context);
    let model = Gpt2::new(cfg, &device, 0);
    let params = model.params();
    if let Some(path) = &args.load {
        params.load(path)?;
    }
    let text = include_bytes!("data/alice.txt");
    println!(
        "GPT-2 {:?}: {:.1}M parameters on {}; {} steps of {} x {seq} tokens, amp {}",
        cfg,
        params.numel() as f64 / 1e6,
        device.name(),
        args.steps,
        args.batch,
        args.amp
    );
    let adamw = AdamWConfig { lr: args.lr, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
    let mut opt = AdamW::new(adamw.lr).betas(adamw.beta1, adamw.beta2).eps(adamw.eps).weight_decay(adamw.weight_decay);
    let mut scaler = (low == Some(DType::F16)).then(GradScaler::new);
    if args.capture && scaler.is_some() {
        return Err(Error::Io(
            "--capture runs bf16 or f32 steps: f16's loss scaling reads each step's gradients".into(),
        ));
    }
    let mut captured = args.capture.then(|| gpt2::CapturedTraining::new(cfg, &params, low, adamw));
    let tokens_per_step = (args.batch * seq) as f64;
    let mut timed = (0.0, 0usize);
    for step in 0..args.steps {
        let start = std::time::Instant::now();
        let (ids, targets) = gpt2::batch(text, args.batch, seq, step, &device);
        let loss = match (&mut captured, &mut scaler) {
            (Some(captured), _) => captured.step(ids, targets)?,
            (None, Some(scaler)) => {
                let loss = autocast(DType::F16, || model.loss(&ids, &targets));
                let mut grads = scaler.scale(&loss).backward()?;
                // Clipping the scaled gradients at the scaled norm is clipping the true ones at 1.
                clip_grad_norm(&params, &mut grads, scaler.get_scale());
                scaler.step(&mut opt, &params, &grads)?;
                scaler.update();
                loss
            }
            (None, None) => gpt2::eager_step(&model, &params, &mut opt, (&ids, &targets), low)?,
        };
        // Reading the loss runs the step: forward, backward and the update.
        let value = loss.item::<f32>()?;
        device.sync()?;
        let secs = start.elapsed().as_secs_f64();
        if step >= 2 {
            // The first steps compile kernels and plan; the rate counts the steps after them.
            timed = (timed.0 + secs, timed.1 + 1);
        }
        println!("step {step:>4}  loss {value:.4}  {:.1} ms  {:.0} tokens/s", secs * 1e3, tokens_per_step / secs);
    }
    if timed.1 > 0 {
        println!(
            "{:.0} tokens/s over steps 2..{} ({:.1} ms a step); peak device memory {:.2} GiB",
            tokens_per_step * timed.1 as f64 / timed.0,
            args.steps,
            timed.0 / timed.1 as f64 * 1e3,
            device.memory().peak as f64 / (1u64 << 30) as f64
        );
    }
    if let Some(captured) = &captured {
        // The model's parameters take the captured step's last values.
        braid::no_grad(|| params.iter().zip(captured.params()).for_each(|(p, v)| p.assign(v)));
    }
    if let Some(path) = &args.save {
        params.save(path)?;
        println!("saved the weights to {path}");
    }
    Ok(())
}
