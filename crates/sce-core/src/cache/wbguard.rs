//! Typed guards for write-back's part of the driver protocol, like those of `guard.rs`: a
//! write-back write ([`WriteBackTxn`]), a cleaning job ([`Cleaning`]) and a slot hold
//! ([`SlotHold`]). Each is `#[must_use]`, consumed by its completion, and, dropped without
//! one (outside a panic), fails a debug assertion: a write-back write or a cleaning never
//! reported stays in flight in the core for ever, a hold never released keeps its slot for
//! ever. The raw calls ([`CacheCore::begin_writeback`], [`CacheCore::complete_writeback`],
//! [`CacheCore::abort_writeback`], [`CacheCore::pick_clean`], [`CacheCore::complete_clean`],
//! [`CacheCore::hold_slot`], [`CacheCore::release_slot`]) stay public for the property tests.

use super::guard::must_complete;
use super::writeback::{CleanJob, WriteBackPlan, WriteBackRefusal};
use super::CacheCore;
use crate::addr::{SlotNo, SourceOffset};

/// A write-back write in flight: its plan (the cache copies to write) and the duty to
/// report it, `complete` once its data was written (or failed), or `abort` if nothing was
/// written (its dirty entries could not be made durable).
#[must_use = "a write-back write must be completed with `complete` or `abort`"]
#[derive(Debug)]
pub struct WriteBackTxn {
    plan: WriteBackPlan,
    done: bool,
}

impl WriteBackTxn {
    /// Starts a write-back write of `len` bytes at `offset` ([`CacheCore::begin_writeback`]).
    pub fn begin(
        core: &mut CacheCore,
        offset: SourceOffset,
        len: u64,
    ) -> Result<WriteBackTxn, WriteBackRefusal> {
        Ok(WriteBackTxn {
            plan: core.begin_writeback(offset, len)?,
            done: false,
        })
    }

    /// Reports the write: its data written (`ok`), or failed (its pages lost).
    pub fn complete(mut self, core: &mut CacheCore, ok: bool) {
        let r = core.complete_writeback(self.plan.id, ok);
        debug_assert!(r.is_ok(), "a write-back write is completed once: {r:?}");
        self.done = true;
    }

    /// Withdraws the write before anything was written: its pages stay as they were.
    pub fn abort(mut self, core: &mut CacheCore) {
        let r = core.abort_writeback(self.plan.id);
        debug_assert!(r.is_ok(), "a write-back write is aborted once: {r:?}");
        self.done = true;
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
        if !self.done {
            must_complete("a write-back write");
        }
    }
}

/// A cleaning job in flight: the dirty runs of one fragment to copy to the source, and the
/// duty to report the copy with `complete`.
#[must_use = "a cleaning job must be completed with `complete`"]
#[derive(Debug)]
pub struct Cleaning {
    job: CleanJob,
    done: bool,
}

impl Cleaning {
    /// The next fragment to clean, in source order ([`CacheCore::pick_clean`]).
    pub fn pick(core: &mut CacheCore) -> Option<Cleaning> {
        core.pick_clean().map(|job| Cleaning { job, done: false })
    }

    /// The next fragment to clean within `[offset, offset + len)`
    /// ([`CacheCore::pick_clean_in`]).
    pub fn pick_in(core: &mut CacheCore, offset: SourceOffset, len: u64) -> Option<Cleaning> {
        core.pick_clean_in(offset, len)
            .map(|job| Cleaning { job, done: false })
    }

    /// Reports the copy: on the source durably (`ok`: the pages are clean), or failed (they
    /// stay dirty).
    pub fn complete(mut self, core: &mut CacheCore, ok: bool) {
        let r = core.complete_clean(self.job.id, ok);
        debug_assert!(r.is_ok(), "a cleaning job is completed once: {r:?}");
        self.done = true;
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
        if !self.done {
            must_complete("a cleaning job");
        }
    }
}

/// A slot held where it is (pinned: not evicted nor given to another fragment) while the
/// device's records may still claim dirty pages in it. Released with `release`; a driver
/// that shuts down with holds outstanding gives them up with `abandon`.
#[must_use = "a slot hold must be released with `release` (or given up with `abandon`)"]
#[derive(Debug)]
pub struct SlotHold {
    slot: SlotNo,
    done: bool,
}

impl SlotHold {
    /// Holds slot `s` ([`CacheCore::hold_slot`]); None if it could not be pinned.
    pub fn take(core: &mut CacheCore, s: SlotNo) -> Option<SlotHold> {
        core.hold_slot(s).then_some(SlotHold {
            slot: s,
            done: false,
        })
    }

    /// The slot held.
    pub fn slot(&self) -> SlotNo {
        self.slot
    }

    /// Releases the hold.
    pub fn release(mut self, core: &mut CacheCore) {
        core.release_slot(self.slot);
        self.done = true;
    }

    /// Gives the hold up without the core: only when the core goes away with it (the
    /// driver shuts down).
    pub fn abandon(mut self) {
        self.done = true;
    }
}

impl Drop for SlotHold {
    fn drop(&mut self) {
        if !self.done {
            must_complete("a slot hold");
        }
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
        let mut c = CacheCore::new(cfg, 64 << 20, 8 << 20).expect("core");
        c.track_dirty();
        c
    }

    #[test]
    fn a_write_back_write_and_its_cleaning_completed_through_their_guards_leave_nothing_behind() {
        let mut c = core();
        let w = WriteBackTxn::begin(&mut c, SourceOffset(0), 8192).expect("begin");
        assert_eq!(w.copies.len(), 1);
        w.complete(&mut c, true);
        assert_eq!(c.dirty_pages(), 2);
        let job = Cleaning::pick(&mut c).expect("a dirty fragment to clean");
        assert_eq!(job.runs.iter().map(|r| r.2).sum::<u64>(), 8192);
        job.complete(&mut c, true);
        assert_eq!(c.dirty_pages(), 0);
        assert!(Cleaning::pick(&mut c).is_none());
        // An aborted write leaves the pages as they were: clean.
        let w = WriteBackTxn::begin(&mut c, SourceOffset(0), 4096).expect("begin");
        w.abort(&mut c);
        assert_eq!(c.dirty_pages(), 0);
        let h = SlotHold::take(&mut c, SlotNo(0)).expect("hold");
        assert_eq!(h.slot(), SlotNo(0));
        h.release(&mut c);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "dropped without being completed")]
    fn a_write_back_write_dropped_uncompleted_fails_a_debug_assertion() {
        let mut c = core();
        drop(WriteBackTxn::begin(&mut c, SourceOffset(0), 4096).expect("begin"));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "dropped without being completed")]
    fn a_cleaning_dropped_uncompleted_fails_a_debug_assertion() {
        let mut c = core();
        WriteBackTxn::begin(&mut c, SourceOffset(0), 4096)
            .expect("begin")
            .complete(&mut c, true);
        drop(Cleaning::pick(&mut c).expect("a job"));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "dropped without being completed")]
    fn a_slot_hold_dropped_unreleased_fails_a_debug_assertion() {
        let mut c = core();
        drop(SlotHold::take(&mut c, SlotNo(1)).expect("hold"));
    }
}
