//! The memory of one wgpu device and the order in which its work is issued.
//!
//! **Memory.** Device buffers are slices of large wgpu storage buffers (*chunks*), handed out by
//! the runtime's [`Pool`]: the pool deals in addresses, so each chunk gets a made-up address
//! range ([`Chunks`]) and a slice's address is its chunk's plus its offset. Every request is
//! rounded up to the adapter's `min_storage_buffer_offset_alignment` (at least the pool's 64
//! bytes), so every slice starts at an offset a kernel can bind. A request beyond the adapter's
//! `max_storage_buffer_binding_size` (or `max_buffer_size`) could never be bound by a kernel,
//! and one the driver cannot back is out of memory: both are
//! [`DeviceError::OutOfMemory`], after the pending work is submitted, waited for and free
//! chunks are returned once. Offloaded values (the schedule's host space) are host memory
//! (`Vec<u8>`), counted in no device statistic.
//!
//! **Order.** wgpu has one queue, and everything on it runs in submission order (wgpu puts a
//! barrier between passes that touch the same buffer). All device work of this device, from
//! any thread, is appended to one open command encoder ([`WgpuMemory::encode`]) in the order the
//! host issues it, and that encoder is submitted before anything that must see its results
//! (a read, a wait, the end of a flush). So *issue order is execution order*: work issued
//! after other work runs after it. That is why a freed slice goes back to the pool at once:
//! whoever used it issued that use while holding the buffer, so before the free, and whoever
//! takes the slice next issues its use after the free, so after every old use. A gated free
//! is the same: the walker hands it over only after the gating events' records were issued,
//! i.e. after every reader on every stream was issued. Uploads are copies from a staging
//! buffer encoded in the same encoder (never `queue.write_buffer`, which would run at the
//! start of the next submission, ahead of work encoded before it).
//!
//! Poison mode fills a freed slice with 0xFF bytes by copies encoded at the free, so they run
//! after every use of the slice and before its next user.
//!
//! Must never: let the host write memory the device may still read (staging buffers are
//! fresh per upload), submit work out of issue order, or panic on a run-time failure.

use super::WgpuContext;
use crate::runtime::pool::{ALIGN, ChunkAllocator, LiveBytes, Pool, Slice};
use crate::{DeviceBuffer, DeviceError};
use braid_graph::MemoryKind;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bytes of the 0xFF source that poison fills copy from (larger slices take several copies).
const POISON_BYTES: u64 = 1 << 20;

/// Chunks: wgpu storage buffers under made-up addresses.
pub(crate) struct Chunks {
    ctx: Arc<WgpuContext>,
    by_addr: Mutex<BTreeMap<u64, wgpu::Buffer>>,
    next: AtomicU64,
}

impl ChunkAllocator for Chunks {
    fn alloc_chunk(&self, bytes: usize) -> Option<u64> {
        match self.ctx.create_buffer(bytes as u64) {
            Ok(buffer) => {
                // Address ranges never overlap and are never reused; a gap keeps them apart.
                let addr = self.next.fetch_add(bytes as u64 + ALIGN as u64, Ordering::Relaxed);
                lock(&self.by_addr).insert(addr, buffer);
                Some(addr)
            }
            Err(e) => {
                tracing::debug!(target: "braid", "a wgpu chunk of {bytes} bytes: {e}");
                None
            }
        }
    }

    unsafe fn free_chunk(&self, addr: u64, _bytes: usize) {
        // wgpu keeps the buffer alive for work already encoded or submitted that uses it.
        lock(&self.by_addr).remove(&addr);
    }
}

impl Chunks {
    /// The chunk holding `addr`: its buffer, its address and the offset of `addr` in it.
    fn find(&self, addr: u64) -> Option<(wgpu::Buffer, u64, u64)> {
        let map = lock(&self.by_addr);
        let (&base, buffer) = map.range(..=addr).next_back()?;
        (addr - base < buffer.size()).then(|| (buffer.clone(), base, addr - base))
    }
}

/// The memory and the open command encoder of one device, shared by its backend and buffers.
pub struct WgpuMemory {
    pub(crate) ctx: Arc<WgpuContext>,
    pool: Pool<Chunks>,
    /// Requests are rounded up to this (a multiple of [`ALIGN`]).
    pub(crate) align: u64,
    /// The largest buffer a kernel can bind.
    pub(crate) max_bytes: u64,
    stats: Mutex<LiveBytes>,
    /// Work issued but not yet submitted, in issue order.
    pending: Mutex<Option<wgpu::CommandEncoder>>,
    poison_source: Mutex<Option<wgpu::Buffer>>,
}

/// Where a buffer's bytes are.
enum Mem {
    /// A slice of a device chunk (`None` for zero bytes).
    Device(Option<Slice>),
    /// Host memory (an offloaded value).
    Host(Mutex<Vec<u8>>),
}

/// A buffer of a wgpu device (see the module docs); its memory goes back with the last handle.
pub struct WgpuBuffer {
    mem: Mem,
    bytes: usize,
    /// Bytes it counts in the device's `in_use`.
    counted: u64,
    exact: bool,
    poison: bool,
    shared: Arc<WgpuMemory>,
}

impl WgpuMemory {
    pub(crate) fn new(ctx: Arc<WgpuContext>) -> Arc<WgpuMemory> {
        let align = (ctx.limits.min_storage_buffer_offset_alignment as u64).max(ALIGN as u64);
        let align = align.div_ceil(ALIGN as u64) * ALIGN as u64;
        let max_bytes = ctx.limits.max_storage_buffer_binding_size.min(ctx.limits.max_buffer_size);
        let chunks = Chunks { ctx: ctx.clone(), by_addr: Mutex::new(BTreeMap::new()), next: AtomicU64::new(1 << 20) };
        Arc::new(WgpuMemory {
            ctx,
            pool: Pool::new(chunks),
            align,
            max_bytes,
            stats: Mutex::new(LiveBytes::default()),
            pending: Mutex::new(None),
            poison_source: Mutex::new(None),
        })
    }

    /// Appends work to the open encoder (issue order is execution order).
    pub(crate) fn encode<T>(&self, f: impl FnOnce(&mut wgpu::CommandEncoder) -> T) -> T {
        let mut pending = lock(&self.pending);
        let encoder = pending.get_or_insert_with(|| self.ctx.encoder());
        f(encoder)
    }

    /// Submits the work issued so far.
    pub(crate) fn submit(&self) -> Result<(), DeviceError> {
        let mut pending = lock(&self.pending);
        match pending.take() {
            // Submitted under the lock, so no later work overtakes it.
            Some(encoder) => self.ctx.submit(encoder),
            None => Ok(()),
        }
    }

    /// Submits and waits for everything issued so far.
    pub(crate) fn synchronize(&self) -> Result<(), DeviceError> {
        self.submit()?;
        self.ctx.wait()
    }

    /// Waits for the device and returns free chunks to the driver.
    pub(crate) fn trim(&self) -> Result<(), DeviceError> {
        let waited = self.synchronize();
        self.pool.trim();
        waited
    }

    fn slice(&self, bytes: usize, exact: bool) -> Result<Slice, DeviceError> {
        let size = (bytes as u64).div_ceil(self.align).max(1) * self.align;
        let out_of_memory = || {
            let s = self.pool.stats();
            DeviceError::OutOfMemory { requested: bytes as u64, in_use: s.in_use, reserved: s.reserved }
        };
        if size > self.max_bytes {
            tracing::debug!(
                target: "braid",
                "a wgpu buffer of {bytes} bytes exceeds the adapter's largest binding ({} bytes)",
                self.max_bytes
            );
            return Err(out_of_memory());
        }
        let take = || if exact { self.pool.alloc_exact(size as usize) } else { self.pool.alloc(size as usize) };
        if let Some(s) = take() {
            return Ok(s);
        }
        // Free chunks may be held for reuse: give them back and try once more.
        self.trim()?;
        take().ok_or_else(out_of_memory)
    }

    /// A new device buffer of `bytes` (contents unspecified).
    pub(crate) fn buffer(
        self: &Arc<WgpuMemory>,
        bytes: usize,
        exact: bool,
        poison: bool,
    ) -> Result<WgpuBuffer, DeviceError> {
        let slice = if bytes == 0 { None } else { Some(self.slice(bytes, exact)?) };
        let counted = slice.as_ref().map_or(0, |s| s.size as u64);
        lock(&self.stats).add(counted, exact);
        Ok(WgpuBuffer { mem: Mem::Device(slice), bytes, counted, exact, poison, shared: self.clone() })
    }

    /// Kernel scratch of `bytes` (at least one word): device memory that is no buffer of the
    /// schedule, so it counts in `reserved` only (as the CUDA device's scratch does).
    pub(crate) fn scratch(self: &Arc<WgpuMemory>, bytes: usize) -> Result<WgpuBuffer, DeviceError> {
        let slice = self.slice(bytes.max(4), false)?;
        Ok(WgpuBuffer {
            mem: Mem::Device(Some(slice)),
            bytes,
            counted: 0,
            exact: false,
            poison: false,
            shared: self.clone(),
        })
    }

    /// A new buffer of host memory (an offloaded value), zeroed.
    pub(crate) fn host_buffer(self: &Arc<WgpuMemory>, bytes: usize) -> WgpuBuffer {
        let mem = Mem::Host(Mutex::new(vec![0u8; bytes]));
        WgpuBuffer { mem, bytes, counted: 0, exact: false, poison: false, shared: self.clone() }
    }

    /// A new device buffer holding `bytes`.
    pub(crate) fn upload(self: &Arc<WgpuMemory>, bytes: &[u8], poison: bool) -> Result<WgpuBuffer, DeviceError> {
        let buffer = self.buffer(bytes.len(), false, poison)?;
        self.write(&buffer, bytes)?;
        Ok(buffer)
    }

    /// Issues a write of `bytes` (the buffer's length) into device buffer `dst`, through a
    /// fresh staging buffer copied in issue order.
    pub(crate) fn write(&self, dst: &WgpuBuffer, bytes: &[u8]) -> Result<(), DeviceError> {
        if bytes.len() != dst.bytes {
            return Err(DeviceError::Internal(format!("writing {} bytes to a buffer of {}", bytes.len(), dst.bytes)));
        }
        let Some((chunk, _, offset)) = dst.binding()? else { return Ok(()) };
        let size = (bytes.len() as u64).div_ceil(4) * 4;
        let fail = |e: String| DeviceError::Kernel(format!("a staging buffer of {size} bytes: {e}"));
        let staging = self.ctx.scoped(size, fail, || {
            self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("braid upload"),
                size,
                usage: wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            })
        })?;
        {
            let mut view = staging
                .get_mapped_range_mut(..)
                .map_err(|e| DeviceError::Kernel(format!("writing a staging buffer: {e}")))?;
            if size as usize == bytes.len() {
                view.copy_from_slice(bytes);
            } else {
                let mut padded = bytes.to_vec();
                padded.resize(size as usize, 0);
                view.copy_from_slice(&padded);
            }
        }
        staging.unmap();
        self.encode(|e| e.copy_buffer_to_buffer(&staging, 0, &chunk, offset, size));
        Ok(())
    }

    /// Issues a copy of `bytes` bytes between two device buffers.
    pub(crate) fn copy(&self, from: &WgpuBuffer, to: &WgpuBuffer) -> Result<(), DeviceError> {
        let (Some((src, src_base, src_off)), Some((dst, dst_base, dst_off))) = (from.binding()?, to.binding()?) else {
            return Ok(());
        };
        let size = (from.bytes as u64).div_ceil(4) * 4;
        if src_base != dst_base {
            self.encode(|e| e.copy_buffer_to_buffer(&src, src_off, &dst, dst_off, size));
            return Ok(());
        }
        // wgpu refuses copies within one buffer: through a temporary one.
        let tmp = self.ctx.create_buffer(size)?;
        self.encode(|e| {
            e.copy_buffer_to_buffer(&src, src_off, &tmp, 0, size);
            e.copy_buffer_to_buffer(&tmp, 0, &dst, dst_off, size);
        });
        Ok(())
    }

    /// The bytes of device buffer `buffer` once the work issued before the call is done.
    /// Blocks.
    pub(crate) fn read(&self, buffer: &WgpuBuffer, dst: &mut [u8]) -> Result<(), DeviceError> {
        if dst.len() != buffer.bytes {
            return Err(DeviceError::Internal(format!("a read of {} bytes into {}", buffer.bytes, dst.len())));
        }
        if let Mem::Host(h) = &buffer.mem {
            dst.copy_from_slice(&lock(h));
            return Ok(());
        }
        let Some((chunk, _, offset)) = buffer.binding()? else { return Ok(()) };
        // Everything issued so far is submitted first; the context's read submits after it.
        self.submit()?;
        let data = self.ctx.read_at(&chunk, offset, dst.len() as u64)?;
        dst.copy_from_slice(&data);
        Ok(())
    }

    /// Issues a fill of `slice` with 0xFF bytes.
    fn poison(&self, slice: &Slice) -> Result<(), DeviceError> {
        let Some((chunk, _, offset)) = self.pool_find(slice.addr) else {
            return Err(DeviceError::Internal("a freed slice is in no chunk".into()));
        };
        let mut source = lock(&self.poison_source);
        if source.is_none() {
            let fail = |e: String| DeviceError::Kernel(format!("the poison source buffer: {e}"));
            let b = self.ctx.scoped(POISON_BYTES, fail, || {
                self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("braid poison"),
                    size: POISON_BYTES,
                    usage: wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                })
            })?;
            b.get_mapped_range_mut(..)
                .map_err(|e| DeviceError::Kernel(format!("filling the poison source: {e}")))?
                .copy_from_slice(&vec![0xFF; POISON_BYTES as usize]);
            b.unmap();
            *source = Some(b);
        }
        let source = source.as_ref().expect("created above");
        self.encode(|e| {
            let mut at = 0;
            while at < slice.size as u64 {
                let n = (slice.size as u64 - at).min(POISON_BYTES);
                e.copy_buffer_to_buffer(source, 0, &chunk, offset + at, n);
                at += n;
            }
        });
        Ok(())
    }

    fn pool_find(&self, addr: u64) -> Option<(wgpu::Buffer, u64, u64)> {
        self.pool.allocator().find(addr)
    }

    /// (live bytes, peak, reserved bytes).
    pub(crate) fn stats(&self) -> (u64, u64, u64) {
        let st = lock(&self.stats);
        (st.live, st.peak, self.pool.stats().reserved)
    }

    pub(crate) fn reset_peak(&self) {
        lock(&self.stats).reset_peak();
    }

    pub(crate) fn persistent(&self) -> u64 {
        lock(&self.stats).persistent
    }
}

impl WgpuBuffer {
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether it is host memory (an offloaded value).
    pub fn is_host(&self) -> bool {
        matches!(self.mem, Mem::Host(_))
    }

    pub(crate) fn shared(&self) -> &Arc<WgpuMemory> {
        &self.shared
    }

    /// Its chunk, the chunk's address and its offset there (`None` for zero bytes); an `Err`
    /// for host memory, which kernels and device copies cannot reach.
    pub(crate) fn binding(&self) -> Result<Option<(wgpu::Buffer, u64, u64)>, DeviceError> {
        match &self.mem {
            Mem::Device(None) => Ok(None),
            Mem::Device(Some(s)) => self
                .shared
                .pool_find(s.addr)
                .map(Some)
                .ok_or_else(|| DeviceError::Internal("a live slice is in no chunk".into())),
            Mem::Host(_) => {
                Err(DeviceError::Internal("a kernel or device copy was given offloaded host memory".into()))
            }
        }
    }

    /// The host bytes of an offloaded value (`None` for device memory).
    pub(crate) fn host(&self) -> Option<MutexGuard<'_, Vec<u8>>> {
        match &self.mem {
            Mem::Host(h) => Some(lock(h)),
            Mem::Device(_) => None,
        }
    }
}

impl DeviceBuffer for WgpuBuffer {
    fn bytes(&self) -> usize {
        self.bytes
    }

    fn is_persistent(&self) -> bool {
        self.exact
    }

    fn is_offloaded(&self) -> bool {
        self.is_host()
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    /// Submits and waits for the work issued on its device before the call.
    fn read_into(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.shared.read(self, dst)
    }
}

impl Drop for WgpuBuffer {
    fn drop(&mut self) {
        let Mem::Device(slice) = &mut self.mem else { return };
        let Some(slice) = slice.take() else { return };
        let shared = &self.shared;
        if self.poison
            && let Err(e) = shared.poison(&slice)
        {
            tracing::warn!(target: "braid", "poisoning a freed wgpu buffer: {e}");
        }
        lock(&shared.stats).remove(self.counted, self.exact);
        // Reusable at once: every use of it was issued before this point (module docs).
        shared.pool.free(slice);
    }
}

impl std::fmt::Debug for WgpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_host() { "host" } else { "device" };
        write!(f, "WgpuBuffer({} B of {kind} memory)", self.bytes)
    }
}
