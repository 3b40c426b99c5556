//! The README's commands, run as a newcomer would run them: every fenced `sh` block, in
//! order, in one bash session (a server started in one block serves the next), with `set -e`
//! so that any command that fails fails the test. The blocks wait for what they start in the
//! background themselves.
//!
//! What the test adds, and only this:
//! - `sce` on the `PATH` is the binary under test, and `SCE_BIN` tells `scripts/demo.sh` and
//!   `scripts/install.sh` to use it rather than build the release binary;
//! - `bash scripts/demo.sh` runs with `--seconds 2` (the demo's two 20 s phases would add
//!   40 s);
//! - `/tmp/` and `mktemp` land in the test's temporary directory;
//! - two things are not run, and are listed as such: `bash scripts/test.sh` (the command this
//!   test runs under), and the block whose preceding line is `<!-- readme-test: skip
//!   (REASON) -->`, the kernel NBD client's, which `the_kernel_nbd_client_block` (ignored:
//!   it needs root and the nbd module) runs on its own.

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
    Some(cmd)
}

/// The test's preamble: strict bash, the binary under test first on the `PATH`, the
/// repository as the working directory, and whatever the blocks leave running or mounted
/// taken down at the end.
fn preamble(root: &str, tmp: &str) -> String {
    format!(
        "set -euo pipefail\nexport PATH='{}':$PATH\ncd '{root}'\n\
         trap 'for m in {tmp}/tmp.*/mnt; do fusermount3 -uz \"$m\" 2>/dev/null || true; done; \
         kill $(jobs -p) 2>/dev/null || true' EXIT\n",
        Path::new(env!("CARGO_BIN_EXE_sce"))
            .parent()
            .unwrap()
            .display()
    )
}

#[test]
fn every_command_of_the_readme_runs() {
    // The walk's clients: missing, the test is skipped, or fails under CI=true.
    for tool in ["qemu-img", "nbdinfo", "nbdfuse", "fusermount3"] {
        if !sce_testkit::require_known_tool(tool) {
            return;
        }
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let d = tempfile::tempdir().unwrap();
    let tmp = d.path().to_str().unwrap();
    let bin = env!("CARGO_BIN_EXE_sce");
    let mut script = preamble(root, tmp);
    let (mut ran, mut skipped) = (0, Vec::new());
    for (text, skip) in blocks(&readme) {
        if let Some(why) = skip {
            skipped.push(format!("{why}: {}", text.lines().next().unwrap_or("")));
            continue;
        }
        for line in text.lines() {
            if line.trim() == "bash scripts/test.sh" {
                skipped.push("the test command itself: bash scripts/test.sh".to_string());
            }
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
        "of 64.00 MiB now cached", // prefetch
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

/// The README's block for the kernel's NBD client, after the walk's server: as root, with
/// the nbd module and nbd-client (`cargo test -p sce --test readme -- --ignored`).
#[test]
#[ignore = "needs root, the nbd kernel module and nbd-client: the README's kernel block"]
fn the_kernel_nbd_client_block() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let (kernel, _) = blocks(&readme)
        .into_iter()
        .find(|(_, skip)| skip.is_some())
        .expect("the kernel block");
    let d = tempfile::tempdir().unwrap();
    let tmp = d.path().to_str().unwrap();
    let script = format!(
        "{}cd \"$(mktemp -d)\"\nhead -c 64MiB /dev/urandom > volume.img\n\
         sce serve --source volume.img --cache cache.img --cache-size 64MiB --listen unix:sce.sock 2>sce.log &\n\
         while [ ! -S sce.sock ]; do sleep 0.1; done\n{kernel}",
        preamble(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."), tmp)
    );
    let out = Command::new("bash")
        .args(["-c", &script])
        .env("TMPDIR", tmp)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
