//! Tests of the reference policies.

use super::*;

#[test]
fn lru_and_fifo_differ_as_expected() {
    let mut lru = BlockCache::new(ReferencePolicy::Lru, 2);
    let mut fifo = BlockCache::new(ReferencePolicy::Fifo, 2);
    for c in [&mut lru, &mut fifo] {
        for b in [1, 2, 1, 3, 1] {
            c.access(b);
        }
    }
    // LRU keeps 1 (recently used), so the last access hits; FIFO evicted 1 for 3.
    assert_eq!((lru.accesses, lru.misses), (5, 3));
    assert_eq!((fifo.accesses, fifo.misses), (5, 4));
    assert_eq!(
        (lru.inserts, fifo.inserts),
        (3, 4),
        "one insertion per miss"
    );
    let mut c = BlockCache::new(ReferencePolicy::Lru, 10);
    c.request(4095, 2);
    assert_eq!(
        c.accesses, 2,
        "a request straddling a block boundary covers two blocks"
    );
    c.request(8192, 0);
    assert_eq!(c.accesses, 2);
}

#[test]
fn lfu_keeps_the_frequent_and_remove_frees_a_slot() {
    let mut c = BlockCache::new(ReferencePolicy::Lfu, 2);
    for b in [1, 1, 1, 2, 3, 1, 3, 4, 3] {
        c.access(b);
    }
    // 1 (count 4) stays throughout; 2 is evicted by 3, 3 (count 2) by 4, then 3 misses.
    assert_eq!((c.accesses, c.misses, c.inserts), (9, 5, 5));
    assert!(c.contains(1) && c.contains(3) && !c.contains(4));
    let mut l = BlockCache::new(ReferencePolicy::Lru, 2);
    l.access(1);
    l.access(2);
    assert!(l.remove(1).is_some());
    assert!(l.remove(1).is_none());
    let a = l.access_detailed(3);
    assert_eq!(
        (a.hit, a.evicted),
        (false, None),
        "the freed slot is reused"
    );
    let a = l.access_detailed(4);
    assert_eq!(a.evicted, Some(2));
    assert_eq!(l.len(), 2);
}

fn in_main(c: &BlockCache, b: u64) -> bool {
    let i = c.index[&b];
    c.s3[i as usize] & IN_MAIN != 0
}

/// A scan of blocks seen once passes through the small FIFO and leaves the blocks used
/// often alone, where LRU loses them all; a block whose id is in the ghost comes back
/// into the main FIFO, any other missed block into the small one.
#[test]
fn s3fifo_resists_a_scan_and_ghost_hits_go_to_main() {
    let mut s3 = BlockCache::new(ReferencePolicy::S3Fifo, 100);
    let mut lru = BlockCache::new(ReferencePolicy::Lru, 100);
    assert_eq!((s3.small_capacity, s3.ghost_capacity), (10, 90));
    for c in [&mut s3, &mut lru] {
        for _ in 0..3 {
            for b in 0..50 {
                c.access(b);
            }
        }
        for b in 1000..3000 {
            c.access(b);
        }
    }
    // The first ten filled the small FIFO; the next forty went straight to main while
    // nothing had been evicted; the small ten, hit twice, moved to main on eviction.
    assert!((0..50).all(|b| s3.contains(b) && in_main(&s3, b)));
    let (s3_misses, lru_misses) = (s3.misses, lru.misses);
    for c in [&mut s3, &mut lru] {
        for b in 0..50 {
            c.access(b);
        }
    }
    assert_eq!(s3.misses, s3_misses, "S3-FIFO kept every frequent block");
    assert_eq!(lru.misses, lru_misses + 50, "LRU kept none");
    assert_eq!(s3.inserts, s3.misses);
    // The ghost holds the ids of the 90 scan blocks evicted last (the small FIFO holds
    // the 10 after them).
    assert_eq!(s3.ghost.len(), 90);
    assert!(s3.ghost.contains(2900) && !s3.ghost.contains(2899));
    assert!((2990..3000).all(|b| s3.contains(b) && !in_main(&s3, b)));
    let a = s3.access_detailed(2950);
    assert!(!a.hit && a.slot != NO_SLOT);
    assert!(in_main(&s3, 2950), "a ghost hit goes to main");
    assert!(!s3.ghost.contains(2950), "and leaves the ghost");
    s3.access(1000);
    assert!(
        s3.contains(1000) && !in_main(&s3, 1000),
        "not in the ghost: small"
    );
    assert!(s3.main.len + s3.small.len == s3.len() && s3.len() == 100);
}

/// In the main FIFO, a block hit since its insertion goes round again instead of
/// leaving, with one hit less each time round.
#[test]
fn s3fifo_main_is_fifo_with_reinsertion() {
    // 20 blocks: small 2, main 18. Before the first eviction, 0 and 1 fill small and
    // 2..=19 go to main.
    let mut c = BlockCache::new(ReferencePolicy::S3Fifo, 20);
    for b in 0..20 {
        c.access(b);
    }
    assert!((2..20).all(|b| in_main(&c, b)) && !in_main(&c, 0));
    // The oldest of main, hit once.
    c.access(2);
    // Each new block evicts from the small FIFO (main is within its share): 0, 1, 20...
    for b in 20..23 {
        c.access(b);
    }
    assert!(!c.contains(0) && !c.contains(1) && !c.contains(20));
    assert!(c.ghost.contains(0) && c.ghost.contains(1) && c.ghost.contains(20));
    // A ghost hit makes main hold 19 > 18: the next eviction is main's, where 2 goes
    // round (its hit spent) and 3 leaves.
    c.access(0);
    assert!(in_main(&c, 0) && c.main.len == 19);
    c.access(100);
    assert!(c.contains(2) && !c.contains(3));
    assert_eq!(c.s3[c.index[&2] as usize] & FREQ, 0);
    assert_eq!(c.main.len, 18);
}

/// LARC writes a block into the cache on its second miss only, and counts only those.
#[test]
fn larc_admits_on_the_second_miss() {
    let mut c = BlockCache::new(ReferencePolicy::Larc, 10);
    let a = c.access_detailed(7);
    assert_eq!((a.hit, a.slot, a.evicted), (false, NO_SLOT, None));
    assert!(!c.contains(7) && c.ghost.contains(7) && c.inserts == 0);
    let a = c.access_detailed(7);
    assert!(!a.hit && a.slot != NO_SLOT);
    assert!(c.contains(7) && !c.ghost.contains(7) && c.inserts == 1);
    assert!(c.access(7));
    assert_eq!((c.accesses, c.misses, c.inserts), (3, 2, 1));
    // A scan is never written: every block is a first miss.
    for b in 100..1100 {
        assert!(!c.access(b));
    }
    assert_eq!((c.inserts, c.len()), (1, 1));
    // The misses grew the ghost to its bound, 0.9 C = 9 ids.
    assert!((c.ghost_target - 9.0).abs() < 1e-9);
    assert_eq!(c.ghost.len(), 9);
    assert!(c.ghost.contains(1099) && !c.ghost.contains(1090));
    // A hit shrinks it, by C/(C - C_r) = 10 here, but not below 0.1 C; the ids stay (the
    // paper drops one per insertion into a ghost longer than C_r).
    c.access(7);
    assert!((c.ghost_target - 1.0).abs() < 1e-9);
    assert_eq!(c.ghost.len(), 9);
    c.access(5000);
    assert_eq!(c.ghost.len(), 9, "one in, one out");
    // Starting from 0.1 C = 10 in a cache of 100: two misses, then a hit.
    let mut d = BlockCache::new(ReferencePolicy::Larc, 100);
    d.access(1);
    assert!((d.ghost_target - 20.0).abs() < 1e-9, "10 + 100/10");
    d.access(1);
    assert!((d.ghost_target - 25.0).abs() < 1e-9, "20 + 100/20");
    d.access(1);
    assert!(
        (d.ghost_target - (25.0 - 100.0 / 75.0)).abs() < 1e-9,
        "a hit"
    );
    // LRU inside: with the cache full, an admission evicts the least recently used.
    let mut c = BlockCache::new(ReferencePolicy::Larc, 2);
    for b in [1, 1, 2, 2, 1, 3, 3] {
        c.access(b);
    }
    assert!(c.contains(1) && c.contains(3) && !c.contains(2));
    assert_eq!(c.inserts, 3);
}

/// Random accesses and removals over every policy keep the structures consistent:
/// slots unique and within the capacity, lists as long as the index, ghosts bounded,
/// insertions as documented.
#[test]
fn every_policy_stays_consistent() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for policy in ReferencePolicy::ALL {
        for cap in [1usize, 2, 5, 20, 64] {
            let mut c = BlockCache::new(policy, cap);
            let mut misses_not_written = 0;
            for step in 0..5000 {
                let b = rng.gen_range(0..(cap as u64 * 3));
                if step % 17 == 0 {
                    c.remove(b);
                    continue;
                }
                let a = c.access_detailed(b);
                if a.hit || a.slot != NO_SLOT {
                    assert!((a.slot as usize) < cap && c.index[&b] == a.slot);
                } else {
                    assert_eq!(policy, ReferencePolicy::Larc);
                    misses_not_written += 1;
                }
                if let Some(old) = a.evicted {
                    assert!(!c.contains(old) && old != b);
                }
            }
            assert!(c.len() <= cap);
            let mut slots: Vec<u32> = c.cached().map(|x| x.1).collect();
            slots.sort_unstable();
            slots.dedup();
            assert_eq!(slots.len(), c.len(), "{policy:?} {cap}");
            let listed = match policy {
                ReferencePolicy::Lfu => c.lfu.len(),
                _ => c.main.len + c.small.len,
            };
            assert_eq!(listed, c.len(), "{policy:?} {cap}");
            assert!(c.ghost.len() <= c.ghost_capacity, "{policy:?} {cap}");
            assert_eq!(c.inserts + misses_not_written, c.misses, "{policy:?} {cap}");
            if policy == ReferencePolicy::S3Fifo {
                assert!(c.cached().all(|(b, _)| !c.ghost.contains(b)));
            }
        }
    }
}
