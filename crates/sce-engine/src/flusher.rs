//! The persistence threads: the metadata flusher (a flush round every `flush_interval`, then
//! the source's identity once its writes settled) and the intent writer (makes the intents
//! set ahead of need durable, in the background). The rounds themselves are
//! `persist::round`'s; this file hands them the core shards' locks, the shard map and the
//! checksums.

use crate::shared::Shared;
use sce_store::CrcTable;
use std::sync::atomic::{Ordering::Relaxed, Ordering::SeqCst};

impl Shared {
    /// The page checksums, which persistence always keeps.
    fn persisted_crcs(&self) -> &CrcTable {
        self.crcs.as_ref().expect("persistence keeps checksums")
    }

    /// Runs one metadata flush round now; returns the metadata errors it met (0 without
    /// persistence).
    pub(crate) fn flush_metadata(&self) -> u64 {
        match &self.persist {
            Some(p) => p.round((&self.cores, &self.map), self.persisted_crcs(), false),
            None => 0,
        }
    }

    /// Clean shutdown of the store (nothing in flight): see `Persist::close`. False without
    /// persistence.
    pub(crate) fn close_store(&self) -> bool {
        match &self.persist {
            Some(p) => {
                let (ids, taken) = self.identities();
                let closed = p.close(
                    (&self.cores, &self.map),
                    self.persisted_crcs(),
                    &ids,
                    self.source_writes_done.load(SeqCst),
                );
                if !closed {
                    self.restore_written(&taken);
                }
                closed
            }
            None => false,
        }
    }
}

/// Makes the intents set ahead of need durable, in the background, as they come; runs a
/// flush round early when the write journal's ring is half full.
pub(crate) fn intent_writer(s: &Shared) {
    let Some(p) = &s.persist else { return };
    loop {
        {
            let mut pending = s.intent_pending.lock();
            while !*pending && !s.shutdown.load(Relaxed) {
                s.intent_wake.wait(&mut pending);
            }
            if s.shutdown.load(Relaxed) {
                return;
            }
            *pending = false;
        }
        if s.passthrough.load(Relaxed) {
            continue;
        }
        if let Err(e) = p.write_pending() {
            s.device_errors(1, &format!("intent write failed: {e}"));
        }
        // The write journal's ring is half full: a round now frees its blocks.
        if p.take_round_wanted() {
            let errors = s.flush_metadata();
            if errors > 0 {
                s.device_errors(errors, "metadata write failed or read back wrong");
            }
        }
    }
}

/// The metadata flusher: a round every `flush_interval`, then the source's identity.
pub(crate) fn flusher(s: &Shared) {
    let Some(p) = &s.persist else { return };
    loop {
        if !s.sleep(p.cfg.flush_interval) {
            return;
        }
        if s.passthrough.load(Relaxed) {
            continue;
        }
        let mut errors = s.flush_metadata();
        // Record the source's identity once its writes have settled (our own writes change
        // a file's modification time), so that a start after a crash can tell whether anyone
        // else changed it since.
        let done = s.source_writes_done.load(SeqCst);
        if s.source_writes_started.load(SeqCst) == done {
            let (identities, taken) = s.identities();
            if s.source_writes_started.load(SeqCst) != done {
                s.restore_written(&taken);
            } else if p.record_identity(&identities, done).is_err() {
                s.restore_written(&taken);
                errors += 1;
            }
        }
        if errors > 0 {
            s.device_errors(errors, "metadata write failed or read back wrong");
        }
    }
}
