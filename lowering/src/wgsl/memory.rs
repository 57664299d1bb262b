//! How kernel arguments live in WGSL storage buffers, and the loads, stores and index
//! arithmetic over them.
//!
//! f32 and i32 arguments are `array<f32>` / `array<i32>`. Sub-word elements (u8 and bool: one
//! byte; f16 and bf16: two) are packed little-endian into `array<u32>` words, exactly braid's
//! byte layout, so buffers move to and from the host unchanged. Neighbouring threads may write
//! neighbouring elements of one word, so a written sub-word argument is an
//! `array<atomic<u32>>` and each store clears its bits with `atomicAnd` and sets them with
//! `atomicOr`: no thread ever writes a word non-atomically that another thread writes.
//! Every binding is `read_write`, so that the planner may bind one buffer to an input and an
//! output (an in-place update) without wgpu seeing a read-only and a writable use of it in one
//! dispatch.
//!
//! Offsets are u32: buffers are within the adapter's binding size (at most 4 GiB on every
//! adapter wgpu knows), and wrapping u32 arithmetic gives the exact offset of every element
//! a view reaches even through negative strides. Nothing here checks views (see
//! `check_printable`, called before printing).

use crate::kernel::{Load, Store, View};
use braid_graph::DType;
use std::fmt::Write;

/// The element type of an argument's array.
pub(super) fn array_type(d: DType, written: bool) -> Result<&'static str, String> {
    Ok(match d {
        DType::F32 => "f32",
        DType::I32 => "i32",
        DType::U8 | DType::Bool | DType::F16 | DType::BF16 if written => "atomic<u32>",
        DType::U8 | DType::Bool | DType::F16 | DType::BF16 => "u32",
        d => return Err(super::refusal(d)),
    })
}

/// Bytes of a binding holding `len` elements of `d`: whole u32 words, and at least one (wgpu
/// binds no empty buffer).
pub fn binding_bytes(d: DType, len: usize) -> u64 {
    ((len * d.size()).div_ceil(4).max(1) * 4) as u64
}

/// Declares argument/binding `b` as an array of `d`.
pub(super) fn declare(out: &mut String, b: usize, d: DType, written: bool) -> Result<(), String> {
    let _ = writeln!(out, "@group(0) @binding({b}) var<storage, read_write> a{b}: array<{}>;", array_type(d, written)?);
    Ok(())
}

/// The u32 word of argument `arg` (packed `1 << shift` elements a word) that holds element
/// `off`, read atomically when the kernel writes the argument.
fn packed_word(arg: u16, written: bool, off: &str, shift: u32) -> String {
    let at = format!("a{arg}[({off}) >> {shift}u]");
    if written { format!("atomicLoad(&{at})") } else { at }
}

/// The register value of element `off` (a u32 expression) of argument `arg` stored as `d`.
pub(super) fn load(arg: u16, d: DType, written: bool, off: &str) -> Result<String, String> {
    let word = |shift: u32| packed_word(arg, written, off, shift);
    Ok(match d {
        DType::F32 | DType::I32 => format!("a{arg}[{off}]"),
        DType::U8 => format!("braid_get_byte({}, {off})", word(2)),
        DType::Bool => format!("(braid_get_byte({}, {off}) != 0u)", word(2)),
        DType::F16 => format!("braid_f16_to_f32(braid_get_half({}, {off}))", word(1)),
        DType::BF16 => format!("braid_bf16_to_f32(braid_get_half({}, {off}))", word(1)),
        d => return Err(super::refusal(d)),
    })
}

/// The statement storing register `value` (of `d.compute()`) to element `off` of argument
/// `arg` stored as `d` (halves round to nearest even, as the CPU's stores).
pub(super) fn store(arg: u16, d: DType, off: &str, value: &str) -> Result<String, String> {
    let packed = |bits: String, per_word: u32| packed(arg, off, &bits, per_word);
    Ok(match d {
        DType::F32 | DType::I32 => format!("a{arg}[{off}] = {value};"),
        DType::U8 => packed(value.to_string(), 4),
        DType::Bool => packed(format!("select(0u, 1u, {value})"), 4),
        DType::F16 => packed(format!("braid_f32_to_f16({value})"), 2),
        DType::BF16 => packed(format!("braid_f32_to_bf16({value})"), 2),
        d => return Err(super::refusal(d)),
    })
}

/// The bits of element `off` of argument `arg` stored as `d`, as a u32 (for kernels that move
/// elements without converting them: a half's bits, a NaN's payload stay as they are).
pub(super) fn load_bits(arg: u16, d: DType, written: bool, off: &str) -> Result<String, String> {
    let word = |shift: u32| packed_word(arg, written, off, shift);
    Ok(match d {
        DType::F32 | DType::I32 => format!("bitcast<u32>(a{arg}[{off}])"),
        DType::U8 | DType::Bool => format!("braid_get_byte({}, {off})", word(2)),
        DType::F16 | DType::BF16 => format!("braid_get_half({}, {off})", word(1)),
        d => return Err(super::refusal(d)),
    })
}

/// The statement storing the u32 `bits` (of [`load_bits`]) to element `off` of argument `arg`
/// stored as `d`.
pub(super) fn store_bits(arg: u16, d: DType, off: &str, bits: &str) -> Result<String, String> {
    Ok(match d {
        DType::F32 => format!("a{arg}[{off}] = bitcast<f32>({bits});"),
        DType::I32 => format!("a{arg}[{off}] = bitcast<i32>({bits});"),
        DType::U8 | DType::Bool => packed(arg, off, bits, 4),
        DType::F16 | DType::BF16 => packed(arg, off, bits, 2),
        d => return Err(super::refusal(d)),
    })
}

/// The statement setting the sub-word element `off` of the packed argument `arg` (`per_word`
/// elements a word) to `bits`, leaving its neighbours, which other threads may be writing, as
/// they are.
fn packed(arg: u16, off: &str, bits: &str, per_word: u32) -> String {
    let (shift, mask, width) = if per_word == 4 { (2, "0xffu", 8) } else { (1, "0xffffu", 16) };
    format!(
        "{{ let e = {off}; let sh = (e & {}u) * {width}u; atomicAnd(&a{arg}[e >> {shift}u], ~({mask} << sh)); \
         atomicOr(&a{arg}[e >> {shift}u], ({bits}) << sh); }}",
        per_word - 1
    )
}

/// The element offset of `view` in terms of the index variables `d0, d1, ...` (u32; only
/// dimensions of extent > 1 and nonzero stride appear).
pub(super) fn offset(view: &View) -> String {
    let mut s = format!("{}u", view.offset);
    for (d, (&e, &st)) in view.dims.iter().zip(&view.strides).enumerate() {
        if e == 1 || st == 0 {
            continue;
        }
        let sign = if st < 0 { '-' } else { '+' };
        match st.unsigned_abs() {
            1 => write!(s, " {sign} d{d}"),
            a => write!(s, " {sign} d{d} * {a}u"),
        }
        .expect("writing to a String");
    }
    s
}

/// The flat row-major index of `(d0, d1, ...)` over `dims`.
pub(super) fn flat_index(dims: &[usize]) -> String {
    let mut terms = vec![];
    let mut stride = 1usize;
    for (d, &e) in dims.iter().enumerate().rev() {
        if e > 1 {
            terms.push(if stride == 1 { format!("d{d}") } else { format!("d{d} * {stride}u") });
        }
        stride *= e;
    }
    if terms.is_empty() { "0u".into() } else { terms.join(" + ") }
}

/// Declares `d{k}` (u32) for each dimension `k` in `which` of extent > 1 from `var`, the
/// row-major index over those dimensions of `dims`.
pub(super) fn decompose(out: &mut String, indent: &str, var: &str, dims: &[usize], which: &[usize]) {
    for (pos, &k) in which.iter().enumerate() {
        if dims[k] == 0 {
            // An empty dimension: nothing runs, but loads still name the variable.
            let _ = writeln!(out, "{indent}let d{k} = 0u;");
            continue;
        }
        if dims[k] == 1 {
            continue;
        }
        let inner: usize = which[pos + 1..].iter().map(|&j| dims[j]).product();
        let outermost = which[..pos].iter().all(|&j| dims[j] <= 1);
        let div = if inner > 1 { format!(" / {inner}u") } else { String::new() };
        let rem = if outermost { String::new() } else { format!(" % {}u", dims[k]) };
        let _ = writeln!(out, "{indent}let d{k} = {var}{div}{rem};");
    }
}

/// The load of `l` as a register expression, at the offset its view gives.
pub(super) fn load_of(l: &Load, written: &[bool]) -> Result<String, String> {
    load(l.arg, l.dtype, written.get(l.arg as usize).copied().unwrap_or(false), &offset(&l.view))
}

/// The statement of store `s` of register `v{s.value}`.
pub(super) fn store_of(s: &Store) -> Result<String, String> {
    store(s.arg, s.dtype, &offset(&s.view), &format!("v{}", s.value))
}
