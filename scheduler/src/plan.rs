//! Building a [`Schedule`] from a flush graph and its fusion.
//!
//! Today: every segment runs on its node's stream in topological order; each value gets its own
//! buffer, allocated right before the kernel that writes it and freed right after its last
//! reader, unless it outlives the flush. The stream-aware planner (events, cross-stream
//! lifetimes, reuse, offloads) replaces the body of [`plan`] without changing its contract:
//! every read happens-after its write, and no buffer is freed before its last reader.

use crate::schedule::*;
use braid_fusion::Fusion;
use braid_graph::{FlushGraph, StreamId, ValueRef};

/// Plans `graph` with the segments of `fusion`.
pub fn plan(graph: &FlushGraph, fusion: Fusion) -> Schedule {
    let mut s = Schedule::default();
    let mut buffers = Vec::with_capacity(graph.externals.len() + graph.nodes.len());
    for (i, e) in graph.externals.iter().enumerate() {
        buffers.push(BufferPlan {
            id: BufferId(i as u32),
            dtype: e.dtype,
            len: e.shape.numel(),
            bytes: e.bytes(),
            space: Space::Device,
            source: BufferSource::External(i),
        });
    }
    s.external_buffers = (0..graph.externals.len() as u32).map(BufferId).collect();

    // Last segment that reads each node's value (node values only; externals are never freed
    // by a flush).
    let mut last_reader = vec![usize::MAX; graph.nodes.len()];
    for (si, seg) in fusion.segments.iter().enumerate() {
        for v in &seg.inputs {
            if let ValueRef::Node(n) = *v {
                last_reader[n] = si;
            }
        }
    }

    let mut value_buffer: Vec<Option<BufferId>> = vec![None; graph.nodes.len()];
    let stream = graph.nodes.first().map_or(StreamId(0), |n| n.stream);
    let mut steps = Vec::with_capacity(graph.nodes.len() * 3);
    let (mut live, mut peak) = (0u64, 0u64);
    for (si, seg) in fusion.segments.iter().enumerate() {
        let mut outputs = Vec::with_capacity(seg.outputs.len());
        for &n in &seg.outputs {
            let node = &graph.nodes[n];
            let id = BufferId(buffers.len() as u32);
            buffers.push(BufferPlan {
                id,
                dtype: node.dtype,
                len: node.shape.numel(),
                bytes: node.bytes(),
                space: Space::Device,
                source: BufferSource::Value(n),
            });
            value_buffer[n] = Some(id);
            steps.push(Step::Alloc(id));
            live += node.bytes() as u64;
            outputs.push(id);
        }
        peak = peak.max(live);
        let inputs = seg
            .inputs
            .iter()
            .map(|v| match *v {
                ValueRef::Node(n) => value_buffer[n].expect("producer planned before reader"),
                ValueRef::External(e) => s.external_buffers[e],
            })
            .collect::<Vec<_>>();
        let kid = KernelId(s.kernels.len() as u32);
        s.kernels.push(KernelPlan { id: kid, stream, segment: si, inputs, outputs });
        steps.push(Step::Kernel(kid));
        for v in &seg.inputs {
            if let ValueRef::Node(n) = *v
                && last_reader[n] == si
                && !graph.nodes[n].keep
            {
                let b = value_buffer[n].expect("planned");
                steps.push(Step::Free { buffer: b, after: Vec::new() });
                live -= buffers[b.index()].bytes as u64;
            }
        }
        // A value nobody reads and nobody keeps (a dead end of the graph) is freed at once.
        for &n in &seg.outputs {
            if last_reader[n] == usize::MAX && !graph.nodes[n].keep {
                let b = value_buffer[n].expect("planned");
                steps.push(Step::Free { buffer: b, after: Vec::new() });
                live -= buffers[b.index()].bytes as u64;
            }
        }
    }
    s.outputs = graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.keep)
        .map(|(i, _)| (i, value_buffer[i].expect("kept value has a buffer")))
        .collect();
    s.buffers = buffers;
    s.streams = vec![StreamSchedule { stream, steps }];
    s.fusion = fusion;
    s.planned_peak_bytes = peak;
    s
}
