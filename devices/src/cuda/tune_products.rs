//! The variants of a float matrix product ([`super::matmul`]) for the tuner
//! ([`crate::runtime::tune`]): the default is today's cuBLAS call (`cublas`), the others the
//! algorithms cuBLASLt's heuristic offers for the same call, in its order (`cublasLt heuristic
//! 0`, ...: the first four on the short list, eight when exhaustive; [`super::blas_lt`]).
//!
//! Which products: those made in one (strided-batched) cuBLAS call, of at least
//! [`MIN_TUNED_FLOPS`], when libcublasLt is there. Their operands copied to scratch memory,
//! padding and epilogue stay as they are: a variant changes the call only, so the tuner runs
//! the whole kernel in each (`super::tune::options`, with [`LaunchOptions::blas_algo`]) and
//! compares its outputs with the default's. cuBLASLt's algorithms may add in another order than
//! cuBLAS's (other tiles, split-K), so every one is non-bitwise: timed only under
//! `BRAID_DETERMINISTIC=0`, and a choice among them is not used while deterministic. A
//! kernel writing over one of its inputs is never timed (`super::tune::options` checks).
//!
//! The key: a hash of the kernel (its IR, its printed epilogue) and of cuBLASLt's version
//! (another version's heuristic may offer other algorithms under the same names), the call's
//! batches, `m, n, k`, transpositions and leading dimensions in buckets, the arguments'
//! dtypes.
//!
//! Must never: offer a variant for a product made in several calls, or mark one bitwise.

use super::blas::Op;
use super::blas_lt::{self, MAX_ALGORITHMS};
use super::launch::{CudaKernel, LaunchOptions};
use super::tune::Variants;
use crate::runtime::tune::{TuneKey, Variant, content_hash};

/// Products of fewer multiplications and additions than this are not tuned (cuBLAS's choice
/// is as good as any where the launch costs about as much as the work).
pub const MIN_TUNED_FLOPS: f64 = (1u64 << 27) as f64;

/// Algorithms the short list (`BRAID_AUTOTUNE=on`) times.
const SHORT_LIST: usize = 4;

/// The variants of `kernel`'s product, the default first, if it has a choice.
pub fn variants(kernel: &CudaKernel) -> Option<Variants> {
    let lt = kernel.matmul_plan()?.lt()?;
    let shape = *lt.shape();
    if shape.flops() < MIN_TUNED_FLOPS || !blas_lt::available() {
        return None;
    }
    let (variants, options) = named();
    let k = kernel.kernel();
    let transposed = |op: Op| (op == Op::T) as usize;
    let (m, n, depth) = shape.dims;
    let extents = [
        shape.batches as usize,
        m as usize,
        n as usize,
        depth as usize,
        transposed(shape.a.0),
        shape.a.1 as usize,
        transposed(shape.b.0),
        shape.b.1 as usize,
        shape.ldc as usize,
    ];
    let hash = content_hash(&(k, &kernel.source().source, blas_lt::version()));
    let key = TuneKey::new(hash, &extents, k.args.iter().map(|a| a.dtype));
    Some(Variants { key, variants, options })
}

/// Every product's variants and the launch options of each.
fn named() -> (Vec<Variant>, Vec<LaunchOptions>) {
    let mut variants = vec![Variant { name: "cublas".into(), bitwise: true, short_list: true }];
    let mut options = vec![LaunchOptions::default()];
    for i in 0..MAX_ALGORITHMS {
        variants.push(Variant { name: format!("cublasLt heuristic {i}"), bitwise: false, short_list: i < SHORT_LIST });
        options.push(LaunchOptions { blas_algo: i as u8 + 1, ..Default::default() });
    }
    (variants, options)
}

#[cfg(test)]
mod tests {
    use crate::runtime::tune::{Mode, Plan, Tuner};

    /// The products' variants as the tuner plans them: deterministic settings time none (the
    /// cuBLAS default runs, bit for bit as with tuning off); `BRAID_DETERMINISTIC=0` times the
    /// short list, or all eight when exhaustive.
    #[test]
    fn only_non_deterministic_settings_time_cublaslt_algorithms() {
        let (variants, options) = super::named();
        assert!(variants.iter().skip(1).all(|v| !v.bitwise), "no cuBLASLt algorithm is claimed bitwise");
        assert!(options.iter().enumerate().all(|(i, o)| o.blas_algo as usize == i));
        let tuner = Tuner::open("test", None);
        let key = crate::runtime::tune::TuneKey::new(1, &[1, 2048, 2048, 2048], []);
        for mode in [Mode::On, Mode::Exhaustive] {
            assert_eq!(tuner.plan_with(&key, &variants, mode, true), Plan::Use(0));
        }
        assert_eq!(tuner.plan_with(&key, &variants, Mode::On, false), Plan::Tune((0..=4).collect()));
        assert_eq!(tuner.plan_with(&key, &variants, Mode::Exhaustive, false), Plan::Tune((0..=8).collect()));
        assert_eq!(tuner.plan_with(&key, &variants, Mode::Off, false), Plan::Use(0));
    }
}
