//! The vector paths of plain row kernels (`rows.rs`): which of a row kernel's loads and stores
//! move as chunks of `width` neighbouring positions (16 bytes by default), and where a row's
//! first chunk starts when rows do not all start aligned. Must never: chunk a view whose chunks would not
//! start at multiples of the width (given an aligned argument), or one that is kept in shared
//! memory by position when rows are peeled (their chunks start at each row's `head`).

use super::rows::RowPlan;
use super::vector::{Vector, width};
use super::*;

/// The per-element accesses of a plain row kernel that walk its one row axis with stride 1.
struct Walking<'a> {
    axis: usize,
    /// Per expression node: the load, for a live per-element load that walks the row.
    loads: Vec<Option<&'a Load>>,
    /// Per store: a per-element store that walks the row.
    stores: Vec<bool>,
}

impl<'a> Walking<'a> {
    /// `None` unless the kernel is along one axis.
    fn of(p: &RowPlan<'a>) -> Option<Walking<'a>> {
        let (r, nodes) = (p.r, &p.r.expr.nodes);
        let [axis] = p.row_dims[..] else { return None };
        let walks = |v: &View| v.strides[axis] == 1;
        let loads = (0..nodes.len())
            .map(|i| match nodes[i].op {
                ExprOp::Load(slot) if p.live[i] && !p.per_row[i] && walks(&r.loads[slot as usize].view) => {
                    Some(&r.loads[slot as usize])
                }
                _ => None,
            })
            .collect();
        let (_, elem_stores) = p.stores();
        let stores =
            r.stores.iter().map(|s| elem_stores.iter().any(|e| std::ptr::eq(*e, s)) && walks(&s.view)).collect();
        Some(Walking { axis, loads, stores })
    }

    /// Their views with their elements' sizes, loads first.
    fn views(&self, r: &'a RowKernel) -> impl Iterator<Item = (&'a View, usize)> + '_ {
        let loads = self.loads.iter().flatten().map(|l| (&l.view, l.dtype.size()));
        loads.chain(r.stores.iter().zip(&self.stores).filter(|(_, w)| **w).map(|(s, _)| (&s.view, s.dtype.size())))
    }

    /// The chunked accesses: the walking ones for which `chunk` holds.
    fn chunked(&self, r: &RowKernel, width: usize, chunk: impl Fn(&View) -> bool) -> Vector {
        let loads = self.loads.iter().map(|l| l.is_some_and(|l| chunk(&l.view))).collect();
        let stores = r.stores.iter().zip(&self.stores).map(|(s, &w)| w && chunk(&s.view)).collect();
        Vector { width, loads, stores }
    }
}

/// The vector path of a plain row kernel (see `RowPlan::vector`), if it has one: along one axis
/// whose length is a multiple of the width, the live per-element loads and the per-element
/// stores that walk the row with stride 1 from an offset and row strides that are multiples of
/// the width (so that every row's chunks are aligned when the argument is), at least one of
/// them; the width fills 16 bytes (`PrintOptions::vector_bytes`) with the largest of their elements
/// and of the kept values.
pub(super) fn plan_vector(p: &RowPlan<'_>, kept: &[bool]) -> Option<Vector> {
    let (r, nodes) = (p.r, &p.r.expr.nodes);
    let walking = Walking::of(p)?;
    let kept_sizes = (0..nodes.len()).filter(|&i| kept[i]).map(|i| nodes[i].dtype.size());
    let width = width(p.options.vector_bytes, walking.views(r).map(|(_, size)| size).chain(kept_sizes))?;
    let rows_aligned = |v: &View| {
        v.offset.is_multiple_of(width)
            && (0..v.dims.len())
                .all(|d| d == walking.axis || v.dims[d] <= 1 || v.strides[d].unsigned_abs().is_multiple_of(width))
    };
    let v = walking.chunked(r, width, rows_aligned);
    let any = v.loads.iter().chain(&v.stores).any(|&c| c);
    (any && width > 1 && p.len.is_multiple_of(width)).then_some(v)
}

/// The vector path of a plain row kernel whose rows do not all start aligned (see
/// `RowPlan::peel`), with the offset of a row's first element in its chunked views: along one
/// axis, nothing kept in shared memory, rows of at least four chunks. Chunked: the live
/// per-element loads and per-element stores that walk the row with stride 1 and whose offset
/// and row strides leave the same remainders as those of the first such view that differs from
/// row to row (the one streamed from memory; a view every row shares stays in cache), so that
/// one `head` aligns them all; the width fills 16 bytes (`PrintOptions::vector_bytes`) with the
/// largest of their elements.
pub(super) fn plan_peeled_vector(p: &RowPlan<'_>, kept: &[bool]) -> Option<(Vector, String)> {
    if kept.iter().any(|&k| k) {
        return None;
    }
    let walking = Walking::of(p)?;
    let axis = walking.axis;
    let varies = |v: &View| p.pos_dims.iter().any(|&d| v.dims[d] > 1 && v.strides[d] != 0);
    let views: Vec<(&View, usize)> = walking.views(p.r).collect();
    let &(first, size) = views.iter().find(|(v, _)| varies(v)).or(views.first())?;
    // The remainders modulo `w` of a view's offset and row strides.
    let phase = |v: &View, w: usize| {
        let strides: Vec<usize> = (0..v.dims.len())
            .map(|d| if d == axis || v.dims[d] <= 1 { 0 } else { v.strides[d].rem_euclid(w as isize) as usize })
            .collect();
        (v.offset % w, strides)
    };
    let w0 = width(p.options.vector_bytes, [size])?;
    let with_first = |v: &View| phase(v, w0) == phase(first, w0);
    // Element sizes are powers of two, so the width divides `w0` and the remainders agree.
    let width = width(p.options.vector_bytes, views.iter().filter(|(v, _)| with_first(v)).map(|&(_, size)| size))?;
    if width < 2 || p.len < 4 * width {
        return None;
    }
    // The row's first element: the view at position 0 along the axis.
    let mut start = first.clone();
    start.dims[axis] = 1;
    Some((walking.chunked(p.r, width, with_first), offset_expr(&start)))
}
