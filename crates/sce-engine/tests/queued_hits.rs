//! Hits served through an I/O queue on the cache device (`CacheVolume::serve_hits_from`,
//! `QueuedReads::start_read`): the reads a server starts this way complete on the queue's
//! thread, verified and counted, and never return stale data while writes, population and
//! eviction go on; reads it cannot start take the blocking path. On a real O_DIRECT cache
//! file through io_uring (and the thread fallback), persistent (the data area starts after
//! the metadata) and not. Under the deadlock detector and stall guard: a read planned for
//! the queue must not hold its core shard's lock when it applies the read log.

mod common;

use common::watchdog::{run_watched, Progress};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sce_core::WriteMode;
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::{
    open_queue, AlignedBuf, Backend, BlockDevice, BufPool, IoDone, MemDevice, QueuedReads,
};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;

const PAGE: u64 = 4096;
const FRAG: u64 = 64 << 10;

/// The content of page `p` at version `v` (0: never written, the source's zeroes).
fn page(p: u64, v: u32) -> Vec<u8> {
    if v == 0 {
        return vec![0; PAGE as usize];
    }
    let x = (p << 32 | v as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..PAGE / 8).flat_map(|j| (x ^ j).to_le_bytes()).collect()
}

struct Setup {
    vol: Arc<CacheVolume>,
    _dir: tempfile::TempDir,
}

fn setup(persist: bool, backend: Backend, shards: usize) -> Setup {
    setup_with(persist, backend, shards, true)
}

/// `background`: population workers (which also apply the read logs) run.
fn setup_with(persist: bool, backend: Backend, shards: usize, background: bool) -> Setup {
    setup_mode(
        persist,
        backend,
        shards,
        background,
        WriteMode::WriteThrough,
    )
}

fn setup_mode(
    persist: bool,
    backend: Backend,
    shards: usize,
    background: bool,
    mode: WriteMode,
) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let source: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(256 * FRAG));
    let size = if persist { 16 << 20 } else { 48 * FRAG };
    let file = common::direct_file(dir.path(), "cache", size);
    let mut core = common::small_window_core(FRAG);
    common::eager_throttle(&mut core);
    core.write_mode = mode;
    let cfg = EngineConfig {
        core,
        core_shards: shards,
        background_population: background,
        persist: persist.then(|| PersistConfig::new("queued-hits")),
        ..EngineConfig::default()
    };
    let vol = Arc::new(CacheVolume::open(source, file.clone(), cfg).unwrap());
    let q = open_queue(file, backend, 64).unwrap();
    assert_eq!(q.backend(), backend, "this machine has io_uring");
    assert!(vol.serve_hits_from(q.clone(), 0));
    assert!(!vol.serve_hits_from(q, 0), "once per volume");
    Setup { vol, _dir: dir }
}

/// A read as the NBD server does it: started through the queue if the volume can, else
/// the blocking call. Returns the data and whether it went through the queue.
fn read(vol: &Arc<CacheVolume>, pool: &Arc<BufPool>, off: u64, len: u64) -> (Vec<u8>, bool) {
    match vol.start_read(off, len) {
        Some(start) => {
            let (tx, rx) = channel::<IoDone>();
            let (op, done) = start(
                pool.take(len as usize),
                Box::new(move |d| tx.send(d).unwrap()),
            );
            vol.queue().expect("a queue").submit(op, done);
            let d = rx.recv().expect("a started read completes");
            d.result.expect("queued read");
            (d.buf.expect("buffer back").to_vec(), true)
        }
        None => {
            let mut b = AlignedBuf::new(len as usize);
            vol.read_at(off, &mut b).expect("read");
            (b.to_vec(), false)
        }
    }
}

/// Threads own interleaved regions of two fragments; they write pages, and read runs of 1
/// to 6 pages (some crossing a fragment), checking every page against their versions.
fn load(s: &Setup, threads: u64, ops: usize, progress: Progress) -> (u64, u64) {
    let vol = &s.vol;
    let regions = vol.size() / (2 * FRAG);
    let pages = 2 * FRAG / PAGE;
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (vol, progress) = (vol.clone(), progress.clone());
            std::thread::spawn(move || {
                let pool = BufPool::new(1 << 20);
                let mut rng = SmallRng::seed_from_u64(t + 7);
                let mine: Vec<u64> = (0..regions).filter(|r| r % threads == t).collect();
                let mut versions = vec![vec![0u32; pages as usize]; mine.len()];
                let (mut queued, mut blocking) = (0, 0);
                for i in 0..ops {
                    // Mostly the first few regions: they get hot and cached.
                    let ri = rng.gen_range(0..mine.len().min(4));
                    let first = rng.gen_range(0..pages);
                    let n = rng.gen_range(1..=6.min(pages - first));
                    let off = (mine[ri] * pages + first) * PAGE;
                    let vs = &mut versions[ri][first as usize..(first + n) as usize];
                    if rng.gen_bool(0.2) {
                        vs.iter_mut().for_each(|v| *v += 1);
                        let mut b = AlignedBuf::new((n * PAGE) as usize);
                        for (k, &v) in vs.iter().enumerate() {
                            let p = off / PAGE + k as u64;
                            b[k * PAGE as usize..(k + 1) * PAGE as usize]
                                .copy_from_slice(&page(p, v));
                        }
                        vol.write_at(off, &b).expect("write");
                    } else {
                        let (got, q) = read(&vol, &pool, off, n * PAGE);
                        if q {
                            queued += 1;
                        } else {
                            blocking += 1;
                        }
                        for (k, &v) in vs.iter().enumerate() {
                            let p = off / PAGE + k as u64;
                            assert!(
                                got[k * PAGE as usize..(k + 1) * PAGE as usize] == page(p, v)[..],
                                "thread {t} op {i}: stale or wrong page {p} (version {v}, queued {q})"
                            );
                        }
                    }
                    progress.fetch_add(1, Relaxed);
                }
                (queued, blocking)
            })
        })
        .collect();
    workers
        .into_iter()
        .map(|w| w.join().expect("worker"))
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

fn run(persist: bool, backend: Backend, shards: usize) {
    let what = format!("queued hits, persist {persist}, {backend}, {shards} shard(s)");
    run_watched(&what.clone(), Duration::from_secs(600), move |p| {
        let s = setup(persist, backend, shards);
        let (queued, blocking) = load(&s, 4, 3000, p);
        let st = s.vol.stats();
        eprintln!(
            "{what}: {queued} reads through the queue, {blocking} blocking; hits {} misses {}",
            st.read_pages_hit, st.read_pages_missed
        );
        // More reads than the read log holds went through the queue: its accounting was
        // applied from there too.
        assert!(queued > 1024, "{queued} queued reads");
        assert!(blocking > 0, "misses take the blocking path");
        assert_eq!(st.cache_checksum_errors, 0);
        assert_eq!(st.cache_read_errors, 0);
    });
}

#[test]
fn io_uring_persistent_two_shards() {
    run(true, Backend::IoUring, 2);
}

#[test]
fn io_uring_volatile_one_shard() {
    run(false, Backend::IoUring, 1);
}

#[test]
fn threads_persistent_four_shards() {
    run(true, Backend::Threads, 4);
}

/// Write-back through the log: reads of pages the log holds take the blocking path, the
/// read cache's other hits go through the queue, and no read returns a stale page while
/// writes land in the log, the cleaner writes them back and population fills.
#[test]
fn io_uring_writeback_through_the_log() {
    run_watched("queued hits in write-back", Duration::from_secs(600), |p| {
        let s = setup_mode(true, Backend::IoUring, 2, true, WriteMode::WriteBack);
        let (queued, blocking) = load(&s, 4, 3000, p);
        let st = s.vol.stats();
        let wb = s.vol.writeback_stats().expect("write-back");
        eprintln!(
            "write-back: {queued} reads through the queue, {blocking} blocking; hits {} \
             misses {}; {} dirty, {} cleaned",
            st.read_pages_hit, st.read_pages_missed, wb.dirty_bytes, wb.cleaned_bytes
        );
        assert!(
            queued > 100,
            "{queued} queued reads: hits of clean pages go the queue"
        );
        assert!(
            blocking > 0,
            "misses and logged pages take the blocking path"
        );
        assert_eq!(st.cache_checksum_errors, 0);
        assert_eq!(st.cache_read_errors, 0);
    });
}

/// Warms fragment 0: reads it until reads of it can be started (it was populated).
fn warm_first_fragment(s: &Setup, pool: &Arc<BufPool>) {
    for _ in 0..50 {
        let _ = read(&s.vol, pool, 0, FRAG);
        s.vol.populate_now(1000);
        s.vol.quiesce();
        if s.vol.start_read(0, PAGE).is_some() {
            return;
        }
    }
    panic!("fragment 0 never became a hit");
}

/// Thousands of hits in a row through the queue, nothing else: their read accounting fills
/// the read log past its cap, and applying it (exclusive lock) must not wait for the shared
/// lock the planning read holds.
#[test]
fn thousands_of_hits_in_a_row() {
    run_watched("hits in a row", Duration::from_secs(600), |p| {
        // Without population workers, which would apply the read log now and then.
        let s = setup_with(false, Backend::IoUring, 1, false);
        let pool = BufPool::new(1 << 20);
        warm_first_fragment(&s, &pool);
        let before = s.vol.stats().read_requests;
        for i in 0..5000u64 {
            let (got, queued) = read(&s.vol, &pool, (i % 16) * PAGE, PAGE);
            assert!(queued, "read {i} is a hit");
            assert!(got.iter().all(|&x| x == 0));
            p.fetch_add(1, Relaxed);
        }
        assert_eq!(s.vol.stats().read_requests, before + 5000);
    });
}

/// A read that is not all hits, or not whole pages, or spans two fragments, is not
/// started: the caller reads it with the blocking call, and nothing was counted for it.
#[test]
fn only_whole_page_hits_in_one_fragment_are_started() {
    let s = setup(false, Backend::IoUring, 1);
    let pool = BufPool::new(1 << 20);
    assert!(
        s.vol.start_read(0, PAGE).is_none(),
        "a cold cache has no hit"
    );
    let reads = || s.vol.stats().read_requests;
    warm_first_fragment(&s, &pool);
    let before = reads();
    let started = s.vol.start_read(0, PAGE).expect("a hit");
    // A started read holds its pins until its buffer comes back: give it one.
    let (tx, rx) = channel::<IoDone>();
    let (op, done) = started(
        pool.take(PAGE as usize),
        Box::new(move |d| tx.send(d).unwrap()),
    );
    s.vol.queue().expect("a queue").submit(op, done);
    rx.recv().unwrap().result.unwrap();
    assert!(s.vol.start_read(512, PAGE).is_none(), "not page-aligned");
    assert!(
        s.vol.start_read(FRAG - PAGE, 2 * PAGE).is_none(),
        "two fragments"
    );
    assert!(
        s.vol.start_read(s.vol.size(), PAGE).is_none(),
        "out of range"
    );
    assert_eq!(reads(), before + 1, "only the started read was counted");
}

/// Cached pages that went bad on the device (here: the whole cache file overwritten behind
/// the volume's back) are caught by their checksums when a started read completes: the
/// read returns the source's data, the error is counted, and the page is dropped, so the
/// next read of it is not started from the cache.
#[test]
fn a_bad_page_read_through_the_queue_is_served_from_the_source() {
    use std::os::unix::fs::FileExt;
    // No background population: it could fill the dropped page again (from the source,
    // correctly) before the test looks, and make "dropped" a race.
    let s = setup_with(false, Backend::IoUring, 1, false);
    let pool = BufPool::new(1 << 20);
    warm_first_fragment(&s, &pool);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(s._dir.path().join("cache"))
        .unwrap();
    f.write_all_at(&vec![0xAB; (48 * FRAG) as usize], 0)
        .unwrap();
    f.sync_all().unwrap();
    let (got, queued) = read(&s.vol, &pool, 0, PAGE);
    assert!(queued, "the volume still thinks page 0 is a hit");
    assert!(
        got.iter().all(|&x| x == 0),
        "the source's zeroes, not the bad page"
    );
    let st = s.vol.stats();
    assert_eq!(st.cache_checksum_errors, 1, "{st:?}");
    assert_eq!(st.source_bytes_read % PAGE, 0);
    assert!(
        s.vol.start_read(0, PAGE).is_none(),
        "the bad page was dropped"
    );
    let (got, _) = read(&s.vol, &pool, 0, PAGE);
    assert!(got.iter().all(|&x| x == 0));
}
