//! Values kept across the passes of a long row: a row kernel with several passes (a softmax's
//! max, then the sum of `exp(x - max)`, then `exp(x - max) / sum` written out) recomputes, on
//! rows too long to stay in registers, every per-element value a later pass needs. For rows up
//! to [`KEEP_ROW`] positions values are kept instead (planned by `braid_lowering::row_passes`): each is computed
//! once, saved into a row-sized scratch (one per running task, reused from row to row and, up
//! to 16 MiB in all, from task to task and kernel to kernel) and copied back by later passes,
//! which then skip what it was computed from. Loads are gathered again rather than kept (as cheap as a copy).
//!
//! It changes only where a value comes from, never the value: kept and recomputed values are
//! the same bits. It never reads or writes kernel buffers.

use super::eval::Reg;
use braid_lowering::RowKernel;
use braid_lowering::row_passes::KeepPlan;
use std::sync::Mutex;

pub(super) use braid_lowering::row_passes::KEEP_ROW;

/// Scratch register sets given back by finished tasks, for the next (any kernel's): a set is
/// allocated (and its pages faulted in) about once per thread rather than once per task.
/// Bounded: sets beyond [`KEPT_BYTES`] in all are freed instead of kept.
static POOL: Mutex<Vec<Vec<Reg>>> = Mutex::new(Vec::new());

/// The most scratch memory kept between tasks and kernels, all threads together.
const KEPT_BYTES: usize = 16 << 20;

fn bytes(regs: &[Reg]) -> usize {
    regs.iter()
        .map(|r| {
            r.len()
                * match r {
                    Reg::F64(_) | Reg::I64(_) => 8,
                    Reg::F32(_) | Reg::I32(_) => 4,
                    Reg::U8(_) | Reg::Bool(_) => 1,
                }
        })
        .sum()
}

/// Scratch registers for the kept nodes of `plan` (indexed by node; the others empty), each
/// with room for `row` values. Hand them back with [`give_back`].
pub(super) fn take(k: &RowKernel, plan: &KeepPlan, row: usize) -> Vec<Reg> {
    let mut regs = POOL.lock().unwrap_or_else(|p| p.into_inner()).pop().unwrap_or_default();
    let nodes = &k.expr.nodes;
    regs.truncate(nodes.len());
    while regs.len() < nodes.len() {
        regs.push(Reg::new(nodes[regs.len()].dtype, 0));
    }
    for (i, n) in nodes.iter().enumerate() {
        let want = if plan.kept.contains(&i) { row } else { 0 };
        if !regs[i].fits(n.dtype, want) {
            regs[i] = Reg::new(n.dtype, want);
        }
    }
    regs
}

/// Keeps `regs` for a later [`take`] while the pool stays within [`KEPT_BYTES`]; frees them
/// otherwise.
pub(super) fn give_back(regs: Vec<Reg>) {
    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
    let held: usize = pool.iter().map(|r| bytes(r)).sum();
    if held + bytes(&regs) <= KEPT_BYTES {
        pool.push(regs);
    }
}

/// Copies `m` values from `src[from..]` into `dst[to..]` (registers of one type).
#[inline(always)]
pub(super) fn copy(src: &Reg, from: usize, dst: &mut Reg, to: usize, m: usize) {
    match (src, dst) {
        (Reg::F32(s), Reg::F32(d)) => d[to..to + m].copy_from_slice(&s[from..from + m]),
        (Reg::F64(s), Reg::F64(d)) => d[to..to + m].copy_from_slice(&s[from..from + m]),
        (Reg::I32(s), Reg::I32(d)) => d[to..to + m].copy_from_slice(&s[from..from + m]),
        (Reg::I64(s), Reg::I64(d)) => d[to..to + m].copy_from_slice(&s[from..from + m]),
        (Reg::U8(s), Reg::U8(d)) => d[to..to + m].copy_from_slice(&s[from..from + m]),
        (Reg::Bool(s), Reg::Bool(d)) => d[to..to + m].copy_from_slice(&s[from..from + m]),
        _ => unreachable!("the registers of one node have one type"),
    }
}
