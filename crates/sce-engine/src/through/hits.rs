//! Hits served through an owned-buffer I/O queue on the cache device (io_uring): a read
//! whose every page is a hit, in one slot, is planned on the caller's thread (the NBD
//! server's connection reader) and completes on the queue's thread, which verifies its
//! checksums, counts it and releases its pins. No worker thread and no blocking call on
//! the way. Every other read takes the blocking path (`read.rs`).

use crate::engine::Engine;
use sce_core::{HeldRead, PinnedRead, ReadPlan, RunTarget};
use sce_io::{IoDone, IoError, IoOp, IoQueue, OnDone, PooledBuf, StartedRead};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// The queue hits are read through, and where the cache device the volume was opened with
/// starts on the queue's device.
pub(crate) struct HitQueue {
    pub(crate) queue: Arc<dyn IoQueue>,
    pub(crate) base: u64,
    slow: crossbeam_channel::Sender<SlowJob>,
}

/// What a hit through the queue works with, built by `Engine::hit_io`.
pub(crate) struct HitIo<'a> {
    pub(crate) dev: &'a crate::devices::Devices,
    pub(crate) cores: &'a crate::cores::Cores,
    pub(crate) checks: &'a crate::checks::Checks,
    pub(crate) health: &'a crate::health::Health,
    pub(crate) persist: Option<&'a crate::persist::Persist>,
    pub(crate) signals: &'a crate::engine::Signals,
    pub(crate) counters: &'a crate::stats::Counters,
    /// log2 of the fragment size.
    pub(crate) fshift: u32,
}

impl HitQueue {
    /// Starts the read of `len` bytes at `offset` (a range the caller checked) through the
    /// queue, if it is a hit of whole pages in one slot; `None` for the blocking path.
    /// Planning a read that turns out not to be such a hit leaves no trace (its plan is
    /// dropped before it is logged, its pins released).
    pub(crate) fn start(&self, engine: &Arc<Engine>, offset: u64, len: u64) -> Option<StartedRead> {
        let e = engine.hit_io();
        let ps = sce_core::PAGE_SIZE;
        let whole_pages = offset.is_multiple_of(ps)
            && ((offset + len).is_multiple_of(ps) || offset + len == e.dev.size);
        let one_fragment = len > 0 && offset >> e.fshift == (offset + len - 1) >> e.fshift;
        if e.health.passthrough() || !whole_pages || !one_fragment {
            return None;
        }
        let piece = e.cores.piece(offset, len);
        let k = piece.shard;
        let mut plan = ReadPlan::default();
        let mut want = Vec::new();
        let mut known = true;
        // The checksums under the lock that made the pages hits (see `Checks::expected`).
        let read = e
            .cores
            .plan_read(&piece, &mut plan, |read| {
                if one_run_hit(read) {
                    known = e.checks.expected(read, &mut want).is_ok();
                }
            })
            .ok()?;
        // A unit whose checksums are not in memory is read by the blocking path, not here.
        if !one_run_hit(&read) || !known {
            return None;
        }
        let RunTarget::Cache(c) = read.runs[0].target else {
            return None;
        };
        // After the shared lock is released: applying the log may take the exclusive one.
        e.cores.log_read(k, &read);
        let held = read.hold(e.cores.pins(k).clone());
        crate::read::preset_intents(e.persist, e.signals, e.fshift, &held);
        let hit = Hit {
            e: Counted::new(engine),
            at: (self.base + c.0, c.0, offset, len),
            want,
            held,
            slow: self.slow.clone(),
        };
        Some(Box::new(move |buf: PooledBuf, done: OnDone| {
            hit.submit(buf, done)
        }))
    }
}

/// True if a planned read is what the queue serves: a hit, in one run, with no inline fill.
fn one_run_hit(read: &PinnedRead) -> bool {
    read.full_hit && !read.needs_commit() && read.runs.len() == 1
}

/// The engine of a hit, which counts the hit in flight from its start (under the lock the
/// caller may hold to keep the volume from being closed: a close waits for it) until this
/// is dropped: when it completes, or if it is never submitted.
struct Counted(Arc<Engine>);

impl Counted {
    fn new(e: &Arc<Engine>) -> Counted {
        e.hit_io()
            .counters
            .latencies
            .in_flight
            .fetch_add(1, Relaxed);
        Counted(e.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0
            .hit_io()
            .counters
            .latencies
            .in_flight
            .fetch_sub(1, Relaxed);
    }
}

impl std::ops::Deref for Counted {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.0
    }
}

/// A hit started through the queue: its engine (counted in flight), where it reads (queue offset, cache offset,
/// source offset, length), its expected checksums, its pins, the slow path.
struct Hit {
    e: Counted,
    at: (u64, u64, u64, u64),
    want: Vec<u32>,
    held: HeldRead,
    slow: crossbeam_channel::Sender<SlowJob>,
}

impl Hit {
    /// The queue's read of the hit and its completion: on the queue's completion thread the
    /// pages are checked; a read that fails or does not match goes to a slow-path thread.
    fn submit(self, buf: PooledBuf, done: OnDone) -> (IoOp, OnDone) {
        let op = IoOp::Read {
            offset: self.at.0,
            buf,
        };
        let t0 = std::time::Instant::now();
        let complete: OnDone = Box::new(move |d: IoDone| {
            let buf = d.buf.expect("a read gives its buffer back");
            let (_, _, offset, len) = self.at;
            let e = self.e.hit_io();
            if d.result.is_ok() && e.checks.pages_match(offset, &buf, &self.want) {
                e.counters.cache_bytes_read.add(len);
                let lat = &e.counters.latencies;
                lat.read_hit.record_since(t0);
                drop(self.e);
                // The pins are released only now that the slot was read.
                drop(self.held);
                return done(IoDone {
                    result: Ok(()),
                    buf: Some(buf),
                });
            }
            // Unreadable, or not what was planned (a write since, or a bad device):
            // finished on a slow-path thread, not on the queue's completion thread, which
            // every other hit waits for; on this one if there is none.
            let slow = self.slow.clone();
            let job: SlowJob = Box::new(move || self.slow_path(d.result, buf, t0, done));
            if let Err(crossbeam_channel::SendError(job)) = slow.send(job) {
                job();
            }
        });
        (op, complete)
    }

    /// The hit's cached data could not be used: the device's fault counted (the page
    /// dropped), the pins released, the source read instead.
    fn slow_path(self, r: Result<(), IoError>, mut buf: PooledBuf, t0: Instant, done: OnDone) {
        let (_, c, offset, len) = self.at;
        let s = &self.e;
        match &r {
            // Counts and drops the page if the device is at fault.
            Ok(()) => {
                s.verifier().check_pages(c, offset, &buf, &self.want);
            }
            Err(e) => s.verifier().cache_run_failed(e, offset, len),
        }
        drop(self.held);
        let io = s.hit_io();
        let r = sce_io::BlockDevice::read_at(&*io.dev.source, offset, &mut buf);
        if r.is_ok() {
            io.counters.source_bytes_read.add(len);
        }
        let lat = &io.counters.latencies;
        lat.read_miss.record_since(t0);
        drop(self.e);
        done(IoDone {
            result: r,
            buf: Some(buf),
        });
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
