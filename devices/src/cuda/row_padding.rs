//! Padded matrices for cuBLAS: where a large float product would hand cuBLAS a matrix whose
//! rows are not 16-byte aligned, or whose `m`, `n` or `k` is not a multiple of 16 bytes' worth of
//! elements, its plan (`super::matmul`) copies the operands into padded scratch matrices (the
//! padding zeroed) and computes the padded product, of which the epilogue reads the real part.
//!
//! cuBLAS's fast kernels (tensor cores fed by TMA on Hopper) need aligned rows and dimensions;
//! an odd one sends it to kernels several times slower. The case everyone meets is a language
//! model's head over GPT-2's vocabulary of 50,257. Measured on an H200 in bf16 (PyTorch, the
//! same cuBLAS): `[8192, 768] x [768, 50257]` takes 6.68 ms (95 TFLOP/s) and the two backward
//! products 4.55 and 4.29 ms, against 0.92, 0.85 and 0.83 ms at 50,264; braid's products, with
//! the rows of the product padded but its width still odd, stayed at 7.4, 9.2 and 3.3 ms, so
//! the dimensions themselves are padded, not only the rows: then 1.7, 1.6 and 1.6 ms, copies
//! included (the padded copy of the `[8192, 50257]` gradient costs about 0.7 ms). A large
//! product is worth it; a small one is not (each copy is a call of its own), hence
//! [`worth_padding`].
//!
//! Most such products never get here: the CUDA target asks for them to be recorded padded
//! (`braid_graph::ProductPadding`: a `cat` with zeros and a `narrow` in the graph, so that the
//! readers and the backward pass work on the padded layout without copies). What is left is
//! padded here: products recorded before padding or whose rows are unaligned only once laid
//! out (a transposed operand's), and odd `m`.
//!
//! The product's own padding changes how its epilogue reads it: [`pad_epilogue`] rewrites the
//! epilogue's loads of the product for padded rows (the loop's index space split, where
//! `MapLoop::simplify` merged it, so that rows are a dimension of their own).
//!
//! Must never: change what any element of any view refers to, except the product's loads, and
//! those only from the contiguous layout to the padded one; leave a padding element of a
//! summed dimension unzeroed.

use super::blas::Op;
use braid_graph::{DType, Shape};
use braid_lowering::{Arg, Body, Kernel, Load, MapLoop, MatmulOperand, Store, View};
use smallvec::SmallVec;

/// The alignment cuBLAS's fast kernels want for a matrix's rows and start.
pub const ROW_BYTES: usize = 16;

/// Products below this many FLOPs keep unaligned rows: a padded copy would cost them more than
/// cuBLAS's slower kernels do.
pub const MIN_FLOPS: f64 = (1u64 << 30) as f64;

/// Whether a product of `m x n x k` over `batches` is large enough for padded copies.
pub fn worth_padding(batches: usize, (m, n, k): (usize, usize, usize)) -> bool {
    2.0 * batches as f64 * m as f64 * n as f64 * k as f64 >= MIN_FLOPS
}

/// Whether cuBLAS reads or writes a matrix of `dtype` with leading dimension `ld`, starting at
/// each of `offsets` (elements), at full speed.
pub fn aligned(dtype: DType, ld: usize, offsets: impl IntoIterator<Item = usize>) -> bool {
    let size = dtype.size();
    (ld * size).is_multiple_of(ROW_BYTES) && offsets.into_iter().all(|o| (o * size).is_multiple_of(ROW_BYTES))
}

/// `cols` rounded up to a multiple of 16 bytes of `dtype`.
pub fn padded(dtype: DType, cols: usize) -> usize {
    let per = (ROW_BYTES / dtype.size()).max(1);
    cols.next_multiple_of(per)
}

/// The epilogue `l` reading the product (argument `product`, `rows x n` contiguous) from rows of
/// `ld` elements instead, or `None` when a load of the product is not the contiguous one over the
/// loop's index space (then the product stays unpadded).
pub fn pad_epilogue(l: &MapLoop, product: u16, rows: usize, n: usize, ld: usize) -> Option<MapLoop> {
    if n == 0 || rows * n != l.numel() {
        return None;
    }
    let contiguous = braid_graph::Shape::new(&l.dims).contiguous_strides();
    let product_loads = l.loads.iter().filter(|x| x.arg == product);
    if !product_loads.clone().all(|x| x.view.offset == 0 && x.view.strides == contiguous) {
        return None;
    }
    // Split the loop dimension that spans the end of a row (merged by `simplify`), so that the
    // last dimensions cover exactly one row.
    let mut split: Option<(usize, usize)> = None; // (dimension, its inner extent)
    let mut inner = 1usize;
    let mut first_col = l.dims.len();
    for d in (0..l.dims.len()).rev() {
        if inner == n {
            break;
        }
        let e = l.dims[d];
        if inner * e <= n {
            inner *= e;
            first_col = d;
            continue;
        }
        // The row ends inside this dimension: it splits as [e / f, f] with f = n / inner.
        if !n.is_multiple_of(inner) || !e.is_multiple_of(n / inner) {
            return None;
        }
        split = Some((d, n / inner));
        inner = n;
        first_col = d + 1; // in the new dimensions: the inner part of `d`
    }
    if inner != n {
        return None;
    }
    let resplit = |v: &View| -> View {
        let Some((d, f)) = split else { return v.clone() };
        let mut dims: SmallVec<[usize; 4]> = SmallVec::new();
        let mut strides: SmallVec<[isize; 4]> = SmallVec::new();
        for i in 0..v.dims.len() {
            if i == d {
                dims.extend([v.dims[i] / f, f]);
                strides.extend([v.strides[i] * f as isize, v.strides[i]]);
            } else {
                dims.push(v.dims[i]);
                strides.push(v.strides[i]);
            }
        }
        View { dims, strides, offset: v.offset }
    };
    let mut out = l.clone();
    for x in &mut out.loads {
        x.view = resplit(&x.view);
    }
    for s in &mut out.stores {
        s.view = resplit(&s.view);
    }
    out.dims = resplit(&View { dims: l.dims.clone(), strides: contiguous.clone(), offset: 0 }).dims;
    // Rows of `ld` elements: the column dimensions keep their strides, the row dimensions step
    // by whole padded rows.
    let mut padded: SmallVec<[isize; 4]> = braid_graph::Shape::new(&out.dims).contiguous_strides();
    let mut step = ld as isize;
    for d in (0..first_col).rev() {
        padded[d] = step;
        step *= out.dims[d] as isize;
    }
    for x in out.loads.iter_mut().filter(|x| x.arg == product) {
        x.view.strides = padded.clone();
    }
    Some(out)
}

/// A copy of an operand into scratch memory: batch after batch of `outer_pad` lines of `ld`
/// elements, of which `outer x inner` hold the operand (rows for `N`, columns for `T`) and the
/// rest is zeroed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyShape {
    pub batches: usize,
    pub outer: usize,
    pub inner: usize,
    pub outer_pad: usize,
    pub ld: usize,
}

impl CopyShape {
    pub fn elements(&self) -> usize {
        self.batches * self.outer_pad * self.ld
    }

    /// The zeroed parts, as 2-D fills in bytes of `size`-byte elements: `(offset, pitch, width,
    /// height)`: the tail of every line, then the lines past `outer` in every batch.
    pub fn fills(&self, size: usize) -> Vec<(usize, usize, usize, usize)> {
        let mut fills = vec![];
        if self.ld > self.inner {
            let lines = self.batches * self.outer_pad;
            fills.push((self.inner * size, self.ld * size, (self.ld - self.inner) * size, lines));
        }
        if self.outer_pad > self.outer {
            let pitch = self.outer_pad * self.ld * size;
            fills.push((
                self.outer * self.ld * size,
                pitch,
                (self.outer_pad - self.outer) * self.ld * size,
                self.batches,
            ));
        }
        fills
    }
}

/// The map kernel that copies every batch of operand `o` (`rows x cols`, in an argument of
/// `arg` elements) into its scratch copy of `shape`, in `op`'s orientation (a column-major
/// operand is read and written along its columns, never transposed element by element);
/// `strided`: the batches' offsets as `(first, step)` where they are an arithmetic progression.
pub fn copy_kernel(o: &MatmulOperand, arg: Arg, op: Op, shape: CopyShape, strided: Option<(usize, usize)>) -> Kernel {
    let CopyShape { batches, outer, inner, outer_pad, ld } = shape;
    let strides = match op {
        Op::N => [o.rs, o.cs],
        Op::T => [o.cs, o.rs],
    };
    let loop_over = |dims: &[usize], strides: &[isize], offset: usize, out_offset: usize| {
        let mut b = braid_graph::expr::ExprBuilder::new();
        let x = b.load(0, arg.dtype);
        let mut out_strides = Shape::new(dims).contiguous_strides();
        let r = dims.len();
        out_strides[r - 2] = ld as isize;
        if r == 3 {
            out_strides[0] = (outer_pad * ld) as isize;
        }
        let out = View { dims: dims.into(), strides: out_strides, offset: out_offset };
        MapLoop {
            dims: dims.into(),
            loads: vec![Load {
                arg: 0,
                dtype: arg.dtype,
                view: View { dims: dims.into(), strides: strides.into(), offset },
            }],
            expr: b.finish(),
            stores: vec![Store { arg: 1, dtype: arg.dtype, view: out, value: x }],
        }
    };
    let loops = match strided {
        Some((first, step)) => {
            vec![loop_over(&[batches, outer, inner], &[step as isize, strides[0], strides[1]], first, 0)]
        }
        None => (o.batch_offsets.iter().enumerate())
            .map(|(b, &off)| loop_over(&[outer, inner], &strides, off, b * outer_pad * ld))
            .collect(),
    };
    let copy = Arg { dtype: arg.dtype, len: shape.elements() };
    Kernel { args: vec![arg, copy], inputs: 1, body: Body::Map(loops) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_lowering::{Load, Store};

    /// The epilogue `cast(product)` over `dims`, simplified as the lowering leaves it.
    fn epilogue(dims: &[usize]) -> MapLoop {
        let mut b = braid_graph::expr::ExprBuilder::new();
        let x = b.load(0, DType::BF16);
        let view = View::contiguous(&braid_graph::Shape::new(dims));
        let mut l = MapLoop {
            dims: dims.into(),
            loads: vec![Load { arg: 1, dtype: DType::BF16, view: view.clone() }],
            expr: b.finish(),
            stores: vec![Store { arg: 0, dtype: DType::F32, view, value: x }],
        };
        l.simplify();
        l
    }

    /// Every index of the loop: the element its load of the product reads and its store writes.
    fn elements(l: &MapLoop) -> Vec<(usize, usize)> {
        let mut out = vec![];
        let mut idx = vec![0usize; l.dims.len()];
        for _ in 0..l.numel() {
            let at = |v: &View| {
                (v.offset as isize + idx.iter().zip(&v.strides).map(|(&i, &s)| i as isize * s).sum::<isize>()) as usize
            };
            out.push((at(&l.loads[0].view), at(&l.stores[0].view)));
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < l.dims[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        out
    }

    #[test]
    fn a_merged_index_space_splits_at_the_row_and_reads_padded_rows() {
        for (dims, n) in [(vec![4usize, 6, 7], 7usize), (vec![3, 5], 5), (vec![2, 3, 5], 15), (vec![1, 1, 9], 9)] {
            let l = epilogue(&dims);
            let rows = dims.iter().product::<usize>() / n;
            let ld = padded(DType::BF16, n);
            let p = pad_epilogue(&l, 1, rows, n, ld).expect("pads");
            let got = elements(&p);
            // The store still writes every element once, in order; the load reads row r,
            // column c at r * ld + c.
            for (i, &(read, wrote)) in got.iter().enumerate() {
                assert_eq!(wrote, i, "{dims:?}");
                assert_eq!(read, (i / n) * ld + i % n, "{dims:?}");
            }
        }
    }

    #[test]
    fn a_product_read_otherwise_stays_unpadded() {
        let mut l = epilogue(&[4, 6]);
        l.loads[0].view.strides = SmallVec::from_slice(&[1, 4]); // transposed
        l.loads[0].view.dims = SmallVec::from_slice(&[4, 6]);
        l.dims = SmallVec::from_slice(&[4, 6]);
        l.stores[0].view = View::contiguous(&braid_graph::Shape::new(&[4, 6]));
        assert!(pad_epilogue(&l, 1, 4, 6, 8).is_none());
    }

    #[test]
    fn copies_zero_the_tail_of_every_line_and_the_lines_past_the_operand() {
        let shape = CopyShape { batches: 2, outer: 3, inner: 5, outer_pad: 4, ld: 8 };
        assert_eq!(shape.elements(), 64);
        // 2-byte elements: columns 5..8 of all 8 lines, then line 3 of each batch.
        assert_eq!(shape.fills(2), vec![(10, 16, 6, 8), (48, 64, 16, 2)]);
        let exact = CopyShape { batches: 1, outer: 4, inner: 8, outer_pad: 4, ld: 8 };
        assert!(exact.fills(2).is_empty());
    }

    #[test]
    fn alignment_follows_bytes() {
        assert!(!aligned(DType::BF16, 50257, [0]));
        assert!(aligned(DType::BF16, 50264, [0, 8]));
        assert!(!aligned(DType::BF16, 50264, [3]));
        assert!(aligned(DType::F32, 4, [0]));
        assert_eq!(padded(DType::BF16, 50257), 50264);
        assert_eq!(padded(DType::F32, 5), 8);
        assert_eq!(padded(DType::F64, 3), 4);
        assert!(worth_padding(1, (8192, 50257, 768)));
        assert!(!worth_padding(1, (64, 63, 65)));
    }
}
