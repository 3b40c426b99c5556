//! A lock on byte ranges of the volume: reads take theirs shared, writes (and cleaning)
//! exclusive. The write-back paths use it so that a read never sees a page while it is being
//! rewritten, nor a page the cleaner is taking away from under it. Its level `L` is the
//! lock's place in the order (`order.rs`): the log's range lock or its source order; a
//! range held through `lock` is checked and recorded as any lock, one taken with
//! `try_take` (held until a completion on another thread gives it back) is not. The list
//! of ranges behind it is a leaf.

use crate::order::{Level, Token};
use parking_lot::{Condvar, Mutex};
use std::marker::PhantomData;

/// Byte ranges in use: (start, end, exclusive); waiting happens on the condition variable.
pub(crate) struct RangeLock<L: Level> {
    ranges: Mutex<Vec<(u64, u64, bool)>>,
    cv: Condvar,
    _level: PhantomData<fn() -> L>,
}

impl<L: Level> Default for RangeLock<L> {
    fn default() -> Self {
        RangeLock {
            ranges: Mutex::default(),
            cv: Condvar::new(),
            _level: PhantomData,
        }
    }
}

/// A held byte range; released when dropped.
pub(crate) struct RangeGuard<'a, L: Level> {
    lock: &'a RangeLock<L>,
    range: (u64, u64, bool),
    _token: Token<L>,
}

impl<L: Level> Drop for RangeGuard<'_, L> {
    fn drop(&mut self) {
        self.lock.release_range(self.range);
    }
}

impl<L: Level> RangeLock<L> {
    /// Takes `[start, end)`, shared (reads) or exclusive (writes), waiting for conflicts.
    pub(crate) fn lock(&self, start: u64, end: u64, exclusive: bool) -> RangeGuard<'_, L> {
        let token = Token::enter();
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
            _token: token,
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
