//! `sce demo`: a slow source (a sparse file behind the latency wrapper) and a cache file,
//! an OLTP-like load run through the cached volume and then, for the same time, against the
//! source alone; periodic progress lines and a side-by-side summary.

use crate::units::{format_size, parse_duration, parse_size};
use anyhow::{bail, Context, Result};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use sce_core::{Admission, CoreConfig, EvictionKind, WriteMode};
use sce_engine::{CacheVolume, EngineConfig, VolumeStats};
use sce_io::{
    AlignedBuf, BlockDevice, Delay, DirectMode, FileDevice, FileOptions, LatencyConfig,
    LatencyDevice,
};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of `sce demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// How long each of the two runs (cache, then no cache) lasts, in seconds.
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// Size of the (sparse) source volume.
    #[arg(long, default_value = "4GiB", value_parser = parse_size)]
    pub source_size: u64,
    /// Size of the cache device.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub cache_size: u64,
    /// Write mode: awt, write-around or write-through.
    #[arg(long, default_value = "awt")]
    pub mode: WriteMode,
    /// Admission: sce (flash-conscious, the default), sce-paper (the paper's Algorithm 1, as
    /// sce did before), always or nhit:K.
    #[arg(long, default_value = "sce")]
    pub admission: Admission,
    /// Options of admission sce and the endurance budget.
    #[command(flatten)]
    pub admission_opts: crate::policy_args::AdmissionArgs,
    /// Fragment size: a power of two from 4KiB to 64MiB.
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    pub fragment_size: u64,
    /// Eviction policy: clock, lru or fifo.
    #[arg(long, default_value = "clock")]
    pub eviction: EvictionKind,
    /// Algorithm 1: populate only while the read miss rate is at least this (0..=1).
    #[arg(long, default_value_t = 0.01)]
    pub target_missrate: f64,
    /// Algorithm 1: populate only while this percentage of slots is free, unless eviction
    /// for population is allowed.
    #[arg(long, default_value_t = 0.0)]
    pub min_free_pcnt: f64,
    /// Algorithm 1: do not evict to populate (population stops when free space falls below
    /// --min-free-pcnt).
    #[arg(long)]
    pub no_evict_for_population: bool,
    /// Algorithm 1: sleep of a population worker between cycles.
    #[arg(long, default_value = "20ms", value_parser = parse_duration)]
    pub period: Duration,
    /// Bytes of AWT copies in flight before writes fall back to write-around.
    #[arg(long, default_value = "8MiB", value_parser = parse_size)]
    pub awt_budget: u64,
    /// Fragments in the MRU hotness window that population picks from.
    #[arg(long, default_value_t = 100)]
    pub hot_window: usize,
    /// Use the flashcache-like baseline (4KiB fragments, always, write-through, LRU) instead
    /// of --mode/--admission/--fragment-size/--eviction.
    #[arg(long)]
    pub flashcache_like: bool,
    /// Latency the source adds to every I/O.
    #[arg(long, default_value = "2ms", value_parser = parse_duration)]
    pub source_latency: Duration,
    /// I/Os the source serves at once; more wait in its queue.
    #[arg(long, default_value_t = 64)]
    pub source_depth: usize,
    /// Bandwidth of the source's link, shared by all its I/Os (0 = unlimited).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub source_bandwidth: u64,
    /// Requests in flight (one thread each).
    #[arg(long, default_value_t = 16)]
    pub depth: usize,
    /// Percentage of requests that are reads.
    #[arg(long, default_value_t = 87)]
    pub read_pct: u32,
    /// Request size.
    #[arg(long, default_value = "8KiB", value_parser = parse_size)]
    pub block_size: u64,
    /// Zipf exponent of the access skew (0 is uniform).
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Hot data comes in runs of this size (like database extents), spread over the volume;
    /// the block size gives no locality at all, the source size gives perfect locality.
    #[arg(long, default_value = "256KiB", value_parser = parse_size)]
    pub cluster_size: u64,
    /// Seconds between progress lines.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub interval: Duration,
    /// Directory for the demo's files (removed at the end); default: the system temp dir.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Fall back to buffered I/O where the filesystem refuses O_DIRECT (tmpfs).
    #[arg(long)]
    pub allow_buffered: bool,
    /// Random seed of the load.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
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

/// Everything `--json` prints.
#[derive(Serialize, Debug)]
pub struct DemoReport {
    /// The configuration that ran.
    pub config: String,
    /// The cache run.
    pub cache: RunResult,
    /// The no-cache run.
    pub no_cache: RunResult,
    /// IOPS of the cache run over IOPS of the no-cache run.
    pub speedup: f64,
}

fn run(
    name: &str,
    dev: Arc<dyn BlockDevice>,
    volume: Option<&CacheVolume>,
    a: &DemoArgs,
    stop_all: &AtomicBool,
) -> Result<RunResult> {
    let blocks = dev.size() / a.block_size;
    let layout = Arc::new(sce_sim::gen::Placement::new(
        blocks,
        a.cluster_size / a.block_size,
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for t in 0..a.depth {
        let (dev, layout, stop, ops, errors) = (
            dev.clone(),
            layout.clone(),
            stop.clone(),
            ops.clone(),
            errors.clone(),
        );
        let (bs, read_pct, zipf, seed) = (a.block_size, a.read_pct, a.zipf, a.seed);
        handles.push(std::thread::spawn(move || -> Vec<u32> {
            let mut rng = SmallRng::seed_from_u64(seed.wrapping_mul(1000).wrapping_add(t as u64));
            let dist = (zipf > 0.0).then(|| Zipf::new(blocks, zipf).expect("valid zipf"));
            let mut buf = AlignedBuf::new(bs as usize);
            let mut lat = Vec::with_capacity(1 << 16);
            while !stop.load(Relaxed) {
                let rank = match &dist {
                    Some(d) => d.sample(&mut rng) as u64 - 1,
                    None => rng.gen_range(0..blocks),
                };
                let off = layout.item(rank, 0) * bs;
                let t0 = Instant::now();
                let r = if rng.gen_range(0..100) < read_pct {
                    dev.read_at(off, &mut buf)
                } else {
                    buf[..8].copy_from_slice(&off.to_le_bytes());
                    dev.write_at(off, &buf)
                };
                lat.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                ops.fetch_add(1, Relaxed);
                if r.is_err() {
                    errors.fetch_add(1, Relaxed);
                }
            }
            lat
        }));
    }
    let start = Instant::now();
    let total = Duration::from_secs(a.seconds);
    let mut intervals = Vec::new();
    let mut last_t = start;
    let mut last_ops = 0;
    let first_stats = volume.map(|v| v.stats());
    let mut last_stats = first_stats.clone();
    while start.elapsed() < total && !stop_all.load(Relaxed) {
        let next = (last_t + a.interval).min(start + total);
        while Instant::now() < next && !stop_all.load(Relaxed) {
            std::thread::sleep(
                Duration::from_millis(20).min(next.saturating_duration_since(Instant::now())),
            );
        }
        let now = Instant::now();
        let dt = now.duration_since(last_t).as_secs_f64().max(1e-9);
        let o = ops.load(Relaxed);
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
        if !a.json {
            print_interval(name, &iv, last_stats.as_ref());
        }
        intervals.push(iv);
        last_t = now;
        last_ops = o;
    }
    stop.store(true, Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    let mut lat: Vec<u32> = Vec::new();
    for h in handles {
        lat.extend(
            h.join()
                .map_err(|_| anyhow::anyhow!("a load thread panicked"))?,
        );
    }
    lat.sort_unstable();
    let n = lat.len().max(1);
    let mean_ms = lat.iter().map(|&x| x as f64).sum::<f64>() / n as f64 / 1000.0;
    let p99_ms = lat.get((n * 99 / 100).min(n - 1)).copied().unwrap_or(0) as f64 / 1000.0;
    let final_stats: Option<VolumeStats> = volume.map(|v| {
        v.stats()
            .delta(first_stats.as_ref().expect("set with volume"))
    });
    let half = a.seconds as f64 / 2.0;
    let written = |second: bool| -> u64 {
        intervals
            .iter()
            .filter(|iv| (iv.t > half + 0.05) == second)
            .filter_map(|iv| iv.cache_bytes_written)
            .sum()
    };
    let (first_half, second_half) = (written(false), written(true));
    Ok(RunResult {
        cache_bytes_written_first_half: first_half,
        cache_bytes_written_second_half: second_half,
        name: name.to_string(),
        ops: lat.len() as u64,
        errors: errors.load(Relaxed),
        iops: lat.len() as f64 / elapsed,
        mean_ms,
        p99_ms,
        read_hit_ratio: final_stats.as_ref().map(|s| s.read_hit_ratio()),
        cache_bytes_written: final_stats.as_ref().map_or(0, |s| s.cache_bytes_written),
        intervals,
    })
}

fn print_interval(name: &str, iv: &Interval, s: Option<&VolumeStats>) {
    match (iv.read_hit_ratio, iv.population_bytes_per_sec, s) {
        (Some(h), Some(p), Some(s)) => println!(
            "[{name:>8}] t={:5.1}s  IOPS {:>8.0}  read hit {:5.1}%  populating {:>11}/s  cache writes {:>11}/s  slots used {:>6}/{}  workers {}",
            iv.t,
            iv.iops,
            h * 100.0,
            format_size(p as u64),
            format_size(iv.cache_bytes_per_sec.unwrap_or(0.0) as u64),
            s.total_slots - s.free_slots,
            s.total_slots,
            s.active_workers
        ),
        _ => println!("[{name:>8}] t={:5.1}s  IOPS {:>8.0}", iv.t, iv.iops),
    }
}

fn print_summary(r: &RunResult) {
    let hit = r
        .read_hit_ratio
        .map_or("-".to_string(), |h| format!("{:.1}%", h * 100.0));
    println!(
        "{:<9} IOPS {:>8.0}  mean {:>7.3} ms  p99 {:>7.3} ms  read hit {:>6}  cache writes {:>10}  errors {}",
        format!("{}:", r.name),
        r.iops,
        r.mean_ms,
        r.p99_ms,
        hit,
        format_size(r.cache_bytes_written),
        r.errors
    );
    if r.read_hit_ratio.is_some() {
        let first = r.cache_bytes_written_first_half;
        println!(
            "{:<9} cache writes in the first half {}, in the second half {} ({})",
            "",
            format_size(first),
            format_size(r.cache_bytes_written_second_half),
            if first > 0 {
                format!(
                    "{:.1}% of the first",
                    100.0 * r.cache_bytes_written_second_half as f64 / first as f64
                )
            } else {
                "nothing in the first".to_string()
            }
        );
    }
}

/// Runs the demo.
pub fn demo(a: DemoArgs) -> Result<()> {
    if a.block_size == 0 || !a.block_size.is_multiple_of(4096) {
        bail!(
            "invalid --block-size {}: must be a positive multiple of 4KiB",
            a.block_size
        );
    }
    if a.read_pct > 100 {
        bail!("invalid --read-pct {}: must be 0..=100", a.read_pct);
    }
    if a.depth == 0 {
        bail!("invalid --depth 0: at least one request must be in flight");
    }
    if a.source_size < a.block_size * 16 {
        bail!("invalid --source-size: too small for the load");
    }
    let mut core = if a.flashcache_like {
        CoreConfig::flashcache_like()
    } else {
        CoreConfig {
            fragment_size: a.fragment_size,
            admission: a.admission,
            write_mode: a.mode,
            eviction: a.eviction,
            ..CoreConfig::default()
        }
    };
    core.throttle.target_missrate = a.target_missrate;
    core.throttle.min_free_pcnt = a.min_free_pcnt;
    core.throttle.allow_eviction = !a.no_evict_for_population;
    core.throttle.period = a.period;
    core.awt_budget = a.awt_budget;
    core.hot_window = a.hot_window;
    if !a.flashcache_like {
        a.admission_opts.apply(&mut core, a.cache_size);
    }
    core.validate().context("invalid cache configuration")?;
    if a.cache_size / core.fragment_size < 2 {
        bail!(
            "invalid --cache-size {}: it must hold at least 2 fragments of {}",
            format_size(a.cache_size),
            format_size(core.fragment_size)
        );
    }
    core.throttle.missrate_window = Duration::from_secs(1);

    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("sce-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let stop_all = Arc::new(AtomicBool::new(false));
    {
        let s = stop_all.clone();
        let _ = ctrlc::set_handler(move || s.store(true, Relaxed));
    }
    let result = (|| -> Result<DemoReport> {
        let direct = if a.allow_buffered {
            DirectMode::Preferred
        } else {
            DirectMode::Required
        };
        let src_file = FileDevice::open(
            &dir.join("source.img"),
            &FileOptions {
                direct,
                create_size: Some(a.source_size),
                read_only: false,
                ..Default::default()
            },
        )?;
        let cache_file = FileDevice::open(
            &dir.join("cache.img"),
            &FileOptions {
                direct,
                create_size: Some(a.cache_size),
                read_only: false,
                ..Default::default()
            },
        )?;
        let lat = LatencyConfig {
            read: Delay::Fixed(a.source_latency),
            write: Delay::Fixed(a.source_latency),
            flush: Delay::Fixed(a.source_latency),
            max_in_flight: a.source_depth.max(1),
            bandwidth: (a.source_bandwidth > 0).then_some(a.source_bandwidth),
            seed: a.seed,
        };
        let source: Arc<dyn BlockDevice> = Arc::new(LatencyDevice::new(src_file, lat));
        let cache: Arc<dyn BlockDevice> = Arc::new(cache_file);
        let cfg_line = format!(
            "source {} (latency {:?}, {} in flight, {}/s), cache {}, fragment {}, admission {}, mode {}, eviction {}; load: {} x {} {}% reads zipf {} in {} extents",
            format_size(a.source_size),
            a.source_latency,
            a.source_depth,
            if a.source_bandwidth > 0 { format_size(a.source_bandwidth) } else { "unlimited".into() },
            format_size(a.cache_size),
            format_size(core.fragment_size),
            core.admission,
            core.write_mode,
            core.eviction,
            a.depth,
            format_size(a.block_size),
            a.read_pct,
            a.zipf,
            format_size(a.cluster_size)
        );
        let cfg_line = if core.admission == Admission::Sce {
            format!(
                "{cfg_line}; {}",
                crate::policy_args::AdmissionArgs::describe(&core)
            )
        } else {
            cfg_line
        };
        if !a.json {
            println!("sce demo: {cfg_line}");
            println!("files in {} (removed at the end)", dir.display());
        }
        let volume = Arc::new(CacheVolume::open(
            source.clone(),
            cache,
            EngineConfig {
                core,
                ..EngineConfig::default()
            },
        )?);
        let cached = run(
            "cache",
            volume.clone() as Arc<dyn BlockDevice>,
            Some(&volume),
            &a,
            &stop_all,
        )?;
        drop(volume);
        let plain = run("no cache", source, None, &a, &stop_all)?;
        let speedup = if plain.iops > 0.0 {
            cached.iops / plain.iops
        } else {
            0.0
        };
        Ok(DemoReport {
            config: cfg_line,
            cache: cached,
            no_cache: plain,
            speedup,
        })
    })();
    let _ = std::fs::remove_dir_all(&dir);
    let report = result?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!();
        print_summary(&report.cache);
        print_summary(&report.no_cache);
        println!(
            "speed-up of the cache over no cache: {:.2}x",
            report.speedup
        );
    }
    Ok(())
}
