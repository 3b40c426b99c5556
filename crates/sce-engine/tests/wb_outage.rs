//! The write-back cleaner when things fail (issue 27; through the log since issue 45): under a source outage its backoff
//! holds (writes waiting for room do not cut it short), so it fails a few cleanings per
//! second, not thousands; and a dirty page whose cache copy fails its checksum is lost
//! alone, the other pages of its run reaching the source.

mod common;

use common::{random_source, read};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_engine::{CacheVolume, EngineConfig};
use sce_io::{AlignedBuf, BlockDevice, FaultDevice, MemDevice, Op};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const PAGE: u64 = 4096;

fn config(idle: Duration, wait: Duration) -> EngineConfig {
    EngineConfig {
        writeback_idle: idle,
        writeback_wait: wait,
        ..common::writeback_config("wb-outage", Duration::from_millis(5))
    }
}

/// Every source write fails for 6 s while four writers keep writing (the cache fills with
/// dirty data, then they wait for room and wake the cleaners every 20 ms each). The failed
/// cleanings per second are printed and bounded (the old cleaner, woken by every waiting
/// write, failed hundreds per second); when the source returns, `flush_to_source` (an
/// operator's kick) drains everything and nothing is lost.
#[test]
fn a_source_outage_costs_a_few_failed_cleanings_per_second() {
    let size = 8 * MIB;
    let source_mem = random_source(size, 21);
    let source = Arc::new(FaultDevice::new(source_mem.clone()));
    source.control().fail_range(&[Op::Write], 0..u64::MAX);
    let cache = Arc::new(MemDevice::new(4 * MIB));
    let cfg = config(Duration::from_millis(100), Duration::from_millis(300));
    let vol = Arc::new(CacheVolume::open(source.clone(), cache, cfg).expect("open"));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..4u64)
        .map(|t| {
            let (vol, stop) = (vol.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t);
                let mut b = vec![0u8; 16 * KIB as usize];
                let (mut ok, mut failed) = (0u64, 0u64);
                while !stop.load(Relaxed) {
                    rng.fill(&mut b[..]);
                    let at = rng.gen_range(0..size / b.len() as u64) * b.len() as u64;
                    // A write that waited too long for room fails: expected in an outage.
                    match vol.write_at(at, &b) {
                        Ok(()) => ok += 1,
                        Err(_) => failed += 1,
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    sce_testkit::poll("a first failed cleaning", 120, || {
        let w = vol.writeback_stats().unwrap();
        (w.clean_errors > 0).then_some(()).ok_or(format!("{w:?}"))
    });
    let (t0, e0) = (Instant::now(), vol.writeback_stats().unwrap().clean_errors);
    std::thread::sleep(Duration::from_secs(6));
    let (secs, e1) = (
        t0.elapsed().as_secs_f64(),
        vol.writeback_stats().unwrap().clean_errors,
    );
    stop.store(true, Relaxed);
    let (mut ok, mut failed) = (0, 0);
    for w in writers {
        let (o, f) = w.join().expect("a writer panicked");
        ok += o;
        failed += f;
    }
    let rate = (e1 - e0) as f64 / secs;
    println!(
        "source outage: {} failed cleanings in {secs:.1} s = {rate:.1}/s ({} in all); writes \
         meanwhile: {ok} absorbed, {failed} failed waiting for room",
        e1 - e0,
        e1
    );
    assert!(rate < 50.0, "{rate:.1} failed cleanings per second");
    assert!(
        failed > 0,
        "the writers never waited for room: no wakes to resist"
    );
    // The source comes back: an operator's flush cuts the backoff short and drains all.
    source.control().clear();
    vol.flush_to_source(None, Duration::from_secs(120))
        .expect("flush to the source");
    let w = vol.writeback_stats().unwrap();
    assert_eq!((w.dirty_bytes, w.lost_bytes), (0, 0), "{w:?}");
    assert_eq!(read(&*source_mem, 0, size), read(&*vol, 0, size));
}

/// One run of 16 dirty pages, one of them damaged on the cache device: cleaning loses that
/// page alone (reads of it fail) and writes the other 15 to the source.
#[test]
fn a_damaged_dirty_page_is_lost_alone_and_the_rest_of_its_run_is_cleaned() {
    let source = random_source(4 * MIB, 22);
    let original = read(&*source, 0, 4 * MIB);
    let cache = Arc::new(MemDevice::new(4 * MIB));
    let cfg = config(Duration::from_secs(3600), Duration::from_secs(5));
    let vol = CacheVolume::open(source.clone(), cache.clone(), cfg).expect("open");
    let (base, n, bad) = (MIB, 16u64, 5u64);
    let mut data = vec![0u8; (n * PAGE) as usize];
    SmallRng::seed_from_u64(23).fill(&mut data[..]);
    vol.write_at(base, &data).unwrap();
    vol.flush().unwrap();
    // Flip a byte of page `bad`'s only copy on the cache device.
    let want = &data[(bad * PAGE) as usize..((bad + 1) * PAGE) as usize];
    let img = read(&*cache, 0, cache.size());
    let at = img
        .chunks(PAGE as usize)
        .position(|c| c == want)
        .expect("the page is on the cache device") as u64
        * PAGE;
    let mut b = read(&*cache, at, PAGE);
    b[100] ^= 0x5a;
    cache.write_at(at, &b).unwrap();
    vol.flush_to_source(None, Duration::from_secs(60))
        .expect("flush to the source");
    let w = vol.writeback_stats().unwrap();
    println!(
        "{n} dirty pages in one run, page {bad} damaged: {} bytes lost, {} cleaned",
        w.lost_bytes, w.cleaned_bytes
    );
    assert_eq!((w.lost_bytes, w.dirty_bytes), (PAGE, 0), "{w:?}");
    assert_eq!(w.cleaned_bytes, (n - 1) * PAGE, "{w:?}");
    let mut page = AlignedBuf::new(PAGE as usize);
    for p in 0..n {
        let (a, s) = ((base + p * PAGE) as usize, (p * PAGE) as usize);
        let on_source = read(&*source, a as u64, PAGE);
        if p == bad {
            assert!(vol.read_at(a as u64, &mut page).is_err(), "page {p} served");
            assert_eq!(on_source, &original[a..a + PAGE as usize], "page {p}");
        } else {
            assert_eq!(
                on_source,
                &data[s..s + PAGE as usize],
                "page {p} on the source"
            );
            assert_eq!(read(&vol, a as u64, PAGE), on_source, "page {p}");
        }
    }
}
