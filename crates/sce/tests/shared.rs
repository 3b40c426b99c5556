//! Shared mode (issue 16): several `sce serve` over one source, coordinated through a real
//! three-member etcd cluster on loopback. Writers on different hosts write the same blocks,
//! readers everywhere check every read against the log of acknowledged writes with their
//! completion times: a read that starts after a write W was acknowledged may not return a
//! value W replaced (one whose write was acknowledged before W started).

mod common;

use common::blocks::{block, client, decode, initial_source, BLOCK};
use common::{env_or, Server};
use parking_lot::Mutex;
use sce_io::{AlignedBuf, BlockDevice};
use sce_nbd::NbdClient;
use sce_testkit::wait_until;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The volume: 16 MiB of self-describing blocks.
const SIZE: u64 = 16 * MIB;
/// The blocks the load works on (the rest is read once at the end).
const HOT: u64 = 1024;

/// One write of a block: its counter, when it was sent, when it was acknowledged (None: it
/// failed or is in flight; such a write never makes another value stale).
#[derive(Clone, Copy)]
struct Write {
    counter: u64,
    start: Instant,
    end: Option<Instant>,
}

/// Every write of every block, and the stale reads found.
struct Log {
    t0: Instant,
    blocks: Vec<Mutex<Vec<Write>>>,
    counter: AtomicU64,
    stale: Mutex<Vec<String>>,
    reads: AtomicU64,
    writes_acked: AtomicU64,
    writes_failed: AtomicU64,
}

impl Log {
    fn new() -> Log {
        Log {
            t0: Instant::now(),
            blocks: (0..SIZE / BLOCK).map(|_| Mutex::new(Vec::new())).collect(),
            counter: AtomicU64::new(1),
            stale: Mutex::new(Vec::new()),
            reads: AtomicU64::new(0),
            writes_acked: AtomicU64::new(0),
            writes_failed: AtomicU64::new(0),
        }
    }

    /// Checks a read of block `b` that started at `start` and returned `data`: stale if
    /// its value was replaced by a write acknowledged before the read started.
    fn check(&self, host: usize, b: u64, start: Instant, data: &[u8]) {
        self.reads.fetch_add(1, SeqCst);
        let Some(c) = decode(b, data) else {
            self.stale
                .lock()
                .push(format!("host {host}: block {b} is torn or foreign"));
            return;
        };
        let log = self.blocks[b as usize].lock();
        // The value's write (counter 0: the initial content, acknowledged before all).
        let written = if c == 0 {
            Some(self.t0)
        } else {
            match log.iter().find(|w| w.counter == c) {
                Some(w) => w.end,
                None => {
                    drop(log);
                    self.stale
                        .lock()
                        .push(format!("host {host}: block {b} holds {c}, never written"));
                    return;
                }
            }
        };
        let Some(written) = written else { return };
        if let Some(w) = log
            .iter()
            .find(|w| w.start > written && w.end.is_some_and(|e| e < start))
        {
            let msg = format!(
                "host {host}: block {b} read {c} at {:?}, but {} was acknowledged at {:?}",
                start - self.t0,
                w.counter,
                w.end.unwrap() - self.t0
            );
            drop(log);
            self.stale.lock().push(msg);
        }
    }

    /// Writes blocks `b0..b0+k` through `c`, logged.
    fn write(&self, c: &NbdClient, b0: u64, buf: &mut [u8]) {
        let k = buf.len() as u64 / BLOCK;
        let n = self.counter.fetch_add(1, SeqCst);
        for j in 0..k {
            let at = (j * BLOCK) as usize..((j + 1) * BLOCK) as usize;
            block(b0 + j, n, &mut buf[at]);
        }
        let start = Instant::now();
        let idx: Vec<usize> = (0..k)
            .map(|j| {
                let mut l = self.blocks[(b0 + j) as usize].lock();
                l.push(Write {
                    counter: n,
                    start,
                    end: None,
                });
                l.len() - 1
            })
            .collect();
        if c.write_at(b0 * BLOCK, buf).is_err() {
            self.writes_failed.fetch_add(1, SeqCst);
            return;
        }
        let end = Instant::now();
        for (j, i) in idx.into_iter().enumerate() {
            self.blocks[b0 as usize + j].lock()[i].end = Some(end);
        }
        self.writes_acked.fetch_add(1, SeqCst);
    }

    /// Reads blocks `b0..b0+k` through `c` and checks them.
    fn read(&self, host: usize, c: &NbdClient, b0: u64, buf: &mut [u8]) {
        let start = Instant::now();
        if c.read_at(b0 * BLOCK, buf).is_err() {
            return;
        }
        for (j, d) in buf.chunks(BLOCK as usize).enumerate() {
            self.check(host, b0 + j as u64, start, d);
        }
    }

    fn stale(&self) -> Vec<String> {
        self.stale.lock().clone()
    }
}

/// The load: per host one reader (skewed to the first eighth of the hot blocks, so the
/// caches fill) and, on `writers` hosts, one writer, all on the same hot blocks, until
/// `stop`.
fn load(log: &Arc<Log>, clients: &[Arc<NbdClient>], writers: usize, stop: &Arc<AtomicBool>) {
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    std::thread::scope(|s| {
        for (h, c) in clients.iter().enumerate() {
            for writer in [false, true] {
                if writer && h >= writers {
                    continue;
                }
                let (log, c, stop) = (log.clone(), c.clone(), stop.clone());
                s.spawn(move || {
                    let mut r = SmallRng::seed_from_u64(h as u64 * 2 + writer as u64);
                    let mut buf = AlignedBuf::new(8 * BLOCK as usize);
                    while !stop.load(SeqCst) {
                        let k = r.gen_range(1..=8u64);
                        let span = if r.gen_bool(0.7) { HOT / 8 } else { HOT };
                        let b0 = r.gen_range(0..span - k);
                        let data = &mut buf[..(k * BLOCK) as usize];
                        if writer {
                            log.write(&c, b0, data);
                            std::thread::sleep(Duration::from_millis(r.gen_range(0..5)));
                        } else {
                            log.read(h, &c, b0, data);
                        }
                    }
                });
            }
        }
    });
}

/// Runs the load for `secs` seconds, with `during` called from another thread meanwhile.
fn run_for(
    log: &Arc<Log>,
    clients: &[Arc<NbdClient>],
    writers: usize,
    secs: f64,
    during: impl FnOnce() + Send,
) {
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        let st = stop.clone();
        s.spawn(move || {
            during();
            std::thread::sleep(Duration::from_secs_f64(secs));
            st.store(true, SeqCst);
        });
        load(log, clients, writers, &stop);
    });
}

/// Reads every block of the volume through `c` (no write runs) and checks each.
fn check_all(log: &Log, host: usize, c: &NbdClient) {
    let mut buf = AlignedBuf::new(MIB as usize);
    for chunk in 0..SIZE / MIB {
        let start = Instant::now();
        c.read_at(chunk * MIB, &mut buf).unwrap();
        for (j, d) in buf.chunks(BLOCK as usize).enumerate() {
            log.check(host, chunk * MIB / BLOCK + j as u64, start, d);
        }
    }
}

/// A host: `sce serve` of `source` with its own cache, in shared mode if `url` is given.
fn host(dir: &Path, i: usize, source: &str, url: Option<&str>) -> (Server, Arc<NbdClient>) {
    host_admitting(dir, i, source, url, "always")
}

/// `host` with admission policy `admission`.
fn host_admitting(
    dir: &Path,
    i: usize,
    source: &str,
    url: Option<&str>,
    admission: &str,
) -> (Server, Arc<NbdClient>) {
    let cache = dir.join(format!("cache{i}"));
    let sock = dir.join(format!("s{i}"));
    let name = format!("h{i}");
    // Each host keeps its id apart (the default, /var/lib/sce, is shared by every test).
    let state = dir.join(format!("state{i}"));
    let mut args = vec![
        "--source",
        source,
        "--cache",
        cache.to_str().unwrap(),
        "--cache-size",
        "8MiB",
        "--fragment-size",
        "256KiB",
        "--admission",
        admission,
        "--metadata-interval",
        "50ms",
        "--allow-buffered",
        "--state-dir",
        state.to_str().unwrap(),
    ];
    if let Some(u) = url {
        args.extend(["--shared", u, "--host-name", &name, "--lease-ttl", "2s"]);
    }
    let s = Server::start(&args, &sock);
    let c = Arc::new(client(&sock, 2));
    (s, c)
}

fn shared_of(s: &Server) -> serde_json::Value {
    s.export_stats()["shared"].clone()
}

/// What every test stands on: a temporary directory, the volume's file (`src`, with its
/// initial content), a three-member etcd cluster, and the length of a load phase
/// (`SCE_SHARED_SECONDS`, default 6). None (the test returns) if etcd is missing outside CI.
struct Ground {
    d: tempfile::TempDir,
    src: std::path::PathBuf,
    etcd: sce_testkit::etcd::Cluster,
    secs: f64,
}

impl Ground {
    fn new() -> Option<Ground> {
        if !sce_testkit::require_known_tool("etcd") {
            return None;
        }
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        initial_source(&src, SIZE);
        let etcd = sce_testkit::etcd::Cluster::start(&d.path().join("etcd"));
        Some(Ground {
            secs: env_or("SCE_SHARED_SECONDS", 6.0),
            d,
            src,
            etcd,
        })
    }

    fn src(&self) -> &str {
        self.src.to_str().unwrap()
    }
}

fn assert_fresh(log: &Log, what: &str) {
    let stale = log.stale();
    assert!(
        stale.is_empty(),
        "{what}: {} stale reads of {}, first: {:?}",
        stale.len(),
        log.reads.load(SeqCst),
        &stale[..stale.len().min(5)]
    );
}

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

/// Waits until every host serves hits (no claim on how soon).
fn serving_again(hosts: &[(Server, Arc<NbdClient>)]) {
    for (i, (s, _)) in hosts.iter().enumerate() {
        wait_until(&format!("host {i} does not serve hits"), 120, || {
            shared_of(s)["serving_hits"] == true
        });
    }
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
    let mut hosts = hosts;
    std::thread::sleep(Duration::from_millis(500));
    let (h1, c1) = hosts.pop().unwrap();
    drop(c1);
    h1.kill();
    run_for(&log, &clients[..1], 1, secs / 2.0, || {});
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
