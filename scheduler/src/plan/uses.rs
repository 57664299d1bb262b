//! Who reads each value of a flush, on which streams, and which segments therefore need an
//! event recorded after them: the facts the planner's frees and waits are built from. It only
//! reads the graph and its segments; it plans nothing.

use super::copies::SegOffload;
use braid_fusion::Segment;
use braid_graph::{FlushGraph, ValueRef};

/// Who reads a value: per reading stream, the last reading segment; and the last reader overall.
#[derive(Default, Clone)]
pub(super) struct Readers {
    pub(super) last: Option<usize>,
    pub(super) by_stream: Vec<(usize, usize)>,
}

impl Readers {
    pub(super) fn add(&mut self, seg: usize, stream: usize) {
        self.last = Some(seg);
        match self.by_stream.iter_mut().find(|(s, _)| *s == stream) {
            Some(entry) => entry.1 = seg,
            None => self.by_stream.push((stream, seg)),
        }
    }
}

/// Who reads what, and which segments need an event recorded after them.
pub(super) struct Uses {
    pub(super) node_readers: Vec<Readers>,
    /// Readers of each external value (those `donated` are freed after their last one).
    pub(super) ext_readers: Vec<Readers>,
    /// Per segment: a segment on another stream depends on it (or an offload's copy out).
    pub(super) cross_dependents: Vec<bool>,
    /// Per segment: it is the last reader on its stream of a value freed on another stream.
    pub(super) gates_a_free: Vec<bool>,
}

impl Uses {
    pub(super) fn of(
        graph: &FlushGraph,
        segments: &[Segment],
        seg_stream: &[usize],
        seg_of: &[usize],
        offloads: &[SegOffload],
    ) -> Uses {
        let mut node_readers = vec![Readers::default(); graph.nodes.len()];
        let mut ext_readers = vec![Readers::default(); graph.externals.len()];
        let mut cross_dependents = vec![false; segments.len()];
        for (si, seg) in segments.iter().enumerate() {
            let st = seg_stream[si];
            for v in &seg.inputs {
                match *v {
                    ValueRef::Node(n) => {
                        node_readers[n].add(si, st);
                        if seg_stream[seg_of[n]] != st {
                            cross_dependents[seg_of[n]] = true;
                        }
                    }
                    ValueRef::External(e) => ext_readers[e].add(si, st),
                }
            }
            for &n in &seg.nodes {
                for &a in &graph.nodes[n].after {
                    if seg_stream[seg_of[a]] != st {
                        cross_dependents[seg_of[a]] = true;
                    }
                }
            }
        }
        // The copy out of an offloaded value waits for its readers so far on every stream.
        for o in offloads {
            for (si, seg) in segments.iter().enumerate().take(o.last_use.map_or(0, |l| l + 1)) {
                let writes = matches!(o.value, ValueRef::Node(n) if seg.outputs.contains(&n));
                if seg.inputs.contains(&o.value) || writes {
                    cross_dependents[si] = true;
                }
            }
        }
        let mut gates_a_free = vec![false; segments.len()];
        let freed_here = node_readers.iter().enumerate().filter(|&(n, _)| !graph.nodes[n].keep).map(|(_, r)| r).chain(
            ext_readers
                .iter()
                .enumerate()
                .filter(|&(e, _)| graph.externals[e].donated || graph.externals[e].offloaded)
                .map(|(_, r)| r),
        );
        for r in freed_here {
            if let Some(last) = r.last {
                for &(st, seg) in &r.by_stream {
                    if st != seg_stream[last] {
                        gates_a_free[seg] = true;
                    }
                }
            }
        }
        Uses { node_readers, ext_readers, cross_dependents, gates_a_free }
    }
}
