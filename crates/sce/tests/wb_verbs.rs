//! Issue 44, as an operator meets it through `sce serve` and `sce ctl`: leaving write-back
//! and detaching end under a writer that never stops, and say how long they took; a drain
//! stops, leaving the mode as it was, when its client goes away; a live switch into
//! write-back on a device without a log is refused with the commands that give it one; a
//! start refused after `--discard-dirty` says it dropped nothing; write-back on a cache
//! made with the defaults goes through the log, and a stop keeps dirty data in the log
//! without draining it (issue 45); `sce check` says what a
//! start does with metadata units damaged in both copies on a device with a log. Each
//! fails on the main before issue 44 (the first: the switch never ends while the writer
//! runs; the hang guard here is two minutes).

mod common;

use common::{ctl, nbdkit, sized_file, unix_client, Server};
use sce_io::BlockDevice;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

fn page(p: u64, tag: u8) -> Vec<u8> {
    let mut b = vec![tag; PAGE as usize];
    b[..8].copy_from_slice(&p.to_le_bytes());
    b
}

/// `sce ctl ARGS` with a bound: Err after `limit` (the child killed).
fn ctl_within(sock: &Path, args: &[&str], limit: Duration) -> Result<(bool, String), String> {
    let mut child = Command::new(common::sce_bin())
        .arg("ctl")
        .arg("-s")
        .arg(format!("{}.ctl", sock.display()))
        .args(args)
        .env_remove("SCE_CTL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            return Ok((st.success(), text));
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("sce ctl {args:?} did not end within {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A server over an nbdkit memory source whose writes take `wdelay`, in write-back with an
/// 8 MiB log.
fn slow_writeback(d: &Path, wdelay: &str) -> (common::Nbdkit, Server) {
    let kit = nbdkit(
        &d.join("src.sock"),
        &[
            "--filter=delay",
            "memory",
            "64M",
            &format!("wdelay={wdelay}"),
        ],
        true,
    );
    let s = writeback_server(d, &kit.uri);
    (kit, s)
}

/// Leaving write-back, then detaching, while one writer (QD1, a FLUSH every 32 writes)
/// writes without a pause over a source with 5 ms writes: both end (the main before kept
/// draining as the writer dirtied), their replies say how long they took, and every write
/// reads back.
#[test]
fn leaving_write_back_and_detach_end_under_a_writer_that_never_stops() {
    let d = tempfile::tempdir().unwrap();
    let (_kit, s) = slow_writeback(d.path(), "5ms");
    let sock = d.path().join("s.sock");
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let writer = {
        let (stop, writes, sock) = (stop.clone(), writes.clone(), sock.clone());
        std::thread::spawn(move || {
            let c = unix_client(&sock, 1);
            let mut last = vec![0u8; 4096];
            let mut x = 0x9e37_79b9_u64;
            while !stop.load(Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let p = x % 4096;
                let tag = 1 + (writes.load(Relaxed) % 250) as u8;
                c.write_at(p * PAGE, &page(p, tag)).unwrap();
                last[p as usize] = tag;
                if writes.fetch_add(1, Relaxed) % 32 == 31 {
                    c.flush().unwrap();
                }
            }
            c.flush().unwrap();
            last
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    let limit = Duration::from_secs(120);
    let (ok, out) = ctl_within(&sock, &["set", "", "mode", "writethrough"], limit).unwrap();
    assert!(ok, "{out}");
    assert!(out.contains("written to the source first, in"), "{out}");
    println!("leaving writeback under the writer: {out}");
    let (ok, out) = ctl_within(&sock, &["set", "", "mode", "writeback"], limit).unwrap();
    assert!(ok, "{out}");
    std::thread::sleep(Duration::from_secs(2));
    let (ok, out) = ctl_within(&sock, &["detach", ""], limit).unwrap();
    assert!(ok && out.contains("detached"), "{out}");
    println!("detach under the writer: {out}");
    let n = writes.load(Relaxed);
    std::thread::sleep(Duration::from_millis(500));
    assert!(writes.load(Relaxed) > n, "the writer stopped");
    stop.store(true, Relaxed);
    let last = writer.join().unwrap();
    let c = unix_client(&sock, 1);
    let mut b = vec![0u8; PAGE as usize];
    for (p, &tag) in last.iter().enumerate() {
        c.read_at(p as u64 * PAGE, &mut b).unwrap();
        let want = if tag == 0 {
            vec![0; 4096]
        } else {
            page(p as u64, tag)
        };
        assert!(b == want, "page {p}");
    }
    drop(c);
    drop(s);
}

/// A drain whose `sce ctl` goes away stops: the export stays in write-back, with its dirty
/// data, and says so in its log.
#[test]
fn a_drain_whose_client_goes_away_stops_and_the_mode_stays() {
    let d = tempfile::tempdir().unwrap();
    let (_kit, s) = slow_writeback(d.path(), "200ms");
    let sock = d.path().join("s.sock");
    let c = unix_client(&sock, 1);
    // 1,024 scattered pages (half the log): 13 s of single-page writes, 16 at once, to a
    // source whose writes take 200 ms.
    for k in 0..1024u64 {
        let p = k * 7 % 16384;
        c.write_at(p * PAGE, &page(p, 3)).unwrap();
    }
    c.flush().unwrap();
    let mut child = Command::new(common::sce_bin())
        .arg("ctl")
        .arg("-s")
        .arg(format!("{}.ctl", sock.display()))
        .args(["set", "", "mode", "writethrough"])
        .env_remove("SCE_CTL")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    child.kill().unwrap();
    child.wait().unwrap();
    let t0 = Instant::now();
    while !s.log().contains("the drain was cancelled") {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", s.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let (ok, out) = ctl(&sock, &["status"]);
    assert!(ok && out.contains("writeback"), "{out}");
    let mut b = vec![0u8; PAGE as usize];
    for k in (0..1024u64).step_by(31) {
        let p = k * 7 % 16384;
        c.read_at(p * PAGE, &mut b).unwrap();
        assert!(b == page(p, 3), "page {p}");
    }
}

/// `sce ctl set "" mode writeback` on a cache formatted without a log (`--writeback-log
/// 0`, or by an sce before issue 45) switches, and the reopen gives the device a log,
/// formatted afresh (before issue 45 it was refused; before that it went to the slot path,
/// whose torn overwrites lost flushed pages at a power cut).
#[test]
fn a_live_switch_into_write_back_without_a_log_gives_the_device_one() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    sized_file(&src, 32 * MIB);
    let sock = d.path().join("s.sock");
    let cache = d.path().join("cache");
    let args = [
        "--source",
        src.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
        "--cache-size",
        "48MiB",
        "--writeback-log",
        "0",
        "--state-dir",
        d.path().to_str().unwrap(),
        "--allow-buffered",
    ];
    let s = Server::start(&args, &sock);
    let c = unix_client(&sock, 1);
    c.write_at(0, &vec![0x3cu8; 64 * 1024]).unwrap();
    c.flush().unwrap();
    drop(c);
    let (ok, out) = ctl(&sock, &["set", "", "mode", "writeback"]);
    assert!(ok, "not switched: {out}");
    let (_, st) = ctl(&sock, &["status"]);
    assert!(st.contains("writeback"), "{st}");
    // Through the log: the write is dirty in it, and reads back.
    let c = unix_client(&sock, 1);
    c.write_at(64 * 1024, &vec![0x3du8; 64 * 1024]).unwrap();
    c.flush().unwrap();
    let mut b = vec![0u8; 128 * 1024];
    c.read_at(0, &mut b).unwrap();
    assert!(b[..65536].iter().all(|&x| x == 0x3c) && b[65536..].iter().all(|&x| x == 0x3d));
    drop(c);
    assert!(
        s.log().contains("formatted afresh with a write-back log"),
        "{}",
        s.log()
    );
    let st = s.export_stats();
    assert!(
        st["writeback_log_commits"].as_u64() > Some(0),
        "not through the log: {st}"
    );
    assert!(s.term().success());
}

/// Issue 45, as a new user reaches write-back: a cache `sce serve` formats with its
/// defaults, served in write-through, is switched live with `sce ctl set "" mode writeback`,
/// and one `sce format` made with its defaults is served in `--mode writeback`: both write
/// through the log (`sce check` counts the dirty pages in it), neither falls back to the
/// slots (the main before: the first was refused, having no log; the second served from the
/// slots with a warning, slower than the source alone).
#[test]
fn write_back_on_a_cache_made_with_the_defaults_goes_through_the_log() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    sized_file(&src, 32 * MIB);
    let (src_s, dir) = (src.to_str().unwrap(), d.path().to_str().unwrap());
    let served = d.path().join("served.cache");
    let formatted = d.path().join("formatted.cache");
    let f = Command::new(common::sce_bin())
        .args(["format", formatted.to_str().unwrap(), "--source", src_s])
        .args(["--cache-size", "48MiB"])
        .output()
        .unwrap();
    assert!(f.status.success(), "{f:?}");
    for (cache, live) in [(&served, true), (&formatted, false)] {
        let sock = d.path().join("s.sock");
        let mut args = vec!["--source", src_s, "--cache", cache.to_str().unwrap()];
        args.extend([
            "--cache-size",
            "48MiB",
            "--state-dir",
            dir,
            "--allow-buffered",
        ]);
        if !live {
            args.extend(["--mode", "writeback"]);
        }
        let s = Server::start(&args, &sock);
        if live {
            let (ok, out) = ctl(&sock, &["set", "", "mode", "writeback"]);
            assert!(ok, "{out}");
        }
        let c = unix_client(&sock, 1);
        for p in 0..32 {
            c.write_at(p * PAGE, &page(p, 7)).unwrap();
        }
        c.flush().unwrap();
        drop(c);
        let log = s.log();
        assert!(!log.contains("without a write-back log"), "{log}");
        s.kill();
        let check = Command::new(common::sce_bin())
            .args(["check", cache.to_str().unwrap()])
            .output()
            .unwrap();
        let check = String::from_utf8_lossy(&check.stdout).to_string();
        assert!(check.contains("write-back log: 12.00 MiB"), "{check}");
        assert!(check.contains("in the log: 32 dirty, 0 lost"), "{check}");
    }
}

/// Issue 45: a stop (SIGTERM) makes the dirty data durable and leaves it in the log, not
/// drained: a unit's stop timeout could never cover draining a large cache over a slow
/// source. The source (writes of 500 ms) holds few of the pages after the stop; the next
/// start serves them all from the log.
#[test]
fn a_stop_keeps_dirty_data_in_the_log_without_draining_it() {
    let d = tempfile::tempdir().unwrap();
    let (kit, s) = slow_writeback(d.path(), "500ms");
    let sock = d.path().join("s.sock");
    let c = unix_client(&sock, 1);
    // 256 pages 64 KiB apart: no two coalesce into one source write.
    for p in 0..256 {
        c.write_at(p * 16 * PAGE, &page(p, 5)).unwrap();
    }
    c.flush().unwrap();
    drop(c);
    assert!(s.term().success());
    let src = sce_nbd::NbdClient::connect(&kit.uri.parse().unwrap(), 1).unwrap();
    let mut b = vec![0u8; PAGE as usize];
    let on_source = (0..256)
        .filter(|&p| {
            src.read_at(p * 16 * PAGE, &mut b).unwrap();
            b == page(p, 5)
        })
        .count();
    drop(src);
    assert!(
        on_source < 128,
        "the stop drained the log: {on_source} of 256 pages on the source"
    );
    let cache = d.path().join("cache");
    let check = Command::new(common::sce_bin())
        .args(["check", cache.to_str().unwrap()])
        .output()
        .unwrap();
    let check = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(check.contains("state clean"), "{check}");
    assert!(
        check.contains(&format!("in the log: {} dirty", 256 - on_source)),
        "{on_source} on the source: {check}"
    );
    let s = writeback_server(d.path(), &kit.uri);
    let c = unix_client(&sock, 1);
    for p in 0..256 {
        c.read_at(p * 16 * PAGE, &mut b).unwrap();
        assert!(b == page(p, 5), "page {p} after the restart");
    }
    drop(s);
}

/// `sce serve` of `source` in write-back, with an 8 MiB log, its cache and state in `d`.
fn writeback_server(d: &Path, source: &str) -> Server {
    writeback_server_with(d, source, &[])
}

/// `writeback_server` with `extra` arguments.
fn writeback_server_with(d: &Path, source: &str, extra: &[&str]) -> Server {
    let cache = d.join("cache");
    let mut args = vec![
        "--source",
        source,
        "--cache",
        cache.to_str().unwrap(),
        "--cache-size",
        "48MiB",
        "--writeback-log",
        "8MiB",
        "--mode",
        "writeback",
        "--state-dir",
        d.to_str().unwrap(),
        "--allow-buffered",
    ];
    args.extend_from_slice(extra);
    Server::start(&args, &d.join("s.sock"))
}

/// Two exports on one cache device in write-back, dirty data of both in the log, export
/// b's behind a's: a start without b that gives b's data up is refused (a's older pages
/// hold the log's anchor), and says it dropped nothing (the main before logged at ERROR
/// that it dropped b's pages).
#[test]
fn a_start_refused_after_discard_dirty_says_it_dropped_nothing() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    for n in ["a.img", "b.img"] {
        sized_file(&dir.join(n), 16 * MIB);
    }
    let cache = dir.join("cache");
    let toml = |both: bool| {
        let mut t = format!(
            "listen = [\"unix:{}\"]\n[[export]]\nname = \"a\"\nsource = \"{}\"\ncache = \"{}\"\n\
             cache_size = \"32MiB\"\nmode = \"writeback\"\n",
            dir.join("s.sock").display(),
            dir.join("a.img").display(),
            cache.display()
        );
        if both {
            t += &format!(
                "[[export]]\nname = \"b\"\nsource = \"{}\"\ncache = \"{}\"\nmode = \"writeback\"\n",
                dir.join("b.img").display(),
                cache.display()
            );
        }
        let p = dir.join(if both { "two.toml" } else { "one.toml" });
        std::fs::write(&p, t).unwrap();
        p
    };
    let serve = |cfg: &Path, extra: &[&str]| {
        let mut c = Command::new(common::sce_bin());
        c.arg("serve")
            .arg("--config")
            .arg(cfg)
            .args(["--state-dir", dir.to_str().unwrap(), "--allow-buffered"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    };
    let mut child = serve(&toml(true), &[]).spawn().unwrap();
    common::wait_for(&dir.join("s.sock"));
    for (name, tag) in [("a", 1u8), ("b", 2)] {
        let uri = format!("nbd+unix:///{name}?socket={}", dir.join("s.sock").display());
        let c = sce_nbd::NbdClient::connect(&uri.parse().unwrap(), 1).unwrap();
        for p in 0..8 {
            c.write_at(p * PAGE, &page(p, tag)).unwrap();
        }
        c.flush().unwrap();
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let b_name = std::fs::canonicalize(dir.join("b.img")).unwrap();
    let out = serve(&toml(false), &["--discard-dirty", b_name.to_str().unwrap()])
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("cannot be dropped yet"), "{log}");
    assert!(
        !log.contains("dropped 8") && !log.contains("drops 8"),
        "a refused start says it dropped data: {log}"
    );
}

/// `sce check` of a device with a log whose metadata units are damaged in both copies
/// says the start goes ahead (the dirty data lives in the log), as it does (the main
/// before said such a start is refused).
#[test]
fn check_says_a_log_device_with_damaged_units_starts() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    sized_file(&src, 32 * MIB);
    let cache = d.path().join("cache");
    let sock = d.path().join("s.sock");
    let args = [
        "--source",
        src.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
        "--cache-size",
        "48MiB",
        "--mode",
        "writeback",
        "--metadata-interval",
        "100ms",
        "--state-dir",
        d.path().to_str().unwrap(),
        "--allow-buffered",
    ];
    let s = Server::start(&args, &sock);
    // Clean data in the slots (their records in the units), dirty data in the log.
    let (ok, out) = ctl(&sock, &["prefetch", "0", "8MiB"]);
    assert!(ok, "{out}");
    let c = unix_client(&sock, 1);
    for p in 0..64 {
        c.write_at((4096 + p) * PAGE, &page(p, 4)).unwrap();
    }
    c.flush().unwrap();
    drop(c);
    std::thread::sleep(Duration::from_millis(300));
    assert!(s.term().success());
    let v: serde_json::Value = serde_json::from_slice(
        &Command::new(common::sce_bin())
            .args(["check", "--json"])
            .arg(&cache)
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let l = &v["superblock"]["layout"];
    let (units, unit, meta) = (
        l["units"].as_u64().unwrap(),
        l["unit_size"].as_u64().unwrap(),
        l["meta_offset"].as_u64().unwrap(),
    );
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&cache)
        .unwrap();
    use std::os::unix::fs::FileExt;
    for u in [0, units] {
        f.write_all_at(&[0xa5; 8], meta + u * unit + 100).unwrap();
    }
    drop(f);
    let out = Command::new(common::sce_bin())
        .arg("check")
        .arg(&cache)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("damaged in both copies"), "{text}");
    assert!(text.contains("which goes ahead"), "{text}");
    assert!(!text.contains("is refused"), "{text}");
    let s = Server::start(&args, &sock);
    let c = unix_client(&sock, 1);
    let mut b = vec![0u8; PAGE as usize];
    for p in 0..64 {
        c.read_at((4096 + p) * PAGE, &mut b).unwrap();
        assert!(b == page(p, 4), "page {p}");
    }
    drop(c);
    drop(s);
}

/// Issue 45: the cleaner's watermarks and rate, from the command line and `sce ctl set`,
/// shown by `status`; out-of-order or malformed values are refused and change nothing.
#[test]
fn the_cleaner_s_watermarks_and_rate_are_set_live_and_shown() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    sized_file(&src, 32 * MIB);
    let sock = d.path().join("s.sock");
    let s = writeback_server_with(
        d.path(),
        src.to_str().unwrap(),
        &["--writeback-rate", "16MiB"],
    );
    let wb = || {
        let (ok, out) = ctl(&sock, &["status", "--json"]);
        assert!(ok, "{out}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["exports"][0]["writeback"].clone()
    };
    let w = wb();
    assert_eq!(w["rate_bytes_per_second"], 16 << 20, "{w}");
    assert_eq!(w["low_watermark"], 0.25, "{w}");
    assert_eq!(w["high_watermark"], 0.75, "{w}");
    let (ok, out) = ctl(&sock, &["set", "", "writeback-low-watermark", "40%"]);
    assert!(
        ok && out.contains("cleaning from 40% (urgent above 75%)"),
        "{out}"
    );
    let (ok, out) = ctl(&sock, &["set", "", "writeback-rate", "unlimited"]);
    assert!(ok && out.contains("at unlimited"), "{out}");
    let w = wb();
    assert_eq!(
        (
            w["low_watermark"].as_f64(),
            w["rate_bytes_per_second"].as_u64()
        ),
        (Some(0.4), Some(0)),
        "{w}"
    );
    let (_, text) = ctl(&sock, &["status"]);
    assert!(
        text.contains("cleans from 40% of the log, urgently above 75%"),
        "{text}"
    );
    for (key, value) in [
        ("writeback-high-watermark", "30%"),
        ("writeback-low-watermark", "half"),
        ("writeback-rate", "fast"),
    ] {
        let (ok, out) = ctl(&sock, &["set", "", key, value]);
        assert!(!ok, "{key} {value} was taken: {out}");
    }
    assert_eq!(wb()["high_watermark"], 0.75);
    assert!(s.term().success());
}
