//! The Prometheus exposition of /metrics, encoded by the `prometheus` crate (text format
//! 0.0.4): every family has a HELP line and a TYPE, counters end in `_total`, values are in
//! base units (bytes, seconds), and the name says the unit. Each export's samples carry an
//! `export` label; the default export (`""`, which Prometheus would read as no label) is
//! labelled `default`.
//!
//! The values are read at scrape time from the counters the server and the engine keep
//! anyway (atomics); the latency histograms are the engine's own lock-free ones
//! ([`sce_engine::stats::LatencyHistogram`]). The families of the stats structs
//! (`VolumeStats`, `WriteBackStats`, `PersistStats`, `ExportCounters`, shared mode's
//! `Counters`) are the ones their tables define (`sce_core::stats_table!`); `tables`
//! holds the rest.

use crate::attach::{ExportCounters, Volumes};
use crate::health::Sources;
use crate::rates::Rates;

mod tables;
use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, TextEncoder};
use sce_core::stats::{Kind, Stat};
use sce_engine::stats::{LatencySnapshot, LATENCY_BOUNDS_NS};
use sce_engine::{PersistStats, VolumeStats, WriteBackStats};
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
pub(crate) struct Families {
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

    pub(crate) fn counter(&mut self, name: &str, help: &str, lp: &[(&str, &str)], v: u64) {
        self.push(name, help, MetricType::COUNTER, lp, v as f64);
    }

    pub(crate) fn gauge(&mut self, name: &str, help: &str, lp: &[(&str, &str)], v: f64) {
        self.push(name, help, MetricType::GAUGE, lp, v);
    }

    /// Every exported figure of a stats table, read from `t`.
    fn stats<T>(&mut self, table: &[Stat<T>], lp: &[(&str, &str)], t: &T) {
        for s in table {
            if let Some(m) = s.metric {
                let kind = match m.kind {
                    Kind::Counter => MetricType::COUNTER,
                    Kind::Gauge => MetricType::GAUGE,
                };
                self.push(m.name, m.help, kind, lp, s.metric_value(t));
            }
        }
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
    f.gauge(
        "sce_build_info",
        "The version of sce serving (the value is always 1).",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1.0,
    );
    for (name, help, get) in tables::SERVER_COUNTERS {
        f.counter(name, help, &[], get(s));
    }
    for (name, help, get) in tables::SERVER_GAUGES {
        f.gauge(name, help, &[], get(s) as f64);
    }
}

/// One cached export's families.
fn volume_families(
    f: &mut Families,
    export: &str,
    (v, a): (&sce_engine::CacheVolume, &crate::attach::Attachable),
    rates: Option<&Rates>,
    i: usize,
) {
    let lp = [("export", export)];
    // Detached since `v` was taken: nothing of it this scrape.
    let Some(stats) = a.stats() else {
        return;
    };
    let view = tables::View {
        stats,
        config: v.config(),
        in_flight: v.latencies().in_flight.load(Relaxed),
    };
    f.stats(VolumeStats::STATS, &lp, &view.stats);
    for (name, help, get) in tables::VOLUME_GAUGES {
        f.gauge(name, help, &lp, get(&view));
    }
    let wb = v.writeback_stats();
    if let Some(w) = &wb {
        f.stats(WriteBackStats::STATS, &lp, w);
    }
    crate::health::cache_families(f, export, v);
    let mode = view.config.write_mode.to_string();
    f.gauge(
        "sce_cache_mode_info",
        "The cache mode in force (the value is always 1): writethrough, writethrough-sync, writearound, writeback or passthrough.",
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
        if let Some(w) = &wb {
            cleaning_families(f, &lp, w, &r);
        }
    }
    let lat = v.latencies();
    for (name, help, h) in [
        (
            "sce_read_hit_duration_seconds",
            "Time to serve a read entirely from the cache, inside the engine.",
            &lat.read_hit,
        ),
        (
            "sce_read_miss_duration_seconds",
            "Time to serve a read that went to the source in part or whole, inside the engine.",
            &lat.read_miss,
        ),
        (
            "sce_write_duration_seconds",
            "Time to acknowledge a write or discard, inside the engine.",
            &lat.write,
        ),
    ] {
        f.histogram(name, help, &lp, &h.snapshot());
    }
    if let Some(p) = v.persist_stats() {
        f.stats(PersistStats::STATS, &lp, &p);
    }
}

/// Write-back's cleaning rate over the sampled window, and the time the dirty data would
/// take at that pace (absent while nothing is cleaned).
fn cleaning_families(
    f: &mut Families,
    lp: &[(&str, &str)],
    w: &WriteBackStats,
    r: &crate::rates::Recent,
) {
    f.gauge(
        "sce_writeback_cleaned_bytes_per_second",
        "Bytes of write-back data the cleaner wrote to the source per second, over the last ten seconds.",
        lp,
        r.cleaned_bytes_per_second,
    );
    if r.cleaned_bytes_per_second > 0.0 {
        f.gauge(
            "sce_writeback_clean_eta_seconds",
            "Seconds the dirty data would take to clean at the last ten seconds' cleaning rate (absent while nothing is cleaned).",
            lp,
            w.dirty_bytes as f64 / r.cleaned_bytes_per_second,
        );
    }
}

/// A cached export's own families: where exports share a cache device, the volume's
/// families above are the device's (the same for each of them), and these are the export's.
fn export_families(f: &mut Families, export: &str, a: &crate::attach::Attachable) {
    let lp = [("export", export)];
    f.stats(ExportCounters::STATS, &lp, &a.counters);
    f.gauge(
        "sce_export_cached_bytes",
        "Bytes of this export the cache holds now.",
        &lp,
        a.cached_bytes() as f64,
    );
    if let Some(d) = a.dirty_bytes() {
        f.gauge(
            "sce_export_dirty_bytes",
            "Bytes of this export only the cache holds now (write-back data not yet on the source).",
            &lp,
            d as f64,
        );
    }
}

/// The Prometheus text of the server's families and every cached export's.
pub fn exposition(
    server: &Server,
    volumes: &Volumes,
    sources: &Sources,
    rates: Option<&Rates>,
) -> String {
    let mut f = Families::default();
    server_families(&mut f, server);
    for (i, (name, v)) in volumes.iter().enumerate() {
        let label = export_label(name);
        if let Some(s) = sources.get(i) {
            crate::health::families(&mut f, label, &s.health());
        }
        let v = v.as_ref().and_then(|a| a.volume());
        f.gauge(
            "sce_export_cached",
            "1 if the export has a cache attached now, 0 if it serves its source alone.",
            &[("export", label)],
            v.is_some() as u64 as f64,
        );
        if let (Some(v), Some(a)) = (v, volumes[i].1.as_ref()) {
            volume_families(&mut f, label, (&v, a), rates, i);
            export_families(&mut f, label, a);
            if let Some(c) = crate::coherent::of(a) {
                shared_families(&mut f, label, &c);
            }
        }
    }
    let mut out = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&f.into_vec(), &mut out) {
        return format!("# encoding the metrics failed: {e}\n");
    }
    String::from_utf8(out).unwrap_or_default()
}

/// Shared mode's families of one export (issue 16).
fn shared_families(f: &mut Families, export: &str, c: &crate::coherent::Coherence) {
    use std::sync::atomic::Ordering::SeqCst;
    let lp = [("export", export)];
    f.gauge(
        "sce_shared_serving_hits",
        "1 while this host may serve hits of the shared volume (lease valid, invalidations processed); 0: reads pass through to the source.",
        &lp,
        c.serving() as u64 as f64,
    );
    let k = &c.counters;
    f.stats(crate::coherent::Counters::STATS, &lp, k);
    f.counter(
        "sce_shared_publish_seconds_total",
        "Seconds writes spent publishing their invalidation and waiting for the other hosts.",
        &lp,
        k.publish_ns.load(SeqCst) / 1_000_000_000,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use sce_core::stats::Metric;

    fn metrics<T>(table: &[Stat<T>]) -> impl Iterator<Item = Metric> + '_ {
        table.iter().filter_map(|s| s.metric)
    }

    /// Every family the stats tables define follows the naming rules of /metrics (`sce_`,
    /// counters and only they end in `_total`, the unit named last, a HELP text), and no
    /// name is defined twice, here or in `tables`.
    #[test]
    fn table_families_follow_the_naming_rules() {
        let all: Vec<Metric> = metrics(VolumeStats::STATS)
            .chain(metrics(WriteBackStats::STATS))
            .chain(metrics(PersistStats::STATS))
            .chain(metrics(ExportCounters::STATS))
            .chain(metrics(crate::coherent::Counters::STATS))
            .collect();
        assert!(all.len() >= 65, "{}", all.len());
        let mut names: Vec<&str> = all.iter().map(|m| m.name).collect();
        for m in &all {
            assert!(m.name.starts_with("sce_"), "{}", m.name);
            assert!(!m.help.is_empty(), "{}", m.name);
            let base = m.name.strip_suffix("_total");
            assert_eq!(base.is_some(), m.kind == Kind::Counter, "{}", m.name);
            let base = base.unwrap_or(m.name);
            if m.unit.is_empty() {
                for unit in ["_bytes", "_seconds", "_per_second"] {
                    assert!(!base.ends_with(unit), "{} names no unit", m.name);
                }
            } else {
                assert!(base.ends_with(&format!("_{}", m.unit)), "{}", m.name);
            }
        }
        names.extend(tables::SERVER_COUNTERS.iter().map(|f| f.0));
        names.extend(tables::SERVER_GAUGES.iter().map(|f| f.0));
        names.extend(tables::VOLUME_GAUGES.iter().map(|f| f.0));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a family name is defined twice");
    }

    /// The JSON names of each table are distinct.
    #[test]
    fn json_names_are_distinct() {
        fn keys<T>(t: &[Stat<T>]) -> Vec<&'static str> {
            let mut k: Vec<_> = t.iter().map(|s| s.key).collect();
            k.sort_unstable();
            k.dedup();
            assert_eq!(k.len(), t.len());
            k
        }
        assert_eq!(keys(VolumeStats::STATS).len(), 38);
        assert!(keys(WriteBackStats::STATS).contains(&"cleaned_bytes"));
        assert!(keys(PersistStats::STATS).contains(&"load_millis"));
        keys(ExportCounters::STATS);
        keys(crate::coherent::Counters::STATS);
    }
}
