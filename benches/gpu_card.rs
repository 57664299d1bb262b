//! The GPU bench card (shared/BENCH.md G1-G5) on any device, side by side with PyTorch (eager,
//! `torch.compile`, `save_on_cpu` for G5) run by `benches/peers/gpu_torch.py` in the same command,
//! and one table written as Markdown and JSON.
//!
//! Run (on the GPU machine, from the repository root):
//! `bash .gpu/run bin bench-gpu_card --device cuda --out $OUT`, or here
//! `cargo bench --bench gpu_card -- --device cpu --scale small`. Options: `--device cpu|cuda|cuda:N|wgpu`
//! (default `BRAID_DEVICE`, else cpu), `--scale full|small` (BENCH.md's sizes, or small ones for
//! a quick check), `--only g1,g3`, `--out DIR` (default `$OUT`, else `bench-out`), `--no-peers`,
//! `--autotune-pairs N` (instead of the card: each workload alternately with tuning off and on,
//! N pairs, `benches/common/autotune_compare.rs`).
//! The peer script is found relative to the current directory.
//!
//! Every workload is checked first (against f64 on the host, or against the same workload on the
//! CPU device), then timed as the median of at least 21 runs after a warm-up; each run records
//! its work, synchronises the device and only then lets its outputs go, so nothing is skipped.
//! Each run holds exactly what its peer computes (G3 applies SGD to every parameter; G5 holds
//! every weight's gradient, as `loss.backward()` fills every `.grad`), each row's check line
//! says what both sides compute, and a row whose step ran fewer matrix products than the
//! workload has by construction fails (`ScheduleDump::product_count`, `benches/common/products.rs`).
//! Bandwidth is shown as a fraction of the device-to-device copy bandwidth PyTorch measures in
//! the same run (on the CPU, of a host memcpy measured here); peak memory is the device's peak
//! over what was live before the run.

#[path = "common/autotune_compare.rs"]
mod autotune_compare;
#[path = "common/products.rs"]
mod products;
#[path = "gpu_card/report.rs"]
mod report;
#[path = "common/timing.rs"]
mod timing;
#[path = "gpu_card/workloads.rs"]
mod workloads;

use braid::prelude::*;
use report::Row;
use std::path::PathBuf;
use std::process::Command;
use workloads::Scale;

struct Options {
    device: Device,
    scale: Scale,
    only: Option<Vec<String>>,
    out: PathBuf,
    peers: bool,
    /// Pairs of runs with tuning off and on, instead of the card.
    autotune_pairs: Option<usize>,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    if let Some(d) = value("--device") {
        // SAFETY: set before any thread of this program starts.
        unsafe { std::env::set_var("BRAID_DEVICE", d) };
    }
    let device = Device::from_env().unwrap_or_else(|e| panic!("gpu_card: {e}"));
    let scale = match value("--scale").as_deref() {
        Some("small") => Scale::Small,
        None | Some("full") => Scale::Full,
        Some(other) => panic!("gpu_card: --scale {other}: expected full or small"),
    };
    let out = value("--out").or_else(|| std::env::var("OUT").ok()).unwrap_or_else(|| "bench-out".into());
    Options {
        device,
        scale,
        only: value("--only").map(|v| v.split(',').map(|s| s.trim().to_lowercase()).collect()),
        out: PathBuf::from(out),
        peers: !args.iter().any(|a| a == "--no-peers") && std::env::var_os("BRAID_NO_PEERS").is_none(),
        autotune_pairs: value("--autotune-pairs").map(|v| v.parse().expect("--autotune-pairs N")),
    }
}

/// One line of the peer script's output: `{"id": "g1", "variant": "eager", "ms": 1.09, ...}`.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
struct PeerRow {
    id: String,
    variant: String,
    ms: f64,
    #[serde(default)]
    peak_extra_bytes: Option<u64>,
}

/// Runs the PyTorch peer script for `ids` on the same GPU; its rows, or why there are none.
fn peers(opts: &Options, ids: &[&str]) -> Result<Vec<PeerRow>, String> {
    if !opts.peers {
        return Err("--no-peers".into());
    }
    let script = PathBuf::from("benches/peers/gpu_torch.py");
    if !script.exists() {
        return Err(format!("{} not found (run from the repository root)", script.display()));
    }
    let device = if opts.device.name().starts_with("cuda") { "cuda" } else { "cpu" };
    let scale = if opts.scale == Scale::Small { "small" } else { "full" };
    let out = Command::new("python3")
        .arg(&script)
        .args(["--device", device, "--scale", scale, "--only", &ids.join(",")])
        .output()
        .map_err(|e| format!("python3: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("failed").to_string());
    }
    Ok(String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
}

/// Checks and times workload `id`.
fn run_workload(id: &str, dev: &Device, scale: Scale) -> Row {
    match id {
        "g1" => workloads::g1(dev, scale),
        "g2" => workloads::g2(dev, scale),
        "g3" => workloads::g3(dev, scale),
        "g4" => workloads::g4(dev, scale),
        _ => workloads::g5(dev, scale),
    }
}

fn main() {
    // `RUST_LOG=braid::kernel=debug` shows each kernel's host issue time, for example.
    if std::env::var_os("RUST_LOG").is_some() {
        let filter = tracing_subscriber::EnvFilter::from_default_env();
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    }
    let opts = options();
    let dev = &opts.device;
    let wanted = |id: &str| opts.only.as_ref().is_none_or(|o| o.iter().any(|x| x == id));
    let ids: Vec<&str> = ["g1", "g2", "g3", "g4", "g5"].into_iter().filter(|id| wanted(id)).collect();
    println!("gpu_card on {} ({:?} scale)", dev.name(), opts.scale);
    if let Some(pairs) = opts.autotune_pairs {
        let scale = opts.scale;
        let workloads = ids
            .iter()
            .map(|&id| {
                let run = move || {
                    let row = run_workload(id, dev, scale);
                    std::iter::once(&row).chain(&row.extra).map(|r| (r.id.to_string(), r.ms)).collect()
                };
                (id, Box::new(run) as Box<dyn FnMut() -> Vec<(String, f64)>>)
            })
            .collect();
        println!("\n{}", autotune_compare::compare(workloads, pairs));
        return;
    }
    // The peers run first, while this process holds no GPU memory.
    let peer_rows = peers(&opts, &ids);
    let copy_gbs = match &peer_rows {
        Ok(rows) => rows.iter().find(|r| r.id == "copy").map(|r| r.ms),
        Err(_) => None,
    };
    let mut rows: Vec<Row> = Vec::new();
    for id in &ids {
        let row = run_workload(id, dev, opts.scale);
        let extra = row.extra.clone();
        println!("{}", row.line());
        extra.iter().for_each(|e| println!("{}", e.line()));
        rows.push(row);
        rows.extend(extra);
    }
    // The copy floor: PyTorch's device-to-device copy in this run (its "ms" field carries GB/s),
    // or a host memcpy measured here on the CPU.
    let floor = copy_gbs.or_else(|| (dev.name() == "cpu").then(report::host_copy_gbs));
    let table = report::table(&rows, peer_rows.as_ref().map(Vec::as_slice).unwrap_or(&[]), floor, &peer_rows);
    println!("\n{table}");
    if let Err(e) = std::fs::create_dir_all(&opts.out).and_then(|()| {
        std::fs::write(opts.out.join("gpu_card.md"), &table)?;
        let json = serde_json::json!({
            "device": dev.name(),
            "scale": format!("{:?}", opts.scale),
            "copy_floor_gbs": floor,
            "braid": rows.iter().map(Row::json).collect::<Vec<_>>(),
            "peers": peer_rows.as_ref().ok(),
            "peers_error": peer_rows.as_ref().err(),
        });
        std::fs::write(opts.out.join("gpu_card.json"), serde_json::to_string_pretty(&json).unwrap())
    }) {
        eprintln!("gpu_card: could not write {}: {e}", opts.out.display());
    }
}
