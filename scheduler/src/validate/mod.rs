//! The validator: proves a schedule safe before it runs, or names the hazard.
//!
//! It builds the happens-before order of a schedule (each stream's program order, plus every
//! record before its waits and before the frees gated on it), computes a vector clock per step,
//! and checks: every waited event is recorded and reachable (no deadlock); every pair of
//! conflicting accesses to a buffer (a write, an allocation or a free against anything) is
//! ordered; replayed in that order, every read sees the value it expects (no read before the
//! write, no buffer overwritten or freed while a reader still needs it); and no kernel holds
//! nodes of two streams. It works on [`Program`], which both a live schedule and a dump read
//! back from JSON convert into, so `braid inspect` checks files exactly as the engine checks
//! schedules. It never changes a schedule.

use crate::dump::{Dump, DumpStep};
use crate::schedule::{BufferSource, Schedule, StreamStep};
use braid_graph::FlushGraph;
use hashbrown::HashMap;
use std::collections::VecDeque;
use std::fmt;

mod buffers;
use buffers::{HappensBefore, accesses, races, replay};

/// A step of a [`Program`]; buffers and events are small integers, values are node ids.
#[derive(Clone, Debug, PartialEq)]
pub enum PStep {
    Kernel { label: String, reads: Vec<(u32, u64)>, writes: Vec<(u32, u64)>, node_streams: Vec<u32> },
    Alloc(u32),
    Free { buffer: u32, after: Vec<u32> },
    Record(u32),
    Wait(u32),
}

/// What the validator checks: per stream, its steps; and the buffers that hold a value before
/// the schedule starts.
#[derive(Clone, Debug, Default)]
pub struct Program {
    pub streams: Vec<(u32, Vec<PStep>)>,
    pub initial: Vec<(u32, u64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HazardKind {
    /// A read not ordered after the write it needs, or before any write.
    ReadAfterWrite,
    /// A buffer overwritten (or reused) while an earlier value still has readers.
    WriteAfterRead,
    /// Two writes to one buffer with no order between them.
    WriteAfterWrite,
    /// A buffer read, written or freed after it was freed, or freed while still in use.
    UseAfterFree,
    /// A wait that can never be satisfied (no record, or a cycle through events).
    Deadlock,
    /// A kernel with nodes of two streams.
    CrossStreamFusion,
}

/// Where a step is: stream, position, and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRef {
    pub stream: u32,
    pub index: usize,
    pub label: String,
}

impl fmt::Display for StepRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (stream {}, step {})", self.label, self.stream, self.index)
    }
}

/// A problem found in a schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hazard {
    pub kind: HazardKind,
    pub buffer: Option<String>,
    pub steps: Vec<StepRef>,
    pub message: String,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.kind)?;
        if let Some(b) = &self.buffer {
            write!(f, " on {b}")?;
        }
        write!(f, ": {}", self.message)
    }
}

fn label(step: &PStep) -> String {
    match step {
        PStep::Kernel { label, .. } => label.clone(),
        PStep::Alloc(b) => format!("alloc b{b}"),
        PStep::Free { buffer, .. } => format!("free b{buffer}"),
        PStep::Record(e) => format!("record e{e}"),
        PStep::Wait(e) => format!("wait e{e}"),
    }
}

impl Program {
    /// The program of a live schedule (values named by recorded-graph node ids).
    pub fn from_schedule(schedule: &Schedule, graph: &FlushGraph) -> Program {
        let value = |b: &crate::BufferPlan| match b.source {
            BufferSource::External(e) | BufferSource::CopyOf(e) => graph.externals[e].id.index() as u64,
            BufferSource::Value(n) => graph.nodes[n].id.index() as u64,
        };
        let initial = schedule
            .buffers
            .iter()
            .filter(|b| matches!(b.source, BufferSource::External(_)))
            .map(|b| (b.id.0, value(b)))
            .collect();
        let streams = schedule
            .streams
            .iter()
            .map(|st| {
                let steps = st
                    .steps
                    .iter()
                    .map(|step| match step {
                        StreamStep::Kernel(k) => {
                            let (plan, seg) = schedule.kernel_and_segment(*k);
                            let ops: Vec<&str> = seg.nodes.iter().map(|&n| graph.nodes[n].op.name()).collect();
                            PStep::Kernel {
                                label: format!("{k} {}", ops.join("+")),
                                reads: plan
                                    .inputs
                                    .iter()
                                    .zip(&seg.inputs)
                                    .map(|(b, v)| (b.0, value_of(graph, *v)))
                                    .collect(),
                                writes: plan
                                    .outputs
                                    .iter()
                                    .zip(&seg.outputs)
                                    .map(|(b, &n)| (b.0, graph.nodes[n].id.index() as u64))
                                    .collect(),
                                node_streams: seg.nodes.iter().map(|&n| graph.nodes[n].stream.0).collect(),
                            }
                        }
                        StreamStep::Copy { from, to, value: written } => PStep::Kernel {
                            label: format!("copy {from} -> {to}"),
                            // A transfer reads another device's value; an offload copies the
                            // value it moves.
                            reads: vec![(
                                from.0,
                                match &schedule.buffers[from.index()] {
                                    b if b.space == crate::Space::Remote => value(b),
                                    _ => value_of(graph, *written),
                                },
                            )],
                            writes: vec![(to.0, value_of(graph, *written))],
                            node_streams: Vec::new(),
                        },
                        StreamStep::Alloc(b) => PStep::Alloc(b.0),
                        StreamStep::Free { buffer, after } => {
                            PStep::Free { buffer: buffer.0, after: after.iter().map(|e| e.0).collect() }
                        }
                        StreamStep::Record(e) => PStep::Record(e.0),
                        StreamStep::Wait(e) => PStep::Wait(e.0),
                    })
                    .collect();
                (st.stream.0, steps)
            })
            .collect();
        Program { streams, initial }
    }

    /// The program of a dump read back from JSON. Errors name what is malformed.
    pub fn from_dump(dump: &Dump) -> Result<Program, String> {
        let num = |s: &str, prefix: char| -> Result<u32, String> {
            s.strip_prefix(prefix).and_then(|n| n.parse().ok()).ok_or_else(|| format!("malformed id {s:?}"))
        };
        let initial = dump
            .buffers
            .iter()
            .filter(|b| b.external)
            .map(|b| Ok((num(&b.id, 'b')?, b.node.unwrap_or(u32::MAX) as u64)))
            .collect::<Result<_, String>>()?;
        let mut streams = Vec::new();
        for st in &dump.streams {
            let mut steps = Vec::new();
            for step in &st.steps {
                steps.push(match step {
                    DumpStep::Kernel { id, ops, inputs, outputs, input_nodes, output_nodes, node_streams, .. } => {
                        let pair = |bufs: &[String], nodes: &[u32]| -> Result<Vec<(u32, u64)>, String> {
                            bufs.iter()
                                .enumerate()
                                .map(|(i, b)| {
                                    Ok((num(b, 'b')?, nodes.get(i).map_or(u64::MAX - i as u64, |&n| n as u64)))
                                })
                                .collect()
                        };
                        PStep::Kernel {
                            label: format!("{id} {}", ops.join("+")),
                            reads: pair(inputs, input_nodes)?,
                            writes: pair(outputs, output_nodes)?,
                            node_streams: node_streams.clone(),
                        }
                    }
                    DumpStep::Alloc { buffer } => PStep::Alloc(num(buffer, 'b')?),
                    DumpStep::Free { buffer, after } => PStep::Free {
                        buffer: num(buffer, 'b')?,
                        after: after.iter().map(|e| num(e, 'e')).collect::<Result<_, _>>()?,
                    },
                    DumpStep::Record { event } => PStep::Record(num(event, 'e')?),
                    DumpStep::Wait { event } => PStep::Wait(num(event, 'e')?),
                    DumpStep::Copy { from, to, node, .. } => {
                        let v = node.ok_or_else(|| format!("copy {from} -> {to} does not name the value it copies"))?;
                        // A transfer's source holds the other device's value its buffer names.
                        let read = match dump.buffers.iter().find(|b| &b.id == from) {
                            Some(b) if b.space == "remote" => b.node.unwrap_or(v),
                            _ => v,
                        };
                        PStep::Kernel {
                            label: format!("copy {from} -> {to}"),
                            reads: vec![(num(from, 'b')?, read as u64)],
                            writes: vec![(num(to, 'b')?, v as u64)],
                            node_streams: Vec::new(),
                        }
                    }
                });
            }
            streams.push((st.id, steps));
        }
        Ok(Program { streams, initial })
    }
}

fn value_of(graph: &FlushGraph, v: braid_graph::ValueRef) -> u64 {
    match v {
        braid_graph::ValueRef::Node(n) => graph.nodes[n].id.index() as u64,
        braid_graph::ValueRef::External(e) => graph.externals[e].id.index() as u64,
    }
}

/// Checks a live schedule.
pub fn validate(schedule: &Schedule, graph: &FlushGraph) -> Result<(), Vec<Hazard>> {
    check(&Program::from_schedule(schedule, graph))
}

/// Checks only that every wait can be satisfied (cheap; run before every execution so that a
/// bad schedule is an error, never a hang).
pub fn check_reachable(schedule: &Schedule, graph: &FlushGraph) -> Result<(), Hazard> {
    // Without waits or gated frees every step is reachable in program order.
    let waits = schedule.streams.iter().flat_map(|s| &s.steps).any(|step| match step {
        StreamStep::Wait(_) => true,
        StreamStep::Free { after, .. } => !after.is_empty(),
        _ => false,
    });
    if !waits {
        return Ok(());
    }
    let p = Program::from_schedule(schedule, graph);
    order(&p, &Lanes::new(&p)).map(|_| ())
}

type Pos = (usize, usize);

/// The happens-before structure of a program. Each step sits on a lane: its stream's lane, in
/// program order; except a free gated on events, which runs when those events are reached while
/// its stream goes on, so it gets a lane of its own (after its stream's previous step and the
/// events). `lane[s][i]` and `slot[s][i]` place step `(s, i)`.
struct Lanes {
    lane: Vec<Vec<usize>>,
    slot: Vec<Vec<u32>>,
    /// The step of the same stream this one follows (skipping gated frees).
    chain: Vec<Vec<Option<usize>>>,
    /// Events a step waits for (waits and gated frees).
    events: Vec<Vec<Vec<u32>>>,
    count: usize,
}

impl Lanes {
    fn new(p: &Program) -> Lanes {
        let ns = p.streams.len();
        let mut l = Lanes { lane: Vec::new(), slot: Vec::new(), chain: Vec::new(), events: Vec::new(), count: ns };
        for (s, (_, steps)) in p.streams.iter().enumerate() {
            let (mut lane, mut slot, mut chain, mut events) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut prev: Option<usize> = None;
            let mut pos = 0u32;
            for (i, st) in steps.iter().enumerate() {
                chain.push(prev);
                match st {
                    PStep::Free { after, .. } if !after.is_empty() => {
                        lane.push(l.count);
                        slot.push(0);
                        l.count += 1;
                        events.push(after.clone());
                    }
                    _ => {
                        lane.push(s);
                        slot.push(pos);
                        pos += 1;
                        prev = Some(i);
                        events.push(if let PStep::Wait(e) = st { vec![*e] } else { Vec::new() });
                    }
                }
            }
            l.lane.push(lane);
            l.slot.push(slot);
            l.chain.push(chain);
            l.events.push(events);
        }
        l
    }
}

/// A topological order of all steps, or the deadlock that prevents one.
fn order(p: &Program, lanes: &Lanes) -> Result<Vec<Pos>, Hazard> {
    let step_ref = |(s, i): Pos| StepRef { stream: p.streams[s].0, index: i, label: label(&p.streams[s].1[i]) };
    let mut records: HashMap<u32, Pos> = HashMap::new();
    for (s, (_, steps)) in p.streams.iter().enumerate() {
        for (i, st) in steps.iter().enumerate() {
            if let PStep::Record(e) = st
                && records.insert(*e, (s, i)).is_some()
            {
                return Err(Hazard {
                    kind: HazardKind::Deadlock,
                    buffer: None,
                    steps: vec![step_ref((s, i))],
                    message: format!("event e{e} is recorded twice"),
                });
            }
        }
    }
    let mut indeg: Vec<Vec<usize>> = p.streams.iter().map(|(_, st)| vec![0; st.len()]).collect();
    let mut next: Vec<Vec<Vec<usize>>> = p.streams.iter().map(|(_, st)| vec![Vec::new(); st.len()]).collect();
    let mut waiters: HashMap<u32, Vec<Pos>> = HashMap::new();
    for (s, (_, steps)) in p.streams.iter().enumerate() {
        for (i, st) in steps.iter().enumerate() {
            if let Some(j) = lanes.chain[s][i] {
                indeg[s][i] += 1;
                next[s][j].push(i);
            }
            for e in &lanes.events[s][i] {
                if !records.contains_key(e) {
                    return Err(Hazard {
                        kind: HazardKind::Deadlock,
                        buffer: None,
                        steps: vec![step_ref((s, i))],
                        message: format!(
                            "{} on stream {} waits for event e{e}, which no stream records in this flush",
                            label(st),
                            p.streams[s].0
                        ),
                    });
                }
                indeg[s][i] += 1;
                waiters.entry(*e).or_default().push((s, i));
            }
        }
    }
    let mut ready: VecDeque<Pos> = (0..p.streams.len())
        .flat_map(|s| (0..indeg[s].len()).map(move |i| (s, i)))
        .filter(|&(s, i)| indeg[s][i] == 0)
        .collect();
    let mut out = Vec::with_capacity(indeg.iter().map(Vec::len).sum());
    while let Some((s, i)) = ready.pop_front() {
        out.push((s, i));
        let mut release = |pos: Pos, ready: &mut VecDeque<Pos>| {
            indeg[pos.0][pos.1] -= 1;
            if indeg[pos.0][pos.1] == 0 {
                ready.push_back(pos);
            }
        };
        for &j in &next[s][i] {
            release((s, j), &mut ready);
        }
        if let PStep::Record(e) = &p.streams[s].1[i] {
            for &w in waiters.get(e).map(Vec::as_slice).unwrap_or(&[]) {
                release(w, &mut ready);
            }
        }
    }
    if out.len() < indeg.iter().map(Vec::len).sum::<usize>() {
        // A waiting step that never became ready is blocked on a cycle.
        let blocked = (0..p.streams.len())
            .flat_map(|s| (0..p.streams[s].1.len()).map(move |i| (s, i)))
            .find(|&(s, i)| indeg[s][i] > 0 && !lanes.events[s][i].is_empty())
            .unwrap_or((0, 0));
        return Err(Hazard {
            kind: HazardKind::Deadlock,
            buffer: None,
            steps: vec![step_ref(blocked)],
            message: format!(
                "{} on stream {} can never be reached: its events wait on each other in a cycle",
                label(&p.streams[blocked.0].1[blocked.1]),
                p.streams[blocked.0].0
            ),
        });
    }
    Ok(out)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Access {
    Alloc,
    Read(u64),
    Write(u64),
    Free,
}

/// Checks a program; returns every hazard found.
pub fn check(p: &Program) -> Result<(), Vec<Hazard>> {
    let lanes = Lanes::new(p);
    let order = order(p, &lanes).map_err(|h| vec![h])?;
    let hb = HappensBefore::new(p, &lanes, &order);
    let (mut accesses, mut hazards) = accesses(p);
    let initial: HashMap<u32, u64> = p.initial.iter().copied().collect();
    let mut buffers: Vec<u32> = accesses.keys().copied().collect();
    buffers.sort_unstable();
    for b in buffers {
        let mut acc = accesses.remove(&b).expect("key");
        // 1. Conflicting accesses must be ordered; 2. replayed in that order, every access
        // finds the buffer in the right state.
        let raced = races(p, &hb, b, &acc);
        if raced.is_empty() {
            hazards.extend(replay(p, &hb, b, &mut acc, initial.get(&b).copied()));
        } else {
            hazards.extend(raced);
        }
    }
    if hazards.is_empty() { Ok(()) } else { Err(hazards) }
}
