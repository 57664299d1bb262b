//! Element types: the `DType` enum and the `Element` trait that maps Rust scalar types onto it.
//!
//! This module only describes types and their byte encodings; it never computes.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
    U8,
    Bool,
}

/// Coarse classes used by the dtype rules of the op table.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum DTypeClass {
    Float,
    Int,
    Bool,
}

impl DType {
    /// Every dtype, in a fixed order (tests iterate over it).
    pub const ALL: [DType; 8] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8, DType::Bool];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }

    pub const fn class(self) -> DTypeClass {
        match self {
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 => DTypeClass::Float,
            DType::I32 | DType::I64 | DType::U8 => DTypeClass::Int,
            DType::Bool => DTypeClass::Bool,
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self.class(), DTypeClass::Float)
    }

    pub const fn is_int(self) -> bool {
        matches!(self.class(), DTypeClass::Int)
    }

    /// Float or integer (everything but `Bool`).
    pub const fn is_numeric(self) -> bool {
        !matches!(self, DType::Bool)
    }

    /// The type arithmetic is carried out in: f16 and bf16 compute in f32, everything else in
    /// itself.
    pub const fn compute(self) -> DType {
        match self {
            DType::F16 | DType::BF16 => DType::F32,
            other => other,
        }
    }

    /// Unit roundoff of a float type (half an ulp at 1.0); 0 for exact types.
    pub const fn epsilon(self) -> f64 {
        match self {
            DType::F64 => f64::EPSILON / 2.0,
            DType::F32 => f32::EPSILON as f64 / 2.0,
            DType::F16 => 1.0 / 2048.0,
            DType::BF16 => 1.0 / 256.0,
            _ => 0.0,
        }
    }

    /// Lower-case name used in messages and dumps (`f32`, `bf16`, `bool`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    /// Whether `v` is exactly representable in this dtype (always true for floats, which
    /// round).
    pub fn represents(self, v: f64) -> bool {
        match self {
            DType::I32 => v.fract() == 0.0 && v >= i32::MIN as f64 && v <= i32::MAX as f64,
            DType::I64 => v.fract() == 0.0 && v >= i64::MIN as f64 && v < i64::MAX as f64,
            DType::U8 => v.fract() == 0.0 && (0.0..=255.0).contains(&v),
            DType::Bool => v == 0.0 || v == 1.0,
            _ => !v.is_nan() || self.is_float(),
        }
    }

    /// Converts an f64 to this dtype, returned as f64: floats round to nearest-even; integer
    /// targets truncate towards zero and saturate at the type's range, NaN giving 0 (Rust's `as`
    /// semantics); bool is `v != 0` (so NaN is true).
    pub fn round_f64(self, v: f64) -> f64 {
        match self {
            DType::F64 => v,
            DType::F32 => v as f32 as f64,
            DType::F16 => f16_from_f64(v).to_f64(),
            DType::BF16 => bf16_from_f64(v).to_f64(),
            DType::I32 => v as i32 as f64,
            DType::I64 => v as i64 as f64,
            DType::U8 => v as u8 as f64,
            DType::Bool => (v != 0.0) as u8 as f64,
        }
    }

    /// Float-to-integer conversion as every device performs it: truncation towards zero,
    /// saturating at this dtype's range, NaN giving 0; bool is `v != 0`. Only for integer and
    /// bool dtypes.
    pub fn int_from_f64(self, v: f64) -> i64 {
        match self {
            DType::I32 => v as i32 as i64,
            DType::I64 => v as i64,
            DType::U8 => v as u8 as i64,
            DType::Bool => (v != 0.0) as i64,
            other => panic!("int_from_f64 on float dtype {other}"),
        }
    }

    /// Integer-to-integer conversion (two's-complement wrapping, Rust's `as`); bool is `v != 0`.
    /// Integer arithmetic is defined as i64 arithmetic followed by this wrap.
    pub fn wrap_int(self, v: i64) -> i64 {
        match self {
            DType::I32 => v as i32 as i64,
            DType::I64 => v,
            DType::U8 => v as u8 as i64,
            DType::Bool => (v != 0) as i64,
            other => panic!("wrap_int on float dtype {other}"),
        }
    }

    /// Largest finite value of a float dtype (infinity for integer dtypes, which never overflow
    /// into infinities).
    pub fn max_finite(self) -> f64 {
        match self {
            DType::F64 => f64::MAX,
            DType::F32 => f32::MAX as f64,
            DType::F16 => f16::MAX.to_f64(),
            DType::BF16 => bf16::MAX.to_f64(),
            _ => f64::INFINITY,
        }
    }

    /// Smallest positive (subnormal) value of a float dtype; 0 for exact types.
    pub fn min_subnormal(self) -> f64 {
        match self {
            DType::F64 => f64::from_bits(1),
            DType::F32 => f32::from_bits(1) as f64,
            DType::F16 => f16::from_bits(1).to_f64(),
            DType::BF16 => bf16::from_bits(1).to_f64(),
            _ => 0.0,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust scalar type that a tensor can hold: `f32, f64, i32, i64, u8, bool, f16, bf16`.
///
/// Sealed: the byte encoding of each type is part of braid's contract with its devices.
pub trait Element: sealed::Sealed + Copy + Send + Sync + fmt::Debug + PartialEq + 'static {
    const DTYPE: DType;
    /// Writes the native-endian bytes of `values` to `out`.
    fn write_bytes(values: &[Self], out: &mut Vec<u8>) {
        let (start, size) = (out.len(), Self::DTYPE.size());
        out.resize(start + values.len() * size, 0);
        for (chunk, &v) in out[start..].chunks_exact_mut(size).zip(values) {
            v.write_one(chunk);
        }
    }
    /// `values` as native-endian bytes, in one allocation.
    fn to_bytes(values: &[Self]) -> std::sync::Arc<[u8]> {
        // SAFETY: every `Element` (the trait is sealed) is plain data without padding whose
        // memory is its native-endian encoding, the bytes `write_one` writes (a test checks
        // each type); so its values can be read as `size_of_val` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) };
        std::sync::Arc::from(bytes)
    }
    /// Writes `self` as native-endian bytes into `out` (exactly the dtype's size).
    fn write_one(self, out: &mut [u8]);
    /// Reads values back from native-endian bytes (length must be a multiple of the size).
    fn read_bytes(bytes: &[u8]) -> Vec<Self>;
    /// The first value of native-endian `bytes` (at least one value long).
    fn read_one(bytes: &[u8]) -> Self;
    /// The value as f64 (bools as 0/1).
    fn to_f64(self) -> f64;
    /// The nearest value of this type (see [`DType::round_f64`]).
    fn from_f64(v: f64) -> Self;
}

/// `v` rounded to the nearest f16 (ties to even), in one rounding. (`half`'s `f16::from_f64`
/// goes through f32 where the CPU has F16C, rounding twice.)
pub fn f16_from_f64(v: f64) -> f16 {
    f16::from_bits(f16_bits_from_f32(f32_round_to_odd(v)))
}

/// `v` rounded to the nearest bf16 (ties to even), in one rounding. (`half`'s
/// `bf16::from_f64` drops the f64's low bits before rounding: 1 value in about 18,000 came out
/// one bf16 step low.)
pub fn bf16_from_f64(v: f64) -> bf16 {
    bf16::from_f32(f32_round_to_odd(v))
}

/// The bits of `v` rounded to the nearest f16 (ties to even; NaNs stay quiet NaNs with their
/// payload's top bits): what `half::f16::from_f32` gives, in integer operations without
/// branches, which inline into the CPU's loops and vectorise (`half`'s call per value does
/// neither). The host C printer's `__float2half_rn` is the same function.
#[inline(always)]
pub fn f16_bits_from_f32(v: f32) -> u16 {
    let x = v.to_bits();
    let (sign, a) = ((x >> 16) & 0x8000, x & 0x7fff_ffff);
    let nan = 0x7e00 | ((a >> 13) & 0x3ff);
    // Normal f16 (from 2^-14): rebias the exponent and round off 13 bits, ties to even.
    let rebiased = a.wrapping_sub(0x3800_0000);
    let normal = rebiased.wrapping_add(0xfff + ((rebiased >> 13) & 1)) >> 13;
    // Subnormal f16: adding 0.5 leaves the multiples of 2^-24, rounded to nearest even.
    let sub = (f32::from_bits(a) + 0.5).to_bits().wrapping_sub(0x3f00_0000);
    let bits = if a > 0x7f80_0000 {
        nan
    } else if a >= 0x477f_f000 {
        0x7c00
    } else if a >= 0x3880_0000 {
        normal
    } else {
        sub
    };
    (sign | bits) as u16
}

/// The f32 value of the f16 whose bits are `h` (exact; NaNs made quiet), as `half::f16::to_f32`
/// gives it, without branches (see [`f16_bits_from_f32`]).
#[inline(always)]
pub fn f32_from_f16_bits(h: u16) -> f32 {
    let h = h as u32;
    let (sign, e, m) = ((h & 0x8000) << 16, (h >> 10) & 0x1f, h & 0x3ff);
    let normal = sign | ((e + 112) << 23) | (m << 13);
    let special = sign | 0x7f80_0000 | if m != 0 { 0x40_0000 } else { 0 } | (m << 13);
    let sub = sign | (m as f32 * f32::from_bits(0x3380_0000)).to_bits();
    f32::from_bits(if e == 0 {
        sub
    } else if e == 31 {
        special
    } else {
        normal
    })
}

/// `v` as f32 rounded "to odd": truncated towards zero, with the last significand bit set when
/// that was inexact. Rounding this to nearest in a format with at least two fewer significand
/// bits (f16, bf16) gives the correctly rounded value of `v`; `v as f32` would round twice.
fn f32_round_to_odd(v: f64) -> f32 {
    let nearest = v as f32;
    if v.is_nan() || nearest as f64 == v {
        return nearest;
    }
    // One step towards zero when rounding to nearest went away from it (infinity steps to the
    // largest finite value).
    let truncated = if (nearest as f64).abs() > v.abs() { f32::from_bits(nearest.to_bits() - 1) } else { nearest };
    f32::from_bits(truncated.to_bits() | 1)
}

macro_rules! element {
    ($t:ty, $d:expr, $to:expr, $from:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            fn read_bytes(bytes: &[u8]) -> Vec<Self> {
                const N: usize = std::mem::size_of::<$t>();
                bytes.chunks_exact(N).map(|c| <$t>::from_ne_bytes(c.try_into().expect("chunk of N bytes"))).collect()
            }
            fn write_one(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_ne_bytes());
            }
            fn read_one(bytes: &[u8]) -> Self {
                const N: usize = std::mem::size_of::<$t>();
                <$t>::from_ne_bytes(bytes[..N].try_into().expect("N bytes"))
            }
            fn to_f64(self) -> f64 {
                let f: fn($t) -> f64 = $to;
                f(self)
            }
            fn from_f64(v: f64) -> Self {
                let f: fn(f64) -> $t = $from;
                f(v)
            }
        }
    };
}

element!(f32, DType::F32, |v| v as f64, |v| v as f32);
element!(f64, DType::F64, |v| v, |v| v);
element!(f16, DType::F16, |v| v.to_f64(), f16_from_f64);
element!(bf16, DType::BF16, |v| v.to_f64(), bf16_from_f64);
element!(i32, DType::I32, |v| v as f64, |v| v as i64 as i32);
element!(i64, DType::I64, |v| v as f64, |v| v as i64);
element!(u8, DType::U8, |v| v as f64, |v| v as i64 as u8);

impl sealed::Sealed for bool {}
impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn read_bytes(bytes: &[u8]) -> Vec<Self> {
        bytes.iter().map(|&b| b != 0).collect()
    }
    fn read_one(bytes: &[u8]) -> Self {
        bytes[0] != 0
    }
    fn write_one(self, out: &mut [u8]) {
        out[0] = self as u8;
    }
    fn to_f64(self) -> f64 {
        self as u8 as f64
    }
    fn from_f64(v: f64) -> Self {
        v != 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `to_bytes` reads each type's memory; it must be the encoding `write_one` writes.
    #[test]
    fn to_bytes_is_the_encoding_write_one_writes() {
        fn check<T: Element>(values: &[T]) {
            let mut written = Vec::new();
            T::write_bytes(values, &mut written);
            assert_eq!(&*T::to_bytes(values), &written[..], "{}", T::DTYPE);
            assert_eq!(std::mem::size_of::<T>(), T::DTYPE.size(), "{}", T::DTYPE);
        }
        check(&[1.5f32, -0.0, f32::NAN, 3e-39]);
        check(&[2.25f64, -7.0, f64::INFINITY]);
        check(&[-3i32, i32::MAX]);
        check(&[i64::MIN, 42i64]);
        check(&[0u8, 7, 255]);
        check(&[true, false, true]);
        check(&[f16::from_f32(1.5), f16::from_f32(-65504.0)]);
        check(&[bf16::from_f32(3.0), bf16::from_f32(-1e30)]);
        check::<f32>(&[]);
    }

    /// The branch-free f16 conversions give `half`'s bits: every f16 widened, and narrowed
    /// from every f32 on a stride through all bit patterns plus each f16's neighbourhood (its
    /// value, the ties half way to the next, and the f32s either side of them).
    #[test]
    fn branch_free_f16_conversions_are_halfs() {
        for h in 0..=u16::MAX {
            assert_eq!(f32_from_f16_bits(h).to_bits(), f16::from_bits(h).to_f32().to_bits(), "{h:#06x}");
            let (v, next) = (f16::from_bits(h).to_f32(), f16::from_bits(h.wrapping_add(1)).to_f32());
            let tie = ((v as f64 + next as f64) / 2.0) as f32;
            for x in
                [v, tie, f32::from_bits(tie.to_bits().wrapping_add(1)), f32::from_bits(tie.to_bits().wrapping_sub(1))]
            {
                assert_eq!(f16_bits_from_f32(x), f16::from_f32(x).to_bits(), "{:#010x}", x.to_bits());
            }
        }
        for bits in (0..=u32::MAX).step_by(997) {
            let x = f32::from_bits(bits);
            assert_eq!(f16_bits_from_f32(x), f16::from_f32(x).to_bits(), "{bits:#010x}");
        }
    }

    /// The nearest value (ties to even) among the finite values of a 16-bit format, by exact
    /// comparison with the midpoints in f64; infinity past the overflow midpoint.
    fn nearest_16(v: f64, to_f64: impl Fn(u16) -> f64, max_finite: u16) -> f64 {
        let (mut lo, mut hi) = (0u16, max_finite);
        let a = v.abs();
        if a >= to_f64(max_finite) {
            let next = 2.0 * to_f64(max_finite) - to_f64(max_finite - 1);
            let mid = (to_f64(max_finite) + next) / 2.0;
            let r =
                if a < mid || (a == mid && max_finite.is_multiple_of(2)) { to_f64(max_finite) } else { f64::INFINITY };
            return r.copysign(v);
        }
        // Largest code with value <= a (positive codes are ordered like their values).
        while lo < hi {
            let m = lo + (hi - lo).div_ceil(2);
            if to_f64(m) <= a { lo = m } else { hi = m - 1 }
        }
        let (down, up) = (to_f64(lo), to_f64(lo + 1));
        let mid = (down + up) / 2.0;
        let r = if a < mid || (a == mid && lo.is_multiple_of(2)) { down } else { up };
        r.copysign(v)
    }

    #[test]
    fn f64_to_half_types_rounds_once_to_nearest_even() {
        let f16_of = |b: u16| f16::from_bits(b).to_f64();
        let bf16_of = |b: u16| bf16::from_bits(b).to_f64();
        // The cases that rounded twice before, then random f64 and f32 values of every scale
        // (both formats' subnormals, normals and overflow), and values next to midpoints.
        let mut values =
            vec![f32::from_bits(0x3F80_8001) as f64, 1.0 + 2f64.powi(-11) + 2f64.powi(-40), 65520.0, -65519.9];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for i in 0..200_000 {
            state = crate::rng::mix64(state.wrapping_add(i));
            let mantissa = 1.0 + (state >> 11) as f64 / (1u64 << 53) as f64;
            let exponent = ((state % 300) as i32) - 150;
            let v = mantissa * 2f64.powi(exponent) * if state & 1 == 0 { 1.0 } else { -1.0 };
            values.push(v);
            values.push(v as f32 as f64);
        }
        for &v in &values {
            let want = nearest_16(v, f16_of, 0x7BFF);
            assert_eq!(f16_from_f64(v).to_f64(), want, "f16 of {v:e}");
            let want = nearest_16(v, bf16_of, 0x7F7F);
            assert_eq!(bf16_from_f64(v).to_f64(), want, "bf16 of {v:e}");
        }
        assert!(f16_from_f64(f64::NAN).is_nan() && bf16_from_f64(f64::NAN).is_nan());
        assert_eq!(bf16_from_f64(1e300).to_f64(), f64::INFINITY);
        assert_eq!(f16_from_f64(-1e-300).to_bits(), 0x8000);
    }

    #[test]
    fn bytes_round_trip_for_every_element() {
        fn check<T: Element>(vals: &[T]) {
            let mut bytes = Vec::new();
            T::write_bytes(vals, &mut bytes);
            assert_eq!(bytes.len(), vals.len() * T::DTYPE.size());
            assert_eq!(T::read_bytes(&bytes), vals);
            assert_eq!(&*T::to_bytes(vals), bytes.as_slice());
            assert_eq!(T::read_one(&bytes), vals[0]);
        }
        check(&[1.5f32, -2.25]);
        check(&[1.5f64, -2.25]);
        check(&[f16::from_f32(0.5), f16::from_f32(-3.0)]);
        check(&[bf16::from_f32(0.5), bf16::from_f32(-3.0)]);
        check(&[7i32, -9]);
        check(&[7i64, -9]);
        check(&[7u8, 250]);
        check(&[true, false]);
    }

    #[test]
    fn representable_scalars() {
        assert!(DType::I32.represents(3.0));
        assert!(!DType::I32.represents(3.5));
        assert!(!DType::U8.represents(-1.0));
        assert!(DType::Bool.represents(1.0));
        assert!(!DType::Bool.represents(2.0));
        assert!(DType::F16.represents(0.1));
    }
}
