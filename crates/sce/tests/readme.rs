//! The README's commands, run as a newcomer would run them: every fenced `sh` block, in
//! order, in one bash session (a server started in one block serves the next), with `set -e`
//! so that any command that fails fails the test.
//!
//! What the test adds, and only this:
//! - `sce` on the `PATH` is the binary under test, and `SCE_BIN` tells `scripts/demo.sh` and
//!   `scripts/install.sh` to use it rather than build the release binary;
//! - `bash scripts/demo.sh` runs with `--seconds 2` (the demo's two 20 s phases would add
//!   40 s), and `bash scripts/test.sh` is not run (it is the command this test runs under);
//! - `/tmp/` and `mktemp` land in the test's temporary directory;
//! - after a command put in the background (`&`), a wait until it is ready: the socket of its
//!   `--listen unix:PATH`, or the file of an `nbdfuse MOUNTPOINT/FILE` mount;
//! - a block whose preceding line is `<!-- readme-test: skip (REASON) -->` is not run, and
//!   is listed with its reason; only the kernel's NBD client is let off that way.

use std::path::Path;
use std::process::Command;

/// The blocks of `readme`: each `sh` block's text and the reason it is skipped, if any.
fn blocks(readme: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut lines = readme.lines().peekable();
    let mut skip = None;
    while let Some(line) = lines.next() {
        if let Some(r) = line.strip_prefix("<!-- readme-test: skip (") {
            skip = Some(r.trim_end_matches(" -->").trim_end_matches(')').to_string());
            continue;
        }
        if line.trim() == "```sh" {
            let mut text = String::new();
            for l in lines.by_ref() {
                if l.trim() == "```" {
                    break;
                }
                text += l;
                text.push('\n');
            }
            out.push((text, skip.take()));
        } else if !line.trim().is_empty() {
            skip = None;
        }
    }
    out
}

/// One line of a block as the test runs it (see the module's list), or None to leave it out.
fn adapt(line: &str, tmp: &str) -> Option<String> {
    let cmd = line.split(" #").next().unwrap().trim_end();
    if cmd.trim() == "bash scripts/test.sh" {
        return None;
    }
    let mut cmd = cmd.replace("/tmp/", &format!("{tmp}/"));
    if cmd.trim() == "bash scripts/demo.sh" {
        cmd += " --seconds 2";
    }
    let mut out = cmd.clone();
    if let Some(bg) = cmd.trim().strip_suffix('&') {
        let words: Vec<&str> = bg.split_whitespace().collect();
        let ready = if let Some(p) = words
            .windows(2)
            .find(|w| w[0] == "--listen")
            .and_then(|w| w[1].strip_prefix("unix:"))
        {
            format!("-S {p}")
        } else if words.first() == Some(&"nbdfuse") {
            format!("-e {}", words[1])
        } else {
            panic!(
                "the README puts {bg:?} in the background: the test does not know when it is ready"
            );
        };
        out += &format!(
            "\nfor i in $(seq 600); do [ {ready} ] && break; sleep 0.1; done; [ {ready} ]"
        );
    }
    Some(out)
}

#[test]
fn every_command_of_the_readme_runs() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let d = tempfile::tempdir().unwrap();
    let tmp = d.path().to_str().unwrap();
    let bin = env!("CARGO_BIN_EXE_sce");
    let mut script = format!(
        "set -euo pipefail\nexport PATH={}:$PATH\ncd {root}\n\
         trap 'for m in {tmp}/tmp.*/mnt; do fusermount3 -uz \"$m\" 2>/dev/null || true; done; \
         kill $(jobs -p) 2>/dev/null || true' EXIT\n",
        Path::new(bin).parent().unwrap().display()
    );
    let (mut ran, mut skipped) = (0, Vec::new());
    for (text, skip) in blocks(&readme) {
        if let Some(why) = skip {
            skipped.push(format!("{why}: {}", text.lines().next().unwrap_or("")));
            continue;
        }
        for line in text.lines() {
            if let Some(cmd) = adapt(line, tmp) {
                ran += !cmd.trim().is_empty() as usize;
                script += &cmd;
                script.push('\n');
            }
        }
    }
    for s in &skipped {
        eprintln!("skipped: {s}");
    }
    assert_eq!(
        skipped.len(),
        1,
        "only the kernel NBD client's block may be skipped: {skipped:?}"
    );
    assert!(skipped[0].contains("kernel module"), "{skipped:?}");
    assert!(ran >= 30, "{ran} commands in the README's blocks");
    let out = Command::new("bash")
        .args(["-c", &script])
        .env_remove("SCE_CTL")
        .env("SCE_BIN", bin)
        .env("TMPDIR", tmp)
        .env("SCE_LOG", "warn")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "the README failed:\n{script}\n{said}\n{err}"
    );
    // What each part shows, as the README says it does.
    for want in [
        "speed-up",               // the demo's summary
        "13 man pages",           // the staged install
        "export-size: 268435456", // nbdinfo of the walk's volume
        "the volume has them",
        "the same bytes",
        "occupancy",
        "64.00 MiB of 64.00 MiB now cached", // prefetch
        "detached",
        "attached",
    ] {
        assert!(
            said.contains(want) || err.contains(want),
            "no {want:?} in:\n{said}\n{err}"
        );
    }
    assert_eq!(said.matches("Images are identical.").count(), 3, "{said}");
    // Warm at once after the restart: most of its first read pass hit.
    let ratio: f64 = said
        .rsplit("\"read_hit_ratio\":")
        .next()
        .and_then(|s| s.trim().trim_end_matches(',').split_whitespace().next())
        .and_then(|n| n.trim_end_matches(',').parse().ok())
        .expect("the restarted server's read_hit_ratio");
    assert!(
        ratio >= 0.5,
        "read hit ratio {ratio} right after the restart"
    );
}
