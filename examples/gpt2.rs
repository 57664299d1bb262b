//! Trains GPT-2 small (124M parameters: 12 layers, 12 heads, width 768, context 1024, a
//! vocabulary of 50,257, tied embeddings, GELU, pre-norm) with fused attention, AdamW and
//! gradient clipping, in mixed precision by default, on bytes of a bundled text as tokens.
//! Prints the loss, tokens per second and peak device memory; `--save` writes the weights as
//! safetensors under Hugging Face GPT-2's names and `--load` reads them (a downloaded GPT-2
//! `model.safetensors` loads too).
//!
//! `generate` continues prompts instead (bytes as tokens): a prefill with the fused attention,
//! then one decode step a token over static key/value caches, captured once as a `braid::Step`
//! (one CUDA graph a token on CUDA), sampling on the device.
//!
//! Run: `cargo run --release --example gpt2 -- --device cuda --steps 50`
//!      `cargo run --release --example gpt2 -- --small --steps 20` (a small model, for a CPU)
//!      `cargo run --release --example gpt2 -- --small --steps 300 --save w.safetensors`, then
//!      `cargo run --release --example gpt2 -- --small --load w.safetensors generate --prompt Alice`

#[path = "common/gpt2.rs"]
mod gpt2;
#[path = "common/gpt2_generate.rs"]
mod gpt2_generate;
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
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Continue prompts with the model (`--load` trained weights first) instead of training.
    Generate(GenerateArgs),
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A prompt (bytes as tokens); repeat the flag for a batch of prompts of any lengths.
    #[arg(long, default_value = "Alice was")]
    prompt: Vec<String>,
    /// Tokens to generate after each prompt.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// greedy, temperature:T or topk:K:T.
    #[arg(long, default_value = "greedy")]
    sampling: String,
    /// Decode op by op instead of replaying the captured step.
    #[arg(long)]
    eager: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Serve with weight-only quantized products: int8, or int4:G (groups of G = 32, 64 or 128).
    #[arg(long)]
    quant: Option<String>,
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
    if let Some(Command::Generate(g)) = &args.command {
        return generate(&model, low, g, &device);
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

fn sampling(spec: &str) -> Result<braid::nn::generate::Sampling> {
    use braid::nn::generate::Sampling;
    let bad = || Error::Io(format!("--sampling {spec}: greedy, temperature:T or topk:K:T"));
    let parts: Vec<&str> = spec.split(':').collect();
    let num = |s: &str| s.parse::<f64>().map_err(|_| bad());
    match parts[..] {
        ["greedy"] => Ok(Sampling::Greedy),
        ["temperature", t] => Ok(Sampling::Temperature(num(t)?)),
        ["topk", k, t] => Ok(Sampling::TopK { k: k.parse().map_err(|_| bad())?, temperature: num(t)? }),
        _ => Err(bad()),
    }
}

fn scheme(spec: &str) -> Result<braid::quant::Scheme> {
    use braid::quant::Scheme;
    match spec.split_once(':') {
        None if spec == "int8" => Ok(Scheme::Int8),
        Some(("int4", g)) if matches!(g, "32" | "64" | "128") => Ok(Scheme::Int4 { group: g.parse().unwrap_or(32) }),
        _ => Err(Error::Io(format!("--quant {spec}: int8, int4:32, int4:64 or int4:128"))),
    }
}

/// `generate`: continues each prompt by `--tokens` tokens and prints them (as text).
fn generate(model: &Gpt2, low: Option<DType>, g: &GenerateArgs, device: &Device) -> Result<()> {
    let how = sampling(&g.sampling)?;
    let prompts: Vec<Vec<i32>> = g.prompt.iter().map(|p| p.bytes().map(i32::from).collect()).collect();
    if prompts.iter().any(Vec::is_empty) {
        return Err(Error::Io("a prompt needs at least one byte".into()));
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let cache_len = longest + g.tokens;
    if cache_len > model.cfg.context {
        return Err(Error::Io(format!("{longest} + {} tokens exceed the context ({})", g.tokens, model.cfg.context)));
    }
    // Serving in low precision: the matrices cast (or quantized) once, not at every step.
    let serving = match g.quant.as_deref() {
        None => model.with_matrices_in(low.unwrap_or(DType::F32)),
        Some(q) => model.quantized(scheme(q)?, low.unwrap_or(DType::F32)),
    };
    device.seed(g.seed);
    let start = std::time::Instant::now();
    let mut run = gpt2_generate::Generation::new(&serving, &prompts, cache_len, how, low, !g.eager);
    for _ in 1..g.tokens {
        run.next()?;
    }
    let tokens = run.tokens()?;
    let secs = start.elapsed().as_secs_f64();
    for (p, t) in g.prompt.iter().zip(&tokens) {
        let text: Vec<u8> = t.iter().map(|&b| b.clamp(0, 255) as u8).collect();
        println!("{p}{}", String::from_utf8_lossy(&text));
    }
    println!(
        "{} sequences x {} tokens in {:.2} s ({:.0} tokens/s with the prefill and first captures){}",
        tokens.len(),
        g.tokens,
        secs,
        (tokens.len() * g.tokens) as f64 / secs,
        run.kernels_per_token().map_or(String::new(), |k| format!("; {k} kernels a token"))
    );
    Ok(())
}
