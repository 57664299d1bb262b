//! Data-parallel scaling (issue 18): G3's model (4 x `relu(h @ W + b)`, `mean(h^2)`, backward,
//! SGD) on one device, then data-parallel over N devices with `braid::dist::DataParallel`
//! (gradients all-reduced in buckets on the communication stream), with the same batch per
//! device. Scaling efficiency = (time of a one-device step) / (time of an N-device step), i.e.
//! throughput per device against one device, measured in the same run.
//!
//! Also reports, from one profiled step of rank 0, how much of the all-reduce time ran while
//! compute kernels ran on the other streams (communication overlapping backward).
//!
//! Run on the GPU machine: `bash .gpu/run bin bench-data_parallel --device cuda --out $OUT`
//! (every GPU, NCCL), or here `cargo bench --bench data_parallel -- --device cpu --scale small`
//! (2 CPU devices). Options: `--ranks N`, `--scale full|small` (H = batch per device = 4096, or
//! 256), `--out DIR` (writes `data_parallel.json`).
//!
//! `--sharded` measures sharded data parallel instead (GPT-2, `braid::dist::Sharded`; see
//! `data_parallel/sharded.rs`): `--model medium|small|tiny`, `--batch`, `--seq`, `--steps`.

use braid::dist::{DataParallel, Group};
use braid::optim::Sgd;
use braid::prelude::*;
use std::time::Duration;
#[path = "common/timing.rs"]
mod timing;
use timing::median_ms;
#[path = "../examples/common/gpt2.rs"]
#[allow(dead_code)]
mod gpt2;
#[path = "data_parallel/sharded.rs"]
mod sharded;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn init(dev: &Device, h: usize) -> Vec<Tensor> {
    dev.seed(1);
    let scale = (2.0 / h as f64).sqrt();
    (0..4)
        .flat_map(|_| [Tensor::randn([h, h], DType::F32, dev) * scale, Tensor::rand([h], -0.1, 0.1, DType::F32, dev)])
        .collect()
}

fn loss_of(params: &[Tensor], x: &Tensor) -> Tensor {
    let mut h = x.clone();
    for l in 0..4 {
        h = (h.matmul(&params[2 * l]) + &params[2 * l + 1]).relu();
    }
    (&h * &h).mean()
}

/// Time during which `a`'s spans and `b`'s spans both ran.
fn overlap(a: &[(Duration, Duration)], b: &[(Duration, Duration)]) -> Duration {
    let mut total = Duration::ZERO;
    for &(s, d) in a {
        for &(t, e) in b {
            let (lo, hi) = (s.max(t), (s + d).min(t + e));
            if hi > lo {
                total += hi - lo;
            }
        }
    }
    total
}

fn main() {
    let device = arg("--device").unwrap_or_else(|| std::env::var("BRAID_DEVICE").unwrap_or_else(|_| "cpu".into()));
    let small = arg("--scale").as_deref() == Some("small");
    let gpus = if device.starts_with("cuda") { Device::count("cuda") } else { 0 };
    let ranks: usize = arg("--ranks").and_then(|r| r.parse().ok()).unwrap_or(if gpus > 0 { gpus } else { 2 });
    let devices: Vec<Device> = (0..ranks)
        .map(|i| if device.starts_with("cuda") { Device::new_cuda(i).expect("a GPU") } else { Device::new_cpu() })
        .collect();
    if std::env::args().any(|a| a == "--sharded") {
        sharded::run(&devices, arg);
        return;
    }
    let (h, b) = if small { (256, 256) } else { (4096, 4096) };
    println!("data parallel: G3 model, H={h}, batch {b} per device, {ranks} x {}", devices[0].name());

    // One device.
    let mut single: Vec<Tensor> = init(&devices[0], h).iter().map(|p| p.requires_grad()).collect();
    let x0 = Tensor::randn([b, h], DType::F32, &devices[0]);
    let mut sgd = Sgd::new(0.01);
    let one = median_ms(3, 21, || {
        let loss = loss_of(&single, &x0);
        let grads = loss.backward().unwrap();
        sgd.step(&mut single, &grads);
        devices[0].sync().unwrap();
    });

    // Data-parallel over every device, the same batch on each.
    let group = Group::new(&devices).expect("a group");
    let mut dp = DataParallel::new(&group, &init(&devices[0], h));
    let xs: Vec<Tensor> = devices.iter().map(|d| Tensor::randn([b, h], DType::F32, d)).collect();
    let mut opts: Vec<Sgd> = (0..ranks).map(|_| Sgd::new(0.01)).collect();
    let mut step = || {
        let losses: Vec<Tensor> = (0..ranks).map(|r| loss_of(dp.params(r), &xs[r])).collect();
        let grads = dp.backward(&losses).unwrap();
        for (r, opt) in opts.iter_mut().enumerate() {
            opt.step(dp.params_mut(r), &grads[r]);
        }
        group.sync().unwrap();
        losses
    };
    let many = median_ms(3, 21, || drop(step()));
    // One profiled step: all-reduce time on rank 0 that overlaps compute on other streams.
    devices[0].set_profiling(true);
    let losses = step();
    let loss = losses[0].item::<f32>().unwrap();
    assert!(loss.is_finite());
    devices[0].set_profiling(false);
    // The replicas stay identical (every rank applies the same averaged gradient).
    let first: Vec<Vec<f32>> = (0..ranks).map(|r| dp.params(r)[0].to_vec::<f32>().unwrap()).collect();
    assert!(first.iter().all(|w| *w == first[0]), "replicas diverged");
    let profile = devices[0].last_profile().expect("a profile");
    let comm_stream = devices[0].comm_stream().id();
    let spans = |pick: &dyn Fn(&braid::profile::ProfileStep) -> bool| -> Vec<(Duration, Duration)> {
        profile.steps.iter().filter(|s| pick(s)).map(|s| (s.start, s.duration)).collect()
    };
    let comm = spans(&|s| s.kind == "kernel" && s.name.contains("all_reduce"));
    let compute = spans(&|s| s.kind == "kernel" && s.stream != comm_stream);
    let comm_total: Duration = comm.iter().map(|s| s.1).sum();
    let hidden = overlap(&comm, &compute);
    let efficiency = one / many;
    println!("one device: {one:.2} ms per step ({b} samples)");
    println!(
        "{ranks} devices: {many:.2} ms per step ({} samples): scaling efficiency {:.1}% (target >= 90%)",
        b * ranks,
        100.0 * efficiency
    );
    println!(
        "rank 0, one profiled step: {} all-reduce(s), {:.2} ms of all-reduce, {:.2} ms of it while compute ran on another stream ({:.0}%); {} kernels in the flush",
        comm.len(),
        comm_total.as_secs_f64() * 1e3,
        hidden.as_secs_f64() * 1e3,
        100.0 * hidden.as_secs_f64() / comm_total.as_secs_f64().max(1e-12),
        profile.steps.iter().filter(|s| s.kind == "kernel").count()
    );
    let out = arg("--out").or_else(|| std::env::var("OUT").ok()).unwrap_or_else(|| "bench-out".into());
    let _ = std::fs::create_dir_all(&out);
    let json = serde_json::json!({
        "device": devices[0].name(), "ranks": ranks, "h": h, "batch_per_device": b,
        "one_device_ms": one, "data_parallel_ms": many, "scaling_efficiency": efficiency,
        "allreduce_ms": comm_total.as_secs_f64() * 1e3, "allreduce_overlapped_ms": hidden.as_secs_f64() * 1e3,
        "allreduces": comm.len(),
    });
    let path = std::path::Path::new(&out).join("data_parallel.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).expect("write the JSON");
    println!("wrote {}", path.display());
}
