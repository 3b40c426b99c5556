//! An export's own counts, apart from its cached volume's (several exports may share one
//! cached volume): a stats table, read by /metrics and /stats.

use std::sync::atomic::AtomicU64;

sce_core::stats_table! {
    /// An export's own counts (several exports may share one cached volume, whose counters
    /// are the device's).
    #[derive(Debug, Default)]
    pub struct ExportCounters {
        /// Reads served while attached.
        read_requests: AtomicU64, Counter("sce_export_read_requests_total", "", "Reads of this export served while its cache was attached.");
        /// Of them, reads served wholly from the cache.
        read_hits: AtomicU64, Counter("sce_export_read_hits_total", "", "Reads of this export served wholly from the cache.");
        /// Bytes read.
        read_bytes: AtomicU64, Counter("sce_export_read_bytes_total", "bytes", "Bytes read from this export while its cache was attached.");
        /// Writes and discards.
        write_requests: AtomicU64, Counter("sce_export_write_requests_total", "", "Writes and discards of this export.");
        /// Bytes written.
        write_bytes: AtomicU64, Counter("sce_export_written_bytes_total", "bytes", "Bytes written to this export.");
    }
}
