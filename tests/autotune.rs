//! Autotuning as a program sees it (`braid::autotune`): choices kept in the device's file and
//! read by the next process, which tunes nothing; a corrupt file ignored with a warning and
//! rewritten; two processes tuning at once leaving one valid file; deterministic mode giving
//! the bits of tuning off. On the device `BRAID_DEVICE` names (cpu, cuda or wgpu: wgpu's
//! variants are map kernels printed in other workgroup sizes).
//! The tuner's own checks (variants that disagree, buckets, checksums) are unit tests in
//! `devices/src/runtime/tune/tests.rs`.

mod common;

use braid::autotune::{self, Mode};
use braid::prelude::*;
use braid::testing::test_device;
use braid_devices::runtime::tune::TuneFile;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Whether this device offers kernel variants; prints why a test is skipped when not.
fn tunes(test: &str) -> bool {
    let kind = std::env::var("BRAID_DEVICE").unwrap_or_default();
    let tunes = kind.is_empty() || kind == "cpu" || kind.starts_with("cuda") || kind.starts_with("wgpu");
    if !tunes {
        let _ = writeln!(std::io::stderr(), "skipped: {test}: BRAID_DEVICE={kind} has no kernel variants");
    }
    tunes
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    common::uniform_f32(n, seed, 2.0)
}

/// Kernels large enough to be tuned on every device with variants: a map chain, row sums, a
/// softmax and column sums; their results as bits.
fn workload(dev: &Device) -> Vec<Vec<u32>> {
    let x = Tensor::from_vec(random(512 * 1024, 1), [512, 1024], dev);
    let w = Tensor::from_vec(random(512 * 1024, 2), [512, 1024], dev);
    let chain = ((&x * &w + 1.0).tanh() * x.sigmoid()).exp();
    let rows = x.sum_dim(1, false);
    let soft = x.softmax(1);
    let cols = (&x * &w).sum_dim(0, false);
    [chain, rows, soft, cols].iter().map(|t| t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()).collect()
}

/// The ignored test a child process runs: the workload, then `tunings N` on stdout; warnings
/// of `braid::autotune` go to stderr.
#[test]
#[ignore = "run by the tests below in a child process"]
fn tuning_child() {
    let _ = tracing_subscriber::fmt().with_writer(std::io::stderr).with_max_level(tracing::Level::WARN).try_init();
    let dev = test_device();
    dev.set_compile_mode(braid::CompileMode::Blocking);
    let _ = workload(&dev);
    dev.sync().unwrap();
    println!("tunings {}", autotune::tunings());
}

/// Runs `count` children at once over the cache directory `dir`; their outputs.
fn children(dir: &Path, count: usize) -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    let spawned: Vec<_> = (0..count)
        .map(|_| {
            Command::new(&exe)
                .args(["--ignored", "--exact", "tuning_child", "--nocapture", "--test-threads", "1"])
                .env("BRAID_KERNEL_CACHE", dir)
                .env("BRAID_CUDA_CACHE", dir)
                .env("BRAID_AUTOTUNE", "on")
                .env_remove("BRAID_DETERMINISTIC")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    spawned
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "a child failed:\n{text}");
            text
        })
        .collect()
}

fn tunings(text: &str) -> u64 {
    // The test harness may print its own words before the count on the same line.
    let at = text.find("tunings ").unwrap_or_else(|| panic!("no count in:\n{text}"));
    let digits: String = text[at + 8..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().unwrap()
}

fn fresh_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("braid-autotune-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tuning files in `dir`, each read and validated.
fn tuning_files(dir: &Path) -> Vec<(PathBuf, Result<TuneFile, String>)> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("autotune-") {
            let read = TuneFile::read(&std::fs::read(&path).unwrap());
            found.push((path, read));
        }
    }
    found
}

#[test]
fn two_processes_tuning_at_once_leave_one_valid_file_and_the_next_tunes_nothing() {
    if !tunes("two_processes_tuning_at_once") {
        return;
    }
    let dir = fresh_dir("two");
    let outs = children(&dir, 2);
    assert!(outs.iter().all(|o| tunings(o) > 0), "both children tuned their kernels:\n{outs:?}");
    let files = tuning_files(&dir);
    assert_eq!(files.len(), 1, "one file, no temporary left: {files:?}");
    let file = files[0].1.as_ref().expect("a valid file");
    // The chain's map kernel at least (row kernels have only reordering variants on CUDA,
    // which the default, deterministic, settings do not time).
    assert!(!file.choices.is_empty(), "the tuned kernels' choices: {file:?}");
    let third = children(&dir, 1);
    assert_eq!(tunings(&third[0]), 0, "a later process times nothing:\n{}", third[0]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupt_tuning_file_is_ignored_with_a_warning_and_rewritten() {
    if !tunes("a_corrupt_tuning_file") {
        return;
    }
    let dir = fresh_dir("corrupt");
    children(&dir, 1);
    let files = tuning_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let path = files[0].0.clone();
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x5A;
    bytes.truncate(bytes.len() - 3);
    std::fs::write(&path, &bytes).unwrap();
    assert!(TuneFile::read(&bytes).is_err());
    let out = children(&dir, 1).remove(0);
    assert!(out.contains("is not used"), "a warning names the file:\n{out}");
    assert!(tunings(&out) > 0, "the kernels were timed again:\n{out}");
    let files = tuning_files(&dir);
    assert!(files.len() == 1 && files[0].1.is_ok(), "rewritten: {files:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn deterministic_mode_gives_the_bits_of_tuning_off() {
    if !tunes("deterministic_mode") {
        return;
    }
    // This binary's other tests change nothing of the process's settings (their children
    // have their own).
    let dev = test_device();
    autotune::set_mode(Mode::Off);
    let off = workload(&dev);
    autotune::set_mode(Mode::On);
    autotune::set_deterministic(true);
    let deterministic = [workload(&dev), workload(&dev)];
    autotune::set_deterministic(false);
    let tuned = workload(&dev);
    assert!(deterministic.iter().all(|d| *d == off), "deterministic mode changed bits");
    // Tuned freely, results agree within the tuner's tolerance.
    for (a, b) in off.iter().zip(&tuned) {
        let scale = a.iter().map(|&v| f32::from_bits(v).abs()).fold(0.0f32, f32::max);
        for (&x, &y) in a.iter().zip(b) {
            let (x, y) = (f32::from_bits(x), f32::from_bits(y));
            assert!((x - y).abs() <= scale / 8192.0, "{x} against {y}");
        }
    }
}

/// The GPU's comparison of a candidate's outputs with the default's (`tune_compare.cu`) gives
/// the host's verdict (`braid_devices::runtime::tune::agree`) on random pairs: equal, a few
/// ulps apart, far apart, NaNs and infinities moved, in every float dtype and for integers,
/// bitwise or within the tolerance.
#[test]
fn gpu_comparisons_give_the_host_rules_verdicts() {
    use braid_devices::cuda::compare_on_gpu;
    use braid_devices::runtime::tune::{Output, agree};
    use braid_graph::DType;
    let Some(h) = common::cuda_harness("gpu_comparisons") else { return };
    let encode = |dtype: DType, v: &[f64]| -> Vec<u8> {
        v.iter()
            .flat_map(|&x| match dtype {
                DType::F64 => x.to_le_bytes().to_vec(),
                DType::F32 => (x as f32).to_le_bytes().to_vec(),
                DType::F16 => half::f16::from_f64(x).to_le_bytes().to_vec(),
                DType::BF16 => half::bf16::from_f64(x).to_le_bytes().to_vec(),
                _ => (x as i32).to_le_bytes().to_vec(),
            })
            .collect()
    };
    let mut agreed = [0usize; 2];
    for case in 0..200u64 {
        let dtype = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32][case as usize % 5];
        let n = 1 + (case as usize * 7919) % 3000;
        let want: Vec<f64> = random(n, case).iter().map(|&x| x as f64 * 100.0).collect();
        let mut got = want.clone();
        let at = (case as usize * 31) % n;
        match case % 6 {
            0 => {}
            1 => got[at] *= 1.0 + 1e-6,
            2 => got[at] += 1.0,
            3 => got[at] = f64::NAN,
            4 => got[at] *= 1.0 + 1e-3,
            _ => {
                got[at] = f64::INFINITY;
                if at + 1 < n {
                    got[at + 1] = f64::NAN;
                }
            }
        }
        let (a, b) = (encode(dtype, &want), encode(dtype, &got));
        for bitwise in [true, false] {
            let host = agree(&[Output { dtype, bytes: a.clone() }], &[Output { dtype, bytes: b.clone() }], bitwise);
            let gpu = compare_on_gpu(&h, dtype, &a, &b, bitwise).unwrap();
            assert_eq!(
                gpu.is_ok(),
                host.is_ok(),
                "case {case} ({dtype}, bitwise {bitwise}): gpu {gpu:?}, host {host:?}"
            );
            agreed[host.is_ok() as usize] += 1;
        }
    }
    assert!(agreed[0] > 50 && agreed[1] > 50, "both verdicts were tried: {agreed:?}");
}

/// A dump names a tuned kernel's variant (JSON `variant`, text `[variant: ...]`) when it is not
/// the default, and reads back with it.
#[test]
fn dumps_name_the_variant_a_kernel_ran() {
    let dev = test_device();
    dev.set_compile_mode(braid::CompileMode::Blocking);
    let x = Tensor::from_vec(random(1 << 20, 3), [1 << 20], &dev);
    for _ in 0..2 {
        let y = (&x * 2.0 + 1.0).tanh();
        y.to_vec::<f32>().unwrap();
    }
    let dump = dev.last_schedule().unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&dump.to_json()).unwrap();
    let kernels = |j: &mut serde_json::Value| -> Vec<serde_json::Value> {
        let steps = j["streams"].as_array().unwrap().iter().flat_map(|s| s["steps"].as_array().unwrap().clone());
        steps.filter(|s| s["kind"] == "kernel").collect()
    };
    let text = dump.to_text();
    for k in kernels(&mut json) {
        if let Some(v) = k.get("variant").and_then(|v| v.as_str()) {
            assert!(text.contains(&format!("[variant: {v}]")), "{text}");
        }
    }
    // Written by hand into a dump file, a variant reads back and prints.
    let first =
        json["streams"].as_array_mut().unwrap().iter_mut().flat_map(|s| s["steps"].as_array_mut().unwrap().iter_mut());
    let step = first.into_iter().find(|s| s["kind"] == "kernel").expect("a kernel");
    step["variant"] = serde_json::Value::from("tasks of 8K");
    let read = braid::ScheduleDump::from_json(&json.to_string()).unwrap();
    assert!(read.to_text().contains("[variant: tasks of 8K]"), "{}", read.to_text());
    assert!(read.to_json().contains("\"variant\""));
}
