//! What an operator meets: logs (each line once, text or JSON, levels), mode names, help.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `sce serve ARGS` over a fresh 64 MiB source with a 16 MiB cache in `d` until it
/// listens, then stops it with SIGTERM. Returns its stderr lines
/// and whether it exited 0.
fn serve_and_stop(d: &Path, args: &[&str]) -> (Vec<String>, bool) {
    let src = d.join("src");
    common::sized_file(&src, 64 << 20);
    let sock = d.join("s.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sce"))
        .arg("serve")
        .args(["--source", src.to_str().unwrap()])
        .args(["--cache", d.join("cache").to_str().unwrap()])
        .args(["--cache-size", "16MiB", "--metrics", "127.0.0.1:0"])
        .args(["--state-dir", d.to_str().unwrap()])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .args(args)
        .env_remove("SCE_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            all.push(l);
        }
        all
    });
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "sce serve never listened"
        );
        if let Ok(Some(st)) = child.try_wait() {
            panic!("sce serve exited with {st}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let ok = child.wait().unwrap().success();
    (reader.join().unwrap(), ok)
}

/// The messages a server logs from start to a clean stop, each once.
const LIFE: [&str; 5] = [
    "listening on unix:",
    "metrics on http://127.0.0.1:",
    "serving",
    "signal received: shutting down",
    "stopped cleanly",
];

#[test]
fn every_log_line_appears_once_as_text() {
    let d = tempfile::tempdir().unwrap();
    let (lines, ok) = serve_and_stop(d.path(), &[]);
    assert!(ok, "{lines:#?}");
    for m in LIFE {
        let n = lines.iter().filter(|l| l.contains(m)).count();
        assert_eq!(n, 1, "{m:?} logged {n} times: {lines:#?}");
    }
    // Text lines: timestamp, level, target, message; nothing printed beside the log.
    for l in &lines {
        assert!(
            l.contains(" INFO ") || l.contains(" WARN ") || l.contains(" ERROR "),
            "not a log line at the default level (info): {l}"
        );
    }
}

#[test]
fn json_logs_are_one_object_per_line() {
    let d = tempfile::tempdir().unwrap();
    let (lines, ok) = serve_and_stop(d.path(), &["--log-format", "json", "-v"]);
    assert!(ok, "{lines:#?}");
    let objs: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    for m in LIFE {
        let n = objs
            .iter()
            .filter(|o| {
                o["fields"]["message"]
                    .as_str()
                    .is_some_and(|s| s.contains(m))
            })
            .count();
        assert_eq!(n, 1, "{m:?} logged {n} times: {lines:#?}");
    }
    assert!(objs
        .iter()
        .all(|o| o["level"].is_string() && o["target"].is_string()));
    // -v: one level more than info.
    assert!(
        objs.iter().any(|o| o["level"] == "DEBUG"),
        "-v shows debug lines: {lines:#?}"
    );
}

#[test]
fn log_level_filters_and_rejects_nonsense() {
    let d = tempfile::tempdir().unwrap();
    let (lines, ok) = serve_and_stop(d.path(), &["--log-level", "warn"]);
    assert!(ok);
    assert!(
        lines.iter().all(|l| !l.contains(" INFO ")),
        "warn hides info: {lines:#?}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["--log-level", "sce=what=ever", "footprint", "--json"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// Every subcommand's help ends with examples; serve's shows its defaults and the mode
/// names operators know.
#[test]
fn every_help_ends_with_examples() {
    let help = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_sce"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    for c in [
        "demo",
        "serve",
        "ctl",
        "stats",
        "sim",
        "gen",
        "trace",
        "format",
        "check",
        "footprint",
        "completions",
        "man",
    ] {
        for flag in ["-h", "--help"] {
            let h = help(&[c, flag]);
            let tail = &h[h
                .rfind("Examples:")
                .unwrap_or_else(|| panic!("sce {c} {flag}: no examples\n{h}"))..];
            assert!(
                tail.lines()
                    .skip(1)
                    .all(|l| l.is_empty() || l.starts_with("  ")),
                "sce {c} {flag}: the examples come last\n{tail}"
            );
        }
    }
    let serve = help(&["serve", "--help"]);
    for want in [
        "writethrough",
        "writearound",
        "passthrough",
        "--awt",
        "--hot-window",
        "--chunk-size",
        "[default: 256]",
        "[default: writethrough]",
        "--admin",
        "--log-format",
    ] {
        assert!(serve.contains(want), "serve --help lacks {want:?}");
    }
}

/// The mode names and the tuning knobs reach the running cache, from the flags and from
/// the TOML file (the old names still work).
#[test]
fn mode_names_and_knobs_reach_the_cache() {
    let (d, src) = common::temp_source(64 << 20);
    let toml = d.path().join("sce.toml");
    std::fs::write(
        &toml,
        format!(
            "admin = \"{}\"\n[[export]]\nname = \"a\"\nsource = \"{}\"\ncache = \"{}\"\ncache_size = \"16MiB\"\nmode = \"write-through\"\nchunk_size = \"128KiB\"\nhot_window = 7\nperiod = \"50ms\"\n\n[[export]]\nname = \"b\"\nsource = \"{}\"\ncache = \"{}\"\ncache_size = \"16MiB\"\nmode = \"writethrough\"\nawt = false\n",
            d.path().join("admin.ctl").display(),
            src.display(),
            d.path().join("ca").display(),
            d.path().join("src2").display(),
            d.path().join("cb").display(),
        ),
    )
    .unwrap();
    common::sized_file(&d.path().join("src2"), 64 << 20);
    let sock = d.path().join("s.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["serve", "--config", toml.to_str().unwrap()])
        .args(["--state-dir", d.path().to_str().unwrap()])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .args(["--log-level", "warn"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let admin = d.path().join("admin.ctl");
    let t0 = Instant::now();
    while !admin.exists() {
        assert!(t0.elapsed() < Duration::from_secs(60), "no admin socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["ctl", "--json", "-s", admin.to_str().unwrap(), "status"])
        .output()
        .unwrap();
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ex = v["exports"].as_array().unwrap();
    assert_eq!(ex[0]["name"], "a");
    assert_eq!(
        ex[0]["mode"], "writethrough-sync",
        "the old name write-through"
    );
    assert_eq!(ex[0]["fragment_size_bytes"], 128 << 10, "chunk_size");
    assert_eq!(
        ex[1]["mode"], "writethrough-sync",
        "writethrough with awt = false"
    );
}

/// /metrics: every family has HELP and TYPE, counters end in `_total`, units are base units
/// named in the metric, the latency histograms and the gauges an operator looks at are
/// there, and Prometheus' own linter (`promtool check metrics`) finds nothing to say.
#[test]
fn metrics_pass_promtool_and_every_family_has_help_and_type() {
    let (d, src) = common::temp_source(64 << 20);
    let sock = d.path().join("s.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["serve", "--source", src.to_str().unwrap()])
        .args(["--cache", d.path().join("cache").to_str().unwrap()])
        .args(["--cache-size", "16MiB", "--metrics", "127.0.0.1:0"])
        .args(["--state-dir", d.path().to_str().unwrap()])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = common::metrics_addr(&mut lines);
    // Some reads and writes, so that the histograms have samples.
    let c = common::unix_client(&sock, 1);
    let mut b = vec![0u8; 65536];
    for i in 0..8 {
        sce_io::BlockDevice::read_at(&c, i * 65536, &mut b).unwrap();
        sce_io::BlockDevice::write_at(&c, i * 65536, &b).unwrap();
    }
    drop(c);
    let text = common::http_get(&addr, "/metrics")
        .split_once("\r\n\r\n")
        .unwrap()
        .1
        .to_string();
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());

    let mut help = std::collections::HashSet::new();
    let mut types = std::collections::HashMap::new();
    for l in text.lines() {
        if let Some(r) = l.strip_prefix("# HELP ") {
            let (name, h) = r.split_once(' ').unwrap();
            assert!(!h.trim().is_empty(), "{name} has an empty HELP");
            assert!(help.insert(name.to_string()), "two HELP lines for {name}");
        } else if let Some(r) = l.strip_prefix("# TYPE ") {
            let (name, t) = r.split_once(' ').unwrap();
            types.insert(name.to_string(), t.to_string());
        }
    }
    let mut families = std::collections::HashSet::new();
    for l in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = l.split(['{', ' ']).next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(name);
        assert!(help.contains(family), "{family} has no HELP");
        let t = types
            .get(family)
            .unwrap_or_else(|| panic!("{family} has no TYPE"));
        assert_eq!(t == "counter", family.ends_with("_total"), "{family}: {t}");
        for bad in ["_millis", "_ms", "_micros", "_kib", "_mib"] {
            assert!(!family.contains(bad), "{family}: not a base unit");
        }
        families.insert(family.to_string());
    }
    assert!(
        !text.contains("export=\"\""),
        "the default export has a label value"
    );
    for f in [
        "sce_build_info",
        "sce_read_hit_duration_seconds",
        "sce_read_miss_duration_seconds",
        "sce_write_duration_seconds",
        "sce_cache_occupied_bytes",
        "sce_inflight_requests",
        "sce_population_rate_limit_bytes_per_second",
        "sce_read_hit_ratio",
        "sce_persist_load_seconds",
        "sce_nbd_open_connections",
    ] {
        assert!(families.contains(f), "no {f}");
    }
    let writes: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("sce_write_duration_seconds_count{export=\"default\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(writes, 8, "every write timed");

    if !sce_testkit::require_known_tool("promtool") {
        return;
    }
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    p.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool: {said}"
    );
}

/// The example Grafana dashboard asks only for metrics sce exports.
#[test]
fn the_grafana_dashboard_uses_only_metrics_that_exist() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../contrib/grafana-sce.json"
    ))
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    // The families are defined in the renderer, its tables, and the stats tables of the
    // engine and the server (`stats_table!`): all of their sources.
    let mut src = String::new();
    let mut dirs: Vec<std::path::PathBuf> = ["sce-server", "sce-engine"]
        .iter()
        .map(|c| format!("{}/../{c}/src", env!("CARGO_MANIFEST_DIR")).into())
        .collect();
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                src += &std::fs::read_to_string(&p).unwrap();
            }
        }
    }
    assert!(src.contains("\"sce_read_requests_total\""));
    let mut n = 0;
    for p in v["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            for (i, _) in expr.match_indices("sce_") {
                let name: String = expr[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .filter(|f| f.ends_with("_seconds"))
                    .unwrap_or(&name);
                assert!(
                    src.contains(&format!("\"{family}\"")),
                    "the dashboard uses {name}, which sce does not export"
                );
                n += 1;
            }
        }
    }
    assert!(n >= 20, "{n} metric references");
}

/// Packaging: completions for every shell, man pages for sce and every subcommand, and the
/// systemd unit's command line is one `sce serve` accepts.
#[test]
fn completions_man_pages_and_the_systemd_unit() {
    let sce = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_sce"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let s = sce(&["completions", shell]);
        assert!(s.contains("ctl") && s.contains("serve"), "{shell}");
    }
    let bash = sce(&["completions", "bash"]);
    let st = Command::new("bash")
        .args(["-n", "-c", &bash])
        .status()
        .unwrap();
    assert!(st.success(), "the bash completion parses");
    let d = tempfile::tempdir().unwrap();
    let listed = sce(&["man", "--out", d.path().to_str().unwrap()]);
    for page in [
        "sce.1",
        "sce-serve.1",
        "sce-ctl.1",
        "sce-stats.1",
        "sce-sim.1",
    ] {
        let p = d.path().join(page);
        assert!(listed.contains(page), "{listed}");
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(
            text.starts_with(".ie") || text.contains(".TH"),
            "{page} is roff"
        );
    }
    let serve_page = std::fs::read_to_string(d.path().join("sce-serve.1")).unwrap();
    assert!(serve_page.contains("admin"), "options are in the page");

    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../contrib/sce@.service"
    ))
    .unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart=/usr/bin/sce "))
        .expect("an ExecStart of sce");
    let help = sce(&["serve", "--help"]);
    for flag in exec.split_whitespace().filter(|w| w.starts_with("--")) {
        assert!(
            help.contains(flag),
            "the unit's {flag} is not a serve option"
        );
    }
    for key in [
        "KillSignal=SIGTERM",
        "TimeoutStopSec=",
        "RuntimeDirectory=sce",
        "[Install]",
    ] {
        assert!(unit.contains(key), "the unit lacks {key}");
    }
}

/// A TCP listener on an address other than loopback carries the volume in the clear: it is
/// refused with the reason unless --insecure, which logs a warning.
#[test]
fn a_non_loopback_tcp_listener_needs_insecure() {
    let (d, src) = common::temp_source(16 << 20);
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["serve", "--source", src.to_str().unwrap()])
        .args(["--listen", "tcp:0.0.0.0:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("refusing to listen on tcp:0.0.0.0:0") && err.contains("--insecure"),
        "{err}"
    );
    // With --insecure it serves, and says what it risks.
    let mut child = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["serve", "--source", src.to_str().unwrap()])
        .args(["--listen", "tcp:0.0.0.0:0", "--insecure"])
        .args(["--admin", d.path().join("a.ctl").to_str().unwrap()])
        .env_remove("SCE_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    loop {
        let l = lines.next().expect("server output").unwrap();
        seen.push(l.clone());
        if l.contains("serving") && !l.contains("WARN") {
            break;
        }
    }
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    seen.extend(lines.map_while(Result::ok));
    assert!(st.success(), "{st}: {seen:#?}");
    assert!(
        seen.iter()
            .any(|l| l.contains("WARN") && l.contains("without TLS")),
        "{seen:#?}"
    );
    // Loopback needs nothing.
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["serve", "--source", "/nonexistent/x"])
        .args(["--listen", "tcp:127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).contains("refusing to listen"));
}
