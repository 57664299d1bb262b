//! One flush on a wgpu device: the runtime's [`Flush`] and [`Queue`]. Every braid stream of
//! the flush is a view of the device's one open command encoder (`super::memory`): a kernel's
//! passes, a copy, an upload's staging copy are appended to it in the order the walker issues
//! them, and the encoder is submitted at the end of the flush (or earlier, when a copy to host
//! memory must read the device).
//!
//! **Streams on one queue.** The walker ([`Driver::Interleaved`](crate::runtime::Driver))
//! issues the streams' steps interleaved, each event's record before any wait for it. wgpu
//! runs one queue in submission order, and everything is submitted in issue order, so:
//! - a record needs no device work: the work before it is issued, hence runs, before any work
//!   issued after the record, which includes every step after a wait for it;
//! - a wait therefore orders nothing that is not ordered already; it only reports whether the
//!   flush has failed;
//! - a free, gated or not, returns memory at once: the walker issues a gated free only after
//!   the records of its events, so after every read of the buffer on every stream, and any
//!   later user of the memory is issued (so runs) after the free. The schedule's happens-before
//!   relation is thus a subset of issue order, and the validator's guarantees hold unchanged
//!   (`tests/runtime_queue.rs` replays the interleaved order against the schedule).
//!
//! Offloaded values (the schedule's host space) are host memory: a copy to it submits the
//! work issued so far and waits for the device (one of the two places a flush blocks, besides
//! failures; the other is a kernel's tuning at its first launch, `super::tune`, which submits
//! the work issued so far and waits for each trial); a copy back is a staging copy in issue
//! order.
//!
//! Must never: run anything the schedule does not say, or in another order than issued;
//! return memory that work issued later could see before work issued earlier is done.

use super::device::WgpuBackend;
use super::memory::{WgpuBuffer, lock};
use super::tune::{self, Bound};
use crate::runtime::{Call, Flush, Queue};
use crate::{Buffer, DeviceBuffer, DeviceError};
use braid_lowering::wgsl::Binding;
use braid_scheduler::{BufferPlan, EventId, Space};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// One flush: the device's issue lock and what went wrong.
pub(crate) struct WgpuFlush<'a> {
    backend: &'a WgpuBackend,
    _issue: MutexGuard<'a, ()>,
    poison: bool,
    /// Planned under a memory budget: kernels are not timed (`super::tune`).
    budgeted: bool,
    failed: AtomicBool,
    error: Mutex<Option<DeviceError>>,
}

impl<'a> WgpuFlush<'a> {
    pub(crate) fn begin(backend: &'a WgpuBackend, poison: bool, budgeted: bool) -> WgpuFlush<'a> {
        let issue = lock(&backend.issue);
        WgpuFlush { backend, _issue: issue, poison, budgeted, failed: AtomicBool::new(false), error: Mutex::new(None) }
    }
}

impl Flush for WgpuFlush<'_> {
    fn queue(&self, _stream: usize) -> Box<dyn Queue + '_> {
        Box::new(WgpuQueue { flush: self })
    }

    fn free_after(&self, buffer: Buffer, _stream: usize, _after: &[EventId]) {
        // Every gating record, and the free step itself, were issued: every reader is issued
        // before this point, and wgpu runs issued work in order (module docs).
        drop(buffer);
    }

    fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
    }

    fn finish(&self, failed: bool) -> Result<(), DeviceError> {
        let shared = &self.backend.shared;
        let submitted = shared.submit();
        if failed || self.failed.load(Ordering::SeqCst) || submitted.is_err() {
            // Not needed for memory (reuse is ordered after this work anyway), but a failed
            // flush reports only once the device is done with it.
            let waited = shared.ctx.wait();
            if let Some(e) = lock(&self.error).take() {
                return Err(e);
            }
            submitted?;
            return waited;
        }
        Ok(())
    }
}

/// One stream of a flush.
struct WgpuQueue<'f, 'a> {
    flush: &'f WgpuFlush<'a>,
}

impl WgpuQueue<'_, '_> {
    fn wgpu_buffer(&self, buffer: &Buffer) -> Result<Arc<WgpuBuffer>, DeviceError> {
        self.flush
            .backend
            .owns(buffer)
            .ok_or_else(|| DeviceError::Internal(format!("a kernel or copy of the wgpu device given {buffer:?}")))
    }

    /// Encodes a kernel's passes over its arguments and fresh scratch slices, and logs it.
    fn run(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        let backend = self.flush.backend;
        let shared = &backend.shared;
        let timed = tracing::enabled!(target: "braid::kernel", tracing::Level::DEBUG);
        let t0 = timed.then(Instant::now);
        let (compiled, variants) = backend.prepared(call.kernel).map_err(|e| e.in_kernel(&call.describe()))?;
        // One buffer per binding but the zero uniform, in binding order: the argument it names,
        // or a fresh scratch slice (back to the pool when `held` drops, after the kernel is
        // issued: later users of the memory are issued after it).
        let mut held: Vec<Arc<WgpuBuffer>> = Vec::with_capacity(compiled.source.bindings.len());
        for b in &compiled.source.bindings {
            match *b {
                Binding::Arg { arg, .. } => {
                    let buffer = call.args.get(arg as usize).ok_or_else(|| {
                        DeviceError::Internal(format!(
                            "{}: binding of argument {arg} of {}",
                            call.describe(),
                            call.args.len()
                        ))
                    })?;
                    held.push(self.wgpu_buffer(buffer)?);
                }
                Binding::Scratch { bytes } => held.push(Arc::new(shared.scratch(bytes as usize)?)),
                Binding::Zero => {}
            }
        }
        let mut places = Vec::with_capacity(held.len());
        let mut words = Vec::new();
        for b in &held {
            let place = match b.binding()? {
                Some(place) => place,
                None => {
                    // Zero bytes: the printer binds at least one word, so give it one.
                    let one = shared.scratch(4)?;
                    let place = one.binding()?;
                    words.push(one);
                    place.ok_or_else(|| DeviceError::Internal("a buffer of four bytes has no memory".into()))?
                }
            };
            places.push((place.0, place.2));
        }
        let refs: Vec<(&wgpu::Buffer, u64)> = places.iter().map(|(c, o)| (c, *o)).collect();
        // The variant chosen for it, or timed now at its first launch (`super::tune`).
        let compiled = match &variants {
            Some(v) => {
                let bound = Bound { kernel: call.kernel, refs: &refs, may_time: !self.flush.budgeted };
                tune::choose(shared, v, &compiled, &bound)
            }
            None => compiled,
        };
        shared
            .encode(|encoder| shared.ctx.encode_at(encoder, &compiled, &refs))
            .map_err(|e| e.in_kernel(&call.describe()))?;
        drop((held, words));
        backend.launched.fetch_add(1, Ordering::Relaxed);
        if let Some(t0) = t0 {
            tracing::debug!(
                target: "braid::kernel",
                "{} s{} {} elems issued in {:.1} us (wgpu: host issue time; the device runs it at the flush's submit)",
                call.describe(),
                call.stream,
                call.kernel.output_elements(),
                t0.elapsed().as_secs_f64() * 1e6,
            );
        }
        Ok(())
    }
}

impl Queue for WgpuQueue<'_, '_> {
    fn alloc(&mut self, plan: &BufferPlan) -> Result<Buffer, DeviceError> {
        let shared = &self.flush.backend.shared;
        let b = match plan.space {
            Space::Device => shared.buffer(plan.bytes, plan.persistent, self.flush.poison)?,
            Space::Host => shared.host_buffer(plan.bytes),
            Space::Remote => {
                return Err(DeviceError::Internal("another device's buffer is never allocated here".into()));
            }
        };
        Ok(Buffer::new(Arc::new(b)))
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<Buffer, DeviceError> {
        Ok(Buffer::new(Arc::new(self.flush.backend.shared.upload(bytes, self.flush.poison)?)))
    }

    fn free(&mut self, buffer: Buffer) {
        // Reusable at once (module docs); a buffer held elsewhere is freed by its last holder.
        drop(buffer);
    }

    fn record(&mut self, _event: EventId) {
        // Nothing to do on one in-order queue (module docs).
    }

    fn wait(&mut self, _event: EventId) -> bool {
        !self.flush.failed.load(Ordering::SeqCst)
    }

    fn copy(&mut self, from: &Buffer, to: &Buffer) -> Result<(), DeviceError> {
        let shared = &self.flush.backend.shared;
        let dst = self.wgpu_buffer(to)?;
        let src = self.flush.backend.owns(from);
        match (src, dst.host()) {
            // Device to device.
            (Some(src), None) if !src.is_host() => shared.copy(&src, &dst),
            // Host (an offloaded value, or another device's buffer read now) to device.
            (_, None) => {
                let mut bytes = vec![0u8; dst.bytes()];
                from.read_into(&mut bytes)?;
                shared.write(&dst, &bytes)
            }
            // To host memory: waits for the work issued so far (the value's writer among it).
            (Some(src), Some(mut host)) => src.read_into(&mut host),
            (None, Some(mut host)) => from.read_into(&mut host),
        }
    }

    fn launch(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        self.run(call)
    }

    fn library(&mut self, call: &Call<'_>) -> Result<(), DeviceError> {
        // No vendor library: the printer's tiled matrix product and its epilogue.
        self.run(call)
    }
}
