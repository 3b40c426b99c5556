//! Slot descriptors, kept as a structure of arrays so that each field costs exactly its size:
//! the source fragment held (8 B), a pin count (2 B) and the page-validity bitmap (32 B for a
//! 1 MiB fragment), 42 B per slot. The eviction policy keeps its own per-slot state
//! (1 B for CLOCK). In-flight state (AWT writes, populations) lives in side tables bounded by
//! the number of operations in flight, not by the number of slots.
//!
//! Free slots: slots at or above the high-water mark have never been used; slots freed later
//! (failed population, explicit eviction) go to a free list that only grows when that happens.

use crate::addr::{FragNo, SlotNo};
use crate::bitmap;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

/// Pin counts of all slots. Pins are taken only by the core (under the driver's lock), but
/// may be released by a driver thread without the lock, so that a read hit costs one lock
/// acquisition, not two. A slot whose count is 0 when the core looks (under its lock) has no
/// reader: counts only go up under the lock.
#[derive(Debug)]
pub struct PinTable(Box<[AtomicU16]>);

impl PinTable {
    /// Current pin count of slot `s`.
    #[inline]
    pub fn get(&self, s: SlotNo) -> u16 {
        self.0[s.0 as usize].load(Ordering::Acquire)
    }

    /// Releases one pin of slot `s`. The caller guarantees it holds one.
    #[inline]
    pub fn release(&self, s: SlotNo) {
        let prev = self.0[s.0 as usize].fetch_sub(1, Ordering::Release);
        debug_assert!(prev > 0, "unpin of unpinned slot {s}");
    }

    fn take(&self, s: SlotNo) -> bool {
        self.0[s.0 as usize]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| p.checked_add(1))
            .is_ok()
    }
}

const NO_FRAGMENT: u64 = u64::MAX;

/// The slot descriptor table.
#[derive(Debug)]
pub struct SlotTable {
    frags: Box<[u64]>,
    pins: Arc<PinTable>,
    valid: Box<[u64]>,
    words: usize,
    high_water: u32,
    free: Vec<u32>,
    /// One bit per slot: its fragment or bitmap changed since the last `take_dirty`.
    dirty_bits: Box<[u64]>,
    dirty: Vec<u32>,
    track_dirty: bool,
    /// One bit per slot lent to the write-back log (empty until one is): never free, never
    /// allocated, until given back.
    lent: Vec<u64>,
    /// Lent slots at or above the high-water mark (not yet taken by it).
    lent_above: u32,
}

impl SlotTable {
    /// A table of `slots` free slots with `words` bitmap words each.
    pub fn new(slots: u32, words: usize) -> Self {
        SlotTable {
            frags: vec![NO_FRAGMENT; slots as usize].into_boxed_slice(),
            pins: Arc::new(PinTable((0..slots).map(|_| AtomicU16::new(0)).collect())),
            valid: vec![0; slots as usize * words].into_boxed_slice(),
            words,
            high_water: 0,
            free: Vec::new(),
            dirty_bits: Box::new([]),
            dirty: Vec::new(),
            track_dirty: false,
            lent: Vec::new(),
            lent_above: 0,
        }
    }

    /// True if slot `s` is lent to the write-back log.
    pub fn is_lent(&self, s: SlotNo) -> bool {
        let i = s.0 as usize;
        self.lent
            .get(i / 64)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// Lends slot `s`, which holds no fragment and no pin, to the write-back log: it is
    /// never free nor allocated until [`Self::give_back`]. False if it was already lent.
    pub fn lend(&mut self, s: SlotNo) -> bool {
        let new = !self.is_lent(s);
        if new {
            self.lend_many(&[s]);
        }
        new
    }

    /// [`Self::lend`] of every one of `slots` (none lent yet, each free of fragment and pin),
    /// with one pass over the free list.
    pub fn lend_many(&mut self, slots: &[SlotNo]) {
        if slots.is_empty() {
            return;
        }
        if self.lent.is_empty() {
            self.lent = vec![0; (self.len() as usize).div_ceil(64)];
        }
        for &s in slots {
            debug_assert!(self.fragment(s).is_none() && self.pins(s) == 0 && !self.is_lent(s));
            let i = s.0 as usize;
            self.lent[i / 64] |= 1 << (i % 64);
            if s.0 >= self.high_water {
                self.lent_above += 1;
            }
        }
        let lent = &self.lent;
        self.free
            .retain(|&f| lent[f as usize / 64] & (1 << (f % 64)) == 0);
    }

    /// Gives back slot `s` (lent), free again. False if it was not lent.
    pub fn give_back(&mut self, s: SlotNo) -> bool {
        if !self.is_lent(s) {
            return false;
        }
        let i = s.0 as usize;
        self.lent[i / 64] &= !(1 << (i % 64));
        if s.0 >= self.high_water {
            self.lent_above -= 1;
        } else {
            self.free.push(s.0);
        }
        true
    }

    /// Starts recording which slots change (for a driver that persists the table).
    pub fn track_dirty(&mut self) {
        if !self.track_dirty {
            self.track_dirty = true;
            self.dirty_bits = vec![0; (self.len() as usize).div_ceil(64)].into_boxed_slice();
        }
    }

    #[inline]
    fn mark_dirty(&mut self, s: SlotNo) {
        if !self.track_dirty {
            return;
        }
        let (w, b) = (s.0 as usize / 64, s.0 % 64);
        if self.dirty_bits[w] & (1 << b) == 0 {
            self.dirty_bits[w] |= 1 << b;
            self.dirty.push(s.0);
        }
    }

    /// Slots whose fragment or validity changed since the last call, in the order they first
    /// changed; clears the set.
    pub fn take_dirty(&mut self) -> Vec<SlotNo> {
        for &s in &self.dirty {
            self.dirty_bits[s as usize / 64] &= !(1 << (s % 64));
        }
        std::mem::take(&mut self.dirty)
            .into_iter()
            .map(SlotNo)
            .collect()
    }

    /// Rebuilds the free list after slots were assigned directly (`restore`): every slot
    /// without a fragment is free, lowest first.
    pub fn rebuild_free(&mut self) {
        self.high_water = self.len();
        self.lent_above = 0;
        self.free = (0..self.len())
            .rev()
            .filter(|&s| self.frags[s as usize] == NO_FRAGMENT && !self.is_lent(SlotNo(s)))
            .collect();
    }

    /// Number of slots.
    pub fn len(&self) -> u32 {
        self.frags.len() as u32
    }

    /// True if the table has no slots.
    pub fn is_empty(&self) -> bool {
        self.frags.is_empty()
    }

    /// Number of free slots.
    pub fn free_count(&self) -> u32 {
        self.len() - self.high_water - self.lent_above + self.free.len() as u32
    }

    /// Takes a free slot, if any.
    pub fn take_free(&mut self) -> Option<SlotNo> {
        if let Some(s) = self.free.pop() {
            return Some(SlotNo(s));
        }
        while self.high_water < self.len() {
            self.high_water += 1;
            let s = SlotNo(self.high_water - 1);
            if !self.is_lent(s) {
                return Some(s);
            }
            self.lent_above -= 1;
        }
        None
    }

    /// Returns a slot to the free list. The caller guarantees it holds no fragment.
    pub fn put_free(&mut self, s: SlotNo) {
        debug_assert!(self.fragment(s).is_none() && !self.is_lent(s));
        self.free.push(s.0);
    }

    /// The fragment a slot holds.
    #[inline]
    pub fn fragment(&self, s: SlotNo) -> Option<FragNo> {
        let f = self.frags[s.0 as usize];
        (f != NO_FRAGMENT).then_some(FragNo(f))
    }

    /// Assigns a fragment to a slot (or clears it); clears the bitmap either way.
    pub fn assign(&mut self, s: SlotNo, f: Option<FragNo>) {
        self.frags[s.0 as usize] = f.map_or(NO_FRAGMENT, |f| f.0);
        self.bitmap_mut(s).fill(0);
    }

    /// The page-validity bitmap of a slot.
    #[inline]
    pub fn bitmap(&self, s: SlotNo) -> &[u64] {
        let i = s.0 as usize * self.words;
        &self.valid[i..i + self.words]
    }

    /// The page-validity bitmap of a slot, mutably.
    #[inline]
    pub fn bitmap_mut(&mut self, s: SlotNo) -> &mut [u64] {
        self.mark_dirty(s);
        let i = s.0 as usize * self.words;
        &mut self.valid[i..i + self.words]
    }

    /// True if page `p` of slot `s` holds valid data.
    #[inline]
    pub fn is_valid(&self, s: SlotNo, p: u32) -> bool {
        bitmap::test(self.bitmap(s), p)
    }

    /// Pin count (reads, population and AWT writes in flight on the slot).
    #[inline]
    pub fn pins(&self, s: SlotNo) -> u16 {
        self.pins.get(s)
    }

    /// The shared pin table.
    pub fn pin_table(&self) -> &Arc<PinTable> {
        &self.pins
    }

    /// Adds a pin; false if the count is saturated (the caller then treats the slot as absent).
    #[inline]
    pub fn pin(&self, s: SlotNo) -> bool {
        self.pins.take(s)
    }

    /// Removes a pin. The caller guarantees it holds one.
    #[inline]
    pub fn unpin(&mut self, s: SlotNo) {
        self.pins.release(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lent slots are never free nor taken, below or above the high-water mark, one at a
    /// time or many at once; given back, they are taken again; the free count agrees.
    #[test]
    fn lent_slots_are_never_taken_until_given_back() {
        let mut t = SlotTable::new(16, 1);
        let taken: Vec<SlotNo> = (0..6).map(|_| t.take_free().unwrap()).collect();
        for &s in &taken[..3] {
            t.put_free(s);
        }
        // Free: 0, 1, 2 (list) and 6.. (above the mark); 3, 4, 5 in use.
        assert_eq!(t.free_count(), 13);
        assert!(t.lend(SlotNo(1)));
        assert!(!t.lend(SlotNo(1)));
        t.lend_many(&[SlotNo(2), SlotNo(7), SlotNo(9)]);
        assert!(t.lend(SlotNo(12)));
        assert_eq!(t.free_count(), 8);
        let mut got = Vec::new();
        while let Some(s) = t.take_free() {
            got.push(s.0);
        }
        got.sort_unstable();
        assert_eq!(got, vec![0, 6, 8, 10, 11, 13, 14, 15]);
        assert_eq!(t.free_count(), 0);
        for s in [1, 2, 7, 9, 12] {
            assert!(t.give_back(SlotNo(s)));
        }
        assert!(!t.give_back(SlotNo(3)));
        assert_eq!(t.free_count(), 5);
        let mut again: Vec<u32> = std::iter::from_fn(|| t.take_free().map(|s| s.0)).collect();
        again.sort_unstable();
        assert_eq!(again, vec![1, 2, 7, 9, 12]);
    }
}
