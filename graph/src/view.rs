//! Strided views: how an index space maps onto the elements of a buffer.
//!
//! A view has the extents of its index dimensions, a stride per dimension (0 broadcasts) and an
//! offset, in elements. Movement ops compose onto views (permute, broadcast, narrow, and reshape
//! where no copy is needed), which is how fusion folds movement into the loads of a kernel.
//! Pure index arithmetic: this module never touches data.

use crate::shape::Shape;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// Strides and offset, in elements, that map an index space onto a buffer argument.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct View {
    pub dims: SmallVec<[usize; 4]>,
    pub strides: SmallVec<[isize; 4]>,
    pub offset: usize,
}

impl View {
    /// The row-major contiguous view of `shape`.
    pub fn contiguous(shape: &Shape) -> View {
        View { dims: shape.dims().into(), strides: shape.contiguous_strides(), offset: 0 }
    }

    /// A contiguous tensor of shape `from`, broadcast (NumPy rules) to `to`.
    pub fn broadcast(from: &Shape, to: &Shape) -> View {
        View::contiguous(from).broadcast_to(to)
    }

    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    pub fn shape(&self) -> Shape {
        Shape::new(&self.dims)
    }

    /// This view broadcast to `to` (its dimensions align from the right; size-1 dimensions
    /// stretch with stride 0; new leading dimensions have stride 0).
    pub fn broadcast_to(&self, to: &Shape) -> View {
        let pad = to.rank() - self.dims.len();
        let strides = (0..to.rank())
            .map(|i| if i < pad || self.dims[i - pad] != to.dims()[i] { 0 } else { self.strides[i - pad] })
            .collect();
        View { dims: to.dims().into(), strides, offset: self.offset }
    }

    /// Result dimension `i` is this view's dimension `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> View {
        View {
            dims: perm.iter().map(|&p| self.dims[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }

    /// Elements `start..start + len` of dimension `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> View {
        let mut v = self.clone();
        v.offset = (v.offset as isize + start as isize * v.strides[dim]) as usize;
        v.dims[dim] = len;
        v
    }

    /// The same elements in row-major order with dimensions `to`, if that needs no copy (the
    /// algorithm PyTorch's `view` uses); `None` when the elements are not laid out so.
    pub fn reshape(&self, to: &Shape) -> Option<View> {
        let new = to.dims();
        if self.numel() != to.numel() {
            return None;
        }
        if self.numel() == 0 || self.is_contiguous() {
            let mut v = View::contiguous(to);
            v.offset = self.offset;
            return Some(v);
        }
        // Drop size-1 dimensions of the source (their strides do not matter).
        let (od, os): (Vec<usize>, Vec<isize>) =
            self.dims.iter().zip(&self.strides).filter(|(d, _)| **d != 1).map(|(&d, &s)| (d, s)).unzip();
        let mut strides: SmallVec<[isize; 4]> = SmallVec::from_elem(0, new.len());
        let mut view_d = new.len() as isize - 1;
        let mut chunk_base = *os.last().unwrap_or(&1);
        let (mut tensor_numel, mut view_numel) = (1usize, 1usize);
        for td in (0..od.len()).rev() {
            tensor_numel *= od[td];
            let chunk_ends = td == 0 || os[td - 1] != tensor_numel as isize * chunk_base;
            if chunk_ends {
                while view_d >= 0 && (view_numel < tensor_numel || new[view_d as usize] == 1) {
                    strides[view_d as usize] = view_numel as isize * chunk_base;
                    view_numel *= new[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if td > 0 {
                    chunk_base = os[td - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        // Remaining leading dimensions of the target must all be 1.
        while view_d >= 0 {
            if new[view_d as usize] != 1 {
                return None;
            }
            strides[view_d as usize] = 1;
            view_d -= 1;
        }
        Some(View { dims: new.into(), strides, offset: self.offset })
    }

    /// Whether index `i` (row-major over `dims`) is element `offset + i` of the buffer.
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1isize;
        for (&d, &s) in self.dims.iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc *= d as isize;
        }
        true
    }

    /// The smallest and largest buffer offsets the view touches (`None` when it has no
    /// elements). A view whose offsets do not fit in an `isize` gives `(isize::MIN, isize::MAX)`,
    /// which lies within no buffer.
    pub fn extent(&self) -> Option<(isize, isize)> {
        if self.dims.contains(&0) {
            return None;
        }
        let unbounded = Some((isize::MIN, isize::MAX));
        let Ok(mut lo) = isize::try_from(self.offset) else { return unbounded };
        let mut hi = lo;
        for (&d, &s) in self.dims.iter().zip(&self.strides) {
            let span = isize::try_from(d - 1).ok().and_then(|d| d.checked_mul(s));
            let moved = span.and_then(|span| {
                if span < 0 { lo.checked_add(span).map(|l| lo = l) } else { hi.checked_add(span).map(|h| hi = h) }
            });
            if moved.is_none() {
                return unbounded;
            }
        }
        Some((lo, hi))
    }

    /// The buffer offset of multi-index `idx`.
    pub fn offset_of(&self, idx: &[usize]) -> isize {
        self.offset as isize + idx.iter().zip(&self.strides).map(|(&i, &s)| i as isize * s).sum::<isize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_extent_that_overflows_lies_within_no_buffer() {
        let v = View { dims: [3, 4].as_slice().into(), strides: [isize::MAX / 2, 1].as_slice().into(), offset: 0 };
        assert_eq!(v.extent(), Some((isize::MIN, isize::MAX)));
        let v = View { dims: [3].as_slice().into(), strides: [-2].as_slice().into(), offset: 4 };
        assert_eq!(v.extent(), Some((0, 4)));
    }

    /// Every element of `v` as a buffer offset, row-major.
    fn offsets(v: &View) -> Vec<isize> {
        let n = v.numel();
        (0..n)
            .map(|mut i| {
                let mut idx = vec![0; v.dims.len()];
                for d in (0..v.dims.len()).rev() {
                    idx[d] = i % v.dims[d];
                    i /= v.dims[d];
                }
                v.offset_of(&idx)
            })
            .collect()
    }

    #[test]
    fn movement_composes() {
        let v = View::contiguous(&Shape::from([2, 3, 4]));
        assert_eq!(offsets(&v.permute(&[2, 0, 1]))[..4], [0, 4, 8, 12]);
        assert_eq!(offsets(&v.narrow(1, 1, 2))[..4], [4, 5, 6, 7]);
        let b = View::broadcast(&Shape::from([3, 1]), &Shape::from([2, 3, 4]));
        assert_eq!(offsets(&b)[..6], [0, 0, 0, 0, 1, 1]);
    }

    #[test]
    fn reshape_needs_no_copy_only_when_the_layout_allows() {
        let v = View::contiguous(&Shape::from([4, 6]));
        let r = v.reshape(&Shape::from([2, 2, 6])).unwrap();
        assert_eq!(offsets(&r), offsets(&v));
        // A transpose cannot be flattened without a copy.
        let t = v.permute(&[1, 0]);
        assert!(t.reshape(&Shape::from([24])).is_none());
        // But splitting one of its dimensions can.
        let s = t.reshape(&Shape::from([2, 3, 4])).unwrap();
        assert_eq!(offsets(&s), offsets(&t));
        // Narrowed rows keep their row structure.
        let n = v.narrow(1, 0, 3);
        assert!(n.reshape(&Shape::from([12])).is_none());
        assert_eq!(offsets(&n.reshape(&Shape::from([4, 3, 1])).unwrap()), offsets(&n));
        // Size-1 dimensions anywhere.
        let one = View::contiguous(&Shape::from([1, 5, 1])).permute(&[2, 1, 0]);
        assert_eq!(offsets(&one.reshape(&Shape::from([5])).unwrap()), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn reshape_agrees_with_a_copy_on_random_views() {
        // Brute force: every reshape `reshape` accepts must visit the same offsets as the view.
        let shapes: &[&[usize]] = &[&[2, 3, 4], &[6, 4], &[24], &[4, 2, 3], &[2, 12], &[3, 8]];
        let base = View::contiguous(&Shape::from([2, 3, 4]));
        let views = vec![base.clone(), base.permute(&[0, 2, 1]), base.permute(&[2, 1, 0]), base.narrow(2, 1, 2)];
        for v in &views {
            for s in shapes {
                let to = Shape::new(s);
                if let Some(r) = v.reshape(&to) {
                    assert_eq!(offsets(&r), offsets(v), "{v:?} as {to}");
                }
            }
        }
    }
}
