//! The grouping algorithm: fold movement and constants into loads (`fold`), then grow segments
//! greedily in topological order, then order the segments.
//!
//! A node joins the segment of one of its producers (first one that a copy computed again for
//! a backward pass started, see `FlushNode::recomputed`; else the latest) when the two can
//! share a kernel (the rules are `joins.rs`'s: same stream, no control edge in between,
//! compatible kinds and index spaces, the target's limits kept, and no cycle between
//! segments); refused there, an elementwise node may join a recent kernel it meets later (a
//! node computed again for the backward pass: only one it meets through such nodes).
//! Otherwise it starts a segment of its own, and the refusal is recorded with its reason.
//! Segments run in a topological order, each at its first node, except one of nodes computed
//! again for the backward pass, which runs right before its first reader (`places`).

mod attention;
mod classify;
mod fold;
mod joins;
mod pack;

use crate::{Fusion, Options, Refusal, Segment, SegmentKind};
use braid_graph::{FlushGraph, Op, Shape, StreamId, ValueRef, View};
use classify::{Class, Level, class, is_transfer};
use fold::fold;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

#[derive(Clone, Debug)]
enum Kind {
    Single,
    Map(Shape),
    Rows(Shape, Option<usize>),
    Matmul(Shape),
    Attention,
}

struct GrowingSegment {
    kind: Kind,
    nodes: Vec<usize>,
    stream: StreamId,
    /// The control dependencies of the first node: later nodes may join only if theirs are a
    /// subset (a kernel never spans an event wait).
    waits: Vec<usize>,
    /// Distinct values read from outside (underlying values of folded movement).
    inputs: Vec<ValueRef>,
    /// Groups this one reads from.
    deps: Vec<usize>,
    /// How many of its nodes are outputs so far: kept, or read by a node outside it (one not
    /// placed yet counts as outside: a joining node may add one, and removes those it was the
    /// last outside reader of).
    exposed: usize,
}

struct Grouper<'a> {
    graph: &'a FlushGraph,
    options: &'a Options,
    folded: Vec<bool>,
    /// Per folded movement node, whether its view is a transpose (see `fold::transposed`).
    transposes: Vec<bool>,
    group_of: Vec<Option<usize>>,
    level: Vec<Level>,
    groups: Vec<GrowingSegment>,
    refused: Vec<Refusal>,
    /// Per node, its readers (a node reading it twice is listed twice).
    readers: Vec<Vec<usize>>,
    /// Per placed node, how many entries of `readers` are not in its group (readers through
    /// folded movement never are).
    unjoined_readers: Vec<usize>,
}

pub(crate) fn run(graph: &FlushGraph, options: &Options) -> Fusion {
    let n = graph.nodes.len();
    let mut control_pred = vec![false; n];
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, node) in graph.nodes.iter().enumerate() {
        for &a in &node.after {
            control_pred[a] = true;
        }
        for v in &node.inputs {
            if let ValueRef::Node(j) = *v {
                readers[j].push(i);
            }
        }
    }
    let (folded, transposes) =
        if options.enabled { fold(graph, options, &control_pred, &readers) } else { (vec![false; n], vec![false; n]) };
    let mut g = Grouper {
        graph,
        options,
        folded,
        transposes,
        group_of: vec![None; n],
        level: vec![Level::Full; n],
        groups: Vec::new(),
        refused: Vec::new(),
        unjoined_readers: readers.iter().map(Vec::len).collect(),
        readers,
    };
    for i in 0..n {
        if !g.folded[i] {
            g.place(i);
        }
    }
    g.finish()
}

impl Grouper<'_> {
    /// What node `i` reads: (input position, the node underneath, whether through a view: folded
    /// movement that does not read the node as a direct read would, see [`Self::reads_inline`]).
    fn producers(&self, i: usize) -> Vec<(usize, usize, bool)> {
        let folded = &self.folded;
        self.graph.nodes[i]
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(k, &v)| match crate::underlying(self.graph, folded, v) {
                ValueRef::Node(j) if !folded[j] => Some((k, j, v != ValueRef::Node(j) && !self.reads_inline(i, v, j))),
                _ => None,
            })
            .collect()
    }

    /// Whether elementwise node `i` reads `v`, folded movement over node `j` of a row kernel,
    /// as it would read `j` directly: seen from the kernel's index space, the view is the one a
    /// direct read of `j` has there (a row's reduced value expanded back along the row, as the
    /// gradient of a sum or a mean is). The kernel then uses the value it holds, so the read
    /// neither stops `i` joining `j`'s kernel nor makes `j` an output for it (lowering resolves
    /// it the same way).
    fn reads_inline(&self, i: usize, v: ValueRef, j: usize) -> bool {
        let Some(g) = self.group_of[j] else { return false };
        let Kind::Rows(full, axis) = &self.groups[g].kind else { return false };
        let node = &self.graph.nodes[i];
        // Only a node over one of the kernel's index spaces (a view of a lower rank than the
        // node's, as an elementwise op's operands are).
        let spaces = [full.clone(), classify::reduced(full, *axis, true), classify::reduced(full, *axis, false)];
        if class(&node.op) != Class::Elementwise || !spaces.contains(&node.shape) {
            return false;
        }
        let crate::FoldedRead::Value(_, view) = crate::folded_read(self.graph, &self.folded, v) else { return false };
        if view.dims.len() > node.shape.rank() {
            return false;
        }
        let own = &self.graph.nodes[j].shape;
        crate::row_view(view, &node.shape, full, *axis) == crate::row_view(View::contiguous(own), own, full, *axis)
    }

    /// Whether node `i`'s value is read outside its kernel by reader `r`: `r` is in another
    /// kernel, or is folded movement that some reader (through the folded chain) reads from
    /// elsewhere or not inline.
    fn read_outside(&self, i: usize, r: usize) -> bool {
        let mut stack = vec![r];
        while let Some(m) = stack.pop() {
            if !self.folded[m] {
                if self.group_of[m] != self.group_of[i] {
                    return true;
                }
                continue;
            }
            if self.readers[m].is_empty() {
                return true; // (not expected: a folded view is read, or it would not be folded)
            }
            for &k in &self.readers[m] {
                if self.folded[k] {
                    stack.push(k);
                } else if self.group_of[k] != self.group_of[i] || !self.reads_inline(k, ValueRef::Node(m), i) {
                    return true;
                }
            }
        }
        false
    }

    fn place(&mut self, i: usize) {
        let node = &self.graph.nodes[i];
        let cls = class(&node.op);
        if self.options.enabled && cls == Class::Attention {
            match self.attention_sibling(i) {
                Some(g) => self.join(g, i, Level::Full),
                None => self.new_group(i, cls),
            }
            return;
        }
        // Of the other kinds, only a concatenation fuses: into the map kernel of its inputs.
        let cat = matches!(node.op, Op::Cat { .. });
        if !self.options.enabled || (cls == Class::Other && !cat) || cls == Class::Attention {
            self.new_group(i, cls);
            return;
        }
        let producers = self.producers(i);
        let mut candidates: Vec<usize> =
            producers.iter().filter(|(_, _, via_view)| !via_view).filter_map(|&(_, j, _)| self.group_of[j]).collect();
        // Latest first, but a kernel that a copy computed again for the backward pass starts
        // before any: the copy was made to be computed inside its reader's kernel, never stored
        // (joined elsewhere, the reader leaves it a kernel of its own that writes it out).
        candidates.sort_unstable_by_key(|&g| (!self.graph.nodes[self.groups[g].nodes[0]].recomputed, Reverse(g)));
        candidates.dedup();
        // A node that reads nothing computed in this flush may join a recent kernel of the same
        // index space anyway (horizontal fusion) when the two will meet or it costs nothing: the
        // node reads nothing (a constant, random numbers), the kernel reads one of its inputs
        // (`gelu(x * w) * sigmoid(x)` reads x once), or a value the kernel computes
        // is still to be read by a later node (the several roots of one chain, `m * b1 + g * (1
        // - b1)`). An independent chain is left to packing (`group/pack.rs`): joined to a
        // finished one (an optimizer's update of another parameter of the same shape), a run of
        // them would reach the kernel's input limit midway through a chain and cut it in two,
        // its middle stored.
        let tried_meeting = candidates.is_empty();
        if candidates.is_empty() && !cat {
            let inputs: Vec<ValueRef> =
                node.inputs.iter().map(|&v| crate::underlying(self.graph, &self.folded, v)).collect();
            // A node computed again for the backward pass joins another such chain only where
            // the two meet (a cross-entropy's one-hot mask and its exponentials): every value
            // of such chains is read later, by the backward pass, and two chains joined
            // without meeting would both be written for their readers instead of computed
            // inside them (every layer's normalized rows in one kernel).
            let meets = |g: &usize| {
                let grp = &self.groups[*g];
                if node.recomputed {
                    return self.meets_near(*g, i);
                }
                self.meets_later(*g, i) || inputs.is_empty() || grp.inputs.iter().any(|u| inputs.contains(u))
            };
            candidates = (0..self.groups.len()).rev().take(4).filter(meets).collect();
        }
        let mut reasons: Vec<(usize, String)> = Vec::new();
        let mut joined = self.first_to_take(candidates, i, &mut reasons);
        // Refused by its producers' kernels, an elementwise node may still join a recent kernel
        // of its index space whose values a later node reads with it (they meet there): a
        // cross-entropy's cast of the logits joins the comparison with the targets. Not a
        // product's epilogue: that would only add an output to it.
        if joined.is_none() && cls == Class::Elementwise && !tried_meeting {
            let tried: Vec<usize> = reasons.iter().map(|(g, _)| *g).collect();
            let open = |g: &usize| {
                !tried.contains(g)
                    && matches!(self.groups[*g].kind, Kind::Map(_) | Kind::Rows(..))
                    && self.meets_later(*g, i)
            };
            let recent = (0..self.groups.len()).rev().take(4).filter(open).collect();
            joined = self.first_to_take(recent, i, &mut reasons);
        }
        match joined {
            Some((g, level)) => self.join(g, i, level),
            None => self.new_group(i, cls),
        }
        // Record why producers of fusable kinds stayed in other kernels.
        let mine = self.group_of[i];
        for &(_, j, via_view) in &producers {
            let Some(g) = self.group_of[j] else { continue };
            if Some(g) == mine || class(&self.graph.nodes[j].op) == Class::Other {
                continue;
            }
            let reason = match reasons.iter().find(|(rg, _)| *rg == g) {
                Some((_, r)) => r.clone(),
                None if via_view => "read through a view (folded movement); only direct reads fuse".to_string(),
                None => continue,
            };
            let r = Refusal { a: j, b: i, reason };
            if !self.refused.contains(&r) {
                self.refused.push(r);
            }
        }
    }

    /// Whether node `i` meets group `g` near the nodes computed again for the backward pass: some
    /// node reads (through such nodes, and at most one other) both a value of `i` and one of `g`
    /// (a cross-entropy's exponentials and its one-hot mask meet in the derivative that reads
    /// the mask's `select`).
    fn meets_near(&self, g: usize, i: usize) -> bool {
        let mine = self.readers_near(&[i]);
        let theirs = self.readers_near(&self.groups[g].nodes);
        mine.iter().any(|r| theirs.contains(r))
    }

    /// The readers of `from`, through readers computed again for the backward pass and at most
    /// one other (a bounded look: such chains are short, see the engine's `recompute.rs`).
    fn readers_near(&self, from: &[usize]) -> Vec<usize> {
        let mut stack: Vec<(usize, bool)> = from.iter().map(|&n| (n, false)).collect();
        let mut seen: Vec<usize> = Vec::new();
        while let Some((n, past_one)) = stack.pop() {
            for &r in &self.readers[n] {
                if seen.contains(&r) || seen.len() >= 64 {
                    continue;
                }
                seen.push(r);
                if self.graph.nodes[r].recomputed {
                    stack.push((r, past_one));
                } else if !past_one {
                    stack.push((r, true));
                }
            }
        }
        seen
    }

    /// Whether a value the last nodes of group `g` compute (where a chain in progress is: a
    /// bounded look) is still to be read by a node after `i`.
    fn meets_later(&self, g: usize, i: usize) -> bool {
        self.groups[g].nodes.iter().rev().take(8).any(|&j| self.readers[j].iter().any(|&r| r > i))
    }

    /// The first of `groups` node `i` can join, with its level there; the others' refusals go
    /// to `reasons`.
    fn first_to_take(
        &self,
        groups: Vec<usize>,
        i: usize,
        reasons: &mut Vec<(usize, String)>,
    ) -> Option<(usize, Level)> {
        for g in groups {
            match self.check(g, i) {
                Ok(level) => return Some((g, level)),
                Err(reason) => reasons.push((g, reason)),
            }
        }
        None
    }

    fn new_group(&mut self, i: usize, cls: Class) {
        let node = &self.graph.nodes[i];
        let kind = match cls {
            Class::Elementwise => Kind::Map(node.shape.clone()),
            Class::Reduce => {
                let Op::Reduce { dim, keepdim, .. } = node.op else { unreachable!() };
                self.level[i] = if keepdim || dim.is_none() { Level::Keep } else { Level::Flat };
                Kind::Rows(self.graph.meta(node.inputs[0]).1.clone(), dim)
            }
            Class::Matmul => Kind::Matmul(node.shape.clone()),
            Class::Attention => Kind::Attention,
            Class::Other => Kind::Single,
        };
        let mut waits: Vec<usize> = node.after.to_vec();
        waits.sort_unstable();
        self.groups.push(GrowingSegment {
            kind,
            nodes: Vec::new(),
            stream: node.stream,
            waits,
            inputs: Vec::new(),
            deps: Vec::new(),
            exposed: 0,
        });
        let g = self.groups.len() - 1;
        self.add(g, i);
    }

    fn join(&mut self, g: usize, i: usize, level: Level) {
        if let (Kind::Map(space), Op::Reduce { dim, .. }) = (&self.groups[g].kind, &self.graph.nodes[i].op) {
            self.groups[g].kind = Kind::Rows(space.clone(), *dim);
        }
        self.level[i] = level;
        self.add(g, i);
    }

    /// Puts node `i` into group `g`, recording its outside inputs and dependencies.
    fn add(&mut self, g: usize, i: usize) {
        // Outputs are counted only for a target that limits buffers (recording stays cheap).
        if self.options.max_buffers != usize::MAX {
            let (opens, closes) = self.exposure(g, i);
            // (Only reads of the node itself are in `readers`: an inline read through a view is
            // counted as one from outside, which only overstates the outputs.)
            let node = &self.graph.nodes[i];
            for (k, j, _) in self.producers(i) {
                if node.inputs[k] == ValueRef::Node(j) && self.group_of[j] == Some(g) {
                    self.unjoined_readers[j] -= 1;
                }
            }
            let grp = &mut self.groups[g];
            grp.exposed = grp.exposed + usize::from(opens) - closes;
        }
        self.group_of[i] = Some(g);
        self.groups[g].nodes.push(i);
        let node = &self.graph.nodes[i];
        for &v in &node.inputs {
            let u = crate::underlying(self.graph, &self.folded, v);
            let external = match u {
                ValueRef::Node(j) if self.folded[j] => continue, // a folded constant
                ValueRef::Node(j) => self.group_of[j] != Some(g) || (v != u && !self.reads_inline(i, v, j)),
                ValueRef::External(_) => true,
            };
            if external && !self.groups[g].inputs.contains(&u) {
                self.groups[g].inputs.push(u);
            }
            if let ValueRef::Node(j) = u
                && let Some(h) = self.group_of[j]
                && h != g
                && !self.groups[g].deps.contains(&h)
            {
                self.groups[g].deps.push(h);
            }
        }
        for &a in &node.after {
            if let Some(h) = self.group_of[a]
                && h != g
                && !self.groups[g].deps.contains(&h)
            {
                self.groups[g].deps.push(h);
            }
        }
    }

    /// What node `i` joining group `g` does to its outputs: whether `i` is one (kept, or read
    /// by anything: its readers all come later), and how many of the group's outputs it reads
    /// for the last time from outside (they stop being outputs).
    fn exposure(&self, g: usize, i: usize) -> (bool, usize) {
        let node = &self.graph.nodes[i];
        let opens = node.op != Op::Event && (node.keep || !self.readers[i].is_empty());
        let mut direct: Vec<usize> = (self.producers(i).into_iter())
            .filter(|&(k, j, _)| node.inputs[k] == ValueRef::Node(j) && self.group_of[j] == Some(g))
            .map(|(_, j, _)| j)
            .collect();
        direct.sort_unstable();
        let closes = direct
            .chunk_by(|a, b| a == b)
            .filter(|reads| {
                let j = reads[0];
                !self.graph.nodes[j].keep && self.unjoined_readers[j] == reads.len()
            })
            .count();
        (opens, closes)
    }

    /// Where each group goes in the kernel order: at its first node, except a group of nodes
    /// computed again for the backward pass (work an earlier flush left pending, or copies)
    /// whose readers are all on its stream: it goes right before its first reader. Such a group
    /// is left when a reader refused to take it in (its values have readers in several
    /// kernels); at its first node it would run at the start of the backward pass, and every
    /// layer's recomputed values would be live at once.
    fn places(&self, users: &[Vec<usize>]) -> Vec<usize> {
        let deferred: Vec<bool> = (self.groups.iter())
            .map(|grp| {
                grp.waits.is_empty()
                    && grp.nodes.iter().all(|&i| {
                        let node = &self.graph.nodes[i];
                        node.recomputed && node.after.iter().all(|&a| self.group_of[a] == self.group_of[i])
                    })
            })
            .collect();
        // A topological order of the groups (a node may join a group made before the groups it
        // reads, so their numbers are not one), walked backwards: a group's readers are placed
        // before it is.
        let ng = self.groups.len();
        let mut indeg: Vec<usize> = self.groups.iter().map(|grp| grp.deps.len()).collect();
        let mut topo: Vec<usize> = (0..ng).filter(|&g| indeg[g] == 0).collect();
        let mut k = 0;
        while k < topo.len() {
            for &u in &users[topo[k]] {
                indeg[u] -= 1;
                if indeg[u] == 0 {
                    topo.push(u);
                }
            }
            k += 1;
        }
        let mut place: Vec<usize> = self.groups.iter().map(|grp| grp.nodes[0]).collect();
        for &g in topo.iter().rev() {
            let stream = self.groups[g].stream;
            if deferred[g] && !users[g].is_empty() && users[g].iter().all(|&u| self.groups[u].stream == stream) {
                place[g] = users[g].iter().map(|&u| place[u]).min().expect("users");
            }
        }
        place
    }

    fn finish(self) -> Fusion {
        let graph = self.graph;
        let readers = &self.readers;
        let n = graph.nodes.len();
        // Topological order of the groups, ties broken by their place (`places`).
        let ng = self.groups.len();
        let mut indeg = vec![0usize; ng];
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); ng];
        for (g, grp) in self.groups.iter().enumerate() {
            for &h in &grp.deps {
                indeg[g] += 1;
                users[h].push(g);
            }
        }
        let place = self.places(&users);
        let mut heap: BinaryHeap<Reverse<(usize, usize)>> =
            (0..ng).filter(|&g| indeg[g] == 0).map(|g| Reverse((place[g], g))).collect();
        let mut order = Vec::with_capacity(ng);
        while let Some(Reverse((_, g))) = heap.pop() {
            order.push(g);
            for &u in &users[g] {
                indeg[u] -= 1;
                if indeg[u] == 0 {
                    heap.push(Reverse((place[u], u)));
                }
            }
        }
        assert_eq!(order.len(), ng, "fusion produced a cycle between kernels");
        // Who reads each node from outside its group (directly, or through folded movement).
        let outside: Vec<bool> = (0..n).map(|i| readers[i].iter().any(|&r| self.read_outside(i, r))).collect();
        let outputs_of = |grp: &GrowingSegment| -> Vec<usize> {
            let mut outputs: Vec<usize> = grp
                .nodes
                .iter()
                .copied()
                // A concatenation is stored region by region into its own buffer by the kernel
                // (nothing in it reads it back), so it is an output even when nobody reads it.
                .filter(|&i| match graph.nodes[i].op {
                    Op::Event => false,
                    Op::Cat { .. } => true,
                    _ => graph.nodes[i].keep || outside[i],
                })
                .collect();
            // A kernel whose values nobody reads (work ordered before a user event) still
            // writes its last value, which the plan frees at once.
            let last = *grp.nodes.last().expect("groups are not empty");
            if outputs.is_empty() && graph.nodes[last].op != Op::Event {
                outputs.push(last);
            }
            outputs
        };
        // Whether every read of `u` by `nodes` is the identity over `space` (a concatenation's
        // copy loop reads in its own order).
        let direct = |u: ValueRef, nodes: &[usize], space: &Shape| {
            graph.meta(u).1 == space
                && nodes.iter().all(|&i| {
                    let cat = matches!(graph.nodes[i].op, Op::Cat { .. });
                    graph.nodes[i]
                        .inputs
                        .iter()
                        .all(|&v| (v == u && !cat) || crate::underlying(graph, &self.folded, v) != u)
                })
        };
        let packs = pack::packs(&self, &order, &|g| outputs_of(&self.groups[g]).len());
        let segments = packs
            .into_iter()
            .map(|pack| {
                if let [g] = pack[..] {
                    let grp = &self.groups[g];
                    let kind = match &grp.kind {
                        Kind::Single if is_transfer(graph, grp.nodes[0]) => SegmentKind::Transfer,
                        Kind::Single => SegmentKind::Single,
                        Kind::Map(_) => SegmentKind::Map,
                        Kind::Rows(full, axis) => SegmentKind::Rows { full: full.clone(), axis: *axis },
                        Kind::Matmul(_) => SegmentKind::Matmul,
                        Kind::Attention => SegmentKind::Attention,
                    };
                    let direct = (grp.inputs.iter())
                        .map(|&u| matches!(&grp.kind, Kind::Map(s) if direct(u, &grp.nodes, s)))
                        .collect();
                    let outputs = outputs_of(grp);
                    return Segment { kind, nodes: grp.nodes.clone(), inputs: grp.inputs.clone(), direct, outputs };
                }
                let groups: Vec<&GrowingSegment> = pack.iter().map(|&g| &self.groups[g]).collect();
                let mut inputs: Vec<ValueRef> = vec![];
                for grp in &groups {
                    inputs.extend(grp.inputs.iter().filter(|u| !inputs.contains(u)).collect::<Vec<_>>());
                }
                // The part that reads each input, when one alone does.
                let input_part: Vec<Option<usize>> = (inputs.iter())
                    .map(|u| {
                        let mut readers = (0..groups.len()).filter(|&k| groups[k].inputs.contains(u));
                        match (readers.next(), readers.next()) {
                            (Some(k), None) => Some(k),
                            _ => None,
                        }
                    })
                    .collect();
                // Direct: read by one part alone, as the identity over its index space.
                let direct = (inputs.iter().zip(&input_part))
                    .map(|(&u, part)| {
                        part.is_some_and(|k| matches!(&groups[k].kind, Kind::Map(s) if direct(u, &groups[k].nodes, s)))
                    })
                    .collect();
                let parts = groups.iter().map(|grp| grp.nodes.len()).collect();
                Segment {
                    kind: SegmentKind::PackedMaps { parts, input_part },
                    nodes: groups.iter().flat_map(|grp| grp.nodes.iter().copied()).collect(),
                    inputs,
                    direct,
                    outputs: groups.iter().flat_map(|grp| outputs_of(grp)).collect(),
                }
            })
            .collect();
        let folded = (0..n).filter(|&i| self.folded[i]).collect();
        Fusion { segments, refused: self.refused, folded }
    }
}
