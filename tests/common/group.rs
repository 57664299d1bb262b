//! Helpers of the multi-rank suites (`tests/dist.rs`, `tests/sharded.rs`), included by path:
//! the devices of a group of the kind `BRAID_DEVICE` names, a closeness check, and running an
//! ignored test of the same binary as the processes of one group.

use braid::prelude::*;
use std::io::Write;
use std::time::{Duration, Instant};

/// Held by every test of a multi-rank suite: two groups' NCCL calls from different threads at
/// once may wait for each other forever (see `braid::dist`), so the tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `n` devices of the kind `BRAID_DEVICE` names, one per rank, or `None` (with a message)
/// when this machine cannot make a group of `n` of them.
pub fn ranks(n: usize, test: &str) -> Option<Vec<Device>> {
    let kind = std::env::var("BRAID_DEVICE").unwrap_or_default();
    let skip = |why: String| {
        let _ = writeln!(std::io::stderr(), "skipped: {test}: {why}");
        None
    };
    match kind.trim() {
        "" | "cpu" => Some((0..n).map(|_| Device::new_cpu()).collect()),
        k if k.starts_with("cuda") => {
            let count = Device::count("cuda");
            if count < n {
                return skip(format!("needs {n} GPUs, this machine has {count}"));
            }
            Some((0..n).map(|i| Device::new_cuda(i).expect("a GPU the driver lists")).collect())
        }
        other => skip(format!("BRAID_DEVICE={other} runs no collectives")),
    }
}

/// Every element of `a` within `tol` (relative to `1 + |b|`) of `b`'s.
pub fn close(a: &[f32], b: &[f32], tol: f32) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("lengths {} and {}", a.len(), b.len()));
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if (x - y).abs() > tol * (1.0 + y.abs()) {
            return Err(format!("element {i}: {x} vs {y}"));
        }
    }
    Ok(())
}

/// Runs the ignored test `worker` of this binary as the 2 processes of one group (RANK,
/// WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as torchrun sets them) and checks that each exits
/// successfully, printing `{marker} {rank}: ok`. Skips (saying why) where the device kind
/// cannot make such a group.
pub fn run_workers(worker: &str, marker: &str, test: &str) {
    run_processes(2, worker, marker, test)
}

/// [`run_workers`] with `world` processes; each also gets `BRAID_TEST_PORTS`, four more free
/// ports (comma-separated) for groups of its own.
pub fn run_processes(world: usize, worker: &str, marker: &str, test: &str) {
    let kind = std::env::var("BRAID_DEVICE").unwrap_or_default();
    if kind.starts_with("cuda") && Device::count("cuda") < world {
        let _ = writeln!(std::io::stderr(), "skipped: {test}: needs {world} GPUs");
        return;
    }
    if !(kind.is_empty() || kind == "cpu" || kind.starts_with("cuda")) {
        let _ = writeln!(std::io::stderr(), "skipped: {test}: BRAID_DEVICE={kind} runs no collectives");
        return;
    }
    // Held together until all are read, so that the five ports differ.
    let listeners: Vec<std::net::TcpListener> =
        (0..5).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let ports: Vec<String> = listeners.iter().map(|l| l.local_addr().unwrap().port().to_string()).collect();
    drop(listeners);
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<std::process::Child> = (0..world)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(["--ignored", "--exact", worker, "--nocapture", "--test-threads", "1"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &ports[0])
                .env("BRAID_TEST_PORTS", ports[1..].join(","))
                .env("BRAID_COLLECTIVE_TIMEOUT", "60")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    while children.iter_mut().any(|c| c.try_wait().unwrap().is_none()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for (rank, mut child) in children.into_iter().enumerate() {
        if child.try_wait().unwrap().is_none() {
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains(&format!("{marker} {rank}: ok")), "rank {rank}:\n{text}");
    }
}
