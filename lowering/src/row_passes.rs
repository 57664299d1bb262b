//! The passes of a row kernel, as every CPU path runs them (the interpreter in
//! `braid_devices::cpu::rows` and the compiled code [`crate::host_c`] prints): which expression
//! nodes are constant along a row, one pass over the row per reduction (in node order) with the
//! per-element nodes its operand needs, and a last pass for the per-element stores; and, for
//! rows whose passes would recompute what an earlier pass computed, which values to keep from
//! pass to pass ([`KeepPlan`]).
//!
//! Both paths follow this one analysis so that they fold the same values in the same order and
//! so compute the same bits. It only analyses the IR: it never decides chunk sizes, threads or
//! memory.

use crate::kernel::{RowKernel, Store};
use braid_graph::expr::{Expr, ExprOp};
use braid_graph::{DType, ReduceOp};

/// The reductions of `expr` that `live` marks, in node order: (node, op, operand, operand's
/// dtype). What the GPU printers fold, one pass per reduction.
pub fn live_reductions(expr: &Expr, live: &[bool]) -> Vec<(usize, ReduceOp, usize, DType)> {
    let nodes = &expr.nodes;
    (0..nodes.len())
        .filter_map(|i| match nodes[i].op {
            ExprOp::Reduce(op, x) if live[i] => Some((i, op, x as usize, nodes[x as usize].dtype)),
            _ => None,
        })
        .collect()
}

/// Per node of `expr`: whether it is a reduction or reads one's value (through any chain of
/// operands). A reduction whose operand is not such a node can fold in the same pass as the
/// first reduction, and so can a store of a value that is not.
pub fn after_reductions(expr: &Expr) -> Vec<bool> {
    let mut after: Vec<bool> = Vec::with_capacity(expr.nodes.len());
    for n in &expr.nodes {
        let reads = n.op.operands().into_iter().any(|o| after[o]);
        after.push(reads || matches!(n.op, ExprOp::Reduce(..)));
    }
    after
}

/// What a row kernel's expression looks like from a row's point of view.
#[derive(Clone, Debug)]
pub struct RowPasses {
    /// Per expression node: constant along the row (reductions, and what depends only on them,
    /// on constants or on loads with stride 0 along the row).
    pub per_row: Vec<bool>,
    /// Per store: a per-row value through a view constant along the row (written once per row).
    pub row_stores: Vec<bool>,
    /// The reductions, in node order, each with the per-element nodes its operand needs (in
    /// node order).
    pub phases: Vec<(usize, Vec<usize>)>,
    /// The values the per-element stores write.
    pub elem_roots: Vec<usize>,
    /// The per-element nodes those need (in node order).
    pub last_phase: Vec<usize>,
}

impl RowPasses {
    pub fn of(k: &RowKernel) -> RowPasses {
        let nodes = &k.expr.nodes;
        let along = |strides: &[isize]| match k.axis {
            Some(d) => strides[d] == 0,
            None => strides.iter().all(|&s| s == 0),
        };
        let mut per_row = vec![false; nodes.len()];
        for (i, n) in nodes.iter().enumerate() {
            per_row[i] = match n.op {
                ExprOp::Load(slot) => along(&k.loads[slot as usize].view.strides),
                ExprOp::Const(_) | ExprOp::ConstInt(_) | ExprOp::Reduce(..) => true,
                ExprOp::Index => false,
                ExprOp::Random { operand, .. } => per_row[operand as usize],
                ExprOp::Unary(_, a) | ExprOp::Cast(_, a) => per_row[a as usize],
                ExprOp::Binary(_, a, b) | ExprOp::Cmp(_, a, b) => per_row[a as usize] && per_row[b as usize],
                ExprOp::Select(c, a, b) => per_row[c as usize] && per_row[a as usize] && per_row[b as usize],
            };
        }
        let phases: Vec<(usize, Vec<usize>)> = nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match n.op {
                ExprOp::Reduce(_, x) => Some((i, needed(k, &per_row, &[x as usize]))),
                _ => None,
            })
            .collect();
        // A per-element value through a view constant along the row only happens when rows
        // have one element.
        let row_store = |s: &Store| per_row[s.value as usize] && along(&s.view.strides);
        let row_stores: Vec<bool> = k.stores.iter().map(row_store).collect();
        let elem_roots: Vec<usize> = k.stores.iter().filter(|s| !row_store(s)).map(|s| s.value as usize).collect();
        let last_phase = needed(k, &per_row, &elem_roots);
        RowPasses { per_row, row_stores, phases, elem_roots, last_phase }
    }

    /// The values each pass computes: the operand of each reduction `pass(node)` keeps (all of
    /// them, or the live ones), then the per-element stores' values.
    pub fn roots(&self, k: &RowKernel, pass: impl Fn(usize) -> bool) -> Vec<Vec<usize>> {
        let mut roots: Vec<Vec<usize>> = (self.phases.iter())
            .filter(|&&(r, _)| pass(r))
            .map(|&(r, _)| match k.expr.nodes[r].op {
                ExprOp::Reduce(_, x) => vec![x as usize],
                _ => unreachable!("phases are reductions"),
            })
            .collect();
        roots.push(self.elem_roots.clone());
        roots
    }
}

/// The per-element nodes needed to compute `roots`, in node order.
fn needed(k: &RowKernel, per_row: &[bool], roots: &[usize]) -> Vec<usize> {
    let nodes = &k.expr.nodes;
    let mut need = vec![false; nodes.len()];
    let mut stack: Vec<usize> = roots.iter().copied().filter(|&r| !per_row[r]).collect();
    while let Some(i) = stack.pop() {
        if std::mem::replace(&mut need[i], true) {
            continue;
        }
        stack.extend(nodes[i].op.operands().into_iter().filter(|&o| !per_row[o]));
    }
    (0..nodes.len()).filter(|&i| need[i]).collect()
}

/// For a row split across threads (the CPU's few long rows), which no scratch holds from pass
/// to pass: the per-element stores whose values need no reduction (a prologue's values the
/// program keeps, random numbers it keeps beside their mean), written by the first pass as it
/// computes them, where the last pass would compute them all again (the ops unfused compute
/// them once). Where a value is stored from never changes it.
#[derive(Clone, Debug)]
pub struct EarlyStores {
    /// The stores (indices into the kernel's stores) the first pass writes.
    pub stores: Vec<usize>,
    /// The per-element nodes the first pass computes: its reduction's operand's and those
    /// stores' values', in node order.
    pub first_pass: Vec<usize>,
    /// The per-element nodes the last pass computes, for the other per-element stores.
    pub last_pass: Vec<usize>,
}

/// The [`EarlyStores`] of row kernel `k` (with its passes): the per-element stores of values
/// that read no reduction and no per-row value recorded after the first reduction; `None` when
/// there are none, or when the first reduction is an argmax (whose fold skips the rest of a
/// segment once it holds a NaN, so could not store as it goes).
pub fn early_stores(k: &RowKernel, passes: &RowPasses) -> Option<EarlyStores> {
    let nodes = &k.expr.nodes;
    let (first, first_need) = passes.phases.first()?;
    if matches!(nodes[*first].op, ExprOp::Reduce(ReduceOp::ArgMax, _)) {
        return None;
    }
    // Per node: whether the first pass can compute it: no reduction among what it reads, and
    // every per-row value it reads computed before the first pass (both paths compute the
    // per-row values below a reduction before its pass; a constant recorded after the first
    // reduction is not, yet).
    let mut ready = vec![false; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        let own = !matches!(n.op, ExprOp::Reduce(..)) && (!passes.per_row[i] || i < *first);
        ready[i] = own && n.op.operands().iter().all(|&o| ready[o]);
    }
    let (early, late): (Vec<usize>, Vec<usize>) =
        (0..k.stores.len()).filter(|&s| !passes.row_stores[s]).partition(|&s| ready[k.stores[s].value as usize]);
    if early.is_empty() {
        return None;
    }
    let values = |stores: &[usize]| stores.iter().map(|&s| k.stores[s].value as usize).collect::<Vec<_>>();
    let mut first_pass = needed(k, &passes.per_row, &values(&early));
    first_pass.extend(first_need);
    first_pass.sort_unstable();
    first_pass.dedup();
    let last_pass = needed(k, &passes.per_row, &values(&late));
    Some(EarlyStores { stores: early, first_pass, last_pass })
}

/// Values kept across the passes of a row: per pass (the reductions in order, then the
/// per-element outputs), what to evaluate, what to take from the kept values first, and what
/// to keep after. Kept and recomputed values are the same bits: this changes only where a value
/// comes from. Loads are read again rather than kept (as cheap as a copy).
#[derive(Clone, Debug)]
pub struct KeepPlan {
    pub need: Vec<Vec<usize>>,
    pub fill: Vec<Vec<usize>>,
    pub save: Vec<Vec<usize>>,
    /// The nodes kept, in node order.
    pub kept: Vec<usize>,
}

/// Plans the kept values of a kernel whose passes compute `roots` (per pass, see
/// [`RowPasses::roots`]) from per-element nodes (`per_row[i]` false); `None` when no pass reads
/// what an earlier one computed.
pub fn keep_plan(k: &RowKernel, per_row: &[bool], roots: &[Vec<usize>]) -> Option<KeepPlan> {
    let nodes = &k.expr.nodes;
    // The pass that evaluated each node.
    let mut evaluated: Vec<Option<usize>> = vec![None; nodes.len()];
    let (mut need, mut fill, mut save) = (Vec::new(), Vec::new(), vec![Vec::new(); roots.len()]);
    for (q, roots) in roots.iter().enumerate() {
        let mut mark = vec![0u8; nodes.len()]; // 1: evaluate, 2: fill
        let mut stack: Vec<usize> = roots.iter().copied().filter(|&r| !per_row[r]).collect();
        while let Some(i) = stack.pop() {
            if mark[i] != 0 {
                continue;
            }
            if evaluated[i].is_some() && !matches!(nodes[i].op, ExprOp::Load(_)) {
                mark[i] = 2;
                continue;
            }
            mark[i] = 1;
            stack.extend(nodes[i].op.operands().into_iter().filter(|&o| !per_row[o]));
        }
        let ev: Vec<usize> = (0..nodes.len()).filter(|&i| mark[i] == 1).collect();
        let fl: Vec<usize> = (0..nodes.len()).filter(|&i| mark[i] == 2).collect();
        for &i in &fl {
            let p = evaluated[i].expect("filled nodes were evaluated before");
            if !save[p].contains(&i) {
                save[p].push(i);
            }
        }
        for &i in &ev {
            evaluated[i] = Some(q);
        }
        need.push(ev);
        fill.push(fl);
    }
    let mut kept: Vec<usize> = save.iter().flatten().copied().collect();
    kept.sort_unstable();
    if kept.is_empty() {
        return None;
    }
    Some(KeepPlan { need, fill, save, kept })
}

/// Rows up to this many positions are folded as one chunk on the CPU, so that values computed
/// for one reduction stay in registers for the next; longer rows in chunks of [`LONG_CHUNK`].
pub const WHOLE_ROW: usize = 4096;

/// Row positions per chunk of a longer row on the CPU (4 x 256 measured best on the 2-core
/// machine: a softmax's registers stay in the first-level cache).
pub const LONG_CHUNK: usize = 1024;

/// Row positions per chunk of a row split across threads on the CPU (`braid_devices::cpu::split`;
/// its segments start at multiples of it, so they fold the chunks a whole row would). The
/// interpreter and the compiled split code ([`crate::host_c`]) both fold in chunks of it.
pub const SPLIT_CHUNK: usize = LONG_CHUNK;

/// The chunks a CPU path folds a row of `row` positions in: a float sum adds each chunk's sum
/// (folded in lanes, see `braid_devices::cpu::reduce`) to the row's with compensation, so the
/// interpreter and the compiled code must chunk alike to compute the same bits.
pub fn chunk_width(row: usize) -> usize {
    if row <= WHOLE_ROW { row.max(1) } else { LONG_CHUNK }
}

/// Longest row (in positions) whose values are kept from pass to pass on the CPU (256Ki f32
/// values make a 1 MiB scratch); longer rows recompute them.
pub const KEEP_ROW: usize = 1 << 20;
