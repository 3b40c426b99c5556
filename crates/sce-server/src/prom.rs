//! The Prometheus exposition of /metrics, encoded by the `prometheus` crate (text format
//! 0.0.4): every family has a HELP line and a TYPE, counters end in `_total`, values are in
//! base units (bytes, seconds), and the name says the unit. Each export's samples carry an
//! `export` label; the default export (`""`, which Prometheus would read as no label) is
//! labelled `default`.
//!
//! The values are read at scrape time from the counters the server and the engine keep
//! anyway (atomics); the latency histograms are the engine's own lock-free ones
//! ([`sce_engine::stats::LatencyHistogram`]).

use crate::metrics::Volumes;
use crate::rates::Rates;
use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, TextEncoder};
use sce_engine::stats::{LatencySnapshot, LATENCY_BOUNDS_NS};
use sce_nbd::Server;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

/// The label value of an export.
pub fn export_label(name: &str) -> &str {
    if name.is_empty() {
        "default"
    } else {
        name
    }
}

/// Families being gathered, by name, in the order first seen.
#[derive(Default)]
struct Families {
    order: Vec<String>,
    by_name: BTreeMap<String, MetricFamily>,
}

fn labels(pairs: &[(&str, &str)]) -> Vec<LabelPair> {
    pairs
        .iter()
        .map(|(k, v)| {
            let mut l = LabelPair::default();
            l.set_name(k.to_string());
            l.set_value(v.to_string());
            l
        })
        .collect()
}

impl Families {
    fn family(&mut self, name: &str, help: &str, kind: MetricType) -> &mut MetricFamily {
        if !self.by_name.contains_key(name) {
            let mut f = MetricFamily::default();
            f.set_name(name.to_string());
            f.set_help(help.to_string());
            f.set_field_type(kind);
            self.order.push(name.to_string());
            self.by_name.insert(name.to_string(), f);
        }
        self.by_name.get_mut(name).expect("just inserted")
    }

    fn push(&mut self, name: &str, help: &str, kind: MetricType, lp: &[(&str, &str)], v: f64) {
        let mut m = Metric::default();
        m.set_label(labels(lp));
        match kind {
            MetricType::COUNTER => {
                let mut c = Counter::default();
                c.set_value(v);
                m.set_counter(c);
            }
            _ => {
                let mut g = Gauge::default();
                g.set_value(v);
                m.set_gauge(g);
            }
        }
        self.family(name, help, kind).mut_metric().push(m);
    }

    fn counter(&mut self, name: &str, help: &str, lp: &[(&str, &str)], v: u64) {
        self.push(name, help, MetricType::COUNTER, lp, v as f64);
    }

    fn gauge(&mut self, name: &str, help: &str, lp: &[(&str, &str)], v: f64) {
        self.push(name, help, MetricType::GAUGE, lp, v);
    }

    fn histogram(&mut self, name: &str, help: &str, lp: &[(&str, &str)], s: &LatencySnapshot) {
        let mut h = Histogram::default();
        h.set_sample_count(s.count);
        h.set_sample_sum(s.sum_ns as f64 / 1e9);
        h.set_bucket(
            LATENCY_BOUNDS_NS
                .iter()
                .zip(&s.cumulative)
                .map(|(&b, &c)| {
                    let mut x = Bucket::default();
                    x.set_upper_bound(b as f64 / 1e9);
                    x.set_cumulative_count(c);
                    x
                })
                .collect(),
        );
        let mut m = Metric::default();
        m.set_label(labels(lp));
        m.set_histogram(h);
        self.family(name, help, MetricType::HISTOGRAM)
            .mut_metric()
            .push(m);
    }

    fn into_vec(mut self) -> Vec<MetricFamily> {
        self.order
            .iter()
            .filter_map(|n| self.by_name.remove(n))
            .filter(|f| !f.get_metric().is_empty())
            .collect()
    }
}

/// The server's own families: connections and requests over NBD.
fn server_families(f: &mut Families, server: &Server) {
    let s = server.stats();
    let c = |a: &std::sync::atomic::AtomicU64| a.load(Relaxed);
    f.gauge(
        "sce_build_info",
        "The version of sce serving (the value is always 1).",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1.0,
    );
    for (name, help, v) in [
        (
            "sce_nbd_connections_total",
            "NBD connections accepted.",
            c(&s.connections),
        ),
        (
            "sce_nbd_requests_total",
            "NBD requests received.",
            c(&s.requests),
        ),
        (
            "sce_nbd_queued_requests_total",
            "NBD requests served through an I/O queue (io_uring) without a worker thread.",
            c(&s.queued_requests),
        ),
        (
            "sce_nbd_inline_requests_total",
            "NBD requests served on the connection's reader thread.",
            c(&s.inline_requests),
        ),
        (
            "sce_nbd_request_errors_total",
            "NBD requests answered with an error.",
            c(&s.request_errors),
        ),
        (
            "sce_nbd_protocol_errors_total",
            "NBD connections closed for a protocol error.",
            c(&s.protocol_errors),
        ),
        (
            "sce_nbd_refused_connections_total",
            "NBD connections refused (over --max-connections, or no thread).",
            c(&s.refused_connections),
        ),
        (
            "sce_nbd_handshake_timeouts_total",
            "NBD connections closed because the handshake took too long.",
            c(&s.handshake_timeouts),
        ),
        (
            "sce_nbd_request_timeouts_total",
            "NBD connections closed because a request took too long to arrive.",
            c(&s.request_timeouts),
        ),
        (
            "sce_nbd_idle_timeouts_total",
            "NBD connections closed after --idle-timeout without a request.",
            c(&s.idle_timeouts),
        ),
        (
            "sce_nbd_reply_timeouts_total",
            "NBD connections closed because the client did not read its replies.",
            c(&s.reply_timeouts),
        ),
    ] {
        f.counter(name, help, &[], v);
    }
    f.gauge(
        "sce_nbd_open_connections",
        "NBD connections open now.",
        &[],
        c(&s.open_connections) as f64,
    );
    f.gauge(
        "sce_nbd_inflight_bytes",
        "Payload bytes held in flight now (write data received, read replies not yet sent).",
        &[],
        c(&s.inflight_bytes) as f64,
    );
    f.gauge(
        "sce_nbd_inflight_peak_bytes",
        "The most payload bytes held in flight at once since start.",
        &[],
        c(&s.inflight_bytes_peak) as f64,
    );
}

/// One cached export's families.
fn volume_families(
    f: &mut Families,
    export: &str,
    v: &sce_engine::CacheVolume,
    rates: Option<&Rates>,
    i: usize,
) {
    let lp = [("export", export)];
    let s = v.stats();
    let cfg = v.config();
    let counters: [(&str, &str, u64); 24] = [
        (
            "sce_read_requests_total",
            "Read requests served by the cached volume.",
            s.read_requests,
        ),
        (
            "sce_read_full_hit_requests_total",
            "Read requests served entirely from the cache.",
            s.read_requests_full_hit,
        ),
        (
            "sce_read_hit_pages_total",
            "4 KiB pages of reads served from the cache.",
            s.read_pages_hit,
        ),
        (
            "sce_read_missed_pages_total",
            "4 KiB pages of reads served from the source.",
            s.read_pages_missed,
        ),
        (
            "sce_write_requests_total",
            "Write and discard requests.",
            s.write_requests,
        ),
        (
            "sce_source_read_bytes_total",
            "Bytes read from the source.",
            s.source_bytes_read,
        ),
        (
            "sce_source_written_bytes_total",
            "Bytes written to the source.",
            s.source_bytes_written,
        ),
        (
            "sce_cache_read_bytes_total",
            "Bytes read from the cache device (hits, checks).",
            s.cache_bytes_read,
        ),
        (
            "sce_cache_written_bytes_total",
            "Bytes written to the cache device (population, write copies, metadata, journal).",
            s.cache_bytes_written,
        ),
        (
            "sce_cache_read_errors_total",
            "Failed reads of the cache device (served from the source instead).",
            s.cache_read_errors,
        ),
        (
            "sce_cache_write_errors_total",
            "Failed writes to the cache device.",
            s.cache_write_errors,
        ),
        (
            "sce_cache_checksum_errors_total",
            "Cached pages whose data failed its checksum (served from the source instead).",
            s.cache_checksum_errors,
        ),
        (
            "sce_populated_fragments_total",
            "Fragments populated (read from the source into the cache).",
            s.fragments_populated,
        ),
        (
            "sce_population_failures_total",
            "Populations that failed.",
            s.populations_failed,
        ),
        (
            "sce_populated_pages_total",
            "4 KiB pages made valid by population.",
            s.pages_populated,
        ),
        (
            "sce_evicted_fragments_total",
            "Fragments evicted.",
            s.fragments_evicted,
        ),
        (
            "sce_awt_copies_started_total",
            "Writes whose cache copy was sent (write-through).",
            s.awt_started,
        ),
        (
            "sce_awt_copies_completed_total",
            "Writes whose cache copy completed and re-validated pages.",
            s.awt_completed,
        ),
        (
            "sce_awt_fallbacks_total",
            "Writes that fell back to write-around (AWT budget spent).",
            s.awt_fallbacks,
        ),
        (
            "sce_awt_duplicates_total",
            "Writes that skipped the cache copy for a concurrent write to the same pages.",
            s.awt_duplicates,
        ),
        (
            "sce_admission_rejections_total",
            "Candidates refused by the admission duel (admission sce).",
            s.admissions_rejected,
        ),
        (
            "sce_sequential_requests_total",
            "Requests found to be part of a sequential stream and bypassed.",
            s.sequential_requests,
        ),
        (
            "sce_population_budget_waits_total",
            "Population picks deferred by the population budget.",
            s.population_budget_waits,
        ),
        (
            "sce_endurance_refusals_total",
            "Cache writes refused by the endurance budget (max_cache_writes).",
            s.endurance_refusals,
        ),
    ];
    for (name, help, val) in counters {
        f.counter(name, help, &lp, val);
    }
    let slot = cfg.fragment_size;
    let used = s.total_slots.saturating_sub(s.free_slots);
    for (name, help, val) in [
        (
            "sce_cache_size_bytes",
            "Bytes of the cache device that hold data (its slots).",
            (s.total_slots * slot) as f64,
        ),
        (
            "sce_cache_occupied_bytes",
            "Bytes of the cache's slots that hold a fragment.",
            (used * slot) as f64,
        ),
        (
            "sce_cache_slots",
            "Slots (fragment-sized places) of the cache.",
            s.total_slots as f64,
        ),
        (
            "sce_cache_free_slots",
            "Slots that hold no fragment.",
            s.free_slots as f64,
        ),
        (
            "sce_fragment_size_bytes",
            "The fragment (cache line) size.",
            slot as f64,
        ),
        (
            "sce_read_hit_ratio",
            "Pages of reads served from the cache over all pages read, since start.",
            s.read_hit_ratio(),
        ),
        (
            "sce_passthrough",
            "1 if the cache disabled itself after device errors and passes I/O to the source.",
            s.passthrough as f64,
        ),
        (
            "sce_population_rate_limit_bytes_per_second",
            "The population rate allowed now (0: unlimited).",
            s.population_rate as f64,
        ),
        (
            "sce_population_workers",
            "Population workers the throttle lets run now.",
            s.active_workers as f64,
        ),
        (
            "sce_inflight_requests",
            "Requests the cached volume is serving now.",
            v.latencies().in_flight.load(Relaxed) as f64,
        ),
    ] {
        f.gauge(name, help, &lp, val);
    }
    let mode = cfg.write_mode.to_string();
    f.gauge(
        "sce_cache_mode_info",
        "The cache mode in force (the value is always 1): writethrough, writethrough-sync, writearound or passthrough.",
        &[("export", export), ("mode", &mode)],
        1.0,
    );
    if let Some(r) = rates.and_then(|r| r.recent(i)) {
        f.gauge(
            "sce_population_bytes_per_second",
            "Bytes populated per second over the last ten seconds.",
            &lp,
            r.population_bytes_per_second,
        );
        f.gauge(
            "sce_recent_read_hit_ratio",
            "Read hit ratio over the last ten seconds.",
            &lp,
            r.read_hit_ratio,
        );
    }
    let lat = v.latencies();
    f.histogram(
        "sce_read_hit_duration_seconds",
        "Time to serve a read entirely from the cache, inside the engine.",
        &lp,
        &lat.read_hit.snapshot(),
    );
    f.histogram(
        "sce_read_miss_duration_seconds",
        "Time to serve a read that went to the source in part or whole, inside the engine.",
        &lp,
        &lat.read_miss.snapshot(),
    );
    f.histogram(
        "sce_write_duration_seconds",
        "Time to acknowledge a write or discard, inside the engine.",
        &lp,
        &lat.write.snapshot(),
    );
    if let Some(p) = v.persist_stats() {
        for (name, help, val) in [
            (
                "sce_persist_intent_syncs_total",
                "Write-intent block writes.",
                p.intent_syncs,
            ),
            (
                "sce_persist_intent_presets_total",
                "Intents set ahead of need.",
                p.intent_presets,
            ),
            (
                "sce_persist_metadata_units_written_total",
                "Metadata units written.",
                p.units_written,
            ),
            (
                "sce_persist_metadata_written_bytes_total",
                "Bytes of metadata written.",
                p.metadata_bytes_written,
            ),
            (
                "sce_persist_metadata_errors_total",
                "Failed metadata writes.",
                p.metadata_errors,
            ),
            (
                "sce_persist_journal_appends_total",
                "Write-journal entries appended.",
                p.journal_appends,
            ),
            (
                "sce_persist_journal_blocks_total",
                "Write-journal blocks written.",
                p.journal_blocks,
            ),
            (
                "sce_persist_journal_written_bytes_total",
                "Bytes of write-journal blocks written.",
                p.journal_bytes,
            ),
            (
                "sce_persist_journal_full_fallbacks_total",
                "Writes that found the journal ring full and fell back to a fragment intent.",
                p.journal_full_fallbacks,
            ),
        ] {
            f.counter(name, help, &lp, val);
        }
        for (name, help, val) in [
            (
                "sce_persist_format_version",
                "Format version of the cache device.",
                p.format_version as f64,
            ),
            (
                "sce_persist_previous_shutdown_clean",
                "1 if the previous stop was clean.",
                p.previous_shutdown_clean as u64 as f64,
            ),
            (
                "sce_persist_last_clean_shutdown_timestamp_seconds",
                "Unix time of the last clean shutdown (0: never).",
                p.last_clean_shutdown as f64,
            ),
            (
                "sce_persist_restored_fragments",
                "Fragments restored at start.",
                p.fragments_restored as f64,
            ),
            (
                "sce_persist_dropped_by_intent_fragments",
                "Fragments dropped at start because a write intent covered them.",
                p.fragments_dropped_intent as f64,
            ),
            (
                "sce_persist_dirty_intents",
                "Fragments whose cached copy a crash now would drop.",
                p.dirty_intents as f64,
            ),
            (
                "sce_persist_load_seconds",
                "Time the start-up load of the cache device took.",
                p.load_millis as f64 / 1e3,
            ),
            (
                "sce_persist_journal_enabled",
                "1 if writes to cached pages are journaled (--crash-journal on).",
                p.journal as u64 as f64,
            ),
            (
                "sce_persist_journal_replayed_blocks",
                "Write-journal blocks replayed at start.",
                p.journal_blocks_replayed as f64,
            ),
            (
                "sce_persist_journal_hit_fragments",
                "Fragments the journal replay touched at start.",
                p.journal_fragments_hit as f64,
            ),
            (
                "sce_persist_journal_dropped_pages",
                "Pages the journal replay dropped at start.",
                p.journal_pages_dropped as f64,
            ),
        ] {
            f.gauge(name, help, &lp, val);
        }
    }
}

/// The Prometheus text of the server's families and every cached export's.
pub fn exposition(server: &Server, volumes: &Volumes, rates: Option<&Rates>) -> String {
    let mut f = Families::default();
    server_families(&mut f, server);
    for (i, (name, v)) in volumes.iter().enumerate() {
        let label = export_label(name);
        let v = v.as_ref().and_then(|a| a.volume());
        f.gauge(
            "sce_export_cached",
            "1 if the export has a cache attached now, 0 if it serves its source alone.",
            &[("export", label)],
            v.is_some() as u64 as f64,
        );
        if let Some(v) = v {
            volume_families(&mut f, label, &v, rates, i);
        }
    }
    let mut out = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&f.into_vec(), &mut out) {
        return format!("# encoding the metrics failed: {e}\n");
    }
    String::from_utf8(out).unwrap_or_default()
}
