//! Settings an operator changes at run time stay (`sce ctl set`, then detach and attach),
//! and write-back is entered and left on a running server: under an fio verify load (zero
//! verify errors, nothing dirty after leaving), and, leaving it, refusing with `--no-wait`
//! while the source cannot take the dirty data, or writing it there first.

mod common;

use common::{num, Server};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

/// `sce ctl -s SOCK --json ARGS`: its JSON, or the error it printed.
fn ctl(sock: &Path, args: &[&str]) -> Result<serde_json::Value, String> {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let out = common::ctl_output(sock, &a);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: {e}: {text}")))
}

fn ok(sock: &Path, args: &[&str]) -> serde_json::Value {
    ctl(sock, args).unwrap_or_else(|e| panic!("sce ctl {args:?}: {e}"))
}

/// The export's status line of `sce ctl status`.
fn status(sock: &Path) -> serde_json::Value {
    ok(sock, &["status"])["exports"][0].clone()
}

/// A server of `source` cached on a device with a write-back log, in write-through.
fn serve(d: &Path, source: &str, sock: &Path) -> Server {
    Server::start(
        &[
            "--source",
            source,
            "--cache",
            d.join("cache").to_str().unwrap(),
            "--cache-size",
            "48MiB",
            "--writeback-log",
            "8MiB",
            "--state-dir",
            d.to_str().unwrap(),
        ],
        sock,
    )
}

/// What `set` changed comes back with an attach, and what is set while detached is what
/// the attach opens with; both replies say which settings are in effect.
#[test]
fn settings_stay_across_detach_and_attach() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    common::sized_file(&src, 32 << 20);
    let sock = d.path().join("s.sock");
    let s = serve(d.path(), src.to_str().unwrap(), &sock);
    ok(&sock, &["set", "", "mode", "writearound"]);
    let set = ok(&sock, &["set", "", "admission", "nhit:2"]);
    assert_eq!(set["mode"], "writearound", "{set}");
    ok(&sock, &["detach", ""]);
    let att = ok(&sock, &["attach", ""]);
    assert_eq!(
        (&att["mode"], &att["admission"], &att["settings_kept"]),
        (&"writearound".into(), &"nhit:2".into(), &true.into()),
        "{att}"
    );
    let st = status(&sock);
    assert_eq!(
        (&st["mode"], &st["admission"]),
        (&att["mode"], &att["admission"])
    );
    // Set while detached: kept for the attach, and the reply says so.
    ok(&sock, &["detach", ""]);
    let set = ok(&sock, &["set", "", "mode", "passthrough"]);
    assert_eq!(
        (&set["mode"], &set["detached"]),
        (&"passthrough".into(), &true.into())
    );
    let att = ok(&sock, &["attach", ""]);
    assert_eq!(
        (&att["mode"], &att["admission"]),
        (&"passthrough".into(), &"nhit:2".into())
    );
    assert_eq!(status(&sock)["state"], "passthrough");
    assert!(s.term().success());
}

/// Write-back switched on and off again and again while fio writes and verifies: zero
/// verify errors, every switch reopened the volume, and nothing is dirty at the end.
#[test]
fn writeback_switched_on_and_off_under_fio_verify_load() {
    if !sce_testkit::require_known_tool("fio") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    common::sized_file(&src, 64 << 20);
    let sock = d.path().join("s.sock");
    let s = serve(d.path(), src.to_str().unwrap(), &sock);
    let done = Arc::new(AtomicBool::new(false));
    let (dn, sk) = (done.clone(), sock.clone());
    let operator = std::thread::spawn(move || {
        let (mut rounds, mut drained) = (0u64, 0u64);
        while !dn.load(Relaxed) {
            let on = ok(&sk, &["set", "", "mode", "writeback"]);
            assert_eq!(
                (&on["mode"], &on["reopened"]),
                (&"writeback".into(), &true.into())
            );
            std::thread::sleep(std::time::Duration::from_millis(300));
            let off = ok(&sk, &["set", "", "mode", "writethrough"]);
            assert_eq!(
                (&off["mode"], &off["reopened"]),
                (&"writethrough".into(), &true.into())
            );
            drained += off["drained_bytes"].as_u64().unwrap();
            rounds += 1;
        }
        (rounds, drained)
    });
    common::fio_verify_rounds(d.path(), &sock);
    done.store(true, Relaxed);
    let (rounds, drained) = operator.join().unwrap_or_else(|_| {
        let log = s.log();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        panic!(
            "the operator failed; the server logged:\n{}",
            tail.join("\n")
        )
    });
    eprintln!("{rounds} switches into write-back and out; {drained} bytes drained on the way out");
    assert!(rounds >= 1);
    let st = status(&sock);
    assert_eq!(st["mode"], "writethrough", "{st}");
    assert!(
        st.get("writeback").is_none(),
        "no write-back state left: {st}"
    );
    assert_eq!(num(&s.export_stats(), "cache_checksum_errors"), 0);
    assert!(s.term().success());
}

/// Leaving write-back while the source refuses writes (nbdkit's error filter, while a flag
/// file exists): `--no-wait` refuses at once and says how much is dirty; once the source
/// takes writes again, leaving writes the dirty data there first, and the source, read
/// through nbdkit directly, holds it.
#[test]
fn leaving_writeback_refuses_or_drains_as_asked() {
    if !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (ksock, flag, sock) = (
        d.path().join("k.sock"),
        d.path().join("outage"),
        d.path().join("s.sock"),
    );
    let kit = common::nbdkit_with_outage(&ksock, &flag, "32M");
    let s = serve(d.path(), &kit.uri, &sock);
    ok(&sock, &["set", "", "admission", "nhit:2"]);
    ok(&sock, &["set", "", "mode", "writeback"]);
    std::fs::write(&flag, b"").unwrap();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let c = common::unix_client(&sock, 1);
    sce_io::BlockDevice::write_at(&c, 4 << 20, &data).unwrap();
    sce_io::BlockDevice::flush(&c).unwrap();
    let err = ctl(&sock, &["set", "", "mode", "writethrough", "--no-wait"]).unwrap_err();
    assert!(err.contains("write-back data the source lacks"), "{err}");
    assert_eq!(status(&sock)["mode"], "writeback");
    std::fs::remove_file(&flag).unwrap();
    let off = ok(&sock, &["set", "", "mode", "writethrough"]);
    assert_eq!(
        (&off["mode"], &off["admission"], &off["reopened"]),
        (&"writethrough".into(), &"nhit:2".into(), &true.into()),
        "{off}"
    );
    assert!(status(&sock).get("writeback").is_none());
    let direct = common::unix_client(&ksock, 1);
    let mut back = vec![0u8; data.len()];
    sce_io::BlockDevice::read_at(&direct, 4 << 20, &mut back).unwrap();
    assert!(back == data, "the source holds what was dirty");
    drop((c, direct));
    assert!(s.term().success());
}

/// A switch whose reopen fails in both modes (the cache's path is no longer a cache: here a
/// directory took its place) leaves the export detached, serving from its source, and the
/// device marked so: after writes while detached, a restart on the device put back starts
/// cold and serves those writes, never the pages the cache held before. The source is an
/// nbdkit memory disk, whose changes sce cannot see by itself: only the mark tells.
#[test]
fn a_reopen_that_fails_leaves_the_export_detached_and_the_device_untrusted() {
    if !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let ksock = d.path().join("k.sock");
    let kit = common::nbdkit(&ksock, &["memory", "32M"], false);
    let src = kit.uri.clone();
    let (cache, away) = (d.path().join("cache"), d.path().join("cache.away"));
    let sock = d.path().join("s.sock");
    let s = serve(d.path(), &src, &sock);
    let c = common::unix_client(&sock, 1);
    let old = vec![0x11u8; 65536];
    sce_io::BlockDevice::write_at(&c, 1 << 20, &old).unwrap();
    let p = ok(&sock, &["prefetch", "0", "4MiB"]);
    assert_eq!(p["cached_bytes"], 4 << 20, "{p}");
    std::fs::rename(&cache, &away).unwrap();
    std::fs::create_dir(&cache).unwrap();
    let err = ctl(&sock, &["set", "", "mode", "writeback"]).unwrap_err();
    assert!(err.contains("detached"), "{err}");
    assert_eq!(status(&sock)["state"], "detached");
    // Served from the source while detached.
    let new = vec![0x22u8; 65536];
    sce_io::BlockDevice::write_at(&c, 1 << 20, &new).unwrap();
    drop(c);
    assert!(s.term().success());
    std::fs::remove_dir(&cache).unwrap();
    std::fs::rename(&away, &cache).unwrap();
    let s = serve(d.path(), &src, &sock);
    let c = common::unix_client(&sock, 1);
    let mut b = vec![0u8; 65536];
    sce_io::BlockDevice::read_at(&c, 1 << 20, &mut b).unwrap();
    assert!(
        b == new,
        "the restart served what the cache held before the detach"
    );
    assert_eq!(num(&s.export_stats(), "persist_fragments_restored"), 0);
    drop(c);
    assert!(s.term().success());
}
