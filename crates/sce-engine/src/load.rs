//! `SourceLoad`: whether the source has room for background population, from the latency
//! of the clients' own source reads (issue 30: population re-reads the source, so on a
//! saturated source it only adds to the queue the clients wait in, while miss fills fill
//! the cache from data already read).
//!
//! Each client read of at most [`SourceLoad::MAX_LEN`] bytes is one sample. `fast` follows
//! the samples quickly (an average over about 16), `floor` follows the least of them and
//! rises only slowly (about 1/1024 of the gap per sample), so it remembers what the source
//! takes when it is not queueing. The source has room while `fast` is within
//! [`SourceLoad::FACTOR`] times the floor plus [`SourceLoad::SLACK_NS`]. Lock-free and
//! approximate: concurrent samples may overwrite each other, which only loses samples.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// The recent latency of client source reads against its floor.
#[derive(Debug, Default)]
pub(crate) struct SourceLoad {
    fast: AtomicU64,
    floor: AtomicU64,
}

impl SourceLoad {
    /// Larger reads (streams, merged runs) say more about bandwidth than about queueing.
    pub(crate) const MAX_LEN: u64 = 128 << 10;
    /// How far above its floor the recent latency may be while the source has room.
    pub(crate) const FACTOR: u64 = 3;
    /// Added to the bound, so that a fast source's jitter is not taken for a queue.
    pub(crate) const SLACK_NS: u64 = 500_000;

    /// Records a client read of `len` bytes that took `took`.
    pub(crate) fn record(&self, len: u64, took: Duration) {
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
        self.fast.store(next, Relaxed);
        let floor = self.floor.load(Relaxed);
        let next = if floor == 0 || x < floor {
            x
        } else {
            floor + (x - floor) / 1024
        };
        self.floor.store(next, Relaxed);
    }

    /// True while the source shows no queue (or nothing was measured yet).
    pub(crate) fn has_room(&self) -> bool {
        let (fast, floor) = (self.fast.load(Relaxed), self.floor.load(Relaxed));
        fast <= floor.saturating_mul(Self::FACTOR) + Self::SLACK_NS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_until_the_latency_climbs_well_above_its_floor() {
        let l = SourceLoad::default();
        assert!(l.has_room(), "nothing measured");
        let ms = |n: u64| Duration::from_micros(n * 1000);
        for _ in 0..100 {
            l.record(4096, ms(2));
        }
        assert!(l.has_room(), "a steady 2 ms source");
        for _ in 0..50 {
            l.record(4096, ms(20));
        }
        assert!(!l.has_room(), "queueing: ten times the floor");
        // Large reads say nothing.
        for _ in 0..100 {
            l.record(1 << 20, ms(1));
        }
        assert!(!l.has_room());
        for _ in 0..100 {
            l.record(4096, ms(2));
        }
        assert!(l.has_room(), "the queue drained");
    }
}
