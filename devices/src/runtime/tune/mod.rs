//! Autotuning: a kernel that can run in several ways (its variants: threads per block, elements
//! per thread, task sizes) is timed in each on its real arguments the first time it runs, the
//! variants are checked against each other, and the fastest is kept, per device, on disk.
//!
//! A backend names a kernel's variants ([`Variant`]; the first is today's fixed choice, the
//! default) and a [`TuneKey`] for it: the kernel's content hash, its shape in buckets (exact up
//! to 64, then the next power of two, as CubeCL's tuner buckets), its dtypes. It asks the
//! device's [`Tuner`] for a [`Plan`]: run the variant already chosen, or time these candidates
//! now. To time, it hands [`Tuner::tune`] a closure that runs one candidate and returns a
//! [`Trial`] (its times and its outputs); the tuner compares every candidate's outputs with the
//! default's, rejects (and logs) those that disagree, keeps the fastest, and writes the choice
//! to the device's file ([`store`]). A later process on the same device reads the file and
//! times nothing.
//!
//! The printed kernels of braid hold their shapes, so the content hash already tells shapes
//! apart; the buckets in the key are what CubeCL's keys hold, and keep two shapes of one
//! bucket apart only through the hash. A new or removed variant changes the checksum of the
//! variants' names stored with each choice, which then no longer counts: the kernel is timed
//! again.
//!
//! Checking: a variant marked `bitwise` must give the default's bytes exactly (threads or tasks
//! that split independent elements differently); one that adds in another order (a reduction
//! tree of fewer threads, rows split otherwise) must agree within [`tolerance`] and is used
//! only under `BRAID_DETERMINISTIC=0` ([`deterministic`]). The default, `1`, keeps every
//! result bit for bit as with tuning off, and so keeps braid's promises that hold across
//! plans: a flush under a memory budget, with fusion off or recomputing gives the bits of the
//! plain one, a replayed step those of the eager run. With `0`, two plans of one program may
//! choose differently for their (different) kernels and differ in the last bits.
//!
//! Settings: `BRAID_AUTOTUNE=on|off|exhaustive` (default on: a short list of variants;
//! exhaustive: every variant, more repetitions) and `BRAID_DETERMINISTIC=1|0`, read once, and [`set_mode`] /
//! [`set_deterministic`] for a program or test that changes them later (choices already
//! made stay, but a non-bitwise one is not used while deterministic). Logs: target
//! `braid::autotune` (`RUST_LOG=braid::autotune=debug`: every tuning with its times and why
//! one was kept; warnings for rejected variants and unusable files).
//!
//! Must never: keep a variant whose outputs it has not compared with the default's, use a
//! non-bitwise variant in deterministic mode, or fail a kernel because tuning or the file
//! failed (the default runs instead).

pub mod store;
#[cfg(test)]
mod tests;

use braid_graph::DType;
use hashbrown::HashMap;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Instant;

pub use store::{StoredChoice, TuneFile};

/// The `tracing` target of tuning events.
pub const TRACE_TARGET: &str = "braid::autotune";

/// A candidate must be this much faster than the default to be kept (timings of one run
/// differ by a few percent; a variant within the noise is not worth a change).
const MARGIN: f64 = 0.03;

/// How much tuning is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Every kernel runs its default.
    Off,
    /// The short list of variants, timed a few times each (the default).
    On,
    /// Every variant a kernel offers, timed more times.
    Exhaustive,
}

impl Mode {
    /// Parses `BRAID_AUTOTUNE`'s value.
    pub fn parse(text: &str) -> Option<Mode> {
        match text.trim().to_ascii_lowercase().as_str() {
            "on" | "1" | "" => Some(Mode::On),
            "off" | "0" => Some(Mode::Off),
            "exhaustive" => Some(Mode::Exhaustive),
            _ => None,
        }
    }

    /// Timed runs of each candidate.
    pub fn repetitions(self) -> usize {
        match self {
            Mode::Off => 0,
            Mode::On => 5,
            Mode::Exhaustive => 15,
        }
    }
}

const UNSET: u8 = 0;
static MODE: AtomicU8 = AtomicU8::new(UNSET);
static DETERMINISTIC: AtomicU8 = AtomicU8::new(UNSET);
static TUNINGS: AtomicU64 = AtomicU64::new(0);
static TUNING_NANOS: AtomicU64 = AtomicU64::new(0);

/// The mode in force: [`set_mode`]'s, else `BRAID_AUTOTUNE`'s (an unknown value is logged and
/// read as `on`).
pub fn mode() -> Mode {
    match MODE.load(Ordering::Relaxed) {
        1 => Mode::Off,
        2 => Mode::On,
        3 => Mode::Exhaustive,
        _ => {
            let text = std::env::var("BRAID_AUTOTUNE").unwrap_or_default();
            let mode = Mode::parse(&text).unwrap_or_else(|| {
                tracing::warn!(target: TRACE_TARGET, "BRAID_AUTOTUNE={text:?} is not on, off or exhaustive: on");
                Mode::On
            });
            let _ = MODE.compare_exchange(UNSET, mode_code(mode), Ordering::Relaxed, Ordering::Relaxed);
            mode
        }
    }
}

fn mode_code(mode: Mode) -> u8 {
    match mode {
        Mode::Off => 1,
        Mode::On => 2,
        Mode::Exhaustive => 3,
    }
}

/// Sets the mode for the rest of the process (over `BRAID_AUTOTUNE`).
pub fn set_mode(mode: Mode) {
    MODE.store(mode_code(mode), Ordering::Relaxed);
}

/// Whether results must stay bit for bit as with tuning off: [`set_deterministic`]'s, else
/// `BRAID_DETERMINISTIC` (`1` by default; `0` lets tuning choose variants that add in another
/// order).
pub fn deterministic() -> bool {
    match DETERMINISTIC.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var("BRAID_DETERMINISTIC").map_or(true, |v| v.trim() != "0");
            let _ = DETERMINISTIC.compare_exchange(UNSET, 1 + on as u8, Ordering::Relaxed, Ordering::Relaxed);
            on
        }
    }
}

/// Sets deterministic mode for the rest of the process (over `BRAID_DETERMINISTIC`).
pub fn set_deterministic(on: bool) {
    DETERMINISTIC.store(1 + on as u8, Ordering::Relaxed);
}

/// Kernels timed by this process so far, on every device.
pub fn tunings() -> u64 {
    TUNINGS.load(Ordering::Relaxed)
}

/// Seconds this process spent timing and checking variants, on every device.
pub fn tuning_seconds() -> f64 {
    TUNING_NANOS.load(Ordering::Relaxed) as f64 * 1e-9
}

/// One way to run a kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Variant {
    /// Names it in logs, dumps and the file (`"threads 128"`); unique among a kernel's variants.
    pub name: String,
    /// Whether it gives the default's bytes exactly.
    pub bitwise: bool,
    /// Whether `on` times it (`exhaustive` times every variant).
    pub short_list: bool,
}

/// The identity of one tuning decision on a device.
#[derive(Clone, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TuneKey {
    /// A hash of the kernel's content (for a printed kernel, its source).
    pub kernel: u64,
    /// The launch's extents in buckets ([`bucket`]).
    pub shape: Vec<u64>,
    /// The arguments' dtypes, in order.
    pub dtypes: String,
}

impl TuneKey {
    /// The key of a kernel whose content hashes to `kernel`, launched over `shape`, with
    /// arguments of `dtypes`.
    pub fn new(kernel: u64, shape: &[usize], dtypes: impl IntoIterator<Item = DType>) -> TuneKey {
        let dtypes = dtypes.into_iter().map(|d| d.name()).collect::<Vec<_>>().join(",");
        TuneKey { kernel, shape: shape.iter().map(|&n| bucket(n)).collect(), dtypes }
    }
}

/// An extent's bucket: itself up to 64, else the next power of two.
pub fn bucket(n: usize) -> u64 {
    if n <= 64 { n as u64 } else { n.next_power_of_two() as u64 }
}

/// A stable hash of anything hashable (a kernel's source), for keys.
pub fn content_hash(value: &impl Hash) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// The checksum of a set of variants: their names and bitwise marks, in order.
pub fn checksum(variants: &[Variant]) -> u64 {
    content_hash(&variants.iter().map(|v| (&v.name, v.bitwise)).collect::<Vec<_>>())
}

/// [`checksum`] of the variants at `candidates` (without copying them: a launch asks).
fn checksum_of(variants: &[Variant], candidates: &[usize]) -> u64 {
    content_hash(&candidates.iter().map(|&i| (&variants[i].name, variants[i].bitwise)).collect::<Vec<_>>())
}

/// What to do at a launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Run this variant (an index into the kernel's variants).
    Use(usize),
    /// Time these candidates (the default first) with [`Tuner::tune`], then run its choice.
    Tune(Vec<usize>),
}

/// One output of a run, as bytes.
#[derive(Clone, Debug)]
pub struct Output {
    pub dtype: DType,
    pub bytes: Vec<u8>,
}

/// What running one candidate gave.
#[derive(Clone, Debug, Default)]
pub struct Trial {
    /// Seconds per timed run.
    pub seconds: Vec<f64>,
    /// The kernel's outputs after the runs, for the tuner to compare ([`agree`]).
    pub outputs: Vec<Output>,
    /// Or the backend's own comparison with the default's outputs, made by [`agree`]'s rules
    /// where the outputs lie (a GPU compares on the device rather than copying them back).
    pub compared: Option<Result<(), String>>,
}

/// The result of a [`Tuner::tune`]: the variant kept and why.
#[derive(Clone, Debug)]
pub struct Tuned {
    pub chosen: usize,
    pub why: String,
    /// Candidates rejected, with the reason (their outputs disagreed, or they failed).
    pub rejected: Vec<(usize, String)>,
}

/// One device's choices: those read from its file and those made by this process.
pub struct Tuner {
    device: String,
    store: Option<store::Store>,
    choices: Mutex<HashMap<TuneKey, StoredChoice>>,
    /// Choices made since the file was last written.
    dirty: AtomicBool,
}

impl Tuner {
    /// The tuner of device `device` (its name and driver, as the file records them), keeping
    /// its file in `dir` (none: choices live as long as the process). An unreadable, corrupt
    /// or foreign file is logged and ignored (the next write replaces it).
    pub fn open(device: impl Into<String>, dir: Option<PathBuf>) -> Tuner {
        let device = device.into();
        let store = dir.map(|d| store::Store::new(&d, &device));
        let mut choices = HashMap::new();
        if let Some(s) = &store {
            match s.load() {
                Ok(Some(file)) => choices.extend(file.choices.into_iter().map(|c| (c.key.clone(), c))),
                Ok(None) => {}
                Err(why) => tracing::warn!(target: TRACE_TARGET, "{why}; ignored, and rewritten at the next tuning"),
            }
        }
        tracing::debug!(target: TRACE_TARGET, device, known = choices.len(), "tuner opened");
        Tuner { device, store, choices: Mutex::new(choices), dirty: AtomicBool::new(false) }
    }

    /// The device this tuner serves.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Where its file is, if it has one.
    pub fn path(&self) -> Option<&std::path::Path> {
        self.store.as_ref().map(|s| s.path())
    }

    /// What to run for `key`, whose variants are `variants` (the default first).
    pub fn plan(&self, key: &TuneKey, variants: &[Variant]) -> Plan {
        self.plan_with(key, variants, mode(), deterministic())
    }

    /// [`Tuner::plan`] under the given settings rather than the process's.
    pub fn plan_with(&self, key: &TuneKey, variants: &[Variant], mode: Mode, deterministic: bool) -> Plan {
        let usable = |v: &Variant| v.bitwise || !deterministic;
        if mode == Mode::Off || variants.len() < 2 {
            return Plan::Use(0);
        }
        let candidates: Vec<usize> = (0..variants.len())
            .filter(|&i| i == 0 || (usable(&variants[i]) && (variants[i].short_list || mode == Mode::Exhaustive)))
            .collect();
        if candidates.len() < 2 {
            return Plan::Use(0);
        }
        // A choice counts when it was made among the candidates these settings time.
        let sum = checksum_of(variants, &candidates);
        if let Some(c) = lock(&self.choices).get(key).filter(|c| c.checksum == sum) {
            let found = variants.iter().position(|v| v.name == c.variant);
            return Plan::Use(found.filter(|&i| usable(&variants[i])).unwrap_or(0));
        }
        Plan::Tune(candidates)
    }

    /// The variant already chosen for `key`, without tuning ([`Plan::Use`]'s index, or the
    /// default): what a recorded device graph runs.
    pub fn chosen(&self, key: &TuneKey, variants: &[Variant]) -> usize {
        match self.plan(key, variants) {
            Plan::Use(i) => i,
            Plan::Tune(_) => 0,
        }
    }

    /// Times `candidates` (from [`Plan::Tune`]) with `run` (one candidate's trial), checks them
    /// against the first (the default), keeps the fastest and records it. `Err` only when the
    /// default itself fails; another failing candidate is rejected.
    pub fn tune<E: std::fmt::Display>(
        &self,
        key: &TuneKey,
        variants: &[Variant],
        candidates: &[usize],
        mut run: impl FnMut(usize) -> Result<Trial, E>,
    ) -> Result<Tuned, E> {
        let started = Instant::now();
        let default = candidates[0];
        let reference = run(default)?;
        let mut best = (default, median(&reference.seconds));
        let default_time = best.1;
        let mut rejected = Vec::new();
        let mut timings = vec![(default, default_time)];
        for &c in &candidates[1..] {
            let trial = match run(c) {
                Ok(t) => t,
                Err(e) => {
                    rejected.push((c, format!("failed: {e}")));
                    continue;
                }
            };
            let verdict = match trial.compared {
                Some(v) => v,
                None => agree(&reference.outputs, &trial.outputs, variants[c].bitwise),
            };
            if let Err(why) = verdict {
                rejected.push((c, why));
                continue;
            }
            let t = median(&trial.seconds);
            timings.push((c, t));
            if t < best.1 && t < default_time * (1.0 - MARGIN) {
                best = (c, t);
            }
        }
        for (c, why) in &rejected {
            tracing::warn!(target: TRACE_TARGET, key = ?key, "variant `{}` rejected: {why}", variants[*c].name);
        }
        let list = timings.iter().map(|(c, t)| format!("{} {:.1} us", variants[*c].name, t * 1e6)).collect::<Vec<_>>();
        let why = format!(
            "`{}` of {} timed ({}){}",
            variants[best.0].name,
            timings.len(),
            list.join(", "),
            if rejected.is_empty() { String::new() } else { format!("; {} rejected", rejected.len()) }
        );
        let elapsed = started.elapsed();
        TUNINGS.fetch_add(1, Ordering::Relaxed);
        TUNING_NANOS.fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        let ms = elapsed.as_secs_f64() * 1e3;
        tracing::debug!(target: TRACE_TARGET, device = self.device, key = ?key, ms, "tuned: {why}");
        let choice = StoredChoice {
            key: key.clone(),
            checksum: checksum_of(variants, candidates),
            variant: variants[best.0].name.clone(),
            bitwise: variants[best.0].bitwise,
            why: why.clone(),
        };
        lock(&self.choices).insert(key.clone(), choice);
        self.dirty.store(true, Ordering::Relaxed);
        Ok(Tuned { chosen: best.0, why, rejected })
    }

    /// Writes this process's choices to the device's file (merged with what another process
    /// wrote meanwhile) when there are new ones; a failure is logged.
    pub fn save(&self) {
        let Some(store) = &self.store else { return };
        if !self.dirty.swap(false, Ordering::Relaxed) {
            return;
        }
        let ours: Vec<StoredChoice> = lock(&self.choices).values().cloned().collect();
        if let Err(why) = store.write(ours) {
            tracing::warn!(target: TRACE_TARGET, "{why}");
        }
    }

    /// Why `key`'s variant was chosen, if it was tuned.
    pub fn why(&self, key: &TuneKey) -> Option<String> {
        lock(&self.choices).get(key).map(|c| c.why.clone())
    }
}

impl Drop for Tuner {
    fn drop(&mut self) {
        self.save();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn median(seconds: &[f64]) -> f64 {
    let mut s = seconds.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() { f64::INFINITY } else { s[s.len() / 2] }
}

/// How far a non-bitwise variant's float output may lie from the default's, relative to the
/// largest magnitude among the default's outputs of that argument: 2^-13 for f32 and f64
/// (reordering a sum of n terms moves it by about sqrt(n) roundings of its largest partial
/// sums), 2^-6 for f16 and bf16 (a sum reordered before its one rounding to 8 or 11 bits can
/// round to the neighbouring value). Integers, booleans and the positions of NaNs and
/// infinities must match exactly.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 | DType::BF16 => 1.0 / 64.0,
        _ => 1.0 / 8192.0,
    }
}

/// `Ok` when `got` agrees with `want` (bytes equal when `bitwise`; else within [`tolerance`]).
pub fn agree(want: &[Output], got: &[Output], bitwise: bool) -> Result<(), String> {
    if want.len() != got.len() {
        return Err(format!("{} outputs, not {}", got.len(), want.len()));
    }
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if w.dtype != g.dtype || w.bytes.len() != g.bytes.len() {
            return Err(format!("output {i} has another dtype or length"));
        }
        if w.bytes == g.bytes {
            continue;
        }
        if bitwise || !w.dtype.is_float() {
            let at = w.bytes.iter().zip(&g.bytes).position(|(a, b)| a != b).unwrap_or(0) / w.dtype.size();
            return Err(format!("output {i} differs at element {at} (the variant must give the same bits)"));
        }
        let (a, b) = (floats(w), floats(g));
        let scale = a.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs()));
        let limit = tolerance(w.dtype) * scale.max(f64::MIN_POSITIVE);
        for (e, (x, y)) in a.iter().zip(&b).enumerate() {
            let same = if x.is_finite() && y.is_finite() {
                (x - y).abs() <= limit
            } else {
                (x.is_nan() && y.is_nan()) || x == y
            };
            if !same {
                return Err(format!("output {i} element {e}: {y} against the default's {x} (limit {limit:e})"));
            }
        }
    }
    Ok(())
}

/// A float output's elements as f64.
fn floats(o: &Output) -> Vec<f64> {
    let b = &o.bytes;
    match o.dtype {
        DType::F64 => b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect(),
        DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")) as f64).collect(),
        DType::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64()).collect(),
        DType::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64()).collect(),
        _ => Vec::new(),
    }
}
