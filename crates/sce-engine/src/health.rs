//! Health: device errors counted against the error limit, and the passthrough flag (the
//! cache disabled itself and I/O goes to the source). What disabling does is the engine's
//! (`Engine::disable`, `engine.rs`); this is the state it decides on.

use crate::order::{levels, OrderedMutex};
/// This file's mutexes are leaves of the lock order (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use sce_io::outage::{OutageLine, OutageLog, SUMMARY_EVERY};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Instant, SystemTime};

/// Errors and passthrough.
pub(crate) struct Health {
    errors: AtomicU64,
    limit: u64,
    passthrough: AtomicBool,
    /// The errors' account for the logs: one outage for the device's life (nothing ends
    /// it), so the first error is told and the rest summarized.
    told: OutageLog,
    /// The last error, and when it came (a leaf lock).
    last: Mutex<Option<(SystemTime, String)>>,
}

impl Health {
    /// Disables the cache after `limit` device errors (at least one).
    pub(crate) fn new(limit: u64) -> Health {
        Health {
            errors: AtomicU64::new(0),
            limit: limit.max(1),
            passthrough: AtomicBool::new(false),
            told: OutageLog::default(),
            last: Mutex::new(None),
        }
    }

    /// The device errors so far, and the last with its time (None if none came).
    pub(crate) fn last_error(&self) -> (u64, Option<(SystemTime, String)>) {
        (self.errors.load(Relaxed), self.last.lock().clone())
    }

    /// A cache-device error (`what`) was counted, `total` so far: logs the first at once,
    /// then at most one summary per [`SUMMARY_EVERY`] with the count since the last line.
    pub(crate) fn log(&self, what: &str, total: u64) {
        *self.last.lock() = Some((SystemTime::now(), what.to_string()));
        match self.told.failed(Instant::now(), what) {
            Some(OutageLine::Started(_)) => tracing::warn!(
                "cache device error: {what} ({total} so far, of {} before the cache disables \
                 itself; further errors are summarized every {} s)",
                self.limit,
                SUMMARY_EVERY.as_secs()
            ),
            Some(OutageLine::Summary { failed, over, .. }) => tracing::warn!(
                "{failed} more cache device errors in the last {} s ({total} so far), the last: {what}",
                over.as_secs()
            ),
            _ => {}
        }
    }

    /// True once the cache disabled itself.
    pub(crate) fn passthrough(&self) -> bool {
        self.passthrough.load(Relaxed)
    }

    /// Sets passthrough; true if it was set already.
    pub(crate) fn enter_passthrough(&self) -> bool {
        self.passthrough.swap(true, Relaxed)
    }

    /// Counts `n` errors: the total so far, and whether it reached the limit.
    pub(crate) fn count(&self, n: u64) -> (u64, bool) {
        let total = self.errors.fetch_add(n, Relaxed) + n;
        (total, total >= self.limit)
    }
}
