//! The metrics endpoint of a server in process, over loopback HTTP: /metrics in the
//! Prometheus text format (a HELP and a TYPE for every family, counters in `_total`, units
//! in the name, an `export` label with `default` for the default export), /stats as JSON
//! (and `fetch_stats`, its client), other paths 404, request heads that are too long 431,
//! and scrapes that are answered while idle or half-sent connections wait.

mod common;
use common::*;
use sce_io::BlockDevice;
use sce_server::metrics::http::MAX_HEAD;
use sce_server::ServeConfig;
use serde_json::json;
use std::collections::BTreeMap;

/// A server of a cached default export "" and an uncached "u", with its metrics endpoint.
fn rig(dir: &std::path::Path) -> Rig {
    let cfg = ServeConfig {
        exports: vec![export(dir, "", true), export(dir, "u", false)],
        ..base_config(dir)
    };
    Rig::start(dir, cfg, true)
}

/// The samples of a Prometheus text, by their name with labels.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap_or_else(|_| panic!("{l}")))
        })
        .collect()
}

#[test]
fn metrics_are_prometheus_text_with_help_type_and_units() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let addr = rig.metrics.clone().unwrap();
    let (code, head, body) = get(&addr, "/metrics");
    assert_eq!(code, 200, "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(
        head.contains(&format!("Content-Length: {}", body.len())),
        "{head}"
    );
    let mut families = 0;
    for l in body.lines().filter(|l| l.starts_with("# TYPE ")) {
        let mut w = l.split_whitespace().skip(2);
        let (name, kind) = (w.next().unwrap(), w.next().unwrap());
        families += 1;
        assert!(name.starts_with("sce_"), "{l}");
        assert!(
            body.contains(&format!("# HELP {name} ")),
            "no HELP for {name}"
        );
        assert_eq!(kind == "counter", name.ends_with("_total"), "{l}");
        for unit in ["_ms", "_millis", "_kib", "_mib"] {
            assert!(!name.contains(unit), "{name}: base units only");
        }
    }
    assert!(families >= 40, "{families} families");
    let s = samples(&body);
    assert_eq!(s["sce_export_cached{export=\"default\"}"], 1.0);
    assert_eq!(s["sce_export_cached{export=\"u\"}"], 0.0);
    assert_eq!(
        s["sce_line_size_bytes{export=\"default\"}"],
        (512 << 10) as f64
    );
    assert_eq!(
        s["sce_fragment_size_bytes{export=\"default\"}"],
        (1 << 20) as f64
    );
    assert!(s["sce_cache_size_bytes{export=\"default\"}"] > 0.0);
    assert!(
        !s.keys().any(|k| k.contains("export=\"\"")),
        "the default export is labelled default"
    );
    assert!(
        !s.keys()
            .any(|k| k.starts_with("sce_line_size_bytes{export=\"u\"")),
        "no cache, no cache families"
    );
    assert_eq!(s["sce_nbd_open_connections"], 0.0);
}

#[test]
fn metrics_follow_what_clients_do() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let addr = rig.metrics.clone().unwrap();
    let before = samples(&get(&addr, "/metrics").2);
    let client = rig.client("");
    let mut b = vec![0u8; 4096];
    for i in 0..4 {
        client.read_at(i * 4096, &mut b).unwrap();
    }
    client.write_at(0, &[1u8; 4096]).unwrap();
    let after = samples(&get(&addr, "/metrics").2);
    let grew = |k: &str| after[k] - before.get(k).copied().unwrap_or(0.0);
    assert_eq!(grew("sce_nbd_connections_total"), 1.0);
    assert!(grew("sce_nbd_requests_total") >= 5.0);
    assert_eq!(after["sce_nbd_open_connections"], 1.0);
    let reads: Vec<_> = after
        .keys()
        .filter(|k| k.starts_with("sce_export_read_requests_total"))
        .collect();
    assert_eq!(reads.len(), 1, "{reads:?}");
    assert_eq!(after[reads[0]], 4.0);
    // Detached: the gauge says so, and the cache's families are gone.
    rig.verb("detach", Some("")).unwrap();
    let s = samples(&get(&addr, "/metrics").2);
    assert_eq!(s["sce_export_cached{export=\"default\"}"], 0.0);
    assert!(!s.contains_key("sce_line_size_bytes{export=\"default\"}"));
}

#[test]
fn stats_is_a_json_document_of_every_export() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let addr = rig.metrics.clone().unwrap();
    let (code, head, body) = get(&addr, "/stats");
    assert_eq!(code, 200);
    assert!(head.contains("Content-Type: application/json"), "{head}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let ex = v["exports"].as_object().unwrap();
    assert_eq!(ex.keys().collect::<Vec<_>>(), ["", "u"]);
    assert_eq!(ex[""]["cached"], json!(true));
    assert_eq!(ex[""]["state"], json!("active"));
    assert_eq!(ex["u"]["cached"], json!(false));
    assert_eq!(ex["u"]["source"]["up"], json!(true));
    assert!(ex[""]["persist_uuid"].is_string(), "{body}");
    rig.client("u").write_at(0, &[1u8; 512]).unwrap();
    let v = sce_server::metrics::fetch_stats(&addr).unwrap();
    assert_eq!(v["connections"], json!(1));
    assert!(v["requests"].as_u64().unwrap() >= 1);
    // What the admin socket's stats says, for the same server.
    let s = rig.verb("stats", None).unwrap();
    assert_eq!(s["exports"].as_object().unwrap().len(), 2);
    assert_eq!(s["connections"], v["connections"]);
}

#[test]
fn other_paths_and_garbage_get_404_and_queries_are_ignored() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let addr = rig.metrics.clone().unwrap();
    let (code, _, body) = get(&addr, "/");
    assert_eq!((code, body.as_str()), (404, "try /metrics or /stats\n"));
    assert_eq!(get(&addr, "/metrics/extra").0, 404);
    assert_eq!(get(&addr, "/Metrics").0, 404);
    let (code, _, body) = get(&addr, "/stats?pretty=1");
    assert_eq!(code, 200);
    assert!(body.starts_with('{'), "{body}");
    assert_eq!(http(&addr, "HELLO\r\n\r\n").0, 404);
    assert_eq!(
        http(&addr, "GET /metrics HTTP/1.1\nHost: x\n\n").0,
        200,
        "bare newlines end a head too"
    );
    // Still serving.
    assert_eq!(get(&addr, "/metrics").0, 200);
}

#[test]
fn a_head_too_long_is_refused_and_the_endpoint_keeps_serving() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let addr = rig.metrics.clone().unwrap();
    let head = format!(
        "GET /metrics HTTP/1.0\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(MAX_HEAD)
    );
    let (code, _, body) = http(&addr, &head);
    assert_eq!(code, 431);
    assert_eq!(body, format!("request head over {MAX_HEAD} bytes\n"));
    // Just under the limit is answered.
    let pad = MAX_HEAD - 64;
    let head = format!("GET /stats HTTP/1.0\r\nX-Pad: {}\r\n\r\n", "a".repeat(pad));
    assert_eq!(http(&addr, &head).0, 200);
}

#[test]
fn idle_and_half_sent_connections_do_not_hold_up_scrapes() {
    use std::io::Write;
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let addr = rig.metrics.clone().unwrap();
    let mut idle = Vec::new();
    for i in 0..20 {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        if i % 2 == 0 {
            c.write_all(b"GET /metr").unwrap();
        }
        idle.push(c);
    }
    for _ in 0..3 {
        assert_eq!(get(&addr, "/metrics").0, 200);
    }
    drop(idle);
    assert_eq!(get(&addr, "/stats").0, 200);
}

#[test]
fn concurrent_scrapes_each_get_a_whole_answer() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let addr = rig.metrics.clone().unwrap();
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let path = if i % 2 == 0 { "/metrics" } else { "/stats" };
                (0..5)
                    .map(|_| {
                        let (code, head, body) = get(&addr, path);
                        let len = format!("Content-Length: {}", body.len());
                        (code, head.contains(&len), body.len() > 100)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for t in threads {
        for r in t.join().unwrap() {
            assert_eq!(r, (200, true, true));
        }
    }
}

#[test]
fn an_address_in_use_is_refused_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let addr = rig.metrics.clone().unwrap();
    let e = sce_server::metrics::metrics_server(
        &addr,
        rig.server.clone(),
        rig.volumes.clone(),
        rig.sources.clone(),
        rig.rates.clone(),
    )
    .unwrap_err();
    assert!(
        text(&e).starts_with(&format!("metrics endpoint {addr}")),
        "{e}"
    );
    let e = sce_server::metrics::fetch_stats("127.0.0.1:1").unwrap_err();
    assert!(text(&e).starts_with("connecting to 127.0.0.1:1"), "{e}");
}

#[test]
fn the_rate_sampler_reports_recent_rates_after_two_samples() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    rig.call(&sce_server::admin::Request {
        offset: Some(0),
        len: Some(2 * MIB),
        ..req("prefetch", Some(""))
    })
    .unwrap();
    wait_until("two rate samples", 60, || rig.rates.recent(0).is_some());
    let r = rig.rates.recent(0).unwrap();
    assert!(r.window_seconds > 0.0, "{r:?}");
    assert!(
        rig.rates.recent(1).is_none(),
        "no rates for an export without a cache"
    );
    let st = rig.verb("status", Some("")).unwrap();
    assert!(
        st["exports"][0]["rates_window_seconds"].as_f64().unwrap() > 0.0,
        "{st}"
    );
    let s = samples(&get(&rig.metrics.clone().unwrap(), "/metrics").2);
    assert!(
        s.keys()
            .any(|k| k.starts_with("sce_") && k.contains("per_second")),
        "a rate gauge"
    );
}

/// Scrapes of /metrics and /stats go on while the cache is detached and attached again and
/// again: each is answered whole, and says the export cached or not, never something else.
#[test]
fn scrapes_during_detach_and_attach_are_each_answered_whole() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Arc;
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let addr = rig.metrics.clone().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let scrapers: Vec<_> = (0..3)
        .map(|k| {
            let (addr, stop) = (addr.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(SeqCst) || n == 0 {
                    if k == 0 {
                        let v = sce_server::metrics::fetch_stats(&addr).unwrap();
                        assert!(v["exports"][""]["cached"].is_boolean(), "{v}");
                    } else {
                        let (code, _, body) = get(&addr, "/metrics");
                        assert_eq!(code, 200);
                        let s = samples(&body);
                        let c = s["sce_export_cached{export=\"default\"}"];
                        assert!(c == 0.0 || c == 1.0, "{c}");
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    for _ in 0..5 {
        rig.verb("detach", Some("")).unwrap();
        rig.verb("attach", Some("")).unwrap();
    }
    stop.store(true, SeqCst);
    let n: u32 = scrapers.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(n >= 3);
    let s = samples(&get(&addr, "/metrics").2);
    assert_eq!(s["sce_export_cached{export=\"default\"}"], 1.0);
}
