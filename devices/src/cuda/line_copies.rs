//! Copies of long lines as the driver's 2-D copies: a map kernel's loop that only moves
//! elements (one load stored as it is) between views whose last dimension is contiguous and
//! whose other dimensions fold into evenly spaced lines of at least [`MIN_LINE_BYTES`] runs as
//! one `cuMemcpy2DAsync` instead of a printed loop. The case that matters: a concatenation's
//! parts whose lines start at odd offsets (the gradient of GPT-2's logits, 50,257 bf16 a row,
//! padded to 50,264 for the language-model head's products), which the printed loop, unable to
//! move 16 bytes at a time where rows start unaligned, copied at 0.8 TB/s (2.04 ms for the
//! 1.65 GB of `[8192, 50257]` bf16 read and written on an H200); the driver's copy takes the
//! same padded copy in about 0.7 ms (`row_padding`'s measurements).
//!
//! The loops left (short lines, anything computed) stay a printed kernel of their own; every
//! loop of a map kernel writes elements no other loop reads or writes, so the copies and that
//! kernel run in any order on the kernel's stream.
//!
//! Must never: plan a copy whose source and destination could overlap (a copy's argument is
//! never its own destination here, and the planner writes an output in place over an input only
//! where every load of it is the identity, which a line copy never is: `launch` checks the
//! addresses all the same), or change what any element receives.

use super::memory::copy_device_2d;
use crate::DeviceError;
use braid_graph::expr::ExprOp;
use braid_lowering::{Body, Kernel, MapLoop, View};
use cudarc::driver::sys::{CUdeviceptr, CUstream};

/// Lines shorter than this stay in the printed loop (the driver's 2-D copy is built for long
/// lines; a permute of attention heads moves lines of 128 bytes).
pub const MIN_LINE_BYTES: usize = 4096;

/// One copy of `lines` lines of `width` bytes, `pitch` bytes apart, from argument `src` at
/// byte `src_at` to argument `dst` at byte `dst_at`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LineCopy {
    pub src: u16,
    pub dst: u16,
    pub src_at: usize,
    pub dst_at: usize,
    pub src_pitch: usize,
    pub dst_pitch: usize,
    pub width: usize,
    pub lines: usize,
}

/// The line copies of `kernel` and the kernel of its other loops (`None` when every loop is a
/// copy); no copies and `kernel` itself when it is not a map kernel or has no such loop.
pub fn plan(kernel: &Kernel) -> (Vec<LineCopy>, Option<Kernel>) {
    let Body::Map(loops) = &kernel.body else { return (vec![], Some(kernel.clone())) };
    let mut copies = vec![];
    let mut rest = vec![];
    for l in loops {
        match line_copy(kernel, l) {
            Some(c) => copies.push(c),
            None => rest.push(l.clone()),
        }
    }
    if copies.is_empty() {
        return (copies, Some(kernel.clone()));
    }
    let rest = (!rest.is_empty()).then(|| Kernel { body: Body::Map(rest), ..kernel.clone() });
    (copies, rest)
}

/// `l` as a line copy, if it is one.
fn line_copy(kernel: &Kernel, l: &MapLoop) -> Option<LineCopy> {
    let ([load], [store]) = (l.loads.as_slice(), l.stores.as_slice()) else { return None };
    let node = l.expr.nodes.get(store.value as usize)?;
    // The load stored as it is (a half type may pass through its f32 register and back).
    let loaded = match node.op {
        ExprOp::Load(0) => true,
        ExprOp::Cast(to, a) if to == store.dtype => l.expr.nodes.get(a as usize)?.op == ExprOp::Load(0),
        _ => false,
    };
    if !loaded || load.dtype != store.dtype || load.arg == store.arg || l.numel() == 0 {
        return None;
    }
    let size = load.dtype.size();
    let (src_lines, src_pitch) = lines(&load.view)?;
    let (dst_lines, dst_pitch) = lines(&store.view)?;
    let width = l.dims.last().copied().unwrap_or(1) * size;
    let arg_bytes = |a: u16| kernel.args.get(a as usize).map(|x| x.len * x.dtype.size());
    let fits = |view: &View, pitch: usize, arg: u16| {
        let end = view.offset * size + (src_lines - 1) * pitch * size + width;
        arg_bytes(arg).is_some_and(|bytes| end <= bytes)
    };
    let ok = src_lines == dst_lines
        && width >= MIN_LINE_BYTES
        && (src_lines == 1 || (src_pitch * size >= width && dst_pitch * size >= width))
        && fits(&load.view, src_pitch, load.arg)
        && fits(&store.view, dst_pitch, store.arg);
    ok.then(|| LineCopy {
        src: load.arg,
        dst: store.arg,
        src_at: load.view.offset * size,
        dst_at: store.view.offset * size,
        src_pitch: if src_lines == 1 { width } else { src_pitch * size },
        dst_pitch: if dst_lines == 1 { width } else { dst_pitch * size },
        width,
        lines: src_lines,
    })
}

/// The lines of `view` (its last dimension contiguous, the others evenly spaced lines): their
/// number and the elements from one to the next.
fn lines(view: &View) -> Option<(usize, usize)> {
    let r = view.dims.len();
    if r == 0 || (view.dims[r - 1] > 1 && view.strides[r - 1] != 1) {
        return None;
    }
    let lines: usize = view.dims[..r - 1].iter().product();
    // Dimensions of one index fold away; the others must nest: each a whole number of the next.
    let outer: Vec<(usize, isize)> =
        (0..r - 1).filter(|&d| view.dims[d] > 1).map(|d| (view.dims[d], view.strides[d])).collect();
    let pitch = outer.last().map_or(0, |&(_, s)| s);
    let nested = outer.windows(2).all(|w| w[0].1 == w[1].1 * w[1].0 as isize);
    (pitch >= 0 && nested).then_some((lines, pitch as usize))
}

/// Queues `copies` on `stream` over the kernel's argument addresses `args`.
///
/// # Safety
/// As [`super::launch::CudaKernel::launch`]: every address points to live device memory of
/// its argument's length until the stream has run the copies.
pub unsafe fn run(copies: &[LineCopy], args: &[CUdeviceptr], stream: CUstream) -> Result<(), DeviceError> {
    for c in copies {
        let (src, dst) = (args[c.src as usize] + c.src_at as u64, args[c.dst as usize] + c.dst_at as u64);
        let span = |at: u64, pitch: usize| (at, at + ((c.lines - 1) * pitch + c.width) as u64);
        let ((s0, s1), (d0, d1)) = (span(src, c.src_pitch), span(dst, c.dst_pitch));
        if s0 < d1 && d0 < s1 {
            return Err(DeviceError::Internal(format!("a line copy over its own source: {c:?}")));
        }
        // SAFETY: the caller's contract; the spans were checked against the arguments when
        // planned.
        unsafe { copy_device_2d((dst, c.dst_pitch), (src, c.src_pitch), c.width, c.lines, stream)? };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_graph::expr::ExprBuilder;
    use braid_graph::{DType, Shape};
    use braid_lowering::{Arg, Load, Store};

    fn view(dims: &[usize], strides: &[isize], offset: usize) -> View {
        View { dims: dims.into(), strides: strides.into(), offset }
    }

    /// A loop copying `from` (arg 0) to `to` (arg 1) over `dims`, or storing `x * 2` instead.
    fn copy_loop(dims: &[usize], from: View, to: View, dtype: DType, computed: bool) -> MapLoop {
        let mut b = ExprBuilder::new();
        let x = b.load(0, dtype);
        let value = if computed {
            let two = b.constant(2.0, dtype);
            b.mul(x, two)
        } else {
            x
        };
        let value = b.stored(value, dtype);
        MapLoop {
            dims: dims.into(),
            loads: vec![Load { arg: 0, dtype, view: from }],
            expr: b.finish(),
            stores: vec![Store { arg: 1, dtype, view: to, value }],
        }
    }

    #[test]
    fn a_concatenations_long_odd_lines_are_one_driver_copy_and_the_rest_a_kernel() {
        // The gradient of GPT-2's logits padded: [8, 5000] bf16 into rows of 5008, and the
        // padding's zeros (lines of 8 elements: a printed loop).
        let dt = DType::BF16;
        let part = copy_loop(&[8, 5000], view(&[8, 5000], &[5000, 1], 0), view(&[8, 5000], &[5008, 1], 0), dt, false);
        let zeros = copy_loop(&[8, 8], view(&[8, 8], &[8, 1], 0), view(&[8, 8], &[5008, 1], 5000), dt, false);
        let args = vec![Arg { dtype: dt, len: 8 * 5000 }, Arg { dtype: dt, len: 8 * 5008 }];
        let kernel = Kernel { args, inputs: 1, body: Body::Map(vec![part, zeros.clone()]) };
        let (copies, rest) = plan(&kernel);
        let want = LineCopy {
            src: 0,
            dst: 1,
            src_at: 0,
            dst_at: 0,
            src_pitch: 10000,
            dst_pitch: 10016,
            width: 10000,
            lines: 8,
        };
        assert_eq!(copies, [want]);
        assert_eq!(rest.map(|k| k.body), Some(Body::Map(vec![zeros])));
    }

    #[test]
    fn only_plain_long_copies_between_lines_become_driver_copies() {
        let dt = DType::F32;
        let args = |n: usize| vec![Arg { dtype: dt, len: n }, Arg { dtype: dt, len: n }];
        let contiguous = |d: &[usize]| View { dims: d.into(), strides: Shape::new(d).contiguous_strides(), offset: 0 };
        let check = |l: MapLoop, n: usize, copies: usize| {
            let kernel = Kernel { args: args(n), inputs: 1, body: Body::Map(vec![l]) };
            assert_eq!(plan(&kernel).0.len(), copies, "{kernel:?}");
        };
        // A whole contiguous block: one line.
        check(copy_loop(&[4096], contiguous(&[4096]), contiguous(&[4096]), dt, false), 4096, 1);
        // Three dimensions that nest into lines of 1024 f32.
        let nested = view(&[2, 3, 1024], &[3 * 2048, 2048, 1], 0);
        check(copy_loop(&[2, 3, 1024], nested, contiguous(&[2, 3, 1024]), dt, false), 6 * 2048, 1);
        // Dimensions that do not nest, a transposed last dimension, a computed value, short lines.
        let apart = view(&[2, 3, 1024], &[5000, 2048, 1], 0);
        check(copy_loop(&[2, 3, 1024], apart, contiguous(&[2, 3, 1024]), dt, false), 16384, 0);
        let transposed = view(&[1024, 8], &[1, 1024], 0);
        check(copy_loop(&[1024, 8], transposed, contiguous(&[1024, 8]), dt, false), 8192, 0);
        check(copy_loop(&[4096], contiguous(&[4096]), contiguous(&[4096]), dt, true), 4096, 0);
        check(copy_loop(&[64, 16], contiguous(&[64, 16]), contiguous(&[64, 16]), dt, false), 1024, 0);
        // A kernel of copies alone prints no entry (nothing is compiled or launched for it).
        let all = Kernel { args: args(4096), inputs: 1, body: Body::Map(vec![]) };
        assert!(braid_lowering::cuda::print(&all, "k").unwrap().entries.is_empty());
    }
}
