//! The host transport: collectives between devices whose memory the host reads (CPU devices).
//! In one process every rank reads every rank's input where it lies; in a group spanning
//! processes the inputs come through [`super::net`]. Each rank computes its own output,
//! combining ranks in rank order so that every rank gets the same bits.
//!
//! Sums wrap for integers and mean is for floats only (the recording call checks; an integer
//! mean here would truncate); f16 and bf16
//! are combined in f32 and rounded once per rank added, as a reduction of that dtype would be.
//! This module never keeps a pointer past [`run`]: every rank waits in [`RankGroup::finish`] until
//! all are done reading.

use super::RankGroup;
use crate::DeviceError;
use braid_graph::{Collective, CollectiveKind, DType, ReduceOp};
use half::{bf16, f16};
use rayon::prelude::*;

/// Elements per parallel task of a reduction.
const CHUNK: usize = 1 << 15;

/// Runs rank `c.rank`'s part of collective `c` over `input`, writing `output`, once every rank
/// of `group` has arrived.
pub fn run(
    group: &RankGroup,
    c: &Collective,
    dtype: DType,
    input: &[u8],
    output: &mut [u8],
) -> Result<(), DeviceError> {
    let size = dtype.size();
    let arrival = group.arrive(c.rank, c, dtype, input.len() / size, (input.as_ptr() as usize, input.len()))?;
    // Every rank reads the others' inputs until all have finished (even if this one fails).
    struct Finish<'g>(&'g RankGroup, u64);
    impl Drop for Finish<'_> {
        fn drop(&mut self) {
            self.0.finish(self.1);
        }
    }
    let _finish = Finish(group, arrival.seq);
    let received;
    let parts: Vec<&[u8]> = match group.net() {
        // A group spanning processes: every rank's input comes through rank 0.
        Some(net) => {
            received = net.exchange(arrival.seq, input).inspect_err(|e| group.break_with(e.to_string()))?;
            received.iter().map(Vec::as_slice).collect()
        }
        // SAFETY: each rank's input stays allocated and unwritten until every rank has
        // finished (its owner waits in `RankGroup::finish`, and its flush orders the free after
        // this step).
        None => arrival
            .inputs
            .iter()
            .map(|&(addr, len)| unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
            .collect(),
    };
    if parts.iter().any(|p| p.len() != input.len()) {
        return Err(DeviceError::Internal(format!("{}: ranks' inputs differ in length", c.kind.name())));
    }
    let ranks = parts.len();
    match c.kind {
        CollectiveKind::AllReduce(op) => reduce(dtype, op, &parts, 0, ranks, output),
        CollectiveKind::ReduceScatter(op) => {
            let offset = c.rank as usize * output.len();
            reduce(dtype, op, &parts, offset, ranks, output)
        }
        CollectiveKind::AllGather => {
            for (r, part) in parts.iter().enumerate() {
                output[r * input.len()..(r + 1) * input.len()].copy_from_slice(part);
            }
            Ok(())
        }
        CollectiveKind::Broadcast { root } => {
            output.copy_from_slice(parts[root as usize]);
            Ok(())
        }
    }
}

/// `output` = the reduction over ranks of `parts[r][offset..offset + output.len()]` (bytes).
fn reduce(
    dtype: DType,
    op: ReduceOp,
    parts: &[&[u8]],
    offset: usize,
    ranks: usize,
    output: &mut [u8],
) -> Result<(), DeviceError> {
    macro_rules! typed {
        ($t:ty, $add:expr, $max:expr, $min:expr, $div:expr) => {{
            let parts: Vec<&[$t]> =
                parts.iter().map(|p| cast::<$t>(&p[offset..offset + output.len()])).collect::<Result<_, _>>()?;
            let out: &mut [$t] = cast_mut::<$t>(output)?;
            let combine: fn($t, $t) -> $t = match op {
                ReduceOp::Sum | ReduceOp::Mean => $add,
                ReduceOp::Max => $max,
                ReduceOp::Min => $min,
                ReduceOp::ArgMax => return Err(DeviceError::Internal("argmax is not a collective reduction".into())),
            };
            let mean = op == ReduceOp::Mean;
            let div: fn($t, usize) -> $t = $div;
            out.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, chunk)| {
                let base = ci * CHUNK;
                for (i, o) in chunk.iter_mut().enumerate() {
                    let mut acc = parts[0][base + i];
                    for p in &parts[1..] {
                        acc = combine(acc, p[base + i]);
                    }
                    *o = if mean { div(acc, ranks) } else { acc };
                }
            });
            Ok(())
        }};
    }
    fn fmax<T: PartialOrd + Copy>(a: T, b: T, nan: impl Fn(T) -> bool) -> T {
        if nan(a) || nan(b) {
            if nan(a) { a } else { b }
        } else if b > a {
            b
        } else {
            a
        }
    }
    fn fmin<T: PartialOrd + Copy>(a: T, b: T, nan: impl Fn(T) -> bool) -> T {
        if nan(a) || nan(b) {
            if nan(a) { a } else { b }
        } else if b < a {
            b
        } else {
            a
        }
    }
    match dtype {
        DType::F32 => {
            typed!(f32, |a, b| a + b, |a, b| fmax(a, b, f32::is_nan), |a, b| fmin(a, b, f32::is_nan), |a, n| a / n
                as f32)
        }
        DType::F64 => {
            typed!(f64, |a, b| a + b, |a, b| fmax(a, b, f64::is_nan), |a, b| fmin(a, b, f64::is_nan), |a, n| a / n
                as f64)
        }
        DType::F16 => typed!(
            f16,
            |a, b| f16::from_f32(a.to_f32() + b.to_f32()),
            |a, b| fmax(a, b, f16::is_nan),
            |a, b| fmin(a, b, f16::is_nan),
            |a, n| f16::from_f32(a.to_f32() / n as f32)
        ),
        DType::BF16 => typed!(
            bf16,
            |a, b| bf16::from_f32(a.to_f32() + b.to_f32()),
            |a, b| fmax(a, b, bf16::is_nan),
            |a, b| fmin(a, b, bf16::is_nan),
            |a, n| bf16::from_f32(a.to_f32() / n as f32)
        ),
        DType::I32 => typed!(i32, |a, b| a.wrapping_add(b), |a, b| a.max(b), |a, b| a.min(b), |a, n| a / n as i32),
        DType::I64 => typed!(i64, |a, b| a.wrapping_add(b), |a, b| a.max(b), |a, b| a.min(b), |a, n| a / n as i64),
        DType::U8 => typed!(u8, |a, b| a.wrapping_add(b), |a, b| a.max(b), |a, b| a.min(b), |a, n| a / n as u8),
        DType::Bool => Err(DeviceError::Internal("bool tensors are not reduced by collectives".into())),
    }
}

fn misaligned<T>(len: usize) -> DeviceError {
    DeviceError::Internal(format!(
        "a collective's buffer of {len} bytes is not aligned for {}",
        std::any::type_name::<T>()
    ))
}

fn cast<T>(bytes: &[u8]) -> Result<&[T], DeviceError> {
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(misaligned::<T>(bytes.len()));
    }
    // SAFETY: aligned (checked), and every bit pattern is a value of these plain number types.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / std::mem::size_of::<T>()) })
}

fn cast_mut<T>(bytes: &mut [u8]) -> Result<&mut [T], DeviceError> {
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(misaligned::<T>(bytes.len()));
    }
    // SAFETY: as in `cast`; the slice is borrowed mutably, so nothing else sees it meanwhile.
    Ok(unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut T, bytes.len() / std::mem::size_of::<T>()) })
}
