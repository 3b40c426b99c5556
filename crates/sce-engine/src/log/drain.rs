//! Drains, and writes and discards that go through to the source (issue 44).
//!
//! **A drain ends.** Leaving write-back, a detach and `flush --to-source` drain a range of
//! the log: from the moment the drain starts, writes to that range go through to the source
//! (as in write-through) instead of adding to the log, so the dirty data only shrinks and
//! the drain is bounded by what was dirty when it began over the cleaning rate. It stops,
//! leaving everything as it was, if its caller cancels it (the operator's client went
//! away), and fails if nothing can be cleaned for its patience. A write that checked the
//! range before the drain began and had not yet taken log positions (waiting for room, say)
//! finds the drain where it takes them, under the state lock in which the drain notes the
//! writes in flight it waits for, and goes through too: none lands in the log after the
//! drain found the range clean.
//!
//! **A write through never goes back in time.** A write to a page the log holds a version
//! of is merged with that version, written through to the source, and the source flushed;
//! then a *cleaned entry* supersedes the log's versions of the page, and the write is
//! acknowledged once that entry is committed. A crash before finds the log's version (the
//! write was not acknowledged); after, the source's newer bytes. Around its source write
//! it holds the pages in `source_order`, as the cleaner does around its own, so an older
//! version the cleaner took never lands on the source after it.
//!
//! **A discard stays a discard.** In write-back a discard (a TRIM, or WRITE_ZEROES that
//! may leave a hole) of whole pages reaches the source as a discard, and the log's versions
//! of those pages are superseded the same way (committed with the next FLUSH, after the
//! source was flushed); partial pages at its edges are written as zeroes.

use super::LogBack;
use super::LogIo;
use crate::through::Payload;
use sce_core::PAGE_SIZE;
use sce_io::{AlignedBuf, IoError};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// What a drain is told while it runs.
pub struct DrainControl<'a> {
    /// True once the drain should stop, leaving the volume as it is (the operator's client
    /// went away). Looked at about every 50 ms.
    pub cancelled: &'a (dyn Fn() -> bool + Sync),
    /// Told about once a second how the drain goes.
    pub progress: &'a (dyn Fn(&DrainDone) + Sync),
    /// How long it may go without cleaning a page before it fails.
    pub patience: Duration,
}

/// How a drain went (or goes, in its progress reports).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DrainDone {
    /// Dirty bytes of the range when it began.
    pub dirty_at_start: u64,
    /// Bytes the cleaner wrote to the source meanwhile (the whole log's).
    pub cleaned_bytes: u64,
    /// Dirty bytes of the range left.
    pub left_bytes: u64,
    /// Lost bytes in the range (their only copy was damaged; reads of them fail): a drain
    /// does not clean them, and a mode switch refuses them.
    pub lost_bytes: u64,
    /// Time since it began.
    pub elapsed: Duration,
}

impl DrainDone {
    /// Bytes cleaned per second so far.
    pub fn rate(&self) -> f64 {
        self.cleaned_bytes as f64 / self.elapsed.as_secs_f64().max(1e-3)
    }
}

/// A drain's registration: its range goes through to the source until this is dropped.
struct Draining<'a> {
    lb: &'a LogBack,
    range: (u64, u64),
}

impl Drop for Draining<'_> {
    fn drop(&mut self) {
        let mut st = self.lb.st.lock();
        if let Some(i) = st.drains.iter().position(|r| *r == self.range) {
            st.drains.swap_remove(i);
        }
        drop(st);
        self.lb.draining.fetch_sub(1, Relaxed);
        self.lb.forced.fetch_sub(1, Relaxed);
    }
}

impl LogBack {
    /// Drains global pages `[g0, g1)`: every dirty page there to the source, which is
    /// flushed, while writes there go through to the source (see the module's doc).
    /// Lost pages stay lost (their bytes are gone): the caller sees them in the result.
    pub(crate) fn drain(
        &self,
        e: &LogIo<'_>,
        (g0, g1): (u64, u64),
        ctl: &DrainControl<'_>,
    ) -> Result<DrainDone, IoError> {
        let started = Instant::now();
        let (before, dirty_at_start, _reg) = self.register_drain(g0, g1);
        let cleaned0 = self.bytes_cleaned.load(Relaxed);
        let report = |left: (u64, u64)| DrainDone {
            dirty_at_start,
            cleaned_bytes: self.bytes_cleaned.load(Relaxed) - cleaned0,
            left_bytes: left.0 * PAGE_SIZE,
            lost_bytes: left.1 * PAGE_SIZE,
            elapsed: started.elapsed(),
        };
        let (mut since, mut told) = (Instant::now(), Instant::now());
        let mut best = u64::MAX;
        loop {
            let (left, landed) = {
                let st = self.st.lock();
                let landed = before.iter().all(|l| !st.inflight.contains_key(l));
                (st.dirty_in(g0, g1), landed)
            };
            if left.0 == 0 && landed {
                e.dev.flush_source()?;
                // What was cleaned may still come back in a replay: after the drain the
                // source is written behind the log (write-through, a detach), so nothing of
                // the range may (cleaned entries, committed). Lost pages stay lost.
                self.supersede(g0, g1, false);
                self.commit(e)?;
                return Ok(report(left));
            }
            if left.0 < best {
                (best, since) = (left.0, Instant::now());
            }
            if told.elapsed() >= Duration::from_secs(1) {
                told = Instant::now();
                (ctl.progress)(&report(left));
            }
            if (ctl.cancelled)() {
                return Err(IoError::Failed(
                    "the drain was cancelled (its caller went away); the rest stays dirty".into(),
                ));
            }
            if e.signals.shutting_down() {
                return Err(IoError::ShuttingDown("the cache is shutting down".into()));
            }
            let stop = || (ctl.cancelled)() || e.signals.shutting_down();
            // Patience runs from the last time the range's own dirty count fell (a batch
            // also cleans other volumes' pages of a shared device, which is no progress of
            // this drain).
            let batch = self.clean_batch(e, Some((g0, g1)), &stop);
            if since.elapsed() >= ctl.patience {
                let why = batch
                    .error
                    .unwrap_or_else(|| self.last_clean_error.lock().clone());
                return Err(IoError::Failed(format!(
                    "no dirty page of the range could be written to the source for {:?} ({} \
                     left): {why}",
                    ctl.patience,
                    sce_core::units::format_size(left.0 * PAGE_SIZE)
                )));
            } else if batch.cleaned == 0 {
                // Stuck pages wait for their backoff, writes in flight to land.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// Registers a drain of `[g0, g1)`: writes there go through from now on. Returns the
    /// log writes in flight (the drain waits for them to land), the range's dirty bytes and
    /// the registration, which ends the drain's hold when dropped.
    fn register_drain(&self, g0: u64, g1: u64) -> (Vec<u64>, u64, Draining<'_>) {
        let (before, dirty_at_start) = {
            let mut st = self.st.lock();
            st.drains.push((g0, g1));
            let before = st.inflight.keys().copied().collect();
            (before, st.dirty_in(g0, g1).0 * PAGE_SIZE)
        };
        self.draining.fetch_add(1, Relaxed);
        self.forced.fetch_add(1, Relaxed);
        let reg = Draining {
            lb: self,
            range: (g0, g1),
        };
        self.cleaner_wanted();
        (before, dirty_at_start, reg)
    }

    /// True if the log holds a version of a page of `[g0, g1)` a replay could bring back,
    /// or has one lost: what a write through or a discard there supersedes.
    fn held_in(&self, g0: u64, g1: u64) -> bool {
        self.st.lock().held_in(g0, g1)
    }

    /// Marks pages `[g0, g1)` superseded (the source holds their newest bytes, flushed):
    /// cleaned entries for each the log holds a version of that a replay could bring back
    /// (and each it had lost, if `lost`: a write or discard over a lost page ends the loss)
    /// go into the next commit.
    fn supersede(&self, g0: u64, g1: u64, lost: bool) {
        self.st
            .lock()
            .supersede_range(g0, g1, lost, |g| self.local(g));
    }

    /// A client's write to a range being drained: through to the source, superseding the
    /// log's versions of its pages durably before it is acknowledged.
    pub(super) fn write_through(
        &self,
        e: &LogIo<'_>,
        offset: u64,
        data: &[u8],
    ) -> Result<(), IoError> {
        let ps = PAGE_SIZE;
        let end = offset + data.len() as u64;
        let (a0, a1) = (offset / ps * ps, end.div_ceil(ps) * ps);
        let (g0, g1) = (a0 / ps, a1 / ps);
        let _g = self.ranges.lock(a0, a1, true);
        if !self.held_in(g0, g1) {
            self.through
                .write(&e.writer, offset, Payload::Borrowed(data))?;
            // Counted once it completed, not before: a FLUSH that counted it while it was
            // still on its way would flush the source ahead of it.
            self.through_writes.completed();
            return Ok(());
        }
        let b = self.merged(e, offset, data)?;
        let len = self.bytes_within(g0, g1 - g0) as usize;
        {
            let _o = self.source_order.lock(a0, a1, true);
            self.through
                .write(&e.writer, a0, Payload::Borrowed(&b[..len]))?;
            e.dev.flush_source()?;
            self.supersede(g0, g1, true);
        }
        self.commit(e)
    }

    /// A client's discard (a range the caller checked): whole pages reach the source as a
    /// discard and the log's versions of them are superseded; the bytes of partial pages at
    /// its edges are written as zeroes.
    pub(crate) fn discard(&self, e: &LogIo<'_>, offset: u64, len: u64) -> Result<(), IoError> {
        self.last_request.store(e.cores.now().0, Relaxed);
        if e.health.passthrough() {
            return Err(crate::log::cache_failed(offset, len));
        }
        let ps = PAGE_SIZE;
        let end = offset + len;
        let (w0, w1) = (offset.div_ceil(ps) * ps, end / ps * ps);
        if w0 >= w1 {
            return self.zero(e, offset, len);
        }
        if offset < w0 {
            self.zero(e, offset, w0 - offset)?;
        }
        if w1 < end {
            self.zero(e, w1, end - w1)?;
        }
        let (g0, g1) = (w0 / ps, w1 / ps);
        let _g = self.ranges.lock(w0, w1, true);
        let held = self.held_in(g0, g1);
        {
            let _o = self.source_order.lock(w0, w1, true);
            self.through.discard(&e.writer, w0, w1 - w0)?;
            if held {
                e.dev.flush_source()?;
                self.supersede(g0, g1, true);
            } else {
                // Counted after the discard completed (as a write through).
                self.through_writes.completed();
            }
        }
        if held && self.goes_through(g0, g1) {
            // In a drain, as a write there: superseded durably before it is acknowledged.
            self.commit(e)?;
        }
        Ok(())
    }

    /// Writes zeroes over `[offset, offset + len)` (less than a page at a discard's edge).
    fn zero(&self, e: &LogIo<'_>, offset: u64, len: u64) -> Result<(), IoError> {
        let zeros = AlignedBuf::new(len as usize);
        self.write(e, offset, &zeros)
    }
}
