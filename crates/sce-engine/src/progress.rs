//! A progress counter that waiters sleep on: bumped whenever something completes that may
//! let a waiting request go on (room freed, a commit or a cleaning done). Both write-back
//! paths use it (`back/`, `log/`). A leaf lock.

use crate::order::{levels, OrderedMutex};
use parking_lot::Condvar;
use std::time::Duration;

#[derive(Default)]
pub(crate) struct Progress {
    n: OrderedMutex<levels::Leaf, u64>,
    cv: Condvar,
}

impl Progress {
    /// Something completed: waiters retry.
    pub(crate) fn bump(&self) {
        *self.n.lock() += 1;
        self.cv.notify_all();
    }

    /// The count now (to pass to `wait`).
    pub(crate) fn now(&self) -> u64 {
        *self.n.lock()
    }

    /// Waits for progress since `seen`, at most `d`.
    pub(crate) fn wait(&self, seen: u64, d: Duration) {
        let mut n = self.n.lock();
        if *n == seen {
            n.wait_for(&self.cv, d);
        }
    }
}
