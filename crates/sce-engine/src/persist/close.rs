//! The clean close of the persistent store: every record written, every intent cleared,
//! the device marked clean (a start then trusts it without a crash's recovery).

use super::Persist;
use crate::cores::Cores;
use crate::crcs::CrcCache;
use crate::devices::Devices;
use std::sync::atomic::Ordering::Relaxed;

impl Persist {
    /// True if every intent is clear and nothing is queued.
    pub(super) fn settled(&self) -> bool {
        let st = self.st.lock();
        st.redo.is_empty() && st.units.is_empty() && st.intents.iter().all(|&w| w == 0)
    }

    /// Clean shutdown (nothing in flight): writes every record, clears every intent and marks
    /// the device clean. Returns false if it could not (the device stays "open" and the next
    /// start recovers as after a crash).
    pub(crate) fn close(
        &self,
        cores: &Cores,
        crcs: &CrcCache,
        dev: &Devices,
        identities: &[Option<String>],
    ) -> bool {
        let writes_done = dev.writes_done();
        for _ in 0..4 {
            if self.round(cores, crcs, dev, true) != (0, false) {
                return false;
            }
            if self.settled() {
                break;
            }
        }
        if !self.settled() {
            return false;
        }
        // Every record is durable and nothing is in flight: no journal block is needed.
        let next = self.st.lock().journal.take_pending_tail();
        let mut sb = self.sb.lock();
        if sb.state == sce_store::DeviceState::Failed {
            return false;
        }
        // Only a change this cache's own writes can explain is recorded: if it made none since
        // the identity was last recorded, a changed identity is someone else's doing, and is
        // left for the next start to find.
        if self.identity_writes.load(Relaxed) != writes_done {
            self.set_identities(&mut sb, identities);
        }
        sb.journal_tail = sb.journal_tail.max(next);
        sb.state = sce_store::DeviceState::Clean;
        sb.last_clean_shutdown = sce_store::unix_now();
        sb.clean_shutdowns += 1;
        self.write_sb(&mut sb).is_ok()
    }
}
