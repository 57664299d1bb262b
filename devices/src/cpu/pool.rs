//! The CPU memory pool: buffers are slices of large chunks, reused after they are freed.
//!
//! Allocation takes an exact-size free slice first, then the smallest free slice that is large
//! enough (splitting off the rest), and only then asks the system for a new chunk (as
//! Burn-Compute does). Freed slices merge with free neighbours. Wholly free chunks are kept for
//! reuse up to a cap and returned to the system beyond it. The pool accounts truthfully:
//! `in_use` is the bytes of live slices (after alignment), `reserved` the bytes of chunks held.
//! It never reads or writes the memory it hands out (except to poison it when asked).
//!
//! Parameters (`alloc_exact`) take chunks of their exact size, never split and reused only by a
//! request of the same size: training replaces each parameter by a new version of the same size
//! every step, and keeping them apart keeps long-lived buffers from pinning the chunks that
//! short-lived activations are cut from (Burn keeps parameters in such a pool).

use std::alloc::{Layout, alloc, dealloc};
use std::collections::{BTreeMap, BTreeSet};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

/// Alignment of every slice (a cache line; enough for any SIMD load).
pub const ALIGN: usize = 64;
/// Chunks for small requests are at least this large, so many small buffers share one.
const MIN_CHUNK: usize = 2 << 20;
/// Wholly free chunks beyond this many bytes (or beyond the bytes in use, if larger) go back to
/// the system.
const KEEP_FREE: usize = 256 << 20;

/// Memory counters of a device, in bytes: live buffers (`in_use`, after alignment), the highest
/// `in_use` since the last reset (`peak`) and memory held from the system (`reserved`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub in_use: u64,
    pub peak: u64,
    pub reserved: u64,
}

struct Chunk {
    ptr: NonNull<u8>,
    size: usize,
    /// An exact-size chunk for one parameter (never split, never in `by_size`).
    exact: bool,
    /// Free ranges by offset (merged: no two are adjacent).
    free: BTreeMap<usize, usize>,
}

#[derive(Default)]
struct State {
    chunks: Vec<Option<Chunk>>,
    /// Every free range of every chunk, keyed for best-fit search: (size, chunk, offset).
    by_size: BTreeSet<(usize, usize, usize)>,
    /// Free exact-size chunks by size.
    exact_free: BTreeMap<usize, Vec<usize>>,
    in_use: usize,
    persistent: usize,
    peak: usize,
    reserved: usize,
}

// SAFETY: the raw chunk pointers are owned by the pool and only handed out as disjoint slices.
unsafe impl Send for State {}

/// A slice handed out by the pool.
#[derive(Debug)]
pub struct Slice {
    pub ptr: NonNull<u8>,
    pub size: usize,
    chunk: usize,
    offset: usize,
}

/// The pool. Thread-safe; lock poisoning is ignored because no operation leaves the state
/// half-updated before a point that can panic.
#[derive(Default)]
pub struct Pool {
    state: Mutex<State>,
}

pub fn round_up(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN).max(1) * ALIGN
}

impl Pool {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `bytes` (rounded up to [`ALIGN`]). `None` when the system has no memory left.
    pub fn alloc(&self, bytes: usize) -> Option<Slice> {
        let size = round_up(bytes);
        let mut st = self.lock();
        // Exact size first, then the smallest larger free range.
        let found = st.by_size.range((size, 0, 0)..).next().copied();
        let (chunk, offset, free_size) = match found {
            Some((free_size, chunk, offset)) => (chunk, offset, free_size),
            None => {
                let chunk_size = if size < MIN_CHUNK / 4 { MIN_CHUNK } else { size };
                let idx = new_chunk(&mut st, chunk_size, false)?;
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
        let c = st.chunks[chunk].as_ref().expect("live chunk");
        // SAFETY: offset + size lies within the chunk.
        let ptr = unsafe { NonNull::new_unchecked(c.ptr.as_ptr().add(offset)) };
        st.in_use += size;
        st.peak = st.peak.max(st.in_use);
        Some(Slice { ptr, size, chunk, offset })
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
            None => new_chunk(&mut st, size, true)?,
        };
        let ptr = st.chunks[chunk].as_ref().expect("live chunk").ptr;
        st.in_use += size;
        st.persistent += size;
        st.peak = st.peak.max(st.in_use);
        Some(Slice { ptr, size, chunk, offset: 0 })
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
            if idle_bytes(&st) > KEEP_FREE.max(st.in_use) {
                let c = st.chunks[slice.chunk].take().expect("live chunk");
                st.reserved -= c.size;
                // SAFETY: the chunk was allocated with this layout and has no live slice.
                unsafe { dealloc(c.ptr.as_ptr(), Layout::from_size_align_unchecked(c.size, ALIGN)) };
            } else {
                st.exact_free.entry(slice.size).or_default().push(slice.chunk);
            }
            return;
        }
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
        if whole && idle_bytes(&st) > KEEP_FREE.max(st.in_use) {
            let c = st.chunks[slice.chunk].take().expect("live chunk");
            st.by_size.remove(&(c.size, slice.chunk, 0));
            st.reserved -= c.size;
            // SAFETY: the chunk was allocated with this layout and has no live slices.
            unsafe { dealloc(c.ptr.as_ptr(), Layout::from_size_align_unchecked(c.size, ALIGN)) };
        }
    }

    /// Returns every wholly free chunk to the system.
    pub fn trim(&self) {
        let mut st = self.lock();
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
                unsafe { dealloc(c.ptr.as_ptr(), Layout::from_size_align_unchecked(c.size, ALIGN)) };
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

/// Takes a chunk of `size` bytes from the system (with no free range recorded yet) and returns
/// its index. `None` when the system has no memory left.
fn new_chunk(st: &mut State, size: usize, exact: bool) -> Option<usize> {
    let layout = Layout::from_size_align(size, ALIGN).ok()?;
    // SAFETY: the layout has a non-zero size.
    let ptr = NonNull::new(unsafe { alloc(layout) })?;
    let idx = match st.chunks.iter().position(Option::is_none) {
        Some(i) => i,
        None => {
            st.chunks.push(None);
            st.chunks.len() - 1
        }
    };
    st.chunks[idx] = Some(Chunk { ptr, size, exact, free: BTreeMap::new() });
    st.reserved += size;
    Some(idx)
}

/// Bytes of wholly free chunks.
fn idle_bytes(st: &State) -> usize {
    st.chunks.iter().flatten().filter(|c| c.free.len() == 1 && c.free.get(&0) == Some(&c.size)).map(|c| c.size).sum()
}

impl Drop for Pool {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for c in st.chunks.drain(..).flatten() {
            // SAFETY: allocated with this layout; the pool outlives every slice (buffers hold
            // an `Arc` of it).
            unsafe { dealloc(c.ptr.as_ptr(), Layout::from_size_align_unchecked(c.size, ALIGN)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_size_slices_are_reused_and_stats_are_truthful() {
        let pool = Pool::default();
        let a = pool.alloc(1000).unwrap();
        assert_eq!(a.size, 1024);
        let b = pool.alloc(4096).unwrap();
        assert_eq!(pool.stats().in_use, 1024 + 4096);
        assert_eq!(pool.stats().reserved, MIN_CHUNK as u64);
        let a_ptr = a.ptr;
        pool.free(a);
        let c = pool.alloc(1024).unwrap();
        assert_eq!(c.ptr, a_ptr, "the exact-size free slice is taken first");
        pool.free(b);
        pool.free(c);
        let s = pool.stats();
        assert_eq!(s.in_use, 0);
        assert_eq!(s.peak, 1024 + 4096);
        pool.reset_peak();
        assert_eq!(pool.stats().peak, 0);
    }

    #[test]
    fn freed_neighbours_merge_into_one_range() {
        let pool = Pool::default();
        let xs: Vec<_> = (0..4).map(|_| pool.alloc(64).unwrap()).collect();
        let first = xs[0].ptr;
        for x in xs {
            pool.free(x);
        }
        // The whole chunk is one free range again, so a chunk-sized request fits without a new
        // chunk.
        let big = pool.alloc(MIN_CHUNK).unwrap();
        assert_eq!(big.ptr, first);
        assert_eq!(pool.stats().reserved, MIN_CHUNK as u64);
        pool.free(big);
        pool.trim();
        assert_eq!(pool.stats().reserved, 0);
    }

    #[test]
    fn parameters_take_exact_size_chunks_apart_from_the_rest() {
        let pool = Pool::default();
        let p = pool.alloc_exact(1000).unwrap();
        let a = pool.alloc(1000).unwrap();
        assert_ne!(p.chunk, a.chunk, "parameters never share a chunk with other buffers");
        assert_eq!((pool.stats().in_use, pool.persistent()), (2048, 1024));
        let (p_ptr, p_chunk) = (p.ptr, p.chunk);
        pool.free(p);
        // A general request of the same size does not take the parameter's chunk ...
        let b = pool.alloc(1024).unwrap();
        assert_ne!(b.chunk, p_chunk);
        // ... the next parameter version of that size does.
        let q = pool.alloc_exact(1024).unwrap();
        assert_eq!(q.ptr, p_ptr);
        for x in [a, b, q] {
            pool.free(x);
        }
        assert_eq!((pool.stats().in_use, pool.persistent()), (0, 0));
        pool.trim();
        assert_eq!(pool.stats().reserved, 0);
    }

    #[test]
    fn idle_parameter_chunks_go_back_to_the_system_beyond_the_cap() {
        let pool = Pool::default();
        // Parameters of many distinct sizes, about 1 MiB each, created and dropped.
        for i in 0..300 {
            let p = pool.alloc_exact((1 << 20) + i * ALIGN).unwrap();
            pool.free(p);
        }
        assert!(pool.stats().reserved <= KEEP_FREE as u64 + (2 << 20), "{:?}", pool.stats());
    }

    #[test]
    fn impossible_requests_fail_cleanly() {
        let pool = Pool::default();
        assert!(pool.alloc(1 << 62).is_none());
        assert_eq!(pool.stats().in_use, 0);
    }
}
