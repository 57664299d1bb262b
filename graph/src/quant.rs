//! Weight-only quantization: the schemes, the byte layout of a quantized weight, and the two
//! host functions every stage agrees on (`quantize`, and `dequantize`, which defines what a
//! quantized product computes).
//!
//! A quantized weight is the right operand `[k, n]` of a product `x [m, k] x w [k, n]`, held as
//! one byte buffer (a `U8` value of [`QuantLayout::bytes`] elements):
//!
//! - **values**, one row per output channel `j` (a column of `w`), at byte `j * row_bytes`:
//!   [`Scheme::Int8`] stores `k` signed bytes (two's complement); [`Scheme::Int4`] stores `k / 2`
//!   bytes, element `2i` in the low nibble of byte `i` and `2i + 1` in the high one, each a
//!   signed 4-bit value. `row_bytes` is rounded up to 16 so that every row starts aligned for
//!   vector loads; the padding is zero.
//! - **scales**, at byte [`QuantLayout::scales_offset`] (a multiple of 16): `n x groups` of the
//!   layout's scale dtype (`F32` or `F16`, little-endian), row-major: one per output channel for
//!   `Int8`, one per `group` consecutive inputs of each channel for `Int4`.
//!
//! Element `(i, j)` of the weight is `value(i, j) * scale(j, i / group)`, multiplied in f32 (the
//! scale widened exactly). Quantization is symmetric: a block's scale is its largest magnitude
//! over 127 (`Int8`) or 7 (`Int4`), rounded to the scale dtype, and each value the nearest
//! integer to `w / scale` (ties away from zero), clamped to `±127` or `±7`; a block of zeros has
//! scale 0.
//!
//! This module describes and converts bytes on the host; it never records or runs anything.

use crate::DType;
use half::f16;
use serde::{Deserialize, Serialize};
use std::fmt;

/// How a weight is quantized (symmetric, weight-only).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Scheme {
    /// Eight-bit values with one scale per output channel.
    Int8,
    /// Four-bit values (two a byte) with one scale per `group` consecutive inputs of each output
    /// channel; `group` is 32, 64 or 128 and divides the input dimension.
    Int4 { group: usize },
}

impl Scheme {
    /// The largest magnitude a value takes.
    pub const fn max_level(self) -> i32 {
        match self {
            Scheme::Int8 => 127,
            Scheme::Int4 { .. } => 7,
        }
    }

    /// Bits a value.
    pub const fn bits(self) -> usize {
        match self {
            Scheme::Int8 => 8,
            Scheme::Int4 { .. } => 4,
        }
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scheme::Int8 => write!(f, "int8"),
            Scheme::Int4 { group } => write!(f, "int4/g{group}"),
        }
    }
}

/// The layout of one quantized `[k, n]` weight (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct QuantLayout {
    pub scheme: Scheme,
    /// Inputs (rows of the weight).
    pub k: usize,
    /// Output channels (columns of the weight).
    pub n: usize,
    /// `F32` or `F16`.
    pub scale: DType,
}

/// Alignment of every row of values and of the scales, in bytes.
pub const ALIGN: usize = 16;

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

impl QuantLayout {
    /// The layout, or why it cannot be one: a group other than 32, 64 or 128, a group that does
    /// not divide `k`, or a scale dtype other than F32 and F16.
    pub fn new(scheme: Scheme, k: usize, n: usize, scale: DType) -> Result<QuantLayout, String> {
        if !matches!(scale, DType::F32 | DType::F16) {
            return Err(format!("scales are f32 or f16, not {scale}"));
        }
        if let Scheme::Int4 { group } = scheme {
            if !matches!(group, 32 | 64 | 128) {
                return Err(format!("an int4 group is 32, 64 or 128 inputs, not {group}"));
            }
            if !k.is_multiple_of(group) {
                return Err(format!("the int4 group {group} does not divide the {k} inputs of the weight"));
            }
        }
        Ok(QuantLayout { scheme, k, n, scale })
    }

    /// Inputs sharing one scale.
    pub fn group(&self) -> usize {
        match self.scheme {
            Scheme::Int8 => self.k.max(1),
            Scheme::Int4 { group } => group,
        }
    }

    /// Scales per output channel.
    pub fn groups(&self) -> usize {
        match self.scheme {
            Scheme::Int8 => 1,
            Scheme::Int4 { group } => self.k / group,
        }
    }

    /// Bytes from one channel's values to the next (a multiple of [`ALIGN`]).
    pub fn row_bytes(&self) -> usize {
        align(match self.scheme {
            Scheme::Int8 => self.k,
            Scheme::Int4 { .. } => self.k.div_ceil(2),
        })
    }

    /// Where the scales start (a multiple of [`ALIGN`]).
    pub fn scales_offset(&self) -> usize {
        self.n * self.row_bytes()
    }

    /// The whole buffer, in bytes (a multiple of [`ALIGN`]).
    pub fn bytes(&self) -> usize {
        align(self.scales_offset() + self.n * self.groups() * self.scale.size())
    }

    /// Bytes a product must read: the values and scales without the padding.
    pub fn payload_bytes(&self) -> usize {
        self.n * (self.k * self.scheme.bits()).div_ceil(8) + self.n * self.groups() * self.scale.size()
    }

    /// The integer value of weight element `(i, j)`.
    pub fn value(&self, bytes: &[u8], i: usize, j: usize) -> i32 {
        let row = j * self.row_bytes();
        match self.scheme {
            Scheme::Int8 => bytes[row + i] as i8 as i32,
            Scheme::Int4 { .. } => {
                let b = bytes[row + i / 2];
                let nibble = if i.is_multiple_of(2) { b & 0xf } else { b >> 4 };
                ((nibble << 4) as i8 >> 4) as i32
            }
        }
    }

    /// Scale `g` of output channel `j`, widened to f32.
    pub fn scale_at(&self, bytes: &[u8], j: usize, g: usize) -> f32 {
        let at = self.scales_offset() + (j * self.groups() + g) * self.scale.size();
        match self.scale {
            DType::F16 => f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32(),
            _ => f32::from_le_bytes(bytes[at..at + 4].try_into().expect("four bytes")),
        }
    }

    /// Weight element `(i, j)` as a product reads it: `value * scale` in f32.
    pub fn weight(&self, bytes: &[u8], i: usize, j: usize) -> f32 {
        self.value(bytes, i, j) as f32 * self.scale_at(bytes, j, i / self.group())
    }

    /// The whole `[k, n]` weight, row-major, in f32.
    pub fn dequantize(&self, bytes: &[u8]) -> Vec<f32> {
        assert_eq!(bytes.len(), self.bytes(), "a quantized {self} weight is {} bytes", self.bytes());
        (0..self.k).flat_map(|i| (0..self.n).map(move |j| self.weight(bytes, i, j))).collect()
    }

    /// Quantizes a `[k, n]` row-major weight (see the module docs for the rounding).
    pub fn quantize(&self, w: &[f32]) -> Vec<u8> {
        assert_eq!(w.len(), self.k * self.n, "a [{}, {}] weight", self.k, self.n);
        let mut scales = Vec::with_capacity(self.n * self.groups());
        let mut values = vec![0i32; self.k * self.n]; // channel-major
        let top = self.scheme.max_level();
        for j in 0..self.n {
            for g in 0..self.groups() {
                let rows = g * self.group()..((g + 1) * self.group()).min(self.k);
                let amax = rows.clone().map(|i| w[i * self.n + j].abs()).fold(0f32, f32::max);
                let s = self.round_scale(amax / top as f32);
                for i in rows {
                    let q = if s == 0.0 || !s.is_finite() { 0.0 } else { (w[i * self.n + j] / s).round() };
                    values[j * self.k + i] = q.clamp(-(top as f32), top as f32) as i32;
                }
                scales.push(s);
            }
        }
        self.pack(&values, &scales)
    }

    /// The buffer of integer `values` (channel-major: `values[j * k + i]`, in the scheme's range)
    /// and f32 `scales` (`n x groups`, rounded to the scale dtype).
    pub fn pack(&self, values: &[i32], scales: &[f32]) -> Vec<u8> {
        assert_eq!(values.len(), self.k * self.n);
        assert_eq!(scales.len(), self.n * self.groups());
        let mut out = vec![0u8; self.bytes()];
        let rb = self.row_bytes();
        for j in 0..self.n {
            for i in 0..self.k {
                let q = values[j * self.k + i];
                match self.scheme {
                    Scheme::Int8 => out[j * rb + i] = q as i8 as u8,
                    Scheme::Int4 { .. } => out[j * rb + i / 2] |= ((q as u8) & 0xf) << (4 * (i % 2)),
                }
            }
        }
        let mut at = self.scales_offset();
        for &s in scales {
            match self.scale {
                DType::F16 => out[at..at + 2].copy_from_slice(&f16::from_f32(s).to_le_bytes()),
                _ => out[at..at + 4].copy_from_slice(&s.to_le_bytes()),
            }
            at += self.scale.size();
        }
        out
    }

    /// `s` as the scale dtype holds it (f16 saturates at its largest finite value).
    fn round_scale(&self, s: f32) -> f32 {
        match self.scale {
            DType::F16 => f16::from_f32(s.min(f16::MAX.to_f32())).to_f32(),
            _ => s,
        }
    }

    /// The integer values, channel-major, and the scales in f32 (what [`QuantLayout::pack`] took).
    pub fn unpack(&self, bytes: &[u8]) -> (Vec<i32>, Vec<f32>) {
        let values = (0..self.n).flat_map(|j| (0..self.k).map(move |i| self.value(bytes, i, j))).collect();
        let scales = (0..self.n).flat_map(|j| (0..self.groups()).map(move |g| self.scale_at(bytes, j, g))).collect();
        (values, scales)
    }
}

impl fmt::Display for QuantLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}, {}] with {} scales", self.scheme, self.k, self.n, self.scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_nibbles_hold_signed_values_low_first() {
        let l = QuantLayout::new(Scheme::Int4 { group: 32 }, 32, 1, DType::F32).unwrap();
        let values: Vec<i32> = (0..32).map(|i| (i % 15) - 7).collect();
        let bytes = l.pack(&values, &[0.5]);
        assert_eq!(bytes[0], ((-6i8 as u8 & 0xf) << 4) | (-7i8 as u8 & 0xf));
        assert_eq!(l.unpack(&bytes), (values, vec![0.5]));
        assert_eq!(l.bytes(), 16 + 16);
    }

    #[test]
    fn quantize_then_dequantize_is_within_half_a_step() {
        for (scheme, scale) in [(Scheme::Int8, DType::F32), (Scheme::Int4 { group: 64 }, DType::F16)] {
            let (k, n) = (128, 5);
            let w: Vec<f32> = (0..k * n).map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0).collect();
            let l = QuantLayout::new(scheme, k, n, scale).unwrap();
            let back = l.dequantize(&l.quantize(&w));
            for i in 0..k {
                for j in 0..n {
                    let s = l.scale_at(&l.quantize(&w), j, i / l.group());
                    assert!((back[i * n + j] - w[i * n + j]).abs() <= s / 2.0 * 1.001, "{scheme} ({i}, {j})");
                }
            }
        }
    }

    #[test]
    fn layouts_refuse_groups_that_do_not_divide() {
        assert!(QuantLayout::new(Scheme::Int4 { group: 32 }, 48, 3, DType::F32).unwrap_err().contains("divide"));
        assert!(QuantLayout::new(Scheme::Int4 { group: 16 }, 64, 3, DType::F32).is_err());
        assert!(QuantLayout::new(Scheme::Int8, 3, 3, DType::BF16).is_err());
    }
}
