//! The engine policies in virtual time, on synthetic traces whose answers are known.

use sce_core::{CoreConfig, WriteMode};
use sce_sim::{DeviceModel, EngineResult, EngineSim, IoKind, TraceRequest};

const MIB: u64 = 1 << 20;

/// Reads 8 MiB in 64 KiB requests 10 ms apart, waits a minute, reads it again.
fn read_twice() -> Vec<TraceRequest> {
    let mut v = Vec::new();
    let mut t = 0;
    for pass in 0..2 {
        for i in 0..128u64 {
            v.push(TraceRequest {
                time_ns: t,
                kind: IoKind::Read,
                volume: 0,
                offset: i * 65536,
                len: 65536,
            });
            t += 10_000_000;
        }
        if pass == 0 {
            t += 60_000_000_000;
        }
    }
    v
}

fn run(cfg: CoreConfig, trace: &[TraceRequest], cache: u64) -> EngineResult {
    let mut s = EngineSim::new(
        cfg,
        64 * MIB,
        cache,
        DeviceModel::mercury_ssd(),
        DeviceModel::disk(),
        10.0,
    )
    .unwrap();
    for r in trace {
        s.request(r);
    }
    s.finish()
}

#[test]
fn flashcache_like_fills_on_every_miss() {
    let r = run(CoreConfig::flashcache_like(), &read_twice(), 32 * MIB);
    assert_eq!(
        r.read_hit_ratio, 0.5,
        "first pass all misses, second all hits"
    );
    assert_eq!(r.cache_bytes_written, 8 * MIB, "each page filled once");
    assert_eq!(r.source_bytes_read, 8 * MIB);
    assert_eq!(r.requests, 256);
}

#[test]
fn sce_populates_in_the_background_and_warms_up() {
    let r = run(CoreConfig::default(), &read_twice(), 32 * MIB);
    // Fragment population prefetches: after the first miss in a 1 MiB fragment the rest of
    // it is populated in the background, so even the first pass hits (SCE 3.2).
    assert!(
        r.read_hit_ratio > 0.5 && r.read_hit_ratio < 1.0,
        "{}",
        r.read_hit_ratio
    );
    let last = r.intervals.iter().rev().find(|(_, h)| !h.is_nan()).unwrap();
    assert_eq!(
        last.1, 1.0,
        "the second pass is all hits: {:?}",
        r.intervals
    );
    // Whole fragments: at most the 8 fragments touched, each once.
    assert!(
        r.cache_bytes_written <= 8 * MIB && r.cache_bytes_written >= 7 * MIB,
        "{}",
        r.cache_bytes_written
    );
    assert!(r.fragments_populated >= 7);
    let w = r.warmup_seconds.expect("a warm-up time");
    assert!(w > 0.0 && w <= r.intervals.last().unwrap().0, "{w}");
    // Hits are modelled on the SSD, misses on the disk.
    assert!(r.mean_read_latency > 0.0 && r.p99_read_latency >= r.mean_read_latency);
}

#[test]
fn writes_reach_the_source_and_awt_copies_reach_the_cache() {
    let mut trace = read_twice();
    let t = trace.last().unwrap().time_ns;
    for i in 0..64u64 {
        trace.push(TraceRequest {
            time_ns: t + (i + 1) * 5_000_000,
            kind: IoKind::Write,
            volume: 0,
            offset: i * 8192,
            len: 8192,
        });
    }
    for (mode, copies) in [
        (WriteMode::Awt, true),
        (WriteMode::WriteAround, false),
        (WriteMode::WriteThrough, true),
    ] {
        let cfg = CoreConfig {
            write_mode: mode,
            ..CoreConfig::default()
        };
        let r = run(cfg, &trace, 32 * MIB);
        assert_eq!(r.source_bytes_written, 64 * 8192, "{mode}");
        let populated = run(
            CoreConfig {
                write_mode: mode,
                ..CoreConfig::default()
            },
            &read_twice(),
            32 * MIB,
        )
        .cache_bytes_written;
        let extra = r.cache_bytes_written - populated;
        if copies {
            assert_eq!(
                extra,
                64 * 8192,
                "{mode}: every write to a cached fragment is copied"
            );
        } else {
            assert_eq!(extra, 0, "{mode}");
        }
    }
}

#[test]
fn deterministic() {
    let a = run(CoreConfig::default(), &read_twice(), 4 * MIB);
    let b = run(CoreConfig::default(), &read_twice(), 4 * MIB);
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    // A cache smaller than the data evicts.
    assert!(a.fragments_evicted > 0);
}
