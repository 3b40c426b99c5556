//! What the engine's write-back persistence needs of the core: a fragment's dirty pages for
//! its record, holds on slots whose on-device records may still claim dirty pages (a held
//! slot is never given to another fragment), lost pages after a restart, and whether (and
//! how many) pages of a range only the cache holds.

use super::{fragments, CacheCore};
use crate::addr::{FragNo, SlotNo, SourceOffset};
use crate::bitmap::{self, PageSet};

impl CacheCore {
    /// The dirty pages of fragment `f`, if any.
    pub fn dirty_pages_of(&self, f: FragNo) -> Option<&PageSet> {
        self.wb.dirty_of(f)
    }

    /// The pages of fragment `f` whose only copy was lost, if any.
    pub fn lost_pages_of(&self, f: FragNo) -> Option<&PageSet> {
        self.wb.lost.get(&f.0)
    }

    /// The first fragment of `from..end` that holds a dirty or lost page (block status
    /// reports it as data whatever the source's map says).
    pub fn first_dirty_fragment(&self, from: FragNo, end: FragNo) -> Option<FragNo> {
        let first = |m: &std::collections::BTreeMap<u64, PageSet>| {
            m.range(from.0..end.0).next().map(|(&f, _)| f)
        };
        let (dirty, lost) = (first(&self.wb.dirty), first(&self.wb.lost));
        dirty.into_iter().chain(lost).min().map(FragNo)
    }

    /// True if `[offset, offset + len)` holds a page whose only copy was lost.
    pub fn lost_in(&self, offset: SourceOffset, len: u64) -> bool {
        !self.wb.lost.is_empty()
            && self.any_in(offset, len, |f, lo, hi| self.wb.any_lost(f, lo, hi))
    }

    /// True if `[offset, offset + len)` holds a page only the cache has, or had: dirty or
    /// lost (a read of it must not go to the source).
    pub fn dirty_or_lost_in(&self, offset: SourceOffset, len: u64) -> bool {
        !(self.wb.dirty.is_empty() && self.wb.lost.is_empty())
            && self.any_in(offset, len, |f, lo, hi| {
                self.wb.any_lost(f, lo, hi) || self.wb.any_dirty(f, lo, hi)
            })
    }

    /// The dirty pages and the lost pages in `[offset, offset + len)`: what only the cache
    /// holds there, or held (a forget keeps them; `sce ctl forget` says how many).
    pub fn dirty_and_lost_in(&self, offset: SourceOffset, len: u64) -> (u64, u64) {
        let end = offset.0.saturating_add(len).min(self.geo.source_size());
        let (mut dirty, mut lost) = (0, 0);
        if offset.0 >= end {
            return (0, 0);
        }
        for (f, lo, hi, _, _) in fragments(self.geo, offset.0, end - offset.0) {
            if let Some(d) = self.wb.dirty_of(f) {
                dirty += u64::from(bitmap::count(d.words(), lo, hi));
            }
            if let Some(l) = self.wb.lost.get(&f.0) {
                lost += u64::from(bitmap::count(l.words(), lo, hi));
            }
        }
        (dirty, lost)
    }

    /// True if `pages(fragment, first, end)` holds for a fragment of `[offset, offset + len)`.
    fn any_in(
        &self,
        offset: SourceOffset,
        len: u64,
        pages: impl Fn(FragNo, u32, u32) -> bool,
    ) -> bool {
        let end = offset.0.saturating_add(len).min(self.geo.source_size());
        offset.0 < end
            && fragments(self.geo, offset.0, end - offset.0)
                .any(|(f, lo, hi, _, _)| pages(f, lo, hi))
    }

    /// Holds slot `s` where it is (a pin): it is not evicted nor given to another fragment
    /// until [`CacheCore::release_slot`]. False if it could not be pinned.
    ///
    /// Raw: the property tests only; drivers use [`super::SlotHold`].
    #[doc(hidden)]
    pub fn hold_slot(&mut self, s: SlotNo) -> bool {
        self.slots.pin(s)
    }

    /// Releases a hold taken by [`CacheCore::hold_slot`].
    ///
    /// Raw: the property tests only; drivers use [`super::SlotHold`].
    #[doc(hidden)]
    pub fn release_slot(&mut self, s: SlotNo) {
        self.slots.unpin(s)
    }

    /// The cache device failed: every dirty page is lost (reads of it fail), held slots
    /// included.
    pub fn lose_all_dirty(&mut self) {
        let ppf = self.geo.pages_per_fragment();
        let frags: Vec<u64> = self.wb.dirty.keys().copied().collect();
        for f in frags {
            self.lose_dirty(FragNo(f), 0, ppf);
        }
    }

    /// Fragments holding dirty pages (each pins a whole slot).
    pub fn dirty_fragments(&self) -> u64 {
        self.wb.dirty.len() as u64
    }

    /// True if write-back left nothing behind: no dirty or lost page, nothing in flight.
    pub fn writeback_clean(&self) -> bool {
        self.wb.is_clean()
    }
}
