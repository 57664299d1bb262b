//! Vector accesses: where a view reads or writes `width` neighbouring elements that start at a
//! multiple of `width`, a thread moves them with one access of up to 16 bytes (`uint4`) into a
//! small aligned array instead of `width` scalar accesses, so that a kernel issues fewer memory
//! and address instructions per element and keeps more bytes in flight per thread. Map loops
//! (`loops.rs`) and row kernels (`rows.rs`) print such paths; this module holds what they share:
//! the chunk arrays and their copies, and the run-time check of the arguments' alignment.
//!
//! Whether an argument's address is aligned is known only when the kernel runs (braid's pools
//! align every buffer to 64 bytes, but a kernel must not rely on that): the printed kernel tests
//! it once, the same way in every thread, and takes its scalar path when any vectorised argument
//! is not aligned. Must never: print a vector access whose element offset is not a multiple of
//! its width (the printers check views; this module only prints), or a chunk wider than 16 bytes.

use super::*;

/// The widest access a thread makes (CUDA's 128-bit loads and stores): the default of
/// `PrintOptions::vector_bytes`.
pub(super) const VECTOR_BYTES: usize = 16;

/// The unsigned type that moves `bytes` (1 to 16, a power of two) in one access.
fn chunk_type(bytes: usize) -> &'static str {
    match bytes {
        16 => "uint4",
        8 => "uint2",
        4 => "unsigned int",
        2 => "unsigned short",
        _ => "unsigned char",
    }
}

/// Elements per vector access of `bytes` (at most 16, a power of two, `PrintOptions::vector_bytes`)
/// for elements of the given sizes in bytes: the largest fills `bytes`. `None` when there is no
/// element at all or the largest does not fit twice (no vector access then).
pub(super) fn width(bytes: usize, sizes: impl IntoIterator<Item = usize>) -> Option<usize> {
    sizes.into_iter().max().map(|s| bytes / s.max(1)).filter(|&w| w >= 2)
}

/// Declares `name` as an aligned array of `width` elements of C type `ty` (the chunk a vector
/// access fills or empties).
pub(super) fn declare_chunk(out: &mut String, pad: &str, name: &str, ty: &str, width: usize) {
    let _ = writeln!(out, "{pad}__align__(16) {ty} {name}[{width}];");
}

/// Copies the `bytes` at address `from` to address `to`, both aligned to `bytes`, in one access.
pub(super) fn copy_chunk(out: &mut String, pad: &str, to: &str, from: &str, bytes: usize) {
    let c = chunk_type(bytes);
    let _ = writeln!(out, "{pad}*reinterpret_cast<{c}*>({to}) = *reinterpret_cast<const {c}*>({from});");
}

/// Declares chunk `name` (`width` elements of C type `ty`, `size` bytes each) and fills it from
/// address `from` in one access.
pub(super) fn read_chunk(out: &mut String, pad: &str, name: &str, (ty, size): (&str, usize), width: usize, from: &str) {
    declare_chunk(out, pad, name, ty, width);
    copy_chunk(out, pad, name, from, size * width);
}

/// The run-time test that each argument `(arg, bytes)` starts at a multiple of `bytes` (true
/// when there is none).
pub(super) fn aligned(args: &[(u16, usize)]) -> String {
    let tests: Vec<String> =
        args.iter().map(|&(a, bytes)| format!("(unsigned long long)a{a} % {bytes}u == 0")).collect();
    if tests.is_empty() { "true".into() } else { tests.join(" && ") }
}

/// Which of a kernel's loads and stores a vector path accesses a chunk of `width` elements at a
/// time (map loops and row kernels plan it each their own way).
pub(super) struct Vector {
    pub width: usize,
    /// Per expression node: a load read as chunks.
    pub loads: Vec<bool>,
    /// Per store (of the kernel's `stores`): written as chunks.
    pub stores: Vec<bool>,
}

impl Vector {
    /// The arguments read or written as chunks (of `expr`'s loads `loads` and of `stores`), each
    /// with the alignment its chunks need, once each.
    pub fn args(&self, expr: &Expr, loads: &[Load], stores: &[Store]) -> Vec<(u16, usize)> {
        let loaded = (expr.nodes.iter().enumerate()).filter(|&(i, _)| self.loads[i]).map(|(_, n)| match n.op {
            ExprOp::Load(slot) => &loads[slot as usize],
            _ => unreachable!("planned from loads"),
        });
        let stored = stores.iter().zip(&self.stores).filter(|&(_, &v)| v).map(|(s, _)| s);
        let sizes = loaded.map(|l| (l.arg, l.dtype.size())).chain(stored.map(|s| (s.arg, s.dtype.size())));
        let mut args: Vec<(u16, usize)> = sizes.map(|(a, size)| (a, size * self.width)).collect();
        args.sort_unstable();
        args.dedup();
        args
    }
}
