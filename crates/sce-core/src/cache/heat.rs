//! Heat regions and lines: heat is tracked per region of `heat_size` bytes (the SCE paper's
//! fragment: the hotness window, the frequency sketch, the stream detector and the eviction
//! duel all count regions), while cache space is allocated and filled per line of
//! `fragment_size` bytes (the core's `FragNo` and `SlotNo`). With `heat_size` equal to
//! `fragment_size` a region is one line and the two are the same thing.
//!
//! A hot region is populated one line at a time, and only the lines of it that were touched
//! since it was last picked: the window remembers which 64ths of a region were touched, and a
//! line whose 64ths were not is left to the source. So a region whose hot part is 64 KiB
//! costs its lines, not `heat_size` bytes of cache.

use super::{fragments, CacheCore};
use crate::addr::{FragNo, PAGE_SHIFT, PAGE_SIZE};
use crate::admit::StreamVerdict;
use crate::bitmap::PageSet;

/// Why [`CacheCore::room_by_duel`] made no room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Duel {
    /// No slot can be evicted (all pinned).
    NoVictim,
    /// The line's region is not hotter than the victim's by the margin.
    Lost,
}

/// With the page area, a line without a slot is populated only if it is dense (its pages
/// were admitted one at a time often enough, `CacheCore::dense`) or the window saw reads or
/// writes in this many distinct 64ths of its region (issue 47: on cloudPhysicsIO's trace,
/// whose written data is read back, 2 cost 0.8x more cache writes on the Zipf trace, and
/// without the rule reads of written data missed: 0.47 read hit at 100% against 0.63).
const DENSE_PARTS: u32 = 3;

/// The bits `[a, b]` (inclusive) of a 64-bit mask.
fn bits(a: u32, b: u32) -> u64 {
    let upper = if b >= 63 {
        u64::MAX
    } else {
        (1u64 << (b + 1)) - 1
    };
    upper & !((1u64 << a.min(63)) - 1)
}

impl CacheCore {
    /// log2 of the lines per region.
    #[inline]
    pub(super) fn line_bits(&self) -> u32 {
        self.cfg.heat_bytes().trailing_zeros() - self.geo.fragment_shift()
    }

    /// The first page of line `f` within its region.
    fn line_base(&self, f: FragNo) -> u32 {
        (f.0 & ((1 << self.line_bits()) - 1)) as u32 * self.geo.pages_per_fragment()
    }

    /// The region (heat unit) line `f` belongs to.
    #[inline]
    pub(super) fn region(&self, f: FragNo) -> FragNo {
        FragNo(f.0 >> self.line_bits())
    }

    /// The lines of region `r` that exist on the source.
    pub(super) fn lines(&self, r: FragNo) -> impl Iterator<Item = FragNo> {
        let b = self.line_bits();
        let end = ((r.0 + 1) << b).min(self.geo.source_fragments());
        ((r.0 << b)..end).map(FragNo)
    }

    /// Pages per region.
    fn region_pages(&self) -> u32 {
        self.geo.pages_per_fragment() << self.line_bits()
    }

    /// Pages per 64th of a region (at least one page).
    fn part_pages(&self) -> u32 {
        self.region_pages().div_ceil(64).max(1)
    }

    /// The 64ths of a region that its pages `[lo, hi)` fall in.
    fn parts_mask(&self, lo: u32, hi: u32) -> u64 {
        let per = self.part_pages();
        bits(lo / per, (hi.max(lo + 1) - 1) / per)
    }

    /// The 64ths of its region that line `f` covers.
    pub(super) fn line_parts(&self, f: FragNo) -> u64 {
        let lo = self.line_base(f);
        self.parts_mask(lo, lo + self.geo.pages_per_fragment())
    }

    /// The heat of line `f`'s region in the frequency sketch (0 without one).
    pub(super) fn heat(&self, f: FragNo) -> u32 {
        let r = self.region(f);
        self.sketch.as_ref().map_or(0, |s| s.estimate(r.0))
    }

    /// Makes room for line `f` if it needs a slot and the cache (or its volume's share) is
    /// full: the eviction victim is evicted only if `f`'s region is hotter than the victim's
    /// by the admission margin in the frequency sketch (the duel of admission `sce`, for
    /// population and miss fills alike).
    pub(super) fn room_by_duel(&mut self, f: FragNo) -> Result<(), Duel> {
        if self.map.get(f).is_some() || (self.slots.free_count() > 0 && self.at_cap(f).is_none()) {
            return Ok(());
        }
        if self.at_cap(f).is_none() && self.area_yields() {
            return Ok(());
        }
        if self.cfg.recency_window > 0 && self.at_cap(f).is_none() {
            return self.room_by_window(f);
        }
        let victim = self.victim_for(f).ok_or(Duel::NoVictim)?;
        let vf = self.slots.fragment(victim).expect("victims hold fragments");
        if !self.out_heats(f, vf) {
            self.stats.admissions_rejected += 1;
            return Err(Duel::Lost);
        }
        self.evict_slot(victim);
        self.slots.put_free(victim);
        Ok(())
    }

    /// True if `f`'s region is hotter than `vf`'s by the admission margin in the frequency
    /// sketch: `f` wins the duel against the victim `vf`.
    fn out_heats(&self, f: FragNo, vf: FragNo) -> bool {
        self.heat(f) >= self.heat(vf).saturating_add(self.cfg.admission_margin)
    }

    /// Lines the recency window holds at most.
    fn recent_cap(&self) -> usize {
        ((self.geo.slots() as u64 * self.cfg.recency_window as u64) / 1000).max(1) as usize
    }

    /// `room_by_duel` with a recency window (W-TinyLFU): line `f` always gets room and
    /// joins the window; while the window is full, its oldest line still cached duels the
    /// eviction victim: it stays (leaving the window for the main cache) if its region is
    /// hotter by the admission margin, and the victim is evicted; otherwise it is the one
    /// evicted. Until the window is full, the victim is evicted without a duel.
    fn room_by_window(&mut self, f: FragNo) -> Result<(), Duel> {
        let mut out = None;
        while out.is_none() && self.recent.len() >= self.recent_cap() {
            let c = self.recent.pop_front().expect("a full window");
            let Some(cs) = self.map.get(c) else {
                continue; // left the cache since
            };
            let victim = self.victim_for(f).ok_or(Duel::NoVictim)?;
            let vf = self.slots.fragment(victim).expect("victims hold fragments");
            // A window line in use (pinned) cannot go: it stays, the victim goes.
            out = Some(
                if (vf != c && self.out_heats(c, vf)) || self.slots.pins(cs) > 0 {
                    victim
                } else {
                    self.stats.admissions_rejected += 1;
                    cs
                },
            );
        }
        let out = match out {
            Some(s) => s,
            None => self.victim_for(f).ok_or(Duel::NoVictim)?,
        };
        self.evict_slot(out);
        self.slots.put_free(out);
        self.recent.push_back(f);
        Ok(())
    }

    /// A line of region `r` to populate: the first one touched since the region was last
    /// picked that has pages to fill (and, with `only_cached`, already a slot, so that
    /// filling it evicts nothing).
    pub(super) fn candidate_line(&self, r: FragNo, only_cached: bool) -> Option<FragNo> {
        let touched = self.window.parts(r);
        self.lines(r).find(|&f| {
            touched & self.line_parts(f) != 0
                && (!only_cached || self.map.get(f).is_some())
                && (self.map.get(f).is_some()
                    || self.dense(f)
                    || (touched & self.line_parts(f)).count_ones() >= DENSE_PARTS)
                && self.worth_populating(f)
                && (!self.cfg.partial_fill
                    || self.fillable(f, self.fill_hint(f).as_ref()).is_some())
        })
    }

    /// Line `f` was picked: its 64ths are no longer owed a fill, and the region's count
    /// starts over once none is.
    pub(super) fn line_picked(&mut self, f: FragNo) {
        let r = self.region(f);
        self.window.clear_parts(r, self.line_parts(f));
        if self.window.parts(r) == 0 {
            self.window.reset(r);
        }
    }

    /// With `partial_fill`, the pages of line `f` in the 64ths of its region touched since it
    /// was last picked; the whole line if half of its 64ths or more were.
    pub(super) fn fill_hint(&self, f: FragNo) -> Option<PageSet> {
        if !self.cfg.partial_fill {
            return None;
        }
        let mine = self.line_parts(f);
        let parts = self.window.parts(self.region(f)) & mine;
        if parts.count_ones() * 2 >= mine.count_ones() || parts == 0 {
            return None;
        }
        let ppf = self.geo.pages_per_fragment();
        let base = self.line_base(f);
        let per = self.part_pages();
        let n = self.geo.fragment_pages(f);
        let mut set = PageSet::new(ppf);
        for i in (0..64).filter(|i| parts & (1 << i) != 0) {
            let lo = (i * per).max(base) - base;
            let hi = ((i + 1) * per).min(base + ppf) - base;
            let (lo, hi) = (lo.min(n), hi.min(n));
            if lo < hi {
                set.insert_range(lo, hi);
            }
        }
        Some(set)
    }

    /// True if a request of `len` bytes of a sequential stream is one whose own data fills
    /// the cache (a read of at least a line, with miss fills), not population.
    pub(super) fn stream_fills(&self, len: u64, write: bool) -> bool {
        !write && self.cfg.fills_from_misses() && len >= 1 << self.geo.fragment_shift()
    }

    /// Accounts one request of `len` bytes at `offset` (a read, or a write if `write`): per
    /// region it covers, one touch of the hotness window and the sketch; per line, the
    /// `nhit` counters and the eviction policy. Under admission `sce`, a request that
    /// continues a stream inside the region it last touched adds no touch, and a request of
    /// a sequential stream adds nothing at all (once the cache is full; a read at once when
    /// misses fill the cache); returns true for those.
    pub(super) fn note_access(
        &mut self,
        offset: u64,
        len: u64,
        verdict: StreamVerdict,
        write: bool,
    ) -> bool {
        if !self.cfg.write_mode.caches_reads() {
            // Passthrough: nothing is learnt, so nothing is populated.
            return false;
        }
        // With miss fills, a stream of reads as large as the cache's lines raises no heat,
        // full or not: population would read its data from the source a second time, on
        // the bandwidth the stream itself is using (a cold copy of a volume behind a
        // link-limited source ran at 0.81x of the source alone, issue 46). While the cache
        // has room its reads fill it from the data in hand instead (`wants_fills`): data
        // read in sequence is often read again. A stream of smaller reads keeps its heat
        // until the cache is full: population fills whole lines, ahead of the stream (read
        // hit 0.03 higher on cloudPhysicsIO's trace at 100% than without), and so do
        // streams without miss fills (population is then the only way in) and writes.
        if verdict.sequential && (self.stream_fills(len, write) || self.slots.free_count() == 0) {
            self.stats.sequential_requests += 1;
            return true;
        }
        if !write {
            self.note_sparse(offset, len);
        }
        let shift = self.geo.fragment_shift() + self.line_bits();
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let r = at >> shift;
            let rstart = r << shift;
            let b = end.min(rstart + (1 << shift));
            let lo = ((at - rstart) >> PAGE_SHIFT) as u32;
            let hi = (b - rstart).div_ceil(PAGE_SIZE) as u32;
            let parts = self.parts_mask(lo, hi);
            if verdict.same_fragment {
                self.window.add_parts(FragNo(r), parts);
            } else {
                self.window.touch_parts(FragNo(r), parts);
                if let Some(sk) = &mut self.sketch {
                    sk.add(r);
                }
            }
            at = b;
        }
        if verdict.same_fragment {
            return false;
        }
        for (f, ..) in fragments(self.geo, offset, len) {
            let slot = self.map.get(f);
            if let Some(n) = &mut self.nhit {
                if slot.is_none() {
                    n.touch(f);
                }
            }
            if let Some(s) = slot {
                self.evict.accessed(s);
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::bits;

    #[test]
    fn bit_ranges() {
        assert_eq!(bits(0, 0), 1);
        assert_eq!(bits(0, 63), u64::MAX);
        assert_eq!(bits(2, 3), 0b1100);
        assert_eq!(bits(63, 63), 1 << 63);
    }
}
