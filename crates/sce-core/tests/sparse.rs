//! The page area (issue 47): a read miss in a sparse line fills only its own pages, packed
//! with other lines' pages; a line whose pages keep being admitted graduates to a line; a
//! write, a bad checksum or a lend to the write-back log drops what the area holds.

use sce_core::*;

const KIB: u64 = 1024;
const LINE: u64 = 128 * KIB;

/// 128 KiB lines (32 pages: two sets per packed slot), a 1 MiB cache, a 64 MiB source.
fn core(dense_line_percent: u32) -> CacheCore {
    let cfg = CoreConfig {
        fragment_size: LINE,
        hot_window: 8,
        sequential_cutoff: 0,
        dense_line_percent,
        ..CoreConfig::default()
    };
    CacheCore::new(cfg, 64 << 20, 1024 * KIB).expect("valid")
}

/// Reads 4 KiB at `off` as a driver does (fills written and completed); returns the bytes
/// it filled and the runs that read the cache.
/// Where a read of the page at `off` finds it on the cache device, if it hits.
fn cache_of(c: &mut CacheCore, off: u64) -> Option<CacheOffset> {
    let mut p = ReadPlan::new();
    c.begin_read(SourceOffset(off), 4096, &mut p).unwrap();
    let at = p.runs.iter().find_map(|r| match r.target {
        RunTarget::Cache(at) => Some(at),
        _ => None,
    });
    assert!(p.pops.is_empty(), "a hit fills nothing");
    c.end_read(&mut p);
    at
}

fn read(c: &mut CacheCore, off: u64) -> (u64, usize) {
    let mut p = ReadPlan::new();
    c.begin_read(SourceOffset(off), 4096, &mut p).unwrap();
    let filled = p.fills.iter().map(|f| f.len).sum();
    let hits = p
        .runs
        .iter()
        .filter(|r| matches!(r.target, RunTarget::Cache(_)))
        .count();
    for pop in std::mem::take(&mut p.pops) {
        c.complete_population(pop, true).unwrap();
    }
    c.end_read(&mut p);
    (filled, hits)
}

/// One page in each of 16 lines: 16 pages filled, each 4 KiB, all in one packed slot; read
/// again, each hits; no line has a slot and population has nothing to do.
#[test]
fn sparse_misses_fill_single_pages_packed_together() {
    let mut c = core(25);
    let at = |i: u64| i * 3 * LINE + 8 * KIB;
    for i in 0..16 {
        assert_eq!(read(&mut c, at(i)), (4096, 0), "line {i}");
    }
    assert_eq!(c.page_area(), (1, 16));
    assert_eq!(c.free_slots(), 7);
    for i in 0..16 {
        assert_eq!(read(&mut c, at(i)), (0, 1), "line {i} again");
        assert!(c.is_cached(SourceOffset(at(i))));
        assert_eq!(c.exists_range(SourceOffset(at(i)), 4096).len(), 1);
    }
    assert!(c.pick_population_unthrottled().is_none());
    assert_eq!(c.stats().sparse_pages_filled, 16);
    assert_eq!(c.stats().cache_bytes_planned, 16 * 4096);
}

/// A line whose pages are read in three places (three 64ths of its fragment in the hotness
/// window) is dense: population fills the whole line, and its pages leave the area; before
/// that, population leaves it alone.
#[test]
fn a_line_touched_in_three_places_is_populated_whole() {
    let mut c = core(25);
    for p in [0, 10] {
        assert_eq!(read(&mut c, p * 4 * KIB).0, 4096);
    }
    assert!(c.pick_population_unthrottled().is_none());
    assert_eq!(read(&mut c, 20 * 4 * KIB).0, 4096);
    assert_eq!(c.page_area().1, 3);
    let job = c
        .pick_population_unthrottled()
        .expect("the line is populated");
    assert_eq!((job.frag, job.len), (FragNo(0), LINE));
    assert!(!c.slot_is_packed(job.slot));
    assert_eq!(c.page_area().1, 0, "its pages left the area");
    c.complete_population(job.id, true).unwrap();
    assert_eq!(c.exists(FragNo(0)).unwrap().1, 32);
    assert_eq!(read(&mut c, 0), (0, 1));
}

/// A read that covers a quarter of a line's pages makes it dense at once: its misses are no
/// longer the page area's.
#[test]
fn a_large_read_makes_its_line_dense() {
    let mut c = core(25);
    let mut p = ReadPlan::new();
    c.begin_read(SourceOffset(5 * LINE), 8 * 4096, &mut p)
        .unwrap();
    assert!(
        p.fills.is_empty(),
        "no page of a dense line goes to the page area"
    );
    c.end_read(&mut p);
    assert_eq!(read(&mut c, 5 * LINE + 20 * 4096).0, 0);
    assert_eq!(c.page_area(), (0, 0));
}

/// A write drops the page (also during its fill), a bad checksum drops it, and so does a
/// lend of its slot to the write-back log, which gets the slot once nothing pins it.
#[test]
fn writes_bad_pages_and_lends_drop_area_pages() {
    let mut c = core(25);
    let at = |i: u64| i * 3 * LINE;
    for i in 0..4 {
        read(&mut c, at(i));
    }
    assert_eq!(c.page_area(), (1, 4));
    // A write over page 0 refills it in its way: cached again once both halves are done.
    let page0 = cache_of(&mut c, at(0));
    let w = c
        .begin_write(SourceOffset(at(0)), 4096, WriteKind::Data)
        .unwrap();
    assert_eq!(
        w.cache_writes.len(),
        1,
        "the write refills the page it held"
    );
    assert_eq!(
        Some(w.cache_writes[0].cache),
        page0,
        "in the page's own way"
    );
    assert!(
        !c.is_cached(SourceOffset(at(0))),
        "not while the copy is in flight"
    );
    c.write_source_done(w.id, true).unwrap();
    assert!(!c.is_cached(SourceOffset(at(0))));
    c.write_cache_done(w.id, w.cache_writes[0].part, true)
        .unwrap();
    assert!(c.is_cached(SourceOffset(at(0))));
    // A failed copy leaves it uncached, and so does a write of part of it (no copy).
    let w = c
        .begin_write(SourceOffset(at(0)), 4096, WriteKind::Data)
        .unwrap();
    c.write_cache_done(w.id, w.cache_writes[0].part, false)
        .unwrap();
    c.write_source_done(w.id, true).unwrap();
    assert!(!c.is_cached(SourceOffset(at(0))));
    read(&mut c, at(3));
    let w = c
        .begin_write(SourceOffset(at(3) + 512), 1024, WriteKind::Data)
        .unwrap();
    assert!(w.cache_writes.is_empty(), "no copy of a partial page");
    c.write_source_done(w.id, true).unwrap();
    assert!(!c.is_cached(SourceOffset(at(3))));
    read(&mut c, at(3));
    assert!(c.is_cached(SourceOffset(at(3))));
    // A write during a fill spoils it.
    let mut p = ReadPlan::new();
    c.begin_read(SourceOffset(at(5)), 4096, &mut p).unwrap();
    assert_eq!(p.fills.len(), 1);
    let w = c
        .begin_write(SourceOffset(at(5)), 4096, WriteKind::Data)
        .unwrap();
    for pop in std::mem::take(&mut p.pops) {
        c.complete_population(pop, true).unwrap();
    }
    c.end_read(&mut p);
    c.write_source_done(w.id, true).unwrap();
    assert!(!c.is_cached(SourceOffset(at(5))));
    // A bad copy of page 1.
    c.invalidate(FragNo(at(1) / LINE), 0, 1);
    assert!(!c.is_cached(SourceOffset(at(1))));
    assert_eq!(c.page_area().1, 2);
    // The packed slot lent while a read pins it: refused, its pages dropped meanwhile.
    let packed = (0..8).map(SlotNo).find(|&s| c.slot_is_packed(s)).unwrap();
    let mut p = ReadPlan::new();
    c.begin_read(SourceOffset(at(2)), 4096, &mut p).unwrap();
    assert_eq!(p.hit_pages, 1);
    assert_eq!(c.lend_slots(&[packed]), vec![packed]);
    assert_eq!(c.page_area().1, 0);
    c.end_read(&mut p);
    assert!(c.lend_slots(&[packed]).is_empty());
    assert!(c.slot_is_lent(packed));
    assert!(!c.slot_is_packed(packed));
    assert_eq!(c.page_area(), (0, 0));
    // The area starts again in another slot.
    read(&mut c, at(3));
    assert_eq!(c.page_area(), (1, 1));
}

/// What the page area keeps in memory per page it can hold: 6 bytes and a little.
#[test]
fn the_page_area_costs_under_8_bytes_per_page() {
    let mut a = sce_core::pagearea::PageArea::new(128);
    for s in 0..1000 {
        a.grow(SlotNo(s));
    }
    let per_page = a.memory_bytes() as f64 / a.capacity() as f64;
    assert!(per_page <= 8.0, "{per_page} B per page");
}

/// The area holds every slot (one page read in each of many lines), then the reads move to
/// a few lines read whole: the area gives its slots back epoch by epoch and population
/// fills those lines. Lines without a slot earn no hits to compare with the area's, so the
/// pages their dense lines miss stand for them; without that the area kept every slot and
/// population found no victim.
#[test]
fn an_area_holding_every_slot_yields_to_dense_lines() {
    let mut c = core(25);
    let mut i = 0;
    while c.free_slots() > 0 {
        read(&mut c, i * LINE + 8 * KIB);
        i += 1;
        assert!(i < 400, "the area never took every slot");
    }
    assert_eq!(c.page_area().0, 8, "every slot is packed");
    let hot: Vec<u64> = (500..504).collect();
    for _ in 0..400 {
        for &l in &hot {
            for p in 0..32 {
                read(&mut c, l * LINE + p * 4 * KIB);
            }
            while let Some(job) = c.pick_population_unthrottled() {
                c.complete_population(job.id, true).unwrap();
            }
        }
    }
    for &l in &hot {
        assert_eq!(c.exists(FragNo(l)).map(|e| e.1), Some(32), "line {l}");
    }
    assert!(c.page_area().0 <= 4, "area slots {}", c.page_area().0);
}

/// Reads 4 KiB at each offset, completing what they fill; then a worker's pick at `t`
/// seconds (completed too).
fn epoch(c: &mut CacheCore, offs: impl Iterator<Item = u64>, t: u64) {
    for off in offs {
        read(c, off);
    }
    if let Some(job) = c.pick_population(Nanos(t * 1_000_000_000 + 1)) {
        c.complete_population(job.id, true).unwrap();
    }
}

/// A worker that populated sleeps the fast period while the read hit ratio moves (a shift
/// being won back), and the throttle's period once it is flat: the slow rung (a low miss
/// rate) would otherwise allow two picks a second while the last lines of a new working
/// set are still missing.
#[test]
fn workers_pick_fast_while_the_hit_ratio_moves() {
    let mut c = core(25);
    let fast = ThrottleConfig::default().period;
    let page = |i: u64| i * LINE + 8 * KIB;
    epoch(&mut c, (0..300).map(|i| page(i % 60)), 0);
    epoch(&mut c, (100..400).map(page), 1);
    // Mostly hits, a few misses: the ratio rose, the miss rate is low (the slow rung).
    let mostly_hits = |k: u64| {
        (0..290)
            .map(|i| page(i % 60))
            .chain((0..10).map(move |i| page(k + i)))
    };
    epoch(&mut c, mostly_hits(400), 2);
    let st = c.throttle(Nanos(2_000_000_002));
    assert!(st.period > fast, "the slow rung: {:?}", st.period);
    assert_eq!(st.after_pick, fast);
    epoch(&mut c, mostly_hits(410), 3);
    let st = c.throttle(Nanos(3_000_000_002));
    assert_eq!(st.after_pick, st.period, "flat: the rung's period");
}
