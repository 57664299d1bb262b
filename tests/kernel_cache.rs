//! The on-disk cache of compiled CPU kernels across processes: a short program that exits while
//! its kernel still compiles in the background leaves the kernel in the cache, and the next
//! program finds it and runs it compiled from its first run.
//!
//! The test runs this test binary again as the short programs (a child process with
//! `BRAID_TEST_SHORT_PROGRAM` set, its own cache directory, and a compiler wrapper that takes three
//! seconds longer, so that the first program exits mid-compile for certain). Skipped, with a
//! message, when there is no C compiler or no `/bin/sh`.

use braid::prelude::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const TEST: &str = "a_kernel_compiling_when_its_short_program_exits_is_cached_for_the_next_one";

/// The work of each short program: one row kernel large enough to be compiled at its first run.
fn work(dev: &Device) -> Vec<f32> {
    let x = Tensor::from_vec((0..128 * 1000).map(|i| (i % 97) as f32 * 0.01).collect::<Vec<_>>(), [128, 1000], dev);
    x.softmax(1).to_vec::<f32>().unwrap()
}

/// `.tmp` files and finished libraries in `dir`.
fn cache_files(dir: &Path) -> (Vec<String>, Vec<String>) {
    let names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let tmp = names.iter().filter(|n| n.contains(".tmp")).cloned().collect();
    (tmp, names.into_iter().filter(|n| !n.contains(".tmp") && n.ends_with(".so")).collect())
}

/// A child run: `start` runs the work twice in the background compile mode and exits as soon as
/// its compile has begun; `check` runs it once and prints how many kernels ran compiled.
fn short_program(mode: &str, cache: &Path) -> ! {
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Background);
    let _ = work(&dev);
    if mode == "start" {
        // A kernel's second run queues its compile (a kernel run once is not worth one).
        let _ = work(&dev);
        // The compile writes its temporary source, then starts the compiler at once.
        let t = Instant::now();
        while cache_files(cache).0.is_empty() && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_secs(1));
    } else {
        println!("compiled launches: {}", dev.compiled_kernels_launched());
    }
    std::process::exit(0)
}

fn run_child(mode: &str, cache: &Path, cc: &Path) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env("BRAID_TEST_SHORT_PROGRAM", mode)
        .env("BRAID_KERNEL_CACHE", cache)
        .env("BRAID_CC", cc)
        .output()
        .unwrap();
    assert!(out.status.success(), "{mode}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_kernel_compiling_when_its_short_program_exits_is_cached_for_the_next_one() {
    if let Ok(mode) = std::env::var("BRAID_TEST_SHORT_PROGRAM") {
        short_program(&mode, &PathBuf::from(std::env::var_os("BRAID_KERNEL_CACHE").unwrap()));
    }
    if let Err(e) = braid_devices::cpu::native::compiler_available() {
        eprintln!("kernel_cache: SKIPPED, no C compiler to compile kernels with: {e}");
        return;
    }
    if !Path::new("/bin/sh").exists() {
        eprintln!("kernel_cache: SKIPPED, no /bin/sh");
        return;
    }
    let dir = std::env::temp_dir().join(format!("braid-kernel-cache-test-{}", std::process::id()));
    let cache = dir.join("kernels");
    std::fs::create_dir_all(&dir).unwrap();
    let cc = dir.join("slow-cc");
    let real = std::env::var("BRAID_CC").unwrap_or_else(|_| "cc".into());
    std::fs::write(&cc, format!("#!/bin/sh\nsleep 3\nexec {real} \"$@\"\n")).unwrap();
    std::fs::set_permissions(&cc, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    run_child("start", &cache, &cc);
    let (tmp, built) = cache_files(&cache);
    assert!(built.is_empty() && !tmp.is_empty(), "the program exited before its compile ended: {tmp:?} {built:?}");
    // The compile goes on without its program and puts the library in place.
    let t = Instant::now();
    loop {
        let (tmp, built) = cache_files(&cache);
        if tmp.is_empty() && !built.is_empty() {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the compile never landed: {tmp:?} {built:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = run_child("check", &cache, &cc);
    assert!(out.contains("compiled launches: 1"), "the next program ran interpreted: {out}");
    std::fs::remove_dir_all(&dir).unwrap();
}
