//! cuBLASLt for the products' tuning variants (`super::tune_products`): the handle each
//! [`Blas`] holds beside its cuBLAS handle ([`LtHandle`]), and one product's descriptors with
//! the algorithms cuBLASLt's heuristic offers for it ([`LtProduct`]), made at its first run
//! with such an algorithm and run on the handle's stream, in the handle's workspace.
//!
//! Numerics as [`Blas::gemm_strided`]'s: the same compute type (f32 for f32, f16 and bf16
//! data, TF32 exactly when the handle's f32 products use it; f64 for f64), an f32 scale (f64
//! for f64), and split-K algorithms only when their partial sums are reduced in the compute
//! type (`CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK` allows no reduction or one in the compute
//! type, never one in place or in the output type, which would round f16/bf16 partial sums;
//! each algorithm's configuration is checked again). An algorithm other than the one cuBLAS
//! picks may add in another order, so the tuner treats these variants as non-bitwise.
//!
//! Availability: libcublasLt is looked for once ([`available`]); without it no handle is made
//! and products have no cuBLASLt variants (cudarc panics on a missing library, so nothing here
//! calls it before). Failures: when an algorithm cannot run (cuBLASLt's heuristic offered
//! fewer, the descriptors could not be made, an address is less aligned than the algorithms
//! were chosen for, a failed status), [`LtProduct::run`] says `Ok(false)` (logged once per
//! product) and the caller runs its default; only while tuning ([`Strict`]) is it an `Err`,
//! which rejects the candidate.
//!
//! Must never: use more workspace than the handle's, run on another stream than the handle's,
//! reduce partial sums other than in the compute type, or fail a product outside tuning.

use super::TRACE_TARGET;
use super::blas::{Blas, Op, Operand};
use crate::DeviceError;
use braid_graph::DType;
use cudarc::cublaslt::sys::{
    self, cublasComputeType_t, cublasLtMatmulAlgoConfigAttributes_t as Config,
    cublasLtMatmulDescAttributes_t as DescAttr, cublasLtMatmulHeuristicResult_t as Heuristic,
    cublasLtMatmulPreferenceAttributes_t as Pref, cublasLtMatrixLayoutAttribute_t as LayoutAttr,
    cublasLtReductionScheme_t as Reduction, cublasStatus_t, cudaDataType_t,
};
use cudarc::driver::sys::CUdeviceptr;
use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

/// Algorithms asked of the heuristic for a product (exhaustive tuning times them all).
pub const MAX_ALGORITHMS: usize = 8;

/// The alignment of every matrix's address the algorithms are chosen for (the engine's
/// buffers and scratch memory start at 256 bytes); at a less aligned one the default runs.
const ALIGN_BYTES: u64 = 16;

/// Whether libcublasLt can be loaded (looked for once).
pub fn available() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    // SAFETY: this only tries to open the library (dlopen) and closes it again.
    *FOUND.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// cuBLASLt's version (0 without the library): part of a product's tuning key, since another
/// version's heuristic may offer other algorithms.
pub fn version() -> usize {
    static VERSION: OnceLock<usize> = OnceLock::new();
    if !available() {
        return 0;
    }
    // SAFETY: the library is there (`available`); the call only reads its version.
    *VERSION.get_or_init(|| unsafe { sys::cublasLtGetVersion() })
}

fn status(s: cublasStatus_t, what: &str) -> Result<(), DeviceError> {
    match s {
        cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED => {
            Err(DeviceError::OutOfMemory { requested: 0, in_use: 0, reserved: 0 })
        }
        s => Err(DeviceError::Kernel(format!("{what}: cuBLASLt status {s:?}"))),
    }
}

/// A cuBLASLt handle (not bound to a stream or context: the stream is given per call).
pub struct LtHandle(sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle may be used from any thread; its holder (`Blas`) uses it from one
// thread at a time.
unsafe impl Send for LtHandle {}
unsafe impl Sync for LtHandle {}

impl LtHandle {
    /// A new handle; `Err(Unavailable)` without the library.
    pub fn new() -> Result<LtHandle, DeviceError> {
        if !available() {
            return Err(DeviceError::Unavailable("cuBLASLt (libcublasLt.so) is not there".into()));
        }
        let mut raw = null_mut();
        // SAFETY: the library is there; `raw` receives the handle.
        status(unsafe { sys::cublasLtCreate(&mut raw) }, "cublasLtCreate")?;
        Ok(LtHandle(raw))
    }
}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: made by cublasLtCreate, destroyed once.
        let _ = unsafe { sys::cublasLtDestroy(self.0) };
    }
}

thread_local! {
    static STRICT: Cell<bool> = const { Cell::new(false) };
}

/// While one lives, a cuBLASLt failure on this thread is an `Err` (tuning: the candidate is
/// rejected) rather than a run of the default.
pub struct Strict(bool);

impl Strict {
    pub fn enter() -> Strict {
        Strict(STRICT.with(|s| s.replace(true)))
    }
}

impl Drop for Strict {
    fn drop(&mut self) {
        STRICT.with(|s| s.set(self.0));
    }
}

/// One strided-batched column-major product, as [`Blas::gemm_strided`] takes it: cuBLAS's
/// `m, n, k`, each operand's transposition, leading dimension and batch stride (elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    pub dtype: DType,
    pub dims: (i32, i32, i32),
    pub a: (Op, i32, i64),
    pub b: (Op, i32, i64),
    pub ldc: i32,
    pub c_stride: i64,
    pub batches: i32,
}

impl GemmShape {
    /// Multiplications and additions.
    pub fn flops(&self) -> f64 {
        let (m, n, k) = self.dims;
        2.0 * self.batches as f64 * m as f64 * n as f64 * k as f64
    }
}

/// Data, compute and scale types of a product in `dtype` (as `Blas`'s).
fn types(dtype: DType, tf32: bool) -> Result<(cudaDataType_t, cublasComputeType_t, cudaDataType_t), DeviceError> {
    use cublasComputeType_t::*;
    use cudaDataType_t::*;
    Ok(match dtype {
        DType::F32 if tf32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F),
        DType::F32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        DType::F64 => (CUDA_R_64F, CUBLAS_COMPUTE_64F, CUDA_R_64F),
        DType::F16 => (CUDA_R_16F, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        DType::BF16 => (CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        d => return Err(DeviceError::Internal(format!("a cuBLASLt product of {d}"))),
    })
}

/// A product's descriptors (made once, destroyed on drop) and the heuristic's algorithms.
struct LtGemm {
    desc: sys::cublasLtMatmulDesc_t,
    /// A, B and C (also D: the product is written where C lies, with `beta` 0).
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algos: Vec<Heuristic>,
    tf32: bool,
}

// SAFETY: the descriptors are plain host objects, used under `LtProduct`'s lock only.
unsafe impl Send for LtGemm {}

/// A preference descriptor, destroyed when dropped.
struct Preference(sys::cublasLtMatmulPreference_t);

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: made by cublasLtMatmulPreferenceCreate, destroyed once.
        let _ = unsafe { sys::cublasLtMatmulPreferenceDestroy(self.0) };
    }
}

impl LtGemm {
    /// The descriptors of `s` and up to [`MAX_ALGORITHMS`] algorithms of the heuristic that fit
    /// in `workspace_bytes`, in the heuristic's order.
    fn new(handle: &LtHandle, s: &GemmShape, tf32: bool, workspace_bytes: usize) -> Result<LtGemm, DeviceError> {
        let (data, compute, scale) = types(s.dtype, tf32)?;
        // Dropped (destroying what was made) on any error below.
        let mut g = LtGemm { desc: null_mut(), layouts: [null_mut(); 3], algos: Vec::new(), tf32 };
        let (m, n, k) = s.dims;
        let stored = |op: Op, rows: i32, cols: i32| if op == Op::N { (rows, cols) } else { (cols, rows) };
        let matrices =
            [(stored(s.a.0, m, k), s.a.1, s.a.2), (stored(s.b.0, k, n), s.b.1, s.b.2), ((m, n), s.ldc, s.c_stride)];
        // SAFETY: every descriptor is made before it is set, and each attribute's buffer holds
        // the type cuBLASLt documents for it (int32 transpositions and batch counts, int64
        // batch offsets, uint32 masks and alignments, uint64 workspace).
        unsafe {
            status(sys::cublasLtMatmulDescCreate(&mut g.desc, compute, scale), "cublasLtMatmulDescCreate")?;
            for (attr, op) in
                [(DescAttr::CUBLASLT_MATMUL_DESC_TRANSA, s.a.0), (DescAttr::CUBLASLT_MATMUL_DESC_TRANSB, s.b.0)]
            {
                let v: i32 = if op == Op::N { 0 } else { 1 };
                let p = &v as *const i32 as *const c_void;
                status(sys::cublasLtMatmulDescSetAttribute(g.desc, attr, p, 4), "cublasLtMatmulDescSetAttribute")?;
            }
            for (i, ((rows, cols), ld, stride)) in matrices.into_iter().enumerate() {
                let what = "cublasLtMatrixLayoutCreate";
                status(
                    sys::cublasLtMatrixLayoutCreate(&mut g.layouts[i], data, rows as u64, cols as u64, ld as i64),
                    what,
                )?;
                let count: i32 = s.batches;
                let (count, stride) = (&count as *const i32 as *const c_void, &stride as *const i64 as *const c_void);
                let set = |attr, p, n| status(sys::cublasLtMatrixLayoutSetAttribute(g.layouts[i], attr, p, n), what);
                set(LayoutAttr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, count, 4)?;
                set(LayoutAttr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride, 8)?;
            }
            let mut raw = null_mut();
            status(sys::cublasLtMatmulPreferenceCreate(&mut raw), "cublasLtMatmulPreferenceCreate")?;
            let pref = Preference(raw);
            let workspace = workspace_bytes as u64;
            let reductions = Reduction::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
            let align = ALIGN_BYTES as u32;
            let u32s = [
                (Pref::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reductions),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align),
            ];
            let what = "cublasLtMatmulPreferenceSetAttribute";
            let p = &workspace as *const u64 as *const c_void;
            status(
                sys::cublasLtMatmulPreferenceSetAttribute(pref.0, Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, p, 8),
                what,
            )?;
            for (attr, v) in u32s {
                status(
                    sys::cublasLtMatmulPreferenceSetAttribute(pref.0, attr, &v as *const u32 as *const c_void, 4),
                    what,
                )?;
            }
            // SAFETY (zeroed): a plain C struct of integers and floats, whose zero status is
            // success; the heuristic writes the first `found`.
            let mut results: Vec<Heuristic> = vec![std::mem::zeroed(); MAX_ALGORITHMS];
            let mut found = 0;
            let [a, b, c] = g.layouts;
            status(
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle.0,
                    g.desc,
                    a,
                    b,
                    c,
                    c,
                    pref.0,
                    MAX_ALGORITHMS as i32,
                    results.as_mut_ptr(),
                    &mut found,
                ),
                "cublasLtMatmulAlgoGetHeuristic",
            )?;
            results.truncate(found.clamp(0, MAX_ALGORITHMS as i32) as usize);
            for (i, r) in results.into_iter().enumerate() {
                let config = |attr: Config| {
                    let (mut v, mut written) = (0u32, 0usize);
                    let s = sys::cublasLtMatmulAlgoConfigGetAttribute(
                        &r.algo,
                        attr,
                        &mut v as *mut u32 as *mut c_void,
                        4,
                        &mut written,
                    );
                    (s == cublasStatus_t::CUBLAS_STATUS_SUCCESS && written == 4).then_some(v)
                };
                let (id, tile) =
                    (config(Config::CUBLASLT_ALGO_CONFIG_ID), config(Config::CUBLASLT_ALGO_CONFIG_TILE_ID));
                let split = config(Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
                let scheme = config(Config::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
                // Partial sums reduced only in the compute type (or not split at all).
                let reduced_right = split.is_some_and(|k| k <= 1) || scheme.is_some_and(|r| r & !reductions == 0);
                let usable = r.state == cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && r.workspaceSize <= workspace_bytes
                    && reduced_right;
                tracing::debug!(
                    target: TRACE_TARGET,
                    "cuBLASLt heuristic {i} for {s:?}: algorithm {id:?}, tile {tile:?}, split-K {split:?}, \
                     reduction {scheme:?}, workspace {} B, waves {:.2}{}",
                    r.workspaceSize,
                    r.wavesCount,
                    if usable { "" } else { ": left out" }
                );
                if usable {
                    g.algos.push(r);
                }
            }
        }
        Ok(g)
    }

    /// Queues `C = A B` with algorithm `algo` on `stream`.
    ///
    /// # Safety
    /// As [`LtProduct::run`]; `workspace` live device memory of `workspace_bytes` that only
    /// `stream` uses.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch(
        &self,
        handle: &LtHandle,
        algo: &Heuristic,
        dtype: DType,
        (a, b, c): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
        (workspace, workspace_bytes): (CUdeviceptr, usize),
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), DeviceError> {
        let (one32, zero32, one64, zero64) = (1f32, 0f32, 1f64, 0f64);
        let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
            (&one64 as *const f64 as _, &zero64 as *const f64 as _)
        } else {
            (&one32 as *const f32 as _, &zero32 as *const f32 as _)
        };
        let [la, lb, lc] = self.layouts;
        // SAFETY: the caller's contract; alpha and beta are host scalars of the scale type,
        // alive for the call (cuBLASLt reads them before it returns in host pointer mode).
        let s = unsafe {
            sys::cublasLtMatmul(
                handle.0,
                self.desc,
                alpha,
                a as *const c_void,
                la,
                b as *const c_void,
                lb,
                beta,
                c as *const c_void,
                lc,
                c as *mut c_void,
                lc,
                &algo.algo,
                workspace as *mut c_void,
                workspace_bytes,
                stream as sys::cudaStream_t,
            )
        };
        status(s, "cublasLtMatmul")
    }
}

impl Drop for LtGemm {
    fn drop(&mut self) {
        // SAFETY: each was made once by its create call (or is null: never made).
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    let _ = sys::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.desc.is_null() {
                let _ = sys::cublasLtMatmulDescDestroy(self.desc);
            }
        }
    }
}

/// One product's cuBLASLt form: its shape, its descriptors and algorithms (made at the first
/// run with an algorithm; a failure to make them is kept, and the default runs).
pub struct LtProduct {
    shape: GemmShape,
    gemm: Mutex<Option<Result<LtGemm, String>>>,
    warned: AtomicBool,
}

impl LtProduct {
    pub fn new(shape: GemmShape) -> LtProduct {
        LtProduct { shape, gemm: Mutex::new(None), warned: AtomicBool::new(false) }
    }

    pub fn shape(&self) -> &GemmShape {
        &self.shape
    }

    /// Queues the product of [`Blas::gemm_strided`]'s arguments (which must be this product's
    /// shape) on `blas`'s stream with the heuristic's algorithm `algo`: `Ok(true)` when it was
    /// queued; `Ok(false)` when it could not be (the caller runs the default), or `Err` while
    /// [`Strict`].
    ///
    /// # Safety
    /// As [`Blas::gemm_strided`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        blas: &Blas,
        algo: usize,
        dtype: DType,
        dims: (i32, i32, i32),
        a: Operand,
        b: Operand,
        c: CUdeviceptr,
        ldc: i32,
        c_stride: i64,
        batches: i32,
    ) -> Result<bool, DeviceError> {
        let asked = GemmShape {
            dtype,
            dims,
            a: (a.op, a.ld, a.batch_stride),
            b: (b.op, b.ld, b.batch_stride),
            ldc,
            c_stride,
            batches,
        };
        let ran = if asked == self.shape {
            // SAFETY: the caller's contract.
            unsafe { self.try_run(blas, algo, (a.ptr, b.ptr, c)) }
        } else {
            Err(DeviceError::Internal(format!("a product of {asked:?} planned as {:?}", self.shape)))
        };
        match ran {
            Ok(()) => Ok(true),
            Err(e) if STRICT.with(Cell::get) => Err(e),
            Err(e) => {
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(target: TRACE_TARGET, "cuBLASLt algorithm {algo} not run, cuBLAS's runs: {e}");
                }
                Ok(false)
            }
        }
    }

    /// # Safety
    /// As [`LtProduct::run`].
    unsafe fn try_run(
        &self,
        blas: &Blas,
        algo: usize,
        ptrs: (CUdeviceptr, CUdeviceptr, CUdeviceptr),
    ) -> Result<(), DeviceError> {
        let handle = blas.lt().ok_or_else(|| DeviceError::Unavailable("no cuBLASLt handle".into()))?;
        let (workspace, workspace_bytes) = blas.workspace();
        let mut made = self.gemm.lock().unwrap_or_else(|p| p.into_inner());
        let gemm = made.get_or_insert_with(|| {
            LtGemm::new(handle, &self.shape, blas.tf32(), workspace_bytes).map_err(|e| e.to_string())
        });
        let gemm = gemm.as_ref().map_err(|e| DeviceError::Kernel(format!("cuBLASLt descriptors: {e}")))?;
        if gemm.tf32 != blas.tf32() {
            return Err(DeviceError::Internal("cuBLASLt algorithms chosen for another TF32 setting".into()));
        }
        let found = (gemm.algos.get(algo)).ok_or_else(|| {
            DeviceError::Kernel(format!("cuBLASLt's heuristic offers {} algorithms", gemm.algos.len()))
        })?;
        if found.workspaceSize > workspace_bytes {
            return Err(DeviceError::Internal(format!("{} bytes of workspace asked", found.workspaceSize)));
        }
        if [ptrs.0, ptrs.1, ptrs.2].iter().any(|p| p % ALIGN_BYTES != 0) {
            return Err(DeviceError::Kernel(format!("a matrix not aligned to {ALIGN_BYTES} bytes")));
        }
        // SAFETY: the caller's contract; the workspace is the handle's, used on its stream.
        unsafe { gemm.launch(handle, found, self.shape.dtype, ptrs, (workspace, workspace_bytes), blas.stream()) }
    }
}
