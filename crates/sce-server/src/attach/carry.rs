//! Counters for the server's life: a detach, an attach or a mode switch closes the export's
//! volume and opens another, whose counters start at zero. The closed volume's counters are
//! carried (`VolumeStats::add_counters`: counters only, gauges are the live volume's) and
//! added to every figure the export reports, so a Prometheus counter never goes back and
//! the hit ratio since start means since the server started.

use super::Attachable;
use sce_engine::{CacheVolume, VolumeStats};

impl Attachable {
    /// The export's figures: the live volume's, its counters plus those of the volumes
    /// closed before it. None while detached. Read under the gate, which a reopen holds
    /// while it carries the closed volume's counters: a reader never adds them to that
    /// volume's own (counted twice, then back: a counter reset to Prometheus).
    pub fn stats(&self) -> Option<VolumeStats> {
        let g = self.gate.read();
        let mut s = g.as_ref()?.stats();
        s.add_counters(&self.carried.lock());
        Some(s)
    }

    /// `v` is closed for good (after its last request): its counters are carried.
    pub(super) fn carry(&self, v: &CacheVolume) {
        // The volume's figures first: they take its core shards, which come before
        // `carried` in the lock order (the receiver's guard would be taken first).
        let closed = v.stats();
        self.carried.lock().add_counters(&closed);
    }
}
