//! A lock on byte ranges of the volume: reads take theirs shared, writes (and cleaning)
//! exclusive. The write-back paths use it so that a read never sees a page while it is being
//! rewritten, nor a page the cleaner is taking away from under it. Outermost in the lock
//! order (docs/ARCHITECTURE.md: taken before any core lock, never while one is held).

use parking_lot::{Condvar, Mutex};

/// Byte ranges in use: (start, end, exclusive); waiting happens on the condition variable.
#[derive(Default)]
pub(crate) struct RangeLock {
    ranges: Mutex<Vec<(u64, u64, bool)>>,
    cv: Condvar,
}

/// A held byte range; released when dropped.
pub(crate) struct RangeGuard<'a> {
    lock: &'a RangeLock,
    range: (u64, u64, bool),
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.lock.release_range(self.range);
    }
}

impl RangeLock {
    /// Takes `[start, end)`, shared (reads) or exclusive (writes), waiting for conflicts.
    pub(crate) fn lock(&self, start: u64, end: u64, exclusive: bool) -> RangeGuard<'_> {
        let mut r = self.ranges.lock();
        while r
            .iter()
            .any(|&(s, e, x)| s < end && start < e && (x || exclusive))
        {
            self.cv.wait(&mut r);
        }
        r.push((start, end, exclusive));
        RangeGuard {
            lock: self,
            range: (start, end, exclusive),
        }
    }

    /// Takes `[start, end)` exclusive if nothing overlaps it now (for a write that must not
    /// wait: it holds the range past this call, until it gives it back with `release`).
    pub(crate) fn try_take(&self, start: u64, end: u64) -> bool {
        let mut r = self.ranges.lock();
        if r.iter().any(|&(s, e, _)| s < end && start < e) {
            return false;
        }
        r.push((start, end, true));
        true
    }

    /// Gives back a range `try_take` took.
    pub(crate) fn release(&self, start: u64, end: u64) {
        self.release_range((start, end, true));
    }

    fn release_range(&self, range: (u64, u64, bool)) {
        let mut r = self.ranges.lock();
        if let Some(i) = r.iter().position(|x| *x == range) {
            r.swap_remove(i);
        }
        drop(r);
        self.cv.notify_all();
    }
}
