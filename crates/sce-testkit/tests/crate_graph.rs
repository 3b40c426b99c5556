//! The crate graph of issue 28: which workspace crate may depend on which. It reads
//! `cargo metadata` and checks every normal dependency (not dev-, not build-) between
//! workspace crates against an allow-list, so that the inversions it forbids cannot come
//! back: the server pulling in the simulator (and its compression C libraries) for a helper,
//! the simulator pulling in the engine for the demo, a library depending on the test kit.
//!
//! A new workspace crate fails the test until it has a line in [`allowed`].

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// What `from` may depend on among the workspace crates (normal dependencies only).
enum Allowed {
    /// Exactly these.
    Only(&'static [&'static str]),
    /// Any workspace crate but these.
    AllBut(&'static [&'static str]),
}

/// The allow-list. `None`: a crate the list does not know.
fn allowed(from: &str) -> Option<Allowed> {
    use Allowed::*;
    Some(match from {
        "sce-core" | "sce-io" | "sce-coord" | "sce-testkit" => Only(&[]),
        "sce-store" => Only(&["sce-core", "sce-io"]),
        "sce-engine" => Only(&["sce-core", "sce-io", "sce-store"]),
        "sce-nbd" => Only(&["sce-io"]),
        // sce-store: the write-back log's state (`wblog::LogState`), which the simulator
        // drives as the engine does (issue 45).
        "sce-sim" => Only(&["sce-core", "sce-io", "sce-store"]),
        "sce-server" => AllBut(&["sce-sim", "sce"]),
        "sce" => AllBut(&[]),
        _ => return None,
    })
}

/// Only the binary may have the test kit as a normal dependency.
const TESTKIT: &str = "sce-testkit";

/// The edges of `edges` (from, to) that the rules forbid, each with the reason.
fn violations(edges: &[(String, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (from, to) in edges {
        if to == ANYHOW {
            if from != "sce" && from != "sce-server" {
                out.push(format!(
                    "{from} -> {to}: anyhow only in the binary and the server (give the \
                     library's errors a type)"
                ));
            }
            continue;
        }
        if to == TESTKIT && from != "sce" {
            out.push(format!(
                "{from} -> {to}: only `sce` may have the test kit as a normal dependency \
                 (make it a dev-dependency)"
            ));
            continue;
        }
        let ok = match allowed(from) {
            None => {
                out.push(format!(
                    "{from} -> {to}: {from} is not in the allow-list of crate_graph.rs"
                ));
                continue;
            }
            Some(Allowed::Only(list)) => list.contains(&to.as_str()),
            Some(Allowed::AllBut(list)) => !list.contains(&to.as_str()),
        };
        if !ok {
            out.push(format!("{from} -> {to}: not allowed by crate_graph.rs"));
        }
    }
    out
}

/// The workspace's crates and the normal dependencies between them, from `cargo metadata`.
fn workspace_graph() -> (BTreeSet<String>, Vec<(String, String)>) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--manifest-path",
        ])
        .arg(&manifest)
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let name = |p: &serde_json::Value| p["name"].as_str().expect("name").to_string();
    let crates: BTreeSet<String> = packages.iter().map(name).collect();
    let mut edges = Vec::new();
    for p in packages {
        for d in p["dependencies"].as_array().expect("dependencies") {
            let to = d["name"].as_str().expect("dependency name");
            // `kind` is null for a normal dependency, "dev" or "build" otherwise.
            if d["kind"].is_null() && (crates.contains(to) || to == ANYHOW) {
                edges.push((name(p), to.to_string()));
            }
        }
    }
    (crates, edges)
}

/// `anyhow` is for the binary and the server only: the libraries' errors have types.
const ANYHOW: &str = "anyhow";

#[test]
fn workspace_crates_depend_only_as_allowed() {
    let (crates, edges) = workspace_graph();
    for c in [
        "sce",
        "sce-core",
        "sce-engine",
        "sce-server",
        "sce-sim",
        "sce-testkit",
    ] {
        assert!(crates.contains(c), "cargo metadata lacks {c}: {crates:?}");
    }
    let mut bad = violations(&edges);
    bad.extend(
        crates
            .iter()
            .filter(|c| allowed(c).is_none())
            .map(|c| format!("{c}: a workspace crate not in the allow-list of crate_graph.rs")),
    );
    assert!(
        bad.is_empty(),
        "forbidden dependencies between workspace crates:\n  {}",
        bad.join("\n  ")
    );
}

/// The rules themselves catch the inversions issue 28 removed.
#[test]
fn the_rules_catch_the_inversions() {
    let e = |a: &str, b: &str| (a.to_string(), b.to_string());
    for (from, to) in [
        ("sce-server", "sce-sim"),
        ("sce-server", "sce"),
        ("sce-sim", "sce-engine"),
        ("sce-sim", "sce-server"),
        ("sce-engine", "sce-testkit"),
        ("sce-core", "sce-io"),
        ("sce-store", "sce-engine"),
        ("sce-nbd", "sce-engine"),
        ("sce-new", "sce-core"),
        ("sce-sim", "anyhow"),
        ("sce-engine", "anyhow"),
    ] {
        let v = violations(&[e(from, to)]);
        assert!(!v.is_empty(), "{from} -> {to} passes");
        assert!(v[0].starts_with(&format!("{from} -> {to}: ")), "{v:?}");
    }
    let fine = [
        e("sce", "sce-testkit"),
        e("sce", "sce-sim"),
        e("sce-server", "sce-engine"),
        e("sce-engine", "sce-store"),
        e("sce-sim", "sce-core"),
        e("sce", "anyhow"),
        e("sce-server", "anyhow"),
    ];
    assert_eq!(violations(&fine), Vec::<String>::new());
}
