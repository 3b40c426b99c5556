//! Ownership of regions in shared mode (issue 31, docs/SHARED.md "Ownership"): a host that
//! writes a region alone owns it and writes without etcd while the others read it from the
//! source; ownership moves between writers that take turns; two writers at once fall back
//! to publishing every write (and every host caches again); an owner paused past its lease
//! with writes in flight has them fenced. Every read is checked against the log of
//! acknowledged writes, as in shared.rs.

mod common;

use common::coherence::*;
use common::Server;
use sce_nbd::NbdClient;
use sce_testkit::wait_until;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn num(s: &Server, k: &str) -> u64 {
    shared_of(s)[k].as_u64().unwrap_or(0)
}

/// Two hosts over the file, in shared mode with regions released after `idle`.
fn two_hosts(g: &Ground, prefix: &str, idle: &str) -> Vec<(Server, Arc<NbdClient>)> {
    let url = g.etcd.url(prefix);
    let more = ["--ownership-idle", idle];
    let hosts: Vec<_> = (0..2)
        .map(|i| host_with(g.d.path(), i, g.src(), Some(&url), "always", &more))
        .collect();
    serving_again(&hosts);
    hosts
}

/// Runs, until `stop`, a reader on every host and a writer on each host `writer` says is
/// writing now, on the hot blocks.
fn turns(
    log: &Arc<Log>,
    clients: &[Arc<NbdClient>],
    writer: &(dyn Fn() -> Option<usize> + Sync),
    stop: &AtomicBool,
) {
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    std::thread::scope(|s| {
        for (h, c) in clients.iter().enumerate() {
            for writes in [false, true] {
                let (log, c) = (log.clone(), c.clone());
                s.spawn(move || {
                    let mut r = SmallRng::seed_from_u64(h as u64 * 2 + writes as u64 + 100);
                    let mut buf = sce_io::AlignedBuf::new(8 * common::blocks::BLOCK as usize);
                    while !stop.load(SeqCst) {
                        let k = r.gen_range(1..=8u64);
                        let b0 = r.gen_range(0..HOT / 8 - k);
                        let data = &mut buf[..(k * common::blocks::BLOCK) as usize];
                        if !writes {
                            log.read(h, &c, b0, data);
                        } else if writer() == Some(h) {
                            log.write(&c, b0, data);
                        } else {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                });
            }
        }
    });
}

/// For `secs`, host `w` (or none) writes while both read.
fn phase(log: &Arc<Log>, clients: &[Arc<NbdClient>], w: Option<usize>, secs: f64) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_secs_f64(secs));
            stop.store(true, SeqCst);
        });
        turns(log, clients, &|| w, &stop);
    });
}

/// One writer: it owns the volume's region after its first write, writes with no etcd
/// call, and the other host reads the region from the source (fresh); once the writer
/// stops, the region is released and the other host caches it again.
#[test]
fn a_lone_writer_owns_its_region_and_the_other_host_reads_the_source() {
    let Some(g) = Ground::new() else { return };
    let hosts = two_hosts(&g, "sce-own-lone", "1s");
    let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
    let log = Arc::new(Log::new());
    phase(&log, &clients, Some(0), g.secs);
    assert_fresh(&log, "host 0 writing alone");
    let (h0, h1) = (&hosts[0].0, &hosts[1].0);
    eprintln!("host 0: {}\nhost 1: {}", shared_of(h0), shared_of(h1));
    assert!(log.writes_acked.load(SeqCst) > 0);
    assert_eq!(num(h0, "region_acquisitions"), 1, "{}", shared_of(h0));
    assert_eq!(num(h0, "writes_published"), 0, "{}", shared_of(h0));
    assert!(num(h0, "owned_writes") > 0);
    assert_eq!(num(h1, "regions_of_others"), 1, "{}", shared_of(h1));
    assert!(num(h1, "region_reads") > 0, "{}", shared_of(h1));
    // Released after the idle time: host 1 caches the region again.
    wait_until("the region was never released", 60, || {
        num(h0, "region_releases") >= 1 && num(h1, "regions_of_others") == 0
    });
    let hits = |s: &Server| s.export_stats()["read_pages_hit"].as_u64().unwrap();
    let before = hits(h1);
    wait_until("host 1 never hit after the release", 60, || {
        phase(&log, &clients, None, 0.5);
        hits(h1) > before
    });
    for (i, (_, c)) in hosts.iter().enumerate() {
        check_all(&log, i, c);
    }
    assert_fresh(&log, "after the release");
}

/// Two writers taking turns every 600 ms with a 200 ms idle time: ownership moves back
/// and forth (each host acquires the region again and again), readers on both hosts read
/// nothing stale. Then both write at once: the region falls back to publishing every
/// write, and both hosts cache it again.
#[test]
fn ownership_moves_between_writers_and_falls_back_when_both_write() {
    let Some(g) = Ground::new() else { return };
    let hosts = two_hosts(&g, "sce-own-turns", "200ms");
    let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
    let log = Arc::new(Log::new());
    for turn in 0..8 {
        phase(&log, &clients, Some(turn % 2), 0.6);
        assert_fresh(&log, &format!("turn {turn}"));
    }
    for (i, (s, _)) in hosts.iter().enumerate() {
        let sh = shared_of(s);
        eprintln!("host {i} after the turns: {sh}");
        assert!(num(s, "region_acquisitions") >= 2, "host {i}: {sh}");
        assert!(num(s, "owned_writes") > 0, "host {i}: {sh}");
    }
    // Both at once: contended, then every write published and both hosts hit.
    let hits = |s: &Server| s.export_stats()["read_pages_hit"].as_u64().unwrap();
    let before: Vec<u64> = hosts.iter().map(|h| hits(&h.0)).collect();
    let published: Vec<u64> = hosts
        .iter()
        .map(|h| num(&h.0, "writes_published"))
        .collect();
    let mut rounds = 0;
    while hosts.iter().zip(&before).any(|(h, b)| hits(&h.0) <= *b) {
        rounds += 1;
        assert!(rounds <= 20, "a host never hit with both writing");
        run_for(&log, &clients, 2, g.secs / 2.0, || {});
        assert_fresh(&log, "both writing");
    }
    for (i, (s, _)) in hosts.iter().enumerate() {
        assert!(
            num(s, "writes_published") > published[i],
            "host {i}: {}",
            shared_of(s)
        );
        eprintln!("host {i} after both wrote: {}", shared_of(s));
    }
    for (i, (_, c)) in hosts.iter().enumerate() {
        check_all(&log, i, c);
    }
    assert_fresh(&log, "at rest");
}

/// The owner is SIGSTOPped past its lease (2 s) while its writer has writes in flight; the
/// other host writes the same blocks meanwhile (it takes the region once the lease lapsed)
/// and both hosts read throughout. After SIGCONT no read anywhere is stale: the paused
/// owner's late writes failed (fenced) or were announced before they were acknowledged.
#[test]
fn an_owner_paused_past_its_lease_is_fenced() {
    let Some(g) = Ground::new() else { return };
    let hosts = two_hosts(&g, "sce-own-pause", "1s");
    let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
    let log = Arc::new(Log::new());
    phase(&log, &clients, Some(0), 2.0);
    assert!(num(&hosts[0].0, "owned_writes") > 0);
    let pid = hosts[0].0.pid() as i32;
    let writer = std::sync::atomic::AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let paused_at = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            // The writer of host 0 is in the middle of its stream of writes.
            // SAFETY: kill(2) on the pid of a child this test started; no memory involved.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            writer.store(1, SeqCst);
            std::thread::sleep(Duration::from_secs(6));
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGCONT) };
            std::thread::sleep(Duration::from_secs(1));
            writer.store(0, SeqCst);
            std::thread::sleep(Duration::from_secs(4));
            stop.store(true, SeqCst);
        });
        turns(&log, &clients, &|| Some(writer.load(SeqCst)), &stop);
    });
    eprintln!("paused and resumed over {:?}", paused_at.elapsed());
    assert_fresh(&log, "owner paused past its lease, then continued");
    serving_again(&hosts);
    for (i, (_, c)) in hosts.iter().enumerate() {
        check_all(&log, i, c);
    }
    assert_fresh(&log, "at rest after the pause");
    let (h0, h1) = (shared_of(&hosts[0].0), shared_of(&hosts[1].0));
    eprintln!(
        "host 0: {h0}\nhost 1: {h1}\nwrites acknowledged {}, failed {}",
        log.writes_acked.load(SeqCst),
        log.writes_failed.load(SeqCst)
    );
    assert!(num(&hosts[1].0, "region_acquisitions") >= 1, "{h1}");
}

/// A hand-off under load, as a VM moves: host 0 writes its region and both hosts read;
/// the writer stops (the VM is paused on host 0), `handoff --to h1` moves the region to
/// host 1 while the readers go on, then the writer runs on host 1, whose writes are owned
/// at once (no acquisition); no read is stale.
#[test]
fn handoff_under_load_moves_the_region_and_its_heat() {
    let Some(g) = Ground::new() else { return };
    let hosts = two_hosts(&g, "sce-own-handoff", "10s");
    let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
    let log = Arc::new(Log::new());
    phase(&log, &clients, Some(0), 2.0);
    assert_eq!(num(&hosts[0].0, "regions_owned"), 1);
    let writer = std::sync::atomic::AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let sock = g.d.path().join("s0");
    std::thread::scope(|s| {
        let handed = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(500));
            writer.store(2, SeqCst);
            let out = common::ctl_output(&sock, &["--json", "handoff", "", "--to", "h1"]);
            // The VM runs on host 1 now.
            writer.store(1, SeqCst);
            std::thread::sleep(Duration::from_secs(3));
            stop.store(true, SeqCst);
            out
        });
        turns(&log, &clients, &|| Some(writer.load(SeqCst)), &stop);
        let out = handed.join().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{out:?}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["regions_moved"], 1, "{text}");
        assert!(v["fragments"].as_u64().unwrap() > 0, "{text}");
    });
    assert_fresh(&log, "hand-off under load");
    let (h0, h1) = (&hosts[0].0, &hosts[1].0);
    wait_until("host 1 never prefetched the hand-off", 60, || {
        num(h1, "handoffs_received") == 1
    });
    eprintln!("host 0: {}\nhost 1: {}", shared_of(h0), shared_of(h1));
    assert_eq!(num(h1, "handoff_regions"), 1, "{}", shared_of(h1));
    assert_eq!(num(h1, "region_acquisitions"), 0, "{}", shared_of(h1));
    assert!(num(h1, "owned_writes") > 0, "{}", shared_of(h1));
    assert_eq!(num(h0, "regions_of_others"), 1, "{}", shared_of(h0));
    for (i, (_, c)) in hosts.iter().enumerate() {
        check_all(&log, i, c);
    }
    assert_fresh(&log, "at rest after the hand-off");
}

/// Every host counts regions alike: a host with another `--region-size` is refused, naming
/// the volume's; a host with `--region-size 0` takes no region but honours the others' (it
/// reads a region another host owns from the source, and reads nothing stale).
#[test]
fn hosts_agree_on_the_region_size() {
    let Some(g) = Ground::new() else { return };
    let url = g.etcd.url("sce-own-size");
    let dir = g.d.path();
    let h0 = host_with(dir, 0, g.src(), Some(&url), "always", &[]);
    let cache = dir.join("cache-odd");
    let state = dir.join("state-odd");
    let odd = Server::try_start(
        &[
            "--source",
            g.src(),
            "--cache",
            cache.to_str().unwrap(),
            "--cache-size",
            "8MiB",
            "--allow-buffered",
            "--state-dir",
            state.to_str().unwrap(),
            "--shared",
            &url,
            "--host-name",
            "odd",
            "--region-size",
            "256MiB",
        ],
        &dir.join("s-odd"),
    );
    let err = odd
        .err()
        .expect("a host with another region size was not refused");
    assert!(err.contains("--region-size 1073741824"), "{err}");
    assert!(
        err.contains("(set by the first host that joined it)"),
        "{err}"
    );
    let h1 = host_with(
        dir,
        1,
        g.src(),
        Some(&url),
        "always",
        &["--region-size", "0"],
    );
    let hosts = vec![h0, h1];
    serving_again(&hosts);
    let clients: Vec<_> = hosts.iter().map(|h| h.1.clone()).collect();
    let log = Arc::new(Log::new());
    for turn in 0..4 {
        phase(&log, &clients, Some(turn % 2), 1.0);
        assert_fresh(&log, &format!("turn {turn}"));
    }
    let (s0, s1) = (&hosts[0].0, &hosts[1].0);
    eprintln!("host 0: {}\nhost 1: {}", shared_of(s0), shared_of(s1));
    assert_eq!(num(s1, "region_acquisitions"), 0, "{}", shared_of(s1));
    assert!(num(s1, "writes_published") > 0, "{}", shared_of(s1));
    assert!(num(s0, "region_acquisitions") >= 1, "{}", shared_of(s0));
    for (i, (_, c)) in hosts.iter().enumerate() {
        check_all(&log, i, c);
    }
    assert_fresh(&log, "at rest");
}
