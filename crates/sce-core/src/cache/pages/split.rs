//! How the cache's slots are split between the page area and lines: the area takes free
//! slots as it needs them; once the cache is full, each epoch (a quarter of the cache's
//! pages read) compares read hits per slot on both sides and lets a few slots change sides.

use super::super::CacheCore;
use super::Sparse;

impl Sparse {
    /// Slots that may change sides per epoch.
    pub(super) fn step(slots: u32) -> u32 {
        (slots / 16).max(1)
    }
}

impl CacheCore {
    /// Grows the area by one slot if `page`'s set has no empty way and a slot can be had: a
    /// free one, or (if the area is 7/8 full and the last epoch said pages earn more per
    /// slot than lines) the line eviction victim's.
    pub(super) fn maybe_grow_area(&mut self, page: u64) {
        let sp = self.sparse.as_ref().expect("area");
        let (cap, valid) = (sp.area.capacity(), sp.area.valid_pages());
        // Free space costs nothing: any set without room grows the area. Otherwise a slot
        // is taken from a line only once the area is nearly full.
        let free = self.slots.free_count() > 0;
        if (!free && cap > 0 && valid * 8 < cap * 7)
            || sp.area.has_room(page, |s| self.slots.pins(s) > 0)
        {
            return;
        }
        let s = match self.slots.take_free() {
            Some(s) => s,
            None if sp.grow_ok > 0 => match self.victim() {
                Some(s) => {
                    self.evict_slot(s);
                    self.sparse.as_mut().expect("area").grow_ok -= 1;
                    s
                }
                None => return,
            },
            None => return,
        };
        self.sparse.as_mut().expect("area").area.grow(s);
    }

    /// Gives the area's last slot back (free) if the last epoch said lines earn more per
    /// slot and it can be had now; true if it did.
    pub(in crate::cache) fn area_yields(&mut self) -> bool {
        let slots = &self.slots;
        let Some(sp) = self.sparse.as_mut() else {
            return false;
        };
        if sp.yield_ok == 0 || !sp.area.can_shrink(|s| slots.pins(s) > 0) {
            return false;
        }
        let (s, _) = sp.area.shrink().expect("checked");
        sp.yield_ok -= 1;
        self.slots.put_free(s);
        true
    }

    /// Counts read pages for the epoch (`area` of `hits` were page-area hits, `dense` of
    /// `misses` in dense lines without a slot) and, at its end, decides whether the area may
    /// grow into lines' slots or should give one back.
    ///
    /// Lines with fewer slots than one step cannot show what a slot earns them: there, the
    /// pages their dense lines missed count as the hits those lines would have had in one
    /// step's slots. Without it an area that held every slot when the workload shifted to
    /// dense lines kept them all: no line had a slot to earn hits, no line could evict
    /// another, and the area's old pages earned nothing.
    pub(in crate::cache) fn epoch_sparse(&mut self, hits: u64, area: u64, misses: u64, dense: u64) {
        let total_pages = self.geo.slots() as u64 * self.geo.pages_per_fragment() as u64;
        let free = self.slots.free_count();
        let Some(sp) = self.sparse.as_mut() else {
            return;
        };
        sp.area_hits += area;
        sp.line_hits += hits - area;
        sp.dense_missed += dense;
        sp.epoch_pages += hits + misses;
        if sp.epoch_pages < (total_pages / 4).max(4096) {
            return;
        }
        let area_slots = sp.area.slots().len() as u64;
        let step = Sparse::step(self.geo.slots());
        let line_slots = (self.geo.slots() - free) as u64 - area_slots;
        // Hits per slot, compared without division: a / as against l / ls. Lines' own
        // rate, and (while they hold under one step) the rate their dense lines' misses
        // would have earned in one step's slots: the area yields if either says lines earn
        // twice its rate, and grows only if neither says lines earn more.
        let rates = |hits: u64, slots: u64| (sp.area_hits * slots, hits * area_slots.max(1));
        let own = rates(sp.line_hits, line_slots.max(1));
        let stand_in =
            (line_slots < step as u64).then(|| rates(sp.line_hits + sp.dense_missed, step as u64));
        let grow = own.0 > own.1 && stand_in.is_none_or(|(pa, pl)| pa > pl);
        let give = own.0 * 2 < own.1 || stand_in.is_some_and(|(pa, pl)| pa * 2 < pl);
        sp.grow_ok = if grow || area_slots == 0 { step } else { 0 };
        sp.yield_ok = if area_slots > 0 && give { step } else { 0 };
        (sp.area_hits, sp.line_hits, sp.dense_missed, sp.epoch_pages) = (0, 0, 0, 0);
    }
}
