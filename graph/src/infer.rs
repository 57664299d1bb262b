//! Shape and dtype inference with validation.
//!
//! Each function checks one op's operands and returns the result's shape and dtype, or a
//! sentence saying what is wrong. The caller (the public API) turns that sentence into a panic
//! at the user's line, adding the operands' devices; this module never panics on user input.

use crate::dtype::DType;
use crate::op::ReduceOp;
use crate::shape::Shape;
use crate::table::{BinaryOp, DTypeRule, UnaryOp};

pub type Inferred = Result<(Shape, DType), String>;

fn check_rule(rule: DTypeRule, name: &str, dtype: DType) -> Result<(), String> {
    match rule {
        DTypeRule::Float if !dtype.is_float() => {
            Err(format!("{name} needs a float dtype (f32, f64, f16, bf16), got {dtype}; convert with to_dtype"))
        }
        DTypeRule::Numeric if !dtype.is_numeric() => {
            Err(format!("{name} needs a numeric dtype, got bool; convert with to_dtype"))
        }
        _ => Ok(()),
    }
}

fn check_scalar(name: &str, dtype: DType, v: f64) -> Result<(), String> {
    if dtype.represents(v) { Ok(()) } else { Err(format!("{name}: the scalar {v} is not representable in {dtype}")) }
}

fn broadcast(name: &str, a: &Shape, b: &Shape) -> Result<Shape, String> {
    a.broadcast(b).ok_or_else(|| format!("{name}: shapes {a} and {b} do not broadcast"))
}

fn same_dtype(name: &str, a: DType, b: DType) -> Result<(), String> {
    if a == b { Ok(()) } else { Err(format!("{name}: dtypes {a} and {b} differ; convert one with to_dtype")) }
}

pub fn unary(op: UnaryOp, shape: &Shape, dtype: DType) -> Inferred {
    check_rule(op.def().dtypes, op.name(), dtype)?;
    Ok((shape.clone(), dtype))
}

pub fn binary(op: BinaryOp, a: (&Shape, DType), b: (&Shape, DType)) -> Inferred {
    let name = op.name();
    same_dtype(name, a.1, b.1)?;
    check_rule(op.def().dtypes, name, a.1)?;
    Ok((broadcast(name, a.0, b.0)?, a.1))
}

pub fn binary_scalar(op: BinaryOp, shape: &Shape, dtype: DType, scalar: f64) -> Inferred {
    check_rule(op.def().dtypes, op.name(), dtype)?;
    check_scalar(op.name(), dtype, scalar)?;
    Ok((shape.clone(), dtype))
}

pub fn compare(name: &str, a: (&Shape, DType), b: (&Shape, DType)) -> Inferred {
    same_dtype(name, a.1, b.1)?;
    Ok((broadcast(name, a.0, b.0)?, DType::Bool))
}

pub fn select(cond: (&Shape, DType), a: (&Shape, DType), b: (&Shape, DType)) -> Inferred {
    if cond.1 != DType::Bool {
        return Err(format!("select: the condition must be bool, got {}", cond.1));
    }
    same_dtype("select", a.1, b.1)?;
    let ab = broadcast("select", a.0, b.0)?;
    Ok((broadcast("select", cond.0, &ab)?, a.1))
}

/// Misuse unless `dtype` is one an index kernel reads: i64, or i32 (the only one on devices
/// without i64, such as wgpu).
fn check_index(op: &str, dtype: DType) -> Result<(), String> {
    match dtype {
        DType::I64 | DType::I32 => Ok(()),
        d => Err(format!("{op}: the index must be i64 or i32, got {d}")),
    }
}

/// A gather along `dim` of `src` at `index` (see [`Op::Gather`](crate::Op::Gather)).
pub fn gather(src: (&Shape, DType), index: (&Shape, DType), dim: usize) -> Inferred {
    check_index("gather", index.1)?;
    let (s, i) = (src.0.dims(), index.0.dims());
    if dim >= s.len() || s.len() != i.len() || (0..s.len()).any(|d| d != dim && s[d] != i[d]) {
        return Err(format!(
            "gather: the index ({}) must have the source's shape ({}) but along dimension {dim}",
            index.0, src.0
        ));
    }
    Ok((index.0.clone(), src.1))
}

/// An index selection along `dim` of `src` at `index` (see
/// [`Op::IndexSelect`](crate::Op::IndexSelect)).
pub fn index_select(src: (&Shape, DType), index: (&Shape, DType), dim: usize) -> Inferred {
    check_index("index_select", index.1)?;
    let s = src.0.dims();
    if dim >= s.len() {
        return Err(format!("index_select: dimension {dim} of a source of shape {}", src.0));
    }
    let dims: Vec<usize> = s[..dim].iter().chain(index.0.dims()).chain(&s[dim + 1..]).copied().collect();
    Ok((Shape::new(&dims), src.1))
}

/// A scatter-add along `dim` of `src` at `index` into `base` (see
/// [`Op::ScatterAdd`](crate::Op::ScatterAdd)).
pub fn scatter_add(base: (&Shape, DType), index: (&Shape, DType), src: (&Shape, DType), dim: usize) -> Inferred {
    check_index("scatter_add", index.1)?;
    same_dtype("scatter_add", base.1, src.1)?;
    check_rule(DTypeRule::Numeric, "scatter_add", base.1)?;
    if matches!(base.1, DType::F16 | DType::BF16) {
        return Err(format!("scatter_add: {} sums run in f32; convert with to_dtype", base.1));
    }
    scatter_shapes("scatter_add", base.0, index.0, src.0, dim)?;
    Ok((base.0.clone(), base.1))
}

/// `base.scatter(dim, index, src)` ([`Op::Scatter`](crate::Op::Scatter)): any dtype, the
/// source's the base's.
pub fn scatter(base: (&Shape, DType), index: (&Shape, DType), src: (&Shape, DType), dim: usize) -> Inferred {
    check_index("scatter", index.1)?;
    same_dtype("scatter", base.1, src.1)?;
    scatter_shapes("scatter", base.0, index.0, src.0, dim)?;
    Ok((base.0.clone(), base.1))
}

/// The index and source of one shape, the base's but along `dim`.
fn scatter_shapes(op: &str, base: &Shape, index: &Shape, src: &Shape, dim: usize) -> Result<(), String> {
    let (b, i) = (base.dims(), index.dims());
    let fits = dim < b.len() && index == src && b.len() == i.len() && (0..b.len()).all(|d| d == dim || b[d] == i[d]);
    if fits {
        return Ok(());
    }
    Err(format!(
        "{op}: the index ({index}) and source ({src}) must have one shape, the base's ({base}) but along dimension {dim}"
    ))
}

pub fn clamp(shape: &Shape, dtype: DType, lo: f64, hi: f64) -> Inferred {
    check_rule(DTypeRule::Numeric, "clamp", dtype)?;
    check_scalar("clamp", dtype, lo)?;
    check_scalar("clamp", dtype, hi)?;
    if lo > hi || lo.is_nan() || hi.is_nan() {
        return Err(format!("clamp: lo ({lo}) must not exceed hi ({hi})"));
    }
    Ok((shape.clone(), dtype))
}

pub fn reduce(op: ReduceOp, shape: &Shape, dtype: DType, dim: Option<usize>, keepdim: bool) -> Inferred {
    let name = op.name();
    let rule = if op == ReduceOp::Mean { DTypeRule::Float } else { DTypeRule::Numeric };
    check_rule(rule, name, dtype)?;
    let out_dtype = if op == ReduceOp::ArgMax { DType::I64 } else { dtype };
    match dim {
        None => {
            if shape.numel() == 0 && matches!(op, ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax) {
                return Err(format!("{name}: cannot reduce an empty tensor of shape {shape}"));
            }
            Ok((Shape::scalar(), out_dtype))
        }
        Some(d) => {
            if d >= shape.rank() {
                return Err(format!("{name}: dimension {d} out of range for shape {shape} (rank {})", shape.rank()));
            }
            if shape.dims()[d] == 0 && matches!(op, ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax) {
                return Err(format!("{name}: cannot reduce the empty dimension {d} of shape {shape}"));
            }
            Ok((shape.reduced(d, keepdim), out_dtype))
        }
    }
}

/// An argmax along `dim` (or over everything) whose positions are `index` (i64, or i32 on
/// request: the dtype a device without i64 can hold), as [`reduce`] otherwise. An i32 result
/// needs the positions to fit in it.
pub fn argmax(shape: &Shape, dtype: DType, dim: Option<usize>, keepdim: bool, index: DType) -> Inferred {
    check_index("argmax", index)?;
    let (out, _) = reduce(ReduceOp::ArgMax, shape, dtype, dim, keepdim)?;
    let positions = dim.map_or(shape.numel(), |d| shape.dims()[d]);
    if index == DType::I32 && positions > i32::MAX as usize {
        return Err(format!("argmax: {positions} positions do not fit in i32; ask for i64"));
    }
    Ok((out, index))
}

pub fn matmul(a: (&Shape, DType), b: (&Shape, DType)) -> Inferred {
    same_dtype("matmul", a.1, b.1)?;
    check_rule(DTypeRule::Numeric, "matmul", a.1)?;
    let (sa, sb) = (a.0.dims(), b.0.dims());
    if sa.len() < 2 || sb.len() < 2 {
        return Err(format!("matmul: both operands need at least 2 dimensions, got {} and {}", a.0, b.0));
    }
    let (m, k) = (sa[sa.len() - 2], sa[sa.len() - 1]);
    let (k2, n) = (sb[sb.len() - 2], sb[sb.len() - 1]);
    if k != k2 {
        return Err(format!(
            "matmul: inner sizes {k} and {k2} differ (the lhs {} has {k} columns, the rhs {} has {k2} rows)",
            a.0, b.0
        ));
    }
    let batch_a = Shape::new(&sa[..sa.len() - 2]);
    let batch_b = Shape::new(&sb[..sb.len() - 2]);
    let batch = batch_a
        .broadcast(&batch_b)
        .ok_or_else(|| format!("matmul: batch dimensions of {} and {} do not broadcast", a.0, b.0))?;
    let mut dims = batch.dims().to_vec();
    dims.extend([m, n]);
    Ok((Shape::from(dims), a.1))
}

/// A product of `x [m, k]` (a float dtype other than f64) and a quantized weight of `layout`,
/// held as `weight` (a `U8` value of the layout's bytes): `[m, n]` of x's dtype.
pub fn quant_matmul(x: (&Shape, DType), weight: (&Shape, DType), layout: &crate::quant::QuantLayout) -> Inferred {
    if !matches!(x.1, DType::F32 | DType::F16 | DType::BF16) {
        return Err(format!("a quantized product takes f32, f16 or bf16 inputs, not {}", x.1));
    }
    let dx = x.0.dims();
    if dx.len() != 2 || dx[1] != layout.k {
        return Err(format!(
            "a quantized product of [{}, {}] weights takes [m, {}] inputs, not {}",
            layout.k, layout.n, layout.k, x.0
        ));
    }
    if weight.1 != DType::U8 || weight.0.dims() != [layout.bytes()] {
        return Err(format!(
            "a quantized {layout} weight is {} bytes, not {} of {}",
            layout.bytes(),
            weight.0,
            weight.1
        ));
    }
    Ok((Shape::from([dx[0], layout.n]), x.1))
}

/// Quantizing a float `[k, n]` weight to `layout`: a `U8` value of the layout's bytes.
pub fn quantize(w: (&Shape, DType), layout: &crate::quant::QuantLayout) -> Inferred {
    if !matches!(w.1, DType::F32 | DType::F16 | DType::BF16) {
        return Err(format!("quantizes f32, f16 or bf16 weights, not {}", w.1));
    }
    if w.0.dims() != [layout.k, layout.n] {
        return Err(format!("a {layout} quantization of a {} weight", w.0));
    }
    Ok((Shape::from([layout.bytes()]), DType::U8))
}

/// The dtype of attention's row statistics (the log-sum-exp and `rowsum(d_out * out)`): f64 for
/// f64 inputs, f32 for the others (f16 and bf16 compute in f32).
pub fn attention_stats(dtype: DType) -> DType {
    if dtype == DType::F64 { DType::F64 } else { DType::F32 }
}

/// Scaled dot-product attention's forward operands: `q [.., sq, d]`, `k` and `v` `[.., sk, d]`
/// with the same leading dimensions and float dtype; the result is the output's shape and dtype.
pub fn attention(q: (&Shape, DType), k: (&Shape, DType), v: (&Shape, DType)) -> Inferred {
    let name = "scaled_dot_product_attention";
    same_dtype(name, q.1, k.1)?;
    same_dtype(name, q.1, v.1)?;
    check_rule(DTypeRule::Float, name, q.1)?;
    let (dq, dk, dv) = (q.0.dims(), k.0.dims(), v.0.dims());
    if dq.len() < 2 || dk.len() != dq.len() || dv.len() != dq.len() {
        return Err(format!(
            "{name}: q, k and v need the same rank of at least 2 ([.., seq, head_dim]), got {}, {} and {}",
            q.0, k.0, v.0
        ));
    }
    let r = dq.len();
    if dq[..r - 2] != dk[..r - 2] || dq[..r - 2] != dv[..r - 2] {
        return Err(format!("{name}: q, k and v need the same leading dimensions, got {}, {} and {}", q.0, k.0, v.0));
    }
    if dk != dv {
        return Err(format!("{name}: k and v need the same shape [.., seq, head_dim], got {} and {}", k.0, v.0));
    }
    if dq[r - 1] != dk[r - 1] {
        return Err(format!("{name}: q and k need the same head dimension, got {} and {}", q.0, k.0));
    }
    if dq[r - 1] == 0 || dk[r - 2] == 0 {
        return Err(format!("{name}: needs a head dimension and at least one key, got q {} and k {}", q.0, k.0));
    }
    Ok((q.0.clone(), q.1))
}

/// The shape and dtype of attention part `part` given its inputs' (see
/// [`AttentionPart`](crate::AttentionPart) for what each part reads).
pub fn attention_part(part: crate::AttentionPart, ins: &[(&Shape, DType)]) -> Inferred {
    use crate::AttentionPart::*;
    let want = if part.is_backward() { 6 } else { 3 };
    if ins.len() != want {
        return Err(format!("{}: expected {want} inputs, got {}", part.name(), ins.len()));
    }
    let (out, dtype) = attention(ins[0], ins[1], ins[2])?;
    let stats = attention_stats(dtype);
    let rows = Shape::new(&out.dims()[..out.rank() - 1]);
    if part.is_backward() {
        if ins[3] != (&out, dtype) {
            return Err(format!("{}: d_out must be {out} {dtype}, got {} {}", part.name(), ins[3].0, ins[3].1));
        }
        for (what, x) in [("lse", ins[4]), ("delta", ins[5])] {
            if x != (&rows, stats) {
                return Err(format!("{}: {what} must be {rows} {stats}, got {} {}", part.name(), x.0, x.1));
            }
        }
    }
    Ok(match part {
        Out | GradQ => (out, dtype),
        Lse => (rows, stats),
        GradK | GradV => (ins[1].0.clone(), dtype),
    })
}

pub fn reshape(shape: &Shape, to: &Shape) -> Result<Shape, String> {
    if shape.numel() != to.numel() {
        return Err(format!(
            "reshape: cannot reshape {shape} ({} elements) to {to} ({} elements)",
            shape.numel(),
            to.numel()
        ));
    }
    Ok(to.clone())
}

pub fn permute(shape: &Shape, perm: &[usize]) -> Result<Shape, String> {
    let mut seen = vec![false; shape.rank()];
    if perm.len() != shape.rank() || perm.iter().any(|&p| p >= shape.rank() || std::mem::replace(&mut seen[p], true)) {
        return Err(format!("permute: {perm:?} is not a permutation of the {} dimensions of {shape}", shape.rank()));
    }
    Ok(Shape::from(perm.iter().map(|&p| shape.dims()[p]).collect::<Vec<_>>()))
}

pub fn expand(shape: &Shape, to: &Shape) -> Result<Shape, String> {
    if !shape.broadcasts_to(to) {
        return Err(format!("expand: {shape} does not broadcast to {to}"));
    }
    Ok(to.clone())
}

pub fn narrow(shape: &Shape, dim: usize, start: usize, len: usize) -> Result<Shape, String> {
    if dim >= shape.rank() {
        return Err(format!("narrow: dimension {dim} out of range for shape {shape}"));
    }
    let size = shape.dims()[dim];
    if start.checked_add(len).is_none_or(|end| end > size) {
        return Err(format!(
            "narrow: range {start}..{} exceeds size {size} of dimension {dim} of {shape}",
            start.saturating_add(len)
        ));
    }
    let mut d = shape.dims().to_vec();
    d[dim] = len;
    Ok(Shape::from(d))
}

pub fn cat(parts: &[(&Shape, DType)], dim: usize) -> Inferred {
    let Some(&(first, dtype)) = parts.first() else {
        return Err("cat: needs at least one tensor".into());
    };
    if dim >= first.rank() {
        return Err(format!("cat: dimension {dim} out of range for shape {first}"));
    }
    let mut total = 0;
    for (i, &(s, d)) in parts.iter().enumerate() {
        same_dtype("cat", dtype, d)?;
        let compatible = s.rank() == first.rank()
            && s.dims().iter().zip(first.dims()).enumerate().all(|(j, (a, b))| j == dim || a == b);
        if !compatible {
            return Err(format!("cat: tensor {i} has shape {s}, which does not match {first} outside dimension {dim}"));
        }
        total += s.dims()[dim];
    }
    let mut d = first.dims().to_vec();
    d[dim] = total;
    Ok((Shape::from(d), dtype))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_problem() {
        let e = binary(BinaryOp::Add, (&Shape::from([2, 3]), DType::F32), (&Shape::from([4]), DType::F32)).unwrap_err();
        assert!(e.contains("[2, 3]") && e.contains("[4]"), "{e}");
        let e = binary(BinaryOp::Add, (&Shape::from([2]), DType::F32), (&Shape::from([2]), DType::I32)).unwrap_err();
        assert!(e.contains("f32") && e.contains("i32"), "{e}");
        let e = unary(UnaryOp::Exp, &Shape::from([2]), DType::I64).unwrap_err();
        assert!(e.contains("float"), "{e}");
        assert!(matmul((&Shape::from([2, 3]), DType::F32), (&Shape::from([4, 5]), DType::F32)).is_err());
        assert!(permute(&Shape::from([2, 3]), &[0, 0]).is_err());
        assert!(narrow(&Shape::from([2, 3]), 1, 2, 2).is_err());
    }

    #[test]
    fn matmul_broadcasts_batches() {
        let (s, _) = matmul((&Shape::from([5, 1, 2, 3]), DType::F32), (&Shape::from([4, 3, 7]), DType::F32)).unwrap();
        assert_eq!(s, Shape::from([5, 4, 2, 7]));
    }

    #[test]
    fn cat_sums_the_dimension() {
        let (s, _) = cat(&[(&Shape::from([2, 3]), DType::F32), (&Shape::from([2, 5]), DType::F32)], 1).unwrap();
        assert_eq!(s, Shape::from([2, 8]));
    }
}
