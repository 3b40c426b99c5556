//! `ShardedCore`: the lock-free half of a sharded core. It owns the shards' [`CacheCore`]s
//! and their [`ShardMap`] and speaks global addresses only: requests come in at global
//! source offsets, plans go out with global source and cache offsets, and completions come
//! back through guards that know their shard ([`OnShard`]). A single-threaded driver (the
//! simulator) calls it like one core, and so runs with the server's shard count.
//!
//! A request is cut by [`ShardMap::pieces`], each piece planned by its shard's core and its
//! plan rewritten by the map (`globalize`): the map stays the only translation code. A
//! multi-threaded driver (the engine), which keeps each shard behind its own lock, uses the
//! same pieces and sees each locked shard through [`GlobalCore`], which this type's
//! per-shard operations also go through.
//!
//! With one shard every translation is the identity and the one core is configured as
//! given: a driver sees exactly what it would of an unsharded [`CacheCore`].

use crate::addr::{FragNo, Nanos, SlotNo, SourceOffset, SECTOR_SIZE};
use crate::cache::{
    CacheCopy, CacheCore, Populating, Population, ReadPlan, RequestError, SourceWrite, WriteKind,
    WriteTxn,
};
use crate::config::{ConfigError, CoreConfig};
use crate::geometry::Geometry;
use crate::global::GlobalCore;
use crate::shards::{Piece, ShardMap};
use crate::slots::PinTable;
use crate::stats::CoreStats;
use crate::throttle::ThrottleState;
use std::sync::Arc;

/// A guard whose plan a shard's core made and whose addresses can be rewritten to global
/// ones ([`ShardMap::on_shard`]). Its completion ids stay the shard's.
pub trait Globalize {
    /// Rewrites the addresses of a plan made by shard `shard` for a piece at `buf_base` of
    /// its request.
    fn globalize(&mut self, map: &ShardMap, shard: usize, buf_base: u64);
}

impl ShardMap {
    /// Takes guard `guard`, made by shard `shard`'s core (for the piece at `buf_base` of its
    /// request: [`Piece::buf_offset`]; 0 for a job of no request), to global addresses:
    /// the guard, knowing its shard, for [`ShardedCore`] or a shard's lock.
    pub fn on_shard<G: Globalize>(&self, shard: usize, buf_base: u64, mut guard: G) -> OnShard<G> {
        guard.globalize(self, shard, buf_base);
        OnShard { shard, guard }
    }
}

/// A guard of one shard, its plan in global addresses. Complete it on the
/// [`ShardedCore`] (the methods below), or take it apart and complete the guard on its
/// shard's core.
#[must_use = "a guard must be completed"]
#[derive(Debug)]
pub struct OnShard<G> {
    shard: usize,
    guard: G,
}

impl<G> OnShard<G> {
    /// The shard whose core the guard completes on.
    pub fn shard(&self) -> usize {
        self.shard
    }

    /// The shard and the guard, to complete on that shard's core.
    pub fn into_parts(self) -> (usize, G) {
        (self.shard, self.guard)
    }
}

impl<G> std::ops::Deref for OnShard<G> {
    type Target = G;
    fn deref(&self) -> &G {
        &self.guard
    }
}

impl OnShard<Population> {
    /// See [`Population::complete`].
    pub fn complete(self, core: &mut ShardedCore, ok: bool) {
        self.guard.complete(&mut core.cores[self.shard], ok);
    }

    /// See [`Population::into_token`].
    pub fn into_token(self) -> OnShard<Populating> {
        OnShard {
            shard: self.shard,
            guard: self.guard.into_token(),
        }
    }
}

impl OnShard<Populating> {
    /// See [`Populating::complete`].
    pub fn complete(self, core: &mut ShardedCore, ok: bool) {
        self.guard.complete(&mut core.cores[self.shard], ok);
    }
}

impl OnShard<WriteTxn> {
    /// See [`WriteTxn::into_parts`].
    pub fn into_halves(self) -> (OnShard<SourceWrite>, Vec<OnShard<CacheCopy>>) {
        let k = self.shard;
        let (source, copies) = self.guard.into_parts();
        let on = |guard| OnShard { shard: k, guard };
        (
            on(source),
            copies
                .into_iter()
                .map(|c| OnShard { shard: k, guard: c })
                .collect(),
        )
    }
}

impl OnShard<SourceWrite> {
    /// See [`SourceWrite::done`].
    pub fn done(self, core: &mut ShardedCore, ok: bool) {
        self.guard.done(&mut core.cores[self.shard], ok);
    }
}

impl OnShard<CacheCopy> {
    /// See [`CacheCopy::done`].
    pub fn done(self, core: &mut ShardedCore, ok: bool) {
        self.guard.done(&mut core.cores[self.shard], ok);
    }
}

/// A read planned over the shards: one plan per piece, in global addresses, each holding
/// its pins until the read is dropped. Take its populations (inline fills) before.
#[must_use = "dropping the read releases its pins: keep it until its I/O is done"]
#[derive(Debug)]
pub struct ShardedRead {
    /// (shard, offset of the piece within the request, plan).
    plans: Vec<(usize, u64, ReadPlan)>,
    pins: Vec<Arc<PinTable>>,
}

impl ShardedRead {
    /// The plans, one per piece, with each piece's offset within the request (a run's or a
    /// fill's `buf_offset` is within its piece).
    pub fn pieces(&self) -> impl Iterator<Item = (u64, &ReadPlan)> {
        self.plans.iter().map(|(_, at, p)| (*at, p))
    }

    /// The populations of the inline fills, each to complete after its fills were written.
    pub fn take_populations(&mut self) -> Vec<OnShard<Populating>> {
        let mut out = Vec::new();
        for (k, _, plan) in &mut self.plans {
            out.extend(plan.pops.drain(..).map(|id| OnShard {
                shard: *k,
                guard: Populating::new(id),
            }));
        }
        out
    }
}

impl Drop for ShardedRead {
    fn drop(&mut self) {
        for (k, _, plan) in &mut self.plans {
            debug_assert!(
                plan.pops.is_empty() || std::thread::panicking(),
                "a read with inline fills dropped before its populations were taken"
            );
            plan.release_pins(&self.pins[*k]);
        }
    }
}

/// The shards of a volume's core, spoken to in global addresses (see the module).
#[derive(Debug)]
pub struct ShardedCore {
    map: ShardMap,
    cores: Vec<CacheCore>,
    pins: Vec<Arc<PinTable>>,
    cfg: CoreConfig,
    geo: Geometry,
}

impl ShardedCore {
    /// The core of a volume of `source_size` bytes on a cache of `cache_size` bytes, cut into
    /// shards as `core_shards` asks (0: the server's automatic choice,
    /// [`crate::shards::shards_for`]); errors name the config field at fault.
    pub fn new(
        cfg: CoreConfig,
        source_size: u64,
        cache_size: u64,
        core_shards: usize,
    ) -> Result<Self, ConfigError> {
        let map = ShardMap::for_cache(core_shards, &cfg, source_size, cache_size);
        let cores = map.build(&cfg, cache_size)?;
        let geo = if map.shards() == 1 {
            *cores[0].geometry()
        } else {
            let slots = (0..map.shards()).map(|k| map.slots(k)).sum();
            Geometry::new(cfg.fragment_size, source_size, slots)
        };
        Ok(ShardedCore {
            pins: cores.iter().map(|c| c.pin_table()).collect(),
            map,
            cores,
            cfg,
            geo,
        })
    }

    /// The number of shards.
    pub fn shards(&self) -> usize {
        self.cores.len()
    }

    /// The volume's configuration (each shard's is [`ShardMap::shard_config`] of it).
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// The volume's geometry: its source, all the slots.
    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }

    /// A counter summed over the shards (`field` picks it).
    pub fn stat(&self, field: impl Fn(&CoreStats) -> u64) -> u64 {
        self.cores.iter().map(|c| field(c.stats())).sum()
    }

    /// Advances every shard's clock.
    pub fn advance_clock(&mut self, now: Nanos) {
        for c in &mut self.cores {
            c.advance_clock(now);
        }
    }

    /// Shard `k`'s throttle (Algorithm 1 runs per shard, on its own misses and free space).
    pub fn throttle(&mut self, k: usize, now: Nanos) -> ThrottleState {
        self.cores[k].throttle(now)
    }

    /// Shard `k`'s source is busy or not ([`CacheCore::set_source_busy`]).
    pub fn set_source_busy(&mut self, k: usize, busy: bool) {
        self.cores[k].set_source_busy(busy);
    }

    /// Shard `k` in global addresses, borrowed exclusively.
    pub(crate) fn shard(&mut self, k: usize) -> GlobalCore<'_, &mut CacheCore> {
        GlobalCore::new(&mut self.cores[k], &self.map, k)
    }

    /// Shard `k` in global addresses, borrowed shared.
    fn shard_ref(&self, k: usize) -> GlobalCore<'_, &CacheCore> {
        GlobalCore::new(&self.cores[k], &self.map, k)
    }

    /// Shard `k`'s next population job, in global addresses.
    pub fn pick_population(&mut self, k: usize, now: Nanos) -> Option<OnShard<Population>> {
        self.shard(k).pick_population(now)
    }

    /// True if the page holding global source byte `at` is cached and valid.
    pub fn is_cached(&self, at: SourceOffset) -> bool {
        self.shard_ref(self.map.shard_of_source(at.0))
            .is_cached(at.0)
    }

    /// The global slot holding global fragment `f`, if it is cached.
    pub fn exists(&self, f: FragNo) -> Option<SlotNo> {
        self.shard_ref(self.map.shard_of_frag(f.0))
            .slot_of(f.0)
            .map(SlotNo)
    }

    /// Lends global slots `slots` to the write-back log (format 9's chunks;
    /// [`CacheCore::lend_slots`] in each shard). Returns the global slots an operation in
    /// flight pins, to try again once it is done.
    pub fn lend_slots(&mut self, slots: std::ops::Range<u64>) -> Vec<SlotNo> {
        let mut by_shard: Vec<Vec<u32>> = vec![Vec::new(); self.cores.len()];
        for g in slots {
            by_shard[self.map.shard_of_slot(g as u32)].push(g as u32);
        }
        let mut busy = Vec::new();
        for (k, ss) in by_shard.into_iter().enumerate() {
            if !ss.is_empty() {
                busy.extend(self.shard(k).lend_slots(&ss).into_iter().map(SlotNo));
            }
        }
        busy
    }

    /// Gives global slots `slots`, lent to the write-back log, back to the read cache.
    pub fn give_back_slots(&mut self, slots: std::ops::Range<u64>) {
        for g in slots {
            let g = g as u32;
            self.shard(self.map.shard_of_slot(g)).give_back_slot(g);
        }
    }

    /// Plans and commits a read of `len` bytes at `offset` ([`CacheCore::begin_read`] per
    /// piece).
    pub fn begin_read(
        &mut self,
        offset: SourceOffset,
        len: u64,
    ) -> Result<ShardedRead, RequestError> {
        self.check(offset, len)?;
        let mut read = ShardedRead {
            plans: Vec::new(),
            pins: self.pins.clone(),
        };
        let pieces: Vec<Piece> = self.map.pieces(offset.0, len).collect();
        for p in pieces {
            let mut plan = ReadPlan::new();
            let r = self.cores[p.shard].begin_read(SourceOffset(p.local), p.len, &mut plan);
            self.map.globalize_plan(p.shard, &mut plan);
            read.plans.push((p.shard, p.buf_offset, plan));
            if let Err(e) = r {
                for pop in read.take_populations() {
                    pop.complete(self, false);
                }
                return Err(e);
            }
        }
        Ok(read)
    }

    /// Starts a write (or discard) of `len` bytes at `offset`: one [`WriteTxn`] per piece,
    /// each to complete (send the source write after this returns).
    pub fn begin_write(
        &mut self,
        offset: SourceOffset,
        len: u64,
        kind: WriteKind,
    ) -> Result<Vec<OnShard<WriteTxn>>, RequestError> {
        self.check(offset, len)?;
        let pieces: Vec<Piece> = self.map.pieces(offset.0, len).collect();
        let mut out = Vec::with_capacity(pieces.len());
        for p in &pieces {
            match WriteTxn::begin(&mut self.cores[p.shard], SourceOffset(p.local), p.len, kind) {
                Ok(t) => out.push(self.map.on_shard(p.shard, p.buf_offset, t)),
                Err(e) => {
                    // Nothing was sent: the pieces begun complete as failed (their pages,
                    // invalidated, stay so).
                    for t in out {
                        let (source, copies) = t.into_halves();
                        copies.into_iter().for_each(|c| c.done(self, false));
                        source.done(self, false);
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// A bad range is refused before any shard sees it (as one core would refuse it).
    fn check(&self, offset: SourceOffset, len: u64) -> Result<(), RequestError> {
        let (offset, size) = (offset.0, self.geo.source_size());
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(RequestError::OutOfRange { offset, len, size });
        }
        if !offset.is_multiple_of(SECTOR_SIZE) || !len.is_multiple_of(SECTOR_SIZE) {
            return Err(RequestError::Unaligned { offset, len });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::RunTarget;
    use crate::config::WriteMode;
    use crate::shards::{shards_for, AUTO_CORE_SHARDS};

    const FRAG: u64 = 1 << 20;

    fn core(shards: usize, mode: WriteMode) -> ShardedCore {
        let cfg = CoreConfig {
            write_mode: mode,
            ..CoreConfig::default()
        };
        ShardedCore::new(cfg, 64 * FRAG, 16 * FRAG, shards).expect("core")
    }

    #[test]
    fn the_automatic_shard_count_is_the_servers() {
        assert_eq!(shards_for(0, 63), 1);
        assert_eq!(shards_for(0, 128), 2);
        assert_eq!(shards_for(0, 1 << 20), AUTO_CORE_SHARDS);
        assert_eq!(shards_for(3, 8), 3);
        // 16 slots: one automatic shard; asked for 4, four.
        assert_eq!(core(0, WriteMode::Awt).shards(), 1);
        assert_eq!(core(4, WriteMode::Awt).shards(), 4);
    }

    #[test]
    fn a_read_over_shards_plans_in_global_addresses() {
        let mut c = core(4, WriteMode::Awt);
        assert_eq!(c.geometry().slots(), 16);
        let (at, len) = (FRAG - 8192, 2 * FRAG);
        let mut read = c.begin_read(SourceOffset(at), len).unwrap();
        let mut covered = 0;
        for (base, plan) in read.pieces() {
            assert_eq!(base, covered, "the pieces tile the request");
            for r in &plan.runs {
                // Nothing is cached: every run reads the source where the request says.
                assert_eq!(
                    r.target,
                    RunTarget::Source(SourceOffset(at + base + r.buf_offset))
                );
                covered += r.len;
            }
        }
        assert_eq!(covered, len);
        assert_eq!(read.pieces().count(), 3);
        // The 8 KiB piece of the first line may fill the page area from its own data.
        for p in read.take_populations() {
            p.complete(&mut c, false);
        }
        drop(read);
        assert_eq!(c.stat(|s| s.read_pages_missed), len / 4096);
    }

    #[test]
    fn one_shard_is_one_core() {
        let mut one = core(1, WriteMode::Awt);
        let mut plain = CacheCore::new(one.config().clone(), 64 * FRAG, 16 * FRAG).unwrap();
        let w = one
            .begin_write(SourceOffset(0), 8192, WriteKind::Data)
            .unwrap();
        let t = WriteTxn::begin(&mut plain, SourceOffset(0), 8192, WriteKind::Data).unwrap();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].copies().len(), t.copies().len());
        let (s, copies) = t.into_parts();
        copies.into_iter().for_each(|c| c.done(&mut plain, true));
        s.done(&mut plain, true);
        for w in w {
            let (s, copies) = w.into_halves();
            copies.into_iter().for_each(|c| c.done(&mut one, true));
            s.done(&mut one, true);
        }
        assert_eq!(one.geometry(), plain.geometry());
        assert_eq!(one.stat(|s| s.write_requests), plain.stats().write_requests);
    }
}
