//! An outage's account, for logs that do not flood: one line at its first failure, then at
//! most one summary per [`SUMMARY_EVERY`] (`N failed in the last 30 s: <last error>`), and
//! one when a success ends it, with the count. Its users word the lines: the write-back
//! cleaner (`sce-engine/src/log/outage.rs`), a watched source (`watch.rs`) and the cache
//! device's error log (`sce-engine/src/health.rs`). [`OutageLog`]'s lock is a device's own
//! (`order::levels::Device`): nothing is taken while it is held, and nothing is logged
//! under it.

use crate::order::{levels, OrderedMutex};
/// This file's locks are a device's own (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use std::time::{Duration, Instant};

/// At most one summary line of an outage's failures per this interval.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(30);

/// What to log about an operation's outcome.
#[derive(Debug, PartialEq)]
pub enum OutageLine {
    /// The first failure of an outage.
    Started(String),
    /// `failed` operations failed in the last `over`; the last with `error`.
    Summary {
        /// Failures since the last line.
        failed: u64,
        /// Since the last line.
        over: Duration,
        /// The last failure's error.
        error: String,
    },
    /// Operations succeed again after `failed` failures over `over`.
    Ended {
        /// The outage's failures.
        failed: u64,
        /// Its length.
        over: Duration,
    },
}

/// An outage in progress: when it started, its failures, and those not yet told.
#[derive(Debug)]
struct Outage {
    started: Instant,
    failed: u64,
    told_at: Instant,
    untold: u64,
}

/// An account of an outage (its lock: level `Device`, nothing taken under it).
#[derive(Default)]
pub struct OutageLog {
    outage: Mutex<Option<Outage>>,
}

impl OutageLog {
    /// An operation failed at `now` with `error`: the line to log, if any.
    pub fn failed(&self, now: Instant, error: &str) -> Option<OutageLine> {
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

    /// An operation succeeded at `now`: the line to log if that ends an outage.
    pub fn succeeded(&self, now: Instant) -> Option<OutageLine> {
        let o = self.outage.lock().take()?;
        Some(OutageLine::Ended {
            failed: o.failed,
            over: now.saturating_duration_since(o.started),
        })
    }

    /// The outage in progress: when it began and its failures so far (None: none is).
    pub fn current(&self) -> Option<(Instant, u64)> {
        self.outage.lock().as_ref().map(|o| (o.started, o.failed))
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
