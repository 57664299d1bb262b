//! The variants of a WGSL kernel and their tuning at its first launch
//! ([`crate::runtime::tune`] chooses and keeps them).
//!
//! Variants: a map kernel (every loop of it) printed with 128 or 64 threads a workgroup, or
//! 256 threads of 4 indices each, besides the default's 256 threads of one index
//! (`braid_lowering::wgsl::WgslOptions`); exhaustive mode adds 2 and 4 indices a thread at
//! each size, and 512 and 1024 threads where the adapter's `max_invocations_per_workgroup`
//! allows. Every printing computes each element by the same statements, so every variant gives
//! the default's bytes (marked bitwise, and checked all the same), NaNs aside: each printing
//! is compiled anew, and the driver may give a NaN the other sign (lavapipe's LLVM does, where
//! it orders an addition's operands otherwise). A variant whose NaNs differ on the arguments
//! it is timed on is rejected; on later arguments a kept variant's NaNs may still differ from
//! the default's in their sign or payload bits (no other bit), even under
//! `BRAID_DETERMINISTIC=1`. Row kernels, products,
//! gathers, scatters and attention have no variants, nor kernels moving under
//! [`MIN_TUNED_BYTES`] (launch-bound), nor map kernels that read an output argument (a loop
//! reading what an earlier loop wrote, or accumulating into it: not timed on their arguments).
//!
//! Tuning runs on the kernel's real arguments when an eager flush first launches it: the work
//! issued so far is submitted (it writes the inputs), then each candidate runs once to warm
//! up (and compile), then is timed by the wall clock around a submit and a wait for the
//! device, a few times; its outputs are read back (through a mapped buffer) and the tuner
//! compares them with the default's. The flush then encodes the chosen variant as usual, so the
//! outputs are the ones of a plain launch whatever the trials left. A kernel whose outputs
//! share bytes with an input (written in place), a flush planned under a memory budget, or
//! outputs over [`MAX_COMPARED_BYTES`] are not timed: the default runs, and a later launch
//! may tune. A failed trial logs a warning and the default runs.
//!
//! The choices live in the process's one wgpu [`Tuner`] ([`tuner`]), its file in the kernel
//! cache directory (`BRAID_KERNEL_CACHE`, as the CPU's), under the adapter's name, backend,
//! driver and braid's version.
//!
//! Must never: time a kernel that writes over one of its inputs or reads its outputs, keep a
//! variant whose outputs were not compared with the default's, or fail a kernel because
//! tuning failed.

use super::WgpuContext;
use super::kernels::WgslKernel;
use super::memory::{WgpuMemory, lock};
use crate::DeviceError;
use crate::runtime::tune::{Mode, Output, Plan, TRACE_TARGET, Trial, TuneKey, Tuner, Variant, content_hash, mode};
use braid_lowering::wgsl::{self, Features, WgslOptions, WgslSource};
use braid_lowering::{Body, Kernel};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Kernels moving fewer bytes than this are not tuned.
pub const MIN_TUNED_BYTES: usize = 1 << 20;
/// Kernels whose outputs hold more than this are not timed (each trial reads them back).
pub const MAX_COMPARED_BYTES: usize = 1 << 28;

/// The process's wgpu tuner (every wgpu device of a process is on its first adapter).
pub fn tuner(ctx: &WgpuContext) -> &'static Tuner {
    static T: OnceLock<Tuner> = OnceLock::new();
    T.get_or_init(|| {
        let i = &ctx.info;
        let device = format!(
            "wgpu {} ({:?}, {:?}), driver {} {}, braid {}",
            i.name,
            i.backend,
            i.device_type,
            i.driver,
            i.driver_info,
            env!("CARGO_PKG_VERSION")
        );
        Tuner::open(device, crate::cpu::native::cache_dir().ok())
    })
}

/// The printings offered: (threads, indices a thread, on the short list).
const PRINTINGS: [(u32, u32, bool); 11] = [
    (128, 1, true),
    (64, 1, true),
    (256, 4, true),
    (256, 2, false),
    (128, 2, false),
    (128, 4, false),
    (64, 2, false),
    (64, 4, false),
    (512, 1, false),
    (1024, 1, false),
    (512, 2, false),
];

/// A kernel's variants (the default first), printed, compiled when first run.
pub struct Variants {
    pub key: TuneKey,
    pub variants: Vec<Variant>,
    printed: Vec<WgslSource>,
    compiled: Mutex<Vec<Option<Arc<WgslKernel>>>>,
}

/// The variants of `kernel`, printed as `default` for `features`, if it has a choice.
pub fn variants(kernel: &Kernel, default: &Arc<WgslKernel>, features: &Features) -> Option<Variants> {
    let Body::Map(loops) = &kernel.body else { return None };
    let reads_outputs = loops.iter().flat_map(|l| &l.loads).any(|l| l.arg as usize >= kernel.inputs);
    if reads_outputs || default.source.entries.is_empty() || kernel.bytes_moved() < MIN_TUNED_BYTES {
        return None;
    }
    let mut variants = vec![Variant { name: "default".into(), bitwise: true, short_list: true }];
    let mut printed = vec![default.source.clone()];
    for (threads, per, short_list) in PRINTINGS {
        let options = WgslOptions { map_threads: threads, map_elements: per };
        if threads > features.max_invocations_per_workgroup || options == WgslOptions::default() {
            continue;
        }
        // A printing refused for this kernel (its indices past u32) is no variant of it.
        let Ok(p) = wgsl::print_with(kernel, features, &options) else { continue };
        let name = match per {
            1 => format!("map {threads} threads"),
            _ => format!("map {threads} threads x{per}"),
        };
        variants.push(Variant { name, bitwise: true, short_list });
        printed.push(p);
    }
    let extents: Vec<usize> = loops.iter().map(|l| l.numel()).collect();
    let key = TuneKey::new(content_hash(&default.source.source), &extents, kernel.args.iter().map(|a| a.dtype));
    let mut compiled = vec![None; printed.len()];
    compiled[0] = Some(default.clone());
    Some(Variants { key, variants, printed, compiled: Mutex::new(compiled) })
}

impl Variants {
    /// Variant `i` compiled (once).
    fn kernel(&self, ctx: &WgpuContext, i: usize) -> Result<Arc<WgslKernel>, DeviceError> {
        if let Some(k) = &lock(&self.compiled)[i] {
            return Ok(k.clone());
        }
        let k = ctx.compile(self.printed[i].clone())?;
        lock(&self.compiled)[i] = Some(k.clone());
        Ok(k)
    }

    /// The name of the variant chosen for this kernel (for dumps): `None` for the default.
    pub fn chosen_name(&self, ctx: &WgpuContext) -> Option<String> {
        if mode() == Mode::Off {
            return None;
        }
        let i = tuner(ctx).chosen(&self.key, &self.variants);
        (i != 0).then(|| self.variants[i].name.clone())
    }
}

/// Where a kernel's arguments lie: per binding but the zero uniform, its buffer and offset;
/// and which of them are the kernel's outputs.
pub struct Bound<'a> {
    pub kernel: &'a Kernel,
    pub refs: &'a [(&'a wgpu::Buffer, u64)],
    /// Whether the flush may time a kernel now (not under a memory budget).
    pub may_time: bool,
}

/// The compiled kernel to launch: the variant chosen, or after timing the candidates now when
/// the plan says so and the arguments allow it; `default` when tuning is off or fails.
pub fn choose(shared: &WgpuMemory, v: &Variants, default: &Arc<WgslKernel>, b: &Bound<'_>) -> Arc<WgslKernel> {
    let ctx = &shared.ctx;
    let tuner = tuner(ctx);
    let chosen = match tuner.plan(&v.key, &v.variants) {
        Plan::Use(i) => i,
        Plan::Tune(candidates) => {
            if let Some(why) = untimeable(b) {
                tracing::debug!(target: TRACE_TARGET, key = ?v.key, "not tuned now ({why}): the default runs");
                return default.clone();
            }
            match tune_now(shared, tuner, v, &candidates, b) {
                Ok(i) => i,
                Err(e) => {
                    tracing::warn!(target: TRACE_TARGET, "tuning a wgpu kernel failed, its default runs: {e}");
                    return default.clone();
                }
            }
        }
    };
    if chosen == 0 {
        return default.clone();
    }
    v.kernel(ctx, chosen).unwrap_or_else(|e| {
        tracing::warn!(target: TRACE_TARGET, "variant `{}` did not compile, the default runs: {e}", v.variants[chosen].name);
        default.clone()
    })
}

/// Why `b`'s kernel cannot be timed on its arguments now, if it cannot.
fn untimeable(b: &Bound<'_>) -> Option<&'static str> {
    let k = b.kernel;
    if !b.may_time {
        return Some("a flush under a memory budget");
    }
    if k.args[k.inputs..].iter().map(|a| a.len * a.dtype.size()).sum::<usize>() > MAX_COMPARED_BYTES {
        return Some("outputs too large to compare");
    }
    // Bindings follow the arguments (a map kernel has no scratch): an output overlapping an
    // input is written in place.
    let span = |i: usize| (b.refs[i].0, b.refs[i].1, b.refs[i].1 + (k.args[i].len * k.args[i].dtype.size()) as u64);
    let overlaps =
        |(a, x0, x1): (&wgpu::Buffer, u64, u64), (c, y0, y1): (&wgpu::Buffer, u64, u64)| a == c && x0 < y1 && y0 < x1;
    if b.refs.len() < k.args.len() {
        return Some("bindings other than the arguments");
    }
    let in_place = (k.inputs..k.args.len()).any(|o| (0..k.inputs).any(|i| overlaps(span(o), span(i))));
    in_place.then_some("an output written over an input")
}

/// Times `candidates` on `b`'s arguments; the index of the variant kept.
fn tune_now(
    shared: &WgpuMemory,
    tuner: &Tuner,
    v: &Variants,
    candidates: &[usize],
    b: &Bound<'_>,
) -> Result<usize, DeviceError> {
    let ctx = &shared.ctx;
    let k = b.kernel;
    // The inputs' writers run first (the trials' own submissions come after them).
    shared.submit()?;
    let run = |kernel: &WgslKernel| -> Result<f64, DeviceError> {
        let t0 = Instant::now();
        shared.encode(|e| ctx.encode_at(e, kernel, b.refs))?;
        shared.submit()?;
        ctx.wait()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    let trial = |c: usize| -> Result<Trial, DeviceError> {
        let kernel = v.kernel(ctx, c)?;
        let first = run(&kernel)?;
        // Long kernels vary less from run to run: fewer runs time them as well.
        let reps = match first {
            t if t >= 0.05 => 2,
            t if t >= 0.005 => 3,
            _ => mode().repetitions().max(Mode::On.repetitions()),
        };
        let seconds = (0..reps).map(|_| run(&kernel)).collect::<Result<Vec<_>, _>>()?;
        let outputs = (k.inputs..k.args.len())
            .map(|o| {
                let a = &k.args[o];
                let (buffer, offset) = b.refs[o];
                let bytes = ctx.read_at(buffer, offset, (a.len * a.dtype.size()) as u64)?;
                Ok(Output { dtype: a.dtype, bytes })
            })
            .collect::<Result<Vec<_>, DeviceError>>()?;
        Ok(Trial { seconds, outputs, compared: None })
    };
    let tuned = tuner.tune(&v.key, &v.variants, candidates, trial)?;
    tuner.save();
    Ok(tuned.chosen)
}
