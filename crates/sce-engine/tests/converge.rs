//! A cache with room for the whole source converges to 100% hits under a uniform random
//! load, with the background population workers alone, as the NBD server drives the
//! volume: hits started through the I/O queue on the driving thread (its read log holds
//! only hits), misses read by another thread (its log holds the misses). Every fragment
//! but a few is prefetched; the few left must be populated while the reads go on.
//!
//! The read logs reach the core in batches, one thread's at a time: the driver's batch of
//! hits, applied while a worker sleeps between reading the throttle and picking, pushes
//! every missed fragment out of the hotness window (a few fragments per core shard), and a
//! pick that does not see the misses finds nothing to populate. Bounded by rounds of reads
//! (no timed assertion); the worker's periods only pace it.

mod common;

use sce_engine::{CacheVolume, EngineConfig};
use sce_io::{
    open_queue, AlignedBuf, Backend, BlockDevice, BufPool, IoDone, MemDevice, QueuedReads,
};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

const PAGE: u64 = 4096;
const FRAG: u64 = 64 << 10;
const FRAGS: u64 = 1024;
/// Fragments left for the background workers: two per core shard of four.
const LEFT: u64 = 8;
const ROUND: usize = 4096;
const QD: usize = 32;
/// Generous: the workers need a few periods; a round of reads takes a few milliseconds or
/// more.
const MAX_ROUNDS: usize = 1000;

/// Starts a read of the page at `off` as the NBD server does: through the queue if the
/// volume can start it (a hit), else on the miss thread; `done` hears when it completes.
fn start(
    vol: &CacheVolume,
    pool: &Arc<BufPool>,
    misses: &Sender<u64>,
    off: u64,
    done: &Sender<()>,
) {
    match vol.start_read(off, PAGE) {
        Some(start) => {
            let done = done.clone();
            let done = Box::new(move |d: IoDone| {
                d.result.expect("queued read");
                done.send(()).unwrap();
            });
            let (op, done) = start(pool.take(PAGE as usize), done);
            vol.queue().expect("a queue").submit(op, done);
        }
        None => misses.send(off).unwrap(),
    }
}

/// Rounds of uniform 4 KiB reads until every fragment was populated; returns the rounds and
/// the misses of one more round.
fn converge(shards: usize) -> (usize, u64) {
    let dir = tempfile::tempdir().unwrap();
    let source: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(FRAGS * FRAG));
    let file = common::direct_file(dir.path(), "cache", FRAGS * FRAG * 5 / 4);
    // A small window (a sharded one holds a few fragments): a missed fragment stays in it
    // only for the next few reads.
    let mut core = common::small_window_core(FRAG);
    // Algorithm 1's periods as they are: one worker, every 500 ms, once the miss rate is
    // low; populating whatever the miss rate.
    core.throttle.target_missrate = 0.0;
    let cfg = EngineConfig {
        core,
        core_shards: shards,
        ..EngineConfig::default()
    };
    let vol = Arc::new(CacheVolume::open(source, file.clone(), cfg).unwrap());
    assert_eq!(vol.core_shards(), shards);
    assert!(vol.serve_hits_from(open_queue(file, Backend::Threads, 64).unwrap(), 0));
    let left = |f: u64| f % (FRAGS / LEFT) == 1 + (f / (FRAGS / LEFT)) % 4;
    for f in (0..FRAGS).filter(|&f| !left(f)) {
        vol.prefetch(f * FRAG, FRAG).unwrap();
    }
    assert_eq!(vol.stats().fragments_populated, FRAGS - LEFT);
    let (done, completed) = channel::<()>();
    let (misses, rx) = channel::<u64>();
    let miss_thread = {
        let (vol, done) = (vol.clone(), done.clone());
        std::thread::spawn(move || {
            let mut b = AlignedBuf::new(PAGE as usize);
            for off in rx {
                vol.read_at(off, &mut b).expect("read");
                done.send(()).unwrap();
            }
        })
    };
    let pool = BufPool::new(1 << 20);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut round = || {
        let before = vol.stats();
        // Reads of QD at a time, as fio's.
        for _ in 0..ROUND / QD {
            for _ in 0..QD {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                start(
                    &vol,
                    &pool,
                    &misses,
                    (x % (FRAGS * FRAG / PAGE)) * PAGE,
                    &done,
                );
            }
            (0..QD).for_each(|_| completed.recv().expect("a read completes"));
        }
        let after = vol.stats();
        (
            after.fragments_populated,
            after.read_pages_missed - before.read_pages_missed,
        )
    };
    let mut rounds = 0;
    while round().0 < FRAGS && rounds < MAX_ROUNDS {
        rounds += 1;
    }
    let (populated, missed) = round();
    assert_eq!(
        populated, FRAGS,
        "shards {shards}: population stalled at {populated} fragments ({rounds} rounds)"
    );
    drop(misses);
    miss_thread.join().unwrap();
    vol.shutdown();
    (rounds, missed)
}

#[test]
fn uniform_reads_populate_every_fragment_with_one_core_shard() {
    let (rounds, missed) = converge(1);
    eprintln!("populated in {rounds} rounds of {ROUND} reads");
    assert_eq!(
        missed, 0,
        "a round after the last population misses nothing"
    );
}

#[test]
fn uniform_reads_populate_every_fragment_with_four_core_shards() {
    let (rounds, missed) = converge(4);
    eprintln!("populated in {rounds} rounds of {ROUND} reads");
    assert_eq!(
        missed, 0,
        "a round after the last population misses nothing"
    );
}
