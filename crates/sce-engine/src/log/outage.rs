//! The cleaner under a source outage (issue 27, item 9): a backoff that holds and logs that
//! do not flood.
//!
//! A cleaner thread whose cleaning failed waits out its backoff (doubling from 50 ms to
//! 5 s, `clean.rs`): new work (writes waiting for room, other threads' wakes) does not
//! cut it short; only shutdown and an operator's `flush --to-source` (a *kick*) do.
//!
//! The logs of an outage: one WARN at its first failure, then at most one summary line per
//! [`SUMMARY_EVERY`] ("N cleanings failed in the last 30 s: <last error>"), and one INFO
//! when a cleaning succeeds again, with the count. [`OutageLog`]'s lock is a leaf: nothing
//! is taken while it is held, and nothing is logged under it.

use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// At most one summary line of failed cleanings per this interval.
pub(crate) const SUMMARY_EVERY: Duration = Duration::from_secs(30);

/// What to log about a cleaning's outcome.
#[derive(Debug, PartialEq)]
pub(crate) enum OutageLine {
    /// The first failure of an outage.
    Started(String),
    /// `failed` cleanings failed in the last `over`; the last with `error`.
    Summary {
        failed: u64,
        over: Duration,
        error: String,
    },
    /// Cleaning succeeds again after `failed` failures over `over`.
    Ended { failed: u64, over: Duration },
}

/// An outage in progress: when it started, its failures, and those not yet told.
#[derive(Debug)]
struct Outage {
    started: Instant,
    failed: u64,
    told_at: Instant,
    untold: u64,
}

/// The cleaners' shared account of a source outage (a leaf lock).
#[derive(Default)]
pub(crate) struct OutageLog {
    outage: Mutex<Option<Outage>>,
}

impl OutageLog {
    /// A cleaning failed at `now` with `error`: the line to log, if any.
    pub(crate) fn failed(&self, now: Instant, error: &str) -> Option<OutageLine> {
        let mut g = self.outage.lock();
        let Some(o) = g.as_mut() else {
            *g = Some(Outage {
                started: now,
                failed: 1,
                told_at: now,
                untold: 0,
            });
            return Some(OutageLine::Started(error.to_string()));
        };
        o.failed += 1;
        o.untold += 1;
        let over = now.saturating_duration_since(o.told_at);
        if over < SUMMARY_EVERY {
            return None;
        }
        let failed = std::mem::take(&mut o.untold);
        o.told_at = now;
        Some(OutageLine::Summary {
            failed,
            over,
            error: error.to_string(),
        })
    }

    /// A cleaning succeeded at `now`: the line to log if that ends an outage.
    pub(crate) fn succeeded(&self, now: Instant) -> Option<OutageLine> {
        let o = self.outage.lock().take()?;
        Some(OutageLine::Ended {
            failed: o.failed,
            over: now.saturating_duration_since(o.started),
        })
    }
}

/// Logs `line` (none if None), outside any lock.
pub(crate) fn log(line: Option<OutageLine>) {
    match line {
        None => {}
        Some(OutageLine::Started(e)) => tracing::warn!(
            "cleaning failed, dirty data kept, retrying with backoff (further failures are \
             summarized every {} s): {e}",
            SUMMARY_EVERY.as_secs()
        ),
        Some(OutageLine::Summary {
            failed,
            over,
            error,
        }) => tracing::warn!(
            "{failed} cleanings failed in the last {} s, dirty data kept: {error}",
            over.as_secs()
        ),
        Some(OutageLine::Ended { failed, over }) => tracing::info!(
            "cleaning succeeds again after {failed} failed cleanings over {:.1} s",
            over.as_secs_f64()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_told_once_then_summarized_then_ended() {
        let log = OutageLog::default();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(log.failed(t0, "e0"), Some(OutageLine::Started("e0".into())));
        // A thousand failures within the interval: silent.
        for i in 1..=1000u32 {
            let at = t0 + SUMMARY_EVERY * i / 1001;
            assert_eq!(log.failed(at, "e"), None, "failure {i}");
        }
        assert_eq!(
            log.failed(t0 + SUMMARY_EVERY + s(1), "e1"),
            Some(OutageLine::Summary {
                failed: 1001,
                over: SUMMARY_EVERY + s(1),
                error: "e1".into()
            })
        );
        assert_eq!(log.failed(t0 + SUMMARY_EVERY + s(2), "e"), None);
        assert_eq!(
            log.succeeded(t0 + s(40)),
            Some(OutageLine::Ended {
                failed: 1003,
                over: s(40)
            })
        );
        assert_eq!(log.succeeded(t0 + s(41)), None, "no outage to end");
        assert_eq!(
            log.failed(t0 + s(50), "e2"),
            Some(OutageLine::Started("e2".into())),
            "a new outage"
        );
    }
}
