//! The metrics endpoint: a small HTTP server that answers /metrics (Prometheus text) and
//! /stats (a JSON document) with the server's counters and every export's, and the client
//! of /stats (`sce stats`).

pub mod http;

use crate::attach::Volumes;
use crate::health::Sources;
use crate::rates::Rates;
use anyhow::{anyhow, Context, Result};
use sce_engine::{PersistStats, VolumeStats, WriteBackStats};
use sce_nbd::Server;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Prometheus text of every export's counters and the server's (see [`crate::prom`]).
pub fn prometheus(
    server: &Server,
    volumes: &Volumes,
    sources: &Sources,
    rates: Option<&Rates>,
) -> String {
    crate::prom::exposition(server, volumes, sources, rates)
}

/// The /stats document: the server's counters and every export's.
pub fn stats_json(server: &Server, volumes: &Volumes, sources: &Sources) -> serde_json::Value {
    let s = server.stats();
    let mut exports = serde_json::Map::new();
    for (i, (name, v)) in volumes.iter().enumerate() {
        let mut m = serde_json::Map::new();
        if let Some(src) = sources.get(i) {
            m.insert("source".into(), crate::health::json(&src.health()));
        }
        if let Some(c) = v.as_ref().and_then(crate::coherent::of) {
            m.insert("shared".into(), c.status());
        }
        let av = v.as_ref().and_then(|a| Some((a, a.volume()?)));
        m.insert("cached".into(), av.is_some().into());
        if let Some((a, v)) = av {
            let st = a.stats().unwrap_or_else(|| v.stats());
            let state = if v.is_passthrough() {
                "passthrough"
            } else {
                "active"
            };
            m.insert("state".into(), state.into());
            for s in VolumeStats::STATS {
                m.insert(s.key.into(), s.value(&st).into());
            }
            m.insert("read_hit_ratio".into(), st.read_hit_ratio().into());
            if let Some(p) = v.persist_stats() {
                for s in PersistStats::STATS {
                    m.insert(format!("persist_{}", s.key), s.value(&p).into());
                }
                m.insert("persist_uuid".into(), p.uuid.clone().into());
            } else {
                m.insert("persist_format_version".into(), serde_json::Value::Null);
            }
            if let Some(w) = v.writeback_stats() {
                for s in WriteBackStats::STATS {
                    m.insert(format!("writeback_{}", s.key), s.value(&w).into());
                }
            }
        }
        exports.insert(name.clone(), m.into());
    }
    serde_json::json!({
        "connections": s.connections.load(Relaxed),
        "open_connections": s.open_connections.load(Relaxed),
        "requests": s.requests.load(Relaxed),
        "request_errors": s.request_errors.load(Relaxed),
        "protocol_errors": s.protocol_errors.load(Relaxed),
        "refused_connections": s.refused_connections.load(Relaxed),
        "handshake_timeouts": s.handshake_timeouts.load(Relaxed),
        "request_timeouts": s.request_timeouts.load(Relaxed),
        "idle_timeouts": s.idle_timeouts.load(Relaxed),
        "reply_timeouts": s.reply_timeouts.load(Relaxed),
        "inflight_bytes": s.inflight_bytes.load(Relaxed),
        "exports": exports,
    })
}

/// Serves /metrics and /stats at `addr` (HOST:PORT) for as long as the process runs (see
/// [`http`] for its bounds). Returns the address bound (with the port chosen if `addr`
/// gave 0).
pub fn metrics_server(
    addr: &str,
    server: Arc<Server>,
    volumes: Arc<Volumes>,
    sources: Arc<Sources>,
    rates: Arc<Rates>,
) -> Result<String> {
    let l = TcpListener::bind(addr).with_context(|| format!("metrics endpoint {addr}"))?;
    let local = l.local_addr()?.to_string();
    let handler = move |path: &str| -> http::Response {
        match path {
            "/metrics" => (
                "200 OK",
                "text/plain; version=0.0.4",
                prometheus(&server, &volumes, &sources, Some(&rates)),
            ),
            "/stats" => (
                "200 OK",
                "application/json",
                stats_json(&server, &volumes, &sources).to_string(),
            ),
            _ => (
                "404 Not Found",
                "text/plain",
                "try /metrics or /stats\n".into(),
            ),
        }
    };
    http::serve(l, Arc::new(handler)).context("starting the metrics endpoint")?;
    Ok(local)
}

/// Fetches the /stats document of a running server's metrics endpoint (HOST:PORT).
pub fn fetch_stats(addr: &str) -> Result<serde_json::Value> {
    let mut c = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    write!(c, "GET /stats HTTP/1.0\r\n\r\n")?;
    let mut resp = String::new();
    c.read_to_string(&mut resp)?;
    let body = resp
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .ok_or_else(|| anyhow!("bad HTTP response"))?;
    serde_json::from_str(body).context("bad stats document")
}

/// Write-back's part of an export's status: what is dirty or lost, cleaning, and the state
/// `degraded-lost-data` when dirty data's only copy went bad (reads of it fail); with the
/// export's `recent` rates, how fast the cleaner goes now and how long the dirty data would
/// take at that pace (none while it is not cleaning).
pub(crate) fn writeback_status(
    m: &mut serde_json::Value,
    v: &sce_engine::CacheVolume,
    recent: Option<crate::rates::Recent>,
) {
    let Some(w) = v.writeback_stats() else { return };
    if w.lost_bytes > 0 {
        m["state"] = serde_json::json!("degraded-lost-data");
    }
    let mut wb: serde_json::Map<_, _> = (WriteBackStats::STATS.iter())
        .map(|s| (s.key.to_string(), s.value(&w).into()))
        .collect();
    if let Some(r) = recent {
        let rate = r.cleaned_bytes_per_second;
        wb.insert("cleaned_bytes_per_second".into(), rate.into());
        if rate > 0.0 {
            wb.insert(
                "clean_eta_seconds".into(),
                (w.dirty_bytes as f64 / rate).into(),
            );
        }
    }
    wb.insert("last_clean_error".into(), w.last_clean_error.into());
    let t = v.config().writeback;
    wb.insert("low_watermark".into(), t.low_watermark.into());
    wb.insert("high_watermark".into(), t.high_watermark.into());
    wb.insert("rate_bytes_per_second".into(), t.rate.into());
    m["writeback"] = wb.into();
}
