//! The CUDA streams of one device and how far the GPU has got on each: *lanes*.
//!
//! A lane is one non-blocking CUDA stream kept for the device's lifetime: lane 0 carries
//! transfers outside flushes (uploads, downloads, poison fills of dropped buffers); every
//! other lane carries one braid stream id (`StreamId`, the copy and offload streams included),
//! the same one in every flush while that stream is in use. Lanes are few, as PyTorch's pool
//! of streams is: a stream new to the device gets a new lane until [`KEPT_LANES`] exist, and
//! after that the lane of the stream no flush has used for longest, the default stream's
//! excepted ([`Lanes::of_streams`]).
//! A program that makes new braid streams every step so reuses a few CUDA streams, and their
//! cuBLAS handles and workspaces (`super::pools`), instead of adding one of each per step.
//! Handing a lane to another braid stream is always safe: every flush begins after everything
//! enqueued before it (`super::queue`), so the order of work on a lane is kept.
//!
//! Positions on a lane are counted on the host: `issued` is the number of operations
//! enqueued so far (bumped *after* each enqueue), and a *point* `(lane, n)` is reached once
//! the first `n` operations of the lane are done on the GPU. The host learns that through
//! *markers*: events recorded on the lane, each with the count it was recorded at (read
//! *before* the record, so a marker never claims more than it covers). A lane's `completed`
//! is the count of its newest marker known done. Memory waiting to be reused is gated on a
//! list of points (see `super::pools`).
//!
//! Events are recycled ([`EventPool`]): a [`Marker`] goes back to the pool when its last
//! handle drops. Re-recording an event is safe while streams still wait on its old record
//! (`cuStreamWaitEvent` waits for the record current at the time of the call).
//!
//! Must never: block the host, enqueue work of its own
//! besides event records, or claim a point reached that the GPU has not reached.

use super::context::{Event, Gpu, Stream};
use crate::DeviceError;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Index of a lane.
pub(crate) type LaneId = usize;

/// The lane of transfers made outside flushes.
pub(crate) const TRANSFER: LaneId = 0;

/// A point on a lane: reached once its first `.1` operations are done.
pub(crate) type Point = (LaneId, u64);

/// Ordering events, recycled.
pub(crate) struct EventPool {
    gpu: Arc<Gpu>,
    free: Mutex<Vec<Event>>,
}

impl EventPool {
    pub(crate) fn new(gpu: &Arc<Gpu>) -> Arc<EventPool> {
        Arc::new(EventPool { gpu: gpu.clone(), free: Mutex::new(Vec::new()) })
    }

    /// An event (never recorded, or recorded by a marker nobody holds any more).
    pub(crate) fn get(self: &Arc<EventPool>) -> Result<Arc<Marker>, DeviceError> {
        let event = match lock(&self.free).pop() {
            Some(e) => e,
            None => Event::new(&self.gpu)?,
        };
        Ok(Arc::new(Marker { event: Some(event), pool: self.clone() }))
    }
}

/// An event from the pool; it returns there when dropped.
pub(crate) struct Marker {
    event: Option<Event>,
    pool: Arc<EventPool>,
}

impl Marker {
    pub(crate) fn event(&self) -> &Event {
        self.event.as_ref().expect("held until dropped")
    }
}

impl Drop for Marker {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            lock(&self.pool.free).push(e);
        }
    }
}

/// One lane: its stream and what is known of its progress.
pub(crate) struct Lane {
    pub(crate) stream: Arc<Stream>,
    /// The braid stream it carries (`None`: the transfer lane).
    pub(crate) braid: Option<u32>,
    /// The last flush that used it (the count of [`Lanes::flushes`] then).
    last_flush: u64,
    /// Operations enqueued so far.
    pub(crate) issued: u64,
    /// Operations known done.
    pub(crate) completed: u64,
    /// Recorded markers not known done yet, oldest first, with the count each covers.
    markers: VecDeque<(u64, Arc<Marker>)>,
}

/// Every lane of a device.
pub(crate) struct Lanes {
    pub(crate) lanes: Vec<Lane>,
    /// Bumped whenever some lane's `completed` grows.
    pub(crate) generation: u64,
    /// Flushes that asked for lanes so far.
    flushes: u64,
}

/// Lanes of braid streams a device keeps before a new stream takes over the lane of the stream
/// unused longest. A flush of more streams than this still gets a lane for each.
pub(crate) const KEPT_LANES: usize = 8;

impl Lanes {
    /// The transfer lane alone.
    pub(crate) fn new(gpu: &Arc<Gpu>) -> Result<Lanes, DeviceError> {
        let transfer = Lane {
            stream: Arc::new(Stream::new(gpu)?),
            braid: None,
            last_flush: 0,
            issued: 0,
            completed: 0,
            markers: VecDeque::new(),
        };
        Ok(Lanes { lanes: vec![transfer], generation: 0, flushes: 0 })
    }

    /// The lanes of one flush's braid streams (`ids`, distinct), in their order: a stream's
    /// own lane when it has one; for a stream new to the device, a new lane while fewer than
    /// [`KEPT_LANES`] exist, else the lane of the stream unused longest that this flush does
    /// not use, but never the default stream's (it now carries `id`).
    pub(crate) fn of_streams(&mut self, gpu: &Arc<Gpu>, ids: &[u32]) -> Result<Vec<LaneId>, DeviceError> {
        self.flushes += 1;
        let mut found: Vec<Option<LaneId>> =
            ids.iter().map(|&id| self.lanes.iter().position(|l| l.braid == Some(id))).collect();
        for i in 0..ids.len() {
            if found[i].is_some() {
                continue;
            }
            // The default stream keeps its lane: nearly every flush uses it.
            let free = (1..self.lanes.len()).filter(|&l| !found.contains(&Some(l)) && self.lanes[l].braid != Some(0));
            let lane = match free.min_by_key(|&l| self.lanes[l].last_flush) {
                Some(l) if self.lanes.len() > KEPT_LANES => l,
                _ => {
                    let stream = Arc::new(Stream::new(gpu)?);
                    let lane =
                        Lane { stream, braid: None, last_flush: 0, issued: 0, completed: 0, markers: VecDeque::new() };
                    self.lanes.push(lane);
                    self.lanes.len() - 1
                }
            };
            self.lanes[lane].braid = Some(ids[i]);
            found[i] = Some(lane);
        }
        let lanes: Vec<LaneId> = found.into_iter().map(|l| l.expect("every stream given a lane above")).collect();
        for &l in &lanes {
            self.lanes[l].last_flush = self.flushes;
        }
        Ok(lanes)
    }

    /// Counts one more operation enqueued on `lane` (call after enqueueing it).
    pub(crate) fn bump(&mut self, lane: LaneId) {
        self.lanes[lane].issued += 1;
    }

    /// The point of `lane` now: reached once everything enqueued on it so far is done.
    pub(crate) fn point(&self, lane: LaneId) -> Point {
        (lane, self.lanes[lane].issued)
    }

    /// Every lane's point now (those with work not known done).
    pub(crate) fn points(&self) -> Vec<Point> {
        (0..self.lanes.len())
            .filter(|&l| self.lanes[l].issued > self.lanes[l].completed)
            .map(|l| self.point(l))
            .collect()
    }

    /// Records `marker` at the end of `lane` and keeps it to learn the lane's progress.
    pub(crate) fn record(&mut self, lane: LaneId, marker: Arc<Marker>) -> Result<(), DeviceError> {
        let seq = self.lanes[lane].issued;
        marker.event().record(&self.lanes[lane].stream)?;
        self.lanes[lane].markers.push_back((seq, marker));
        Ok(())
    }

    /// Learns which markers are done (non-blocking queries). A query error is left for the
    /// next synchronisation to report.
    pub(crate) fn refresh(&mut self) {
        for lane in &mut self.lanes {
            while let Some((seq, m)) = lane.markers.front() {
                match m.event().is_done() {
                    Ok(true) => {
                        if *seq > lane.completed {
                            lane.completed = *seq;
                            self.generation += 1;
                        }
                        lane.markers.pop_front();
                    }
                    _ => break,
                }
            }
        }
    }

    /// Whether `point` is known reached.
    pub(crate) fn reached(&self, (lane, n): Point) -> bool {
        self.lanes[lane].completed >= n
    }

    /// For every lane with work not known done: a marker at its end (recording one where the
    /// newest does not cover everything enqueued). Waiting for all of them orders after
    /// everything enqueued on the device so far.
    pub(crate) fn fence(&mut self, events: &Arc<EventPool>) -> Result<Vec<(LaneId, Arc<Marker>)>, DeviceError> {
        self.refresh();
        let mut fence = Vec::new();
        for l in 0..self.lanes.len() {
            let lane = &self.lanes[l];
            if lane.issued <= lane.completed {
                continue;
            }
            let covered = lane.markers.back().is_some_and(|(seq, _)| *seq >= lane.issued);
            if !covered {
                self.record(l, events.get()?)?;
            }
            let (_, m) = self.lanes[l].markers.back().expect("recorded above");
            fence.push((l, m.clone()));
        }
        Ok(fence)
    }

    /// Every lane's count of operations enqueued so far (taken before a host synchronisation,
    /// so that [`Lanes::reached_all`] claims no more than the synchronisation covered).
    pub(crate) fn issued_counts(&self) -> Vec<u64> {
        self.lanes.iter().map(|l| l.issued).collect()
    }

    /// After a host synchronisation: the counts taken before it are reached.
    pub(crate) fn reached_all(&mut self, counts: &[u64]) {
        for (lane, &n) in self.lanes.iter_mut().zip(counts) {
            if n > lane.completed {
                lane.completed = n;
            }
            while lane.markers.front().is_some_and(|(seq, _)| *seq <= lane.completed) {
                lane.markers.pop_front();
            }
        }
        self.generation += 1;
    }
}
