//! The toolchain pin and `rust-version` say true things: `rust-version` in Cargo.toml is at
//! least what every locked dependency declares it needs (`cargo metadata`), and at most the
//! pinned toolchain of rust-toolchain.toml.

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// "1.88" or "1.88.0" as (1, 88, 0).
fn version(v: &str) -> (u32, u32, u32) {
    let mut p = v
        .trim()
        .split('.')
        .map(|x| x.parse::<u32>().unwrap_or_else(|_| panic!("{v}")));
    (
        p.next().unwrap(),
        p.next().unwrap_or(0),
        p.next().unwrap_or(0),
    )
}

/// The quoted value of `key = "..."` in a TOML file's text.
fn value<'a>(text: &'a str, key: &str) -> &'a str {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{key} =")))
        .unwrap_or_else(|| panic!("no {key}"));
    line.split('"').nth(1).unwrap_or_else(|| panic!("{line}"))
}

#[test]
fn rust_version_covers_the_locked_dependencies_and_the_pin_covers_it() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let ours = version(value(&manifest, "rust-version"));
    let pin = std::fs::read_to_string(root().join("rust-toolchain.toml")).unwrap();
    let channel = version(value(&pin, "channel"));
    assert!(
        ours <= channel,
        "rust-version {ours:?} is newer than the pinned {channel:?}"
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // The dependencies built here (a fresh machine has fetched only those: offline, the
    // other platforms' would be missing).
    let rustc = Command::new("rustc").arg("-vV").output().unwrap();
    let info = String::from_utf8_lossy(&rustc.stdout).to_string();
    let host = info
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .unwrap_or_else(|| panic!("no host in rustc -vV: {info}"));
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", host])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let needs: Vec<((u32, u32, u32), String)> = m["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| {
            let rv = p["rust_version"].as_str()?;
            Some((version(rv), format!("{} {}", p["name"], p["version"])))
        })
        .collect();
    assert!(
        needs.len() > 20,
        "cargo metadata listed {} packages with a rust-version",
        needs.len()
    );
    let (most, who) = needs.iter().max().unwrap();
    assert!(
        ours >= *most,
        "rust-version {ours:?} in Cargo.toml, but {who} needs {most:?}: raise it"
    );
}
