//! The variants of a printed CUDA kernel and their tuning at its first launch
//! ([`crate::runtime::tune`] chooses and keeps them).
//!
//! Launch variants: map loops (grid-stride loops, so any grid covers them) take 128, 256 or
//! 512 threads a block (1024 when exhaustive, and never more than the function's registers
//! allow) and a grid of 4 to 32 blocks a multiprocessor (fewer blocks: more elements a
//! thread); both give the default's bytes. Row kernels take the printed threads a row or half
//! or a quarter of them (down to 32 when exhaustive): their reduction trees are correct for
//! any power of two, but add in another order, so these variants are marked non-bitwise
//! (timed only under `BRAID_DETERMINISTIC=0`; a packed map kernel's rows are marked so too,
//! conservatively). Printed variants ([`print_variants`]): a large row kernel printed with its
//! long rows split in other segments, or its long columns over other blocks
//! (`braid_lowering::cuda::PrintOptions`), compiled only when timed; non-bitwise too. A map
//! loop or row kernel printed with vector accesses of 8 bytes or none (16 by default): bitwise
//! for map loops (each index computed alone), not for row kernels (a thread sums other
//! positions of its row); timed only when exhaustive (each is a compile). Fused
//! attention on tensor cores printed with other tilings
//! (`braid_lowering::cuda::attention_shapes`): its tiles over other warps and slabs, or with
//! another register cap, are bitwise (each row runs the same instructions in the same order);
//! other tile sizes are not (a row's keys or queries are walked in other groups); they are
//! timed only when exhaustive (`BRAID_AUTOTUNE=exhaustive`: each is compiled first). Products
//! (cuBLAS) and kernels moving under [`MIN_TUNED_BYTES`] (launch-bound: the launch costs more
//! than any variant saves) have no variants here.
//!
//! Tuning runs on the kernel's real arguments, on its stream, when it is first launched by an
//! eager flush: each candidate once to warm up, then timed with CUDA events, its outputs
//! compared with the default's on the device (`tune_compare.cu`: the default's outputs are
//! copied aside first; a few counters come back), the stream synchronised (the one time a
//! queue blocks the host outside a failure). A kernel whose outputs share a buffer with an
//! input (written in place) is never timed on its arguments: it runs its default until a
//! launch of the same kernel elsewhere tuned it. A flush recorded into a CUDA graph only reads the
//! choices made (a captured step's kernels were tuned by its capture, an eager flush).
//!
//! Must never: time a kernel that writes over one of its inputs, or keep a variant whose
//! outputs were not compared with the default's.

use super::DriverResult;
use super::compile::{Compiler, Module};
use super::context::{Event, Stream};
use super::lanes::LaneId;
use super::launch::{CudaKernel, LaunchOptions};
use super::memory::{copy_device_to_device, copy_device_to_host, fill_device};
use super::pools::{CudaPools, Mem};
use crate::DeviceError;
use crate::runtime::tune::{Mode, Plan, TRACE_TARGET, Trial, TuneKey, Tuner, Variant, content_hash, tolerance};
use braid_graph::DType;
use braid_lowering::cuda::{Launch, PrintOptions, attention_shapes, attention_tiles_with};
use braid_lowering::{Body, Kernel};
use cudarc::driver::result as cu;
use cudarc::driver::sys::CUdeviceptr;
use std::ffi::c_void;

/// Kernels moving fewer bytes than this are not tuned.
pub const MIN_TUNED_BYTES: usize = 1 << 20;
/// Kernels whose outputs hold more than this are not tuned (the default's outputs are kept on
/// the device while the candidates run, to be compared with theirs).
const MAX_COMPARED_BYTES: usize = 1 << 30;

/// A kernel's variants and the launch options of each (the default first).
pub struct Variants {
    pub key: TuneKey,
    pub variants: Vec<Variant>,
    pub options: Vec<LaunchOptions>,
}

/// The variants of `kernel`, the default first, if it has a choice.
pub fn variants(kernel: &CudaKernel) -> Option<Variants> {
    let k = kernel.kernel();
    let src = kernel.source();
    if kernel.needs_blas() || src.entries.is_empty() || k.bytes_moved() < MIN_TUNED_BYTES {
        return None;
    }
    let mut maps = false;
    let mut row_threads = None;
    let mut extents = Vec::new();
    for e in &src.entries {
        match e.launch {
            Launch::Map { numel, .. } | Launch::Copy { numel, .. } => {
                maps = true;
                extents.push(numel);
            }
            Launch::Rows { rows, threads } => {
                row_threads = Some(row_threads.map_or(threads, |t: u32| t.min(threads)));
                extents.push(rows);
            }
            // Fused attention's only variants are its printed tilings.
            Launch::Tiles { blocks, .. } if matches!(k.body, Body::Attention(_)) => extents.push(blocks),
            Launch::Tiles { .. } => return None,
        }
    }
    let mut variants = vec![Variant { name: "default".into(), bitwise: true, short_list: true }];
    let mut options = vec![LaunchOptions::default()];
    if maps {
        for block in [128, 256, 512, 1024] {
            for per_sm in [32, 16, 8, 4] {
                if (block, per_sm) == (braid_lowering::cuda::MAP_BLOCK, 32) {
                    continue;
                }
                let short_list = matches!((block, per_sm), (128, 32) | (512, 32) | (256, 8));
                variants.push(Variant { name: format!("map {block}x{per_sm}/sm"), bitwise: true, short_list });
                options.push(LaunchOptions {
                    map_block: Some(block),
                    map_blocks_per_sm: Some(per_sm),
                    ..Default::default()
                });
            }
        }
    }
    for (i, p) in kernel.printed().iter().enumerate() {
        let default = PrintOptions::default();
        let (name, bitwise, short_list) = match (&k.body, p.options.attention) {
            (Body::Attention(a), Some(shape)) => {
                // The same tiles over other warps keep every row's instructions and their
                // order; other tiles walk a row's keys (or queries) in other groups.
                let tiles = |s| attention_tiles_with(a, s).map(|t| (t.bq, t.bk)).ok();
                let same = tiles(None).is_some() && tiles(None) == tiles(Some(shape));
                let name = format!(
                    "tiles {}x{} warps x slabs, {} a tile, {} blocks/sm",
                    shape.warps, shape.mw, shape.other, shape.min_blocks
                );
                // Exhaustive only: each tiling is an NVRTC compile of a second or more, and the
                // table was chosen by timing these on an H200 (BENCHMARKS.md, issue 44).
                (name, same, false)
            }
            _ if p.options.vector_bytes != default.vector_bytes => {
                let width = match p.options.vector_bytes {
                    0 => "no vector accesses".to_string(),
                    b => format!("vector accesses of {b} bytes"),
                };
                // A map loop computes each index alone whatever its accesses; a row kernel's
                // thread sums other positions of its row when its chunks are narrower.
                // Exhaustive only: each is an NVRTC compile (BENCHMARKS.md, issue 44, stop 64).
                (width, matches!(k.body, Body::Map(_)), false)
            }
            _ if p.options.segment != default.segment => {
                (format!("rows split in segments of {}", p.options.segment), false, true)
            }
            _ => (format!("columns over {} blocks", p.options.column_blocks), false, true),
        };
        variants.push(Variant { name, bitwise, short_list });
        options.push(LaunchOptions { printed: i as u8 + 1, ..Default::default() });
    }
    if let Some(printed) = row_threads {
        let mut t = printed / 2;
        while t >= 32 {
            let short_list = t * 4 >= printed;
            variants.push(Variant { name: format!("rows {t} threads"), bitwise: false, short_list });
            options.push(LaunchOptions { row_threads: Some(t), ..Default::default() });
            t /= 2;
        }
    }
    if variants.len() < 2 {
        return None;
    }
    let key = TuneKey::new(content_hash(&src.source), &extents, k.args.iter().map(|a| a.dtype));
    Some(Variants { key, variants, options })
}

/// The other printings a large kernel is offered in: a row kernel's long rows among few split
/// in segments of 2K, 8K or 16K elements (4K by default), its long columns spread over 64, 256
/// or 512 blocks (128); a map loop's or row kernel's vector accesses 8 bytes wide or none (16
/// by default); fused attention on tensor cores tiled otherwise
/// ([`braid_lowering::cuda::attention_shapes`]). Those that print as the default does are left
/// out by the caller.
pub fn print_variants(kernel: &Kernel) -> Vec<PrintOptions> {
    let d = PrintOptions::default();
    let vectors = [8, 0].map(|vector_bytes| PrintOptions { vector_bytes, ..d });
    match &kernel.body {
        Body::Map(_) => vectors.to_vec(),
        Body::Rows(_) => {
            let segments = [2048, 8192, 16384].map(|segment| PrintOptions { segment, ..d });
            let columns = [64, 256, 512].map(|column_blocks| PrintOptions { column_blocks, ..d });
            segments.into_iter().chain(columns).chain(vectors).collect()
        }
        Body::Attention(a) => {
            attention_shapes(a).into_iter().map(|s| PrintOptions { attention: Some(s), ..d }).collect()
        }
        _ => vec![],
    }
}

/// The GPU code that compares a candidate's outputs with the default's.
const COMPARE_SOURCE: &str = include_str!("tune_compare.cu");
const COMPARE_ENTRIES: [&str; 5] =
    ["braid_compare_bytes", "braid_compare_f64", "braid_compare_f32", "braid_compare_f16", "braid_compare_bf16"];

/// What a tuning launch needs besides the kernel: the GPU's compiler (for the compare code),
/// its pools (for the default's outputs, kept on the device) and the stream's lane.
pub struct Tuning<'a> {
    /// Whether a kernel not tuned yet may be timed now (not in a flush planned under a memory
    /// budget: the comparison needs memory of its own); it runs its default otherwise.
    pub may_time: bool,
    pub tuner: &'a Tuner,
    pub compiler: &'a Compiler,
    pub pools: &'a CudaPools,
    pub lane: LaneId,
    pub stream: &'a Stream,
}

/// The launch options to run `kernel` with: the choice made, or after timing the candidates
/// now when the plan says so and the arguments allow it (`args`: one address per argument,
/// `scratch` as for a launch); the default when tuning fails.
///
/// # Safety
/// As [`CudaKernel::launch`], `tuning.stream` being the one the kernel is launched on; every
/// launch here comes after the stream's waits for the kernel's inputs.
pub unsafe fn options(
    tuning: &Tuning<'_>,
    kernel: &CudaKernel,
    v: &Variants,
    blas: Option<&super::Blas>,
    args: &[CUdeviceptr],
) -> LaunchOptions {
    let candidates = match tuning.tuner.plan(&v.key, &v.variants) {
        Plan::Use(i) => return v.options[i],
        Plan::Tune(c) => c,
    };
    let k = kernel.kernel();
    let inputs = &args[..k.inputs];
    let in_place = args[k.inputs..].iter().any(|o| inputs.contains(o));
    let out_bytes: usize = k.args[k.inputs..].iter().map(|a| a.len * a.dtype.size()).sum();
    if !tuning.may_time || in_place || out_bytes > MAX_COMPARED_BYTES {
        return LaunchOptions::default();
    }
    // The default's outputs, kept on the device for the candidates to be compared with, then
    // the scratch memory of the candidate that needs most.
    let scratch_bytes = candidates.iter().map(|&c| kernel.scratch_bytes_with(v.options[c])).max().unwrap_or(0);
    let memory = tuning.pools.slice(
        Some(tuning.lane),
        out_bytes.next_multiple_of(256) + scratch_bytes.max(1),
        Mem::Device,
        false,
    );
    let memory = match memory {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(target: TRACE_TARGET, "not tuned now, no memory for the comparison: {e}");
            return LaunchOptions::default();
        }
    };
    let (kept, scratch) = (memory.addr, memory.addr + out_bytes.next_multiple_of(256) as u64);
    // SAFETY: the caller's contract; `memory` holds the outputs' bytes and the scratch until
    // it is given back below, after the stream was synchronised.
    let tuned = unsafe { tune_now(tuning, kernel, v, &candidates, blas, args, scratch, kept) };
    let gate = vec![tuning.pools.state().lanes.point(tuning.lane)];
    tuning.pools.give(memory, Mem::Device, false, gate, false);
    match tuned {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(target: TRACE_TARGET, "tuning a kernel failed, its default runs: {e}");
            LaunchOptions::default()
        }
    }
}

/// Times `candidates` with the default's outputs copied to `kept` and the others compared
/// with them there.
///
/// # Safety
/// As [`options`], `kept` holding the kernel's output bytes.
#[allow(clippy::too_many_arguments)]
unsafe fn tune_now(
    tuning: &Tuning<'_>,
    kernel: &CudaKernel,
    v: &Variants,
    candidates: &[usize],
    blas: Option<&super::Blas>,
    args: &[CUdeviceptr],
    scratch: CUdeviceptr,
    kept: CUdeviceptr,
) -> Result<LaunchOptions, DeviceError> {
    let k = kernel.kernel();
    let stream = tuning.stream;
    let compare = compare_module(tuning.compiler)?;
    let outputs: Vec<(DType, usize, CUdeviceptr)> =
        (k.args[k.inputs..].iter().zip(&args[k.inputs..])).map(|(a, &addr)| (a.dtype, a.len, addr)).collect();
    let reps = crate::runtime::tune::mode().repetitions().max(Mode::On.repetitions());
    let trial = |c: usize| -> Result<Trial, DeviceError> {
        let o = v.options[c];
        kernel.prepare(tuning.compiler, o)?;
        // SAFETY: the caller's contract; every launch writes the same outputs from the same
        // inputs.
        unsafe { kernel.launch(stream.raw(), blas, args, scratch, o)? };
        let gpu = stream.gpu();
        let marks = (0..=reps).map(|_| Event::timing(gpu)).collect::<Result<Vec<_>, _>>()?;
        marks[0].record(stream)?;
        for m in &marks[1..] {
            // SAFETY: as above.
            unsafe { kernel.launch(stream.raw(), blas, args, scratch, o)? };
            m.record(stream)?;
        }
        let compared = if c == 0 {
            let mut at = kept;
            for &(dtype, len, addr) in &outputs {
                // SAFETY: `kept` holds every output's bytes, one after another.
                unsafe { copy_device_to_device(at, addr, len * dtype.size(), stream.raw())? };
                at += (len * dtype.size()) as u64;
            }
            None
        } else {
            // SAFETY: as above.
            Some(unsafe { compare_outputs(tuning, &compare, &outputs, kept, v.variants[c].bitwise)? })
        };
        stream.synchronize()?;
        let seconds = (marks.windows(2))
            .map(|w| w[1].elapsed_ms_since(&w[0]).map(|ms| ms as f64 * 1e-3))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Trial { seconds, outputs: Vec::new(), compared })
    };
    let t = tuning.tuner.tune(&v.key, &v.variants, candidates, trial)?;
    Ok(v.options[t.chosen])
}

/// Compares `outputs` with the default's in `kept`, on the device, by the rules of
/// `crate::runtime::tune::agree`: `Err` says where they differ.
///
/// # Safety
/// As [`tune_now`].
unsafe fn compare_outputs(
    tuning: &Tuning<'_>,
    compare: &Module,
    outputs: &[(DType, usize, CUdeviceptr)],
    kept: CUdeviceptr,
    bitwise: bool,
) -> Result<Result<(), String>, DeviceError> {
    let found = tuning.pools.slice(Some(tuning.lane), 24 * outputs.len(), Mem::Device, false)?;
    // SAFETY: the caller's contract; `found` holds the counters.
    let verdict = unsafe { compare_at(compare, tuning.stream, outputs, kept, found.addr, bitwise) };
    let gate = vec![tuning.pools.state().lanes.point(tuning.lane)];
    tuning.pools.give(found, Mem::Device, false, gate, false);
    verdict
}

/// The compare code's module, compiled once per GPU (the compiler's cache).
pub fn compare_module(compiler: &Compiler) -> Result<std::sync::Arc<Module>, DeviceError> {
    compiler.module(COMPARE_SOURCE, "braid_compare", &COMPARE_ENTRIES)
}

/// [`compare_outputs`] with the counters at `counters` (three per output): the outputs at
/// their addresses against the same outputs one after another from `kept`; waits for the
/// stream.
///
/// # Safety
/// Every address points to live device memory of its output's bytes (`kept` to all of them),
/// `counters` to `24 * outputs.len()` bytes; nothing else writes them until this returns.
pub unsafe fn compare_at(
    compare: &Module,
    stream: &Stream,
    outputs: &[(DType, usize, CUdeviceptr)],
    kept: CUdeviceptr,
    counters: CUdeviceptr,
    bitwise: bool,
) -> Result<Result<(), String>, DeviceError> {
    let words = 3 * outputs.len();
    let mut host = vec![0u64; words];
    // SAFETY: `counters` holds `words` counters (the caller's contract).
    unsafe { fill_device(counters, 0, words * 8, stream.raw())? };
    let mut at = kept;
    for (i, &(dtype, len, addr)) in outputs.iter().enumerate() {
        let (entry, n) = match dtype {
            _ if bitwise || !dtype.is_float() => ("braid_compare_bytes", len * dtype.size()),
            DType::F64 => ("braid_compare_f64", len),
            DType::F16 => ("braid_compare_f16", len),
            DType::BF16 => ("braid_compare_bf16", len),
            _ => ("braid_compare_f32", len),
        };
        let function = compare.function(entry)?;
        let (mut a, mut b, mut n64, mut r) = (at, addr, n as u64, counters + (24 * i) as u64);
        let mut params = [
            &mut a as *mut u64 as *mut c_void,
            &mut b as *mut u64 as *mut c_void,
            &mut n64 as *mut u64 as *mut c_void,
            &mut r as *mut u64 as *mut c_void,
        ];
        let blocks = n.div_ceil(256).clamp(1, stream.gpu().multiprocessors as usize * 8) as u32;
        // SAFETY: the entry reads `n` elements at `a` and `b` and adds to three counters at
        // `r`; the parameters live through the call.
        unsafe { cu::launch_kernel(function, (blocks, 1, 1), (256, 1, 1), 0, stream.raw(), &mut params) }
            .or_device(&format!("launching `{entry}`"))?;
        at += (len * dtype.size()) as u64;
    }
    // SAFETY: `host` holds `words` counters; read after the synchronisation.
    unsafe { copy_device_to_host(host.as_mut_ptr() as *mut u8, counters, words * 8, stream.raw())? };
    stream.synchronize()?;
    for (i, &(dtype, _, _)) in outputs.iter().enumerate() {
        let (count, scale, diff) = (host[3 * i], f64::from_bits(host[3 * i + 1]), f64::from_bits(host[3 * i + 2]));
        if bitwise || !dtype.is_float() {
            if count > 0 {
                return Ok(Err(format!("output {i}: {count} bytes differ (the variant must give the same bits)")));
            }
            continue;
        }
        let limit = tolerance(dtype) * scale.max(f64::MIN_POSITIVE);
        if count > 0 {
            return Ok(Err(format!("output {i}: {count} NaNs or infinities where the default has others")));
        }
        if diff > limit {
            return Ok(Err(format!("output {i}: differs from the default's by {diff:e} (limit {limit:e})")));
        }
    }
    Ok(Ok(()))
}
