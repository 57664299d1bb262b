//! braid's f32 `exp` and `tanh`, as every CPU kernel computes them: the interpreter calls these
//! functions, and the host C printer ([`crate::host_c`]) prints the same steps with the same
//! constants. Branch-free polynomial approximations, written so that the compiler turns a loop
//! over a slice into SIMD (AVX2 or AVX-512 where the CPU has it), instead of one `libm` call per
//! element.
//!
//! `exp`: Cody-Waite range reduction `x = n ln 2 + r`, a degree-6 polynomial for `e^r` (a
//! minimax fit of `(e^r - 1 - r) / r^2` on `|r| <= ln 2 / 2`, relative error 3e-9 before
//! rounding), and `2^n` built from exponent bits in two steps so subnormal results are right.
//! Inputs outside [`EXP_RANGE`] are not clamped first: the steps run on them as they are and
//! the result is replaced at the end (two compares and two selects, where clamping costs four
//! compares: a clamp that keeps NaN is not one `max` instruction). `tanh`: an odd polynomial
//! below 0.625 in magnitude, `1 - 2 / (e^(2|x|) + 1)` above.
//! The range reduction and the polynomials use fused multiply-adds (`mul_add`, one rounding):
//! the FMA instructions at the AVX2 and AVX-512 levels, libm's correctly rounded `fmaf` on the
//! baseline (slow, but the same bits), so results are the same bits at every vector level. The
//! error bounds (measured in the tests below) are what the op table's `ulps` allow.

// The polynomial coefficients are written as fitted; each rounds to the f32 used.
#![allow(clippy::excessive_precision)]

/// `exp`'s input range: below it the result is 0 (it underflows), above it infinity.
pub const EXP_RANGE: [f32; 2] = [-104.0, 88.8];
/// `ln 2` split in two for the range reduction: `LN2_HI` has few enough bits that `n * LN2_HI`
/// is exact.
pub const LN2_HI: f32 = 0.693_359_4;
pub const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding and subtracting it rounds to an integer.
pub const ROUND: f32 = 12_582_912.0;
/// `e^r ~ 1 + r + r^2 (c0 r^4 + c1 r^3 + ... + c4)`, Horner from `c0`.
pub const EXP_POLY: [f32; 5] =
    [1.381_453_998_9e-3, 8.368_745_116_4e-3, 4.166_839_078_7e-2, 1.666_652_039_9e-1, 4.999_999_343_2e-1];
/// `tanh(x) ~ x + x^3 (c0 z^4 + ... + c4)` with `z = x^2`, below [`TANH_SMALL`] in magnitude.
pub const TANH_POLY: [f32; 5] = [-5.704_988_7e-3, 2.063_908_9e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328_2e-1];
pub const TANH_SMALL: f32 = 0.625;

/// `e^x` for f32, about 1 ulp; NaN stays NaN, overflow gives infinity, underflow 0.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let t = x.mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = t - ROUND;
    // The integer n read off t's bits (t = 1.5 * 2^23 + n), which vectorises where `as i32`
    // (saturating) would not. Wrapping: outside EXP_RANGE these bits are garbage (the result
    // is replaced below).
    let ni = t.to_bits().wrapping_sub(0x4B40_0000);
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let c = EXP_POLY;
    let p = c[0].mul_add(r, c[1]).mul_add(r, c[2]).mul_add(r, c[3]).mul_add(r, c[4]);
    let e = p * (r * r) + r + 1.0;
    // 2^n as two factors, each a normal number for n in [-150, 128].
    let n1 = ((ni as i32) >> 1) as u32;
    let n2 = ni.wrapping_sub(n1);
    let p1 = f32::from_bits(n1.wrapping_add(127) << 23);
    let p2 = f32::from_bits(n2.wrapping_add(127) << 23);
    let y = e * p1 * p2;
    // NaN fails both tests and stays NaN (every step above keeps it).
    let y = if x > EXP_RANGE[1] { f32::INFINITY } else { y };
    if x < EXP_RANGE[0] { 0.0 } else { y }
}

/// `tanh(x)` for f32, a few ulp; odd, saturating to +-1, NaN stays NaN.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let c = TANH_POLY;
    let p = c[0].mul_add(z, c[1]).mul_add(z, c[2]).mul_add(z, c[3]).mul_add(z, c[4]);
    // The sign copied back for -0, where `x z p + x` rounds to +0 (the sign is x's anyway).
    let small = (x * z).mul_add(p, x).copysign(x);
    let e = exp(2.0 * a);
    let large = (1.0 - 2.0 / (e + 1.0)).copysign(x);
    if a < TANH_SMALL { small } else { large }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in ulps between an f32 and the exact value (f64), measured in units of the f32
    /// spacing at the exact value.
    fn ulps(got: f32, exact: f64) -> f64 {
        if exact == 0.0 {
            return (got as f64).abs() / f32::from_bits(1) as f64;
        }
        let e = exact.abs();
        let spacing = if e < f32::MIN_POSITIVE as f64 {
            f32::from_bits(1) as f64
        } else {
            let bits = (e as f32).to_bits() & 0x7f80_0000;
            f32::from_bits(bits) as f64 * f32::EPSILON as f64
        };
        (got as f64 - exact).abs() / spacing
    }

    /// Every 61st f32 in [lo, hi] (both signs handled by the ranges given).
    fn samples(lo: f32, hi: f32) -> impl Iterator<Item = f32> {
        let (a, b) = (lo.to_bits(), hi.to_bits());
        let (a, b) = (a.min(b), a.max(b));
        (a..=b).step_by(61).map(f32::from_bits)
    }

    #[test]
    fn exp_is_within_one_ulp() {
        let mut worst = 0.0f64;
        for x in samples(0.0, 88.7).chain(samples(-0.0, -103.9)) {
            let u = ulps(exp(x), (x as f64).exp());
            worst = worst.max(u);
        }
        assert!(worst <= 1.0, "exp worst {worst} ulp");
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn tanh_is_within_one_and_a_half_ulps() {
        let mut worst = 0.0f64;
        for x in samples(0.0, 10.0).chain(samples(-0.0, -10.0)) {
            let u = ulps(tanh(x), (x as f64).tanh());
            worst = worst.max(u);
        }
        assert!(worst <= 1.5, "tanh worst {worst} ulp");
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(-50.0), -1.0);
        assert!(tanh(f32::NAN).is_nan());
        assert_eq!((tanh(0.0).to_bits(), tanh(-0.0).to_bits()), (0.0f32.to_bits(), (-0.0f32).to_bits()));
    }
}
