//! The first pass over a trace: its volumes, its requests, and whether its timestamps can
//! drive an open-loop replay.

use super::Result;
use super::SimConfig;
use crate::layers::{Replay, VolumeLayout};
use crate::request::IoKind;
use crate::trace::TraceReader;

/// The queue depth of the closed-loop replay of traces without usable timestamps.
const DEFAULT_QUEUE_DEPTH: u32 = 32;

/// What the first pass learns about the trace.
#[derive(Debug)]
pub struct Survey {
    /// The volumes of the trace, laid side by side.
    pub layout: VolumeLayout,
    /// Requests (writes left out with `reads_only`).
    pub requests: u64,
    /// Malformed records skipped.
    pub skipped: u64,
    /// Requests whose time is earlier than the request before them.
    backwards: u64,
    /// The most a request's time is earlier than an earlier request's, nanoseconds.
    max_lag: u64,
    /// Earliest and latest request time.
    times: Option<(u64, u64)>,
}

impl Survey {
    /// Streams the trace once.
    /// `seen` counts the requests read so far (for a progress display).
    pub fn take(cfg: &SimConfig, seen: &std::sync::atomic::AtomicU64) -> Result<Survey> {
        let mut layout = VolumeLayout::new(64 << 20);
        let mut reader = TraceReader::open(&cfg.trace, cfg.format.clone(), cfg.skip_bad)?;
        let mut requests = 0;
        let mut backwards = 0;
        let mut max_lag = 0;
        let mut times: Option<(u64, u64)> = None;
        let mut previous = None;
        while let Some(r) = reader.next_request()? {
            if cfg.reads_only && r.kind != IoKind::Read {
                continue;
            }
            requests += 1;
            if requests % 4096 == 0 {
                seen.store(requests, std::sync::atomic::Ordering::Relaxed);
            }
            backwards += previous.is_some_and(|p| r.time_ns < p) as u64;
            previous = Some(r.time_ns);
            if let Some((_, latest)) = times {
                max_lag = max_lag.max(latest.saturating_sub(r.time_ns));
            }
            times = Some(times.map_or((r.time_ns, r.time_ns), |(lo, hi)| {
                (lo.min(r.time_ns), hi.max(r.time_ns))
            }));
            let vol = if cfg.hosts > 1 { 0 } else { r.volume };
            layout.observe(vol, r.offset.saturating_add(r.len));
        }
        layout.finish();
        Ok(Survey {
            layout,
            requests,
            skipped: reader.skipped(),
            backwards,
            max_lag,
            times,
        })
    }

    /// Why the trace's timestamps cannot drive an open-loop replay, if they cannot: they are
    /// all equal (all zero, say), or a request is earlier than an earlier request by more
    /// than a tenth of the trace's span (shuffled times, or streams laid end to end; the
    /// open loop issues a late request at the time reached, so it would move by that much).
    /// Jitter is fine: requests logged in completion order a few milliseconds out of order.
    fn unusable_timestamps(&self) -> Option<String> {
        match self.times {
            Some((lo, hi)) if lo == hi => Some("the trace's timestamps are all equal".into()),
            Some((lo, hi)) if self.max_lag > (hi - lo) / 10 => Some(format!(
                "{} of the trace's {} requests are earlier than the request before them, \
                 one by {:.3} s of a {:.3} s span",
                self.backwards,
                self.requests,
                self.max_lag as f64 / 1e9,
                (hi - lo) as f64 / 1e9
            )),
            _ => None,
        }
    }

    /// The replay `--replay` asks for, or the default: open if the timestamps are usable,
    /// else closed:32; with a phrase that says why.
    pub fn replay(&self, asked: Option<Replay>) -> (Replay, String) {
        match (asked, self.unusable_timestamps()) {
            (Some(r), _) => (r, "--replay".into()),
            (None, None) => (Replay::Open, "default: the trace's timestamps".into()),
            (None, Some(why)) => (
                Replay::Closed(DEFAULT_QUEUE_DEPTH),
                format!("default: {why}"),
            ),
        }
    }
}
