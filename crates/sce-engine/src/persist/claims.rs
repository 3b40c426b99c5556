//! The possible on-device claims (`docs/FORMAT.md`; the rule in `persist/mod.rs`): per slot,
//! the fragment its record may claim (the *mirror*), and the inverse, fragment to the one
//! slot that may claim it (the *owner*).
//!
//! The inverse is an index of slot numbers only: an open-addressed table (linear probing,
//! about two entries in three used when every slot claims) whose keys are not stored but read
//! from the mirror, so it costs 6 bytes per slot, fixed at open, where a hash map of fragment
//! to slot grew to 19-39 bytes per claiming slot as the cache filled (and rehashed, under
//! the persistence lock, while it did). The bits of an entry above the slot number carry a
//! few bits of the fragment's hash, so a probe rarely reads the mirror for a slot that is
//! not the one sought.

use sce_store::unit::NO_FRAGMENT;

/// An empty entry of the index.
const EMPTY: u32 = u32::MAX;

/// The mirror and its inverse. Each slot claims at most one fragment and each fragment is
/// claimed by at most one slot (the callers keep this: [`Claims::claim`] checks it).
#[derive(Debug)]
pub(super) struct Claims {
    /// Per slot: the fragment its on-device record may claim, or NO_FRAGMENT.
    mirror: Vec<u64>,
    /// Entries: a slot number in the bits of `slot_mask`, hash bits of its fragment above.
    index: Box<[u32]>,
    /// The low bits that hold a slot number (all 32 when the slots need them all).
    slot_mask: u32,
}

/// The hash of fragment `f` (a multiplicative hash with the high bits folded down).
fn hash(f: u64) -> u64 {
    let h = (f ^ (f >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^ (h >> 32)
}

impl Claims {
    /// No claims, for `slots` slots.
    pub(super) fn new(slots: usize) -> Self {
        assert!(
            slots < EMPTY as usize,
            "{slots} slots: more than the index can name"
        );
        // Room for every slot at two thirds full, at least a few entries.
        let cap = (slots + slots / 2 + 8).min(EMPTY as usize);
        let slot_bits = (usize::BITS - slots.leading_zeros()).max(1);
        Claims {
            mirror: vec![NO_FRAGMENT; slots],
            index: vec![EMPTY; cap].into_boxed_slice(),
            slot_mask: u32::MAX >> (32 - slot_bits),
        }
    }

    /// The fragment slot `s`'s record may claim, or NO_FRAGMENT.
    #[inline]
    pub(super) fn of(&self, s: u32) -> u64 {
        self.mirror[s as usize]
    }

    /// The entry bits above the slot number for a fragment of hash `h`.
    fn tag(&self, h: u64) -> u32 {
        h as u32 & !self.slot_mask
    }

    /// The entry's slot.
    fn slot(&self, e: u32) -> u32 {
        e & self.slot_mask
    }

    /// The first position a fragment of hash `h` is looked for.
    fn home(&self, h: u64) -> usize {
        ((h as u128 * self.index.len() as u128) >> 64) as usize
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.index.len() {
            0
        } else {
            i + 1
        }
    }

    /// The position of fragment `f`'s entry.
    fn find(&self, f: u64) -> Option<usize> {
        let h = hash(f);
        let tag = self.tag(h);
        let mut i = self.home(h);
        loop {
            let e = self.index[i];
            if e == EMPTY {
                return None;
            }
            if e & !self.slot_mask == tag && self.mirror[self.slot(e) as usize] == f {
                return Some(i);
            }
            i = self.next(i);
        }
    }

    /// The slot whose record may claim fragment `f`.
    #[inline]
    pub(super) fn owner(&self, f: u64) -> Option<u32> {
        self.find(f).map(|i| self.slot(self.index[i]))
    }

    /// Slot `s` may now claim fragment `f`. False (and nothing changed) if that would give
    /// the slot a second fragment or the fragment a second slot.
    pub(super) fn claim(&mut self, s: u32, f: u64) -> bool {
        debug_assert_ne!(f, NO_FRAGMENT);
        let m = self.mirror[s as usize];
        if m == f {
            return true;
        }
        if m != NO_FRAGMENT || self.find(f).is_some() {
            return false;
        }
        self.mirror[s as usize] = f;
        let h = hash(f);
        let mut i = self.home(h);
        while self.index[i] != EMPTY {
            i = self.next(i);
        }
        self.index[i] = self.tag(h) | s;
        true
    }

    /// Slot `s`'s record claims nothing now.
    pub(super) fn clear(&mut self, s: u32) {
        let f = self.mirror[s as usize];
        if f == NO_FRAGMENT {
            return;
        }
        let found = self.find(f);
        self.mirror[s as usize] = NO_FRAGMENT;
        let Some(mut hole) = found else {
            // Never: `claim` indexes every fragment it records. The slot claims nothing now
            // either way, which only forgets a claim the device may still hold less of.
            debug_assert!(
                false,
                "slot {s} claims fragment {f} but the index does not name it"
            );
            return;
        };
        self.index[hole] = EMPTY;
        // Backward shift: move up every later entry of the run whose home does not lie
        // cyclically in (hole, j], so that no lookup stops at the hole.
        let mut j = self.next(hole);
        while self.index[j] != EMPTY {
            let e = self.index[j];
            let home = self.home(hash(self.mirror[self.slot(e) as usize]));
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.index[hole] = e;
                self.index[j] = EMPTY;
                hole = j;
            }
            j = self.next(j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;

    /// Random claims and clears against a map of the same relation, for table sizes from
    /// nearly full (collisions, runs that wrap) to roomy.
    #[test]
    fn claims_follow_a_map_of_fragments_to_slots() {
        for (slots, frags, seed) in [(1, 3, 1), (7, 10, 2), (64, 80, 3), (1000, 5000, 4)] {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut c = Claims::new(slots);
            let mut by_frag: HashMap<u64, u32> = HashMap::new();
            let mut by_slot: HashMap<u32, u64> = HashMap::new();
            for _ in 0..20_000 {
                let s = rng.gen_range(0..slots as u32);
                // Fragments far apart too (the hash must spread them).
                let f = rng.gen_range(0..frags) * if rng.gen_bool(0.5) { 1 } else { 1 << 40 };
                if rng.gen_bool(0.55) {
                    let ok = !by_slot.contains_key(&s) && !by_frag.contains_key(&f)
                        || by_slot.get(&s) == Some(&f);
                    assert_eq!(c.claim(s, f), ok, "claim({s}, {f})");
                    if ok {
                        by_slot.insert(s, f);
                        by_frag.insert(f, s);
                    }
                } else {
                    c.clear(s);
                    if let Some(f) = by_slot.remove(&s) {
                        by_frag.remove(&f);
                    }
                }
                assert_eq!(c.of(s), by_slot.get(&s).copied().unwrap_or(NO_FRAGMENT));
                assert_eq!(c.owner(f), by_frag.get(&f).copied(), "owner({f})");
            }
            for (&f, &s) in &by_frag {
                assert_eq!(c.owner(f), Some(s));
            }
            for s in 0..slots as u32 {
                assert_eq!(c.of(s), by_slot.get(&s).copied().unwrap_or(NO_FRAGMENT));
            }
        }
    }

    /// Every slot claiming at once fits, and clearing them all leaves the index empty.
    #[test]
    fn a_full_cache_fits_and_empties() {
        let n = 10_000;
        let mut c = Claims::new(n);
        for s in 0..n as u32 {
            assert!(c.claim(s, u64::from(s) * 7919 + 3));
        }
        for s in 0..n as u32 {
            assert_eq!(c.owner(u64::from(s) * 7919 + 3), Some(s));
        }
        for s in (0..n as u32).rev() {
            c.clear(s);
        }
        assert!(c.index.iter().all(|&e| e == EMPTY));
    }
}
