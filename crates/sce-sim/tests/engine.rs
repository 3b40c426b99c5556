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
    let paper = CoreConfig {
        admission: sce_core::Admission::ScePaper,
        ..CoreConfig::default()
    };
    for cfg in [CoreConfig::default(), paper] {
        let a = run(cfg.clone(), &read_twice(), 4 * MIB);
        let b = run(cfg.clone(), &read_twice(), 4 * MIB);
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        // Two sequential sweeps of 8 MiB through a 4 MiB cache: the paper's Algorithm 1
        // evicts to populate the sweep; the default sees a stream once the cache is full and
        // evicts nothing.
        if cfg.admission == sce_core::Admission::ScePaper {
            assert!(a.fragments_evicted > 0);
        } else {
            assert_eq!(a.fragments_evicted, 0);
        }
    }
}

/// A write is acknowledged when the source has it (AWT, write-around), or when the source
/// and every cache copy have it (synchronous write-through): with a cache device slower to
/// write than the source, only write-through waits for it.
#[test]
fn write_latency_waits_for_cache_copies_in_write_through_only() {
    let slow = DeviceModel {
        write_ns: 20_000_000,
        ..DeviceModel::mercury_ssd()
    };
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
    let source = DeviceModel::disk();
    let source_write = source.write_ns + 8192 * 1_000_000_000 / source.write_bw;
    let cache_write = slow.write_ns + 8192 * 1_000_000_000 / slow.write_bw;
    for (mode, want) in [
        (WriteMode::Awt, source_write),
        (WriteMode::WriteAround, source_write),
        (WriteMode::WriteThrough, cache_write),
    ] {
        let cfg = CoreConfig {
            write_mode: mode,
            ..CoreConfig::default()
        };
        let mut s =
            EngineSim::new(cfg, 64 * MIB, 32 * MIB, slow.clone(), source.clone(), 10.0).unwrap();
        let mut last = 0;
        for r in &trace {
            let done = s.request(r);
            assert!(done >= r.time_ns);
            if r.kind == IoKind::Write {
                last = done - r.time_ns;
            }
        }
        assert_eq!(last, want, "{mode}: the request's own completion");
        let r = s.finish();
        // Writes 5 ms apart queue on neither device: every one costs its service time.
        assert_eq!(r.write_latency.count(), 64, "{mode}");
        let mean = r.mean_write_latency;
        assert!(
            (mean - want as f64 / 1e9).abs() < 1e-12,
            "{mode}: {mean} against {want} ns"
        );
        assert!(r.p99_write_latency >= mean && r.p99_write_latency < mean * 1.091);
        assert_eq!(r.read_latency.count(), 256);
    }
}
