//! The `BRAID_*` environment variables a flush reads, checked when it starts: a value braid does
//! not understand is an `Error::Environment` naming the accepted values (never silently ignored),
//! and a dump directory or trace file that cannot be written is one too, before anything runs.
//!
//! Variables are read when a flush starts, never cached at program start (API.md), except
//! which dump directories and trace files were already found writable.

use crate::error::{Error, Result};
use crate::lock;
use std::path::PathBuf;
use std::sync::Mutex;

/// A yes/no variable: `1`/`0` (also `true`/`false`, `on`/`off`); `None` when unset or empty.
pub(crate) fn flag(name: &'static str) -> Result<Option<bool>> {
    let Ok(value) = std::env::var(name) else { return Ok(None) };
    yes_no(&value).ok_or_else(|| Error::Environment { name, value, reason: "expected 1 or 0".into() })
}

/// A yes/no spelling: `Some(None)` for an empty value, `None` for something else.
fn yes_no(value: &str) -> Option<Option<bool>> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" => Some(None),
        "1" | "true" | "on" | "yes" => Some(Some(true)),
        "0" | "false" | "off" | "no" => Some(Some(false)),
        _ => None,
    }
}

/// The `BRAID_*` settings one flush runs with, each variable read once when the flush starts
/// (a read is a lock and a walk of the environment: a replayed step is only a few of them).
#[derive(Clone, Debug, Default)]
pub(crate) struct FlushEnv {
    /// `BRAID_POISON`, when set.
    pub(crate) poison: Option<bool>,
    /// `BRAID_FUSION`, when set.
    pub(crate) fusion: Option<bool>,
    /// `BRAID_RECOMPUTE`, when set.
    pub(crate) recompute: Option<bool>,
    /// `BRAID_VALIDATE=1`.
    pub(crate) validate: bool,
    /// Where this flush's dump goes (`BRAID_DUMP` or the program's choice), checked writable.
    pub(crate) dump: Option<PathBuf>,
    /// Where this flush's trace goes (`BRAID_TRACE` or the program's choice).
    pub(crate) trace: Option<PathBuf>,
}

impl FlushEnv {
    /// Reads and checks every `BRAID_*` variable a flush reads (`BRAID_POISON`, `BRAID_FUSION`,
    /// `BRAID_RECOMPUTE`, `BRAID_VALIDATE`, `BRAID_CPU_COMPILE`, `BRAID_AUTOTUNE`, `BRAID_DUMP`,
    /// `BRAID_TRACE`).
    pub(crate) fn for_flush() -> Result<FlushEnv> {
        let poison = flag("BRAID_POISON")?;
        let fusion = flag("BRAID_FUSION")?;
        let recompute = flag("BRAID_RECOMPUTE")?;
        let validate = flag("BRAID_VALIDATE")?.unwrap_or(false);
        if let Ok(value) = std::env::var("BRAID_CPU_COMPILE")
            && !matches!(value.trim().to_ascii_lowercase().as_str(), "background" | "blocking")
            && yes_no(&value).is_none()
        {
            let reason = "expected off, background (also on, 1) or blocking".into();
            return Err(Error::Environment { name: "BRAID_CPU_COMPILE", value, reason });
        }
        if let Ok(value) = std::env::var("BRAID_AUTOTUNE")
            && braid_devices::runtime::tune::Mode::parse(&value).is_none()
        {
            let reason = "expected on, off or exhaustive".into();
            return Err(Error::Environment { name: "BRAID_AUTOTUNE", value, reason });
        }
        Ok(FlushEnv { poison, fusion, recompute, validate, ..FlushEnv::destinations()? })
    }

    /// What replaying a captured plan reads: `BRAID_POISON`, `BRAID_DUMP` and `BRAID_TRACE`
    /// (its fusion, validation and kernels were settled when it was captured).
    pub(crate) fn for_replay() -> Result<FlushEnv> {
        Ok(FlushEnv { poison: flag("BRAID_POISON")?, ..FlushEnv::destinations()? })
    }

    /// The dump and trace destinations, the dump directory and the trace file checked writable.
    fn destinations() -> Result<FlushEnv> {
        let dump = super::dump::dir();
        if let Some(dir) = &dump {
            checked_once(dir, "BRAID_DUMP", "dump files cannot be written there", |dir| {
                let probe = dir.join(format!(".braid-probe-{}", std::process::id()));
                std::fs::create_dir_all(dir)
                    .and_then(|()| std::fs::write(&probe, b""))
                    .and_then(|()| std::fs::remove_file(&probe))
            })?;
        }
        let trace = super::profile::trace_path();
        if let Some(file) = &trace {
            checked_once(file, "BRAID_TRACE", "the trace file cannot be written", |file| {
                std::fs::OpenOptions::new().create(true).append(true).open(file).map(drop)
            })?;
        }
        Ok(FlushEnv { dump, trace, ..FlushEnv::default() })
    }
}

/// `Ok` when `probe` succeeds on `path` (a dump directory, a trace file), checked once per
/// path; else an error naming the variable `name`.
fn checked_once(
    path: &PathBuf,
    name: &'static str,
    problem: &str,
    probe: impl FnOnce(&PathBuf) -> std::io::Result<()>,
) -> Result<()> {
    // Keyed by the variable too: a path fit for a dump directory is no trace file.
    static CHECKED: Mutex<Vec<(&str, PathBuf)>> = Mutex::new(Vec::new());
    if lock(&CHECKED).iter().any(|(n, p)| *n == name && p == path) {
        return Ok(());
    }
    match probe(path) {
        Ok(()) => {
            lock(&CHECKED).push((name, path.clone()));
            Ok(())
        }
        Err(e) => {
            Err(Error::Environment { name, value: path.display().to_string(), reason: format!("{problem}: {e}") })
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn flags_accept_the_usual_spellings_and_nothing_else() {
        // These variables are read by no other unit test of this crate.
        for (v, want) in [("1", Some(true)), ("off", Some(false)), ("", None)] {
            // SAFETY: unit tests of this module are the only readers of this variable.
            unsafe { std::env::set_var("BRAID_TEST_FLAG", v) };
            assert_eq!(super::flag("BRAID_TEST_FLAG").unwrap(), want);
        }
        unsafe { std::env::set_var("BRAID_TEST_FLAG", "maybe") };
        let e = super::flag("BRAID_TEST_FLAG").unwrap_err().to_string();
        assert!(e.contains("BRAID_TEST_FLAG") && e.contains("expected 1 or 0"), "{e}");
        unsafe { std::env::remove_var("BRAID_TEST_FLAG") };
    }
}
