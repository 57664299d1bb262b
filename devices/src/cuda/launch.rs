//! Launching a compiled kernel on a stream: a printed [`CudaSource`]'s entries in order, each
//! with the grid and block its [`Launch`] asks for, over raw device addresses; a float matrix
//! product through cuBLAS first ([`super::matmul`]).
//!
//! Grids: a map entry (a grid-stride loop) gets one thread per index in blocks of the printed
//! size, at most 32 blocks per multiprocessor (the loop covers the rest), or the block and
//! blocks per multiprocessor a tuned variant asks for ([`super::tune`]); a row entry gets one
//! block per row and the printed number of threads, or fewer ([`LaunchOptions::row_threads`],
//! a power of two: the printed reduction trees are correct for any, which tests check); a tile
//! entry (fused attention) gets its blocks of exactly the printed threads and its dynamic shared
//! memory, the function opted in first where that is above 48 KiB.
//!
//! Must never: allocate or free memory (scratch memory comes from the caller), synchronise,
//! or launch with more threads than the printed shared-memory arrays hold.

use super::blas::Blas;
use super::compile::{Compiler, Module};
use super::line_copies::LineCopy;
use super::matmul::MatmulPlan;
use super::{DriverResult, TRACE_TARGET};
use crate::DeviceError;
use braid_lowering::cuda::{self, CudaSource, Launch, PrintOptions};
use braid_lowering::{Body, Kernel};
use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUdeviceptr, CUfunction_attribute, CUstream};
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// Name of every printed kernel's entry points (the same kernel prints the same source, so
/// equal kernels share one compiled module whatever plan they came from).
const KERNEL_NAME: &str = "braid";

/// Dynamic shared memory a function may use without opting in (CUDA's static limit).
const STATIC_SHARED_LIMIT: u32 = 48 * 1024;
const MAX_DYNAMIC_SHARED: CUfunction_attribute = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
const MAX_THREADS: CUfunction_attribute = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK;

/// Choices a caller may make about a launch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Threads per block of row kernels: `None` for the printed number; otherwise a power of
    /// two no larger than it.
    pub row_threads: Option<u32>,
    /// Threads per block of map loops and copies: `None` for the printed number; more than
    /// printed only as many as the function's registers allow.
    pub map_block: Option<u32>,
    /// Most blocks of a map loop or copy per multiprocessor (the loop strides over the rest):
    /// `None` for 32.
    pub map_blocks_per_sm: Option<u32>,
    /// Which printing of the kernel runs: 0 for its own, `i` for its `i`-th printed variant
    /// ([`CudaKernel::printed`], prepared first with [`CudaKernel::prepare`]).
    pub printed: u8,
    /// How a float product is made: 0 by cuBLAS, `i` by cuBLASLt's `i`-th algorithm minus one
    /// (`super::tune_products`; cuBLAS's when that cannot run).
    pub blas_algo: u8,
    /// Bytes past an aligned address at which the test harness (`harness.rs`) places every
    /// argument; ignored by launches themselves, 0 in the engine. 8 keeps every element
    /// aligned but no argument aligned for a vector access, so kernels take their scalar paths.
    pub skew: usize,
}

/// Launches the entries of `src` from `module` on `stream`, in order, over `params` (one device
/// address per `src.params`).
///
/// # Safety
/// The module's GPU context is current; each address points to live device memory of at least
/// the length (in elements of its dtype) the kernel declares for that parameter, until the
/// stream has run the launches; `stream` is alive.
pub unsafe fn launch_entries(
    module: &Module,
    src: &CudaSource,
    params: &[CUdeviceptr],
    stream: CUstream,
    options: LaunchOptions,
) -> Result<(), DeviceError> {
    if params.len() != src.params.len() {
        return Err(DeviceError::Internal(format!("{} addresses for {} parameters", params.len(), src.params.len())));
    }
    let max_map_blocks =
        module.gpu().multiprocessors as usize * options.map_blocks_per_sm.unwrap_or(32).max(1) as usize;
    // The driver reads each parameter through a pointer to its value.
    let mut values: Vec<CUdeviceptr> = params.to_vec();
    let mut pointers: Vec<*mut c_void> = values.iter_mut().map(|v| v as *mut CUdeviceptr as *mut c_void).collect();
    for entry in &src.entries {
        let function = module.function(&entry.name)?;
        let mut shared = 0;
        let (grid, block) = match entry.launch {
            Launch::Map { numel: 0, .. }
            | Launch::Copy { numel: 0, .. }
            | Launch::Rows { rows: 0, .. }
            | Launch::Tiles { blocks: 0, .. } => continue,
            Launch::Copy { from, to, .. } if params.get(from as usize) == params.get(to as usize) => continue,
            Launch::Map { numel, block } | Launch::Copy { numel, block, .. } => {
                let block = match options.map_block {
                    // More threads than printed: no more than the function's registers allow.
                    Some(b) if b > block => {
                        // SAFETY: `function` is a live entry of `module`.
                        let most = unsafe { cu::function::get_function_attribute(function, MAX_THREADS) }
                            .or_device(&format!("`{}`: its most threads a block", entry.name))?;
                        b.min(most.max(32) as u32)
                    }
                    Some(b) => b.max(32),
                    None => block,
                };
                (numel.div_ceil(block as usize).min(max_map_blocks), block)
            }
            Launch::Tiles { blocks, threads, shared_bytes } => {
                if shared_bytes > STATIC_SHARED_LIMIT {
                    // SAFETY: `function` is a live entry of `module`; the driver refuses sizes
                    // beyond the GPU's opt-in limit, which comes back as an error.
                    unsafe { cu::function::set_function_attribute(function, MAX_DYNAMIC_SHARED, shared_bytes as i32) }
                        .or_device(&format!("`{}`: {shared_bytes} bytes of shared memory", entry.name))?;
                }
                shared = shared_bytes;
                (blocks, threads)
            }
            Launch::Rows { rows, threads } => {
                let block = match options.row_threads {
                    None => threads,
                    Some(t) if t.is_power_of_two() && t <= threads => t,
                    Some(t) => {
                        return Err(DeviceError::Internal(format!(
                            "{t} threads for a row kernel printed for at most {threads} (a power of two)"
                        )));
                    }
                };
                (rows, block)
            }
        };
        let grid = u32::try_from(grid)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| DeviceError::Kernel(format!("{grid} blocks: more than one launch has")))?;
        // SAFETY: the caller's contract; `pointers` point into `values`, alive for the call.
        unsafe { cu::launch_kernel(function, (grid, 1, 1), (block, 1, 1), shared, stream, &mut pointers) }
            .or_device(&format!("launching `{}` ({grid} x {block})", entry.name))?;
    }
    Ok(())
}

/// A kernel of the kernel IR compiled for one GPU: its printed source, its module, and for a
/// float matrix product the plan of its cuBLAS calls.
pub struct CudaKernel {
    kernel: Kernel,
    source: CudaSource,
    module: Option<Arc<Module>>,
    matmul: Option<MatmulPlan>,
    /// Loops run as the driver's 2-D copies, not printed (`super::line_copies`).
    copies: Vec<LineCopy>,
    /// The ways it may launch, when it has a choice (`super::tune`).
    variants: Option<super::tune::Variants>,
    /// The kernel printed with other split choices, for the tuner.
    reprinted: Vec<Printed>,
}

/// A kernel printed with other [`PrintOptions`] (a tuning variant, `super::tune`), compiled
/// when first asked for.
pub struct Printed {
    pub options: PrintOptions,
    pub source: CudaSource,
    module: OnceLock<Arc<Module>>,
}

impl CudaKernel {
    /// Prints and compiles `kernel` (through `compiler`'s caches).
    pub fn new(compiler: &Compiler, kernel: &Kernel) -> Result<CudaKernel, DeviceError> {
        // A large product whose rows cuBLAS would write unaligned gets padded rows in scratch
        // memory, and an epilogue that reads them (`super::row_padding`).
        let (kernel, product_ld) = super::matmul::pad_product(kernel);
        let kernel = kernel.as_ref();
        // Long lines copied as they are go to the driver's 2-D copies; the rest is printed.
        let (copies, printed) = super::line_copies::plan(kernel);
        let printed = printed.unwrap_or_else(|| Kernel { body: Body::Map(vec![]), ..kernel.clone() });
        let source =
            cuda::print(&printed, KERNEL_NAME).map_err(|e| DeviceError::Internal(format!("printing CUDA C: {e}")))?;
        let names: Vec<&str> = source.entries.iter().map(|e| e.name.as_str()).collect();
        let module =
            if names.is_empty() { None } else { Some(compiler.module(&source.source, KERNEL_NAME, &names)?) };
        let matmul = match &kernel.body {
            Body::Matmul(m) if source.library_product => Some(MatmulPlan::new(compiler, kernel, m, product_ld)?),
            _ => None,
        };
        // Other splits of a large row kernel's work, or other tiles of fused attention, each
        // printed once here (compiled only if the tuner times it), those that print as the
        // default does left out.
        let mut reprinted: Vec<Printed> = Vec::new();
        if kernel.bytes_moved() >= super::tune::MIN_TUNED_BYTES {
            for options in super::tune::print_variants(kernel) {
                let Ok(other) = cuda::print_with(&printed, KERNEL_NAME, &options) else { continue };
                if other.source != source.source && reprinted.iter().all(|p| p.source.source != other.source) {
                    reprinted.push(Printed { options, source: other, module: OnceLock::new() });
                }
            }
        }
        let mut compiled =
            CudaKernel { kernel: kernel.clone(), source, module, matmul, copies, variants: None, reprinted };
        compiled.variants = super::tune::variants(&compiled).or_else(|| super::tune_products::variants(&compiled));
        Ok(compiled)
    }

    /// Its printed variants (other splits of a row kernel's work, other tiles of fused
    /// attention), for [`LaunchOptions::printed`].
    pub fn printed(&self) -> &[Printed] {
        &self.reprinted
    }

    /// Compiles (or loads from the disk cache) the printing `options` launch, if it is a
    /// printed variant not compiled yet.
    pub fn prepare(&self, compiler: &Compiler, options: LaunchOptions) -> Result<(), DeviceError> {
        let Some(i) = (options.printed as usize).checked_sub(1) else { return Ok(()) };
        let p = self.reprinted.get(i).ok_or_else(|| DeviceError::Internal(format!("no printed variant {}", i + 1)))?;
        if p.module.get().is_none() {
            let names: Vec<&str> = p.source.entries.iter().map(|e| e.name.as_str()).collect();
            let module = compiler.module(&p.source.source, KERNEL_NAME, &names)?;
            let _ = p.module.set(module);
        }
        Ok(())
    }

    /// The source and module a launch with `options` runs.
    fn code(&self, options: LaunchOptions) -> Result<(&CudaSource, Option<&Arc<Module>>), DeviceError> {
        match (options.printed as usize).checked_sub(1) {
            None => Ok((&self.source, self.module.as_ref())),
            Some(i) => {
                let p = self
                    .reprinted
                    .get(i)
                    .ok_or_else(|| DeviceError::Internal(format!("no printed variant {}", i + 1)))?;
                let module =
                    p.module.get().ok_or_else(|| DeviceError::Internal("a printed variant not prepared".into()))?;
                Ok((&p.source, Some(module)))
            }
        }
    }

    /// [`CudaKernel::scratch_bytes`] of a launch with `options` (a printed variant splits its
    /// rows otherwise).
    pub fn scratch_bytes_with(&self, options: LaunchOptions) -> usize {
        match (options.printed as usize).checked_sub(1).and_then(|i| self.reprinted.get(i)) {
            Some(p) => p.source.scratch_bytes,
            None => self.scratch_bytes(),
        }
    }

    /// The ways this kernel may launch, the default first, when it has a choice.
    pub fn variants(&self) -> Option<&super::tune::Variants> {
        self.variants.as_ref()
    }

    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    pub fn source(&self) -> &CudaSource {
        &self.source
    }

    /// The cuBLAS plan of a float matrix product.
    pub fn matmul_plan(&self) -> Option<&MatmulPlan> {
        self.matmul.as_ref()
    }

    /// Whether a launch needs a cuBLAS handle (a float matrix product).
    pub fn needs_blas(&self) -> bool {
        self.matmul.is_some()
    }

    /// Bytes of scratch device memory a launch needs (a product no argument holds, operands
    /// copied to a layout cuBLAS takes); 0 for most kernels.
    pub fn scratch_bytes(&self) -> usize {
        match (&self.matmul, &self.kernel.body) {
            (Some(plan), _) => plan.scratch_bytes(),
            // An integer product in scratch memory, written by the printed product entry.
            (None, Body::Matmul(m)) if m.product as usize == self.kernel.args.len() => {
                m.lhs.batch_offsets.len() * m.m * m.n * m.dtype.size()
            }
            // A split row kernel's partial results and row values.
            _ => self.source.scratch_bytes,
        }
    }

    /// Queues the kernel on `stream` over `args` (one device address per kernel argument),
    /// with `scratch` holding [`CudaKernel::scratch_bytes_with`] bytes (any value when 0) and `blas`
    /// a handle bound to the same stream when [`CudaKernel::needs_blas`].
    ///
    /// # Safety
    /// The GPU's context is current; every address points to live device memory of at least
    /// the argument's length, and `scratch` to the bytes asked for, until the stream has run
    /// the kernel; no other stream writes them meanwhile (the schedule's events say so).
    pub unsafe fn launch(
        &self,
        stream: CUstream,
        blas: Option<&Blas>,
        args: &[CUdeviceptr],
        scratch: CUdeviceptr,
        options: LaunchOptions,
    ) -> Result<(), DeviceError> {
        if args.len() != self.kernel.args.len() {
            return Err(DeviceError::Internal(format!(
                "{} addresses for a kernel of {}",
                args.len(),
                self.kernel.args.len()
            )));
        }
        let (source, module) = self.code(options)?;
        let mut params = args.to_vec();
        if source.params.len() == args.len() + 1 {
            // The product in scratch memory (or a split row kernel's scratch) is the last
            // parameter of the printed entries; a float plan places it at the start of the
            // scratch memory.
            params.push(scratch);
        }
        if let Some(plan) = &self.matmul {
            let blas = blas.ok_or_else(|| DeviceError::Internal("a matrix product launched without cuBLAS".into()))?;
            if blas.stream() != stream {
                return Err(DeviceError::Internal("a cuBLAS handle of another stream".into()));
            }
            // SAFETY: the caller's contract.
            unsafe { plan.run(blas, args, scratch, options.blas_algo)? };
        }
        // SAFETY: the caller's contract.
        unsafe { super::line_copies::run(&self.copies, args, stream)? };
        if let Some(module) = module {
            tracing::trace!(target: TRACE_TARGET, entries = source.entries.len(), "launch");
            // SAFETY: the caller's contract.
            unsafe { launch_entries(module, source, &params, stream, options)? };
        }
        Ok(())
    }
}
