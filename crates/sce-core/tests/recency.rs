//! The recency window in front of admission `sce`'s frequency duel (`recency_window`,
//! W-TinyLFU; issue 30): a new line enters without a duel; the window's oldest line stays
//! once it leaves the window only by out-heating the eviction victim.

use sce_core::*;

const KIB: u64 = 1024;
/// 16 KiB fragments, 64 KiB apart so that no two accesses look sequential.
const FRAG: u64 = 16 * KIB;

fn far(f: u64) -> u64 {
    f * 64 * KIB
}

fn frag(f: u64) -> FragNo {
    FragNo(far(f) / FRAG)
}

/// A core of 4 slots; `window` thousandths of them are the recency window (at least one
/// line when on).
fn four_slots(window: u32) -> CacheCore {
    let cfg = CoreConfig {
        fragment_size: FRAG,
        hot_window: 8,
        miss_fills: false,
        recency_window: window,
        ..CoreConfig::default()
    };
    CacheCore::new(cfg, 2048 * KIB, 4 * FRAG).expect("valid")
}

/// `n` separate 4 KiB reads of fragment `f`, then every population pickable.
fn reads(c: &mut CacheCore, f: u64, n: u32) {
    for _ in 0..n {
        let mut p = ReadPlan::new();
        c.begin_read(SourceOffset(far(f)), 4096, &mut p).unwrap();
        c.end_read(&mut p);
    }
    while let Some(job) = c.pick_population_unthrottled() {
        c.complete_population(job.id, true).unwrap();
    }
}

/// Fills the 4 slots with fragments 0..4, each read 4 times (sketch heat 4).
fn full_of_hot() -> [CacheCore; 2] {
    [four_slots(0), four_slots(1)].map(|mut c| {
        for f in 0..4 {
            reads(&mut c, f, 4);
        }
        assert_eq!(c.free_slots(), 0);
        assert!((0..4).all(|f| c.exists(frag(f)).is_some()));
        c
    })
}

#[test]
fn a_new_line_enters_the_window_and_stays_only_by_out_heating_the_victim() {
    let [mut duel, mut window] = full_of_hot();
    // Read twice (heat 2), fragment 5 loses the duel against any victim (heat 4).
    reads(&mut duel, 5, 2);
    assert!(duel.exists(frag(5)).is_none());
    assert_eq!(duel.stats().fragments_evicted, 0);
    assert_eq!(duel.stats().admissions_rejected, 1);
    // With a window, it enters without a duel: the victim goes.
    reads(&mut window, 5, 2);
    assert!(window.exists(frag(5)).is_some(), "recent, admitted");
    assert_eq!(window.stats().fragments_evicted, 1);
    let main: Vec<u64> = (0..4)
        .filter(|&f| window.exists(frag(f)).is_some())
        .collect();
    assert_eq!(main.len(), 3);
    // Fragment 6 takes the window's place; 5, no hotter than the victim, is the one to go.
    reads(&mut window, 6, 2);
    assert!(window.exists(frag(6)).is_some());
    assert!(
        window.exists(frag(5)).is_none(),
        "cold once out of the window"
    );
    assert!(main.iter().all(|&f| window.exists(frag(f)).is_some()));
    assert_eq!(window.stats().admissions_rejected, 1);
    // Read on (heat 8), fragment 6 out-heats the victim when 7 takes the window's place: it
    // stays, in the main cache, and the victim goes.
    reads(&mut window, 6, 6);
    reads(&mut window, 7, 2);
    assert!(window.exists(frag(7)).is_some());
    assert!(
        window.exists(frag(6)).is_some(),
        "hot, kept past the window"
    );
    let left = main.iter().filter(|&&f| window.exists(frag(f)).is_some());
    assert_eq!(left.count(), 2, "the victim went");
    assert_eq!(window.stats().fragments_evicted, 3);
}

#[test]
fn the_window_is_a_share_of_the_cache_and_validated() {
    let bad = CoreConfig {
        recency_window: 501,
        ..CoreConfig::default()
    };
    let e = CacheCore::new(bad, 1 << 30, 64 << 20).unwrap_err();
    assert!(e.to_string().contains("recency_window"), "{e}");
}
