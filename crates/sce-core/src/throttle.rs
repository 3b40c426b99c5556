//! SCE's Algorithm 1: how many population workers run and how long they sleep, from the
//! recent read miss rate and the free space.
//!
//! Each worker loops: sleep for the period; read the cache status; if free space is at least
//! `min_free_pcnt` (or eviction is allowed) and the miss rate is at least `target_missrate`,
//! promote the hottest fragment of the MRU window. Eight workers run until the miss rate falls
//! below 35% or free space to 10%; then four until it falls below 15%; then one, sleeping
//! 500 ms per cycle.

use crate::addr::Nanos;
use crate::config::ThrottleConfig;
use std::time::Duration;

/// What the throttle says right now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThrottleState {
    /// Workers allowed to populate (workers `0..active_workers`).
    pub active_workers: u32,
    /// How long each worker sleeps between cycles.
    pub period: Duration,
    /// How long a worker sleeps after a cycle that populated a fragment: `period`, or the
    /// fast period while the read hit ratio is moving (the population budget says so). The slow
    /// rung saves flash writes once hits are steady, but the end of a shift of the working
    /// set has a low miss rate concentrated in the lines still missing: at two picks a
    /// second a 200 MiB region's last tenth took tens of seconds.
    pub after_pick: Duration,
    /// Whether a worker that wakes up may promote a fragment now.
    pub may_populate: bool,
    /// Read miss rate over the recent window (0.0 ..= 1.0; 0 when there were no reads).
    pub missrate: f64,
    /// Percentage of free slots.
    pub free_pcnt: f64,
}

/// Read hit/miss counts over a sliding window of two buckets.
#[derive(Debug, Default, Clone)]
pub struct MissRate {
    start: Nanos,
    cur: (u64, u64),
    prev: (u64, u64),
}

impl MissRate {
    /// Counts read pages (called on every read, no clock needed).
    #[inline]
    pub fn record(&mut self, hits: u64, misses: u64) {
        self.cur.0 += hits;
        self.cur.1 += misses;
    }

    /// Rotates the buckets if the window has passed and returns the miss rate.
    pub fn rate(&mut self, now: Nanos, window: Duration) -> f64 {
        if now.since(self.start) >= window {
            self.prev = if now.since(self.start) >= 2 * window {
                (0, 0)
            } else {
                self.cur
            };
            self.cur = (0, 0);
            self.start = now;
        }
        let hits = self.prev.0 + self.cur.0;
        let misses = self.prev.1 + self.cur.1;
        if hits + misses == 0 {
            0.0
        } else {
            misses as f64 / (hits + misses) as f64
        }
    }
}

/// Applies Algorithm 1 to a miss rate and free percentage; `moving` (the population
/// budget saw the read hit ratio move in its last epoch) makes `after_pick` the fast period.
pub fn decide(cfg: &ThrottleConfig, missrate: f64, free_pcnt: f64, moving: bool) -> ThrottleState {
    let (active_workers, period) = if missrate >= cfg.high_missrate && free_pcnt > cfg.low_free_pcnt
    {
        (cfg.max_workers, cfg.period)
    } else if missrate >= cfg.low_missrate {
        (cfg.mid_workers, cfg.period)
    } else {
        (cfg.min_workers, cfg.slow_period)
    };
    let space_ok = free_pcnt >= cfg.min_free_pcnt || cfg.allow_eviction;
    let may_populate = space_ok && missrate >= cfg.target_missrate && missrate > 0.0;
    ThrottleState {
        active_workers,
        period,
        after_pick: if moving {
            period.min(cfg.period)
        } else {
            period
        },
        may_populate,
        missrate,
        free_pcnt,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_steps_follow_algorithm_1() {
        let c = ThrottleConfig::default();
        assert_eq!(decide(&c, 0.9, 80.0, false).active_workers, 8);
        assert_eq!(decide(&c, 0.34, 80.0, false).active_workers, 4);
        assert_eq!(decide(&c, 0.9, 10.0, false).active_workers, 4);
        let low = decide(&c, 0.10, 80.0, false);
        assert_eq!(
            (low.active_workers, low.period),
            (1, Duration::from_millis(500))
        );
        assert!(low.may_populate);
        assert_eq!(low.after_pick, low.period);
        assert_eq!(decide(&c, 0.10, 80.0, true).after_pick, c.period);
        assert!(!decide(&c, 0.0, 80.0, false).may_populate);
        let strict = ThrottleConfig {
            min_free_pcnt: 5.0,
            allow_eviction: false,
            ..c.clone()
        };
        assert!(!decide(&strict, 0.9, 4.0, false).may_populate);
        assert!(decide(&strict, 0.9, 6.0, false).may_populate);
        let target = ThrottleConfig {
            target_missrate: 0.2,
            ..c
        };
        assert!(!decide(&target, 0.1, 50.0, false).may_populate);
    }

    #[test]
    fn missrate_window_slides() {
        let mut m = MissRate::default();
        let w = Duration::from_secs(1);
        m.record(90, 10);
        assert!((m.rate(Nanos(0), w) - 0.1).abs() < 1e-9);
        // One window later the old bucket still counts.
        assert!((m.rate(Nanos(1_000_000_000), w) - 0.1).abs() < 1e-9);
        m.record(0, 100);
        assert!((m.rate(Nanos(1_500_000_000), w) - 110.0 / 200.0).abs() < 1e-9);
        // Long idle: everything forgotten.
        assert_eq!(m.rate(Nanos(10_000_000_000), w), 0.0);
    }
}
