//! The write-back path (issue 15; docs/WRITEBACK.md): a write lands in the cache only and
//! is acknowledged once its dirty entries are durable and its data written (`write.rs`);
//! the cleaners copy dirty pages to the source later (`clean.rs`). The cache device holds
//! the only copy of dirty data: reads and writes take their pages in the range lock
//! (below), FLUSH makes acknowledged writes durable on the cache device, and a start puts
//! back what the device holds dirty (`restore.rs`).
//!
//! Lock order: the range lock is outermost (order -0.5 in docs/ARCHITECTURE.md: taken
//! before any core lock, never while one is held); `progress` and the cleaners' state are
//! leaves.

mod clean;
pub(crate) mod outage;
mod restore;
mod write;

pub(crate) use clean::CLEANERS;
pub(crate) use restore::{check_dirty, hold_dirty, restore};

use crate::engine::Engine;
use crate::persist::Persist;
use crate::progress::Progress;
use crate::ranges::RangeLock;
use parking_lot::Mutex;
use sce_core::PAGE_SIZE;
use sce_io::IoError;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

sce_core::stats_table! {
    /// Write-back's state and counters (`CacheVolume::writeback_stats`). In /stats each
    /// JSON name has the prefix `writeback_`; `sce ctl status` shows them as they are.
    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct WriteBackStats {
        /// Bytes (4 KiB pages) only the cache holds now.
        dirty_bytes: u64, Gauge("sce_writeback_dirty_bytes", "bytes", "Bytes only the cache holds (write-back data not yet on the source).");
        /// Bytes whose dirty data was lost (reads of them fail).
        lost_bytes: u64, Gauge("sce_writeback_lost_bytes", "bytes", "Bytes of write-back data whose only copy was lost on the cache device; reads of them fail.");
        /// Bytes the cleaner wrote to the source.
        cleaned_bytes: u64, Counter("sce_writeback_cleaned_bytes_total", "bytes", "Bytes of write-back data the cleaner wrote to the source.");
        /// Cleaning jobs that failed (source errors), retried with backoff.
        clean_errors: u64, Counter("sce_writeback_clean_errors_total", "", "Cleaning jobs that failed on the source (the data stays dirty and is retried).");
        /// Writes that waited for cleaning or a metadata round (backpressure).
        waits: u64, Counter("sce_writeback_waits_total", "", "Writes that waited for cleaning or a metadata round (backpressure).");
        /// Commit records written to the write-back log (0 without one).
        log_commits: u64, Counter("sce_writeback_log_commits_total", "", "Commit records written to the write-back log (FLUSH, FUA, autocommit and seals); 0 for a device without a log.");
        /// Commits whose record's second copies went beside the first in the ring, not to
        /// the mirror area (every mirror slot still needed by replay).
        log_commits_beside: u64, Counter("sce_writeback_log_commits_beside_total", "", "Commits of the write-back log whose record's second copy went beside the first in the ring (same device write) because every slot of the mirror area was still needed; 0 for a device without a log.");
        /// Source writes the log's cleaner made (0 without a log).
        log_source_writes: u64, Counter("sce_writeback_log_source_writes_total", "", "Source writes the write-back log's cleaner made (adjacent dirty pages coalesced, up to 1 MiB each); 0 for a device without a log.");
        /// Dirty bytes whose write to the source failed, retried with backoff (the log).
        stuck_bytes: u64, Gauge("sce_writeback_stuck_bytes", "bytes", "Dirty bytes the cleaner could not write to the source (their writes failed): retried with backoff; the rest is cleaned meanwhile.");
        /// Dirty bytes the log copied forward past the pages it could not clean yet (the log).
        relocated_bytes: u64, Counter("sce_writeback_relocated_bytes_total", "bytes", "Dirty bytes the write-back log copied to its head so that pages it cannot clean yet hold only their own room.");
        /// Dirty pages found damaged on the cache device while serving (the log).
        damaged_pages: u64, Counter("sce_writeback_damaged_pages_total", "", "Dirty pages whose only copy failed its checksum on the cache device while serving: counted lost (reads of them fail until written again).");
        /// Bytes of large writes in long sequential streams that went through to the source
        /// rather than into the log (the log).
        sequential_bytes: u64, Counter("sce_writeback_sequential_bypass_bytes_total", "bytes", "Bytes of large writes in sequential streams past the sequential cutoff that went through to the source instead of into the write-back log.");
    }
    also {
        /// The last cleaning error ("" if none).
        pub last_clean_error: String,
    }
}

/// A write-back write refused because the cache device failed (passthrough): it holds the
/// only copy of dirty data, so no write may go around it. Both write-back paths say so.
pub(crate) fn cache_failed(offset: u64, len: u64) -> IoError {
    IoError::Io {
        op: sce_io::Op::Write,
        offset,
        len,
        source: std::io::Error::other(
            "the cache device failed: write-back cannot take writes (see the log)",
        ),
    }
}

/// The write-back path's own state.
pub(crate) struct WriteBack {
    /// The store: write-back always has one (its journal holds the dirty entries).
    persist: Arc<Persist>,
    ranges: RangeLock,
    /// Bumped on every completion that may let a waiting write go on.
    progress: Progress,
    /// `flush --to-source` calls waiting: the cleaner cleans everything meanwhile.
    forced: AtomicU64,
    /// Nanoseconds (engine clock) of the last client request: the cleaner cleans all when
    /// idle.
    last_request: AtomicU64,
    /// Writes that waited for cleaning or a round, and when one last did (engine clock).
    waits: AtomicU64,
    last_wait: AtomicU64,
    /// Cleaning: bytes written to the source, failed jobs, the last failure.
    bytes_cleaned: AtomicU64,
    clean_errors: AtomicU64,
    last_clean_error: Mutex<String>,
    /// The current source outage, for rate-limited logs.
    outage: outage::OutageLog,
    /// Bumped by every `flush --to-source`: cuts the cleaners' backoff short.
    kicks: AtomicU64,
    /// How long a write waits for room before it fails.
    wait_limit: Duration,
    /// Time without requests after which the cleaner cleans everything.
    idle: Duration,
}

impl WriteBack {
    /// The path over `persist`: a write waits up to `wait_limit` for room; the cleaners
    /// clean everything after `idle` without requests.
    pub(crate) fn new(persist: Arc<Persist>, wait_limit: Duration, idle: Duration) -> Self {
        WriteBack {
            persist,
            ranges: RangeLock::default(),
            progress: Progress::default(),
            forced: AtomicU64::new(0),
            last_request: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            last_wait: AtomicU64::new(0),
            bytes_cleaned: AtomicU64::new(0),
            clean_errors: AtomicU64::new(0),
            last_clean_error: Mutex::new(String::new()),
            outage: outage::OutageLog::default(),
            kicks: AtomicU64::new(0),
            wait_limit,
            idle,
        }
    }

    /// A client's read: its pages taken shared in the range lock (a read must never see a
    /// page half rewritten in place, whose checksum would then look like device damage).
    pub(crate) fn read(&self, e: &Engine, offset: u64, buf: &mut [u8]) -> Result<bool, IoError> {
        self.last_request.store(e.cores.now().0, Relaxed);
        let end = offset + buf.len() as u64;
        let _g = self.ranges.lock(
            offset / PAGE_SIZE * PAGE_SIZE,
            end.div_ceil(PAGE_SIZE) * PAGE_SIZE,
            false,
        );
        e.read(offset, buf)
    }

    /// Acknowledged writes made durable on the cache device. What the flush covers is noted
    /// before it; the superblock then says so, so that a restart tells a flushed page
    /// damaged since from a torn one.
    pub(crate) fn flush(&self, e: &Engine) -> Result<(), IoError> {
        let mark = self.persist.landed_mark();
        e.dev.cache.flush()?;
        self.persist.record_landed(mark)?;
        e.dev.flush_source()
    }

    /// A cleaner thread's work (`clean.rs`).
    pub(crate) fn cleaner(&self, e: &Engine) {
        clean::cleaner(e, self)
    }

    /// Write-back's state and counters.
    pub(crate) fn stats(&self, e: &Engine) -> WriteBackStats {
        let dirty = e.cores.sum(|c| c.dirty_pages());
        let lost = e.cores.sum(|c| c.lost_pages());
        WriteBackStats {
            dirty_bytes: dirty * PAGE_SIZE,
            lost_bytes: lost * PAGE_SIZE,
            waits: self.waits.load(Relaxed),
            cleaned_bytes: self.bytes_cleaned.load(Relaxed),
            clean_errors: self.clean_errors.load(Relaxed),
            last_clean_error: self.last_clean_error.lock().clone(),
            ..Default::default()
        }
    }
}
