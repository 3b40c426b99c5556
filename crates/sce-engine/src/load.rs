//! `SourceLoad`: whether the source has room for background population, from the latency
//! of the clients' own source reads (issue 30: population re-reads the source, so on a
//! saturated source it only adds to the queue the clients wait in, while miss fills fill
//! the cache from data already read).
//!
//! Each client read of at most [`SourceLoad::MAX_LEN`] bytes is one sample. `fast` follows
//! the samples quickly (an average over about 16); `floor` follows them down by an eighth
//! of the gap (so one odd fast read, a hole of a thin source, moves it little) and up by
//! 1/1024 of it, so it remembers what the source takes when it is not queueing. The source
//! has room while `fast` is within [`SourceLoad::FACTOR`] times the floor plus
//! [`SourceLoad::SLACK_NS`], and whenever no sample came for [`SourceLoad::STALE_NS`] (a
//! workload that became all hits, or idle, leaves the source to population). Lock-free and
//! approximate: concurrent samples may overwrite each other, which only loses samples.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// The recent latency of client source reads against its floor.
#[derive(Debug)]
pub(crate) struct SourceLoad {
    base: Instant,
    fast: AtomicU64,
    floor: AtomicU64,
    /// Nanoseconds from `base` to the last sample.
    last: AtomicU64,
}

impl Default for SourceLoad {
    fn default() -> Self {
        SourceLoad {
            base: Instant::now(),
            fast: AtomicU64::new(0),
            floor: AtomicU64::new(0),
            last: AtomicU64::new(0),
        }
    }
}

impl SourceLoad {
    /// Larger reads (streams, merged runs) say more about bandwidth than about queueing.
    pub(crate) const MAX_LEN: u64 = 128 << 10;
    /// How far above its floor the recent latency may be while the source has room.
    pub(crate) const FACTOR: u64 = 3;
    /// Added to the bound, so that a fast source's jitter is not taken for a queue.
    pub(crate) const SLACK_NS: u64 = 500_000;
    /// With no sample for this long, the source has room.
    pub(crate) const STALE_NS: u64 = 1_000_000_000;

    /// Records a client read of `len` bytes that took `took`.
    pub(crate) fn record(&self, len: u64, took: Duration) {
        self.record_at(len, took, self.base.elapsed());
    }

    fn record_at(&self, len: u64, took: Duration, now: Duration) {
        if len > Self::MAX_LEN {
            return;
        }
        let x = took.as_nanos().min(u64::MAX as u128) as u64;
        let fast = self.fast.load(Relaxed);
        let next = if fast == 0 {
            x
        } else {
            (fast as i128 + (x as i128 - fast as i128) / 16) as u64
        };
        self.fast.store(next.max(1), Relaxed);
        let floor = self.floor.load(Relaxed);
        let next = if floor == 0 {
            x
        } else if x < floor {
            floor - (floor - x) / 8
        } else {
            floor + (x - floor) / 1024
        };
        self.floor.store(next.max(1), Relaxed);
        self.last.store(now.as_nanos() as u64, Relaxed);
    }

    /// True while the source shows no queue, when nothing was measured yet, and when the
    /// last sample is older than `STALE_NS`.
    pub(crate) fn has_room(&self) -> bool {
        self.has_room_at(self.base.elapsed())
    }

    fn has_room_at(&self, now: Duration) -> bool {
        let (fast, floor) = (self.fast.load(Relaxed), self.floor.load(Relaxed));
        let stale = (now.as_nanos() as u64).saturating_sub(self.last.load(Relaxed));
        stale >= Self::STALE_NS || fast <= floor.saturating_mul(Self::FACTOR) + Self::SLACK_NS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_until_the_latency_climbs_well_above_its_floor() {
        let l = SourceLoad::default();
        let at = |s: u64| Duration::from_millis(s);
        assert!(l.has_room_at(at(0)), "nothing measured");
        let ms = |n: u64| Duration::from_micros(n * 1000);
        for _ in 0..100 {
            l.record_at(4096, ms(2), at(1));
        }
        assert!(l.has_room_at(at(1)), "a steady 2 ms source");
        for _ in 0..50 {
            l.record_at(4096, ms(20), at(2));
        }
        assert!(!l.has_room_at(at(2)), "queueing: ten times the floor");
        // Large reads say nothing; one very fast read barely moves the floor.
        for _ in 0..100 {
            l.record_at(1 << 20, ms(1), at(3));
        }
        l.record_at(4096, Duration::from_micros(10), at(3));
        assert!(!l.has_room_at(at(3)));
        // No sample for a second: the clients left the source.
        assert!(l.has_room_at(at(1003)));
        for _ in 0..100 {
            l.record_at(4096, ms(2), at(1004));
        }
        assert!(l.has_room_at(at(1004)), "the queue drained");
    }
}
