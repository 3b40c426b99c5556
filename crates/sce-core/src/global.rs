//! `GlobalCore`: one shard's [`CacheCore`] seen in the volume's global addresses, for a
//! driver that keeps each shard behind a lock of its own (the engine's `Cores`). The driver
//! finds the shard of a global address ([`ShardMap::shard_of_source`], `_of_frag`,
//! `_of_slot`), locks it, and asks through this view: every address in and out is global,
//! and jobs and write transactions come out as [`OnShard`] guards in global addresses. The
//! translations stay in this crate ([`ShardMap`]); a driver never sees a shard's own
//! fragment, slot or offset numbers.
//!
//! [`ShardedCore`](crate::ShardedCore) is the same boundary for a driver that holds every
//! shard at once (the simulator).

use crate::addr::{FragNo, Nanos, SlotNo, SourceOffset};
use crate::cache::{
    CacheCore, PinnedRead, Population, ReadPlan, RequestError, WriteKind, WriteTxn,
};
use crate::sharded::OnShard;
use crate::shards::{Piece, ShardMap};
use crate::slots::PinTable;
use std::ops::{Deref, DerefMut};

impl ShardMap {
    /// The shard holding global source offset `o`.
    pub fn shard_of_source(&self, o: u64) -> usize {
        self.source_to_local(SourceOffset(o)).0
    }

    /// The shard holding global fragment `f`.
    pub fn shard_of_frag(&self, f: u64) -> usize {
        self.frag_to_local(FragNo(f)).0
    }

    /// The shard owning global slot `s`.
    pub fn shard_of_slot(&self, s: u32) -> usize {
        self.slot_to_local(SlotNo(s)).0
    }

    /// The one piece of a request of `len > 0` bytes at global `offset` that lies within
    /// one fragment (a hit's fast path): what [`ShardMap::pieces`] would give alone.
    pub fn piece(&self, offset: u64, len: u64) -> Piece {
        let (shard, local) = self.source_to_local(SourceOffset(offset));
        Piece {
            shard,
            offset,
            local: local.0,
            len,
            buf_offset: 0,
        }
    }
}

/// Shard `k`'s core (`C`: `&CacheCore` under a shared lock, `&mut CacheCore` under an
/// exclusive one), in global addresses.
pub struct GlobalCore<'a, C> {
    core: C,
    map: &'a ShardMap,
    k: usize,
}

impl<'a, C: Deref<Target = CacheCore>> GlobalCore<'a, C> {
    /// Shard `k`'s core `core`, cut from the volume as `map` says.
    pub fn new(core: C, map: &'a ShardMap, k: usize) -> Self {
        GlobalCore { core, map, k }
    }

    /// The shard.
    pub fn shard(&self) -> usize {
        self.k
    }

    /// The global fragment that global slot `slot`'s record names, if any (the slot must be
    /// this shard's).
    pub fn slot_fragment(&self, slot: u32) -> Option<u64> {
        self.slot_state(slot).0
    }

    /// Global slot `slot`'s (this shard's) fragment, in global numbers, and validity bitmap.
    pub fn slot_state(&self, slot: u32) -> (Option<u64>, &[u64]) {
        let (k, s) = self.map.slot_to_local(SlotNo(slot));
        debug_assert_eq!(k, self.k, "slot {slot} is not this shard's");
        let (f, bits) = self.core.slot_state(s);
        (f.map(|f| self.map.frag_to_global(self.k, f).0), bits)
    }

    /// True if global fragment `frag` has I/O in flight, or is not this shard's (a caller
    /// that asks about another shard's fragment must treat it as busy).
    pub fn fragment_busy(&self, frag: u64) -> bool {
        let (k, f) = self.map.frag_to_local(FragNo(frag));
        k != self.k || self.core.fragment_busy(f)
    }

    /// The global slot that holds global fragment `frag`, if it is cached.
    pub fn slot_of(&self, frag: u64) -> Option<u32> {
        let (_, f) = self.map.frag_to_local(FragNo(frag));
        let (s, _) = self.core.exists(f)?;
        Some(self.map.slot_to_global(self.k, s).0)
    }

    /// True if the page at global source offset `at` is cached and valid.
    pub fn is_cached(&self, at: u64) -> bool {
        let (_, o) = self.map.source_to_local(SourceOffset(at));
        self.core.is_cached(o)
    }

    /// FlashTier's `exists` over this shard's piece `p`: each cached fragment as (global
    /// source offset, valid pages within the piece).
    pub fn exists_range(&self, p: &Piece) -> Vec<(u64, u32)> {
        let found = self.core.exists_range(SourceOffset(p.local), p.len);
        let global = |(o, n)| (self.map.source_to_global(self.k, o).0, n);
        found.into_iter().map(global).collect()
    }

    /// The heat of the fragment holding global source offset `at` (`CacheCore::heat_at`).
    pub fn heat_at(&self, at: u64) -> u32 {
        self.core
            .heat_at(self.map.source_to_local(SourceOffset(at)).1)
    }

    /// True if global slot `slot` (this shard's) is lent to the write-back log.
    pub fn slot_is_lent(&self, slot: u32) -> bool {
        self.core
            .slot_is_lent(self.map.slot_to_local(SlotNo(slot)).1)
    }

    /// Plans a read of piece `p` (this shard's) under the shard's shared lock: a
    /// [`PinnedRead`] whose runs and fills are global, its pins in `pins` (the shard's).
    pub fn plan_read<'p>(
        &self,
        pins: &'p PinTable,
        p: &Piece,
        plan: &'p mut ReadPlan,
    ) -> Result<PinnedRead<'p>, RequestError> {
        let mut read = PinnedRead::plan(&self.core, pins, SourceOffset(p.local), p.len, plan)?;
        read.globalize(self.map, self.k);
        Ok(read)
    }

    /// This shard's global slots.
    pub fn slots(&self) -> std::ops::Range<u32> {
        let lo = self.map.slot_base(self.k);
        lo..lo + self.map.slots(self.k)
    }
}

impl<C: DerefMut<Target = CacheCore>> GlobalCore<'_, C> {
    fn job(&self, job: Option<crate::PopulationJob>) -> Option<OnShard<Population>> {
        Some(self.map.on_shard(self.k, 0, Population::new(job?)))
    }

    /// Algorithm 1's pick ([`CacheCore::pick_population`]), in global addresses.
    pub fn pick_population(&mut self, now: Nanos) -> Option<OnShard<Population>> {
        let job = self.core.pick_population(now);
        self.job(job)
    }

    /// The hottest fragment, whatever the throttle says, in global addresses.
    pub fn pick_population_unthrottled(&mut self) -> Option<OnShard<Population>> {
        let job = self.core.pick_population_unthrottled();
        self.job(job)
    }

    /// A population of the fragment at global source offset `at` (NBD CACHE, a refill).
    pub fn prefetch(&mut self, at: u64) -> Option<OnShard<Population>> {
        let (_, o) = self.map.source_to_local(SourceOffset(at));
        let job = self.core.prefetch(o);
        self.job(job)
    }

    /// Commits a read `plan_read` planned (it wants inline fills) under the shard's
    /// exclusive lock, its addresses made global again.
    pub fn commit_read(&mut self, read: &mut PinnedRead) -> Result<(), RequestError> {
        read.commit(&mut self.core)?;
        read.globalize(self.map, self.k);
        Ok(())
    }

    /// Begins a write of piece `p` (this shard's): its cache copies in global cache
    /// offsets, their buffer offsets within the piece.
    pub fn begin_write(
        &mut self,
        p: &Piece,
        kind: WriteKind,
    ) -> Result<OnShard<WriteTxn>, RequestError> {
        let txn = WriteTxn::begin(&mut self.core, SourceOffset(p.local), p.len, kind)?;
        Ok(self.map.on_shard(self.k, 0, txn))
    }

    /// Lends global slots `slots` (this shard's) to the write-back log; returns those still
    /// in use, which were not lent.
    pub fn lend_slots(&mut self, slots: &[u32]) -> Vec<u32> {
        let local: Vec<SlotNo> = slots
            .iter()
            .map(|&s| self.map.slot_to_local(SlotNo(s)).1)
            .collect();
        let busy = self.core.lend_slots(&local);
        busy.into_iter()
            .map(|s| self.map.slot_to_global(self.k, s).0)
            .collect()
    }

    /// Gives global slot `slot` (this shard's) back to the read cache.
    pub fn give_back_slot(&mut self, slot: u32) -> bool {
        let s = self.map.slot_to_local(SlotNo(slot)).1;
        self.core.give_back_slot(s)
    }

    /// Turns caching of global fragments `[first, end)` off (or back on) in this shard.
    pub fn set_disabled(&mut self, first: u64, end: u64, on: bool) {
        let a = self.map.first_local_from(self.k, FragNo(first));
        let b = self.map.first_local_from(self.k, FragNo(end));
        self.core.set_disabled(a, b, on);
    }

    /// The global slots whose records changed since the last call (`CacheCore::take_dirty`).
    pub fn take_dirty(&mut self) -> Vec<u32> {
        let dirty = self.core.take_dirty();
        dirty
            .into_iter()
            .map(|s| self.map.slot_to_global(self.k, s).0)
            .collect()
    }

    /// Puts records a store loaded back (`CacheCore::restore`), each as (global slot, global
    /// fragment, bitmap): those of other shards' slots, and those whose fragment belongs to
    /// another shard (the shard count changed), are left out. Returns the records restored.
    pub fn restore<'b>(&mut self, entries: impl IntoIterator<Item = (u32, u64, &'b [u64])>) -> u32 {
        let (map, k) = (self.map, self.k);
        let local = entries.into_iter().filter_map(|(s, f, bits)| {
            let (ks, ls) = map.slot_to_local(SlotNo(s));
            let (kf, lf) = map.frag_to_local(FragNo(f));
            (ks == k && kf == k && ls.0 < map.slots(k)).then_some((ls, lf, bits))
        });
        self.core.restore(local)
    }

    /// Caps each volume's share of this shard's slots (`CacheCore::set_shares`): per volume,
    /// its first global fragment and its cap (in slots of this shard).
    pub fn set_shares(&mut self, volumes: &[(u64, Option<u32>)]) {
        let local: Vec<(FragNo, Option<u32>)> = volumes
            .iter()
            .map(|&(first, cap)| (self.map.first_local_from(self.k, FragNo(first)), cap))
            .collect();
        self.core.set_shares(&local);
    }

    /// FlashTier's `evict` over this shard's piece `p` (`CacheCore::evict_range`): the
    /// pages dropped.
    pub fn evict_range(&mut self, p: &Piece) -> u64 {
        self.core.evict_range(SourceOffset(p.local), p.len)
    }

    /// Drops pages `[p0, p1)` of global fragment `f` (this shard's).
    pub fn invalidate(&mut self, f: u64, p0: u32, p1: u32) {
        let (_, f) = self.map.frag_to_local(FragNo(f));
        self.core.invalidate(f, p0, p1);
    }
}

impl<C: Deref<Target = CacheCore>> Deref for GlobalCore<'_, C> {
    type Target = CacheCore;
    /// The core's address-free side (counters, the throttle, the clock).
    fn deref(&self) -> &CacheCore {
        &self.core
    }
}

impl<C: DerefMut<Target = CacheCore>> DerefMut for GlobalCore<'_, C> {
    fn deref_mut(&mut self) -> &mut CacheCore {
        &mut self.core
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CoreConfig;
    use crate::ShardedCore;

    const FRAG: u64 = 1 << 20;

    /// Four shards over 64 fragments of source and 32 slots.
    fn four_shards() -> (ShardMap, Vec<CacheCore>) {
        let cfg = CoreConfig::default();
        let map = ShardMap::for_cache(4, &cfg, 64 * FRAG, 32 * FRAG);
        let cores = map.build(&cfg, 32 * FRAG).expect("cores");
        (map, cores)
    }

    #[test]
    fn jobs_slots_and_records_are_global_and_stay_in_their_shard() {
        let (map, mut cores) = four_shards();
        assert_eq!(map.shards(), 4);
        // A prefetch of each fragment: its job names the fragment, a slot and a span of the
        // shard that holds it, all global.
        for f in 0..64u64 {
            let k = map.shard_of_frag(f);
            assert_eq!(map.shard_of_source(f * FRAG + 4096), k);
            let mut g = GlobalCore::new(&mut cores[k], &map, k);
            let Some(job) = g.prefetch(f * FRAG) else {
                continue;
            };
            assert_eq!((job.frag.0, job.source.0), (f, f * FRAG), "fragment {f}");
            assert!(
                g.slots().contains(&job.slot.0),
                "slot {} of shard {k}",
                job.slot.0
            );
            assert_eq!(map.shard_of_slot(job.slot.0), k);
            for &(_, _, c) in &job.runs {
                assert_eq!(c.0 >> 20, job.slot.0 as u64, "a run outside its slot");
            }
            let slot = job.slot.0;
            let (_, job) = job.into_parts();
            job.complete(&mut g, true);
            assert_eq!(g.slot_of(f), Some(slot));
            assert_eq!(g.slot_fragment(slot), Some(f));
            assert!(g.is_cached(f * FRAG + 8192));
        }
        // Records of another shard's fragment are left out of a restore.
        let k = 1;
        let slot = map.slot_base(k);
        let other = (0..64).find(|&f| map.shard_of_frag(f) != k).expect("one");
        let own = (0..64).find(|&f| map.shard_of_frag(f) == k).expect("one");
        let bits = vec![u64::MAX; cores[k].geometry().bitmap_words()];
        let mut fresh = four_shards();
        let mut g = GlobalCore::new(&mut fresh.1[k], &fresh.0, k);
        assert_eq!(g.restore([(slot, other, &bits[..])]), 0);
        assert_eq!(g.restore([(slot, own, &bits[..])]), 1);
        assert_eq!(g.slot_fragment(slot), Some(own));
    }

    #[test]
    fn the_simulators_core_and_a_locked_shard_agree() {
        let cfg = CoreConfig::default();
        let mut sharded = ShardedCore::new(cfg, 64 * FRAG, 32 * FRAG, 4).expect("core");
        let (map, mut cores) = four_shards();
        for f in [3u64, 17, 42, 63] {
            let k = map.shard_of_frag(f);
            let a = sharded.shard(k).prefetch(f * FRAG).expect("a job");
            let b = GlobalCore::new(&mut cores[k], &map, k)
                .prefetch(f * FRAG)
                .expect("a job");
            assert_eq!((a.slot, a.frag, a.source), (b.slot, b.frag, b.source));
            a.complete(&mut sharded, true);
            let (_, b) = b.into_parts();
            b.complete(&mut cores[k], true);
            assert_eq!(
                sharded.exists(FragNo(f)).map(|s| s.0),
                GlobalCore::new(&cores[k], &map, k).slot_of(f)
            );
        }
    }
}
