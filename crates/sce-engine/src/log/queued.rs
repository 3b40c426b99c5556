//! A write-back write through the log started without blocking (by the NBD reader) and
//! finished on the cache device's I/O queue (io_uring): the same one device write of its
//! pages into the log as `write.rs` makes, acknowledged once it completed and its pages are
//! indexed. Only a write of whole pages whose range is free in the range lock and that
//! fits in the ring now starts this way; any other (edge pages to merge, a page being
//! written, no room, a commit due) is left to the blocking path, which waits.
//!
//! A started write holds its pages in the range lock and its log positions in flight until
//! its completion has run; a started write that is dropped unsubmitted, or whose device
//! write failed, gives both back and indexes nothing (its pages keep their versions).

use super::LogBack;
use crate::engine::Engine;
use sce_core::PAGE_SIZE;
use sce_io::{IoDone, IoError, IoOp, IoQueue, OnDone, StartedWrite};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// A started write's pages `[g0, g0 + n)`, held in the range lock, and its log positions
/// from `lpos`, in flight; given back when dropped (once completed, or never submitted).
struct Held {
    lb: Arc<LogBack>,
    e: Arc<Engine>,
    g0: u64,
    n: u64,
    lpos: u64,
    /// Set once the completion has accounted for the positions.
    finished: bool,
}

impl Held {
    /// The device write completed (`result`, over `buf`): the pages indexed, or the
    /// failure counted as `write.rs` does. `io` is the held engine's.
    fn complete(
        mut self,
        io: &super::LogIo<'_>,
        result: Result<(), IoError>,
        buf: Option<&[u8]>,
    ) -> Result<(), IoError> {
        if let (Ok(()), None) = (&result, buf) {
            // Cannot happen (a write's buffer comes back with it); nothing is indexed.
            return Err(IoError::Invalid(
                "a log write came back without its bytes".into(),
            ));
        }
        self.finished = true;
        let bytes = buf.filter(|_| result.is_ok()).unwrap_or(&[]);
        self.lb.appended(io, self.g0, self.lpos, bytes, result)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.finished {
            // Never written: the positions stay unused, the pages keep their versions.
            self.lb.st.lock().landed(self.lpos);
        }
        let ps = PAGE_SIZE;
        self.lb
            .ranges
            .release(self.g0 * ps, (self.g0 + self.n) * ps);
    }
}

impl LogBack {
    /// Writes may start through `queue`, an owned-buffer queue on the cache device (or on
    /// a device it is a slice of, starting at `base` there). Once; false if already set.
    pub(crate) fn serve_writes_from(&self, queue: Arc<dyn IoQueue>, base: u64) -> bool {
        self.queue.set((queue, base)).is_ok()
    }

    /// Serves whole-page hits of the read cache through `queue` too (the cache device's
    /// data area starting at `base` there), as write-through does: reads of pages the log
    /// does not hold ([`Self::start_read`]). False if it already has one.
    pub(crate) fn serve_hits_from(&self, queue: Arc<dyn IoQueue>, base: u64) -> bool {
        self.through.serve_hits_from(queue, base)
    }

    /// Starts a client's read of `len` bytes at `offset` (a range the caller checked)
    /// through the queue if the log holds none of its pages (none dirty, none lost) and
    /// the read cache holds them all (a hit, as write-through starts it); `None` for the
    /// blocking path. A write acknowledged before the read arrived is in the log's index
    /// by then (a write is indexed before it is acknowledged), so the read goes the
    /// blocking way and finds it; one acknowledged after is concurrent with the read,
    /// which may return either version, as any read racing a write may.
    pub(crate) fn start_read(
        &self,
        e: &Arc<Engine>,
        offset: u64,
        len: u64,
    ) -> Option<sce_io::StartedRead> {
        let ps = PAGE_SIZE;
        let (p0, p1) = (offset / ps, (offset + len).div_ceil(ps));
        {
            let st = self.st.lock();
            let logged = |p: u64| st.index.contains_key(&p) || st.lost.contains(&p);
            if (!st.index.is_empty() || !st.lost.is_empty()) && (p0..p1).any(logged) {
                return None;
            }
        }
        self.last_request.store(e.log_io().cores.now().0, Relaxed);
        self.through.start_read(e, offset, len)
    }

    /// The queue writes start through, if any.
    pub(crate) fn queue(&self) -> Option<Arc<dyn IoQueue>> {
        self.queue.get().map(|(q, _)| q.clone())
    }

    /// Starts a client's write of `len` bytes at `offset` (whole pages, a range the caller
    /// checked) if it can go out without waiting, with the queue to submit it to; `None`:
    /// write it with `write`. Never blocks.
    pub(crate) fn start_write(
        self: &Arc<Self>,
        e: &Arc<Engine>,
        offset: u64,
        len: u64,
    ) -> Option<(StartedWrite, Arc<dyn IoQueue>)> {
        let ps = PAGE_SIZE;
        // Asked first, whatever else turns the write away: the reader sees the requests in
        // the order they came, which is what tells a stream.
        let sequential = self.sequential(offset, len);
        let (queue, base) = self.queue.get()?;
        let base = *base;
        let n = len / ps;
        let chunk = super::write::CHUNK_PAGES.min(self.region.max_write());
        let io = e.log_io();
        if !offset.is_multiple_of(ps)
            || !len.is_multiple_of(ps)
            || n == 0
            || n > chunk
            || io.health.passthrough()
        {
            return None;
        }
        if sequential || self.goes_through(offset / ps, offset / ps + n) {
            // A sequential stream, or a drain: the write goes through to the source, on the
            // blocking path.
            return None;
        }
        self.last_request.store(io.cores.now().0, Relaxed);
        if !self.ranges.try_take(offset, offset + len) {
            return None;
        }
        let mut held = Held {
            lb: self.clone(),
            e: e.clone(),
            g0: offset / ps,
            n,
            lpos: 0,
            // Nothing in flight yet: dropping it now only gives the range back.
            finished: true,
        };
        {
            let mut st = self.st.lock();
            // A drain that began since `goes_through`: the blocking path goes through. (A
            // drain notes the positions in flight under this lock: one this write takes
            // after the check is one the drain waits for.)
            if st.draining(offset / ps, offset / ps + n) || self.over_share(&st, offset / ps, n) {
                return None;
            }
            held.lpos = st.allocate(n).ok()?;
        }
        held.finished = false;
        let at = base + self.at(held.lpos);
        let t0 = Instant::now();
        let start: StartedWrite = Box::new(move |buf, done: OnDone| {
            debug_assert_eq!(buf.len() as u64, held.n * PAGE_SIZE);
            let op = IoOp::Write { offset: at, buf };
            let on_done: OnDone = Box::new(move |d: IoDone| {
                let e = held.e.clone();
                let io = e.log_io();
                let result = held.complete(&io, d.result, d.buf.as_deref());
                io.counters.latencies.write.record_since(t0);
                done(IoDone { result, buf: d.buf });
            });
            (op, on_done)
        });
        Some((start, queue.clone()))
    }
}
