//! The direct-mapped fragment table: source fragment number -> cache slot, one lookup per
//! fragment.
//!
//! Layout: two levels. The top level is a vector with one pointer per leaf; a leaf covers
//! `LEAF_ENTRIES` consecutive source fragments and is allocated the first time one of its
//! fragments is mapped (FlashTier's argument for sparse address spaces: small fragments over a
//! large, sparsely used source stay cheap). Entries inside a leaf are bit-packed with just
//! enough bits for `slots + 1` values (0 = not cached, `s + 1` = slot `s`), so a 2 TiB cache of
//! 1 MiB slots needs 22 bits, not 32, per source fragment. A lookup reads one or two adjacent
//! words of one leaf.

use crate::addr::{FragNo, SlotNo};

const LEAF_SHIFT: u32 = 14;
/// Source fragments covered by one leaf.
pub const LEAF_ENTRIES: u64 = 1 << LEAF_SHIFT;

/// Fragment number -> slot table.
#[derive(Debug)]
pub struct FragmentMap {
    width: u32,
    leaves: Vec<Option<Box<[u64]>>>,
    fragments: u64,
}

impl FragmentMap {
    /// A map for `fragments` source fragments and `slots` cache slots; no leaf is allocated.
    pub fn new(fragments: u64, slots: u32) -> Self {
        let width = 64 - (slots as u64).leading_zeros();
        let nleaves = fragments.div_ceil(LEAF_ENTRIES) as usize;
        let mut leaves = Vec::with_capacity(nleaves);
        leaves.resize_with(nleaves, || None);
        FragmentMap {
            width: width.max(1),
            leaves,
            fragments,
        }
    }

    /// Bits per entry.
    pub fn entry_bits(&self) -> u32 {
        self.width
    }

    /// Number of source fragments covered.
    pub fn fragments(&self) -> u64 {
        self.fragments
    }

    fn leaf_words(&self) -> usize {
        ((LEAF_ENTRIES * self.width as u64).div_ceil(64) + 1) as usize
    }

    /// The slot holding fragment `f`, if any. The caller guarantees `f < fragments()`.
    #[inline]
    pub fn get(&self, f: FragNo) -> Option<SlotNo> {
        let leaf = self.leaves[(f.0 >> LEAF_SHIFT) as usize].as_deref()?;
        let bit = (f.0 & (LEAF_ENTRIES - 1)) * self.width as u64;
        let w = (bit / 64) as usize;
        let sh = (bit % 64) as u32;
        // The leaf has one spare word at the end, so `w + 1` is always in bounds.
        let raw = (leaf[w] >> sh) | if sh == 0 { 0 } else { leaf[w + 1] << (64 - sh) };
        let v = raw & ((1u64 << self.width) - 1);
        if v == 0 {
            None
        } else {
            Some(SlotNo((v - 1) as u32))
        }
    }

    /// Maps fragment `f` to `slot` (or unmaps it with `None`). Allocates the leaf on first use.
    pub fn set(&mut self, f: FragNo, slot: Option<SlotNo>) {
        let words = self.leaf_words();
        let width = self.width;
        let li = (f.0 >> LEAF_SHIFT) as usize;
        let v = match slot {
            Some(s) => s.0 as u64 + 1,
            None => 0,
        };
        let leaf = match &mut self.leaves[li] {
            Some(l) => l,
            None if v == 0 => return,
            l @ None => l.insert(vec![0u64; words].into_boxed_slice()),
        };
        let mask = (1u64 << width) - 1;
        let bit = (f.0 & (LEAF_ENTRIES - 1)) * width as u64;
        let w = (bit / 64) as usize;
        let sh = (bit % 64) as u32;
        leaf[w] = (leaf[w] & !(mask << sh)) | (v << sh);
        if sh != 0 && sh + width > 64 {
            let hi_bits = sh + width - 64;
            let hi_mask = (1u64 << hi_bits) - 1;
            leaf[w + 1] = (leaf[w + 1] & !hi_mask) | (v >> (64 - sh));
        }
    }

    /// Allocates every leaf (for measuring the worst-case footprint).
    pub fn touch_all(&mut self) {
        let words = self.leaf_words();
        for l in self.leaves.iter_mut().filter(|l| l.is_none()) {
            *l = Some(vec![0u64; words].into_boxed_slice());
        }
    }

    /// Leaves currently allocated.
    pub fn leaves_allocated(&self) -> usize {
        self.leaves.iter().filter(|l| l.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_entries_round_trip_at_every_width() {
        for slots in [1u32, 2, 3, 7, 8, 100, 1 << 21, u32::MAX - 1] {
            let n = LEAF_ENTRIES * 2 + 5;
            let mut m = FragmentMap::new(n, slots);
            let val = |i: u64| {
                if i.is_multiple_of(3) {
                    None
                } else {
                    Some(SlotNo((i * 7919 % slots as u64) as u32))
                }
            };
            for i in 0..n {
                m.set(FragNo(i), val(i));
            }
            for i in 0..n {
                assert_eq!(m.get(FragNo(i)), val(i), "slots={slots} i={i}");
            }
            for i in (0..n).step_by(2) {
                m.set(FragNo(i), None);
            }
            for i in 0..n {
                let want = if i % 2 == 0 { None } else { val(i) };
                assert_eq!(m.get(FragNo(i)), want, "slots={slots} i={i}");
            }
        }
    }

    #[test]
    fn leaves_are_allocated_on_first_touch() {
        let mut m = FragmentMap::new(LEAF_ENTRIES * 100, 1000);
        assert_eq!(m.leaves_allocated(), 0);
        m.set(FragNo(LEAF_ENTRIES * 50 + 3), None);
        assert_eq!(m.leaves_allocated(), 0);
        m.set(FragNo(LEAF_ENTRIES * 50 + 3), Some(SlotNo(999)));
        assert_eq!(m.leaves_allocated(), 1);
        assert_eq!(m.get(FragNo(LEAF_ENTRIES * 50 + 3)), Some(SlotNo(999)));
        assert_eq!(m.get(FragNo(0)), None);
    }
}
