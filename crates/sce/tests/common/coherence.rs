//! Shared mode's test ground (crates/sce/tests/shared*.rs): a log of every acknowledged
//! write with its times, against which each read is checked (a read that starts after a
//! write W was acknowledged may not return a value W replaced), the load of writers and
//! readers on several hosts, and the hosts themselves over a three-member etcd.

use super::blocks::{block, client, decode, initial_source, BLOCK};
use super::{env_or, Server};
use parking_lot::Mutex;
use sce_io::{AlignedBuf, BlockDevice};
use sce_nbd::NbdClient;
use sce_testkit::wait_until;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const MIB: u64 = 1 << 20;
/// The volume: 16 MiB of self-describing blocks.
pub const SIZE: u64 = 16 * MIB;
/// The blocks the load works on (the rest is read once at the end).
pub const HOT: u64 = 1024;

/// One write of a block: its counter, when it was sent, when it was acknowledged (None: it
/// failed or is in flight; such a write never makes another value stale), and when it
/// failed, if it did.
#[derive(Clone, Copy)]
pub struct Write {
    pub counter: u64,
    pub start: Instant,
    pub end: Option<Instant>,
    pub failed: Option<Instant>,
}

/// Every write of every block, and the stale reads found.
pub struct Log {
    pub t0: Instant,
    pub blocks: Vec<Mutex<Vec<Write>>>,
    pub counter: AtomicU64,
    pub stale: Mutex<Vec<String>>,
    /// Reads torn between values each of which the read could have returned (see `check`).
    pub torn: Mutex<Vec<String>>,
    pub reads: AtomicU64,
    pub writes_acked: AtomicU64,
    pub writes_failed: AtomicU64,
}

impl Log {
    pub fn new() -> Log {
        Log {
            t0: Instant::now(),
            blocks: (0..SIZE / BLOCK).map(|_| Mutex::new(Vec::new())).collect(),
            counter: AtomicU64::new(1),
            stale: Mutex::new(Vec::new()),
            torn: Mutex::new(Vec::new()),
            reads: AtomicU64::new(0),
            writes_acked: AtomicU64::new(0),
            writes_failed: AtomicU64::new(0),
        }
    }

    /// Checks a read of block `b` that started at `start` and returned `data`: stale if
    /// its value was replaced by a write acknowledged before the read started. A block
    /// that does not decode is stale too, unless each of its 8-byte words is a word of a
    /// value the read could have returned whole (the block-device contract for a read that
    /// overlaps a write: the source here, a buffered file behind nbdkit or `sce serve`,
    /// copies a page while another request copies it); those are counted in `torn`.
    pub fn check(&self, host: usize, b: u64, start: Instant, data: &[u8]) {
        self.reads.fetch_add(1, SeqCst);
        let Some(c) = decode(b, data) else {
            let end = Instant::now();
            match self.torn_between(b, start, end, data) {
                Ok(values) => self.torn.lock().push(format!(
                    "host {host}: block {b} torn between {values:?}, read at {:?}",
                    start - self.t0
                )),
                Err(what) => self
                    .stale
                    .lock()
                    .push(format!("host {host}: block {b} is torn or foreign: {what}")),
            }
            return;
        };
        let log = self.blocks[b as usize].lock();
        let Some((_, written, _)) = self.values(&log).find(|v| v.0 == c) else {
            drop(log);
            self.stale
                .lock()
                .push(format!("host {host}: block {b} holds {c}, never written"));
            return;
        };
        if let Some(msg) = written.and_then(|at| self.replaced(&log, b, c, at, start)) {
            drop(log);
            self.stale.lock().push(format!("host {host}: {msg}"));
        }
    }

    /// The values a block may hold, from its log: (counter, when it was acknowledged,
    /// when it was sent). Counter 0 is the initial content, acknowledged before all. A
    /// failed write may have reached the source: its value stands as from its failure, as an
    /// acknowledged one's does from its acknowledgement (until a later write is
    /// acknowledged); one in flight has no time yet, and makes no value stale.
    fn values<'a>(
        &self,
        log: &'a [Write],
    ) -> impl Iterator<Item = (u64, Option<Instant>, Instant)> + 'a {
        let initial = (0, Some(self.t0), self.t0);
        std::iter::once(initial).chain(log.iter().map(|w| (w.counter, w.end.or(w.failed), w.start)))
    }

    /// Why value `c` of block `b`, acknowledged at `written`, is stale for a read that
    /// started at `start`: a write started after it and acknowledged before the read.
    fn replaced(
        &self,
        log: &[Write],
        b: u64,
        c: u64,
        written: Instant,
        start: Instant,
    ) -> Option<String> {
        let w = log
            .iter()
            .find(|w| w.start > written && w.end.is_some_and(|e| e < start))?;
        Some(format!(
            "block {b} read {c} at {:?}, but {} was acknowledged at {:?}",
            start - self.t0,
            w.counter,
            w.end.unwrap() - self.t0
        ))
    }

    /// The values a block that does not decode is made of, if every 8-byte word of it is a
    /// word of a value a read from `start` to `end` could return whole (not replaced before
    /// it started, written before it ended); else what it holds, for the stale report.
    fn torn_between(
        &self,
        b: u64,
        start: Instant,
        end: Instant,
        data: &[u8],
    ) -> Result<Vec<u64>, String> {
        let log = self.blocks[b as usize].lock();
        let legit: Vec<(u64, Vec<u8>)> = self
            .values(&log)
            .filter(|&(c, acked, sent)| {
                sent < end && acked.is_none_or(|at| self.replaced(&log, b, c, at, start).is_none())
            })
            .map(|(c, _, _)| {
                let mut v = vec![0u8; BLOCK as usize];
                block(b, c, &mut v);
                (c, v)
            })
            .collect();
        drop(log);
        let mut used = Vec::new();
        for (i, word) in data.chunks(8).enumerate() {
            let at = i * 8..i * 8 + word.len();
            match legit.iter().find(|(_, v)| v[at.clone()] == *word) {
                Some((c, _)) if !used.contains(c) => used.push(*c),
                Some(_) => {}
                None => {
                    let idx = u64::from_le_bytes(data[..8].try_into().unwrap());
                    let c = u64::from_le_bytes(data[8..16].try_into().unwrap());
                    let could: Vec<u64> = legit.iter().map(|(c, _)| *c).collect();
                    return Err(format!(
                        "header block {idx} value {c}; byte {} is no word of the values it \
                         could read, {could:?}; read at {:?}",
                        i * 8,
                        start - self.t0
                    ));
                }
            }
        }
        Ok(used)
    }

    /// Writes blocks `b0..b0+k` through `c`, logged.
    pub fn write(&self, c: &NbdClient, b0: u64, buf: &mut [u8]) {
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
                    failed: None,
                });
                l.len() - 1
            })
            .collect();
        if c.write_at(b0 * BLOCK, buf).is_err() {
            let at = Instant::now();
            for (j, i) in idx.into_iter().enumerate() {
                self.blocks[b0 as usize + j].lock()[i].failed = Some(at);
            }
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
    pub fn read(&self, host: usize, c: &NbdClient, b0: u64, buf: &mut [u8]) {
        let start = Instant::now();
        if c.read_at(b0 * BLOCK, buf).is_err() {
            return;
        }
        for (j, d) in buf.chunks(BLOCK as usize).enumerate() {
            self.check(host, b0 + j as u64, start, d);
        }
    }

    pub fn stale(&self) -> Vec<String> {
        self.stale.lock().clone()
    }
}

/// The load: per host one reader (skewed to the first eighth of the hot blocks, so the
/// caches fill) and, on `writers` hosts, one writer, all on the same hot blocks, until
/// `stop`.
pub fn load(log: &Arc<Log>, clients: &[Arc<NbdClient>], writers: usize, stop: &Arc<AtomicBool>) {
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
pub fn run_for(
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
pub fn check_all(log: &Log, host: usize, c: &NbdClient) {
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
pub fn host(dir: &Path, i: usize, source: &str, url: Option<&str>) -> (Server, Arc<NbdClient>) {
    host_admitting(dir, i, source, url, "always")
}

/// `host` with admission policy `admission`.
pub fn host_admitting(
    dir: &Path,
    i: usize,
    source: &str,
    url: Option<&str>,
    admission: &str,
) -> (Server, Arc<NbdClient>) {
    host_with(dir, i, source, url, admission, &[])
}

/// `host_admitting` with more options for `sce serve`.
pub fn host_with(
    dir: &Path,
    i: usize,
    source: &str,
    url: Option<&str>,
    admission: &str,
    more: &[&str],
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
        // Shared mode is write-through: all 8 MiB are read slots, as these loads were
        // sized for (a log by default would take a quarter of so small a cache).
        "--writeback-log",
        "0",
        "--allow-buffered",
        "--state-dir",
        state.to_str().unwrap(),
    ];
    if let Some(u) = url {
        args.extend(["--shared", u, "--host-name", &name, "--lease-ttl", "2s"]);
    }
    args.extend(more);
    let s = Server::start(&args, &sock);
    let c = Arc::new(client(&sock, 2));
    (s, c)
}

pub fn shared_of(s: &Server) -> serde_json::Value {
    s.export_stats()["shared"].clone()
}

/// What every test stands on: a temporary directory, the volume's file (`src`, with its
/// initial content), a three-member etcd cluster, and the length of a load phase
/// (`SCE_SHARED_SECONDS`, default 6). None (the test returns) if etcd is missing outside CI.
pub struct Ground {
    pub d: tempfile::TempDir,
    pub src: std::path::PathBuf,
    pub etcd: sce_testkit::etcd::Cluster,
    pub secs: f64,
}

impl Ground {
    pub fn new() -> Option<Ground> {
        Ground::sized(SIZE)
    }

    /// `new` with a volume of `size` bytes.
    pub fn sized(size: u64) -> Option<Ground> {
        if !sce_testkit::require_known_tool("etcd") {
            return None;
        }
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        initial_source(&src, size);
        let etcd = sce_testkit::etcd::Cluster::start(&d.path().join("etcd"));
        Some(Ground {
            secs: env_or("SCE_SHARED_SECONDS", 6.0),
            d,
            src,
            etcd,
        })
    }

    pub fn src(&self) -> &str {
        self.src.to_str().unwrap()
    }
}

pub fn assert_fresh(log: &Log, what: &str) {
    let torn = log.torn.lock().clone();
    if !torn.is_empty() {
        eprintln!(
            "{what}: {} reads torn by a write in flight, first: {:?}",
            torn.len(),
            &torn[..torn.len().min(5)]
        );
    }
    let stale = log.stale();
    assert!(
        stale.is_empty(),
        "{what}: {} stale reads of {}, first: {:?}",
        stale.len(),
        log.reads.load(SeqCst),
        &stale[..stale.len().min(5)]
    );
}

/// Waits until every host serves hits (no claim on how soon).
pub fn serving_again(hosts: &[(Server, Arc<NbdClient>)]) {
    for (i, (s, _)) in hosts.iter().enumerate() {
        wait_until(&format!("host {i} does not serve hits"), 120, || {
            shared_of(s)["serving_hits"] == true
        });
    }
}
