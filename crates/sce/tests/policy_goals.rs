//! The default policy's goals against `flashcache-like` on a reduced policy matrix
//! (`scripts/sim-matrix.py`, whose docstring defines them: issue 47's), and issue 30's third
//! goal (read hit within 0.02 of the better of `lru` and `s3fifo`, 'r' below): two traces,
//! three cache sizes, ratios only (hit ratios, bytes written per request, modelled latency
//! in trace time), never wall time. The full matrix is `scripts/sim-matrix.py` with no options (docs/SIM-REPORT.md).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn script() -> Command {
    let mut c = Command::new("python3");
    c.arg(repo().join("scripts/sim-matrix.py"));
    c
}

/// The goal arithmetic of the script on made-up results, so that a pass of the test below
/// means the goals were met, not that the script checks nothing.
#[test]
fn the_goal_arithmetic_is_right() {
    if !sce_testkit::require_tool("python3", "python3") {
        return;
    }
    let o = script().arg("--self-test").output().expect("run python3");
    assert!(
        o.status.success(),
        "sim-matrix.py --self-test: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The goals `sce` misses today on the reduced matrix, each with why (docs/SIM-REPORT.md has
/// the analysis). The test fails on any other miss (a regression), and on a listed miss that
/// is now met (an improvement: shorten the list, so that it stays the truth).
const KNOWN_MISSES: &[(&str, u32, char, &str)] = &[
    (
        "cloudPhysicsIO.vscsi",
        50,
        'a',
        "lines populated whole on a trace of page density 0.40 (half of flashcache-like's \
         writes is the goal with spatial locality)",
    ),
    (
        "cloudPhysicsIO.vscsi",
        50,
        'b',
        "lru caches every written and every misaligned block; sce refills only the area pages \
         a write covers whole (this trace's writes are 4 KiB at 512 B offsets: none) and fills \
         misaligned pages only by population",
    ),
    (
        "cloudPhysicsIO.vscsi",
        50,
        'r',
        "as (b): reads of written data",
    ),
    ("cloudPhysicsIO.vscsi", 150, 'a', "as at 50%"),
    (
        "cloudPhysicsIO.vscsi",
        150,
        'b',
        "as at 50%: reads of written data",
    ),
    ("cloudPhysicsIO.vscsi", 150, 'r', "as (b)"),
    (
        "oltp",
        150,
        'a',
        "whole-line population of dense lines: 0.021 more read hits for 1.06x the writes",
    ),
];

/// How far the cells may drift before the test fails, so that a known miss cannot quietly
/// get worse: (trace, percent, most cache bytes written per request over flashcache-like's,
/// least read hit ratio minus flashcache-like's, most modelled mean read latency over
/// flashcache-like's). Today's values with room for small changes: writes +10%, hit ratio
/// -0.02, latency +15%. Today (issue 47, miss fills `auto` fill free space too, the page
/// area yields to starved lines, population follows a shift): cloudPhysics 10% 0.35 /
/// +0.125 / 0.92, 50% 0.64 / -0.143 / 0.61, 150% 1.02 / -0.006 / 0.44; oltp 10% 0.49 /
/// +0.042 / 0.81, 50% 0.69 / +0.010 / 0.95, 150% 1.06 / +0.021 / 0.93.
const BOUNDS: &[(&str, u32, f64, f64, f64)] = &[
    ("cloudPhysicsIO.vscsi", 10, 0.39, 0.105, 1.06),
    ("cloudPhysicsIO.vscsi", 50, 0.70, -0.163, 0.70),
    ("cloudPhysicsIO.vscsi", 150, 1.12, -0.026, 0.51),
    ("oltp", 10, 0.54, 0.022, 0.93),
    ("oltp", 50, 0.76, -0.010, 1.09),
    ("oltp", 150, 1.17, 0.001, 1.07),
];

/// cloudPhysicsIO.vscsi and the generated `oltp` trace of the full matrix (4 GiB, 300,000
/// requests) at 10%, 50% and 150% of their 4 KiB working sets: the very cells of the full
/// matrix. `sce` must meet issue 47's goals (the script's docstring: (a) cache bytes written
/// per request <= `flashcache-like`'s, half of it on a trace with spatial locality, (b) read
/// hit ratio >= the better of its and `lru`'s - 0.01, (c) modelled mean read latency <= 1.1x
/// its) in every cell but the known misses above. On failure the table and the goals are
/// printed.
#[test]
fn the_default_policy_meets_its_goals_on_the_reduced_matrix() {
    if !sce_testkit::require_tool("python3", "python3") {
        return;
    }
    let traces = repo().join("../shared/traces");
    assert!(
        traces.join("cloudPhysicsIO.vscsi").is_file(),
        "{} is missing: the shared traces sit next to the repository",
        traces.display()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("matrix.json");
    let o = script()
        .args(["--sce", env!("CARGO_BIN_EXE_sce")])
        .arg("--traces")
        .arg(&traces)
        .args([
            "--traces-subset",
            "cloudPhysicsIO.vscsi,oltp",
            "--sizes",
            "10,50,150",
            "--policies",
            "sce,flashcache-like,lru,s3fifo",
            "--jobs",
            "2",
            "--json",
        ])
        .arg(&json)
        .output()
        .expect("run python3");
    let table = String::from_utf8_lossy(&o.stdout);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "sim-matrix.py exit {:?}:\n{table}\n{log}",
        o.status.code()
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("matrix json")).unwrap();
    let cells = doc["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), 6, "{table}");
    let mut unexpected = Vec::new();
    let mut seen = Vec::new();
    for c in cells {
        let trace = c["trace"].as_str().unwrap_or_default();
        let pct = c["pct"].as_u64().unwrap_or_default() as u32;
        assert_eq!(
            c["goals"]["checked"], true,
            "{trace} {pct}%: not checked\n{table}"
        );
        let mut missed: Vec<String> = c["goals"]["missed"]
            .as_array()
            .expect("missed")
            .iter()
            .map(|m| m.as_str().unwrap_or_default().to_string())
            .collect();
        // The reference goal: [met, why], present for every checked cell.
        let reference = c["reference"].as_array().expect("reference goal checked");
        if reference[0] == false {
            missed.push(format!("(r) {}", reference[1].as_str().unwrap_or_default()));
        }
        for m in &missed {
            let goal = m.chars().nth(1).unwrap_or('?');
            if KNOWN_MISSES
                .iter()
                .any(|k| k.0 == trace && k.1 == pct && k.2 == goal)
            {
                seen.push((trace.to_string(), pct, goal));
            } else {
                unexpected.push(format!("{trace} {pct}%: {m}"));
            }
        }
    }
    for c in cells {
        let trace = c["trace"].as_str().unwrap_or_default();
        let pct = c["pct"].as_u64().unwrap_or_default() as u32;
        let Some(&(_, _, max_wr, min_hit, max_lat)) =
            BOUNDS.iter().find(|b| b.0 == trace && b.1 == pct)
        else {
            continue;
        };
        let (s, f) = (&c["policies"]["sce"], &c["policies"]["flashcache-like"]);
        let num = |v: &serde_json::Value, k: &str| v[k].as_f64();
        let wr = num(s, "cache_bytes_written_per_request").unwrap_or(f64::INFINITY)
            / num(f, "cache_bytes_written_per_request").unwrap_or(0.0);
        let hit = num(s, "read_hit_ratio").unwrap_or(0.0) - num(f, "read_hit_ratio").unwrap_or(1.0);
        let lat = num(s, "mean_read_latency").unwrap_or(f64::INFINITY)
            / num(f, "mean_read_latency").unwrap_or(0.0);
        if wr > max_wr {
            unexpected.push(format!(
                "{trace} {pct}%: writes {wr:.3}x flashcache-like's > {max_wr}"
            ));
        }
        if hit < min_hit {
            unexpected.push(format!(
                "{trace} {pct}%: read hit {hit:+.4} against flashcache-like < {min_hit}"
            ));
        }
        if lat.is_nan() || lat > max_lat {
            unexpected.push(format!(
                "{trace} {pct}%: mean read latency {lat:.2}x flashcache-like's > {max_lat}"
            ));
        }
    }
    assert!(
        unexpected.is_empty(),
        "new misses of the default policy's goals, or known misses grown worse:\n{}\n{table}",
        unexpected.join("\n")
    );
    let now_met: Vec<_> = KNOWN_MISSES
        .iter()
        .filter(|k| !seen.iter().any(|s| s.0 == k.0 && s.1 == k.1 && s.2 == k.2))
        .collect();
    assert!(
        now_met.is_empty(),
        "goals listed as missed are met now; remove them from KNOWN_MISSES: {now_met:?}\n{table}"
    );
}
