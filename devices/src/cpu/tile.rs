//! Iteration orders for the CPU: the same kernel over a rewritten index space, chosen so that
//! every view is read and written in runs of neighbouring elements.
//!
//! A kernel's index space is walked in row-major order, so a view whose last dimension is not
//! its contiguous one (a transposed operand: `x.t().exp()`, `x.t().contiguous()`,
//! `x.t().sum_dim(1)`) is read one element per cache line and, at strides of 4 KiB and more,
//! one page per element: 10-25x slower than the same kernel over a contiguous input. Views are
//! strided, so walking the space in another order only rewrites dimensions and strides: a
//! dimension is split into `blocks x width` ([`Part`]), and the parts are put in a new order.
//! Every rewrite here covers each old index exactly once, keeps each row's reduction order
//! (positions along the axis in order), and is refused for kernels that read the flat element
//! index (random numbers, `Index`), whose values depend on the order. It must never change what
//! a kernel computes, only the order in which independent elements are visited.

use super::rows::{MIN_ROWS, WHOLE_ROW};
use braid_graph::expr::{Expr, ExprOp};
use braid_lowering::{MapLoop, RowKernel, View};

/// One dimension of a rewritten index space: `extent` steps of `step` positions along the old
/// dimension `old` (a whole dimension is `(d, dims[d], 1)`; split into blocks of `width`, it is
/// `(d, dims[d] / width, width)` then `(d, width, 1)`).
#[derive(Clone, Copy, Debug)]
struct Part {
    old: usize,
    extent: usize,
    step: usize,
}

/// `view` over the index space `parts` describes.
fn rewrite(view: &View, parts: &[Part]) -> View {
    let dims = parts.iter().map(|p| p.extent).collect();
    let strides = parts.iter().map(|p| view.strides[p.old] * p.step as isize).collect();
    View { dims, strides, offset: view.offset }
}

/// The parts of `dims` with dimension `d` split into `dims[d] / width` blocks (placed at
/// `blocks_at` among the other dimensions, in their order) and `width` positions (last).
fn split_last(dims: &[usize], d: usize, width: usize, blocks_at: usize) -> Vec<Part> {
    let mut parts: Vec<Part> =
        (0..dims.len()).filter(|&i| i != d).map(|i| Part { old: i, extent: dims[i], step: 1 }).collect();
    parts.insert(blocks_at, Part { old: d, extent: dims[d] / width, step: width });
    parts.push(Part { old: d, extent: width, step: 1 });
    parts
}

/// Whether the expression reads the flat element index (its values depend on the order).
fn reads_index(expr: &Expr) -> bool {
    expr.nodes.iter().any(|n| matches!(n.op, ExprOp::Index | ExprOp::Random { .. }))
}

/// The dimension (other than `not`, of extent at least 2) along which `view` is contiguous.
fn unit_dim(view: &View, not: usize) -> Option<usize> {
    (0..view.dims.len()).find(|&i| i != not && view.strides[i].abs() == 1 && view.dims[i] > 1)
}

/// Widths tried for the blocks of a map loop's tiles (see [`map_loop`]), widest first: along the
/// dimension a strided view is contiguous in, and along the last dimension.
const TILE_WIDTHS: [usize; 4] = [64, 32, 16, 8];
const RUN_WIDTHS: [usize; 2] = [16, 8];

/// A map loop whose last dimension some view walks at a stride (a transposed input or output)
/// while another dimension `d` is contiguous for it, and that is long enough to matter (more
/// than 16 positions): the same loop over tiles of `W` positions along `d` and `T` along the
/// last dimension, `[last / T, d / W, other dims.., W, T]`. In each tile the strided view reads
/// (or writes) `T` runs of `W` neighbours, a few cache lines at a time, and views contiguous
/// along the last dimension walk runs of `T`; the tiles of one block of `T` along the last
/// dimension come one after another, so the strided view is walked through memory in order
/// (`T` of its runs along `d` at a time). The host C printer computes such a tile as a whole
/// (`braid_lowering::host_c`: transposed in registers). `x.t().contiguous()` of a `[4096,
/// 1024]` f32 matrix: 20 ms in row-major order, 2-4 ms tiled and compiled, on a 2-core Zen 3
/// (PyTorch: 6.6-8.0 ms; BENCHMARKS.md). `None` when no view needs it, or when neither dimension divides into such
/// blocks.
pub fn map_loop(l: &MapLoop) -> Option<MapLoop> {
    let (d, w, t) = tiles(l)?;
    let last = l.dims.len() - 1;
    let mut parts =
        vec![Part { old: last, extent: l.dims[last] / t, step: t }, Part { old: d, extent: l.dims[d] / w, step: w }];
    parts.extend((0..last).filter(|&i| i != d).map(|i| Part { old: i, extent: l.dims[i], step: 1 }));
    parts.push(Part { old: d, extent: w, step: 1 });
    parts.push(Part { old: last, extent: t, step: 1 });
    let mut tiled = l.clone();
    tiled.dims = parts.iter().map(|p| p.extent).collect();
    tiled.loads.iter_mut().for_each(|x| x.view = rewrite(&x.view, &parts));
    tiled.stores.iter_mut().for_each(|x| x.view = rewrite(&x.view, &parts));
    Some(tiled)
}

/// `k` over the index space `parts` describes, reducing along its dimension `axis`.
fn rows_over(k: &RowKernel, parts: &[Part], axis: usize) -> RowKernel {
    let mut t = k.clone();
    t.dims = parts.iter().map(|p| p.extent).collect();
    t.axis = Some(axis);
    t.loads.iter_mut().for_each(|x| x.view = rewrite(&x.view, parts));
    t.stores.iter_mut().for_each(|x| x.view = rewrite(&x.view, parts));
    t
}

/// Whether [`map_loop`] runs `l` in another order (cheap: no allocation).
pub fn reorders(l: &MapLoop) -> bool {
    tiles(l).is_some()
}

/// [`map_loop`]'s tiles: the dimension a strided view is contiguous in, and the tile's widths
/// along it and along the last dimension.
fn tiles(l: &MapLoop) -> Option<(usize, usize, usize)> {
    let last = l.dims.len().checked_sub(1)?;
    if l.dims[last] <= 16 || reads_index(&l.expr) {
        return None;
    }
    let t = RUN_WIDTHS.into_iter().find(|&t| l.dims[last].is_multiple_of(t))?;
    let views = l.loads.iter().map(|x| &x.view).chain(l.stores.iter().map(|x| &x.view));
    views.filter(|v| v.strides[last].abs() > 1).find_map(|v| {
        let d = unit_dim(v, last)?;
        let w = TILE_WIDTHS.into_iter().find(|&w| l.dims[d].is_multiple_of(w))?;
        Some((d, w, t))
    })
}

/// A row kernel in the order it should run on the CPU, or `None` to run it as planned:
/// - a reduction along the last axis of a view that is contiguous along another, earlier
///   dimension (`x.t().sum_dim(1)`, `x.t().softmax(-1)`) runs with that dimension moved after
///   the axis, so each step along the axis reads a run of it (then re-tiled as below);
/// - a reduction along an axis with few rows before it and a wide last dimension, see
///   [`retile`].
pub fn row_kernel(k: &RowKernel) -> Option<RowKernel> {
    if reads_index(&k.expr) {
        return None;
    }
    match transposed(k) {
        Some(t) => Some(retile(&t, true).unwrap_or(t)),
        None => retile(k, false),
    }
}

/// [`row_kernel`]'s first case: the kernel with the contiguous dimension moved last.
fn transposed(k: &RowKernel) -> Option<RowKernel> {
    let d = k.axis?;
    let f = (k.loads.iter().map(|l| &l.view))
        .filter(|v| v.strides[d].abs() > 1)
        .find_map(|v| unit_dim(v, d).filter(|&f| f < d))?;
    let mut parts: Vec<Part> =
        (0..k.dims.len()).filter(|&i| i != f).map(|i| Part { old: i, extent: k.dims[i], step: 1 }).collect();
    parts.push(Part { old: f, extent: k.dims[f], step: 1 });
    Some(rows_over(k, &parts, d - 1))
}

/// How many times a row kernel reads its rows: once per reduction, and once more for outputs
/// per element.
fn passes(k: &RowKernel) -> usize {
    let d = k.axis.unwrap_or(0);
    let reductions = k.expr.nodes.iter().filter(|n| matches!(n.op, ExprOp::Reduce(..))).count();
    reductions + usize::from(k.stores.iter().any(|s| s.view.strides.get(d).is_some_and(|&x| x != 0)))
}

/// Positions of a re-tiled transposed row that stay in the second-level cache from pass to
/// pass (256 KiB of f32).
const CACHED_ROW: usize = 1 << 16;

/// A reduction along an axis with few rows before it and a wide last dimension (the column sums
/// of a bias gradient: `[batch, n]` summed over the batch is one row of `batch x n` elements,
/// run on one thread and too long to stay in cache) is the same kernel over the index space
/// with the last dimension split into `blocks x width` and the blocks moved in front of the
/// axis: every block is an independent row of `len x width` elements. With `always`, rows that
/// are already many are split too (a transposed row's wide last dimension would otherwise be
/// written as that many runs side by side).
fn retile(k: &RowKernel, always: bool) -> Option<RowKernel> {
    let d = k.axis?;
    let last = k.dims.len() - 1;
    if d == last {
        return None;
    }
    let outer: usize = k.dims[..d].iter().product();
    let inner: usize = k.dims[d + 1..].iter().product();
    let cols = k.dims[last];
    if (outer >= MIN_ROWS && !always) || inner < 64 {
        return None;
    }
    // The widest block (a multiple of 8 lanes) that leaves enough rows and, where possible,
    // rows that fit one chunk. Rows too long for that are read in runs of the block's width,
    // one run per step along the axis: then the widest block that leaves enough rows (runs of
    // 1 KiB stream from memory; runs of 32 bytes waste half of every cache line).
    let rest = k.dims[d] * (inner / cols);
    let enough = |w: usize| cols.is_multiple_of(w) && outer * (cols / w) >= MIN_ROWS;
    let width = if always && passes(k) > 1 {
        // Rows read more than once: the widest block whose rows stay in the second-level
        // cache between passes (a transposed `[512, 4096]` softmax: blocks of 16 run in 0.9x
        // the unfused ops' time, of 64 in 3.3x; a sum, read once, runs best in wide blocks).
        [64usize, 32, 16, 8].into_iter().filter(|&w| cols.is_multiple_of(w)).find(|&w| rest * w <= CACHED_ROW)
    } else {
        [64usize, 32, 16, 8]
            .into_iter()
            .filter(|&w| enough(w))
            .find(|&w| rest * w <= WHOLE_ROW)
            .or_else(|| [256usize, 128, 64, 32, 16, 8].into_iter().find(|&w| enough(w)))
    };
    let width =
        width.or_else(|| [8usize, 16, 32, 64].into_iter().find(|&w| cols.is_multiple_of(w) && cols / w >= 2))?;
    Some(rows_over(k, &split_last(&k.dims, last, width, d), d + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_graph::DType;
    use braid_graph::expr::ExprNode;
    use braid_graph::{ReduceOp, Shape};
    use braid_lowering::{Load, Store};

    /// `view`'s element offset at every index of `dims`, in row-major order.
    fn offsets(dims: &[usize], view: &View) -> Vec<isize> {
        let n: usize = dims.iter().product();
        (0..n)
            .map(|mut i| {
                let mut at = view.offset as isize;
                for d in (0..dims.len()).rev() {
                    at += (i % dims[d]) as isize * view.strides[d];
                    i /= dims[d];
                }
                at
            })
            .collect()
    }

    /// The loads' and stores' offsets at each index, sorted: a rewrite must visit the same
    /// tuples, each once.
    fn visits(dims: &[usize], views: &[&View]) -> Vec<Vec<isize>> {
        let per_view: Vec<Vec<isize>> = views.iter().map(|v| offsets(dims, v)).collect();
        let mut v: Vec<Vec<isize>> = (0..per_view[0].len()).map(|i| per_view.iter().map(|o| o[i]).collect()).collect();
        v.sort();
        v
    }

    fn view(dims: &[usize], strides: &[isize], offset: usize) -> View {
        View { dims: dims.into(), strides: strides.into(), offset }
    }

    fn contiguous(dims: &[usize]) -> View {
        View::contiguous(&Shape::from(dims.to_vec()))
    }

    /// `y = x` over `dims`, reading `x` through `load`.
    fn copy(dims: &[usize], load: View) -> MapLoop {
        let expr = Expr { nodes: vec![ExprNode { op: ExprOp::Load(0), dtype: DType::F32 }] };
        MapLoop {
            dims: dims.into(),
            loads: vec![Load { arg: 0, dtype: DType::F32, view: load }],
            expr,
            stores: vec![Store { arg: 1, dtype: DType::F32, view: contiguous(dims), value: 0 }],
        }
    }

    /// `x` (contiguous `[a, b]`) read as its transpose `[b, a]`.
    fn transposed(a: usize, b: usize) -> View {
        view(&[b, a], &[1, b as isize], 3)
    }

    #[test]
    fn a_transposed_copy_is_tiled_and_visits_every_element_once() {
        let l = copy(&[96, 40], transposed(40, 96));
        let t = map_loop(&l).expect("tiled");
        // Blocks along the last dimension (40 = 5 x 8), then along the load's contiguous one (96 =
        // 3 x 32), then the tile.
        assert_eq!(t.dims.as_slice(), &[5, 3, 32, 8]);
        assert_eq!(t.loads[0].view.strides.as_slice(), &[768, 32, 1, 96]);
        let views = |m: &MapLoop| visits(&m.dims, &[&m.loads[0].view, &m.stores[0].view]);
        assert_eq!(views(&l), views(&t));
        // Already tiled, or contiguous, or not divisible into blocks: left as it is.
        assert!(map_loop(&t).is_none());
        assert!(map_loop(&copy(&[96, 40], contiguous(&[96, 40]))).is_none());
        assert!(map_loop(&copy(&[30, 50], transposed(50, 30))).is_none());
    }

    #[test]
    fn a_permuted_batch_is_tiled_with_the_batch_inside_each_tile() {
        // x [6, 40, 24] read as x.permute([0, 2, 1]): [6, 24, 40], strides [960, 1, 24].
        let load = view(&[6, 24, 40], &[960, 1, 24], 0);
        let l = copy(&[6, 24, 40], load);
        let t = map_loop(&l).expect("tiled");
        assert_eq!(t.dims.as_slice(), &[5, 3, 6, 8, 8]);
        let views = |m: &MapLoop| visits(&m.dims, &[&m.loads[0].view, &m.stores[0].view]);
        assert_eq!(views(&l), views(&t));
    }

    /// A sum along the last axis of `[rows, len]` read through `load`, stored per row.
    fn row_sum(rows: usize, len: usize, load: View) -> RowKernel {
        let nodes = vec![
            ExprNode { op: ExprOp::Load(0), dtype: DType::F32 },
            ExprNode { op: ExprOp::Reduce(ReduceOp::Sum, 0), dtype: DType::F32 },
        ];
        let out = view(&[rows, len], &[1, 0], 0);
        RowKernel {
            dims: [rows, len].as_slice().into(),
            axis: Some(1),
            loads: vec![Load { arg: 0, dtype: DType::F32, view: load }],
            expr: Expr { nodes },
            stores: vec![Store { arg: 1, dtype: DType::F32, view: out, value: 1 }],
        }
    }

    /// Each row's (load, store) offsets along its axis, in order; the rows sorted.
    fn rows_of(k: &RowKernel) -> Vec<Vec<(isize, isize)>> {
        let d = k.axis.unwrap();
        let (load, store) = (offsets(&k.dims, &k.loads[0].view), offsets(&k.dims, &k.stores[0].view));
        let inner: usize = k.dims[d + 1..].iter().product();
        let len = k.dims[d];
        let mut rows = Vec::new();
        for o in 0..k.dims[..d].iter().product::<usize>() {
            for j in 0..inner {
                rows.push((0..len).map(|a| (o * len + a) * inner + j).map(|i| (load[i], store[i])).collect());
            }
        }
        rows.sort();
        rows
    }

    #[test]
    fn a_transposed_row_moves_its_contiguous_dimension_last_and_keeps_each_rows_order() {
        // x [512, 64] summed over its first dimension through x.t(): rows of 512 at stride 64.
        let k = row_sum(64, 512, transposed(512, 64));
        let t = row_kernel(&k).expect("reordered");
        assert_eq!(t.axis, Some(1));
        assert_eq!(t.loads[0].view.strides[t.axis.unwrap()], 64, "the axis is still walked at x's row stride");
        assert_eq!(t.loads[0].view.strides.last(), Some(&1), "each step reads a run of x's row");
        assert_eq!(rows_of(&k), rows_of(&t));
        // A contiguous row is left as it is.
        assert!(row_kernel(&row_sum(64, 512, contiguous(&[64, 512]))).is_none());
    }
}
