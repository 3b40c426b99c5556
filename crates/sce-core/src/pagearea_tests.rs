//! Unit tests of the page area (its states, growth, rewrite).

use super::*;
use std::collections::HashMap;

const PPS: u32 = 64;

fn never(_: SlotNo) -> bool {
    false
}

/// Fills `page` if it can; returns true if it became valid.
fn fill(a: &mut PageArea, page: u64) -> bool {
    if a.find(page).is_some() {
        return false;
    }
    match a.victim(page, never) {
        Some((w, _)) => {
            a.start_fill(w, page);
            a.complete_fill(w, page, true)
        }
        None => false,
    }
}

/// Growing and shrinking one slot at a time keeps every page it did not drop findable
/// where it was filled, and the counts agree.
#[test]
fn growth_keeps_pages_findable() {
    let mut a = PageArea::new(PPS);
    let mut held: HashMap<u64, WayAt> = HashMap::new();
    let mut next = 0u64;
    for step in 0..40u32 {
        if step % 7 == 6 && a.can_shrink(never) {
            a.shrink();
        } else {
            a.grow(SlotNo(step));
        }
        for _ in 0..300 {
            next += 1;
            let page = next.wrapping_mul(7919) % 100_000;
            fill(&mut a, page);
        }
        held.clear();
        let mut n = 0;
        for w in 0..a.lo.len() {
            if a.state(w) & VALID != 0 {
                n += 1;
                let page = a.page_of(w);
                assert!(held.insert(page, a.at(w)).is_none(), "page {page} twice");
            }
        }
        assert_eq!(n, a.valid_pages());
        for (&page, &at) in &held {
            assert_eq!(a.lookup(page), Some(at), "page {page} at step {step}");
        }
    }
}

/// A write during a fill spoils it; a draining way is not reused while its slot is
/// pinned, nor is any valid way of a pinned slot evicted.
#[test]
fn spoiled_fills_and_pinned_slots() {
    let mut a = PageArea::new(PPS);
    a.grow(SlotNo(9));
    let (w, old) = a.victim(5, never).unwrap();
    assert_eq!(old, None);
    a.start_fill(w, 5);
    assert!(a.filling(5));
    assert_eq!(a.drop_page(5, never), Dropped::Filling);
    assert!(!a.complete_fill(w, 5, true));
    assert_eq!(a.lookup(5), None);
    assert!(fill(&mut a, 5));
    assert_eq!(a.drop_page(5, |_| true), Dropped::Valid);
    // Fill every way of the area (one slot: both sets of any page are full; page 5's
    // draining way is reused, its slot not pinned), then ask for a way while it is.
    let mut p = 6u64;
    while (0..a.lo.len()).any(|w| a.state(w) == 0) {
        fill(&mut a, p);
        p += 1;
    }
    assert_eq!(a.valid_pages() as usize, a.lo.len());
    assert_eq!(a.victim(p, |_| true), None);
    let (w, old) = a.victim(p, never).unwrap();
    assert_eq!(old, Some(a.page_of(w)), "CLOCK's victim, for the duel");
}

/// A write's copy refills a valid page in its way; a pinned slot's page, or one whose
/// fill is in flight, is dropped instead, and a second write spoils the first's copy.
#[test]
fn rewrite_refills_in_place_or_drops() {
    let mut a = PageArea::new(PPS);
    a.grow(SlotNo(3));
    assert_eq!(a.rewrite(7, never), None);
    assert!(fill(&mut a, 7));
    let at = a.lookup(7).unwrap();
    let w = a
        .rewrite(7, never)
        .expect("a valid, unpinned page is rewritten");
    assert_eq!(a.at(w), at);
    assert_eq!((a.lookup(7), a.valid_pages()), (None, 0));
    // A second write while the first copy is in flight spoils it.
    assert_eq!(a.rewrite(7, never), None);
    assert!(!a.complete_fill(w, 7, true));
    assert_eq!(a.lookup(7), None);
    assert!(fill(&mut a, 7));
    let w = a.rewrite(7, never).unwrap();
    assert!(a.complete_fill(w, 7, true));
    assert_eq!(a.lookup(7), Some(at));
    // A read holds the slot: the page drains, no copy.
    assert_eq!(a.rewrite(7, |_| true), None);
    assert_eq!(a.lookup(7), None);
}

/// Pages of the last slot are dropped by a shrink, and replace empties one slot.
#[test]
fn shrink_and_replace_drop_pages() {
    let mut a = PageArea::new(PPS);
    for s in 0..4 {
        a.grow(SlotNo(s));
    }
    for p in 0..1000 {
        fill(&mut a, p);
    }
    let before = a.valid_pages();
    assert!(before > 0);
    let (s, dropped) = a.shrink().unwrap();
    assert_eq!(s, SlotNo(3));
    assert_eq!(a.valid_pages(), before - dropped);
    let d = a.replace(0, SlotNo(77));
    assert_eq!(a.valid_pages(), before - dropped - d);
    assert_eq!(a.slots()[0], SlotNo(77));
    for p in 0..1000 {
        if let Some(at) = a.lookup(p) {
            assert!(at.slot == SlotNo(1) || at.slot == SlotNo(2), "{at:?}");
        }
    }
}

/// A page whose first set is full goes to its second if that has room, and is found there.
#[test]
fn a_full_first_set_sends_a_page_to_its_second() {
    let mut a = PageArea::new(PPS);
    for s in 0..4 {
        a.grow(SlotNo(s));
    }
    let set = a.addr(1);
    let mut p = 2u64;
    let mut same = 0;
    while same < WAYS {
        if a.addr(p) == set && a.addr2(p) != set && fill(&mut a, p) {
            same += 1;
        }
        p += 1;
    }
    // Every way of the first set holds a page whose first set it is: filled there.
    assert!(PageArea::ways(set).all(|w| a.state(w) & VALID != 0));
    while !(a.addr(p) == set && a.addr2(p) != set) {
        p += 1;
    }
    let (w, old) = a.victim(p, never).unwrap();
    assert_eq!(old, None, "an empty way of the second set, no eviction");
    assert!(PageArea::ways(a.addr2(p)).contains(&w));
    a.start_fill(w, p);
    assert!(a.complete_fill(w, p, true));
    assert_eq!(a.lookup(p), Some(a.at(w)));
}
