//! `sce demo`: a slow source (a sparse file behind the latency wrapper) and a cache file,
//! an OLTP-like load run through the cached volume and then, for the same time, against the
//! source alone; periodic progress lines and a side-by-side summary. The load itself is
//! [`crate::load`]; this module sets up the devices and prints.

use crate::load::{Interval, LoadConfig, RunResult};
use crate::units::{format_size, parse_duration, parse_size};
use anyhow::{bail, Context, Result};
use sce_core::{Admission, CoreConfig, EvictionKind, WriteMode};
use sce_engine::{CacheVolume, EngineConfig, VolumeStats};
use sce_io::{
    BlockDevice, Delay, DirectMode, FileDevice, FileOptions, LatencyConfig, LatencyDevice,
};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

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
    /// Cache mode: writethrough (asynchronous), writethrough-sync (or --awt off),
    /// writearound, writeback (on a fresh persistent cache in the demo's directory) or
    /// passthrough. The old names awt, write-through and write-around work too.
    #[arg(long, default_value = "writethrough")]
    pub mode: WriteMode,
    /// Admission: sce (flash-conscious, the default), sce-paper (the paper's Algorithm 1, as
    /// sce did before), always or nhit:K.
    #[arg(long, default_value = "sce")]
    pub admission: Admission,
    /// Options of admission sce and the endurance budget.
    #[command(flatten)]
    pub admission_opts: crate::policy_args::AdmissionArgs,
    /// Fragment size: a power of two from 4KiB to 64MiB. Given, the cache line is the
    /// fragment; by default admission sce counts heat per 1MiB fragment and fills 512KiB
    /// lines of it. [default: 1MiB in lines of 512KiB]
    #[arg(long, value_parser = parse_size)]
    pub fragment_size: Option<u64>,
    /// Eviction policy: clock, lru or fifo.
    #[arg(long, default_value = "clock")]
    pub eviction: EvictionKind,
    /// Algorithm 1: populate only while the read miss rate is at least this (0..=1).
    #[arg(long, default_value_t = 0.01)]
    pub target_missrate: f64,
    /// The engine's tuning knobs (as in serve and the TOML file).
    #[command(flatten)]
    pub tuning: crate::policy_args::TuningArgs,
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

/// The load of the arguments.
fn load(a: &DemoArgs) -> LoadConfig {
    LoadConfig {
        seconds: a.seconds,
        depth: a.depth,
        read_pct: a.read_pct,
        block_size: a.block_size,
        zipf: a.zipf,
        cluster_size: a.cluster_size,
        interval: a.interval,
        seed: a.seed,
    }
}

/// Runs the load on `dev`, printing the progress unless `--json`.
fn run(
    name: &str,
    dev: Arc<dyn BlockDevice>,
    volume: Option<&CacheVolume>,
    a: &DemoArgs,
    stop_all: &AtomicBool,
) -> Result<RunResult> {
    let mut on_interval = |iv: &Interval, s: Option<&VolumeStats>| {
        if !a.json {
            print_interval(name, iv, s);
        }
    };
    crate::load::run(name, dev, volume, &load(a), stop_all, &mut on_interval)
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
    let core = core_config(&a)?;
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("sce-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let stop_all = Arc::new(AtomicBool::new(false));
    {
        let s = stop_all.clone();
        let _ = ctrlc::set_handler(move || s.store(true, Relaxed));
    }
    let result = run_both(&a, &dir, core, &stop_all);
    let _ = std::fs::remove_dir_all(&dir);
    let report = result?;
    print_report(&a, &report)
}

/// The cache configuration of the arguments, checked.
fn core_config(a: &DemoArgs) -> Result<CoreConfig> {
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
        let mut core = CoreConfig {
            admission: a.admission,
            write_mode: a.mode,
            eviction: a.eviction,
            ..CoreConfig::default()
        };
        sce_server::admission::geometry(&mut core, a.fragment_size, None);
        core
    };
    core.throttle.target_missrate = a.target_missrate;
    a.tuning.apply(&mut core);
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
    Ok(core)
}

/// The source (a sparse file behind the latency wrapper) and the cache file, in `dir`.
fn open_devices(a: &DemoArgs, dir: &Path) -> Result<(Arc<dyn BlockDevice>, Arc<dyn BlockDevice>)> {
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
    Ok((source, cache))
}

/// The line that says what runs.
fn config_line(a: &DemoArgs, core: &CoreConfig) -> String {
    let cfg_line = format!(
        "source {} (latency {:?}, {} in flight, {}/s), cache {}, line {} (fragment {}), admission {}, mode {}, eviction {}; load: {} x {} {}% reads zipf {} in {} extents",
        format_size(a.source_size),
        a.source_latency,
        a.source_depth,
        if a.source_bandwidth > 0 { format_size(a.source_bandwidth) } else { "unlimited".into() },
        format_size(a.cache_size),
        format_size(core.fragment_size),
        format_size(core.heat_bytes()),
        core.admission,
        core.write_mode,
        core.eviction,
        a.depth,
        format_size(a.block_size),
        a.read_pct,
        a.zipf,
        format_size(a.cluster_size)
    );
    if core.admission == Admission::Sce {
        format!(
            "{cfg_line}; {}",
            crate::policy_args::AdmissionArgs::describe(core)
        )
    } else {
        cfg_line
    }
}

/// What runs, in words, and what the columns mean (the whole configuration is `config` in
/// `--json`, and `--help` has every option).
fn print_header(a: &DemoArgs, core: &CoreConfig, dir: &Path) {
    let link = if a.source_bandwidth > 0 {
        format!("{}/s", format_size(a.source_bandwidth))
    } else {
        "unlimited".into()
    };
    println!(
        "sce demo: a {} source volume that takes {:?} per I/O ({} at once, link {link}), cached on a {} file",
        format_size(a.source_size),
        a.source_latency,
        a.source_depth,
        format_size(a.cache_size),
    );
    println!(
        "  load:  {} clients doing {} I/Os, {}% reads, most of them to a few hot {} regions",
        a.depth,
        format_size(a.block_size),
        a.read_pct,
        format_size(a.cluster_size),
    );
    println!(
        "  cache: mode {}, admission {}, {} lines ({} fragments), {} eviction; first with the cache, then the source alone",
        core.write_mode,
        core.admission,
        format_size(core.fragment_size),
        format_size(core.heat_bytes()),
        core.eviction,
    );
    println!(
        "  columns: read hit = share of pages read from the cache; populating = hot data copied from \
         the source into the cache; cache writes = that plus the clients' writes copied there \
         ({}); workers = population threads the throttle lets run (fewer once the hit ratio \
         no longer rises)",
        match core.write_mode {
            m if m.copies_writes() => "write-through keeps the cached copy current",
            WriteMode::WriteBack => "write-back keeps them there until cleaned",
            _ => "none in this mode",
        }
    );
    println!("  files in {} (removed at the end)", dir.display());
}

/// The cache run, then the no-cache run, over devices in `dir`.
fn run_both(
    a: &DemoArgs,
    dir: &Path,
    core: CoreConfig,
    stop_all: &AtomicBool,
) -> Result<DemoReport> {
    let (source, cache) = open_devices(a, dir)?;
    let cfg_line = config_line(a, &core);
    if !a.json {
        print_header(a, &core, dir);
    }
    // Write-back keeps its dirty data on a persistent cache (a fresh one: the files are
    // the demo's own).
    let persist = (core.write_mode == WriteMode::WriteBack)
        .then(|| sce_engine::PersistConfig::new(dir.join("source").display().to_string()));
    let volume = Arc::new(CacheVolume::open(
        source.clone(),
        cache,
        EngineConfig {
            core,
            persist,
            ..EngineConfig::default()
        },
    )?);
    let cached = run(
        "cache",
        volume.clone() as Arc<dyn BlockDevice>,
        Some(&volume),
        a,
        stop_all,
    )?;
    drop(volume);
    let plain = run("no cache", source, None, a, stop_all)?;
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
}

/// Prints the report: JSON, or the summary of both runs and the speed-up.
fn print_report(a: &DemoArgs, report: &DemoReport) -> Result<()> {
    if a.json {
        println!("{}", serde_json::to_string_pretty(report)?);
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
