//! Matrix products on the CPU: f32 and f64 through the `gemm` crate (any operand strides, so a
//! transposed operand needs no copy), f16/bf16 widened to f32 for it, integers with a plain
//! wrapping loop; then the elementwise epilogue over the product. Batches of small matrices
//! are spread over rayon; a large product lets gemm parallelise inside.

use super::map::{ArgPtr, run_loop};
use braid_graph::DType;
use braid_lowering::{Arg, Body, Kernel, MapLoop, MatmulKernel};
use gemm::Parallelism;
use half::{bf16, f16};
use rayon::prelude::*;

/// Multiply-adds below which one product runs single-threaded.
const PAR_FLOPS: usize = 1 << 21;

trait GemmScalar: Copy + 'static {
    const ZERO: Self;
    const ONE: Self;
}
impl GemmScalar for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}
impl GemmScalar for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

/// `dst[m, n] (row-major) = lhs x rhs` through gemm (alpha = 0: dst is not read; beta = 1).
///
/// # Safety
/// The operands must address valid `m x k` and `k x n` matrices with the given strides, `dst`
/// `m * n` elements that overlap neither.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into<T: GemmScalar>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    lhs: *const T,
    (lrs, lcs): (isize, isize),
    rhs: *const T,
    (rrs, rcs): (isize, isize),
    par: Parallelism,
) {
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            false,
            lhs,
            lcs,
            lrs,
            rhs,
            rcs,
            rrs,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            par,
        )
    }
}

/// Runs a matrix-product kernel: checks its operands, computes every batch's product into
/// the product argument (or scratch memory), then runs the epilogue (interpreted).
pub fn run_matmul(k: &MatmulKernel, args: &[ArgPtr]) -> Result<(), String> {
    run_matmul_with(k, args, run_loop)
}

/// [`run_matmul`] with the epilogue run by `epilogue(loop, args)`, where `args` are the
/// kernel's arguments followed, when the product goes to scratch memory, by that scratch.
pub fn run_matmul_with(
    k: &MatmulKernel,
    args: &[ArgPtr],
    epilogue: impl FnOnce(&MapLoop, &[ArgPtr]) -> Result<(), String>,
) -> Result<(), String> {
    let get = |i: u16| args.get(i as usize).copied().ok_or_else(|| format!("matmul argument {i} missing"));
    let (lhs, rhs) = (get(k.lhs.arg)?, get(k.rhs.arg)?);
    k.check_operands(|i| args.get(i as usize).map(|a| (a.dtype, a.len)))?;
    let total = k.lhs.batch_offsets.len() * k.m * k.n;
    let mut scratch = Vec::new();
    let (product, all) = product_target(args, k.product, total, k.dtype, &mut scratch)?;
    let batches = Batches::new(k, lhs, rhs, product);
    // SAFETY: the operands were checked against their arguments above, and the product holds
    // `batches * m * n` elements of the kernel's dtype.
    unsafe {
        match k.dtype {
            DType::F32 => batches.float::<f32>(),
            DType::F64 => batches.float::<f64>(),
            DType::F16 => batches.half::<f16>(),
            DType::BF16 => batches.half::<bf16>(),
            DType::I32 => batches.int::<i32>(),
            DType::I64 => batches.int::<i64>(),
            DType::U8 => batches.int::<u8>(),
            DType::Bool => return Err("matmul of bool is rejected when recorded".into()),
        }
    }
    if let Some(l) = &k.epilogue {
        epilogue(l, &all)?;
    }
    drop(scratch);
    Ok(())
}

/// Where a product of `total` elements of `dtype` goes: argument `product`, or memory in
/// `scratch` when `product` is one past the last argument (no output can hold it). Returns it
/// and the arguments an epilogue sees (the kernel's, then the scratch if any).
pub(super) fn product_target(
    args: &[ArgPtr],
    product: u16,
    total: usize,
    dtype: DType,
    scratch: &mut Vec<u64>,
) -> Result<(ArgPtr, Vec<ArgPtr>), String> {
    let mut all: Vec<ArgPtr> = args.to_vec();
    let p = if (product as usize) < args.len() {
        args[product as usize]
    } else {
        scratch.resize((total * dtype.size()).div_ceil(8), 0);
        let p = ArgPtr { ptr: scratch.as_mut_ptr() as *mut u8, len: total, dtype };
        all.push(p);
        p
    };
    if p.len != total || p.dtype != dtype {
        return Err(format!("matmul product of {total} {dtype} into an argument of {} {}", p.len, p.dtype));
    }
    Ok((p, all))
}

/// The epilogue of matrix-product kernel `kernel` (whose body is `k`) as a kernel of one map
/// loop, so that it can be compiled like any other. Its first argument is the product, an input
/// here (it is complete before the epilogue starts); the matrix kernel's arguments follow, one
/// place later. An epilogue may overwrite the product in place (each index reads and writes
/// the same element: the product's loads and stores share one view); `None` when it writes to
/// the product otherwise (that kernel stays interpreted).
pub fn epilogue_kernel(kernel: &Kernel, product: Arg, product_arg: u16, epilogue: &MapLoop) -> Option<Kernel> {
    let mut l = epilogue.clone();
    let mut product_views = (l.loads.iter().filter(|x| x.arg == product_arg).map(|x| &x.view))
        .chain(l.stores.iter().filter(|s| s.arg == product_arg).map(|s| &s.view));
    let first = product_views.next();
    let in_place = l.stores.iter().any(|s| s.arg == product_arg);
    if in_place && product_views.any(|v| Some(v) != first) {
        return None;
    }
    for x in &mut l.loads {
        x.arg = if x.arg == product_arg { 0 } else { x.arg + 1 };
    }
    for s in &mut l.stores {
        s.arg += 1;
    }
    let args = std::iter::once(product).chain(kernel.args.iter().cloned()).collect();
    Some(Kernel { args, inputs: kernel.inputs + 1, body: Body::Map(vec![l]) })
}

/// The batches of one product: shapes, operand addresses and strides, per-batch offsets, and
/// how the work is spread (over batches, or inside each product).
struct Batches<'k> {
    m: usize,
    n: usize,
    k: usize,
    lhs: usize,
    rhs: usize,
    out: usize,
    lhs_strides: (isize, isize),
    rhs_strides: (isize, isize),
    lhs_offsets: &'k [usize],
    rhs_offsets: &'k [usize],
    /// Many small products: run batches in parallel.
    spread: bool,
    /// One large product: let gemm parallelise inside it.
    inner: Parallelism,
}

/// Element types the integer loop handles (arithmetic wraps, as everywhere in braid).
trait WrappingInt: Copy + Send + Sync + 'static {
    const ZERO: Self;
    fn mul_add(self, a: Self, b: Self) -> Self;
}

macro_rules! wrapping_int {
    ($($t:ty),*) => {$(
        impl WrappingInt for $t {
            const ZERO: Self = 0;
            fn mul_add(self, a: Self, b: Self) -> Self {
                self.wrapping_add(a.wrapping_mul(b))
            }
        }
    )*};
}
wrapping_int!(i32, i64, u8);

/// Half-precision types, computed in f32: converted a contiguous run at a time (`half`'s slice
/// conversions, F16C's instructions where the CPU has them; the same bits as one at a time).
trait HalfFloat: Copy + Send + Sync + 'static {
    fn widen(self) -> f32;
    fn widen_run(src: &[Self], dst: &mut [f32]);
    fn narrow_run(src: &[f32], dst: &mut [Self]);
}

macro_rules! half_float {
    ($($t:ty),*) => {$(
        impl HalfFloat for $t {
            fn widen(self) -> f32 {
                self.to_f32()
            }
            fn widen_run(src: &[Self], dst: &mut [f32]) {
                use half::slice::HalfFloatSliceExt;
                src.convert_to_f32_slice(dst)
            }
            fn narrow_run(src: &[f32], dst: &mut [Self]) {
                use half::slice::HalfFloatSliceExt;
                dst.convert_from_f32_slice(src)
            }
        }
    )*};
}
half_float!(f16, bf16);

impl<'k> Batches<'k> {
    fn new(k: &'k MatmulKernel, lhs: ArgPtr, rhs: ArgPtr, out: ArgPtr) -> Batches<'k> {
        let batches = k.lhs.batch_offsets.len();
        let flops = k.m * k.n * k.k;
        Batches {
            m: k.m,
            n: k.n,
            k: k.k,
            lhs: lhs.ptr as usize,
            rhs: rhs.ptr as usize,
            out: out.ptr as usize,
            lhs_strides: (k.lhs.rs, k.lhs.cs),
            rhs_strides: (k.rhs.rs, k.rhs.cs),
            lhs_offsets: &k.lhs.batch_offsets,
            rhs_offsets: &k.rhs.batch_offsets,
            spread: batches > 1 && flops < PAR_FLOPS && batches * flops >= PAR_FLOPS / 4,
            inner: if flops >= PAR_FLOPS { Parallelism::Rayon(0) } else { Parallelism::None },
        }
    }

    /// Runs `f` for every batch, in parallel when there are many small ones.
    fn each(&self, f: impl Fn(usize) + Sync + Send) {
        let count = self.lhs_offsets.len();
        if self.spread { (0..count).into_par_iter().for_each(f) } else { (0..count).for_each(f) }
    }

    /// The batch's `m x n` block of the product.
    ///
    /// # Safety
    /// The product holds every batch's block of `T`s; each batch writes only its own.
    #[allow(clippy::mut_from_ref)]
    unsafe fn block<T>(&self, b: usize) -> &mut [T] {
        unsafe { std::slice::from_raw_parts_mut((self.out as *mut T).add(b * self.m * self.n), self.m * self.n) }
    }

    /// # Safety
    /// As [`run_matmul`] checked: operands inside their arguments, product of `T`s.
    unsafe fn float<T: GemmScalar + Send + Sync>(&self) {
        self.each(|b| unsafe {
            let dst = self.block::<T>(b);
            if self.k == 0 {
                dst.fill(T::ZERO);
            } else {
                gemm_into::<T>(
                    self.m,
                    self.n,
                    self.k,
                    dst.as_mut_ptr(),
                    (self.lhs as *const T).add(self.lhs_offsets[b]),
                    self.lhs_strides,
                    (self.rhs as *const T).add(self.rhs_offsets[b]),
                    self.rhs_strides,
                    self.inner,
                );
            }
        })
    }

    /// Widens both operands to contiguous f32, multiplies, rounds back.
    ///
    /// # Safety
    /// As for [`Batches::float`].
    unsafe fn half<T: HalfFloat>(&self) {
        let (m, n, kk) = (self.m, self.n, self.k);
        self.each(|b| unsafe {
            // Row by row: a contiguous row as one run, a strided one element by element.
            let widen = |p: usize, off: usize, rows: usize, cols: usize, (sr, sc): (isize, isize)| -> Vec<f32> {
                let base = (p as *const T).add(off);
                let mut out = vec![0f32; rows * cols];
                for (i, row) in out.chunks_exact_mut(cols.max(1)).enumerate().take(rows) {
                    let start = base.offset(i as isize * sr);
                    if sc == 1 {
                        T::widen_run(std::slice::from_raw_parts(start, cols), row);
                    } else {
                        for (j, d) in row.iter_mut().enumerate() {
                            *d = (*start.offset(j as isize * sc)).widen();
                        }
                    }
                }
                out
            };
            let a = widen(self.lhs, self.lhs_offsets[b], m, kk, self.lhs_strides);
            let bm = widen(self.rhs, self.rhs_offsets[b], kk, n, self.rhs_strides);
            let mut c = vec![0f32; m * n];
            if kk > 0 {
                let (a_strides, b_strides) = ((kk as isize, 1), (n as isize, 1));
                gemm_into::<f32>(m, n, kk, c.as_mut_ptr(), a.as_ptr(), a_strides, bm.as_ptr(), b_strides, self.inner);
            }
            T::narrow_run(&c, self.block::<T>(b));
        })
    }

    /// A plain wrapping loop.
    ///
    /// # Safety
    /// As for [`Batches::float`].
    unsafe fn int<T: WrappingInt>(&self) {
        let (ls, rs) = (self.lhs_strides, self.rhs_strides);
        self.each(|b| unsafe {
            let a = (self.lhs as *const T).add(self.lhs_offsets[b]);
            let r = (self.rhs as *const T).add(self.rhs_offsets[b]);
            let c = self.block::<T>(b);
            c.fill(T::ZERO);
            for i in 0..self.m {
                for p in 0..self.k {
                    let x = *a.offset(i as isize * ls.0 + p as isize * ls.1);
                    for (j, cv) in c[i * self.n..(i + 1) * self.n].iter_mut().enumerate() {
                        *cv = cv.mul_add(x, *r.offset(p as isize * rs.0 + j as isize * rs.1));
                    }
                }
            }
        })
    }
}
