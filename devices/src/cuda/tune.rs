//! The variants of a printed CUDA kernel and their tuning at its first launch
//! ([`crate::runtime::tune`] chooses and keeps them).
//!
//! Variants change only the launch, never the printed code: map loops (grid-stride loops, so
//! any grid covers them) take 128, 256 or 512 threads a block (1024 when exhaustive) and a grid
//! of 4 to 32 blocks a multiprocessor (fewer blocks: more elements a thread); both give the
//! default's bytes. Row kernels take the printed threads a row or half or a quarter of them
//! (down to 32 when exhaustive): their reduction trees are correct for any power of two, but
//! add in another order, so these variants are marked non-bitwise (never under
//! `BRAID_DETERMINISTIC=1`). Fused attention's tiles, products (cuBLAS) and kernels moving
//! under [`MIN_TUNED_BYTES`] (launch-bound: the launch costs more than any variant saves) have
//! no variants.
//!
//! Tuning runs on the kernel's real arguments, on its stream, when it is first launched by an
//! eager flush: each candidate once to warm up, then timed with CUDA events, the stream
//! synchronised (the one time a queue blocks the host outside a failure), the outputs copied
//! back and compared with the default's. A kernel whose outputs share a buffer with an input
//! (written in place) is never timed on its arguments: it runs its default until a launch of
//! the same kernel elsewhere tuned it. A flush recorded into a CUDA graph only reads the
//! choices made (a captured step's kernels were tuned by its capture, an eager flush).
//!
//! Must never: time a kernel that writes over one of its inputs, or keep a variant whose
//! outputs were not compared with the default's.

use super::context::{Event, Stream};
use super::launch::{CudaKernel, LaunchOptions};
use crate::DeviceError;
use crate::runtime::tune::{Mode, Output, Plan, Trial, TuneKey, Tuner, Variant, content_hash};
use braid_lowering::cuda::Launch;
use cudarc::driver::sys::CUdeviceptr;

/// Kernels moving fewer bytes than this are not tuned.
pub const MIN_TUNED_BYTES: usize = 1 << 20;
/// Kernels whose outputs hold more than this are not tuned (each candidate's outputs are
/// copied to the host to be compared).
const MAX_COMPARED_BYTES: usize = 1 << 30;

/// A kernel's variants and the launch options of each (the default first).
pub struct Variants {
    pub key: TuneKey,
    pub variants: Vec<Variant>,
    pub options: Vec<LaunchOptions>,
}

/// The variants of `kernel` (printed for a GPU of `multiprocessors`), if it has a choice.
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

/// The launch options to run `kernel` with: the choice made, or after timing the candidates
/// now when the plan says so and the arguments allow it (`args`: one address per argument,
/// `scratch` as for a launch); the default when tuning fails.
///
/// # Safety
/// As [`CudaKernel::launch`], `stream` being the one the kernel is launched on; every launch
/// here comes after the stream's waits for the kernel's inputs.
pub unsafe fn options(
    tuner: &Tuner,
    kernel: &CudaKernel,
    v: &Variants,
    stream: &Stream,
    blas: Option<&super::Blas>,
    args: &[CUdeviceptr],
    scratch: CUdeviceptr,
) -> LaunchOptions {
    let candidates = match tuner.plan(&v.key, &v.variants) {
        Plan::Use(i) => return v.options[i],
        Plan::Tune(c) => c,
    };
    let k = kernel.kernel();
    let inputs = &args[..k.inputs];
    let in_place = args[k.inputs..].iter().any(|o| inputs.contains(o));
    let out_bytes: usize = k.args[k.inputs..].iter().map(|a| a.len * a.dtype.size()).sum();
    if in_place || out_bytes > MAX_COMPARED_BYTES {
        return LaunchOptions::default();
    }
    let reps = crate::runtime::tune::mode().repetitions().max(Mode::On.repetitions());
    let trial = |c: usize| -> Result<Trial, DeviceError> {
        let o = v.options[c];
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
        stream.synchronize()?;
        let seconds = (marks.windows(2))
            .map(|w| w[1].elapsed_ms_since(&w[0]).map(|ms| ms as f64 * 1e-3))
            .collect::<Result<Vec<_>, _>>()?;
        let mut outputs = Vec::new();
        for (a, &addr) in k.args[k.inputs..].iter().zip(&args[k.inputs..]) {
            let mut bytes = vec![0u8; a.len * a.dtype.size()];
            // SAFETY: the output holds `a.len` elements; the stream is synchronised below
            // before the bytes are read.
            unsafe { super::memory::copy_device_to_host(bytes.as_mut_ptr(), addr, bytes.len(), stream.raw())? };
            outputs.push(Output { dtype: a.dtype, bytes });
        }
        stream.synchronize()?;
        Ok(Trial { seconds, outputs })
    };
    match tuner.tune(&v.key, &v.variants, &candidates, trial) {
        Ok(t) => v.options[t.chosen],
        Err(e) => {
            tracing::warn!(target: crate::runtime::tune::TRACE_TARGET, "tuning a kernel failed, its default runs: {e}");
            LaunchOptions::default()
        }
    }
}
