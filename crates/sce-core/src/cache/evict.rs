//! Eviction: victims, freeing and allocating slots.

use super::CacheCore;
use crate::addr::{FragNo, SlotNo};

impl CacheCore {
    /// Drops every cached fragment that no operation pins (the volume was forgotten or the
    /// cache device failed). Returns how many were dropped.
    pub fn drop_all(&mut self) -> u32 {
        let mut n = 0;
        for s in 0..self.geo.slots() {
            let s = SlotNo(s);
            if self.slots.fragment(s).is_some() && self.slots.pins(s) == 0 {
                self.evict_slot(s);
                self.slots.put_free(s);
                n += 1;
            }
        }
        n
    }

    /// FlashTier's `evict`: drops fragment `f` from the cache. Returns false if it is not
    /// cached or its slot is pinned by an operation in flight.
    pub fn evict_fragment(&mut self, f: FragNo) -> bool {
        match self.map.get(f) {
            Some(s) if self.slots.pins(s) == 0 => {
                self.evict_slot(s);
                self.slots.put_free(s);
                true
            }
            _ => false,
        }
    }

    /// Evicts the policy's victim, if there is one that is not pinned. Returns its fragment.
    pub fn evict_one(&mut self) -> Option<FragNo> {
        let s = self.victim()?;
        let f = self.slots.fragment(s);
        self.evict_slot(s);
        self.slots.put_free(s);
        f
    }

    pub(super) fn victim(&mut self) -> Option<SlotNo> {
        let slots = &self.slots;
        self.evict
            .victim(|s| slots.pins(s) > 0 || slots.fragment(s).is_none())
    }

    pub(super) fn evict_slot(&mut self, s: SlotNo) {
        if let Some(f) = self.slots.fragment(s) {
            self.map.set(f, None);
            self.stats.fragments_evicted += 1;
        }
        self.slots.assign(s, None);
        self.evict.removed(s);
    }

    /// Gives fragment `f` a slot: a free one, or the eviction policy's victim.
    pub(super) fn allocate(&mut self, f: FragNo) -> Option<SlotNo> {
        let s = match self.slots.take_free() {
            Some(s) => s,
            None => {
                let s = self.victim()?;
                self.evict_slot(s);
                s
            }
        };
        self.slots.assign(s, Some(f));
        self.map.set(f, Some(s));
        self.evict.inserted(s);
        Some(s)
    }
}
