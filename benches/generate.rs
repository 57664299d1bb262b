//! g8: decode tokens per second of GPT-2 (`examples/common/gpt2.rs`, random weights) with a
//! static key/value cache, greedy sampling on the device, for GPT-2 124M and a 1.5B-shaped
//! model (48 layers, width 1600, 25 heads), batch 1 and 8, weights in bf16, int8 (per channel)
//! and int4 (groups of 128 for 124M, 64 for the 1.5B shape, whose width 1600 is no multiple of
//! 128): every block's four matrices and the output head quantized, the embeddings bf16,
//! activations under bf16 autocast.
//!
//! Each row prefills prompts of 16 tokens, decodes 8 tokens to capture the step (and record
//! its CUDA graph), reads them, then times 100 decode steps (each one replay of the captured
//! `braid::Step`: the whole model for one position of every sequence, the caches written at
//! each sequence's position, the greedy token) and the read of all 100 tokens of every
//! sequence at the end, which waits for the last step. Tokens/s = batch x 100 / that time.
//! What PyTorch computes in the same call (`benches/peers/generate_torch.py`): the same model,
//! static caches written in place (indexed assignment, the cache marked static), SDPA with the
//! length mask, greedy argmax, the 100 tokens read at the end; eager and
//! `torch.compile(mode="reduce-overhead")`.
//!
//! Run: `BRAID_DEVICE=cuda cargo bench --bench generate` (`-- --only gpt2-124m,bf16` for some
//! rows, `-- --prompt 896` for prompts of 896 tokens: a context of 896 to 1,004 positions; on the CPU, the default device, a small model only: 2 layers, width 64, 39 timed
//! steps).

#[path = "../examples/common/gpt2.rs"]
#[allow(dead_code)]
mod gpt2;
#[path = "../examples/common/gpt2_generate.rs"]
#[allow(dead_code)]
mod gpt2_generate;
#[path = "../examples/common/logging.rs"]
mod logging;

use braid::nn::generate::Sampling;
use braid::prelude::*;
use braid::quant::Scheme;
use gpt2::{Config, Gpt2};
use gpt2_generate::Generation;
use std::time::Instant;

/// Prompt tokens a sequence, unless `-- --prompt N` says otherwise.
const PROMPT: usize = 16;
const WARM: usize = 8;

/// Tokens/s of `timed` greedy decode steps of `model` for `batch` prompts of `prompt` tokens,
/// and its kernels a step.
fn decode_rate(model: &Gpt2, batch: usize, prompt: usize, timed: usize) -> Result<(f64, Option<usize>)> {
    let v = model.cfg.vocabulary.min(256) as i32;
    let prompts: Vec<Vec<i32>> =
        (0..batch).map(|i| (0..prompt).map(|j| ((i * 31 + j * 7) as i32) % v).collect()).collect();
    let cache_len = prompt + 1 + WARM + timed;
    let mut g = Generation::new(model, &prompts, cache_len, Sampling::Greedy, Some(DType::BF16), true);
    for _ in 0..WARM {
        g.next()?;
    }
    g.tokens()?;
    let start = Instant::now();
    for _ in 0..timed {
        g.next()?;
    }
    let tokens = g.tokens()?;
    let secs = start.elapsed().as_secs_f64();
    assert!(tokens.iter().all(|t| t.len() == 1 + WARM + timed));
    Ok(((batch * timed) as f64 / secs, g.kernels_per_token()))
}

fn main() -> Result<()> {
    logging::init();
    let device = Device::from_env()?;
    // `-- --only NAME,...`: the rows of the models and weights named (a list that names no model
    // keeps every model, one that names no weights every weights).
    let args: Vec<String> = std::env::args().collect();
    let only: Vec<String> = (args.iter().position(|a| a == "--only"))
        .and_then(|i| args.get(i + 1))
        .map_or_else(Vec::new, |v| v.split(',').map(str::to_string).collect());
    let is_model = |o: &String| o.starts_with("gpt2") || o == "small";
    let wanted_model = |n: &str| !only.iter().any(is_model) || only.iter().any(|o| o == n);
    let wanted_weights = |w: &str| only.iter().all(is_model) || only.iter().any(|o| w.starts_with(o.as_str()));
    // `-- --prompt N`: prompts of N tokens (the attention's context at every timed step).
    let prompt: usize = match (args.iter().position(|a| a == "--prompt")).map(|i| args.get(i + 1)) {
        None => PROMPT,
        Some(n) => n.and_then(|n| n.parse().ok()).unwrap_or_else(|| {
            eprintln!("--prompt takes a number of tokens");
            std::process::exit(2)
        }),
    };
    let on_gpu = device.name().starts_with("cuda");
    // Steps timed: 100, or as many as the small model's context holds.
    let timed = if on_gpu { 100 } else { Config::SMALL.context - PROMPT - 1 - WARM };
    let models: Vec<(&str, Config)> = if on_gpu {
        vec![
            ("gpt2-124m", Config::GPT2_124M),
            ("gpt2-1.5b-shape", Config { layers: 48, heads: 25, width: 1600, context: 1024, vocabulary: 50257 }),
        ]
    } else {
        vec![("small", Config::SMALL)]
    };
    println!("g8 on {}: decode tokens/s, greedy, prompts of {prompt}, {timed} timed steps", device.name());
    let mut warmed = false;
    for (name, cfg) in models.into_iter().filter(|(name, _)| wanted_model(name)) {
        let model = Gpt2::new(cfg, &device, 0);
        if !warmed {
            // The first decoding at a batch size in a process on a GPU machine that has just
            // started ran 30-50x slower than later ones (seen on the H200: 40 tokens/s, then
            // 1,340 for the same row; 261, then 11,957 at batch 8), for the whole row: not
            // explained (BENCHMARKS.md). A warm-up run at both batch sizes, not reported, takes
            // it out of the rows.
            let warm = model.with_matrices_in(DType::BF16);
            for batch in [1, 8] {
                decode_rate(&warm, batch, PROMPT, timed)?;
            }
            warmed = true;
        }
        // Int4's group: the largest of 128, 64 and 32 that divides the width.
        let group = [128, 64, 32].into_iter().find(|g| cfg.width % g == 0).expect("a width of a multiple of 32");
        let int4 = format!("int4-g{group}");
        for (weights, scheme) in
            [("bf16", None), ("int8", Some(Scheme::Int8)), (int4.as_str(), Some(Scheme::Int4 { group }))]
        {
            if !wanted_weights(weights) {
                continue;
            }
            let started = Instant::now();
            let serving = match scheme {
                None => model.with_matrices_in(DType::BF16),
                Some(s) => model.quantized(s, DType::BF16),
            };
            device.sync()?;
            let prepared = started.elapsed().as_secs_f64();
            for batch in [1, 8] {
                let (rate, kernels) = decode_rate(&serving, batch, prompt, timed)?;
                let kernels = kernels.map_or("-".to_string(), |k| k.to_string());
                println!(
                    "g8 {name} {weights} batch {batch}: braid {rate:.0} tokens/s ({kernels} kernels a step; weights prepared in {prepared:.1} s)"
                );
            }
            drop(serving);
            device.trim_memory();
        }
    }
    Ok(())
}
