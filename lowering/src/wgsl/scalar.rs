//! WGSL expressions for the nodes of a kernel expression: register types, constants, casts and
//! arithmetic with braid's semantics (the CPU evaluator's), printed as calls of the helpers in
//! [`super::helpers`] wherever plain WGSL differs from braid.
//!
//! Registers: f32 (also for f16/bf16 values, which only round), i32, u32 holding a u8 (always
//! 0..=255), bool, and `vec2<u32>` (low word, high word) for i64 values, which exist only
//! inside kernels (indices, argmax results, random-number counters). f64 is refused.
//!
//! Every constant goes through `braid_opaque`, a function call, so that naga never
//! constant-folds an expression over constants: its evaluator rejects what braid defines
//! (integer division by zero, overflow, infinities), and a folded result could differ from
//! the run-time one. This module prints text only; it never decides where values are loaded
//! from or stored to (see `memory`).

use braid_graph::DType;
use braid_graph::expr::{Distribution, Expr, ExprOp, PrimBinary, PrimCmp, PrimUnary};

/// The WGSL type of a register of compute dtype `d`.
pub(super) fn reg_type(d: DType) -> Result<&'static str, String> {
    Ok(match d {
        DType::F32 | DType::F16 | DType::BF16 => "f32",
        DType::I32 => "i32",
        DType::U8 => "u32",
        DType::Bool => "bool",
        DType::I64 => "vec2<u32>",
        DType::F64 => return Err(super::refusal(DType::F64)),
    })
}

/// An f32 constant with exactly the bits of `v as f32` (braid's constants are f64; a kernel
/// computing in f32 rounds them once, as the CPU does).
pub(super) fn f32_const(v: f64) -> String {
    let f = v as f32;
    format!("bitcast<f32>(braid_opaque(0x{:08x}u))", f.to_bits())
}

/// An integer constant as a register of dtype `d` holds it (wrapped as the CPU wraps it).
pub(super) fn int_const(v: i64, d: DType) -> Result<String, String> {
    Ok(match d {
        DType::I32 => format!("bitcast<i32>(braid_opaque(0x{:08x}u))", v as i32 as u32),
        DType::U8 => format!("braid_opaque({}u)", v as u8),
        DType::Bool => format!("(braid_opaque({}u) != 0u)", (v != 0) as u8),
        DType::I64 => u64_const(v as u64),
        d => return Err(format!("integer constant of {d}")),
    })
}

/// A 64-bit constant as a `vec2<u32>` register.
pub(super) fn u64_const(v: u64) -> String {
    format!("vec2<u32>(braid_opaque(0x{:08x}u), braid_opaque(0x{:08x}u))", v as u32, (v >> 32) as u32)
}

/// The identity of a reduction over registers of dtype `d`.
pub(super) fn identity(op: braid_graph::ReduceOp, d: DType) -> Result<String, String> {
    use braid_graph::ReduceOp::*;
    let (lo, hi) = match d {
        DType::F32 => (f32_const(f64::NEG_INFINITY), f32_const(f64::INFINITY)),
        DType::I32 => (int_const(i32::MIN as i64, d)?, int_const(i32::MAX as i64, d)?),
        DType::I64 => (int_const(i64::MIN, d)?, int_const(i64::MAX, d)?),
        DType::U8 => (int_const(0, d)?, int_const(255, d)?),
        d => return Err(format!("reduction of {d}")),
    };
    Ok(match op {
        Sum | Mean if d == DType::F32 => f32_const(0.0),
        Sum | Mean => int_const(0, d)?,
        Max | ArgMax => lo,
        Min => hi,
    })
}

/// `a op b` on registers of dtype `d`, with braid's semantics: integers wrap, integer
/// division truncates and `x / 0 == 0`, float max/min propagate NaN from either side.
pub(super) fn binary(op: PrimBinary, d: DType, a: &str, b: &str) -> Result<String, String> {
    use PrimBinary::*;
    Ok(match (d, op) {
        (DType::F32, Add) => format!("{a} + {b}"),
        (DType::F32, Sub) => format!("{a} - {b}"),
        (DType::F32, Mul) => format!("{a} * {b}"),
        (DType::F32, Div) => format!("{a} / {b}"),
        (DType::F32, Pow) => format!("braid_pow({a}, {b})"),
        (DType::F32, Max) => format!("braid_fmax({a}, {b})"),
        (DType::F32, Min) => format!("braid_fmin({a}, {b})"),
        // WGSL's i32 +, -, * wrap (two's complement) at run time.
        (DType::I32, Add) => format!("{a} + {b}"),
        (DType::I32, Sub) => format!("{a} - {b}"),
        (DType::I32, Mul) => format!("{a} * {b}"),
        (DType::I32, Div) => format!("braid_div_i32({a}, {b})"),
        (DType::I32, Max) => format!("max({a}, {b})"),
        (DType::I32, Min) => format!("min({a}, {b})"),
        // u8 in a u32: compute, then wrap to the low byte.
        (DType::U8, Add) => format!("(({a} + {b}) & 0xffu)"),
        (DType::U8, Sub) => format!("(({a} - {b}) & 0xffu)"),
        (DType::U8, Mul) => format!("(({a} * {b}) & 0xffu)"),
        (DType::U8, Div) => format!("braid_div_u32({a}, {b})"),
        (DType::U8, Max) => format!("max({a}, {b})"),
        (DType::U8, Min) => format!("min({a}, {b})"),
        (DType::I64, Add) => format!("braid_i64_add({a}, {b})"),
        (DType::I64, Sub) => format!("braid_i64_sub({a}, {b})"),
        (DType::I64, Mul) => format!("braid_i64_mul({a}, {b})"),
        (DType::I64, Div) => format!("braid_i64_div({a}, {b})"),
        (DType::I64, Max) => format!("select({b}, {a}, braid_i64_lt({b}, {a}))"),
        (DType::I64, Min) => format!("select({b}, {a}, braid_i64_lt({a}, {b}))"),
        (d, op) => return Err(format!("{op:?} on {d}")),
    })
}

/// `a op b` comparing registers of dtype `d` (floats: every comparison with NaN is false but
/// `!=`, tested on the bits so that no compiler may assume NaN away).
pub(super) fn compare(op: PrimCmp, d: DType, a: &str, b: &str) -> Result<String, String> {
    use PrimCmp::*;
    let sym = match op {
        Eq => "==",
        Ne => "!=",
        Lt => "<",
        Le => "<=",
        Gt => ">",
        Ge => ">=",
    };
    Ok(match d {
        DType::F32 if op == Ne => format!("(braid_isnan({a}) || braid_isnan({b}) || {a} != {b})"),
        DType::F32 => format!("(!braid_isnan({a}) && !braid_isnan({b}) && {a} {sym} {b})"),
        DType::I32 | DType::U8 => format!("({a} {sym} {b})"),
        DType::Bool => match op {
            Eq => format!("({a} == {b})"),
            Ne => format!("({a} != {b})"),
            Lt => format!("(!{a} && {b})"),
            Le => format!("(!{a} || {b})"),
            Gt => format!("({a} && !{b})"),
            Ge => format!("({a} || !{b})"),
        },
        DType::I64 => match op {
            Eq => format!("all({a} == {b})"),
            Ne => format!("any({a} != {b})"),
            Lt => format!("braid_i64_lt({a}, {b})"),
            Le => format!("!braid_i64_lt({b}, {a})"),
            Gt => format!("braid_i64_lt({b}, {a})"),
            Ge => format!("!braid_i64_lt({a}, {b})"),
        },
        d => return Err(format!("comparison of {d}")),
    })
}

/// `x` (a register of dtype `from`) cast to `to` with braid's semantics: one rounding from any
/// source to f32, f16 and bf16 (to nearest, ties to even, in integer arithmetic, not WGSL's
/// conversions, whose rounding is implementation-defined); float to integer truncates and
/// saturates, NaN giving 0; integer to integer wraps; anything to bool is `!= 0`.
pub(super) fn cast(to: DType, from: DType, x: &str) -> Result<String, String> {
    use DType::*;
    // As f32 rounded to odd: exact for f32, u8 and bool, one rounding for i32/i64, so that a
    // second rounding to f16/bf16 is correct.
    let to_f32 = |odd: bool| -> Result<String, String> {
        Ok(match from {
            F32 => x.to_string(),
            I32 => format!("braid_i64_to_f32(braid_i64_from_i32({x}), {odd})"),
            I64 => format!("braid_i64_to_f32({x}, {odd})"),
            U8 => format!("f32({x})"),
            Bool => format!("f32(select(0u, 1u, {x}))"),
            d => return Err(format!("cast from {d}")),
        })
    };
    Ok(match to {
        _ if to == from => x.to_string(),
        F32 => to_f32(false)?,
        F16 => format!("braid_f16_to_f32(braid_f32_to_f16({}))", to_f32(true)?),
        BF16 => format!("braid_bf16_to_f32(braid_f32_to_bf16({}))", to_f32(true)?),
        Bool => match from {
            F32 => format!("((bitcast<u32>({x}) & 0x7fffffffu) != 0u)"),
            I32 => format!("({x} != 0)"),
            U8 => format!("({x} != 0u)"),
            I64 => format!("any({x} != vec2<u32>(0u, 0u))"),
            d => return Err(format!("cast from {d}")),
        },
        I32 => match from {
            F32 => format!("braid_f2i32({x})"),
            U8 => format!("i32({x})"),
            Bool => format!("select(0i, 1i, {x})"),
            I64 => format!("bitcast<i32>({x}.x)"),
            d => return Err(format!("cast from {d}")),
        },
        U8 => match from {
            F32 => format!("braid_f2u8({x})"),
            I32 => format!("(bitcast<u32>({x}) & 0xffu)"),
            Bool => format!("select(0u, 1u, {x})"),
            I64 => format!("({x}.x & 0xffu)"),
            d => return Err(format!("cast from {d}")),
        },
        I64 => match from {
            F32 => format!("braid_f2i64({x})"),
            I32 => format!("braid_i64_from_i32({x})"),
            U8 => format!("vec2<u32>({x}, 0u)"),
            Bool => format!("vec2<u32>(select(0u, 1u, {x}), 0u)"),
            d => return Err(format!("cast from {d}")),
        },
        F64 => return Err(super::refusal(F64)),
    })
}

/// The WGSL expression of node `i`, which is neither a load nor a reduction (the callers
/// print those): `index` is the flat element index, a u32.
pub(super) fn node_expr(expr: &Expr, i: usize, index: &str) -> Result<String, String> {
    let n = expr.nodes[i];
    let d = n.dtype;
    let ty = |j: u32| expr.nodes[j as usize].dtype;
    let bad = |what: &str| Err(format!("node {i} ({:?} of {d}): {what}", n.op));
    reg_type(d)?;
    Ok(match n.op {
        ExprOp::Const(bits) if d == DType::F32 => f32_const(f64::from_bits(bits)),
        ExprOp::ConstInt(v) if !d.is_float() => int_const(v, d)?,
        ExprOp::Index if d == DType::I64 => format!("vec2<u32>({index}, 0u)"),
        ExprOp::Random { seed, dist, operand } if ty(operand) == DType::I64 && d == DType::F32 => {
            let f = if dist == Distribution::Uniform { "braid_uniform24" } else { "braid_normal_f32" };
            format!("{f}({}, v{operand})", u64_const(seed))
        }
        ExprOp::Unary(op, a) if ty(a) == d && d == DType::F32 => match op {
            PrimUnary::Neg => format!("-v{a}"),
            PrimUnary::Abs => format!("bitcast<f32>(bitcast<u32>(v{a}) & 0x7fffffffu)"),
            PrimUnary::Exp => format!("exp(v{a})"),
            PrimUnary::Log => format!("log(v{a})"),
            PrimUnary::Sqrt => format!("sqrt(v{a})"),
            PrimUnary::Sin => format!("sin(v{a})"),
            PrimUnary::Cos => format!("cos(v{a})"),
            PrimUnary::Tanh => format!("braid_tanh(v{a})"),
        },
        ExprOp::Unary(op @ (PrimUnary::Neg | PrimUnary::Abs), a) if ty(a) == d && d.is_int() => {
            let neg = match d {
                DType::I32 => format!("bitcast<i32>(0u - bitcast<u32>(v{a}))"),
                DType::U8 => format!("((0u - v{a}) & 0xffu)"),
                _ => format!("braid_i64_neg(v{a})"),
            };
            match (op, d) {
                (PrimUnary::Neg, _) => neg,
                (_, DType::U8) => format!("v{a}"),
                (_, DType::I32) => format!("select(v{a}, {neg}, v{a} < 0i)"),
                _ => format!("select(v{a}, {neg}, (v{a}.y >> 31u) == 1u)"),
            }
        }
        // `x - x`, `x / x`, ... of one value: compilers fold them as if NaN and infinities did
        // not exist (`x - x` to 0), so the second operand is laundered into another value.
        ExprOp::Binary(op, a, b) if ty(a) == d && ty(b) == d && a == b && d == DType::F32 => {
            binary(op, d, &format!("v{a}"), &format!("braid_launder(v{b})"))?
        }
        ExprOp::Binary(op, a, b) if ty(a) == d && ty(b) == d => binary(op, d, &format!("v{a}"), &format!("v{b}"))?,
        ExprOp::Cmp(op, a, b) if ty(a) == ty(b) && d == DType::Bool => {
            compare(op, ty(a), &format!("v{a}"), &format!("v{b}"))?
        }
        ExprOp::Select(c, a, b) if ty(c) == DType::Bool && ty(a) == d && ty(b) == d => {
            format!("select(v{b}, v{a}, v{c})")
        }
        ExprOp::Cast(to, a) if d == to.compute() => cast(to, ty(a), &format!("v{a}"))?,
        ExprOp::Load(_) | ExprOp::Reduce(..) => return bad("printed by the loop, not as an expression"),
        _ => return bad("operands of the wrong dtype"),
    })
}
