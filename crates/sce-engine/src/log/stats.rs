//! Write-back's state and counters as `status`, /stats and /metrics show them, and the
//! error a write-back write gets when the cache device has failed.

use sce_io::IoError;

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
        /// What the log holds at most with the chunks of read slots its laps use now (its
        /// own region and those chunks; 0 without a log).
        log_capacity_bytes: u64, Gauge("sce_writeback_log_capacity_bytes", "bytes", "Bytes the write-back log holds at most now: its own region and the chunks of read slots its laps use (it lends more as dirty data grows, up to log_max_bytes).");
        /// The most the log may hold: its region and every chunk of read slots it may lend.
        log_max_bytes: u64, Gauge("sce_writeback_log_max_bytes", "bytes", "Bytes the write-back log may hold at most: its own region and every chunk of read slots it may lend (format 9: up to half the cache device by default).");
        /// Bytes of read slots lent to the log now (out of the read cache).
        log_lent_bytes: u64, Gauge("sce_writeback_log_lent_bytes", "bytes", "Bytes of the read cache's slots lent to the write-back log now (out of the read cache until given back).");
        /// Chunks of read slots lent to the log.
        log_lends: u64, Counter("sce_writeback_log_lends_total", "", "Chunks of read slots the write-back log took as dirty data grew.");
        /// Chunks of read slots the log gave back.
        log_give_backs: u64, Counter("sce_writeback_log_give_backs_total", "", "Chunks of read slots the write-back log gave back to the read cache once cleaning emptied them.");
        /// The cleaner's time in batches in the background (16 source writes in flight), µs.
        clean_background_micros: u64, Counter("sce_writeback_clean_background_seconds_total", "seconds", "Time the write-back log's cleaner spent cleaning in the background (16 source writes in flight at most).") / 1e6;
        /// Source writes the cleaner made in those batches.
        clean_background_writes: u64, Counter("sce_writeback_clean_background_source_writes_total", "", "Source writes the write-back log's cleaner made while cleaning in the background.");
        /// The cleaner's time in urgent batches (64 source writes in flight), µs.
        clean_urgent_micros: u64, Counter("sce_writeback_clean_urgent_seconds_total", "seconds", "Time the write-back log's cleaner spent cleaning urgently (past the high watermark or writers waiting for room; 64 source writes in flight at most).") / 1e6;
        /// Source writes the cleaner made in urgent batches.
        clean_urgent_writes: u64, Counter("sce_writeback_clean_urgent_source_writes_total", "", "Source writes the write-back log's cleaner made while cleaning urgently.");
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
