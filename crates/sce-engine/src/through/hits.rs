//! Hits served through an owned-buffer I/O queue on the cache device (io_uring): a read
//! whose every page is a hit, in one slot, is planned on the caller's thread (the NBD
//! server's connection reader) and completes on the queue's thread, which verifies its
//! checksums, counts it and releases its pins. No worker thread and no blocking call on
//! the way. Every other read takes the blocking path (`read.rs`).

use crate::engine::Engine;
use sce_core::{Piece, ReadPlan, RunTarget};
use sce_io::{IoDone, IoOp, IoQueue, OnDone, PooledBuf, StartedRead};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// The queue hits are read through, and where the cache device the volume was opened with
/// starts on the queue's device.
pub(crate) struct HitQueue {
    pub(crate) queue: Arc<dyn IoQueue>,
    pub(crate) base: u64,
    slow: crossbeam_channel::Sender<SlowJob>,
}

impl HitQueue {
    /// Starts the read of `len` bytes at `offset` (a range the caller checked) through the
    /// queue, if it is a hit of whole pages in one slot; `None` for the blocking path.
    /// Planning a read that turns out not to be such a hit leaves no trace (its plan is
    /// dropped before it is logged, its pins released).
    pub(crate) fn start(&self, e: &Arc<Engine>, offset: u64, len: u64) -> Option<StartedRead> {
        let ps = sce_core::PAGE_SIZE;
        let whole_pages = offset.is_multiple_of(ps)
            && ((offset + len).is_multiple_of(ps) || offset + len == e.dev.size);
        let one_fragment = len > 0 && offset >> e.fshift == (offset + len - 1) >> e.fshift;
        if e.health.passthrough() || !whole_pages || !one_fragment {
            return None;
        }
        let (k, local) = e.cores.source(offset);
        let piece = Piece {
            shard: k,
            offset,
            local: local.0,
            len,
            buf_offset: 0,
        };
        let mut plan = ReadPlan::default();
        let mut want = Vec::new();
        // The checksums under the lock that made the pages hits (see `Checks::expected`).
        let read = e
            .cores
            .plan_read(&piece, &mut plan, |read| {
                if read.full_hit && !read.needs_commit() && read.runs.len() == 1 {
                    e.checks.expected(read, &mut want)
                }
            })
            .ok()?;
        if !read.full_hit || read.needs_commit() || read.runs.len() != 1 {
            return None;
        }
        let RunTarget::Cache(c) = read.runs[0].target else {
            return None;
        };
        // After the shared lock is released: applying the log may take the exclusive one.
        e.cores.log_read(k, &read);
        let held = read.hold(e.cores.pins(k).clone());
        e.preset_intents(&held);
        let (shared, at, slow) = (e.clone(), self.base + c.0, self.slow.clone());
        Some(Box::new(move |buf: PooledBuf, done: OnDone| {
            let op = IoOp::Read { offset: at, buf };
            let t0 = std::time::Instant::now();
            shared.counters.latencies.in_flight.fetch_add(1, Relaxed);
            let complete: OnDone = Box::new(move |d: IoDone| {
                let buf = d.buf.expect("a read gives its buffer back");
                if d.result.is_ok() && shared.checks.pages_match(offset, &buf, &want) {
                    shared.counters.cache_bytes_read.add(len);
                    let lat = &shared.counters.latencies;
                    lat.read_hit.record_since(t0);
                    lat.in_flight.fetch_sub(1, Relaxed);
                    // The pins are released only now that the slot was read.
                    drop(held);
                    return done(IoDone {
                        result: Ok(()),
                        buf: Some(buf),
                    });
                }
                // Unreadable, or not what was planned (a write since, or a bad device):
                // finished on a slow-path thread, not on the queue's completion thread,
                // which every other hit waits for.
                let s = shared.clone();
                let job = move || {
                    let mut buf = buf;
                    match &d.result {
                        Ok(()) => {
                            // Counts and drops the page if the device is at fault.
                            s.check_pages(c.0, offset, &buf, &want);
                        }
                        Err(e) => s.cache_run_failed(e, offset, len),
                    }
                    drop(held);
                    let r = sce_io::BlockDevice::read_at(&*s.dev.source, offset, &mut buf);
                    if r.is_ok() {
                        s.counters.source_bytes_read.add(len);
                    }
                    let lat = &s.counters.latencies;
                    lat.read_miss.record_since(t0);
                    lat.in_flight.fetch_sub(1, Relaxed);
                    done(IoDone {
                        result: r,
                        buf: Some(buf),
                    });
                };
                // On a slow-path thread, or on this one if there is none.
                if let Err(crossbeam_channel::SendError(job)) = slow.send(Box::new(job)) {
                    job();
                }
            });
            (op, complete)
        }))
    }
}

/// Work for a slow-path thread.
pub(crate) type SlowJob = Box<dyn FnOnce() + Send>;

/// Threads that finish the hits whose cached data could not be used (a source read each).
const SLOW_THREADS: usize = 4;

impl HitQueue {
    /// The hit queue, with its slow-path threads (they end when it is dropped).
    pub(crate) fn new(queue: Arc<dyn IoQueue>, base: u64) -> HitQueue {
        let (slow, rx) = crossbeam_channel::unbounded::<SlowJob>();
        for _ in 0..SLOW_THREADS {
            let rx = rx.clone();
            // A thread that cannot be started leaves the others (or, with none, the
            // completion thread itself, see `start`) to do the work.
            let _ = std::thread::Builder::new()
                .name("sce-hit-slow".into())
                .spawn(move || rx.iter().for_each(|job| job()));
        }
        HitQueue { queue, base, slow }
    }
}
