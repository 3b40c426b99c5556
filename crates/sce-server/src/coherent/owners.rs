//! Ownership of regions, the changes of owner keys: what the listener applies (in revision
//! order, before it acknowledges), releases of idle or contended regions and of keys left
//! over (the background thread), and hand-offs of owned regions. The write path and the
//! state are in `own.rs` (its doc gives the lock order).

use super::own::{Mine, Phase, State};
use super::Coherence;
use sce_coord::{own, EtcdError, Kv};
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
        let stale =
            |m: &Mine| m.lease != lease || (m.phase != Phase::Acquiring && revision > m.revision);
        match holder {
            Some(kv) if kv.lease == lease => {
                if st.mine.get(&r).is_some_and(|m| m.lease != lease) {
                    st.mine.remove(&r);
                }
                if st.mine.contains_key(&r) {
                    // Its own acquisition (or one it took over): nothing to change.
                } else if own::is_handoff(&kv.value) {
                    g.set_theirs(&mut st, r, Some(revision));
                    drop(st);
                    self.drop_region(r);
                    st = g.st.lock();
                    g.set_theirs(&mut st, r, None);
                    let token = st.token();
                    let mut m = Mine::acquiring(token, lease);
                    (m.revision, m.phase) = (kv.mod_revision, Phase::Held);
                    st.mine.insert(r, m);
                    st.contended.remove(&r);
                    st.stray
                        .retain(|&(sr, srev)| (sr, srev) != (r, kv.mod_revision));
                    self.counters.handoff_regions.fetch_add(1, SeqCst);
                    tracing::info!(volume = %self.volume_prefix, region = r, "shared volume: region handed to this host");
                } else {
                    // Nobody writes it as owned here; the others read it from the source.
                    st.stray.push((r, kv.mod_revision));
                }
            }
            Some(_) => {
                if st.mine.get(&r).is_some_and(stale) {
                    st.mine.remove(&r);
                }
                g.set_theirs(&mut st, r, Some(revision));
                drop(st);
                self.drop_region(r);
            }
            None => {
                if st.mine.get(&r).is_some_and(stale) {
                    st.mine.remove(&r);
                }
                let Some(seen) = g.theirs_rev(r) else {
                    drop(st);
                    g.changed.notify_all();
                    return;
                };
                drop(st);
                self.drop_region(r);
                st = g.st.lock();
                // Unless it was counted as another's again meanwhile (a hand-off of this
                // host's, say): that stays.
                if g.theirs_rev(r) == Some(seen) {
                    g.set_theirs(&mut st, r, None);
                }
            }
        }
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
            let Some((r, token, rev)) = self.next_release() else {
                break;
            };
            let out = own::release(&self.etcd, &self.volume_prefix, r, rev);
            let mut st = g.st.lock();
            if st.entry(r, token).is_some() {
                st.mine.remove(&r);
            }
            match out {
                Ok(_) => {
                    self.counters.releases.fetch_add(1, SeqCst);
                }
                Err(e) => {
                    // Perhaps deleted, perhaps not: no longer owned here either way (a
                    // write takes the key over if it is still there), deleted again later.
                    tracing::debug!(volume = %self.volume_prefix, region = r, "shared volume: releasing a region: {e}");
                    st.stray.push((r, rev));
                }
            }
            drop(st);
            g.changed.notify_all();
        }
        let stray = std::mem::take(&mut g.st.lock().stray);
        for (i, &(r, rev)) in stray.iter().enumerate() {
            if !going() || own::release(&self.etcd, &self.volume_prefix, r, rev).is_err() {
                g.st.lock().stray.extend_from_slice(&stray[i..]);
                break;
            }
        }
    }

    /// The next region to release (idle, or contended, with no owned write in flight),
    /// marked leaving: (region, token, revision).
    fn next_release(&self) -> Option<(u64, u64, i64)> {
        let g = &self.regions;
        let mut st = g.st.lock();
        let now = Instant::now();
        st.contended.retain(|_, t| *t > now);
        let State {
            mine, contended, ..
        } = &mut *st;
        let (r, m) = (mine.iter_mut())
            .filter(|(_, m)| m.phase == Phase::Held && m.inflight == 0)
            .find(|(r, m)| now.duration_since(m.last) >= g.idle || contended.contains_key(*r))?;
        m.phase = Phase::Leaving;
        Some((*r, m.token, m.revision))
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
            let mut st = g.st.lock();
            if st.entry(r, token).is_some() {
                st.mine.remove(&r);
            }
            match out {
                Ok(Ok(new)) => (moved, last) = (moved + 1, new),
                // A retried move whose first try went through: moved.
                Ok(Err(Some(kv))) if kv.lease == lease && own::is_handoff(&kv.value) => {
                    (moved, last) = (moved + 1, kv.mod_revision)
                }
                // Not moved (the key changed, or the answer was lost): deleted, so that the
                // region is nobody's; it stays another's here until the listener says so.
                _ => st.stray.push((r, rev)),
            }
            drop(st);
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
        let mut marked = Vec::new();
        for (r, m) in st.mine.iter_mut().filter(|(_, m)| m.phase == Phase::Held) {
            m.phase = Phase::Leaving;
            marked.push((*r, m.token));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let busy = |st: &mut State| {
            (marked.iter()).any(|&(r, t)| st.entry(r, t).is_some_and(|m| m.inflight > 0))
        };
        while busy(&mut st) && Instant::now() < deadline {
            g.changed.wait_for(&mut st, Duration::from_millis(50));
        }
        let mut ready = Vec::new();
        for &(r, token) in &marked {
            // Gone meanwhile: its key was lost.
            let Some(m) = st.entry(r, token) else {
                continue;
            };
            if m.inflight > 0 {
                m.phase = Phase::Held;
                continue;
            }
            let rev = m.revision;
            g.set_theirs(&mut st, r, Some(rev));
            ready.push((r, token, rev));
        }
        drop(st);
        g.changed.notify_all();
        ready
    }
}
