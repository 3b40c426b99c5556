//! Write-back in the simulator (issue 15; Holland et al.'s write policies at the flash
//! layer), on the core's write-back calls: a write is acknowledged when its cache copy is
//! written; a cleaner writes dirty fragments back in source order, continuously above a low
//! watermark of dirty pages, with more jobs above a high one, and everything when the
//! workload is idle; a write that finds the cache full of dirty data waits for cleaning
//! (backpressure), which shows in its latency.

use super::{EngineSim, Event};
use sce_core::{SourceOffset, WriteBackRefusal};

/// Dirty share of the cache above which the cleaner runs.
pub const LOW_WATERMARK: f64 = 0.10;
/// Dirty share above which it runs with all its jobs.
pub const HIGH_WATERMARK: f64 = 0.50;
/// Cleaning jobs in flight between the watermarks, and above the high one.
const JOBS: (u32, u32) = (1, 4);
/// How often the cleaner looks, ns.
pub(super) const CLEAN_PERIOD: u64 = 10_000_000;
/// No request for this long: the workload is idle, and the cleaner cleans everything.
const IDLE: u64 = 1_000_000_000;

impl EngineSim {
    /// Share of the cache's pages that are dirty.
    pub(super) fn dirty_share(&self) -> f64 {
        let g = self.core.geometry();
        let pages = g.slots() as u64 * g.pages_per_fragment() as u64;
        self.core.dirty_pages() as f64 / pages.max(1) as f64
    }

    /// The cleaner's turn at `t`: starts jobs as the watermarks (or `urgent`: a write waits
    /// for a slot) say.
    pub(super) fn clean(&mut self, t: u64, urgent: bool) {
        let share = self.dirty_share();
        let idle = t.saturating_sub(self.last_request) >= IDLE;
        let jobs = if share >= HIGH_WATERMARK || urgent {
            JOBS.1
        } else if share >= LOW_WATERMARK || (idle && share > 0.0) {
            JOBS.0
        } else {
            0
        };
        while self.cleaning < jobs {
            let Some(job) = self.core.pick_clean() else {
                break;
            };
            let len: u64 = job.runs.iter().map(|r| r.2).sum();
            let read = self.ssd.io(t, len, false);
            self.res.cache_bytes_read += len;
            let done = self.source.io(read, len, true);
            self.res.source_bytes_written += len;
            self.res.bytes_written_back += len;
            self.cleaning += 1;
            self.push(done, Event::CleanDone(job));
        }
    }

    /// A write in write-back mode at `t`: returns when it is acknowledged.
    pub(super) fn write_back(&mut self, t: u64, off: u64, len: u64) -> u64 {
        // Pages written in part are read first (from the source unless cached): the
        // driver's read-modify-write.
        let g = *self.core.geometry();
        let (a, b) = (off / 4096 * 4096, (off + len).div_ceil(4096) * 4096);
        let b = b.min(g.source_size());
        let mut start = t;
        for edge in [a, b.saturating_sub(4096)] {
            let partial = (edge == a && a < off) || (edge + 4096 > off + len && edge >= off);
            if partial && !self.core.is_cached(SourceOffset(edge)) {
                start = start.max(self.source.io(t, 4096, false));
                self.res.source_bytes_read += 4096;
            }
        }
        let mut now = start;
        let plan = loop {
            match self.core.begin_writeback(SourceOffset(a), b - a) {
                Ok(p) => break Some(p),
                Err(WriteBackRefusal::Full) | Err(WriteBackRefusal::Busy) => {
                    self.res.writeback_waits += 1;
                    self.clean(now, true);
                    match self.next_event_time() {
                        Some(next) => {
                            now = now.max(next);
                            self.run_until(now);
                        }
                        None => break None,
                    }
                }
                Err(_) => break None,
            }
        };
        let Some(pieces) = plan else {
            // Not reached with a trace's requests (ranges are clipped, waits end with the
            // cleaning they wait for); counted as what it cost if it is.
            self.wlat.record(now - t);
            return now;
        };
        let mut ack = now;
        for c in pieces.iter().flat_map(|w| &w.copies) {
            ack = ack.max(self.ssd.io(now, c.len, true));
            self.res.cache_bytes_written += c.len;
        }
        for w in pieces {
            self.push(ack, Event::WbDone(w));
        }
        self.wlat.record(ack - t);
        ack
    }
}
