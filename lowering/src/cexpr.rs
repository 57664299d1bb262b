//! Printing of expressions, constants, casts and view offsets as C, shared by the CUDA C
//! printer ([`crate::cuda`]) and the host C printer ([`crate::host_c`]). Both print the same
//! semantics (the CPU evaluator's, see their module docs); [`Dialect`] names the few functions
//! that differ. This module prints expressions only; entry points, loops and launches are each
//! printer's own.

use crate::kernel::{Load, Store, View, check_access};
use braid_graph::DType;
use braid_graph::expr::{Distribution, Expr, ExprOp, PrimBinary, PrimCmp, PrimUnary};
use std::fmt::Write;

/// Which C the expressions are printed for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dialect {
    /// CUDA C for NVRTC: CUDA's math functions.
    Cuda,
    /// C99 for the host's compiler: f32 `exp` and `tanh` are braid's own polynomials
    /// (`braid_expf`, `braid_tanhf`, as the CPU evaluator computes them), square roots and
    /// absolute values are compiler built-ins (one instruction), the rest libm calls.
    Host,
}

/// Checks what every target checks ([`check_access`]), and what printing needs on top: stores
/// go to output arguments, every view walks the loop's dims, and the expression is in
/// topological order. `arg(i)` gives argument `i`'s dtype, length in elements, and whether it
/// may be written.
pub(crate) fn check_printable(
    loads: &[Load],
    stores: &[Store],
    expr: &Expr,
    dims: &[usize],
    arg: impl Fn(u16) -> Option<(DType, usize, bool)>,
) -> Result<(), String> {
    check_access(loads, stores, expr, |a| arg(a).map(|(d, len, _)| (d, len)))?;
    if let Some(s) = stores.iter().find(|s| arg(s.arg).is_some_and(|(_, _, writable)| !writable)) {
        return Err(format!("store of {} to argument {}, an input", s.dtype, s.arg));
    }
    for view in loads.iter().map(|l| &l.view).chain(stores.iter().map(|s| &s.view)) {
        if view.dims.as_slice() != dims || view.strides.len() != dims.len() {
            return Err(format!("view {view:?} over a loop of dims {dims:?}"));
        }
    }
    for (i, n) in expr.nodes.iter().enumerate() {
        if n.op.operands().iter().any(|&o| o >= i) {
            return Err(format!("node {i} ({:?}) reads a node that does not precede it", n.op));
        }
    }
    Ok(())
}

/// The C type of a register (compute dtype).
pub(crate) fn ctype(d: DType) -> &'static str {
    match d {
        DType::F32 | DType::F16 | DType::BF16 => "float",
        DType::F64 => "double",
        DType::I32 => "int",
        DType::I64 => "long long",
        DType::U8 => "unsigned char",
        DType::Bool => "bool",
    }
}

/// The C type of a buffer element (bools are bytes: any nonzero byte reads as true).
pub fn storage_ctype(d: DType) -> &'static str {
    match d {
        DType::F16 => "__half",
        DType::BF16 => "__nv_bfloat16",
        DType::Bool => "unsigned char",
        d => ctype(d),
    }
}

/// A float constant of compute dtype `d` (F32 or F64) that parses back to the same bits: plain
/// decimals for integers (exact), hexadecimal floats otherwise, bit casts for NaN and infinity.
pub(crate) fn float_literal(v: f64, d: DType) -> String {
    let sign = if v.is_sign_negative() { "-" } else { "" };
    if d == DType::F64 {
        if !v.is_finite() {
            return format!("{sign}__longlong_as_double(0x{:016x}LL)", v.to_bits() & !(1 << 63));
        }
        if v.fract() == 0.0 && v.abs() < 2f64.powi(53) { format!("{v:?}") } else { hex_float(v) }
    } else {
        let f = v as f32;
        if !f.is_finite() {
            return format!("{sign}__int_as_float(0x{:08x})", f.to_bits() & !(1 << 31));
        }
        if f.fract() == 0.0 && f.abs() < 2f32.powi(24) {
            format!("{f:?}f")
        } else {
            format!("{}f", hex_float(f as f64))
        }
    }
}

/// `v` (finite) as a C99/C++17 hexadecimal floating literal.
pub(crate) fn hex_float(v: f64) -> String {
    let bits = v.to_bits();
    let sign = if v.is_sign_negative() { "-" } else { "" };
    let exp = ((bits >> 52) & 0x7ff) as i64;
    let (mut frac, mut digits) = (bits & ((1 << 52) - 1), 13);
    if exp == 0 && frac == 0 {
        return format!("{sign}0x0p+0");
    }
    let (lead, e) = if exp == 0 { (0, -1022) } else { (1, exp - 1023) };
    while digits > 0 && frac & 0xf == 0 {
        frac >>= 4;
        digits -= 1;
    }
    if digits == 0 { format!("{sign}0x{lead}p{e:+}") } else { format!("{sign}0x{lead}.{frac:0digits$x}p{e:+}") }
}

/// An integer constant as a register of dtype `d` holds it (wrapped as the CPU does).
pub(crate) fn int_literal(v: i64, d: DType) -> String {
    match d {
        DType::I32 if v as i32 == i32::MIN => "(-2147483647 - 1)".into(),
        DType::I32 => (v as i32).to_string(),
        DType::I64 if v == i64::MIN => "(-9223372036854775807LL - 1)".into(),
        DType::I64 => format!("{v}LL"),
        DType::U8 => (v as u8).to_string(),
        _ => (v != 0).to_string(),
    }
}

/// `a op b` in dtype `d`, with the CPU's semantics (integers wrap; `x / 0 == 0`).
pub(crate) fn binary(op: PrimBinary, d: DType, a: &str, b: &str) -> Result<String, String> {
    let f = if d == DType::F32 { "f" } else { "" };
    let (t, u) = match d {
        DType::F32 | DType::F64 => {
            return Ok(match op {
                PrimBinary::Add => format!("{a} + {b}"),
                PrimBinary::Sub => format!("{a} - {b}"),
                PrimBinary::Mul => format!("{a} * {b}"),
                PrimBinary::Div => format!("{a} / {b}"),
                PrimBinary::Pow => format!("pow{f}({a}, {b})"),
                PrimBinary::Max => format!("({a} > {b} || isnan({a})) ? {a} : {b}"),
                PrimBinary::Min => format!("({a} < {b} || isnan({a})) ? {a} : {b}"),
            });
        }
        DType::I32 => ("int", "unsigned"),
        DType::I64 => ("long long", "unsigned long long"),
        // u8 arithmetic happens in int (no overflow) and wraps when narrowed.
        DType::U8 => ("unsigned char", "int"),
        DType::F16 | DType::BF16 | DType::Bool => return Err(format!("{op:?} on {d}")),
    };
    let wrap = |sym: &str| format!("({t})(({u}){a} {sym} ({u}){b})");
    Ok(match op {
        PrimBinary::Add => wrap("+"),
        PrimBinary::Sub => wrap("-"),
        PrimBinary::Mul => wrap("*"),
        PrimBinary::Div if d == DType::U8 => format!("{b} == 0 ? 0 : {a} / {b}"),
        // INT_MIN / -1 overflows (and traps on x86): it wraps to INT_MIN, the negation.
        PrimBinary::Div => format!("{b} == 0 ? 0 : {b} == -1 ? ({t})(({u})0 - ({u}){a}) : {a} / {b}"),
        PrimBinary::Max => format!("{a} > {b} ? {a} : {b}"),
        PrimBinary::Min => format!("{a} < {b} ? {a} : {b}"),
        PrimBinary::Pow => return Err("pow has no integer form".into()),
    })
}

/// `x` (a register of dtype `from`) cast to `to` with braid's cast semantics.
pub(crate) fn cast(to: DType, from: DType, x: &str) -> String {
    let float_src = matches!(from, DType::F32 | DType::F64);
    match to {
        _ if to == from => x.to_string(),
        // One rounding from any source, as the CPU's.
        DType::F32 => format!("(float){x}"),
        DType::F64 => format!("(double){x}"),
        DType::F16 if from == DType::F32 => format!("__half2float(__float2half_rn({x}))"),
        DType::BF16 if from == DType::F32 => format!("__bfloat162float(__float2bfloat16_rn({x}))"),
        DType::F16 => format!("__half2float(__double2half((double){x}))"),
        DType::BF16 => format!("__bfloat162float(__double2bfloat16((double){x}))"),
        DType::Bool => format!("{x} != 0"),
        DType::I32 if float_src => format!("braid_f2i32({x})"),
        DType::I64 if float_src => format!("braid_f2i64({x})"),
        DType::U8 if float_src => format!("braid_f2u8({x})"),
        // Integer to integer wraps (two's complement, as every CUDA target converts).
        _ => format!("({}){x}", ctype(to)),
    }
}

/// The C expression of node `i` (not a reduction). `offset` prints a view's element offset and
/// `index` is the flat element index.
pub(crate) fn node_expr(
    dialect: Dialect,
    expr: &Expr,
    loads: &[Load],
    i: usize,
    offset: &dyn Fn(&View) -> String,
    index: &str,
) -> Result<String, String> {
    let n = expr.nodes[i];
    let d = n.dtype;
    let ty = |j: u32| expr.nodes[j as usize].dtype;
    let bad = |what: &str| Err(format!("node {i} ({:?} of {d}): {what}", n.op));
    let f = if d == DType::F32 { "f" } else { "" };
    Ok(match n.op {
        ExprOp::Load(slot) => {
            let l = &loads[slot as usize];
            if d != l.dtype.compute() {
                return bad(&format!("loads a {} argument", l.dtype));
            }
            load_value(l.dtype, &format!("a{}[{}]", l.arg, offset(&l.view)))
        }
        ExprOp::Const(bits) if d.is_float() => float_literal(f64::from_bits(bits), d),
        ExprOp::ConstInt(v) if !d.is_float() => int_literal(v, d),
        ExprOp::Index if d == DType::I64 => index.to_string(),
        ExprOp::Random { seed, dist, operand } if ty(operand) == DType::I64 && d.is_float() => {
            let call = match (dist, d) {
                (Distribution::Uniform, DType::F64) => "braid_uniform53",
                (Distribution::Uniform, _) => "(float)braid_uniform24",
                (Distribution::Normal, DType::F64) => "braid_normal_f64",
                (Distribution::Normal, _) => "braid_normal_f32",
            };
            format!("{call}(0x{seed:x}ULL, (unsigned long long)v{operand})")
        }
        ExprOp::Unary(op, a) if ty(a) == d && d.is_float() => {
            let host = dialect == Dialect::Host;
            let name = match op {
                PrimUnary::Neg => return Ok(format!("-v{a}")),
                PrimUnary::Exp if host && d == DType::F32 => return Ok(format!("braid_expf(v{a})")),
                PrimUnary::Tanh if host && d == DType::F32 => return Ok(format!("braid_tanhf(v{a})")),
                PrimUnary::Sqrt if host => "__builtin_sqrt",
                PrimUnary::Abs if host => "__builtin_fabs",
                PrimUnary::Exp => "exp",
                PrimUnary::Log => "log",
                PrimUnary::Sqrt => "sqrt",
                PrimUnary::Abs => "fabs",
                PrimUnary::Sin => "sin",
                PrimUnary::Cos => "cos",
                PrimUnary::Tanh => "tanh",
            };
            format!("{name}{f}(v{a})")
        }
        ExprOp::Unary(PrimUnary::Abs, a) if ty(a) == d && d == DType::U8 => format!("v{a}"),
        ExprOp::Unary(op @ (PrimUnary::Neg | PrimUnary::Abs), a) if ty(a) == d && d.is_int() => {
            let neg = binary(PrimBinary::Sub, d, "0", &format!("v{a}"))?;
            if op == PrimUnary::Neg { neg } else { format!("v{a} < 0 ? {neg} : v{a}") }
        }
        ExprOp::Binary(op, a, b) if ty(a) == d && ty(b) == d => binary(op, d, &format!("v{a}"), &format!("v{b}"))?,
        ExprOp::Cmp(op, a, b) if ty(a) == ty(b) && d == DType::Bool => {
            let sym = match op {
                PrimCmp::Eq => "==",
                PrimCmp::Ne => "!=",
                PrimCmp::Lt => "<",
                PrimCmp::Le => "<=",
                PrimCmp::Gt => ">",
                PrimCmp::Ge => ">=",
            };
            format!("v{a} {sym} v{b}")
        }
        ExprOp::Select(c, a, b) if ty(c) == DType::Bool && ty(a) == d && ty(b) == d => format!("v{c} ? v{a} : v{b}"),
        ExprOp::Cast(to, a) if d == to.compute() => cast(to, ty(a), &format!("v{a}")),
        ExprOp::Reduce(..) => return bad("reductions only run in row kernels"),
        _ => return bad("operands of the wrong dtype"),
    })
}

/// The element offset of `view` in terms of the index variables `d0, d1, ...` (dimensions of
/// extent 1 and stride 0 do not appear).
pub(crate) fn offset_expr(view: &View) -> String {
    let mut s = if view.offset != 0 { view.offset.to_string() } else { String::new() };
    for (d, (&e, &st)) in view.dims.iter().zip(&view.strides).enumerate() {
        // Extent 1: index 0. Extent 0: the view has no element, so the expression is never
        // evaluated (and `decompose` declares no index variable for it).
        if e <= 1 || st == 0 {
            continue;
        }
        let term = if st.unsigned_abs() == 1 { format!("d{d}") } else { format!("d{d} * {}", st.unsigned_abs()) };
        match (s.is_empty(), st < 0) {
            (true, false) => s = term,
            (true, true) => s = format!("-{term}"),
            (false, neg) => s += &format!(" {} {term}", if neg { '-' } else { '+' }),
        }
    }
    if s.is_empty() { "0".into() } else { s }
}

/// Declares `d{k}` for each dimension `k` in `which` (used ones of extent > 1) from the flat
/// row-major index `var` (from 0, below the product of those dimensions) over those
/// dimensions of `dims`. Where that product fits 32 bits the divisions are 32-bit ones: a
/// GPU divides 64-bit integers (even by a constant) in several times the instructions, which
/// an elementwise kernel over bf16 with a broadcast operand pays per element.
pub(crate) fn decompose(out: &mut String, indent: &str, var: &str, dims: &[usize], which: &[usize], used: &[bool]) {
    let narrow = which.iter().map(|&j| dims[j]).product::<usize>() <= u32::MAX as usize;
    for (pos, &k) in which.iter().enumerate() {
        if !used[k] {
            continue;
        }
        let inner: usize = which[pos + 1..].iter().map(|&j| dims[j]).product();
        let outermost = which[..pos].iter().all(|&j| dims[j] == 1);
        let u = if narrow { "u" } else { "" };
        let div = if inner > 1 { format!(" / {inner}{u}") } else { String::new() };
        let rem = if outermost { String::new() } else { format!(" % {}{u}", dims[k]) };
        let _ = match narrow {
            true => writeln!(out, "{indent}const long long d{k} = (long long)((unsigned int){var}{div}{rem});"),
            false => writeln!(out, "{indent}const long long d{k} = {var}{div}{rem};"),
        };
    }
}

/// Which dimensions need an index variable: those of extent > 1 that some view walks (all of
/// them when the flat index is computed from them).
pub(crate) fn used_dims(dims: &[usize], views: &[&View], all: bool) -> Vec<bool> {
    (0..dims.len()).map(|k| dims[k] > 1 && (all || views.iter().any(|v| v.strides[k] != 0))).collect()
}

/// Per node, whether a store depends on it (the others cannot change an output and are not
/// printed), and the views that live loads and the stores read through.
pub(crate) fn live<'a>(expr: &Expr, loads: &'a [Load], stores: &'a [Store]) -> (Vec<bool>, Vec<&'a View>) {
    let mut live = vec![false; expr.nodes.len()];
    stores.iter().for_each(|s| live[s.value as usize] = true);
    for i in (0..live.len()).rev() {
        if live[i] {
            expr.nodes[i].op.operands().into_iter().for_each(|o| live[o] = true);
        }
    }
    let read = |slot: usize| expr.nodes.iter().zip(&live).any(|(n, &l)| l && n.op == ExprOp::Load(slot as u16));
    let loaded = loads.iter().enumerate().filter(|&(slot, _)| read(slot)).map(|(_, l)| &l.view);
    let views = loaded.chain(stores.iter().map(|s| &s.view)).collect();
    (live, views)
}

/// The statement storing `s` at element `offset` of its argument.
pub(crate) fn store_stmt(s: &Store, offset: &str) -> String {
    format!("a{}[{offset}] = {};", s.arg, stored_value(s))
}

/// The value `s` stores, converted to its storage type.
pub(crate) fn stored_value(s: &Store) -> String {
    storage_value(s.dtype, &format!("v{}", s.value))
}

/// `v`, a register of `d`'s compute type, converted to `d`'s storage type.
pub(crate) fn storage_value(d: DType, v: &str) -> String {
    match d {
        DType::F16 => format!("__float2half_rn({v})"),
        DType::BF16 => format!("__float2bfloat16_rn({v})"),
        DType::Bool => format!("(unsigned char){v}"),
        _ => v.to_string(),
    }
}

/// The compute value of `raw`, an element of a `d` argument in its storage type.
pub(crate) fn load_value(d: DType, raw: &str) -> String {
    match d {
        DType::F16 => format!("__half2float({raw})"),
        DType::BF16 => format!("__bfloat162float({raw})"),
        DType::Bool => format!("{raw} != 0"),
        _ => raw.to_string(),
    }
}

/// Helpers every printed source starts with, each function declared with `qual`: conversions
/// as braid defines them, and the counter-based random numbers of `braid_graph::rng`, ported to
/// 64-bit integer math.
pub(crate) fn helpers(qual: &str) -> String {
    let tau32 = float_literal(std::f32::consts::TAU as f64, DType::F32);
    let tau64 = float_literal(std::f64::consts::TAU, DType::F64);
    format!(
        r#"
// Float to integer: truncate towards zero, saturate at the type's range, NaN gives 0.
{qual} int braid_f2i32(double x) {{
  return isnan(x) ? 0 : x <= -0x1p31 ? (-2147483647 - 1) : x >= 0x1p31 ? 2147483647 : (int)x;
}}
{qual} long long braid_f2i64(double x) {{
  return isnan(x) ? 0 : x <= -0x1p63 ? (-9223372036854775807LL - 1) : x >= 0x1p63 ? 9223372036854775807LL : (long long)x;
}}
{qual} unsigned char braid_f2u8(double x) {{
  return isnan(x) || x <= 0.0 ? 0 : x >= 255.0 ? 255 : (unsigned char)(int)x;
}}
// Counter-based random numbers (braid_graph::rng): SplitMix64's finaliser.
{qual} unsigned long long braid_mix64(unsigned long long z) {{
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}}
{qual} unsigned long long braid_bits(unsigned long long seed, unsigned long long i) {{
  return braid_mix64(seed ^ braid_mix64(i));
}}
// Uniform on [0, 1) with 24 or 53 random bits: exact in float, resp. double.
{qual} double braid_uniform24(unsigned long long seed, unsigned long long i) {{
  return (double)(braid_bits(seed, i) >> 40) * 0x1p-24;
}}
{qual} double braid_uniform53(unsigned long long seed, unsigned long long i) {{
  return (double)(braid_bits(seed, i) >> 11) * 0x1p-53;
}}
// Box-Muller on uniforms 2i (u1 in (0, 1]) and 2i + 1, in the variate's precision.
{qual} float braid_normal_f32(unsigned long long seed, unsigned long long i) {{
  const float u1 = (float)(1.0 - braid_uniform24(seed, i * 2));
  const float u2 = (float)braid_uniform24(seed, i * 2 + 1);
  return sqrtf(-2.0f * logf(u1)) * cosf({tau32} * u2);
}}
{qual} double braid_normal_f64(unsigned long long seed, unsigned long long i) {{
  const double u1 = 1.0 - braid_uniform53(seed, i * 2);
  const double u2 = braid_uniform53(seed, i * 2 + 1);
  return sqrt(-2.0 * log(u1)) * cos({tau64} * u2);
}}
"#
    )
}
