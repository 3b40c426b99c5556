//! Recent rates of every cached export, from counter samples taken once a second: what
//! `sce ctl status` and the population-rate gauge of /metrics show. Counters only tell
//! totals since start; an operator asks what the cache does now.

use crate::attach::Volumes;
use sce_engine::order::{levels, OrderedMutex};
/// This file's locks, unless named otherwise (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Samples kept per export: ten seconds of them.
const SAMPLES: usize = 11;

/// One sample: when, and (fragments populated, fragments evicted, pages hit, pages missed,
/// pages populated, bytes written back).
type Sample = (Instant, [u64; 6]);

/// What happened over the last seconds (up to ten) of an export.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Recent {
    /// Fragments populated per second.
    pub populations_per_second: f64,
    /// Fragments evicted per second.
    pub evictions_per_second: f64,
    /// Bytes populated per second.
    pub population_bytes_per_second: f64,
    /// Read hit ratio over the window's pages (0 if nothing was read).
    pub read_hit_ratio: f64,
    /// Pages read over the window (hits and misses).
    pub read_pages: f64,
    /// Write-back: bytes the cleaner wrote to the source per second.
    pub cleaned_bytes_per_second: f64,
    /// The window's length.
    pub window_seconds: f64,
}

/// The sampler of a server's exports; it stops when the last handle is dropped.
pub struct Rates {
    volumes: Arc<Volumes>,
    samples: Mutex<Vec<Vec<Sample>>>,
    stop: AtomicBool,
}

impl Rates {
    /// Starts sampling `volumes` once a second on a thread of its own.
    pub fn start(volumes: Arc<Volumes>) -> std::io::Result<Arc<Rates>> {
        let n = volumes.len();
        let r = Arc::new(Rates {
            volumes,
            samples: Mutex::new(vec![Vec::new(); n]),
            stop: AtomicBool::new(false),
        });
        r.sample();
        let weak = Arc::downgrade(&r);
        std::thread::Builder::new()
            .name("sce-rates".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_secs(1));
                match weak.upgrade() {
                    Some(r) if !r.stop.load(Relaxed) => r.sample(),
                    _ => return,
                }
            })?;
        Ok(r)
    }

    /// Stops the sampler thread (it also stops once every handle is gone).
    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
    }

    /// Records every export's counters, keeping the last [`SAMPLES`].
    fn sample(&self) {
        let now = Instant::now();
        // Taken before the samples' lock, which is a leaf: a row takes the export's gate.
        // None: detached (its rates start over when a cache is attached again); Some(None):
        // no counters this time.
        let rows: Vec<Option<Option<[u64; 6]>>> = (self.volumes.iter())
            .map(|(_, a)| {
                let (a, v) = a.as_ref().and_then(|a| Some((a, a.volume()?)))?;
                Some(a.stats().map(|s| {
                    [
                        s.fragments_populated,
                        s.fragments_evicted,
                        s.read_pages_hit,
                        s.read_pages_missed,
                        s.pages_populated,
                        v.writeback_stats().map_or(0, |w| w.cleaned_bytes),
                    ]
                }))
            })
            .collect();
        let mut all = self.samples.lock();
        for (q, row) in all.iter_mut().zip(rows) {
            match row {
                None => q.clear(),
                Some(None) => {}
                Some(Some(row)) => {
                    q.push((now, row));
                    if q.len() > SAMPLES {
                        q.remove(0);
                    }
                }
            }
        }
    }

    /// Export `i`'s rates over the sampled window (None before two samples).
    pub fn recent(&self, i: usize) -> Option<Recent> {
        let all = self.samples.lock();
        let q = all.get(i)?;
        let (first, last) = (q.first()?, q.last()?);
        let dt = last.0.duration_since(first.0).as_secs_f64();
        if dt <= 0.0 {
            return None;
        }
        let d = |k: usize| last.1[k].saturating_sub(first.1[k]) as f64;
        let reads = d(2) + d(3);
        Some(Recent {
            populations_per_second: d(0) / dt,
            evictions_per_second: d(1) / dt,
            population_bytes_per_second: d(4) * sce_core::PAGE_SIZE as f64 / dt,
            read_hit_ratio: if reads > 0.0 { d(2) / reads } else { 0.0 },
            read_pages: reads,
            cleaned_bytes_per_second: d(5) / dt,
            window_seconds: dt,
        })
    }
}
