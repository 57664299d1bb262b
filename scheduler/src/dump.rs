//! Schedule dumps: JSON schema version 1 (as fixed in the user contract), a text listing and
//! Graphviz DOT.
//!
//! A [`Dump`] is built from a schedule once and is self-contained, so a dump read back from a
//! file prints and checks exactly like the live one. This module only formats; it never
//! changes a schedule.

use crate::assign::COPY_STREAM;
use crate::schedule::{BufferSource, OFFLOAD_STREAM, Schedule, Space, StreamStep};
use braid_graph::{FlushGraph, StreamId, ValueRef};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

pub const SCHEMA_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    pub schema: u32,
    pub flush: u64,
    pub device: String,
    pub streams: Vec<DumpStream>,
    pub events: Vec<DumpEvent>,
    pub buffers: Vec<DumpBuffer>,
    pub fusion: DumpFusion,
    #[serde(default)]
    pub offloads: Vec<DumpOffload>,
    pub planned_peak_bytes: u64,
    /// Why the flush did not run (a memory budget out of reach, a schedule the validator
    /// refused); absent when it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_run: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DumpStream {
    pub id: u32,
    pub steps: Vec<DumpStep>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DumpStep {
    Kernel {
        id: String,
        ops: Vec<String>,
        nodes: Vec<u32>,
        inputs: Vec<String>,
        outputs: Vec<String>,
        /// The value (node) each input buffer must hold, parallel to `inputs`.
        #[serde(default)]
        input_nodes: Vec<u32>,
        /// The value (node) each output buffer receives, parallel to `outputs`.
        #[serde(default)]
        output_nodes: Vec<u32>,
        /// The stream of each node in `nodes`.
        #[serde(default)]
        node_streams: Vec<u32>,
        /// Outputs written in place over an input's buffer.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        in_place: Vec<String>,
        /// Why a buffer was not reused in place (another stream may still read it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
        /// The launch variant the device's tuner chose for it (absent: its default, or a
        /// device without variants).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        variant: Option<String>,
    },
    Alloc {
        buffer: String,
    },
    Free {
        buffer: String,
        after: Vec<String>,
    },
    Record {
        event: String,
    },
    Wait {
        event: String,
    },
    Copy {
        from: String,
        to: String,
        direction: String,
        /// The value (node) copied.
        #[serde(default)]
        node: Option<u32>,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DumpEvent {
    pub id: String,
    pub stream: u32,
    pub auto: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DumpBuffer {
    pub id: String,
    pub bytes: u64,
    pub space: String,
    #[serde(default)]
    pub dtype: String,
    /// The graph node whose value the buffer holds first.
    #[serde(default)]
    pub node: Option<u32>,
    /// Whether the buffer existed before the flush.
    #[serde(default)]
    pub external: bool,
    /// Whether it holds a parameter (exact-size memory).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub persistent: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DumpFusion {
    pub kernels: u64,
    pub fused_ops: u64,
    pub refused: Vec<DumpRefusal>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DumpRefusal {
    pub a: u32,
    pub b: u32,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DumpOffload {
    pub buffer: String,
    pub to: String,
    /// The kernel that needs it back, `"end"` (back in device memory when the flush ends, which
    /// it outlives) or [`LATER_FLUSH`] (it stays in host memory past the flush; `to` is then
    /// the value the flush leaves, and a later flush that reads it copies it in first).
    pub back_before: String,
}

/// `back_before` of an offload that stays in host memory past its flush.
pub const LATER_FLUSH: &str = "later flush";

impl Dump {
    /// Describes `schedule` (planned from `graph`) as flush number `flush` on `device`.
    pub fn new(schedule: &Schedule, graph: &FlushGraph, flush: u64, device: &str) -> Dump {
        let node_id = |i: usize| graph.nodes[i].id.index() as u32;
        let value_id = |v: ValueRef| match v {
            ValueRef::Node(n) => node_id(n),
            ValueRef::External(e) => graph.externals[e].id.index() as u32,
        };
        let streams = schedule
            .streams
            .iter()
            .map(|st| DumpStream {
                id: st.stream.0,
                steps: st
                    .steps
                    .iter()
                    .map(|step| match step {
                        StreamStep::Kernel(k) => {
                            let (plan, seg) = schedule.kernel_and_segment(*k);
                            DumpStep::Kernel {
                                id: k.to_string(),
                                ops: seg.nodes.iter().map(|&n| graph.nodes[n].op.name().to_string()).collect(),
                                nodes: seg.nodes.iter().map(|&n| node_id(n)).collect(),
                                inputs: plan.inputs.iter().map(|b| b.to_string()).collect(),
                                outputs: plan.outputs.iter().map(|b| b.to_string()).collect(),
                                input_nodes: seg
                                    .inputs
                                    .iter()
                                    .map(|v| match *v {
                                        ValueRef::Node(n) => node_id(n),
                                        ValueRef::External(e) => graph.externals[e].id.index() as u32,
                                    })
                                    .collect(),
                                output_nodes: seg.outputs.iter().map(|&n| node_id(n)).collect(),
                                node_streams: seg.nodes.iter().map(|&n| graph.nodes[n].stream.0).collect(),
                                in_place: plan.in_place.iter().map(|&(o, _)| plan.outputs[o].to_string()).collect(),
                                note: plan.note.clone(),
                                variant: None,
                            }
                        }
                        StreamStep::Alloc(b) => DumpStep::Alloc { buffer: b.to_string() },
                        StreamStep::Free { buffer, after } => DumpStep::Free {
                            buffer: buffer.to_string(),
                            after: after.iter().map(|e| e.to_string()).collect(),
                        },
                        StreamStep::Record(e) => DumpStep::Record { event: e.to_string() },
                        StreamStep::Wait(e) => DumpStep::Wait { event: e.to_string() },
                        StreamStep::Copy { from, to, value } => DumpStep::Copy {
                            from: from.to_string(),
                            to: to.to_string(),
                            direction: match (schedule.buffers[from.index()].space, schedule.buffers[to.index()].space)
                            {
                                (Space::Remote, _) => "transfer",
                                (_, Space::Host) => "d2h",
                                _ => "h2d",
                            }
                            .to_string(),
                            node: Some(value_id(*value)),
                        },
                    })
                    .collect(),
            })
            .collect();
        Dump {
            schema: SCHEMA_VERSION,
            flush,
            device: device.to_string(),
            streams,
            events: schedule
                .events
                .iter()
                .map(|e| DumpEvent { id: e.id.to_string(), stream: e.stream.0, auto: e.auto })
                .collect(),
            buffers: schedule
                .buffers
                .iter()
                .map(|b| DumpBuffer {
                    id: b.id.to_string(),
                    bytes: b.bytes as u64,
                    space: match b.space {
                        Space::Device => "device",
                        Space::Host => "host",
                        Space::Remote => "remote",
                    }
                    .to_string(),
                    dtype: b.dtype.name().to_string(),
                    node: Some(match b.source {
                        BufferSource::External(e) | BufferSource::CopyOf(e) => graph.externals[e].id.index() as u32,
                        BufferSource::Value(n) => node_id(n),
                    }),
                    external: matches!(b.source, BufferSource::External(_)),
                    persistent: b.persistent,
                })
                .collect(),
            fusion: DumpFusion {
                kernels: schedule.kernels.len() as u64,
                fused_ops: schedule.fusion.fused_ops() as u64,
                refused: schedule
                    .fusion
                    .refused
                    .iter()
                    .map(|r| DumpRefusal { a: node_id(r.a), b: node_id(r.b), reason: r.reason.clone() })
                    .collect(),
            },
            offloads: schedule
                .offloads
                .iter()
                .map(|o| DumpOffload {
                    buffer: o.device.to_string(),
                    to: o.host.to_string(),
                    back_before: match (o.back_before, o.back) {
                        (Some(k), _) => k.to_string(),
                        (None, Some(_)) => "end".to_string(),
                        (None, None) => LATER_FLUSH.to_string(),
                    },
                })
                .collect(),
            planned_peak_bytes: schedule.planned_peak_bytes,
            not_run: None,
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a dump always serialises")
    }

    /// Reads a dump back; the error says what is wrong (not JSON, another schema, a missing
    /// field).
    pub fn from_json(text: &str) -> Result<Dump, String> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        match value.get("schema").and_then(|s| s.as_u64()) {
            Some(v) if v == SCHEMA_VERSION as u64 => {}
            Some(v) => {
                return Err(format!("schema version {v} is not supported (this braid reads version {SCHEMA_VERSION})"));
            }
            None => return Err("not a braid schedule dump: no \"schema\" field".into()),
        }
        serde_json::from_value(value).map_err(|e| format!("malformed schedule dump: {e}"))
    }

    /// Sets each kernel's `variant` to what `of` says for its id (`"k3"`).
    pub fn set_variants(&mut self, of: impl Fn(&str) -> Option<String>) {
        for step in self.streams.iter_mut().flat_map(|s| &mut s.steps) {
            if let DumpStep::Kernel { id, variant, .. } = step {
                *variant = of(id);
            }
        }
    }

    pub fn kernel_count(&self) -> usize {
        self.fusion.kernels as usize
    }

    /// Matrix products the kernels of the dump compute: their `matmul` ops, each counted once;
    /// 0 for a flush that did not run.
    pub fn product_count(&self) -> usize {
        if self.not_run.is_some() {
            return 0;
        }
        let kernel_ops = self.streams.iter().flat_map(|s| &s.steps).flat_map(|step| match step {
            DumpStep::Kernel { ops, .. } => ops.as_slice(),
            _ => &[],
        });
        kernel_ops.filter(|op| *op == "matmul").count()
    }

    /// What in the dump contradicts itself (a file edited or written by something else): ids
    /// named twice, steps naming buffers or events it does not list, events of streams it
    /// does not have, kernels of no nodes, offloads of unknown buffers or kernels, a kernel
    /// count that is not the streams'. Empty for every dump braid writes.
    pub fn inconsistencies(&self) -> Vec<String> {
        use std::collections::HashSet;
        let mut found = Vec::new();
        // The set of `ids`, each one listed twice reported.
        let mut set = |what: &str, ids: Vec<String>| {
            let mut seen = HashSet::new();
            for id in ids {
                if seen.contains(&id) {
                    found.push(format!("{what} {id} is listed twice"));
                }
                seen.insert(id);
            }
            seen
        };
        let streams = set("stream", self.streams.iter().map(|s| s.id.to_string()).collect());
        let buffers = set("buffer", self.buffers.iter().map(|b| b.id.clone()).collect());
        let events = set("event", self.events.iter().map(|e| e.id.clone()).collect());
        let steps = || self.streams.iter().flat_map(|s| &s.steps);
        let kernel_ids: Vec<String> = steps()
            .filter_map(|st| match st {
                DumpStep::Kernel { id, .. } => Some(id.clone()),
                _ => None,
            })
            .collect();
        let kernel_count = kernel_ids.len();
        let kernels = set("kernel", kernel_ids);
        let buffer = |b: &String| buffers.contains(b);
        let event = |e: &String| events.contains(e);
        let missing = |what: &str, id: &String, known: bool, step: &str| {
            (!known).then(|| format!("{step} names {what} {id}, which the dump does not list"))
        };
        for step in steps() {
            match step {
                DumpStep::Kernel { id, nodes, inputs, outputs, .. } => {
                    found.extend(inputs.iter().chain(outputs).filter_map(|b| missing("buffer", b, buffer(b), id)));
                    if nodes.is_empty() {
                        found.push(format!("kernel {id} computes no nodes"));
                    }
                }
                DumpStep::Alloc { buffer: b } => found.extend(missing("buffer", b, buffer(b), "an alloc")),
                DumpStep::Free { buffer: b, after } => {
                    found.extend(missing("buffer", b, buffer(b), "a free"));
                    found.extend(after.iter().filter_map(|e| missing("event", e, event(e), "a free")));
                }
                DumpStep::Record { event: e } => found.extend(missing("event", e, event(e), "a record")),
                DumpStep::Wait { event: e } => found.extend(missing("event", e, event(e), "a wait")),
                DumpStep::Copy { from, to, .. } => {
                    found.extend([from, to].into_iter().filter_map(|b| missing("buffer", b, buffer(b), "a copy")));
                }
            }
        }
        for e in &self.events {
            if !streams.contains(&e.stream.to_string()) {
                found.push(format!("event {} is on stream {}, which the dump does not have", e.id, e.stream));
            }
        }
        for o in &self.offloads {
            found.extend(missing("buffer", &o.buffer, buffer(&o.buffer), "an offload"));
            found.extend(missing("buffer", &o.to, buffer(&o.to), "an offload"));
            let before = o.back_before == "end" || o.back_before == LATER_FLUSH || kernels.contains(&o.back_before);
            found.extend(missing("kernel", &o.back_before, before, "an offload"));
        }
        if kernel_count as u64 != self.fusion.kernels {
            found.push(format!(
                "the streams run {kernel_count} kernel(s) but the fusion summary counts {}",
                self.fusion.kernels
            ));
        }
        found
    }

    /// One line per step, stream after stream.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        if let Some(why) = &self.not_run {
            let _ = writeln!(s, "NOT RUN: {why}");
        }
        let _ = writeln!(
            s,
            "flush {} on {}: {} stream(s), {} kernel(s) for {} op(s), {} event(s), {} buffer(s), planned peak {} B",
            self.flush,
            self.device,
            self.streams.len(),
            self.fusion.kernels,
            self.fusion.fused_ops,
            self.events.len(),
            self.buffers.len(),
            self.planned_peak_bytes
        );
        for st in &self.streams {
            let _ = writeln!(s, "stream {}:", stream_name(st.id));
            for step in &st.steps {
                let _ = writeln!(s, "  {}", step_text(step, &self.buffers, &self.events));
            }
        }
        for r in &self.fusion.refused {
            let _ = writeln!(s, "not fused: n{} | n{}: {}", r.a, r.b, r.reason);
        }
        for o in &self.offloads {
            if o.back_before == LATER_FLUSH {
                let _ =
                    writeln!(s, "offload: {} -> {} while idle, left in host memory for a later flush", o.buffer, o.to);
            } else {
                let _ = writeln!(s, "offload: {} -> {} while idle, back before {}", o.buffer, o.to, o.back_before);
            }
        }
        s
    }

    /// Graphviz DOT: one cluster per stream with its steps in order; events as dashed edges
    /// from the record to each wait.
    pub fn to_dot(&self) -> String {
        let mut s = String::from("digraph schedule {\n  rankdir=TB;\n  node [shape=box, fontname=monospace];\n");
        let mut records = Vec::new();
        let mut waits = Vec::new();
        for st in &self.streams {
            let _ = writeln!(s, "  subgraph cluster_s{} {{\n    label=\"stream {}\";", st.id, stream_name(st.id));
            for (i, step) in st.steps.iter().enumerate() {
                let name = format!("s{}_{}", st.id, i);
                let label = step_text(step, &self.buffers, &self.events).replace('"', "'");
                let _ = writeln!(s, "    {name} [label=\"{label}\"];");
                if i > 0 {
                    let _ = writeln!(s, "    s{}_{} -> {name};", st.id, i - 1);
                }
                match step {
                    DumpStep::Record { event } => records.push((event.clone(), name)),
                    DumpStep::Wait { event } => waits.push((event.clone(), name)),
                    DumpStep::Free { after, .. } => waits.extend(after.iter().map(|e| (e.clone(), name.clone()))),
                    _ => {}
                }
            }
            s.push_str("  }\n");
        }
        for (event, from) in &records {
            for (_, to) in waits.iter().filter(|(e, _)| e == event) {
                let _ = writeln!(s, "  {from} -> {to} [style=dashed, label=\"{event}\"];");
            }
        }
        s.push_str("}\n");
        s
    }
}

/// A stream as dumps print it: its number, or the name of braid's own streams.
pub fn stream_name(id: u32) -> String {
    match StreamId(id) {
        OFFLOAD_STREAM => "offload".into(),
        COPY_STREAM => "copy".into(),
        _ => id.to_string(),
    }
}

fn step_text(step: &DumpStep, buffers: &[DumpBuffer], events: &[DumpEvent]) -> String {
    let bytes = |b: &str| buffers.iter().find(|x| x.id == b).map_or(0, |x| x.bytes);
    let kind = |e: &str| match events.iter().find(|x| x.id == e) {
        Some(x) if !x.auto => " (user event)",
        _ => "",
    };
    match step {
        DumpStep::Kernel { id, ops, nodes, inputs, outputs, in_place, note, variant, .. } => format!(
            "{id} {} [{}] {} -> {}{}{}{}",
            ops.join("+"),
            nodes.iter().map(|n| format!("n{n}")).collect::<Vec<_>>().join(" "),
            inputs.join(" "),
            outputs.join(" "),
            if in_place.is_empty() { String::new() } else { format!(" (in place: {})", in_place.join(" ")) },
            note.as_ref().map_or(String::new(), |n| format!(" ({n})")),
            variant.as_ref().map_or(String::new(), |v| format!(" [variant: {v}]"))
        ),
        DumpStep::Alloc { buffer } => format!("alloc {buffer} ({} B)", bytes(buffer)),
        DumpStep::Free { buffer, after } if after.is_empty() => format!("free {buffer}"),
        DumpStep::Free { buffer, after } => format!("free {buffer} after {}", after.join(" ")),
        DumpStep::Record { event } => format!("record {event}{}", kind(event)),
        DumpStep::Wait { event } => format!("wait {event}{}", kind(event)),
        DumpStep::Copy { from, to, direction, .. } => format!("copy {from} -> {to} ({direction}, {} B)", bytes(from)),
    }
}
