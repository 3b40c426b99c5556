//! The stack's replay and device models: reference policies get modelled latencies without
//! their hit/miss counting changing, a closed loop issues at the pace the models sustain
//! (exactly, where every request costs the same), an open loop faster than the models shows
//! a utilization above 1, and the cache bytes written per interval add up.

use sce_core::CoreConfig;
use sce_sim::layers::{Flash, Host, RamCache, RamPolicy, Replay, Stack, StackResult};
use sce_sim::{
    BlockCache, DeviceModel, EngineSim, GenConfig, Generator, IoKind, ReferencePolicy, Workload,
    ZipfParams,
};

const MIB: u64 = 1 << 20;

/// Service time of one I/O on an idle channel of `m`.
fn service(m: &DeviceModel, bytes: u64, write: bool) -> u64 {
    let (lat, bw) = if write {
        (m.write_ns, m.write_bw)
    } else {
        (m.read_ns, m.read_bw)
    };
    lat + bytes * 1_000_000_000 / bw
}

fn ssd() -> DeviceModel {
    DeviceModel::mercury_ssd()
}

fn disk() -> DeviceModel {
    DeviceModel::disk()
}

fn lru(blocks: usize) -> Flash {
    Flash::Reference(Box::new(BlockCache::new(ReferencePolicy::Lru, blocks)))
}

fn timed(flash: Flash) -> Host {
    Host::new(flash, None).with_devices(ssd(), disk())
}

fn flashcache_like(source: u64) -> Flash {
    Flash::Engine(Box::new(
        EngineSim::new(
            CoreConfig::flashcache_like(),
            source,
            64 * MIB,
            ssd(),
            disk(),
            1.0,
        )
        .expect("valid"),
    ))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1e-9)
}

/// A miss of one 4 KiB block: read from the source, then written into the cache.
fn miss_cost() -> u64 {
    service(&disk(), 4096, false) + service(&ssd(), 4096, true)
}

#[test]
fn reference_latencies_follow_the_device_models() {
    let mut s = Stack::new(vec![timed(lru(16))], 1.0);
    s.request(0, 0, IoKind::Read, 0, 4096); // miss
    s.request(0, 1_000_000_000, IoKind::Read, 0, 4096); // hit
    s.request(0, 2_000_000_000, IoKind::Write, 8192, 8192);
    let r = s.finish();
    assert_eq!((r.read_hits, r.read_pages), (1, 2));
    let (miss, hit) = (miss_cost(), service(&ssd(), 4096, false));
    assert_eq!(r.read_latency.count(), 2);
    assert!(close(r.read_latency.mean(), (miss + hit) as f64 / 2e9));
    let p99 = r.read_latency.quantile(0.99);
    assert!(p99 >= miss as f64 / 1e9 && p99 < miss as f64 * 1.091 / 1e9);
    // A write is acknowledged when the source has it; its blocks go to the cache meanwhile.
    assert_eq!(r.write_latency.count(), 1);
    assert!(close(
        r.write_latency.mean(),
        service(&disk(), 8192, true) as f64 / 1e9
    ));
    // Busy time over the 2 s replay: per channel, 4 source and 8 cache channels.
    let source_busy = (service(&disk(), 4096, false) + service(&disk(), 8192, true)) / 4;
    let cache_busy = (service(&ssd(), 4096, true) + hit + service(&ssd(), 8192, true)) / 8;
    assert_eq!(r.duration_ns, 2_000_000_000);
    assert!(close(r.source_utilization, source_busy as f64 / 2e9));
    assert!(close(r.cache_utilization, cache_busy as f64 / 2e9));
}

/// A policy that does not admit a missed block (LARC's first miss) reads it from the source
/// and writes nothing to the cache device.
#[test]
fn only_inserted_blocks_are_written_to_the_cache_model() {
    let larc = Flash::Reference(Box::new(BlockCache::new(ReferencePolicy::Larc, 16)));
    let mut s = Stack::new(vec![timed(larc)], 1.0);
    for i in 0..3 {
        s.request(0, i * 1_000_000_000, IoKind::Read, 0, 4096);
    }
    let r = s.finish();
    assert_eq!((r.read_hits, r.read_pages), (1, 3));
    let (source, hit) = (service(&disk(), 4096, false), service(&ssd(), 4096, false));
    // First miss: the source only; second: admitted, so written; third: a hit.
    assert!(close(
        r.read_latency.mean(),
        (source + miss_cost() + hit) as f64 / 3e9
    ));
    let cache_busy = (service(&ssd(), 4096, true) + hit) / 8;
    assert!(close(r.cache_utilization, cache_busy as f64 / 2e9));
    assert_eq!(r.interval_cache_bytes.iter().sum::<u64>(), 4096);
}

fn zipf(requests: u64, read_fraction: f64) -> Generator {
    Generator::new(GenConfig {
        workload: Workload::Zipf(ZipfParams {
            size: 256 * MIB,
            skew: 0.8,
            read_fraction,
            request_size: 16384,
            cluster_size: 16384,
        }),
        requests,
        iops: 1000.0,
        seed: 3,
    })
    .expect("valid")
}

fn counts(r: &StackResult) -> (Option<(u64, u64)>, u64, u64) {
    (r.reference, r.read_hits, r.read_pages)
}

/// Modelling the devices changes no hit or miss of a reference policy, in either replay,
/// with or without a RAM cache above it.
#[test]
fn the_model_does_not_change_reference_counting() {
    for policy in [
        ReferencePolicy::Lru,
        ReferencePolicy::Fifo,
        ReferencePolicy::Lfu,
    ] {
        for ram in [false, true] {
            let host = |devices: bool| {
                let flash = Flash::Reference(Box::new(BlockCache::new(policy, 2048)));
                let ram = ram.then(|| RamCache::new(MIB, RamPolicy::Sync));
                let h = Host::new(flash, ram);
                if devices {
                    h.with_devices(ssd(), disk())
                } else {
                    h
                }
            };
            let mut plain = Stack::new(vec![host(false)], 1.0);
            let mut open = Stack::new(vec![host(true)], 1.0);
            let mut closed = Stack::new(vec![host(true)], 1.0).with_replay(Replay::Closed(8));
            for r in zipf(20_000, 0.7) {
                for s in [&mut plain, &mut open, &mut closed] {
                    s.request(0, r.time_ns, r.kind, r.offset, r.len);
                }
            }
            let (plain, open, closed) = (plain.finish(), open.finish(), closed.finish());
            assert_eq!(counts(&plain), counts(&open), "{policy:?} ram {ram}");
            assert_eq!(counts(&plain), counts(&closed), "{policy:?} ram {ram}");
            assert_eq!(plain.read_latency.count(), 0, "no devices, no latencies");
            assert!(open.read_latency.count() > 0 && open.write_latency.count() > 0);
        }
    }
}

/// With one request in flight, each request issues when the one before it completes: a
/// trace of misses that each cost the same lasts that cost times the requests, whatever its
/// timestamps say, and nothing queues.
#[test]
fn closed_loop_issues_at_the_pace_of_the_models() {
    let n = 40u64;
    // Timestamps out of order and far apart: a closed loop ignores them.
    let times: Vec<u64> = (0..n).map(|i| (n - i) * 1_000_000_000_000).collect();
    for (qd, hosts) in [(1u32, 1usize), (4, 1), (2, 2)] {
        let mut s = Stack::new((0..hosts).map(|_| timed(lru(1024))).collect(), 1.0)
            .with_replay(Replay::Closed(qd));
        for (i, &t) in times.iter().enumerate() {
            s.request(i % hosts, t, IoKind::Read, i as u64 * 4096, 4096);
        }
        let r = s.finish();
        // Four source channels a host: QD requests (at most 4 per host) go at once.
        let rounds = n / qd as u64;
        assert_eq!(r.duration_ns, rounds * miss_cost(), "closed:{qd}");
        assert!(close(r.read_latency.mean(), miss_cost() as f64 / 1e9));
        assert_eq!(r.replay, Replay::Closed(qd));
    }
    // The engine alike: flashcache-like fills every 4 KiB miss inline, so each read of a new
    // block costs a source read then a cache write.
    let mut s = Stack::new(vec![Host::new(flashcache_like(64 * MIB), None)], 1.0)
        .with_replay(Replay::Closed(1));
    for (i, &t) in times.iter().enumerate() {
        s.request(0, t, IoKind::Read, i as u64 * 4096, 4096);
    }
    let r = s.finish();
    assert_eq!(r.duration_ns, n * miss_cost());
    assert!(close(r.read_latency.mean(), miss_cost() as f64 / 1e9));
    // One request at a time on four channels: a quarter of the source at most.
    let busy = n * service(&disk(), 4096, false) / 4;
    assert!(close(
        r.source_utilization,
        busy as f64 / (n * miss_cost()) as f64
    ));
}

/// A trace that offers more than the source model serves: open loop, the utilization is
/// above 1 and reads queue; a closed loop keeps it at most 1 with latencies at cost.
#[test]
fn an_open_loop_faster_than_the_models_overloads_them() {
    let n = 200u64;
    let run = |replay: Replay, engine: bool| {
        let flash = if engine {
            flashcache_like(64 * MIB)
        } else {
            lru(1024)
        };
        let mut s = Stack::new(vec![timed(flash)], 1.0).with_replay(replay);
        // A miss a millisecond; the disk model serves four per 5.04 ms.
        for i in 0..n {
            s.request(0, i * 1_000_000, IoKind::Read, i * 4096, 4096);
        }
        s.finish()
    };
    for engine in [false, true] {
        let open = run(Replay::Open, engine);
        let want = (n * service(&disk(), 4096, false) / 4) as f64 / ((n - 1) * 1_000_000) as f64;
        assert!(close(open.source_utilization, want), "{engine}");
        assert!(open.source_utilization > 1.2);
        // The backlog grows by a fifth of a request per millisecond: reads wait ~25 ms.
        assert!(open.read_latency.mean() > 3.0 * miss_cost() as f64 / 1e9);
        let closed = run(Replay::Closed(4), engine);
        assert!(closed.source_utilization <= 1.0, "{engine}");
        assert!(close(closed.read_latency.mean(), miss_cost() as f64 / 1e9));
    }
}

/// The cache bytes written per interval add up to the total: the engine's own count, and a
/// block per insertion for a reference policy.
#[test]
fn interval_cache_bytes_add_up() {
    let sce = || {
        Flash::Engine(Box::new(
            EngineSim::new(
                CoreConfig::default(),
                256 * MIB,
                32 * MIB,
                ssd(),
                disk(),
                1.0,
            )
            .expect("valid"),
        ))
    };
    for replay in [Replay::Open, Replay::Closed(16)] {
        let mut s = Stack::new(vec![timed(sce()), timed(lru(4096))], 2.0).with_replay(replay);
        for r in zipf(20_000, 0.8) {
            s.request(
                (r.offset / MIB % 2) as usize,
                r.time_ns,
                r.kind,
                r.offset,
                r.len,
            );
        }
        let r = s.finish();
        assert_eq!(r.intervals.len(), r.interval_cache_bytes.len());
        let engine: u64 = r.engines.iter().map(|e| e.cache_bytes_written).sum();
        let (_, misses) = r.reference.expect("a reference host");
        assert!(engine > 0);
        // LRU inserts every block it misses, and rewrites every block a write hits.
        assert!(
            r.reference_updates > 0,
            "{replay}: the trace has write hits"
        );
        assert_eq!(
            r.interval_cache_bytes.iter().sum::<u64>(),
            engine + (misses + r.reference_updates) * 4096,
            "{replay}"
        );
        // Writes are spread over the trace, not lumped in one interval.
        let busy = r.interval_cache_bytes.iter().filter(|&&b| b > 0).count();
        assert!(busy * 2 > r.intervals.len(), "{replay}: {busy}");
    }
}

/// Above a RAM cache, an application waits for a write only with the synchronous policy;
/// a closed loop then goes at the pace of the source writes, otherwise at once.
#[test]
fn a_ram_cache_acknowledges_writes_unless_synchronous() {
    for (policy, waits) in [
        (RamPolicy::Sync, true),
        (RamPolicy::Async, false),
        (RamPolicy::None, false),
    ] {
        let host =
            Host::new(lru(1024), Some(RamCache::new(MIB, policy))).with_devices(ssd(), disk());
        let mut s = Stack::new(vec![host], 1.0).with_replay(Replay::Closed(1));
        for i in 0..10u64 {
            s.request(0, 0, IoKind::Write, i * 4096, 4096);
        }
        let r = s.finish();
        let want = if waits {
            10 * service(&disk(), 4096, true)
        } else {
            0
        };
        assert_eq!(r.duration_ns, want, "{policy:?}");
        // Whatever the application waits for, the pages reach the flash cache's model: one
        // write each through, one run at the end when written back.
        let writes = if policy == RamPolicy::None { 1 } else { 10 };
        assert_eq!(r.write_latency.count(), writes, "{policy:?}");
    }
}

#[test]
fn replay_parses() {
    assert_eq!("open".parse(), Ok(Replay::Open));
    assert_eq!("closed:32".parse(), Ok(Replay::Closed(32)));
    assert_eq!(Replay::Closed(7).to_string(), "closed:7");
    for bad in [
        "closed",
        "closed:0",
        "closed:x",
        "shut:3",
        "closed:99999999",
    ] {
        assert!(bad.parse::<Replay>().is_err(), "{bad}");
    }
}
