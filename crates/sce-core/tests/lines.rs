//! Lines inside heat regions, and fills from a read miss's own data (issue 30): a hot region
//! costs the cache only the lines of it that were touched, and a read miss can fill the
//! cache without the source being read again.

use sce_core::*;

const KIB: u64 = 1024;

/// 64 KiB lines in 1 MiB heat regions, admission `sce`.
fn lines(miss_fills: bool) -> CoreConfig {
    CoreConfig {
        fragment_size: 64 * KIB,
        heat_size: 1024 * KIB,
        miss_fills,
        hot_window: 8,
        sequential_cutoff: 0,
        // Lines only (the page area's own tests are in sparse.rs).
        dense_line_percent: 0,
        ..CoreConfig::default()
    }
}

fn read(c: &mut CacheCore, off: u64, len: u64) -> ReadPlan {
    let mut p = ReadPlan::new();
    c.begin_read(SourceOffset(off), len, &mut p).unwrap();
    p
}

/// Reads 4 KiB at `off` and completes it, fills included, as a driver would.
fn touch(c: &mut CacheCore, off: u64) -> (usize, u64) {
    let mut p = read(c, off, 4096);
    let filled = p.fills.iter().map(|f| f.len).sum();
    for pop in std::mem::take(&mut p.pops) {
        c.complete_population(pop, true).unwrap();
    }
    let fills = p.fills.len();
    c.end_read(&mut p);
    (fills, filled)
}

#[test]
fn a_hot_region_costs_only_the_lines_it_touched() {
    let mut c = CacheCore::new(lines(false), 64 << 20, 1024 * KIB).unwrap();
    assert_eq!(c.free_slots(), 16);
    // Two 4 KiB reads in region 0, in its lines 0 and 8; one read in region 3.
    touch(&mut c, 4 * KIB);
    touch(&mut c, 512 * KIB + 8 * KIB);
    touch(&mut c, (3 << 20) + 4 * KIB);
    let mut jobs = Vec::new();
    while let Some(j) = c.pick_population_unthrottled() {
        jobs.push((j.frag, j.len));
        c.complete_population(j.id, true).unwrap();
    }
    jobs.sort();
    // Whole lines, only the touched ones: 192 KiB of cache, not three 1 MiB slots.
    assert_eq!(
        jobs,
        vec![
            (FragNo(0), 64 * KIB),
            (FragNo(8), 64 * KIB),
            (FragNo(48), 64 * KIB)
        ]
    );
    assert_eq!(c.free_slots(), 13);
    // The populated lines hit; a line of a hot region that was not touched does not.
    let mut p = read(&mut c, 512 * KIB, 64 * KIB);
    assert!(p.full_hit);
    c.end_read(&mut p);
    let mut p = read(&mut c, 64 * KIB, 4 * KIB);
    assert!(!p.full_hit);
    c.end_read(&mut p);
}

#[test]
fn heat_is_counted_per_region_not_per_line() {
    let cfg = CoreConfig {
        admission_margin: 1,
        ..lines(false)
    };
    // A cache of two lines, filled by region 0's lines 0 and 1.
    let mut c = CacheCore::new(cfg, 64 << 20, 128 * KIB).unwrap();
    touch(&mut c, 0);
    touch(&mut c, 64 * KIB);
    while let Some(j) = c.pick_population_unthrottled() {
        c.complete_population(j.id, true).unwrap();
    }
    assert_eq!(c.free_slots(), 0);
    // Region 5 touched twice in one line: not hotter than region 0 (two touches), so it
    // does not evict; a third touch makes it hotter by the margin.
    touch(&mut c, (5 << 20) + 4 * KIB);
    touch(&mut c, (5 << 20) + 8 * KIB);
    assert!(c.pick_population_unthrottled().is_none());
    assert!(c.stats().admissions_rejected >= 1);
    touch(&mut c, (5 << 20) + 4 * KIB);
    touch(&mut c, (5 << 20) + 8 * KIB);
    touch(&mut c, (5 << 20) + 12 * KIB);
    let j = c
        .pick_population_unthrottled()
        .expect("hotter region admitted");
    assert_eq!(j.frag, FragNo(80));
    c.complete_population(j.id, true).unwrap();
}

#[test]
fn a_read_miss_fills_the_cache_from_its_own_data() {
    for on in [false, true] {
        let mut c = CacheCore::new(lines(on), 64 << 20, 1024 * KIB).unwrap();
        let (fills, bytes) = touch(&mut c, 4 * KIB);
        if !on {
            assert_eq!((fills, bytes), (0, 0), "off: population's job");
            continue;
        }
        // Free space: the miss's 4 KiB go to the cache with the read, nothing else.
        assert_eq!((fills, bytes), (1, 4 * KIB));
        assert_eq!(c.stats().miss_fills, 1);
        let mut p = read(&mut c, 4 * KIB, 4 * KIB);
        assert!(p.full_hit, "the filled page hits");
        c.end_read(&mut p);
        // The rest of the line is still owed to population (a prefetch of a touched line).
        let j = c.pick_population_unthrottled().expect("rest of the line");
        assert_eq!(j.frag, FragNo(0));
        assert!(j.runs.iter().all(|r| r.1 < 64 * KIB));
        c.complete_population(j.id, true).unwrap();
    }
}

#[test]
fn a_miss_fill_in_a_full_cache_must_win_the_duel() {
    // Two lines, both cached and hot.
    let mut c = CacheCore::new(lines(true), 64 << 20, 128 * KIB).unwrap();
    for _ in 0..3 {
        touch(&mut c, 0);
        touch(&mut c, 64 * KIB);
    }
    assert_eq!(c.free_slots(), 0);
    // A region seen once: no fill (not a candidate yet); seen twice, still colder than the
    // victim's region: no fill either.
    assert_eq!(touch(&mut c, 7 << 20).0, 0);
    assert_eq!(touch(&mut c, 7 << 20).0, 0);
    let rejected = c.stats().admissions_rejected;
    assert!(rejected >= 1);
    // Hotter than the victim by the margin: it fills, evicting a line.
    let mut filled = 0;
    for _ in 0..12 {
        filled += touch(&mut c, 7 << 20).0;
    }
    assert!(filled >= 1, "a hot region's miss fills");
    assert_eq!(c.free_slots(), 0);
    let mut p = read(&mut c, 7 << 20, 4096);
    assert!(p.full_hit);
    c.end_read(&mut p);
}

#[test]
fn a_miss_fill_refused_by_the_endurance_budget_evicts_nothing() {
    let cfg = CoreConfig {
        max_cache_writes: Some(16 * KIB),
        ..lines(true)
    };
    let mut c = CacheCore::new(cfg, 64 << 20, 128 * KIB).unwrap();
    // Two lines cached by misses in free space: the budget's 16 KiB are spent.
    touch(&mut c, 0);
    touch(&mut c, 64 * KIB);
    for _ in 0..4 {
        touch(&mut c, 4 * KIB);
        touch(&mut c, 8 * KIB);
    }
    assert_eq!(c.free_slots(), 0);
    let cached = |c: &mut CacheCore| {
        let mut p = read(c, 0, 4096);
        let hit = p.full_hit;
        c.end_read(&mut p);
        hit
    };
    assert!(cached(&mut c));
    // A region hot enough to win every duel: its misses would evict, but nothing may be
    // written, so nothing is evicted.
    for _ in 0..20 {
        assert_eq!(touch(&mut c, (9 << 20) + 4 * KIB).0, 0);
    }
    assert!(c.stats().endurance_refusals > 0);
    assert_eq!(c.free_slots(), 0);
    assert!(cached(&mut c), "the cached line stayed");
}

#[test]
fn a_stream_fills_free_space_from_its_own_data_and_population_never_rereads_it() {
    // A cold copy of a volume (1 MiB reads in order) over a source that is not busy: its
    // reads past the cutoff fill the cache's free space from the data they read, and raise
    // no heat, so population never reads that data from the source a second time (on the
    // bandwidth the copy itself uses: issue 46). Once the cache is full, the stream is
    // bypassed.
    let cfg = CoreConfig {
        sequential_cutoff: 4 << 20,
        miss_fills_when_busy: true,
        ..lines(true)
    };
    // Room for 8 MiB: the 16 MiB stream fills it, then passes by.
    let mut c = CacheCore::new(cfg, 64 << 20, 8 << 20).unwrap();
    let (mut filled, mut picked) = (Vec::new(), Vec::new());
    for i in 0..16u64 {
        let mut p = read(&mut c, i << 20, 1 << 20);
        filled.push(p.fills.iter().map(|f| f.len).sum::<u64>());
        for pop in std::mem::take(&mut p.pops) {
            c.complete_population(pop, true).unwrap();
        }
        c.end_read(&mut p);
        while let Some(j) = c.pick_population_unthrottled() {
            picked.push((j.frag.0 * (64 << 10)) >> 20);
            c.complete_population(j.id, true).unwrap();
        }
    }
    // The first reads are not known to be a stream yet: the source is not busy, so they
    // leave their filling to population, which takes (some of) the regions they touched.
    assert!(
        picked.iter().all(|&r| r < 4),
        "population re-read a stream: {picked:?}"
    );
    assert!(filled[4..].contains(&(1 << 20)), "{filled:?}");
    assert_eq!(c.free_slots(), 0, "the stream filled the free space");
    assert_eq!(filled[15], 0, "full: bypassed: {filled:?}");
    assert!(c.stats().sequential_requests >= 12);
    // A stream of reads smaller than a line keeps its heat while the cache has room:
    // population fills whole lines ahead of it (what its own data cannot).
    let mut c = CacheCore::new(cfg_small(), 64 << 20, 8 << 20).unwrap();
    let mut picked = 0;
    for i in 0..512u64 {
        touch(&mut c, i * 16 * KIB);
        while let Some(j) = c.pick_population_unthrottled() {
            picked += 1;
            c.complete_population(j.id, true).unwrap();
        }
    }
    assert!(
        picked >= 8,
        "population took a line of each of the 8 regions: {picked}"
    );
}

/// `lines(true)` with a 4 MiB sequential cutoff and miss fills kept for a busy source.
fn cfg_small() -> CoreConfig {
    CoreConfig {
        sequential_cutoff: 4 << 20,
        miss_fills_when_busy: true,
        ..lines(true)
    }
}

/// Miss fills `auto`: while the cache has free slots (its first pass: empty, or cold after a
/// restart) a read miss fills the pages it read, as a populate-on-miss cache does, instead
/// of leaving the source to be read twice by population; once the cache is full, an idle
/// source leaves misses to population, and a busy one has them fill again.
#[test]
fn auto_miss_fills_fill_free_space_then_only_while_the_source_is_busy() {
    let cfg = CoreConfig {
        miss_fills_when_busy: true,
        ..lines(true)
    };
    // 16 lines of 64 KiB.
    let mut c = CacheCore::new(cfg, 64 << 20, 1024 * KIB).unwrap();
    assert_eq!(
        touch(&mut c, 4 * KIB),
        (1, 4 * KIB),
        "free space: the miss fills"
    );
    for l in 1..16u64 {
        touch(&mut c, l * 64 * KIB);
    }
    assert_eq!(c.free_slots(), 0);
    // Full, and the source idle: a miss in a line of the same (hot) region is population's.
    let line = 20 * 64 * KIB;
    assert_eq!(touch(&mut c, line).0, 0, "full and idle: no fill");
    for _ in 0..40 {
        touch(&mut c, line + 8 * KIB);
    }
    assert!(
        !c.is_cached(SourceOffset(line + 8 * KIB)),
        "idle: still no fill"
    );
    // Busy: the next miss of the region, now hotter than the victim's, fills.
    c.set_source_busy(true);
    assert_eq!(touch(&mut c, line + 12 * KIB), (1, 4 * KIB));
    assert!(c.is_cached(SourceOffset(line + 12 * KIB)));
}
