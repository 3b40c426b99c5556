//! Health: device errors counted against the error limit, and the passthrough flag (the
//! cache disabled itself and I/O goes to the source). What disabling does is the engine's
//! (`Engine::disable`, `engine.rs`); this is the state it decides on.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// Errors and passthrough.
pub(crate) struct Health {
    errors: AtomicU64,
    limit: u64,
    passthrough: AtomicBool,
}

impl Health {
    /// Disables the cache after `limit` device errors (at least one).
    pub(crate) fn new(limit: u64) -> Health {
        Health {
            errors: AtomicU64::new(0),
            limit: limit.max(1),
            passthrough: AtomicBool::new(false),
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

    /// Counts `n` errors: the total, if it reached the limit.
    pub(crate) fn count(&self, n: u64) -> Option<u64> {
        let total = self.errors.fetch_add(n, Relaxed) + n;
        (total >= self.limit).then_some(total)
    }
}
