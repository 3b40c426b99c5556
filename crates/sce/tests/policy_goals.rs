//! The default policy's goals against `flashcache-like` on a reduced policy matrix
//! (`scripts/sim-matrix.py`, whose docstring defines them): two traces, three cache sizes,
//! ratios only (hit ratios, bytes written per request, warm-up in trace time), never wall
//! time. The full matrix is `scripts/sim-matrix.py` with no options (docs/SIM-REPORT.md).

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

/// cloudPhysicsIO.vscsi and the generated `oltp` trace of the full matrix (4 GiB, 300,000
/// requests) at 10%, 50% and 150% of their 4 KiB working sets: the very cells of the full
/// matrix. `sce` must meet (a) cache bytes written per request <= half of
/// `flashcache-like`'s, (b) read hit ratio >= its - 0.01, (c) warm-up <= half its, in every
/// cell. On failure the table and the missed goals are printed.
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
            "sce,flashcache-like",
            "--jobs",
            "2",
            "--check",
        ])
        .output()
        .expect("run python3");
    let table = String::from_utf8_lossy(&o.stdout);
    let log = String::from_utf8_lossy(&o.stderr);
    // Exit 1 is a missed goal; anything else (2, a signal) a run that failed.
    assert!(
        o.status.success(),
        "the goals of the default policy, sim-matrix.py exit {:?}:\n{table}\n{log}",
        o.status.code()
    );
    assert!(
        table.contains("Goals met in 6 of 6 checked cells"),
        "{table}"
    );
}
