//! The cleaner: one thread that drains the log to the source, batch after batch
//! (`batch.rs`), and makes room where pages it cannot clean hold the tail (`room.rs`). It
//! runs while the log is a quarter full, while writers wait for room, while a drain runs,
//! and after `writeback_idle` without requests; it also commits at least every second and
//! seals the last commit. A batch that cleans nothing because the source fails every write
//! (an outage) makes it hold a backoff; one that cleans some pages goes on (the pages that
//! failed wait for their own backoff).

use super::commit::AUTOCOMMIT;
use super::outage;
use super::LogBack;
use super::LogIo;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// The cleaner thread.
pub(super) fn cleaner(e: &LogIo<'_>, lb: &LogBack) {
    let mut backoff = Duration::ZERO;
    let mut last_commit = Instant::now();
    let mut priority = Priority::new();
    while !e.signals.shutting_down() {
        commit_duties(lb, &mut last_commit);
        lb.adjust_lending(e);
        if !lb.wants_cleaning(e) {
            if lb.room_short() || lb.st.lock().w.mirror_short() {
                // Nothing to clean, yet room (or the mirror area) is short: commits since the
                // last batch may let the tail and the anchor move on (a writer waiting for
                // room woke us).
                lb.settle_tail();
            }
            lb.nap(e, lb.seal_wait(Duration::from_millis(50)));
            continue;
        }
        let urgent = lb.urgent();
        priority.set(urgent);
        let t0 = Instant::now();
        let b = lb.clean_batch(e, None, &|| e.signals.shutting_down());
        let depth = usize::from(b.urgent);
        lb.clean_busy[depth].fetch_add(b.busy.as_micros() as u64, Relaxed);
        lb.clean_busy_writes[depth].fetch_add(b.source_writes, Relaxed);
        if !urgent && b.cleaned > 0 {
            // Background cleaning keeps to its rate; the pause ends once cleaning is urgent
            // (the ring past its high watermark, writers waiting for room, a drain): the
            // rate never holds a write back.
            let pause = lb.rate_pause(b.cleaned * sce_core::PAGE_SIZE, t0.elapsed());
            hold_while(e, lb, pause, &mut last_commit, || lb.urgent());
        }
        if lb.room_wanted() {
            lb.make_room();
        }
        if b.failed > 0 {
            lb.clean_errors.fetch_add(1, Relaxed);
            if let Some(err) = &b.error {
                *lb.last_clean_error.lock() = err.clone();
            }
        }
        if b.cleaned > 0 {
            backoff = Duration::ZERO;
            outage::log(lb.outage.succeeded(Instant::now()));
        } else if b.fresh_failed > 0 {
            let err = b.error.unwrap_or_default();
            outage::log(lb.outage.failed(Instant::now(), &err));
            backoff = (backoff * 2).clamp(Duration::from_millis(50), Duration::from_secs(5));
            // The backoff holds: writers waiting for room do not cut it short (a source
            // that is down would be retried at their pace). A drain cleans from its own
            // thread meanwhile.
            hold(e, lb, backoff, &mut last_commit);
        } else if b.failed == 0 {
            // Nothing it may take: every dirty page is stuck until its retry, or none is
            // left. Held, not napped: writers waiting for room would wake it at once, and
            // it can do no more for them until a retry is due or a write comes.
            hold(e, lb, lb.until_retry(), &mut last_commit);
        } else {
            lb.nap(e, Duration::from_millis(50));
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

/// Sleeps `d`, or until the volume shuts down or `stop` says so (looked at every 10 ms),
/// still sealing and committing at least every [`AUTOCOMMIT`]: an outage of the source must
/// not stretch what a crash may take back, nor the rate's pause a seal.
fn hold_while(
    e: &LogIo<'_>,
    lb: &LogBack,
    d: Duration,
    last_commit: &mut Instant,
    stop: impl Fn() -> bool,
) {
    let until = Instant::now() + d;
    while !e.signals.shutting_down() && !stop() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        commit_duties(lb, last_commit);
        std::thread::sleep(left.min(Duration::from_millis(10)));
    }
}

/// [`hold_while`] the whole of `d`.
fn hold(e: &LogIo<'_>, lb: &LogBack, d: Duration, last_commit: &mut Instant) {
    hold_while(e, lb, d, last_commit, || false)
}

/// What the cleaner owes the log whatever else it does: an autocommit once
/// [`AUTOCOMMIT`] passed since `last_commit` (if writes, tombstones or cleaned entries wait
/// for one), and a due seal.
fn commit_duties(lb: &LogBack, last_commit: &mut Instant) {
    if last_commit.elapsed() >= AUTOCOMMIT {
        *last_commit = Instant::now();
        if lb.uncommitted() {
            lb.autocommit();
        }
    }
    lb.seal_if_due();
}

impl LogBack {
    /// Sleeps up to `d`, or until a writer or `flush --to-source` wants the cleaner, or the
    /// volume shuts down (looked at every 50 ms).
    fn nap(&self, e: &LogIo<'_>, d: Duration) {
        let until = Instant::now() + d;
        let mut w = self.wanted.lock();
        while !*w && !e.signals.shutting_down() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            w.wait_for(&self.wanted_cv, left.min(Duration::from_millis(50)));
        }
        *w = false;
    }

    /// Wakes the cleaner (writers waiting for room, `flush --to-source`).
    pub(super) fn cleaner_wanted(&self) {
        *self.wanted.lock() = true;
        self.wanted_cv.notify_all();
    }

    /// How long until the first stuck page's retry is due, 5 to 200 ms (200 with none).
    fn until_retry(&self) -> Duration {
        let first = self.st.lock().stuck.values().map(|s| s.retry_at).min();
        first
            .map_or(Duration::MAX, |t| {
                t.saturating_duration_since(Instant::now())
            })
            .clamp(Duration::from_millis(5), Duration::from_millis(200))
    }

    /// True if the ring is past its high watermark, or writers wait for room.
    fn room_short(&self) -> bool {
        self.waiting.load(Relaxed) > 0 || self.past_high(&self.st.lock().w)
    }

    /// True if cleaning is urgent: the ring past its high watermark, writers waiting for
    /// room, or `flush --to-source` waiting.
    pub(super) fn urgent(&self) -> bool {
        self.forced.load(Relaxed) > 0 || self.room_short()
    }

    /// True if the cleaner should clean now.
    fn wants_cleaning(&self, e: &LogIo<'_>) -> bool {
        let st = self.st.lock();
        let short = self.waiting.load(Relaxed) > 0 || self.past_high(&st.w);
        if st.index.is_empty() {
            // Nothing to clean, but the record of a loss may still hold the ring: making
            // room (after a batch) carries it.
            return short && !st.loss_at.is_empty();
        }
        let used = st.w.used();
        let idle = e
            .cores
            .now()
            .0
            .saturating_sub(self.last_request.load(Relaxed));
        used >= self.low_blocks(&st.w)
            || st.w.mirror_short()
            || self.forced.load(Relaxed) > 0
            || short
            || idle >= self.idle.as_nanos() as u64
    }
}
