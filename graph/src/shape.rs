//! Shapes: dimension lists, element counts, contiguous strides and NumPy broadcasting.
//!
//! Pure arithmetic on dimension lists; it never looks at data.

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::fmt;

/// The dimensions of a tensor. `()` is a scalar (rank 0, one element).
#[derive(PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Shape(SmallVec<[usize; 4]>);

// By hand: `SmallVec`'s own `clone` pushes element by element through its generic `extend`
// (about a hundred instructions for a short shape, and every recorded op clones a few).
impl Clone for Shape {
    fn clone(&self) -> Shape {
        Shape::new(&self.0)
    }
}

impl Shape {
    pub fn new(dims: &[usize]) -> Shape {
        // Up to four dimensions are stored inline, copied as one array (`from_slice` calls
        // `memcpy` for any length, a scalar's zero included).
        let inline = match *dims {
            [] => [0; 4],
            [a] => [a, 0, 0, 0],
            [a, b] => [a, b, 0, 0],
            [a, b, c] => [a, b, c, 0],
            [a, b, c, d] => [a, b, c, d],
            _ => return Shape(SmallVec::from_slice(dims)),
        };
        Shape(SmallVec::from_buf_and_len(inline, dims.len()))
    }

    pub fn scalar() -> Shape {
        Shape(SmallVec::new())
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar). Saturates at `usize::MAX` for shapes too large to
    /// exist (which recording rejects).
    pub fn numel(&self) -> usize {
        if self.0.contains(&0) {
            return 0;
        }
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).unwrap_or(usize::MAX)
    }

    /// Row-major strides, in elements, of a contiguous tensor of this shape.
    pub fn contiguous_strides(&self) -> SmallVec<[isize; 4]> {
        let mut strides: SmallVec<[isize; 4]> = SmallVec::from_elem(0, self.rank());
        let mut acc = 1isize;
        for (s, &d) in strides.iter_mut().zip(self.0.iter()).rev() {
            *s = acc;
            acc *= d as isize;
        }
        strides
    }

    /// NumPy broadcasting of two shapes (dimensions aligned from the right; a dimension of 1
    /// stretches). `None` when they are incompatible.
    pub fn broadcast(&self, other: &Shape) -> Option<Shape> {
        let rank = self.rank().max(other.rank());
        let mut out: SmallVec<[usize; 4]> = SmallVec::from_elem(0, rank);
        for i in 0..rank {
            let a = dim_from_right(self, rank - 1 - i);
            let b = dim_from_right(other, rank - 1 - i);
            out[i] = match (a, b) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => return None,
            };
        }
        Some(Shape(out))
    }

    /// Whether this shape broadcasts to `target` without `target` changing.
    pub fn broadcasts_to(&self, target: &Shape) -> bool {
        self.broadcast(target).as_ref() == Some(target)
    }

    /// The shape with dimension `dim` removed (or set to 1 when `keepdim`).
    pub fn reduced(&self, dim: usize, keepdim: bool) -> Shape {
        let mut d = self.0.clone();
        if keepdim {
            d[dim] = 1;
        } else {
            d.remove(dim);
        }
        Shape(d)
    }
}

/// Dimension `i` counted from the right, padding with 1 on the left.
fn dim_from_right(s: &Shape, i: usize) -> usize {
    if i < s.rank() { s.0[s.rank() - 1 - i] } else { 1 }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.dims())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.dims())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Shape {
        Shape::new(&d)
    }
}

impl<const N: usize> From<&[usize; N]> for Shape {
    fn from(d: &[usize; N]) -> Shape {
        Shape::new(d)
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Shape {
        Shape::new(d)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Shape {
        Shape(SmallVec::from_vec(d))
    }
}

impl From<&Vec<usize>> for Shape {
    fn from(d: &Vec<usize>) -> Shape {
        Shape::new(d)
    }
}

impl From<()> for Shape {
    fn from(_: ()) -> Shape {
        Shape::scalar()
    }
}

impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Shape {
        s.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        let b = |a: &[usize], b: &[usize]| Shape::new(a).broadcast(&Shape::new(b));
        assert_eq!(b(&[2, 3], &[3]), Some(Shape::new(&[2, 3])));
        assert_eq!(b(&[4, 1, 3], &[5, 1]), Some(Shape::new(&[4, 5, 3])));
        assert_eq!(b(&[], &[2]), Some(Shape::new(&[2])));
        assert_eq!(b(&[2, 3], &[2]), None);
        assert_eq!(b(&[0, 3], &[1, 3]), Some(Shape::new(&[0, 3])));
    }

    #[test]
    fn strides_and_counts() {
        let s = Shape::from([2, 3, 4]);
        assert_eq!(s.numel(), 24);
        assert_eq!(s.contiguous_strides().as_slice(), &[12, 4, 1]);
        assert_eq!(Shape::from(()).numel(), 1);
        assert_eq!(s.reduced(1, false), Shape::from([2, 4]));
        assert_eq!(s.reduced(1, true), Shape::from([2, 1, 4]));
    }
}
