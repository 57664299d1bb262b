//! Which values a plain row kernel (`rows.rs`) keeps in shared memory between the sweeps over
//! its row ([`plan_keep`]), planned over the same sweeps it prints (`RowPlan::sweep_roots`).
//! Must never: keep a value where a later sweep would read it after another value took over
//! its array, or plan beyond the block's static shared memory.

use super::rows::RowPlan;
use super::*;

/// Which per-element values the kernel keeps in shared memory (`keep<i>[len]`, indexed by the
/// position along the row) between its phases.
///
/// Loads that two or more sweeps read (a reduction's fold and a later one, or the last sweep's
/// stores), in node order, while their arrays fit in [`ROW_KEEP_BYTES`] and, with the
/// reductions' arrays of one entry per warp, in the static shared memory of a block: a row that
/// fits is read from global memory once, however many phases it has. Then computed values that
/// later sweeps would compute again (a softmax's `exp(x - max)`, for its stores), latest first,
/// where they can take over a kept load's array: once kept, the load's last reader must be the
/// sweep that computes them. They cost no shared memory (an extra array would lower the blocks
/// an SM holds, which costs more than the recomputation), and the values read back are the
/// same bits as recomputed ones.
///
/// Why shared memory and not registers: each thread of every sweep visits the same positions
/// (`t = threadIdx.x; t += blockDim.x`), so a thread reads back only what it wrote, with no
/// barrier, at whatever power-of-two block size the launcher picks; a per-thread register
/// array would need its length, `ceil(len / blockDim.x)`, fixed when printing, so it would hold
/// the row only at the printed block size and need a second, multi-pass path for the others.
/// Shared memory is far faster than the global memory it saves (an f32 row of 4096 elements,
/// 16 KiB, still lets 8 blocks of 256 threads share a multiprocessor of an H100). Longer rows,
/// and the loads that one sweep reads, stay as they were: read from global memory per sweep.
pub(super) fn plan_keep(p: &RowPlan<'_>) -> (Vec<bool>, Vec<Option<usize>>) {
    let nodes = &p.r.expr.nodes;
    // Each sweep's roots: a reduction's operand, in node order, then the stored values.
    let mut sweeps = p.sweep_roots();
    let mut combine_bytes = 0;
    for (_, op, _, d) in p.reductions() {
        let idx = if op == ReduceOp::ArgMax { 8 } else { 0 };
        combine_bytes += (p.threads as usize).div_ceil(32) * (d.size() + idx);
    }
    let (_, elem_stores) = p.stores();
    if !elem_stores.is_empty() {
        sweeps.push(elem_stores.iter().map(|s| s.value as usize).collect());
    }
    let mut reads = vec![0; nodes.len()];
    sweeps.iter().flat_map(|roots| p.needed(roots)).for_each(|i| reads[i] += 1);
    let mut budget = ROW_KEEP_BYTES.min(STATIC_SHARED_BYTES.saturating_sub(combine_bytes));
    let mut keep = vec![false; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        let bytes = p.len * n.dtype.size();
        if matches!(n.op, ExprOp::Load(_)) && reads[i] >= 2 && p.len > 0 && bytes <= budget {
            keep[i] = true;
            budget -= bytes;
        }
    }
    let mut over = vec![None; nodes.len()];
    for j in (0..nodes.len()).rev() {
        if keep[j] || p.per_row[j] || matches!(nodes[j].op, ExprOp::Load(_)) {
            continue;
        }
        keep[j] = true;
        let uses = sweep_uses(p, &sweeps, &keep);
        let first = uses.iter().position(|u| u.contains(&j));
        let taken = |i: usize| over.contains(&Some(i));
        let host = first.filter(|_| uses.iter().filter(|u| u.contains(&j)).count() >= 2).and_then(|f| {
            // Before `j` (printed first in that sweep, so read before `j` is written over it).
            (0..j).find(|&i| {
                keep[i]
                    && matches!(nodes[i].op, ExprOp::Load(_))
                    && !taken(i)
                    && ctype(nodes[i].dtype) == ctype(nodes[j].dtype)
                    && uses[f].contains(&i)
                    && uses[f + 1..].iter().all(|u| !u.contains(&i))
            })
        });
        match host {
            Some(i) => over[j] = Some(i),
            None => keep[j] = false,
        }
    }
    (keep, over)
}

/// The nodes each sweep (given by its roots) computes or reads when the values of `keep` are
/// read back from shared memory by every sweep after the first that computes them (as
/// `RowPlan::sweep` prints them).
fn sweep_uses(p: &RowPlan<'_>, sweeps: &[Vec<usize>], keep: &[bool]) -> Vec<Vec<usize>> {
    let mut written = vec![false; keep.len()];
    sweeps
        .iter()
        .map(|roots| {
            let uses = p.needed_given(roots, &|i| keep[i] && written[i]);
            uses.iter().filter(|&&i| keep[i]).for_each(|&i| written[i] = true);
            uses
        })
        .collect()
}
