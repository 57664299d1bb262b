//! Matrix products on the CPU: f32 and f64 through the `gemm` crate, f16/bf16 widened to f32
//! for it, integers with a plain wrapping loop. Batches with small matrices are spread over
//! rayon; large products let gemm parallelise inside.

use super::map::ArgPtr;
use braid_graph::DType;
use braid_lowering::MatmulKernel;
use gemm::Parallelism;
use half::{bf16, f16};
use rayon::prelude::*;

/// Multiply-adds below which one product runs single-threaded.
const PAR_FLOPS: usize = 1 << 18;

pub fn run_matmul(k: &MatmulKernel, args: &[ArgPtr]) -> Result<(), String> {
    let (lhs, rhs, out) = (
        *args.get(k.lhs as usize).ok_or("matmul lhs missing")?,
        *args.get(k.rhs as usize).ok_or("matmul rhs missing")?,
        *args.get(k.output as usize).ok_or("matmul output missing")?,
    );
    let batches = k.lhs_offsets.len();
    if k.rhs_offsets.len() != batches || out.len != batches * k.m * k.n {
        return Err("matmul batch bookkeeping does not match the output".into());
    }
    let fits = |offs: &[usize], len: usize, size: usize| offs.iter().all(|&o| o + size <= len);
    if !fits(&k.lhs_offsets, lhs.len, k.m * k.k) || !fits(&k.rhs_offsets, rhs.len, k.k * k.n) {
        return Err("matmul operand offsets exceed their buffers".into());
    }
    if [lhs.dtype, rhs.dtype, out.dtype].iter().any(|&d| d != k.dtype) {
        return Err("matmul arguments have unexpected dtypes".into());
    }
    let (m, n, kk) = (k.m, k.n, k.k);
    let (lp, rp, op) = (lhs.ptr as usize, rhs.ptr as usize, out.ptr as usize);
    let flops = m * n * kk;
    let inner_par = if flops >= PAR_FLOPS * 8 { Parallelism::Rayon(0) } else { Parallelism::None };
    let spread = batches > 1 && flops < PAR_FLOPS * 8;
    let for_batches = |f: &(dyn Fn(usize) + Sync)| {
        if spread && batches * flops >= PAR_FLOPS {
            (0..batches).into_par_iter().for_each(f);
        } else {
            (0..batches).for_each(f);
        }
    };
    macro_rules! float {
        ($t:ty) => {
            for_batches(&|b| unsafe {
                let dst = (op as *mut $t).add(b * m * n);
                if kk == 0 {
                    std::slice::from_raw_parts_mut(dst, m * n).fill(0.0);
                } else {
                    gemm_typed::<$t>(
                        m,
                        n,
                        kk,
                        dst,
                        (lp as *const $t).add(k.lhs_offsets[b]),
                        (rp as *const $t).add(k.rhs_offsets[b]),
                        inner_par,
                    );
                }
            })
        };
    }
    macro_rules! half {
        ($t:ty) => {
            for_batches(&|b| unsafe {
                let widen = |p: usize, off: usize, len: usize| -> Vec<f32> {
                    std::slice::from_raw_parts((p as *const $t).add(off), len).iter().map(|x| x.to_f32()).collect()
                };
                let a = widen(lp, k.lhs_offsets[b], m * kk);
                let bm = widen(rp, k.rhs_offsets[b], kk * n);
                let mut c = vec![0f32; m * n];
                if kk > 0 {
                    gemm_typed::<f32>(m, n, kk, c.as_mut_ptr(), a.as_ptr(), bm.as_ptr(), inner_par);
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
                let a = std::slice::from_raw_parts((lp as *const $t).add(k.lhs_offsets[b]), m * kk);
                let r = std::slice::from_raw_parts((rp as *const $t).add(k.rhs_offsets[b]), kk * n);
                let c = std::slice::from_raw_parts_mut((op as *mut $t).add(b * m * n), m * n);
                c.fill(0);
                for i in 0..m {
                    for p in 0..kk {
                        let x = a[i * kk + p];
                        for (cv, &rv) in c[i * n..(i + 1) * n].iter_mut().zip(&r[p * n..(p + 1) * n]) {
                            *cv = cv.wrapping_add(x.wrapping_mul(rv));
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
    Ok(())
}

/// `dst[m, n] = lhs[m, k] x rhs[k, n]`, row-major, through gemm (alpha = 0 so dst is not
/// read, beta = 1).
///
/// # Safety
/// The pointers must address `m*k`, `k*n` and `m*n` valid elements; `dst` must not overlap.
unsafe fn gemm_typed<T: 'static + Copy + GemmScalar>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    lhs: *const T,
    rhs: *const T,
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
            1,
            k as isize,
            rhs,
            1,
            n as isize,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            par,
        )
    }
}

trait GemmScalar {
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
