//! `sce ctl` against a live `sce serve`: every verb, under an fio verify load on another
//! connection (zero verify errors), then each verb's effect on a quiet server, and bad input.
//! fio missing: the test skips, or fails under `CI=true` (`sce_testkit`).

mod common;

use common::Server;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

/// `sce ctl -s SOCK ARGS`: (success, stdout, stderr).
fn ctl(sock: &Path, args: &[&str]) -> (bool, String, String) {
    let out = common::ctl_output(sock, args);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// `sce ctl -s SOCK --json ARGS`, which must succeed: its JSON.
fn ctl_json(sock: &Path, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let (ok, out, err) = ctl(sock, &a);
    assert!(ok, "sce ctl {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

fn cached_bytes(sock: &Path, off: &str, len: &str) -> u64 {
    ctl_json(sock, &["exists", off, len])["cached_bytes"]
        .as_u64()
        .unwrap()
}

fn serve(d: &Path) -> (Server, std::path::PathBuf) {
    common::sized_file(&d.join("src"), 64 << 20);
    restart(d)
}

/// `serve` over the source and cache `d` holds already.
fn restart(d: &Path) -> (Server, std::path::PathBuf) {
    let src = d.join("src");
    let sock = d.join("s.sock");
    let s = Server::start(
        &[
            "--source",
            src.to_str().unwrap(),
            "--cache",
            d.join("cache").to_str().unwrap(),
            "--cache-size",
            "16MiB",
            "--fragment-size",
            "256KiB",
            "--state-dir",
            d.to_str().unwrap(),
        ],
        &sock,
    );
    (s, sock)
}

#[test]
fn every_verb_under_fio_verify_load() {
    if !sce_testkit::require_known_tool("fio") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (server, sock) = serve(d.path());
    assert!(
        d.path().join("s.sock.ctl").exists(),
        "admin socket next to the data socket"
    );
    let done = Arc::new(AtomicBool::new(false));
    let (dn, sk) = (done.clone(), sock.clone());
    // The operator's hand: every verb, in turn, for as long as fio runs.
    let operator = std::thread::spawn(move || {
        let verbs: [&[&str]; 19] = [
            &["status"],
            &["stats"],
            &["exists", "0", "64MiB"],
            &["detach", ""],
            &["status"],
            &["attach", ""],
            &["evict", "0", "64MiB"],
            &["set", "", "mode", "writearound"],
            &["prefetch", "0", "4MiB"],
            &["set", "", "mode", "passthrough"],
            &["evict", "1MiB", "3MiB"],
            &["set", "", "mode", "writethrough-sync"],
            &["set", "", "admission", "always"],
            &["forget", ""],
            &["set", "", "admission", "sce"],
            &["set", "", "mode", "writethrough"],
            &["detach", ""],
            &["attach", ""],
            &["flush"],
        ];
        let mut rounds = 0;
        while !dn.load(Relaxed) {
            for v in verbs {
                let (ok, _, err) = ctl(&sk, v);
                assert!(ok, "sce ctl {v:?}: {err}");
            }
            rounds += 1;
        }
        rounds
    });
    common::fio_verify_rounds(d.path(), &sock);
    done.store(true, Relaxed);
    let rounds = operator.join().unwrap();
    assert!(rounds >= 1, "every verb ran at least once under load");
    eprintln!("{rounds} rounds of every verb under fio verify");
    let st = server.export_stats();
    assert_eq!(common::num(&st, "cache_checksum_errors"), 0);
    assert!(server.term().success());
}

/// Detach releases a clean cache device while the export serves on; attach brings it back
/// warm (the first reads hit), less the ranges written while detached (cold past the bound
/// of ranges kept), and then never serves the old bytes.
#[test]
fn detach_and_attach() {
    let d = tempfile::tempdir().unwrap();
    let (server, sock) = serve(d.path());
    let cache = d.path().join("cache");
    let p = ctl_json(&sock, &["prefetch", "0", "4MiB"]);
    assert_eq!(p["cached_bytes"], 4 << 20);
    let det = ctl_json(&sock, &["detach", ""]);
    assert_eq!(det["left_clean"], true, "{det}");
    assert_eq!(
        ctl_json(&sock, &["status"])["exports"][0]["state"],
        "detached"
    );
    // Released and clean: `sce check` takes the device while the server runs.
    let chk = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["check", cache.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    assert!(
        chk.status.success(),
        "{}",
        String::from_utf8_lossy(&chk.stderr)
    );
    let c: serde_json::Value = serde_json::from_slice(&chk.stdout).unwrap();
    assert_eq!(c["superblock"]["state"], "clean", "{c}");
    // The export serves on, from the source.
    let client = common::unix_client(&sock, 1);
    let mut b = vec![0u8; 65536];
    sce_io::BlockDevice::read_at(&client, 0, &mut b).unwrap();
    // Refused while detached, with the reason.
    for (args, says) in [
        (&["detach", ""][..], "detached already"),
        (&["exists", "0", "1MiB"], "detached"),
    ] {
        let (ok, _, err) = ctl(&sock, args);
        assert!(!ok && err.contains(says), "{args:?}: {err}");
    }
    // Warm again: what was cached is restored, and reads of it hit.
    let att = ctl_json(&sock, &["attach", ""]);
    assert_eq!(att["warm"], true, "{att}");
    assert_eq!(att["fragments_restored"], 16, "{att}"); // 4 MiB of 256 KiB fragments
    let (ok, _, err) = ctl(&sock, &["attach", ""]);
    assert!(!ok && err.contains("attached already"), "{err}");
    let hits = |s: &Server| common::num(&s.export_stats(), "read_pages_hit");
    let before = hits(&server);
    sce_io::BlockDevice::read_at(&client, 1 << 20, &mut b).unwrap();
    assert_eq!(
        hits(&server) - before,
        16,
        "the first read after attach hits"
    );
    // A write while detached: the next attach drops what it changed and keeps the rest warm;
    // the new bytes are read.
    ctl_json(&sock, &["detach", ""]);
    let new = vec![0x5au8; 65536];
    sce_io::BlockDevice::write_at(&client, 1 << 20, &new).unwrap();
    let att = ctl_json(&sock, &["attach", ""]);
    assert_eq!(att["warm"], true, "{att}");
    assert_eq!(cached_bytes(&sock, "0", "4MiB"), (4 << 20) - 65536);
    sce_io::BlockDevice::read_at(&client, 1 << 20, &mut b).unwrap();
    assert_eq!(b, new);
    let before = hits(&server);
    sce_io::BlockDevice::read_at(&client, 2 << 20, &mut b).unwrap();
    assert_eq!(hits(&server) - before, 16, "the untouched data stays warm");
    // Writes over more ranges than are kept: cold, and said why.
    ctl_json(&sock, &["detach", ""]);
    let page = vec![0xc3u8; 4096];
    for i in 0..4097u64 {
        sce_io::BlockDevice::write_at(&client, (8 << 20) + i * 8192, &page).unwrap();
    }
    let att = ctl_json(&sock, &["attach", ""]);
    assert_eq!(att["warm"], false, "{att}");
    assert!(
        att["cold_because"]
            .as_str()
            .unwrap()
            .contains("more ranges than are kept"),
        "{att}"
    );
    assert_eq!(cached_bytes(&sock, "0", "4MiB"), 0);
    sce_io::BlockDevice::read_at(&client, 1 << 20, &mut b).unwrap();
    assert_eq!(b, new);
    drop(client);
    assert!(server.term().success());
}

#[test]
fn each_verb_does_what_it_says() {
    let d = tempfile::tempdir().unwrap();
    let (server, sock) = serve(d.path());
    // The data socket is taken for the admin socket next to it.
    let st = ctl_json(&sock, &["status"]);
    let e = &st["exports"][0];
    assert_eq!(e["mode"], "writethrough");
    assert_eq!(e["state"], "active");
    assert_eq!(e["fragment_size_bytes"], 256 << 10);
    // prefetch fills, exists sees it, evict drops it.
    let p = ctl_json(&sock, &["prefetch", "1MiB", "2MiB"]);
    assert_eq!(p["cached_bytes"], 2 << 20, "{p}");
    assert!(p["short_because"].is_null(), "{p}");
    assert_eq!(cached_bytes(&sock, "1MiB", "2MiB"), 2 << 20);
    assert_eq!(cached_bytes(&sock, "8MiB", "1MiB"), 0);
    let ev = ctl_json(&sock, &["evict", "1MiB", "1MiB"]);
    assert_eq!(ev["evicted_bytes"], 1 << 20);
    assert_eq!(cached_bytes(&sock, "1MiB", "2MiB"), 1 << 20);
    // passthrough: prefetch fetches nothing, status says so; the cache stays for later.
    ctl_json(&sock, &["set", "", "mode", "passthrough"]);
    assert_eq!(
        ctl_json(&sock, &["status"])["exports"][0]["state"],
        "passthrough"
    );
    let p = ctl_json(&sock, &["prefetch", "8MiB", "1MiB"]);
    assert_eq!(p["fetched_bytes"], 0, "{p}");
    let why = p["short_because"].as_str().unwrap_or_default();
    assert!(
        why.contains("passthrough"),
        "a short prefetch says why: {p}"
    );
    assert_eq!(cached_bytes(&sock, "2MiB", "1MiB"), 1 << 20);
    ctl_json(&sock, &["set", "", "mode", "writethrough"]);
    // More than the cache holds (16 MiB): fetched in part, and why.
    let (ok, out, err) = ctl(&sock, &["prefetch", "0", "64MiB"]);
    assert!(ok && out.contains("larger than the cache"), "{out}{err}");
    // set: every key, and the reply shows the settings in force.
    let s = ctl_json(&sock, &["set", "", "admission", "nhit:2"]);
    assert_eq!(s["admission"], "nhit:2");
    let s = ctl_json(&sock, &["set", "", "seq-cutoff", "8MiB"]);
    assert_eq!(s["sequential_cutoff_bytes"], 8 << 20);
    let s = ctl_json(&sock, &["set", "", "population-rate", "64MiB"]);
    assert_eq!(s["population_rate_bytes_per_second"], 64 << 20);
    assert_eq!(s["population_rate_adaptive"], false);
    // forget drops everything.
    let f = ctl_json(&sock, &["forget", ""]);
    assert!(f["fragments_dropped"].as_u64().unwrap() >= 4, "{f}");
    assert_eq!(cached_bytes(&sock, "0", "64MiB"), 0);
    // flush and stats.
    assert_eq!(ctl_json(&sock, &["flush"])["flushed"][0], "");
    let stats = ctl_json(&sock, &["stats", ""]);
    assert!(
        stats["exports"][""]["fragments_populated"]
            .as_u64()
            .unwrap()
            >= 8
    );
    // Human output: aligned, with sizes in units.
    let (ok, out, _) = ctl(&sock, &["status"]);
    assert!(
        ok && out.contains("occupancy") && out.contains("MiB"),
        "{out}"
    );
    let (ok, out, _) = ctl(&sock, &["stats", "--watch", "0.2", "--count", "2"]);
    assert!(ok, "{out}");
    assert_eq!(out.matches("read hit ratio").count(), 2, "{out}");
    assert!(out.contains("/s"), "the second print has rates: {out}");
    // Bad input: a clear error, exit 1, and the server serves on.
    for (args, says) in [
        (&["set", "nope", "mode", "passthrough"][..], "no export"),
        (&["set", "", "mode", "writebehind"], "unknown mode"),
        (&["set", "", "fragment-size", "1MiB"], "cannot set"),
        (&["evict", "60MiB", "8MiB"], "out of range"),
        (&["exists", "0", "65MiB"], "out of range"),
    ] {
        let (ok, _, err) = ctl(&sock, args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.to_lowercase().contains(says), "{args:?}: {err}");
    }
    let (ok, _, err) = ctl(&d.path().join("nothing.sock"), &["status"]);
    assert!(!ok && err.contains("admin socket"), "{err}");
    // Malformed requests on the socket itself.
    use std::io::{BufRead, BufReader, Write};
    let c = std::os::unix::net::UnixStream::connect(d.path().join("s.sock.ctl")).unwrap();
    writeln!(&c, "this is not json").unwrap();
    writeln!(&c, r#"{{"verb":"evict"}}"#).unwrap();
    let mut r = BufReader::new(&c);
    for want in ["bad request", "needs an offset"] {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(
            line.contains("\"ok\":false") && line.contains(want),
            "{line}"
        );
    }
    assert_eq!(
        ctl_json(&sock, &["status"])["exports"][0]["state"],
        "active"
    );
    assert!(server.term().success());
    assert!(
        !d.path().join("s.sock.ctl").exists(),
        "the admin socket is removed at shutdown"
    );
}

/// The default geometry (1 MiB fragments of heat over 512 KiB lines) survives a restart
/// without sizes, and a device formatted with other slots keeps them as whole fragments, as
/// every device was served before lines (the core shards stripe by the heat size, so a
/// restart that changed it could not place the records).
#[test]
fn a_restart_keeps_the_devices_geometry() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    common::sized_file(&src, 64 << 20);
    let geometry = |cache: &str, more: &[&str]| {
        let sock = d.path().join(format!("{cache}.sock"));
        let mut args = vec![
            "--source",
            src.to_str().unwrap(),
            "--cache-size",
            "16MiB",
            "--state-dir",
            d.path().to_str().unwrap(),
        ];
        let path = d.path().join(cache);
        args.extend_from_slice(&["--cache", path.to_str().unwrap()]);
        args.extend_from_slice(more);
        let server = Server::start(&args, &sock);
        let e = ctl_json(&sock, &["status"])["exports"][0].clone();
        assert!(server.term().success());
        (
            e["line_size_bytes"].clone(),
            e["fragment_size_bytes"].clone(),
        )
    };
    let lines = (serde_json::json!(512 << 10), serde_json::json!(1 << 20));
    assert_eq!(geometry("default", &[]), lines, "a blank device");
    assert_eq!(geometry("default", &[]), lines, "restarted");
    let whole = (serde_json::json!(256 << 10), serde_json::json!(256 << 10));
    assert_eq!(geometry("small", &["--fragment-size", "256KiB"]), whole);
    assert_eq!(geometry("small", &[]), whole, "restarted without a size");
}

/// Counters are the server's life's, whatever reopens the volume: a detach and attach and
/// two mode switches (into write-back and out, each a reopen) leave every counter at least
/// where it was, in /stats and in /metrics, and `forget` counts as forgotten, not evicted.
#[test]
fn counters_survive_detach_attach_and_mode_switches_and_forget_is_not_eviction() {
    use sce_io::BlockDevice;
    let d = tempfile::tempdir().unwrap();
    let (server, sock) = serve(d.path());
    ctl_json(&sock, &["prefetch", "0", "4MiB"]);
    let client = common::unix_client(&sock, 1);
    let mut b = vec![0u8; 1 << 20];
    for i in 0..4 {
        client.read_at(i << 20, &mut b).unwrap();
    }
    let counters = |what: &str| {
        let st = server.export_stats();
        let m = common::http_get(&server.metrics, "/metrics");
        let metric = m
            .lines()
            .find(|l| l.starts_with("sce_read_hit_pages_total{"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{what}: no sce_read_hit_pages_total in\n{m}"));
        let hit = common::num(&st, "read_pages_hit");
        assert_eq!(metric as u64, hit, "{what}: /metrics and /stats differ");
        (hit, common::num(&st, "read_requests"), st)
    };
    let (hit0, req0, _) = counters("before");
    assert!(hit0 >= 1024, "{hit0} pages hit");
    let steps: [&[&str]; 4] = [
        &["detach", ""],
        &["attach", ""],
        &["set", "", "mode", "writeback"],
        &["set", "", "mode", "writethrough"],
    ];
    let mut last = (hit0, req0);
    for step in steps {
        ctl_json(&sock, step);
        if step[0] == "detach" {
            continue;
        }
        let (hit, req, st) = counters(&format!("after {step:?}"));
        assert!(
            hit >= last.0 && req >= last.1,
            "{step:?}: counters went back from {last:?} to {:?}: {st}",
            (hit, req)
        );
        last = (hit, req);
        // The volume is new: the same reads hit again (it restored what it held), on top.
        client.read_at(0, &mut b).unwrap();
    }
    let status = ctl_json(&sock, &["status"]);
    let ratio = status["exports"][0]["read_hit_ratio"].as_f64().unwrap();
    assert!(
        ratio > 0.5,
        "the hit ratio since start counts the hits before: {status}"
    );
    let (_, _, before) = counters("before forget");
    let f = ctl_json(&sock, &["forget", ""]);
    let (_, _, after) = counters("after forget");
    let forgotten = common::num(&after, "fragments_forgotten");
    assert!(forgotten > 0, "{f}\n{after}");
    assert_eq!(
        common::num(&after, "fragments_evicted"),
        common::num(&before, "fragments_evicted"),
        "forget counted as evictions: {after}"
    );
    drop(client);
    assert!(server.term().success());
}

/// A SIGKILL while detached, after writes: the device keeps its "detached" mark, so the
/// restart trusts nothing of it, and the written range reads the new bytes.
#[test]
fn a_kill_while_detached_after_writes_never_serves_the_old_bytes() {
    use sce_io::BlockDevice;
    let d = tempfile::tempdir().unwrap();
    let (server, sock) = serve(d.path());
    ctl_json(&sock, &["prefetch", "0", "4MiB"]);
    ctl_json(&sock, &["detach", ""]);
    let client = common::unix_client(&sock, 1);
    let new = vec![0x77u8; 65536];
    client.write_at(1 << 20, &new).unwrap();
    drop(client);
    server.kill();
    let (server, sock) = restart(d.path());
    let st = ctl_json(&sock, &["status"]);
    assert_eq!(st["exports"][0]["state"], "active", "{st}");
    // Nothing of the written range is trusted (checked before a read: a miss in an empty
    // cache fills it, from the source's new bytes).
    assert_eq!(cached_bytes(&sock, "1MiB", "64KiB"), 0, "{st}");
    let client = common::unix_client(&sock, 1);
    let mut b = vec![0u8; 65536];
    client.read_at(1 << 20, &mut b).unwrap();
    let first_new = b.iter().position(|&x| x == 0x77);
    assert!(
        b == new,
        "the write made while detached: old bytes up to {first_new:?}; status {st}; log:\n{}",
        server.log()
    );
    assert!(
        server.log().contains("detached from the source"),
        "the start says why it trusts nothing:\n{}",
        server.log()
    );
    drop(client);
    assert!(server.term().success());
}

/// Every verb names an export the same way: `--export NAME`, or by default the only export
/// (verbs that took it first keep taking it so: `detach ""`, `set "" mode ...`).
#[test]
fn every_verb_takes_the_export_by_flag_or_by_default() {
    let d = tempfile::tempdir().unwrap();
    let (server, sock) = serve(d.path());
    // Detach and attach in turn, so that each finds the export as it needs it.
    let verbs: [&[&str]; 10] = [
        &["status"],
        &["stats"],
        &["flush"],
        &["exists", "0", "1MiB"],
        &["prefetch", "0", "1MiB"],
        &["evict", "0", "1MiB"],
        &["forget"],
        &["set", "mode", "writearound"],
        &["detach"],
        &["attach"],
    ];
    for how in ["default", "flag", "position"] {
        for v in verbs {
            let mut args: Vec<&str> = v.to_vec();
            match how {
                "flag" => args.extend(["--export", ""]),
                // The verbs that took the export first.
                "position"
                    if [
                        "forget", "set", "detach", "attach", "status", "stats", "flush",
                    ]
                    .contains(&v[0]) =>
                {
                    args.insert(1, "")
                }
                _ => {}
            }
            let (ok, _, err) = ctl(&sock, &args);
            assert!(ok, "sce ctl {args:?}: {err}");
        }
    }
    // The old forms still work, and `attach --export NAME CACHE` takes the cache.
    ctl_json(&sock, &["set", "", "mode", "writethrough"]);
    ctl_json(&sock, &["detach", ""]);
    let cache = d.path().join("cache");
    ctl_json(&sock, &["attach", "--export", "", cache.to_str().unwrap()]);
    let (ok, _, err) = ctl(
        &sock,
        &["set", "other", "mode", "writearound", "--export", ""],
    );
    assert!(!ok && err.contains("named twice"), "{err}");
    let st = ctl_json(&sock, &["status"]);
    assert_eq!(st["exports"][0]["mode"], "writethrough", "{st}");
    // A name that is not an export is refused, by flag as by position.
    for args in [&["forget", "--export", "nope"][..], &["forget", "nope"]] {
        let (ok, _, err) = ctl(&sock, args);
        assert!(!ok && err.contains("no export"), "{args:?}: {err}");
    }
    assert!(server.term().success());
}

/// The written ranges are those of the device the export detached: detach A, attach another
/// device B, write through it, detach B, write again, attach A: A is not the device last
/// detached, so it starts cold (what was written while B served is not in the ranges), and
/// every page reads the newest bytes.
#[test]
fn a_warm_attach_only_for_the_device_that_was_detached() {
    use sce_io::BlockDevice;
    let d = tempfile::tempdir().unwrap();
    let (server, sock) = serve(d.path());
    ctl_json(&sock, &["prefetch", "0", "4MiB"]);
    ctl_json(&sock, &["detach"]);
    let other = d.path().join("other");
    let att = ctl_json(&sock, &["attach", "--export", "", other.to_str().unwrap()]);
    assert_eq!(att["cache"], other.to_str().unwrap(), "{att}");
    let client = common::unix_client(&sock, 1);
    let b1 = vec![0x11u8; 65536];
    client.write_at(1 << 20, &b1).unwrap();
    ctl_json(&sock, &["detach"]);
    let b2 = vec![0x22u8; 65536];
    client.write_at(3 << 20, &b2).unwrap();
    let first = d.path().join("cache");
    let att = ctl_json(&sock, &["attach", "", first.to_str().unwrap()]);
    assert_eq!(att["warm"], false, "{att}");
    assert_eq!(cached_bytes(&sock, "0", "4MiB"), 0, "{att}");
    let mut b = vec![0u8; 65536];
    client.read_at(1 << 20, &mut b).unwrap();
    assert_eq!(b, b1, "written while the other device served");
    client.read_at(3 << 20, &mut b).unwrap();
    assert_eq!(b, b2, "written while detached");
    drop(client);
    assert!(server.term().success());
}
