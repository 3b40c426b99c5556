//! The write-back cleaner: [`CLEANERS`] threads copy dirty pages to the source in the
//! background, in source order (the core's elevator), one fragment's runs of dirty pages
//! per job.
//!
//! It cleans when the dirty share of the cache (of its pages or its slots, whichever is
//! larger) exceeds [`HIGH`], until it is below [`LOW`]; everything when the volume has been
//! idle for `writeback_idle` (1 s), while `flush --to-source` waits, or while writes wait
//! for room. A source write error leaves the pages dirty and backs off (doubling, up to
//! [`MAX_BACKOFF`]; the backoff holds, see `outage.rs`); the error shows in the stats. A
//! dirty page whose cache copy fails its checksum or cannot be read is lost alone (reads of
//! it fail), never written to the source; the other pages of its run are cleaned.

use super::{outage, WriteBack};
use crate::engine::Engine;
use sce_core::{CacheCore, CleanJob, Cleaning, PAGE_SIZE};
use sce_io::{AlignedBuf, IoError};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

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

/// A cleaner thread.
pub(crate) fn cleaner(s: &Engine, wb: &WriteBack) {
    let mut active = false;
    let mut backoff = Duration::ZERO;
    loop {
        if s.signals.shutting_down() {
            return;
        }
        let (dirty, share) = dirty_share(s);
        let now = s.cores.now().0;
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
            if !s.signals.sleep(Duration::from_millis(50)) {
                return;
            }
            continue;
        }
        let kicks = wb.kicks.load(Relaxed);
        match wb.clean_some(s) {
            Ok(0) => {
                // Everything dirty is busy (being written): let it finish.
                if !s.signals.sleep(Duration::from_millis(5)) {
                    return;
                }
            }
            Ok(_) => {
                backoff = Duration::ZERO;
                outage::log(wb.outage.succeeded(Instant::now()));
            }
            Err(e) => {
                wb.clean_errors.fetch_add(1, Relaxed);
                let e = e.to_string();
                outage::log(wb.outage.failed(Instant::now(), &e));
                *wb.last_clean_error.lock() = e;
                backoff = (backoff * 2).clamp(Duration::from_millis(50), MAX_BACKOFF);
                // Held: new work does not cut it short, an operator's flush does.
                if !wb.back_off(s, backoff, kicks) {
                    return;
                }
                if wb.kicks.load(Relaxed) != kicks {
                    backoff = Duration::ZERO;
                }
            }
        }
    }
}

/// Dirty pages now, and the dirty share of the cache: of its pages or of its slots,
/// whichever is larger (a dirty page holds its whole slot until it is cleaned).
fn dirty_share(s: &Engine) -> (u64, f64) {
    let count = |c: &CacheCore| {
        let g = c.geometry();
        let slots = g.slots() as u64;
        [
            c.dirty_pages(),
            c.dirty_fragments(),
            slots * g.pages_per_fragment() as u64,
            slots,
        ]
    };
    let [pages, frags, total_pages, slots] = (0..s.cores.count())
        .map(|k| s.cores.read_shard(k, count))
        .fold([0; 4], |a, b| std::array::from_fn(|i| a[i] + b[i]));
    let by_pages = pages as f64 / total_pages.max(1) as f64;
    (pages, by_pages.max(frags as f64 / slots.max(1) as f64))
}

impl WriteBack {
    /// Waits out a cleaner's backoff `d`: only shutdown (false) or a kick (an operator's
    /// `flush --to-source`, the kick count no longer `kicks`) cut it short.
    fn back_off(&self, s: &Engine, d: Duration, kicks: u64) -> bool {
        let until = Instant::now() + d;
        loop {
            let now = Instant::now();
            if now >= until || self.kicks.load(Relaxed) != kicks {
                return !s.signals.shutting_down();
            }
            if !s.signals.sleep(until - now) {
                return false;
            }
        }
    }

    /// One cleaning job per core shard that has one, as a batch: one cache flush before,
    /// one source flush after (issue 29: not one per job). Returns the jobs done.
    ///
    /// The cache device is flushed before anything is copied: only data durable on the
    /// cache goes to the source. Otherwise a crash could take back the cache's copy of a
    /// write the source already has, leaving the two disagreeing about a clean page.
    fn clean_some(&self, s: &Engine) -> Result<usize, IoError> {
        let jobs: Vec<(usize, Cleaning)> = (0..s.cores.count())
            .filter_map(|k| s.cores.with_shard(k, Cleaning::pick).map(|job| (k, job)))
            .collect();
        if jobs.is_empty() {
            return Ok(0);
        }
        let complete = |jobs: Vec<(usize, Cleaning, bool)>| {
            for (k, job, ok) in jobs {
                s.cores.with_shard(k, |core| job.complete(core, ok));
            }
            self.progress.bump();
        };
        if let Err(e) = s.dev.cache.flush() {
            complete(jobs.into_iter().map(|(k, j)| (k, j, false)).collect());
            s.device_errors(1, &format!("flush before cleaning failed: {e}"));
            return Err(e);
        }
        // Every job's runs to the source, then one source flush for the batch: a job is
        // clean only once the source has it durably (the record that says so lets the slot
        // go). A failure leaves its job and the ones after it dirty.
        let mut r = Ok(());
        let mut copied: Vec<(usize, Cleaning, bool)> = Vec::with_capacity(jobs.len());
        for (k, job) in jobs {
            let ok = r.is_ok() && {
                r = self.clean_job(s, k, &job);
                r.is_ok()
            };
            copied.push((k, job, ok));
        }
        let done = copied.iter().filter(|c| c.2).count();
        if done > 0 {
            if let Err(e) = s.dev.flush_source() {
                copied.iter_mut().for_each(|c| c.2 = false);
                r = Err(e);
            }
        }
        complete(copied);
        r.map(|()| done)
    }

    /// Copies a job's runs (core shard `k`'s coordinates) from the cache to the source.
    /// Each page is checked on its own: one that fails its checksum (or cannot be read) is
    /// lost alone, and the run's other pages still go to the source.
    fn clean_job(&self, s: &Engine, k: usize, job: &CleanJob) -> Result<(), IoError> {
        let fstart_local = job.frag.0 << s.fshift;
        let fstart = s.cores.frag_global(k, job.frag) << s.fshift;
        for &(src, cache, len) in &job.runs {
            let global = fstart + (src.0 - fstart_local);
            let c = s.cores.cache_global(k, cache);
            let mut buf = AlignedBuf::new(len as usize);
            let good = read_dirty_run(s, c, global, &mut buf)?;
            let first = ((src.0 - fstart_local) / PAGE_SIZE) as u32;
            for (lo, hi, ok) in page_runs(&good) {
                let (a, b) = (lo as u64 * PAGE_SIZE, (hi as u64 * PAGE_SIZE).min(len));
                if ok {
                    s.source_write(global + a, &buf[a as usize..b as usize])?;
                    self.bytes_cleaned.fetch_add(b - a, Relaxed);
                    continue;
                }
                // The only copy is bad: lose those pages (reads fail), never write them.
                s.cores
                    .with_shard(k, |core| core.invalidate(job.frag, first + lo, first + hi));
                tracing::error!(
                    offset = global + a,
                    len = b - a,
                    "dirty data failed its checksum on the cache device: lost"
                );
            }
        }
        Ok(())
    }

    /// Cleans until nothing is dirty in `[offset, offset + len)` (everything if None), then
    /// flushes the source. Fails after `patience` without progress.
    pub(crate) fn flush_to_source(
        &self,
        s: &Engine,
        range: Option<(u64, u64)>,
        patience: Duration,
    ) -> Result<u64, IoError> {
        self.forced.fetch_add(1, Relaxed);
        // Asked by an operator: the cleaners retry now, whatever their backoff.
        self.kicks.fetch_add(1, Relaxed);
        let r = self.drain(s, range, patience);
        self.forced.fetch_sub(1, Relaxed);
        let cleaned = r?;
        s.dev.flush_source()?;
        Ok(cleaned)
    }

    fn drain(
        &self,
        s: &Engine,
        range: Option<(u64, u64)>,
        patience: Duration,
    ) -> Result<u64, IoError> {
        let start = self.bytes_cleaned.load(Relaxed);
        let mut last = (u64::MAX, Instant::now());
        loop {
            // Dirty pages in `range` (global), or in all.
            let left = match range {
                None => dirty_share(s).0,
                Some((offset, len)) => s.cores.sum_in(offset, len, CacheCore::dirty_in),
            };
            if left == 0 {
                return Ok(self.bytes_cleaned.load(Relaxed) - start);
            }
            if left != last.0 {
                last = (left, Instant::now());
            } else if last.1.elapsed() > patience {
                let why = self.last_clean_error.lock().clone();
                return Err(IoError::Failed(format!(
                    "{left} dirty pages could not be written to the source ({why})"
                )));
            }
            s.signals.wake_all();
            if !s.signals.sleep(Duration::from_millis(10)) {
                return Err(IoError::ShuttingDown("the cache is shutting down".into()));
            }
        }
    }
}
/// Reads a run of dirty pages (cache offset `c`, source offset `global`) into `buf`;
/// per page, whether it read and matched its checksum. A failed read of the whole run
/// is retried page by page, so that one unreadable page does not take the others. An
/// error if the pages' checksums cannot be read from the records (nothing is lost: the
/// batch is tried again).
fn read_dirty_run(s: &Engine, c: u64, global: u64, buf: &mut [u8]) -> Result<Vec<bool>, IoError> {
    let ps = PAGE_SIZE as usize;
    let pages = buf.len().div_ceil(ps);
    let want: Vec<u32> = (0..pages as u64)
        .map(|i| s.checks.get(c + i * PAGE_SIZE))
        .collect::<Result<_, _>>()?;
    let whole = s.dev.cache.read_at(c, buf);
    if let Err(e) = &whole {
        s.cache_read_failed(e);
    }
    let len = buf.len();
    Ok((0..pages)
        .map(|i| {
            let page = &mut buf[i * ps..((i + 1) * ps).min(len)];
            let at = (i * ps) as u64;
            if whole.is_err() {
                if let Err(e) = s.dev.cache.read_at(c + at, page) {
                    s.cache_read_failed(&e);
                    return false;
                }
            }
            let ok = s.checks.pages_match(global + at, page, &want[i..i + 1]);
            if !ok {
                s.counters.cache_checksum_errors.fetch_add(1, Relaxed);
            }
            ok
        })
        .collect())
}

/// The spans of equal values in `good`: (first page, end page, value), in order.
fn page_runs(good: &[bool]) -> Vec<(u32, u32, bool)> {
    let mut out: Vec<(u32, u32, bool)> = Vec::new();
    for (i, &g) in good.iter().enumerate() {
        match out.last_mut() {
            Some(last) if last.2 == g => last.1 = i as u32 + 1,
            _ => out.push((i as u32, i as u32 + 1, g)),
        }
    }
    out
}
