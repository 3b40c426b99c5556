//! Example-based tests of the core's mechanisms, one behaviour each: coalescing of reads,
//! AWT re-validation and budget fallback, admission policies, eviction and the throttle.

use sce_core::*;

const KIB: u64 = 1024;

fn core(cfg: CoreConfig, source: u64, cache: u64) -> CacheCore {
    CacheCore::new(cfg, source, cache).expect("valid")
}

fn small(admission: Admission, write_mode: WriteMode) -> CoreConfig {
    CoreConfig {
        fragment_size: 16 * KIB,
        admission,
        write_mode,
        hot_window: 8,
        ..CoreConfig::default()
    }
}

/// Populates every pickable fragment, pretending the I/O succeeded.
fn populate_all(c: &mut CacheCore) -> usize {
    let mut n = 0;
    while let Some(job) = c.pick_population_unthrottled() {
        c.complete_population(job.id, true).unwrap();
        n += 1;
    }
    n
}

/// Touches the fragment holding `off` and populates everything pickable.
fn warm(c: &mut CacheCore, off: u64) {
    let mut p = read(c, off, 4096);
    c.end_read(&mut p);
    populate_all(c);
}

fn read(c: &mut CacheCore, off: u64, len: u64) -> ReadPlan {
    let mut p = ReadPlan::new();
    c.begin_read(SourceOffset(off), len, &mut p).unwrap();
    p
}

#[test]
fn reads_coalesce_into_one_io_per_run() {
    let mut c = core(small(Admission::Sce, WriteMode::Awt), 256 * KIB, 64 * KIB);
    let mut p = read(&mut c, 0, 16 * KIB);
    c.end_read(&mut p);
    assert_eq!(populate_all(&mut c), 1);
    // Fragment 0 cached, fragments 1 and 2 not: one cache run, one source run for 16..48 KiB.
    let mut p = read(&mut c, 0, 48 * KIB);
    assert_eq!(p.runs.len(), 2, "{:?}", p.runs);
    assert_eq!(
        p.runs[0],
        ReadRun {
            buf_offset: 0,
            len: 16 * KIB,
            target: RunTarget::Cache(CacheOffset(0))
        }
    );
    assert_eq!(
        p.runs[1],
        ReadRun {
            buf_offset: 16 * KIB,
            len: 32 * KIB,
            target: RunTarget::Source(SourceOffset(16 * KIB))
        }
    );
    assert!(!p.full_hit);
    c.end_read(&mut p);
    // An unaligned sub-page read of a hit is one cache run at the right offset.
    let mut p = read(&mut c, 4096 + 512, 1024);
    assert_eq!(
        p.runs,
        vec![ReadRun {
            buf_offset: 0,
            len: 1024,
            target: RunTarget::Cache(CacheOffset(4096 + 512))
        }]
    );
    assert!(p.full_hit);
    c.end_read(&mut p);
    assert_eq!(c.stats().read_requests_full_hit, 1);
}

#[test]
fn awt_revalidates_only_after_both_halves() {
    let mut c = core(small(Admission::Sce, WriteMode::Awt), 256 * KIB, 64 * KIB);
    warm(&mut c, 0);
    let w = c
        .begin_write(SourceOffset(4096), 8192, WriteKind::Data)
        .unwrap();
    assert_eq!(w.cache_writes.len(), 1);
    assert!(!w.synchronous);
    assert!(
        !c.is_cached(SourceOffset(4096)),
        "invalidated before the source write is sent"
    );
    c.write_source_done(w.id, true).unwrap();
    assert!(
        !c.is_cached(SourceOffset(4096)),
        "not valid before the cache copy completes"
    );
    c.write_cache_done(w.id, 0, true).unwrap();
    assert!(c.is_cached(SourceOffset(4096)) && c.is_cached(SourceOffset(8192)));
    assert_eq!(c.stats().awt_completed, 1);
    // A failed source write leaves the pages invalid even if the copy succeeded.
    let w = c
        .begin_write(SourceOffset(4096), 4096, WriteKind::Data)
        .unwrap();
    c.write_cache_done(w.id, 0, true).unwrap();
    c.write_source_done(w.id, false).unwrap();
    assert!(!c.is_cached(SourceOffset(4096)));
    assert!(
        c.write_source_done(w.id, true).is_err(),
        "completed ids are rejected"
    );
}

#[test]
fn awt_budget_exhaustion_falls_back_to_write_around() {
    let mut cfg = small(Admission::Sce, WriteMode::Awt);
    cfg.awt_budget = 8 * KIB;
    let mut c = core(cfg, 256 * KIB, 64 * KIB);
    warm(&mut c, 0);
    let w1 = c
        .begin_write(SourceOffset(0), 8 * KIB, WriteKind::Data)
        .unwrap();
    assert_eq!(w1.cache_writes.len(), 1);
    assert_eq!(c.awt_bytes_in_flight(), 8 * KIB);
    let w2 = c
        .begin_write(SourceOffset(8 * KIB), 4 * KIB, WriteKind::Data)
        .unwrap();
    assert!(w2.cache_writes.is_empty(), "over budget: write-around");
    assert_eq!(c.stats().awt_fallbacks, 1);
    for w in [&w1, &w2] {
        c.write_source_done(w.id, true).unwrap();
    }
    c.write_cache_done(w1.id, 0, true).unwrap();
    assert_eq!(c.awt_bytes_in_flight(), 0);
}

#[test]
fn duplicate_writes_skip_the_copy_and_spoil_each_other() {
    let mut c = core(small(Admission::Sce, WriteMode::Awt), 256 * KIB, 64 * KIB);
    warm(&mut c, 0);
    let w1 = c
        .begin_write(SourceOffset(0), 4096, WriteKind::Data)
        .unwrap();
    let w2 = c
        .begin_write(SourceOffset(0), 8192, WriteKind::Data)
        .unwrap();
    assert_eq!(w1.cache_writes.len(), 1);
    assert!(w2.cache_writes.is_empty());
    assert_eq!(c.stats().awt_duplicates, 1);
    c.write_source_done(w2.id, true).unwrap();
    c.write_source_done(w1.id, true).unwrap();
    c.write_cache_done(w1.id, 0, true).unwrap();
    assert!(
        !c.is_cached(SourceOffset(0)),
        "page 0 had two writes in flight: dropped, not trusted"
    );
}

#[test]
fn write_through_is_synchronous_and_write_around_copies_nothing() {
    let mut c = core(
        small(Admission::Sce, WriteMode::WriteThrough),
        256 * KIB,
        64 * KIB,
    );
    warm(&mut c, 0);
    let w = c
        .begin_write(SourceOffset(0), 4096, WriteKind::Data)
        .unwrap();
    assert!(w.synchronous && w.cache_writes.len() == 1);
    let mut c = core(
        small(Admission::Sce, WriteMode::WriteAround),
        256 * KIB,
        64 * KIB,
    );
    warm(&mut c, 0);
    let w = c
        .begin_write(SourceOffset(0), 4096, WriteKind::Data)
        .unwrap();
    assert!(w.cache_writes.is_empty());
    assert!(!c.is_cached(SourceOffset(0)));
    assert!(c.is_cached(SourceOffset(4096)));
}

#[test]
fn always_fills_inline_and_allocates_on_write() {
    let mut c = core(CoreConfig::flashcache_like(), 256 * KIB, 64 * KIB);
    let mut p = read(&mut c, 0, 8192);
    // Two 4 KiB fragments missed: two fills, nothing for the background workers.
    assert_eq!(p.fills.len(), 2);
    assert_eq!(p.pops.len(), 2);
    for pop in p.pops.clone() {
        c.complete_population(pop, true).unwrap();
    }
    c.end_read(&mut p);
    assert!(c.is_cached(SourceOffset(0)) && c.is_cached(SourceOffset(4096)));
    assert!(c.pick_population_unthrottled().is_none());
    let w = c
        .begin_write(SourceOffset(100 * KIB), 4096, WriteKind::Data)
        .unwrap();
    assert_eq!(w.cache_writes.len(), 1, "write miss allocates a slot");
    assert!(w.synchronous);
    c.write_cache_done(w.id, 0, true).unwrap();
    c.write_source_done(w.id, true).unwrap();
    assert!(c.is_cached(SourceOffset(100 * KIB)));
}

#[test]
fn nhit_admits_on_the_kth_access() {
    let mut c = core(
        small(Admission::NHit(3), WriteMode::Awt),
        256 * KIB,
        64 * KIB,
    );
    for i in 0..2 {
        let mut p = read(&mut c, 0, 4096);
        c.end_read(&mut p);
        assert!(
            c.pick_population_unthrottled().is_none(),
            "access {} must not admit",
            i + 1
        );
    }
    let mut p = read(&mut c, 0, 4096);
    c.end_read(&mut p);
    let job = c
        .pick_population_unthrottled()
        .expect("third access admits");
    assert_eq!(job.frag, FragNo(0));
    assert_eq!(job.len, 16 * KIB);
}

#[test]
fn sce_picks_the_hottest_and_evicts_with_clock() {
    // 2 slots, fragments 0..3 accessed with different heat.
    let mut c = core(small(Admission::Sce, WriteMode::Awt), 256 * KIB, 32 * KIB);
    for (f, n) in [(0u64, 1), (1, 5), (2, 3)] {
        for _ in 0..n {
            let mut p = read(&mut c, f * 16 * KIB, 4096);
            c.end_read(&mut p);
        }
    }
    let j = c.pick_population_unthrottled().unwrap();
    assert_eq!(j.frag, FragNo(1));
    c.complete_population(j.id, true).unwrap();
    let j = c.pick_population_unthrottled().unwrap();
    assert_eq!(j.frag, FragNo(2));
    c.complete_population(j.id, true).unwrap();
    assert_eq!(c.free_slots(), 0);
    // Fragment 0 is next; the cache is full, so CLOCK evicts one of the two.
    let j = c.pick_population_unthrottled().unwrap();
    assert_eq!(j.frag, FragNo(0));
    assert_eq!(c.stats().fragments_evicted, 1);
    c.complete_population(j.id, true).unwrap();
    assert!(c.exists(FragNo(0)).is_some());
}

#[test]
fn pinned_slots_are_not_evicted() {
    let mut c = core(small(Admission::Sce, WriteMode::Awt), 256 * KIB, 32 * KIB);
    for f in 0..2u64 {
        let mut p = read(&mut c, f * 16 * KIB, 4096);
        c.end_read(&mut p);
    }
    populate_all(&mut c);
    let mut p0 = read(&mut c, 0, 4096);
    let mut p1 = read(&mut c, 16 * KIB, 4096);
    assert!(p0.full_hit && p1.full_hit);
    assert!(!c.evict_fragment(FragNo(0)));
    assert_eq!(c.evict_one(), None, "both slots pinned by reads in flight");
    c.end_read(&mut p0);
    assert_eq!(c.evict_one(), Some(FragNo(0)));
    c.end_read(&mut p1);
}

#[test]
fn throttle_gates_population() {
    let mut cfg = small(Admission::Sce, WriteMode::Awt);
    cfg.throttle.target_missrate = 0.5;
    let mut c = core(cfg, 256 * KIB, 64 * KIB);
    assert!(
        c.pick_population(Nanos(0)).is_none(),
        "no reads yet: miss rate 0"
    );
    let mut p = read(&mut c, 0, 4096);
    c.end_read(&mut p);
    let st = c.throttle(Nanos(1));
    assert_eq!((st.active_workers, st.may_populate), (8, true));
    let j = c.pick_population(Nanos(1)).expect("miss rate 100%");
    c.complete_population(j.id, true).unwrap();
    for _ in 0..10 {
        let mut p = read(&mut c, 0, 4096);
        c.end_read(&mut p);
    }
    // 1 miss, 10 hits: 9% < 15%: one slow worker, and below target: no promotion.
    let st = c.throttle(Nanos(2));
    assert_eq!(st.active_workers, 1);
    assert!(!st.may_populate);
}

#[test]
fn bad_requests_are_refused_without_state_change() {
    let mut c = core(small(Admission::Sce, WriteMode::Awt), 256 * KIB, 64 * KIB);
    let mut p = ReadPlan::new();
    assert!(matches!(
        c.begin_read(SourceOffset(256 * KIB), 512, &mut p),
        Err(RequestError::OutOfRange { .. })
    ));
    assert!(matches!(
        c.begin_read(SourceOffset(u64::MAX), 512, &mut p),
        Err(RequestError::OutOfRange { .. })
    ));
    assert!(matches!(
        c.begin_write(SourceOffset(100), 512, WriteKind::Data),
        Err(RequestError::Unaligned { .. })
    ));
    assert!(matches!(
        c.begin_write(SourceOffset(0), 100, WriteKind::Data),
        Err(RequestError::Unaligned { .. })
    ));
    assert_eq!(c.stats().read_requests, 0);
    assert_eq!(c.operations_in_flight(), (0, 0));
}

#[test]
fn config_errors_name_the_field() {
    let e = CacheCore::new(
        CoreConfig {
            fragment_size: 5000,
            ..CoreConfig::default()
        },
        1 << 30,
        1 << 30,
    )
    .unwrap_err();
    assert_eq!(e.field, "fragment_size");
    let e = CacheCore::new(CoreConfig::default(), 1 << 30, (2 << 20) - 1).unwrap_err();
    assert_eq!(e.field, "cache_size");
    let e = CacheCore::new(CoreConfig::default(), 1000, 1 << 30).unwrap_err();
    assert_eq!(e.field, "source_size");
    assert!("nhit:0".parse::<Admission>().is_err());
    assert_eq!("nhit:2".parse::<Admission>(), Ok(Admission::NHit(2)));
    assert!("lfu".parse::<EvictionKind>().is_err());
}

/// Regression: a hot cached fragment whose only invalid pages are under an AWT copy in
/// flight must not win the pick (its fill would be empty) and starve colder fragments.
#[test]
fn awt_in_flight_on_a_hot_fragment_does_not_starve_population() {
    let mut c = core(small(Admission::Sce, WriteMode::Awt), 256 * KIB, 64 * KIB);
    warm(&mut c, 0);
    for _ in 0..20 {
        let mut p = read(&mut c, 0, 4096);
        c.end_read(&mut p);
    }
    let w = c
        .begin_write(SourceOffset(0), 4096, WriteKind::Data)
        .unwrap();
    let mut p = read(&mut c, 32 * KIB, 4096);
    c.end_read(&mut p);
    let job = c
        .pick_population_unthrottled()
        .expect("fragment 2 is worth populating");
    assert_eq!(job.frag, FragNo(2));
    c.complete_population(job.id, true).unwrap();
    c.write_source_done(w.id, true).unwrap();
    c.write_cache_done(w.id, 0, true).unwrap();
    assert!(c.is_cached(SourceOffset(0)) && c.is_cached(SourceOffset(32 * KIB)));
}
