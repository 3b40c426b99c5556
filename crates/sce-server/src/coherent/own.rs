//! Ownership of regions (issue 31, docs/SHARED.md "Ownership"), this host's side: which
//! regions it owns (its writes there need no etcd call), which ones another host owns (its
//! reads there go to the source), and the moves between the two.
//!
//! Lock order: the ownership state (`Regions::st`) is taken before, never inside, the
//! cache's locks, and it is not held across an etcd call or a drop from the cache (a
//! region's pages are dropped with the lock released, while the region is counted as
//! another's, so no read serves it meanwhile).

use super::Coherence;
use parking_lot::{Condvar, Mutex};
use sce_coord::{own, EtcdError, Kv};
use sce_io::{BlockDevice, IoError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// A region this host owns, or is taking or giving up.
#[derive(Debug)]
struct Mine {
    /// The lease the owner key is under: a new registration (a new lease) ends it.
    lease: i64,
    /// The revision of the owner key (0 while acquiring).
    revision: i64,
    phase: Phase,
    /// Owned writes in flight.
    inflight: u32,
    /// The last owned write's end.
    last: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The key is being put and the others' acknowledgements awaited.
    Acquiring,
    /// Owned: writes go without etcd.
    Held,
    /// The key is being deleted or handed to another host.
    Leaving,
}

#[derive(Default, Debug)]
struct State {
    /// Regions another host owns, with the revision that said so.
    theirs: HashMap<u64, i64>,
    mine: HashMap<u64, Mine>,
    /// Regions several hosts wrote lately, until when: nobody takes them meanwhile, every
    /// write there is published (today's per-write rule), and every host caches them.
    contended: HashMap<u64, Instant>,
}

/// The ownership state of one shared volume on this host.
#[derive(Debug)]
pub(super) struct Regions {
    /// log2 of the region size; None: ownership is off (every write is published).
    shift: Option<u32>,
    idle: Duration,
    st: Mutex<State>,
    changed: Condvar,
    /// `theirs.len()`, read without the lock by reads.
    theirs_n: AtomicUsize,
}

/// How a write goes: owned (no etcd call; its regions' counts to give back), or published.
#[must_use]
pub(crate) enum WriteKind {
    Owned { regions: Vec<u64>, lease: i64 },
    Published,
}

impl Regions {
    /// Regions of `size` bytes (a power of two; 0: ownership off), released after `idle`.
    pub(super) fn new(size: u64, idle: Duration) -> Regions {
        Regions {
            shift: (size > 0).then(|| size.trailing_zeros()),
            idle,
            st: Mutex::default(),
            changed: Condvar::new(),
            theirs_n: AtomicUsize::new(0),
        }
    }

    /// The regions `[offset, offset+len)` touches.
    fn of(&self, offset: u64, len: u64) -> Option<std::ops::RangeInclusive<u64>> {
        let s = self.shift?;
        Some((offset >> s)..=(offset.saturating_add(len.max(1)) - 1) >> s)
    }

    /// The byte range of region `r`.
    pub(super) fn span(&self, r: u64) -> (u64, u64) {
        let s = self.shift.unwrap_or(63);
        (r << s, 1 << s)
    }

    /// True if another host owns a region `[offset, offset+len)` touches.
    pub(super) fn theirs(&self, offset: u64, len: u64) -> bool {
        if self.theirs_n.load(SeqCst) == 0 {
            return false;
        }
        let Some(rs) = self.of(offset, len) else {
            return false;
        };
        let st = self.st.lock();
        rs.into_iter().any(|r| st.theirs.contains_key(&r))
    }

    fn set_theirs(&self, st: &mut State, r: u64, revision: Option<i64>) {
        match revision {
            Some(rev) => st.theirs.insert(r, rev),
            None => st.theirs.remove(&r),
        };
        self.theirs_n.store(st.theirs.len(), SeqCst);
    }

    /// (owned, of others) counts, for the status.
    pub(super) fn counts(&self) -> (usize, usize) {
        let st = self.st.lock();
        let held = st.mine.values().filter(|m| m.phase == Phase::Held);
        (held.count(), st.theirs.len())
    }

    /// Another host published a write of `[offset, offset+len)`: its regions count as
    /// contended for the idle time, and one this host owns is released at once.
    pub(super) fn foreign_write(&self, offset: u64, len: u64) {
        let Some(rs) = self.of(offset, len.min(u64::MAX - offset)) else {
            return;
        };
        let until = Instant::now() + self.idle;
        let mut st = self.st.lock();
        // A whole-volume drop (an unreadable invalidation) names every region: only those
        // this host owns or knows matter.
        if rs.end() - rs.start() > 1 << 16 {
            let known: Vec<u64> = st.mine.keys().copied().collect();
            for r in known.into_iter().filter(|r| rs.contains(r)) {
                st.contended.insert(r, until);
            }
            return;
        }
        for r in rs {
            st.contended.insert(r, until);
        }
    }

    /// Gives back the counts an owned write took; `ok`: its end counts as the regions' last
    /// use.
    fn put_back(&self, regions: &[u64]) {
        let mut st = self.st.lock();
        for r in regions {
            if let Some(m) = st.mine.get_mut(r) {
                m.inflight -= 1;
                m.last = Instant::now();
            }
        }
        drop(st);
        self.changed.notify_all();
    }
}

impl Coherence {
    /// True if another host owns a region `[offset, offset+len)` touches: the read goes to
    /// the source.
    pub(crate) fn others_own(&self, offset: u64, len: u64) -> bool {
        self.regions.theirs(offset, len)
    }

    /// Decides how a write of `[offset, offset+len)` goes: owned if this host owns (or can
    /// take) every region it touches, published otherwise (a region another host owns, or
    /// etcd refusing the acquisition: the contended case, today's per-write rule).
    pub(crate) fn begin_write(&self, offset: u64, len: u64) -> WriteKind {
        let Some(rs) = self.regions.of(offset, len) else {
            return WriteKind::Published;
        };
        let lease = self.member.lease();
        let mut taken = Vec::new();
        for r in rs {
            if self.take_region(r, lease) {
                taken.push(r);
            } else {
                self.regions.put_back(&taken);
                return WriteKind::Published;
            }
        }
        WriteKind::Owned {
            regions: taken,
            lease,
        }
    }

    /// Counts a write in region `r` as owned, acquiring the region first if nobody owns it.
    /// False: the write must be published.
    fn take_region(&self, r: u64, lease: i64) -> bool {
        let g = &self.regions;
        let mut st = g.st.lock();
        loop {
            if !self.member.valid() || self.member.lease() != lease || self.stop.load(SeqCst) {
                return false;
            }
            let theirs = st.theirs.contains_key(&r);
            let contended = st.contended.get(&r).is_some_and(|t| *t > Instant::now());
            match st.mine.get_mut(&r) {
                Some(m) if m.lease != lease => {
                    // Under a lease this host no longer has: the key went with it.
                    st.mine.remove(&r);
                }
                Some(m) if m.phase == Phase::Held => {
                    m.inflight += 1;
                    return true;
                }
                Some(_) => {
                    // Another writer is taking or giving it up: wait for the outcome.
                    g.changed.wait_for(&mut st, Duration::from_millis(100));
                }
                None if theirs => {
                    // Two writers: the owner gives the region up when it hears of this one.
                    st.contended.insert(r, Instant::now() + g.idle);
                    return false;
                }
                None if contended => return false,
                None => {
                    st.mine.insert(r, Mine::acquiring(lease));
                    drop(st);
                    let got = self.acquire(r, lease);
                    st = g.st.lock();
                    match (got, st.mine.get_mut(&r)) {
                        (Some(rev), Some(m)) if m.phase == Phase::Acquiring => {
                            (m.revision, m.phase, m.inflight) = (rev, Phase::Held, 1);
                            g.changed.notify_all();
                            return true;
                        }
                        _ => {
                            st.mine.remove(&r);
                            g.changed.notify_all();
                            return false;
                        }
                    }
                }
            }
        }
    }

    /// Puts the owner key of region `r` under `lease` and waits until every other host has
    /// dropped the region and counts it as this host's. None: not acquired (held by
    /// another, etcd unreachable, or a host that did not acknowledge: the key is deleted
    /// again, or lapses with the lease).
    fn acquire(&self, r: u64, lease: i64) -> Option<i64> {
        let value = own::value(&self.cfg.host, self.identity.id(), None);
        let p = &self.volume_prefix;
        let rev = match own::acquire(&self.etcd, p, r, &value, lease) {
            Ok(Ok(rev)) => rev,
            Ok(Err(_)) => {
                self.counters.acquisitions_refused.fetch_add(1, SeqCst);
                return None;
            }
            Err(e) => {
                tracing::debug!(volume = %p, region = r, "shared volume: acquiring a region: {e}");
                return None;
            }
        };
        let deadline = Instant::now() + super::ack_timeout(self.cfg.lease_ttl);
        if let Err(e) = self.tracker.wait_acked(rev, deadline) {
            tracing::warn!(volume = %p, region = r, "shared volume: a region's acquisition was not acknowledged, giving it up: {e}");
            let _ = own::release(&self.etcd, p, r, rev);
            return None;
        }
        self.counters.acquisitions.fetch_add(1, SeqCst);
        tracing::debug!(volume = %p, region = r, revision = rev, "shared volume: region acquired");
        Some(rev)
    }

    /// After an owned write's source write: gives its regions back, and fences it. A write
    /// that ended after this host stopped counting on its lease may have landed after
    /// another host took the region: it fails (EIO) and its range is announced to the
    /// others as soon as etcd answers, as a publication that failed.
    pub(crate) fn end_owned(
        &self,
        (regions, lease): (&[u64], i64),
        result: Result<(), IoError>,
        offset: u64,
        len: u64,
    ) -> Result<(), IoError> {
        let current = self.member.valid() && self.member.lease() == lease;
        self.regions.put_back(regions);
        if current {
            self.counters.owned_writes.fetch_add(1, SeqCst);
            return result;
        }
        self.counters.owned_writes_fenced.fetch_add(1, SeqCst);
        self.remember_unpublished([(offset, len)]);
        Err(IoError::Io {
            op: sce_io::Op::Write,
            offset,
            len,
            source: std::io::Error::other(
                "shared volume: this host's lease lapsed while the write was in flight, so \
                 another host may own its region now; it reached the source, and is \
                 announced to the others when etcd answers",
            ),
        })
    }

    /// A change of an owner key, in revision order (the listener's thread), applied before
    /// the revision is acknowledged: another host's region is dropped and counted as
    /// theirs; a released one is dropped again (this host may have cached it meanwhile,
    /// from a source the owner was writing) before it is served; a hand-off to this host is
    /// dropped and then owned.
    pub(super) fn owner_changed(&self, r: u64, holder: Option<&Kv>, revision: i64) {
        let g = &self.regions;
        let lease = self.member.lease();
        let mut st = g.st.lock();
        match holder {
            Some(kv) if kv.lease == lease => {
                if st.mine.contains_key(&r) {
                    return; // its own acquisition
                }
                let handoff = own::is_handoff(&kv.value);
                g.set_theirs(&mut st, r, Some(revision));
                drop(st);
                self.drop_region(r);
                if !handoff {
                    // A key of this lease it does not track (an acquisition given up):
                    // deleted, so that the region is nobody's.
                    let _ = own::release(&self.etcd, &self.volume_prefix, r, kv.mod_revision);
                    return;
                }
                let mut st = g.st.lock();
                g.set_theirs(&mut st, r, None);
                let mut m = Mine::acquiring(lease);
                (m.revision, m.phase) = (kv.mod_revision, Phase::Held);
                st.mine.insert(r, m);
                self.counters.handoff_regions.fetch_add(1, SeqCst);
                tracing::info!(volume = %self.volume_prefix, region = r, "shared volume: region handed to this host");
            }
            Some(_) => {
                if st.mine.get(&r).is_some_and(|m| m.lease != lease) {
                    st.mine.remove(&r);
                }
                g.set_theirs(&mut st, r, Some(revision));
                drop(st);
                self.drop_region(r);
            }
            None => {
                if st.mine.get(&r).is_some_and(|m| m.lease != lease) {
                    st.mine.remove(&r);
                }
                if !st.theirs.contains_key(&r) {
                    return;
                }
                drop(st);
                self.drop_region(r);
                let mut st = g.st.lock();
                g.set_theirs(&mut st, r, None);
            }
        }
        g.changed.notify_all();
    }

    /// Makes the ownership state what etcd held at `revision` (a listener that starts
    /// there): each region that differs is changed as by its event.
    pub(super) fn resync_owners(&self, revision: i64) -> Result<(), EtcdError> {
        if self.regions.shift.is_none() {
            return Ok(());
        }
        let owners = own::owners_at(&self.etcd, &self.volume_prefix, revision)?;
        let held: HashMap<u64, Kv> = owners.into_iter().collect();
        let gone: Vec<u64> = {
            let st = self.regions.st.lock();
            (st.theirs.keys())
                .filter(|r| !held.contains_key(r))
                .copied()
                .collect()
        };
        for r in gone {
            self.owner_changed(r, None, revision);
        }
        for (r, kv) in &held {
            let known = self.regions.st.lock().theirs.contains_key(r);
            if !known {
                self.owner_changed(*r, Some(kv), kv.mod_revision);
            }
        }
        Ok(())
    }

    fn drop_region(&self, r: u64) {
        let (o, n) = self.regions.span(r);
        let end = o.saturating_add(n).min(self.att.size());
        if o < end {
            let n = self.att.evict(o, end - o).unwrap_or(0);
            self.counters.dropped_bytes.fetch_add(n, SeqCst);
        }
    }

    /// Releases the regions no owned write used for the idle time (the background thread).
    pub(super) fn release_idle(&self) {
        let g = &self.regions;
        let idle: Vec<(u64, i64)> = {
            let mut st = g.st.lock();
            let now = Instant::now();
            st.contended.retain(|_, t| *t > now);
            let State {
                mine, contended, ..
            } = &mut *st;
            mine.iter_mut()
                .filter(|(_, m)| m.phase == Phase::Held && m.inflight == 0)
                .filter(|(r, m)| now.duration_since(m.last) >= g.idle || contended.contains_key(r))
                .map(|(r, m)| {
                    m.phase = Phase::Leaving;
                    (*r, m.revision)
                })
                .collect()
        };
        for (r, rev) in idle {
            let out = own::release(&self.etcd, &self.volume_prefix, r, rev);
            let mut st = g.st.lock();
            match out {
                Err(e) => {
                    tracing::debug!(volume = %self.volume_prefix, region = r, "shared volume: releasing a region: {e}");
                    if let Some(m) = st.mine.get_mut(&r) {
                        m.phase = Phase::Held;
                    }
                }
                Ok(_) => {
                    st.mine.remove(&r);
                    self.counters.releases.fetch_add(1, SeqCst);
                }
            }
            drop(st);
            g.changed.notify_all();
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
        let mine: Vec<(u64, i64)> = {
            let mut st = g.st.lock();
            let deadline = Instant::now() + Duration::from_secs(10);
            while st.mine.values().any(|m| m.inflight > 0) && Instant::now() < deadline {
                g.changed.wait_for(&mut st, Duration::from_millis(50));
            }
            (st.mine.iter_mut())
                .filter(|(_, m)| m.phase == Phase::Held && m.inflight == 0)
                .map(|(r, m)| {
                    m.phase = Phase::Leaving;
                    (*r, m.revision)
                })
                .collect()
        };
        let value = own::value(to, "-", Some(&self.cfg.host));
        let (mut moved, mut last) = (0, 0);
        for (r, rev) in mine {
            let out = own::transfer(&self.etcd, &self.volume_prefix, r, rev, &value, lease);
            let mut st = g.st.lock();
            st.mine.remove(&r);
            if let Ok(Ok(new)) = out {
                g.set_theirs(&mut st, r, Some(new));
                (moved, last) = (moved + 1, new);
            } else {
                // Not moved: released (or lapsed), so that the region is nobody's.
                drop(st);
                let _ = own::release(&self.etcd, &self.volume_prefix, r, rev);
            }
            g.changed.notify_all();
        }
        Ok((moved, last))
    }
}

impl Mine {
    fn acquiring(lease: i64) -> Mine {
        Mine {
            lease,
            revision: 0,
            phase: Phase::Acquiring,
            inflight: 0,
            last: Instant::now(),
        }
    }
}
