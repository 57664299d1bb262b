//! Dimension arguments: every method that takes a dimension accepts a `usize` or a signed
//! integer, where `-1` is the last dimension, `-2` the one before, and so on (as in PyTorch and
//! NumPy). Out of range is misuse, reported at the caller's line.

/// A dimension index: `usize`, or a signed integer counting from the end when negative.
pub trait Dim: Copy {
    /// The dimension of a tensor of rank `rank` this names (`extra` allows one past the last,
    /// for `unsqueeze`), or `None` when out of range.
    fn resolve(self, rank: usize, extra: bool) -> Option<usize>;
    /// The index as written, for messages.
    fn written(self) -> i128;
}

macro_rules! unsigned_dim {
    ($($t:ty),*) => {$(
        impl Dim for $t {
            fn resolve(self, rank: usize, extra: bool) -> Option<usize> {
                let d = usize::try_from(self).ok()?;
                (d < rank + usize::from(extra)).then_some(d)
            }
            fn written(self) -> i128 {
                self as i128
            }
        }
    )*};
}

macro_rules! signed_dim {
    ($($t:ty),*) => {$(
        impl Dim for $t {
            fn resolve(self, rank: usize, extra: bool) -> Option<usize> {
                let n = (rank + usize::from(extra)) as i128;
                let d = self as i128;
                let d = if d < 0 { d + n } else { d };
                (0..n).contains(&d).then_some(d as usize)
            }
            fn written(self) -> i128 {
                self as i128
            }
        }
    )*};
}

unsigned_dim!(usize, u32, u64);
signed_dim!(i32, i64, isize);

#[cfg(test)]
mod tests {
    use super::Dim;

    #[test]
    fn negative_dimensions_count_from_the_end() {
        assert_eq!((-1i32).resolve(3, false), Some(2));
        assert_eq!((-3i64).resolve(3, false), Some(0));
        assert_eq!((-4i32).resolve(3, false), None);
        assert_eq!(3usize.resolve(3, false), None);
        assert_eq!(3usize.resolve(3, true), Some(3));
        assert_eq!((-1i32).resolve(3, true), Some(3));
        assert_eq!(0usize.resolve(0, false), None);
    }
}
