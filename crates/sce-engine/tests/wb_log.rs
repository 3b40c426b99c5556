//! Write-back through the log (issue 29): a write is one device write, a FLUSH one commit
//! record and one flush; dirty data does not take the read slots; a restart (clean or not)
//! finds what was committed; the cleaner drains it all to the source.

mod common;

use common::{random_source, read};
use sce_engine::{CacheVolume, EngineConfig};
use sce_io::{AlignedBuf, BlockDevice, BufPool, FaultDevice, IoQueue, MemDevice, Op, QueuedReads};
use std::sync::Arc;
use std::time::Duration;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const PAGE: u64 = 4096;

/// Write-back with a 2 MiB log, no idle cleaning (the test says when).
fn config() -> EngineConfig {
    let mut c = EngineConfig {
        writeback_wait: Duration::from_secs(5),
        writeback_idle: Duration::from_secs(3600),
        ..common::writeback_config("wb-log", Duration::from_secs(3600))
    };
    c.persist.as_mut().unwrap().writeback_log = 2 * MIB;
    c
}

fn pattern(seed: u8, len: u64) -> AlignedBuf {
    let mut b = AlignedBuf::new(len as usize);
    for (i, x) in b.iter_mut().enumerate() {
        *x = seed.wrapping_add((i / 512) as u8);
    }
    b
}

#[test]
fn a_write_is_one_device_write_and_a_flush_one_commit() {
    let source = random_source(16 * MIB, 1);
    let before = read(&*source, 0, 16 * MIB);
    let cache = Arc::new(FaultDevice::new(MemDevice::new(8 * MIB)));
    let ctl = cache.control();
    let vol = CacheVolume::open(source.clone(), cache.clone(), config()).unwrap();
    assert!(vol.writeback_log_counts().is_some(), "not the log path");
    let w0 = ctl.ops(Op::Write);
    let f0 = ctl.ops(Op::Flush);
    let data = pattern(7, PAGE);
    vol.write_at(5 * MIB, &data).unwrap();
    assert_eq!(
        ctl.ops(Op::Write) - w0,
        1,
        "one device write for a 4 KiB write"
    );
    assert_eq!(
        ctl.ops(Op::Flush) - f0,
        0,
        "no flush before a write is acknowledged"
    );
    // Unaligned: the edge pages are merged, still one device write.
    vol.write_at(6 * MIB + 512, &pattern(9, 5120)).unwrap();
    assert_eq!(ctl.ops(Op::Write) - w0, 2);
    vol.flush().unwrap();
    // The commit record's two copies lie apart (the ring and the mirror area): two writes.
    assert_eq!(ctl.ops(Op::Write) - w0, 4, "the commit record's two copies");
    assert_eq!(ctl.ops(Op::Flush) - f0, 1, "one cache-device flush");
    // A FLUSH with nothing new costs nothing.
    vol.flush().unwrap();
    assert_eq!((ctl.ops(Op::Write) - w0, ctl.ops(Op::Flush) - f0), (4, 1));
    let mut want = before.clone();
    want[(5 * MIB) as usize..(5 * MIB + PAGE) as usize].copy_from_slice(&data);
    want[(6 * MIB + 512) as usize..(6 * MIB + 5632) as usize].copy_from_slice(&pattern(9, 5120));
    assert!(
        read(&vol, 0, 16 * MIB) == want,
        "reads return the newest writes"
    );
    assert!(
        read(&*source, 0, 16 * MIB) == before,
        "the source is untouched"
    );
    let wb = vol.writeback_stats().unwrap();
    assert_eq!(wb.dirty_bytes, 3 * PAGE, "{wb:?}");
    vol.flush_to_source(None, Duration::from_secs(10)).unwrap();
    assert!(
        read(&*source, 0, 16 * MIB) == want,
        "the cleaner wrote it all"
    );
    assert_eq!(vol.writeback_stats().unwrap().dirty_bytes, 0);
    assert!(read(&vol, 0, 16 * MIB) == want);
}

#[test]
fn dirty_data_does_not_take_the_read_slots() {
    let source = random_source(32 * MIB, 2);
    let cache = Arc::new(MemDevice::new(8 * MIB));
    let mut cfg = config();
    cfg.background_population = false;
    let vol = CacheVolume::open(source.clone(), cache, cfg).unwrap();
    // A hot read set of 2 MiB, cached.
    let hot = read(&vol, 0, 2 * MIB);
    vol.populate_now(100);
    let s0 = vol.stats();
    assert!(read(&vol, 0, 2 * MIB) == hot);
    let warm = vol.stats().delta(&s0);
    assert_eq!(warm.read_pages_missed, 0, "{warm:?}");
    // 1.5 MiB of writes elsewhere (three quarters of the log), then the hot set again.
    for i in 0..6 {
        vol.write_at(16 * MIB + i * 256 * KIB, &pattern(i as u8, 256 * KIB))
            .unwrap();
    }
    let s1 = vol.stats();
    assert!(read(&vol, 0, 2 * MIB) == hot);
    let after = vol.stats().delta(&s1);
    assert_eq!(
        after.read_pages_missed, 0,
        "writes pushed out the read set: {after:?}"
    );
}

#[test]
fn a_crash_after_a_flush_keeps_what_it_committed() {
    let source = random_source(16 * MIB, 3);
    let cache = Arc::new(MemDevice::new(8 * MIB));
    let vol = CacheVolume::open(source.clone(), cache.clone(), config()).unwrap();
    vol.write_at(MIB, &pattern(1, 64 * KIB)).unwrap();
    vol.write_at(MIB + 8 * KIB, &pattern(2, 4 * KIB)).unwrap();
    vol.flush().unwrap();
    let want = read(&vol, 0, 16 * MIB);
    // A crash: the volume is never shut down (its threads stop with the test).
    std::mem::forget(vol);
    let image = Arc::new(MemDevice::new(8 * MIB));
    image.write_at(0, &read(&*cache, 0, 8 * MIB)).unwrap();
    let again = CacheVolume::open(source.clone(), image, config()).unwrap();
    assert!(read(&again, 0, 16 * MIB) == want, "a committed write lost");
    assert_eq!(again.writeback_stats().unwrap().dirty_bytes, 16 * PAGE);
    again
        .flush_to_source(None, Duration::from_secs(10))
        .unwrap();
    assert!(read(&*source, 0, 16 * MIB) == want);
}

#[test]
fn another_mode_refuses_a_log_with_dirty_pages() {
    let source = random_source(16 * MIB, 4);
    let cache = Arc::new(MemDevice::new(8 * MIB));
    {
        let vol = CacheVolume::open(source.clone(), cache.clone(), config()).unwrap();
        vol.write_at(0, &pattern(3, PAGE)).unwrap();
        assert!(vol.shutdown());
    }
    let mut wt = config();
    wt.core.write_mode = sce_core::WriteMode::WriteThrough;
    let Err(e) = CacheVolume::open(source.clone(), cache.clone(), wt.clone()) else {
        panic!("write-through served over dirty data in the log");
    };
    assert!(e.to_string().contains("1 dirty pages"), "{e}");
    // Cleaned in write-back, the device serves write-through.
    let vol = CacheVolume::open(source.clone(), cache.clone(), config()).unwrap();
    vol.flush_to_source(None, Duration::from_secs(10)).unwrap();
    assert!(vol.shutdown());
    let vol = CacheVolume::open(source.clone(), cache, wt).unwrap();
    assert!(read(&vol, 0, PAGE) == pattern(3, PAGE).to_vec());
}

#[test]
fn a_reformat_never_drops_the_log_s_dirty_pages_unasked() {
    let source = random_source(16 * MIB, 5);
    let cache = Arc::new(MemDevice::new(8 * MIB));
    {
        let vol = CacheVolume::open(source.clone(), cache.clone(), config()).unwrap();
        vol.write_at(0, &pattern(4, 2 * PAGE)).unwrap();
        assert!(vol.shutdown());
    }
    // Another fragment size makes the device unusable as it is: `reformat` would format it.
    let other = |discard: bool| {
        let mut c = config();
        c.core.fragment_size = 128 * KIB;
        let p = c.persist.as_mut().unwrap();
        p.reformat = true;
        if discard {
            p.discard_dirty = vec!["all".into()];
        }
        c
    };
    let Err(e) = CacheVolume::open(source.clone(), cache.clone(), other(false)) else {
        panic!("a reformat dropped dirty pages of the write-back log");
    };
    assert!(e.to_string().contains("2 dirty"), "{e}");
    let vol = CacheVolume::open(source.clone(), cache.clone(), other(true)).unwrap();
    assert!(
        read(&vol, 0, PAGE) == read(&*source, 0, PAGE),
        "asked to drop, dropped"
    );
}

#[test]
fn the_log_wraps_round_many_times_through_cleaning() {
    // 24 MiB of writes into a 2 MiB log, with flushes and a full clean half way: the ring is
    // reused (tail, anchor) and no write waits out its limit.
    let source = random_source(16 * MIB, 6);
    let cache = Arc::new(MemDevice::new(8 * MIB));
    let vol = CacheVolume::open(source.clone(), cache, config()).unwrap();
    let mut want = read(&*source, 0, 16 * MIB);
    for i in 0..96u64 {
        let at = (i * 37 % 64) * 256 * KIB;
        let data = pattern(i as u8, 256 * KIB);
        vol.write_at(at, &data).unwrap();
        want[at as usize..(at + 256 * KIB) as usize].copy_from_slice(&data);
        if i % 8 == 7 {
            vol.flush().unwrap();
        }
        if i == 48 {
            vol.flush_to_source(None, Duration::from_secs(10)).unwrap();
        }
    }
    assert!(read(&vol, 0, 16 * MIB) == want);
    vol.flush_to_source(None, Duration::from_secs(10)).unwrap();
    assert!(read(&*source, 0, 16 * MIB) == want);
    let wb = vol.writeback_stats().unwrap();
    assert!(wb.cleaned_bytes >= 8 * MIB, "{wb:?}");
}

/// A write started without blocking (as the NBD reader starts one, through the cache
/// device's queue) is the same one device write, visible once its completion ran,
/// committed by the next FLUSH and found after a crash. Only whole pages whose range is
/// free start; a started write dropped unsubmitted writes nothing and holds nothing.
#[test]
fn a_write_started_through_the_queue_is_one_device_write_acknowledged_when_done() {
    let source = random_source(16 * MIB, 4);
    let before = read(&*source, 0, 16 * MIB);
    let cache = Arc::new(FaultDevice::new(MemDevice::new(8 * MIB)));
    let vol = CacheVolume::open(source.clone(), cache.clone(), config()).unwrap();
    assert!(
        vol.start_write(0, PAGE).is_none(),
        "no queue: the blocking path"
    );
    // The queue's own view of the device counts only what goes through the queue: the
    // fill writers, commits and the cleaner write the device directly, whenever they run.
    let through_queue = Arc::new(FaultDevice::new(
        sce_io::SliceDevice::new(cache.clone(), 0, 8 * MIB).unwrap(),
    ));
    let qctl = through_queue.control();
    let q: Arc<dyn IoQueue> = Arc::new(sce_io::ThreadQueue::new(through_queue, 2));
    assert!(vol.serve_hits_from(q, 0));
    assert!(vol.start_write(512, PAGE).is_none(), "not whole pages");
    let pool = BufPool::new(MIB);
    let (start, queue) = vol.start_write(3 * MIB, 2 * PAGE).expect("started");
    assert!(
        vol.start_write(3 * MIB + PAGE, PAGE).is_none(),
        "its pages are held until it completes"
    );
    let mut buf = pool.take((2 * PAGE) as usize);
    buf.copy_from_slice(&pattern(5, 2 * PAGE));
    let (tx, rx) = std::sync::mpsc::channel();
    let (op, done) = start(buf, Box::new(move |d| tx.send(d.result).unwrap()));
    queue.submit(op, done);
    rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    assert_eq!(qctl.ops(Op::Write), 1, "one device write");
    let mut want = before.clone();
    want[(3 * MIB) as usize..(3 * MIB + 2 * PAGE) as usize].copy_from_slice(&pattern(5, 2 * PAGE));
    assert!(read(&vol, 0, 16 * MIB) == want, "visible once done");
    // Dropped unsubmitted: nothing written, its pages and positions given back.
    let (s2, _) = vol
        .start_write(3 * MIB + PAGE, PAGE)
        .expect("released at completion");
    drop(s2);
    assert_eq!(qctl.ops(Op::Write), 1, "a dropped start writes nothing");
    assert!(read(&vol, 0, 16 * MIB) == want);
    vol.write_at(3 * MIB + PAGE, &pattern(8, PAGE)).unwrap();
    want[(3 * MIB + PAGE) as usize..(3 * MIB + 2 * PAGE) as usize]
        .copy_from_slice(&pattern(8, PAGE));
    vol.flush().unwrap();
    assert_eq!(vol.writeback_stats().unwrap().dirty_bytes, 2 * PAGE);
    // A crash after the FLUSH keeps both.
    std::mem::forget(vol);
    let image = Arc::new(MemDevice::new(8 * MIB));
    image.write_at(0, &read(&*cache, 0, 8 * MIB)).unwrap();
    let again = CacheVolume::open(source.clone(), image, config()).unwrap();
    assert!(read(&again, 0, 16 * MIB) == want, "a committed write lost");
    again
        .flush_to_source(None, Duration::from_secs(10))
        .unwrap();
    assert!(read(&*source, 0, 16 * MIB) == want);
}

/// Log writes that fail still take their positions; once they fill the gap a commit must
/// close, a writer needs a commit even though nothing completed since the last one. Found by
/// review: the commit saw nothing to commit and wrote none, and every later write waited for
/// room until it failed.
#[test]
fn failed_log_writes_never_leave_the_log_waiting_for_a_commit() {
    let source = random_source(16 * MIB, 3);
    let cache = Arc::new(FaultDevice::new(MemDevice::new(8 * MIB)));
    let ctl = cache.control();
    let mut cfg = config();
    cfg.error_limit = u64::MAX;
    cfg.writeback_wait = Duration::from_secs(1);
    let vol = CacheVolume::open(source.clone(), cache.clone(), cfg).unwrap();
    const FAILING: u64 = 200;
    let w0 = ctl.ops(Op::Write);
    for k in 0..FAILING {
        ctl.fail_nth(Op::Write, w0 + k);
    }
    let data = pattern(3, PAGE);
    for i in 0..2 * FAILING {
        if ctl.ops(Op::Write) >= w0 + FAILING {
            break;
        }
        if let Err(sce_io::IoError::NoRoom(m)) = vol.write_at(i * PAGE, &data) {
            panic!(
                "after {} failed device writes: {m}",
                ctl.ops(Op::Write) - w0
            );
        }
    }
    assert!(ctl.ops(Op::Write) >= w0 + FAILING);
    vol.write_at(3 * MIB, &data).unwrap();
    vol.flush().unwrap();
    assert!(read(&vol, 3 * MIB, PAGE)[..] == data[..]);
}

/// The cleaner reads the log's versions in spans (one device read for neighbouring
/// positions), not one read per page: 64 pages scattered over the volume, written one by
/// one, sit together in the log and clean in a handful of reads, each page to its place.
#[test]
fn the_cleaner_reads_neighbouring_versions_in_one_device_read() {
    let source = random_source(16 * MIB, 8);
    let cache = Arc::new(FaultDevice::new(MemDevice::new(8 * MIB)));
    let ctl = cache.control();
    let vol = CacheVolume::open(source.clone(), cache.clone(), config()).unwrap();
    let mut want = read(&*source, 0, 16 * MIB);
    for i in 0..64u64 {
        // Pages 61 apart (mod 4,096): no two adjacent, so 64 source runs of one page.
        let at = (i * 61 * 67 % 4096) * PAGE;
        let data = pattern(i as u8 + 1, PAGE);
        vol.write_at(at, &data).unwrap();
        want[at as usize..(at + PAGE) as usize].copy_from_slice(&data);
    }
    vol.flush().unwrap();
    let r0 = ctl.ops(Op::Read);
    vol.flush_to_source(None, Duration::from_secs(10)).unwrap();
    let reads = ctl.ops(Op::Read) - r0;
    assert!(
        reads <= 4,
        "{reads} device reads to clean 64 neighbouring versions"
    );
    assert!(
        read(&*source, 0, 16 * MIB) == want,
        "each page in its place"
    );
    let wb = vol.writeback_stats().unwrap();
    assert_eq!((wb.dirty_bytes, wb.log_source_writes), (0, 64), "{wb:?}");
}

/// A crash image of `cache` (8 MiB) with the 4 KiB block equal to `page` damaged.
fn damaged_image(cache: &MemDevice, page: &[u8]) -> Arc<MemDevice> {
    let mut bytes = read(cache, 0, 8 * MIB);
    let at = bytes
        .chunks_exact(PAGE as usize)
        .position(|b| b == page)
        .expect("the page is in the log");
    bytes[at * PAGE as usize + 100] ^= 0x40;
    let image = Arc::new(MemDevice::new(8 * MIB));
    image.write_at(0, &bytes).unwrap();
    image
}

/// A page found damaged in the log at start stays lost (a read error, never older bytes)
/// while the ring laps round it: the loss is carried forward in tombstones, so the damaged
/// version no longer holds the ring (writes went on waiting for room, then failed, before),
/// and a restart after those laps still finds the page lost. Written again, it reads back.
#[test]
fn a_lost_page_stays_lost_while_the_ring_laps_round_it() {
    let source = random_source(16 * MIB, 9);
    let cache = Arc::new(MemDevice::new(8 * MIB));
    let vol = CacheVolume::open(source.clone(), cache.clone(), config()).unwrap();
    let x = pattern(0xA5, PAGE);
    vol.write_at(MIB, &x).unwrap();
    vol.flush().unwrap();
    vol.write_at(2 * MIB, &pattern(0xB7, PAGE)).unwrap();
    vol.flush().unwrap();
    std::mem::forget(vol);
    let image = damaged_image(&cache, &x);
    let vol = CacheVolume::open(source.clone(), image.clone(), config()).unwrap();
    let mut b = AlignedBuf::new(PAGE as usize);
    assert!(vol.read_at(MIB, &mut b).is_err(), "a lost page read");
    assert_eq!(vol.writeback_stats().unwrap().lost_bytes, PAGE);
    // Three laps of the 2 MiB ring.
    let mut want = read(&*source, 4 * MIB, 2 * MIB);
    for i in 0..96u64 {
        let at = (i % 32) * 64 * KIB;
        let data = pattern(i as u8, 64 * KIB);
        vol.write_at(4 * MIB + at, &data).unwrap();
        want[at as usize..(at + 64 * KIB) as usize].copy_from_slice(&data);
        if i % 4 == 3 {
            vol.flush().unwrap();
        }
    }
    assert!(
        vol.read_at(MIB, &mut b).is_err(),
        "a lost page read after the laps"
    );
    assert_eq!(vol.writeback_stats().unwrap().lost_bytes, PAGE);
    std::mem::forget(vol);
    let again = Arc::new(MemDevice::new(8 * MIB));
    again.write_at(0, &read(&*image, 0, 8 * MIB)).unwrap();
    let vol = CacheVolume::open(source.clone(), again, config()).unwrap();
    assert!(
        vol.read_at(MIB, &mut b).is_err(),
        "the loss forgotten by a restart"
    );
    assert!(read(&vol, 4 * MIB, 2 * MIB) == want);
    assert!(read(&vol, 2 * MIB, PAGE)[..] == pattern(0xB7, PAGE)[..]);
    let y = pattern(0x11, PAGE);
    vol.write_at(MIB, &y).unwrap();
    assert!(read(&vol, MIB, PAGE)[..] == y[..]);
    assert_eq!(vol.writeback_stats().unwrap().lost_bytes, 0);
}

/// Issue 45: large writes of a sequential stream past the cutoff (4 MiB) go through to the
/// source, not into the log, so that a restore does not fill the dirty room; a page the
/// log held under the stream is superseded (the stream's bytes read back, before and after
/// a crash); small sequential writes (a WAL) stay in the log however long their run.
#[test]
fn a_long_sequential_stream_of_large_writes_goes_through_to_the_source() {
    let source = random_source(64 * MIB, 3);
    let cache = Arc::new(MemDevice::new(16 * MIB));
    let mut c = config();
    c.persist.as_mut().unwrap().writeback_log = 8 * MIB;
    let vol = CacheVolume::open(source.clone(), cache.clone(), c.clone()).unwrap();
    // A page the log holds, in the stream's way.
    vol.write_at(10 * MIB + PAGE, &pattern(1, PAGE)).unwrap();
    vol.flush().unwrap();
    let stream = pattern(40, 16 * MIB);
    for k in 0..16u64 {
        let r = (k * MIB) as usize..((k + 1) * MIB) as usize;
        vol.write_at(k * MIB, &stream[r]).unwrap();
    }
    vol.flush().unwrap();
    let w = vol.writeback_stats().unwrap();
    // The first 3 MiB went into the log (dirty still, or cleaned by now: 3 MiB of an 8 MiB
    // log is past the low watermark); from the 4th write the run reached the cutoff; the
    // page the log held at 10 MiB is superseded.
    assert_eq!(w.sequential_bytes, 13 * MIB, "{w:?}");
    assert_eq!(w.dirty_bytes + w.cleaned_bytes, 3 * MIB, "{w:?}");
    assert_eq!(
        read(&*source, 3 * MIB, 13 * MIB)[..],
        stream[(3 * MIB) as usize..]
    );
    assert_eq!(read(&vol, 0, 16 * MIB)[..], stream[..]);
    // Small sequential writes stay in the log.
    let wal = pattern(90, 8 * MIB);
    for k in 0..(8 * MIB / (8 * KIB)) {
        let r = (k * 8 * KIB) as usize..((k + 1) * 8 * KIB) as usize;
        vol.write_at(32 * MIB + k * 8 * KIB, &wal[r]).unwrap();
    }
    vol.flush().unwrap();
    let w2 = vol.writeback_stats().unwrap();
    // (The log is smaller than the run: the cleaner drains it meanwhile.)
    assert_eq!(w2.sequential_bytes, 13 * MIB, "{w2:?}");
    // A crash: the superseded page stays superseded.
    drop(vol);
    let vol = CacheVolume::open(source.clone(), cache.clone(), c).unwrap();
    assert_eq!(read(&vol, 0, 16 * MIB)[..], stream[..]);
    assert_eq!(read(&vol, 32 * MIB, 8 * MIB)[..], wal[..]);
}

/// Reads the log serves are hits in the volume's counters (the main before counted only the
/// reads that reached the read slots: write-back's hit ratio left out its hottest pages).
#[test]
fn reads_of_dirty_pages_count_as_hits() {
    let source = random_source(16 * MIB, 3);
    let cache = Arc::new(MemDevice::new(8 * MIB));
    let vol = CacheVolume::open(source, cache, config()).unwrap();
    vol.write_at(MIB, &pattern(7, 64 * KIB)).unwrap();
    let s0 = vol.stats();
    // One read the log serves whole (16 pages), one half from it (8 pages).
    assert_eq!(read(&vol, MIB, 64 * KIB), pattern(7, 64 * KIB).to_vec());
    read(&vol, MIB + 32 * KIB, 64 * KIB);
    let s1 = vol.stats();
    assert_eq!(s1.read_pages_hit - s0.read_pages_hit, 16 + 8, "{s1:?}");
    assert_eq!(s1.read_requests_full_hit - s0.read_requests_full_hit, 1);
    assert_eq!(s1.read_pages_missed - s0.read_pages_missed, 8, "{s1:?}");
}

/// A read of pages one write put in the log side by side is one device read, and a page of
/// it that fails its checksum is never served: that page alone is read again and, damaged,
/// lost (its reads fail); the others read right.
#[test]
fn a_run_of_logged_pages_is_read_at_once_and_each_page_checked() {
    let source = random_source(16 * MIB, 3);
    let cache = Arc::new(FaultDevice::new(MemDevice::new(8 * MIB)));
    let ctl = cache.control();
    let vol = CacheVolume::open(source, cache.clone(), config()).unwrap();
    let data = pattern(11, 4 * PAGE);
    vol.write_at(3 * MIB, &data).unwrap();
    let r0 = ctl.ops(Op::Read);
    assert_eq!(read(&vol, 3 * MIB, 4 * PAGE), data.to_vec());
    assert_eq!(
        ctl.ops(Op::Read) - r0,
        1,
        "four pages of one write: one device read"
    );
    // Every read from now returns a bit flipped in its middle: the third page of the run.
    ctl.corrupt_reads(0..u64::MAX);
    let mut buf = AlignedBuf::new(4 * PAGE as usize);
    assert!(
        vol.read_at(3 * MIB, &mut buf).is_err(),
        "a damaged page was served"
    );
    ctl.clear();
    assert_eq!(
        read(&vol, 3 * MIB, 2 * PAGE),
        data[..2 * PAGE as usize].to_vec()
    );
    assert_eq!(
        read(&vol, 3 * MIB + 3 * PAGE, PAGE),
        data[3 * PAGE as usize..].to_vec()
    );
    let mut page = AlignedBuf::new(PAGE as usize);
    assert!(
        vol.read_at(3 * MIB + 2 * PAGE, &mut page).is_err(),
        "the damaged page is lost: its reads fail"
    );
}
