//! Multi-threaded stress on real files opened with O_DIRECT: several threads write
//! verifiable patterns through a `CacheVolume` and read them back while population and
//! eviction run (the cache is much smaller than the data). Every read is checked against
//! what the thread knows it wrote; at the end the whole volume and the source file itself
//! are checked. Bounded by operation count, never by time. Each load runs under the
//! deadlock detector and stall guard of `common/watchdog.rs`.

mod common;

use common::watchdog::{run_watched, Progress};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sce_core::{Admission, CoreConfig, EvictionKind, WriteMode};
use sce_engine::CacheVolume;
use sce_io::{
    AlignedBuf, BlockDevice, Delay, DirectMode, FileDevice, FileOptions, LatencyConfig,
    LatencyDevice,
};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

const REGION: u64 = 64 << 10;
const SECTOR: u64 = 512;
/// Hang guard only: a load takes seconds.
const BOUND: Duration = Duration::from_secs(600);

/// The content of sector `s` after version `v` of it was written: a stamp of both.
fn stamp(buf: &mut [u8], first_sector: u64, versions: &[u32]) {
    for (i, chunk) in buf.chunks_mut(SECTOR as usize).enumerate() {
        let s = first_sector + i as u64;
        let v = versions[i];
        for (j, w) in chunk.chunks_mut(8).enumerate() {
            let x = (s << 32 | v as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ j as u64;
            w.copy_from_slice(&x.to_le_bytes());
        }
    }
}

fn expected(first_sector: u64, versions: &[u32]) -> Vec<u8> {
    let mut v = vec![0u8; versions.len() * SECTOR as usize];
    stamp(&mut v, first_sector, versions);
    v
}

struct Setup {
    _dir: tempfile::TempDir,
    source_file: Arc<FileDevice>,
    volume: Arc<CacheVolume>,
}

fn setup(core: CoreConfig, source_size: u64, cache_size: u64) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = |n| FileOptions {
        direct: DirectMode::Required,
        create_size: Some(n),
        read_only: false,
        ..Default::default()
    };
    let source_file =
        Arc::new(FileDevice::open(&dir.path().join("source"), &opts(source_size)).expect("source"));
    let cache =
        Arc::new(FileDevice::open(&dir.path().join("cache"), &opts(cache_size)).expect("cache"));
    let lat = LatencyConfig {
        read: Delay::Uniform {
            min: Duration::ZERO,
            max: Duration::from_micros(300),
        },
        write: Delay::Uniform {
            min: Duration::ZERO,
            max: Duration::from_micros(300),
        },
        flush: Delay::None,
        max_in_flight: 16,
        bandwidth: None,
        seed: 7,
    };
    let source: Arc<dyn BlockDevice> = Arc::new(LatencyDevice::new(source_file.clone(), lat));
    let mut core = core;
    common::eager_throttle(&mut core);
    let volume = CacheVolume::open(source, cache, common::awt_engine(core)).expect("open volume");
    Setup {
        _dir: dir,
        source_file,
        volume: Arc::new(volume),
    }
}

/// Runs `stress_load` under the watchdog: a lock-order cycle or a hang fails the test.
fn stress(core: CoreConfig, threads: u64, ops: usize) {
    let what = format!("stress: {threads} threads, {ops} operations each");
    run_watched(&what, BOUND, move |progress| {
        stress_load(core, threads, ops, progress)
    });
}

fn stress_load(core: CoreConfig, threads: u64, ops: usize, progress: Progress) {
    let source_size = 32 << 20;
    let cache_size = (8 << 20).max(2 * core.fragment_size);
    let s = setup(core, source_size, cache_size);
    let regions = source_size / REGION;
    let sectors_per_region = (REGION / SECTOR) as usize;
    let mut handles = Vec::new();
    for t in 0..threads {
        let vol = s.volume.clone();
        let progress = progress.clone();
        handles.push(std::thread::spawn(
            move || -> (u64, Vec<(u64, Vec<u32>)>) {
                let mut rng = SmallRng::seed_from_u64(t + 100);
                // This thread owns regions r with r % threads == t; versions per sector.
                let mine: Vec<u64> = (0..regions).filter(|r| r % threads == t).collect();
                let mut versions: Vec<Vec<u32>> = mine
                    .iter()
                    .map(|_| vec![0u32; sectors_per_region])
                    .collect();
                let mut checked = 0u64;
                for i in 0..ops {
                    let ri = rng.gen_range(0..mine.len());
                    let base = mine[ri] * REGION;
                    // Unaligned to pages on purpose: any sector offset, 1..=48 sectors.
                    let first = rng.gen_range(0..sectors_per_region);
                    let n = rng.gen_range(1..=48.min(sectors_per_region - first));
                    let off = base + first as u64 * SECTOR;
                    let mut buf = AlignedBuf::new(n * SECTOR as usize);
                    if rng.gen_bool(0.4) {
                        for v in &mut versions[ri][first..first + n] {
                            *v += 1;
                        }
                        stamp(&mut buf, off / SECTOR, &versions[ri][first..first + n]);
                        vol.write_at(off, &buf).expect("write");
                    } else {
                        vol.read_at(off, &mut buf).expect("read");
                        let want = expected(off / SECTOR, &versions[ri][first..first + n]);
                        // Sectors never written read as zero (sparse source).
                        for k in 0..n {
                            let got = &buf[k * 512..(k + 1) * 512];
                            let w = if versions[ri][first + k] == 0 {
                                &[0u8; 512][..]
                            } else {
                                &want[k * 512..(k + 1) * 512]
                            };
                            assert!(
                                got == w,
                                "thread {t} op {i}: mismatch at sector {} (version {})",
                                off / SECTOR + k as u64,
                                versions[ri][first + k]
                            );
                        }
                        checked += n as u64;
                    }
                    progress.fetch_add(1, Relaxed);
                }
                (checked, mine.into_iter().zip(versions).collect())
            },
        ));
    }
    let mut all = Vec::new();
    let mut checked = 0;
    for h in handles {
        let (c, v) = h.join().expect("thread");
        checked += c;
        all.extend(v);
    }
    s.volume.quiesce();
    // Every region, through the cache and straight from the source file.
    for (r, versions) in &all {
        let off = r * REGION;
        let want: Vec<u8> = {
            let e = expected(off / SECTOR, versions);
            e.chunks(512)
                .zip(versions)
                .flat_map(|(c, v)| if *v == 0 { vec![0u8; 512] } else { c.to_vec() })
                .collect()
        };
        let mut buf = AlignedBuf::new(REGION as usize);
        s.volume.read_at(off, &mut buf).expect("final read");
        assert!(
            buf[..] == want[..],
            "final read through the cache differs in region {r}"
        );
        s.source_file.read_at(off, &mut buf).expect("source read");
        assert!(buf[..] == want[..], "source differs in region {r}");
    }
    let st = s.volume.stats();
    eprintln!(
        "checked {checked} sectors; hits {} misses {} populated {} evicted {} awt {} dup {} fallback {}",
        st.read_pages_hit, st.read_pages_missed, st.fragments_populated, st.fragments_evicted, st.awt_completed, st.awt_duplicates, st.awt_fallbacks
    );
    assert!(checked > 0);
    // The test is only meaningful if the cache really served and churned.
    assert!(
        st.read_pages_hit > 0,
        "no read hit at all: the cache was not exercised"
    );
    assert!(
        st.fragments_populated > 0 || st.pages_populated > 0,
        "nothing was populated"
    );
}

fn cfg(
    fragment_size: u64,
    admission: Admission,
    write_mode: WriteMode,
    eviction: EvictionKind,
) -> CoreConfig {
    CoreConfig {
        fragment_size,
        admission,
        write_mode,
        eviction,
        hot_window: 16,
        ..CoreConfig::default()
    }
}

#[test]
fn stress_sce_awt_clock() {
    stress(
        cfg(1 << 20, Admission::Sce, WriteMode::Awt, EvictionKind::Clock),
        6,
        1500,
    );
}

#[test]
fn stress_sce_small_fragments_write_around() {
    stress(
        cfg(
            64 << 10,
            Admission::Sce,
            WriteMode::WriteAround,
            EvictionKind::Fifo,
        ),
        4,
        1500,
    );
}

/// Miss fills in 64 KiB lines of 1 MiB heat regions (issue 30): reads fill the cache from
/// their own data, under writes to the same pages.
#[test]
fn stress_sce_miss_fills_in_lines() {
    let mut c = cfg(
        64 << 10,
        Admission::Sce,
        WriteMode::Awt,
        EvictionKind::Clock,
    );
    c.heat_size = 1 << 20;
    c.miss_fills = true;
    stress(c, 4, 1500);
}

#[test]
fn stress_flashcache_like() {
    stress(CoreConfig::flashcache_like(), 4, 1500);
}

#[test]
fn stress_nhit_write_through_lru() {
    stress(
        cfg(
            256 << 10,
            Admission::NHit(2),
            WriteMode::WriteThrough,
            EvictionKind::Lru,
        ),
        4,
        1500,
    );
}
