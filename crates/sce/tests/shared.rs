//! Shared mode (issue 16): several `sce serve` over one source, coordinated through a real
//! three-member etcd cluster on loopback. Writers on different hosts write the same blocks,
//! readers everywhere check every read against the log of acknowledged writes with their
//! completion times: a read that starts after a write W was acknowledged may not return a
//! value W replaced (one whose write was acknowledged before W started).

mod common;

use common::blocks::{initial_source, BLOCK};
use common::coherence::*;
use common::Server;
use sce_io::{AlignedBuf, BlockDevice};
use sce_nbd::NbdClient;
use sce_testkit::wait_until;
use std::path::Path;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Three hosts over one file: zero stale reads while writers on two hosts write the same
/// blocks and readers read them everywhere; with one etcd member killed; with etcd gone
/// (every host passes reads through within the lease time, writes fail); with etcd back
/// (hits again); and after one host is killed, others write, and it restarts on its cache
/// (it catches up, not forgets). A plain cache of the same file is refused meanwhile.
#[test]
fn three_hosts_over_one_file_never_read_stale() {
    let Some(mut g) = Ground::new() else { return };
    let (d, src_s, secs, etcd) = (&g.d, g.src.to_str().unwrap(), g.secs, &mut g.etcd);
    let url = etcd.url("sce-test");
    let log = Arc::new(Log::new());
    let mut hosts: Vec<_> = (0..3)
        .map(|i| host(d.path(), i, src_s, Some(&url)))
        .collect();
    let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
    refused_plain_cache(d.path(), src_s);
    // Steady, then one etcd member killed halfway.
    run_for(&log, &clients, 2, secs, || {
        std::thread::sleep(Duration::from_secs_f64(secs / 2.0));
        etcd.kill(0);
    });
    assert_fresh(&log, "steady, one etcd member killed");
    for (i, (s, _)) in hosts.iter().enumerate() {
        let st = s.export_stats();
        let sh = &st["shared"];
        eprintln!("host {i}: read hits {}, shared {sh}", st["read_pages_hit"]);
        assert!(
            st["read_pages_hit"].as_u64().unwrap() > 0,
            "host {i} never hit"
        );
        assert!(sh["invalidations_received"].as_u64().unwrap() > 0, "{sh}");
    }
    assert!(log.writes_acked.load(SeqCst) > 0);
    // etcd gone: every host stops serving hits (within the lease time; no claim on how
    // soon), reads stay fresh, writes fail.
    etcd.stop_all();
    let stopped = Instant::now();
    for (i, (s, _)) in hosts.iter().enumerate() {
        wait_until(&format!("host {i} still serves hits"), 60, || {
            shared_of(s)["serving_hits"] == false
        });
    }
    // Reported, not asserted (a loaded machine may be slow to poll).
    eprintln!(
        "every host passed reads through {:?} after etcd stopped (lease 2 s)",
        stopped.elapsed()
    );
    let passed = |hosts: &[(Server, Arc<NbdClient>)]| -> u64 {
        hosts
            .iter()
            .map(|h| shared_of(&h.0)["passthrough_reads"].as_u64().unwrap())
            .sum()
    };
    let passed_before = passed(&hosts);
    run_for(&log, &clients, 2, secs / 2.0, || {});
    assert_fresh(&log, "etcd stopped");
    assert!(passed(&hosts) > passed_before, "no read passed through");
    // etcd back: hits again, reads fresh.
    etcd.start_all();
    serving_again(&hosts);
    let hits_before = hosts[0].0.export_stats()["read_pages_hit"]
        .as_u64()
        .unwrap();
    let acked = log.writes_acked.load(SeqCst);
    run_for(&log, &clients, 2, secs, || {});
    assert_fresh(&log, "etcd back");
    assert!(
        log.writes_acked.load(SeqCst) > acked,
        "no write succeeded after etcd came back"
    );
    assert!(
        hosts[0].0.export_stats()["read_pages_hit"]
            .as_u64()
            .unwrap()
            > hits_before
    );
    // Host 2 killed; the others write; host 2 restarts on its cache and reads no old bytes.
    let (h2, c2) = hosts.pop().unwrap();
    drop(c2);
    h2.kill();
    run_for(&log, &clients[..2], 2, secs / 2.0, || {});
    hosts.push(host(d.path(), 2, src_s, Some(&url)));
    serving_again(&hosts);
    for (i, (_, c)) in hosts.iter().enumerate() {
        check_all(&log, i, c);
    }
    assert_fresh(&log, "after host 2 restarted");
    let sh = shared_of(&hosts[2].0);
    assert_eq!(
        sh["forgotten"], 0,
        "host 2 forgot instead of catching up: {sh}"
    );
    eprintln!(
        "{} reads checked, {} writes acknowledged, {} failed; host 2 after its restart: {sh}",
        log.reads.load(SeqCst),
        log.writes_acked.load(SeqCst),
        log.writes_failed.load(SeqCst)
    );
}

/// A cache of the file outside shared mode is refused while shared hosts serve it: it
/// would never hear of their writes.
fn refused_plain_cache(dir: &Path, src: &str) {
    let cache = dir.join("plain-cache");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["serve", "--source", src, "--cache"])
        .arg(&cache)
        .args(["--cache-size", "8MiB", "--allow-buffered", "--listen"])
        .arg(format!("unix:{}", dir.join("plain.sock").display()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("in use"), "{err}");
}

/// The same with two hosts over an nbdkit export of the file, after the control: three
/// plain caches over it serve stale data under the same load (so the check can fail).
#[test]
fn hosts_over_nbdkit_never_read_stale_and_plain_caches_do() {
    if !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let Some(g) = Ground::new() else { return };
    let (d, src, secs) = (&g.d, &g.src, g.secs);
    let ksock = d.path().join("k.sock");
    let mut nbdkit = std::process::Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "-U"])
        .arg(&ksock)
        .arg("file")
        .arg(src)
        .spawn()
        .unwrap();
    common::wait_for(&ksock);
    let uri = format!("nbd+unix:///?socket={}", ksock.display());
    {
        let log = Arc::new(Log::new());
        let plain = d.path().join("plain");
        std::fs::create_dir(&plain).unwrap();
        let hosts: Vec<_> = (0..3).map(|i| host(&plain, i, &uri, None)).collect();
        let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
        run_for(&log, &clients, 2, secs, || {});
        let stale = log.stale().len();
        eprintln!(
            "without shared mode: {stale} stale reads of {}",
            log.reads.load(SeqCst)
        );
        assert!(
            stale > 0,
            "without shared mode no read was stale: the load tests nothing"
        );
    }
    initial_source(src, SIZE);
    let url = g.etcd.url("sce-nbdkit");
    let log = Arc::new(Log::new());
    let hosts: Vec<_> = (0..2)
        .map(|i| host(d.path(), i, &uri, Some(&url)))
        .collect();
    let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
    run_for(&log, &clients, 2, secs, || {});
    assert_fresh(&log, "two hosts over nbdkit");
    for (i, (s, c)) in hosts.iter().enumerate() {
        check_all(&log, i, c);
        let st = s.export_stats();
        assert!(
            st["read_pages_hit"].as_u64().unwrap() > 0,
            "host {i} never hit"
        );
        eprintln!(
            "host {i}: read hits {}, shared {}",
            st["read_pages_hit"], st["shared"]
        );
    }
    assert_fresh(&log, "two hosts over nbdkit, at rest");
    // Host 1 back on its cache: serving again, nothing it reads stale, and caught up from
    // the stream (some ranges dropped) rather than forgetting the volume.
    let restart_host_1 = |hosts: &mut Vec<(Server, Arc<NbdClient>)>, after: &str| {
        hosts.push(host(d.path(), 1, &uri, Some(&url)));
        serving_again(hosts);
        check_all(&log, 1, &hosts[1].1);
        assert_fresh(&log, &format!("host 1 restarted after {after}"));
        let sh = shared_of(&hosts[1].0);
        eprintln!("host 1 restarted after {after}: {sh}");
        assert_eq!(sh["forgotten"], 0, "{sh}");
        assert!(
            sh["dropped_bytes"].as_u64().unwrap() > 0,
            "nothing to catch up on: {sh}"
        );
    };
    // Host 1 killed at rest (its records written), host 0 writes, host 1 restarts on its
    // cache: an NBD source looks the same after the writes, so only the invalidations it
    // catches up on keep it from the old bytes.
    // Host 1 reads the hot blocks first (32 KiB at a time, out of order: no stream), so
    // host 0's writes land on pages it has cached.
    let mut hosts = hosts;
    let mut buf = AlignedBuf::new(8 * BLOCK as usize);
    for i in 0..HOT / 8 {
        let b0 = (i * 37) % (HOT / 8) * 8;
        let start = Instant::now();
        hosts[1].1.read_at(b0 * BLOCK, &mut buf).unwrap();
        for (j, d) in buf.chunks(BLOCK as usize).enumerate() {
            log.check(1, b0 + j as u64, start, d);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let (h1, c1) = hosts.pop().unwrap();
    drop(c1);
    h1.kill();
    // Host 0's writes wait for the killed host's lease to expire (on a slow machine, for
    // all of a pass): the load goes on until some were acknowledged after the kill.
    let acked = log.writes_acked.load(SeqCst);
    for _ in 0..10 {
        run_for(&log, &clients[..1], 1, secs / 2.0, || {});
        if log.writes_acked.load(SeqCst) >= acked + 20 {
            break;
        }
    }
    let after_kill = log.writes_acked.load(SeqCst) - acked;
    assert!(
        after_kill >= 20,
        "host 0 wrote {after_kill} times after the kill"
    );
    eprintln!("host 0 wrote {after_kill} times after host 1 was killed");
    restart_host_1(&mut hosts, "host 0 wrote");
    // Host 1 stopped cleanly (SIGTERM) with the hot blocks cached: it leaves, so host 0's
    // writes do not wait for it (none fails); restarted, it catches up from the revision
    // its shutdown saved.
    let both = [clients[0].clone(), hosts[1].1.clone()];
    run_for(&log, &both, 1, secs / 2.0, || {});
    assert_fresh(&log, "host 1 back in the load");
    let (h1, c1) = hosts.pop().unwrap();
    drop(c1);
    assert!(h1.term().success());
    let failed = log.writes_failed.load(SeqCst);
    run_for(&log, &clients[..1], 1, secs / 2.0, || {});
    assert_eq!(
        log.writes_failed.load(SeqCst),
        failed,
        "writes failed after host 1 left"
    );
    restart_host_1(&mut hosts, "a clean stop");
    drop(hosts);
    let _ = nbdkit.kill();
    let _ = nbdkit.wait();
}

/// One host cut off from etcd (a proxy in front of each member stops carrying its
/// connections) while the other keeps it: the cut-off host stops serving hits by its own
/// lease clock, the other's writes go ahead once that lease has expired, and no read on
/// either host is stale; when the connection is back, the host catches up before it
/// serves hits again.
#[test]
fn a_host_cut_off_from_etcd_passes_through_then_catches_up() {
    let Some(g) = Ground::new() else { return };
    let (d, src_s, secs, etcd) = (&g.d, g.src(), g.secs, &g.etcd);
    let proxies: Vec<_> = etcd
        .endpoints
        .iter()
        .map(|e| sce_testkit::etcd::Proxy::start(e))
        .collect();
    let cut_url = format!(
        "etcd://{}/sce-cut",
        proxies
            .iter()
            .map(|p| p.endpoint.clone())
            .collect::<Vec<_>>()
            .join(",")
    );
    let log = Arc::new(Log::new());
    let hosts = [
        host(d.path(), 0, src_s, Some(&etcd.url("sce-cut"))),
        host(d.path(), 1, src_s, Some(&cut_url)),
    ];
    let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
    run_for(&log, &clients, 1, secs, || {});
    assert_fresh(&log, "both hosts connected");
    proxies.iter().for_each(|p| p.cut(true));
    wait_until("host 1 still serves hits while cut off", 60, || {
        shared_of(&hosts[1].0)["serving_hits"] == false
    });
    let acked = log.writes_acked.load(SeqCst);
    run_for(&log, &clients, 1, secs, || {});
    assert_fresh(&log, "host 1 cut off");
    assert!(
        log.writes_acked.load(SeqCst) > acked,
        "host 0 acknowledged no write while host 1 was cut off"
    );
    assert!(shared_of(&hosts[0].0)["serving_hits"] == true);
    proxies.iter().for_each(|p| p.cut(false));
    serving_again(&hosts);
    run_for(&log, &clients, 1, secs, || {});
    for (i, (_, c)) in hosts.iter().enumerate() {
        check_all(&log, i, c);
    }
    assert_fresh(&log, "host 1 back");
    eprintln!(
        "host 0: {}\nhost 1: {}",
        shared_of(&hosts[0].0),
        shared_of(&hosts[1].0)
    );
}

/// `sce ctl handoff`: the receiving host prefetches what the sender caches; `status` shows
/// shared mode; `detach` and a hand-off to oneself are refused.
#[test]
fn handoff_warms_the_receiving_host_and_detach_is_refused() {
    let Some(g) = Ground::new() else { return };
    let d = &g.d;
    let url = g.etcd.url("sce-handoff");
    let hosts: Vec<_> = (0..2)
        .map(|i| host(d.path(), i, g.src(), Some(&url)))
        .collect();
    let log = Log::new();
    serving_again(&hosts);
    // Host 0 reads the first 4 MiB until it caches some of it.
    let mut buf = AlignedBuf::new(MIB as usize);
    wait_until("host 0 never cached anything", 120, || {
        for m in 0..4 {
            log.read(0, &hosts[0].1, m * MIB / BLOCK, &mut buf);
        }
        hosts[0].0.export_stats()["read_pages_hit"]
            .as_u64()
            .unwrap()
            > 0
    });
    let ctl = |i: usize, args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sce"))
            .args(["ctl", "-s"])
            .arg(d.path().join(format!("s{i}")))
            .args(args)
            .output()
            .unwrap()
    };
    let out = ctl(0, &["handoff", "", "--to", "h1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("handed off"),
        "{text}{:?}",
        out
    );
    wait_until("host 1 never prefetched the hand-off", 120, || {
        shared_of(&hosts[1].0)["handoffs_received"] == 1
    });
    let sh = shared_of(&hosts[1].0);
    assert!(sh["handoff_prefetched_bytes"].as_u64().unwrap() > 0, "{sh}");
    let out = ctl(1, &["exists", "0", "4MiB"]);
    assert!(out.status.success(), "{out:?}");
    let status = ctl(1, &["status"]);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("shared") && text.contains("as h1"), "{text}");
    for (args, why) in [
        (&["detach", ""][..], "shared mode"),
        (&["handoff", "", "--to", "h1"][..], "this host"),
    ] {
        let out = ctl(1, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(why),
            "{args:?}: {err}"
        );
    }
    check_all(&log, 1, &hosts[1].1);
    assert_fresh(&log, "after the hand-off");
}

/// The default admission (SCE's background population of the hottest fragments, which
/// races with writes and invalidations in other ways than `always`'s fills on misses): two
/// hosts writing and reading the same blocks, until both have hits and have dropped pages
/// for the other's writes; zero stale reads.
#[test]
fn background_population_stays_coherent() {
    let Some(g) = Ground::new() else { return };
    let secs = g.secs;
    let url = g.etcd.url("sce-population");
    let hosts: Vec<_> = (0..2)
        .map(|i| host_admitting(g.d.path(), i, g.src(), Some(&url), "sce"))
        .collect();
    let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
    let log = Arc::new(Log::new());
    let exercised = |h: &(Server, Arc<NbdClient>)| {
        let st = h.0.export_stats();
        st["read_pages_hit"].as_u64().unwrap() > 0
            && st["fragments_populated"].as_u64().unwrap() > 0
            && st["shared"]["dropped_bytes"].as_u64().unwrap() > 0
    };
    let mut rounds = 0;
    while !hosts.iter().all(exercised) {
        rounds += 1;
        assert!(
            rounds <= 20,
            "no hits, populations or drops after {rounds} rounds"
        );
        run_for(&log, &clients, 2, secs, || {});
        assert_fresh(&log, "background population");
    }
    for (i, (_, c)) in hosts.iter().enumerate() {
        check_all(&log, i, c);
    }
    assert_fresh(&log, "background population, at rest");
    for (s, _) in &hosts {
        let st = s.export_stats();
        eprintln!(
            "populated {} fragments, {} pages hit, shared {}",
            st["fragments_populated"], st["read_pages_hit"], st["shared"]
        );
    }
}
