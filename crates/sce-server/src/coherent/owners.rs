//! Ownership of regions, the changes of owner keys: what the listener applies (in revision
//! order, before it acknowledges), releases of idle or contended regions and of keys left
//! over (the background thread), and hand-offs of owned regions. The write path and the
//! state are in `own.rs` (its doc gives the lock order); what to do at each step is the
//! decision of the machine, `sce_core::regions::Regions`.

use super::Coherence;
use sce_coord::{own, EtcdError, Kv};
use sce_core::regions::Heard;
use std::collections::HashMap;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

impl Coherence {
    /// A change of an owner key, in revision order (the listener's thread), applied before
    /// the revision is acknowledged:
    /// - another host's key: the region counts as theirs, then is dropped (an entry of this
    ///   host's, older than the change, is lost: its writes in flight are fenced);
    /// - a deletion: a region of others is dropped again (this host may have cached it
    ///   meanwhile, from a source its owner was writing) and then served;
    /// - a key of this host's lease it did not put: a hand-off to it is dropped and then
    ///   owned; any other is deleted.
    pub(super) fn owner_changed(&self, r: u64, holder: Option<&Kv>, revision: i64) {
        let g = &self.regions;
        let mut st = g.st.lock();
        // Under the lock: a registration that changes it meanwhile is seen whole.
        let lease = self.member.lease();
        let heard = match holder {
            Some(kv) => {
                let key = (kv.lease, kv.mod_revision, own::is_handoff(&kv.value));
                st.owner_put(r, key, revision, lease)
            }
            None => st.owner_deleted(r, revision, lease),
        };
        g.sync(&st, r);
        if let Heard::Drop(after) = heard {
            drop(st);
            self.drop_region(r);
            st = g.st.lock();
            if st.dropped(r, after, lease, g.now()) {
                self.counters.handoff_regions.fetch_add(1, SeqCst);
                tracing::info!(volume = %self.volume_prefix, region = r, "shared volume: region handed to this host");
            }
            g.sync(&st, r);
        }
        drop(st);
        g.changed.notify_all();
    }

    /// Makes the ownership state what etcd held at `revision` (a listener that starts
    /// there): each region that differs is changed as by its event.
    pub(super) fn resync_owners(&self, revision: i64) -> Result<(), EtcdError> {
        let owners = own::owners_at(&self.etcd, &self.volume_prefix, revision)?;
        let held: HashMap<u64, Kv> = owners.into_iter().collect();
        for r in self.regions.theirs_list() {
            if !held.contains_key(&r) {
                self.owner_changed(r, None, revision);
            }
        }
        for (r, kv) in &held {
            if !self.regions.is_theirs(*r) {
                self.owner_changed(*r, Some(kv), kv.mod_revision);
            }
        }
        Ok(())
    }

    pub(super) fn drop_region(&self, r: u64) {
        let (o, n) = self.regions.span(r);
        self.evict(o, n);
    }

    /// Releases the regions no owned write used for the idle time, or that another host
    /// writes too, one at a time, and deletes keys left over (the background thread). It
    /// stops when the server stops or the lease stops counting (the keys go with it).
    pub(super) fn release_idle(&self) {
        let g = &self.regions;
        let going = || !self.stop.load(SeqCst) && self.member.valid();
        while going() {
            let Some(rel) = g.st.lock().next_release(g.now()) else {
                break;
            };
            let (r, rev) = (rel.region, rel.revision);
            let out = own::release(&self.etcd, &self.volume_prefix, r, rev);
            // Perhaps deleted, perhaps not: no longer owned here either way (a write takes
            // the key over if it is still there), deleted again later.
            g.st.lock().released(r, rel.token, rev, out.is_ok());
            match out {
                Ok(_) => {
                    self.counters.releases.fetch_add(1, SeqCst);
                }
                Err(e) => {
                    tracing::debug!(volume = %self.volume_prefix, region = r, "shared volume: releasing a region: {e}");
                }
            }
            g.changed.notify_all();
        }
        let stray = g.st.lock().take_stray();
        for (i, &(r, rev)) in stray.iter().enumerate() {
            if !going() || own::release(&self.etcd, &self.volume_prefix, r, rev).is_err() {
                g.st.lock().add_stray(&stray[i..]);
                break;
            }
        }
    }

    /// Hands every region this host owns to host `to` (its registration's lease), each once
    /// no owned write is in flight there: from then on this host's writes there are
    /// published, and its reads go to the source. Returns the regions moved and the
    /// revision of the last move (0: none).
    pub(super) fn hand_regions(&self, to: &str) -> anyhow::Result<(u64, i64)> {
        let g = &self.regions;
        let Some(lease) = self.tracker.lease_of(to) else {
            anyhow::bail!("handoff: host {to:?} is not registered under this volume");
        };
        let ready = self.hold_for_handoff();
        let value = own::value(to, "-", Some(&self.cfg.host));
        let (mut moved, mut last) = (0, 0);
        for (r, token, rev) in ready {
            let out = own::transfer(&self.etcd, &self.volume_prefix, r, rev, &value, lease);
            let new = match out {
                Ok(Ok(new)) => Some(new),
                // A retried move whose first try went through: moved.
                Ok(Err(Some(kv))) if kv.lease == lease && own::is_handoff(&kv.value) => {
                    Some(kv.mod_revision)
                }
                // Not moved (the key changed, or the answer was lost): deleted, so that the
                // region is nobody's; it stays another's here until the listener says so.
                _ => None,
            };
            if let Some(new) = new {
                (moved, last) = (moved + 1, new);
            }
            g.st.lock().released(r, token, rev, new.is_some());
            g.changed.notify_all();
        }
        Ok((moved, last))
    }

    /// Marks every owned region leaving, waits (up to 10 s) for the owned writes in flight
    /// there, and counts those that drained as another's before they move (the receiver
    /// may own them as soon as the move commits): (region, token, revision). A region
    /// still written stays owned here.
    fn hold_for_handoff(&self) -> Vec<(u64, u64, i64)> {
        let g = &self.regions;
        let mut st = g.st.lock();
        let marked = st.mark_handoff();
        let deadline = Instant::now() + Duration::from_secs(10);
        while st.handoff_busy(&marked) && Instant::now() < deadline {
            st.wait_for(&g.changed, Duration::from_millis(50));
        }
        let ready = st.handoff_ready(&marked);
        for &(r, ..) in &ready {
            g.sync(&st, r);
        }
        drop(st);
        g.changed.notify_all();
        ready
    }
}
