//! The memory pool every backend allocates from: buffers are slices of large chunks, reused
//! after they are freed. Chunks come from a [`ChunkAllocator`] (host memory for the CPU, a
//! GPU's memory for GPU backends); the pool deals in addresses and never touches the memory.
//!
//! Allocation takes an exact-size free slice first, then the smallest free slice that is large
//! enough (splitting off the rest), and only then asks the system for a new chunk (as
//! Burn-Compute does). Freed slices merge with free neighbours, except small ones (up to
//! [`SMALL_MAX`] bytes, [`SMALL_KEPT_BYTES`] of them in all), kept aside by size for the next
//! request of that size (small tensors come and go every step) and merged back at a trim.
//! Wholly free chunks are kept for
//! reuse up to a cap and returned to the system beyond it (a GPU's pools keep them all until
//! trimmed: giving a chunk back waits for the whole GPU). The pool accounts truthfully:
//! `in_use` is the bytes of live slices (after alignment), `reserved` the bytes of chunks held.
//! It never reads or writes the memory it hands out (poisoning freed memory is the buffer's job).
//!
//! Parameters (`alloc_exact`) take chunks of their exact size, never split and reused only by a
//! request of the same size: training replaces each parameter by a new version of the same size
//! every step, and keeping them apart keeps long-lived buffers from pinning the chunks that
//! short-lived activations are cut from (Burn keeps parameters in such a pool).

use std::alloc::{Layout, alloc, dealloc};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

/// Alignment of every slice (a cache line; enough for any SIMD load, and for GPU loads).
pub const ALIGN: usize = 64;
/// Chunks for small requests are at least this large, so many small buffers share one.
const MIN_CHUNK: usize = 2 << 20;
/// Wholly free chunks beyond this many bytes (or beyond the bytes in use, if larger) go back to
/// the system.
const KEEP_FREE: usize = 256 << 20;
/// Freed slices of at most this many bytes (scalars, small activations) are kept aside by size
/// for the next request of the same size: a replayed step or a small model's training step
/// makes and frees many every call, and each would otherwise cost a best-fit search and a
/// merge in the ordered free lists (about 12% of C4's replay). They merge back into their
/// chunks when the pool is trimmed.
const SMALL_MAX: usize = 4096;
/// At most this many bytes of small slices are kept aside (the rest merge as usual).
const SMALL_KEPT_BYTES: usize = 1 << 20;

/// Memory counters of a device, in bytes: live buffers (`in_use`, after alignment), the highest
/// `in_use` since the last reset (`peak`) and memory held from the system (`reserved`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub in_use: u64,
    pub peak: u64,
    pub reserved: u64,
}

/// Where a pool's chunks come from: host memory, a GPU's memory, pinned host memory.
pub trait ChunkAllocator: Send + Sync {
    /// Reserves `bytes` (a multiple of [`ALIGN`]), aligned to [`ALIGN`]; its address, or `None`
    /// when no memory is left.
    fn alloc_chunk(&self, bytes: usize) -> Option<u64>;
    /// Gives back a chunk that `alloc_chunk` returned, with its size.
    ///
    /// # Safety
    /// No slice of the chunk is in use any more.
    unsafe fn free_chunk(&self, addr: u64, bytes: usize);
    /// Whether wholly free chunks stay in the pool until [`Pool::trim`] instead of going back
    /// beyond the cap. A GPU's allocator says yes: returning a chunk waits for the whole GPU
    /// and taking it again costs a fresh allocation (page-locking, for pinned host memory: an
    /// offloading step that gave its chunks back stalled the GPU for about 70 ms per 512 MiB
    /// chunk on the H100). Such a pool is trimmed by `Device::trim_memory` and before it
    /// reports out of memory.
    fn keeps_idle_chunks(&self) -> bool {
        false
    }
}

/// Host memory from the global allocator (the CPU device's memory and its offload space).
#[derive(Default)]
pub struct HostMemory;

impl ChunkAllocator for HostMemory {
    fn alloc_chunk(&self, bytes: usize) -> Option<u64> {
        let layout = Layout::from_size_align(bytes, ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size (the pool never asks for zero bytes).
        let ptr = unsafe { alloc(layout) };
        (!ptr.is_null()).then_some(ptr as u64)
    }

    unsafe fn free_chunk(&self, addr: u64, bytes: usize) {
        // SAFETY: allocated above with this layout.
        unsafe { dealloc(addr as *mut u8, Layout::from_size_align_unchecked(bytes, ALIGN)) }
    }
}

struct Chunk {
    addr: u64,
    size: usize,
    /// An exact-size chunk for one parameter (never split, never in `by_size`).
    exact: bool,
    /// Free ranges by offset (merged: no two are adjacent).
    free: BTreeMap<usize, usize>,
}

#[derive(Default)]
struct ChunkState {
    chunks: Vec<Option<Chunk>>,
    /// Every free range of every chunk, keyed for best-fit search: (size, chunk, offset).
    by_size: BTreeSet<(usize, usize, usize)>,
    /// Free exact-size chunks by size.
    exact_free: BTreeMap<usize, Vec<usize>>,
    /// Freed small slices not merged back, by size (`size / ALIGN - 1`; see [`SMALL_MAX`]):
    /// (chunk, offset).
    small: Vec<Vec<(usize, usize)>>,
    /// Their bytes.
    small_bytes: usize,
    in_use: usize,
    persistent: usize,
    peak: usize,
    reserved: usize,
}

/// A slice handed out by the pool.
#[derive(Debug)]
pub struct Slice {
    pub addr: u64,
    pub size: usize,
    chunk: usize,
    offset: usize,
}

/// The pool. Thread-safe; lock poisoning is ignored because no operation leaves the state
/// half-updated before a point that can panic.
#[derive(Default)]
pub struct Pool<A: ChunkAllocator = HostMemory> {
    chunks: A,
    state: Mutex<ChunkState>,
}

pub fn round_up(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN).max(1) * ALIGN
}

impl<A: ChunkAllocator> Pool<A> {
    /// A pool taking its chunks from `chunks`.
    pub fn new(chunks: A) -> Pool<A> {
        Pool { chunks, state: Mutex::new(ChunkState::default()) }
    }

    /// Where its chunks come from.
    pub fn allocator(&self) -> &A {
        &self.chunks
    }

    fn lock(&self) -> MutexGuard<'_, ChunkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `bytes` (rounded up to [`ALIGN`]). `None` when the system has no memory left.
    pub fn alloc(&self, bytes: usize) -> Option<Slice> {
        let size = round_up(bytes);
        let mut st = self.lock();
        if size <= SMALL_MAX
            && let Some((chunk, offset)) = st.small.get_mut(size / ALIGN - 1).and_then(Vec::pop)
        {
            st.small_bytes -= size;
            let addr = st.chunks[chunk].as_ref().expect("live chunk").addr + offset as u64;
            st.in_use += size;
            st.peak = st.peak.max(st.in_use);
            return Some(Slice { addr, size, chunk, offset });
        }
        // Exact size first, then the smallest larger free range.
        let found = st.by_size.range((size, 0, 0)..).next().copied();
        let (chunk, offset, free_size) = match found {
            Some((free_size, chunk, offset)) => (chunk, offset, free_size),
            None => {
                let chunk_size = if size < MIN_CHUNK / 4 { MIN_CHUNK } else { size };
                let idx = new_chunk(&self.chunks, &mut st, chunk_size, false)?;
                st.chunks[idx].as_mut().expect("new chunk").free.insert(0, chunk_size);
                st.by_size.insert((chunk_size, idx, 0));
                (idx, 0, chunk_size)
            }
        };
        st.by_size.remove(&(free_size, chunk, offset));
        let c = st.chunks[chunk].as_mut().expect("live chunk");
        c.free.remove(&offset);
        if free_size > size {
            c.free.insert(offset + size, free_size - size);
            st.by_size.insert((free_size - size, chunk, offset + size));
        }
        let addr = st.chunks[chunk].as_ref().expect("live chunk").addr + offset as u64;
        st.in_use += size;
        st.peak = st.peak.max(st.in_use);
        Some(Slice { addr, size, chunk, offset })
    }

    /// Takes `bytes` (rounded up to [`ALIGN`]) for a parameter: a free chunk of exactly that
    /// size, or a new one. `None` when the system has no memory left.
    pub fn alloc_exact(&self, bytes: usize) -> Option<Slice> {
        let size = round_up(bytes);
        let mut st = self.lock();
        let chunk = match st.exact_free.get_mut(&size).and_then(Vec::pop) {
            Some(idx) => {
                st.chunks[idx].as_mut().expect("live chunk").free.clear();
                idx
            }
            None => new_chunk(&self.chunks, &mut st, size, true)?,
        };
        let addr = st.chunks[chunk].as_ref().expect("live chunk").addr;
        st.in_use += size;
        st.persistent += size;
        st.peak = st.peak.max(st.in_use);
        Some(Slice { addr, size, chunk, offset: 0 })
    }

    /// Returns a slice; it merges with free neighbours, and a wholly free chunk may go back to
    /// the system.
    pub fn free(&self, slice: Slice) {
        let mut st = self.lock();
        st.in_use -= slice.size;
        if st.chunks[slice.chunk].as_ref().is_some_and(|c| c.exact) {
            st.persistent -= slice.size;
            st.chunks[slice.chunk].as_mut().expect("live chunk").free.insert(0, slice.size);
            // Kept for the next version of this size, within the same cap as other idle chunks.
            if self.over_cap(&st) {
                let c = st.chunks[slice.chunk].take().expect("live chunk");
                st.reserved -= c.size;
                // SAFETY: the chunk has no live slice.
                unsafe { self.chunks.free_chunk(c.addr, c.size) };
            } else {
                st.exact_free.entry(slice.size).or_default().push(slice.chunk);
            }
            return;
        }
        if slice.size <= SMALL_MAX && st.small_bytes + slice.size <= SMALL_KEPT_BYTES {
            let class = slice.size / ALIGN - 1;
            if st.small.len() <= class {
                st.small.resize_with(class + 1, Vec::new);
            }
            st.small[class].push((slice.chunk, slice.offset));
            st.small_bytes += slice.size;
            return;
        }
        self.merge_free(&mut st, slice);
    }

    /// Returns a slice of a shared chunk to its free ranges, merged with free neighbours; a
    /// wholly free chunk beyond the cap goes back to the system.
    fn merge_free(&self, st: &mut ChunkState, slice: Slice) {
        let (mut offset, mut size) = (slice.offset, slice.size);
        let c = st.chunks[slice.chunk].as_mut().expect("live chunk");
        let mut removed = Vec::with_capacity(2);
        if let Some((&prev_off, &prev_size)) = c.free.range(..offset).next_back()
            && prev_off + prev_size == offset
        {
            c.free.remove(&prev_off);
            removed.push((prev_size, prev_off));
            offset = prev_off;
            size += prev_size;
        }
        if let Some(&next_size) = c.free.get(&(slice.offset + slice.size)) {
            c.free.remove(&(slice.offset + slice.size));
            removed.push((next_size, slice.offset + slice.size));
            size += next_size;
        }
        c.free.insert(offset, size);
        let whole = size == c.size;
        for (s, o) in removed {
            st.by_size.remove(&(s, slice.chunk, o));
        }
        st.by_size.insert((size, slice.chunk, offset));
        if whole && self.over_cap(st) {
            let c = st.chunks[slice.chunk].take().expect("live chunk");
            st.by_size.remove(&(c.size, slice.chunk, 0));
            st.reserved -= c.size;
            // SAFETY: the chunk has no live slices.
            unsafe { self.chunks.free_chunk(c.addr, c.size) };
        }
    }

    /// Whether the wholly free chunks exceed what the pool keeps (see [`KEEP_FREE`] and
    /// [`ChunkAllocator::keeps_idle_chunks`]).
    fn over_cap(&self, st: &ChunkState) -> bool {
        !self.chunks.keeps_idle_chunks() && idle_bytes(st) > KEEP_FREE.max(st.in_use)
    }

    /// Returns every wholly free chunk to the system (the small slices kept aside merged back
    /// first).
    pub fn trim(&self) {
        let mut st = self.lock();
        for (class, kept) in std::mem::take(&mut st.small).into_iter().enumerate() {
            for (chunk, offset) in kept {
                let (addr, size) =
                    (st.chunks[chunk].as_ref().expect("live chunk").addr + offset as u64, (class + 1) * ALIGN);
                self.merge_free(&mut st, Slice { addr, size, chunk, offset });
            }
        }
        st.small_bytes = 0;
        for i in 0..st.chunks.len() {
            let idle = st.chunks[i].as_ref().is_some_and(|c| c.free.get(&0) == Some(&c.size));
            if idle {
                let c = st.chunks[i].take().expect("checked");
                if c.exact {
                    if let Some(list) = st.exact_free.get_mut(&c.size) {
                        list.retain(|&j| j != i);
                    }
                } else {
                    st.by_size.remove(&(c.size, i, 0));
                }
                st.reserved -= c.size;
                // SAFETY: as in `free`.
                unsafe { self.chunks.free_chunk(c.addr, c.size) };
            }
        }
    }

    pub fn stats(&self) -> MemoryStats {
        let st = self.lock();
        MemoryStats { in_use: st.in_use as u64, peak: st.peak as u64, reserved: st.reserved as u64 }
    }

    /// The part of `in_use` holding parameters in their exact-size chunks.
    pub fn persistent(&self) -> u64 {
        self.lock().persistent as u64
    }

    pub fn reset_peak(&self) {
        let mut st = self.lock();
        st.peak = st.in_use;
    }
}

/// Takes a chunk of `size` bytes from `chunks` (with no free range recorded yet) and returns
/// its index. `None` when no memory is left.
fn new_chunk(chunks: &impl ChunkAllocator, st: &mut ChunkState, size: usize, exact: bool) -> Option<usize> {
    let addr = chunks.alloc_chunk(size)?;
    let idx = match st.chunks.iter().position(Option::is_none) {
        Some(i) => i,
        None => {
            st.chunks.push(None);
            st.chunks.len() - 1
        }
    };
    st.chunks[idx] = Some(Chunk { addr, size, exact, free: BTreeMap::new() });
    st.reserved += size;
    Some(idx)
}

/// Bytes of wholly free chunks.
fn idle_bytes(st: &ChunkState) -> usize {
    st.chunks.iter().flatten().filter(|c| c.free.len() == 1 && c.free.get(&0) == Some(&c.size)).map(|c| c.size).sum()
}

impl<A: ChunkAllocator> Drop for Pool<A> {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for c in st.chunks.drain(..).flatten() {
            // SAFETY: the pool outlives every slice (buffers hold an `Arc` of it).
            unsafe { self.chunks.free_chunk(c.addr, c.size) };
        }
    }
}

/// Bytes in a device's live buffers (as the scheduler plans them), their peak since the last
/// reset, and the part in parameter (exact-size) memory: the accounting of every backend whose
/// buffers hold pool slices (CUDA, wgpu), kept in one place.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveBytes {
    pub live: u64,
    pub peak: u64,
    pub persistent: u64,
}

impl LiveBytes {
    /// A buffer of `bytes` became live (in parameter memory if `persistent`).
    pub fn add(&mut self, bytes: u64, persistent: bool) {
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        if persistent {
            self.persistent += bytes;
        }
    }

    /// A buffer of `bytes` was let go of.
    pub fn remove(&mut self, bytes: u64, persistent: bool) {
        self.live -= bytes;
        if persistent {
            self.persistent -= bytes;
        }
    }

    pub fn reset_peak(&mut self) {
        self.peak = self.live;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_size_slices_are_reused_and_stats_are_truthful() {
        let pool: Pool = Pool::default();
        let a = pool.alloc(1000).unwrap();
        assert_eq!(a.size, 1024);
        let b = pool.alloc(4096).unwrap();
        assert_eq!(pool.stats().in_use, 1024 + 4096);
        assert_eq!(pool.stats().reserved, MIN_CHUNK as u64);
        let a_ptr = a.addr;
        pool.free(a);
        let c = pool.alloc(1024).unwrap();
        assert_eq!(c.addr, a_ptr, "the exact-size free slice is taken first");
        pool.free(b);
        pool.free(c);
        let s = pool.stats();
        assert_eq!(s.in_use, 0);
        assert_eq!(s.peak, 1024 + 4096);
        pool.reset_peak();
        assert_eq!(pool.stats().peak, 0);
    }

    #[test]
    fn small_slices_are_kept_aside_by_size_for_reuse_and_merged_back_by_a_trim() {
        let pool: Pool = Pool::default();
        let big = pool.alloc(4096).unwrap();
        let scalars: Vec<Slice> = (0..4).map(|_| pool.alloc(8).unwrap()).collect();
        let addrs: Vec<u64> = scalars.iter().map(|s| s.addr).collect();
        assert!(scalars.iter().all(|s| s.size == ALIGN));
        scalars.into_iter().for_each(|s| pool.free(s));
        assert_eq!(pool.stats().in_use, 4096, "kept-aside slices are not in use");
        // Taken back last freed first, at the same addresses.
        let again: Vec<Slice> = (0..4).map(|_| pool.alloc(1).unwrap()).collect();
        assert_eq!(again.iter().map(|s| s.addr).collect::<Vec<_>>(), addrs.iter().rev().copied().collect::<Vec<_>>());
        assert_eq!(pool.stats().in_use, 4096 + 4 * ALIGN as u64);
        again.into_iter().for_each(|s| pool.free(s));
        // Kept by size: a freed 256-byte slice serves the next 256-byte request, not a 64.
        let mid = pool.alloc(200).unwrap();
        let mid_addr = mid.addr;
        pool.free(mid);
        let one = pool.alloc(64).unwrap();
        assert_ne!(one.addr, mid_addr);
        let mid = pool.alloc(256).unwrap();
        assert_eq!(mid.addr, mid_addr);
        pool.free(one);
        pool.free(mid);
        pool.free(big);
        // A trim merges them back: the chunk is wholly free again and goes back to the system.
        pool.trim();
        assert_eq!(pool.stats(), MemoryStats { in_use: 0, peak: 4096 + 256 + 64, reserved: 0 });
        // And a large request is served from one free range of a fresh chunk.
        let whole = pool.alloc(MIN_CHUNK / 8).unwrap();
        assert_eq!(pool.stats().reserved, MIN_CHUNK as u64);
        pool.free(whole);
    }

    #[test]
    fn freed_neighbours_merge_into_one_range() {
        let pool: Pool = Pool::default();
        // Larger than SMALL_MAX: small freed slices are kept aside until a trim (see the test
        // above).
        let xs: Vec<_> = (0..4).map(|_| pool.alloc(SMALL_MAX + 1).unwrap()).collect();
        let first = xs[0].addr;
        for x in xs {
            pool.free(x);
        }
        // The whole chunk is one free range again, so a chunk-sized request fits without a new
        // chunk.
        let big = pool.alloc(MIN_CHUNK).unwrap();
        assert_eq!(big.addr, first);
        assert_eq!(pool.stats().reserved, MIN_CHUNK as u64);
        pool.free(big);
        pool.trim();
        assert_eq!(pool.stats().reserved, 0);
    }

    #[test]
    fn parameters_take_exact_size_chunks_apart_from_the_rest() {
        let pool: Pool = Pool::default();
        let p = pool.alloc_exact(1000).unwrap();
        let a = pool.alloc(1000).unwrap();
        assert_ne!(p.chunk, a.chunk, "parameters never share a chunk with other buffers");
        assert_eq!((pool.stats().in_use, pool.persistent()), (2048, 1024));
        let (p_ptr, p_chunk) = (p.addr, p.chunk);
        pool.free(p);
        // A general request of the same size does not take the parameter's chunk ...
        let b = pool.alloc(1024).unwrap();
        assert_ne!(b.chunk, p_chunk);
        // ... the next parameter version of that size does.
        let q = pool.alloc_exact(1024).unwrap();
        assert_eq!(q.addr, p_ptr);
        for x in [a, b, q] {
            pool.free(x);
        }
        assert_eq!((pool.stats().in_use, pool.persistent()), (0, 0));
        pool.trim();
        assert_eq!(pool.stats().reserved, 0);
    }

    #[test]
    fn idle_parameter_chunks_go_back_to_the_system_beyond_the_cap() {
        let pool: Pool = Pool::default();
        // Parameters of many distinct sizes, about 1 MiB each, created and dropped.
        for i in 0..300 {
            let p = pool.alloc_exact((1 << 20) + i * ALIGN).unwrap();
            pool.free(p);
        }
        assert!(pool.stats().reserved <= KEEP_FREE as u64 + (2 << 20), "{:?}", pool.stats());
    }

    /// Host memory that says it keeps idle chunks (as a GPU's allocators do), counting what
    /// goes back.
    #[derive(Default)]
    struct Keeping(std::sync::atomic::AtomicUsize);

    impl ChunkAllocator for Keeping {
        fn alloc_chunk(&self, bytes: usize) -> Option<u64> {
            HostMemory.alloc_chunk(bytes)
        }
        unsafe fn free_chunk(&self, addr: u64, bytes: usize) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // SAFETY: the caller's contract.
            unsafe { HostMemory.free_chunk(addr, bytes) }
        }
        fn keeps_idle_chunks(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_keeping_allocator_gets_chunks_back_only_when_trimmed() {
        let pool = Pool::new(Keeping::default());
        let big = KEEP_FREE / 2;
        // More idle bytes than the cap: a host pool would return some of them.
        let slices: Vec<_> = (0..4).map(|_| pool.alloc(big).unwrap()).collect();
        let addrs: Vec<u64> = slices.iter().map(|s| s.addr).collect();
        slices.into_iter().for_each(|s| pool.free(s));
        assert_eq!(pool.chunks.0.load(std::sync::atomic::Ordering::Relaxed), 0, "nothing went back");
        assert_eq!(pool.stats().reserved, 4 * big as u64);
        // The next step's requests are served from the kept chunks.
        let again: Vec<_> = (0..4).map(|_| pool.alloc(big).unwrap()).collect();
        let mut got: Vec<u64> = again.iter().map(|s| s.addr).collect();
        let mut want = addrs;
        got.sort();
        want.sort();
        assert_eq!(got, want);
        again.into_iter().for_each(|s| pool.free(s));
        pool.trim();
        assert_eq!(pool.chunks.0.load(std::sync::atomic::Ordering::Relaxed), 4);
        assert_eq!(pool.stats().reserved, 0);
    }

    #[test]
    fn impossible_requests_fail_cleanly() {
        let pool: Pool = Pool::default();
        assert!(pool.alloc(1 << 62).is_none());
        assert_eq!(pool.stats().in_use, 0);
    }
}
