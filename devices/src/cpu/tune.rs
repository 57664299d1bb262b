//! The CPU's kernel variants and their tuning at first run ([`crate::runtime::tune`] chooses
//! and keeps them): how many elements (map loops) or row positions (row kernels) one parallel
//! task takes, 8K, 32K (the default, [`super::map::TASK`]) or 128K, or the whole kernel on the
//! calling thread (exhaustive mode adds 4K and 512K). Tasks only split independent elements
//! and rows, so every variant gives the default's bytes (checked all the same).
//!
//! A kernel is tuned on its real arguments the first time it runs as compiled code (or
//! interpreted, when compiling is off: a key of its own), never while its code compiles: the
//! interpreter's timings would not hold for the code that replaces it. Long kernels are timed
//! fewer times (two runs a candidate from 20 ms). Kernels of arguments under
//! [`MIN_TUNED_ELEMENTS`] (a task or two: the split cannot matter) or whose outputs share
//! memory with an input (written in place) are not timed. The choice is kept per interned kernel, so a later run pays one lookup.
//!
//! `CpuDevice::run` (here) looks the choice up, or tunes, around every kernel it runs. The
//! choice reaches the loops through a thread-local ([`super::map::with_task_size`]) that
//! the calling thread sets around one kernel; rayon's workers never read it.
//!
//! Must never: time a kernel that writes over one of its inputs.

use super::map::{ArgPtr, TASK};
use crate::runtime::tune::{Mode, Output, Plan, Trial, TuneKey, Tuner, Variant, content_hash, mode};
use braid_lowering::{Body, Kernel};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// Kernels whose arguments all hold fewer elements than this keep the default.
pub const MIN_TUNED_ELEMENTS: usize = 4 * TASK;

/// Tasks of the whole kernel: every range under two of them runs on the calling thread.
const ONE_THREAD: usize = usize::MAX / 4;

/// The variants (the default first) and their task sizes.
fn variants() -> &'static (Vec<Variant>, Vec<usize>) {
    static V: OnceLock<(Vec<Variant>, Vec<usize>)> = OnceLock::new();
    V.get_or_init(|| {
        let mut names = Vec::new();
        let mut sizes = Vec::new();
        for (task, short_list) in [
            (TASK, true),
            (TASK / 4, true),
            (TASK * 4, true),
            (ONE_THREAD, true),
            (TASK / 8, false),
            (TASK * 16, false),
        ] {
            let name = if task == ONE_THREAD { "one thread".to_string() } else { format!("tasks of {}K", task / 1024) };
            names.push(Variant { name, bitwise: true, short_list });
            sizes.push(task);
        }
        (names, sizes)
    })
}

/// The process's CPU tuner: one file for every CPU device (they share the machine's cores),
/// in the compiled kernels' cache directory, under the CPU's model and the thread count.
pub fn tuner() -> &'static Tuner {
    static T: OnceLock<Tuner> = OnceLock::new();
    T.get_or_init(|| {
        let model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let device =
            format!("cpu {model}, {} threads, braid {}", rayon::current_num_threads(), env!("CARGO_PKG_VERSION"));
        Tuner::open(device, super::native::cache_dir().ok())
    })
}

/// What a kernel runs with once its choice is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Tasks of this many elements (or row positions).
    Task(usize),
    /// Not known yet (the kernel's compiled code is not ready, or it ran in place): the
    /// default, and ask again next time.
    NotYet,
}

/// Whether `kernel` has variants at all: map loops and row kernels with an argument of at
/// least [`MIN_TUNED_ELEMENTS`] (a row kernel's input, for a reduction).
pub fn tunable(kernel: &Kernel) -> bool {
    matches!(kernel.body, Body::Map(_) | Body::Rows(_)) && kernel.args.iter().any(|a| a.len >= MIN_TUNED_ELEMENTS)
}

/// How a kernel runs now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Interpreted, for good (compiling is off).
    Interpreted,
    /// As compiled code.
    Compiled,
    /// Interpreted until its compiled code is ready.
    Pending,
}

/// The task size to run `kernel` with: the choice made, or after timing the variants with
/// `run` (which runs the kernel on `args` with the task size set) when the plan says so.
/// Interpreted and compiled code are tuned apart (their keys differ); a pending kernel is
/// tuned once its code is ready. A kernel written in place keeps the default for the rest of
/// the process.
pub fn choose(
    kernel: &Arc<Kernel>,
    args: &[ArgPtr],
    code: Code,
    run: impl Fn(usize) -> Result<(), String>,
) -> Result<Choice, String> {
    let (names, sizes) = variants();
    if mode() == Mode::Off {
        return Ok(Choice::Task(TASK));
    }
    let outputs = &args[kernel.inputs..];
    if outputs.iter().any(|o| args[..kernel.inputs].iter().any(|i| i.ptr == o.ptr)) {
        return Ok(Choice::Task(TASK));
    }
    if code == Code::Pending {
        return Ok(Choice::NotYet);
    }
    let hash = content_hash(&(&**kernel, code == Code::Compiled));
    let key = TuneKey::new(hash, &[kernel.output_elements()], kernel.args.iter().map(|a| a.dtype));
    let tuner = tuner();
    let candidates = match tuner.plan(&key, names) {
        Plan::Use(i) => return Ok(Choice::Task(sizes[i])),
        Plan::Tune(c) => c,
    };
    let trial = |c: usize| -> Result<Trial, String> {
        let t0 = Instant::now();
        run(sizes[c])?;
        // Long kernels vary less from run to run: fewer runs time them as well.
        let reps = match t0.elapsed().as_secs_f64() {
            t if t >= 0.02 => 2,
            t if t >= 0.002 => 3,
            _ => mode().repetitions(),
        };
        let mut seconds = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t0 = Instant::now();
            run(sizes[c])?;
            seconds.push(t0.elapsed().as_secs_f64());
        }
        // SAFETY: every output argument points to `len` elements of its dtype (the caller's
        // arguments, checked by the run just made), not written by anything else meanwhile.
        let outputs = outputs
            .iter()
            .map(|a| Output {
                dtype: a.dtype,
                bytes: unsafe { std::slice::from_raw_parts(a.ptr, a.len * a.dtype.size()) }.to_vec(),
            })
            .collect();
        Ok(Trial { seconds, outputs, compared: None })
    };
    let tuned = tuner.tune(&key, names, &candidates, trial)?;
    tuner.save();
    Ok(Choice::Task(sizes[tuned.chosen]))
}

/// Whether tuning is off now (every kernel then runs its default, whatever was chosen).
pub fn mode_is_off() -> bool {
    mode() == Mode::Off
}

/// The name of the variant of task size `task` (for dumps): `None` for the default.
pub fn variant_name(task: usize) -> Option<String> {
    let (names, sizes) = variants();
    let i = sizes.iter().position(|&s| s == task)?;
    (i != 0).then(|| names[i].name.clone())
}

impl super::CpuDevice {
    /// Runs `kernel`, preparing it once per distinct (interned) kernel, with the task size
    /// tuned for it (`tune`; timed now when it is first ready).
    pub(super) fn run(&self, kernel: &Arc<Kernel>, args: &[ArgPtr]) -> Result<(), String> {
        if !tunable(kernel) || mode() == Mode::Off {
            return self.run_untuned(kernel, args);
        }
        let key = Arc::as_ptr(kernel) as usize;
        let known = self.prepared.lock().unwrap_or_else(|p| p.into_inner()).tasks.get(&key).map(|t| t.1);
        let task = match known {
            Some(task) => task,
            None => {
                // Neither the probe nor the trial runs count as the program's launches.
                use super::native::Native;
                let code = match self.native.mode() {
                    super::CompileMode::Off => Code::Interpreted,
                    _ if Native::uncounted(|| self.compiled(kernel)) => Code::Compiled,
                    _ => Code::Pending,
                };
                let run =
                    |task| Native::uncounted(|| super::map::with_task_size(task, || self.run_untuned(kernel, args)));
                match choose(kernel, args, code, run)? {
                    Choice::NotYet => TASK,
                    Choice::Task(task) => {
                        let mut prep = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
                        if prep.tasks.len() >= super::MAX_PREPARED {
                            prep.tasks.clear();
                        }
                        prep.tasks.insert(key, (kernel.clone(), task));
                        task
                    }
                }
            }
        };
        super::map::with_task_size(task, || self.run_untuned(kernel, args))
    }

    /// Whether `kernel` runs as compiled code now (asking starts its compile if it has none).
    fn compiled(&self, kernel: &Arc<Kernel>) -> bool {
        match &kernel.body {
            Body::Map(loops) if loops.iter().any(super::tile::reorders) => {
                self.native.library(&self.reordered_map(kernel), None)
            }
            Body::Rows(r) => {
                let p = super::rows::plan(r);
                self.native.library(kernel, Some(super::native::PlannedRows { kernel: p.kernel(r), split: p.splits() }))
            }
            _ => self.native.library(kernel, None),
        }
        .is_some()
    }

    /// The task size chosen for `kernel`, if it was tuned here.
    pub(super) fn task_of(&self, kernel: &Arc<Kernel>) -> Option<usize> {
        let prep = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
        prep.tasks.get(&(Arc::as_ptr(kernel) as usize)).map(|t| t.1)
    }
}
