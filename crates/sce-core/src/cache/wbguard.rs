//! Typed guards of write-back (see [`guard`](super::guard) for the pattern): a write-back
//! write ([`WriteBackTxn`]), a cleaning job ([`Cleaning`]) and a slot hold ([`SlotHold`]).
//! Each is `#[must_use]`, completed by a method that consumes it, and fails a debug
//! assertion when dropped uncompleted outside a panic. Like the other guards they are pure
//! state: a driver that keeps its core behind a lock passes the locked core to the
//! completion, from any thread.
//!
//! The raw calls ([`CacheCore::begin_writeback`], [`CacheCore::complete_writeback`],
//! [`CacheCore::abort_writeback`], [`CacheCore::pick_clean`], [`CacheCore::pick_clean_in`],
//! [`CacheCore::complete_clean`], [`CacheCore::hold_slot`], [`CacheCore::release_slot`])
//! stay public, hidden from the docs, for the property test `tests/writeback.rs` alone,
//! which delivers completions in every order, wrong ones too.

use super::guard::must_complete;
use super::writeback::{CleanJob, WriteBackPlan, WriteBackRefusal};
use super::CacheCore;
use crate::addr::{SlotNo, SourceOffset};
use crate::shards::ShardMap;
use std::mem::ManuallyDrop;

/// A write-back write in flight: write every copy of its plan to the cache device, then
/// [`complete`](Self::complete) it; or [`abort`](Self::abort) it if nothing was written
/// (its records could not be made durable).
///
/// The engine's `WriteBack::begin` (crates/sce-engine/src/back/write.rs) starts it, and
/// `WriteBack::piece` completes it, or aborts it when its dirty entries could not be made
/// durable.
#[must_use = "a write-back write must be completed with `complete` or `abort`"]
#[derive(Debug)]
pub struct WriteBackTxn {
    plan: WriteBackPlan,
}

impl WriteBackTxn {
    /// Starts a write-back write of `len` bytes at `offset` with
    /// [`CacheCore::begin_writeback`] (the refusals say why it must wait, or cannot be).
    pub fn begin(
        core: &mut CacheCore,
        offset: SourceOffset,
        len: u64,
    ) -> Result<Self, WriteBackRefusal> {
        Ok(WriteBackTxn {
            plan: core.begin_writeback(offset, len)?,
        })
    }

    /// Its plan: the cache writes to make.
    pub fn plan(&self) -> &WriteBackPlan {
        &self.plan
    }

    /// Reports the cache copies: all written (`ok`: the pages are valid and dirty), or one
    /// failed (the pages are invalid, and those that were dirty are lost).
    pub fn complete(self, core: &mut CacheCore, ok: bool) {
        let this = ManuallyDrop::new(self);
        let r = core.complete_writeback(this.plan.id, ok);
        debug_assert!(
            r.is_ok(),
            "a write-back write is completed once, by its guard: {r:?}"
        );
    }

    /// Gives the write up before any of its data was written: its pages stay exactly as
    /// they were.
    pub fn abort(self, core: &mut CacheCore) {
        let this = ManuallyDrop::new(self);
        let r = core.abort_writeback(this.plan.id);
        debug_assert!(
            r.is_ok(),
            "a write-back write is aborted once, by its guard: {r:?}"
        );
    }
}

impl crate::sharded::Globalize for WriteBackTxn {
    fn globalize(&mut self, map: &ShardMap, shard: usize, buf_base: u64) {
        map.globalize_writeback(shard, buf_base, &mut self.plan);
    }
}

impl crate::sharded::Globalize for Cleaning {
    fn globalize(&mut self, map: &ShardMap, shard: usize, _buf_base: u64) {
        map.globalize_clean(shard, &mut self.job);
    }
}

impl std::ops::Deref for WriteBackTxn {
    type Target = WriteBackPlan;
    fn deref(&self) -> &WriteBackPlan {
        &self.plan
    }
}

impl Drop for WriteBackTxn {
    fn drop(&mut self) {
        must_complete("a write-back write");
    }
}

/// A cleaning job in flight: read its runs from the cache, write them to the source, then
/// [`complete`](Self::complete) it.
///
/// The engine's `WriteBack::clean_some` (crates/sce-engine/src/back/clean.rs) picks it and
/// completes it, failed if the cache device's flush or the source's write failed.
#[must_use = "a cleaning job must be completed with `complete`"]
#[derive(Debug)]
pub struct Cleaning {
    job: CleanJob,
}

impl Cleaning {
    /// The next cleaning job in source order from the cleaner's cursor
    /// ([`CacheCore::pick_clean`]), if there is one now.
    pub fn pick(core: &mut CacheCore) -> Option<Self> {
        core.pick_clean().map(|job| Cleaning { job })
    }

    /// The next cleaning job among the dirty fragments of `[offset, offset + len)`
    /// ([`CacheCore::pick_clean_in`]: `sce ctl clean RANGE`, a detach draining its export).
    pub fn pick_in(core: &mut CacheCore, offset: SourceOffset, len: u64) -> Option<Self> {
        core.pick_clean_in(offset, len).map(|job| Cleaning { job })
    }

    /// Reports the job: its pages are on the source (`ok`: now clean, unless lost
    /// meanwhile), or not (they stay dirty).
    pub fn complete(self, core: &mut CacheCore, ok: bool) {
        let this = ManuallyDrop::new(self);
        let r = core.complete_clean(this.job.id, ok);
        debug_assert!(
            r.is_ok(),
            "a cleaning job is completed once, by its guard: {r:?}"
        );
    }
}

impl std::ops::Deref for Cleaning {
    type Target = CleanJob;
    fn deref(&self) -> &CleanJob {
        &self.job
    }
}

impl Drop for Cleaning {
    fn drop(&mut self) {
        must_complete("a cleaning job");
    }
}

/// A hold on a slot: while it lasts the slot is not evicted nor given to another fragment
/// (write-back persistence holds the slots whose on-device records may still claim dirty
/// pages). [`release`](Self::release) it on the core it was taken from.
///
/// The engine takes it in `WriteBack::begin` (crates/sce-engine/src/back/write.rs) and
/// `hold_dirty` (back/restore.rs), keeps it in its persistence state, and releases it in
/// `release_holds` (crates/sce-engine/src/persist/wb.rs); a store that goes away with its
/// cores gives its holds up with `abandon`.
#[must_use = "a slot hold must be released with `release` (or given up with `abandon`)"]
#[derive(Debug)]
pub struct SlotHold {
    slot: SlotNo,
}

impl SlotHold {
    /// Holds slot `s` of `core` where it is ([`CacheCore::hold_slot`]). None if it could
    /// not be pinned (its pin count is at its maximum).
    pub fn take(core: &mut CacheCore, s: SlotNo) -> Option<Self> {
        core.hold_slot(s).then_some(SlotHold { slot: s })
    }

    /// The slot held (the core's own number).
    pub fn slot(&self) -> SlotNo {
        self.slot
    }

    /// Releases the hold.
    pub fn release(self, core: &mut CacheCore) {
        let this = ManuallyDrop::new(self);
        core.release_slot(this.slot);
    }

    /// Gives the hold up without the core: only when the core goes away with it (the
    /// driver shuts down).
    pub fn abandon(self) {
        let _ = ManuallyDrop::new(self);
    }
}

impl Drop for SlotHold {
    fn drop(&mut self) {
        must_complete("a slot hold");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CoreConfig, WriteMode};

    fn core() -> CacheCore {
        let cfg = CoreConfig {
            write_mode: WriteMode::WriteBack,
            ..CoreConfig::default()
        };
        CacheCore::new(cfg, 64 << 20, 8 << 20).expect("core")
    }

    #[test]
    fn a_write_back_write_and_its_cleaning_through_their_guards_leave_nothing_behind() {
        let mut c = core();
        let w = WriteBackTxn::begin(&mut c, SourceOffset(0), 8192).unwrap();
        assert_eq!(w.copies.len(), 1);
        w.complete(&mut c, true);
        assert_eq!(c.dirty_pages(), 2);
        let job = Cleaning::pick(&mut c).expect("a dirty fragment");
        assert_eq!(job.runs.len(), 1);
        job.complete(&mut c, true);
        assert_eq!(c.dirty_pages(), 0);
        assert!(c.writeback_clean());
    }

    #[test]
    fn an_aborted_write_back_write_leaves_its_pages_as_they_were() {
        let mut c = core();
        let w = WriteBackTxn::begin(&mut c, SourceOffset(0), 4096).unwrap();
        w.abort(&mut c);
        assert_eq!(c.dirty_pages(), 0);
        assert!(c.writeback_clean());
        assert!(!c.is_cached(SourceOffset(0)));
    }

    #[test]
    fn a_held_slot_is_pinned_until_released() {
        let mut c = core();
        let pins = c.pin_table();
        let h = SlotHold::take(&mut c, SlotNo(3)).expect("held");
        assert_eq!(pins.get(h.slot()), 1);
        h.release(&mut c);
        assert_eq!(pins.get(SlotNo(3)), 0);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "dropped without being completed")]
    fn a_cleaning_job_dropped_uncompleted_fails_a_debug_assertion() {
        let mut c = core();
        WriteBackTxn::begin(&mut c, SourceOffset(0), 4096)
            .unwrap()
            .complete(&mut c, true);
        drop(Cleaning::pick(&mut c));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "dropped without being completed")]
    fn a_slot_hold_dropped_unreleased_fails_a_debug_assertion() {
        let mut c = core();
        drop(SlotHold::take(&mut c, SlotNo(0)));
    }
}
