//! Printing tensors: `Display` reads the values (it flushes what they need) and prints them
//! PyTorch-style, nested brackets per dimension, summarised with `...` beyond 1,000 elements;
//! `Debug` prints the shape, dtype and device only and never flushes.

use super::Tensor;
use braid_graph::DType;
use half::{bf16, f16};
use std::fmt;

/// Beyond this many elements, each dimension shows its first and last `EDGE` entries.
const SUMMARISE_ABOVE: usize = 1000;
const EDGE: usize = 3;

/// The values of a tensor as the printer formats them.
enum Values {
    Float(Vec<f64>),
    Int(Vec<i64>),
    Bool(Vec<bool>),
}

impl Values {
    fn read(t: &Tensor) -> crate::Result<Values> {
        let floats = |v: Vec<f64>| Values::Float(v);
        Ok(match t.dtype() {
            DType::F32 => floats(t.to_vec::<f32>()?.into_iter().map(f64::from).collect()),
            DType::F64 => floats(t.to_vec::<f64>()?),
            DType::F16 => floats(t.to_vec::<f16>()?.into_iter().map(f64::from).collect()),
            DType::BF16 => floats(t.to_vec::<bf16>()?.into_iter().map(f64::from).collect()),
            DType::I32 => Values::Int(t.to_vec::<i32>()?.into_iter().map(i64::from).collect()),
            DType::I64 => Values::Int(t.to_vec::<i64>()?),
            DType::U8 => Values::Int(t.to_vec::<u8>()?.into_iter().map(i64::from).collect()),
            DType::Bool => Values::Bool(t.to_vec::<bool>()?),
        })
    }

    /// Every element formatted, padded to one width.
    fn formatted(&self) -> Vec<String> {
        let cells: Vec<String> = match self {
            Values::Int(v) => v.iter().map(i64::to_string).collect(),
            Values::Bool(v) => v.iter().map(bool::to_string).collect(),
            Values::Float(v) => {
                let finite = || v.iter().copied().filter(|x| x.is_finite() && *x != 0.0).map(f64::abs);
                let (lo, hi) = (finite().fold(f64::INFINITY, f64::min), finite().fold(0.0, f64::max));
                let scientific = hi >= 1e8 || (lo < 1e-4 && lo.is_finite());
                v.iter()
                    .map(|x| match x {
                        x if x.is_nan() => "nan".to_string(),
                        x if x.is_infinite() => if *x > 0.0 { "inf" } else { "-inf" }.to_string(),
                        x if scientific => format!("{x:.4e}"),
                        x => format!("{x:.4}"),
                    })
                    .collect()
            }
        };
        let width = cells.iter().map(String::len).max().unwrap_or(0);
        cells.into_iter().map(|c| format!("{c:>width$}")).collect()
    }
}

/// Writes the nested brackets of `dims` over `cells` (row-major), starting at element `offset`,
/// indented by `indent` columns.
fn nested(out: &mut String, cells: &[String], dims: &[usize], offset: usize, indent: usize, summarise: bool) {
    let Some((&n, inner)) = dims.split_first() else {
        out.push_str(&cells[offset]);
        return;
    };
    let stride: usize = inner.iter().product();
    let shown: Vec<Option<usize>> = if summarise && n > 2 * EDGE {
        (0..EDGE).map(Some).chain([None]).chain((n - EDGE..n).map(Some)).collect()
    } else {
        (0..n).map(Some).collect()
    };
    out.push('[');
    for (k, i) in shown.iter().enumerate() {
        if k > 0 {
            out.push(',');
            if inner.is_empty() {
                out.push(' ');
            } else {
                out.push_str(&"\n".repeat(inner.len()));
                out.push_str(&" ".repeat(indent + 1));
            }
        }
        match i {
            Some(i) => nested(out, cells, inner, offset + i * stride, indent + 1, summarise),
            None => out.push_str("..."),
        }
    }
    out.push(']');
}

impl fmt::Display for Tensor {
    /// `tensor([[1.0000, 2.0000], [3.0000, 4.0000]], shape=[2, 2], dtype=f32, device=cpu)`
    /// (one row per line). Reads the values: this flushes what they need; a failure is printed
    /// in their place.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tail = format!("shape={}, dtype={}, device={}", self.shape(), self.dtype(), self.device());
        let values = match Values::read(self) {
            Ok(v) => v,
            Err(e) => return write!(f, "tensor(<not computed: {e}>, {tail})"),
        };
        let cells = values.formatted();
        let mut body = String::new();
        if self.numel() == 0 {
            // No values: `[]` whatever the rank (the shape says which empty tensor), as
            // PyTorch prints it; nested brackets would read as another shape.
            body.push_str("[]");
        } else {
            nested(&mut body, &cells, self.dims(), 0, "tensor(".len(), self.numel() > SUMMARISE_ABOVE);
        }
        write!(f, "tensor({body}, {tail})")
    }
}

#[cfg(test)]
mod tests {
    use crate::prelude::*;

    #[test]
    fn small_tensors_print_every_value_and_large_ones_are_summarised() {
        let dev = Device::new_cpu();
        let tail = |shape: &str, dtype: &str| format!("shape={shape}, dtype={dtype}, device={}", dev.name());
        let t = Tensor::from_vec(vec![1.0f32, -2.5, 3.0, 4.25], [2, 2], &dev);
        let want = format!("tensor([[ 1.0000, -2.5000],\n        [ 3.0000,  4.2500]], {})", tail("[2, 2]", "f32"));
        assert_eq!(t.to_string(), want);
        let i = Tensor::from_vec(vec![3i64, -10, 7], [3], &dev);
        assert_eq!(i.to_string(), format!("tensor([  3, -10,   7], {})", tail("[3]", "i64")));
        let s = Tensor::from_vec(vec![true], (), &dev);
        assert_eq!(s.to_string(), format!("tensor(true, {})", tail("[]", "bool")));
        let big = Tensor::arange(0, 2000, &dev).reshape([2, 1000]);
        let want = format!(
            "tensor([[   0,    1,    2, ...,  997,  998,  999],\n        [1000, 1001, 1002, ..., 1997, 1998, 1999]], {})",
            tail("[2, 1000]", "i64")
        );
        assert_eq!(big.to_string(), want);
        let tiny = Tensor::from_vec(vec![1e-6f64, 1.0, f64::NAN], [3], &dev);
        assert_eq!(tiny.to_string(), format!("tensor([1.0000e-6,  1.0000e0,       nan], {})", tail("[3]", "f64")));
        // An empty tensor of any rank prints `[]`; the shape says which.
        let empty = Tensor::zeros([2, 0, 3], DType::F32, &dev);
        assert_eq!(empty.to_string(), format!("tensor([], {})", tail("[2, 0, 3]", "f32")));
        // Debug never flushes.
        let pending = &t * 2.0;
        let before = dev.kernels_launched();
        assert_eq!(format!("{pending:?}"), format!("Tensor([2, 2] f32 on {})", dev.name()));
        assert_eq!(dev.kernels_launched(), before);
    }
}
