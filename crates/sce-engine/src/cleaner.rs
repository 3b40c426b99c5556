//! The write-back cleaner: [`CLEANERS`] threads copy dirty pages to the source in the
//! background, in source order (the core's elevator), one fragment's runs of dirty pages
//! per job.
//!
//! It cleans when the dirty share of the cache (of its pages or its slots, whichever is
//! larger) exceeds [`HIGH`], until it is below [`LOW`]; everything when the volume has been
//! idle for `writeback_idle` (1 s), while `flush --to-source` waits, or while writes wait for room. A source write error leaves the pages dirty and backs off (doubling, up to
//! [`MAX_BACKOFF`]); the error shows in the stats. A dirty page whose cache copy fails its
//! checksum or cannot be read is lost (reads of it fail), never written to the source.

use crate::shared::Shared;
use sce_core::{CleanJob, SourceOffset};
use sce_io::{AlignedBuf, IoError};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// Dirty share of the cache above which the cleaner starts.
pub(crate) const HIGH: f64 = 0.20;
/// Dirty share below which it stops (unless idle or forced).
pub(crate) const LOW: f64 = 0.05;
/// How long after a write waited for room the cleaner keeps cleaning, whatever the share.
const PRESSED: Duration = Duration::from_millis(500);
/// Cleaner threads: cleaning jobs are source writes, and a slow source (milliseconds each)
/// needs several in flight to keep up with writes.
pub(crate) const CLEANERS: usize = 4;
/// Longest wait after source errors.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The cleaner thread.
pub(crate) fn cleaner(s: &Shared) {
    let Some(wb) = s.wb.as_ref() else { return };
    let mut active = false;
    let mut backoff = Duration::ZERO;
    loop {
        if s.shutdown.load(Relaxed) {
            return;
        }
        let (dirty, share) = s.dirty_share();
        let now = s.now().0;
        let idle = now.saturating_sub(wb.last_request.load(Relaxed)) >= wb.idle.as_nanos() as u64;
        // Writes waited for room lately: clean whatever the share.
        let last_wait = wb.last_wait.load(Relaxed);
        let pressed = last_wait > 0 && now.saturating_sub(last_wait) < PRESSED.as_nanos() as u64;
        active = dirty > 0
            && (wb.forced.load(Relaxed) > 0
                || idle
                || pressed
                || share > HIGH
                || (active && share > LOW));
        if !active {
            if !s.sleep(Duration::from_millis(50)) {
                return;
            }
            continue;
        }
        match s.clean_some() {
            Ok(0) => {
                // Everything dirty is busy (being written): let it finish.
                if !s.sleep(Duration::from_millis(5)) {
                    return;
                }
            }
            Ok(_) => backoff = Duration::ZERO,
            Err(e) => {
                wb.clean_errors.fetch_add(1, Relaxed);
                *wb.last_clean_error.lock() = e.to_string();
                tracing::warn!("cleaning failed, dirty data kept, retrying: {e}");
                backoff = (backoff * 2).clamp(Duration::from_millis(50), MAX_BACKOFF);
                if !s.sleep(backoff) {
                    return;
                }
            }
        }
    }
}

impl Shared {
    /// Dirty pages now, and the dirty share of the cache: of its pages or of its slots,
    /// whichever is larger (a dirty page holds its whole slot until it is cleaned).
    pub(crate) fn dirty_share(&self) -> (u64, f64) {
        let (mut pages, mut frags, mut total_pages, mut slots) = (0, 0, 0, 0);
        for c in self.cores.iter() {
            let core = c.read();
            pages += core.dirty_pages();
            frags += core.dirty_fragments();
            let g = core.geometry();
            slots += g.slots() as u64;
            total_pages += g.slots() as u64 * g.pages_per_fragment() as u64;
        }
        let by_pages = pages as f64 / total_pages.max(1) as f64;
        (pages, by_pages.max(frags as f64 / slots.max(1) as f64))
    }

    /// One cleaning job per core shard that has one. Returns the jobs done.
    ///
    /// The cache device is flushed before anything is copied: only data durable on the
    /// cache goes to the source. Otherwise a crash could take back the cache's copy of a
    /// write the source already has, leaving the two disagreeing about a clean page.
    pub(crate) fn clean_some(&self) -> Result<usize, IoError> {
        let mut done = 0;
        let mut flushed = false;
        for k in 0..self.cores.len() {
            let job = self.cores[k].write().pick_clean();
            let Some(job) = job else { continue };
            if !flushed {
                if let Err(e) = self.cache.flush() {
                    self.cores[k].write().complete_clean(job.id, false).ok();
                    self.device_errors(1, &format!("flush before cleaning failed: {e}"));
                    return Err(e);
                }
                flushed = true;
            }
            // Clean only once the source has it durably: the record that says so lets the
            // slot go.
            let r = self.clean_job(k, &job).and_then(|()| self.source.flush());
            self.cores[k].write().complete_clean(job.id, r.is_ok()).ok();
            if let Some(wb) = &self.wb {
                wb.progressed();
            }
            r?;
            done += 1;
        }
        Ok(done)
    }

    /// Copies a job's runs (core shard `k`'s coordinates) from the cache to the source.
    fn clean_job(&self, k: usize, job: &CleanJob) -> Result<(), IoError> {
        let fstart_local = job.frag.0 << self.fshift;
        let fstart = self.map.frag_to_global(k, job.frag).0 << self.fshift;
        for &(src, cache, len) in &job.runs {
            let global = fstart + (src.0 - fstart_local);
            let c = self.map.cache_to_global(k, cache).0;
            let mut buf = AlignedBuf::new(len as usize);
            let want: Vec<u32> = {
                let crcs = self.crcs.as_ref().expect("checksums");
                let pages = len.div_ceil(sce_core::PAGE_SIZE);
                (0..pages)
                    .map(|i| {
                        let (slot, p) = self.slot_page(c + i * sce_core::PAGE_SIZE);
                        crcs.get(slot as u32, p)
                    })
                    .collect()
            };
            let read = self.cache.read_at(c, &mut buf);
            if read.is_err() || !self.pages_match(global, &buf, &want) {
                // The only copy is bad: lose those pages (reads fail), never write them.
                if let Err(e) = &read {
                    self.cache_read_failed(e);
                } else {
                    self.counters.cache_checksum_errors.fetch_add(1, Relaxed);
                }
                let lo = ((src.0 - fstart_local) / sce_core::PAGE_SIZE) as u32;
                let hi = lo + len.div_ceil(sce_core::PAGE_SIZE) as u32;
                self.cores[k].write().invalidate(job.frag, lo, hi);
                tracing::error!(
                    offset = global,
                    len,
                    "dirty data failed its checksum on the cache device: lost"
                );
                continue;
            }
            self.source_write(global, &buf)?;
            if let Some(wb) = &self.wb {
                wb.bytes_cleaned.fetch_add(len, Relaxed);
            }
        }
        Ok(())
    }

    /// Cleans until nothing is dirty in `[offset, offset + len)` (everything if None), then
    /// flushes the source. Fails after `patience` without progress.
    pub(crate) fn flush_to_source(
        &self,
        range: Option<(u64, u64)>,
        patience: Duration,
    ) -> Result<u64, IoError> {
        let Some(wb) = &self.wb else {
            return self.source.flush().map(|()| 0);
        };
        wb.forced.fetch_add(1, Relaxed);
        let r = self.drain(range, patience);
        wb.forced.fetch_sub(1, Relaxed);
        let cleaned = r?;
        self.source.flush()?;
        Ok(cleaned)
    }

    fn drain(&self, range: Option<(u64, u64)>, patience: Duration) -> Result<u64, IoError> {
        let wb = self.wb.as_ref().expect("write-back");
        let start = wb.bytes_cleaned.load(Relaxed);
        let mut last = (u64::MAX, std::time::Instant::now());
        loop {
            let left = self.dirty_left(range);
            if left == 0 {
                return Ok(wb.bytes_cleaned.load(Relaxed) - start);
            }
            if left != last.0 {
                last = (left, std::time::Instant::now());
            } else if last.1.elapsed() > patience {
                let why = wb.last_clean_error.lock().clone();
                return Err(IoError::Invalid(format!(
                    "{left} dirty pages could not be written to the source ({why})"
                )));
            }
            self.wake.notify_all();
            if !self.sleep(Duration::from_millis(10)) {
                return Err(IoError::Invalid("the cache is shutting down".into()));
            }
        }
    }

    /// Dirty pages in `range` (global), or in all.
    fn dirty_left(&self, range: Option<(u64, u64)>) -> u64 {
        match range {
            None => self.dirty_share().0,
            Some((offset, len)) => self
                .map
                .pieces(offset, len)
                .map(|p| {
                    self.cores[p.shard]
                        .read()
                        .dirty_in(SourceOffset(p.local), p.len)
                })
                .sum(),
        }
    }
}
