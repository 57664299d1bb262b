//! cuBLAS handles, one per stream, and the one call braid makes through them: a (strided)
//! batched `gemm` in any of braid's float dtypes ([`Blas::gemm`]).
//!
//! A handle is bound to its stream (`cublasSetStream`) and to a workspace the caller owns
//! (`cublasSetWorkspace`, set after the stream because setting a stream resets the workspace),
//! so cuBLAS never allocates or synchronises on its own. Its math mode is set explicitly:
//! `CUBLAS_DEFAULT_MATH` with reduced-precision reductions disallowed, so f16/bf16 products
//! accumulate and reduce in f32 and round once, as the CPU's; f32 products run in full f32
//! (no TF32) unless the handle was made with `tf32` (then f32 products use the
//! `CUBLAS_COMPUTE_32F_FAST_TF32` compute type: faster, about 10 bits of mantissa per product).
//! Beside it, a handle holds a cuBLASLt handle (when the library is there) whose products run on
//! the same stream, in the same workspace, with the same numerics (`super::blas_lt`).
//!
//! Must never: choose a stream, allocate workspace, or run anything but what it is asked to.

use super::context::Gpu;
use crate::DeviceError;
use braid_graph::DType;
use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{
    self, cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasMath_t, cublasOperation_t, cublasStatus_t,
    cudaDataType_t,
};
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use std::ffi::c_void;
use std::sync::Arc;

/// Workspace a handle should be given: cuBLAS asks for 32 MiB on Hopper GPUs (4 MiB on older
/// ones); less only limits the algorithms it may pick.
pub const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

fn status(s: cublasStatus_t, what: &str) -> Result<(), DeviceError> {
    match s {
        cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED => {
            Err(DeviceError::OutOfMemory { requested: 0, in_use: 0, reserved: 0 })
        }
        s => Err(DeviceError::Kernel(format!("{what}: cuBLAS status {s:?}"))),
    }
}

/// A transposition flag of cuBLAS's column-major view of an operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    N,
    T,
}

/// One column-major operand of a `gemm`: its address (of batch 0), transposition, leading
/// dimension and element stride between batches.
#[derive(Clone, Copy, Debug)]
pub struct Operand {
    pub ptr: CUdeviceptr,
    pub op: Op,
    pub ld: i32,
    pub batch_stride: i64,
}

/// A cuBLAS handle bound to one stream and workspace.
pub struct Blas {
    raw: cublasHandle_t,
    stream: CUstream,
    tf32: bool,
    gpu: Arc<Gpu>,
    workspace: (CUdeviceptr, usize),
    /// A cuBLASLt handle for the products' tuning variants (`super::blas_lt`), when the library
    /// is there; it runs on this handle's stream, in its workspace.
    lt: Option<super::blas_lt::LtHandle>,
}

// SAFETY: a cuBLAS handle may be used from any thread, one at a time; `&self` methods only
// issue calls that cuBLAS documents as safe on one handle from one thread at a time, and the
// runtime drives a stream from one thread.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    /// A handle issuing work on `stream` with `workspace_bytes` of device memory at
    /// `workspace` (see [`BLAS_WORKSPACE_BYTES`]); f32 products in TF32 if `tf32`.
    ///
    /// # Safety
    /// `stream` is a live stream of `gpu`, and `workspace` live device memory of
    /// `workspace_bytes` that only this handle's stream uses, both for the handle's lifetime.
    pub unsafe fn new(
        gpu: &Arc<Gpu>,
        stream: CUstream,
        workspace: CUdeviceptr,
        workspace_bytes: usize,
        tf32: bool,
    ) -> Result<Blas, DeviceError> {
        gpu.bind()?;
        let raw = blas::create_handle().map_err(|e| status(e.0, "cublasCreate").unwrap_err())?;
        // Without it, products have no cuBLASLt variants (and run as ever).
        let lt = match super::blas_lt::available().then(super::blas_lt::LtHandle::new) {
            Some(Ok(h)) => Some(h),
            Some(Err(e)) => {
                tracing::debug!(target: super::TRACE_TARGET, "no cuBLASLt handle: {e}");
                None
            }
            None => None,
        };
        let workspace_of = (workspace, workspace_bytes);
        let handle = Blas { raw, stream, tf32, gpu: gpu.clone(), workspace: workspace_of, lt };
        // SAFETY: a live handle; the caller's contract for the stream and workspace.
        unsafe {
            status(sys::cublasSetStream_v2(raw, stream as sys::cudaStream_t), "cublasSetStream")?;
            status(sys::cublasSetWorkspace_v2(raw, workspace as *mut c_void, workspace_bytes), "cublasSetWorkspace")?;
            let mode = cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
            status(sys::cublasSetMathMode(raw, mode), "cublasSetMathMode")?;
        }
        Ok(handle)
    }

    pub fn stream(&self) -> CUstream {
        self.stream
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Whether its f32 products use TF32.
    pub fn tf32(&self) -> bool {
        self.tf32
    }

    /// Its workspace: address and bytes.
    pub fn workspace(&self) -> (CUdeviceptr, usize) {
        self.workspace
    }

    /// Its cuBLASLt handle, if the library is there.
    pub fn lt(&self) -> Option<&super::blas_lt::LtHandle> {
        self.lt.as_ref()
    }

    /// `C = A * B` for `batches` column-major products (`m x k` times `k x n` into `m x n`,
    /// `ldc` and `c_batch_stride` for `C`) in `dtype` (`cublasGemmStridedBatchedEx`; f32
    /// accumulation for f16/bf16). Batches that no stride describes are one call each, with
    /// `batches` 1.
    ///
    /// # Safety
    /// The GPU's context is current; every matrix lies in live device memory until the stream
    /// runs the product; `C` does not overlap `A` or `B`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_strided(
        &self,
        dtype: DType,
        (m, n, k): (i32, i32, i32),
        a: Operand,
        b: Operand,
        c: CUdeviceptr,
        ldc: i32,
        c_batch_stride: i64,
        batches: i32,
    ) -> Result<(), DeviceError> {
        let (data, compute) = self.types(dtype)?;
        let (one32, zero32, one64, zero64) = (1f32, 0f32, 1f64, 0f64);
        let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
            (&one64 as *const f64 as _, &zero64 as *const f64 as _)
        } else {
            (&one32 as *const f32 as _, &zero32 as *const f32 as _)
        };
        let op = |o: Op| if o == Op::N { cublasOperation_t::CUBLAS_OP_N } else { cublasOperation_t::CUBLAS_OP_T };
        // SAFETY: the caller's contract; alpha and beta are host scalars of the compute type.
        let r = unsafe {
            blas::gemm_strided_batched_ex(
                self.raw,
                op(a.op),
                op(b.op),
                m,
                n,
                k,
                alpha,
                a.ptr as *const c_void,
                data,
                a.ld,
                a.batch_stride,
                b.ptr as *const c_void,
                data,
                b.ld,
                b.batch_stride,
                beta,
                c as *mut c_void,
                data,
                ldc,
                c_batch_stride,
                batches,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        r.map_err(|e| {
            status(e.0, &format!("cublasGemmStridedBatchedEx ({dtype}, {m} x {n} x {k}, {batches} batches)"))
                .unwrap_err()
        })
    }

    /// The data type and compute type of a product in `dtype`.
    fn types(&self, dtype: DType) -> Result<(cudaDataType_t, cublasComputeType_t), DeviceError> {
        use cublasComputeType_t::*;
        Ok(match dtype {
            DType::F32 if self.tf32 => (cudaDataType_t::CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32),
            DType::F32 => (cudaDataType_t::CUDA_R_32F, CUBLAS_COMPUTE_32F),
            DType::F64 => (cudaDataType_t::CUDA_R_64F, CUBLAS_COMPUTE_64F),
            DType::F16 => (cudaDataType_t::CUDA_R_16F, CUBLAS_COMPUTE_32F),
            DType::BF16 => (cudaDataType_t::CUDA_R_16BF, CUBLAS_COMPUTE_32F),
            d => return Err(DeviceError::Internal(format!("a cuBLAS product of {d}"))),
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: created by cublasCreate and destroyed once.
            let _ = unsafe { blas::destroy_handle(self.raw) };
        }
    }
}
