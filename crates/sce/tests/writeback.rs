//! Write-back through `sce serve` (issue 15): SIGKILL at random moments under verifying
//! writers, restarts that bring every acknowledged write back, and `sce ctl flush
//! --to-source` after which the source file alone holds them all.

mod common;

use common::blocks::{decode, BLOCK};
use common::num;
use std::path::Path;

/// `sce serve` of `source` in write-back, with a `size` cache of 256 KiB fragments at
/// `cache`, listening on `sock`.
fn writeback_server(source: &str, cache: &Path, size: &str, sock: &Path) -> common::Server {
    let cache = cache.to_str().unwrap();
    common::Server::start(
        &[
            "--source",
            source,
            "--cache",
            cache,
            "--cache-size",
            size,
            "--fragment-size",
            "256KiB",
            "--mode",
            "writeback",
            "--allow-buffered",
        ],
        sock,
    )
}

/// SIGKILLs in write-back, through the write-back log (issue 29; the only write-back since
/// issue 45): 100 kills by default (`SCE_WBLOG_KILLS`; the power cuts of
/// `sce-server/tests/powercut.rs` test the same path harder).
#[test]
fn sigkill_through_the_write_back_log_loses_nothing() {
    let iterations: u32 = common::env_or("SCE_WBLOG_KILLS", 100);
    let extra = ["--mode", "writeback"];
    kill_test("through the log", &extra, iterations);
}

/// The SIGKILL loop with `extra` arguments, then `flush --to-source`: the source file alone
/// holds every acknowledged write.
fn kill_test(name: &str, extra: &[&str], iterations: u32) {
    let d = tempfile::tempdir().unwrap();
    let r = common::blocks::kill_loop(d.path(), extra, iterations, 15);
    let (src, sock) = (&r.src, &r.sock);
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
    // The log served (it commits at every FLUSH).
    let commits = sum(&r.at_kill, "writeback_log_commits");
    assert!(commits > 0, "{commits} log commits {name}");
    // Everything to the source, then the source file alone holds every acknowledged write.
    let (ok, out) = common::ctl(sock, &["flush", "--to-source"]);
    assert!(ok, "{out}");
    let (ok, out) = common::ctl(sock, &["status"]);
    assert!(
        ok && out.contains("writeback") && out.contains("0 B dirty"),
        "{out}"
    );
    let st = r.server.export_stats();
    assert_eq!(num(&st, "writeback_dirty_bytes"), 0);
    let source = std::fs::read(src).unwrap();
    let mut stale = 0;
    for (b, want) in r.model.iter().enumerate() {
        let got = decode(
            b as u64,
            &source[b * BLOCK as usize..(b + 1) * BLOCK as usize],
        );
        stale += (got != Some(want.acked)) as u64;
    }
    println!(
        "{iterations} SIGKILLs in writeback {name}, {kills_with_dirty} with dirty data: {dirty_at_kill} \
         dirty bytes at the kills, {dirty_restored} restored dirty after them, {cleaned} bytes \
         written back by the cleaner before the kills, {} blocks with a write in flight at a \
         kill; after flush --to-source {stale} blocks of the source differ from the last \
         acknowledged writes",
        r.in_flight
    );
    assert_eq!(stale, 0, "the source misses acknowledged writes");
    assert!(r.server.term().success());
}

/// fio verify (randrw, QD16) in write-back with a cache smaller than the data, so dirty
/// data is cleaned and slots evicted all along; then flush --to-source, and the source
/// file reads exactly as the export. `SCE_WB_FIO_SECONDS` (default 30; the run:
/// 300).
#[test]
fn fio_verify_in_writeback_through_eviction_and_cleaning() {
    if !sce_testkit::require_known_tool("fio") {
        return;
    }
    let seconds: u64 = common::env_or("SCE_WB_FIO_SECONDS", 30);
    let d = tempfile::tempdir().unwrap();
    let (src, cache, sock) = (
        d.path().join("src"),
        d.path().join("cache"),
        d.path().join("s"),
    );
    std::fs::File::create(&src)
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    let s = writeback_server(src.to_str().unwrap(), &cache, "16MiB", &sock);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let load = [
        "--rw=randrw",
        "--iodepth=16",
        "--size=128M",
        "--time_based",
        &format!("--runtime={seconds}"),
        "--verify_backlog=4096",
    ];
    common::fio_verify(d.path(), &uri, &load);
    let st = s.export_stats();
    let (cleaned, waits) = (
        num(&st, "writeback_cleaned_bytes"),
        num(&st, "writeback_waits"),
    );
    let evicted = num(&st, "fragments_evicted");
    assert!(cleaned > 0 && evicted > 0, "no cleaning or eviction: {st}");
    let (ok, out) = common::ctl(&sock, &["flush", "--to-source"]);
    assert!(ok, "{out}");
    // The export and the source file now agree byte for byte.
    let c = common::blocks::client(&sock, 1);
    let differ = mib_differing(&c, &std::fs::read(&src).unwrap());
    println!(
        "fio verify in writeback, {seconds} s, 16 MiB cache over 128 MiB: no verify error; \
         {cleaned} bytes cleaned, {evicted} fragments evicted, {waits} writes waited for room; \
         after flush --to-source {differ} MiB of the source differ from the export"
    );
    assert_eq!(differ, 0);
    assert!(s.term().success());
}

/// A source outage through `sce serve`: nbdkit's error filter fails every write to the
/// source while a flag file exists. Writes are absorbed until the cache is full of dirty
/// data, then wait (the writer does not finish, and status counts waits and cleaning
/// errors); when the source returns the cleaner drains it all, and the source, read
/// through nbdkit directly, holds every write.
#[test]
fn a_source_outage_through_nbdkit_is_absorbed_then_drained() {
    if !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (ksock, flag, cache, sock) = (
        d.path().join("src.sock"),
        d.path().join("outage"),
        d.path().join("cache"),
        d.path().join("s"),
    );
    std::fs::write(&flag, b"").unwrap();
    let kit = common::nbdkit_with_outage(&ksock, &flag, "32M");
    let src_uri = kit.uri.clone();
    let s = writeback_server(&src_uri, &cache, "8MiB", &sock);
    // 16 MiB of writes, twice what the cache holds, from a thread.
    let mut data = vec![0u8; 16 << 20];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[i % 8];
    }
    let data = std::sync::Arc::new(data);
    let writer = {
        let (c, data) = (common::blocks::client(&sock, 2), data.clone());
        std::thread::spawn(move || {
            for (k, chunk) in data.chunks(256 << 10).enumerate() {
                sce_io::BlockDevice::write_at(&c, (k as u64) << 18, chunk).expect("a write failed");
            }
        })
    };
    // Until writes wait and cleaning fails.
    let st = sce_testkit::poll("writes waiting and cleaning failing", 120, || {
        let st = s.export_stats();
        let both = num(&st, "writeback_waits") > 0 && num(&st, "writeback_clean_errors") > 0;
        if both {
            Ok(st)
        } else {
            Err(st.to_string())
        }
    });
    assert!(
        !writer.is_finished(),
        "every write went through during the outage"
    );
    let (ok, out) = common::ctl(&sock, &["status"]);
    assert!(ok && out.contains("clean errors"), "{out}");
    std::fs::remove_file(&flag).unwrap();
    writer.join().expect("the writer failed");
    let (ok, out) = common::ctl(&sock, &["flush", "--to-source"]);
    assert!(ok, "{out}");
    // The source itself, through nbdkit, holds every byte written.
    let uri: sce_nbd::NbdUri = src_uri.parse().unwrap();
    let src = sce_nbd::NbdClient::connect(&uri, 1).unwrap();
    let differ = mib_differing(&src, &data);
    println!(
        "source outage through nbdkit's error filter: {} dirty bytes absorbed, {} waits and \
         {} failed cleanings during it; after it, {differ} MiB of the source differ",
        num(&st, "writeback_dirty_bytes"),
        num(&st, "writeback_waits"),
        num(&st, "writeback_clean_errors")
    );
    assert_eq!(differ, 0);
    assert!(s.term().success());
}

/// The MiB of `dev` that differ from `want` (read from offset 0, 1 MiB at a time).
fn mib_differing(dev: &dyn sce_io::BlockDevice, want: &[u8]) -> u32 {
    let mut buf = sce_io::AlignedBuf::new(1 << 20);
    let mut differ = 0;
    for (k, chunk) in want.chunks(1 << 20).enumerate() {
        dev.read_at((k as u64) << 20, &mut buf[..chunk.len()])
            .unwrap();
        differ += (buf[..chunk.len()] != chunk[..]) as u32;
    }
    differ
}
