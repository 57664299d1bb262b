//! Trains the mini GPT of BENCH.md C5 (46,337 parameters) on a few lines of text, one SGD step
//! per sample, and prints the loss falling.
//!
//! Run: `cargo run --release --example mini_gpt [steps]`

#[path = "common/logging.rs"]
mod logging;
#[path = "common/mini_gpt.rs"]
mod mini_gpt;

use braid::optim::{Optimizer, Sgd};
use braid::prelude::*;
use mini_gpt::{CONTEXT, MiniGpt};

fn main() -> Result<()> {
    logging::init();
    let steps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(600);
    let device = Device::from_env()?;
    let model = MiniGpt::new(&device, 0);
    let params = model.params();
    println!("mini GPT: {} parameters on {}", params.numel(), device.name());
    let tokens = mini_gpt::tokens();
    let mut opt = Sgd::new(0.1);
    let start = std::time::Instant::now();
    let mut window = 0.0;
    for step in 0..steps {
        let at = (step * 7) % (tokens.len() - CONTEXT - 1);
        let loss = model.loss(&tokens[at..at + CONTEXT], &tokens[at + 1..at + CONTEXT + 1]);
        let grads = loss.backward()?;
        opt.update(&params, &grads);
        // Reading the loss runs what it needs: this forward, and the previous step's backward
        // and update (its parameters' new versions). Every such flush has the same structure,
        // so after the first few it replays a cached schedule.
        window += loss.item::<f32>()?;
        if step % 50 == 49 {
            println!("steps {:4}-{:4}: mean loss {:.3}", step - 49, step, window / 50.0);
            window = 0.0;
        }
    }
    let per_step = start.elapsed().as_secs_f64() / steps as f64;
    println!("{:.2} ms per step; peak device memory {} KiB", per_step * 1e3, device.memory().peak / 1024);
    Ok(())
}
