//! Write-back in the engine (issue 15): writes land in the cache only, the cleaner and
//! `flush_to_source` copy them to the source, and crashes (power loss: the cache device
//! loses a random part of what was not flushed) never lose a flushed write nor bring back
//! older bytes.

mod common;

use common::{random_source, read};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_engine::{CacheVolume, EngineConfig};
use sce_io::{AlignedBuf, BlockDevice, FaultDevice, MemDevice, Op};
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const PAGE: u64 = 4096;

/// `config` without idle cleaning: only the watermarks, waiting writes and flushes to the
/// source start the cleaner.
fn quiet_config(interval_ms: u64) -> EngineConfig {
    EngineConfig {
        writeback_idle: Duration::from_secs(3600),
        ..config(interval_ms)
    }
}

fn config(interval_ms: u64) -> EngineConfig {
    EngineConfig {
        // After a crash the devices refuse everything: writers waiting for room give up
        // (the test's writers stop at the crash; only the concurrent ones may be waiting).
        writeback_wait: Duration::from_secs(2),
        ..common::writeback_config("wb-source", Duration::from_millis(interval_ms))
    }
}

#[test]
fn writes_stay_in_the_cache_until_flushed_to_the_source() {
    let source = random_source(8 * MIB, 1);
    let cache = Arc::new(MemDevice::new(16 * MIB));
    // No cleaning but the forced kind: 200 writes into 512 KiB take under two thirds of
    // the 4 MiB write-back log, below a low watermark of 0.9 (at the default 0.25 the
    // background cleaner started during the writes, and on a loaded machine could finish
    // before the source was compared), and the idle rule is off.
    let mut cfg = quiet_config(50);
    cfg.core.writeback.low_watermark = 0.9;
    cfg.core.writeback.high_watermark = 0.95;
    let vol = CacheVolume::open(source.clone(), cache.clone(), cfg).expect("open");
    let mut model = read(&*source, 0, 8 * MIB);
    let mut rng = SmallRng::seed_from_u64(2);
    for _ in 0..200 {
        // Sector-aligned, often not page-aligned: edges are read and merged.
        let len = rng.gen_range(1..=32u64) * 512;
        let at = rng.gen_range(0..(MIB / 2 - len) / 512) * 512;
        let mut b = vec![0u8; len as usize];
        rng.fill(&mut b[..]);
        vol.write_at(at, &b).expect("write");
        model[at as usize..(at + len) as usize].copy_from_slice(&b);
    }
    assert_eq!(
        read(&vol, 0, 8 * MIB),
        model,
        "the volume reads its writes back"
    );
    let wb = vol.writeback_stats().expect("write-back");
    assert!(wb.dirty_bytes > 0, "{wb:?}");
    assert_ne!(
        read(&*source, 0, 8 * MIB),
        model,
        "the writes went to the source at once"
    );
    vol.flush_to_source(None, Duration::from_secs(30))
        .expect("flush to source");
    // Cleaned by the flush or, before it, by the background cleaner (it may have been
    // quicker on a busy machine: the flush then had nothing left to clean).
    let wb = vol.writeback_stats().unwrap();
    assert!(wb.cleaned_bytes > 0, "{wb:?}");
    assert_eq!(wb.dirty_bytes, 0);
    assert_eq!(
        read(&*source, 0, 8 * MIB),
        model,
        "the source holds every write"
    );
    assert_eq!(read(&vol, 0, 8 * MIB), model);
    assert!(vol.shutdown(), "clean shutdown");
}

/// An unclean stop with 5% of the cache dirty: the restart brings back exactly that 5%,
/// and cleaning it writes exactly those bytes to the source (no "assume everything dirty").
#[test]
fn an_unclean_stop_with_five_percent_dirty_cleans_only_that() {
    let source_mem = random_source(8 * MIB, 3);
    let cache_mem = Arc::new(MemDevice::new(4 * MIB));
    let (cache, source) = common::crash::machine(&cache_mem, &source_mem);
    // No idle cleaning.
    let cfg = quiet_config(20);
    let vol = CacheVolume::open(source, cache.clone(), cfg.clone()).expect("open");
    // Warm the cache with clean data first: all of it is cached, none of it is dirty.
    let _ = read(&vol, 0, 4 * MIB);
    let cache_bytes = vol.stats().total_slots * 64 * KIB;
    // 5% of the cache, in 32 KiB pieces, each in a fragment of its own over the cached
    // data, in the write-back log: too little to start its cleaner (and the idle rule is
    // off), so nothing is cleaned before the stop or before the count after it.
    let piece = 32 * KIB;
    let pieces = cache_bytes / 20 / piece;
    let dirty_target = pieces * piece;
    let mut model = read(&*source_mem, 0, 8 * MIB);
    let mut rng = SmallRng::seed_from_u64(4);
    let mut b = vec![0u8; dirty_target as usize];
    rng.fill(&mut b[..]);
    for k in 0..pieces {
        let at = k * (4 * MIB / pieces) / (64 * KIB) * (64 * KIB);
        let src = &b[(k * piece) as usize..((k + 1) * piece) as usize];
        vol.write_at(at, src).unwrap();
        model[at as usize..(at + piece) as usize].copy_from_slice(src);
    }
    vol.flush().unwrap();
    let before = vol.writeback_stats().unwrap();
    assert_eq!(before.dirty_bytes, dirty_target, "{before:?}");
    // Power off: nothing unflushed to lose, and no clean shutdown.
    cache.crash(&mut rng);
    drop(vol);
    // Nor after it, until the count below is taken.
    let vol = CacheVolume::open(source_mem.clone(), cache_mem.clone(), cfg).expect("reopen");
    let p = vol.persist_stats().unwrap();
    assert!(!p.previous_shutdown_clean);
    let dirty = vol.writeback_stats().unwrap().dirty_bytes;
    assert_eq!(read(&vol, 0, 8 * MIB), model);
    vol.flush_to_source(None, Duration::from_secs(30)).unwrap();
    // Everything this run wrote to the source, whoever cleaned it.
    let cleaned = vol.stats().source_bytes_written;
    println!(
        "unclean stop with {dirty_target} of {cache_bytes} bytes dirty ({:.1}%): {dirty} dirty \
         after the restart, {cleaned} bytes written to the source by cleaning",
        100.0 * dirty_target as f64 / cache_bytes as f64
    );
    assert_eq!(
        dirty, dirty_target,
        "the restart restored exactly the dirty pages"
    );
    assert_eq!(cleaned, dirty_target, "cleaning wrote only the dirty pages");
    assert_eq!(read(&*source_mem, 0, 8 * MIB), model);
}

/// Per 4 KiB page, the contents a read may return after a crash: what the last flush made
/// durable, and every version acknowledged since (unflushed writes may or may not survive).
#[derive(Default)]
struct Allowed {
    since_flush: HashMap<u64, Vec<u64>>,
}

fn page_hash(b: &[u8]) -> u64 {
    sce_store::page_checksum(b, 0) as u64
}

#[test]
fn crashes_in_write_back_never_lose_a_flushed_write_nor_return_older_bytes() {
    write_back_crashes();
}

fn write_back_crashes() {
    let size = 8 * MIB;
    let source_mem = random_source(size, 5);
    let cache_mem = Arc::new(MemDevice::new(3 * MIB));
    let mut rng = SmallRng::seed_from_u64(6);
    let mut model = read(&*source_mem, 0, size);
    // What the last flush made durable (the model holds the newest).
    let mut durable = model.clone();
    let mut allowed = Allowed::default();
    let (mut restored_dirty, mut crashes_with_dirty) = (0u64, 0u32);
    let iterations = 60;
    for it in 0..iterations {
        let (cache, source) = common::crash::machine(&cache_mem, &source_mem);
        let vol = CacheVolume::open(source.clone(), cache.clone(), config(2)).expect("open");
        if it > 0 {
            restored_dirty += vol.writeback_stats().unwrap().dirty_bytes;
        }
        // After the crash: each page holds its flushed version or one written since.
        let now = read(&vol, 0, size);
        for p in 0..size / PAGE {
            let r = (p * PAGE) as usize..((p + 1) * PAGE) as usize;
            if now[r.clone()] != durable[r.clone()] {
                let ok = allowed
                    .since_flush
                    .get(&p)
                    .is_some_and(|v| v.contains(&page_hash(&now[r.clone()])));
                assert!(
                    ok,
                    "iteration {it}: page {p} reads bytes never written there"
                );
            }
        }
        model = now;
        durable = model.clone();
        allowed.since_flush.clear();
        let ops = rng.gen_range(20..200);
        let crash_at = rng.gen_range(0..ops);
        for op in 0..ops {
            if op == crash_at {
                if vol.writeback_stats().unwrap().dirty_bytes > 0 {
                    crashes_with_dirty += 1;
                }
                cache.crash(&mut rng);
                break;
            }
            let len = rng.gen_range(1..=32u64) * 512;
            let hot = rng.gen_bool(0.5);
            let span = if hot { MIB } else { size };
            let at = rng.gen_range(0..(span - len) / 512) * 512;
            match rng.gen_range(0..10) {
                0..=3 => {
                    let mut b = vec![0u8; len as usize];
                    rng.fill(&mut b[..]);
                    vol.write_at(at, &b).expect("write");
                    model[at as usize..(at + len) as usize].copy_from_slice(&b);
                    let (p0, p1) = (at / PAGE * PAGE, (at + len).div_ceil(PAGE) * PAGE);
                    if std::env::var("WB_DEBUG").is_ok() {
                        let got = read(&vol, p0, p1 - p0);
                        assert!(
                            got[..] == model[p0 as usize..p1 as usize],
                            "it {it} op {op}: write at {at:#x}+{len} reads back wrong"
                        );
                    }
                    for p in at / PAGE..(at + len).div_ceil(PAGE) {
                        let r = (p * PAGE) as usize..((p + 1) * PAGE) as usize;
                        let h = page_hash(&model[r]);
                        allowed.since_flush.entry(p).or_default().push(h);
                    }
                }
                4 => {
                    vol.flush().expect("flush");
                    durable.copy_from_slice(&model);
                    allowed.since_flush.clear();
                }
                _ => {
                    let got = read(&vol, at, len);
                    assert!(
                        got[..] == model[at as usize..(at + len) as usize],
                        "iteration {it}: a read at {at:#x} did not return the newest write"
                    );
                }
            }
        }
        drop(vol);
    }
    println!(
        "{iterations} crashes in write-back, {crashes_with_dirty} with dirty data: \
         {restored_dirty} dirty bytes restored in all"
    );
    assert!(crashes_with_dirty > 0 && restored_dirty > 0);
    // At last everything goes to the source.
    let vol = CacheVolume::open(source_mem.clone(), cache_mem.clone(), config(2)).expect("open");
    let now = read(&vol, 0, size);
    vol.flush_to_source(None, Duration::from_secs(30)).unwrap();
    assert_eq!(read(&*source_mem, 0, size), now, "the source holds it all");
}

/// What one writer thread of the concurrent crash test did: its pages as of its last
/// flush, and the versions it wrote since.
struct Writer {
    durable: Vec<u8>,
    since_flush: HashMap<u64, Vec<u64>>,
}

/// One writer: random writes in its own region `[base, base + len)`, some flushes, until
/// `stop` (or its first error, once the devices froze).
fn writer(vol: &CacheVolume, base: u64, region: Vec<u8>, seed: u64, stop: &AtomicBool) -> Writer {
    let mut rng = SmallRng::seed_from_u64(seed);
    let span = region.len() as u64;
    let mut model = region;
    let mut w = Writer {
        durable: model.clone(),
        since_flush: HashMap::new(),
    };
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let len = rng.gen_range(1..=48u64) * 512;
        let at = rng.gen_range(0..(span - len) / 512) * 512;
        if rng.gen_ratio(1, 6) {
            if vol.flush().is_err() {
                break;
            }
            w.durable.copy_from_slice(&model);
            w.since_flush.clear();
            continue;
        }
        let mut b = vec![0u8; len as usize];
        rng.fill(&mut b[..]);
        let failed = vol.write_at(base + at, &b).is_err();
        if failed {
            // A write that fails (the devices froze under it) leaves its range undefined,
            // as on any disk: the part that landed may be found after the restart.
            let mut next = model.clone();
            next[at as usize..(at + len) as usize].copy_from_slice(&b);
            for p in at / PAGE..(at + len).div_ceil(PAGE) {
                let h = page_hash(&next[(p * PAGE) as usize..((p + 1) * PAGE) as usize]);
                w.since_flush.entry(p).or_default().push(h);
            }
            break;
        }
        model[at as usize..(at + len) as usize].copy_from_slice(&b);
        for p in at / PAGE..(at + len).div_ceil(PAGE) {
            let h = page_hash(&model[(p * PAGE) as usize..((p + 1) * PAGE) as usize]);
            w.since_flush.entry(p).or_default().push(h);
        }
    }
    w
}

#[test]
fn crashes_amid_concurrent_write_back_writers_never_lose_a_flushed_write() {
    let size = 8 * MIB;
    let threads = 4u64;
    let region = size / threads;
    let source_mem = random_source(size, 7);
    let cache_mem = Arc::new(MemDevice::new(3 * MIB));
    let mut rng = SmallRng::seed_from_u64(8);
    let mut writers: Vec<Writer> = Vec::new();
    let iterations = 60;
    for it in 0..iterations {
        let (cache, source) = common::crash::machine(&cache_mem, &source_mem);
        let vol = CacheVolume::open(source.clone(), cache.clone(), config(1)).expect("open");
        let now = read(&vol, 0, size);
        for (t, w) in writers.iter().enumerate() {
            for p in 0..region / PAGE {
                let r = (p * PAGE) as usize..((p + 1) * PAGE) as usize;
                let g = (t as u64 * region) as usize;
                let got = &now[g + r.start..g + r.end];
                let ok = got == &w.durable[r.clone()]
                    || w.since_flush
                        .get(&p)
                        .is_some_and(|v| v.contains(&page_hash(got)));
                assert!(
                    ok,
                    "iteration {it}: writer {t}'s page {p} lost a flushed write"
                );
            }
        }
        let stop = AtomicBool::new(false);
        let delay = Duration::from_millis(rng.gen_range(1..40));
        writers = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (vol, stop) = (&vol, &stop);
                    let mine = now[(t * region) as usize..((t + 1) * region) as usize].to_vec();
                    let seed = it as u64 * 100 + t;
                    sc.spawn(move || writer(vol, t * region, mine, seed, stop))
                })
                .collect();
            std::thread::sleep(delay);
            cache.crash(&mut rng);
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        drop(vol);
    }
}

/// Open CAS's surprise-shutdown test in write-back: every write to the cache device fails
/// from the N-th on, for every N until a run sees no fault. While it fails, a read returns
/// what was acknowledged, or fails (a lost page, and the stats say so), never the source's
/// older bytes; after
/// a restart on the healthy device no write acknowledged before the last successful FLUSH
/// is lost (a write acknowledged since may read as it or as any version since that FLUSH:
/// through the log a write is durable at the FLUSH or FUA after it, as NBD says).
#[test]
fn fail_every_write_from_n_loses_no_acknowledged_write() {
    let size = 4 * MIB;
    let (mut n, mut lost_reads, mut runs_with_lost) = (0u64, 0u64, 0u64);
    let mut held_at_failure = 0u64;
    loop {
        let source = random_source(size, 9);
        let cache_mem = Arc::new(MemDevice::new(2 * MIB));
        let fault = Arc::new(FaultDevice::new(cache_mem.clone()));
        fault.control().fail_from(&[Op::Write], n);
        let mut model = read(&*source, 0, size);
        // Versions of pages written by writes that failed (not acknowledged): either may be
        // found after the restart.
        let mut maybe: HashMap<u64, Vec<u64>> = HashMap::new();
        // Per page written since the last successful FLUSH: its versions since (from the
        // one that FLUSH made durable on).
        let mut since_flush: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut rng = SmallRng::seed_from_u64(n);
        let cfg = quiet_config(5);
        if let Ok(vol) = CacheVolume::open(source.clone(), fault.clone(), cfg) {
            for _ in 0..60 {
                if rng.gen_bool(0.2) {
                    if vol.flush().is_ok() {
                        since_flush.clear();
                    }
                    continue;
                }
                let len = rng.gen_range(1..=16u64) * 512;
                let write = rng.gen_bool(0.5);
                // Writes stay in 256 KiB (under the log's low watermark, and no idle
                // cleaning: dirty data is there when the device fails).
                let span = if write { 256 * KIB } else { size };
                let at = rng.gen_range(0..(span - len) / 512) * 512;
                if write {
                    let mut b = vec![0u8; len as usize];
                    rng.fill(&mut b[..]);
                    let mut next = model.clone();
                    next[at as usize..(at + len) as usize].copy_from_slice(&b);
                    if vol.write_at(at, &b).is_ok() {
                        for p in at / PAGE..(at + len).div_ceil(PAGE) {
                            let r = (p * PAGE) as usize..((p + 1) * PAGE) as usize;
                            let v = since_flush.entry(p).or_default();
                            if v.is_empty() {
                                v.push(page_hash(&model[r.clone()]));
                            }
                            v.push(page_hash(&next[r]));
                        }
                        model = next;
                    } else {
                        for p in at / PAGE..(at + len).div_ceil(PAGE) {
                            let h =
                                page_hash(&next[(p * PAGE) as usize..((p + 1) * PAGE) as usize]);
                            maybe.entry(p).or_default().push(h);
                        }
                    }
                } else {
                    let mut got = AlignedBuf::new(len as usize);
                    match vol.read_at(at, &mut got) {
                        // A read that succeeds is never stale (pages with a failed write
                        // pending may hold either version).
                        Ok(()) => {
                            for p in at / PAGE..(at + len).div_ceil(PAGE) {
                                let (lo, hi) = ((p * PAGE).max(at), ((p + 1) * PAGE).min(at + len));
                                let g = &got[(lo - at) as usize..(hi - at) as usize];
                                assert!(
                                    g == &model[lo as usize..hi as usize] || maybe.contains_key(&p),
                                    "N = {n}: a read at {lo:#x} returned bytes never acknowledged there"
                                );
                            }
                        }
                        Err(_) => {
                            let w = vol.writeback_stats().unwrap();
                            assert!(w.lost_bytes > 0, "N = {n}: a read failed with nothing lost");
                            lost_reads += 1;
                        }
                    }
                }
            }
            let w = vol.writeback_stats().unwrap();
            runs_with_lost += (w.lost_bytes > 0) as u64;
            held_at_failure += (w.dirty_bytes > 0 && fault.control().faults_fired() > 0) as u64;
            drop(vol);
        }
        let fired = fault.control().faults_fired();
        // The healthy device: never refused, every page as acknowledged (or as a failed
        // write may have left it), nothing lost.
        let vol = CacheVolume::open(source.clone(), cache_mem.clone(), config(5))
            .unwrap_or_else(|e| panic!("N = {n}: the healthy device was refused: {e}"));
        assert_eq!(vol.writeback_stats().unwrap().lost_bytes, 0, "N = {n}");
        let now = read(&vol, 0, size);
        for p in 0..size / PAGE {
            let r = (p * PAGE) as usize..((p + 1) * PAGE) as usize;
            let h = page_hash(&now[r.clone()]);
            let ok = now[r.clone()] == model[r.clone()]
                || maybe.get(&p).is_some_and(|v| v.contains(&h))
                || since_flush.get(&p).is_some_and(|v| v.contains(&h));
            assert!(
                ok,
                "N = {n}: page {p} lost a write acknowledged before a FLUSH"
            );
        }
        vol.flush_to_source(None, Duration::from_secs(30)).unwrap();
        assert_eq!(read(&*source, 0, size), now, "N = {n}");
        drop(vol);
        if fired == 0 {
            break;
        }
        n += 1;
        assert!(n < 3000, "the scenario never ran fault-free");
    }
    println!(
        "fail-from-N in write-back: N = 0..={n}; {held_at_failure} runs held dirty data when \
         the device failed, {runs_with_lost} had some lost while it failed, {lost_reads} reads \
         of it failed (never served from the source); every restart on the healthy device \
         lost nothing acknowledged before a FLUSH"
    );
    // The log's copies stay readable while the device refuses writes: the runs that
    // matter are those with dirty data when it began to fail.
    assert!(
        held_at_failure > 0,
        "no run had dirty data when the device failed"
    );
}

/// A source outage in write-back: writes are absorbed until the cache is full of dirty
/// data, then wait (backpressure, not errors); the cleaner's failures show in the stats;
/// when the source returns the cleaner drains everything and nothing is lost.
#[test]
fn a_source_outage_is_absorbed_then_drained() {
    let size = 8 * MIB;
    let source_mem = random_source(size, 11);
    let source = Arc::new(FaultDevice::new(source_mem.clone()));
    source.control().fail_range(&[Op::Write], 0..u64::MAX);
    // An 8 MiB cache: a 2 MiB write-back log.
    let cache = Arc::new(MemDevice::new(8 * MIB));
    let mut cfg = config(5);
    cfg.writeback_wait = Duration::from_secs(600);
    let vol = Arc::new(CacheVolume::open(source.clone(), cache, cfg).expect("open"));
    let before = read(&*source_mem, 0, size);
    let mut model = before.clone();
    let mut data = vec![0u8; 4 * MIB as usize];
    SmallRng::seed_from_u64(12).fill(&mut data[..]);
    model[..4 * MIB as usize].copy_from_slice(&data);
    // More than the cache holds, in 64 KiB writes.
    let writer = {
        let vol = vol.clone();
        std::thread::spawn(move || {
            for (k, chunk) in data.chunks(64 * KIB as usize).enumerate() {
                vol.write_at(k as u64 * 64 * KIB, chunk)
                    .expect("a write failed");
            }
        })
    };
    // Until the writer waits for room with more than 1 MiB dirty (a first wait may be a
    // short one, for the journal or a round, which no failing cleaner cuts short now).
    let absorbed = sce_testkit::poll("the writer waiting for room", 120, || {
        let w = vol.writeback_stats().unwrap();
        if w.waits > 0 && w.clean_errors > 0 && w.dirty_bytes > MIB {
            Ok(w)
        } else {
            Err(format!("{w:?}"))
        }
    });
    assert!(
        !writer.is_finished(),
        "the writes all went through during the outage"
    );
    assert_eq!(
        read(&*source_mem, 0, size),
        before,
        "the source was written during the outage"
    );
    assert!(absorbed.dirty_bytes > MIB, "{absorbed:?}");
    // The source comes back.
    source.control().clear();
    writer.join().expect("the writer failed");
    vol.flush_to_source(None, Duration::from_secs(60)).unwrap();
    let w = vol.writeback_stats().unwrap();
    println!(
        "source outage: {} dirty bytes absorbed, {} waits, {} failed cleanings before the \
         source came back; then {} bytes written back, {} lost",
        absorbed.dirty_bytes, absorbed.waits, absorbed.clean_errors, w.cleaned_bytes, w.lost_bytes
    );
    assert_eq!(w.lost_bytes, 0);
    assert_eq!(
        read(&*source_mem, 0, size),
        model,
        "the source holds every write"
    );
    assert_eq!(read(&*vol, 0, size), model);
}

/// Dirty data whose only copy went bad stays lost across a restart (the record keeps a
/// dirty bit on the invalid page): reads of it fail, never the source's older bytes, until
/// a write covers it whole.
#[test]
fn a_lost_page_stays_lost_across_a_restart_until_rewritten() {
    let source = random_source(4 * MIB, 13);
    let cache = Arc::new(MemDevice::new(2 * MIB));
    let cfg = quiet_config(5);
    let vol = CacheVolume::open(source.clone(), cache.clone(), cfg.clone()).expect("open");
    let at = 3 * MIB + 8 * KIB;
    let mut page = vec![0u8; PAGE as usize];
    SmallRng::seed_from_u64(14).fill(&mut page[..]);
    vol.write_at(at, &page).unwrap();
    vol.flush().unwrap();
    // Damage the page's only copy on the cache device.
    let img = read(&*cache, 0, cache.size());
    let where_ = img
        .chunks(PAGE as usize)
        .position(|c| c == &page[..])
        .expect("the page is on the cache device") as u64;
    cache
        .write_at(where_ * PAGE, &vec![0x5a; PAGE as usize])
        .unwrap();
    let mut buf = AlignedBuf::new(PAGE as usize);
    assert!(
        vol.read_at(at, &mut buf).is_err(),
        "a damaged dirty page was served"
    );
    assert_eq!(vol.writeback_stats().unwrap().lost_bytes, PAGE);
    assert_eq!(vol.flush_metadata(), 0);
    assert!(vol.shutdown());
    let vol = CacheVolume::open(source.clone(), cache.clone(), cfg).expect("reopen");
    assert_eq!(
        vol.writeback_stats().unwrap().lost_bytes,
        PAGE,
        "lost after restart"
    );
    assert!(
        vol.read_at(at, &mut buf).is_err(),
        "after a restart the lost page read as the source's older bytes"
    );
    // A whole-page write makes it readable again.
    let mut fresh = vec![0u8; PAGE as usize];
    SmallRng::seed_from_u64(15).fill(&mut fresh[..]);
    vol.write_at(at, &fresh).unwrap();
    assert_eq!(read(&vol, at, PAGE), fresh);
    assert_eq!(vol.writeback_stats().unwrap().lost_bytes, 0);
    vol.flush_to_source(None, Duration::from_secs(30)).unwrap();
    assert_eq!(read(&*source, at, PAGE), fresh);
}
