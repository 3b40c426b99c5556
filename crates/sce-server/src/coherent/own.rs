//! Ownership of regions (issue 31, docs/SHARED.md "Ownership"), this host's side: which
//! regions it owns (its writes there need no etcd call), which ones another host owns (its
//! reads there go to the source), and the write path between the two. The listener's side
//! (owner keys changing), releases and hand-offs are in `owners.rs`.
//!
//! Lock order: the ownership state (`Regions::st`), then the map of others' regions
//! (`Regions::theirs`), then the cache's locks; none is held across an etcd call or a drop
//! from the cache (a region's pages are dropped with the locks released, while the region
//! is counted as another's, so no read serves it meanwhile).
//!
//! Each region this host owns (or is taking) has a token of its own: an owned write, an
//! acquisition, a release or a hand-off changes the entry only while it still holds the
//! token it started with, so that an entry replaced meanwhile (a new lease, a lost key) is
//! never counted down or changed by another's outcome, and a write whose entry is gone when
//! it ends is fenced.

use super::Coherence;
use parking_lot::{Condvar, Mutex, RwLock};
use sce_coord::own;
use sce_io::IoError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// A write over more regions than this is published rather than taking them all (a discard
/// of a whole device would otherwise take every region, one transaction each).
const MAX_OWNED_SPAN: u64 = 4;

/// A region this host owns, or is taking or giving up.
#[derive(Debug)]
pub(super) struct Mine {
    pub token: u64,
    /// The lease the owner key is under: a new registration (a new lease) ends it.
    pub lease: i64,
    /// The revision of the owner key (0 while acquiring).
    pub revision: i64,
    pub phase: Phase,
    /// Owned writes in flight.
    pub inflight: u32,
    /// The last owned write's end.
    pub last: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// The key is being put and the others' acknowledgements awaited.
    Acquiring,
    /// Owned: writes go without etcd.
    Held,
    /// The key is being deleted or handed to another host.
    Leaving,
}

#[derive(Default, Debug)]
pub(super) struct State {
    pub mine: HashMap<u64, Mine>,
    /// Regions several hosts wrote lately, until when: nobody takes them meanwhile, every
    /// write there is published (the per-write rule), and every host caches them.
    pub contended: HashMap<u64, Instant>,
    /// Owner keys of this host's lease whose deletion failed or was not confirmed
    /// (region, revision): deleted again by the background thread.
    pub stray: Vec<(u64, i64)>,
    next_token: u64,
}

impl State {
    /// A new entry's token.
    pub fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    /// The entry of region `r` if it still holds `token`.
    pub fn entry(&mut self, r: u64, token: u64) -> Option<&mut Mine> {
        self.mine.get_mut(&r).filter(|m| m.token == token)
    }
}

/// The ownership state of one shared volume on this host.
#[derive(Debug)]
pub(super) struct Regions {
    /// log2 of the volume's region size (agreed by the hosts in etcd).
    shift: u32,
    /// This host takes regions (`--region-size` not 0); it honours others' either way.
    pub acquires: bool,
    pub idle: Duration,
    pub st: Mutex<State>,
    pub changed: Condvar,
    /// Regions another host owns, with the revision that said so (read by every read).
    theirs: RwLock<HashMap<u64, i64>>,
    /// `theirs.len()`, read without a lock.
    theirs_n: AtomicUsize,
}

/// How a write goes: owned (no etcd call; its regions and tokens to give back), or
/// published.
#[must_use]
pub(crate) enum WriteKind {
    Owned {
        regions: Vec<(u64, u64)>,
        lease: i64,
    },
    Published,
}

impl Regions {
    /// Regions of `size` bytes (a power of two), taken by this host if `acquires`, released
    /// after `idle`.
    pub(super) fn new(size: u64, acquires: bool, idle: Duration) -> Regions {
        Regions {
            shift: size.max(1).trailing_zeros(),
            acquires,
            idle,
            st: Mutex::default(),
            changed: Condvar::new(),
            theirs: RwLock::default(),
            theirs_n: AtomicUsize::new(0),
        }
    }

    /// The regions `[offset, offset+len)` touches.
    fn of(&self, offset: u64, len: u64) -> std::ops::RangeInclusive<u64> {
        let last = offset.saturating_add(len.max(1)) - 1;
        (offset >> self.shift)..=(last >> self.shift)
    }

    /// The byte range of region `r`.
    pub(super) fn span(&self, r: u64) -> (u64, u64) {
        (r << self.shift, 1 << self.shift)
    }

    /// True if another host owns a region `[offset, offset+len)` touches.
    pub(super) fn theirs_in(&self, offset: u64, len: u64) -> bool {
        if self.theirs_n.load(SeqCst) == 0 {
            return false;
        }
        let theirs = self.theirs.read();
        self.of(offset, len).any(|r| theirs.contains_key(&r))
    }

    pub(super) fn is_theirs(&self, r: u64) -> bool {
        self.theirs.read().contains_key(&r)
    }

    /// The revision that made region `r` another's, if it is.
    pub(super) fn theirs_rev(&self, r: u64) -> Option<i64> {
        self.theirs.read().get(&r).copied()
    }

    /// Counts region `r` as another's (from `revision`) or not (None). Called with `st`
    /// held, so that the two agree.
    pub(super) fn set_theirs(&self, _st: &mut State, r: u64, revision: Option<i64>) {
        let mut theirs = self.theirs.write();
        match revision {
            Some(rev) => theirs.insert(r, rev),
            None => theirs.remove(&r),
        };
        self.theirs_n.store(theirs.len(), SeqCst);
    }

    /// The regions counted as another's.
    pub(super) fn theirs_list(&self) -> Vec<u64> {
        self.theirs.read().keys().copied().collect()
    }

    /// (owned, of others) counts, for the status.
    pub(super) fn counts(&self) -> (usize, usize) {
        let st = self.st.lock();
        let held = st.mine.values().filter(|m| m.phase == Phase::Held);
        (held.count(), self.theirs_n.load(SeqCst))
    }

    /// Another host published a write of `[offset, offset+len)`: its regions count as
    /// contended for the idle time (and one this host owns is released soon).
    pub(super) fn foreign_write(&self, offset: u64, len: u64) {
        let rs = self.of(offset, len.min(u64::MAX - offset));
        let until = Instant::now() + self.idle;
        let mut st = self.st.lock();
        // A whole-volume drop (an unreadable invalidation) names every region: only those
        // this host owns matter.
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

    /// Gives back the counts an owned write took. False if an entry it counted on is gone
    /// (its key was lost meanwhile): the write must be fenced.
    fn put_back(&self, regions: &[(u64, u64)]) -> bool {
        let mut st = self.st.lock();
        let mut all = true;
        for &(r, token) in regions {
            match st.entry(r, token) {
                Some(m) => {
                    m.inflight = m.inflight.saturating_sub(1);
                    m.last = Instant::now();
                }
                None => all = false,
            }
        }
        drop(st);
        self.changed.notify_all();
        all
    }
}

impl Coherence {
    /// True if another host owns a region `[offset, offset+len)` touches: the read goes to
    /// the source.
    pub(crate) fn others_own(&self, offset: u64, len: u64) -> bool {
        self.regions.theirs_in(offset, len)
    }

    /// Decides how a write of `[offset, offset+len)` goes: owned if this host owns (or can
    /// take) every region it touches, published otherwise (a region another host owns or
    /// wrote lately, a write over many regions, or etcd refusing the acquisition: the
    /// per-write rule).
    pub(crate) fn begin_write(&self, offset: u64, len: u64) -> WriteKind {
        let g = &self.regions;
        let rs = g.of(offset, len);
        if !g.acquires || rs.end() - rs.start() >= MAX_OWNED_SPAN {
            return WriteKind::Published;
        }
        let lease = self.member.lease();
        let mut taken = Vec::new();
        for r in rs {
            match self.take_region(r, lease, !taken.is_empty()) {
                Some(token) => taken.push((r, token)),
                None => {
                    g.put_back(&taken);
                    return WriteKind::Published;
                }
            }
        }
        WriteKind::Owned {
            regions: taken,
            lease,
        }
    }

    /// Counts a write in region `r` as owned, acquiring the region first if nobody owns it:
    /// the entry's token. None: the write must be published. A writer that already holds
    /// other regions (`holding`) does not wait for this one.
    fn take_region(&self, r: u64, lease: i64, holding: bool) -> Option<u64> {
        let g = &self.regions;
        let mut st = g.st.lock();
        loop {
            if !self.member.valid() || self.member.lease() != lease || self.stop.load(SeqCst) {
                return None;
            }
            let now = Instant::now();
            let contended = st.contended.get(&r).is_some_and(|t| *t > now);
            let theirs = g.is_theirs(r);
            match st.mine.get_mut(&r) {
                Some(m) if m.lease != lease => {
                    // Under a lease this host no longer has: the key went with it.
                    st.mine.remove(&r);
                }
                Some(m) if m.phase == Phase::Held && !contended => {
                    m.inflight += 1;
                    return Some(m.token);
                }
                // Another writer publishes: published too, while the owned ones drain
                // and the region is released.
                Some(m) if m.phase == Phase::Held => return None,
                Some(_) if holding => return None,
                Some(_) => {
                    // Being taken or given up: wait for the outcome.
                    g.changed.wait_for(&mut st, Duration::from_millis(100));
                }
                None if theirs => {
                    // Two writers: the owner gives the region up when it hears of this one.
                    st.contended.insert(r, now + g.idle);
                    return None;
                }
                None if contended => return None,
                None => {
                    let token = st.token();
                    st.mine.insert(r, Mine::acquiring(token, lease));
                    drop(st);
                    let got = self.acquire(r, lease);
                    st = g.st.lock();
                    let out = match (got, st.entry(r, token)) {
                        (Some(rev), Some(m)) if m.phase == Phase::Acquiring => {
                            (m.revision, m.phase, m.inflight) = (rev, Phase::Held, 1);
                            Some(token)
                        }
                        (got, entry) => {
                            if entry.is_some() {
                                st.mine.remove(&r);
                            }
                            // A key put but not used (its entry was replaced): deleted.
                            st.stray.extend(got.map(|rev| (r, rev)));
                            // The writers waiting publish rather than try again at once.
                            st.contended.insert(r, Instant::now() + g.idle);
                            None
                        }
                    };
                    g.changed.notify_all();
                    return out;
                }
            }
        }
    }

    /// Puts the owner key of region `r` under `lease` (taking over a key of this lease
    /// left from an acquisition whose answer was lost) and waits until every other host
    /// has dropped the region and counts it as this host's. None: not acquired (held by
    /// another, etcd unreachable, or a host that did not acknowledge: the key is deleted
    /// again, or lapses with the lease).
    fn acquire(&self, r: u64, lease: i64) -> Option<i64> {
        let value = own::value(&self.cfg.host, self.identity.id(), None);
        let p = &self.volume_prefix;
        let rev = match own::acquire(&self.etcd, p, r, &value, lease) {
            Ok(Ok(rev)) => rev,
            Ok(Err(Some(kv))) if kv.lease == lease => {
                match own::transfer(&self.etcd, p, r, kv.mod_revision, &value, lease) {
                    Ok(Ok(rev)) => rev,
                    _ => return None,
                }
            }
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
            if own::release(&self.etcd, p, r, rev).is_err() {
                self.regions.st.lock().stray.push((r, rev));
            }
            return None;
        }
        self.counters.acquisitions.fetch_add(1, SeqCst);
        tracing::debug!(volume = %p, region = r, revision = rev, "shared volume: region acquired");
        Some(rev)
    }

    /// After an owned write's source write: gives its regions back, and fences it. A write
    /// that ended after this host stopped counting on its lease, or whose region's key was
    /// lost meanwhile, may have landed after another host took the region: it fails (EIO)
    /// and its range is announced to the others as soon as etcd answers, as a publication
    /// that failed.
    pub(crate) fn end_owned(
        &self,
        (regions, lease): (&[(u64, u64)], i64),
        result: Result<(), IoError>,
        offset: u64,
        len: u64,
    ) -> Result<(), IoError> {
        let held = self.regions.put_back(regions);
        if held && self.member.valid() && self.member.lease() == lease {
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
                "shared volume: this host's ownership of the region lapsed while the write \
                 was in flight (its lease, or the owner key), so another host may own it \
                 now; the write reached the source, and is announced to the others when \
                 etcd answers",
            ),
        })
    }
}

impl Mine {
    pub(super) fn acquiring(token: u64, lease: i64) -> Mine {
        Mine {
            token,
            lease,
            revision: 0,
            phase: Phase::Acquiring,
            inflight: 0,
            last: Instant::now(),
        }
    }
}
