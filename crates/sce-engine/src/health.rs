//! Health: device errors counted against the error limit, and passthrough (the cache
//! disables itself and I/O goes to the source) when they reach it or when a write intent
//! cannot be made durable.

use crate::persist::Ticket;
use crate::shared::Shared;
use sce_io::IoError;
use std::sync::atomic::Ordering::Relaxed;

impl Shared {
    /// Waits for intents to be durable. False if they could not be written: the cache device
    /// failed, and the cache is disabled (so nothing it holds is served or trusted again).
    pub(crate) fn wait_intents(&self, tickets: &[Ticket]) -> bool {
        let Some(p) = &self.persist else { return true };
        match p.sync(tickets) {
            Ok(()) => true,
            Err(e) => {
                self.disable(&format!("cannot write the write-intent bitmap: {e}"));
                false
            }
        }
    }

    /// Counts `n` cache-device errors; disables the cache once they reach the limit.
    pub(crate) fn device_errors(&self, n: u64, what: &str) {
        let total = self.errors.fetch_add(n, Relaxed) + n;
        if total >= self.error_limit {
            self.disable(&format!("{total} cache device errors, the last: {what}"));
        }
    }

    /// Disables the cache: from now on I/O passes through to the source.
    pub(crate) fn disable(&self, why: &str) {
        if self.wb.is_some() {
            // Before passthrough is visible: no read may find a dirty page valid and go
            // to the source for it (passthrough reads of dirty or lost pages fail, too).
            for core in self.cores.iter() {
                core.write().lose_all_dirty();
            }
        }
        if self.passthrough.swap(true, Relaxed) {
            return;
        }
        if self.wb.is_some() {
            // Write-back: the device holds the only copy of the dirty data. It is not marked
            // failed (a restart on a healthy device recovers what it holds, each page checked
            // against its checksum); until then dirty pages read as errors, writes are
            // refused (they could not be recorded), and clean reads go to the source.
            tracing::error!(
                "cache device failed in write-back: writes are refused and reads of data \
                 not yet on the source fail until a restart on a healthy device: {why}"
            );
            for core in self.cores.iter() {
                let mut core = core.write();
                core.lose_all_dirty();
                core.drop_all();
            }
            return;
        }
        tracing::error!("cache disabled, passing I/O through to the source: {why}");
        if let Some(p) = &self.persist {
            if let Err(e) = p.fail() {
                tracing::error!(
                    "could not mark the cache device failed ({e}); reformat it before reusing it"
                );
            }
        }
        for core in self.cores.iter() {
            core.write().drop_all();
        }
    }

    /// Counts a failed cache read towards the error limit.
    pub(crate) fn cache_read_failed(&self, e: &IoError) {
        self.counters.cache_read_errors.fetch_add(1, Relaxed);
        self.device_errors(1, &format!("read error: {e}"));
    }

    pub(crate) fn cache_write(&self, offset: u64, data: &[u8]) -> bool {
        match self.cache.write_at(offset, data) {
            Ok(()) => {
                self.counters
                    .cache_bytes_written
                    .fetch_add(data.len() as u64, Relaxed);
                true
            }
            Err(e) => {
                self.counters.cache_write_errors.fetch_add(1, Relaxed);
                self.device_errors(1, &format!("write error: {e}"));
                false
            }
        }
    }
}
