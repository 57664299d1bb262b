//! The CPU memory pool: buffers are slices of large chunks, reused after they are freed.
//!
//! Allocation takes an exact-size free slice first, then the smallest free slice that is large
//! enough (splitting off the rest), and only then asks the system for a new chunk (as
//! Burn-Compute does). Freed slices merge with free neighbours. Wholly free chunks are kept for
//! reuse up to a cap and returned to the system beyond it. The pool accounts truthfully:
//! `in_use` is the bytes of live slices (after alignment), `reserved` the bytes of chunks held.
//! It never reads or writes the memory it hands out (except to poison it when asked).

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
    /// Free ranges by offset (merged: no two are adjacent).
    free: BTreeMap<usize, usize>,
}

#[derive(Default)]
struct State {
    chunks: Vec<Option<Chunk>>,
    /// Every free range of every chunk, keyed for best-fit search: (size, chunk, offset).
    by_size: BTreeSet<(usize, usize, usize)>,
    in_use: usize,
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
                let layout = Layout::from_size_align(chunk_size, ALIGN).ok()?;
                // SAFETY: the layout has a non-zero size.
                let ptr = NonNull::new(unsafe { alloc(layout) })?;
                let idx = match st.chunks.iter().position(Option::is_none) {
                    Some(i) => i,
                    None => {
                        st.chunks.push(None);
                        st.chunks.len() - 1
                    }
                };
                let mut free = BTreeMap::new();
                free.insert(0, chunk_size);
                st.chunks[idx] = Some(Chunk { ptr, size: chunk_size, free });
                st.by_size.insert((chunk_size, idx, 0));
                st.reserved += chunk_size;
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

    /// Returns a slice; it merges with free neighbours, and a wholly free chunk may go back to
    /// the system.
    pub fn free(&self, slice: Slice) {
        let mut st = self.lock();
        st.in_use -= slice.size;
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
        if whole {
            let idle: usize = st
                .chunks
                .iter()
                .flatten()
                .filter(|c| c.free.len() == 1 && c.free.get(&0) == Some(&c.size))
                .map(|c| c.size)
                .sum();
            if idle > KEEP_FREE.max(st.in_use) {
                let c = st.chunks[slice.chunk].take().expect("live chunk");
                st.by_size.remove(&(c.size, slice.chunk, 0));
                st.reserved -= c.size;
                // SAFETY: the chunk was allocated with this layout and has no live slices.
                unsafe { dealloc(c.ptr.as_ptr(), Layout::from_size_align_unchecked(c.size, ALIGN)) };
            }
        }
    }

    /// Returns every wholly free chunk to the system.
    pub fn trim(&self) {
        let mut st = self.lock();
        for i in 0..st.chunks.len() {
            let idle = st.chunks[i].as_ref().is_some_and(|c| c.free.get(&0) == Some(&c.size));
            if idle {
                let c = st.chunks[i].take().expect("checked");
                st.by_size.remove(&(c.size, i, 0));
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

    pub fn reset_peak(&self) {
        let mut st = self.lock();
        st.peak = st.in_use;
    }
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
    fn impossible_requests_fail_cleanly() {
        let pool = Pool::default();
        assert!(pool.alloc(1 << 62).is_none());
        assert_eq!(pool.stats().in_use, 0);
    }
}
