//! The cleaner under a source outage (issue 27, item 9): a backoff that holds and logs that
//! do not flood.
//!
//! A cleaner thread whose cleaning failed waits out its backoff (doubling from 50 ms to
//! 5 s, `clean.rs`): new work (writes waiting for room, other threads' wakes) does not
//! cut it short; only shutdown and an operator's `flush --to-source` (a *kick*) do.
//!
//! The logs of an outage (`sce_io::outage`): one WARN at its first failure, then at most
//! one summary line per [`SUMMARY_EVERY`] (`N cleanings failed in the last 30 s: <last
//! error>`), and one INFO when a cleaning succeeds again, with the count.

pub(crate) use sce_io::outage::OutageLog;
use sce_io::outage::{OutageLine, SUMMARY_EVERY};

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
