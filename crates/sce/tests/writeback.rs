//! Write-back through `sce serve` (issue 15): SIGKILL at random moments under verifying
//! writers, restarts that bring every acknowledged write back, and `sce ctl flush
//! --to-source` after which the source file alone holds them all.

mod common;

use common::blocks::{decode, BLOCK};
use common::num;
use std::path::Path;
use std::process::Command;

fn ctl(sock: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .arg("ctl")
        .arg("-s")
        .arg(format!("{}.ctl", sock.display()))
        .args(args)
        .env_remove("SCE_CTL")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn sigkill_in_writeback_loses_nothing_and_flush_to_source_fills_the_source() {
    let iterations: u32 = std::env::var("SCE_WB_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let d = tempfile::tempdir().unwrap();
    let (src, cache, sock) = (
        d.path().join("src"),
        d.path().join("cache"),
        d.path().join("s"),
    );
    let args = [
        "--source",
        src.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
        "--cache-size",
        "8MiB",
        "--fragment-size",
        "256KiB",
        "--metadata-interval",
        "50ms",
        "--mode",
        "writeback",
        "--allow-buffered",
    ];
    let r = common::blocks::kill_loop(&args, &src, &sock, iterations, 15);
    let sum = |v: &[serde_json::Value], k: &str| v.iter().map(|x| num(x, k)).sum::<u64>();
    let dirty_at_kill = sum(&r.at_kill, "writeback_dirty_bytes");
    let dirty_restored = sum(&r.after_restart, "writeback_dirty_bytes");
    let cleaned = sum(&r.at_kill, "writeback_cleaned_bytes");
    let kills_with_dirty = r
        .at_kill
        .iter()
        .filter(|x| num(x, "writeback_dirty_bytes") > 0)
        .count();
    assert_eq!(sum(&r.after_restart, "writeback_lost_bytes"), 0);
    assert!(
        kills_with_dirty > 0 && dirty_restored > 0,
        "never killed with dirty data"
    );
    assert!(cleaned > 0, "the cleaner never ran");
    // Everything to the source, then the source file alone holds every acknowledged write.
    let (ok, out) = ctl(&sock, &["flush", "--to-source"]);
    assert!(ok, "{out}");
    let (ok, out) = ctl(&sock, &["status"]);
    assert!(
        ok && out.contains("writeback") && out.contains("0 B dirty"),
        "{out}"
    );
    let st = r.server.export_stats();
    assert_eq!(num(&st, "writeback_dirty_bytes"), 0);
    let source = std::fs::read(&src).unwrap();
    let mut stale = 0;
    for (b, want) in r.model.iter().enumerate() {
        let got = decode(
            b as u64,
            &source[b * BLOCK as usize..(b + 1) * BLOCK as usize],
        );
        stale += (got != Some(want.acked)) as u64;
    }
    println!(
        "{iterations} SIGKILLs in writeback, {kills_with_dirty} with dirty data: {dirty_at_kill} \
         dirty bytes at the kills, {dirty_restored} restored dirty after them, {cleaned} bytes \
         written back by the cleaner before the kills, {} blocks with a write in flight at a \
         kill; after flush --to-source {stale} blocks of the source differ from the last \
         acknowledged writes",
        r.in_flight
    );
    assert_eq!(stale, 0, "the source misses acknowledged writes");
    assert!(r.server.term().success());
}
