//! Counter-based random numbers: the definition of `rand`/`randn`.
//!
//! A value depends only on `(seed, element index)`, never on how work is split across threads
//! or devices, so every backend and the reference interpreter produce the same numbers. The
//! uniform variates are exact multiples of 2^-24 (f32 and narrower) or 2^-53 (f64), so they are
//! the same number in every precision.

use crate::dtype::DType;

/// SplitMix64's finaliser: a fast bijective 64-bit mixer.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64 random bits for element `counter` of the stream `seed`.
#[inline]
pub fn bits(seed: u64, counter: u64) -> u64 {
    mix64(seed ^ mix64(counter))
}

/// Uniform on [0, 1), at the resolution of `compute` (F32: 24 bits, F64: 53 bits).
#[inline]
pub fn uniform(seed: u64, counter: u64, compute: DType) -> f64 {
    let b = bits(seed, counter);
    if compute == DType::F64 {
        (b >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    } else {
        (b >> 40) as f64 * (1.0 / (1u64 << 24) as f64)
    }
}

/// The two uniforms behind normal variate `i`: `u1` in (0, 1], `u2` in [0, 1).
#[inline]
pub fn normal_uniforms(seed: u64, i: u64, compute: DType) -> (f64, f64) {
    let u1 = 1.0 - uniform(seed, i.wrapping_mul(2), compute);
    let u2 = uniform(seed, i.wrapping_mul(2).wrapping_add(1), compute);
    (u1, u2)
}

/// Standard normal variate `i` by Box-Muller, evaluated in f64 (the reference's formula).
#[inline]
pub fn normal_f64(seed: u64, i: u64, compute: DType) -> f64 {
    let (u1, u2) = normal_uniforms(seed, i, compute);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The same variate evaluated in f32 arithmetic (what an f32 kernel computes).
#[inline]
pub fn normal_f32(seed: u64, i: u64) -> f32 {
    let (u1, u2) = normal_uniforms(seed, i, DType::F32);
    let (u1, u2) = (u1 as f32, u2 as f32);
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniforms_are_exact_in_f32_and_in_range() {
        for i in 0..1000 {
            let u = uniform(7, i, DType::F32);
            assert!((0.0..1.0).contains(&u));
            assert_eq!(u as f32 as f64, u);
            let (u1, _) = normal_uniforms(7, i, DType::F32);
            assert!(u1 > 0.0 && u1 <= 1.0);
        }
    }

    #[test]
    fn normals_have_unit_variance() {
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|i| normal_f64(3, i, DType::F64)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "variance {var}");
    }
}
