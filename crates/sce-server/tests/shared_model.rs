//! Shared mode's protocol in one process, in seconds (issue 49): three hosts (or up to
//! eight: `SCE_MODEL_HOSTS`), each running sce-server's real shared mode (`Coherence`:
//! membership, listener, tracker, batcher, region ownership, fencing) over its own memory
//! cache and one shared memory source, all coordinated through the in-memory etcd
//! (`sce_coord::MemEtcd`, on the real clock: a lease not renewed expires after its time,
//! counted from the last renewal the store received). A seeded schedule runs a random
//! workload of reads and writes on every host while it pauses hosts' etcd clients (calls
//! wait, or answers are late), partitions them, expires a partitioned host's lease once it
//! stopped counting on it (as the cluster would), compacts the history, and hands a host's
//! regions to another (`sce ctl handoff`). Five probes run between: one makes a host's
//! acknowledgements late while another host writes what it caches (a listener that
//! acknowledged before dropping would serve the old bytes); one stalls a host's owned write
//! in its source write, cuts it off until its lease is expired and another host caches the
//! block, then lets the write finish (a write let through past the fence would be
//! acknowledged over another host's cached copy); one brings a host back after its lease
//! expired and another wrote what it caches, its listener still cut off (a host that served
//! hits before catching up would serve the old bytes); one hands a host's regions to
//! another, which writes there as their owner (a host that did not count a region it handed
//! over as another's would serve the old bytes); one pauses a host past its lease's time
//! while another writes what it caches (a host that counted on its lease longer than the
//! store keeps it would serve the old bytes).
//!
//! Every read is checked against the model of acknowledged writes (`model/mod.rs`): it must
//! return the newest version acknowledged before it started, or one written since. Printed:
//! hosts, operations, reads checked, faults, each host's counters. `SCE_MODEL_SEED` sets the
//! seed, `SCE_MODEL_STEPS` the schedule's length, `SCE_MODEL_HOSTS` the hosts (3 to 8).

mod model;

use model::{Host, Model, BLOCK, PROBE_FIRST, REGION};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sce_coord::MemEtcd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::RwLock;
use std::time::{Duration, Instant};

/// Blocks per region.
const PER_REGION: u64 = REGION / BLOCK;

struct World {
    hosts: Vec<Host>,
    etcd: MemEtcd,
    model: Model,
    /// Workers hold it shared per operation; a probe holds it alone.
    quiet: RwLock<()>,
    stop: AtomicBool,
    /// Faults injected, by kind.
    faults: [AtomicU64; 7],
    /// Probes that came to their point: late acknowledgements, fence, catching up, hand-off,
    /// lease margin.
    probed: [AtomicU64; 5],
}

const KINDS: [&str; 7] = [
    "pause",
    "late answers",
    "partition",
    "lease expired",
    "compaction",
    "hand-off",
    "probe",
];

impl World {
    /// Hosts that take regions: all but the last.
    fn owners(&self) -> usize {
        self.hosts.len() - 1
    }

    /// Two hosts apart, the first a host that takes regions, the second any other; when
    /// `among` is `owners()`, both take regions.
    fn pair(&self, rng: &mut SmallRng, among: usize) -> (usize, usize) {
        let a = rng.gen_range(0..self.owners());
        let b = (a + rng.gen_range(1..among)) % among;
        (a, b)
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A worker on host `h`: reads (often of blocks written lately) and writes (mostly in the
/// host's own regions, so that it takes them; sometimes anywhere, so that regions are
/// contended), never in the probes' regions.
fn worker(w: &World, h: usize, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let host = &w.hosts[h];
    let regions = PROBE_FIRST * BLOCK / REGION;
    let hosts = w.hosts.len() as u64;
    while !w.stop.load(SeqCst) {
        let _g = w.quiet.read().unwrap();
        let n = rng.gen_range(1..=4u64);
        if rng.gen_bool(0.3) {
            let r = match rng.gen_bool(0.7) {
                true => (rng.gen_range(0..regions) / hosts) * hosts + h as u64 % hosts,
                false => rng.gen_range(0..regions),
            }
            .min(regions - 1);
            let first = r * PER_REGION + rng.gen_range(0..PER_REGION - n);
            let _ = w.model.write(host, first, n);
        } else {
            let first = match rng.gen_bool(0.5) {
                true => w.model.recent(rng.gen_range(0..64)).unwrap_or(0),
                false => rng.gen_range(0..PROBE_FIRST),
            }
            .min(PROBE_FIRST - n);
            w.model.read(host, first, n, "workload");
        }
    }
}

/// Host `h` cut off (partitioned) until it stops counting on its lease, then its leases
/// expired as the cluster would: the others stop waiting for it, and its owner keys go.
/// The revision of the expiry.
fn cut_and_expire(w: &World, h: usize) -> Option<i64> {
    let host = &w.hosts[h];
    host.faults.partition();
    if !host.wait(20, |x| x.status("lease_valid") == false) {
        eprintln!(
            "host {} kept counting on its lease while cut off",
            host.name
        );
        return None;
    }
    host.faults.expire(&w.etcd)
}

/// Waits (bounded) until every host but `but` processed revision `rev`.
fn others_at(w: &World, but: usize, rev: i64) {
    for (i, x) in w.hosts.iter().enumerate().filter(|(i, _)| *i != but) {
        if !x.wait(20, |x| {
            x.status("revision_processed").as_i64().unwrap_or(0) >= rev
        }) {
            eprintln!("host {i} never processed revision {rev}");
        }
    }
}

/// Reads block `b` on `host` until its cache holds it (bounded): whether it does.
fn cache_on(w: &World, host: &Host, b: u64) -> bool {
    for _ in 0..50 {
        w.model.read(host, b, 1, "probe warm-up");
        if host.caches(b) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Late acknowledgements (in the first probe region): host `b` caches block `x`, its
/// answers from etcd are held, host `a` writes `x`, and `b` reads it once the write is
/// acknowledged. `b`'s acknowledgement reached etcd (so `a`'s write completed) but `b`'s
/// listener hears of its put late: it must have dropped `x` before it acknowledged. True if
/// the probe came to its point (the write acknowledged before `b`'s read).
fn probe_late_acks(w: &World, rng: &mut SmallRng) -> bool {
    let (a, b) = w.pair(rng, w.hosts.len());
    let (a, b) = (&w.hosts[a], &w.hosts[b]);
    let x = PROBE_FIRST + rng.gen_range(0..PER_REGION);
    if w.model.write(b, x, 1) != Some(true) || !cache_on(w, b, x) {
        eprintln!(
            "late acknowledgements probe: host {} did not cache block {x}",
            b.name
        );
        return false;
    }
    b.faults.hold_replies();
    let wrote = std::thread::scope(|s| {
        let t = s.spawn(|| w.model.write(a, x, 1));
        let t0 = Instant::now();
        while !t.is_finished() && t0.elapsed() < Duration::from_millis(800) {
            std::thread::sleep(Duration::from_millis(2));
        }
        let finished = t.is_finished();
        w.model.read(b, x, 1, "late acknowledgements");
        b.faults.heal();
        finished && t.join().unwrap() == Some(true)
    });
    wrote
}

/// The fence (in the second probe region): host `a` writes block `x` in a region it owns,
/// its source write stalls, it is cut off until its lease expires, another host `b` caches
/// `x` meanwhile (the region is nobody's now), then `a`'s write finishes. It must fail: `b`
/// never heard of it. True if the probe came to its point (`b` cached `x` meanwhile).
fn probe_fence(w: &World, rng: &mut SmallRng) -> bool {
    let (ai, bi) = w.pair(rng, w.owners());
    let (a, b) = (&w.hosts[ai], &w.hosts[bi]);
    let x = PROBE_FIRST + PER_REGION + rng.gen_range(0..PER_REGION);
    let owned = |h: &Host| h.status("owned_writes").as_u64().unwrap_or(0);
    // Owned once the others' writes there are older than the idle time.
    let mut before = owned(a);
    for _ in 0..10 {
        if w.model.write(a, x, 1) == Some(true) && owned(a) > before {
            break;
        }
        std::thread::sleep(Duration::from_millis(350));
        before = owned(a);
    }
    if owned(a) == before {
        eprintln!(
            "fence probe: host {} never owned block {x}'s region",
            a.name
        );
        return false;
    }
    a.gate.set(true);
    let fenced = std::thread::scope(|s| {
        let t = s.spawn(|| w.model.write(a, x, 1));
        // In its source write: it counted on its ownership when it began.
        let t0 = Instant::now();
        while a.gate.waiting() == 0 && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let stalled = a.gate.waiting() > 0;
        // The others apply the deletion of the owner key (a listener's processed revision
        // moves with invalidations and owner keys only).
        let expired = cut_and_expire(w, ai);
        if let Some(rev) = expired {
            others_at(w, ai, rev);
        }
        let cached = stalled && expired.is_some() && cache_on(w, b, x);
        a.gate.set(false);
        let out = t.join().unwrap();
        w.model.read(b, x, 1, "after a fenced write");
        a.faults.heal();
        cached && out.is_some()
    });
    a.wait(20, |x| x.status("serving_hits") == true);
    fenced
}

/// Catching up (in the third probe region): host `a` caches block `x`, is cut off until its
/// lease expires, host `b` writes `x` (not waiting for `a`), then `a`'s network comes back
/// but for its listener's client. It registers again, and must pass reads through until its
/// listener caught up; every other run the history `a` missed is compacted before its
/// listener comes back, so that it must forget its cache instead. Then it must serve `b`'s
/// bytes. True if the probe came to its point (`b`'s write acknowledged, `a` registered
/// again while its listener was still cut off, then served hits again).
fn probe_catch_up(w: &World, rng: &mut SmallRng) -> bool {
    let (ai, bi) = w.pair(rng, w.hosts.len());
    let (a, b) = (&w.hosts[ai], &w.hosts[bi]);
    let x = PROBE_FIRST + 2 * PER_REGION + rng.gen_range(0..PER_REGION);
    if !cache_on(w, a, x) || cut_and_expire(w, ai).is_none() {
        a.faults.heal();
        return false;
    }
    let wrote = w.model.write(b, x, 1) == Some(true);
    a.faults.heal_but_listener();
    let registered = a.wait(20, |h| h.status("lease_valid") == true);
    for _ in 0..20 {
        w.model.read(a, x, 1, "registered again, not caught up");
    }
    if w.probed[2].load(SeqCst) % 2 == 1 {
        let _ = w.etcd.compact(w.etcd.revision());
    }
    a.faults.heal();
    let serving = a.wait(20, |h| h.status("serving_hits") == true);
    for _ in 0..20 {
        w.model.read(a, x, 1, "caught up");
    }
    wrote && registered && serving
}

/// A hand-off (in the fourth probe region): host `a` owns and caches block `x`, hands its
/// regions to host `b` (`sce ctl handoff`) while its own listener is paused, `b` writes `x`
/// as its owner (no publication), and `a` reads it: `a` must count the region as another's
/// from the move on, not from when its listener hears of it. True if the probe came to its
/// point (the region moved, `b`'s write owned and acknowledged).
fn probe_handoff(w: &World, rng: &mut SmallRng) -> bool {
    let (ai, bi) = w.pair(rng, w.owners());
    let (a, b) = (&w.hosts[ai], &w.hosts[bi]);
    let x = PROBE_FIRST + 3 * PER_REGION + rng.gen_range(0..PER_REGION);
    let owned = |h: &Host| h.status("owned_writes").as_u64().unwrap_or(0);
    let handed = |h: &Host| h.status("handoff_regions").as_u64().unwrap_or(0);
    let before = owned(a);
    if w.model.write(a, x, 1) != Some(true) || owned(a) == before || !cache_on(w, a, x) {
        return false;
    }
    let got = handed(b);
    a.faults.pause_listener();
    let moved = sce_server::coherent::handoff(&a.coh, &b.name).map_or(0, |m| m.2);
    if moved == 0 || !b.wait(20, |h| handed(h) > got) {
        a.faults.heal();
        return false;
    }
    let before = owned(b);
    let wrote = w.model.write(b, x, 1) == Some(true) && owned(b) > before;
    w.model.read(a, x, 1, "after a hand-off");
    a.faults.heal();
    wrote
}

/// The lease's margin (in the first probe region; the store's clock is real): host `a`
/// caches block `x`, then its network is paused past its lease's time, so that the store
/// expires the lease as etcd would, counting from the last renewal it received. Host `b`'s
/// write of `x` waits for `a` until then, and `a` reads `x` all along: it must stop
/// counting on its lease (and pass reads through) before the store can expire it. True if
/// the probe came to its point (`b`'s write acknowledged while `a` was paused).
fn probe_lease_margin(w: &World, rng: &mut SmallRng) -> bool {
    let (ai, bi) = w.pair(rng, w.hosts.len());
    let (a, b) = (&w.hosts[ai], &w.hosts[bi]);
    let x = PROBE_FIRST + rng.gen_range(0..PER_REGION);
    if !cache_on(w, a, x) {
        return false;
    }
    a.faults.pause();
    let stop = AtomicBool::new(false);
    let wrote = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(SeqCst) {
                w.model.read(a, x, 1, "lease margin");
            }
        });
        let wrote = w.model.write(b, x, 1) == Some(true);
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, SeqCst);
        wrote
    });
    a.faults.heal();
    a.wait(20, |h| h.status("serving_hits") == true);
    wrote
}

/// Step `i` of the schedule: a fault on a host for a while, or a compaction, at random;
/// every 8th, the probes.
fn step(w: &World, rng: &mut SmallRng, i: u64) -> &'static str {
    let h = rng.gen_range(0..w.hosts.len());
    let host = &w.hosts[h];
    let kind = match i % 8 {
        4 => KINDS.len() - 1,
        _ => rng.gen_range(0..KINDS.len() - 1),
    };
    w.faults[kind].fetch_add(1, SeqCst);
    match kind {
        0..=2 => {
            let d = ms(rng, 100, 600);
            match kind {
                0 => host.faults.pause(),
                1 => host.faults.hold_replies(),
                _ => host.faults.partition(),
            }
            std::thread::sleep(d);
            host.faults.heal();
        }
        3 => {
            let _g = rng.gen_bool(0.5).then(|| w.quiet.write().unwrap());
            cut_and_expire(w, h);
            std::thread::sleep(ms(rng, 100, 300));
            host.faults.heal();
        }
        4 => {
            let rev = w.etcd.revision() - rng.gen_range(0..20);
            let _ = w.etcd.compact(rev.max(w.etcd.compacted() + 1));
        }
        5 => {
            // What it owns to another host (`sce ctl handoff`), while everyone writes.
            let to = &w.hosts[(h + rng.gen_range(1..w.hosts.len())) % w.hosts.len()];
            let _ = sce_server::coherent::handoff(&host.coh, &to.name);
        }
        _ => {
            let _g = w.quiet.write().unwrap();
            for h in &w.hosts {
                h.faults.heal();
                h.wait(20, |x| x.status("serving_hits") == true);
            }
            let probes = [
                probe_late_acks,
                probe_fence,
                probe_catch_up,
                probe_handoff,
                probe_lease_margin,
            ];
            for (k, probe) in probes.iter().enumerate() {
                w.probed[k].fetch_add(probe(w, rng) as u64, SeqCst);
            }
        }
    }
    std::thread::sleep(ms(rng, 50, 250));
    KINDS[kind]
}

fn ms(rng: &mut SmallRng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(rng.gen_range(lo..hi))
}

#[test]
fn shared_mode_never_serves_a_stale_read_under_pauses_partitions_expiries_and_compaction() {
    let t0 = Instant::now();
    let seed = env("SCE_MODEL_SEED", 49);
    let steps = env("SCE_MODEL_STEPS", 32);
    let dir = tempfile::tempdir().unwrap();
    // On the real clock: a host paused past its lease's time loses it, as with etcd.
    let etcd = MemEtcd::with_real_clock();
    let src = model::source();
    // Every host but the last takes regions; the last takes none (every write of its is
    // published).
    let n = env("SCE_MODEL_HOSTS", 3).clamp(3, 8) as usize;
    let hosts: Vec<Host> = (0..n)
        .map(|i| Host::start(dir.path(), &format!("h{i}"), &src, &etcd, i + 1 < n))
        .collect();
    for h in &hosts {
        assert!(
            h.wait(30, |x| x.status("serving_hits") == true),
            "{} never served",
            h.name
        );
    }
    let w = World {
        hosts,
        etcd,
        model: Model::new(),
        quiet: RwLock::new(()),
        stop: AtomicBool::new(false),
        faults: Default::default(),
        probed: Default::default(),
    };
    let mut rng = SmallRng::seed_from_u64(seed);
    std::thread::scope(|s| {
        for h in 0..w.hosts.len() {
            for k in 0..2 {
                let (w, seed) = (&w, seed * 100 + (h * 2 + k) as u64);
                s.spawn(move || worker(w, h, seed));
            }
        }
        for i in 0..steps {
            if w.model.failed_any() {
                break;
            }
            step(&w, &mut rng, i);
        }
        w.stop.store(true, SeqCst);
    });
    report(&w, seed, steps, t0);
    for h in &w.hosts {
        h.faults.heal();
        h.gate.set(false);
        h.coh.leave();
    }
}

fn report(w: &World, seed: u64, steps: u64, t0: Instant) {
    let m = &w.model;
    let (reads, blocks) = (m.reads.load(SeqCst), m.blocks_checked.load(SeqCst));
    let (acked, failed) = (m.acked.load(SeqCst), m.failed.load(SeqCst));
    eprintln!(
        "shared-mode model: seed {seed}, {} hosts, {steps} schedule steps, {} operations: {reads} reads checked ({blocks} blocks), {acked} writes acknowledged, {failed} failed; {:.1} s",
        w.hosts.len(),
        reads + acked + failed,
        t0.elapsed().as_secs_f64()
    );
    let faults: Vec<String> = (KINDS.iter().zip(&w.faults))
        .map(|(k, n)| format!("{k} {}", n.load(SeqCst)))
        .collect();
    let probed = [0, 1, 2, 3, 4].map(|k| w.probed[k].load(SeqCst));
    eprintln!(
        "faults: {}; probes that came to their point: late acknowledgements {}, fence {}, catching up {}, hand-off {}, lease margin {}",
        faults.join(", "),
        probed[0],
        probed[1],
        probed[2],
        probed[3],
        probed[4]
    );
    for h in &w.hosts {
        let s = h.coh.status();
        eprintln!(
            "host {}: hits {}, invalidations received {}, acquisitions {}, owned writes {}, fenced {}, publish failures {}, passthrough reads {}, forgotten {}, regions handed to it {}",
            h.name,
            h.hits(),
            s["invalidations_received"],
            s["region_acquisitions"],
            s["owned_writes"],
            s["owned_writes_fenced"],
            s["publish_failures"],
            s["passthrough_reads"],
            s["forgotten"],
            s["handoff_regions"]
        );
    }
    let failures = m.failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{} bad reads; first: {:#?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(reads >= 2000, "only {reads} reads checked");
    assert!(
        probed.iter().all(|n| *n >= 2),
        "probes that came to their point: {probed:?}"
    );
    assert!(acked >= 200, "only {acked} writes acknowledged");
    for h in &w.hosts {
        assert!(h.hits() > 0, "host {} never served a hit", h.name);
    }
}
