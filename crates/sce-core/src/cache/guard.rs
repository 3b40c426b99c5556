//! Typed guards for the driver protocol: plan, pin, I/O, complete.
//!
//! The raw protocol ([`CacheCore::begin_read`], [`CacheCore::begin_write`],
//! [`CacheCore::pick_population`] and their completions) leaves it to the driver to release
//! every pin and report every half of every operation exactly once; an operation never
//! reported stays in flight in the core for ever (its slots pinned, its fragment busy). The
//! guards make that a matter of types. They are pure state, like the core: they do no I/O and
//! take no lock, and a driver that keeps its core behind a lock passes the locked core to the
//! completion.
//!
//! * [`PinnedRead`]: a planned read that owns its pins and releases them when it is dropped
//!   (through the shared [`PinTable`], without the core). Its inline fills come out as
//!   [`Populating`] tokens.
//! * [`WriteTxn`]: a write in flight. It splits into a [`SourceWrite`] and one [`CacheCopy`]
//!   per planned cache copy; each is completed by a method that consumes it.
//! * [`Population`]: a population job with its [`Populating`] token.
//!
//! A completion token is `#[must_use]`; dropping one without completing it (outside a panic)
//! is a driver bug, caught by a debug assertion. (Reporting a failure from `drop` would need
//! the core, which a multi-threaded driver keeps behind its lock.) The raw protocol stays
//! public for the property test, which delivers completions in every order, wrong ones too.

use super::plan::{CacheWrite, PopId, PopulationJob, ReadPlan, RequestError, WriteId, WriteKind};
use super::CacheCore;
use crate::addr::SourceOffset;
use crate::shards::ShardMap;
use crate::slots::PinTable;
use std::sync::Arc;

/// Asserts (in debug builds) that a completion token was completed before it was dropped.
pub(super) fn must_complete(what: &str) {
    if !std::thread::panicking() {
        debug_assert!(
            false,
            "{what} dropped without being completed: the core would keep it in flight for ever"
        );
    }
}

/// A planned read that owns its pins: dropping it releases them through the pin table,
/// without the core's lock. Keep it until the read's I/O is done.
#[must_use = "dropping the read releases its pins: keep it until its I/O is done"]
#[derive(Debug)]
pub struct PinnedRead<'a> {
    plan: &'a mut ReadPlan,
    pins: &'a PinTable,
}

impl<'a> PinnedRead<'a> {
    /// Plans a read with [`CacheCore::plan_read`] (a shared borrow of the core: the caller
    /// records the plan in an `AccessLog`). If the result `needs_commit()`, drop it and
    /// plan again with [`PinnedRead::begin`] under the exclusive lock.
    pub fn plan(
        core: &CacheCore,
        pins: &'a PinTable,
        offset: SourceOffset,
        len: u64,
        plan: &'a mut ReadPlan,
    ) -> Result<Self, RequestError> {
        core.plan_read(offset, len, plan)?;
        Ok(PinnedRead { plan, pins })
    }

    /// Plans and commits a read with [`CacheCore::begin_read`]: accounting, and with
    /// admission `always` the inline fills, whose populations [`PinnedRead::take_populations`]
    /// hands out.
    pub fn begin(
        core: &mut CacheCore,
        pins: &'a PinTable,
        offset: SourceOffset,
        len: u64,
        plan: &'a mut ReadPlan,
    ) -> Result<Self, RequestError> {
        core.begin_read(offset, len, plan)?;
        Ok(PinnedRead { plan, pins })
    }

    /// Redoes a read that `needs_commit()` (an inline fill is wanted: admission `always`, or
    /// a miss fill) under the exclusive lock: releases its pins and plans it again as
    /// [`CacheCore::begin_read`] does, which starts the fills' populations, keeping the
    /// stream detector's verdict of the first plan.
    pub fn commit(&mut self, core: &mut CacheCore) -> Result<(), RequestError> {
        self.plan.release_pins(self.pins);
        let (offset, len) = (self.plan.offset, self.plan.len);
        core.redo_read(SourceOffset(offset), len, self.plan)
    }

    /// The populations of this read's inline fills, each to complete after its fills were
    /// written (`fills` with the token's id). Before the read is dropped: its pins are
    /// released after them.
    pub fn take_populations(&mut self) -> Vec<Populating> {
        self.plan
            .pops
            .drain(..)
            .map(|id| Populating { id })
            .collect()
    }

    /// Rewrites the plan's runs and fills to global addresses: it was made by shard `shard`
    /// of `map` (see [`ShardMap::globalize_plan`]). Its pins stay the shard's.
    pub fn globalize(&mut self, map: &ShardMap, shard: usize) {
        map.globalize_plan(shard, self.plan);
    }

    /// Drops the inline fills: their populations are then completed as failed (the fills'
    /// slots could not be guarded).
    pub fn clear_fills(&mut self) {
        self.plan.fills.clear();
    }
}

impl PinnedRead<'_> {
    /// Keeps the read's pins beyond the borrow of its plan, for a read whose I/O completes
    /// on another thread (a hit served through an I/O queue): the plan moves into the
    /// returned [`HeldRead`], which releases the pins when dropped. `pins` must be the pin
    /// table the read was planned with; a read with inline fills cannot be held.
    pub fn hold(self, pins: Arc<PinTable>) -> HeldRead {
        assert!(
            std::ptr::eq(self.pins, &*pins),
            "a read is held with the pin table it was planned with"
        );
        assert!(
            self.plan.pops.is_empty(),
            "a read with inline fills is completed where it was planned"
        );
        let plan = std::mem::take(&mut *self.plan);
        // Its pins now belong to the held read, which releases them.
        std::mem::forget(self);
        HeldRead { plan, pins }
    }
}

/// A planned read that owns its plan and its pins (see [`PinnedRead::hold`]): dropping it
/// releases the pins. Keep it until the read's I/O is done.
#[must_use = "dropping the read releases its pins: keep it until its I/O is done"]
#[derive(Debug)]
pub struct HeldRead {
    plan: ReadPlan,
    pins: Arc<PinTable>,
}

impl std::ops::Deref for HeldRead {
    type Target = ReadPlan;
    fn deref(&self) -> &ReadPlan {
        &self.plan
    }
}

impl Drop for HeldRead {
    fn drop(&mut self) {
        self.plan.release_pins(&self.pins);
    }
}

impl std::ops::Deref for PinnedRead<'_> {
    type Target = ReadPlan;
    fn deref(&self) -> &ReadPlan {
        self.plan
    }
}

impl Drop for PinnedRead<'_> {
    fn drop(&mut self) {
        debug_assert!(
            self.plan.pops.is_empty() || std::thread::panicking(),
            "a read with inline fills dropped before its populations were taken"
        );
        self.plan.release_pins(self.pins);
    }
}

/// A population in flight (background, prefetch or an inline fill): complete it once its
/// source read and cache writes are done.
#[must_use = "a population must be completed with `complete`"]
#[derive(Debug)]
pub struct Populating {
    id: PopId,
}

impl Populating {
    /// The token of population `id`, just started by the core.
    pub(crate) fn new(id: PopId) -> Self {
        Populating { id }
    }

    /// The population's id (an inline fill's `FillRun::pop`).
    pub fn id(&self) -> PopId {
        self.id
    }

    /// Reports the population: `ok` if the source read and every cache write succeeded.
    pub fn complete(self, core: &mut CacheCore, ok: bool) {
        let this = std::mem::ManuallyDrop::new(self);
        let r = core.complete_population(this.id, ok);
        debug_assert!(
            r.is_ok(),
            "a population is completed once, by its token: {r:?}"
        );
    }
}

impl Drop for Populating {
    fn drop(&mut self) {
        must_complete("a population");
    }
}

/// A population job the core picked, with its completion token.
#[must_use = "a population must be completed with `complete`"]
#[derive(Debug)]
pub struct Population {
    job: PopulationJob,
    token: Populating,
}

impl Population {
    /// Takes charge of a job just returned by [`CacheCore::pick_population`],
    /// [`CacheCore::pick_population_unthrottled`] or [`CacheCore::prefetch`].
    pub fn new(job: PopulationJob) -> Self {
        let token = Populating { id: job.id };
        Population { job, token }
    }

    /// Reports the population: `ok` if the source read and every cache write succeeded.
    pub fn complete(self, core: &mut CacheCore, ok: bool) {
        self.token.complete(core, ok);
    }

    /// The completion token alone (a driver that models the I/O and completes it later).
    pub fn into_token(self) -> Populating {
        self.token
    }
}

impl std::ops::Deref for Population {
    type Target = PopulationJob;
    fn deref(&self) -> &PopulationJob {
        &self.job
    }
}

/// A write in flight: its source half and its cache copies, each to complete once.
#[must_use = "a write must be completed: `into_parts`, then complete every part"]
#[derive(Debug)]
pub struct WriteTxn {
    source: SourceWrite,
    copies: Vec<CacheCopy>,
    synchronous: bool,
}

impl WriteTxn {
    /// Starts a write with [`CacheCore::begin_write`]: the pages are invalidated and the
    /// cache copies planned. Send the source write only after this returns.
    pub fn begin(
        core: &mut CacheCore,
        offset: SourceOffset,
        len: u64,
        kind: WriteKind,
    ) -> Result<Self, RequestError> {
        let plan = core.begin_write(offset, len, kind)?;
        let id = plan.id;
        Ok(WriteTxn {
            source: SourceWrite { id },
            copies: plan
                .cache_writes
                .into_iter()
                .map(|write| CacheCopy { id, write })
                .collect(),
            synchronous: plan.synchronous,
        })
    }

    /// The write's id.
    pub fn id(&self) -> WriteId {
        self.source.id
    }

    /// True in synchronous write-through mode: acknowledge only after the cache copies.
    pub fn synchronous(&self) -> bool {
        self.synchronous
    }

    /// The cache copies to write.
    pub fn copies(&self) -> &[CacheCopy] {
        &self.copies
    }

    /// The two halves, to complete independently (in any order, from any thread).
    pub fn into_parts(self) -> (SourceWrite, Vec<CacheCopy>) {
        (self.source, self.copies)
    }
}

impl crate::sharded::Globalize for WriteTxn {
    fn globalize(&mut self, map: &ShardMap, shard: usize, buf_base: u64) {
        for c in &mut self.copies {
            c.write.cache = map.cache_to_global(shard, c.write.cache);
            c.write.buf_offset += buf_base;
        }
    }
}

impl crate::sharded::Globalize for Population {
    fn globalize(&mut self, map: &ShardMap, shard: usize, _buf_base: u64) {
        map.globalize_job(shard, &mut self.job);
    }
}

/// The source half of a write in flight.
#[must_use = "the source half of a write must be completed with `done`"]
#[derive(Debug)]
pub struct SourceWrite {
    id: WriteId,
}

impl SourceWrite {
    /// The write's id.
    pub fn id(&self) -> WriteId {
        self.id
    }

    /// Reports the source write (or discard). A failed one leaves the pages invalid.
    pub fn done(self, core: &mut CacheCore, ok: bool) {
        let this = std::mem::ManuallyDrop::new(self);
        let r = core.write_source_done(this.id, ok);
        debug_assert!(
            r.is_ok(),
            "a source write is completed once, by its token: {r:?}"
        );
    }
}

impl Drop for SourceWrite {
    fn drop(&mut self) {
        must_complete("the source half of a write");
    }
}

/// One cache copy of a write in flight.
#[must_use = "a cache copy must be completed with `done`"]
#[derive(Debug)]
pub struct CacheCopy {
    id: WriteId,
    write: CacheWrite,
}

impl CacheCopy {
    /// What to write: `len` bytes of the request buffer at `buf_offset`, to `cache`.
    pub fn write(&self) -> &CacheWrite {
        &self.write
    }

    /// Reports the copy. A failed one leaves its pages invalid.
    pub fn done(self, core: &mut CacheCore, ok: bool) {
        let this = std::mem::ManuallyDrop::new(self);
        let r = core.write_cache_done(this.id, this.write.part, ok);
        debug_assert!(
            r.is_ok(),
            "a cache copy is completed once, by its token: {r:?}"
        );
    }
}

impl Drop for CacheCopy {
    fn drop(&mut self) {
        must_complete("a cache copy of a write");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CoreConfig;

    fn core() -> CacheCore {
        CacheCore::new(CoreConfig::default(), 64 << 20, 8 << 20).expect("core")
    }

    #[test]
    fn a_write_completed_through_its_tokens_leaves_nothing_in_flight() {
        let mut c = core();
        let t = WriteTxn::begin(&mut c, SourceOffset(0), 4096, WriteKind::Data).unwrap();
        let (source, copies) = t.into_parts();
        for copy in copies {
            copy.done(&mut c, true);
        }
        source.done(&mut c, true);
        assert_eq!(c.operations_in_flight(), (0, 0));
    }

    #[test]
    fn a_read_releases_its_pins_when_dropped() {
        let mut c = core();
        let job = c.prefetch(SourceOffset(0)).expect("a job");
        Population::new(job).complete(&mut c, true);
        let pins = c.pin_table();
        let mut plan = ReadPlan::new();
        let read = PinnedRead::plan(&c, &pins, SourceOffset(0), 4096, &mut plan).unwrap();
        assert!(read.full_hit);
        let slot = c.exists(crate::FragNo(0)).expect("cached").0;
        assert!(pins.get(slot) > 0);
        drop(read);
        assert_eq!(pins.get(slot), 0);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "dropped without being completed")]
    fn a_token_dropped_uncompleted_fails_a_debug_assertion() {
        let mut c = core();
        let t = WriteTxn::begin(&mut c, SourceOffset(0), 4096, WriteKind::Data).unwrap();
        drop(t);
    }
}
