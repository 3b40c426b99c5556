//! Issue 44: the write-back log never wedges, and every drain ends. One page the cleaner
//! cannot write back (the last page of an odd-sized source, one source block that fails
//! writes, one log page damaged while serving) holds only itself: every other write goes on
//! and is cleaned. A drain under a writer that never stops ends, and a write that went
//! through to the source during it is never taken back by a crash. A discard reaches the
//! source as a discard.
//!
//! Each test fails on the main before issue 44 (the wedges: writes wait out the wait limit
//! and fail with ENOSPC; the drain: never ends, caught by the hang guard).

mod common;

use common::crash::machine;
use common::watchdog::run_watched;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_engine::{CacheVolume, EngineConfig, VolumePart};
use sce_io::{AlignedBuf, BlockDevice, FaultDevice, LatencyConfig, LatencyDevice, MemDevice, Op};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const PAGE: u64 = 4096;

/// Write-back through a 1 MiB log (the least), a writer waiting at most `wait` for room.
fn config(wait: Duration) -> EngineConfig {
    let mut c = EngineConfig {
        writeback_wait: wait,
        writeback_idle: Duration::from_secs(3600),
        background_population: false,
        ..common::writeback_config("wb-wedge", Duration::from_secs(3600))
    };
    c.persist.as_mut().unwrap().writeback_log = MIB;
    c
}

fn page(tag: u8, n: u64) -> Vec<u8> {
    (0..PAGE as usize)
        .map(|i| tag ^ (n as u8).wrapping_mul(31) ^ (i / 64) as u8)
        .collect()
}

/// Writes `count` pages of `tag` over `[base, base + span)` pages (each page written once
/// per lap of the span), a FLUSH every 64: five laps of a 1 MiB log and more. Returns the
/// pages written.
fn write_many(vol: &CacheVolume, base: u64, span: u64, count: u64, tag: u8) -> Vec<u64> {
    let mut pages = Vec::new();
    for k in 0..count {
        let p = base + (k * 7) % span;
        vol.write_at(p * PAGE, &page(tag, p)).unwrap_or_else(|e| {
            panic!("write {k} of {count} failed (the log wedged?): {e}");
        });
        pages.push(p);
        if k % 64 == 63 {
            vol.flush().unwrap();
        }
    }
    vol.flush().unwrap();
    pages
}

fn read(dev: &dyn BlockDevice, at: u64, len: u64) -> Vec<u8> {
    common::read(dev, at, len)
}

/// A source of 16 MiB + 512 bytes: a 512-byte write to its last page is cleaned up to the
/// source's end (the main before wrote a whole page past it, failed every batch, and the
/// log filled: every later write waited and failed).
#[test]
fn an_odd_sized_source_s_last_page_is_cleaned_up_to_its_end() {
    let size = 16 * MIB + 512;
    let source = Arc::new(MemDevice::new(size));
    let cache = Arc::new(MemDevice::new(8 * MIB));
    let vol = CacheVolume::open(source.clone(), cache, config(Duration::from_secs(3))).unwrap();
    vol.write_at(16 * MIB, &[0x5c; 512]).unwrap();
    vol.flush().unwrap();
    let pages = write_many(&vol, 16, 3000, 2048, 0xa1);
    vol.flush_to_source(None, Duration::from_secs(30)).unwrap();
    assert_eq!(read(&*source, 16 * MIB, 512), vec![0x5c; 512]);
    assert_eq!(vol.writeback_stats().unwrap().dirty_bytes, 0);
    for &p in pages.iter().step_by(97) {
        assert_eq!(read(&*source, p * PAGE, PAGE), page(0xa1, p), "page {p}");
    }
}

/// Two volumes on one cache device; volume a's source fails writes to one block. Volume
/// b's writes go on and are cleaned (the main before stopped them once the log was full),
/// a's bad page stays dirty and readable, holding only itself, and is cleaned once its
/// source takes it again.
#[test]
fn one_source_block_that_fails_writes_holds_only_itself() {
    let a = Arc::new(FaultDevice::new(MemDevice::new(16 * MIB)));
    let faults = a.control();
    let b = Arc::new(MemDevice::new(16 * MIB));
    let parts = vec![
        VolumePart::new("a", a.clone()),
        VolumePart::new("b", b.clone()),
    ];
    let cache = Arc::new(MemDevice::new(8 * MIB));
    let vol = CacheVolume::open_shared(parts, cache, config(Duration::from_secs(3))).unwrap();
    let base_b = vol.volumes()[1].1.base;
    faults.fail_range(&[Op::Write], 100 * PAGE..101 * PAGE);
    vol.write_at(100 * PAGE, &page(0x11, 100)).unwrap();
    vol.flush().unwrap();
    let pages = write_many(&vol, base_b / PAGE, 3000, 3072, 0xb2);
    vol.flush_to_source(Some((base_b, 16 * MIB)), Duration::from_secs(30))
        .unwrap();
    for &p in pages.iter().step_by(101) {
        let local = p - base_b / PAGE;
        assert_eq!(
            read(&*b, local * PAGE, PAGE),
            page(0xb2, p),
            "b's page {local}"
        );
    }
    let wb = vol.writeback_stats().unwrap();
    assert_eq!(
        wb.dirty_bytes, PAGE,
        "a's bad page alone stays dirty: {wb:?}"
    );
    assert!(wb.clean_errors > 0, "{wb:?}");
    assert_eq!(read(&vol, 100 * PAGE, PAGE), page(0x11, 100));
    faults.clear();
    vol.flush_to_source(None, Duration::from_secs(30)).unwrap();
    assert_eq!(read(&*a, 100 * PAGE, PAGE), page(0x11, 100));
    assert_eq!(vol.writeback_stats().unwrap().dirty_bytes, 0);
}

/// The ring position of the page whose bytes are `want` in the log of `cache`.
fn log_block_of(cache: &MemDevice, want: &[u8]) -> u64 {
    let sb = sce_store::read_superblock(cache).unwrap();
    let log = sb.log.expect("a log");
    let region = log.region(&sb.layout);
    (0..region.blocks)
        .map(|b| region.offset + b * PAGE)
        .find(|&at| read(cache, at, PAGE) == want)
        .expect("the page is in the log")
}

/// One flushed log page damaged while the server runs: reads of it fail (never older
/// bytes), it is counted lost once, the rest is cleaned and writes go on (the main before
/// never counted it and wedged the cleaner), and a restart finds it lost still, until it is
/// written again.
#[test]
fn a_log_page_damaged_while_serving_is_lost_alone() {
    let source = Arc::new(MemDevice::new(32 * MIB));
    let cache = Arc::new(MemDevice::new(8 * MIB));
    let cfg = || config(Duration::from_secs(3));
    let vol = CacheVolume::open(source.clone(), cache.clone(), cfg()).unwrap();
    let victim = page(0x77, 5);
    vol.write_at(5 * PAGE, &victim).unwrap();
    vol.flush().unwrap();
    let at = log_block_of(&cache, &victim);
    let mut b = read(&*cache, at, PAGE);
    b[100] ^= 0xff;
    cache.write_at(at, &b).unwrap();
    write_many(&vol, 100, 3000, 3072, 0xc3);
    let mut buf = AlignedBuf::new(PAGE as usize);
    assert!(
        vol.read_at(5 * PAGE, &mut buf).is_err(),
        "a damaged page read"
    );
    vol.flush_to_source(None, Duration::from_secs(30)).unwrap();
    let wb = vol.writeback_stats().unwrap();
    assert_eq!((wb.dirty_bytes, wb.lost_bytes), (0, PAGE), "{wb:?}");
    assert_eq!(read(&*source, 5 * PAGE, PAGE), vec![0; PAGE as usize]);
    drop(vol);
    let vol = CacheVolume::open(source.clone(), cache.clone(), cfg()).unwrap();
    assert!(
        vol.read_at(5 * PAGE, &mut buf).is_err(),
        "lost after a restart"
    );
    vol.write_at(5 * PAGE, &page(0x78, 5)).unwrap();
    assert_eq!(read(&vol, 5 * PAGE, PAGE), page(0x78, 5));
    assert_eq!(vol.writeback_stats().unwrap().lost_bytes, 0);
}

/// A source of `size` bytes with `latency` per write, 16 writes at once.
fn slow_source(size: u64, latency: Duration) -> (Arc<MemDevice>, Arc<dyn BlockDevice>) {
    let mem = Arc::new(MemDevice::new(size));
    let mut cfg = LatencyConfig::disk(latency, 16);
    cfg.read = sce_io::latency::Delay::None;
    let slow: Arc<dyn BlockDevice> = Arc::new(LatencyDevice::new(mem.clone(), cfg));
    (mem, slow)
}

/// `flush --to-source` (a drain) under a writer that never stops, over a source with 2 ms
/// writes: it ends, while the writer still writes (the main before cleaned as the writer
/// dirtied and never ended: the hang guard fails it), and everything acknowledged before
/// it ended is on the source.
#[test]
fn a_drain_under_a_writer_that_never_stops_ends() {
    run_watched(
        "a drain under a steady writer",
        Duration::from_secs(240),
        |progress| {
            let (mem, slow) = slow_source(64 * MIB, Duration::from_millis(2));
            let cache = Arc::new(MemDevice::new(32 * MIB));
            let mut cfg = config(Duration::from_secs(60));
            cfg.persist.as_mut().unwrap().writeback_log = 8 * MIB;
            let vol = Arc::new(CacheVolume::open(slow, cache, cfg).unwrap());
            // 4 MiB dirty before the drain starts.
            for p in 0..1024 {
                vol.write_at(p * PAGE, &page(1, p)).unwrap();
            }
            vol.flush().unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let writes = Arc::new(AtomicU64::new(0));
            let writer = {
                let (vol, stop, writes, progress) =
                    (vol.clone(), stop.clone(), writes.clone(), progress.clone());
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(44);
                    let mut last = vec![1u8; 4096];
                    while !stop.load(Relaxed) {
                        let p = rng.gen_range(0..4096u64);
                        let tag = 2 + (writes.load(Relaxed) % 200) as u8;
                        vol.write_at(p * PAGE, &page(tag, p)).unwrap();
                        last[p as usize] = tag;
                        if writes.fetch_add(1, Relaxed) % 32 == 31 {
                            vol.flush().unwrap();
                        }
                        progress.fetch_add(1, Relaxed);
                    }
                    vol.flush().unwrap();
                    last
                })
            };
            while writes.load(Relaxed) < 200 {
                std::thread::sleep(Duration::from_millis(5));
            }
            let during = writes.load(Relaxed);
            vol.flush_to_source(None, Duration::from_secs(60)).unwrap();
            let after = writes.load(Relaxed);
            stop.store(true, Relaxed);
            let last = writer.join().unwrap();
            assert!(after > during, "the writer went on during the drain");
            vol.flush_to_source(None, Duration::from_secs(60)).unwrap();
            for (p, &tag) in last.iter().enumerate().step_by(7) {
                let p = p as u64;
                let want = if tag == 1 && p >= 1024 {
                    vec![0; 4096]
                } else {
                    page(tag, p)
                };
                assert_eq!(read(&*mem, p * PAGE, PAGE), want, "page {p} on the source");
                assert_eq!(
                    read(&*vol, p * PAGE, PAGE),
                    want,
                    "page {p} through the cache"
                );
            }
        },
    );
}

/// A write that went through to the source during a drain, then a FLUSH, then a crash:
/// the page reads as that write, never the log's older version (the cleaned entry that
/// superseded it was durable before the write was acknowledged), and the cleaner never
/// writes the older version over it.
#[test]
fn a_write_through_a_drain_is_never_taken_back_by_a_crash() {
    for round in 0..20u64 {
        let source_mem = Arc::new(MemDevice::new(16 * MIB));
        let cache_mem = Arc::new(MemDevice::new(8 * MIB));
        let (cache, source) = machine(&cache_mem, &source_mem);
        let slow: Arc<dyn BlockDevice> = Arc::new(LatencyDevice::new(
            source,
            LatencyConfig::disk(Duration::from_micros(500), 4),
        ));
        let vol = CacheVolume::open(slow, cache.clone(), config(Duration::from_secs(5))).unwrap();
        for p in 0..256 {
            vol.write_at(p * PAGE, &page(1, p)).unwrap();
        }
        vol.flush().unwrap();
        // Eight writes through to the source once the drain runs (from its own loop, while
        // the cleaner thread cleans beside it).
        let written = std::sync::Mutex::new(Vec::new());
        let cancelled = || {
            let mut w = written.lock().unwrap();
            while w.len() < 8 {
                let p = (round * 31 + w.len() as u64 * 37) % 256;
                vol.write_at(p * PAGE, &page(9, p)).unwrap();
                w.push(p);
            }
            false
        };
        let ctl = sce_engine::DrainControl {
            cancelled: &cancelled,
            progress: &|_| {},
            patience: Duration::from_secs(30),
        };
        vol.drain_writeback(None, &ctl).unwrap();
        let written = written.into_inner().unwrap();
        assert_eq!(written.len(), 8);
        for p in 0..4 {
            vol.write_at((300 + p) * PAGE, &page(2, p)).unwrap();
        }
        vol.flush().unwrap();
        cache.crash(&mut SmallRng::seed_from_u64(round));
        drop(vol);
        let (cache, source) = machine(&cache_mem, &source_mem);
        let vol = CacheVolume::open(source, cache, config(Duration::from_secs(5))).unwrap();
        for p in 0..256 {
            let want = if written.contains(&p) {
                page(9, p)
            } else {
                page(1, p)
            };
            assert_eq!(read(&vol, p * PAGE, PAGE), want, "round {round}: page {p}");
        }
        vol.flush_to_source(None, Duration::from_secs(30)).unwrap();
        for &p in &written {
            assert_eq!(
                read(&*source_mem, p * PAGE, PAGE),
                page(9, p),
                "source page {p}"
            );
        }
    }
}

/// A discard of 8 MiB of dirty pages over a sparse source: the source stays sparse (the
/// main before wrote 8 MiB of zeroes through the log to it), and the pages read as zeroes,
/// after a restart too.
#[test]
fn a_discard_in_write_back_reaches_the_source_as_a_discard() {
    let source = Arc::new(MemDevice::new(32 * MIB));
    let cache = Arc::new(MemDevice::new(16 * MIB));
    let mut cfg = config(Duration::from_secs(5));
    cfg.persist.as_mut().unwrap().writeback_log = 4 * MIB;
    let vol = CacheVolume::open(source.clone(), cache.clone(), cfg.clone()).unwrap();
    for p in 0..64 {
        vol.write_at((2048 + p) * PAGE, &page(5, p)).unwrap();
    }
    vol.flush().unwrap();
    // 8 MiB from 8 MiB on, unaligned at both ends: the edges are written as zeroes.
    vol.discard(8 * MIB - 512, 8 * MIB + 1024).unwrap();
    vol.flush().unwrap();
    assert!(read(&vol, 8 * MIB - 512, 8 * MIB + 1024)
        .iter()
        .all(|&x| x == 0));
    vol.flush_to_source(None, Duration::from_secs(30)).unwrap();
    // The edges' zeroes allocate the two 1 MiB chunks of the memory device they fall in.
    assert!(
        source.allocated_bytes() <= 2 * MIB,
        "the discard allocated the source: {} bytes",
        source.allocated_bytes()
    );
    drop(vol);
    let vol = CacheVolume::open(source.clone(), cache, cfg).unwrap();
    assert!(read(&vol, 8 * MIB, 8 * MIB).iter().all(|&x| x == 0));
    assert_eq!(vol.writeback_stats().unwrap().dirty_bytes, 0);
}
