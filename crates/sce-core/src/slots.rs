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
        }
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
        self.len() - self.high_water + self.free.len() as u32
    }

    /// Takes a free slot, if any.
    pub fn take_free(&mut self) -> Option<SlotNo> {
        if let Some(s) = self.free.pop() {
            return Some(SlotNo(s));
        }
        if self.high_water < self.len() {
            self.high_water += 1;
            return Some(SlotNo(self.high_water - 1));
        }
        None
    }

    /// Returns a slot to the free list. The caller guarantees it holds no fragment.
    pub fn put_free(&mut self, s: SlotNo) {
        debug_assert!(self.fragment(s).is_none());
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
