//! Write-back through the log (issue 29; docs/WRITEBACK.md, "the write-back log"): a
//! write-back write is one device write of its pages into the log region
//! (`sce_store::wblog`), acknowledged at once; an NBD FLUSH (or FUA) commits what was
//! written (one commit record and one cache-device flush, shared by concurrent callers);
//! an index in memory maps each dirty page to its newest version in the log, and reads look
//! there before the clean cache. Nothing is ever overwritten in place: a page's older
//! committed version stays intact until the ring passes it, which only happens once a newer
//! version is committed or the page was cleaned. The cleaner (`clean.rs`, `batch.rs`)
//! drains the log, oldest first, to the source through the write-through path, which keeps
//! the clean cache's copies right; dirty data never takes a read slot.
//!
//! Cleaning fails per page, never per batch (issue 44): a page whose source write fails
//! stays dirty and is retried after its own backoff, and one whose log copy is damaged is
//! lost (reads of it fail) and carried forward in a tombstone; either way it holds back
//! only its own room, for the log copies the pages that hold its tail forward (`room.rs`).
//! A drain (leaving write-back, a detach, `flush --to-source`) sends the writes of its range
//! through to the source meanwhile, superseding the log's versions durably, so that it ends
//! (`drain.rs`); a discard reaches the source as a discard the same way.
//!
//! A write of whole pages that can go out at once may also be started by the NBD reader
//! and finished on the cache device's I/O queue (`queued.rs`): the same device write,
//! acknowledged from its completion.
//!
//! Lock order: the range lock (outermost, as in `back/`; only writes take it), then
//! `clean_io`, then `source_order` (the cleaner and writes through to the source, around
//! their source writes of the same pages), then `commit_io`, then `st` (a leaf: no other
//! lock is taken while it is held, and no device I/O happens under it). `anchor_io` comes
//! after `clean_io` and is never taken with `source_order` or `commit_io` held; under it
//! only `st` and the superblock's lock (`persist`). `progress`, `wanted` and the sequential
//! bypass's detector (`seq.rs`) are leaves.

mod batch;
mod clean;
mod commit;
mod drain;
mod lend;
mod open;
pub(crate) mod outage;
mod prefetch;
mod queued;
mod read;
mod room;
mod seq;
mod stats;
mod tune;
mod write;

pub use drain::{DrainControl, DrainDone};

/// What the write-back log works with, built per call by `Engine::log_io`: the devices,
/// the core's shards, health, signals, the store and the counters; the engine's judged
/// device I/O (`faults`); the read-cache's reader (for pages the log does not hold) and
/// the write-through path's writer (the cleaner's and a drain's writes to the source).
pub(crate) struct LogIo<'a> {
    pub(crate) dev: &'a crate::devices::Devices,
    pub(crate) cores: &'a crate::cores::Cores,
    pub(crate) health: &'a crate::health::Health,
    pub(crate) signals: &'a crate::engine::Signals,
    pub(crate) persist: Option<&'a crate::persist::Persist>,
    pub(crate) counters: &'a crate::stats::Counters,
    pub(crate) faults: &'a dyn crate::engine::DeviceFaults,
    pub(crate) reader: crate::read::Reader<'a>,
    pub(crate) writer: crate::through::Writer<'a>,
}
pub(crate) use open::open_log;
pub(crate) use stats::cache_failed;
pub use stats::WriteBackStats;

use crate::order::{levels, OrderedMutex};
use crate::progress::Progress;
use crate::ranges::RangeLock;
use crate::through::WriteThrough;
use parking_lot::Condvar;
use sce_core::PAGE_SIZE;
use sce_io::BlockDevice;
use sce_store::wblog::state::GROUP_SHIFT;
use sce_store::wblog::LogRegion;

/// The log's state in memory (`sce_store::wblog::LogState`), on the engine's clock.
pub(super) type St = sce_store::wblog::LogState<std::time::Instant>;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// A volume the log holds pages of: its first global page, its id in the volume table, and
/// the global byte where it ends (a source need not be a whole number of pages).
#[derive(Clone, Copy, Debug)]
struct Vol {
    base: u64,
    id: u16,
    end: u64,
}

/// The write-back-through-the-log path.
pub(crate) struct LogBack {
    /// The write-through path: clean reads, the cleaner's writes to the source, and the
    /// writes a drain sends through.
    through: WriteThrough,
    /// The cache device, and its log region.
    dev: Arc<dyn BlockDevice>,
    region: LogRegion,
    /// The volumes, in address order: log entries name pages by volume id and page within
    /// the volume.
    vols: Vec<Vol>,
    persist: Arc<crate::persist::Persist>,
    st: OrderedMutex<levels::Leaf, St>,
    /// One commit at a time (group commit: the others find theirs done).
    commit_io: OrderedMutex<levels::LogCommitIo, ()>,
    /// One cleaning batch at a time (the cleaner's, a drain's).
    clean_io: OrderedMutex<levels::LogCleanIo, ()>,
    /// One anchor move at a time (`commit.rs`: candidate, superblock write, writer).
    anchor_io: OrderedMutex<levels::LogAnchorIo, ()>,
    /// Writes hold their pages exclusively (a write merging a partial page must not lose a
    /// concurrent write's other bytes of it); reads and the cleaner take none. A write
    /// started through the queue holds them until its completion ran.
    ranges: RangeLock<levels::LogRange>,
    /// The order of source writes of the same pages: the cleaner takes a run's pages here
    /// around its source write, and so does a write (or discard) that goes through to the
    /// source and supersedes the log's versions, so that an older version the cleaner took
    /// never lands on the source after the newer bytes.
    source_order: RangeLock<levels::LogSourceOrder>,
    /// The cache device's I/O queue writes may start through, and where the cache device
    /// starts on its device (`queued.rs`).
    queue: OnceLock<(Arc<dyn sce_io::IoQueue>, u64)>,
    /// The cleaner is wanted now (writers waiting for room, a drain).
    wanted: OrderedMutex<levels::Leaf, bool>,
    wanted_cv: Condvar,
    /// Bumped when room may have come back or a commit completed.
    progress: Progress,
    /// Drains under way (the cleaner cleans everything meanwhile, at full priority).
    forced: AtomicU64,
    /// Drains under way, for the writers' quick look (`St::drains` has their ranges).
    draining: AtomicUsize,
    /// Writes and discards that went through to the source without flushing it, counted
    /// once each completed, and what a source flush covers: a FLUSH that finds one owed
    /// flushes the source itself.
    through_writes: crate::devices::FlushMark,
    /// Writers waiting for room in the ring now: the cleaner works while there are any,
    /// whatever its thresholds say (they do not count the room writes leave for commits
    /// and copies).
    waiting: AtomicU64,
    /// Engine clock (ns) of the last client request: the cleaner cleans all when idle.
    last_request: AtomicU64,
    waits: AtomicU64,
    /// Pages reads took from the log, and reads the log served whole (hits the core's
    /// counters do not see).
    read_pages: AtomicU64,
    read_requests: AtomicU64,
    bytes_cleaned: AtomicU64,
    clean_errors: AtomicU64,
    source_writes: AtomicU64,
    /// The cleaner's time in batches (µs) and its source writes there, in the background
    /// [0] and while urgent [1]: its rate while it works, at each depth.
    clean_busy: [AtomicU64; 2],
    clean_busy_writes: [AtomicU64; 2],
    commits: AtomicU64,
    relocated: AtomicU64,
    damaged_found: AtomicU64,
    last_clean_error: OrderedMutex<levels::Leaf, String>,
    /// Large writes of a sequential stream go through to the source (`seq.rs`), and the
    /// bytes that did.
    seq: seq::Bypass,
    bypassed: AtomicU64,
    /// The current source outage, for rate-limited logs.
    outage: outage::OutageLog,
    /// The cleaner's watermarks and rate (`tune.rs`), and each volume's share of the log
    /// (millionths; set once, at open).
    tuning: tune::Tuning,
    shares: OnceLock<Vec<u64>>,
    wait_limit: Duration,
    idle: Duration,
    /// Chunks of read slots the superblock records lent (`lend.rs`), and how many were
    /// lent and given back.
    lent: AtomicU64,
    lends: AtomicU64,
    give_backs: AtomicU64,
}

impl LogBack {
    /// The device offset of log position `lpos`.
    fn at(&self, lpos: u64) -> u64 {
        self.region.offset_of(lpos)
    }

    /// The volume global page `g` lies in.
    fn vol(&self, g: u64) -> Vol {
        let i = self.vols.partition_point(|v| v.base <= g).max(1) - 1;
        self.vols[i]
    }

    /// The log's name of global page `g`: (volume id, page within the volume).
    fn local(&self, g: u64) -> (u32, u64) {
        let v = self.vol(g);
        (v.id as u32, g - v.base)
    }

    /// Global page of (volume id, page), if the volume is served and the page lies before
    /// the next volume's first.
    fn global(&self, volume: u32, page: u64) -> Option<u64> {
        let i = self.vols.iter().position(|v| v.id as u32 == volume)?;
        let g = self.vols[i].base + page;
        let end = self.vols.get(i + 1).map_or(u64::MAX, |v| v.base);
        (g < end).then_some(g)
    }

    /// The bytes of pages `[g0, g0 + n)` that lie inside their volume (the last page of a
    /// source that is not a whole number of pages is cut at its end).
    fn bytes_within(&self, g0: u64, n: u64) -> u64 {
        let end = self.vol(g0).end;
        (n * PAGE_SIZE).min(end.saturating_sub(g0 * PAGE_SIZE))
    }

    /// Write-back's state and counters (the same figures as the slot path's).
    pub(crate) fn stats(&self) -> WriteBackStats {
        let (dirty, lost, stuck, beside, cap) = {
            let st = self.st.lock();
            let beside = st.w.commits_beside();
            let cap = st.w.usable_capacity();
            (st.index.len(), st.lost.len(), st.stuck.len(), beside, cap)
        };
        let block = sce_store::wblog::LOG_BLOCK;
        let lend = self.region.lend;
        WriteBackStats {
            dirty_bytes: dirty as u64 * PAGE_SIZE,
            lost_bytes: lost as u64 * PAGE_SIZE,
            waits: self.waits.load(Relaxed),
            cleaned_bytes: self.bytes_cleaned.load(Relaxed),
            clean_errors: self.clean_errors.load(Relaxed),
            log_commits: self.commits.load(Relaxed),
            log_commits_beside: beside,
            log_source_writes: self.source_writes.load(Relaxed),
            stuck_bytes: stuck as u64 * PAGE_SIZE,
            relocated_bytes: self.relocated.load(Relaxed) * PAGE_SIZE,
            damaged_pages: self.damaged_found.load(Relaxed),
            sequential_bytes: self.bypassed.load(Relaxed),
            log_capacity_bytes: cap * block,
            log_max_bytes: self.region.lap() * block,
            log_lent_bytes: self.lent.load(Relaxed) * lend.chunk_blocks * block,
            log_lends: self.lends.load(Relaxed),
            log_give_backs: self.give_backs.load(Relaxed),
            clean_background_micros: self.clean_busy[0].load(Relaxed),
            clean_background_writes: self.clean_busy_writes[0].load(Relaxed),
            clean_urgent_micros: self.clean_busy[1].load(Relaxed),
            clean_urgent_writes: self.clean_busy_writes[1].load(Relaxed),
            last_clean_error: self.last_clean_error.lock().clone(),
        }
    }

    /// Dirty and lost pages among global pages `first..end` (a volume's: `ctl forget`
    /// keeps them and says how many).
    pub(crate) fn dirty_in(&self, first: u64, end: u64) -> (u64, u64) {
        self.st.lock().dirty_in(first, end)
    }

    /// The first 1 MiB group of global pages at or after page `first` and before `end`
    /// that holds a dirty or lost page, as its page range: what block status must report
    /// as data whatever the source's map says.
    pub(crate) fn dirty_group_from(&self, first: u64, end: u64) -> Option<(u64, u64)> {
        let st = self.st.lock();
        let dirty = (st.groups.range(first >> GROUP_SHIFT..).next()).map(|(&k, _)| k);
        let lost = st.lost.range(first..).next().map(|g| g >> GROUP_SHIFT);
        let k = dirty.into_iter().chain(lost).min()?;
        let (lo, hi) = (
            (k << GROUP_SHIFT).max(first),
            ((k + 1) << GROUP_SHIFT).min(end),
        );
        (lo < hi).then_some((lo, hi))
    }

    /// Source writes the cleaner made, and commits (figures for the benchmarks).
    pub(crate) fn log_counts(&self) -> (u64, u64) {
        (self.source_writes.load(Relaxed), self.commits.load(Relaxed))
    }

    /// Pages reads took from the log, and reads it served whole.
    pub(crate) fn read_counts(&self) -> (u64, u64) {
        (
            self.read_pages.load(Relaxed),
            self.read_requests.load(Relaxed),
        )
    }

    /// Sequential runs of large writes from `cutoff` bytes on go through to the source (0:
    /// none does).
    pub(crate) fn set_sequential_cutoff(&self, cutoff: u64) {
        self.seq.set_cutoff(cutoff);
    }

    /// True if a client's write of `len` bytes at `offset` is a large write of a sequential
    /// stream past the cutoff, which goes through to the source (`seq.rs`); never while the
    /// source fails writes (pages stuck). The same request asked again gets the same answer.
    pub(crate) fn sequential(&self, offset: u64, len: u64) -> bool {
        self.seq.goes_around(offset, len) && self.st.lock().stuck.is_empty()
    }

    /// True if a write of global pages `[g0, g1)` goes through to the source now (a drain
    /// of its range is under way).
    fn goes_through(&self, g0: u64, g1: u64) -> bool {
        self.draining.load(Relaxed) > 0 && self.st.lock().draining(g0, g1)
    }

    /// True if some range is being drained (writes there do not run locally).
    pub(crate) fn drain_under_way(&self) -> bool {
        self.draining.load(Relaxed) > 0
    }

    /// The cleaner thread's work (`clean.rs`).
    pub(crate) fn cleaner(&self, e: &LogIo<'_>) {
        clean::cleaner(e, self)
    }
}
