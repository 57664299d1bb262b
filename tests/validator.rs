//! The validator against planted hazards. Random multi-stream flush graphs (with user events,
//! control edges, values read on several streams, in-place candidates) are planned; every plan
//! must validate. Then hazards are planted (a wait dropped, a record dropped, a free moved
//! earlier, a buffer reused early) and an independent oracle (random interleavings of the
//! streams, executed against a model of the buffers) confirms which corruptions really break
//! something. The validator must name every confirmed hazard with its buffer and both steps, and
//! must not report hazards in the plans the planner produced.

mod common;

use braid_graph::table::{BinaryOp, UnaryOp};
use braid_graph::{DType, DeviceId, External, FlushGraph, FlushNode, NodeId, Op, Shape, StreamId, ValueRef};
use braid_scheduler::{BufferSource, HazardKind, Schedule, StreamStep, offload, plan, validate};
use common::Rng;
use hashbrown::HashMap;

fn random_graph(rng: &mut Rng) -> FlushGraph {
    // 16 f32 = 64 bytes: budgets below the planned peak are then reachable (allocations are
    // counted in 64-byte units).
    let shape = Shape::from([16]);
    let streams = 1 + rng.below(3) as u32;
    let mut g = FlushGraph::default();
    for i in 0..1 + rng.below(3) {
        // Sometimes another CPU device's value, read in place (never donated).
        let foreign = i == 1 && rng.chance(0.5);
        g.externals.push(External {
            id: NodeId::new(1000 + i),
            dtype: DType::F32,
            shape: shape.clone(),
            device: DeviceId(foreign as u32),
            stream: StreamId(0),
            donated: i % 2 == 0,
            on_host: i == 2,
            // Sometimes left in host memory by an earlier flush's offload (copied in first).
            offloaded: i < 2 && !foreign && rng.chance(0.3),
            persistent: false,
            overwritable: false,
            remote: false,
            foreign,
        });
    }
    // Sometimes a value of another device, which only transfers read (copy steps).
    let locals = g.externals.len();
    if rng.chance(0.5) {
        g.externals.push(External {
            id: NodeId::new(2000),
            dtype: DType::F32,
            shape: shape.clone(),
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
    }
    let n = 4 + rng.below(16);
    for i in 0..n {
        let stream = StreamId(rng.below(streams as usize) as u32);
        let values: Vec<usize> = (0..i).filter(|&j| g.nodes[j].op != Op::Event).collect();
        let pick = |rng: &mut Rng| {
            if values.is_empty() || rng.chance(0.25) {
                ValueRef::External(rng.below(locals))
            } else {
                ValueRef::Node(*rng.pick(&values))
            }
        };
        let mut after = smallvec::SmallVec::new();
        let (op, inputs) = if i > 0 && rng.chance(0.12) {
            // A user event after an earlier node of its stream.
            if let Some(j) = (0..i).rev().find(|&j| g.nodes[j].stream == stream) {
                after.push(j);
            }
            (Op::Event, vec![])
        } else if g.externals.len() > locals && rng.chance(0.15) {
            // A transfer, on its stream or on the copy stream.
            (Op::ToDevice, vec![ValueRef::External(locals)])
        } else if rng.chance(0.4) {
            (Op::Unary(UnaryOp::Exp), vec![pick(rng)])
        } else {
            (Op::Binary(BinaryOp::Add), vec![pick(rng), pick(rng)])
        };
        // Sometimes wait for an earlier user event.
        if let Some(e) = (0..i).rev().find(|&j| g.nodes[j].op == Op::Event)
            && rng.chance(0.3)
        {
            after.push(e);
        }
        let (dtype, shape) =
            if op == Op::Event { (DType::Bool, Shape::from([0])) } else { (DType::F32, shape.clone()) };
        let stream = if op == Op::ToDevice && rng.chance(0.5) { braid_scheduler::COPY_STREAM } else { stream };
        g.nodes.push(FlushNode {
            id: NodeId::new(i),
            op,
            dtype,
            shape,
            device: DeviceId(0),
            stream,
            inputs: inputs.into(),
            after,
            keep: false,
            offload_hint: rng.chance(0.25),
            persistent: rng.chance(0.2),
            recomputed: false,
        });
    }
    // Keep values nobody reads (the flush's results) and a few others.
    let read: Vec<bool> =
        (0..n).map(|j| g.nodes.iter().any(|m| m.inputs.contains(&ValueRef::Node(j)) || m.after.contains(&j))).collect();
    for (node, &is_read) in g.nodes.iter_mut().zip(&read) {
        node.keep = !is_read || rng.chance(0.1);
    }
    assert!(g.is_topological());
    g
}

/// A plan; half the time with offloads, for a random budget below the plain plan's peak (or
/// only for the hinted values when that budget is out of reach).
fn schedule_for(g: &FlushGraph, rng: &mut Rng) -> Schedule {
    if rng.chance(0.5) {
        return plan(g, braid_fusion::segment(g, &braid_fusion::Options::default()));
    }
    // Unfused plans have more kernels, so more idle gaps to offload in.
    let options = braid_fusion::Options { enabled: rng.chance(0.3), ..Default::default() };
    let base = plan(g, braid_fusion::segment(g, &options));
    let budget = (base.planned_peak_bytes as f64 * rng.uniform(0.3, 0.95)) as u64;
    let model = braid_scheduler::CostModel::CPU;
    let decisions = offload::choose(g, &base, Some(budget), &model)
        .or_else(|_| offload::choose(g, &base, None, &model))
        .expect("hints alone always place");
    braid_scheduler::plan_with_offloads(g, base, &decisions)
}

/// The oracle: runs the schedule's streams in random interleavings against a model of the
/// buffers. `Some(reason)` if some interleaving reads a wrong or missing value, writes or
/// frees a buffer that is not live, or cannot finish (deadlock).
fn oracle(s: &Schedule, g: &FlushGraph, rng: &mut Rng) -> Option<String> {
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum B {
        Unallocated,
        Allocated,
        Holds(usize),
        Freed,
    }
    let value_of = |v: ValueRef| match v {
        ValueRef::Node(n) => n,
        ValueRef::External(e) => 1_000_000 + e,
    };
    for round in 0..300 {
        let mut state: Vec<B> = s
            .buffers
            .iter()
            .map(|b| match b.source {
                BufferSource::External(e) => B::Holds(1_000_000 + e),
                BufferSource::Value(_) | BufferSource::CopyOf(_) => B::Unallocated,
            })
            .collect();
        let mut pc = vec![0usize; s.streams.len()];
        let mut recorded: Vec<bool> = vec![false; s.events.len()];
        let mut pending_frees: Vec<(usize, Vec<usize>)> = Vec::new();
        loop {
            let ready: Vec<usize> = (0..s.streams.len())
                .filter(|&i| match s.streams[i].steps.get(pc[i]) {
                    None => false,
                    Some(StreamStep::Wait(e)) => recorded.get(e.index()).copied().unwrap_or(false),
                    Some(_) => true,
                })
                .collect();
            if ready.is_empty() {
                if (0..s.streams.len()).any(|i| pc[i] < s.streams[i].steps.len()) {
                    return Some("deadlock: no stream can proceed".into());
                }
                if let Some((b, _)) = pending_frees.first() {
                    return Some(format!("the free of b{b} waits for an event that is never recorded"));
                }
                break;
            }
            // Round 0 always runs the last ready stream, round 1 the first, then at random.
            let st = match round {
                0 => *ready.last().unwrap(),
                1 => ready[0],
                _ => *rng.pick(&ready),
            };
            let step = &s.streams[st].steps[pc[st]];
            pc[st] += 1;
            match step {
                StreamStep::Alloc(b) => {
                    if state[b.index()] != B::Unallocated {
                        return Some(format!("{b} allocated twice"));
                    }
                    state[b.index()] = B::Allocated;
                }
                StreamStep::Kernel(k) => {
                    let kp = &s.kernels[k.index()];
                    let seg = &s.fusion.segments[kp.segment];
                    for (b, v) in kp.inputs.iter().zip(&seg.inputs) {
                        if state[b.index()] != B::Holds(value_of(*v)) {
                            return Some(format!("{k} reads {b} in state {:?}, wanting {v:?}", state[b.index()]));
                        }
                    }
                    for (b, &n) in kp.outputs.iter().zip(&seg.outputs) {
                        if matches!(state[b.index()], B::Unallocated | B::Freed) {
                            return Some(format!("{k} writes {b}, which is not live"));
                        }
                        state[b.index()] = B::Holds(n);
                    }
                }
                StreamStep::Free { buffer, after } => {
                    if matches!(state[buffer.index()], B::Unallocated | B::Freed) {
                        return Some(format!("{buffer} freed while not live"));
                    }
                    pending_frees.push((buffer.index(), after.iter().map(|e| e.index()).collect()));
                }
                StreamStep::Record(e) => {
                    if let Some(r) = recorded.get_mut(e.index()) {
                        *r = true;
                    }
                }
                StreamStep::Wait(_) => {}
                StreamStep::Copy { from, to, value } => {
                    let v = value_of(*value);
                    // A transfer reads the other device's value; an offload the value it moves.
                    let read = match s.buffers[from.index()].source {
                        BufferSource::External(e) if g.externals[e].remote => 1_000_000 + e,
                        _ => v,
                    };
                    if state[from.index()] != B::Holds(read) {
                        return Some(format!(
                            "copy reads {from} in state {:?}, wanting {value:?}",
                            state[from.index()]
                        ));
                    }
                    if matches!(state[to.index()], B::Unallocated | B::Freed) {
                        return Some(format!("copy writes {to}, which is not live"));
                    }
                    state[to.index()] = B::Holds(v);
                }
            }
            // Frees happen once their events are recorded.
            pending_frees.retain(|(b, after)| {
                let due = after.iter().all(|&e| recorded.get(e).copied().unwrap_or(false));
                if due {
                    state[*b] = B::Freed;
                }
                !due
            });
        }
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Corruption {
    DropWait,
    DropRecord,
    FreeEarly,
    ReuseEarly,
}

/// Plants one corruption of `kind`; `None` if the schedule offers no place for it.
fn corrupt(s: &Schedule, kind: Corruption, rng: &mut Rng) -> Option<Schedule> {
    let mut c = s.clone();
    let positions = |c: &Schedule, f: &dyn Fn(&StreamStep) -> bool| -> Vec<(usize, usize)> {
        c.streams
            .iter()
            .enumerate()
            .flat_map(|(i, st)| st.steps.iter().enumerate().filter(|(_, x)| f(x)).map(move |(j, _)| (i, j)))
            .collect()
    };
    match kind {
        Corruption::DropWait | Corruption::DropRecord => {
            let want_wait = kind == Corruption::DropWait;
            let spots = positions(&c, &|x| {
                if want_wait { matches!(x, StreamStep::Wait(_)) } else { matches!(x, StreamStep::Record(_)) }
            });
            let &(i, j) = spots.get(rng.below(spots.len().max(1)))?;
            c.streams[i].steps.remove(j);
        }
        Corruption::FreeEarly => {
            let spots = positions(&c, &|x| matches!(x, StreamStep::Free { .. }));
            let &(i, j) = spots.get(rng.below(spots.len().max(1)))?;
            let StreamStep::Free { buffer, .. } = c.streams[i].steps[j].clone() else { unreachable!() };
            // Move it right after the kernel that writes the buffer (before its readers).
            let writer = positions(
                &c,
                &|x| matches!(x, StreamStep::Kernel(k) if s.kernels[k.index()].outputs.contains(&buffer)),
            );
            let &(wi, wj) = writer.first()?;
            c.streams[i].steps.remove(j);
            let at = if wi == i && wj > j { wj } else { wj + 1 };
            let len = c.streams[wi].steps.len();
            c.streams[wi].steps.insert(at.min(len), StreamStep::Free { buffer, after: Vec::new() });
        }
        Corruption::ReuseEarly => {
            // Rename buffer b (allocated later) to a, an earlier buffer of the same size.
            let allocs = positions(&c, &|x| matches!(x, StreamStep::Alloc(_)));
            if allocs.len() < 2 {
                return None;
            }
            let x = rng.below(allocs.len());
            let y = rng.below(allocs.len());
            let (StreamStep::Alloc(a), StreamStep::Alloc(b)) =
                (&c.streams[allocs[x].0].steps[allocs[x].1], &c.streams[allocs[y].0].steps[allocs[y].1])
            else {
                unreachable!()
            };
            let (a, b) = (*a, *b);
            if a == b || c.buffers[a.index()].bytes != c.buffers[b.index()].bytes {
                return None;
            }
            for st in &mut c.streams {
                st.steps.retain(|x| {
                    !matches!(x, StreamStep::Alloc(v) if *v == b)
                        && !matches!(x, StreamStep::Free { buffer, .. } if *buffer == b)
                });
            }
            for k in &mut c.kernels {
                for v in k.inputs.iter_mut().chain(k.outputs.iter_mut()) {
                    if *v == b {
                        *v = a;
                    }
                }
            }
            for st in &mut c.streams {
                for step in &mut st.steps {
                    if let StreamStep::Copy { from, to, .. } = step {
                        for v in [from, to] {
                            if *v == b {
                                *v = a;
                            }
                        }
                    }
                }
            }
            c.outputs.iter_mut().for_each(|(_, v)| {
                if *v == b {
                    *v = a
                }
            });
        }
    }
    Some(c)
}

#[test]
fn planned_schedules_validate_and_every_planted_hazard_is_named() {
    let mut rng = Rng::new(99);
    let mut planted: HashMap<Corruption, usize> = HashMap::new();
    let mut harmless = 0;
    let mut flagged_unseen = 0;
    let mut plans = 0;
    let mut offloaded = 0;
    let mut offloaded_inputs = 0;
    let mut planted_with_offloads = 0;
    let (mut packed, mut in_place_pairs) = (0, 0);
    for _ in 0..1500 {
        let g = random_graph(&mut rng);
        let s = schedule_for(&g, &mut rng);
        plans += 1;
        let is_packed = |seg: &braid_fusion::Segment| matches!(seg.kind, braid_fusion::SegmentKind::PackedMaps { .. });
        packed += usize::from(s.fusion.segments.iter().any(is_packed));
        in_place_pairs += usize::from(s.kernels.iter().any(|k| k.in_place.len() > 1));
        offloaded += usize::from(!s.offloads.is_empty());
        offloaded_inputs += s.offloads.iter().filter(|o| matches!(o.value, ValueRef::External(_))).count();
        if let Err(h) = validate(&s, &g) {
            panic!("the planner produced a schedule the validator rejects: {h:?}\n{g:#?}\n{s:#?}");
        }
        assert_eq!(oracle(&s, &g, &mut rng), None, "the oracle disagrees with a valid plan: {s:#?}");
        for kind in [Corruption::DropWait, Corruption::DropRecord, Corruption::FreeEarly, Corruption::ReuseEarly] {
            let Some(bad) = corrupt(&s, kind, &mut rng) else { continue };
            let truth = oracle(&bad, &g, &mut rng);
            let verdict = validate(&bad, &g);
            match (truth, verdict) {
                (Some(why), Ok(())) => panic!(
                    "{kind:?}: the validator missed a hazard ({why}):\n{}\noriginal:\n{}",
                    braid_scheduler::Dump::new(&bad, &g, 0, "cpu").to_text(),
                    braid_scheduler::Dump::new(&s, &g, 0, "cpu").to_text()
                ),
                (Some(_), Err(hazards)) => {
                    *planted.entry(kind).or_default() += 1;
                    planted_with_offloads += usize::from(!s.offloads.is_empty());
                    for h in &hazards {
                        match h.kind {
                            HazardKind::Deadlock => assert!(!h.steps.is_empty() && h.message.contains("stream"), "{h}"),
                            _ => {
                                assert!(h.buffer.is_some(), "{h}");
                                assert_eq!(h.steps.len(), 2, "both steps are named: {h}");
                                let text = h.to_string();
                                assert!(
                                    text.contains(h.buffer.as_deref().unwrap()) && text.contains("stream"),
                                    "{text}"
                                );
                            }
                        }
                    }
                }
                (None, Ok(())) => harmless += 1, // e.g. a redundant wait; not counted as planted
                (None, Err(h)) => {
                    // Not seen by 300 random interleavings: the validator's proof must name a
                    // real race (two unordered conflicting steps), never a replay error.
                    flagged_unseen += 1;
                    if std::env::var("SHOW").is_ok() && flagged_unseen < 3 {
                        println!("{kind:?} {}\n{}", h[0], braid_scheduler::Dump::new(&bad, &g, 0, "cpu").to_text());
                    }
                    assert!(h.iter().all(|h| h.steps.len() == 2 || h.kind == HazardKind::Deadlock), "{kind:?}: {h:?}");
                }
            }
        }
    }
    assert!(
        offloaded >= 50 && planted_with_offloads >= 100 && offloaded_inputs >= 10,
        "too few plans with offloads ({offloaded}), offloads of donated inputs ({offloaded_inputs}) or hazards \
         planted in them ({planted_with_offloads})"
    );
    println!(
        "{plans} plans ({offloaded} with offloads, {offloaded_inputs} offloads of donated inputs, \
         {planted_with_offloads} hazards planted in those); planted hazards caught: {planted:?}; corruptions with no effect: {harmless}; \
         races found by the validator that no sampled interleaving hit: {flagged_unseen}"
    );
    for kind in [Corruption::DropWait, Corruption::DropRecord, Corruption::FreeEarly, Corruption::ReuseEarly] {
        assert!(planted.get(&kind).copied().unwrap_or(0) >= 50, "too few {kind:?} hazards planted: {planted:?}");
    }
    println!("{packed} plans with packed maps, {in_place_pairs} with a kernel writing several outputs in place");
    assert!(
        packed >= 50 && in_place_pairs >= 20,
        "too few packed maps ({packed}) or in-place pairs ({in_place_pairs})"
    );
}
