//! Benchmark of the in-process hit path: 4 KiB reads that all hit, through a `CacheVolume` on
//! memory devices, from 1 and 2 threads, in one run. Prints operations per second and the
//! ratio between the two, for checksums verified without persistence (every page's checksum
//! in memory), with persistence (checksums in the records, in memory for the units in use:
//! the default capacity, then one unit only, the worst case where nearly every hit reads its
//! unit's records), and without checksums. Run: `cargo bench -p sce-engine --bench
//! hit_path`.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sce_core::CoreConfig;
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::{AlignedBuf, BlockDevice, MemDevice};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WORKING_SET: u64 = 64 << 20;

fn run(vol: &Arc<CacheVolume>, threads: usize, dur: Duration) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (vol, stop) = (vol.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t as u64);
                let mut buf = AlignedBuf::new(4096);
                let mut n = 0u64;
                while !stop.load(Relaxed) {
                    for _ in 0..256 {
                        let off = rng.gen_range(0..WORKING_SET / 4096) * 4096;
                        vol.read_at(off, &mut buf).expect("read");
                    }
                    n += 256;
                }
                n
            })
        })
        .collect();
    let t0 = Instant::now();
    std::thread::sleep(dur);
    stop.store(true, Relaxed);
    let ops: u64 = hs.into_iter().map(|h| h.join().expect("thread")).sum();
    ops as f64 / t0.elapsed().as_secs_f64()
}

/// How a benchmarked volume keeps its checksums.
#[derive(Clone, Copy)]
enum Checksums {
    Off,
    /// Verified, no persistence: every page's checksum in memory.
    Memory,
    /// Persistence, with this many units' checksums in memory (0: the default).
    Records(usize),
}

impl std::fmt::Display for Checksums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Checksums::Off => f.write_str("off"),
            Checksums::Memory => f.write_str("verified, every page's in memory (no persistence)"),
            Checksums::Records(0) => {
                f.write_str("verified, persistent, in the records (default units in memory)")
            }
            Checksums::Records(n) => write!(
                f,
                "verified, persistent, in the records ({n} unit in memory)"
            ),
        }
    }
}

fn warm_volume(sums: Checksums, quiet: bool) -> Arc<CacheVolume> {
    let source: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(1 << 30));
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(256 << 20));
    let persist = match sums {
        Checksums::Records(n) => {
            let mut p = PersistConfig::new("bench");
            // Counting instructions: no metadata round in the count (a round every 100 ms
            // would add work in proportion to the wall time, not to the reads).
            p.flush_interval = Duration::from_millis(if quiet { 3_600_000 } else { 100 });
            p.checksum_units = n;
            Some(p)
        }
        _ => None,
    };
    let cfg = EngineConfig {
        core: CoreConfig::default(),
        background_population: false,
        verify: !matches!(sums, Checksums::Off),
        persist,
        ..EngineConfig::default()
    };
    let vol = Arc::new(CacheVolume::open(source, cache, cfg).expect("open"));
    // Warm: read every fragment of the working set whole (a read of a few pages would be a
    // sparse line's, which the page area takes page by page and population leaves alone),
    // then populate them all.
    let mut buf = AlignedBuf::new(1 << 20);
    for f in 0..WORKING_SET >> 20 {
        vol.read_at(f << 20, &mut buf).expect("read");
    }
    let mut populated = 0;
    while populated < (WORKING_SET >> 20) as usize {
        let n = vol.populate_now(usize::MAX);
        if n == 0 {
            for f in 0..WORKING_SET >> 20 {
                vol.read_at(f << 20, &mut buf).expect("read");
            }
        }
        populated += n;
    }
    vol
}

/// `HIT_PATH_READS=N HIT_PATH_CASE=K`: warms case K (0-3, the order of `main`'s table) and
/// makes exactly N reads on this thread, then exits: run under valgrind's cachegrind at N
/// and 2N, the difference is the instructions of N hits, whatever the machine's load
/// (`scripts/bench-hit-path-ab.py --instructions`).
fn counted_reads(kinds: &[Checksums]) -> bool {
    let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let (Some(reads), Some(case)) = (var("HIT_PATH_READS"), var("HIT_PATH_CASE")) else {
        return false;
    };
    let vol = warm_volume(kinds[case as usize % kinds.len()], true);
    vol.flush_metadata();
    let mut rng = SmallRng::seed_from_u64(7);
    let mut buf = AlignedBuf::new(4096);
    for _ in 0..reads {
        let off = rng.gen_range(0..WORKING_SET / 4096) * 4096;
        vol.read_at(off, &mut buf).expect("read");
    }
    println!("{reads} reads, case {case}");
    true
}

fn main() {
    let kinds = [
        Checksums::Memory,
        Checksums::Records(0),
        Checksums::Records(1),
        Checksums::Off,
    ];
    if counted_reads(&kinds) {
        return;
    }
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing: keep that run short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let dur = if quick {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(1)
    };
    // The machines are shared and noisy: alternate 1 and 2 threads for several rounds and
    // report the medians.
    let rounds = if quick { 1 } else { 5 };
    let mut results = Vec::new();
    for sums in kinds {
        let vol = warm_volume(sums, false);
        // The round after the population: the records hold every checksum.
        vol.flush_metadata();
        let before = vol.stats();
        let (mut ones, mut twos) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            ones.push(run(&vol, 1, dur));
            twos.push(run(&vol, 2, dur));
        }
        let d = vol.stats().delta(&before);
        assert_eq!(
            d.read_pages_missed, 0,
            "the benchmark must measure hits only"
        );
        let (one, two) = (median(&mut ones), median(&mut twos));
        println!(
            "hit path, 4 KiB reads, memory devices, {} MiB working set, all hits ({} reads), checksums {sums}, median of {rounds}",
            WORKING_SET >> 20,
            d.read_requests,
        );
        if let Some(p) = vol.persist_stats() {
            println!(
                "  units' checksums read from the records: {}, {} units in memory",
                p.checksum_unit_loads, p.checksum_units_resident
            );
        }
        println!("  1 thread : {:>12.0} ops/s", one);
        println!(
            "  2 threads: {:>12.0} ops/s  ({:.0} per thread)",
            two,
            two / 2.0
        );
        println!("  ratio 2 threads / 1 thread: {:.2}", two / one);
        results.push((one, two));
    }
    let off = results[3];
    for (k, sums) in kinds.iter().enumerate().take(3) {
        println!(
            "checksums {sums}: 1 thread {:.2}x, 2 threads {:.2}x the ops/s without",
            results[k].0 / off.0,
            results[k].1 / off.1
        );
    }
    println!(
        "in the records (default) against every page's in memory: 1 thread {:.2}x, 2 threads {:.2}x",
        results[1].0 / results[0].0,
        results[1].1 / results[0].1
    );
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
