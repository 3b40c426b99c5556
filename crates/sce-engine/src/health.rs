//! Health: device errors counted against the error limit, and the passthrough flag (the
//! cache disabled itself and I/O goes to the source). What disabling does is the engine's
//! (`Engine::disable`, `engine.rs`); this is the state it decides on.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// At most one summary line of cache-device errors per this interval.
const SUMMARY_EVERY: Duration = Duration::from_secs(30);

/// Errors and passthrough.
pub(crate) struct Health {
    errors: AtomicU64,
    limit: u64,
    passthrough: AtomicBool,
    /// When errors were last logged, and how many came since (a leaf lock).
    told: Mutex<Option<(Instant, u64)>>,
    /// The last error, and when it came (a leaf lock).
    last: Mutex<Option<(std::time::SystemTime, String)>>,
}

impl Health {
    /// Disables the cache after `limit` device errors (at least one).
    pub(crate) fn new(limit: u64) -> Health {
        Health {
            errors: AtomicU64::new(0),
            limit: limit.max(1),
            passthrough: AtomicBool::new(false),
            told: Mutex::new(None),
            last: Mutex::new(None),
        }
    }

    /// The device errors so far, and the last with its time (None if none came).
    pub(crate) fn last_error(&self) -> (u64, Option<(std::time::SystemTime, String)>) {
        (self.errors.load(Relaxed), self.last.lock().clone())
    }

    /// A cache-device error (`what`) was counted, `total` so far: logs the first at once,
    /// then at most one summary per [`SUMMARY_EVERY`] with the count since the last line.
    pub(crate) fn log(&self, what: &str, total: u64) {
        *self.last.lock() = Some((std::time::SystemTime::now(), what.to_string()));
        let now = Instant::now();
        let line = {
            let mut t = self.told.lock();
            match t.as_mut() {
                None => {
                    *t = Some((now, 0));
                    Some(0)
                }
                Some((at, untold)) if now.duration_since(*at) >= SUMMARY_EVERY => {
                    let n = std::mem::take(untold) + 1;
                    *at = now;
                    Some(n)
                }
                Some((_, untold)) => {
                    *untold += 1;
                    None
                }
            }
        };
        match line {
            None => {}
            Some(0) => tracing::warn!(
                "cache device error: {what} ({total} so far, of {} before the cache disables \
                 itself; further errors are summarized every {} s)",
                self.limit,
                SUMMARY_EVERY.as_secs()
            ),
            Some(n) => tracing::warn!(
                "{n} more cache device errors in the last {} s ({total} so far), the last: {what}",
                SUMMARY_EVERY.as_secs()
            ),
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
