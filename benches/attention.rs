//! Fused attention (`Tensor::scaled_dot_product_attention`), bf16, causal, at two shapes
//! `[batch, heads, seq, head_dim]`: `[8, 12, 1024, 64]` and `[4, 16, 2048, 128]`. Timed: the
//! forward pass (the output held until the next run; `Device::sync` waits for it) and the
//! forward and backward passes of the loss `sum(f32(y * w))` (`w` a fixed bf16 tensor; the
//! gradients of q, k and v held), each the median of 31 runs after 5 warm-ups; recording and
//! the flush are included, as the peer's eager calls include PyTorch's dispatch. The last
//! output and gradients are read back at the end (their sums printed, so that nothing is
//! skipped).
//!
//! Then the same back to back: 10 calls (10 forward passes, or 10 forward and backward passes)
//! recorded before one flush and one wait, the time divided by 10, against the peer's 10 calls
//! before one synchronisation: the kernels' throughput with the host's work amortised, the
//! figure to compare with FlashAttention's published rates.
//!
//! Printed per shape: the profile of one forward and backward pass (a line per kernel), then
//! milliseconds and TFLOP/s, counting a forward pass as `4 b h s^2 d`
//! flops halved for the causal mask, and a backward pass as 2.5 forward passes (the flops
//! FlashAttention-2 counts; braid's backward recomputes the scores twice, once per kernel, so it
//! does more work than that). The PyTorch peer (`benches/peers/attention_torch.py`, flash
//! backend) prints the same lines.
//!
//! Run: `BRAID_DEVICE=cuda cargo bench --bench attention` (on the CPU, the default device, at a
//! sixteenth of the batch). `--autotune-pairs N`: instead, each shape alternately with tuning
//! off and on, N pairs (`benches/common/autotune_compare.rs`; the attention kernels' tilings
//! are its variants).

use braid::prelude::*;
#[path = "common/timing.rs"]
mod timing;
use timing::median_ms;
#[path = "common/autotune_compare.rs"]
mod autotune_compare;

/// Calls recorded before one wait in the back-to-back timing.
const REPS: usize = 10;

fn main() {
    let dev = Device::from_env().expect("the device BRAID_DEVICE names");
    let on_cpu = dev.name().starts_with("cpu");
    let args: Vec<String> = std::env::args().collect();
    let pairs = args
        .iter()
        .position(|a| a == "--autotune-pairs")
        .map(|i| args.get(i + 1).and_then(|v| v.parse::<usize>().ok()).expect("--autotune-pairs N"));
    if std::env::var_os("RUST_LOG").is_some() {
        let filter = tracing_subscriber::EnvFilter::from_default_env();
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    }
    dev.seed(1);
    let shapes = [[8usize, 12, 1024, 64], [4, 16, 2048, 128]];
    let shapes = shapes.map(|dims| if on_cpu { [1, dims[1] / 4, dims[2], dims[3]] } else { dims });
    if let Some(pairs) = pairs {
        let dev = &dev;
        let workloads = (shapes.iter())
            .map(|&dims| {
                let run = move || {
                    let t = measure(dev, dims, false);
                    let id = |what: &str| format!("g7 {dims:?} {what}");
                    vec![
                        (id("fwd"), t.fwd),
                        (id("fwd+bwd"), t.both),
                        (id("fwd b2b"), t.fwd_b2b),
                        (id("fwd+bwd b2b"), t.both_b2b),
                    ]
                };
                ("g7", Box::new(run) as Box<dyn FnMut() -> Vec<(String, f64)>>)
            })
            .collect();
        println!("attention on {}\n\n{}", dev.name(), autotune_compare::compare(workloads, pairs));
        return;
    }
    for dims in shapes {
        let [b, h, s, d] = dims;
        let t = measure(&dev, dims, true);
        let flops = 4.0 * (b * h * s * s * d) as f64 / 2.0;
        println!(
            "braid attention bf16 causal {dims:?} on {}: forward {:.3} ms ({:.1} TFLOP/s), \
             forward+backward {:.3} ms ({:.1} TFLOP/s); sums of out, dq, dk, dv {:?}",
            dev.name(),
            t.fwd,
            flops / t.fwd / 1e9,
            t.both,
            3.5 * flops / t.both / 1e9,
            t.sums
        );
        println!(
            "braid attention bf16 causal {dims:?} back to back ({REPS} calls a flush): forward {:.3} ms \
             ({:.1} TFLOP/s), forward+backward {:.3} ms ({:.1} TFLOP/s)",
            t.fwd_b2b,
            flops / t.fwd_b2b / 1e9,
            t.both_b2b,
            3.5 * flops / t.both_b2b / 1e9
        );
    }
}

/// One shape's times (milliseconds) and the sums of the last output and gradients.
struct Times {
    fwd: f64,
    both: f64,
    fwd_b2b: f64,
    both_b2b: f64,
    sums: Vec<f32>,
}

/// Times one shape (see the module docs); `profile`: print one profiled forward and backward
/// pass too.
fn measure(dev: &Device, dims: [usize; 4], profile: bool) -> Times {
    let leaf = || Tensor::randn(dims, DType::F32, dev).to_dtype(DType::BF16).detach();
    let (q, k, v, w) = (leaf(), leaf(), leaf(), leaf());
    dev.sync().unwrap();
    let mut held = None;
    let fwd = median_ms(5, 31, || {
        let y = q.scaled_dot_product_attention(&k, &v, true);
        dev.sync().unwrap();
        held = Some(y);
    });
    let y = held.take().unwrap();
    let (q, k, v) = (q.requires_grad(), k.requires_grad(), v.requires_grad());
    let mut grads = None;
    let both = median_ms(5, 31, || {
        let y = q.scaled_dot_product_attention(&k, &v, true);
        let g = (&y * &w).to_dtype(DType::F32).sum().backward().unwrap();
        let held = [g.get(&q).unwrap(), g.get(&k).unwrap(), g.get(&v).unwrap()];
        dev.sync().unwrap();
        grads = Some(held);
    });
    // Back to back: REPS calls recorded before one flush and one wait (held until the next
    // run), as a training step queues its layers: the kernels' throughput, the host's work
    // amortised.
    let mut held_all: Vec<Tensor> = vec![];
    let fwd_b2b = median_ms(2, 11, || {
        let ys: Vec<Tensor> = (0..REPS).map(|_| q.scaled_dot_product_attention(&k, &v, true)).collect();
        dev.sync().unwrap();
        held_all = ys;
    }) / REPS as f64;
    let both_b2b = median_ms(2, 11, || {
        let mut gs = vec![];
        for _ in 0..REPS {
            let y = q.scaled_dot_product_attention(&k, &v, true);
            let g = (&y * &w).to_dtype(DType::F32).sum().backward().unwrap();
            gs.extend([g.get(&q).unwrap(), g.get(&k).unwrap(), g.get(&v).unwrap()]);
        }
        dev.sync().unwrap();
        held_all = gs;
    }) / REPS as f64;
    drop(held_all);
    // One more forward and backward pass, profiled: a line per kernel with its time.
    if profile {
        dev.set_profiling(true);
        let y2 = q.scaled_dot_product_attention(&k, &v, true);
        let g = (&y2 * &w).to_dtype(DType::F32).sum().backward().unwrap();
        let _held = [g.get(&q).unwrap(), g.get(&k).unwrap(), g.get(&v).unwrap()];
        dev.sync().unwrap();
        dev.set_profiling(false);
        if let Some(p) = dev.last_profile() {
            print!("{}", p.to_text());
        }
    }
    let sums: Vec<f32> = std::iter::once(&y)
        .chain(grads.as_ref().unwrap())
        .map(|t| t.to_dtype(DType::F32).sum().item::<f32>().unwrap())
        .collect();
    Times { fwd, both, fwd_b2b, both_b2b, sums }
}
