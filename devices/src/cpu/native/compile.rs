//! Building printed host C into a shared library and loading it: the compiler, its flags for
//! the CPU's vector level, the on-disk cache, `dlopen` (through `libloading`).
//!
//! The cache directory (`BRAID_KERNEL_CACHE`, else `$XDG_CACHE_HOME/braid/kernels`, else
//! `~/.cache/braid/kernels`, else `braid-kernels-UID` under the temporary directory) holds
//! `KEY.c` and `KEY.so` per kernel, `KEY` a 128-bit hash of the source, the compiler's identity
//! and the flags. It is created private (0700) and used only if it belongs to this user and no
//! one else may write to it (a library from it runs in this process). A library is loaded from
//! the cache only when its `.c` holds exactly the source asked for (so a hash collision cannot
//! load the wrong code), and files are written under temporary names and renamed, the `.c`
//! last, so that another process never sees a half-written library. The compile and the renames
//! run in a shell that outlives the process, so that a program exiting while its kernels
//! compile in the background still leaves them for its next run. The cache is never pruned:
//! deleting it is always safe.
//!
//! Compiled code is built only for 64-bit x86 and ARM Unix hosts (where floats are computed in
//! SSE/NEON registers, as the interpreter computes them; 32-bit x86 would use x87 extended
//! precision). After three compile failures in a row (a broken toolchain), nothing more is
//! compiled in this process.
//!
//! This module compiles what it is given; it never decides which kernels to compile.

use crate::cpu::eval::{Simd, simd};
use braid_lowering::host_c::CC_OPTIONS;
use libloading::Library;
use std::ffi::OsString;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The C compiler: `BRAID_CC`, else `cc`, and the first line of its `--version`.
struct Toolchain {
    cc: OsString,
    id: String,
}

/// The compiler, looked for once per process; `Err` says why there is none.
fn toolchain() -> Result<&'static Toolchain, String> {
    static TOOLCHAIN: OnceLock<Result<Toolchain, String>> = OnceLock::new();
    TOOLCHAIN
        .get_or_init(|| {
            if !(cfg!(unix) && cfg!(any(target_arch = "x86_64", target_arch = "aarch64"))) {
                return Err("compiled kernels are built on 64-bit x86 and ARM Unix hosts only".into());
            }
            let cc = std::env::var_os("BRAID_CC").unwrap_or_else(|| "cc".into());
            let out = Command::new(&cc)
                .arg("--version")
                .output()
                .map_err(|e| format!("no C compiler `{}` ({e})", cc.to_string_lossy()))?;
            if !out.status.success() {
                return Err(format!("`{} --version` failed", cc.to_string_lossy()));
            }
            let id = String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").to_string();
            Ok(Toolchain { cc, id })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether a C compiler is available (looked for once per process).
pub fn available() -> Result<(), String> {
    toolchain().map(|_| ())
}

/// Instruction-set flags for the vector level the evaluator runs at now, so compiled code uses
/// what the interpreted code would (every level gives the same bits), with F16C's f16
/// conversions where the CPU has them (as every AVX2 CPU does; they give the same bits as the
/// printed code's own).
fn target_flags(level: Simd) -> Vec<&'static str> {
    if !cfg!(target_arch = "x86_64") {
        return vec![];
    }
    let mut flags = match level {
        Simd::Avx512 => {
            vec!["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mprefer-vector-width=512"]
        }
        Simd::Avx2 => vec!["-mavx2", "-mfma"],
        Simd::Baseline => vec![],
    };
    #[cfg(target_arch = "x86_64")]
    if level != Simd::Baseline && std::arch::is_x86_feature_detected!("f16c") {
        flags.push("-mf16c");
    }
    flags
}

/// Where compiled kernels are kept: created if missing, and checked to be private.
pub(crate) fn cache_dir() -> Result<PathBuf, String> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let dir = var("BRAID_KERNEL_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("braid/kernels")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/braid/kernels")))
        .unwrap_or_else(|| std::env::temp_dir().join(format!("braid-kernels-{uid}")));
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        let _ = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir);
        let meta = std::fs::metadata(&dir).map_err(|e| format!("no kernel cache {}: {e}", dir.display()))?;
        if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
            return Err(format!(
                "the kernel cache {} is not a directory of this user that only it may write to; not used",
                dir.display()
            ));
        }
    }
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(|| sweep_stale(&dir));
    Ok(dir)
}

/// Removes temporary files left behind by compiles of processes no longer running (a compile
/// that failed, or was killed with its process), once they are [`STALE_AFTER`] old: a compile
/// whose process exited may still be running, and renames its files into place when it ends.
/// Once per process.
fn sweep_stale(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(pid) = name.split(".tmp").nth(1).and_then(|rest| rest.split('.').next()?.parse::<u32>().ok()) else {
            continue;
        };
        let old =
            entry.metadata().and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().is_ok_and(|a| a >= STALE_AFTER));
        if pid != std::process::id() && old && !process_alive(pid) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// How old a dead process's temporary file must be to be swept: far longer than any compile.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(600);

/// Whether process `pid` is running (on Linux, its `/proc` entry; elsewhere assumed so).
fn process_alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") { std::path::Path::new(&format!("/proc/{pid}")).exists() } else { true }
}

/// The library of `source` if the disk cache already holds it (nothing is compiled): how a
/// kernel a previous run compiled runs compiled from its first run.
pub fn cached(source: &str) -> Option<Library> {
    let cc = toolchain().ok()?;
    let dir = cache_dir().ok()?;
    let key = key(source, cc, &target_flags(simd()));
    let (c_path, so_path) = (dir.join(format!("{key}.c")), dir.join(format!("{key}.so")));
    if !(std::fs::read(&c_path).is_ok_and(|c| c == source.as_bytes()) && so_path.exists()) {
        return None;
    }
    // SAFETY: the library was built by `build` from this very source; loading it runs no
    // initialisers (the printed C has none).
    unsafe { Library::new(&so_path) }.ok()
}

/// A shared library, linked against libm (`-lm`, after the source) and bound when loaded, so
/// that a missing symbol is a load error rather than a crash at the first call.
const LINK_OPTIONS: &[&str] = &["-shared", "-fPIC", "-Wl,-z,now"];

/// `sh -c` script compiling `$3` into `$2` with compiler `$1` and options `$6..`, then renaming
/// `$2` to `$4` and `$3` to `$5` (the library first, the source last: see the module docs).
const COMPILE_AND_RENAME: &str = r#"cc=$1 so=$2 c=$3 final_so=$4 final_c=$5
shift 5
"$cc" "$@" -o "$so" "$c" -lm && mv -f "$so" "$final_so" && mv -f "$c" "$final_c""#;

/// A 128-bit hex key of everything that determines the library.
fn key(source: &str, cc: &Toolchain, flags: &[&str]) -> String {
    let half = |salt: u64| {
        let mut h = std::hash::DefaultHasher::new();
        (salt, source, &cc.id, &cc.cc, flags, CC_OPTIONS, LINK_OPTIONS).hash(&mut h);
        h.finish()
    };
    format!("{:016x}{:016x}", half(1), half(2))
}

/// Compile failures in a row; at [`MAX_FAILURES`] nothing more is compiled.
static FAILURES: AtomicU32 = AtomicU32::new(0);
const MAX_FAILURES: u32 = 3;

/// The library of `source`, from the cache (unless `fresh`) or compiled now (a fraction of a
/// second to a few seconds). Errors when there is no compiler, when it rejects the source, or
/// when the library cannot be loaded.
pub fn build(source: &str, fresh: bool) -> Result<Library, String> {
    build_for(source, fresh, simd())
}

/// As [`build`], for vector level `level` (never above the CPU's).
pub fn build_for(source: &str, fresh: bool, level: Simd) -> Result<Library, String> {
    let cc = toolchain()?;
    if FAILURES.load(Ordering::Relaxed) >= MAX_FAILURES {
        return Err(format!("{MAX_FAILURES} compile failures in a row: compiling is off in this process"));
    }
    let r = build_with(cc, source, fresh, level.min(simd()));
    match &r {
        Ok(_) => FAILURES.store(0, Ordering::Relaxed),
        Err(_) => drop(FAILURES.fetch_add(1, Ordering::Relaxed)),
    }
    r
}

fn build_with(cc: &Toolchain, source: &str, fresh: bool, level: Simd) -> Result<Library, String> {
    let flags = target_flags(level);
    let dir = cache_dir()?;
    let key = key(source, cc, &flags);
    let (c_path, so_path) = (dir.join(format!("{key}.c")), dir.join(format!("{key}.so")));
    if !fresh && std::fs::read(&c_path).is_ok_and(|c| c == source.as_bytes()) && so_path.exists() {
        // SAFETY: the library was built by `build` from this very source; loading it runs no
        // initialisers (the printed C has none).
        if let Ok(lib) = unsafe { Library::new(&so_path) } {
            return Ok(lib);
        }
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let tmp = format!("{key}.tmp{}.{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    let (tmp_c, tmp_so) = (dir.join(format!("{tmp}.c")), dir.join(format!("{tmp}.so")));
    std::fs::write(&tmp_c, source).map_err(|e| format!("cannot write {}: {e}", tmp_c.display()))?;
    // The compile and both renames run in one shell, a child of this process that outlives
    // it: a program that exits while its kernels compile in the background (a short script)
    // still leaves them in the cache for its next run.
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(COMPILE_AND_RENAME)
        .arg("sh")
        .arg(&cc.cc)
        .args([&tmp_so, &tmp_c, &so_path, &c_path])
        .args(CC_OPTIONS)
        .args(&flags)
        .args(LINK_OPTIONS)
        .output();
    if !out.as_ref().is_ok_and(|o| o.status.success()) {
        let _ = (std::fs::remove_file(&tmp_so), std::fs::remove_file(&tmp_c));
        let cc = cc.cc.to_string_lossy();
        return Err(match out {
            Ok(o) => format!("{cc} failed ({}):\n{}", o.status, String::from_utf8_lossy(&o.stderr)),
            Err(e) => format!("cannot run {cc} through /bin/sh: {e}"),
        });
    }
    // SAFETY: as above, a library just built from the printed source.
    unsafe { Library::new(&so_path) }.map_err(|e| format!("cannot load {}: {e}", so_path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_temporary_files_of_dead_processes_are_swept() {
        let dir = std::env::temp_dir().join(format!("braid-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // pid 0x7fffffff is no running process; ours is; other files are left alone.
        let names = ["abc.tmp2147483646.0.c", "abc.tmp2147483646.1.so", "def.so", "def.c"];
        let ours = format!("ghi.tmp{}.3.c", std::process::id());
        let long_ago = std::time::SystemTime::now() - STALE_AFTER - std::time::Duration::from_secs(1);
        for n in names.iter().map(|s| s.to_string()).chain([ours.clone()]) {
            std::fs::File::create(dir.join(n)).unwrap().set_modified(long_ago).unwrap();
        }
        // A dead process's file written just now may belong to a compile still running.
        let recent = "jkl.tmp2147483646.2.so";
        std::fs::write(dir.join(recent), b"x").unwrap();
        if cfg!(target_os = "linux") {
            sweep_stale(&dir);
            let mut left: Vec<String> =
                std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
            left.sort();
            assert_eq!(left, vec!["def.c".to_string(), "def.so".into(), ours, recent.into()]);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_library_in_the_disk_cache_is_found_without_compiling() {
        if available().is_err() {
            eprintln!("native: SKIPPED, no C compiler");
            return;
        }
        let source = format!("void braid_cached_probe_{}(void) {{}}\n", std::process::id());
        assert!(cached(&source).is_none(), "nothing cached yet");
        build(&source, false).unwrap();
        assert!(cached(&source).is_some());
    }
}
