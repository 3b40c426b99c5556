//! `Cores`: the core's shards behind their locks, with everything that is per shard (the
//! shard map, the pin tables, the deferred read accounting) and the engine's clock. It is
//! the only owner of the shards' locks.
//!
//! - Exclusive access is [`Cores::with_shard`], shared access [`Cores::read_shard`]: a
//!   closure runs with the shard locked, so a lock can never outlive its use, and a debug
//!   build asserts that no thread holds two shards at once (level `CoreShard` in
//!   `order.rs` and docs/ARCHITECTURE.md): taking a second shard inside a closure, or a
//!   lock of a lower level, panics in every test.
//! - Callers speak global addresses: a shard is seen through `sce_core::GlobalCore`
//!   ([`Cores::global`], [`Cores::at_source`], ...), jobs and writes come out as `OnShard`
//!   guards in global addresses and complete with [`Cores::finish`]. The translations
//!   between a shard's own numbers and the volume's stay in `sce-core`.
//! - Reads planned under a shared lock defer their accounting to log shards
//!   ([`Cores::log_read`]), applied to the core in batches.

use crate::brlock::BrLock;
use crate::order::{levels, OrderedMutex, Token};
use crate::shard::thread_index;
use sce_core::slots::PinTable;
use sce_core::{
    AccessLog, CacheCore, CoreConfig, GlobalCore, Nanos, OnShard, Piece, PinnedRead, ReadPlan,
    RequestError, ShardMap,
};
use std::sync::Arc;
use std::time::Instant;

/// Shards of deferred read accounting per core shard.
const LOG_SHARDS: usize = 32;
/// Reads a shard records before it applies its log to the core, if the core's exclusive
/// lock is free at once.
const LOG_BATCH: u64 = 256;
/// Reads a shard records before it applies its log whatever the wait.
const LOG_CAP: u64 = 1024;

/// One shard of deferred read accounting, on its own cache lines so that threads on
/// different shards do not share them.
#[derive(Default)]
#[repr(align(128))]
struct LogShard(OrderedMutex<levels::LogShard, AccessLog>);

/// The core's shards and what belongs to each.
pub(crate) struct Cores {
    /// Each behind a big-reader lock: a hit takes only its thread's reader shard of its
    /// fragment's core shard.
    shards: Box<[BrLock<CacheCore>]>,
    map: ShardMap,
    pins: Box<[Arc<PinTable>]>,
    /// `LOG_SHARDS` read-log shards per core shard: core shard `k`, thread shard `t` at
    /// `k * LOG_SHARDS + t`.
    logs: Box<[LogShard]>,
    epoch: Instant,
}

/// A core shard held by this thread (its level, checked in debug builds: no second one).
type Holding = Token<levels::CoreShard>;

impl Cores {
    /// The shards `cores`, cut as `map` says.
    pub(crate) fn new(cores: Vec<CacheCore>, map: ShardMap) -> Cores {
        let n = cores.len();
        Cores {
            pins: cores.iter().map(|c| c.pin_table()).collect(),
            shards: cores.into_iter().map(BrLock::new).collect(),
            map,
            logs: (0..LOG_SHARDS * n).map(|_| LogShard::default()).collect(),
            epoch: Instant::now(),
        }
    }

    /// The engine's clock, for the core.
    pub(crate) fn now(&self) -> Nanos {
        Nanos::from_duration(self.epoch.elapsed())
    }

    /// The number of shards.
    pub(crate) fn count(&self) -> usize {
        self.shards.len()
    }

    /// Runs `f` with shard `k` locked exclusively.
    pub(crate) fn with_shard<R>(&self, k: usize, f: impl FnOnce(&mut CacheCore) -> R) -> R {
        let _h = Holding::enter();
        f(&mut self.shards[k].write())
    }

    /// Runs `f` with shard `k` locked shared.
    pub(crate) fn read_shard<R>(&self, k: usize, f: impl FnOnce(&CacheCore) -> R) -> R {
        let _h = Holding::enter();
        f(&self.shards[k].read())
    }

    /// Runs `f` with shard `k` locked exclusively, seen in global addresses.
    #[inline]
    pub(crate) fn global<R>(
        &self,
        k: usize,
        f: impl FnOnce(&mut GlobalCore<&mut CacheCore>) -> R,
    ) -> R {
        self.with_shard(k, |core| f(&mut GlobalCore::new(core, &self.map, k)))
    }

    /// Runs `f` with shard `k` locked shared, seen in global addresses.
    #[inline]
    pub(crate) fn global_read<R>(
        &self,
        k: usize,
        f: impl FnOnce(&GlobalCore<&CacheCore>) -> R,
    ) -> R {
        self.read_shard(k, |core| f(&GlobalCore::new(core, &self.map, k)))
    }

    /// `global` on the shard holding global source offset `o`.
    pub(crate) fn at_source<R>(
        &self,
        o: u64,
        f: impl FnOnce(&mut GlobalCore<&mut CacheCore>) -> R,
    ) -> R {
        self.global(self.map.shard_of_source(o), f)
    }

    /// `global_read` on the shard holding global source offset `o`.
    pub(crate) fn read_at_source<R>(
        &self,
        o: u64,
        f: impl FnOnce(&GlobalCore<&CacheCore>) -> R,
    ) -> R {
        self.global_read(self.map.shard_of_source(o), f)
    }

    /// `global` on the shard owning global slot `s`.
    pub(crate) fn at_slot<R>(
        &self,
        s: u32,
        f: impl FnOnce(&mut GlobalCore<&mut CacheCore>) -> R,
    ) -> R {
        self.global(self.map.shard_of_slot(s), f)
    }

    /// The shard owning global slot `s`.
    pub(crate) fn shard_of_slot(&self, s: u32) -> usize {
        self.map.shard_of_slot(s)
    }

    /// Completes guard `on` on its shard's core, under that shard's exclusive lock.
    pub(crate) fn finish<G, R>(&self, on: OnShard<G>, f: impl FnOnce(G, &mut CacheCore) -> R) -> R {
        let (k, g) = on.into_parts();
        self.with_shard(k, |core| f(g, core))
    }

    /// Runs `f` on every shard in turn, each locked exclusively (one at a time).
    pub(crate) fn each_shard(&self, mut f: impl FnMut(usize, &mut CacheCore)) {
        for k in 0..self.count() {
            self.with_shard(k, |core| f(k, core));
        }
    }

    /// Runs `f` on every shard in turn, each locked exclusively and seen in global
    /// addresses (one at a time).
    pub(crate) fn each_global(&self, mut f: impl FnMut(&mut GlobalCore<&mut CacheCore>)) {
        for k in 0..self.count() {
            self.global(k, &mut f);
        }
    }

    /// Sums `f` over the shards, each locked shared (one at a time).
    pub(crate) fn sum<T: std::iter::Sum>(&self, f: impl Fn(&CacheCore) -> T) -> T {
        (0..self.count()).map(|k| self.read_shard(k, &f)).sum()
    }

    /// The pieces of a request at global `offset`: one per shard-contiguous part.
    pub(crate) fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = Piece> + '_ {
        self.map.pieces(offset, len)
    }

    /// The one piece of a request of `len > 0` bytes at global `offset` within one fragment.
    pub(crate) fn piece(&self, offset: u64, len: u64) -> Piece {
        self.map.piece(offset, len)
    }

    /// A shard's part of the volume's configuration `cfg`.
    pub(crate) fn shard_config(&self, cfg: &CoreConfig) -> CoreConfig {
        self.map.shard_config(cfg)
    }

    /// Plans a read of `piece` under its shard's shared lock, its addresses made global;
    /// `then` runs under the same lock (to take what must be read with the plan).
    pub(crate) fn plan_read<'p>(
        &'p self,
        piece: &Piece,
        plan: &'p mut ReadPlan,
        then: impl FnOnce(&PinnedRead),
    ) -> Result<PinnedRead<'p>, RequestError> {
        let k = piece.shard;
        self.global_read(k, |core| {
            let read = core.plan_read(&self.pins[k], piece, plan)?;
            then(&read);
            Ok(read)
        })
    }

    /// Commits a read planned by `plan_read` under its shard's exclusive lock (it wants
    /// inline fills), its addresses made global again; `then` runs under the same lock.
    pub(crate) fn commit_read(
        &self,
        k: usize,
        read: &mut PinnedRead,
        then: impl FnOnce(&PinnedRead, &CacheCore),
    ) -> Result<(), RequestError> {
        self.global(k, |core| {
            core.advance_clock(self.now());
            core.commit_read(read)?;
            then(read, core);
            Ok(())
        })
    }

    /// Shard `k`'s pin table (a read held past its plan keeps it).
    pub(crate) fn pins(&self, k: usize) -> &Arc<PinTable> {
        &self.pins[k]
    }

    /// Drops pages `[p0, p1)` of global fragment `f` from the cache.
    pub(crate) fn invalidate(&self, f: u64, p0: u32, p1: u32) {
        self.global(self.map.shard_of_frag(f), |core| core.invalidate(f, p0, p1));
    }

    /// The read-log shards of core shard `k`.
    fn logs_of(&self, k: usize) -> &[LogShard] {
        &self.logs[k * LOG_SHARDS..(k + 1) * LOG_SHARDS]
    }

    /// Records a read planned under shard `k`'s shared lock in this thread's log shard for
    /// it, and applies the log to the shard once it holds `LOG_BATCH` reads and the
    /// exclusive lock is free at once, or once it holds `LOG_CAP` reads whatever it costs.
    pub(crate) fn log_read(&self, k: usize, plan: &ReadPlan) {
        // Lock order: a log shard is a leaf lock, released before the core lock is taken;
        // the log is then taken out of the shard under the core lock (core, then leaf).
        let shard = &self.logs_of(k)[thread_index() % LOG_SHARDS];
        let pending = {
            let mut log = shard.0.lock();
            log.record(plan);
            log.requests()
        };
        if pending < LOG_BATCH {
            return;
        }
        let _h = Holding::enter();
        let core = if pending < LOG_CAP {
            self.shards[k].try_write()
        } else {
            Some(self.shards[k].write())
        };
        if let Some(mut core) = core {
            core.apply_access_log(&mut shard.0.lock());
        }
    }

    /// Applies the deferred read accounting of shard `k` (`core`, locked) to it: every
    /// thread's log at once, so that the reads that missed, in any log, go to the front of
    /// the hotness window (`CacheCore::apply_access_logs`). The log shards are leaf locks,
    /// taken in index order, and nobody holds one while taking another.
    pub(crate) fn apply_logs(&self, k: usize, core: &mut CacheCore) {
        let mut logs: Vec<_> = self.logs_of(k).iter().map(|s| s.0.lock()).collect();
        core.apply_access_logs(&mut logs);
    }

    /// Applies every shard's deferred read accounting, one shard at a time.
    pub(crate) fn apply_all_logs(&self) {
        self.each_shard(|k, core| self.apply_logs(k, core));
    }

    /// What shard `k`'s logs add to its read counters once applied (requests, full hits,
    /// hit pages, missed pages); the caller holds the shard (core, then leaf).
    pub(crate) fn pending_counts(&self, k: usize) -> [u64; 4] {
        let mut sum = [0; 4];
        for shard in self.logs_of(k) {
            for (s, x) in sum.iter_mut().zip(shard.0.lock().pending_counts()) {
                *s += x;
            }
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::order::{levels, OrderedMutex};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    fn two_shards() -> Cores {
        let cfg = CoreConfig::default();
        let (source, cache) = (1 << 30, 64 << 20);
        let map = ShardMap::for_cache(2, &cfg, source, cache);
        Cores::new(map.build(&cfg, cache).expect("cores"), map)
    }

    /// Panics of `f`, as text (None if it returned).
    fn panic_of(f: impl FnOnce()) -> Option<String> {
        let e = catch_unwind(AssertUnwindSafe(f)).err()?;
        e.downcast_ref::<String>().cloned().or(Some("?".into()))
    }

    #[test]
    #[cfg(debug_assertions)]
    fn a_second_shard_or_a_lock_out_of_order_panics() {
        let cores = two_shards();
        assert_eq!(cores.count(), 2);
        // One shard after the other: fine.
        cores.with_shard(0, |_| ());
        cores.read_shard(1, |_| ());
        type Nested = fn(&Cores);
        let nested: [(&str, Nested); 3] = [
            ("exclusive, then shared", |c| {
                c.with_shard(0, |_| c.read_shard(1, |_| ()))
            }),
            ("shared, then exclusive", |c| {
                c.read_shard(1, |_| c.with_shard(0, |_| ()))
            }),
            ("shared twice", |c| {
                c.read_shard(0, |_| c.read_shard(1, |_| ()))
            }),
        ];
        for (what, f) in nested {
            let p = panic_of(|| f(&cores)).unwrap_or_else(|| panic!("{what}: no panic"));
            assert!(p.contains("took CoreShard"), "{what}: {p}");
        }
        // A lock of a lower level under a shard: the engine's configuration (level 3).
        let config = OrderedMutex::<levels::EngineConfig, _>::new(());
        let p = panic_of(|| cores.with_shard(0, |_| drop(config.lock()))).expect("no panic");
        assert!(
            p.contains("took EngineConfig (level 3) while holding CoreShard"),
            "{p}"
        );
        // The other way round is the order, and a panic above released what it held.
        let _c = config.lock();
        cores.with_shard(1, |_| ());
        cores.apply_all_logs();
    }
}
