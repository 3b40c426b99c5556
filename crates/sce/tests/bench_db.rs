//! `scripts/bench-db.py --short --kill-test` (issue 13): PostgreSQL on ext4 on a loop device
//! on nbdfuse on every configuration (no cache, sce with its defaults, `--admission
//! sce-paper`, flashcache-like, nbdkit's cache filter, all-flash), then a SIGKILL of
//! `sce serve` under pgbench. Checks that every configuration started, served the database,
//! produced its figures and passed the database's consistency check (pgbench's invariant and
//! pg_amcheck), and that the database recovered after the SIGKILL. No timing is asserted.
//!
//! Needs root, /dev/fuse, loop devices and the tools of `sce_testkit::TOOLS`; a missing one
//! skips the test, or fails it under `CI=true`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn have_everything() -> bool {
    if !sce_testkit::require_tool("python3", "python3") {
        return false;
    }
    for tool in [
        "nbdkit",
        "nbdfuse",
        "fusermount3",
        "losetup",
        "mkfs.ext4",
        "pgbench",
    ] {
        if !sce_testkit::require_known_tool(tool) {
            return false;
        }
    }
    // SAFETY: geteuid(2) has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    sce_testkit::require(
        root,
        "root (losetup, mount, FUSE, PostgreSQL as the postgres user)",
        "run the tests as root",
    ) && sce_testkit::require_device(
        "/dev/fuse",
        "load the fuse kernel module (in a container: --device /dev/fuse)",
    ) && sce_testkit::require_device(
        "/dev/loop-control",
        "load the loop kernel module (modprobe loop)",
    )
}

fn field<'a>(v: &'a serde_json::Value, k: &str, what: &str) -> &'a serde_json::Value {
    let x = &v[k];
    assert!(!x.is_null(), "{what}: no {k} in {v}");
    x
}

#[test]
fn every_configuration_serves_postgres_and_the_database_survives_a_sigkill() {
    if !have_everything() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench-db.json");
    let mut cmd = Command::new("python3");
    cmd.arg(repo().join("scripts/bench-db.py"))
        // 4 s of pgbench per configuration, not the short mode's 8: the suite stays under
        // 20 minutes (114 s instead of 140 here); no timing is asserted.
        .args([
            "--short",
            "--seconds",
            "4",
            "--kill-test",
            "--sce",
            env!("CARGO_BIN_EXE_sce"),
        ])
        .arg("--json")
        .arg(&json)
        .env("TMPDIR", dir.path());
    // A hang guard, not a timing assertion: the run takes about 2.5 minutes.
    let o = sce_testkit::within("scripts/bench-db.py --short --kill-test", 1200, move || {
        cmd.output().expect("run python3")
    });
    let report = String::from_utf8_lossy(&o.stdout);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "bench-db.py exit {:?}:\n{report}\n{log}",
        o.status.code()
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON report"))
            .expect("JSON");
    let configs = doc["configs"].as_array().expect("configs");
    let names: Vec<&str> = configs.iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(
        names,
        ["nocache", "sce", "sce-paper", "flashcache", "kit", "flash"],
        "{report}"
    );
    for c in configs {
        let what = c["label"].as_str().unwrap_or("?");
        assert_eq!(c["started"], true, "{what} did not start: {c}\n{log}");
        assert_eq!(
            c["served"], true,
            "{what} did not serve PostgreSQL: {c}\n{log}"
        );
        assert!(c["error"].is_null(), "{what}: {}\n{log}", c["error"]);
        assert_eq!(
            c["check_ok"], true,
            "{what}: the consistency check failed: {}",
            c["check"]
        );
        let series = field(c, "series", what).as_array().expect("series");
        assert!(
            !series.is_empty() && series.iter().any(|v| v.as_u64() > Some(0)),
            "{what}: no transaction in its TPS series {series:?}"
        );
        assert!(field(c, "steady_tps", what).as_f64() > Some(0.0), "{what}");
        assert!(field(c, "lat_mean_ms", what).is_number(), "{what}");
        assert!(field(c, "lat_p99_ms", what).is_number(), "{what}");
        match c["kind"].as_str() {
            Some("sce") => {
                // Over the whole run (the last third may see no read at all when the
                // database's memory holds what it reads; PostgreSQL's start always reads).
                let h = field(c, "hit_run", what).as_f64().expect("hit ratio");
                assert!((0.0..=1.0).contains(&h), "{what}: hit ratio {h}");
                let last = &c["hit_last_third"];
                assert!(
                    last.is_null() || last.as_f64().is_some_and(|h| (0.0..=1.0).contains(&h)),
                    "{what}: {last}"
                );
                // Every byte written to the cache file has its cause: populated pages, copies
                // of writes, the write journal, metadata records.
                let total = field(c, "cache_bytes_per_tx", what)
                    .as_f64()
                    .expect("bytes");
                let parts = field(c, "cache_bytes_per_tx_by_cause", what);
                let parts = parts.as_object().expect("causes");
                let sum: f64 = parts.values().filter_map(|v| v.as_f64()).sum();
                assert_eq!(parts.len(), 4, "{what}: {parts:?}");
                assert!(
                    total > 0.0 && (sum - total).abs() <= total * 1e-9 + 1.0,
                    "{what}: the causes {parts:?} do not add up to {total} bytes per transaction"
                );
            }
            // nbdkit's cache filter has no hit counters; its cache writes are counted.
            Some("kit") => assert!(field(c, "cache_bytes_per_tx", what).is_number(), "{what}"),
            _ => assert!(
                c["cache_bytes_per_tx"].is_null(),
                "{what}: no cache, no writes"
            ),
        }
    }
    let k = &doc["kill_test"];
    assert!(k["error"].is_null(), "kill test: {}\n{log}", k["error"]);
    assert_eq!(
        k["check_ok"], true,
        "after the SIGKILL and the restart: {k}\n{log}"
    );
    for f in ["cold_hit", "warm_hit"] {
        let h = field(k, f, "kill test").as_f64().expect("hit ratio");
        assert!((0.0..=1.0).contains(&h), "kill test: {f} {h}");
    }
    let steps = k["steps"].as_array().expect("steps");
    assert!(
        steps
            .iter()
            .any(|s| s.as_str().is_some_and(|s| s.contains("SIGKILL"))),
        "{k}"
    );
    assert!(
        report.contains("## The issue's goals") && report.contains("SIGKILL of sce serve"),
        "{report}"
    );
}
