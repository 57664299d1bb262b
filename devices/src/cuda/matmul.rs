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
//! A large product with rows or dimensions cuBLAS cannot take at full speed (not multiples of
//! 16 bytes: `super::row_padding`) is computed padded: its operands are copied into padded,
//! zero-filled scratch matrices (in their own orientation) unless already aligned, and the
//! product goes to padded scratch rows, which its epilogue reads ([`pad_product`] rewrites the
//! kernel before it is printed) or which are copied into the argument that holds the product.
//! Batches of a row-major left-hand side that follow each other row after row, times one
//! right-hand side, are first folded into one product of all their rows, as PyTorch folds
//! `[b, m, k] @ [k, n]` (cuBLAS's batched kernels take a broadcast operand at a fraction of the
//! speed).
//!
//! A large product made in one call can also run as cuBLASLt's algorithms
//! ([`super::blas_lt`]), variants the tuner times (`super::tune_products`): the same call,
//! operands and scratch memory, the product made by `cublasLtMatmul` rather than cuBLAS.
//!
//! Integer products are not planned here: cuBLAS cannot wrap them as the CPU does, so the
//! printer prints them as a kernel entry ([`braid_lowering::cuda::CudaSource::library_product`]).
//!
//! Must never: allocate, synchronise, or hand cuBLAS a layout it does not document.

use super::blas::{Blas, Op, Operand};
use super::blas_lt::{GemmShape, LtProduct};
use super::compile::Compiler;
use super::launch::{CudaKernel, LaunchOptions};
use super::memory::{copy_device_2d, fill_device, fill_device_2d};
use super::row_padding::{CopyShape, aligned, copy_kernel, pad_epilogue, padded, worth_padding};
use crate::DeviceError;
use braid_graph::DType;
use braid_lowering::{Body, Kernel, MatmulKernel, MatmulOperand};
use cudarc::driver::sys::{CUdeviceptr, CUstream};
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

/// A copy of an operand into scratch memory: where, how, and its padding, zeroed first.
struct OperandCopy {
    at: usize,
    how: CopyBy,
    shape: CopyShape,
}

enum CopyBy {
    /// A printed map kernel (arguments: the operand's argument, the scratch copy).
    Kernel(Arc<CudaKernel>),
    /// 2-D copies of whole lines (the operand's lines are contiguous, `pitch` elements apart):
    /// `(source offset, destination offset, lines)` in elements.
    Lines { pitch: usize, copies: Vec<(usize, usize, usize)> },
}

/// One operand: where cuBLAS reads it and how.
struct OperandPlan {
    /// The kernel argument it lives in.
    arg: u16,
    /// A copy into scratch memory, or `None` when cuBLAS reads the argument in place.
    copy: Option<OperandCopy>,
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

fn is_library_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// `kernel` as it should be printed, and the row length of its product in scratch memory: a
/// large float product that no argument holds and whose rows cuBLAS would write unaligned gets
/// padded rows, and its epilogue reads them (`row_padding::pad_epilogue`). Every other kernel
/// is returned as it is, with `None`.
pub fn pad_product(kernel: &Kernel) -> (std::borrow::Cow<'_, Kernel>, Option<usize>) {
    use std::borrow::Cow;
    let Body::Matmul(mm) = &kernel.body else { return (Cow::Borrowed(kernel), None) };
    let batches = mm.lhs.batch_offsets.len();
    let in_scratch = mm.product as usize == kernel.args.len();
    if !is_library_dtype(mm.dtype)
        || !in_scratch
        || aligned(mm.dtype, mm.n, [0])
        || !worth_padding(batches, (mm.m, mm.n, mm.k))
    {
        return (Cow::Borrowed(kernel), None);
    }
    let ld = padded(mm.dtype, mm.n);
    let epilogue = match &mm.epilogue {
        None => None,
        Some(l) => match pad_epilogue(l, mm.product, batches * mm.m, mm.n, ld) {
            Some(p) => Some(p),
            None => return (Cow::Borrowed(kernel), None),
        },
    };
    let mut padded_kernel = kernel.clone();
    if let Body::Matmul(m) = &mut padded_kernel.body {
        m.epilogue = epilogue;
    }
    (Cow::Owned(padded_kernel), Some(ld))
}

/// The cuBLAS calls of one float matrix product (see the module docs).
pub struct MatmulPlan {
    dtype: DType,
    /// Batches, rows, columns and depth of the product as computed: folded, and padded where
    /// the product is large (`m`, `n`, `k` at least the kernel's).
    batches: usize,
    m: usize,
    n: usize,
    k: usize,
    /// The elements of the real product (the rest of a padded one is never read).
    total: usize,
    /// Whether the kernel's product sums over nothing (`k == 0`: zeros).
    empty_sum: bool,
    /// The argument holding the product, or `None` for the start of scratch memory.
    product: Option<u16>,
    /// For a product an argument holds but cuBLAS writes into padded scratch rows first: that
    /// argument and the product's real rows and columns, copied into it from the start of
    /// scratch memory.
    unpad: Option<(u16, usize, usize)>,
    lhs: OperandPlan,
    rhs: OperandPlan,
    scratch_bytes: usize,
    /// The one strided-batched call as cuBLASLt runs it (products made in one call only).
    lt: Option<LtProduct>,
}

/// A product's operands as one product of all the left-hand side's rows, when its batches follow
/// each other row after row and the right-hand side is the same for all: `(batches, m, lhs,
/// rhs)`, else the kernel's own.
fn fold(mm: &MatmulKernel) -> (usize, usize, MatmulOperand, MatmulOperand) {
    let (l, r) = (&mm.lhs, &mm.rhs);
    let batches = l.batch_offsets.len();
    let one_rhs = r.batch_offsets.windows(2).all(|w| w[0] == w[1]);
    let rows_follow = match layout(mm.m, mm.k, l.rs, l.cs) {
        Some((Op::N, ld)) => {
            let step = mm.m * ld as usize;
            l.batch_offsets.iter().enumerate().all(|(b, &o)| o == l.batch_offsets[0] + b * step)
        }
        _ => false,
    };
    if batches > 1 && one_rhs && rows_follow && mm.m > 1 && i32::try_from(batches * mm.m).is_ok() {
        let lhs = MatmulOperand { batch_offsets: vec![l.batch_offsets[0]], ..l.clone() };
        let rhs = MatmulOperand { batch_offsets: vec![r.batch_offsets[0]], ..r.clone() };
        return (1, batches * mm.m, lhs, rhs);
    }
    (batches, mm.m, l.clone(), r.clone())
}

impl MatmulPlan {
    /// The plan of `kernel`'s product `mm`, with `product_ld` the row length [`pad_product`]
    /// gave a product in scratch memory.
    pub fn new(
        compiler: &Compiler,
        kernel: &Kernel,
        mm: &MatmulKernel,
        product_ld: Option<usize>,
    ) -> Result<MatmulPlan, DeviceError> {
        let bad = |what: String| DeviceError::Internal(format!("matrix product: {what}"));
        if !is_library_dtype(mm.dtype) {
            return Err(bad(format!("{} is not a cuBLAS product", mm.dtype)));
        }
        mm.check_operands(|i| kernel.args.get(i as usize).map(|a| (a.dtype, a.len))).map_err(bad)?;
        let kernel_batches = mm.lhs.batch_offsets.len();
        let (dtype, size) = (mm.dtype, mm.dtype.size());
        let total = kernel_batches * mm.m * mm.n;
        let product = match (mm.product as usize).cmp(&kernel.args.len()) {
            std::cmp::Ordering::Less => {
                let a = kernel.args[mm.product as usize];
                if a.dtype != dtype || a.len != total {
                    return Err(bad(format!("product of {total} {dtype} into an argument of {} {}", a.len, a.dtype)));
                }
                Some(mm.product)
            }
            std::cmp::Ordering::Equal => None,
            std::cmp::Ordering::Greater => return Err(bad(format!("product in argument {}", mm.product))),
        };
        let (batches, m, lhs_operand, rhs_operand) = fold(mm);
        // Padded dimensions: a large product whose scratch product could not be padded (an
        // epilogue reading it otherwise) keeps its own.
        let pad = worth_padding(batches, (m, mm.n, mm.k))
            && (product.is_some() || aligned(dtype, mm.n, [0]) || product_ld.is_some());
        let up = |d: usize| if pad { padded(dtype, d) } else { d };
        // Rows are padded only in a single product: the epilogue reads batches of `m` rows.
        let (pm, pn, pk) = (if batches == 1 { up(m) } else { m }, up(mm.n), up(mm.k));
        for d in [pm, pn, pk, batches] {
            if i32::try_from(d).is_err() {
                return Err(bad(format!("dimension {d} exceeds cuBLAS's 32-bit sizes")));
            }
        }
        if let Some(ld) = product_ld.filter(|&ld| product.is_none() && ld != pn) {
            return Err(bad(format!("product rows of {ld} for {pn} padded columns")));
        }
        // A product an argument holds but cuBLAS computes padded: into scratch, then copied.
        let unpad_into = product.filter(|_| (pm, pn) != (m, mm.n));
        let in_scratch = product.is_none() || unpad_into.is_some();
        let mut scratch = if in_scratch { (batches * pm * pn * size).next_multiple_of(ALIGN) } else { 0 };
        let unpad = unpad_into.map(|arg| (arg, batches * m, mm.n));
        let mut plan_operand = |o: &MatmulOperand, (rows, cols): (usize, usize), (prows, pcols): (usize, usize)| {
            // Present and of the product's dtype: `check_operands` above.
            let arg = kernel.args[o.arg as usize];
            let in_place = |ld: i32| {
                !pad || ((prows, pcols) == (rows, cols) && aligned(dtype, ld as usize, o.batch_offsets.iter().copied()))
            };
            // Copied (padded where the product is large) in its own orientation, unless cuBLAS
            // reads it in place.
            let op = match layout(rows, cols, o.rs, o.cs) {
                Some((op, ld)) if in_place(ld) => {
                    return Ok(OperandPlan { arg: o.arg, copy: None, op, ld, batches: Batches::of(&o.batch_offsets) });
                }
                Some((op, _)) => op,
                None => Op::N,
            };
            let (outer, inner, outer_pad, inner_pad) =
                if op == Op::N { (rows, cols, prows, pcols) } else { (cols, rows, pcols, prows) };
            let shape = CopyShape { batches: o.batch_offsets.len(), outer, inner, outer_pad, ld: inner_pad };
            let at = scratch;
            scratch += (shape.elements() * size).next_multiple_of(ALIGN);
            // Contiguous lines are copied by the copy engines' 2-D copies (as fast as a copy
            // gets, where a printed kernel over odd lines could not read in wide words).
            let how = match layout(rows, cols, o.rs, o.cs) {
                Some((_, pitch)) => {
                    let pitch = pitch as usize;
                    let per_batch =
                        o.batch_offsets.iter().enumerate().map(|(b, &from)| (from, b * outer_pad * inner_pad, outer));
                    let mut copies: Vec<(usize, usize, usize)> = vec![];
                    for (from, to, lines) in per_batch {
                        // Batches that continue line after line, in both, are one copy.
                        match copies.last_mut() {
                            Some(last)
                                if outer == outer_pad
                                    && last.0 + last.2 * pitch == from
                                    && last.1 + last.2 * inner_pad == to =>
                            {
                                last.2 += lines
                            }
                            _ => copies.push((from, to, lines)),
                        }
                    }
                    CopyBy::Lines { pitch, copies }
                }
                None => {
                    let strided = match Batches::of(&o.batch_offsets) {
                        Batches::Strided { first, step } => Some((first, step)),
                        Batches::Each(_) => None,
                    };
                    CopyBy::Kernel(compiler.kernel(&copy_kernel(o, arg, op, shape, strided))?)
                }
            };
            let batches = Batches::Strided { first: 0, step: outer_pad * inner_pad };
            let ld = i32::try_from(inner_pad).map_err(|_| bad("a copied operand too wide".into()))?;
            Ok(OperandPlan { arg: o.arg, copy: Some(OperandCopy { at, how, shape }), op, ld, batches })
        };
        let empty = m == 0 || mm.n == 0 || mm.k == 0 || batches == 0;
        let (lhs, rhs) = if empty {
            // Nothing is read: no copies, no calls (a `k == 0` product is zeros).
            let none = |o: &MatmulOperand| OperandPlan {
                arg: o.arg,
                copy: None,
                op: Op::N,
                ld: 1,
                batches: Batches::Each(vec![]),
            };
            (none(&lhs_operand), none(&rhs_operand))
        } else {
            (plan_operand(&lhs_operand, (m, mm.k), (pm, pk))?, plan_operand(&rhs_operand, (mm.k, mm.n), (pk, pn))?)
        };
        let mut plan = MatmulPlan {
            dtype,
            batches,
            m: pm,
            n: pn,
            k: pk,
            total,
            empty_sum: mm.k == 0,
            product: if unpad.is_some() { None } else { product },
            unpad,
            lhs,
            rhs,
            scratch_bytes: scratch,
            lt: None,
        };
        plan.lt = plan.gemm_shape().map(LtProduct::new);
        Ok(plan)
    }

    pub fn scratch_bytes(&self) -> usize {
        self.scratch_bytes
    }

    /// The one strided-batched call of a product made in one (`None` for one call per batch,
    /// an empty product or one over nothing), as `run` makes it.
    fn gemm_shape(&self) -> Option<GemmShape> {
        let stride = |o: &OperandPlan| match o.batches {
            Batches::Strided { step, .. } => Some(step as i64),
            Batches::Each(_) => None,
        };
        if self.total == 0 || self.empty_sum || self.batches == 0 {
            return None;
        }
        // C^T = B^T A^T: cuBLAS's first operand is braid's right-hand side.
        Some(GemmShape {
            dtype: self.dtype,
            dims: (self.n as i32, self.m as i32, self.k as i32),
            a: (self.rhs.op, self.rhs.ld, stride(&self.rhs)?),
            b: (self.lhs.op, self.lhs.ld, stride(&self.lhs)?),
            ldc: self.n as i32,
            c_stride: (self.m * self.n) as i64,
            batches: self.batches as i32,
        })
    }

    /// The product's cuBLASLt form, when it is made in one call (see [`MatmulPlan::run`]'s
    /// `algo`).
    pub fn lt(&self) -> Option<&LtProduct> {
        self.lt.as_ref()
    }

    /// Queues the product on `blas`'s stream: by cuBLAS when `algo` is 0, else (made in one
    /// call) by cuBLASLt's algorithm `algo - 1` (`super::blas_lt`; cuBLAS's when it cannot run).
    ///
    /// # Safety
    /// As [`CudaKernel::launch`]: `args` and `scratch` live device memory of the sizes the
    /// kernel and [`MatmulPlan::scratch_bytes`] name, the GPU's context current.
    pub unsafe fn run(
        &self,
        blas: &Blas,
        args: &[CUdeviceptr],
        scratch: CUdeviceptr,
        algo: u8,
    ) -> Result<(), DeviceError> {
        let (size, stream) = (self.dtype.size(), blas.stream());
        let product = match self.product {
            Some(a) => args[a as usize],
            None => scratch,
        };
        if self.total == 0 {
            return Ok(());
        }
        if self.empty_sum {
            // SAFETY: the product holds `total` elements (the caller's contract; never padded:
            // a product over nothing is not worth padding).
            return unsafe { fill_device(product, 0, self.total * size, stream) };
        }
        let mut base = [0; 2];
        for (i, o) in [&self.lhs, &self.rhs].into_iter().enumerate() {
            base[i] = match &o.copy {
                None => args[o.arg as usize],
                Some(copy) => {
                    let to = scratch + copy.at as u64;
                    for (offset, pitch, width, height) in copy.shape.fills(size) {
                        // SAFETY: within the scratch copy (`CopyShape::fills`).
                        unsafe { fill_device_2d(to + offset as u64, pitch, 0, width, height, stream)? };
                    }
                    let from = args[o.arg as usize];
                    match &copy.how {
                        // SAFETY: the operand's argument and its scratch copy are live (contract).
                        CopyBy::Kernel(k) => unsafe {
                            k.launch(stream, None, &[from, to], 0, LaunchOptions::default())?
                        },
                        CopyBy::Lines { pitch, copies } => {
                            let line = copy.shape.inner * size;
                            for &(src, dst, lines) in copies {
                                let (src, dst) = (from + (src * size) as u64, to + (dst * size) as u64);
                                let pitches = (pitch * size, copy.shape.ld * size);
                                // SAFETY: within the operand (its layout) and the copy (its shape).
                                unsafe { copy_device_2d((dst, pitches.1), (src, pitches.0), line, lines, stream)? };
                            }
                        }
                    }
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
        // Checked to fit when planned.
        let dims = (self.n as i32, self.m as i32, self.k as i32);
        let (ldc, c_stride) = (self.n as i32, (self.m * self.n) as i64);
        let strided =
            matches!((&self.lhs.batches, &self.rhs.batches), (Batches::Strided { .. }, Batches::Strided { .. }));
        // C^T = B^T A^T: cuBLAS's first operand is braid's right-hand side.
        let (a, b) = ((&self.rhs, base[1]), (&self.lhs, base[0]));
        let by_lt = match self.lt.as_ref().filter(|_| algo > 0 && strided) {
            Some(lt) => {
                let (lta, ltb, batches) = (operand(a.0, a.1, 0), operand(b.0, b.1, 0), self.batches as i32);
                // SAFETY: the caller's contract; the same call as cuBLAS's below.
                unsafe { lt.run(blas, algo as usize - 1, self.dtype, dims, lta, ltb, product, ldc, c_stride, batches)? }
            }
            None => false,
        };
        if strided && !by_lt {
            // SAFETY: the caller's contract; layouts checked by `layout` when planned.
            unsafe {
                blas.gemm_strided(
                    self.dtype,
                    dims,
                    operand(a.0, a.1, 0),
                    operand(b.0, b.1, 0),
                    product,
                    ldc,
                    c_stride,
                    self.batches as i32,
                )?
            };
        } else if !strided {
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
        }
        // SAFETY: as above.
        unsafe { self.unpad(stream, args, scratch) }
    }

    /// Copies a product computed into padded scratch rows into the argument that holds it.
    ///
    /// # Safety
    /// As [`MatmulPlan::run`], after the product's calls.
    unsafe fn unpad(&self, stream: CUstream, args: &[CUdeviceptr], scratch: CUdeviceptr) -> Result<(), DeviceError> {
        let Some((arg, rows, cols)) = self.unpad else { return Ok(()) };
        let size = self.dtype.size();
        // SAFETY: the scratch rows (`n` elements apart) and the argument (`rows x cols`) are live
        // (the caller's contract).
        unsafe {
            copy_device_2d((args[arg as usize], cols * size), (scratch, self.n * size), cols * size, rows, stream)
        }
    }
}
