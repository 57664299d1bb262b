//! Where a flush's time went: a per-flush [`Profile`] (kernels, copies and waits with their
//! stream, time and bytes), kept as the device's last profile when profiling is on, and
//! Chrome/Perfetto trace files (`BRAID_TRACE=file.json` or [`set_trace_file`]) with one track per
//! stream of each device, which open in ui.perfetto.dev or chrome://tracing.
//!
//! The times are the runtime's: when a CPU step ran; for a GPU, when the device ran it if its
//! backend reports device times, else when it was issued. Profiling costs two clock reads per
//! step; it is off unless asked for.

use crate::lock;
use braid_devices::runtime::Span;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One timed step of a flush.
#[derive(Clone, Debug)]
pub struct ProfileStep {
    /// The stream (its number; braid's own streams print as `offload` and `copy`).
    pub stream: u32,
    /// `kernel`, `copy` or `wait`.
    pub kind: &'static str,
    /// The kernel's label (`k3 mul+exp [n12 n13]`), `copy b1 -> b4` or `wait e2`.
    pub name: String,
    /// From the start of the flush's execution.
    pub start: Duration,
    pub duration: Duration,
    /// Bytes read and written.
    pub bytes: usize,
}

/// Where one flush's time went.
#[derive(Clone, Debug)]
pub struct Profile {
    pub flush: u64,
    pub device: String,
    /// From the first step to the end of the last, on all streams.
    pub wall: Duration,
    pub steps: Vec<ProfileStep>,
    /// The device's memory peak at the end of the flush (bytes).
    pub peak_bytes: u64,
}

impl Profile {
    pub(crate) fn new(flush: u64, device: String, spans: Vec<Span>, peak_bytes: u64) -> Profile {
        let origin = spans.iter().map(|s| s.start).min().unwrap_or_else(Instant::now);
        let mut steps: Vec<ProfileStep> = spans
            .into_iter()
            .map(|s| ProfileStep {
                stream: s.stream,
                kind: s.kind,
                name: s.name,
                start: s.start.saturating_duration_since(origin),
                duration: s.duration,
                bytes: s.bytes,
            })
            .collect();
        steps.sort_by_key(|s| s.start);
        let wall = steps.iter().map(|s| s.start + s.duration).max().unwrap_or_default();
        Profile { flush, device, wall, steps, peak_bytes }
    }

    /// The kernels, in the order they started.
    pub fn kernels(&self) -> impl Iterator<Item = &ProfileStep> {
        self.steps.iter().filter(|s| s.kind == "kernel")
    }

    /// Time spent in kernels, summed over streams.
    pub fn kernel_time(&self) -> Duration {
        self.kernels().map(|s| s.duration).sum()
    }

    /// One line per step (stream, start, duration, bandwidth), then totals.
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "flush {} on {}: {:.1} us wall, {} steps\n",
            self.flush,
            self.device,
            us(self.wall),
            self.steps.len()
        );
        for st in &self.steps {
            let gbs = if st.bytes > 0 {
                format!(", {:.2} GB/s", st.bytes as f64 / st.duration.as_secs_f64().max(1e-9) / 1e9)
            } else {
                String::new()
            };
            let _ = writeln!(
                s,
                "  s{:<3} +{:>9.1} us {:>9.1} us  {}{gbs}",
                braid_scheduler::dump::stream_name(st.stream),
                us(st.start),
                us(st.duration),
                st.name
            );
        }
        let bytes: usize = self.kernels().map(|k| k.bytes).sum();
        let _ = writeln!(
            s,
            "kernels: {} taking {:.1} us, {:.1} MB moved; peak memory {} B",
            self.kernels().count(),
            us(self.kernel_time()),
            bytes as f64 / 1e6,
            self.peak_bytes
        );
        s
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The trace file being written: its path, the open file (events appended as they come) and
/// the tracks named so far.
struct Trace {
    path: PathBuf,
    file: std::fs::File,
    named: Vec<(u32, u32)>,
}

/// `Some(path)` set by [`set_trace_file`]; `None` inside means "explicitly off".
static OVERRIDE: Mutex<Option<Option<PathBuf>>> = Mutex::new(None);
static OPEN: Mutex<Option<Trace>> = Mutex::new(None);
static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Makes every flush append its steps to the Chrome/Perfetto trace file `path` (`None` stops
/// tracing). Overrides `BRAID_TRACE`. The file holds a JSON array of trace events, left open
/// at its end as the trace event format allows, so that a program that stops at any point
/// leaves a file the viewers read.
pub fn set_trace_file(path: Option<PathBuf>) {
    *lock(&OVERRIDE) = Some(path);
}

/// The trace file flushes write to now, if any.
pub(crate) fn trace_path() -> Option<PathBuf> {
    if let Some(choice) = lock(&OVERRIDE).clone() {
        return choice;
    }
    std::env::var_os("BRAID_TRACE").filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// Appends a flush's steps to the trace at `path`: one process per device (`pid`), one thread
/// per stream (`tid`), complete events (`ph: X`) in microseconds since tracing started.
/// Failures are logged, never fatal (a trace must not break the computation it describes).
pub(crate) fn append(path: PathBuf, device: u32, device_name: &str, profile: &Profile, started: Instant) {
    let origin = *ORIGIN.get_or_init(|| started);
    let base = us(started.saturating_duration_since(origin));
    let mut open = lock(&OPEN);
    if open.as_ref().is_none_or(|t| t.path != path) {
        match std::fs::File::create(&path).and_then(|mut f| f.write_all(b"[\n").map(|()| f)) {
            Ok(file) => *open = Some(Trace { path: path.clone(), file, named: Vec::new() }),
            Err(e) => {
                tracing::warn!(target: "braid::trace", "cannot write the trace file {}: {e}", path.display());
                return;
            }
        }
    }
    let trace = open.as_mut().expect("opened above");
    let mut text = String::new();
    for st in &profile.steps {
        if !trace.named.contains(&(device, st.stream)) {
            trace.named.push((device, st.stream));
            let meta = serde_json::json!({"name": "thread_name", "ph": "M", "pid": device, "tid": st.stream,
                "args": {"name": format!("stream {}", braid_scheduler::dump::stream_name(st.stream))}});
            let process =
                serde_json::json!({"name": "process_name", "ph": "M", "pid": device, "args": {"name": device_name}});
            let _ = writeln!(text, "{process},\n{meta},");
        }
        let event = serde_json::json!({
            "name": st.name, "cat": st.kind, "ph": "X", "pid": device, "tid": st.stream,
            "ts": base + us(st.start), "dur": us(st.duration),
            "args": {"flush": profile.flush, "bytes": st.bytes},
        });
        let _ = writeln!(text, "{event},");
    }
    if let Err(e) = trace.file.write_all(text.as_bytes()) {
        tracing::warn!(target: "braid::trace", "cannot append to the trace file {}: {e}", path.display());
    }
}
