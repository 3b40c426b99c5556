//! The cleaner: one thread that drains the log to the source. It takes the oldest live
//! versions (up to [`BATCH_PAGES`]), sorts them by source offset and coalesces adjacent
//! pages into runs of up to [`RUN_PAGES`] (1 MiB), and writes the runs, up to
//! [`SOURCE_WRITERS`] at once, through the write-through path (the source, and the clean cache's copy where the fragment is
//! cached, with that path's own journal). It takes no range lock (so a writer waiting for
//! room while it holds its pages never waits for the cleaner's). One source flush per batch; then the versions it wrote leave the index (unless a
//! newer one came meanwhile), the tail moves, and the anchor follows. It runs while the
//! log is a quarter full, while writers wait for room, when `flush --to-source` asks, and
//! after `writeback_idle` without requests; it also commits at least every second.

use super::commit::AUTOCOMMIT;
use super::prefetch::Prefetched;
use super::LogBack;
use crate::back::outage;
use crate::engine::Engine;
use crate::through::Payload;
use sce_core::PAGE_SIZE;
use sce_io::{AlignedBuf, IoError};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// Versions one batch takes (4 MiB of pages).
const BATCH_PAGES: usize = 1024;
/// Pages of one source write, at most (1 MiB).
const RUN_PAGES: u64 = 256;
/// Source writes a batch keeps in flight.
const SOURCE_WRITERS: usize = 16;

/// The cleaner thread.
pub(super) fn cleaner(e: &Engine, lb: &LogBack) {
    let mut backoff = Duration::ZERO;
    let mut last_commit = Instant::now();
    let mut priority = Priority::new();
    while !e.signals.shutting_down() {
        commit_duties(lb, &mut last_commit);
        if !lb.wants_cleaning(e) {
            lb.nap(e, lb.seal_wait(Duration::from_millis(50)));
            continue;
        }
        priority.set(lb.urgent());
        match lb.clean_batch(e) {
            Ok(0) => lb.nap(e, Duration::from_millis(50)),
            Ok(_) => {
                backoff = Duration::ZERO;
                outage::log(lb.outage.succeeded(Instant::now()));
            }
            Err(err) => {
                let err = err.to_string();
                lb.clean_errors.fetch_add(1, Relaxed);
                outage::log(lb.outage.failed(Instant::now(), &err));
                *lb.last_clean_error.lock() = err;
                backoff = (backoff * 2).clamp(Duration::from_millis(50), Duration::from_secs(5));
                // The backoff holds: writers waiting for room do not cut it short (a source
                // that is down would be retried at their pace). `flush --to-source` cleans
                // from its own thread meanwhile.
                hold(e, lb, backoff, &mut last_commit);
            }
        }
    }
}

/// Nice values the cleaner adds to its own while cleaning is not urgent.
const BACKGROUND_NICE: i32 = 10;

/// The cleaner's CPU priority (its batch's source writers inherit it): below the threads
/// that serve clients while the log has room, theirs when it runs short or `flush
/// --to-source` waits (so that a reader on another export cannot starve a writer waiting
/// for room). Going back up needs `CAP_SYS_NICE` (sce usually runs as root); without it the
/// cleaner never goes below.
struct Priority {
    /// The cleaner's own nice value; `None` once it is not to be changed (it cannot be
    /// raised back, or raising it back failed).
    base: Option<i32>,
    lowered: bool,
}

impl Priority {
    /// Lowers the priority only where it can be raised back: a throwaway thread tries both
    /// first (without `CAP_SYS_NICE` the cleaner keeps its priority, rather than be stuck
    /// below readers that could starve a writer waiting for room).
    fn new() -> Self {
        let base = sce_io::thread::nice().ok();
        let can_raise = base.is_some_and(|b| {
            std::thread::spawn(move || {
                sce_io::thread::set_nice((b + BACKGROUND_NICE).min(19)).is_ok()
                    && sce_io::thread::set_nice(b).is_ok()
            })
            .join()
            .unwrap_or(false)
        });
        if !can_raise {
            tracing::debug!(
                "the write-back log's cleaner keeps its CPU priority (it could not raise it back)"
            );
        }
        Priority {
            base: base.filter(|_| can_raise),
            lowered: false,
        }
    }

    fn set(&mut self, urgent: bool) {
        let Some(base) = self.base else { return };
        if urgent && self.lowered {
            match sce_io::thread::set_nice(base) {
                Ok(()) => self.lowered = false,
                Err(err) => {
                    self.base = None;
                    tracing::info!(
                        "the write-back log's cleaner cannot raise its CPU priority back \
                         ({err}); it keeps cleaning at nice {}",
                        base + BACKGROUND_NICE
                    );
                }
            }
        } else if !urgent && !self.lowered {
            self.lowered = sce_io::thread::set_nice((base + BACKGROUND_NICE).min(19)).is_ok();
        }
    }
}

/// Sleeps `d`, or until the volume shuts down (looked at every 10 ms), still sealing and
/// committing at least every [`AUTOCOMMIT`]: an outage of the source must not stretch
/// what a crash may take back.
fn hold(e: &Engine, lb: &LogBack, d: Duration, last_commit: &mut Instant) {
    let until = Instant::now() + d;
    while !e.signals.shutting_down() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        commit_duties(lb, last_commit);
        std::thread::sleep(left.min(Duration::from_millis(10)));
    }
}

/// What the cleaner owes the log whatever else it does: an autocommit once
/// [`AUTOCOMMIT`] passed since `last_commit` (if writes wait for one), and a due seal.
fn commit_duties(lb: &LogBack, last_commit: &mut Instant) {
    if last_commit.elapsed() >= AUTOCOMMIT {
        *last_commit = Instant::now();
        if lb.uncommitted() {
            lb.autocommit();
        }
    }
    lb.seal_if_due();
    lb.carry_lost();
}

impl LogBack {
    /// Sleeps up to `d`, or until a writer or `flush --to-source` wants the cleaner, or the
    /// volume shuts down (looked at every 50 ms).
    fn nap(&self, e: &Engine, d: Duration) {
        let until = Instant::now() + d;
        let mut w = self.wanted.lock();
        while !*w && !e.signals.shutting_down() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            self.wanted_cv
                .wait_for(&mut w, left.min(Duration::from_millis(50)));
        }
        *w = false;
    }

    /// Wakes the cleaner (writers waiting for room, `flush --to-source`).
    pub(super) fn cleaner_wanted(&self) {
        *self.wanted.lock() = true;
        self.wanted_cv.notify_all();
    }

    /// True if cleaning is urgent: the ring is three quarters full, or `flush --to-source`
    /// waits.
    fn urgent(&self) -> bool {
        self.forced.load(Relaxed) > 0 || self.st.lock().w.room() < self.region.blocks / 4
    }

    /// True if the cleaner should clean now.
    fn wants_cleaning(&self, e: &Engine) -> bool {
        let st = self.st.lock();
        let blocks = self.region.blocks;
        if st.index.is_empty() {
            // Nothing to clean, but a stale anchor may still hold the ring: a batch moves it.
            return st.w.room() < blocks / 4 && st.w.anchor_candidate() != st.w.anchor();
        }
        let used = st.w.head() - st.w.tail();
        let idle = e
            .cores
            .now()
            .0
            .saturating_sub(self.last_request.load(Relaxed));
        used * 4 >= blocks
            || self.forced.load(Relaxed) > 0
            || st.w.room() < blocks / 4
            || idle >= self.idle.as_nanos() as u64
    }

    /// One batch: cleans up to `BATCH_PAGES` of the oldest live versions, flushes the
    /// source, lets them go, moves the tail and the anchor. Returns the pages cleaned.
    /// Versions not yet committed may go too: a crash then finds an older committed version
    /// in the log, which the last FLUSH allows, and cleans that again.
    pub(super) fn clean_batch(&self, e: &Engine) -> Result<u64, IoError> {
        let _one = self.clean_io.lock();
        let (mut pages, positions): (Vec<u64>, Vec<u64>) = {
            let st = self.st.lock();
            let pages: Vec<u64> = st.live.values().take(BATCH_PAGES).copied().collect();
            let positions = pages.iter().filter_map(|g| st.index.get(g)).map(|d| d.lpos);
            let positions = positions.collect();
            (pages, positions)
        };
        if pages.is_empty() {
            let mut st = self.st.lock();
            let tail = st.tail();
            st.w.set_tail(tail);
            drop(st);
            self.advance_anchor()?;
            return Ok(0);
        }
        pages.sort_unstable();
        pages.dedup();
        let runs = self.runs(&pages);
        let pre = Prefetched::read(self, positions);
        // The runs go to the source from `SOURCE_WRITERS` threads at once (a SAN serves
        // many writes in flight; one at a time, 4 KiB runs over a 2 ms source drain 2 MB/s).
        let next = std::sync::atomic::AtomicUsize::new(0);
        let results: Vec<Result<Vec<(u64, u64)>, IoError>> = std::thread::scope(|sc| {
            let workers: Vec<_> = (0..SOURCE_WRITERS.min(runs.len()))
                .map(|_| {
                    sc.spawn(|| {
                        let mut mine = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Relaxed);
                            let Some(&(g0, n)) = runs.get(i) else {
                                return Ok(mine);
                            };
                            self.clean_run(e, &pre, g0, n, &mut mine)?;
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("a cleaning thread panicked"))
                .collect()
        });
        let mut cleaned = Vec::with_capacity(pages.len());
        for r in results {
            cleaned.extend(r?);
        }
        e.dev.source.flush()?;
        let n = cleaned.len() as u64;
        {
            let mut st = self.st.lock();
            for (g, l) in cleaned {
                st.cleaned(g, l);
            }
            let tail = st.tail();
            st.w.set_tail(tail);
        }
        self.bytes_cleaned.fetch_add(n * PAGE_SIZE, Relaxed);
        self.advance_anchor()?;
        self.progress.bump();
        Ok(n)
    }

    /// Sorted pages cut into runs of consecutive pages within one volume, at most
    /// `RUN_PAGES` each: (first page, pages).
    fn runs(&self, pages: &[u64]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < pages.len() {
            let g0 = pages[i];
            let stop = self.volume_end(g0);
            let mut n = 1;
            while i + (n as usize) < pages.len()
                && pages[i + n as usize] == g0 + n
                && g0 + n < stop
                && n < RUN_PAGES
            {
                n += 1;
            }
            out.push((g0, n));
            i += n as usize;
        }
        out
    }

    /// Writes pages `[g0, g0 + n)` (each has a version in the log, unless it was cleaned
    /// already) to the source through the write-through path; notes (page, position) of each
    /// version written.
    fn clean_run(
        &self,
        e: &Engine,
        pre: &Prefetched,
        g0: u64,
        n: u64,
        cleaned: &mut Vec<(u64, u64)>,
    ) -> Result<(), IoError> {
        let ps = PAGE_SIZE;
        // The newest versions now. No range lock: a version's blocks stay as they are until
        // the tail passes them, which only this thread moves; a client write meanwhile
        // indexes a newer version, which stays (its position differs).
        let vers: Vec<_> = {
            let st = self.st.lock();
            (g0..g0 + n).map(|g| st.index.get(&g).copied()).collect()
        };
        let mut buf = AlignedBuf::new((n * ps) as usize);
        let mut page = AlignedBuf::new(ps as usize);
        let mut k = 0;
        while k < vers.len() {
            // Sub-runs of pages that still have a version.
            if vers[k].is_none() {
                k += 1;
                continue;
            }
            let start = k;
            while k < vers.len() && vers[k].is_some() {
                let d = vers[k].expect("checked");
                let to = &mut buf[k * ps as usize..(k + 1) * ps as usize];
                match pre.block(d.lpos) {
                    // Read ahead and intact (a damaged block is read again on its own: the
                    // error names the page).
                    Some(b) if sce_store::wblog::page_crc(b) == d.crc => to.copy_from_slice(b),
                    _ => {
                        self.read_version(g0 + k as u64, d, &mut page)?;
                        to.copy_from_slice(&page);
                    }
                }
                k += 1;
            }
            let (a, b) = (start * ps as usize, k * ps as usize);
            self.through
                .write(e, (g0 + start as u64) * ps, Payload::Borrowed(&buf[a..b]))?;
            self.source_writes.fetch_add(1, Relaxed);
            for (j, d) in vers.iter().enumerate().take(k).skip(start) {
                cleaned.push((g0 + j as u64, d.expect("checked").lpos));
            }
        }
        Ok(())
    }

    /// True if no page is dirty and no write is in flight.
    fn nothing_dirty(&self) -> bool {
        let st = self.st.lock();
        st.index.is_empty() && st.inflight.is_empty()
    }

    /// Cleans every dirty page to the source and flushes it (`sce ctl flush --to-source`,
    /// detach). Fails if no page could be cleaned for `patience`. Returns the bytes cleaned.
    pub(crate) fn flush_to_source(&self, e: &Engine, patience: Duration) -> Result<u64, IoError> {
        self.forced.fetch_add(1, Relaxed);
        let before = self.bytes_cleaned.load(Relaxed);
        let mut since = Instant::now();
        let result = loop {
            match self.clean_batch(e) {
                // Writes started through the queue and not completed yet (a detach holds
                // the gate, so no more start) are waited for: their pages go too.
                Ok(0) if self.nothing_dirty() => break e.dev.source.flush(),
                Ok(0) if since.elapsed() >= patience => {
                    break Err(IoError::Failed(
                        "write-back data is left that the cleaner does not take".into(),
                    ))
                }
                Ok(0) => std::thread::sleep(Duration::from_millis(5)),
                Ok(_) => {
                    since = Instant::now();
                    // A batch cleaned here ends an outage as one of the cleaner's does (the
                    // cleaner may be holding its backoff while this drains everything).
                    outage::log(self.outage.succeeded(since));
                }
                Err(err) if since.elapsed() >= patience => break Err(err),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
            if e.signals.shutting_down() {
                break Err(IoError::ShuttingDown("the cache is shutting down".into()));
            }
        };
        self.forced.fetch_sub(1, Relaxed);
        result.map(|()| self.bytes_cleaned.load(Relaxed) - before)
    }
}
