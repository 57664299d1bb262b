//! The planner's offload steps: copying a value to host memory on the offload stream after its
//! last use before an idle gap, and back before its next use (decided by `crate::offload`).

use super::Planner;
use crate::schedule::*;
use braid_graph::ValueRef;

/// An offload in segment terms.
pub(super) struct SegOffload {
    pub(super) value: ValueRef,
    /// `None`: a donated input that leaves at the start of the flush.
    pub(super) last_use: Option<usize>,
    /// The first segment planned without the value in device memory (it waits for the copy
    /// out), if any.
    pub(super) release: Option<usize>,
    /// Where it comes back (`None`: it stays in host memory past the flush, which it
    /// outlives; a later flush that reads it copies it in).
    pub(super) back_at: Option<usize>,
    pub(super) next_use: usize,
}

/// Planning state of one offload.
#[derive(Default, Clone)]
pub(super) struct OffloadState {
    pub(super) device: Option<BufferId>,
    pub(super) host: Option<BufferId>,
    pub(super) out_done: Option<EventId>,
    pub(super) back: Option<BufferId>,
}

impl Planner<'_> {
    pub(super) fn offload_stream(&self) -> usize {
        self.streams.len() - 1
    }

    fn host_buffer(&mut self, v: ValueRef, space: Space) -> BufferId {
        let (dtype, shape) = self.graph.meta(v);
        let id = BufferId(self.buffers.len() as u32);
        self.buffers.push(BufferPlan {
            id,
            dtype,
            len: shape.numel(),
            bytes: shape.numel() * dtype.size(),
            space,
            source: match v {
                ValueRef::Node(n) => BufferSource::Value(n),
                ValueRef::External(e) => BufferSource::CopyOf(e),
            },
            persistent: space == Space::Device && matches!(v, ValueRef::Node(n) if self.graph.nodes[n].persistent),
            upload_at_first_use: false,
        });
        id
    }

    /// The buffer holding a value now.
    pub(super) fn buffer_of(&self, v: ValueRef) -> BufferId {
        match v {
            ValueRef::Node(n) => self.node_buffer[n].expect("planned before its readers"),
            ValueRef::External(e) => self.ext_buffer[e],
        }
    }

    pub(super) fn bytes_of(&self, v: ValueRef) -> u64 {
        let (dtype, shape) = self.graph.meta(v);
        (shape.numel() * dtype.size()) as u64
    }

    /// After the value's last use before its idle gap: copy it to the host on the offload
    /// stream, once every stream has finished reading it, then give its device buffer back.
    pub(super) fn copy_out(&mut self, i: usize) {
        let o = self.offload_stream();
        let v = self.offloads[i].value;
        let users: Vec<usize> = (0..self.offloads[i].last_use.map_or(0, |l| l + 1))
            .filter(|&si| {
                let seg = &self.segments[si];
                seg.inputs.contains(&v) || matches!(v, ValueRef::Node(n) if seg.outputs.contains(&n))
            })
            .collect();
        for si in users {
            self.wait_for(o, si);
        }
        let device = self.buffer_of(v);
        let host = self.host_buffer(v, Space::Host);
        self.steps[o].extend([
            StreamStep::Alloc(host),
            StreamStep::Copy { from: device, to: host, value: v },
            StreamStep::Free { buffer: device, after: Vec::new() },
        ]);
        self.count[o] += 1;
        self.clock[o][o] = self.count[o];
        let done = self.record_here(o, None);
        self.offload_state[i] =
            OffloadState { device: Some(device), host: Some(host), out_done: Some(done), back: None };
        if self.offloads[i].release.is_none() {
            self.live -= self.bytes_of(v);
        }
    }

    /// Before segment `back_at` (on stream `s`): copy the value back into a new device buffer
    /// on the offload stream, starting once `s` gets here; its next reader waits for it.
    pub(super) fn copy_back(&mut self, i: usize, s: usize) {
        let o = self.offload_stream();
        let v = self.offloads[i].value;
        let start = self.record_here(s, None);
        self.wait_event(o, start);
        let back = self.host_buffer(v, Space::Device);
        let host = self.offload_state[i].host.expect("the copy out is planned first");
        self.steps[o].extend([
            StreamStep::Alloc(back),
            StreamStep::Copy { from: host, to: back, value: v },
            StreamStep::Free { buffer: host, after: Vec::new() },
        ]);
        // The copy stands for the value's producer from now on.
        let pseudo = self.copied_in(v, o);
        match v {
            ValueRef::Node(n) => {
                self.seg_of[n] = pseudo;
                self.node_buffer[n] = Some(back);
            }
            ValueRef::External(e) => {
                self.ext_producer[e] = Some(pseudo);
                self.ext_buffer[e] = back;
            }
        }
        self.offload_state[i].back = Some(back);
    }

    /// Before the first reader (on stream `s`) of an input that an earlier flush left in
    /// host memory: copies it into a new device buffer on `s`, which its readers read and
    /// which is freed after the last of them; the host copy stays the value.
    pub(super) fn copy_in(&mut self, e: usize, s: usize) {
        let v = ValueRef::External(e);
        let device = self.host_buffer(v, Space::Device);
        let host = self.ext_buffer[e];
        self.steps[s].extend([StreamStep::Alloc(device), StreamStep::Copy { from: host, to: device, value: v }]);
        // The copy stands for the value's producer: readers on other streams wait for it.
        self.ext_producer[e] = Some(self.copied_in(v, s));
        self.ext_buffer[e] = device;
    }

    /// After a copy of `v` into device memory planned last on stream `s`: counts its bytes,
    /// makes the copy a point of `s` with an event recorded after it, and returns a segment
    /// number standing for it (a value's producer, which its later readers wait for).
    fn copied_in(&mut self, v: ValueRef, s: usize) -> usize {
        self.live += self.bytes_of(v);
        self.peak = self.peak.max(self.live);
        self.count[s] += 1;
        self.clock[s][s] = self.count[s];
        let pseudo = self.seg_stream.len();
        self.seg_stream.push(s);
        self.seg_point.push(self.count[s]);
        self.record_here(s, None);
        pseudo
    }
}
