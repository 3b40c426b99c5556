//! The write journal: a crash amid writes to every cached fragment drops only the pages
//! written (without the journal, the fragments whole), and the journal blocks a load must
//! ignore (torn, garbage, an older lap, another device's) are ignored.

use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_core::CoreConfig;
use sce_engine::{CacheVolume, EngineConfig, PersistConfig, PersistStats};
use sce_io::{AlignedBuf, BlockDevice, MemDevice};
use sce_store::journal::{encode_block, JournalEntry};
use std::sync::Arc;
use std::time::Duration;
mod common;
use common::crash_image;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
/// Fragments the tests cache (1 MiB each).
const HOT: u64 = 16;

fn random_source(size: u64, seed: u64) -> Arc<MemDevice> {
    let d = MemDevice::new(size);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut buf = AlignedBuf::new(MIB as usize);
    for at in (0..size).step_by(MIB as usize) {
        rng.fill(&mut buf[..]);
        d.write_at(at, &buf).unwrap();
    }
    Arc::new(d)
}

/// Rounds only when the test asks (`flush_metadata`), no background population.
fn config(journal: bool) -> EngineConfig {
    let mut p = PersistConfig::new("journal-test");
    p.flush_interval = Duration::from_secs(1_000_000);
    p.journal = journal;
    EngineConfig {
        core: CoreConfig {
            fragment_size: MIB,
            ..CoreConfig::default()
        },
        background_population: false,
        persist: Some(p),
        ..EngineConfig::default()
    }
}

/// Blocks (of 4 KiB) where the volume and the source differ.
fn mismatches(vol: &dyn BlockDevice, source: &dyn BlockDevice) -> usize {
    let (mut a, mut b) = (AlignedBuf::new(MIB as usize), AlignedBuf::new(MIB as usize));
    let mut bad = 0;
    for at in (0..source.size()).step_by(MIB as usize) {
        vol.read_at(at, &mut a).unwrap();
        source.read_at(at, &mut b).unwrap();
        bad += a
            .chunks(4096)
            .zip(b.chunks(4096))
            .filter(|(x, y)| x != y)
            .count();
    }
    bad
}

/// A volume with the first `HOT` fragments cached and their records durable.
fn warm(source: &Arc<MemDevice>, cache: &Arc<MemDevice>, journal: bool) -> CacheVolume {
    let vol = CacheVolume::open(source.clone(), cache.clone(), config(journal)).unwrap();
    let mut buf = AlignedBuf::new(MIB as usize);
    for f in 0..HOT {
        vol.read_at(f * MIB, &mut buf).unwrap();
    }
    assert_eq!(vol.populate_now(100), HOT as usize);
    for _ in 0..3 {
        assert_eq!(vol.flush_metadata(), 0);
    }
    assert_eq!(vol.persist_stats().unwrap().dirty_intents, 0);
    vol
}

/// One 4 KiB write into every cached fragment (at a page that differs from fragment to
/// fragment; 16 journal blocks, under half the 64-block ring of a 64 MiB device, so no
/// early flush round rewrites the records first), then a crash: the stats of the restart on the crash image, and that volume.
fn write_every_fragment_and_crash(
    source: &Arc<MemDevice>,
    vol: &CacheVolume,
    cache: &MemDevice,
    journal: bool,
) -> (PersistStats, CacheVolume) {
    let mut rng = SmallRng::seed_from_u64(5);
    let mut page = AlignedBuf::new(4096);
    for f in 0..HOT {
        rng.fill(&mut page[..]);
        vol.write_at(f * MIB + (f * 7 % 256) * 4096, &page).unwrap();
    }
    vol.quiesce();
    let image = crash_image(cache);
    let again = CacheVolume::open(source.clone(), image, config(journal)).unwrap();
    (again.persist_stats().unwrap(), again)
}

#[test]
fn a_crash_amid_writes_drops_only_the_written_pages() {
    let source = random_source(64 * MIB, 1);
    let cache = Arc::new(MemDevice::new(64 * MIB));
    let vol = warm(&source, &cache, true);
    let (p, again) = write_every_fragment_and_crash(&source, &vol, &cache, true);
    println!("with the journal: {p:?}");
    assert_eq!(p.fragments_restored, HOT, "{p:?}");
    assert_eq!(p.fragments_dropped_intent, 0, "{p:?}");
    assert_eq!(p.journal_pages_dropped, HOT, "one page per fragment: {p:?}");
    assert_eq!(p.journal_fragments_hit, HOT, "{p:?}");
    assert!(p.journal_blocks_replayed >= 1, "{p:?}");
    let w = vol.persist_stats().unwrap();
    assert_eq!(w.journal_appends, HOT, "{w:?}");
    assert!(w.journal_blocks >= 1 && w.journal_blocks <= HOT, "{w:?}");
    assert_eq!(w.journal_full_fallbacks, 0, "{w:?}");
    // Never stale, and warm: only the written pages miss.
    assert_eq!(mismatches(&again, &*source), 0);
    let s0 = again.stats();
    let mut buf = AlignedBuf::new(MIB as usize);
    for f in 0..HOT {
        again.read_at(f * MIB, &mut buf).unwrap();
    }
    let d = again.stats().delta(&s0);
    assert_eq!(
        d.read_pages_missed, HOT,
        "only the written pages miss: {d:?}"
    );
    assert_eq!(d.read_pages_hit, HOT * 256 - HOT, "{d:?}");
    // The slots that lost pages were guarded by intents at start; the flusher rewrites their
    // records and clears the intents, so a second crash drops nothing.
    assert!(again.persist_stats().unwrap().dirty_intents > 0);
    for _ in 0..3 {
        assert_eq!(again.flush_metadata(), 0);
    }
    assert_eq!(again.persist_stats().unwrap().dirty_intents, 0);
    drop(vol);
}

#[test]
fn without_the_journal_a_crash_drops_the_written_fragments_whole() {
    let source = random_source(64 * MIB, 2);
    let cache = Arc::new(MemDevice::new(64 * MIB));
    let vol = warm(&source, &cache, false);
    let (p, again) = write_every_fragment_and_crash(&source, &vol, &cache, false);
    println!("without the journal: {p:?}");
    assert_eq!(p.fragments_restored, 0, "{p:?}");
    assert_eq!(p.fragments_dropped_intent, HOT, "{p:?}");
    assert_eq!(p.journal_pages_dropped, 0, "{p:?}");
    assert_eq!(vol.persist_stats().unwrap().journal_appends, 0);
    assert_eq!(mismatches(&again, &*source), 0);
}

#[test]
fn writes_to_a_slot_under_an_intent_do_not_keep_it_set() {
    // With the journal and no write-hot presets (`warm_rounds` 0), an intent (here: set at
    // start for a slot that lost pages) is cleared by the flusher even while the slot keeps
    // being written. (With presets, a slot written every round keeps its intent by design:
    // `write_hot_slots_keep_their_intents_and_writes_to_them_wait_for_nothing`.)
    let source = random_source(64 * MIB, 3);
    let cache = Arc::new(MemDevice::new(64 * MIB));
    let vol = warm(&source, &cache, true);
    let (_, again) = write_every_fragment_and_crash(&source, &vol, &cache, true);
    drop(again);
    let mut cfg = config(true);
    cfg.persist.as_mut().unwrap().warm_rounds = 0;
    let image = crash_image(&cache);
    let again = CacheVolume::open(source.clone(), image, cfg).unwrap();
    assert!(again.persist_stats().unwrap().dirty_intents > 0);
    let mut page = AlignedBuf::new(4096);
    for round in 0..4 {
        for f in 0..HOT {
            page.fill(round as u8);
            again.write_at(f * MIB, &page).unwrap();
        }
        again.quiesce();
        assert_eq!(again.flush_metadata(), 0);
    }
    assert_eq!(again.persist_stats().unwrap().dirty_intents, 0);
    assert_eq!(mismatches(&again, &*source), 0);
}

#[test]
fn torn_garbage_old_and_foreign_journal_blocks_are_ignored() {
    let source = random_source(64 * MIB, 4);
    let cache = Arc::new(MemDevice::new(64 * MIB));
    {
        let vol = warm(&source, &cache, true);
        // Some journaled writes, so that the tail is past zero after the clean close.
        let page = AlignedBuf::new(4096);
        for f in 0..8 {
            vol.write_at(f * MIB, &page).unwrap();
        }
        assert!(vol.shutdown());
    }
    let sb = sce_store::read_superblock(&*cache).unwrap();
    let (l, tail) = (sb.layout, sb.journal_tail);
    assert!(tail >= 8, "{tail}");
    let e = |frag, first, pages| JournalEntry {
        frag,
        volume: sb.volumes[0].id,
        first,
        pages,
        dirty: None,
    };
    let put = |at: u32, img: &[u8]| {
        let mut b = AlignedBuf::new(4096);
        b.copy_from_slice(img);
        cache.write_at(l.journal_block_offset(at), &b).unwrap();
    };
    // Live: drops pages 3 and 4 of fragment 0.
    put(0, &encode_block(&sb.uuid, tail, 0, &[e(0, 3, 2)]));
    // Torn (one byte off): fragment 1 whole.
    let mut torn = encode_block(&sb.uuid, tail + 1, 1, &[e(1, 0, 256)]);
    torn[3000] ^= 0x40;
    put(1, &torn);
    // An older lap (below the tail): fragment 2 whole.
    put(2, &encode_block(&sb.uuid, tail - 1, 2, &[e(2, 0, 256)]));
    // Another device's: fragment 3 whole.
    put(
        3,
        &encode_block(b"another-device!!", tail + 2, 3, &[e(3, 0, 256)]),
    );
    // Garbage.
    let mut junk = vec![0u8; 4096];
    SmallRng::seed_from_u64(9).fill(&mut junk[..]);
    put(4, &junk);
    let frags = source.size().div_ceil(MIB);
    let loaded = sce_store::load(&*cache, sb.clone(), 0, frags).unwrap();
    let j = &loaded.journal;
    assert_eq!(
        (j.blocks_live, j.blocks_bad, j.blocks_foreign),
        (1, 2, 1),
        "{j:?}"
    );
    assert_eq!(loaded.report.journal_pages_dropped, 2);
    let vol = CacheVolume::open(source.clone(), cache.clone(), config(true)).unwrap();
    let p = vol.persist_stats().unwrap();
    assert_eq!(p.fragments_restored, HOT, "{p:?}");
    assert_eq!(
        (
            p.journal_pages_dropped,
            p.journal_fragments_hit,
            p.journal_blocks_replayed
        ),
        (2, 1, 1),
        "{p:?}"
    );
    assert_eq!(mismatches(&vol, &*source), 0);
    // The journal was reset above every block of this device: the next start replays none.
    let sb = sce_store::read_superblock(&*cache).unwrap();
    assert_eq!(sb.journal_tail, tail + 1);
    assert!(vol.shutdown());
    let vol = CacheVolume::open(source.clone(), cache.clone(), config(true)).unwrap();
    let p = vol.persist_stats().unwrap();
    assert_eq!(
        (p.journal_pages_dropped, p.fragments_restored),
        (0, HOT),
        "{p:?}"
    );
}

#[test]
fn write_hot_slots_keep_their_intents_and_writes_to_them_wait_for_nothing() {
    let source = random_source(64 * MIB, 6);
    // A 128-block ring: 32 journaled writes stay under half of it (no early round).
    let cache = Arc::new(MemDevice::new(256 * MIB));
    let vol = warm(&source, &cache, true);
    let mut page = AlignedBuf::new(4096);
    let write_all = |vol: &CacheVolume, page: &mut AlignedBuf, i: u64| {
        for f in 0..HOT {
            page.fill((i + f) as u8);
            vol.write_at(f * MIB + (i % 256) * 4096, page).unwrap();
        }
    };
    // The first write to each slot is journaled; the second one too, and it sets the slot's
    // intent ahead of the next write.
    write_all(&vol, &mut page, 0);
    write_all(&vol, &mut page, 1);
    let p = vol.persist_stats().unwrap();
    assert_eq!(p.journal_appends, 2 * HOT, "{p:?}");
    assert_eq!(p.intent_presets, HOT, "{p:?}");
    assert_eq!(p.dirty_intents, HOT, "{p:?}");
    // Once the intent writer made them durable (in the background), writes to those slots
    // are covered by them: no journal entry, no wait.
    let mut i = 2;
    while vol.persist_stats().unwrap().intent_hits < HOT {
        assert!(i < 2000, "the preset intents never became durable");
        write_all(&vol, &mut page, i);
        i += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    let before = vol.persist_stats().unwrap();
    for j in 0..10 {
        write_all(&vol, &mut page, i + j);
    }
    vol.quiesce();
    let after = vol.persist_stats().unwrap();
    assert_eq!(after.journal_appends, before.journal_appends, "{after:?}");
    assert_eq!(after.journal_blocks, before.journal_blocks, "{after:?}");
    assert_eq!(after.intent_syncs, before.intent_syncs, "{after:?}");
    assert_eq!(
        after.intent_hits,
        before.intent_hits + 10 * HOT,
        "{after:?}"
    );
    // A round with writes since the last keeps them; a crash now drops those slots whole,
    // and nothing read after it is stale.
    assert_eq!(vol.flush_metadata(), 0);
    assert_eq!(vol.persist_stats().unwrap().dirty_intents, HOT);
    let again = CacheVolume::open(source.clone(), crash_image(&cache), config(true)).unwrap();
    let p = again.persist_stats().unwrap();
    assert_eq!(p.fragments_dropped_intent, HOT, "{p:?}");
    assert_eq!(mismatches(&again, &*source), 0);
    // Those slots were the hottest: they are filled again from the source in the
    // background (`refill.rs`), racing writes to them, which it must never undo.
    for f in 0..HOT {
        page.fill(0xA5);
        again.write_at(f * MIB + 4096, &page).unwrap();
    }
    let mut polls = 0;
    while again.persist_stats().unwrap().refill_pending > 0 {
        assert!(polls < 6000, "the refill never ended");
        polls += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    let p = again.persist_stats().unwrap();
    assert_eq!(p.refilled, HOT, "{p:?}");
    let hits = again.stats().read_pages_hit;
    assert_eq!(mismatches(&again, &*source), 0);
    let hit = again.stats().read_pages_hit - hits;
    assert!(hit >= HOT * 255, "{hit} pages hit after the refill");
    // Rounds without writes keep them while the slots count as written lately
    // (`warm_rounds` rounds after their last write: a slot written every few rounds never
    // journals again), then clear them.
    let warm_rounds = PersistConfig::new("x").warm_rounds;
    for _ in 0..2 {
        assert_eq!(vol.flush_metadata(), 0);
    }
    assert_eq!(vol.persist_stats().unwrap().dirty_intents, HOT);
    for _ in 0..warm_rounds {
        assert_eq!(vol.flush_metadata(), 0);
    }
    assert_eq!(vol.persist_stats().unwrap().dirty_intents, 0);
    drop(again);
}
