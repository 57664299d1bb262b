//! Compiled CPU kernels: a kernel of map loops, or a row kernel walked with one stride, printed
//! as host C ([`braid_lowering::host_c`]), built by the system's C compiler into a shared library, loaded,
//! and run over rayon tasks like the interpreter's loops; a row kernel whose few long rows are
//! split across threads (see `rows::Plan::splits`) in its split form, one segment per call, the
//! segments cut and combined by `split` as for the interpreter. They compute the same values as the
//! interpreter, bit for bit except for the payload of a NaN (checked by
//! `tests/native_kernels.rs`), so a kernel may run interpreted until its library is ready and
//! compiled after, without a result ever depending on which.
//!
//! [`Native`] decides which kernels to compile and when ([`CompileMode`]): by default in the
//! background, one at a time on a thread of its own, from a kernel's second run (a kernel that
//! runs once is not worth a compile) while the interpreter runs it, or from its first run when
//! an earlier process left its library in the disk cache. Small kernels (fewer than
//! [`MIN_ELEMENTS`] elements, or loops whose last dimension is shorter than [`MIN_RUN`]) wait
//! for their [`SMALL_RUNS`]th run: a few runs of them cost little interpreted, many runs (a
//! replayed step) cost the interpreter's per-node dispatch each time. Never kernels the
//! printer does not print (matrix products, rows not walked with one stride, split rows with
//! positions after the axis), nor kernels of more than
//! [`MAX_NODES`] expression nodes. Libraries are shared by every device of the process
//! (keyed by their source) and kept on disk across processes (see `compile`). A kernel whose
//! compilation fails is interpreted, and the failure logged once.
//!
//! This module never changes what a kernel computes and never touches the schedule.

mod compile;
pub(crate) use compile::cache_dir;

use super::CompileMode;
use super::eval::{Simd, simd};
use super::map::{ArgPtr, in_tasks};
use super::rows::Plan;
use braid_lowering::{Body, Kernel, RowKernel, check_args, host_c};
use hashbrown::HashMap;
use libloading::Library;
use rayon::prelude::*;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};

pub use compile::available as compiler_available;

/// Kernels producing fewer elements than this are small: interpreted until they have run
/// [`SMALL_RUNS`] times.
pub const MIN_ELEMENTS: usize = 1 << 16;
/// Loops whose runs ([`host_c::run_length`]: along the last dimension after merging contiguous
/// ones, or whole tiles of a transposing loop) are shorter than this make a kernel small too:
/// the compiled code pays index arithmetic per run.
pub const MIN_RUN: usize = 64;
/// Runs after which a small kernel is compiled as well: one that runs this often (a replayed
/// `Step`, a training loop's cached plan) spends more time in the interpreter's per-node
/// dispatch than its library's call costs (C4's step: about 2 us of 4.5 in the interpreter for
/// 60 nodes over one element), while a kernel that runs a few times is not worth a compile.
pub const SMALL_RUNS: u64 = 64;

/// Kernels of more expression nodes than this (all loops together) stay interpreted: the
/// compiler takes seconds over their thousands of lines (on a thread that competes with the
/// program's), and a loop body that large is no longer vectorised, while the interpreter's
/// per-node dispatch is already small next to each node's work over a chunk. (A 10,000-node
/// random graph, O2's, fuses into kernels of about 2,500 nodes: compiled, its flush ran 2.4x
/// slower.)
pub const MAX_NODES: usize = 1024;

type LoopFn = unsafe extern "C" fn(*const *mut u8, i64, i64);
/// A row kernel's entry point: arguments, rows `from..to`, scratch.
type RowsFn = unsafe extern "C" fn(*const *mut u8, i64, i64, *mut u8);
/// An entry point of a split row kernel: arguments, row, positions `from..to`, the finished
/// reductions, the accumulator it writes (see `host_c::print_split`).
type SplitFn = unsafe extern "C" fn(*const *mut u8, i64, i64, i64, *const u8, *mut u8);

/// The entry points of a row kernel printed split: one fold per reduction (in node order), the
/// row stores, the element stores.
struct SplitEntries {
    folds: Vec<SplitFn>,
    row: SplitFn,
    elements: SplitFn,
}

/// How a row kernel runs, as its plan says (`rows::plan`): the kernel it runs (re-tiled or
/// not), and whether its rows are split across threads (`rows::Plan::splits`), which it is then
/// compiled for.
#[derive(Clone, Copy)]
pub struct PlannedRows<'a> {
    pub kernel: &'a RowKernel,
    pub split: bool,
}

/// A loaded library and its entry points: one per map loop of the kernel it was printed from,
/// or one for its rows.
pub struct NativeKernel {
    loops: Vec<LoopFn>,
    /// A row kernel's entry point and the scratch bytes each call needs.
    rows: Option<(RowsFn, usize)>,
    /// A split row kernel's entry points.
    split: Option<SplitEntries>,
    /// Keeps the code of `loops` and `rows` mapped.
    _lib: Library,
}

/// The largest scratch kept by a thread between calls (1 MiB); larger ones are freed after use.
const KEPT_SCRATCH_WORDS: usize = (1 << 20) / 8;

thread_local! {
    /// The scratch of compiled row kernels run on this thread (kept values), reused from call
    /// to call up to [`KEPT_SCRATCH_WORDS`]; in `u64`s so that it is aligned for every element
    /// type.
    static ROW_SCRATCH: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl NativeKernel {
    /// Prints `kernel`, compiles it (or finds it in the disk cache) and loads it, on the calling
    /// thread.
    pub fn build(kernel: &Kernel) -> Result<NativeKernel, String> {
        let src = host_c::print(kernel, "braid_kernel", host_target(simd()))?;
        Self::load(&src)
    }

    /// Prints row kernel `kernel` in its split form (whatever its sizes), compiles it (or finds
    /// it in the disk cache) and loads it, on the calling thread.
    pub fn build_split(kernel: &Kernel) -> Result<NativeKernel, String> {
        Self::load(&host_c::print_split(kernel, "braid_kernel", host_target(simd()))?)
    }

    /// As [`build`](Self::build), for vector level `level` (never above the CPU's): tests check
    /// that every level gives the same bits.
    pub fn build_at(kernel: &Kernel, level: Simd) -> Result<NativeKernel, String> {
        let src = host_c::print(kernel, "braid_kernel", host_target(level.min(simd())))?;
        entries(&src, compile::build_for(&src.source, false, level)?)
    }

    /// The library of `src`, from the disk cache or compiled (again, if a cached library lacks
    /// an entry point).
    fn load(src: &host_c::HostSource) -> Result<NativeKernel, String> {
        entries(src, compile::build(&src.source, false)?)
            .or_else(|_: String| entries(src, compile::build(&src.source, true)?))
    }

    /// The library of `src` if the disk cache holds it already; compiles nothing.
    fn cached(src: &host_c::HostSource) -> Option<NativeKernel> {
        entries(src, compile::cached(&src.source)?).ok()
    }

    /// Runs row kernel `r` over `args`, rows spread over rayon's threads as the interpreter
    /// spreads them (whole rows; split rows run through
    /// [`run_split_rows`](Self::run_split_rows)).
    ///
    /// # Safety
    /// `r` must print to the source this library was built from, as for [`run`](Self::run).
    pub unsafe fn run_rows(&self, r: &RowKernel, args: &[ArgPtr]) -> Result<(), String> {
        let Some((f, scratch)) = self.rows else { return Err("a compiled kernel of map loops run as rows".into()) };
        check_args(&r.loads, &r.stores, |a| args.get(a as usize).map(|p| (p.dtype, p.len)))?;
        let (outer, row): (usize, usize) = match r.axis {
            Some(d) => (r.dims[..d].iter().product(), r.dims[d..].iter().product()),
            None => (1, r.dims.iter().product()),
        };
        if outer == 0 {
            return Ok(());
        }
        let ptrs: SmallVec<[*mut u8; 16]> = args.iter().map(|a| a.ptr).collect();
        let ptrs = Ptrs(&ptrs);
        let words = scratch.div_ceil(8);
        // SAFETY: the code was printed from `r` (the caller's promise), whose accesses were just
        // checked; different rows never write the same element, and each call has a scratch
        // of its own of the size the printer asked for.
        let call = |from: usize, to: usize| {
            let run = |s: &mut Vec<u64>| {
                if s.len() < words {
                    s.resize(words, 0);
                }
                unsafe { f(ptrs.base(), from as i64, to as i64, s.as_mut_ptr() as *mut u8) };
            };
            if words <= KEPT_SCRATCH_WORDS {
                ROW_SCRATCH.with(|s| run(&mut s.borrow_mut()));
            } else {
                // Long rows: a scratch of their own, freed after (their work dwarfs its cost).
                run(&mut Vec::new());
            }
            Ok::<(), String>(())
        };
        let per_task = (super::map::task_size() / row.max(1)).max(1);
        if outer <= per_task {
            return call(0, outer);
        }
        (0..outer.div_ceil(per_task))
            .into_par_iter()
            .try_for_each(|t| call(t * per_task, ((t + 1) * per_task).min(outer)))
    }

    /// Runs row kernel `r`, planned as `p`, over `args`, each row split across threads as the
    /// interpreter splits it (`split::run_row_compiled`).
    ///
    /// # Safety
    /// This library must be `r`'s split form ([`build_split`](Self::build_split), or a library
    /// [`Native::library`] gave for `r` with `split`), and `p` must be `r`'s plan.
    pub unsafe fn run_split_rows(&self, r: &RowKernel, p: &Plan, args: &[ArgPtr]) -> Result<(), String> {
        let Some(entries) = &self.split else { return Err("a compiled kernel run as split rows".into()) };
        if entries.folds.len() != p.phases.len() || p.inner != 1 {
            return Err("a compiled split kernel run with another kernel's plan".into());
        }
        check_args(&r.loads, &r.stores, |a| args.get(a as usize).map(|p| (p.dtype, p.len)))?;
        let ptrs: SmallVec<[*mut u8; 16]> = args.iter().map(|a| a.ptr).collect();
        // SAFETY of every call through `code`: the code was printed from `r` (the caller's
        // promise), whose accesses were just checked; segments write disjoint positions.
        let code = SplitCode { entries, args: Ptrs(&ptrs) };
        let outer: usize = p.outer_dims.iter().product();
        (0..outer).for_each(|o| super::split::run_row_compiled(r, p, &code, o));
        Ok(())
    }

    /// Runs `kernel` over `args`.
    ///
    /// # Safety
    /// `kernel` must print to the source this library was built from (the kernel it was built
    /// from, or one differing only in argument lengths): the compiled code accesses memory
    /// through that kernel's views, and only `kernel`'s are checked against `args`.
    pub unsafe fn run(&self, kernel: &Kernel, args: &[ArgPtr]) -> Result<(), String> {
        // SAFETY: the caller's promise, and the accesses are checked.
        unsafe { self.run_checking(kernel, args, true) }
    }

    /// [`NativeKernel::run`], checking `kernel`'s accesses against `args` only when `check`.
    ///
    /// # Safety
    /// As [`NativeKernel::run`]; without `check`, `args` must also have the dtypes and lengths of
    /// arguments an earlier checked run of `kernel` on this library accepted.
    pub unsafe fn run_checking(&self, kernel: &Kernel, args: &[ArgPtr], check: bool) -> Result<(), String> {
        let Body::Map(loops) = &kernel.body else { return Err("a compiled kernel of map loops only".into()) };
        if loops.len() != self.loops.len() || args.len() != kernel.args.len() {
            return Err("a compiled kernel run with another kernel's loops or arguments".into());
        }
        let ptrs: SmallVec<[*mut u8; 16]> = args.iter().map(|a| a.ptr).collect();
        let ptrs = Ptrs(&ptrs);
        for (l, &f) in loops.iter().zip(&self.loops) {
            // Every view within its argument, with the dtypes the printed code assumes (its
            // expression was checked when it was printed).
            if check {
                check_args(&l.loads, &l.stores, |a| args.get(a as usize).map(|p| (p.dtype, p.len)))?;
            }
            // SAFETY: the code was printed from `l` (the caller's promise), whose accesses were
            // just checked; tasks cover disjoint index ranges, and different indices never write
            // the same element.
            let call = |a: usize, b: usize| {
                unsafe { f(ptrs.base(), a as i64, b as i64) };
                Ok(())
            };
            if l.numel() > 0 {
                in_tasks(l.numel(), call)?;
            }
        }
        Ok(())
    }
}

/// A split row kernel's compiled code over one call's arguments (checked against the kernel
/// it was printed from before this is made): each call computes one segment of a row.
pub(super) struct SplitCode<'a> {
    entries: &'a SplitEntries,
    args: Ptrs<'a>,
}

impl SplitCode<'_> {
    /// Folds positions `from..to` of row `o` into a fresh accumulator of reduction `q` (its
    /// value, compensation and position: see `reduce::Acc::from_parts`), given the finished
    /// reductions before it in `results`.
    pub(super) fn fold(&self, q: usize, o: usize, (from, to): (usize, usize), results: &[u64]) -> [u64; 3] {
        assert!(results.len() >= q, "the reductions before reduction {q}");
        let mut state = [0u64; 3];
        // SAFETY: see `NativeKernel::run_split_rows`; the code reads the `q` results before
        // reduction `q` (8 bytes each) and writes 24 bytes of state.
        unsafe {
            (self.entries.folds[q])(
                self.args.base(),
                o as i64,
                from as i64,
                to as i64,
                results.as_ptr() as *const u8,
                state.as_mut_ptr() as *mut u8,
            )
        };
        state
    }

    /// Writes row `o`'s per-row stores, given every reduction's result.
    pub(super) fn row_stores(&self, o: usize, results: &[u64]) {
        assert_eq!(results.len(), self.entries.folds.len(), "every reduction's result");
        // SAFETY: as for `fold`; the code reads every result and no state.
        unsafe {
            (self.entries.row)(self.args.base(), o as i64, 0, 0, results.as_ptr() as *const u8, std::ptr::null_mut())
        };
    }

    /// Writes the per-element stores of positions `from..to` of row `o`, given every
    /// reduction's result.
    pub(super) fn element_stores(&self, o: usize, (from, to): (usize, usize), results: &[u64]) {
        assert_eq!(results.len(), self.entries.folds.len(), "every reduction's result");
        // SAFETY: as for `row_stores`; segments write disjoint positions.
        unsafe {
            (self.entries.elements)(
                self.args.base(),
                o as i64,
                from as i64,
                to as i64,
                results.as_ptr() as *const u8,
                std::ptr::null_mut(),
            )
        };
    }
}

/// The kernel of `lib`'s entry points for `src`.
fn entries(src: &host_c::HostSource, lib: Library) -> Result<NativeKernel, String> {
    // SAFETY (of each `get` below): the printer declared each entry with exactly the signature
    // it is looked up with.
    if let (Some(scratch), [e]) = (src.row_scratch, &src.entries[..]) {
        let f = unsafe { lib.get::<RowsFn>(e.as_bytes()) };
        let f = f.map(|f| *f).map_err(|err| format!("entry {e} not found: {err}"))?;
        return Ok(NativeKernel { loops: vec![], rows: Some((f, scratch)), split: None, _lib: lib });
    }
    if src.split_rows {
        let mut fns: Vec<SplitFn> = (src.entries.iter())
            .map(|e| {
                let f = unsafe { lib.get::<SplitFn>(e.as_bytes()) };
                f.map(|f| *f).map_err(|err| format!("entry {e} not found: {err}"))
            })
            .collect::<Result<_, _>>()?;
        let (Some(elements), Some(row)) = (fns.pop(), fns.pop()) else {
            return Err("a split row kernel without its store entries".into());
        };
        let split = SplitEntries { folds: fns, row, elements };
        return Ok(NativeKernel { loops: vec![], rows: None, split: Some(split), _lib: lib });
    }
    let loops = (src.entries.iter())
        .map(|e| {
            // SAFETY: the printer declared this entry with exactly the `LoopFn` signature.
            let f = unsafe { lib.get::<LoopFn>(e.as_bytes()) };
            f.map(|f| *f).map_err(|err| format!("entry {e} not found: {err}"))
        })
        .collect::<Result<_, _>>()?;
    Ok(NativeKernel { loops, rows: None, split: None, _lib: lib })
}

/// Argument pointers shared with rayon tasks (see `map::SharedArgs` for why that is sound).
#[derive(Clone, Copy)]
struct Ptrs<'a>(&'a [*mut u8]);
unsafe impl Send for Ptrs<'_> {}
unsafe impl Sync for Ptrs<'_> {}

impl Ptrs<'_> {
    fn base(self) -> *const *mut u8 {
        self.0.as_ptr()
    }
}

/// One library being built or built, shared by every kernel printed to the same source.
struct Slot {
    source: host_c::HostSource,
    built: OnceLock<Result<Arc<NativeKernel>, String>>,
    queued: AtomicBool,
    /// Runs asked for so far: compiling starts at the second.
    runs: AtomicU64,
}

impl Slot {
    fn build(&self) -> &Result<Arc<NativeKernel>, String> {
        self.built.get_or_init(|| {
            let r = NativeKernel::load(&self.source).map(Arc::new);
            if let Err(e) = &r {
                tracing::warn!("a kernel could not be compiled and stays interpreted: {e}");
            }
            r
        })
    }
}

impl Slot {
    /// Takes the library from the disk cache if it is there (compiles nothing).
    fn try_cached(&self) {
        if let Some(lib) = NativeKernel::cached(&self.source) {
            tracing::debug!(target: "braid::kernel", "a compiled kernel came from the disk cache");
            let _ = self.built.set(Ok(Arc::new(lib)));
        }
    }
}

/// The process's libraries, by source.
fn slots() -> &'static Mutex<HashMap<String, Arc<Slot>>> {
    static SLOTS: OnceLock<Mutex<HashMap<String, Arc<Slot>>>> = OnceLock::new();
    SLOTS.get_or_init(Default::default)
}

/// Hands `slot` to the background compiler thread (started on first use).
fn enqueue(slot: Arc<Slot>) {
    static QUEUE: OnceLock<Mutex<mpsc::Sender<Arc<Slot>>>> = OnceLock::new();
    let queue = QUEUE.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Arc<Slot>>();
        let spawned = std::thread::Builder::new().name("braid-cc".into()).spawn(move || {
            for slot in rx {
                slot.build();
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("no background compiler thread ({e}): kernels stay interpreted");
        }
        Mutex::new(tx)
    });
    // If the thread could not start, the slot stays empty and the kernel interpreted.
    let _ = queue.lock().unwrap_or_else(|p| p.into_inner()).send(slot);
}

thread_local! {
    /// Set while the tuner runs a kernel for itself ([`Native::uncounted`]).
    static UNCOUNTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A device's view of compiled kernels: its mode, which of its kernels have a library, and how
/// many kernels it ran compiled.
pub struct Native {
    mode: AtomicU8,
    /// By the address of an interned kernel.
    kernels: Mutex<HashMap<usize, KernelEntry>>,
    launches: AtomicU64,
}

/// An interned kernel (held so its address stays its own), its runs, and its library's slot
/// once it is looked for (`None` in it when the kernel is not printed for the host).
struct KernelEntry {
    _kernel: Arc<Kernel>,
    runs: u64,
    slot: Option<Option<Arc<Slot>>>,
}

/// Entries kept per device before the table is cleared (as the row-kernel plans are).
const MAX_KERNELS: usize = 4096;

impl Default for Native {
    fn default() -> Native {
        Native {
            mode: AtomicU8::new(CompileMode::from_env() as u8),
            kernels: Default::default(),
            launches: AtomicU64::new(0),
        }
    }
}

impl Native {
    pub fn mode(&self) -> CompileMode {
        match self.mode.load(Ordering::Relaxed) {
            0 => CompileMode::Off,
            1 => CompileMode::Background,
            _ => CompileMode::Blocking,
        }
    }

    pub fn set_mode(&self, mode: CompileMode) {
        self.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// Runs `f` without counting the libraries it asks for as launches (the tuner's trial
    /// runs and readiness probes, `super::tune`: [`Native::launches`] counts the runs a
    /// program asked for).
    pub fn uncounted<T>(f: impl FnOnce() -> T) -> T {
        /// Puts the flag back when dropped, also when `f` panics.
        struct Restore(bool);
        impl Drop for Restore {
            fn drop(&mut self) {
                UNCOUNTED.with(|u| u.set(self.0));
            }
        }
        let _restore = Restore(UNCOUNTED.with(|u| u.replace(true)));
        f()
    }

    /// Counts a launch of a library its caller kept from an earlier [`Native::library`].
    pub fn count_launch(&self) {
        self.launches.fetch_add(1, Ordering::Relaxed);
    }

    /// Kernels run compiled so far.
    pub fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// The library to run `kernel` with, if it is compiled (and ready); in `Blocking` mode
    /// this compiles it first, in `Background` mode it queues it. A small kernel (see
    /// [`MIN_ELEMENTS`]) is looked for only from its [`SMALL_RUNS`]th run. A row kernel is
    /// compiled as `rows` says its plan runs it (`None`: interpreted).
    pub fn library(&self, kernel: &Arc<Kernel>, rows: Option<PlannedRows<'_>>) -> Option<Arc<NativeKernel>> {
        let mode = self.mode();
        if mode == CompileMode::Off {
            return None;
        }
        let (small, nodes) = match &kernel.body {
            Body::Map(loops) => {
                let long_runs = loops.iter().all(|l| l.dims.is_empty() || host_c::run_length(l) >= MIN_RUN);
                let nodes = loops.iter().map(|l| l.expr.nodes.len()).sum();
                (kernel.output_elements() < MIN_ELEMENTS || !long_runs, nodes)
            }
            // A row's per-row work is a few scalars in compiled code, so short rows are fine.
            Body::Rows(_) => {
                let r = rows?.kernel;
                (r.dims.iter().product::<usize>() < MIN_ELEMENTS, r.expr.nodes.len())
            }
            _ => return None,
        };
        if nodes > MAX_NODES {
            return None;
        }
        let slot = {
            let mut kernels = self.kernels.lock().unwrap_or_else(|p| p.into_inner());
            if kernels.len() >= MAX_KERNELS {
                kernels.clear();
            }
            let key = Arc::as_ptr(kernel) as usize;
            let entry =
                kernels.entry(key).or_insert_with(|| KernelEntry { _kernel: kernel.clone(), runs: 0, slot: None });
            entry.runs += 1;
            if small && entry.runs < SMALL_RUNS {
                return None;
            }
            // Printed once per kernel (the slot is shared by every kernel of the same source).
            entry.slot.get_or_insert_with(|| slot_for(kernel, rows)).clone()?
        };
        // Runs of this source, by any kernel of any device.
        let runs = slot.runs.fetch_add(1, Ordering::Relaxed) + 1;
        let built = match mode {
            CompileMode::Blocking => slot.build(),
            _ => {
                if runs == 1 && slot.built.get().is_none() {
                    // Compiled by an earlier run of a program: used from the first run.
                    slot.try_cached();
                }
                if runs >= 2 && slot.built.get().is_none() && !slot.queued.swap(true, Ordering::Relaxed) {
                    enqueue(slot.clone());
                }
                slot.built.get()?
            }
        };
        let lib = built.as_ref().ok()?.clone();
        if !UNCOUNTED.with(|u| u.get()) {
            self.launches.fetch_add(1, Ordering::Relaxed);
        }
        Some(lib)
    }
}

/// What this machine's kernels are printed for: its streaming size and the vector level they
/// are compiled at (`compile`'s flags).
fn host_target(level: Simd) -> host_c::HostTarget {
    let f32_lanes = match level {
        Simd::Avx512 => 16,
        Simd::Avx2 => 8,
        Simd::Baseline => 4,
    };
    host_c::HostTarget { stream_bytes: super::map::stream_bytes(), f32_lanes }
}

/// The slot of `kernel`'s source (as `rows` says for a row kernel), or `None` when it is not
/// printed for the host or there is no compiler.
fn slot_for(kernel: &Kernel, rows: Option<PlannedRows<'_>>) -> Option<Arc<Slot>> {
    compile::available().ok()?;
    let source = match (&kernel.body, rows) {
        (Body::Rows(_), Some(r)) => {
            let body = Body::Rows(r.kernel.clone());
            let planned = Kernel { args: kernel.args.clone(), inputs: kernel.inputs, body };
            match r.split {
                true => host_c::print_split(&planned, "braid_kernel", host_target(simd())),
                false => host_c::print(&planned, "braid_kernel", host_target(simd())),
            }
        }
        _ => host_c::print(kernel, "braid_kernel", host_target(simd())),
    };
    let source = source.ok()?;
    let mut slots = slots().lock().unwrap_or_else(|p| p.into_inner());
    if slots.len() >= MAX_KERNELS {
        // Forget every slot; kernels holding one keep its library loaded.
        slots.clear();
    }
    let slot = slots.entry(source.source.clone()).or_insert_with(|| {
        Arc::new(Slot { source, built: OnceLock::new(), queued: AtomicBool::new(false), runs: AtomicU64::new(0) })
    });
    Some(slot.clone())
}

#[cfg(test)]
mod tests;
