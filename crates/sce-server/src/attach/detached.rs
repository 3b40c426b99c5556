//! Writes served while an export is detached: counted, and their ranges kept (merged, at
//! most [`MAX_RANGES`]), so that an attach drops only what they changed and keeps the rest
//! of the cache warm. Past the bound (or in a shared device's export) an attach starts cold,
//! as it did before ranges were kept.
//!
//! The ranges live in memory only. That is safe: the device stays marked detached on the
//! device itself until the attach has dropped the written ranges and made that durable
//! (`Attachable::attach`), and a start that finds the mark trusts nothing of it. A crash
//! while detached therefore costs the warm cache, never the data.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Ranges kept at most; one more and an attach starts cold.
pub(crate) const MAX_RANGES: usize = 4096;

/// Writes served while detached since the last attach.
pub(crate) struct DetachedWrites {
    count: AtomicU64,
    /// Sorted, disjoint, merged `(start, end)` byte ranges; None once over the bound.
    ranges: Mutex<Option<Vec<(u64, u64)>>>,
}

impl DetachedWrites {
    /// None written yet.
    pub(crate) fn new() -> Self {
        DetachedWrites {
            count: AtomicU64::new(0),
            ranges: Mutex::new(Some(Vec::new())),
        }
    }

    /// A write or discard of `[offset, offset + len)` is about to reach the source (counted
    /// before it is sent: an attach that sees the count unchanged knows no write it missed
    /// can land on the source later).
    pub(crate) fn note(&self, offset: u64, len: u64) {
        self.count.fetch_add(1, Relaxed);
        let mut g = self.ranges.lock();
        let Some(r) = g.as_mut() else {
            return;
        };
        let (mut a, mut b) = (offset, offset.saturating_add(len));
        // Every range that touches [a, b) merges into it.
        let lo = r.partition_point(|&(_, e)| e < a);
        let hi = r.partition_point(|&(s, _)| s <= b);
        if lo < hi {
            a = a.min(r[lo].0);
            b = b.max(r[hi - 1].1);
        }
        r.splice(lo..hi, [(a, b)]);
        if r.len() > MAX_RANGES {
            *g = None;
        }
    }

    /// Writes since the last reset.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// The ranges written since the last reset, None if too many were.
    pub(crate) fn ranges(&self) -> Option<Vec<(u64, u64)>> {
        self.ranges.lock().clone()
    }

    /// Starts over (the cache is attached, or detached afresh).
    pub(crate) fn reset(&self) {
        *self.ranges.lock() = Some(Vec::new());
        self.count.store(0, Relaxed);
    }
}

impl super::Attachable {
    /// At an attach, under the gate, with volume `v` opened (trusting the device if `warm`,
    /// its "detached" mark kept; cold otherwise, after `written` writes): drops every page
    /// of the ranges written while detached or attaching, makes that durable, then clears
    /// the mark. Returns why the cache starts cold, if it does after all (the ranges
    /// overflowed, or writes came while a cold device was opening, or the records could not
    /// be written).
    pub(super) fn settle_detached(
        &self,
        v: &sce_engine::CacheVolume,
        warm: bool,
        written: u64,
    ) -> Option<String> {
        let late = self.count_and_ranges();
        let forget = |why: String| {
            let (_, errors) = v.forget();
            let tail = if errors > 0 {
                " (and its records could not be written)"
            } else {
                ""
            };
            Some(format!("{why}{tail}"))
        };
        if !warm {
            // Opened cold; writes while it opened changed pages it may have restored since.
            if late.0 == written {
                return None;
            }
            return forget(format!(
                "{} write(s) reached the source while the cache was detached or attaching",
                late.0
            ));
        }
        let why = match late.1 {
            None => Some(format!("{} write(s) reached the source while the cache was detached or attaching, over more ranges than are kept", late.0)),
            Some(ranges) => self.drop_ranges(v, &ranges),
        };
        let why = why.and_then(forget);
        if let Err(e) = v.set_detached(0, false) {
            // The mark stays: a start trusts nothing of the device, which is safe.
            tracing::warn!(target: crate::LOG_TARGET, "attach: the cache device's detached mark could not be cleared ({e}): a restart will start it cold");
        }
        why
    }

    fn count_and_ranges(&self) -> (u64, Option<Vec<(u64, u64)>>) {
        (self.detached.count(), self.detached.ranges())
    }

    /// Drops the cached pages of `ranges` (widened to whole pages) and writes the records;
    /// why it could not, if it could not.
    fn drop_ranges(&self, v: &sce_engine::CacheVolume, ranges: &[(u64, u64)]) -> Option<String> {
        let (page, size) = (sce_core::PAGE_SIZE, self.source.size());
        let mut dropped = 0;
        for &(a, b) in ranges {
            let (a, b) = (
                a / page * page,
                b.div_ceil(page).saturating_mul(page).min(size),
            );
            if a < b {
                dropped += v.evict(a, b - a).unwrap_or(0);
            }
        }
        let errors = v.flush_metadata();
        if errors > 0 {
            return Some(format!(
                "{errors} metadata writes failed while dropping what was written while detached"
            ));
        }
        if !ranges.is_empty() {
            tracing::info!(target: crate::LOG_TARGET, ranges = ranges.len(), dropped_bytes = dropped, "attach: dropped what was written while the cache was detached; the rest stays warm");
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_overflow_to_none() {
        let w = DetachedWrites::new();
        w.note(100, 10);
        w.note(0, 10);
        w.note(10, 5); // touches [0, 10): merges
        w.note(200, 50);
        w.note(90, 120); // bridges [100, 110) and [200, 250)
        assert_eq!(w.ranges(), Some(vec![(0, 15), (90, 250)]));
        assert_eq!(w.count(), 5);
        for i in 0..MAX_RANGES as u64 {
            w.note(1_000 + i * 10, 1);
        }
        assert_eq!(w.ranges(), None, "over the bound: cold");
        w.reset();
        assert_eq!((w.ranges(), w.count()), (Some(vec![]), 0));
    }
}
