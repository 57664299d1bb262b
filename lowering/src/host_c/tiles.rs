//! Whole tiles of a map loop that transposes: a loop whose last two dimensions `[.., A, B]` are
//! walked by some view along the second to last (stride 1 there, a long stride along the last:
//! `x.t().exp()`, `x.t().contiguous()`, after the CPU's iteration orders split the loop into
//! tiles) is computed a tile of `A x B` indices at a time instead of in runs of `B` along the
//! last dimension, which read a transposed view one element per cache line.
//!
//! A tile is computed in column order (the second to last dimension innermost, `A` long) into
//! local arrays, one per store. Loads that walk the tile row-major (contiguous along the last
//! dimension, strided along the other) are first transposed into a local array of their own;
//! every other load is read where it is. Stores that walk the tile row-major are transposed out
//! of their array, every other store is copied out in column order. Transposes of 32-bit values
//! go 8x8 at a time through AVX registers where the CPU has AVX (`braid_transpose32`); other
//! types by element. Every load of a tile happens before any of its stores, so an output written
//! in place over an input (read at the output's own indices only) reads the old values.
//!
//! Only whole tiles take this path: the caller's run loop does any partial tile at either end
//! of a task's range (the CPU splits loops into tasks of 32Ki indices, a multiple of every tile
//! its iteration orders make). It must never change what an element computes, only the order
//! in which elements are visited, and never take a loop that reads the flat element index.

use super::{along, array_ctype};
use crate::cexpr::*;
use crate::kernel::{MapLoop, View};
use braid_graph::DType;
use braid_graph::expr::ExprOp;
use std::fmt::Write;

/// Indices of the largest tile computed this way: its local arrays, one per store and per
/// transposed load, stay in L1 (4 KiB each at 32 bits).
const MAX_TILE: usize = 1024;
/// Bytes of local arrays a tile may take on the stack (the caller's thread, a rayon worker of 2
/// MiB, runs it): a loop of more loads and stores than this holds is walked in runs instead.
const MAX_TILE_ARRAYS: usize = 256 << 10;

/// Transposes a block of 32-bit values (any of them: the bits are moved, never computed with),
/// 8x8 at a time in AVX registers where the CPU has AVX. Bit moves through `float` vectors keep
/// every pattern, NaNs included; `braid_u32` may alias any 32-bit type.
pub(super) const TRANSPOSE: &str = r#"typedef uint32_t __attribute__((may_alias)) braid_u32;
// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols. Blocks go along
// the destination's rows first, so that each of its lines is finished before the next.
static inline void braid_transpose32(void *dst_, long long dst_stride, const void *src_, long long src_stride, int rows, int cols) {
  braid_u32 *dst = (braid_u32 *)dst_;
  const braid_u32 *src = (const braid_u32 *)src_;
  int c0 = 0;
#if defined(__AVX__)
  for (; c0 + 8 <= cols; c0 += 8) {
    int r0 = 0;
    for (; r0 + 8 <= rows; r0 += 8) {
      const float *s = (const float *)(src + r0 * src_stride + c0);
      const __m256 x0 = _mm256_loadu_ps(s), x1 = _mm256_loadu_ps(s + src_stride);
      const __m256 x2 = _mm256_loadu_ps(s + 2 * src_stride), x3 = _mm256_loadu_ps(s + 3 * src_stride);
      const __m256 x4 = _mm256_loadu_ps(s + 4 * src_stride), x5 = _mm256_loadu_ps(s + 5 * src_stride);
      const __m256 x6 = _mm256_loadu_ps(s + 6 * src_stride), x7 = _mm256_loadu_ps(s + 7 * src_stride);
      const __m256 t0 = _mm256_unpacklo_ps(x0, x1), t1 = _mm256_unpackhi_ps(x0, x1);
      const __m256 t2 = _mm256_unpacklo_ps(x2, x3), t3 = _mm256_unpackhi_ps(x2, x3);
      const __m256 t4 = _mm256_unpacklo_ps(x4, x5), t5 = _mm256_unpackhi_ps(x4, x5);
      const __m256 t6 = _mm256_unpacklo_ps(x6, x7), t7 = _mm256_unpackhi_ps(x6, x7);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float *d = (float *)(dst + c0 * dst_stride + r0);
      _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(d + dst_stride, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(d + 2 * dst_stride, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(d + 3 * dst_stride, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(d + 4 * dst_stride, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(d + 5 * dst_stride, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(d + 6 * dst_stride, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(d + 7 * dst_stride, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
    for (; r0 < rows; r0++)
      for (int c = c0; c < c0 + 8; c++) dst[c * dst_stride + r0] = src[r0 * src_stride + c];
  }
#endif
  for (; c0 < cols; c0++)
    for (int r = 0; r < rows; r++) dst[c0 * dst_stride + r] = src[r * src_stride + c0];
}
"#;

/// The tile `(A, B)` of `l`'s last two dimensions, when a view walks them transposed (stride 1
/// along the second to last, not along the last), the tile is at most [`MAX_TILE`] indices, its
/// arrays at most [`MAX_TILE_ARRAYS`] bytes, and the loop does not read the flat element index.
pub(super) fn tile_of(l: &MapLoop) -> Option<(usize, usize)> {
    let rank = l.dims.len();
    let (&b, &a) = (l.dims.last()?, l.dims.get(rank.checked_sub(2)?)?);
    let columns = |v: &View| v.strides[rank - 2] == 1 && v.strides[rank - 1].abs() > 1;
    let transposes = l.loads.iter().map(|x| &x.view).chain(l.stores.iter().map(|s| &s.view)).any(columns);
    let by_index = || l.expr.nodes.iter().any(|n| matches!(n.op, ExprOp::Index | ExprOp::Random { .. }));
    // At most 8 bytes an element (f64, i64), an array per load and per store.
    let arrays = (l.loads.len() + l.stores.len()) * a * b * 8;
    let fits = a >= 2 && b >= 2 && a * b <= MAX_TILE && arrays <= MAX_TILE_ARRAYS;
    (transposes && fits && !by_index()).then_some((a, b))
}

/// Whether `view` walks the tile row-major: contiguous along the last dimension, strided along
/// the second to last (such a load is transposed in, such a store transposed out).
fn row_major(view: &View, rank: usize) -> bool {
    view.strides[rank - 1] == 1 && view.strides[rank - 2].abs() > 1
}

/// Values of `d` that `braid_transpose32` moves (a 32-bit type whose computed value is its
/// stored value).
fn moves_whole(d: DType) -> bool {
    matches!(d, DType::F32 | DType::I32)
}

/// Prints the branch of `l`'s run loop that computes a whole `a x b` tile starting at the
/// current index (whose offsets `o{slot}` and `w{s}` the caller printed), then goes on to the
/// next one. `live` marks the expression nodes the loop computes.
pub(super) fn print_whole_tile(
    out: &mut String,
    l: &MapLoop,
    live: &[bool],
    (a, b): (usize, usize),
) -> Result<(), String> {
    let rank = l.dims.len();
    let n = a * b;
    let strides = |v: &View| (v.strides[rank - 2], v.strides[rank - 1]);
    let _ = writeln!(out, "    if (d{} == 0 && d{} == 0 && end - i >= {n}LL) {{", rank - 1, rank - 2);
    let _ = writeln!(out, "      // A whole {a} x {b} tile, in column order.");
    let read = |slot: usize| (l.expr.nodes.iter().zip(live)).any(|(x, &on)| on && x.op == ExprOp::Load(slot as u16));
    // The transposed array each row-major load reads (loads of one argument through one view
    // share the first one's).
    let transposed: Vec<Option<usize>> = (0..l.loads.len())
        .map(|slot| {
            let x = &l.loads[slot];
            let same = |y: usize| read(y) && l.loads[y].arg == x.arg && l.loads[y].view == x.view;
            (row_major(&x.view, rank) && read(slot)).then(|| (0..slot).find(|&y| same(y)).unwrap_or(slot))
        })
        .collect();
    for slot in (0..l.loads.len()).filter(|&s| transposed[s] == Some(s)) {
        let x = &l.loads[slot];
        let (t, arg, stride) = (storage_ctype(x.dtype), x.arg, strides(&x.view).0);
        let _ = writeln!(out, "      {t} l{slot}[{n}] __attribute__((aligned(64)));");
        if moves_whole(x.dtype) {
            let _ = writeln!(out, "      braid_transpose32(l{slot}, {a}, a{arg} + o{slot}, {stride}, {a}, {b});");
        } else {
            let _ = writeln!(
                out,
                "      for (int p = 0; p < {a}; p++)\n        for (int q = 0; q < {b}; q++) l{slot}[q * {a} + p] = a{arg}[{}];",
                along(&format!("o{slot} + q"), "p", stride)
            );
        }
    }
    for (s, store) in l.stores.iter().enumerate() {
        let t = array_ctype(l.expr.nodes[store.value as usize].dtype);
        let _ = writeln!(out, "      {t} r{s}[{n}] __attribute__((aligned(64)));");
    }
    let _ = writeln!(
        out,
        "      for (int q = 0; q < {b}; q++) {{\n        for (int p = 0; p < {a}; p++) {{\n          const int k = q * {a} + p;"
    );
    let offset = |v: &View| {
        let slot = l.loads.iter().position(|x| &x.view == v).expect("a load's own view");
        let (sa, sb) = strides(v);
        along(&along(&format!("o{slot}"), "q", sb), "p", sa)
    };
    for (i, node) in l.expr.nodes.iter().enumerate().filter(|&(i, _)| live[i]) {
        let e = match node.op {
            ExprOp::Load(slot) if let Some(from) = transposed[slot as usize] => {
                load_value(l.loads[slot as usize].dtype, &format!("l{from}[k]"))
            }
            _ => node_expr(Dialect::Host, &l.expr, &l.loads, i, &offset, "0")?,
        };
        let _ = writeln!(out, "          const {} v{i} = {e};", ctype(node.dtype));
    }
    for (s, store) in l.stores.iter().enumerate() {
        let _ = writeln!(out, "          r{s}[k] = v{};", store.value);
    }
    out.push_str("        }\n      }\n");
    for (s, store) in l.stores.iter().enumerate() {
        let (arg, (sa, sb)) = (store.arg, strides(&store.view));
        let value_type = l.expr.nodes[store.value as usize].dtype;
        if row_major(&store.view, rank) && moves_whole(store.dtype) && value_type == store.dtype {
            let _ = writeln!(out, "      braid_transpose32(a{arg} + w{s}, {sa}, r{s}, {a}, {b}, {a});");
            continue;
        }
        // Row-major stores of other types along their rows (`q` innermost), the others along
        // the tile's columns.
        let (outer, inner) = if row_major(&store.view, rank) { (("p", a), ("q", b)) } else { (("q", b), ("p", a)) };
        let at = along(&along(&format!("w{s}"), "q", sb), "p", sa);
        let value = storage_value(store.dtype, &format!("r{s}[q * {a} + p]"));
        let _ = writeln!(
            out,
            "      for (int {o} = 0; {o} < {on}; {o}++)\n        for (int {i} = 0; {i} < {n_i}; {i}++) a{arg}[{at}] = {value};",
            o = outer.0,
            on = outer.1,
            i = inner.0,
            n_i = inner.1
        );
    }
    let _ = writeln!(out, "      i += {n}LL;\n      continue;\n    }}");
    Ok(())
}
