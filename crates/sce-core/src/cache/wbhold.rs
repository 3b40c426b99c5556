//! What the engine's write-back persistence needs of the core: a fragment's dirty pages for
//! its record, holds on slots whose on-device records may still claim dirty pages (a held
//! slot is never given to another fragment), lost pages after a restart, and whether a
//! range holds lost pages.

use super::{fragments, CacheCore};
use crate::addr::{FragNo, SlotNo, SourceOffset};
use crate::bitmap::PageSet;

impl CacheCore {
    /// The dirty pages of fragment `f`, if any.
    pub fn dirty_pages_of(&self, f: FragNo) -> Option<&PageSet> {
        self.wb.dirty_of(f)
    }

    /// True if `[offset, offset + len)` holds a page whose only copy was lost.
    pub fn lost_in(&self, offset: SourceOffset, len: u64) -> bool {
        if self.wb.lost.is_empty() || len == 0 {
            return false;
        }
        let end = offset.0.saturating_add(len).min(self.geo.source_size());
        offset.0 < end
            && fragments(self.geo, offset.0, end - offset.0)
                .any(|(f, lo, hi, _, _)| self.wb.any_lost(f, lo, hi))
    }

    /// Holds slot `s` where it is (a pin): it is not evicted nor given to another fragment
    /// until [`CacheCore::release_slot`]. False if it could not be pinned.
    pub fn hold_slot(&mut self, s: SlotNo) -> bool {
        self.slots.pin(s)
    }

    /// Releases a hold taken by [`CacheCore::hold_slot`].
    pub fn release_slot(&mut self, s: SlotNo) {
        self.slots.unpin(s)
    }

    /// After a restart: page `p` of fragment `f` was dirty and its data did not survive.
    pub fn restore_lost(&mut self, f: FragNo, p: u32) {
        self.lose_page(f, p);
    }

    /// A write went to the source alone (the cache device failed): whole pages of
    /// `[offset, offset + len)` are new there and no longer lost.
    pub fn found_on_source(&mut self, offset: SourceOffset, len: u64) {
        if self.wb.lost.is_empty() || len == 0 {
            return;
        }
        let ps = crate::addr::PAGE_SIZE;
        let end = offset.0.saturating_add(len).min(self.geo.source_size());
        for (f, lo, hi, a, b) in fragments(self.geo, offset.0, end.saturating_sub(offset.0)) {
            let fstart = self.geo.fragment_start(f).0;
            let first = if a == fstart + lo as u64 * ps {
                lo
            } else {
                lo + 1
            };
            let last = if b == self.page_end(f, hi - 1) {
                hi
            } else {
                hi - 1
            };
            if first < last {
                self.wb.found(f, first, last);
            }
        }
    }

    /// True if write-back left nothing behind: no dirty or lost page, nothing in flight.
    pub fn writeback_clean(&self) -> bool {
        self.wb.is_clean()
    }
}
