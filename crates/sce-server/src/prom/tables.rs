//! The families of /metrics as data: each a name (with its unit and, for counters,
//! `_total`), a HELP text, and how to read its value. One line each, so that what sce
//! exports can be read at a glance.

use sce_engine::{PersistStats, VolumeStats};
use sce_nbd::ServerStats;
use std::sync::atomic::Ordering::Relaxed;

/// A family read from `T`: (name, help, value).
pub type Family<T, V> = (&'static str, &'static str, fn(&T) -> V);

/// What a cached export's gauges are read from.
pub struct View {
    /// The volume's counters.
    pub stats: VolumeStats,
    /// Its configuration in force.
    pub config: sce_core::CoreConfig,
    /// Requests it serves now.
    pub in_flight: u64,
}

#[rustfmt::skip]
pub const SERVER_COUNTERS: &[Family<ServerStats, u64>] = &[
    ("sce_nbd_connections_total", "NBD connections accepted.", |s| s.connections.load(Relaxed)),
    ("sce_nbd_requests_total", "NBD requests received.", |s| s.requests.load(Relaxed)),
    ("sce_nbd_queued_requests_total", "NBD requests served through an I/O queue (io_uring) without a worker thread.", |s| s.queued_requests.load(Relaxed)),
    ("sce_nbd_inline_requests_total", "NBD requests served on the connection's reader thread.", |s| s.inline_requests.load(Relaxed)),
    ("sce_nbd_request_errors_total", "NBD requests answered with an error.", |s| s.request_errors.load(Relaxed)),
    ("sce_nbd_protocol_errors_total", "NBD connections closed for a protocol error.", |s| s.protocol_errors.load(Relaxed)),
    ("sce_nbd_refused_connections_total", "NBD connections refused (over --max-connections, or no thread).", |s| s.refused_connections.load(Relaxed)),
    ("sce_nbd_handshake_timeouts_total", "NBD connections closed because the handshake took too long.", |s| s.handshake_timeouts.load(Relaxed)),
    ("sce_nbd_request_timeouts_total", "NBD connections closed because a request took too long to arrive.", |s| s.request_timeouts.load(Relaxed)),
    ("sce_nbd_idle_timeouts_total", "NBD connections closed after --idle-timeout without a request.", |s| s.idle_timeouts.load(Relaxed)),
    ("sce_nbd_reply_timeouts_total", "NBD connections closed because the client did not read its replies.", |s| s.reply_timeouts.load(Relaxed)),
];

#[rustfmt::skip]
pub const SERVER_GAUGES: &[Family<ServerStats, u64>] = &[
    ("sce_nbd_open_connections", "NBD connections open now.", |s| s.open_connections.load(Relaxed)),
    ("sce_nbd_inflight_bytes", "Payload bytes held in flight now (write data received, read replies not yet sent).", |s| s.inflight_bytes.load(Relaxed)),
    ("sce_nbd_inflight_peak_bytes", "The most payload bytes held in flight at once since start.", |s| s.inflight_bytes_peak.load(Relaxed)),
];

#[rustfmt::skip]
pub const VOLUME_COUNTERS: &[Family<VolumeStats, u64>] = &[
    ("sce_read_requests_total", "Read requests served by the cached volume.", |s| s.read_requests),
    ("sce_read_full_hit_requests_total", "Read requests served entirely from the cache.", |s| s.read_requests_full_hit),
    ("sce_read_hit_pages_total", "4 KiB pages of reads served from the cache.", |s| s.read_pages_hit),
    ("sce_read_missed_pages_total", "4 KiB pages of reads served from the source.", |s| s.read_pages_missed),
    ("sce_write_requests_total", "Write and discard requests.", |s| s.write_requests),
    ("sce_source_read_bytes_total", "Bytes read from the source.", |s| s.source_bytes_read),
    ("sce_source_written_bytes_total", "Bytes written to the source.", |s| s.source_bytes_written),
    ("sce_cache_read_bytes_total", "Bytes read from the cache device (hits, checks).", |s| s.cache_bytes_read),
    ("sce_cache_written_bytes_total", "Bytes written to the cache device (population, write copies, metadata, journal).", |s| s.cache_bytes_written),
    ("sce_cache_read_errors_total", "Failed reads of the cache device (served from the source instead).", |s| s.cache_read_errors),
    ("sce_cache_write_errors_total", "Failed writes to the cache device.", |s| s.cache_write_errors),
    ("sce_cache_checksum_errors_total", "Cached pages whose data failed its checksum (served from the source instead).", |s| s.cache_checksum_errors),
    ("sce_populated_fragments_total", "Fragments populated (read from the source into the cache).", |s| s.fragments_populated),
    ("sce_population_failures_total", "Populations that failed.", |s| s.populations_failed),
    ("sce_populated_pages_total", "4 KiB pages made valid by population.", |s| s.pages_populated),
    ("sce_evicted_fragments_total", "Fragments evicted.", |s| s.fragments_evicted),
    ("sce_awt_copies_started_total", "Writes whose cache copy was sent (write-through).", |s| s.awt_started),
    ("sce_awt_copies_completed_total", "Writes whose cache copy completed and re-validated pages.", |s| s.awt_completed),
    ("sce_awt_fallbacks_total", "Writes that fell back to write-around (AWT budget spent).", |s| s.awt_fallbacks),
    ("sce_awt_duplicates_total", "Writes that skipped the cache copy for a concurrent write to the same pages.", |s| s.awt_duplicates),
    ("sce_admission_rejections_total", "Candidates refused by the admission duel (admission sce).", |s| s.admissions_rejected),
    ("sce_sequential_requests_total", "Requests found to be part of a sequential stream and bypassed.", |s| s.sequential_requests),
    ("sce_population_budget_waits_total", "Population picks deferred by the population budget.", |s| s.population_budget_waits),
    ("sce_endurance_refusals_total", "Cache writes refused by the endurance budget (max_cache_writes).", |s| s.endurance_refusals),
];

#[rustfmt::skip]
pub const VOLUME_GAUGES: &[Family<View, f64>] = &[
    ("sce_cache_size_bytes", "Bytes of the cache device that hold data (its slots).", |v| (v.stats.total_slots * v.config.fragment_size) as f64),
    ("sce_cache_occupied_bytes", "Bytes of the cache's slots that hold a fragment.", |v| (v.stats.total_slots.saturating_sub(v.stats.free_slots) * v.config.fragment_size) as f64),
    ("sce_cache_slots", "Slots (fragment-sized places) of the cache.", |v| v.stats.total_slots as f64),
    ("sce_cache_free_slots", "Slots that hold no fragment.", |v| v.stats.free_slots as f64),
    ("sce_fragment_size_bytes", "The fragment (cache line) size.", |v| v.config.fragment_size as f64),
    ("sce_read_hit_ratio", "Pages of reads served from the cache over all pages read, since start.", |v| v.stats.read_hit_ratio()),
    ("sce_passthrough", "1 if the cache disabled itself after device errors and passes I/O to the source.", |v| v.stats.passthrough as f64),
    ("sce_population_rate_limit_bytes_per_second", "The population rate allowed now (0: unlimited).", |v| v.stats.population_rate as f64),
    ("sce_population_workers", "Population workers the throttle lets run now.", |v| v.stats.active_workers as f64),
    ("sce_inflight_requests", "Requests the cached volume is serving now.", |v| v.in_flight as f64),
];

#[rustfmt::skip]
pub const PERSIST_COUNTERS: &[Family<PersistStats, u64>] = &[
    ("sce_persist_intent_syncs_total", "Write-intent block writes.", |p| p.intent_syncs),
    ("sce_persist_intent_presets_total", "Intents set ahead of need.", |p| p.intent_presets),
    ("sce_persist_metadata_units_written_total", "Metadata units written.", |p| p.units_written),
    ("sce_persist_metadata_written_bytes_total", "Bytes of metadata written.", |p| p.metadata_bytes_written),
    ("sce_persist_metadata_errors_total", "Failed metadata writes.", |p| p.metadata_errors),
    ("sce_persist_journal_appends_total", "Write-journal entries appended.", |p| p.journal_appends),
    ("sce_persist_journal_blocks_total", "Write-journal blocks written.", |p| p.journal_blocks),
    ("sce_persist_journal_written_bytes_total", "Bytes of write-journal blocks written.", |p| p.journal_bytes),
    ("sce_persist_journal_full_fallbacks_total", "Writes that found the journal ring full and fell back to a fragment intent.", |p| p.journal_full_fallbacks),
];

#[rustfmt::skip]
pub const PERSIST_GAUGES: &[Family<PersistStats, f64>] = &[
    ("sce_persist_format_version", "Format version of the cache device.", |p| p.format_version as f64),
    ("sce_persist_previous_shutdown_clean", "1 if the previous stop was clean.", |p| p.previous_shutdown_clean as u64 as f64),
    ("sce_persist_last_clean_shutdown_timestamp_seconds", "Unix time of the last clean shutdown (0: never).", |p| p.last_clean_shutdown as f64),
    ("sce_persist_restored_fragments", "Fragments restored at start.", |p| p.fragments_restored as f64),
    ("sce_persist_dropped_by_intent_fragments", "Fragments dropped at start because a write intent covered them.", |p| p.fragments_dropped_intent as f64),
    ("sce_persist_dirty_intents", "Fragments whose cached copy a crash now would drop.", |p| p.dirty_intents as f64),
    ("sce_persist_load_seconds", "Time the start-up load of the cache device took.", |p| p.load_millis as f64 / 1e3),
    ("sce_persist_journal_enabled", "1 if writes to cached pages are journaled (--crash-journal on).", |p| p.journal as u64 as f64),
    ("sce_persist_journal_replayed_blocks", "Write-journal blocks replayed at start.", |p| p.journal_blocks_replayed as f64),
    ("sce_persist_journal_hit_fragments", "Fragments the journal replay touched at start.", |p| p.journal_fragments_hit as f64),
    ("sce_persist_journal_dropped_pages", "Pages the journal replay dropped at start.", |p| p.journal_pages_dropped as f64),
];
