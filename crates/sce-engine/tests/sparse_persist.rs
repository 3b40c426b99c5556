//! The page area on a persistent cache (issue 47): packed slots are never restored (their
//! pages are not in any record), and a slot that held a line with a durable record and
//! now holds packed pages (some of them pages of that very line, at other places in the
//! slot) must not come back as the line after a crash. Checked with page checksums off,
//! so that only the write intents stand between a stale record and the client: the fill of
//! a packed page guards its slot as no line's (`Persist::fill_fragment`).
//!
//! Single-threaded client I/O: at every moment the source is the truth.

use sce_core::CoreConfig;
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
mod common;

use common::{crash_image, random_source};
use sce_io::{AlignedBuf, BlockDevice, MemDevice};
use std::sync::Arc;
use std::time::Duration;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const LINE: u64 = 128 * KIB;

fn config(verify: bool) -> EngineConfig {
    let mut p = PersistConfig::new("sparse-source");
    // No flush round but the ones the test asks for: records stay as they were written.
    p.flush_interval = Duration::from_secs(3600);
    EngineConfig {
        core: CoreConfig {
            fragment_size: LINE,
            hot_window: 16,
            sequential_cutoff: 0,
            ..CoreConfig::default()
        },
        background_population: false,
        verify,
        persist: Some(p),
        ..EngineConfig::default()
    }
}

/// Pages (4 KiB) where the volume and the source differ.
fn mismatches(vol: &dyn BlockDevice, source: &dyn BlockDevice) -> Vec<u64> {
    let (mut a, mut b) = (
        AlignedBuf::new(LINE as usize),
        AlignedBuf::new(LINE as usize),
    );
    let mut bad = Vec::new();
    for at in (0..source.size()).step_by(LINE as usize) {
        vol.read_at(at, &mut a).expect("volume read");
        source.read_at(at, &mut b).expect("source read");
        for p in 0..(LINE / 4096) as usize {
            if a[p * 4096..(p + 1) * 4096] != b[p * 4096..(p + 1) * 4096] {
                bad.push(at + p as u64 * 4096);
            }
        }
    }
    bad
}

/// Fills the cache with lines (durable records), evicts one and reads single pages of it
/// out of place (into the slot it left, whose record still names it), then single pages of
/// other lines and of the evicted ones until packed slots took more lines' slots; a crash
/// then, and one right after the evicted line's pages were packed.
/// Returns the source and the crash image of the cache device, and the packed slots seen.
fn packed_after_lines(verify: bool) -> (Arc<MemDevice>, [Arc<MemDevice>; 2], u64) {
    let source = random_source(16 * MIB, 7);
    let cache = Arc::new(MemDevice::new(4 * MIB));
    let vol = CacheVolume::open(source.clone(), cache.clone(), config(verify)).expect("open");
    // Line 3 cached as population does for a line written in three places (reads would
    // have made it dense, and a dense line's misses are population's, not the page area's).
    let mut page = AlignedBuf::new(4096);
    for p in [1u64, 12, 25] {
        page.fill(p as u8);
        vol.write_at(3 * LINE + p * 4096, &page).unwrap();
    }
    assert_eq!(vol.populate_now(10), 1);
    let mut line = AlignedBuf::new(LINE as usize);
    let mut lines = 1;
    // Whole lines until the cache is full: each read covers its line, which is dense.
    for f in (0..(16 * MIB / LINE)).filter(|&f| f != 3) {
        vol.read_at(f * LINE, &mut line).unwrap();
        if vol.populate_now(10) == 0 {
            break;
        }
        lines += 1;
    }
    assert!(lines >= 8, "{lines} lines cached");
    for _ in 0..3 {
        assert_eq!(vol.flush_metadata(), 0);
    }
    // Line 3 evicted (its record still claims it), then single pages of it, out of place:
    // the page area's first slot is the one line 3 left, and holds only line 3's pages.
    vol.evict(3 * LINE, LINE).unwrap();
    for p in [9u64, 0, 17, 30, 5, 22] {
        vol.read_at(3 * LINE + p * 4096, &mut page).unwrap();
    }
    vol.quiesce();
    assert!(vol.stats().sparse_pages_filled > 0, "{:?}", vol.stats());
    let first = crash_image(&cache);
    // Single pages of lines never read, then of the cached lines' neighbours and of the
    // lines themselves: the page area grows by evicting lines, and takes their pages.
    for round in 0..4u64 {
        for f in 0..(16 * MIB / LINE) {
            let p = (f * 7 + round * 5) % (LINE / 4096);
            vol.read_at(f * LINE + p * 4096, &mut page).unwrap();
        }
    }
    vol.quiesce();
    let packed = vol.stats().sparse_pages_filled;
    let last = crash_image(&cache);
    drop(vol);
    (source, [first, last], packed)
}

#[test]
fn packed_slots_never_come_back_as_the_lines_they_held() {
    for verify in [false, true] {
        let (source, images, packed) = packed_after_lines(verify);
        assert!(packed >= 16, "verify {verify}: {packed} pages packed");
        for (i, image) in images.into_iter().enumerate() {
            let vol = CacheVolume::open(source.clone(), image, config(verify)).expect("reopen");
            let bad = mismatches(&vol, &*source);
            assert!(
                bad.is_empty(),
                "verify {verify}, crash {i}: stale pages at {bad:x?}"
            );
            let p = vol.persist_stats().unwrap();
            eprintln!(
                "verify {verify}, crash {i}: {packed} pages packed; after it {} lines \
                 restored, {} dropped for their intents",
                p.fragments_restored, p.fragments_dropped_intent
            );
        }
    }
}
