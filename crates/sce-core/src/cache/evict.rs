//! Eviction: victims, freeing and allocating slots.

use super::{fragments, CacheCore};
use crate::addr::{FragNo, SlotNo, SourceOffset};
use crate::bitmap::{self, PageSet};

impl CacheCore {
    /// Drops every cached fragment that no operation pins (the volume was forgotten or the
    /// cache device failed). Returns how many were dropped.
    pub fn drop_all(&mut self) -> u32 {
        self.forget_sparse();
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

    /// FlashTier's `evict` over a range of the source: every page of `[offset, offset+len)`
    /// the cache holds is dropped, and fragments left with no valid page give their slot
    /// back unless pinned (a read or copy in flight; their pages are invalid all the same).
    /// Returns the pages dropped.
    pub fn evict_range(&mut self, offset: SourceOffset, len: u64) -> u64 {
        let end = offset.0.saturating_add(len).min(self.geo.source_size());
        if offset.0 >= end {
            return 0;
        }
        let mut dropped = 0;
        for (f, lo, hi, _, _) in fragments(self.geo, offset.0, end - offset.0) {
            dropped += self.drop_sparse(f, lo, hi);
            let Some(s) = self.map.get(f) else { continue };
            dropped += bitmap::count(self.slots.bitmap(s), lo, hi) as u64;
            bitmap::clear_range(self.slots.bitmap_mut(s), lo, hi);
            self.spoil_in_flight(f, lo, hi);
            let empty = !bitmap::any_set(self.slots.bitmap(s), 0, self.geo.pages_per_fragment());
            if empty && self.slots.pins(s) == 0 {
                self.evict_slot(s);
                self.slots.put_free(s);
            }
        }
        self.stats.pages_invalidated += dropped;
        dropped
    }

    /// Forgets everything cached, at once (the source changed behind the cache's back):
    /// every page is invalid, every unpinned slot is free, and what is in flight may
    /// validate nothing it began before (populations read the old source, and a write's
    /// partial pages would keep old bytes). Returns the fragments that were cached.
    pub fn forget(&mut self) -> u64 {
        let ppf = self.geo.pages_per_fragment();
        for pop in self.pops.values_mut() {
            pop.spoiled.insert_range(0, ppf);
        }
        for w in self.writes.values_mut() {
            for part in &mut w.parts {
                part.spoiled
                    .get_or_insert_with(|| PageSet::new(ppf))
                    .insert_range(part.lo, part.hi);
            }
        }
        let mut n = 0;
        self.forget_sparse();
        for s in (0..self.geo.slots()).map(SlotNo) {
            if self.slots.fragment(s).is_none() {
                continue;
            }
            n += 1;
            bitmap::clear_range(self.slots.bitmap_mut(s), 0, ppf);
            if self.slots.pins(s) == 0 {
                self.evict_slot(s);
                self.slots.put_free(s);
                // Forgotten, not evicted: no policy chose it.
                self.stats.fragments_evicted -= 1;
                self.stats.fragments_forgotten += 1;
            }
        }
        n
    }

    /// Spoils pages `[lo, hi)` of fragment `f` for the population and writes in flight on it,
    /// so that none of them validates those pages when it completes (an eviction of the
    /// pages, or a new write over them). Returns whether anything in flight overlapped them,
    /// and how many pages of the population's fill were spoiled.
    pub(super) fn spoil_in_flight(&mut self, f: FragNo, lo: u32, hi: u32) -> (bool, u32) {
        let ppf = self.geo.pages_per_fragment();
        let Some(act) = self.activity.get(&f.0) else {
            return (false, 0);
        };
        let (mut overlapped, mut pop_pages) = (false, 0);
        if let Some(pop) = act.pop.and_then(|p| self.pops.get_mut(p.0)) {
            if bitmap::any_set(pop.fill.words(), lo, hi) {
                overlapped = true;
                pop_pages = bitmap::count(pop.fill.words(), lo, hi);
                pop.spoiled.insert_range(lo, hi);
            }
        }
        for &w in &act.writes {
            if let Some(ws) = self.writes.get_mut(w.0) {
                for part in ws.parts.iter_mut().filter(|p| p.frag == f) {
                    let (ol, oh) = (part.lo.max(lo), part.hi.min(hi));
                    if ol < oh {
                        overlapped = true;
                        part.spoiled
                            .get_or_insert_with(|| PageSet::new(ppf))
                            .insert_range(ol, oh);
                    }
                }
            }
        }
        (overlapped, pop_pages)
    }

    /// Lends `slots` to the write-back log (format 9's chunks of read slots): their
    /// fragments evicted, the slots out of the cache until [`Self::give_back_slot`], with
    /// one pass over the free list. Returns those an operation pins, to try again: their
    /// pages are dropped meanwhile (no new hit pins them, and what is in flight on them
    /// validates nothing), so the pins drain. Slots lent already are left as they are.
    pub fn lend_slots(&mut self, slots: &[SlotNo]) -> Vec<SlotNo> {
        let ppf = self.geo.pages_per_fragment();
        let mut busy = Vec::new();
        let mut take = Vec::with_capacity(slots.len());
        for &s in slots {
            if self.slots.is_lent(s) {
                continue;
            }
            if self.slot_is_packed(s) {
                match self.unpack_slot(s) {
                    true => take.push(s),
                    false => busy.push(s),
                }
                continue;
            }
            let frag = self.slots.fragment(s);
            if self.slots.pins(s) > 0 {
                if let Some(f) = frag {
                    crate::bitmap::clear_range(self.slots.bitmap_mut(s), 0, ppf);
                    self.spoil_in_flight(f, 0, ppf);
                }
                busy.push(s);
                continue;
            }
            if frag.is_some() {
                self.evict_slot(s);
            }
            take.push(s);
        }
        self.slots.lend_many(&take);
        busy
    }

    /// Gives back a slot lent to the write-back log: free for the cache again.
    pub fn give_back_slot(&mut self, s: SlotNo) -> bool {
        self.slots.give_back(s)
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
            self.share_count(f, false);
        }
        self.slots.assign(s, None);
        self.evict.removed(s);
    }

    /// Gives fragment `f` a slot: a free one, or the eviction policy's victim.
    /// A volume at its share takes the slot from its own fragments.
    pub(super) fn allocate(&mut self, f: FragNo) -> Option<SlotNo> {
        let free = match self.at_cap(f) {
            Some(_) => None,
            None => self.slots.take_free(),
        };
        let s = match free {
            Some(s) => s,
            None => {
                let s = self.victim_for(f)?;
                self.evict_slot(s);
                s
            }
        };
        self.slots.assign(s, Some(f));
        self.map.set(f, Some(s));
        self.evict.inserted(s);
        self.share_count(f, true);
        self.line_allocated(f);
        Some(s)
    }

    /// The victim whose slot fragment `f` would take: among its volume's fragments if that
    /// volume is at its share, else the policy's.
    pub(super) fn victim_for(&mut self, f: FragNo) -> Option<SlotNo> {
        match self.at_cap(f) {
            Some(k) => self.victim_in(k),
            None => self.victim(),
        }
    }
}
