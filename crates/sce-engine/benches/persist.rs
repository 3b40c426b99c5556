//! Benchmarks of the persistent cache, each comparing configurations in one run:
//!
//! 1. **Write latency with persistence off and on**: 4 KiB writes to cached fragments, on an
//!    O_DIRECT cache file, with an in-memory source (the overhead alone) and with a 2 ms
//!    source (a SAN-like volume). "oltp" is a database-like load: 4 threads, 87% reads and
//!    13% writes of 4 KiB pages picked with a skew over 48 cached fragments, for a few
//!    seconds, with the flusher clearing quiet intents as it runs; "hot" rewrites a few
//!    fragments (they turn write-hot: their intents stay set), at QD1 and with 16 writers
//!    (QD16); "spread" writes a different fragment each time with
//!    no read before it and every intent cleared in between: the worst case, where each
//!    write waits for an intent write and a flush of the cache device.
//! 2. **Start-up time of a 1 TiB cache device with every slot in use** (a sparse file whose
//!    metadata units are all written).
//!
//! Run: `cargo bench -p sce-engine --bench persist [-- latency|startup]` (files go to
//! $TMPDIR, about 1.5 GiB for the start-up part; `cargo test --benches` runs a quick
//! version). "on" journals writes (`PersistConfig::journal`, the default);
//! `SCE_BENCH_CRASH_JOURNAL=off` measures persistence without the write journal (intents);
//! `SCE_BENCH_WRITE_HOT=off` with the journal but no write-hot presets (every write to a
//! cached fragment journaled: before issue 29).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sce_core::{CoreConfig, ShardMap};
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::{
    AlignedBuf, BlockDevice, DirectMode, FileDevice, FileOptions, LatencyConfig, LatencyDevice,
    MemDevice,
};
use sce_store::unit::{EntryIn, UnitBuilder};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// Whether persistence journals writes in this run (`SCE_BENCH_CRASH_JOURNAL=off`: no).
fn journal() -> bool {
    std::env::var("SCE_BENCH_CRASH_JOURNAL").map_or(true, |v| v != "off")
}

struct Lat {
    n: usize,
    mean: f64,
    p50: f64,
    p99: f64,
}

fn lat(mut v: Vec<Duration>) -> Lat {
    v.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    Lat {
        n: v.len(),
        mean: v.iter().map(|&d| us(d)).sum::<f64>() / v.len() as f64,
        p50: us(v[v.len() / 2]),
        p99: us(v[v.len() * 99 / 100]),
    }
}

/// A 256 MiB memory source (behind 2 ms of latency, 64 in flight, if `slow`) and a 96 MiB
/// O_DIRECT cache file.
fn devices(dir: &std::path::Path, slow: bool) -> (Arc<dyn BlockDevice>, Arc<dyn BlockDevice>) {
    let mem: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(256 * MIB));
    let source: Arc<dyn BlockDevice> = if slow {
        Arc::new(LatencyDevice::new(
            mem,
            LatencyConfig::disk(Duration::from_millis(2), 64),
        ))
    } else {
        mem
    };
    (source, cache_file(dir, "sce-bench-lat.img", 96 * MIB))
}

fn cache_file(dir: &std::path::Path, name: &str, size: u64) -> Arc<dyn BlockDevice> {
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    Arc::new(
        FileDevice::open(
            &p,
            &FileOptions {
                direct: DirectMode::Preferred,
                create_size: Some(size),
                read_only: false,
                ..Default::default()
            },
        )
        .expect("cache file"),
    )
}

/// A volume (persistent or not) with 48 fragments cached and their records written, its
/// quiet intents cleared.
fn warm_volume(
    source: Arc<dyn BlockDevice>,
    cache: Arc<dyn BlockDevice>,
    persist: bool,
) -> CacheVolume {
    let cfg = EngineConfig {
        core: CoreConfig::default(),
        background_population: false,
        persist: persist.then(|| PersistConfig {
            reformat: true,
            journal: journal(),
            // `SCE_BENCH_WRITE_HOT=off`: no write-hot presets with the journal (every write
            // to a cached fragment journaled, as before issue 29).
            warm_rounds: match std::env::var("SCE_BENCH_WRITE_HOT").as_deref() {
                Ok("off") => 0,
                _ => PersistConfig::new("bench").warm_rounds,
            },
            ..PersistConfig::new("bench")
        }),
        ..EngineConfig::default()
    };
    let vol = CacheVolume::open(source, cache, cfg).expect("open");
    let mut buf = AlignedBuf::new(MIB as usize);
    for f in 0..48 {
        vol.read_at(f * MIB, &mut buf).unwrap();
    }
    vol.populate_now(100);
    vol.flush_metadata();
    vol.flush_metadata();
    vol
}

/// Write latencies on a warmed volume: `hot` rewrites 4 fragments, else every write goes to
/// the next of 48 fragments. `threads` writers (16: QD16) each make `n` writes (hot only).
fn writes(
    source: Arc<dyn BlockDevice>,
    cache: Arc<dyn BlockDevice>,
    persist: bool,
    (hot, threads): (bool, u64),
    n: usize,
) -> Lat {
    let vol = Arc::new(warm_volume(source, cache, persist));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let vol = vol.clone();
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t + 1);
                let mut out = Vec::with_capacity(n);
                let mut data = AlignedBuf::new(4096);
                for i in 0..n {
                    rng.fill(&mut data[..]);
                    let f = if hot { i as u64 % 4 } else { i as u64 % 48 };
                    let off = f * MIB + rng.gen_range(0..256) * 4096;
                    let t = Instant::now();
                    vol.write_at(off, &data).unwrap();
                    out.push(t.elapsed());
                    if !hot && i % 48 == 47 {
                        // Let the flusher clear the intents, so the next round pays them
                        // again.
                        vol.quiesce();
                        vol.flush_metadata();
                        vol.flush_metadata();
                    }
                }
                out
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.join().unwrap());
    }
    lat(all)
}

/// Write latencies under a database-like mix: `threads` threads each doing, for `secs`
/// seconds (after a quarter of that unmeasured), 87% reads and 13% writes of skewed-random
/// 4 KiB pages of 48 cached fragments.
fn oltp(
    source: Arc<dyn BlockDevice>,
    cache: Arc<dyn BlockDevice>,
    persist: bool,
    threads: u64,
    secs: f64,
) -> (Vec<Duration>, Option<sce_engine::PersistStats>) {
    let vol = Arc::new(warm_volume(source, cache, persist));
    // The steady state: the load runs a quarter of its time unmeasured first (both sides),
    // so the first writes to each slot (journaled until the slot turns write-hot) are not
    // what is measured; `spread` below measures those.
    let measured = Instant::now() + Duration::from_secs_f64(secs / 4.0);
    let deadline = measured + Duration::from_secs_f64(secs);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let vol = vol.clone();
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t + 1);
                let mut data = AlignedBuf::new(4096);
                let mut out = Vec::new();
                while Instant::now() < deadline {
                    // A skewed pick: u^3 puts most accesses on the first pages.
                    let u: f64 = rng.gen();
                    let page = ((u * u * u) * (48.0 * 256.0)) as u64;
                    if rng.gen_bool(0.13) {
                        rng.fill(&mut data[..]);
                        let t0 = Instant::now();
                        vol.write_at(page * 4096, &data).unwrap();
                        if t0 >= measured {
                            out.push(t0.elapsed());
                        }
                    } else {
                        vol.read_at(page * 4096, &mut data).unwrap();
                    }
                }
                out
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.join().unwrap());
    }
    (all, vol.persist_stats())
}

fn latency_part(dir: &std::path::Path, n: usize) {
    let (secs, rounds) = if n < 1000 { (1.0, 1) } else { (12.0, 4) };
    println!(
        "write latency, oltp: 4 threads, 87% reads / 13% writes of 4 KiB pages over 48 cached \
         1 MiB fragments, {secs} s per configuration in {rounds} alternating rounds, O_DIRECT \
         cache file (microseconds; \"writes\": with persistence on; crash journal {}):",
        if journal() { "on" } else { "off" }
    );
    println!(
        "{:<22} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "source",
        "writes",
        "off mean",
        "off p50",
        "off p99",
        "on mean",
        "on p50",
        "on p99",
        "mean x",
        "p99 x",
        "syncs",
        "presets",
        "jblocks"
    );
    for (sname, slow) in [("memory", false), ("2 ms, 64 in flight", true)] {
        // Off and on alternate in short rounds, and each side pools its rounds, so that a
        // burst of noise on this shared machine falls on both sides alike.
        let mut pooled: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
        let (mut syncs, mut presets, mut jblocks) = (0, 0, 0);
        for _ in 0..rounds {
            for persist in [false, true] {
                let (source, cache) = devices(dir, slow);
                let (v, p) = oltp(source, cache, persist, 4, secs / rounds as f64);
                pooled[persist as usize].extend(v);
                if let Some(p) = p {
                    syncs += p.intent_syncs;
                    presets += p.intent_presets;
                    jblocks += p.journal_blocks;
                }
            }
        }
        let [off, on] = pooled;
        let res = [lat(off), lat(on)];
        let writes_n = res[1].n;
        println!(
            "{:<22} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2} {:>8} {:>8} {:>8}",
            sname,
            writes_n,
            res[0].mean,
            res[0].p50,
            res[0].p99,
            res[1].mean,
            res[1].p50,
            res[1].p99,
            res[1].mean / res[0].mean,
            res[1].p99 / res[0].p99,
            syncs,
            presets,
            jblocks
        );
    }
    println!();
    println!(
        "write latency, 4 KiB writes to cached fragments, O_DIRECT cache file (microseconds; crash journal {}):",
        if journal() { "on" } else { "off" }
    );
    println!(
        "{:<22} {:<8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "source",
        "pattern",
        "off mean",
        "off p50",
        "off p99",
        "on mean",
        "on p50",
        "on p99",
        "mean x",
        "p99 x"
    );
    for (sname, slow) in [("memory", false), ("2 ms, 64 in flight", true)] {
        for (hot, threads) in [(true, 1), (true, 16), (false, 1)] {
            let mut res = Vec::new();
            let each = n;
            for persist in [false, true] {
                let (source, cache) = devices(dir, slow);
                res.push(writes(source, cache, persist, (hot, threads), each));
            }
            println!(
                "{:<22} {:<8} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>8.2} {:>8.2}",
                sname,
                match (hot, threads) {
                    (true, 1) => "hot",
                    (true, _) => "hot QD16",
                    _ => "spread",
                },
                res[0].mean,
                res[0].p50,
                res[0].p99,
                res[1].mean,
                res[1].p50,
                res[1].p99,
                res[1].mean / res[0].mean,
                res[1].p99 / res[0].p99
            );
        }
    }
    let _ = std::fs::remove_file(dir.join("sce-bench-lat.img"));
}

/// The core shards of the start-up part's volume (and of the image it writes).
const BENCH_SHARDS: usize = 4;

fn startup_part(dir: &std::path::Path, cache_size: u64) {
    let path = dir.join("sce-bench-startup.img");
    let _ = std::fs::remove_file(&path);
    let cache = cache_file(dir, "sce-bench-startup.img", cache_size);
    let source_size = 4 * cache_size;
    let source: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(source_size));
    // The volume records the source's identity, as `sce serve` would have.
    let identity = sce_store::identity_hash(&source.identity().expect("memory identity"));
    let sb = sce_store::format(
        &*cache,
        &sce_store::FormatOptions {
            fragment_size: MIB,
            volume: sce_store::Volume {
                id: 1,
                generation: 1,
                source_size,
                name: "bench-source".into(),
                identity,
                detached: false,
                writeback: false,
            },
            size: None,
            log_bytes: 0,
            lend_bytes: 0,
        },
    )
    .expect("format");
    let l = sb.layout;
    // Every slot holds a fragment with every page valid; the data is the sparse file's zeros,
    // so the checksums are those of a zero page at each page's address. A slot may hold only a
    // fragment of the core shard that owns it, so the image is laid out with the shard map
    // the volume will use (`BENCH_SHARDS`): the slots of shard `k`, in order, hold every
    // third of the shard's fragments, in order.
    let map = ShardMap::new(BENCH_SHARDS, MIB, source_size, sb.layout.slots);
    let mut frag_of = vec![u64::MAX; sb.layout.slots as usize];
    let mut seen = [0u64; BENCH_SHARDS];
    let mut next: Vec<u32> = (0..BENCH_SHARDS).map(|k| map.slot_base(k)).collect();
    for f in 0..source_size / MIB {
        let k = map.shard_of_frag(f);
        if seen[k].is_multiple_of(3) && next[k] < map.slot_base(k) + map.slots(k) {
            frag_of[next[k] as usize] = f;
            next[k] += 1;
        }
        seen[k] += 1;
    }
    assert!(
        frag_of.iter().all(|&f| f != u64::MAX),
        "a slot without a fragment"
    );
    let frag_in = |s: u32| frag_of[s as usize];
    let zero = [0u8; 4096];
    let pages = l.pages_per_fragment as u64;
    let bitmap = vec![u64::MAX; l.bitmap_words()];
    let t = Instant::now();
    let per = (8 * MIB / l.unit_size as u64) as u32;
    let mut buf = AlignedBuf::new((per * l.unit_size) as usize);
    let mut u = 0;
    while u < l.units {
        let n = per.min(l.units - u);
        for k in 0..n {
            let mut b = UnitBuilder::new(&l, &sb.uuid, u + k, 1);
            let (first, end) = l.unit_slots(u + k);
            for s in first..end {
                b.set(
                    s - first,
                    &EntryIn {
                        frag: frag_in(s),
                        volume: 1,
                        generation: 1,
                        bitmap: &bitmap,
                        dirty: &[],
                    },
                    |p| {
                        let page = frag_in(s) * pages + p as u64;
                        sce_store::page_checksum(&zero, sce_store::page_seed(1, page))
                    },
                );
            }
            let img = b.finish();
            buf[(k * l.unit_size) as usize..((k + 1) * l.unit_size) as usize].copy_from_slice(&img);
        }
        cache
            .write_at(l.unit_offset(u), &buf[..(n * l.unit_size) as usize])
            .expect("write units");
        u += n;
    }
    cache.flush().unwrap();
    println!(
        "start-up: {} cache device, {} slots of 1 MiB all in use, {} of metadata written in {:.1} s",
        human(cache_size),
        l.slots,
        human(l.metadata_bytes()),
        t.elapsed().as_secs_f64()
    );
    for run in 0..2 {
        let t = Instant::now();
        let vol = CacheVolume::open(
            source.clone(),
            cache.clone(),
            EngineConfig {
                background_population: false,
                persist: Some(PersistConfig::new("bench-source")),
                core_shards: BENCH_SHARDS,
                ..EngineConfig::default()
            },
        )
        .expect("open");
        let open = t.elapsed();
        let p = vol.persist_stats().unwrap();
        println!(
            "  open #{}: {:.2} s in all ({} ms reading and checking metadata), {} fragments restored",
            run + 1,
            open.as_secs_f64(),
            p.load_millis,
            p.fragments_restored
        );
        assert_eq!(p.fragments_restored, l.slots as u64);
        let t = Instant::now();
        drop(vol);
        println!("  clean shutdown: {:.2} s", t.elapsed().as_secs_f64());
    }
    let _ = std::fs::remove_file(&path);
}

fn human(n: u64) -> String {
    if n >= 1 << 40 {
        format!("{:.0} TiB", n as f64 / (1u64 << 40) as f64)
    } else if n >= 1 << 30 {
        format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.0} MiB", n as f64 / (1u64 << 20) as f64)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = !args.iter().any(|a| a == "--bench");
    // `cargo bench --bench persist -- latency` (or `startup`) runs one part.
    let only = |part: &str| {
        let named: Vec<&String> = args
            .iter()
            .skip(1)
            .filter(|a| !a.starts_with("--"))
            .collect();
        named.is_empty() || named.iter().any(|a| *a == part)
    };
    let dir = std::env::temp_dir();
    if only("latency") {
        latency_part(&dir, if quick { 96 } else { 2000 });
    }
    if only("startup") {
        startup_part(&dir, if quick { 4 << 30 } else { 1 << 40 });
    }
}
