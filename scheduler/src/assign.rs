//! Automatic streams: spreading independent branches of default-stream work over several
//! streams (`device.set_auto_streams(n)`; off by default).
//!
//! Runs before fusion, so fusion sees the final streams. A node on the default stream follows
//! its first input's stream when it is that input's first reader (a chain stays on one stream);
//! any other node starts a branch on the least loaded stream. Explicit streams and user events
//! are never moved. Correctness does not depend on the choice: the planner orders every
//! cross-stream dependency with events.

use braid_graph::{FlushGraph, Op, StreamId, ValueRef};

/// Reassigns default-stream nodes of `graph` over `streams` (the first being the default).
pub fn spread_default_stream(graph: &mut FlushGraph, streams: &[StreamId]) {
    if streams.len() < 2 {
        return;
    }
    let default = StreamId(0);
    let mut first_reader: Vec<Option<usize>> = vec![None; graph.nodes.len()];
    for (i, n) in graph.nodes.iter().enumerate() {
        for v in &n.inputs {
            if let ValueRef::Node(j) = *v {
                first_reader[j].get_or_insert(i);
            }
        }
    }
    let mut load = vec![0usize; streams.len()];
    for i in 0..graph.nodes.len() {
        let n = &graph.nodes[i];
        if n.stream != default || n.op == Op::Event {
            continue;
        }
        let inherited = n.inputs.iter().find_map(|v| match *v {
            ValueRef::Node(j) if first_reader[j] == Some(i) && streams.contains(&graph.nodes[j].stream) => {
                Some(graph.nodes[j].stream)
            }
            _ => None,
        });
        let chosen = inherited.unwrap_or_else(|| {
            let k = (0..streams.len()).min_by_key(|&k| load[k]).expect("at least two streams");
            streams[k]
        });
        let k = streams.iter().position(|&s| s == chosen).expect("one of ours");
        load[k] += n.shape.numel().max(1);
        graph.nodes[i].stream = chosen;
    }
}

/// The stream transfers from other devices run on when the target has a copy engine.
pub const COPY_STREAM: StreamId = StreamId(u32::MAX - 1);

/// Moves every transfer of another device's value that this device cannot read in place (a
/// `to_device` of a remote input) to [`COPY_STREAM`], so that copies overlap compute; its
/// readers wait for it by events, like any cross-stream read.
pub fn transfers_to_copy_stream(graph: &mut FlushGraph) {
    for i in 0..graph.nodes.len() {
        let n = &graph.nodes[i];
        let remote = matches!(n.inputs.first(), Some(&ValueRef::External(e)) if graph.externals[e].remote);
        if n.op == Op::ToDevice && remote {
            graph.nodes[i].stream = COPY_STREAM;
        }
    }
}
