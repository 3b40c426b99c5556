//! A dead source as an operator and a client meet it: `sce serve` caching an nbdkit export
//! that is killed and later started again. While it is gone, a read that needs it and a
//! write-through write fail with EIO at the client (qemu-io), the export's state says
//! `degraded` with the reason, `/metrics` says `sce_source_up 0` and counts the errors by
//! kind, and the log says so once; when it is back, the next request works, the state is
//! `active` again and the log says that once too.

mod common;

use std::path::Path;
use std::process::Command;

/// qemu-io's `CMD` against the export on `sock`: (success, stdout and stderr).
fn qemu_io(sock: &Path, cmd: &str) -> (bool, String) {
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", cmd])
        .arg(format!("nbd+unix:///?socket={}", sock.display()))
        .output()
        .expect("run qemu-io");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    // qemu-io exits 0 after a failed command; its output says so.
    (out.status.success() && !text.contains("failed"), text)
}

fn export_status(sock: &Path) -> serde_json::Value {
    let (ok, out) = common::ctl(sock, &["--json", "status"]);
    assert!(ok, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["exports"][0].clone()
}

fn metric(metrics: &str, line_start: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn a_dead_source_is_degraded_in_status_and_metrics_logged_once_and_eio_at_the_client() {
    if !sce_testkit::require_known_tool("nbdkit") || !sce_testkit::require_known_tool("qemu-io") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (ksock, cache, sock) = (
        d.path().join("src.sock"),
        d.path().join("cache"),
        d.path().join("s"),
    );
    let kit = common::nbdkit(&ksock, &["memory", "64M"], true);
    let s = common::Server::start(
        &[
            "--source",
            &kit.uri,
            "--cache",
            cache.to_str().unwrap(),
            "--cache-size",
            "16MiB",
            "--allow-buffered",
        ],
        &sock,
    );
    let (ok, out) = qemu_io(&sock, "read 0 64k");
    assert!(ok, "{out}");
    let st = export_status(&sock);
    assert_eq!(st["state"], "active", "{st}");
    assert_eq!(st["source"]["up"], true, "{st}");
    // The source dies.
    drop(kit);
    let _ = std::fs::remove_file(&ksock);
    for cmd in ["read 32M 64k", "write -P 7 40M 4k", "read 48M 4k"] {
        let (ok, out) = qemu_io(&sock, cmd);
        assert!(!ok, "{cmd} worked with the source gone: {out}");
        assert!(out.contains("Input/output error"), "{cmd}: not EIO: {out}");
    }
    let st = export_status(&sock);
    assert_eq!(st["state"], "degraded", "{st}");
    assert_eq!(st["source"]["up"], false, "{st}");
    assert!(st["source"]["down_since"].as_f64().is_some(), "{st}");
    assert!(
        st["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("source is failing"),
        "{st}"
    );
    let text = Command::new(common::sce_bin())
        .args(["ctl", "-s"])
        .arg(&sock)
        .arg("status")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("degraded") && text.contains("source is failing"),
        "{text}"
    );
    let m = common::http_get(&s.metrics, "/metrics");
    assert_eq!(
        metric(&m, "sce_source_up{export=\"default\"}"),
        Some(0.0),
        "{m}"
    );
    let read_errors = metric(
        &m,
        "sce_source_errors_total{export=\"default\",op=\"read\"}",
    );
    let write_errors = metric(
        &m,
        "sce_source_errors_total{export=\"default\",op=\"write\"}",
    );
    assert!(read_errors.is_some_and(|n| n >= 2.0), "{m}");
    assert!(write_errors.is_some_and(|n| n >= 1.0), "{m}");
    assert!(
        metric(
            &m,
            "sce_source_last_error_timestamp_seconds{export=\"default\"}"
        )
        .is_some_and(|t| t > 1e9),
        "{m}"
    );
    // It comes back (empty: a memory disk), and the next request works.
    let kit = common::nbdkit(&ksock, &["memory", "64M"], true);
    sce_testkit::poll("a read through the source again", 60, || {
        let (ok, out) = qemu_io(&sock, "read 32M 64k");
        ok.then_some(()).ok_or(out)
    });
    let st = export_status(&sock);
    assert_eq!(st["state"], "active", "{st}");
    assert_eq!(st["source"]["up"], true, "{st}");
    assert!(
        st["source"]["last_error"].is_string(),
        "the last error is kept: {st}"
    );
    let m = common::http_get(&s.metrics, "/metrics");
    assert_eq!(
        metric(&m, "sce_source_up{export=\"default\"}"),
        Some(1.0),
        "{m}"
    );
    let log = s.log();
    assert_eq!(log.matches("is failing").count(), 1, "{log}");
    assert_eq!(log.matches("works again").count(), 1, "{log}");
    drop(kit);
    s.kill();
}

/// Page `i` of the source below: its index, then a byte of it repeated.
fn page(i: u64) -> Vec<u8> {
    let mut p = vec![(i as u8) ^ 0xA5; 4096];
    p[..8].copy_from_slice(&i.to_le_bytes());
    p
}

#[test]
fn bad_cache_pages_are_logged_once_then_summarized_and_read_from_the_source() {
    use sce_io::BlockDevice;
    let d = tempfile::tempdir().unwrap();
    let (src, cache, sock) = (
        d.path().join("src"),
        d.path().join("cache"),
        d.path().join("s"),
    );
    let data: Vec<u8> = (0..1024).flat_map(page).collect();
    std::fs::write(&src, &data).unwrap();
    let args = [
        "--source",
        src.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
        "--cache-size",
        "16MiB",
        "--allow-buffered",
    ];
    let s = common::Server::start(&args, &sock);
    let (ok, out) = common::ctl(&sock, &["prefetch", "0", "4MiB"]);
    assert!(ok, "{out}");
    assert!(s.term().success());
    // Four cached pages damaged on the device, where the cache holds them.
    let img = std::fs::read(&cache).unwrap();
    let bad = [10u64, 11, 12, 13];
    for i in bad {
        let at = img
            .chunks(4096)
            .position(|c| c == page(i).as_slice())
            .unwrap_or_else(|| panic!("page {i} is not in the cache")) as u64;
        common::flip_byte(&cache, at * 4096 + 100);
    }
    let s = common::Server::start(&args, &sock);
    let client = common::unix_client(&sock, 1);
    let mut b = vec![0u8; 4096];
    for i in 0..64 {
        client.read_at(i * 4096, &mut b).unwrap();
        assert!(b == page(i), "page {i} read wrong");
    }
    let st = s.export_stats();
    assert_eq!(common::num(&st, "cache_checksum_errors"), 4, "{st}");
    // The export is degraded for a while, and says why; the metrics say when.
    let (ok, out) = common::ctl(&sock, &["--json", "status"]);
    assert!(ok, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let e = &v["exports"][0];
    assert_eq!(e["state"], "degraded", "{e}");
    assert!(
        e["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("cache device returned 4 error(s)"),
        "{e}"
    );
    let m = common::http_get(&s.metrics, "/metrics");
    assert!(
        metric(
            &m,
            "sce_cache_last_error_timestamp_seconds{export=\"default\"}"
        )
        .is_some_and(|t| t > 1e9),
        "{m}"
    );
    let log = s.log();
    assert_eq!(
        log.matches("checksum mismatch of the cached page at source offset")
            .count(),
        1,
        "the first is told, the rest summarized later:\n{log}"
    );
    assert!(
        log.contains("source offset 40960"),
        "the first names its page:\n{log}"
    );
    drop(client);
    assert!(s.term().success());
}
