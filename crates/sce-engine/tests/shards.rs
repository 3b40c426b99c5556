//! The core cut into shards by fragment (`EngineConfig::core_shards`): concurrent reads,
//! writes and population over several shards checked against a model of what each thread
//! wrote, with requests that cross fragment (so shard) boundaries; reopening a persistent
//! cache with another shard count serves nothing stale; and the point of it all, a hit on
//! one shard completes while another shard's exclusive lock is held. Bounded by operation
//! counts and synchronised by channels, never by time; the loads run under the deadlock
//! detector and stall guard of `common/watchdog.rs`.

mod common;

use common::watchdog::{run_watched, Progress};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sce_core::{Admission, CoreConfig, WriteMode};
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::{AlignedBuf, BlockDevice, MemDevice};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const SECTOR: u64 = 512;
/// Hang guard only: a load takes seconds.
const BOUND: Duration = Duration::from_secs(600);

/// The content of sector `s` at version `v`.
fn stamp(buf: &mut [u8], first_sector: u64, versions: &[u32]) {
    for (i, chunk) in buf.chunks_mut(SECTOR as usize).enumerate() {
        let x = ((first_sector + i as u64) << 32 | versions[i] as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for (j, w) in chunk.chunks_mut(8).enumerate() {
            w.copy_from_slice(&(x ^ j as u64).to_le_bytes());
        }
    }
}

/// What sector `s` holds at version `v` (0: never written, the source's zeroes).
fn want_sector(s: u64, v: u32) -> Vec<u8> {
    let mut b = vec![0u8; SECTOR as usize];
    if v > 0 {
        stamp(&mut b, s, &[v]);
    }
    b
}

fn engine(core: CoreConfig, shards: usize, background: bool) -> EngineConfig {
    let mut core = core;
    common::eager_throttle(&mut core);
    EngineConfig {
        core,
        background_population: background,
        core_shards: shards,
        ..EngineConfig::default()
    }
}

/// Threads own interleaved regions of two fragments each, write and read them (requests up
/// to 48 sectors anywhere in a region, so many cross a fragment boundary), and check every
/// read against their versions; one more thread runs `populate_now` and prefetches while
/// the background workers populate too.
fn load(core: CoreConfig, shards: usize, threads: u64, ops: usize, progress: Progress) {
    let fsize = core.fragment_size;
    let region = 2 * fsize;
    let source_size = 256 * fsize;
    let source: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(source_size));
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(48 * fsize));
    let vol = Arc::new(
        CacheVolume::open(source.clone(), cache, engine(core, shards, true)).expect("open"),
    );
    assert_eq!(vol.core_shards(), shards);
    let regions = source_size / region;
    let per_region = (region / SECTOR) as usize;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let populator = {
        let (vol, stop, progress) = (vol.clone(), stop.clone(), progress.clone());
        std::thread::spawn(move || {
            let mut at = 0;
            while !stop.load(Relaxed) {
                vol.populate_now(2);
                vol.prefetch(at, fsize).expect("prefetch");
                at = (at + 7 * fsize) % source_size;
                progress.fetch_add(1, Relaxed);
            }
        })
    };
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (vol, progress) = (vol.clone(), progress.clone());
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t + 40);
                let mine: Vec<u64> = (0..regions).filter(|r| r % threads == t).collect();
                let mut versions = vec![vec![0u32; per_region]; mine.len()];
                let mut checked = 0;
                for i in 0..ops {
                    let ri = rng.gen_range(0..mine.len());
                    let first = rng.gen_range(0..per_region);
                    let n = rng.gen_range(1..=48.min(per_region - first));
                    let off = mine[ri] * region + first as u64 * SECTOR;
                    let mut buf = AlignedBuf::new(n * SECTOR as usize);
                    let vs = &mut versions[ri][first..first + n];
                    if rng.gen_bool(0.35) {
                        vs.iter_mut().for_each(|v| *v += 1);
                        stamp(&mut buf, off / SECTOR, vs);
                        vol.write_at(off, &buf).expect("write");
                    } else {
                        vol.read_at(off, &mut buf).expect("read");
                        for (k, &v) in vs.iter().enumerate() {
                            let s = off / SECTOR + k as u64;
                            let got = &buf[k * SECTOR as usize..(k + 1) * SECTOR as usize];
                            assert!(
                                got == &want_sector(s, v)[..],
                                "thread {t} op {i}: stale or wrong sector {s} (version {v})"
                            );
                        }
                        checked += n;
                    }
                    progress.fetch_add(1, Relaxed);
                }
                (checked, mine, versions)
            })
        })
        .collect();
    let results: Vec<_> = workers
        .into_iter()
        .map(|h| h.join().expect("worker"))
        .collect();
    stop.store(true, Relaxed);
    populator.join().expect("populator");
    vol.quiesce();
    for (_, mine, versions) in &results {
        for (r, vs) in mine.iter().zip(versions) {
            let mut buf = AlignedBuf::new(region as usize);
            vol.read_at(r * region, &mut buf).expect("final read");
            for (k, &v) in vs.iter().enumerate() {
                let s = r * region / SECTOR + k as u64;
                let got = &buf[k * SECTOR as usize..(k + 1) * SECTOR as usize];
                assert!(got == &want_sector(s, v)[..], "final read: sector {s}");
            }
        }
    }
    let st = vol.stats();
    eprintln!(
        "{shards} shards: hits {} misses {} populated {} evicted {} awt {} dup {}",
        st.read_pages_hit,
        st.read_pages_missed,
        st.fragments_populated,
        st.fragments_evicted,
        st.awt_completed,
        st.awt_duplicates
    );
    assert!(results.iter().map(|r| r.0).sum::<usize>() > 0);
    assert!(st.read_pages_hit > 0, "no hit: the cache was not exercised");
    assert!(st.fragments_populated > 0, "nothing was populated");
    assert_eq!(st.total_slots, 48);
}

fn sharded(core: CoreConfig, shards: usize) {
    let what = format!("{shards} core shards");
    run_watched(&what, BOUND, move |p| load(core, shards, 4, 1500, p));
}

#[test]
fn two_shards_awt() {
    sharded(
        CoreConfig {
            fragment_size: 64 << 10,
            hot_window: 16,
            ..CoreConfig::default()
        },
        2,
    );
}

#[test]
fn three_shards_write_through_sce_paper() {
    sharded(
        CoreConfig {
            fragment_size: 16 << 10,
            admission: Admission::ScePaper,
            write_mode: WriteMode::WriteThrough,
            hot_window: 16,
            ..CoreConfig::default()
        },
        3,
    );
}

#[test]
fn four_shards_inline_fills() {
    sharded(
        CoreConfig {
            fragment_size: 16 << 10,
            ..CoreConfig::flashcache_like()
        },
        4,
    );
}

/// Reads every byte of `vol` and compares it with `source`.
fn assert_same(vol: &dyn BlockDevice, source: &dyn BlockDevice, what: &str) {
    let mut a = AlignedBuf::new(MIB as usize);
    let mut b = AlignedBuf::new(MIB as usize);
    for at in (0..source.size()).step_by(MIB as usize) {
        vol.read_at(at, &mut a).expect("volume read");
        source.read_at(at, &mut b).expect("source read");
        assert!(a[..] == b[..], "{what}: stale data in the MiB at {at}");
    }
}

#[test]
fn reopening_with_another_shard_count_serves_nothing_stale() {
    let fsize = 64 << 10;
    let source = Arc::new(MemDevice::new(32 * MIB));
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 * MIB));
    let mut rng = SmallRng::seed_from_u64(5);
    for (round, shards) in [4usize, 4, 3, 1, 2, 4].into_iter().enumerate() {
        let mut cfg = engine(
            CoreConfig {
                fragment_size: fsize,
                ..CoreConfig::default()
            },
            shards,
            false,
        );
        cfg.persist = Some(PersistConfig::new("shards"));
        let vol = CacheVolume::open(source.clone(), cache.clone(), cfg).expect("open");
        let restored = vol.persist_stats().expect("persistent").fragments_restored;
        assert_same(
            &vol,
            &*source,
            &format!("round {round}, {shards} shards, at open"),
        );
        eprintln!("round {round}: {shards} shards, {restored} fragments restored");
        if round == 1 {
            assert!(restored > 0, "the same shard count restores the cache");
        }
        // Writes across fragment boundaries, then population of what was read.
        let mut buf = AlignedBuf::new(96 << 10);
        for _ in 0..64 {
            let at = rng.gen_range(0..(32 * MIB - buf.len() as u64) / 4096) * 4096;
            rng.fill(&mut buf[..]);
            vol.write_at(at, &buf).expect("write");
        }
        for at in (0..16 * MIB).step_by(fsize as usize) {
            vol.read_at(at, &mut buf[..4096]).expect("read");
        }
        vol.populate_now(usize::MAX);
        vol.quiesce();
        assert_same(&vol, &*source, &format!("round {round}, {shards} shards"));
        assert!(vol.shutdown(), "clean shutdown");
    }
}

#[test]
fn a_hit_completes_while_another_shard_is_locked() {
    let source = Arc::new(MemDevice::new(16 * MIB));
    let mut data = AlignedBuf::new(MIB as usize);
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    source.write_at(MIB, &data).expect("source");
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 * MIB));
    let vol = Arc::new(
        CacheVolume::open(source, cache, engine(CoreConfig::default(), 2, false)).expect("open"),
    );
    assert_eq!(vol.core_shards(), 2);
    // Fragment 1 is shard 1's: cache it.
    vol.prefetch(MIB, MIB).expect("prefetch");
    let before = vol.stats();
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let holder = {
        let vol = vol.clone();
        std::thread::spawn(move || {
            vol.with_core_shard_locked(0, || {
                locked_tx.send(()).expect("signal");
                release_rx.recv().expect("release");
            })
        })
    };
    locked_rx.recv().expect("shard 0 locked");
    // Shard 0's exclusive lock is held: a hit, and a write, on shard 1 complete.
    let mut buf = AlignedBuf::new(8192);
    vol.read_at(MIB + 4096, &mut buf).expect("hit");
    assert!(buf[..] == data[4096..4096 + 8192], "the hit's data");
    buf.fill(7);
    vol.write_at(MIB + 65536, &buf).expect("write on shard 1");
    release_tx.send(()).expect("release");
    holder.join().expect("holder");
    let after = vol.stats();
    assert_eq!(
        after.read_pages_hit - before.read_pages_hit,
        2,
        "both pages hit"
    );
    assert_eq!(after.write_requests - before.write_requests, 1);
}

/// A source that counts its reads.
struct CountingSource {
    inner: MemDevice,
    reads: std::sync::atomic::AtomicU64,
}

impl BlockDevice for CountingSource {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), sce_io::IoError> {
        self.reads.fetch_add(1, Relaxed);
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), sce_io::IoError> {
        self.inner.write_at(offset, buf)
    }
    fn flush(&self) -> Result<(), sce_io::IoError> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), sce_io::IoError> {
        self.inner.discard(offset, len)
    }
}

/// A read over many fragments of several shards costs one source read where its misses
/// follow each other, however many pieces it is cut into (4 KiB fragments, the
/// flashcache-like geometry, cut a 128 KiB read into 32 pieces: read one by one, they cost
/// 32 round trips to the source); a hit in the middle splits it in two, and the data is
/// the source's.
#[test]
fn misses_across_pieces_are_one_source_read() {
    let source = Arc::new(CountingSource {
        inner: MemDevice::new(16 * MIB),
        reads: Default::default(),
    });
    let mut data = AlignedBuf::new(MIB as usize);
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    source.inner.write_at(0, &data).expect("source");
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 * MIB));
    let core = CoreConfig {
        fragment_size: 4096,
        ..CoreConfig::default()
    };
    let vol =
        CacheVolume::open(source.clone(), cache.clone(), engine(core, 4, false)).expect("open");
    assert_eq!(vol.core_shards(), 4);
    let mut buf = AlignedBuf::new(128 << 10);
    let reads = |vol: &CacheVolume, buf: &mut AlignedBuf, at: u64| {
        let before = source.reads.load(Relaxed);
        vol.read_at(at, buf).expect("read");
        assert!(
            buf[..] == data[at as usize..at as usize + buf.len()],
            "the source's data"
        );
        source.reads.load(Relaxed) - before
    };
    assert_eq!(
        reads(&vol, &mut buf, 64 << 10),
        1,
        "32 missed pieces, one source read"
    );
    // Cache one fragment in the middle: the misses on either side are two reads.
    vol.prefetch((64 << 10) + 16 * 4096, 4096)
        .expect("prefetch");
    assert!(
        vol.stats().fragments_populated >= 1,
        "the fragment was cached"
    );
    assert_eq!(
        reads(&vol, &mut buf, 64 << 10),
        2,
        "a hit between two runs of misses"
    );
    drop(vol);
    // Inline fills (admission `always`, the flashcache-like baseline): one source read fills
    // every piece, and the same read again is all hits.
    let core = CoreConfig {
        fragment_size: 4096,
        admission: Admission::Always,
        ..CoreConfig::default()
    };
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 * MIB));
    let vol = CacheVolume::open(source.clone(), cache, engine(core, 4, false)).expect("open");
    assert_eq!(
        reads(&vol, &mut buf, 256 << 10),
        1,
        "32 inline-filled pieces, one read"
    );
    // The fills are written after the read is answered (issue 46).
    vol.quiesce();
    assert_eq!(reads(&vol, &mut buf, 256 << 10), 0, "then all hits");
    assert_eq!(vol.stats().read_pages_hit, 32);
}
