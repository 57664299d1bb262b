//! `--sharded`: GPT-2 trained with `braid::dist::Sharded` (issue 45). The model of
//! `examples/common/gpt2.rs` at `--model` (`medium`: 24 layers, width 1024, 16 heads, 355M
//! parameters; `small`: GPT-2 small; `tiny`: 2 layers of width 64 for a CPU), one unit per block
//! plus the embeddings and final norm, bf16 autocast with parameters gathered in bf16 (f32
//! shards, reduction and AdamW), `--batch` sequences of `--seq` tokens per rank.
//!
//! Each step records every rank's forward pass (gathering unit by unit) and backward pass
//! (gathered again, reduce-scattered unit by unit), each rank on a thread of its own
//! (`Sharded::record_ranks`; `--one-thread`: every rank on the bench's thread, one after
//! another), AdamW on every rank's shards, and runs it
//! all (`Group::sync`) and reads every rank's loss: what FSDP2's step computes. Measured on 1
//! rank and on `--ranks` ranks (weak scaling: the same batch per rank), the median step after
//! 3 warm-up steps; tokens/s = ranks x batch x seq / step; the peak memory of rank 0's device;
//! from one profiled step of rank 0, the all-gather and reduce-scatter time and how much of it
//! ran while compute kernels ran on another stream.
//!
//! The peer is `benches/peers/fsdp_torch.py` under `torchrun` (the same model, `fully_shard`
//! per block and on the root, `MixedPrecisionPolicy(bf16, f32)`, AdamW), run in the same
//! command on the GPU machine (BENCHMARKS.md has both commands).

use super::gpt2;
use super::overlap;
use braid::dist::{Group, Sharded};
use braid::optim::AdamW;
use braid::prelude::*;
use std::time::{Duration, Instant};

fn config(name: &str) -> gpt2::Config {
    match name {
        "small" => gpt2::Config::GPT2_124M,
        "tiny" => gpt2::Config::SMALL,
        _ => gpt2::Config { layers: 24, heads: 16, width: 1024, context: 1024, vocabulary: 50257 },
    }
}

struct Measured {
    step_ms: f64,
    tokens_per_s: f64,
    peak_bytes: u64,
    comm_ms: f64,
    hidden_ms: f64,
    loss: f32,
    recording_ms: f64,
}

/// Trains on `devices` (one rank each) and measures.
fn measure(devices: &[Device], cfg: gpt2::Config, batch: usize, seq: usize, steps: usize, threads: bool) -> Measured {
    let n = devices.len();
    let group = Group::new(devices).expect("a group");
    let model = gpt2::Gpt2::new(cfg, &devices[0], 1);
    let mut sharded = Sharded::new(&group, &model.units()).with_param_dtype(DType::BF16);
    drop(model);
    let mut opts: Vec<AdamW> = (0..n).map(|_| AdamW::new(6e-4).betas(0.9, 0.95).weight_decay(0.1)).collect();
    let text = include_bytes!("../../examples/data/alice.txt");
    // Host time spent recording the step (every rank), before it runs.
    let mut recording = Vec::new();
    let mut step = |k: usize| -> Vec<Tensor> {
        let t = Instant::now();
        let batch = |r: usize| gpt2::batch(text, batch, seq, k * n + r, &devices[r]);
        let (losses, grads) = if threads {
            sharded
                .record_ranks(|rank| {
                    let (ids, targets) = batch(rank.rank());
                    braid::amp::autocast(DType::BF16, || gpt2::unit_loss(cfg, &ids, &targets, |u| rank.gather(u)))
                })
                .expect("gradients")
        } else {
            let losses: Vec<Tensor> = (0..n)
                .map(|r| {
                    let (ids, targets) = batch(r);
                    braid::amp::autocast(DType::BF16, || gpt2::unit_loss(cfg, &ids, &targets, |u| sharded.gather(r, u)))
                })
                .collect();
            let grads = sharded.backward(&losses).expect("gradients");
            (losses, grads)
        };
        for (r, opt) in opts.iter_mut().enumerate() {
            opt.step(sharded.shards_mut(r), &grads[r]);
        }
        recording.push(t.elapsed().as_secs_f64() * 1e3);
        group.sync().expect("the step runs");
        for l in &losses {
            assert!(l.item::<f32>().expect("a loss").is_finite());
        }
        losses
    };
    for k in 0..3 {
        step(k);
    }
    devices[0].reset_peak();
    let mut times = Vec::new();
    let mut loss = 0.0;
    for k in 3..3 + steps {
        let t = Instant::now();
        let losses = step(k);
        times.push(t.elapsed().as_secs_f64() * 1e3);
        loss = losses[0].item::<f32>().unwrap();
    }
    times.sort_by(f64::total_cmp);
    let step_ms = times[times.len() / 2];
    let peak_bytes = devices[0].memory().peak;
    devices[0].set_profiling(true);
    step(3 + steps);
    devices[0].set_profiling(false);
    recording.sort_by(f64::total_cmp);
    let recording_ms = recording[recording.len() / 2];
    let profile = devices[0].last_profile().expect("a profile");
    let comm_stream = devices[0].comm_stream().id();
    let spans = |pick: &dyn Fn(&braid::profile::ProfileStep) -> bool| -> Vec<(Duration, Duration)> {
        profile.steps.iter().filter(|s| pick(s)).map(|s| (s.start, s.duration)).collect()
    };
    let comm = spans(&|s| s.kind == "kernel" && (s.name.contains("all_gather") || s.name.contains("reduce_scatter")));
    let compute = spans(&|s| s.kind == "kernel" && s.stream != comm_stream);
    let comm_ms = comm.iter().map(|s| s.1.as_secs_f64()).sum::<f64>() * 1e3;
    let hidden_ms = overlap(&comm, &compute).as_secs_f64() * 1e3;
    Measured {
        step_ms,
        tokens_per_s: (n * batch * seq) as f64 / (step_ms / 1e3),
        peak_bytes,
        comm_ms,
        hidden_ms,
        loss,
        recording_ms,
    }
}

pub fn run(devices: &[Device], arg: impl Fn(&str) -> Option<String>) {
    let model = arg("--model").unwrap_or_else(|| "medium".into());
    let cfg = config(&model);
    let batch: usize = arg("--batch").and_then(|v| v.parse().ok()).unwrap_or(8);
    let seq: usize = arg("--seq").and_then(|v| v.parse().ok()).unwrap_or(cfg.context.min(1024));
    let steps: usize = arg("--steps").and_then(|v| v.parse().ok()).unwrap_or(10);
    let n = devices.len();
    println!(
        "sharded data parallel: GPT-2 {model} ({} layers, width {}), bf16 autocast, batch {batch} x {seq} tokens per rank, {n} x {}",
        cfg.layers,
        cfg.width,
        devices[0].name()
    );
    let mut rows = Vec::new();
    let threads = !std::env::args().any(|a| a == "--one-thread");
    let recorded = if threads { "each rank on a thread of its own" } else { "every rank on one thread" };
    for ranks in [1, n] {
        let m = measure(&devices[..ranks], cfg, batch, seq, steps, threads);
        println!(
            "braid sharded, {ranks} rank(s): {:.1} ms/step ({:.1} ms of it recording, {recorded}), {:.0} tokens/s, peak {:.2} GiB on rank 0, all-gather + reduce-scatter {:.1} ms of which {:.1} ms ({:.0}%) under compute, loss {:.3}",
            m.step_ms,
            m.recording_ms,
            m.tokens_per_s,
            m.peak_bytes as f64 / (1u64 << 30) as f64,
            m.comm_ms,
            m.hidden_ms,
            100.0 * m.hidden_ms / m.comm_ms.max(1e-9),
            m.loss
        );
        rows.push((ranks, m));
        if n == 1 {
            break;
        }
    }
    if let [(1, one), (_, many)] = &rows[..] {
        println!(
            "weak-scaling efficiency 1 -> {n} ranks: {:.1}% (target >= 90%)",
            100.0 * many.tokens_per_s / (n as f64 * one.tokens_per_s)
        );
    }
}
