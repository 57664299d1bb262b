//! Packing: elementwise kernels that run one after another, on one stream, behind the same
//! waits, none reading another's values, become one kernel of several loops
//! ([`SegmentKind::PackedMaps`](crate::SegmentKind::PackedMaps)). An optimizer's step records
//! one elementwise chain per parameter; packed, the update of every parameter is a few kernels
//! (PyTorch's multi-tensor `foreach` updates), which saves a launch, a plan step and its
//! bookkeeping per parameter.
//!
//! A group joins the open pack of its stream (the last segment on that stream, when it is a
//! map) when everything it reads runs before the pack does: the pack runs where its first
//! group did, so no group moves ahead of work it depends on and the order stays topological.
//! (Work on another stream that reads an earlier loop's value now waits for the whole pack: a
//! little less overlap, never a cycle, since no loop reads anything after the pack's start.)
//! The pack stays within the target's limits on bound buffers and nodes, and [`MAX_PARTS`]
//! loops. (The target's limit on kernel inputs bounds how far one loop's chain grows, and each
//! part keeps it.)
//!
//! Must never: pack across streams or an event wait, or pack a group with one it depends on.

use super::{Grouper, Kind};
use braid_graph::{StreamId, ValueRef};

/// The most loops one packed kernel holds: its argument list and its source grow with each
/// (the CPU and NVRTC compile it once per distinct pack, which a training loop repeats).
pub(crate) const MAX_PARTS: usize = 32;

/// A pack still open to more groups on its stream.
struct Open {
    /// Its index in the packs.
    pack: usize,
    /// Its first group's position in the order (the pack runs there).
    start: usize,
    inputs: Vec<ValueRef>,
    nodes: usize,
    written: usize,
}

/// The groups of `order` (in execution order) as packs, each a list of groups that become one
/// segment (a pack of one is the group's own segment), in the order the segments run: a pack
/// runs where its first group did. `outputs(g)` is how many values group `g` writes.
pub(super) fn packs(g: &Grouper<'_>, order: &[usize], outputs: &dyn Fn(usize) -> usize) -> Vec<Vec<usize>> {
    let mut position = vec![0; g.groups.len()];
    for (p, &h) in order.iter().enumerate() {
        position[h] = p;
    }
    let mut packs: Vec<Vec<usize>> = Vec::with_capacity(order.len());
    let mut open: Vec<(StreamId, Open)> = vec![];
    for (p, &h) in order.iter().enumerate() {
        let grp = &g.groups[h];
        let packable = g.options.enabled && matches!(grp.kind, Kind::Map(_));
        let slot = open.iter().position(|(s, _)| *s == grp.stream);
        let fits = |o: &Open| {
            let pack = &packs[o.pack];
            let new_inputs = grp.inputs.iter().filter(|u| !o.inputs.contains(u)).count();
            // Moved up to where the pack runs, the group must still follow everything it reads.
            pack.len() < MAX_PARTS
                && g.groups[pack[0]].waits == grp.waits
                && grp.deps.iter().all(|&d| position[d] < o.start)
                && o.inputs.len() + new_inputs + o.written + outputs(h) <= g.options.max_buffers
                && o.nodes + grp.nodes.len() <= g.options.max_nodes
        };
        match slot {
            Some(k) if packable && fits(&open[k].1) => {
                let o = &mut open[k].1;
                packs[o.pack].push(h);
                o.inputs.extend(grp.inputs.iter().filter(|u| !o.inputs.contains(u)).collect::<Vec<_>>());
                o.nodes += grp.nodes.len();
                o.written += outputs(h);
            }
            _ => {
                packs.push(vec![h]);
                if let Some(k) = slot {
                    // Work on the stream between two groups ends the pack (its order stays).
                    open.swap_remove(k);
                }
                if packable {
                    let o = Open {
                        pack: packs.len() - 1,
                        start: p,
                        inputs: grp.inputs.clone(),
                        nodes: grp.nodes.len(),
                        written: outputs(h),
                    };
                    open.push((grp.stream, o));
                }
            }
        }
    }
    packs
}
