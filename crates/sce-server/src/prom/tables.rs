//! The families of /metrics that no stats table defines, as data: the NBD server's, and a
//! cached export's figures derived from its stats and configuration. Each is a name (with
//! its unit and, for counters, `_total`), a HELP text, and how to read its value, one line
//! each. The families of the stats structs come from their tables (`VolumeStats::STATS`
//! and the like, see `sce_core::stats_table!`).

use sce_engine::VolumeStats;
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
pub const VOLUME_GAUGES: &[Family<View, f64>] = &[
    ("sce_cache_size_bytes", "Bytes of the cache device that hold data (its slots).", |v| (v.stats.total_slots * v.config.fragment_size) as f64),
    ("sce_cache_occupied_bytes", "Bytes of the cache's slots that hold a fragment.", |v| (v.stats.total_slots.saturating_sub(v.stats.free_slots) * v.config.fragment_size) as f64),
    ("sce_line_size_bytes", "The line size: the unit of cache space (one slot of the device).", |v| v.config.fragment_size as f64),
    ("sce_fragment_size_bytes", "The fragment size: the unit of heat (a line or several).", |v| v.config.heat_bytes() as f64),
    ("sce_read_hit_ratio", "Pages of reads served from the cache over all pages read, since start.", |v| v.stats.read_hit_ratio()),
    ("sce_inflight_requests", "Requests the cached volume is serving now.", |v| v.in_flight as f64),
];
