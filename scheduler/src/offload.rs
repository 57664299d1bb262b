//! Offload placement: which values leave device memory while idle, and when they come back.
//!
//! Works on a schedule planned without offloads (the baseline), in plan order (kernel `t` is
//! the `t`-th kernel planned). From its allocations and frees it computes the device memory
//! live during each kernel and at the end of the flush (rounded as the device allocates); while
//! the highest of those is over the budget it looks at that kernel `T` and picks, among the
//! values live there but idle (last used at `a < T`, next used at `b > T`, or used at the end
//! because they outlive the flush; a donated input also from the start of the flush to its
//! first reader), the largest: it is copied to host memory on the offload stream right after
//! `a`, its device buffer is given back once that copy is done (the kernel after next waits for
//! it, so one kernel of compute hides the copy; when the very next kernel is the peak or also
//! over the budget, that one waits), and it is copied back starting at kernel `c`, early enough
//! that the copy takes no longer than the kernels `c..b` by the device's cost model, yet after
//! `T` and after every kernel before `b` that would be over the budget with the value back (a
//! value is offloaded once, so it stays out wherever it is in the way; past the last such
//! kernel the copy may no longer be hidden, and its reader waits for it). Values the user
//! marked with `offload_hint` are offloaded over their longest idle gap whether or not a budget
//! asks for it. A value that outlives the flush (a tensor names it, or pending work of a later
//! flush reads it) is used at the end of the flush: by default it is back in device memory
//! then, but when the end is over the budget with it back, it stays in host memory past the
//! flush (not a parameter, which every step reads), and the later flush that reads it copies
//! it in before its first reader (`plan`); an offload already coming back at the end is the
//! first to stay out. So the end of a flush is a peak like any other, not a floor. When no idle
//! value is left at the peak, or the flush's inputs alone exceed the
//! budget when it starts, the budget cannot be met: the error names the smallest peak reached
//! and where it is. Both placement rules above look only at kernels over the budget, so a larger
//! budget makes the same choices wherever a kernel stays over it: the peak named is met when it
//! is the budget.
//!
//! This module decides; the planner (`plan`) emits the copies, events and frees. It never
//! touches memory.

use crate::schedule::{KernelId, Schedule, StreamStep};
use braid_fusion::SegmentKind;
use braid_graph::{FlushGraph, ValueRef};

pub use braid_graph::CostModel;

/// One offload: `value` (a flush node, or a donated input) leaves after kernel `last_use` (`None`:
/// a donated input idle from the start of the flush leaves at once), is out of device
/// memory from kernel `release` (which waits for the copy out: `last_use + 2` lets one kernel
/// hide it, `last_use + 1` when the memory is needed at once), comes back starting at kernel
/// `back_at` and is needed again by kernel `next_use` (kernel positions in plan order, which
/// the planner reproduces; the number of kernels stands for the end of the flush, where a
/// value that outlives it is back in device memory, unless `back_at` is `None`: then it stays
/// in host memory past the flush, and a later flush that reads it copies it in).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub value: ValueRef,
    pub last_use: Option<usize>,
    pub release: usize,
    pub back_at: Option<usize>,
    pub next_use: usize,
}

/// A budget offloading cannot meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreachable {
    /// The lowest peak offloading reaches.
    pub min_peak: u64,
    /// Where that peak is.
    pub at: PeakAt,
}

/// Where a flush's memory peaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeakAt {
    /// When it starts: its inputs are all in device memory.
    Start,
    /// While this kernel runs.
    Kernel(KernelId),
    /// When it ends: its inputs that it does not free and every value that outlives it.
    End,
}

/// Per value (computed by the flush, or one of its inputs): its bytes and the kernels that write
/// and read it.
struct Uses {
    value: ValueRef,
    bytes: u64,
    kernels: Vec<usize>,
    eligible: bool,
    hinted: bool,
}

/// Chooses offloads so that `base` (planned without any) peaks at most at `budget`.
pub fn choose(
    graph: &FlushGraph,
    base: &Schedule,
    budget: Option<u64>,
    model: &CostModel,
) -> Result<Vec<Decision>, Unreachable> {
    let k = base.kernels.len();
    let mut live = live_per_kernel(base, model);
    let uses = value_uses(graph, base, model);
    let cost: Vec<f64> = (0..k).map(|t| kernel_seconds(graph, base, t, model)).collect();
    let mut decisions: Vec<Decision> = Vec::new();
    let mut taken = vec![false; uses.len()];
    // Absent from device memory during kernels release .. back_at - 1 (and at the end of the
    // flush too, when it stays out).
    let apply = |decisions: &mut Vec<Decision>, d: Decision, bytes: u64, live: &mut [u64]| {
        for l in &mut live[d.release..d.back_at.unwrap_or(k + 1)] {
            *l -= bytes;
        }
        decisions.push(d);
    };
    // Hinted values first: over their longest idle gap.
    for (n, u) in uses.iter().enumerate() {
        if !u.hinted || !u.eligible {
            continue;
        }
        let best = u.kernels.windows(2).filter(|w| w[1] >= w[0] + 3).max_by_key(|w| w[1] - w[0]);
        if let Some(w) = best {
            let back_at = back_at(w[0] + 2, w[1], u.bytes, &cost, model);
            if back_at <= w[0] + 2 {
                continue; // the copy back would have to start at once: nothing to gain
            }
            let d = Decision {
                value: u.value,
                last_use: Some(w[0]),
                release: w[0] + 2,
                back_at: Some(back_at),
                next_use: w[1],
            };
            taken[n] = true;
            apply(&mut decisions, d, u.bytes, &mut live);
        }
    }
    let Some(budget) = budget else { return Ok(decisions) };
    loop {
        let Some((peak_at, &peak)) = live.iter().enumerate().max_by_key(|&(t, &b)| (b, std::cmp::Reverse(t))) else {
            return Ok(decisions);
        };
        if peak <= budget {
            // Before the first kernel every input is in device memory (offloads begin then).
            let start = inputs_at_start(base, model);
            if start > budget {
                return Err(Unreachable { min_peak: start.max(peak), at: PeakAt::Start });
            }
            return Ok(decisions);
        }
        // At the end of the flush, a value coming back there for a later flush may stay in
        // host memory instead (the largest first): it is out already.
        if peak_at == k {
            let back_at_end = decisions
                .iter()
                .enumerate()
                .filter(|(_, d)| d.next_use == k && d.back_at.is_some() && may_stay_out(graph, d.value))
                .max_by_key(|(_, d)| bytes_of(&uses, graph, d.value));
            if let Some((i, _)) = back_at_end {
                let bytes = bytes_of(&uses, graph, decisions[i].value);
                let back = decisions[i].back_at.take().expect("filtered");
                for l in &mut live[back..=k] {
                    *l -= bytes;
                }
                continue;
            }
        }
        // The largest value idle at the peak (ties: the longest gap). A value that outlives the
        // flush is used at its end (position `k`): idle at an earlier peak until then, and idle
        // at the end itself if it may stay in host memory past the flush.
        let candidate = uses
            .iter()
            .enumerate()
            .filter(|&(n, u)| u.eligible && !taken[n])
            .filter_map(|(n, u)| {
                let i = u.kernels.iter().position(|&t| t > peak_at || (t == k && may_stay_out(graph, u.value)))?;
                // Kernel positions shifted by one: 0 stands for the start of the flush, where a
                // donated input is already idle until its first reader.
                let a = match i.checked_sub(1) {
                    Some(j) => u.kernels[j] + 1,
                    None if matches!(u.value, ValueRef::External(_)) => 0,
                    None => return None,
                };
                (a < peak_at + 1).then_some((n, a, u.kernels[i], u.bytes))
            })
            // The largest; then one whose copy out a kernel can hide; then the longest gap.
            .max_by_key(|&(_, a, b, bytes)| (bytes, a < peak_at, b + 1 - a));
        let Some((n, a, b, bytes)) = candidate else {
            let start = inputs_at_start(base, model);
            if start >= peak {
                return Err(Unreachable { min_peak: start, at: PeakAt::Start });
            }
            let at = if peak_at < k { PeakAt::Kernel(KernelId(peak_at as u32)) } else { PeakAt::End };
            return Err(Unreachable { min_peak: peak, at });
        };
        // In unshifted positions: out of memory from last use + 2 (one kernel hides the copy
        // out), or last use + 1 when that kernel cannot hold the value within the budget (the
        // peak itself, or another kernel over the budget).
        let release = if a < peak_at && live[a] <= budget { a + 1 } else { a };
        // Back where the cost model hides the copy, but never while a kernel of the gap after
        // the peak would then go over the budget: those kernels need it out as much as the peak
        // does, and it could not be taken out again. Past the last of them the copy may no
        // longer be hidden (its reader waits for it); a budget comes before speed.
        // A value needed next at the end of the flush stays in host memory past it when the
        // end is over the budget with it back (a later flush that reads it copies it in).
        let back = if b == k && live[k] > budget && may_stay_out(graph, uses[n].value) {
            None
        } else {
            let hidden = back_at((peak_at + 1).min(b), b, bytes, &cost, model);
            Some((hidden..b).rev().find(|&t| live[t] > budget).map_or(hidden, |t| t + 1))
        };
        taken[n] = true;
        let last_use = a.checked_sub(1);
        let d = Decision { value: uses[n].value, last_use, release, back_at: back, next_use: b };
        apply(&mut decisions, d, bytes, &mut live);
    }
}

/// Whether `value` may stay in host memory past the flush, once offloaded: a value the flush
/// computes, not a parameter (parameters stay in device memory between steps, where every
/// step reads them).
fn may_stay_out(graph: &FlushGraph, value: ValueRef) -> bool {
    matches!(value, ValueRef::Node(n) if graph.nodes[n].keep && !graph.nodes[n].persistent)
}

/// The bytes `value` takes in device memory (as counted in `uses`).
fn bytes_of(uses: &[Uses], graph: &FlushGraph, value: ValueRef) -> u64 {
    let slot = match value {
        ValueRef::Node(n) => n,
        ValueRef::External(e) => graph.nodes.len() + e,
    };
    uses[slot].bytes
}

/// Where the copy back of `bytes` needed by kernel `next_use` starts: the latest kernel, no
/// earlier than `earliest`, from which the kernels before `next_use` take at least as long as
/// the copy.
fn back_at(earliest: usize, next_use: usize, bytes: u64, cost: &[f64], model: &CostModel) -> usize {
    let copy = bytes as f64 / model.copy_bytes_per_sec;
    let mut c = next_use;
    let mut hidden = 0.0;
    while c > earliest && hidden < copy {
        c -= 1;
        hidden += cost[c];
    }
    c.max(earliest)
}

/// Device memory the flush's inputs take when it starts (what no offload can lower).
fn inputs_at_start(base: &Schedule, model: &CostModel) -> u64 {
    base.buffers
        .iter()
        .filter(|b| {
            matches!(b.source, crate::BufferSource::External(_))
                && !b.upload_at_first_use
                && b.space == crate::Space::Device
        })
        .map(|b| model.allocated(b.bytes))
        .sum()
}

/// Device memory live while each kernel runs (after its outputs are allocated, before its
/// inputs are freed), as the planner orders them but counted as the device allocates (rounded
/// to its granularity), and at the end of the flush (one more entry). A transfer (a copy step,
/// maybe on a stream without kernels) counts its destination from the first kernel planned
/// after it.
fn live_per_kernel(base: &Schedule, model: &CostModel) -> Vec<u64> {
    let k = base.kernels.len();
    // One more entry each for the end of the flush (what transfers planned last allocate).
    let mut alloc_at = vec![0u64; k + 1];
    let mut free_after = vec![0u64; k + 1];
    let mut start = inputs_at_start(base, model);
    // Inputs uploaded at their first use count from their first reader.
    let mut seen = vec![false; base.buffers.len()];
    for (t, plan) in base.kernels.iter().enumerate() {
        for b in &plan.inputs {
            let buffer = &base.buffers[b.index()];
            if buffer.upload_at_first_use && !std::mem::replace(&mut seen[b.index()], true) {
                alloc_at[t] += model.allocated(buffer.bytes);
            }
        }
    }
    for st in &base.streams {
        let mut pending = 0u64;
        let mut last: Option<usize> = None;
        for step in &st.steps {
            match step {
                StreamStep::Alloc(b) => pending += model.allocated(base.buffers[b.index()].bytes),
                StreamStep::Kernel(kid) => {
                    alloc_at[kid.index()] += std::mem::take(&mut pending);
                    last = Some(kid.index());
                }
                // A transfer, the only copy of a plan without offloads.
                &StreamStep::Copy { value: ValueRef::Node(n), .. } => {
                    let t = kernel_after(base, n);
                    alloc_at[t] += std::mem::take(&mut pending);
                    last = Some(t);
                }
                StreamStep::Free { buffer, .. } => {
                    let bytes = model.allocated(base.buffers[buffer.index()].bytes);
                    match last {
                        Some(t) => free_after[t] += bytes,
                        None => start -= bytes,
                    }
                }
                _ => {}
            }
        }
    }
    // The last entry is the end of the flush: its inputs and every value that outlives it,
    // all in device memory.
    let mut live = Vec::with_capacity(k + 1);
    let mut cur = start;
    for t in 0..=k {
        cur += alloc_at[t];
        live.push(cur);
        cur -= free_after[t];
    }
    live
}

/// The first kernel planned after the segment of node `n` (`kernels.len()`: none, the end).
fn kernel_after(base: &Schedule, n: usize) -> usize {
    let segment = base.fusion.segments.iter().position(|s| s.nodes.contains(&n));
    segment.map_or(base.kernels.len(), |si| base.kernels.partition_point(|p| p.segment <= si))
}

/// For every flush node, then every input of the flush: the kernels that write and read it (a
/// value that outlives the flush is also used at the end, position `kernels.len()`), and whether
/// it may be offloaded (computed by this flush, or a donated input; not sharing a buffer through
/// in-place reuse).
fn value_uses(graph: &FlushGraph, base: &Schedule, model: &CostModel) -> Vec<Uses> {
    let nodes = graph.nodes.iter().enumerate().map(|(i, n)| Uses {
        value: ValueRef::Node(i),
        bytes: model.allocated(n.bytes()),
        kernels: Vec::new(),
        eligible: true,
        hinted: n.offload_hint,
    });
    let externals = graph.externals.iter().enumerate().map(|(i, e)| Uses {
        value: ValueRef::External(i),
        bytes: model.allocated(e.bytes()),
        kernels: Vec::new(),
        eligible: e.donated && !e.on_host && !e.offloaded,
        hinted: false,
    });
    let mut uses: Vec<Uses> = nodes.chain(externals).collect();
    let slot = |v: ValueRef| match v {
        ValueRef::Node(n) => n,
        ValueRef::External(e) => graph.nodes.len() + e,
    };
    let mut written = vec![false; graph.nodes.len()];
    for (t, plan) in base.kernels.iter().enumerate() {
        let seg = &base.fusion.segments[plan.segment];
        for &n in &seg.outputs {
            uses[n].kernels.push(t);
            written[n] = true;
        }
        for &v in &seg.inputs {
            let u = &mut uses[slot(v)];
            if u.kernels.last() != Some(&t) {
                u.kernels.push(t);
            }
        }
        for &(o, i) in &plan.in_place {
            uses[seg.outputs[o]].eligible = false;
            uses[slot(seg.inputs[i])].eligible = false;
        }
    }
    for ((u, w), n) in uses.iter_mut().zip(written).zip(&graph.nodes) {
        u.eligible &= w;
        if n.keep {
            u.kernels.push(base.kernels.len());
        }
    }
    for u in &mut uses {
        u.eligible &= u.bytes > 0;
    }
    uses
}

/// Estimated run time of kernel `t`.
fn kernel_seconds(graph: &FlushGraph, base: &Schedule, t: usize, model: &CostModel) -> f64 {
    let seg = &base.fusion.segments[base.kernels[t].segment];
    let bytes: usize = seg.inputs.iter().map(|&v| byte_size(graph, v)).sum::<usize>()
        + seg.outputs.iter().map(|&n| graph.nodes[n].bytes()).sum::<usize>();
    let mut secs = model.kernel_overhead_secs + bytes as f64 / model.kernel_bytes_per_sec;
    if seg.kind == SegmentKind::Matmul {
        let first = &graph.nodes[seg.nodes[0]];
        let inner = first.inputs.first().map_or(1, |&v| graph.meta(v).1.dims().last().copied().unwrap_or(1));
        secs += 2.0 * first.shape.numel() as f64 * inner as f64 / model.flops_per_sec;
    }
    if seg.kind == SegmentKind::Attention {
        // Two products of [sq, d] x [d, sk] per problem forward, five in the backward passes.
        let first = &graph.nodes[seg.nodes[0]];
        let (q, k) = (graph.meta(first.inputs[0]).1, graph.meta(first.inputs[1]).1);
        let keys = k.dims()[k.rank() - 2];
        let products = if first.inputs.len() > 3 { 5.0 } else { 2.0 };
        secs += products * 2.0 * q.numel() as f64 * keys as f64 / model.flops_per_sec;
    }
    secs
}

fn byte_size(graph: &FlushGraph, v: ValueRef) -> usize {
    let (dtype, shape) = graph.meta(v);
    dtype.size() * shape.numel()
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_graph::{DType, DeviceId, FlushNode, NodeId, Op, ReduceOp, Shape, StreamId};

    fn node(i: usize, op: Op, len: usize, inputs: &[usize]) -> FlushNode {
        FlushNode {
            id: NodeId::new(i),
            op,
            dtype: DType::F32,
            shape: if len == 1 { Shape::from([]) } else { Shape::from([len]) },
            device: DeviceId(0),
            stream: StreamId(0),
            inputs: inputs.iter().map(|&j| ValueRef::Node(j)).collect(),
            after: Default::default(),
            keep: false,
            offload_hint: false,
            persistent: false,
            recomputed: false,
        }
    }

    /// `x` (12,288 bytes) is written by k0 and read by k3; k1 holds `x` and `p` (16,384 bytes),
    /// k2 `x`, `p` and `q` (24,576, the peak). Under a budget of 14,000 `x` must be out during
    /// k1 as well as k2, so its copy out cannot be hidden behind k1 (which waits for it).
    #[test]
    fn a_kernel_over_the_budget_between_the_last_use_and_the_peak_keeps_the_value_out() {
        let mut graph = FlushGraph::default();
        graph.nodes.push(node(0, Op::Randn { seed: 1 }, 3072, &[]));
        graph.nodes.push(node(1, Op::Randn { seed: 2 }, 1024, &[]));
        // A cast, not written over `p` in place (another dtype).
        graph.nodes.push(node(2, Op::Cast, 1024, &[1]));
        graph.nodes[2].dtype = DType::F64;
        graph.nodes.push(node(3, Op::Reduce { op: ReduceOp::Sum, dim: None, keepdim: false }, 1, &[0]));
        graph.nodes[3].keep = true;
        let options = braid_fusion::Options { enabled: false, ..Default::default() };
        let base = crate::plan(&graph, braid_fusion::segment(&graph, &options));
        assert_eq!(base.kernels.len(), 4);
        assert_eq!(live_per_kernel(&base, &CostModel::CPU), [12_288, 16_384, 24_576, 12_352, 64]);
        let decisions = choose(&graph, &base, Some(14_000), &CostModel::CPU).expect("reachable");
        let x = Decision { value: ValueRef::Node(0), last_use: Some(0), release: 1, back_at: Some(3), next_use: 3 };
        assert_eq!(decisions, [x]);
        let planned = crate::plan_with_offloads(&graph, base, &decisions);
        assert!(planned.planned_peak_bytes <= 14_000, "{}", planned.planned_peak_bytes);
        crate::validate(&planned, &graph).unwrap();
    }

    /// `x` (12,288 bytes, kept past the flush) is last read by k1; k2 makes `y` (4,096, kept).
    /// The end of the flush holds both, as k2 does: under a budget of 13,000, `x` leaves after
    /// k1 and stays in host memory past the flush, where the schedule's output for it is.
    #[test]
    fn a_kept_value_idle_at_the_end_stays_in_host_memory_past_the_flush() {
        let mut graph = FlushGraph::default();
        graph.nodes.push(node(0, Op::Randn { seed: 1 }, 3072, &[]));
        graph.nodes.push(node(1, Op::Reduce { op: ReduceOp::Sum, dim: None, keepdim: false }, 1, &[0]));
        graph.nodes.push(node(2, Op::Randn { seed: 2 }, 1024, &[]));
        for n in &mut graph.nodes {
            n.keep = true;
        }
        let options = braid_fusion::Options { enabled: false, ..Default::default() };
        let base = crate::plan(&graph, braid_fusion::segment(&graph, &options));
        assert_eq!(live_per_kernel(&base, &CostModel::CPU), [12_288, 12_352, 16_448, 16_448]);
        let decisions = choose(&graph, &base, Some(13_000), &CostModel::CPU).expect("reachable");
        let x = Decision { value: ValueRef::Node(0), last_use: Some(1), release: 2, back_at: None, next_use: 3 };
        assert_eq!(decisions, [x]);
        let planned = crate::plan_with_offloads(&graph, base, &decisions);
        assert!(planned.planned_peak_bytes <= 13_000, "{}", planned.planned_peak_bytes);
        let (_, out) = planned.outputs.iter().find(|(n, _)| *n == 0).copied().expect("x is an output");
        assert_eq!(planned.buffers[out.index()].space, crate::Space::Host);
        assert_eq!(planned.offloads[0].back, None);
        crate::validate(&planned, &graph).unwrap();
    }

    /// A transfer on the copy stream (which runs no kernel) takes device memory from the first
    /// kernel after it, its reader here, until freed after that reader: 64 bytes copied in and
    /// 128 cast from them during k0, the cast alone at the end.
    #[test]
    fn a_transfer_on_the_copy_stream_counts_from_the_kernel_after_it() {
        let mut graph = FlushGraph::default();
        graph.externals.push(braid_graph::External {
            id: NodeId::new(100),
            dtype: DType::F32,
            shape: Shape::from([16]),
            device: DeviceId(1),
            stream: StreamId(0),
            donated: false,
            on_host: false,
            offloaded: false,
            persistent: false,
            overwritable: false,
            remote: true,
            foreign: false,
        });
        let mut copy = node(0, Op::ToDevice, 16, &[]);
        copy.inputs.push(ValueRef::External(0));
        copy.stream = crate::COPY_STREAM;
        graph.nodes.push(copy);
        graph.nodes.push(node(1, Op::Cast, 16, &[0]));
        graph.nodes[1].dtype = DType::F64;
        graph.nodes[1].keep = true;
        let base = crate::plan(&graph, braid_fusion::segment(&graph, &Default::default()));
        assert_eq!(base.kernels.len(), 1);
        assert_eq!(live_per_kernel(&base, &CostModel::CPU), [192, 128]);
        assert_eq!(base.planned_peak_bytes, 192);
        let err = choose(&graph, &base, Some(150), &CostModel::CPU).unwrap_err();
        assert_eq!(err, Unreachable { min_peak: 192, at: PeakAt::Kernel(KernelId(0)) });
    }
}
