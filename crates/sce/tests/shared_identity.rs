//! Shared mode's host identity (issue 27, item 6) and its logging (item 10), with a real
//! etcd: a second server under a host name a live server holds is refused and told about
//! `--host-name` (two servers with one name read stale: each took the other's
//! invalidations for its own); the same host restarting on its own state directory is
//! recognised while its old lease still lives; the move into and out of passing reads
//! through during an etcd cut is logged once each.

mod common;

use common::blocks::{block, client, decode, BLOCK};
use common::Server;
use sce_io::BlockDevice;
use sce_testkit::wait_until;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SIZE: u64 = 4 << 20;

/// `sce serve` arguments of a host in shared mode: its cache, state directory and host
/// name, over the source `src`.
fn args(dir: &Path, src: &str, i: usize, url: &str, name: &str, ttl: &str) -> Vec<String> {
    let p = |s: &str| dir.join(format!("{s}{i}")).to_str().unwrap().to_string();
    [
        "--source",
        src,
        "--cache",
        &p("cache"),
        "--cache-size",
        "4MiB",
        "--fragment-size",
        "256KiB",
        "--admission",
        "always",
        "--allow-buffered",
        "--state-dir",
        &p("state"),
        "--shared",
        url,
        "--host-name",
        name,
        "--lease-ttl",
        ttl,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn start(a: &[String], sock: &Path) -> Server {
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    Server::start(&a, sock)
}

/// Block 0's counter as read through `sock`.
fn counter_of_block0(sock: &Path) -> u64 {
    let c = client(sock, 1);
    let mut buf = vec![0u8; BLOCK as usize];
    c.read_at(0, &mut buf).unwrap();
    decode(0, &buf).expect("block 0 is not a block")
}

/// What the server on `sock` caches of the volume's first 256 KiB (`sce ctl exists` on
/// its admin socket, `SOCK.ctl`).
fn cached_bytes(sock: &Path) -> u64 {
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["ctl", "-s"])
        .arg(format!("{}.ctl", sock.display()))
        .args(["--json", "exists", "0", "256KiB"])
        .env_remove("SCE_CTL")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["cached_bytes"].as_u64().unwrap_or(0)
}

/// The etcd cluster and the source file, or None (the test returns) without etcd outside CI.
fn ground() -> Option<(
    tempfile::TempDir,
    sce_testkit::etcd::Cluster,
    std::path::PathBuf,
)> {
    common::coherence::Ground::sized(SIZE).map(|g| (g.d, g.etcd, g.src))
}

/// Two servers on one machine under the same host name (as the machine's host name makes
/// them by default), each with its own cache and state directory: the second is refused,
/// naming --host-name, and never serves. The first stays coherent with a host of another
/// name: the repro's read, write elsewhere, read pattern returns the new bytes.
#[test]
fn a_second_server_under_a_live_host_name_is_refused() {
    let Some((d, etcd, src)) = ground() else {
        return;
    };
    let s = src.to_str().unwrap();
    let url = etcd.url("sce-same-name");
    let a = start(
        &args(d.path(), s, 0, &url, "vm", "2s"),
        &d.path().join("s0"),
    );
    refused_clone(d.path(), s, &url);
    // A clone that came with a copy of the state directory has the same host id: it is
    // refused all the same (the same id under another live lease is another process).
    std::fs::create_dir_all(d.path().join("state1")).unwrap();
    std::fs::copy(
        d.path().join("state0/shared-host.vm.id"),
        d.path().join("state1/shared-host.vm.id"),
    )
    .unwrap();
    refused_clone(d.path(), s, &url);
    // The first is unharmed: coherent with a host of its own name.
    let b = start(
        &args(d.path(), s, 2, &url, "other", "2s"),
        &d.path().join("s2"),
    );
    assert_eq!(counter_of_block0(&d.path().join("s2")), 0);
    let mut buf = vec![0u8; BLOCK as usize];
    block(0, 7, &mut buf);
    client(&d.path().join("s0"), 1).write_at(0, &buf).unwrap();
    assert_eq!(
        counter_of_block0(&d.path().join("s2")),
        7,
        "host \"other\" read stale"
    );
    drop((a, b));
}

/// A host killed and restarted on its own state directory is not refused: its old lease
/// (3 s) still lives, and the same id under another live lease may be a clone that came
/// with a copy of the state directory, so the restart waits for that lease to lapse, then
/// registers under the id kept in the state directory.
#[test]
fn a_host_restarting_on_its_own_state_dir_is_not_refused() {
    let Some((d, etcd, src)) = ground() else {
        return;
    };
    let s = src.to_str().unwrap();
    let url = etcd.url("sce-restart");
    let a = args(d.path(), s, 0, &url, "vm", "3s");
    let sock = d.path().join("s0");
    let first = start(&a, &sock);
    let id = first.export_stats()["shared"]["host_id"].clone();
    first.kill();
    let again = start(&a, &sock);
    assert_eq!(again.export_stats()["shared"]["host_id"], id);
    let kept = std::fs::read_to_string(d.path().join("state0/shared-host.vm.id")).unwrap();
    assert_eq!(serde_json::json!(kept.trim()), id);
    assert_eq!(counter_of_block0(&sock), 0);
}

/// Cut off from etcd, a host passes reads through: it says so once (WARN, with the
/// reason), however many reads pass through, and once (WARN) when it serves hits again;
/// both moves are counted. (A 5 s lease: a shorter
/// one can lapse on a loaded machine, which is one more stall, logged as such.)
#[test]
fn passing_reads_through_is_logged_once_in_and_once_out() {
    let Some((d, etcd, src)) = ground() else {
        return;
    };
    let s = src.to_str().unwrap();
    let proxies: Vec<_> = (etcd.endpoints.iter())
        .map(|e| sce_testkit::etcd::Proxy::start(e))
        .collect();
    let eps: Vec<_> = proxies.iter().map(|p| p.endpoint.clone()).collect();
    let url = format!("etcd://{}/sce-log", eps.join(","));
    let sock = d.path().join("s0");
    let h = start(&args(d.path(), s, 0, &url, "h0", "5s"), &sock);
    let shared = |k: &str| h.export_stats()["shared"][k].clone();
    wait_until("serving hits", 60, || shared("serving_hits") == true);
    let into = "shared volume: passing reads through";
    let out = "shared volume: serving hits again";
    let count = |what: &str| h.log().lines().filter(|l| l.contains(what)).count();
    proxies.iter().for_each(|p| p.cut(true));
    wait_until("passing reads through", 60, || {
        shared("serving_hits") == false
    });
    for _ in 0..20 {
        assert_eq!(counter_of_block0(&sock), 0);
    }
    eprintln!("passthrough reads: {}", shared("passthrough_reads"));
    let t0 = Instant::now();
    while count(into) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no WARN: {}",
            h.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    proxies.iter().for_each(|p| p.cut(false));
    wait_until("serving hits again", 60, || shared("serving_hits") == true);
    for _ in 0..20 {
        assert_eq!(counter_of_block0(&sock), 0);
    }
    wait_until("the serving-again WARN", 30, || count(out) > 0);
    // Once each per stall: a lease renewal that was late on this loaded machine may have
    // made one more (and said so), never one per read (20 passed through in the cut).
    let log = h.log();
    let (ins, outs) = (count(into), count(out));
    eprintln!("passthrough WARNs {ins}, serving-again WARNs {outs}");
    assert!(ins == outs && ins <= 3, "{log}");
    let why = "its lease is not valid by its own clock";
    assert!(
        log.lines()
            .any(|l| l.contains(into) && l.contains("WARN") && l.contains(why)),
        "{log}"
    );
    assert!(
        log.lines().any(|l| l.contains(out) && l.contains("WARN")),
        "{log}"
    );
    assert_eq!(shared("passthrough_entered"), ins as u64, "{log}");
}

/// Two servers that held one host name in turn (never at once, so neither was refused):
/// the revision one saved says nothing of the other's cache. B caches block 0 and stops;
/// A, under the same name with its own state directory, writes block 0 and stops (it saves
/// its revision under the name); B restarts on its cache: it must not catch up from A's
/// revision (it would skip A's write, which it never saw) but forget, and read A's write.
#[test]
fn a_revision_saved_under_the_name_by_another_id_is_not_caught_up_from() {
    let Some((d, etcd, src)) = ground() else {
        return;
    };
    let s = src.to_str().unwrap();
    if !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let url = etcd.url("sce-turns");
    let ksock = d.path().join("k.sock");
    let mut nbdkit = Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "-U"])
        .arg(&ksock)
        .args(["file", s])
        .spawn()
        .unwrap();
    common::wait_for(&ksock);
    let uri = format!("nbd+unix:///?socket={}", ksock.display());
    let (sa, sb) = (d.path().join("s0"), d.path().join("s1"));
    // Over NBD: a source whose changes the cache cannot see for itself (over the file, its
    // new mtime alone would drop B's cache at its restart).
    let pinned = |i| {
        let mut a = args(d.path(), &uri, i, &url, "vm", "2s");
        a.extend(["--source-generation".to_string(), "g1".to_string()]);
        a
    };
    let b_args = pinned(1);
    let b = start(&b_args, &sb);
    // Reads pass through until B serves hits; then one is cached.
    wait_until("B serving", 60, || {
        b.export_stats()["shared"]["serving_hits"] == true
    });
    wait_until("B caches block 0", 60, || {
        counter_of_block0(&sb) == 0 && cached_bytes(&sb) > 0
    });
    assert!(b.term().success());
    let a = start(&pinned(0), &sa);
    let mut buf = vec![0u8; BLOCK as usize];
    block(0, 7, &mut buf);
    client(&sa, 1).write_at(0, &buf).unwrap();
    assert!(a.term().success());
    let b = start(&b_args, &sb);
    let shared = |k: &str| b.export_stats()["shared"][k].clone();
    wait_until("serving hits", 60, || shared("serving_hits") == true);
    assert_eq!(counter_of_block0(&sb), 7, "B read stale: {}", b.log());
    assert_eq!(shared("forgotten"), 1, "{}", b.log());
    drop(b);
    let _ = nbdkit.kill();
    let _ = nbdkit.wait();
}

/// Starts a second server named "vm" (state directory 1) beside the live one and expects
/// it to be refused, naming --host-name, without ever listening.
fn refused_clone(d: &Path, s: &str, url: &str) {
    let sock1 = d.join("s1");
    let mut clone = Command::new(env!("CARGO_BIN_EXE_sce"))
        .arg("serve")
        .args(args(d, s, 1, url, "vm", "2s"))
        .args(["--listen", &format!("unix:{}", sock1.display())])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // It waits up to the lease time (2 s) for the name to lapse; a live holder renews it.
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = clone.try_wait().unwrap() {
            break Some(st);
        }
        if sock1.exists() || t0.elapsed() > Duration::from_secs(60) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let Some(status) = status else {
        let _ = clone.kill();
        let _ = clone.wait();
        panic!("a second server under host name \"vm\" started (or hung) beside a live one");
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut clone.stderr.take().unwrap(), &mut err).unwrap();
    eprintln!("refused in {:?}: {err}", t0.elapsed());
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("host name \"vm\" is registered by another live server")
            && err.contains("--host-name"),
        "{err}"
    );
}
