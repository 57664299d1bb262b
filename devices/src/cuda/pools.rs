//! The memory of one CUDA device and its buffers: a device pool over `cuMemAlloc` chunks, a
//! pinned host pool (offloaded values, staging of host transfers), and the rule that decides
//! when freed memory may be handed out again.
//!
//! A buffer's memory is a slice of a pool chunk. The GPU runs behind the host, so a slice
//! freed on the host may still be used by queued work: it waits, gated on a list of lane
//! points (`super::lanes`), and goes back to its pool once every point is reached (learned
//! from markers when allocating). Where it came from decides the gate:
//! - a free step of a flush on lane `l` (`Queue::free`): the point of `l` at the step;
//! - a gated free (`Flush::free_after`): the points where the gating events were recorded, and
//!   the freeing lane's point;
//! - a buffer dropped anywhere else (outputs and inputs the engine lets go of, after a flush):
//!   every lane's point at the drop, since its last user is enqueued by then (whoever enqueued
//!   work on it held a handle while doing so).
//!
//! A device slice gated only on points of lane `l` is reused at once by an allocation on `l`:
//! stream order puts every later use after the old ones (the scheduler orders every access of
//! a buffer after its allocation step). Pinned slices are written by the host (staging), so
//! they are reused only once their gate is reached. When a pool has no room, the host waits for
//! the whole GPU, every waiting slice goes back, free chunks are returned, and the allocation
//! is tried once more before it is [`DeviceError::OutOfMemory`].
//!
//! `memory()` counts live buffers (as the scheduler plans them: bytes rounded to the pool's
//! alignment); `reserved` is the device pool's chunks (cuBLAS workspaces and kernel scratch
//! included, which are no buffers). Poison mode fills a freed device slice with 0xFF on the
//! freeing lane, after what it waits for, and a pinned slice on the host once its gate is
//! reached.
//!
//! Must never: hand out a slice before its gate is reached (but to the lane it is gated on),
//! block the host except when reading a value, when out of memory, or when trimming.

use super::context::{Gpu, Stream};
use super::lanes::{EventPool, LaneId, Lanes, Point, TRANSFER, lock};
use super::memory::{
    alloc_device_chunk, alloc_host_chunk, copy_async, fill_device, free_device_chunk, free_host_chunk,
};
use super::{Blas, TRACE_TARGET};
use crate::runtime::pool::{ChunkAllocator, LiveBytes, Pool, Slice, round_up};
use crate::{DeviceBuffer, DeviceError};
use braid_graph::MemoryKind;
use std::sync::{Arc, Mutex, MutexGuard};

/// Device chunks from `cuMemAlloc`.
pub(crate) struct DeviceChunks(Arc<Gpu>);

impl ChunkAllocator for DeviceChunks {
    fn alloc_chunk(&self, bytes: usize) -> Option<u64> {
        match alloc_device_chunk(&self.0, bytes as u64) {
            Ok(p) => Some(p),
            Err(DeviceError::OutOfMemory { .. }) => None,
            Err(e) => {
                tracing::warn!(target: TRACE_TARGET, "a device chunk of {bytes} bytes: {e}");
                None
            }
        }
    }

    unsafe fn free_chunk(&self, addr: u64, _bytes: usize) {
        // SAFETY: the pool's contract (no slice in use); the free waits for the GPU.
        if let Err(e) = unsafe { free_device_chunk(&self.0, addr) } {
            tracing::warn!(target: TRACE_TARGET, "returning a device chunk: {e}");
        }
    }

    fn keeps_idle_chunks(&self) -> bool {
        true
    }
}

/// Pinned host chunks from `cuMemHostAlloc`.
pub(crate) struct PinnedChunks(Arc<Gpu>);

impl ChunkAllocator for PinnedChunks {
    fn alloc_chunk(&self, bytes: usize) -> Option<u64> {
        match alloc_host_chunk(&self.0, bytes as u64) {
            Ok(p) => Some(p as u64),
            Err(DeviceError::OutOfMemory { .. }) => None,
            Err(e) => {
                tracing::warn!(target: TRACE_TARGET, "a pinned chunk of {bytes} bytes: {e}");
                None
            }
        }
    }

    unsafe fn free_chunk(&self, addr: u64, _bytes: usize) {
        // SAFETY: as above.
        if let Err(e) = unsafe { free_host_chunk(&self.0, addr as *mut u8) } {
            tracing::warn!(target: TRACE_TARGET, "returning a pinned chunk: {e}");
        }
    }

    fn keeps_idle_chunks(&self) -> bool {
        true
    }
}

/// Which pool a slice belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mem {
    Device,
    Pinned,
}

/// A freed slice waiting for its gate.
struct Waiting {
    slice: Slice,
    mem: Mem,
    exact: bool,
    gate: Vec<Point>,
    /// Fill with 0xFF on the host when it goes back (a pinned slice in poison mode).
    poison_host: bool,
}

/// What the device's mutex guards.
pub(crate) struct PoolState {
    pub(crate) lanes: Lanes,
    waiting: Vec<Waiting>,
    /// `lanes.generation` when `waiting` was last swept.
    swept: u64,
    bytes: LiveBytes,
    /// Per lane that ran a product: its cuBLAS handle and workspace.
    pub(crate) blas: Vec<(LaneId, Arc<Blas>, Slice)>,
}

/// The memory pools and lanes of one device, shared by its backend and every buffer.
pub struct CudaPools {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) events: Arc<EventPool>,
    device: Pool<DeviceChunks>,
    pinned: Pool<PinnedChunks>,
    state: Mutex<PoolState>,
    tf32: bool,
    /// Bumped whenever the cuBLAS handles and workspaces are given back: a CUDA graph recorded
    /// before refers to freed workspaces (`super::graph`).
    blas_epoch: std::sync::atomic::AtomicU64,
}

impl CudaPools {
    pub(crate) fn new(gpu: &Arc<Gpu>, tf32: bool) -> Result<Arc<CudaPools>, DeviceError> {
        let state = PoolState {
            lanes: Lanes::new(gpu)?,
            waiting: Vec::new(),
            swept: 0,
            bytes: LiveBytes::default(),
            blas: Vec::new(),
        };
        Ok(Arc::new(CudaPools {
            gpu: gpu.clone(),
            events: EventPool::new(gpu),
            device: Pool::new(DeviceChunks(gpu.clone())),
            pinned: Pool::new(PinnedChunks(gpu.clone())),
            state: Mutex::new(state),
            tf32,
            blas_epoch: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, PoolState> {
        lock(&self.state)
    }

    /// The stream of `lane`.
    pub(crate) fn stream(&self, lane: LaneId) -> Arc<Stream> {
        self.state().lanes.lanes[lane].stream.clone()
    }

    /// Counts an operation just enqueued on `lane`.
    pub(crate) fn bump(&self, lane: LaneId) {
        self.state().lanes.bump(lane)
    }

    fn pool_free(&self, w: Waiting) {
        match w.mem {
            Mem::Device => self.device.free(w.slice),
            Mem::Pinned => {
                if w.poison_host {
                    // SAFETY: pinned host memory of the slice; its gate is reached, so no
                    // queued copy uses it, and nothing else holds it.
                    unsafe { std::ptr::write_bytes(w.slice.addr as *mut u8, 0xFF, w.slice.size) };
                }
                self.pinned.free(w.slice)
            }
        }
    }

    /// Sends every waiting slice whose gate is reached back to its pool.
    fn reclaim(&self, st: &mut PoolState) {
        if st.waiting.is_empty() {
            return;
        }
        st.lanes.refresh();
        if st.lanes.generation == st.swept {
            return;
        }
        st.swept = st.lanes.generation;
        let mut i = 0;
        while i < st.waiting.len() {
            if st.waiting[i].gate.iter().all(|&p| st.lanes.reached(p)) {
                let w = st.waiting.swap_remove(i);
                self.pool_free(w);
            } else {
                i += 1;
            }
        }
    }

    /// A slice of `bytes` (> 0) if one is free for an allocation on `lane` (`None`: used
    /// outside stream order, by the host).
    fn take(&self, st: &mut PoolState, lane: Option<LaneId>, bytes: usize, mem: Mem, exact: bool) -> Option<Slice> {
        self.reclaim(st);
        let need = round_up(bytes);
        if let (Mem::Device, Some(l)) = (mem, lane) {
            let lanes = &st.lanes;
            let best = (st.waiting.iter().enumerate())
                .filter(|(_, w)| w.mem == Mem::Device && w.exact == exact)
                .filter(|(_, w)| if exact { w.slice.size == need } else { (need..=2 * need).contains(&w.slice.size) })
                .filter(|(_, w)| w.gate.iter().all(|&(gl, n)| gl == l || lanes.reached((gl, n))))
                .min_by_key(|(_, w)| w.slice.size)
                .map(|(i, _)| i);
            if let Some(i) = best {
                return Some(st.waiting.swap_remove(i).slice);
            }
        }
        match (mem, exact) {
            (Mem::Device, false) => self.device.alloc(bytes),
            (Mem::Device, true) => self.device.alloc_exact(bytes),
            (Mem::Pinned, false) => self.pinned.alloc(bytes),
            (Mem::Pinned, true) => self.pinned.alloc_exact(bytes),
        }
    }

    /// A slice of `bytes` (> 0), waiting for the GPU and releasing cached memory once before
    /// reporting that there is no room.
    pub(crate) fn slice(
        &self,
        lane: Option<LaneId>,
        bytes: usize,
        mem: Mem,
        exact: bool,
    ) -> Result<Slice, DeviceError> {
        if let Some(s) = self.take(&mut self.state(), lane, bytes, mem, exact) {
            return Ok(s);
        }
        tracing::debug!(target: TRACE_TARGET, bytes, ?mem, "no room: waiting for the GPU and releasing cached memory");
        self.quiesce()?;
        if let Some(s) = self.take(&mut self.state(), lane, bytes, mem, exact) {
            return Ok(s);
        }
        let st = self.state();
        let reserved = match mem {
            Mem::Device => self.device.stats().reserved,
            Mem::Pinned => self.pinned.stats().reserved,
        };
        Err(DeviceError::OutOfMemory { requested: bytes as u64, in_use: st.bytes.live, reserved })
    }

    /// Gives `slice` back once every point of `gate` is reached.
    pub(crate) fn give(&self, slice: Slice, mem: Mem, exact: bool, gate: Vec<Point>, poison: bool) {
        let mut st = self.state();
        let w = Waiting { slice, mem, exact, gate, poison_host: poison && mem == Mem::Pinned };
        if w.gate.iter().all(|&p| st.lanes.reached(p)) {
            drop(st);
            self.pool_free(w);
        } else {
            st.waiting.push(w);
        }
    }

    /// Waits for everything enqueued on the GPU so far (reporting an asynchronous failure),
    /// then sends the slices waiting for it back.
    pub(crate) fn synchronize(&self) -> Result<(), DeviceError> {
        let counts = self.state().lanes.issued_counts();
        self.gpu.synchronize()?;
        let mut st = self.state();
        st.lanes.reached_all(&counts);
        self.reclaim(&mut st);
        Ok(())
    }

    /// [`CudaPools::synchronize`], then returns free chunks to the driver.
    pub(crate) fn quiesce(&self) -> Result<(), DeviceError> {
        self.synchronize()?;
        self.device.trim();
        self.pinned.trim();
        Ok(())
    }

    /// A new buffer of `bytes` for work on `lane` (`None`: outside stream order).
    pub(crate) fn buffer(
        self: &Arc<CudaPools>,
        lane: Option<LaneId>,
        bytes: usize,
        mem: Mem,
        exact: bool,
        poison: bool,
    ) -> Result<CudaBuffer, DeviceError> {
        let slice = if bytes == 0 { None } else { Some(self.slice(lane, bytes, mem, exact)?) };
        let counted = if slice.is_some() && mem == Mem::Device { round_up(bytes) as u64 } else { 0 };
        if counted > 0 {
            self.state().bytes.add(counted, exact);
        }
        Ok(CudaBuffer { slice, bytes, counted, mem, exact, poison, pools: self.clone() })
    }

    /// Takes the memory out of `buffer` (it is no longer live).
    fn retire(&self, buffer: &mut CudaBuffer) -> Option<Slice> {
        let slice = buffer.slice.take()?;
        if buffer.counted > 0 {
            self.state().bytes.remove(buffer.counted, buffer.exact);
        }
        Some(slice)
    }

    /// Frees `buffer` at the current end of `lane`, once the markers of `after` (points of
    /// other lanes) are reached too; in poison mode, `lane` waits for `after` and fills it.
    pub(crate) fn free_on(
        &self,
        lane: LaneId,
        mut buffer: CudaBuffer,
        after: &[(Point, &super::lanes::Marker)],
    ) -> Result<(), DeviceError> {
        let Some(slice) = self.retire(&mut buffer) else { return Ok(()) };
        let mut gate: Vec<Point> = after.iter().map(|(p, _)| *p).collect();
        if buffer.poison && buffer.mem == Mem::Device {
            let stream = self.stream(lane);
            let fill = (|| {
                for (_, m) in after {
                    stream.wait(m.event())?;
                }
                // SAFETY: the slice is ours; every earlier user is before this point of `lane`
                // or before the events it now waits for.
                unsafe { fill_device(slice.addr, 0xFF, slice.size, stream.raw()) }
            })();
            self.bump(lane);
            if let Err(e) = fill {
                self.give(slice, buffer.mem, buffer.exact, self.everything(), false);
                return Err(e);
            }
        }
        gate.push(self.state().lanes.point(lane));
        self.give(slice, buffer.mem, buffer.exact, gate, buffer.poison);
        Ok(())
    }

    /// Every lane's point now.
    fn everything(&self) -> Vec<Point> {
        self.state().lanes.points()
    }

    /// A dropped buffer's memory: reused once everything enqueued so far is done.
    fn dropped(&self, buffer: &mut CudaBuffer) {
        let Some(slice) = self.retire(buffer) else { return };
        let mut gate = self.everything();
        if buffer.poison && buffer.mem == Mem::Device {
            let filled = (|| {
                self.gpu.bind()?;
                let fence = self.state().lanes.fence(&self.events)?;
                let stream = self.stream(TRANSFER);
                for (l, m) in &fence {
                    if *l != TRANSFER {
                        stream.wait(m.event())?;
                    }
                }
                // SAFETY: the slice is ours; the transfer lane now follows all its users.
                let r = unsafe { fill_device(slice.addr, 0xFF, slice.size, stream.raw()) };
                self.bump(TRANSFER);
                r
            })();
            match filled {
                Ok(()) => gate.push(self.state().lanes.point(TRANSFER)),
                Err(e) => tracing::warn!(target: TRACE_TARGET, "poisoning a freed buffer: {e}"),
            }
        }
        self.give(slice, buffer.mem, buffer.exact, gate, buffer.poison);
    }

    /// Copies `buffer` into `dst` once everything enqueued on the device before the call is
    /// done (its writer among it): through pinned staging on the transfer lane. Blocks.
    pub(crate) fn read(&self, buffer: &CudaBuffer, dst: &mut [u8]) -> Result<(), DeviceError> {
        if dst.len() != buffer.bytes {
            return Err(DeviceError::Internal(format!("a read of {} bytes into {}", buffer.bytes, dst.len())));
        }
        if buffer.bytes == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let stream = self.stream(TRANSFER);
        let fence = self.state().lanes.fence(&self.events)?;
        for (l, m) in &fence {
            if *l != TRANSFER {
                stream.wait(m.event())?;
            }
        }
        let staging = self.slice(None, buffer.bytes, Mem::Pinned, false)?;
        let done = self.events.get();
        let copied = done.and_then(|done| {
            // SAFETY: the staging slice is ours and holds the bytes; the buffer is alive (held
            // by the caller) and its writer is before the fence the lane waits for.
            unsafe { copy_async(staging.addr, buffer.addr(), buffer.bytes, stream.raw())? };
            self.bump(TRANSFER);
            self.state().lanes.record(TRANSFER, done.clone())?;
            done.event().synchronize()
        });
        match copied {
            Ok(()) => {
                // SAFETY: the copy is done; the staging slice holds `bytes` bytes.
                unsafe { std::ptr::copy_nonoverlapping(staging.addr as *const u8, dst.as_mut_ptr(), dst.len()) };
                self.give(staging, Mem::Pinned, false, Vec::new(), false);
                Ok(())
            }
            Err(e) => {
                self.give(staging, Mem::Pinned, false, self.everything(), false);
                Err(e)
            }
        }
    }

    /// Enqueues a copy of `len` host bytes, written by `fill` into pinned staging, to `dst`
    /// (device or pinned memory) on `lane`. `fill` gets the staging bytes (a value from the
    /// host, or another device's buffer read into them).
    pub(crate) fn write(
        &self,
        lane: LaneId,
        dst: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        if len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let staging = self.slice(None, len, Mem::Pinned, false)?;
        // SAFETY: the staging slice is ours (its gate reached) and holds `len` bytes.
        let host = unsafe { std::slice::from_raw_parts_mut(staging.addr as *mut u8, len) };
        // `fill` may read another device's buffer (binding its context): bind ours again.
        if let Err(e) = fill(host).and_then(|()| self.gpu.bind()) {
            self.give(staging, Mem::Pinned, false, Vec::new(), false);
            return Err(e);
        }
        let stream = self.stream(lane);
        // SAFETY: `dst` is live memory of the caller's for `len` bytes; the staging slice
        // stays ours until the lane passes the copy (its gate below).
        let r = unsafe { copy_async(dst, staging.addr, len, stream.raw()) };
        self.bump(lane);
        let gate = vec![self.state().lanes.point(lane)];
        self.give(staging, Mem::Pinned, false, gate, false);
        r
    }

    /// The cuBLAS handle of `lane`, created with its workspace on first use.
    pub(crate) fn blas(&self, lane: LaneId) -> Result<Arc<Blas>, DeviceError> {
        if let Some((_, b, _)) = self.state().blas.iter().find(|(l, _, _)| *l == lane) {
            return Ok(b.clone());
        }
        let bytes = super::BLAS_WORKSPACE_BYTES;
        let workspace = self.slice(Some(lane), bytes, Mem::Device, false)?;
        let stream = self.stream(lane);
        // SAFETY: the stream lives as long as the device (lanes are never removed) and the
        // workspace stays with the handle until `drop_blas`, which runs with the GPU idle.
        match unsafe { Blas::new(&self.gpu, stream.raw(), workspace.addr, bytes, self.tf32) } {
            Ok(b) => {
                let b = Arc::new(b);
                self.state().blas.push((lane, b.clone(), workspace));
                Ok(b)
            }
            Err(e) => {
                self.give(workspace, Mem::Device, false, self.everything(), false);
                Err(e)
            }
        }
    }

    /// Destroys the cuBLAS handles and frees their workspaces. The GPU must be idle and no
    /// flush running.
    pub(crate) fn drop_blas(&self) {
        self.blas_epoch.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let handles = std::mem::take(&mut self.state().blas);
        for (_, b, workspace) in handles {
            drop(b);
            self.device.free(workspace);
        }
    }

    /// How many times the cuBLAS handles were given back (see `blas_epoch`).
    pub(crate) fn blas_epoch(&self) -> u64 {
        self.blas_epoch.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// (live bytes, peak, reserved device bytes).
    pub(crate) fn stats(&self) -> (u64, u64, u64) {
        let st = self.state();
        (st.bytes.live, st.bytes.peak, self.device.stats().reserved)
    }

    pub(crate) fn reset_peak(&self) {
        self.state().bytes.reset_peak();
    }

    pub(crate) fn persistent(&self) -> u64 {
        self.state().bytes.persistent
    }

    /// Bytes held by pinned host memory (offloads, staging): in use and reserved.
    pub(crate) fn pinned_stats(&self) -> crate::MemoryStats {
        self.pinned.stats()
    }
}

impl Drop for CudaPools {
    fn drop(&mut self) {
        // Nothing may be queued when the pools return their chunks.
        let _ = self.gpu.synchronize();
        self.drop_blas();
    }
}

/// A buffer of a CUDA device: a slice of device memory (or of pinned host memory, for an
/// offloaded value). Its memory goes back (gated, see the module docs) with the last handle.
pub struct CudaBuffer {
    slice: Option<Slice>,
    bytes: usize,
    /// Bytes it counts in the device's `in_use`.
    counted: u64,
    mem: Mem,
    exact: bool,
    poison: bool,
    pools: Arc<CudaPools>,
}

impl CudaBuffer {
    /// Its address (device memory, or pinned host memory addressed the same way): 0 when it
    /// holds no bytes.
    pub fn addr(&self) -> u64 {
        self.slice.as_ref().map_or(0, |s| s.addr)
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Exact-size memory for a parameter.
    pub fn is_exact(&self) -> bool {
        self.exact
    }

    /// Whether it lives in pinned host memory (an offloaded value).
    pub fn is_pinned(&self) -> bool {
        self.mem == Mem::Pinned
    }

    pub(crate) fn pools(&self) -> &Arc<CudaPools> {
        &self.pools
    }
}

impl DeviceBuffer for CudaBuffer {
    fn bytes(&self) -> usize {
        self.bytes
    }

    fn is_persistent(&self) -> bool {
        self.exact
    }

    fn is_offloaded(&self) -> bool {
        self.is_pinned()
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    /// Waits for the work writing it (everything enqueued on its GPU before the call).
    fn read_into(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.pools.read(self, dst)
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        let pools = self.pools.clone();
        pools.dropped(self);
    }
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_pinned() { "pinned" } else { "device" };
        write!(f, "CudaBuffer({} B of {kind} memory at {:#x})", self.bytes, self.addr())
    }
}
