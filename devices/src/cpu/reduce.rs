//! Reductions on the CPU: a contiguous `[outer, len, inner]` input reduced along `len`.
//!
//! Floats accumulate in their compute type (f16/bf16 in f32) with several partial sums so the
//! loops vectorise; integers wrap. Rows are split across rayon when there are enough of them.
//! This module never allocates device memory.

use super::map::ArgPtr;
use braid_graph::{DType, ReduceOp};
use braid_lowering::ReduceKernel;
use half::{bf16, f16};
use rayon::prelude::*;

/// Rows of work below which the reduction stays on the calling thread.
const PAR_ELEMENTS: usize = 64 * 1024;

trait Acc: Copy + PartialOrd + Send + Sync {
    const ZERO: Self;
    fn add(self, o: Self) -> Self;
    fn is_nan(self) -> bool;
    fn mean(self, n: usize) -> Self;
}

macro_rules! acc_float {
    ($t:ty) => {
        impl Acc for $t {
            const ZERO: Self = 0.0;
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn mean(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
macro_rules! acc_int {
    ($t:ty) => {
        impl Acc for $t {
            const ZERO: Self = 0;
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            fn is_nan(self) -> bool {
                false
            }
            fn mean(self, _: usize) -> Self {
                unreachable!("mean of integers is rejected when recorded")
            }
        }
    };
}
acc_float!(f32);
acc_float!(f64);
acc_int!(i32);
acc_int!(i64);
acc_int!(u8);

/// Sum of a contiguous row with 8 independent partial sums (vectorises for floats).
fn row_sum<T: Acc>(row: &[T]) -> T {
    let mut parts = [T::ZERO; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (p, &x) in parts.iter_mut().zip(c) {
            *p = p.add(x);
        }
    }
    let mut s = chunks.remainder().iter().fold(T::ZERO, |a, &x| a.add(x));
    for p in parts {
        s = s.add(p);
    }
    s
}

/// Reduces one `[len, inner]` block into `out[..inner]` (as T), and for ArgMax into `arg`.
fn reduce_block<T: Acc>(op: ReduceOp, block: &[T], len: usize, inner: usize, out: &mut [T], arg: &mut [i64]) {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            if inner == 1 {
                out[0] = row_sum(block);
            } else {
                out.fill(T::ZERO);
                for r in 0..len {
                    for (o, &x) in out.iter_mut().zip(&block[r * inner..(r + 1) * inner]) {
                        *o = o.add(x);
                    }
                }
            }
            if op == ReduceOp::Mean {
                out.iter_mut().for_each(|o| *o = o.mean(len));
            }
        }
        ReduceOp::Max | ReduceOp::Min => {
            let better = |x: T, best: T| if op == ReduceOp::Max { x > best } else { x < best };
            out.copy_from_slice(&block[..inner]);
            for r in 1..len {
                for (o, &x) in out.iter_mut().zip(&block[r * inner..(r + 1) * inner]) {
                    if (better(x, *o) || x.is_nan()) && !o.is_nan() {
                        *o = x;
                    }
                }
            }
        }
        ReduceOp::ArgMax => {
            out.copy_from_slice(&block[..inner]);
            arg.fill(0);
            for r in 1..len {
                for ((o, a), &x) in out.iter_mut().zip(arg.iter_mut()).zip(&block[r * inner..(r + 1) * inner]) {
                    if !o.is_nan() && (x > *o || x.is_nan()) {
                        *o = x;
                        *a = r as i64;
                    }
                }
            }
        }
    }
}

/// Converts block `o` of the input to `T` (into the vector).
type LoadBlock<'a, T> = &'a (dyn Fn(usize, &mut Vec<T>) + Sync);
/// Writes the results of block `o` (values, or indices for ArgMax).
type StoreBlock<'a, T> = &'a (dyn Fn(usize, &[T], &[i64]) + Sync);

/// Runs `k` for one dtype.
fn run_typed<T: Acc + Default>(k: &ReduceKernel, load: LoadBlock<'_, T>, store: StoreBlock<'_, T>) {
    let work = |o: usize, block: &mut Vec<T>, out: &mut Vec<T>, arg: &mut Vec<i64>| {
        load(o, block);
        reduce_block(k.op, block, k.len, k.inner, out, arg);
        store(o, out, arg);
    };
    let fresh = || (Vec::<T>::new(), vec![T::ZERO; k.inner], vec![0i64; k.inner]);
    if k.outer * k.len * k.inner < PAR_ELEMENTS || k.outer == 1 {
        let (mut block, mut out, mut arg) = fresh();
        (0..k.outer).for_each(|o| work(o, &mut block, &mut out, &mut arg));
    } else {
        (0..k.outer).into_par_iter().for_each_init(fresh, |(block, out, arg), o| work(o, block, out, arg));
    }
}

/// Runs a reduction kernel. `args` are the kernel's arguments.
pub fn run_reduce(k: &ReduceKernel, args: &[ArgPtr]) -> Result<(), String> {
    let input = *args.get(k.input as usize).ok_or("reduction input missing")?;
    let output = *args.get(k.output as usize).ok_or("reduction output missing")?;
    if input.dtype != k.in_dtype || output.dtype != k.out_dtype {
        return Err("reduction arguments have unexpected dtypes".into());
    }
    if input.len != k.outer * k.len * k.inner || output.len != k.outer * k.inner {
        return Err(format!(
            "reduction of {}x{}x{} over arguments of {} and {} elements",
            k.outer, k.len, k.inner, input.len, output.len
        ));
    }
    if k.len == 0 && k.op != ReduceOp::Sum && k.op != ReduceOp::Mean {
        return Err("reduction of an empty dimension".into());
    }
    let block = k.len * k.inner;
    let (ip, op) = (input.ptr as usize, output.ptr as usize);
    let argmax = k.op == ReduceOp::ArgMax;
    // Loads a block of the input as T (a copy: keeps the typed paths uniform and lets f16/bf16
    // widen once).
    macro_rules! go {
        ($t:ty, $store_ty:ty, $widen:expr, $narrow:expr) => {{
            let load = move |o: usize, buf: &mut Vec<$t>| {
                // SAFETY: o < outer and the input holds outer * block elements (checked above).
                let src = unsafe { std::slice::from_raw_parts((ip as *const $store_ty).add(o * block), block) };
                buf.clear();
                buf.extend(src.iter().map($widen));
            };
            let store = move |o: usize, vals: &[$t], arg: &[i64]| {
                // SAFETY: each o writes its own inner-long row of the output.
                unsafe {
                    if argmax {
                        let dst = std::slice::from_raw_parts_mut((op as *mut i64).add(o * k.inner), k.inner);
                        dst.copy_from_slice(arg);
                    } else {
                        let dst = std::slice::from_raw_parts_mut((op as *mut $store_ty).add(o * k.inner), k.inner);
                        for (d, &v) in dst.iter_mut().zip(vals) {
                            *d = $narrow(v);
                        }
                    }
                }
            };
            run_typed::<$t>(k, &load, &store);
        }};
    }
    match k.in_dtype {
        DType::F32 => go!(f32, f32, |&x: &f32| x, |v: f32| v),
        DType::F64 => go!(f64, f64, |&x: &f64| x, |v: f64| v),
        DType::F16 => go!(f32, f16, |x: &f16| x.to_f32(), f16::from_f32),
        DType::BF16 => go!(f32, bf16, |x: &bf16| x.to_f32(), bf16::from_f32),
        DType::I32 => go!(i32, i32, |&x: &i32| x, |v: i32| v),
        DType::I64 => go!(i64, i64, |&x: &i64| x, |v: i64| v),
        DType::U8 => go!(u8, u8, |&x: &u8| x, |v: u8| v),
        DType::Bool => return Err("reductions of bool are rejected when recorded".into()),
    }
    Ok(())
}
