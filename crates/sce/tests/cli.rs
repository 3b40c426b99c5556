//! The `sce` binary end to end: a short `demo`, and bad input. The `footprint` numbers are
//! in tests/footprint.rs (they need the feature `footprint`).

use std::process::Command;

fn sce(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(args)
        .output()
        .expect("run sce")
}

fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "sce failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

#[test]
fn short_demo_reports_both_runs_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let out = sce(&[
        "demo",
        "--seconds",
        "3",
        "--source-size",
        "256MiB",
        "--cache-size",
        "64MiB",
        "--interval",
        "1s",
        "--dir",
        dir.path().to_str().unwrap(),
        "--json",
    ]);
    let v = json(&out);
    assert!(v["cache"]["ops"].as_u64().unwrap() > 0);
    assert!(v["no_cache"]["ops"].as_u64().unwrap() > 0);
    assert_eq!(v["cache"]["errors"].as_u64(), Some(0));
    assert!(v["speedup"].as_f64().unwrap() > 0.0);
    assert!(!v["cache"]["intervals"].as_array().unwrap().is_empty());
    assert!(v["cache"]["read_hit_ratio"].as_f64().is_some());
    assert!(v["no_cache"]["read_hit_ratio"].is_null());
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "demo left files behind: {left:?}");
}

#[test]
fn bad_input_gets_a_clear_message() {
    let out = sce(&["demo", "--fragment-size", "3MiB", "--seconds", "1"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("fragment_size") && err.contains("power of two"),
        "{err}"
    );

    // The default geometry's cache line is 512 KiB (1 MiB fragments in lines).
    let out = sce(&["demo", "--cache-size", "512KiB", "--seconds", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 2 fragments"));

    let out = sce(&["footprint", "--cache-size", "12XB"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown unit"));

    let out = sce(&["demo", "--target-missrate", "2", "--seconds", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("throttle.target_missrate"));

    let out = sce(&["demo", "--admission", "nhit:0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nhit:K"));

    // A --dir below a regular file cannot be created.
    let file = tempfile::NamedTempFile::new().unwrap();
    let bad = file.path().join("sub");
    let out = sce(&["demo", "--seconds", "1", "--dir", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(bad.to_str().unwrap()));
}

#[test]
fn help_explains_itself() {
    let out = sce(&["--help"]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("demo") && s.contains("footprint"));
    // Which size units are binary and which decimal, once for every option.
    assert!(
        s.contains("powers of 1024") && s.contains("powers of 1000"),
        "{s}"
    );
    let out = sce(&["demo", "--help"]);
    let s = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--seconds",
        "--source-size",
        "--cache-size",
        "--mode",
        "--admission",
        "--fragment-size",
        "--json",
    ] {
        assert!(s.contains(flag), "demo --help lacks {flag}");
    }
}

#[test]
fn sim_lru_reads_only_matches_the_reference() {
    let trace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces/cloudPhysicsIO.vscsi");
    for (size, want) in [("64MiB", 0.9167), ("256MiB", 0.8273), ("512MiB", 0.8255)] {
        let v = json(&sce(&[
            "sim",
            "--trace",
            trace.to_str().unwrap(),
            "--format",
            "vscsi",
            "--cache-size",
            size,
            "--policy",
            "lru",
            "--reads-only",
            "--json",
        ]));
        let got = v["policies"][0]["miss_ratio"].as_f64().unwrap();
        assert_eq!(format!("{got:.4}"), format!("{want:.4}"), "{size}");
        assert_eq!(v["policies"][0]["accesses"].as_u64(), Some(485_700));
    }
    let out = sce(&[
        "sim",
        "--trace",
        trace.to_str().unwrap(),
        "--format",
        "parquet",
        "--cache-size",
        "1GiB",
    ]);
    // An unknown format is a usage error (clap's exit code 2) that names the known ones.
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("vscsi"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = sce(&[
        "sim",
        "--trace",
        trace.to_str().unwrap(),
        "--format",
        "msr",
        "--cache-size",
        "1GiB",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("line 1"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `sce gen` says what it wrote in the words of its command line, not Rust's.
#[test]
fn gen_reports_its_workload_by_name() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("t.sce");
    let o = sce(&[
        "gen",
        "oltp",
        "--seed",
        "7",
        "--requests",
        "100",
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("wrote 100 requests (oltp, seed 7)"), "{err}");
}

/// What a help text lists is what the code takes: the policies `sim` accepts (its error for
/// an unknown one lists them, from the list a unit test checks against the parser), the
/// loads of `gen` (clap's own list of its values) and the cache modes (the parser's list),
/// each named in the top-level help, the subcommand's help and the README's table.
#[test]
fn help_texts_name_every_policy_load_and_mode() {
    let text = |out: std::process::Output| {
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
    };
    let top = text(sce(&["--help"]));
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/traces/msr-cambridge1-sample.csv"
    );
    let err = text(sce(&[
        "sim",
        "--trace",
        trace,
        "--format",
        "msr",
        "--cache-size",
        "1MiB",
        "--policy",
        "bogus",
    ]));
    let list = err
        .split_once("(one of: ")
        .map(|x| x.1)
        .unwrap_or_else(|| panic!("{err}"));
    let policies: Vec<&str> = list.trim_end().trim_end_matches(')').split(", ").collect();
    assert!(
        policies.len() >= 10 && policies.contains(&"s3fifo"),
        "{policies:?}"
    );
    let sim_help = text(sce(&["sim", "--help"]));
    for p in &policies {
        assert!(top.contains(p), "sce --help does not name policy {p}");
        assert!(
            sim_help.contains(p),
            "sce sim --help does not name policy {p}"
        );
    }
    let gen_help = text(sce(&["gen", "--help"]));
    let loads: Vec<&str> = gen_help
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("- "))
        .filter_map(|l| l.split_once(':').map(|x| x.0))
        .collect();
    assert!(loads.len() >= 7 && loads.contains(&"hotscan"), "{gen_help}");
    for l in &loads {
        assert!(top.contains(l), "sce --help does not name load {l}");
    }
    let err = text(sce(&["serve", "--mode", "bogus"]));
    let list = err
        .split_once("(expected ")
        .map(|x| x.1)
        .unwrap_or_else(|| panic!("{err}"));
    let modes: Vec<&str> = list
        .split(" (old names")
        .next()
        .unwrap()
        .split(", ")
        .collect();
    assert!(
        modes.contains(&"writeback") && modes.len() >= 5,
        "{modes:?}"
    );
    let doc = |f: &str| {
        std::fs::read_to_string(format!("{}/../../{f}", env!("CARGO_MANIFEST_DIR"))).unwrap()
    };
    let conf = doc("docs/CONFIGURATION.md");
    let row = conf
        .lines()
        .find(|l| l.starts_with("| `--mode`"))
        .expect("docs/CONFIGURATION.md --mode row");
    let readme = doc("README.md");
    let table = &readme[readme.find("## Modes").expect("README's modes")..];
    for (what, help) in [
        ("sce serve --help", text(sce(&["serve", "--help"]))),
        ("sce demo --help", text(sce(&["demo", "--help"]))),
        ("sce ctl set --help", text(sce(&["ctl", "set", "--help"]))),
        ("docs/CONFIGURATION.md's --mode row", row.to_string()),
        (
            "README's modes",
            table[..table.find("\n## ").unwrap()].to_string(),
        ),
    ] {
        for m in &modes {
            assert!(help.contains(m), "{what} does not name mode {m}");
        }
    }
}
