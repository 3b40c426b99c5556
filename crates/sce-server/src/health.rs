//! An export's source health in status, /stats and /metrics (`sce_io::watch` keeps it).
//! While its source fails, an export's state is `degraded`, with the reason and since when.

use crate::prom::Families;
use std::sync::Arc;

/// A source as its users meet it (up, or failing since when, and its errors by kind).
pub type WatchedSource = Arc<sce_io::WatchedDevice<dyn sce_io::BlockDevice>>;

/// Every export's source health, in the order of [`crate::attach::Volumes`].
pub type Sources = Vec<WatchedSource>;
use sce_io::watch::Health;
use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the epoch.
fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The `source` object of an export's status and /stats.
pub(crate) fn json(h: &Health) -> Value {
    let errors: serde_json::Map<String, Value> = h
        .errors
        .iter()
        .map(|(k, n)| ((*k).into(), (*n).into()))
        .collect();
    json!({
        "up": h.up,
        "down_since": h.down_since.map(unix),
        "down_for_seconds": h.down_since.map(|t| t.elapsed().map_or(0.0, |d| d.as_secs_f64())),
        "outage_failures": h.outage_failures,
        "errors": errors,
        "last_error": h.last_error.as_ref().map(|(_, e)| e.clone()),
        "last_error_time": h.last_error.as_ref().map(|(t, _)| unix(*t)),
    })
}

/// A cache device that returned an error this recently makes its export `degraded`.
const CACHE_ERROR_RECENT: std::time::Duration = std::time::Duration::from_secs(300);

/// The cache device's errors: their count, and the last with its time.
pub(crate) type CacheErrors = (u64, Option<(SystemTime, String)>);

/// Puts the source's health into an export's status object `m`: its `source` object, and
/// the state `degraded` with the reason while the source fails, or while its cache device
/// returned an error in the last five minutes (over a state that says the export serves:
/// `active`, `passthrough`, `uncached`).
pub(crate) fn status(m: &mut Value, h: &Health, att: Option<&Arc<crate::attach::Attachable>>) {
    let cache: Option<CacheErrors> = att.and_then(|a| a.volume()).map(|v| v.cache_errors());
    if let Some((n, Some((at, e)))) = cache {
        let ago = at.elapsed().unwrap_or_default();
        m["cache_last_error"] = json!(e);
        m["cache_last_error_time"] = json!(unix(at));
        if ago < CACHE_ERROR_RECENT && m["state"] == "active" {
            m["state"] = json!("degraded");
            m["state_reason"] = json!(format!(
                "the cache device returned {n} error(s), the last {:.0} s ago: {e}",
                ago.as_secs_f64()
            ));
        }
    }
    m["source"] = json(h);
    let serving = matches!(
        m["state"].as_str(),
        Some("active" | "passthrough" | "uncached" | "degraded")
    );
    if !h.up && serving {
        m["state"] = json!("degraded");
        let e = h.last_error.as_ref().map_or("", |(_, e)| e.as_str());
        m["state_reason"] = json!(format!(
            "the source is failing ({} failed requests since {:.0} s ago): {e}",
            h.outage_failures,
            h.down_since
                .and_then(|t| t.elapsed().ok())
                .map_or(0.0, |d| d.as_secs_f64())
        ));
    }
}

/// The cache device's family of one export: when it last returned an error.
pub(crate) fn cache_families(f: &mut Families, export: &str, v: &sce_engine::CacheVolume) {
    f.gauge(
        "sce_cache_last_error_timestamp_seconds",
        "When the cache device last returned an error (a checksum mismatch, a failed read or write), seconds since the epoch (0: never).",
        &[("export", export)],
        v.cache_errors().1.map_or(0.0, |(t, _)| unix(t)),
    );
}

/// The source's families of one export.
pub(crate) fn families(f: &mut Families, export: &str, h: &Health) {
    let lp = [("export", export)];
    f.gauge(
        "sce_source_up",
        "1 while the export's source answers; 0 from a failed request until one succeeds again.",
        &lp,
        h.up as u64 as f64,
    );
    for (op, n) in h.errors {
        f.counter(
            "sce_source_errors_total",
            "Requests to the source that failed, by operation (the device's failures, not refused requests).",
            &[("export", export), ("op", op)],
            n,
        );
    }
    f.gauge(
        "sce_source_last_error_timestamp_seconds",
        "When a request to the source last failed, seconds since the epoch (0: never).",
        &lp,
        h.last_error.as_ref().map_or(0.0, |(t, _)| unix(*t)),
    );
    f.gauge(
        "sce_source_down_since_timestamp_seconds",
        "When the source's current outage began, seconds since the epoch (0: it is up).",
        &lp,
        h.down_since.map_or(0.0, unix),
    );
}
