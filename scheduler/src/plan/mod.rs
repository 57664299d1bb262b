//! Building a [`Schedule`] from a flush graph and its fusion: streams, events, buffers, frees.
//!
//! Segments keep the flush graph's order (recording order, a topological order); each stream's
//! steps are that order restricted to the stream, so waits can always be satisfied. A vector
//! clock per stream tracks how far it knows every other stream to be: a dependency on another
//! stream's kernel adds a wait only when no earlier wait already implies it. A value's buffer is
//! allocated right before its writer and freed right after its last reader in plan order, on that
//! reader's stream, gated by events recorded after its readers on other streams unless the clock
//! shows they are done. An elementwise kernel writes each output in place over an input of the
//! same shape and dtype (in packed maps, one its own loop alone reads) when it is that value's
//! last reader and every other reader happens-before it, and the
//! input is computed by the same flush or donated to it (an old parameter version under its
//! update); never over another value from before the flush (see `in_place_pairs`). An
//! input an earlier flush left in host memory (`External::offloaded`) is copied into a device
//! buffer on its first reader's stream right before that reader (`copies::copy_in`), and the
//! copy freed after its last reader; the host copy stays the value.

mod copies;
mod uses;

use crate::offload::Decision;
use crate::schedule::*;
use braid_fusion::{Fusion, Segment, SegmentKind};
use braid_graph::{FlushGraph, Op, StreamId, ValueRef};
use copies::{OffloadState, SegOffload};
use hashbrown::HashMap;
use uses::{Readers, Uses};

/// Plans `graph` with the segments of `fusion`.
pub fn plan(graph: &FlushGraph, fusion: Fusion) -> Schedule {
    let mut p = Planner::new(graph, &fusion, &[]);
    for si in 0..fusion.segments.len() {
        p.segment(si);
    }
    let mut schedule = p.finish();
    schedule.fusion = fusion;
    schedule
}

/// Plans `graph` again like `base` (planned by [`plan`] from the same graph), with the
/// offloads `decisions` (see [`crate::offload`]) on [`OFFLOAD_STREAM`].
pub fn plan_with_offloads(graph: &FlushGraph, base: Schedule, decisions: &[Decision]) -> Schedule {
    if decisions.is_empty() {
        return base;
    }
    let end = base.fusion.segments.len();
    let seg = |t: usize| base.kernels.get(t).map_or(end, |k| k.segment);
    let offloads: Vec<SegOffload> = decisions
        .iter()
        .map(|d| SegOffload {
            value: d.value,
            last_use: d.last_use.map(seg),
            release: (d.back_at.is_none_or(|b| d.release < b)).then(|| seg(d.release)),
            back_at: d.back_at.map(seg),
            next_use: seg(d.next_use),
        })
        .collect();
    let fusion = base.fusion;
    let mut p = Planner::new(graph, &fusion, &offloads);
    for si in 0..fusion.segments.len() {
        p.segment(si);
    }
    // Values that outlive the flush come back at its end (unless they stay in host memory).
    let last = p.kernels.last().map_or(0, |k| p.seg_stream[k.segment]);
    for (i, o) in offloads.iter().enumerate() {
        if o.back_at == Some(end) {
            p.copy_back(i, last);
        }
    }
    let mut schedule = p.finish();
    schedule.fusion = fusion;
    schedule
}

struct Planner<'a> {
    graph: &'a FlushGraph,
    segments: &'a [Segment],
    seg_of: Vec<usize>,
    streams: Vec<StreamId>,
    seg_stream: Vec<usize>,
    /// Per stream: kernels emitted so far (a stream's "time").
    count: Vec<u32>,
    /// Per stream: how many kernels of every stream are known complete at its current point.
    clock: Vec<Vec<u32>>,
    /// Per segment: its stream's count right after it.
    seg_point: Vec<u32>,
    steps: Vec<Vec<StreamStep>>,
    events: Vec<EventPlan>,
    event_clock: Vec<Vec<u32>>,
    event_at: HashMap<(usize, u32), EventId>,
    node_readers: Vec<Readers>,
    /// Readers of each external value (those `donated` are freed after their last one).
    ext_readers: Vec<Readers>,
    /// The buffer holding each external now (its own, or where an offload brought it back).
    ext_buffer: Vec<BufferId>,
    /// The copy that brought an offloaded external back, which its later readers wait for.
    ext_producer: Vec<Option<usize>>,
    /// Per external uploaded at its first use, or copied in from host memory (`offloaded`):
    /// whether a reader was planned yet.
    uploaded: Vec<bool>,
    /// Per segment: a segment on another stream depends on it.
    cross_dependents: Vec<bool>,
    /// Per segment: it is the last reader on its stream of a value freed on another stream.
    gates_a_free: Vec<bool>,
    buffers: Vec<BufferPlan>,
    node_buffer: Vec<Option<BufferId>>,
    kernels: Vec<KernelPlan>,
    live: u64,
    peak: u64,
    offloads: &'a [SegOffload],
    offload_state: Vec<OffloadState>,
    /// Per flush node: it is offloaded (never overwritten in place).
    offloaded: Vec<bool>,
}

impl<'a> Planner<'a> {
    fn new(graph: &'a FlushGraph, fusion: &'a Fusion, offloads: &'a [SegOffload]) -> Planner<'a> {
        let segments = fusion.segments.as_slice();
        let mut streams: Vec<StreamId> = graph.nodes.iter().map(|n| n.stream).collect();
        if !offloads.is_empty() {
            streams.push(OFFLOAD_STREAM);
        }
        streams.sort_unstable();
        streams.dedup();
        let sidx = |s: StreamId| streams.binary_search(&s).expect("known stream");
        let seg_stream: Vec<usize> = segments.iter().map(|s| sidx(graph.nodes[s.nodes[0]].stream)).collect();
        // Folded nodes belong to no segment; nothing asks for theirs.
        let mut seg_of = vec![usize::MAX; graph.nodes.len()];
        for (si, s) in segments.iter().enumerate() {
            for &n in &s.nodes {
                seg_of[n] = si;
            }
        }
        let uses = Uses::of(graph, segments, &seg_stream, &seg_of, offloads);
        let Uses { node_readers, ext_readers, cross_dependents, gates_a_free } = uses;
        let mut offloaded = vec![false; graph.nodes.len()];
        for o in offloads {
            if let ValueRef::Node(n) = o.value {
                offloaded[n] = true;
            }
        }
        let ns = streams.len();
        let mut buffers = Vec::with_capacity(graph.externals.len() + graph.nodes.len());
        let mut live = 0;
        for (i, e) in graph.externals.iter().enumerate() {
            // Another device's memory (a transfer's source, or read in place): that device
            // counts it and owns it; this flush only reads it.
            debug_assert!(!(e.held_elsewhere() && e.donated), "another device's value is never donated");
            buffers.push(BufferPlan {
                id: BufferId(i as u32),
                dtype: e.dtype,
                len: e.shape.numel(),
                bytes: e.bytes(),
                space: if e.held_elsewhere() {
                    Space::Remote
                } else if e.offloaded {
                    Space::Host
                } else {
                    Space::Device
                },
                source: BufferSource::External(i),
                persistent: e.persistent,
                upload_at_first_use: e.on_host,
            });
            if !e.on_host && !e.offloaded && !e.held_elsewhere() {
                live += e.bytes() as u64;
            }
        }
        Planner {
            graph,
            segments,
            seg_of,
            seg_stream,
            count: vec![0; ns],
            clock: vec![vec![0; ns]; ns],
            seg_point: vec![0; segments.len()],
            steps: vec![Vec::new(); ns],
            events: Vec::new(),
            event_clock: Vec::new(),
            event_at: HashMap::new(),
            node_readers,
            ext_readers,
            ext_buffer: (0..graph.externals.len() as u32).map(BufferId).collect(),
            ext_producer: vec![None; graph.externals.len()],
            uploaded: vec![false; graph.externals.len()],
            cross_dependents,
            gates_a_free,
            buffers,
            node_buffer: vec![None; graph.nodes.len()],
            kernels: Vec::new(),
            live,
            peak: live,
            streams,
            offloads,
            offload_state: vec![OffloadState::default(); offloads.len()],
            offloaded,
        }
    }

    /// The segment that produces node `n`.
    fn producer(&self, n: usize) -> usize {
        self.seg_of[n]
    }

    /// An event recorded on stream `s` at its current point (shared if one is there already).
    fn record_here(&mut self, s: usize, user_node: Option<usize>) -> EventId {
        let key = (s, self.count[s]);
        if let Some(&e) = self.event_at.get(&key) {
            if user_node.is_some() {
                self.events[e.index()].user_node = user_node;
                self.events[e.index()].auto = false;
            }
            return e;
        }
        let e = EventId(self.events.len() as u32);
        self.events.push(EventPlan { id: e, stream: self.streams[s], auto: user_node.is_none(), user_node });
        self.event_clock.push(self.clock[s].clone());
        self.event_at.insert(key, e);
        self.steps[s].push(StreamStep::Record(e));
        e
    }

    /// Makes stream `s` wait until segment `dep` (on another stream) has run, unless its clock
    /// already says so.
    fn wait_for(&mut self, s: usize, dep: usize) {
        let t = self.seg_stream[dep];
        if t == s || self.clock[s][t] >= self.seg_point[dep] {
            return;
        }
        let e = self.event_at[&(t, self.seg_point[dep])];
        self.wait_event(s, e);
    }

    /// Whether every reader of a value on a stream other than `s` happens-before `s`'s current
    /// point.
    fn others_done(&self, s: usize, readers: &Readers) -> bool {
        readers.by_stream.iter().all(|&(t, seg)| t == s || self.clock[s][t] >= self.seg_point[seg])
    }

    fn alloc(&mut self, s: usize, n: usize) -> BufferId {
        let node = &self.graph.nodes[n];
        let id = BufferId(self.buffers.len() as u32);
        self.buffers.push(BufferPlan {
            id,
            dtype: node.dtype,
            len: node.shape.numel(),
            bytes: node.bytes(),
            space: Space::Device,
            source: BufferSource::Value(n),
            persistent: node.persistent,
            upload_at_first_use: false,
        });
        self.steps[s].push(StreamStep::Alloc(id));
        self.live += node.bytes() as u64;
        self.peak = self.peak.max(self.live);
        id
    }

    fn free(&mut self, s: usize, buffer: BufferId, after: Vec<EventId>) {
        self.steps[s].push(StreamStep::Free { buffer, after });
        self.live -= self.buffers[buffer.index()].bytes as u64;
    }

    /// The inputs a Map segment (or packed maps) may overwrite with its outputs: pairs of
    /// (output position, input position), each output over an input of its dtype and shape that
    /// it reads directly (in packed maps, one its own part alone reads); and, when the only
    /// obstacle was another stream that may still read an input, why not.
    fn in_place_pairs(&self, si: usize, s: usize) -> (Vec<(usize, usize)>, Option<String>) {
        let seg = &self.segments[si];
        let (mut pairs, mut note) = (vec![], None);
        // The part of each output, and the part that alone reads each input (a later part must
        // never write over what an earlier one reads, nor an earlier over a later's input).
        let (output_part, input_part): (Vec<usize>, &[Option<usize>]) = match &seg.kind {
            SegmentKind::Map => (vec![0; seg.outputs.len()], &[]),
            SegmentKind::PackedMaps { parts, input_part } => {
                let part_of: HashMap<usize, usize> = (parts.iter().enumerate())
                    .flat_map(|(k, &n)| std::iter::repeat_n(k, n))
                    .zip(&seg.nodes)
                    .map(|(k, &n)| (n, k))
                    .collect();
                (seg.outputs.iter().map(|n| part_of[n]).collect(), input_part)
            }
            SegmentKind::Single if scatter_base(self.graph, seg).is_some() => (vec![0], &[]),
            _ => return (pairs, note),
        };
        let input_part = |i: usize| if input_part.is_empty() { Some(0) } else { input_part[i] };
        // A scatter writes over its base only (its other inputs are read at other positions).
        let scatter = scatter_base(self.graph, seg);
        for (o, &out) in seg.outputs.iter().enumerate() {
            let node = &self.graph.nodes[out];
            for (i, &v) in seg.inputs.iter().enumerate() {
                let (dtype, shape) = self.graph.meta(v);
                let taken = pairs.iter().any(|&(_, input)| input == i);
                let direct = scatter.map_or(seg.direct[i], |base| base == i);
                if taken || !direct || dtype != node.dtype || shape != &node.shape {
                    continue;
                }
                if input_part(i) != Some(output_part[o]) {
                    continue;
                }
                // Values computed by this flush, and donated inputs (an old version of a
                // parameter under its update): nothing outside the flush reads them. Never
                // another input: its buffer may still be read by someone else (a download in
                // progress), and a retry after a failure would read the overwritten value.
                // Parameter memory (exact-size) holds parameters only, and they hold nothing
                // else. A value hinted for offload keeps its own buffer, so that it can leave.
                let input = |n: usize| &self.graph.nodes[n];
                let overwritable = |n: usize| {
                    !input(n).keep
                        && !self.offloaded[n]
                        && !input(n).offload_hint
                        && input(n).persistent == node.persistent
                };
                let readers = match v {
                    ValueRef::Node(n) if overwritable(n) => &self.node_readers[n],
                    ValueRef::External(e) if self.overwritable_external(e, node.persistent) => &self.ext_readers[e],
                    _ => continue,
                };
                if readers.last != Some(si) {
                    continue;
                }
                if self.others_done(s, readers) {
                    pairs.push((o, i));
                    break;
                }
                let busy: Vec<String> = readers
                    .by_stream
                    .iter()
                    .filter(|&&(t, seg)| t != s && self.clock[s][t] < self.seg_point[seg])
                    .map(|&(t, _)| self.streams[t].0.to_string())
                    .collect();
                note =
                    Some(format!("input {i} not overwritten in place: stream {} may still read it", busy.join(", ")));
            }
        }
        (pairs, note)
    }

    /// Whether input `e` may hold a new value in place: donated device data that may be
    /// overwritten (see `External::overwritable`), in its own buffer for the whole flush (not
    /// offloaded), and a parameter exactly when the new value is one (parameters live in
    /// exact-size memory).
    fn overwritable_external(&self, e: usize, persistent: bool) -> bool {
        let ext = &self.graph.externals[e];
        ext.overwritable
            && ext.persistent == persistent
            && self.ext_buffer[e] == BufferId(e as u32)
            && !self.offloads.iter().any(|o| o.value == ValueRef::External(e))
    }

    fn segment(&mut self, si: usize) {
        let s = self.seg_stream[si];
        if si == 0 {
            // Donated inputs idle from the start leave at once.
            for i in 0..self.offloads.len() {
                if self.offloads[i].last_use.is_none() {
                    self.copy_out(i);
                }
            }
        }
        // Values planned out of device memory from here go first, then values coming back:
        // the choice of offloads counted them as simultaneous.
        for i in 0..self.offloads.len() {
            if self.offloads[i].release == Some(si) {
                // Planned without the value from here: wait until its copy out is done.
                let e = self.offload_state[i].out_done.expect("the copy out is planned first");
                self.wait_event(s, e);
                self.live -= self.bytes_of(self.offloads[i].value);
            }
        }
        for i in 0..self.offloads.len() {
            if self.offloads[i].back_at == Some(si) {
                self.copy_back(i, s);
            }
        }
        self.segment_steps(si);
        for i in 0..self.offloads.len() {
            if self.offloads[i].last_use == Some(si) {
                self.copy_out(i);
            }
        }
    }

    /// Makes stream `s` wait for event `e` (of another stream) and learn its clock.
    fn wait_event(&mut self, s: usize, e: EventId) {
        self.steps[s].push(StreamStep::Wait(e));
        let theirs = self.event_clock[e.index()].clone();
        for (mine, &other) in self.clock[s].iter_mut().zip(&theirs) {
            *mine = (*mine).max(other);
        }
    }

    fn segment_steps(&mut self, si: usize) {
        let s = self.seg_stream[si];
        let segments = self.segments;
        let seg = &segments[si];
        // Dependencies on other streams: data inputs and control edges.
        let mut deps: Vec<usize> = seg
            .inputs
            .iter()
            .filter_map(|v| match *v {
                ValueRef::Node(n) => Some(self.producer(n)),
                ValueRef::External(e) => self.ext_producer[e],
            })
            .collect();
        for &n in &seg.nodes {
            deps.extend(self.graph.nodes[n].after.iter().map(|&a| self.producer(a)));
        }
        // Waiting for the latest dependency of a stream implies the earlier ones.
        deps.sort_unstable_by_key(|&d| std::cmp::Reverse((self.seg_stream[d], self.seg_point[d])));
        deps.dedup_by_key(|d| self.seg_stream[*d]);
        for dep in deps {
            self.wait_for(s, dep);
        }
        let graph = self.graph;
        let first = &graph.nodes[seg.nodes[0]];
        if first.op == Op::Event {
            // A user event: a point in the stream, no kernel.
            self.seg_point[si] = self.count[s];
            if self.cross_dependents[si] || first.keep {
                self.record_here(s, Some(seg.nodes[0]));
            }
            return;
        }
        // Values an earlier flush left in host memory come into device memory first.
        for &v in &seg.inputs {
            if let ValueRef::External(e) = v
                && self.graph.externals[e].offloaded
                && !std::mem::replace(&mut self.uploaded[e], true)
            {
                self.copy_in(e, s);
            }
        }
        let input_buffers: Vec<BufferId> = seg.inputs.iter().map(|&v| self.buffer_of(v)).collect();
        // Donated host data takes device memory from its first reader on (uploaded then).
        for &v in &seg.inputs {
            if let ValueRef::External(e) = v
                && self.graph.externals[e].on_host
                && !std::mem::replace(&mut self.uploaded[e], true)
            {
                self.live += self.graph.externals[e].bytes() as u64;
                self.peak = self.peak.max(self.live);
            }
        }
        let (in_place, note) = self.in_place_pairs(si, s);
        let mut outputs = Vec::with_capacity(seg.outputs.len());
        for (o, &n) in seg.outputs.iter().enumerate() {
            let b = match in_place.iter().find(|&&(out, _)| out == o) {
                Some(&(_, i)) => input_buffers[i],
                None => self.alloc(s, n),
            };
            self.node_buffer[n] = Some(b);
            outputs.push(b);
        }
        if seg.kind == SegmentKind::Transfer {
            // Another device's value, copied into this device's memory: a step, not a kernel.
            let value = ValueRef::Node(seg.nodes[0]);
            self.steps[s].push(StreamStep::Copy { from: input_buffers[0], to: outputs[0], value });
        } else {
            let kid = KernelId(self.kernels.len() as u32);
            self.kernels.push(KernelPlan {
                id: kid,
                stream: self.streams[s],
                segment: si,
                inputs: input_buffers.clone(),
                outputs,
                in_place: in_place.clone(),
                note,
            });
            self.steps[s].push(StreamStep::Kernel(kid));
        }
        self.count[s] += 1;
        self.clock[s][s] = self.count[s];
        self.seg_point[si] = self.count[s];
        // Frees: inputs whose last reader this is (unless overwritten in place or kept), and
        // donated flush inputs after their last reader, and the device copies of inputs
        // copied in from host memory (the host copy stays the value).
        for (i, v) in seg.inputs.iter().enumerate() {
            if seg.inputs[..i].contains(v) {
                continue; // read twice by this kernel: freed once
            }
            let readers = match *v {
                ValueRef::Node(n) if !self.graph.nodes[n].keep => &self.node_readers[n],
                ValueRef::External(e) if self.graph.externals[e].donated || self.graph.externals[e].offloaded => {
                    &self.ext_readers[e]
                }
                _ => continue,
            };
            if readers.last != Some(si) || in_place.iter().any(|&(_, input)| input == i) {
                continue;
            }
            let after = readers
                .by_stream
                .iter()
                .filter(|&&(t, seg)| t != s && self.clock[s][t] < self.seg_point[seg])
                .map(|&(t, seg)| self.event_at[&(t, self.seg_point[seg])])
                .collect();
            self.free(s, input_buffers[i], after);
        }
        // Values nobody reads and nobody keeps are freed at once.
        for &n in &seg.outputs {
            if self.node_readers[n].last.is_none() && !self.graph.nodes[n].keep {
                let b = self.node_buffer[n].expect("planned");
                self.free(s, b, Vec::new());
            }
        }
        // The event goes after the frees: whatever waits for it (a copy back that allocates)
        // then finds the memory the planner counted as free.
        if self.cross_dependents[si] || self.gates_a_free[si] {
            self.record_here(s, None);
        }
    }

    fn finish(mut self) -> Schedule {
        // Drop records nobody waits for (kept: user events, which a later flush may name).
        let used: hashbrown::HashSet<EventId> = self
            .steps
            .iter()
            .flatten()
            .flat_map(|st| match st {
                StreamStep::Wait(e) => vec![*e],
                StreamStep::Free { after, .. } => after.clone(),
                _ => Vec::new(),
            })
            .collect();
        let keep_event = |e: &EventId, events: &[EventPlan]| used.contains(e) || events[e.index()].user_node.is_some();
        for steps in &mut self.steps {
            steps.retain(|st| !matches!(st, StreamStep::Record(e) if !keep_event(e, &self.events)));
        }
        let graph = self.graph;
        let offloads = self
            .offloads
            .iter()
            .zip(&self.offload_state)
            .map(|(o, st)| OffloadPlan {
                value: o.value,
                device: st.device.expect("planned"),
                host: st.host.expect("planned"),
                back: st.back,
                back_before: self.kernels.iter().find(|k| k.segment == o.next_use).map(|k| k.id),
            })
            .collect();
        // A value that stays in host memory past the flush is its host copy there.
        let on_host = |i: usize| {
            self.offloads.iter().zip(&self.offload_state).find_map(|(o, st)| {
                (o.value == ValueRef::Node(i) && o.back_at.is_none()).then(|| st.host.expect("planned"))
            })
        };
        let outputs = graph
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.keep && n.op != Op::Event)
            .map(|(i, _)| (i, on_host(i).unwrap_or_else(|| self.node_buffer[i].expect("kept value has a buffer"))))
            .collect();
        Schedule {
            streams: self
                .streams
                .iter()
                .zip(self.steps)
                .map(|(&stream, steps)| StreamSchedule { stream, steps })
                .collect(),
            buffers: self.buffers,
            kernels: self.kernels,
            events: self.events,
            fusion: Fusion::default(),
            external_buffers: (0..graph.externals.len() as u32).map(BufferId).collect(),
            outputs,
            planned_peak_bytes: self.peak,
            offloads,
            memory_budget: None,
        }
    }
}

/// For a segment that is one scatter (`Op::Scatter`) reading its base as it lies (no movement
/// folded into the load) and through no other input: the base's input position, which the
/// scatter may overwrite in place (then only the source's elements are written).
fn scatter_base(graph: &FlushGraph, seg: &Segment) -> Option<usize> {
    let [n] = seg.nodes[..] else { return None };
    let node = &graph.nodes[n];
    let Op::Scatter { .. } = node.op else { return None };
    // Three distinct values: the base is read by the base's load alone.
    if seg.inputs.len() != 3 {
        return None;
    }
    seg.inputs.iter().position(|&v| v == node.inputs[0])
}
