//! A float [`MatmulKernel`] as cuBLAS calls: the plan is made once per kernel, run per launch.
//!
//! braid's products are row-major (`[batch, m, n]`, contiguous); cuBLAS is column-major. A
//! row-major `m x n` matrix is, read column-major, its transpose, so the plan computes
//! `C^T = B^T A^T`: cuBLAS's `m, n, k` are braid's `n, m, k`, its first operand is braid's
//! right-hand side. An operand cuBLAS can read in place is either row-major (unit column
//! stride: cuBLAS's `N`, leading dimension the row stride) or column-major (unit row stride:
//! `T`, leading dimension the column stride), with a leading dimension at least the other
//! extent. Any other operand (neither stride 1, a negative or zero stride, overlapping rows) is
//! first copied by a printed map kernel into contiguous scratch memory. When both operands'
//! batch offsets are arithmetic progressions (with a non-negative step) the product is one
//! `cublasGemmStridedBatchedEx`; otherwise one call per batch. `k == 0` fills the product with
//! zeros; an empty product does nothing.
//!
//! Scratch memory (the caller's, [`MatmulPlan::scratch_bytes`]): the product first when no
//! argument holds it (the printed epilogue reads it there, as its last parameter), then the
//! copied operands, each at a multiple of 256 bytes.
//!
//! Integer products are not planned here: cuBLAS cannot wrap them as the CPU does, so the
//! printer prints them as a kernel entry ([`braid_lowering::cuda::CudaSource::library_product`]).
//!
//! Must never: allocate, synchronise, or hand cuBLAS a layout it does not document.

use super::blas::{Blas, Op, Operand};
use super::compile::Compiler;
use super::launch::{CudaKernel, LaunchOptions};
use super::memory::fill_device;
use crate::DeviceError;
use braid_graph::{DType, Shape};
use braid_lowering::{Arg, Body, Kernel, Load, MapLoop, MatmulKernel, MatmulOperand, Store, View};
use cudarc::driver::sys::CUdeviceptr;
use std::sync::Arc;

const ALIGN: usize = 256;

/// How an operand's batches are found.
#[derive(Clone, Debug)]
enum Batches {
    /// Batch `b` at element `first + b * step`.
    Strided { first: usize, step: usize },
    /// Batch `b` at element `offsets[b]`.
    Each(Vec<usize>),
}

impl Batches {
    fn of(offsets: &[usize]) -> Batches {
        let step = if offsets.len() > 1 { offsets[1] as i128 - offsets[0] as i128 } else { 0 };
        let arithmetic = offsets.iter().enumerate().all(|(b, &o)| o as i128 == offsets[0] as i128 + b as i128 * step);
        match (arithmetic && step >= 0, offsets.first()) {
            (true, Some(&first)) => Batches::Strided { first, step: step as usize },
            _ => Batches::Each(offsets.to_vec()),
        }
    }

    fn offset(&self, b: usize) -> usize {
        match self {
            Batches::Strided { first, step } => first + b * step,
            Batches::Each(o) => o[b],
        }
    }
}

/// One operand: where cuBLAS reads it and how.
struct OperandPlan {
    /// The kernel argument it lives in.
    arg: u16,
    /// A copy into scratch memory at this byte offset, by this kernel (arguments: the operand's
    /// argument, the scratch copy), or `None` when cuBLAS reads the argument in place.
    copy: Option<(usize, Arc<CudaKernel>)>,
    op: Op,
    ld: i32,
    batches: Batches,
}

/// Whether cuBLAS can read a `rows x cols` matrix with strides `(rs, cs)` in place: its
/// transposition flag (in the `C^T = B^T A^T` form) and leading dimension.
fn layout(rows: usize, cols: usize, rs: isize, cs: isize) -> Option<(Op, i32)> {
    let fits = |ld: isize| i32::try_from(ld).ok().filter(|&l| l >= 1);
    if (cols == 1 || cs == 1) && (rows == 1 || rs >= cols as isize) {
        return fits(if rows == 1 { cols as isize } else { rs }).map(|ld| (Op::N, ld));
    }
    if (rows == 1 || rs == 1) && (cols == 1 || cs >= rows as isize) {
        return fits(if cols == 1 { rows as isize } else { cs }).map(|ld| (Op::T, ld));
    }
    None
}

/// The map kernel that copies every batch of operand `o` (`rows x cols`, in an argument of
/// `arg` elements) contiguously into its scratch copy.
fn copy_kernel(o: &MatmulOperand, arg: Arg, rows: usize, cols: usize) -> Kernel {
    let batches = o.batch_offsets.len();
    let loop_over = |dims: &[usize], strides: &[isize], offset: usize, out_offset: usize| {
        let mut b = braid_graph::expr::ExprBuilder::new();
        let x = b.load(0, arg.dtype);
        let out = View { dims: dims.into(), strides: Shape::new(dims).contiguous_strides(), offset: out_offset };
        MapLoop {
            dims: dims.into(),
            loads: vec![Load {
                arg: 0,
                dtype: arg.dtype,
                view: View { dims: dims.into(), strides: strides.into(), offset },
            }],
            expr: b.finish(),
            stores: vec![Store { arg: 1, dtype: arg.dtype, view: out, value: x }],
        }
    };
    let loops = match Batches::of(&o.batch_offsets) {
        Batches::Strided { first, step } => {
            vec![loop_over(&[batches, rows, cols], &[step as isize, o.rs, o.cs], first, 0)]
        }
        Batches::Each(offsets) => (offsets.iter().enumerate())
            .map(|(b, &off)| loop_over(&[rows, cols], &[o.rs, o.cs], off, b * rows * cols))
            .collect(),
    };
    let copy = Arg { dtype: arg.dtype, len: batches * rows * cols };
    Kernel { args: vec![arg, copy], inputs: 1, body: Body::Map(loops) }
}

/// The cuBLAS calls of one float matrix product (see the module docs).
pub struct MatmulPlan {
    dtype: DType,
    batches: usize,
    m: usize,
    n: usize,
    k: usize,
    /// The argument holding the product, or `None` for the start of scratch memory.
    product: Option<u16>,
    lhs: OperandPlan,
    rhs: OperandPlan,
    scratch_bytes: usize,
}

impl MatmulPlan {
    pub fn new(compiler: &Compiler, kernel: &Kernel, mm: &MatmulKernel) -> Result<MatmulPlan, DeviceError> {
        let bad = |what: String| DeviceError::Internal(format!("matrix product: {what}"));
        if !matches!(mm.dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
            return Err(bad(format!("{} is not a cuBLAS product", mm.dtype)));
        }
        let batches = mm.lhs.batch_offsets.len();
        if mm.rhs.batch_offsets.len() != batches {
            return Err(bad("operands with different batch counts".into()));
        }
        for d in [mm.m, mm.n, mm.k, batches] {
            if i32::try_from(d).is_err() {
                return Err(bad(format!("dimension {d} exceeds cuBLAS's 32-bit sizes")));
            }
        }
        let size = mm.dtype.size();
        let total = batches * mm.m * mm.n;
        let product = match (mm.product as usize).cmp(&kernel.args.len()) {
            std::cmp::Ordering::Less => {
                let a = kernel.args[mm.product as usize];
                if a.dtype != mm.dtype || a.len != total {
                    return Err(bad(format!(
                        "product of {total} {} into an argument of {} {}",
                        mm.dtype, a.len, a.dtype
                    )));
                }
                Some(mm.product)
            }
            std::cmp::Ordering::Equal => None,
            std::cmp::Ordering::Greater => return Err(bad(format!("product in argument {}", mm.product))),
        };
        let mut scratch = if product.is_none() { (total * size).next_multiple_of(ALIGN) } else { 0 };
        let mut plan_operand = |o: &MatmulOperand, rows: usize, cols: usize| -> Result<OperandPlan, DeviceError> {
            let arg = *kernel.args.get(o.arg as usize).ok_or_else(|| bad(format!("operand {} missing", o.arg)))?;
            if arg.dtype != mm.dtype {
                return Err(bad(format!("operand of {} in a product of {}", arg.dtype, mm.dtype)));
            }
            if let Some((op, ld)) = layout(rows, cols, o.rs, o.cs) {
                return Ok(OperandPlan { arg: o.arg, copy: None, op, ld, batches: Batches::of(&o.batch_offsets) });
            }
            let at = scratch;
            scratch += (batches * rows * cols * size).next_multiple_of(ALIGN);
            let copy = compiler.kernel(&copy_kernel(o, arg, rows, cols))?;
            let ld = i32::try_from(cols).map_err(|_| bad("a copied operand too wide".into()))?;
            let batches = Batches::Strided { first: 0, step: rows * cols };
            Ok(OperandPlan { arg: o.arg, copy: Some((at, copy)), op: Op::N, ld, batches })
        };
        let empty = mm.m == 0 || mm.n == 0 || mm.k == 0 || batches == 0;
        let (lhs, rhs) = if empty {
            // Nothing is read: no copies, no calls (a `k == 0` product is zeros).
            let none = |o: &MatmulOperand| OperandPlan {
                arg: o.arg,
                copy: None,
                op: Op::N,
                ld: 1,
                batches: Batches::Each(vec![]),
            };
            (none(&mm.lhs), none(&mm.rhs))
        } else {
            (plan_operand(&mm.lhs, mm.m, mm.k)?, plan_operand(&mm.rhs, mm.k, mm.n)?)
        };
        Ok(MatmulPlan {
            dtype: mm.dtype,
            batches,
            m: mm.m,
            n: mm.n,
            k: mm.k,
            product,
            lhs,
            rhs,
            scratch_bytes: scratch,
        })
    }

    pub fn scratch_bytes(&self) -> usize {
        self.scratch_bytes
    }

    /// Queues the product on `blas`'s stream.
    ///
    /// # Safety
    /// As [`CudaKernel::launch`]: `args` and `scratch` live device memory of the sizes the
    /// kernel and [`MatmulPlan::scratch_bytes`] name, the GPU's context current.
    pub unsafe fn run(&self, blas: &Blas, args: &[CUdeviceptr], scratch: CUdeviceptr) -> Result<(), DeviceError> {
        let (size, stream) = (self.dtype.size(), blas.stream());
        let product = match self.product {
            Some(a) => args[a as usize],
            None => scratch,
        };
        let total = self.batches * self.m * self.n;
        if total == 0 {
            return Ok(());
        }
        if self.k == 0 {
            // SAFETY: the product holds `total` elements (the caller's contract).
            return unsafe { fill_device(product, 0, total * size, stream) };
        }
        let mut base = [0; 2];
        for (i, o) in [&self.lhs, &self.rhs].into_iter().enumerate() {
            base[i] = match &o.copy {
                None => args[o.arg as usize],
                Some((at, copy)) => {
                    let to = scratch + *at as u64;
                    // SAFETY: the operand's argument and its scratch copy are live (contract).
                    unsafe { copy.launch(stream, None, &[args[o.arg as usize], to], 0, LaunchOptions::default())? };
                    to
                }
            };
        }
        let at = |o: &OperandPlan, base: CUdeviceptr, b: usize| base + (o.batches.offset(b) * size) as u64;
        let operand = |o: &OperandPlan, base: CUdeviceptr, b: usize| {
            let stride = match o.batches {
                Batches::Strided { step, .. } => step as i64,
                Batches::Each(_) => 0,
            };
            Operand { ptr: at(o, base, b), op: o.op, ld: o.ld, batch_stride: stride }
        };
        let dims = (self.n as i32, self.m as i32, self.k as i32);
        let (ldc, c_stride) = (self.n as i32, (self.m * self.n) as i64);
        let strided =
            matches!((&self.lhs.batches, &self.rhs.batches), (Batches::Strided { .. }, Batches::Strided { .. }));
        // C^T = B^T A^T: cuBLAS's first operand is braid's right-hand side.
        let (a, b) = ((&self.rhs, base[1]), (&self.lhs, base[0]));
        if strided {
            // SAFETY: the caller's contract; layouts checked by `layout` when planned.
            return unsafe {
                blas.gemm_strided(
                    self.dtype,
                    dims,
                    operand(a.0, a.1, 0),
                    operand(b.0, b.1, 0),
                    product,
                    ldc,
                    c_stride,
                    self.batches as i32,
                )
            };
        }
        for batch in 0..self.batches {
            let c = product + (batch * self.m * self.n * size) as u64;
            // SAFETY: as above, one batch at a time.
            unsafe {
                blas.gemm_strided(
                    self.dtype,
                    dims,
                    operand(a.0, a.1, batch),
                    operand(b.0, b.1, batch),
                    c,
                    ldc,
                    c_stride,
                    1,
                )?
            };
        }
        Ok(())
    }
}
