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
//! Printed: each step's loss and time (and how long the call took to return: recording and
//! issuing), one more eager step profiled (its kernels' time against the step's, by kind and
//! the costliest; every kernel to `$OUT/g6_kernels.tsv`), one more captured step profiled (its
//! kernels to `$OUT/g6_captured_kernels.tsv`), then the median step (steps 5 and later) as ms,
//! tokens/s and MFU (nanoGPT's count: `6 N + 12 L C T` FLOPs a token with N the parameters
//! without the position table, against the H200's 989 TFLOP/s of dense bf16), and the peak
//! device memory. The losses go to `$OUT/gpt2_braid_losses.json` for the peer to print beside
//! its own.
//!
//! Run: `BRAID_DEVICE=cuda cargo bench --bench gpt2_train -- [--steps N] [--out DIR] [--small] [--dump]`

#[path = "../examples/common/gpt2.rs"]
mod gpt2;

use braid::optim::AdamW;
use braid::prelude::*;
use gpt2::{AdamWConfig, Config, Gpt2};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// One more eager step, profiled: its flushes (one: `gpt2::eager_step` flushes the whole step),
/// their kernels' GPU time against each flush's wall time (the rest is the host's planning and
/// launching, or waiting), the time by kind of kernel, and the costliest kernels; every kernel
/// goes to `out/g6_kernels.tsv`, and with `--dump` the step's flushes to `out/g6_dump/`.
fn profile_one_step(
    dev: &Device,
    model: &Gpt2,
    params: &braid::nn::Params,
    opt: &mut AdamW,
    text: &[u8],
    (batch, seq): (usize, usize),
    (out, dump): (&std::path::Path, bool),
) -> Result<()> {
    let (ids, targets) = gpt2::batch(text, batch, seq, 1000, dev);
    dev.set_profiling(true);
    // With `--dump`, the step's flushes as dumps too: the kernels' shapes and buffers, by the
    // names the listing prints (writing them adds to the step's wall time, not its kernels').
    if dump {
        let dumps = out.join("g6_dump");
        std::fs::create_dir_all(&dumps).map_err(|e| Error::Io(e.to_string()))?;
        braid::dump::set_dir(Some(dumps));
    }
    let start = std::time::Instant::now();
    let loss = gpt2::eager_step(model, params, opt, (&ids, &targets), Some(DType::BF16))?;
    let recorded = start.elapsed();
    loss.item::<f32>()?;
    let forward = dev.last_profile();
    dev.sync()?;
    let wall = start.elapsed();
    dev.set_profiling(false);
    if dump {
        braid::dump::set_dir(None);
    }
    let mut profiles: Vec<_> = forward.into_iter().chain(dev.last_profile()).collect();
    profiles.dedup_by_key(|p| p.flush);
    let kernels: Vec<_> = profiles.iter().flat_map(|p| p.kernels()).collect();
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    println!(
        "g6 profile of one eager step: {:.1} ms from the first op to the end of the sync ({:.1} ms recording and issuing); {} kernels, {:.1} ms of kernel time",
        ms(wall),
        ms(recorded),
        kernels.len(),
        kernels.iter().map(|k| ms(k.duration)).sum::<f64>(),
    );
    for p in &profiles {
        println!(
            "  flush {}: {} kernels, {:.1} ms of kernel time in {:.1} ms of wall time",
            p.flush,
            p.kernels().count(),
            ms(p.kernel_time()),
            ms(p.wall)
        );
    }
    // Kind: what the label names first after the kernel's number (`k3 matmul+cast [..]`).
    let kind =
        |name: &str| name.split_whitespace().nth(1).and_then(|ops| ops.split('+').next()).unwrap_or("?").to_string();
    let mut by_kind: Vec<(String, f64, usize)> = vec![];
    for k in &kernels {
        let (name, t) = (kind(&k.name), ms(k.duration));
        match by_kind.iter_mut().find(|(n, ..)| *n == name) {
            Some(e) => (e.1, e.2) = (e.1 + t, e.2 + 1),
            None => by_kind.push((name, t, 1)),
        }
    }
    by_kind.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!("  by the first op of the kernel:");
    for (name, t, n) in &by_kind {
        println!("  {t:8.2} ms  {n:4} x  {name}");
    }
    // Every kernel of the step, in the order the flushes ran them, for a closer look.
    let listing: String = kernels.iter().map(|k| format!("{:.4}\t{}\t{}\n", ms(k.duration), k.bytes, k.name)).collect();
    let list = out.join("g6_kernels.tsv");
    std::fs::write(&list, format!("ms\tbytes\tkernel\n{listing}")).map_err(|e| Error::Io(e.to_string()))?;
    println!("  every kernel: {}", list.display());
    let mut costliest = kernels.clone();
    costliest.sort_by_key(|k| std::cmp::Reverse(k.duration));
    println!("  the costliest kernels:");
    for k in costliest.iter().take(25) {
        let gbs = k.bytes as f64 / k.duration.as_secs_f64().max(1e-9) / 1e9;
        println!("  {:8.3} ms  {:8.1} MB  {gbs:7.0} GB/s  {}", ms(k.duration), k.bytes as f64 / 1e6, k.name);
    }
    Ok(())
}

fn main() -> Result<()> {
    let small = std::env::args().any(|a| a == "--small");
    let dump = std::env::args().any(|a| a == "--dump");
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
            let issued = start.elapsed().as_secs_f64() * 1e3;
            let value = loss.item::<f32>()?;
            dev.sync()?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
            println!(
                "braid {mode} step {step:>3}: loss {value:.4}  {ms:.1} ms ({issued:.1} ms until the step returned)"
            );
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
        match &mut captured_run {
            None => {
                losses = run_losses;
                profile_one_step(&dev, &model, &params, &mut opt, text, (batch, seq), (&out, dump))?;
            }
            Some(run) => {
                // One more captured step, profiled (it runs as a flush then): its kernels' GPU
                // time against its wall time and the step's.
                let (ids, targets) = gpt2::batch(text, batch, seq, steps, &dev);
                dev.set_profiling(true);
                let start = std::time::Instant::now();
                run.step(ids, targets)?.item::<f32>()?;
                dev.sync()?;
                let ms = start.elapsed().as_secs_f64() * 1e3;
                dev.set_profiling(false);
                if let Some(p) = dev.last_profile() {
                    println!(
                        "g6 profile of one captured step: {ms:.1} ms; {} kernels, {:.1} ms of kernel time in {:.1} ms of the flush's wall time",
                        p.kernels().count(),
                        p.kernel_time().as_secs_f64() * 1e3,
                        p.wall.as_secs_f64() * 1e3
                    );
                    let listing: String = (p.kernels())
                        .map(|k| format!("{:.4}\t{}\t{}\n", k.duration.as_secs_f64() * 1e3, k.bytes, k.name))
                        .collect();
                    let list = out.join("g6_captured_kernels.tsv");
                    std::fs::write(&list, format!("ms\tbytes\tkernel\n{listing}"))
                        .map_err(|e| Error::Io(e.to_string()))?;
                    println!("  every kernel of it: {}", list.display());
                }
            }
        }
    }
    let json = serde_json::to_string(&losses).expect("losses serialise");
    std::fs::write(out.join("gpt2_braid_losses.json"), json).map_err(|e| Error::Io(e.to_string()))?;
    Ok(())
}
