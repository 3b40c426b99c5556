//! Tests of the ownership machine: each transition, then many hosts stepped at random
//! against a model of etcd's owner keys (`regions_model.rs`).

use super::*;

const IDLE: u64 = 100;
const L: i64 = 7;

/// Regions of 1 MiB, released after 100 ns.
fn host() -> Regions {
    Regions::new(1 << 20, true, IDLE)
}

/// Takes region `r` for a write under lease `L`, acquiring it at revision `rev` if free.
fn own(g: &mut Regions, r: u64, rev: i64, now: u64) -> u64 {
    match g.take(r, L, Some(L), false, now) {
        Take::Owned(t) => t,
        Take::Acquire(t) => {
            assert!(g.acquired(r, t, Some(rev), now));
            t
        }
        other => panic!("region {r}: {other:?}"),
    }
}

#[test]
fn a_free_region_is_acquired_then_owned_and_a_wide_write_is_published() {
    let mut g = host();
    assert_eq!(g.cut().of(0, 0), 0..=0);
    assert_eq!(g.cut().of((1 << 20) - 1, 2), 0..=1);
    assert_eq!(g.plan(0, 5 << 20), None, "five regions: published");
    assert_eq!(g.plan(0, 4 << 20), Some(0..=3));
    assert_eq!(Regions::new(1 << 20, false, IDLE).plan(0, 1), None);
    let t = own(&mut g, 3, 10, 0);
    assert_eq!(
        g.mine(3).map(|m| (m.phase, m.inflight, m.revision)),
        Some((Phase::Held, 1, 10))
    );
    assert_eq!(g.take(3, L, Some(L), false, 1), Take::Owned(t));
    assert!(g.end_write(&[(3, t), (3, t)], L, Some(L), 2));
    assert_eq!(g.mine(3).unwrap().inflight, 0);
    assert_eq!(g.held(), 1);
}

#[test]
fn a_write_is_published_without_a_valid_lease_and_waits_on_a_region_being_taken() {
    let mut g = host();
    assert_eq!(
        g.take(0, L, None, false, 0),
        Take::Publish,
        "lease not valid"
    );
    assert_eq!(
        g.take(0, L, Some(L + 1), false, 0),
        Take::Publish,
        "lease replaced"
    );
    let Take::Acquire(t) = g.take(0, L, Some(L), false, 0) else {
        panic!()
    };
    assert_eq!(g.take(0, L, Some(L), false, 1), Take::Wait);
    assert_eq!(
        g.take(0, L, Some(L), true, 1),
        Take::Publish,
        "holding others: no wait"
    );
    // Refused: the waiting writers publish, the region is contended for the idle time.
    assert!(!g.acquired(0, t, None, 5));
    assert!(g.mine(0).is_none() && g.contended(0, 5 + IDLE - 1) && !g.contended(0, 5 + IDLE));
    assert_eq!(g.take(0, L, Some(L), false, 50), Take::Publish);
    assert!(matches!(
        g.take(0, L, Some(L), false, 5 + IDLE),
        Take::Acquire(_)
    ));
}

#[test]
fn an_outcome_for_a_replaced_entry_changes_nothing_and_its_key_is_a_stray() {
    let mut g = host();
    let Take::Acquire(old) = g.take(0, L, Some(L), false, 0) else {
        panic!()
    };
    // A new lease: the old entry is dead, and a write under the new one takes the region.
    let Take::Acquire(new) = g.take(0, L + 1, Some(L + 1), false, 1) else {
        panic!()
    };
    assert_ne!(old, new);
    let before = g.clone();
    assert!(!g.acquired(0, old, Some(5), 2), "stale token");
    assert_eq!(g.mine(0), before.mine(0), "the new entry is untouched");
    assert_eq!(
        g.take_stray(),
        vec![(0, 5)],
        "the key put for nothing is deleted"
    );
    assert!(
        !g.put_back(&[(0, old)], 3),
        "a write counted on the old entry is fenced"
    );
    let mut h = g.clone();
    h.released(0, old, 5, true);
    assert_eq!(h.mine(0), g.mine(0));
}

#[test]
fn a_write_whose_entry_was_lost_or_whose_lease_lapsed_is_fenced() {
    let mut g = host();
    let t = own(&mut g, 0, 10, 0);
    assert!(
        !g.clone().end_write(&[(0, t)], L, None, 1),
        "lease not valid at the end"
    );
    assert!(
        !g.clone().end_write(&[(0, t)], L, Some(L + 1), 1),
        "another lease"
    );
    // Another host's key, newer than this host's: the entry is lost.
    assert_eq!(
        g.owner_put(0, (L + 1, 11, false), 11, L),
        Heard::Drop(AfterDrop::Keep)
    );
    assert!(g.mine(0).is_none() && g.theirs_in(0, 1) && g.theirs(0) == Some(11));
    assert!(!g.end_write(&[(0, t)], L, Some(L), 1));
}

#[test]
fn another_hosts_key_makes_reads_go_to_the_source_until_its_deletion_is_dropped() {
    let mut g = host();
    assert!(!g.theirs_in(0, 4 << 20));
    assert_eq!(
        g.owner_put(2, (L + 1, 5, false), 5, L),
        Heard::Drop(AfterDrop::Keep)
    );
    assert!(g.theirs_in(0, 4 << 20) && !g.theirs_in(0, 2 << 20));
    // A write there is published and marks it contended.
    assert_eq!(g.take(2, L, Some(L), false, 0), Take::Publish);
    assert!(g.contended(2, 0));
    let after = AfterDrop::Uncount { seen: 5 };
    assert_eq!(g.owner_deleted(2, 6, L), Heard::Drop(after));
    assert!(g.theirs_in(2 << 20, 1), "still another's until dropped");
    // Counted as another's again meanwhile (another key): that stays.
    let mut h = g.clone();
    h.owner_put(2, (L + 2, 7, false), 7, L);
    h.dropped(2, after, L, 1);
    assert_eq!(h.theirs(2), Some(7));
    g.dropped(2, after, L, 1);
    assert_eq!((g.theirs(2), g.theirs_list()), (None, vec![]));
    assert_eq!(g.owner_deleted(2, 8, L), Heard::Nothing);
}

#[test]
fn a_key_of_this_lease_is_taken_if_handed_over_and_deleted_otherwise() {
    let mut g = host();
    let t = own(&mut g, 0, 10, 0);
    assert_eq!(
        g.owner_put(0, (L, 10, false), 10, L),
        Heard::Nothing,
        "its own"
    );
    assert_eq!(g.mine(0).unwrap().token, t);
    assert_eq!(g.owner_put(1, (L, 12, false), 12, L), Heard::Nothing);
    assert_eq!(
        g.take_stray(),
        vec![(1, 12)],
        "not put by this host: deleted"
    );
    let take = AfterDrop::Take { key_revision: 13 };
    assert_eq!(g.owner_put(2, (L, 13, true), 13, L), Heard::Drop(take));
    assert!(g.theirs_in(2 << 20, 1), "dropped before it is owned");
    g.add_stray(&[(2, 13)]);
    g.foreign_write(2 << 20, 1, 0);
    assert!(g.dropped(2, take, L, 1));
    assert_eq!(
        g.mine(2).map(|m| (m.phase, m.revision)),
        Some((Phase::Held, 13))
    );
    assert!(!g.theirs_in(2 << 20, 1) && !g.contended(2, 1) && g.take_stray().is_empty());
}

#[test]
fn idle_regions_are_released_oldest_first_and_contended_ones_once_drained() {
    let mut g = host();
    let a = own(&mut g, 0, 10, 0);
    let b = own(&mut g, 1, 11, 0);
    assert!(g.end_write(&[(0, a)], L, Some(L), 10) && g.end_write(&[(1, b)], L, Some(L), 5));
    assert_eq!(g.next_release(104), None, "region 1 idle for 99 ns");
    let rel = g.next_release(105).unwrap();
    assert_eq!((rel.region, rel.revision, rel.contended), (1, 11, false));
    assert_eq!(g.mine(1).unwrap().phase, Phase::Leaving);
    assert_eq!(g.take(1, L, Some(L), false, 105), Take::Wait);
    g.released(1, rel.token, rel.revision, false);
    assert!(g.mine(1).is_none() && g.take_stray() == vec![(1, 11)]);
    // Region 0, written again: its idle time starts again at that write's end.
    let a = own(&mut g, 0, 10, 106);
    assert_eq!(g.next_release(200), None, "a write in flight");
    g.foreign_write(0, 1, 150);
    assert_eq!(
        g.take(0, L, Some(L), false, 151),
        Take::Publish,
        "contended"
    );
    assert_eq!(g.next_release(151), None, "a write in flight");
    assert!(g.end_write(&[(0, a)], L, Some(L), 152));
    let rel = g.next_release(153).unwrap();
    assert_eq!((rel.region, rel.contended), (0, true));
    g.released(0, rel.token, rel.revision, true);
    assert_eq!((g.held(), g.next_release(1 << 40)), (0, None));
    // A whole-volume invalidation marks only the regions this host has.
    g.foreign_write(0, u64::MAX, 0);
    assert!(!g.contended(5, 1));
}

#[test]
fn a_handoff_moves_the_drained_regions_and_keeps_the_written_ones() {
    let mut g = host();
    let a = own(&mut g, 0, 10, 0);
    let b = own(&mut g, 1, 11, 0);
    assert!(g.end_write(&[(0, a)], L, Some(L), 1));
    let marked = g.mark_handoff();
    assert_eq!(marked.len(), 2);
    assert!(g.handoff_busy(&marked));
    assert_eq!(g.take(0, L, Some(L), false, 2), Take::Wait, "leaving");
    let ready = g.handoff_ready(&marked);
    assert_eq!(ready, vec![(0, a, 10)]);
    assert!(g.theirs_in(0, 1), "another's before it moves");
    assert_eq!(
        g.mine(1).map(|m| m.phase),
        Some(Phase::Held),
        "still written: kept"
    );
    g.released(0, a, 10, true);
    assert!(g.mine(0).is_none() && g.end_write(&[(1, b)], L, Some(L), 3));
}

#[path = "regions_model.rs"]
mod model;
