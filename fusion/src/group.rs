//! The grouping algorithm: fold movement and constants into loads (`fold`), then grow segments
//! greedily in topological order, then order the segments.
//!
//! A node joins the segment of one of its producers when the two can share a kernel: same
//! stream, no control edge in between, compatible kinds and index spaces, the input limit kept,
//! and no cycle between segments. Otherwise it starts a segment of its own, and the refusal is
//! recorded with its reason.

mod attention;
mod classify;
mod fold;
mod pack;

use crate::{Fusion, Options, Refusal, Segment, SegmentKind};
use braid_graph::{FlushGraph, Op, Shape, StreamId, ValueRef};
use classify::{Class, Level, along, class, is_transfer, reduce_level, reduced};
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
    /// Whether a node of group `g` reads a folded view that is a transpose.
    fn reads_transposed(&self, g: usize) -> bool {
        let transposed_input = |v: &ValueRef| matches!(*v, ValueRef::Node(j) if self.folded[j] && self.transposes[j]);
        self.groups[g].nodes.iter().any(|&k| self.graph.nodes[k].inputs.iter().any(transposed_input))
    }

    /// What node `i` reads: (input position, the node underneath, whether through folding).
    fn producers(&self, i: usize) -> Vec<(usize, usize, bool)> {
        let folded = &self.folded;
        self.graph.nodes[i]
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(k, &v)| match crate::underlying(self.graph, folded, v) {
                ValueRef::Node(j) if !folded[j] => Some((k, j, v != ValueRef::Node(j))),
                _ => None,
            })
            .collect()
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
        if !self.options.enabled || cls == Class::Other || cls == Class::Attention {
            self.new_group(i, cls);
            return;
        }
        let producers = self.producers(i);
        let mut candidates: Vec<usize> =
            producers.iter().filter(|(_, _, via_view)| !via_view).filter_map(|&(_, j, _)| self.group_of[j]).collect();
        candidates.sort_unstable_by_key(|&g| Reverse(g));
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
        if candidates.is_empty() {
            let inputs: Vec<ValueRef> =
                node.inputs.iter().map(|&v| crate::underlying(self.graph, &self.folded, v)).collect();
            let meets = |g: &usize| {
                let grp = &self.groups[*g];
                // Its last nodes: where a chain in progress is (a bounded look).
                let pending = grp.nodes.iter().rev().take(8).any(|&j| self.readers[j].iter().any(|&r| r > i));
                pending || inputs.is_empty() || grp.inputs.iter().any(|u| inputs.contains(u))
            };
            candidates = (0..self.groups.len()).rev().take(4).filter(meets).collect();
        }
        let mut joined = None;
        let mut reasons: Vec<(usize, String)> = Vec::new();
        for g in candidates {
            match self.check(g, i) {
                Ok(level) => {
                    joined = Some((g, level));
                    break;
                }
                Err(reason) => reasons.push((g, reason)),
            }
        }
        // Refused by its producers' kernels, an elementwise node may still join a recent kernel
        // of its index space whose values a later node reads with it (they meet there): a
        // cross-entropy's cast of the logits joins the comparison with the targets.
        if joined.is_none() && cls == Class::Elementwise && !tried_meeting {
            let tried: Vec<usize> = reasons.iter().map(|(g, _)| *g).collect();
            // Not a product's epilogue: that would only add an output to it.
            let open = |g: &usize| !tried.contains(g) && matches!(self.groups[*g].kind, Kind::Map(_) | Kind::Rows(..));
            for g in (0..self.groups.len()).rev().take(4).filter(open) {
                let grp = &self.groups[g];
                let meets = grp.nodes.iter().rev().take(8).any(|&j| self.readers[j].iter().any(|&r| r > i));
                if !meets {
                    continue;
                }
                match self.check(g, i) {
                    Ok(level) => {
                        joined = Some((g, level));
                        break;
                    }
                    Err(reason) => reasons.push((g, reason)),
                }
            }
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
            for (_, j, via) in self.producers(i) {
                if !via && self.group_of[j] == Some(g) {
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
                ValueRef::Node(j) => self.group_of[j] != Some(g) || v != u,
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
            .filter(|&(_, j, via)| !via && self.group_of[j] == Some(g))
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

    /// Whether node `i` is a widening cast of a product's result that should not be the
    /// product's epilogue: the product's own values are written anyway (kept, or read by
    /// another kernel), or the cast's values are not kept and every reader of them is
    /// elementwise or a reduction, which converts the narrow values as it reads them. (A kept
    /// cast, such as an f32 gradient of a bf16 product, stays the epilogue: the product then
    /// writes only the wide values.)
    fn widens_a_kept_or_streamed_product(&self, i: usize) -> bool {
        let node = &self.graph.nodes[i];
        let [ValueRef::Node(p)] = node.inputs.as_slice() else { return false };
        let product = &self.graph.nodes[*p];
        if node.op != Op::Cast || product.op != Op::Matmul || node.dtype.size() <= product.dtype.size() {
            return false;
        }
        let product_written = product.keep || self.readers[*p].iter().any(|&r| r != i);
        let streamed = !node.keep
            && self.readers[i]
                .iter()
                .all(|&r| matches!(class(&self.graph.nodes[r].op), Class::Elementwise | Class::Reduce));
        product_written || streamed
    }

    /// Whether group `from` depends (transitively) on group `to`.
    fn depends(&self, from: usize, to: usize) -> bool {
        let mut stack = vec![from];
        let mut seen = vec![false; self.groups.len()];
        while let Some(x) = stack.pop() {
            if x == to {
                return true;
            }
            if !std::mem::replace(&mut seen[x], true) {
                stack.extend(&self.groups[x].deps);
            }
        }
        false
    }

    /// Can node `i` join group `g`? The level it would have, or why not.
    fn check(&self, g: usize, i: usize) -> Result<Level, String> {
        let grp = &self.groups[g];
        let node = &self.graph.nodes[i];
        let nid = node.id.index();
        if grp.stream != node.stream {
            return Err(format!("different streams ({}, {})", grp.stream.0, node.stream.0));
        }
        if node.after.iter().any(|a| grp.waits.binary_search(a).is_err()) {
            return Err(format!("an event wait or control edge orders n{nid} after work in this kernel"));
        }
        // Every read of a value of this group must be direct (no view of a value being computed).
        let producers = self.producers(i);
        if producers.iter().any(|&(_, j, via)| via && self.group_of[j] == Some(g)) {
            return Err(format!("n{nid} reads a value of this kernel through a view"));
        }
        let inside = |j: usize| self.group_of[j] == Some(g);
        let levels: Vec<Level> =
            producers.iter().filter(|&&(_, j, _)| inside(j)).map(|&(_, j, _)| self.level[j]).collect();
        let level = match (&grp.kind, class(&node.op)) {
            (Kind::Single | Kind::Attention, _) => return Err("a kernel of this kind does not fuse".into()),
            (Kind::Map(space), Class::Elementwise) if &node.shape == space => Level::Full,
            (Kind::Map(space), Class::Reduce) if self.graph.meta(node.inputs[0]).1 == space => {
                if self.options.copy_transposed_rows
                    && matches!(node.op, Op::Reduce { dim: None, .. })
                    && self.reads_transposed(g)
                {
                    // Fused, the reduction would read the view in its order, across lines; the
                    // map kernel writes its values in order first (a tiled loop).
                    return Err(format!("n{nid} reduces every element of a kernel that reads a transposed view"));
                }
                reduce_level(&node.op)
            }
            (Kind::Rows(full, axis), Class::Elementwise) => {
                let keep = reduced(full, *axis, true);
                let flat = reduced(full, *axis, false);
                // Sources number their elements over the kernel's whole index space.
                let source = matches!(node.op, Op::Arange { .. } | Op::Rand { .. } | Op::Randn { .. });
                if &node.shape == full && levels.iter().all(|&l| l != Level::Flat || axis.is_none()) {
                    Level::Full
                } else if source {
                    return Err(format!(
                        "n{nid} ({}) numbers its elements, which a reduced index space cannot",
                        node.op.name()
                    ));
                } else if node.shape == keep && levels.iter().all(|&l| l == Level::Keep) {
                    Level::Keep
                } else if node.shape == flat && levels.iter().all(|&l| l == Level::Flat) {
                    Level::Flat
                } else {
                    return Err(format!(
                        "index spaces {full} (reduced over {}) and {} differ",
                        along(*axis),
                        node.shape
                    ));
                }
            }
            (Kind::Rows(full, axis), Class::Reduce) => {
                let Op::Reduce { dim, .. } = node.op else { unreachable!() };
                let reductions =
                    grp.nodes.iter().filter(|&&j| matches!(self.graph.nodes[j].op, Op::Reduce { .. })).count();
                if reductions >= self.options.max_reductions {
                    return Err(format!(
                        "a row kernel with {reductions} reductions already re-reads its rows that often; a new kernel for n{nid} costs less"
                    ));
                }
                if dim != *axis || self.graph.meta(node.inputs[0]).1 != full || levels.iter().any(|&l| l != Level::Full)
                {
                    return Err(format!(
                        "a reduction over {} does not share rows reduced over {}",
                        along(dim),
                        along(*axis)
                    ));
                }
                reduce_level(&node.op)
            }
            (Kind::Matmul(_), Class::Elementwise) if self.widens_a_kept_or_streamed_product(i) => {
                return Err(format!(
                    "n{nid} widens the product's values to {}: its readers convert them as they read them, \
                     instead of the product writing them twice or wide",
                    node.dtype
                ));
            }
            (Kind::Matmul(out), Class::Elementwise) if &node.shape == out => Level::Full,
            (Kind::Map(space) | Kind::Matmul(space), _) => {
                return Err(format!("n{nid} ({}, {}) does not fit a kernel over {space}", node.op.name(), node.shape));
            }
            (Kind::Rows(..), _) => return Err("a matrix product starts its own kernel".into()),
        };
        // The target's limit on kernel size.
        if grp.nodes.len() >= self.options.max_nodes {
            return Err(format!("kernel node limit {} reached", self.options.max_nodes));
        }
        // The target's limit on kernel inputs.
        let new_inputs: Vec<ValueRef> = node
            .inputs
            .iter()
            .map(|&v| crate::underlying(self.graph, &self.folded, v))
            .filter(|&u| match u {
                ValueRef::Node(j) => !self.folded[j] && !inside(j),
                ValueRef::External(_) => true,
            })
            .filter(|u| !grp.inputs.contains(u))
            .collect();
        let mut distinct = new_inputs.clone();
        distinct.dedup();
        if grp.inputs.len() + distinct.len() > self.options.max_inputs {
            return Err(format!("kernel input limit {} reached", self.options.max_inputs));
        }
        // The target's limit on bound buffers: inputs and outputs together.
        if self.options.max_buffers != usize::MAX {
            let (opens, closes) = self.exposure(g, i);
            let outputs = (grp.exposed + usize::from(opens) - closes).max(1);
            let inputs = grp.inputs.len() + distinct.len();
            if inputs + outputs > self.options.max_buffers {
                return Err(format!(
                    "kernel buffer limit {} reached ({inputs} inputs and {outputs} outputs)",
                    self.options.max_buffers
                ));
            }
        }
        // No cycle: nothing this node reads from elsewhere may depend on this group.
        for u in &new_inputs {
            if let ValueRef::Node(j) = *u
                && let Some(h) = self.group_of[j]
                && self.depends(h, g)
            {
                return Err(format!(
                    "joining would form a cycle through the kernel of n{}",
                    self.graph.nodes[j].id.index()
                ));
            }
        }
        Ok(level)
    }

    fn finish(self) -> Fusion {
        let graph = self.graph;
        let readers = &self.readers;
        let n = graph.nodes.len();
        // Topological order of the groups, ties broken by their first node.
        let ng = self.groups.len();
        let mut indeg = vec![0usize; ng];
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); ng];
        for (g, grp) in self.groups.iter().enumerate() {
            for &h in &grp.deps {
                indeg[g] += 1;
                users[h].push(g);
            }
        }
        let mut heap: BinaryHeap<Reverse<(usize, usize)>> =
            (0..ng).filter(|&g| indeg[g] == 0).map(|g| Reverse((self.groups[g].nodes[0], g))).collect();
        let mut order = Vec::with_capacity(ng);
        while let Some(Reverse((_, g))) = heap.pop() {
            order.push(g);
            for &u in &users[g] {
                indeg[u] -= 1;
                if indeg[u] == 0 {
                    heap.push(Reverse((self.groups[u].nodes[0], u)));
                }
            }
        }
        assert_eq!(order.len(), ng, "fusion produced a cycle between kernels");
        // Who reads each node from outside its group (directly, or through folded movement).
        let mut outside = vec![false; n];
        for i in 0..n {
            for &r in &readers[i] {
                let through_view = self.folded[r];
                if through_view || self.group_of[r] != self.group_of[i] {
                    outside[i] = true;
                }
            }
        }
        let outputs_of = |grp: &GrowingSegment| -> Vec<usize> {
            let mut outputs: Vec<usize> = grp
                .nodes
                .iter()
                .copied()
                .filter(|&i| graph.nodes[i].op != Op::Event && (graph.nodes[i].keep || outside[i]))
                .collect();
            // A kernel whose values nobody reads (work ordered before a user event) still
            // writes its last value, which the plan frees at once.
            let last = *grp.nodes.last().expect("groups are not empty");
            if outputs.is_empty() && graph.nodes[last].op != Op::Event {
                outputs.push(last);
            }
            outputs
        };
        // Whether every read of `u` by `nodes` is the identity over `space`.
        let direct = |u: ValueRef, nodes: &[usize], space: &Shape| {
            graph.meta(u).1 == space
                && nodes.iter().all(|&i| {
                    graph.nodes[i].inputs.iter().all(|&v| v == u || crate::underlying(graph, &self.folded, v) != u)
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
