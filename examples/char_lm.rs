//! Trains a character-level language model on a bundled text (the opening of *Alice's
//! Adventures in Wonderland*) with `Embedding`, `Linear`, `LayerNorm`, `cross_entropy` and
//! AdamW; prints the loss falling and a sample, saves the weights, loads them into a fresh
//! model and checks that it gets the same loss.
//!
//! Run: `cargo run --release --example char_lm [steps]`

#[path = "common/char_lm.rs"]
mod char_lm;
#[path = "common/logging.rs"]
mod logging;

use braid::prelude::*;
use char_lm::{CharLm, Config, Corpus};

fn main() -> Result<()> {
    logging::init();
    let mut cfg = Config::EXAMPLE;
    if let Some(steps) = std::env::args().nth(1).and_then(|s| s.parse().ok()) {
        cfg.steps = steps;
    }
    let device = Device::from_env()?;
    let corpus = Corpus::new(char_lm::TEXT);
    println!(
        "{} characters, a vocabulary of {}, {} steps of {} windows of {} on {}",
        corpus.ids.len(),
        corpus.vocabulary(),
        cfg.steps,
        cfg.batch,
        cfg.context,
        device.name()
    );
    let start = std::time::Instant::now();
    let mut window = Vec::new();
    let model = char_lm::train(&corpus, &cfg, &device, |step, loss| {
        window.push(loss);
        if window.len() == 100 || step + 1 == cfg.steps {
            let mean = window.iter().sum::<f32>() / window.len() as f32;
            println!("step {:>5}  loss {mean:.3}  ({:.1} s)", step + 1, start.elapsed().as_secs_f64());
            window.clear();
        }
    })?;
    println!("{} parameters", model.params().numel());
    let loss = char_lm::eval_loss(&model, &corpus, &device)?;
    println!("loss on 512 fixed windows: {loss:.4}");
    println!("sample: {}", char_lm::sample(&model, &corpus, &device, "Alice was beginning", 200)?);

    let path = std::env::temp_dir().join(format!("braid-char-lm-{}.safetensors", std::process::id()));
    model.params().save(&path)?;
    device.seed(99);
    let fresh = CharLm::new(corpus.vocabulary(), &cfg, &device);
    let untrained = char_lm::eval_loss(&fresh, &corpus, &device)?;
    fresh.params().load(&path)?;
    let reloaded = char_lm::eval_loss(&fresh, &corpus, &device)?;
    std::fs::remove_file(&path).map_err(|e| Error::Io(e.to_string()))?;
    println!("a fresh model: loss {untrained:.4}; with the saved weights loaded: {reloaded:.4}");
    if reloaded.to_bits() != loss.to_bits() {
        return Err(Error::Internal(format!("the reloaded model's loss {reloaded} is not {loss}")));
    }
    Ok(())
}
