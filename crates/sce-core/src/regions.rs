//! Ownership of a shared volume's regions (issue 31, docs/SHARED.md "Ownership"), one
//! host's view, as a state machine stepped by events: no clock (every time is an input, in
//! nanoseconds from any origin), no etcd, no thread, no lock. `sce serve --shared`
//! (`sce-server`'s `coherent/own.rs` and `owners.rs`) drives it under its locks and
//! performs the etcd calls and the cache drops it decides; the simulator's `--hosts` mode
//! drives one per simulated host, with a table of owner keys standing for etcd.
//!
//! A volume is cut into regions of a power-of-two size; each region has at most one owner
//! key in etcd, under its holder's lease. A host's writes to a region it owns need no etcd
//! call; every other write is published (the per-write rule), and every other host drops
//! the written range before the write is acknowledged.
//!
//! # States
//! Per region, in this host's view:
//! - **mine** ([`Mine`]): this host is taking it ([`Phase::Acquiring`]: the key is being put
//!   and the others' acknowledgements awaited), owns it ([`Phase::Held`]: owned writes go
//!   without etcd), or is giving it up ([`Phase::Leaving`]: its key is being deleted or
//!   handed to another host). Each entry has a token of its own and the lease its key is
//!   under; an entry under a lease this host no longer has is dead (the key went with it).
//! - **theirs**: another host's key was heard (with the revision that said so); reads go
//!   to the source, and a write there is published and marks the region contended.
//! - **contended until t**: several hosts wrote it lately; nobody takes it meanwhile, a
//!   write there is published, and a held one is released as soon as no owned write is in
//!   flight there.
//! - otherwise free: every host caches it, and a write takes it.
//!
//! # Events and decisions
//! - A write of `[offset, offset+len)`: [`Regions::plan`] says whether it may be owned at
//!   all (this host acquires, and it spans at most [`MAX_OWNED_SPAN`] regions); then
//!   [`Regions::take`] per region, in order, decides [`Take`]: `Owned` (counted in flight),
//!   `Acquire` (the driver puts the key and waits for the acknowledgements, then reports
//!   with [`Regions::acquired`]), `Publish` (the whole write is published; the counts taken
//!   so far are given back with [`Regions::put_back`]) or `Wait` (an acquisition or a
//!   release there is under way: ask again once it ends).
//! - The write's end: [`Regions::end_write`] gives the counts back; the write is fenced
//!   (failed, and announced later) if an entry it counted on is gone or replaced, or the
//!   lease it began under is no longer this host's valid lease.
//! - An owner key put or deleted (the listener, in revision order, before it
//!   acknowledges): [`Regions::owner_put`] and [`Regions::owner_deleted`] decide a
//!   [`Heard`]; `Drop` asks the driver to drop the region from the cache with no lock
//!   held (the region counts as another's meanwhile, so no read serves it) and then to
//!   report with [`Regions::dropped`]. Another host's key makes the region theirs and
//!   kills an older entry of this host's (its writes in flight are then fenced); a deletion
//!   drops the region again (this host may have cached it from a source its owner was
//!   writing) and then serves it; a key of this host's lease that it did not put is taken
//!   if it is a hand-off, and deleted otherwise (a stray).
//! - A publication heard ([`Regions::foreign_write`]): its regions are contended until
//!   `t + idle`.
//! - Time passing ([`Regions::next_release`]): a held region with no owned write in flight
//!   that went unwritten for the idle time, or is contended, is marked leaving and its
//!   release decided; the driver deletes the key and reports with [`Regions::released`].
//! - A hand-off ([`Regions::mark_handoff`], [`Regions::handoff_ready`],
//!   [`Regions::released`]): every held region is marked leaving; those with no write in
//!   flight count as another's before their key moves; the others stay held.
//! - A read: [`Regions::theirs_in`] says whether it goes to the source.
//!
//! Outcomes carry the token of the entry they began with: an outcome for an entry replaced
//! meanwhile (a new lease, a lost key) changes nothing, and a write whose entry is gone
//! when it ends is fenced.

use std::collections::{BTreeSet, HashMap};
use std::ops::RangeInclusive;

/// A write over more regions than this is published rather than taking them
/// all (a discard of a whole device would otherwise take every region, one transaction
/// each).
pub const MAX_OWNED_SPAN: u64 = 4;

/// A publication naming more regions than this names the whole volume (an unreadable
/// invalidation): only the regions this host owns are marked contended.
const WHOLE_VOLUME: u64 = 1 << 16;

/// The least size of the contended map at which its expired entries are purged.
const PURGE_MIN: usize = 64;

/// A region this host owns, or is taking or giving up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mine {
    /// Outcomes and write counts that began with another token leave the entry alone.
    pub token: u64,
    /// The lease the owner key is under: a new registration (a new lease) ends it.
    pub lease: i64,
    /// The revision of the owner key (0 while acquiring).
    pub revision: i64,
    /// Being taken, owned, or being given up.
    pub phase: Phase,
    /// Owned writes in flight.
    pub inflight: u32,
    /// The last owned write's end (or when the region was taken).
    pub last: u64,
}

/// Where an entry of this host's stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The key is being put and the others' acknowledgements awaited.
    Acquiring,
    /// Owned: writes go without etcd.
    Held,
    /// The key is being deleted or handed to another host.
    Leaving,
}

/// What a write does about one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Owned: counted in flight under this token.
    Owned(u64),
    /// Free: put the owner key under the write's lease, wait for the others'
    /// acknowledgements, and report with [`Regions::acquired`] and this token.
    Acquire(u64),
    /// The whole write is published.
    Publish,
    /// Being taken or given up: ask again once that ends.
    Wait,
}

/// What hearing an owner key's change asks of the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// Nothing to drop.
    Nothing,
    /// Drop the region from the cache (no lock held), then report with
    /// [`Regions::dropped`] and this.
    Drop(AfterDrop),
}

/// What follows the drop of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterDrop {
    /// It stays another's.
    Keep,
    /// A hand-off to this host: owned from now on.
    Take {
        /// The revision of the key handed over.
        key_revision: i64,
    },
    /// Its key was deleted: served again, unless it was counted as another's again since
    /// (by another revision than `seen`).
    Uncount {
        /// The revision that made it another's.
        seen: i64,
    },
}

/// A release decided by [`Regions::next_release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    /// The region released.
    pub region: u64,
    /// Its entry's token, for [`Regions::released`].
    pub token: u64,
    /// The owner key's revision, for the delete.
    pub revision: i64,
    /// Released because contended (else idle).
    pub contended: bool,
}

/// A volume cut into regions of a power-of-two size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// log2 of the region size.
    shift: u32,
}

impl Cut {
    /// Regions of `size` bytes (a power of two).
    pub fn new(size: u64) -> Cut {
        Cut {
            shift: size.max(1).trailing_zeros(),
        }
    }

    /// The regions `[offset, offset+len)` touches (region of `offset` for `len` 0).
    pub fn of(&self, offset: u64, len: u64) -> RangeInclusive<u64> {
        let last = offset.saturating_add(len.max(1)) - 1;
        (offset >> self.shift)..=(last >> self.shift)
    }

    /// The byte range of region `r`.
    pub fn span(&self, r: u64) -> (u64, u64) {
        (r << self.shift, 1 << self.shift)
    }
}

/// One host's view of a shared volume's regions (see the module's doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Regions {
    cut: Cut,
    /// This host takes regions; it honours others' either way.
    acquires: bool,
    /// Nanoseconds unwritten before a release, and of a contended window.
    idle: u64,
    mine: HashMap<u64, Mine>,
    /// Regions several hosts wrote lately, until when.
    contended: HashMap<u64, u64>,
    /// `contended`'s size at which its expired entries are purged.
    purge_at: usize,
    /// Regions another host owns, with the revision that said so.
    theirs: HashMap<u64, i64>,
    /// Owner keys of this host's lease whose deletion failed or was not confirmed (region,
    /// revision): to delete again.
    stray: Vec<(u64, i64)>,
    next_token: u64,
    /// (last write, region) of held entries, the oldest first; stale pairs are skipped.
    by_last: BTreeSet<(u64, u64)>,
    /// Held regions heard contended: released once no write is in flight there.
    soon: BTreeSet<u64>,
}

impl Regions {
    /// Regions of `size` bytes (a power of two), taken by this host if `acquires`, released
    /// after `idle` nanoseconds unwritten.
    pub fn new(size: u64, acquires: bool, idle: u64) -> Regions {
        Regions {
            cut: Cut::new(size),
            acquires,
            idle,
            mine: HashMap::new(),
            contended: HashMap::new(),
            purge_at: PURGE_MIN,
            theirs: HashMap::new(),
            stray: Vec::new(),
            next_token: 0,
            by_last: BTreeSet::new(),
            soon: BTreeSet::new(),
        }
    }

    /// How the volume is cut into regions.
    pub fn cut(&self) -> Cut {
        self.cut
    }

    /// The regions a write of `[offset, offset+len)` takes, or None: it is published (this
    /// host does not acquire, or the write spans too many regions).
    pub fn plan(&self, offset: u64, len: u64) -> Option<RangeInclusive<u64>> {
        let rs = self.cut.of(offset, len);
        (self.acquires && rs.end() - rs.start() < MAX_OWNED_SPAN).then_some(rs)
    }

    /// True if another host owns a region `[offset, offset+len)` touches: a read there goes
    /// to the source.
    pub fn theirs_in(&self, offset: u64, len: u64) -> bool {
        !self.theirs.is_empty()
            && self
                .cut
                .of(offset, len)
                .any(|r| self.theirs.contains_key(&r))
    }

    /// The revision that made region `r` another's, if it is.
    pub fn theirs(&self, r: u64) -> Option<i64> {
        self.theirs.get(&r).copied()
    }

    /// The regions counted as another's.
    pub fn theirs_list(&self) -> Vec<u64> {
        self.theirs.keys().copied().collect()
    }

    /// This host's entry of region `r`.
    pub fn mine(&self, r: u64) -> Option<&Mine> {
        self.mine.get(&r)
    }

    /// Regions held (owned) now.
    pub fn held(&self) -> usize {
        self.mine
            .values()
            .filter(|m| m.phase == Phase::Held)
            .count()
    }

    /// Whether region `r` counts as contended at `now`.
    pub fn contended(&self, r: u64, now: u64) -> bool {
        self.contended.get(&r).is_some_and(|&until| until > now)
    }

    /// Region `r` counts as contended from `now` for the idle time.
    fn mark_contended(&mut self, r: u64, now: u64) {
        self.contended.insert(r, now.saturating_add(self.idle));
        if self.mine.contains_key(&r) {
            self.soon.insert(r);
        }
        if self.contended.len() >= self.purge_at {
            self.contended.retain(|_, until| *until > now);
            self.purge_at = (2 * self.contended.len()).max(PURGE_MIN);
        }
    }

    /// A new entry's token.
    fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    /// The entry of region `r` if it still holds `token`.
    fn entry(&mut self, r: u64, token: u64) -> Option<&mut Mine> {
        self.mine.get_mut(&r).filter(|m| m.token == token)
    }

    /// Indexes region `r`'s entry by its last write, for [`Regions::next_release`].
    fn index(&mut self, r: u64) {
        if let Some(m) = self.mine.get(&r) {
            self.by_last.insert((m.last, r));
        }
    }

    /// A write under `lease` takes region `r` at `now` (see [`Take`]). `current` is this
    /// host's lease if it is valid and the host not stopping. A writer that already holds
    /// other regions of the write (`holding`) does not wait for this one.
    pub fn take(
        &mut self,
        r: u64,
        lease: i64,
        current: Option<i64>,
        holding: bool,
        now: u64,
    ) -> Take {
        if current != Some(lease) {
            return Take::Publish;
        }
        if self.mine.get(&r).is_some_and(|m| m.lease != lease) {
            // Under a lease this host no longer has: the key went with it.
            self.mine.remove(&r);
        }
        let contended = self.contended(r, now);
        let theirs = self.theirs.contains_key(&r);
        match self.mine.get_mut(&r) {
            Some(m) if m.phase == Phase::Held && !contended => {
                m.inflight += 1;
                Take::Owned(m.token)
            }
            // Another writer publishes: published too, while the owned ones drain and the
            // region is released.
            Some(m) if m.phase == Phase::Held => Take::Publish,
            Some(_) if holding => Take::Publish,
            Some(_) => Take::Wait,
            None if theirs => {
                // Two writers: the owner gives the region up when it hears of this one.
                self.mark_contended(r, now);
                Take::Publish
            }
            None if contended => Take::Publish,
            None => {
                let token = self.token();
                self.mine.insert(r, Mine::acquiring(token, lease, now));
                Take::Acquire(token)
            }
        }
    }

    /// The outcome of an acquisition of region `r` (`token`): `Some(revision)` if the key
    /// was put and acknowledged, None if not. True if the write counts the region as owned;
    /// otherwise it is published, and a key put for an entry replaced meanwhile is a stray.
    pub fn acquired(&mut self, r: u64, token: u64, got: Option<i64>, now: u64) -> bool {
        match (got, self.entry(r, token)) {
            (Some(rev), Some(m)) if m.phase == Phase::Acquiring => {
                (m.revision, m.phase, m.inflight, m.last) = (rev, Phase::Held, 1, now);
                true
            }
            (got, entry) => {
                if entry.is_some() {
                    self.mine.remove(&r);
                }
                self.stray.extend(got.map(|rev| (r, rev)));
                // The writers waiting publish rather than try again at once.
                self.mark_contended(r, now);
                false
            }
        }
    }

    /// Gives back the counts an owned write took (region, token), its end at `now`. False
    /// if an entry it counted on is gone or replaced: the write must be fenced.
    pub fn put_back(&mut self, regions: &[(u64, u64)], now: u64) -> bool {
        let mut all = true;
        for &(r, token) in regions {
            match self.entry(r, token) {
                Some(m) => {
                    m.inflight = m.inflight.saturating_sub(1);
                    m.last = now;
                    self.index(r);
                }
                None => all = false,
            }
        }
        all
    }

    /// An owned write under `lease` ends at `now`: gives its counts back, and says whether
    /// it stands (true) or is fenced: an entry it counted on is gone, or `lease` is not
    /// `current` (this host's lease if it is still valid).
    pub fn end_write(
        &mut self,
        regions: &[(u64, u64)],
        lease: i64,
        current: Option<i64>,
        now: u64,
    ) -> bool {
        let held = self.put_back(regions, now);
        held && current == Some(lease)
    }

    /// Whether an entry under `lease` is dead for a change of revision `revision`: under
    /// another lease, or older than the change (unless still acquiring: its key is that
    /// change, or comes after it).
    fn stale(&self, r: u64, lease: i64, revision: i64) -> bool {
        self.mine.get(&r).is_some_and(|m| {
            m.lease != lease || (m.phase != Phase::Acquiring && revision > m.revision)
        })
    }

    /// The owner key of region `r` was put at `revision` (key revision `key_revision`)
    /// under `key_lease`, a hand-off if `handoff`; `lease` is this host's lease.
    pub fn owner_put(&mut self, r: u64, key: (i64, i64, bool), revision: i64, lease: i64) -> Heard {
        let (key_lease, key_revision, handoff) = key;
        if key_lease != lease {
            if self.stale(r, lease, revision) {
                self.mine.remove(&r);
            }
            self.theirs.insert(r, revision);
            return Heard::Drop(AfterDrop::Keep);
        }
        if self.mine.get(&r).is_some_and(|m| m.lease != lease) {
            self.mine.remove(&r);
        }
        if self.mine.contains_key(&r) {
            // Its own acquisition (or one it took over): nothing to change.
            Heard::Nothing
        } else if handoff {
            self.theirs.insert(r, revision);
            Heard::Drop(AfterDrop::Take { key_revision })
        } else {
            // Nobody writes it as owned here; the others read it from the source.
            self.stray.push((r, key_revision));
            Heard::Nothing
        }
    }

    /// The owner key of region `r` was deleted at `revision`; `lease` is this host's lease.
    pub fn owner_deleted(&mut self, r: u64, revision: i64, lease: i64) -> Heard {
        if self.stale(r, lease, revision) {
            self.mine.remove(&r);
        }
        match self.theirs(r) {
            Some(seen) => Heard::Drop(AfterDrop::Uncount { seen }),
            None => Heard::Nothing,
        }
    }

    /// Region `r` was dropped from the cache as [`Heard::Drop`] asked, at `now`, `lease`
    /// being this host's lease. True if it is now this host's by a hand-off.
    pub fn dropped(&mut self, r: u64, after: AfterDrop, lease: i64, now: u64) -> bool {
        match after {
            AfterDrop::Keep => false,
            AfterDrop::Uncount { seen } => {
                if self.theirs(r) == Some(seen) {
                    self.theirs.remove(&r);
                }
                false
            }
            AfterDrop::Take { key_revision } => {
                self.theirs.remove(&r);
                let mut m = Mine::acquiring(self.token(), lease, now);
                (m.revision, m.phase) = (key_revision, Phase::Held);
                self.mine.insert(r, m);
                self.index(r);
                self.contended.remove(&r);
                self.stray.retain(|&s| s != (r, key_revision));
                true
            }
        }
    }

    /// Another host published a write of `[offset, offset+len)` heard at `now`: its
    /// regions count as contended for the idle time (and one this host owns is released as
    /// soon as no owned write is in flight there).
    pub fn foreign_write(&mut self, offset: u64, len: u64, now: u64) {
        let rs = self.cut.of(offset, len.min(u64::MAX - offset));
        if rs.end() - rs.start() > WHOLE_VOLUME {
            let known: Vec<u64> = self
                .mine
                .keys()
                .copied()
                .filter(|r| rs.contains(r))
                .collect();
            for r in known {
                self.mark_contended(r, now);
            }
            return;
        }
        for r in rs {
            self.mark_contended(r, now);
        }
    }
}

impl Mine {
    fn acquiring(token: u64, lease: i64, now: u64) -> Mine {
        Mine {
            token,
            lease,
            revision: 0,
            phase: Phase::Acquiring,
            inflight: 0,
            last: now,
        }
    }
}

#[path = "regions_leave.rs"]
mod leave;

#[cfg(test)]
#[path = "regions_tests.rs"]
mod tests;
