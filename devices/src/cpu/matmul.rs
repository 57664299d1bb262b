//! Matrix products on the CPU: f32 and f64 through the `gemm` crate (any operand strides, so a
//! transposed operand needs no copy), f16/bf16 widened to f32 for it, integers with a plain
//! wrapping loop; then the elementwise epilogue over the product. Batches of small matrices
//! are spread over rayon; a large product lets gemm parallelise inside.

use super::map::{ArgPtr, run_loop};
use braid_graph::DType;
use braid_lowering::{MatmulKernel, MatmulOperand};
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

/// Checks that every matrix of an operand lies inside its argument.
fn check_operand(op: &MatmulOperand, arg: &ArgPtr, rows: usize, cols: usize, dtype: DType) -> Result<(), String> {
    if arg.dtype != dtype {
        return Err(format!("matmul operand of {} where {dtype} was expected", arg.dtype));
    }
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    for &off in &op.batch_offsets {
        let (mut lo, mut hi) = (off as isize, off as isize);
        for (extent, stride) in [(rows, op.rs), (cols, op.cs)] {
            let span = (extent as isize - 1) * stride;
            if span < 0 { lo += span } else { hi += span }
        }
        if lo < 0 || hi >= arg.len as isize {
            return Err(format!("matmul operand reaches elements {lo}..={hi} of an argument of {}", arg.len));
        }
    }
    Ok(())
}

pub fn run_matmul(k: &MatmulKernel, args: &[ArgPtr]) -> Result<(), String> {
    let get = |i: u16| args.get(i as usize).copied().ok_or_else(|| format!("matmul argument {i} missing"));
    let (lhs, rhs) = (get(k.lhs.arg)?, get(k.rhs.arg)?);
    let batches = k.lhs.batch_offsets.len();
    if k.rhs.batch_offsets.len() != batches {
        return Err("matmul operands have different batch counts".into());
    }
    check_operand(&k.lhs, &lhs, k.m, k.k, k.dtype)?;
    check_operand(&k.rhs, &rhs, k.k, k.n, k.dtype)?;
    // The product goes to an argument, or to scratch memory when no output can hold it.
    let total = batches * k.m * k.n;
    let mut scratch: Vec<u64> = Vec::new();
    let mut all: Vec<ArgPtr> = args.to_vec();
    let product = if (k.product as usize) < args.len() {
        args[k.product as usize]
    } else {
        scratch.resize((total * k.dtype.size()).div_ceil(8), 0);
        let p = ArgPtr { ptr: scratch.as_mut_ptr() as *mut u8, len: total, dtype: k.dtype };
        all.push(p);
        p
    };
    if product.len != total || product.dtype != k.dtype {
        return Err(format!(
            "matmul product of {total} {} into an argument of {} {}",
            k.dtype, product.len, product.dtype
        ));
    }
    let (m, n, kk) = (k.m, k.n, k.k);
    let flops = m * n * kk;
    let inner_par = if flops >= PAR_FLOPS { Parallelism::Rayon(0) } else { Parallelism::None };
    let spread = batches > 1 && flops < PAR_FLOPS && batches * flops >= PAR_FLOPS / 4;
    let (lp, rp, op) = (lhs.ptr as usize, rhs.ptr as usize, product.ptr as usize);
    let (ls, rs) = ((k.lhs.rs, k.lhs.cs), (k.rhs.rs, k.rhs.cs));
    let for_batches = |f: &(dyn Fn(usize) + Sync)| {
        if spread { (0..batches).into_par_iter().for_each(f) } else { (0..batches).for_each(f) }
    };
    let (lo, ro) = (&k.lhs.batch_offsets, &k.rhs.batch_offsets);
    // SAFETY (all three macros): operands were checked against their arguments above, the
    // product is `batches * m * n` elements, and each batch writes its own `m * n` block.
    macro_rules! float {
        ($t:ty) => {
            for_batches(&|b| unsafe {
                let dst = (op as *mut $t).add(b * m * n);
                if kk == 0 {
                    std::slice::from_raw_parts_mut(dst, m * n).fill(0.0);
                } else {
                    gemm_into::<$t>(
                        m,
                        n,
                        kk,
                        dst,
                        (lp as *const $t).add(lo[b]),
                        ls,
                        (rp as *const $t).add(ro[b]),
                        rs,
                        inner_par,
                    );
                }
            })
        };
    }
    macro_rules! half {
        ($t:ty) => {
            for_batches(&|b| unsafe {
                let widen = |p: usize, off: usize, rows: usize, cols: usize, (sr, sc): (isize, isize)| -> Vec<f32> {
                    let base = (p as *const $t).add(off);
                    (0..rows * cols)
                        .map(|i| (*base.offset((i / cols) as isize * sr + (i % cols) as isize * sc)).to_f32())
                        .collect()
                };
                let a = widen(lp, lo[b], m, kk, ls);
                let bm = widen(rp, ro[b], kk, n, rs);
                let mut c = vec![0f32; m * n];
                if kk > 0 {
                    gemm_into::<f32>(
                        m,
                        n,
                        kk,
                        c.as_mut_ptr(),
                        a.as_ptr(),
                        (kk as isize, 1),
                        bm.as_ptr(),
                        (n as isize, 1),
                        inner_par,
                    );
                }
                let dst = std::slice::from_raw_parts_mut((op as *mut $t).add(b * m * n), m * n);
                for (d, &v) in dst.iter_mut().zip(&c) {
                    *d = <$t>::from_f32(v);
                }
            })
        };
    }
    macro_rules! int {
        ($t:ty) => {
            for_batches(&|b| unsafe {
                let a = (lp as *const $t).add(lo[b]);
                let r = (rp as *const $t).add(ro[b]);
                let c = std::slice::from_raw_parts_mut((op as *mut $t).add(b * m * n), m * n);
                c.fill(0);
                for i in 0..m {
                    for p in 0..kk {
                        let x = *a.offset(i as isize * ls.0 + p as isize * ls.1);
                        for (j, cv) in c[i * n..(i + 1) * n].iter_mut().enumerate() {
                            *cv = cv.wrapping_add(x.wrapping_mul(*r.offset(p as isize * rs.0 + j as isize * rs.1)));
                        }
                    }
                }
            })
        };
    }
    match k.dtype {
        DType::F32 => float!(f32),
        DType::F64 => float!(f64),
        DType::F16 => half!(f16),
        DType::BF16 => half!(bf16),
        DType::I32 => int!(i32),
        DType::I64 => int!(i64),
        DType::U8 => int!(u8),
        DType::Bool => return Err("matmul of bool is rejected when recorded".into()),
    }
    if let Some(epilogue) = &k.epilogue {
        run_loop(epilogue, &all)?;
    }
    drop(scratch);
    Ok(())
}
