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
