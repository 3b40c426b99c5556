//! Shared mode's two threads. The listener watches the volume's invalidations, drops their
//! pages and acknowledges them, and decides when the host may serve hits again after a
//! registration. The other thread does what may wait on etcd or the cache device without
//! holding up acknowledgements: announcing failed writes again, saving the processed
//! revision after a metadata round, and taking hand-offs.

use super::{batch, Coherence, SERVING, STARTING};
use sce_coord::inval::{self, Change, Listener};
use sce_coord::{Coord, EtcdError};
use sce_io::BlockDevice;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// At most this many failed writes' ranges are kept apart; beyond, the whole volume is
/// announced.
const MAX_UNPUBLISHED: usize = 4096;

impl Coherence {
    /// Drops an invalidated range from the cache, whole pages around it (`evict` drops
    /// every page the range touches; the whole volume for an invalidation this host cannot
    /// read).
    pub(super) fn drop_range(&self, offset: u64, len: u64) {
        self.regions.foreign_write(offset, len);
        self.evict(offset, len);
        self.counters.received.fetch_add(1, SeqCst);
    }

    /// Drops `[offset, offset+len)` (cut to the volume) from the cache, counting the bytes.
    pub(super) fn evict(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.att.size());
        if offset < end {
            let n = self.att.evict(offset, end - offset).unwrap_or(0);
            self.counters.dropped_bytes.fetch_add(n, SeqCst);
        }
    }

    /// The listener's thread: watch, drop, acknowledge; catch up after a registration.
    pub(super) fn run(self: Arc<Self>, etcd: Box<dyn Coord>) {
        let mut listener: Option<Listener> = None;
        // The acknowledgements of the current listener counted so far.
        let mut acked = 0;
        // The registration `caught_up` waits for, and the revision the listener must pass.
        let mut target = (0, 0);
        // The member's displacements this listener has forgotten the cache for.
        let mut displaced = 0;
        // The owners were read from etcd once: a watch started again after an error goes
        // on from the last revision processed, over a state that is right up to it.
        let mut synced = false;
        while !self.stop.load(SeqCst) {
            // A change is logged even while no read comes (and while etcd is unreachable).
            self.serving_logged();
            let generation = self.member.generation();
            let l = match listener.as_mut() {
                Some(l) => l,
                None => match self.listen(&etcd, !synced) {
                    Some(l) => {
                        (acked, synced) = (0, true);
                        listener.insert(l)
                    }
                    None => {
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                },
            };
            // What was published under this host's name before it registered is not its own.
            l.set_registered(self.member.registered_at());
            let lease = self.member.lease();
            let pumped = l.pump_all(&etcd, lease, Duration::from_millis(200), &mut |c| match c {
                Change::Drop(o, n) => self.drop_range(o, n),
                Change::Owner {
                    region,
                    holder,
                    revision,
                } => self.owner_changed(region, holder, revision),
            });
            self.done.store(l.done(), SeqCst);
            let acks = l.acks();
            self.counters
                .acks
                .fetch_add(acks - std::mem::replace(&mut acked, acks), SeqCst);
            if let Err(e) = pumped {
                tracing::debug!(volume = %self.volume_prefix, "shared volume: listening again ({e})");
                listener = None;
                continue;
            }
            if self.caught_up.load(SeqCst) != generation {
                self.catch_up(&etcd, generation, &mut target, &mut displaced);
            }
        }
    }

    /// A watch from the revision after the last processed (with the owners as of the
    /// revision before it, read from etcd's history, if `resync`: at the start); after
    /// compaction, the cache forgets the volume and the watch starts from the revision read
    /// before the forget (whatever was published up to it reached the source before the
    /// forget began).
    fn listen(&self, etcd: &dyn Coord, resync: bool) -> Option<Listener> {
        let (p, me) = (&self.volume_prefix, &self.cfg.host);
        let from = self.done.load(SeqCst) + 1;
        match Listener::new(etcd, p, me, from) {
            Ok(l) if !resync => Some(l),
            Ok(l) => match self.resync_owners(from - 1) {
                Ok(()) => Some(l),
                Err(EtcdError::Compacted(_)) => self.listen_after_compaction(etcd),
                Err(_) => None,
            },
            Err(EtcdError::Compacted(_)) => self.listen_after_compaction(etcd),
            Err(_) => None,
        }
    }

    /// A listener from now on, after the cache forgot the volume: etcd no longer has the
    /// history it missed; the owners are read as they are now.
    fn listen_after_compaction(&self, etcd: &dyn Coord) -> Option<Listener> {
        let (p, me) = (&self.volume_prefix, &self.cfg.host);
        // The revision only: the hosts' keys are few.
        let (_, now) = etcd.range_prefix(format!("{p}/hosts/").as_bytes()).ok()?;
        // Nothing counts as caught up until the forget is done.
        self.caught_up.store(0, SeqCst);
        self.forget("etcd compacted the invalidations this host missed");
        self.done.store(now, SeqCst);
        let l = Listener::new(etcd, p, me, now + 1).ok()?;
        self.resync_owners(now).ok()?;
        Some(l)
    }

    /// After registration `generation`: serve hits again once the listener is past every
    /// invalidation published before it (the target is read once per registration, so a
    /// steady stream of new ones cannot keep the host from serving).
    /// Another server that held this host's name meanwhile (`displaced` behind the
    /// member's count) published under it what this listener skipped as its own: the
    /// cache is forgotten before it serves again.
    fn catch_up(
        &self,
        etcd: &dyn Coord,
        generation: u64,
        target: &mut (u64, i64),
        displaced: &mut u64,
    ) {
        let displacements = self.member.displacements();
        if *displaced != displacements {
            if self.att.forget().is_err() {
                return;
            }
            self.counters.forgotten.fetch_add(1, SeqCst);
            tracing::warn!(volume = %self.volume_prefix, "shared volume: cache forgotten (another server held this host's name meanwhile)");
            *displaced = displacements;
        }
        if target.0 != generation {
            let Ok(newest) = inval::newest(etcd, &self.volume_prefix) else {
                return;
            };
            *target = (generation, newest);
        }
        if self.done.load(SeqCst) >= target.1 {
            self.caught_up.store(generation, SeqCst);
            // The first time; after a later registration, `serving_logged` says it (once).
            if self
                .logged_mode
                .compare_exchange(STARTING, SERVING, SeqCst, SeqCst)
                .is_ok()
            {
                tracing::info!(volume = %self.volume_prefix, "shared volume: serving hits");
            }
        }
    }

    /// Keeps the ranges of writes whose announcement failed, to announce them again.
    pub(super) fn remember_unpublished(&self, ranges: impl IntoIterator<Item = (u64, u64)>) {
        let mut u = self.unpublished.lock();
        u.extend(ranges);
        if u.len() > MAX_UNPUBLISHED {
            *u = batch::coalesce(std::mem::take(&mut *u));
            if u.len() > MAX_UNPUBLISHED {
                *u = vec![(0, self.att.size())];
            }
        }
    }

    /// The background thread: announce failed writes again (every 200 ms while there are
    /// any), and every second take a hand-off and save the processed revision.
    pub(super) fn maintain(self: Arc<Self>, etcd: Box<dyn Coord>) {
        let mut saved = (self.done.load(SeqCst), Instant::now());
        while !self.stop.load(SeqCst) {
            std::thread::sleep(Duration::from_millis(200));
            self.republish();
            self.release_idle();
            if saved.1.elapsed() > Duration::from_secs(1) {
                self.take_handoff(&etcd);
                if self.done.load(SeqCst) > saved.0 {
                    saved.0 = self.save_seen(&etcd).unwrap_or(saved.0);
                }
                saved.1 = Instant::now();
            }
        }
    }

    /// Announces the ranges of failed writes again: one publication of them all (one put,
    /// one wait), kept for later if it fails.
    pub(super) fn republish(&self) {
        let ranges = batch::coalesce(std::mem::take(&mut *self.unpublished.lock()));
        if ranges.is_empty() {
            return;
        }
        if let Err(e) = self.publish_now(&ranges) {
            tracing::debug!(volume = %self.volume_prefix, "shared volume: announcing failed writes again: {e}");
            self.remember_unpublished(ranges);
        }
    }

    /// Makes the drops up to the processed revision durable, then saves that revision.
    fn save_seen(&self, etcd: &dyn Coord) -> Option<i64> {
        let done = self.done.load(SeqCst);
        let v = self.att.live_volume()?;
        v.persist_stats()?;
        if v.flush_metadata() > 0 {
            return None;
        }
        self.save(etcd, done).ok()?;
        Some(done)
    }
}
