//! The load of `sce demo`: threads that issue random I/O to a block device, Zipf-skewed in
//! extents, as fast as it completes, for a while; progress sampled at intervals (with the
//! cache's counters when the device is a cached volume) and a summary of the run.

use anyhow::Result;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use sce_engine::{CacheVolume, VolumeStats};
use sce_io::{AlignedBuf, BlockDevice};
use sce_sim::gen::Placement;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The load.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// How long the run lasts, in seconds.
    pub seconds: u64,
    /// Requests in flight (one thread each).
    pub depth: usize,
    /// Percentage of requests that are reads.
    pub read_pct: u32,
    /// Request size, bytes.
    pub block_size: u64,
    /// Zipf exponent of the access skew (0 is uniform).
    pub zipf: f64,
    /// Hot data comes in runs of this size, spread over the volume.
    pub cluster_size: u64,
    /// Time between progress samples.
    pub interval: Duration,
    /// Random seed of the load.
    pub seed: u64,
}

/// One progress interval.
#[derive(Serialize, Debug, Clone)]
pub struct Interval {
    /// Seconds since the run started.
    pub t: f64,
    /// Requests per second in the interval.
    pub iops: f64,
    /// Read hit ratio over the interval's read pages (cache run only).
    pub read_hit_ratio: Option<f64>,
    /// Bytes per second made valid by population in the interval (cache run only).
    pub population_bytes_per_sec: Option<f64>,
    /// Bytes written to the cache device in the interval (cache run only).
    pub cache_bytes_written: Option<u64>,
    /// The same per second.
    pub cache_bytes_per_sec: Option<f64>,
}

/// The result of one run.
#[derive(Serialize, Debug, Clone)]
pub struct RunResult {
    /// "cache" or "no cache".
    pub name: String,
    /// Requests completed.
    pub ops: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Requests per second.
    pub iops: f64,
    /// Mean latency in milliseconds.
    pub mean_ms: f64,
    /// 99th percentile latency in milliseconds.
    pub p99_ms: f64,
    /// Mean latency of the writes alone, in milliseconds (0 without writes).
    pub write_mean_ms: f64,
    /// 99th percentile latency of the writes alone, in milliseconds.
    pub write_p99_ms: f64,
    /// Read hit ratio over all read pages of the run.
    pub read_hit_ratio: Option<f64>,
    /// Bytes written to the cache device.
    pub cache_bytes_written: u64,
    /// Bytes written to the cache device in the first half of the run (by interval ends).
    pub cache_bytes_written_first_half: u64,
    /// Bytes written to the cache device in the second half of the run.
    pub cache_bytes_written_second_half: u64,
    /// Progress intervals.
    pub intervals: Vec<Interval>,
}

/// The counters the load threads share.
#[derive(Default)]
struct Counters {
    stop: AtomicBool,
    ops: AtomicU64,
    errors: AtomicU64,
}

/// Runs the load on `dev` (`volume`: the cached volume behind it, if it is one) for
/// `cfg.seconds` or until `stop_all`; calls `on_interval` with every progress sample and
/// the volume's counters then.
pub fn run(
    name: &str,
    dev: Arc<dyn BlockDevice>,
    volume: Option<&CacheVolume>,
    cfg: &LoadConfig,
    stop_all: &AtomicBool,
    on_interval: &mut dyn FnMut(&Interval, Option<&VolumeStats>),
) -> Result<RunResult> {
    let counters = Arc::new(Counters::default());
    let handles = spawn_threads(dev, cfg, &counters);
    let start = Instant::now();
    let first_stats = volume.map(|v| v.stats());
    let intervals = sample(
        volume,
        cfg,
        stop_all,
        &counters,
        (start, first_stats.clone()),
        on_interval,
    );
    counters.stop.store(true, Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    let mut lat: Vec<u32> = Vec::new();
    for h in handles {
        lat.extend(
            h.join()
                .map_err(|_| anyhow::anyhow!("a load thread panicked"))?,
        );
    }
    let final_stats: Option<VolumeStats> = volume.map(|v| {
        v.stats()
            .delta(first_stats.as_ref().expect("set with volume"))
    });
    Ok(summary(
        name,
        cfg,
        lat,
        elapsed,
        &counters,
        final_stats,
        intervals,
    ))
}

/// The bit of a latency sample that marks a write.
const WRITE: u32 = 1 << 31;

/// Starts the load threads; each returns its latencies in microseconds, writes marked with
/// [`WRITE`].
fn spawn_threads(
    dev: Arc<dyn BlockDevice>,
    cfg: &LoadConfig,
    counters: &Arc<Counters>,
) -> Vec<JoinHandle<Vec<u32>>> {
    let blocks = dev.size() / cfg.block_size;
    let layout = Arc::new(Placement::new(blocks, cfg.cluster_size / cfg.block_size));
    let mut handles = Vec::new();
    for t in 0..cfg.depth {
        let (dev, layout, counters) = (dev.clone(), layout.clone(), counters.clone());
        let (bs, read_pct, zipf, seed) = (cfg.block_size, cfg.read_pct, cfg.zipf, cfg.seed);
        handles.push(std::thread::spawn(move || -> Vec<u32> {
            let mut rng = SmallRng::seed_from_u64(seed.wrapping_mul(1000).wrapping_add(t as u64));
            let dist = (zipf > 0.0).then(|| Zipf::new(blocks, zipf).expect("valid zipf"));
            let mut buf = AlignedBuf::new(bs as usize);
            let mut lat = Vec::with_capacity(1 << 16);
            while !counters.stop.load(Relaxed) {
                let rank = match &dist {
                    Some(d) => d.sample(&mut rng) as u64 - 1,
                    None => rng.gen_range(0..blocks),
                };
                let off = layout.item(rank, 0) * bs;
                let t0 = Instant::now();
                let write = rng.gen_range(0..100) >= read_pct;
                let r = if !write {
                    dev.read_at(off, &mut buf)
                } else {
                    buf[..8].copy_from_slice(&off.to_le_bytes());
                    dev.write_at(off, &buf)
                };
                let us = t0.elapsed().as_micros().min((WRITE - 1) as u128) as u32;
                lat.push(if write { us | WRITE } else { us });
                counters.ops.fetch_add(1, Relaxed);
                if r.is_err() {
                    counters.errors.fetch_add(1, Relaxed);
                }
            }
            lat
        }));
    }
    handles
}

/// Samples the progress every `cfg.interval` until the run is over, from the start of the
/// run and the volume's counters then.
fn sample(
    volume: Option<&CacheVolume>,
    cfg: &LoadConfig,
    stop_all: &AtomicBool,
    counters: &Counters,
    (start, first_stats): (Instant, Option<VolumeStats>),
    on_interval: &mut dyn FnMut(&Interval, Option<&VolumeStats>),
) -> Vec<Interval> {
    let total = Duration::from_secs(cfg.seconds);
    let mut intervals = Vec::new();
    let mut last_t = start;
    let mut last_ops = 0;
    let mut last_stats = first_stats;
    while start.elapsed() < total && !stop_all.load(Relaxed) {
        let next = (last_t + cfg.interval).min(start + total);
        while Instant::now() < next && !stop_all.load(Relaxed) {
            std::thread::sleep(
                Duration::from_millis(20).min(next.saturating_duration_since(Instant::now())),
            );
        }
        let now = Instant::now();
        let dt = now.duration_since(last_t).as_secs_f64().max(1e-9);
        let o = counters.ops.load(Relaxed);
        let iops = (o - last_ops) as f64 / dt;
        let (mut hit, mut pop, mut written) = (None, None, None);
        if let (Some(v), Some(prev)) = (volume, &last_stats) {
            let s = v.stats();
            let d = s.delta(prev);
            hit = Some(d.read_hit_ratio());
            pop = Some(d.pages_populated as f64 * 4096.0 / dt);
            written = Some(d.cache_bytes_written);
            last_stats = Some(s);
        }
        let iv = Interval {
            t: now.duration_since(start).as_secs_f64(),
            iops,
            read_hit_ratio: hit,
            population_bytes_per_sec: pop,
            cache_bytes_written: written,
            cache_bytes_per_sec: written.map(|w| w as f64 / dt),
        };
        on_interval(&iv, last_stats.as_ref());
        intervals.push(iv);
        last_t = now;
        last_ops = o;
    }
    intervals
}

/// What the run comes to, from the threads' latencies and the samples.
fn summary(
    name: &str,
    cfg: &LoadConfig,
    samples: Vec<u32>,
    elapsed: f64,
    counters: &Counters,
    final_stats: Option<VolumeStats>,
    intervals: Vec<Interval>,
) -> RunResult {
    let writes: Vec<u32> = samples
        .iter()
        .filter(|&&x| x & WRITE != 0)
        .map(|&x| x & !WRITE)
        .collect();
    let lat: Vec<u32> = samples.iter().map(|&x| x & !WRITE).collect();
    let (mean_ms, p99_ms) = mean_p99(lat.clone());
    let (write_mean_ms, write_p99_ms) = mean_p99(writes);
    let half = cfg.seconds as f64 / 2.0;
    let written = |second: bool| -> u64 {
        intervals
            .iter()
            .filter(|iv| (iv.t > half + 0.05) == second)
            .filter_map(|iv| iv.cache_bytes_written)
            .sum()
    };
    let (first_half, second_half) = (written(false), written(true));
    RunResult {
        cache_bytes_written_first_half: first_half,
        cache_bytes_written_second_half: second_half,
        name: name.to_string(),
        ops: lat.len() as u64,
        errors: counters.errors.load(Relaxed),
        iops: lat.len() as f64 / elapsed,
        mean_ms,
        p99_ms,
        write_mean_ms,
        write_p99_ms,
        read_hit_ratio: final_stats.as_ref().map(|s| s.read_hit_ratio()),
        cache_bytes_written: final_stats.as_ref().map_or(0, |s| s.cache_bytes_written),
        intervals,
    }
}

/// Mean and 99th percentile of latencies in microseconds, in milliseconds (0 if none).
fn mean_p99(mut lat: Vec<u32>) -> (f64, f64) {
    if lat.is_empty() {
        return (0.0, 0.0);
    }
    lat.sort_unstable();
    let n = lat.len();
    let mean = lat.iter().map(|&x| x as f64).sum::<f64>() / n as f64 / 1000.0;
    let p99 = lat[(n * 99 / 100).min(n - 1)] as f64 / 1000.0;
    (mean, p99)
}
