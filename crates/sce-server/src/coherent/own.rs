//! Ownership of regions (issue 31, docs/SHARED.md "Ownership"), this host's side: the
//! write path between owned regions (no etcd call), published writes and acquisitions, and
//! the reads of regions another host owns (to the source). The rule itself is
//! `sce_core::regions::Regions`, a state machine of this host's view stepped by events:
//! this file and `owners.rs` (the listener's side: owner keys changing, releases and
//! hand-offs) keep the locks, make the etcd calls and the cache drops, and ask the machine
//! what to do, feeding it the outcomes.
//!
//! Lock order: the ownership state (`Regions::st`, the machine), then the map of others'
//! regions (`Regions::theirs`, the machine's copy for reads); no lock of the cache is taken
//! under them (both come after the volume's in `sce_io::order`), and none is held across an etcd call or a drop from the cache (a region's pages are dropped with
//! the locks released, while the region is counted as another's, so no read serves it
//! meanwhile).
//!
//! Each region this host owns (or is taking) has a token of its own: an owned write, an
//! acquisition, a release or a hand-off changes the entry only while it still holds the
//! token it started with, so that an entry replaced meanwhile (a new lease, a lost key) is
//! never counted down or changed by another's outcome, and a write whose entry is gone when
//! it ends is fenced.

use super::Coherence;
use parking_lot::Condvar;
use sce_engine::order::{levels, OrderedMutex, OrderedRwLock};
/// The copy of others' regions, a leaf (`sce_io::order`).
type RwLock<T> = OrderedRwLock<levels::Leaf, T>;
use sce_coord::own;
use sce_core::regions::{self, Cut, Take};
use sce_io::IoError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// The ownership state of one shared volume on this host.
#[derive(Debug)]
pub(super) struct Regions {
    cut: Cut,
    /// The machine: this host's view of the regions.
    pub st: OrderedMutex<levels::Regions, regions::Regions>,
    pub changed: Condvar,
    /// The machine's regions of other hosts, with the revision that said so, copied under
    /// `st` after each step that may change them: read by every read without `st`.
    theirs: RwLock<HashMap<u64, i64>>,
    /// `theirs.len()`, read without a lock.
    theirs_n: AtomicUsize,
    /// The origin of the machine's times.
    origin: Instant,
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
        let idle = u64::try_from(idle.as_nanos()).unwrap_or(u64::MAX);
        Regions {
            cut: Cut::new(size),
            st: OrderedMutex::new(regions::Regions::new(size, acquires, idle)),
            changed: Condvar::new(),
            theirs: RwLock::default(),
            theirs_n: AtomicUsize::new(0),
            origin: Instant::now(),
        }
    }

    /// Now, in the machine's time (nanoseconds since `origin`).
    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The byte range of region `r`.
    pub(super) fn span(&self, r: u64) -> (u64, u64) {
        self.cut.span(r)
    }

    /// True if another host owns a region `[offset, offset+len)` touches.
    pub(super) fn theirs_in(&self, offset: u64, len: u64) -> bool {
        if self.theirs_n.load(SeqCst) == 0 {
            return false;
        }
        let theirs = self.theirs.read();
        self.cut.of(offset, len).any(|r| theirs.contains_key(&r))
    }

    pub(super) fn is_theirs(&self, r: u64) -> bool {
        self.theirs.read().contains_key(&r)
    }

    /// Copies whether the machine `st` counts region `r` as another's. Called with `st`
    /// held, so that the two agree.
    pub(super) fn sync(&self, st: &regions::Regions, r: u64) {
        let mut theirs = self.theirs.write();
        match st.theirs(r) {
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
        (self.st.lock().held(), self.theirs_n.load(SeqCst))
    }

    /// Another host published a write of `[offset, offset+len)`: its regions count as
    /// contended for the idle time (and one this host owns is released soon).
    pub(super) fn foreign_write(&self, offset: u64, len: u64) {
        let now = self.now();
        self.st.lock().foreign_write(offset, len, now);
    }

    /// Gives back the counts an owned write took; whether the write stands under `lease`
    /// (`current`: this host's lease if still valid), else it must be fenced.
    fn put_back(&self, regions: &[(u64, u64)], lease: i64, current: Option<i64>) -> bool {
        let now = self.now();
        let stands = self.st.lock().end_write(regions, lease, current, now);
        self.changed.notify_all();
        stands
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
        let Some(rs) = g.st.lock().plan(offset, len) else {
            return WriteKind::Published;
        };
        let lease = self.member.lease();
        let mut taken = Vec::new();
        for r in rs {
            match self.take_region(r, lease, !taken.is_empty()) {
                Some(token) => taken.push((r, token)),
                None => {
                    let _ = g.put_back(&taken, lease, None);
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
            let going = self.member.valid() && !self.stop.load(SeqCst);
            let current = going.then(|| self.member.lease());
            match st.take(r, lease, current, holding, g.now()) {
                Take::Owned(token) => return Some(token),
                Take::Publish => return None,
                // Being taken or given up: wait for the outcome.
                Take::Wait => {
                    st.wait_for(&g.changed, Duration::from_millis(100));
                }
                Take::Acquire(token) => {
                    drop(st);
                    let got = self.acquire(r, lease);
                    let won = g.st.lock().acquired(r, token, got, g.now());
                    g.changed.notify_all();
                    return won.then_some(token);
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
                self.regions.st.lock().add_stray(&[(r, rev)]);
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
        let current = self.member.valid().then(|| self.member.lease());
        if self.regions.put_back(regions, lease, current) {
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
