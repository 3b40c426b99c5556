//! `sce sim`: trace-driven simulation. A first streaming pass lays out the volumes of the
//! trace (each its own address space) and counts the requests; then every policy streams
//! the trace again in its own thread (as many at once as there are cores): the reference
//! policies (`lru`, `fifo`, `lfu` over 4 KiB blocks, every block access a lookup that
//! inserts on a miss) and the engine policies (`sce`, `flashcache-like`, `always`,
//! `nhit:K`), which run the sce-core state machine in virtual time over modelled devices.
//! Each policy runs inside a [`Stack`]: one or several hosts, optionally with a RAM cache
//! above the flash cache.

use crate::alloc::live_bytes;
use crate::units::{format_size, parse_duration, parse_size};
use anyhow::{bail, Context, Result};
use sce_core::{Admission, CacheCore, CoreConfig, WriteMode};
use sce_sim::layers::{Flash, Host, RamCache, RamPolicy, Replay, Stack, StackResult, VolumeLayout};
use sce_sim::{
    BlockCache, DeviceModel, EngineResult, EngineSim, IoKind, ReferencePolicy, TraceFormat,
    TraceReader,
};
use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// The most cache slots an engine policy may have here (about 6 GiB of core metadata).
const MAX_ENGINE_SLOTS: u64 = 1 << 27;

/// Options of `sce sim`.
#[derive(clap::Args, Debug)]
#[command(after_long_help = SIM_HELP)]
pub struct SimArgs {
    /// The trace file (gzip, bzip2 and xz are read directly).
    #[arg(long)]
    pub trace: PathBuf,
    /// Its format: vscsi, msr, systor, tencent, disksim, sce, csv or csv:SPEC (see below).
    #[arg(long)]
    pub format: TraceFormat,
    /// Cache size (4 KiB blocks of it for the reference policies).
    #[arg(long, value_parser = parse_size)]
    pub cache_size: u64,
    /// Policies to run side by side (repeatable or comma-separated): the engine's sce,
    /// flashcache-like, always, nhit:K; the reference lru, fifo, lfu, s3fifo, larc.
    #[arg(long, value_delimiter = ',', default_value = "sce")]
    pub policy: Vec<String>,
    /// Fragment size of the engine policies (flashcache-like always uses 4KiB).
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    pub fragment_size: u64,
    /// Write mode of the engine policies (flashcache-like always uses write-through).
    #[arg(long, default_value = "awt")]
    pub mode: WriteMode,
    /// Length of the intervals of the warm-up curve, in trace seconds.
    #[arg(long, default_value_t = 60.0)]
    pub interval: f64,
    /// Drop writes from the trace.
    #[arg(long)]
    pub reads_only: bool,
    /// Count and skip malformed records instead of failing.
    #[arg(long)]
    pub skip_bad: bool,
    /// Hosts sharing one volume: the volume field of the trace is the host id (modulo N);
    /// each host has its own caches, and a write by one invalidates the others' copies.
    #[arg(long, default_value_t = 1)]
    pub hosts: u32,
    /// A RAM cache (LRU, 4 KiB pages) of this size above each flash cache.
    #[arg(long, value_parser = parse_size)]
    pub ram_size: Option<u64>,
    /// When the RAM cache writes down to flash: sync, async, periodic:SECS or none.
    #[arg(long, default_value = "async")]
    pub ram_policy: RamPolicy,
    /// Device models: ssd=MODEL,source=MODEL, where MODEL is mercury-ssd, disk, or
    /// READ_LAT/WRITE_LAT/READ_BW/WRITE_BW/CHANNELS such as 240us/225us/110MB/39MB/8.
    #[arg(long, default_value = "ssd=mercury-ssd,source=disk")]
    pub device_model: String,
    /// How the requests issue in virtual time: open (at their trace times) or closed:QD
    /// (QD requests in flight, the next issuing when one completes; trace times ignored).
    /// Default: open if the trace's timestamps are usable, else closed:32 (see below).
    #[arg(long)]
    pub replay: Option<Replay>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG plot of the read hit ratio over time, one line per policy.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Policies simulated at once (default: the number of cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Options of admission sce (and the endurance budget of every engine policy).
    #[command(flatten)]
    pub admission_opts: crate::policy_args::AdmissionArgs,
}

const SIM_HELP: &str = "\
Generic CSV: --format csv:KEY=VALUE,... with keys (defaults in brackets)
  time=COL [0] op=COL [1] volume=COL|none [2] offset=COL [3] len=COL [4]   (columns from 0)
  unit=byte|sector|4k [byte]   time_unit=s|ms|us|100ns|ns [ns]   header=N [0] lines to skip
  sep=comma|tab|space|semicolon|pipe [comma]   read=TOKEN write=TOKEN  (default r/read, w/write)
  e.g. Tencent CBS: csv:time=0,offset=1,len=2,op=3,volume=4,unit=sector,time_unit=s,read=0,write=1
Lines that are empty or start with # are skipped; `csv` alone reads what `sce trace convert
--out-format csv` writes.

Replay: --replay open issues each request at its trace time; a trace faster than the device
models queues on them. --replay closed:QD keeps QD requests in flight and issues the next
when one completes (reads when their data is read, writes when acknowledged), ignoring the
trace times; intervals, warm-up and the population workers then run on that virtual clock.
The default is open, unless the trace's timestamps are unusable (all equal, or a request
earlier than an earlier request by more than a tenth of the trace's span): then closed:32.
The output says which replay ran and why.

Device models: every policy runs over them. Engine policies model the core's own I/O;
reference policies read hits from the cache device, read misses from the source and write
the inserted blocks to the cache device before the read completes (as inline fills), and
send writes to the source and their blocks to the cache device, acknowledged when the source
write completes. Writes of the engine are acknowledged when the source write completes (AWT,
write-around) or when it and every cache copy complete (synchronous write-through).

Reference policies, over 4 KiB blocks, every block of a request (read or write) one access:
lru, fifo, lfu (in-cache counts) and s3fifo (S3-FIFO as libCacheSim's S3FIFO: small FIFO of
10%, main FIFO of 90% with reinsertion, ghost of 90%, to main after 2 hits) write every missed
block into the cache; larc (LARC) writes a block only on a miss that finds it in its adaptive
ghost queue of recent misses. Their cache bytes written are 4 KiB per block written.

Output per policy: read hit ratio (4 KiB pages of reads, RAM and flash), hit ratio of all
block accesses (reference policies, comparable to libCacheSim), warm-up seconds (until the
interval read hit ratio first reaches 90% of its final value), cache bytes written (and per
request), source bytes, modelled mean/p99 read and write latency at the flash layer (a RAM
hit costs nothing), source and cache device utilization (busy time per channel over the
replay's duration: open loop the trace's span, closed loop until the last request completes;
the most loaded host's; above 1 in an open-loop replay, a warning says the latencies are
queueing), metadata bytes (engine: allocated when the core is built; reference: its
structures at the end), and with --hosts the invalidations per write. JSON adds per interval
the cache bytes written (interval_cache_bytes_written, parallel to intervals); --plot draws
them, cumulated, under the hit ratio.";

/// The result of one policy.
#[derive(Serialize, Debug, Default)]
pub struct PolicyResult {
    /// Policy name.
    pub policy: String,
    /// Read pages hit (RAM or flash) over read pages.
    pub read_hit_ratio: f64,
    /// Block accesses hit over block accesses at the flash layer (reference policies).
    pub hit_ratio: Option<f64>,
    /// Block misses over block accesses at the flash layer (reference policies).
    pub miss_ratio: Option<f64>,
    /// Block accesses at the flash layer (reference policies).
    pub accesses: Option<u64>,
    /// Read pages served by the RAM cache over read pages (with --ram-size).
    pub ram_hit_ratio: Option<f64>,
    /// Read pages served by flash over the read pages that reach it (with --ram-size).
    pub flash_hit_ratio: Option<f64>,
    /// Trace seconds until the interval read hit ratio first reached 90% of its final value.
    pub warmup_seconds: Option<f64>,
    /// Bytes written to the cache devices (engine policies).
    pub cache_bytes_written: Option<u64>,
    /// Bytes written to the cache devices per trace request.
    pub cache_bytes_written_per_request: Option<f64>,
    /// Bytes read from the source.
    pub source_bytes_read: Option<u64>,
    /// Bytes written to the source.
    pub source_bytes_written: Option<u64>,
    /// Modelled mean read latency at the flash layer, seconds (engine policies).
    pub mean_read_latency: Option<f64>,
    /// Modelled p99 read latency at the flash layer, seconds (all hosts).
    pub p99_read_latency: Option<f64>,
    /// Modelled mean write latency at the flash layer, until acknowledged, seconds.
    pub mean_write_latency: Option<f64>,
    /// Modelled p99 write latency at the flash layer, seconds (all hosts).
    pub p99_write_latency: Option<f64>,
    /// Busy time of the source model (service time per channel) over the duration of the
    /// replay; the most loaded host's. Null if infinite (work in a zero-length replay).
    pub source_utilization: Option<f64>,
    /// The same for the cache device model.
    pub cache_utilization: Option<f64>,
    /// A device model's utilization is above 1 under open-loop replay: the trace offers more
    /// than the model sustains, and the latencies are mostly queueing.
    pub overloaded: bool,
    /// Fragments populated (engine policies).
    pub fragments_populated: Option<u64>,
    /// Metadata bytes of one host's flash cache: for the engine, counted by the allocator
    /// when the core is built; for the reference policies, their structures at the end.
    pub metadata_bytes: u64,
    /// Write requests.
    pub writes: u64,
    /// Other hosts' caches holding a copy, per write (with --hosts).
    pub invalidations_per_write: Option<f64>,
    /// Fraction of writes that invalidated a copy on another host (Holland's Figure 4).
    pub writes_invalidating: Option<f64>,
    /// Seconds this policy took to simulate (including parsing the trace).
    pub seconds: f64,
    /// Trace requests per second of simulation.
    pub requests_per_second: f64,
    /// Block accesses per second (reference policies).
    pub accesses_per_second: Option<f64>,
    /// Warm-up curve: (trace seconds, interval read hit ratio; null if no read).
    pub intervals: Vec<(f64, Option<f64>)>,
    /// Cache bytes written in each interval of `intervals` (engine: its cache writes,
    /// reference: 4 KiB per block inserted).
    pub interval_cache_bytes_written: Vec<u64>,
}

#[derive(Clone)]
enum Kind {
    Reference(ReferencePolicy),
    Engine(CoreConfig),
}

fn policy(p: &str, a: &SimArgs) -> Result<Kind> {
    let engine = |admission| {
        let mut cfg = CoreConfig {
            fragment_size: a.fragment_size,
            admission,
            write_mode: a.mode,
            ..CoreConfig::default()
        };
        a.admission_opts.apply(&mut cfg, a.cache_size);
        cfg
    };
    Ok(match p {
        "lru" => Kind::Reference(ReferencePolicy::Lru),
        "fifo" => Kind::Reference(ReferencePolicy::Fifo),
        "lfu" => Kind::Reference(ReferencePolicy::Lfu),
        "s3fifo" => Kind::Reference(ReferencePolicy::S3Fifo),
        "larc" => Kind::Reference(ReferencePolicy::Larc),
        "sce" => Kind::Engine(engine(Admission::Sce)),
        "sce-paper" => Kind::Engine(engine(Admission::ScePaper)),
        "always" => Kind::Engine(engine(Admission::Always)),
        "flashcache-like" => Kind::Engine({
            // The baseline as it is, but under the same endurance budget if one is set.
            let mut cfg = CoreConfig::flashcache_like();
            cfg.max_cache_writes = engine(Admission::Always).max_cache_writes;
            cfg
        }),
        _ => match p.parse::<Admission>() {
            Ok(adm @ Admission::NHit(_)) => Kind::Engine(engine(adm)),
            _ => {
                bail!(
                    "unknown policy {p:?} (sce, flashcache-like, always, nhit:K, lru, fifo, lfu, \
                     s3fifo, larc)"
                )
            }
        },
    })
}

/// Parses `ssd=MODEL,source=MODEL` (either may be left out).
pub fn parse_device_models(s: &str) -> Result<(DeviceModel, DeviceModel), String> {
    let (mut ssd, mut source) = (DeviceModel::mercury_ssd(), DeviceModel::disk());
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("device model {part:?}: expected ssd=MODEL or source=MODEL"))?;
        let m = match v {
            "mercury-ssd" => DeviceModel::mercury_ssd(),
            "disk" => DeviceModel::disk(),
            _ => {
                let f: Vec<&str> = v.split('/').collect();
                if f.len() != 5 {
                    return Err(format!(
                        "device model {v:?}: expected mercury-ssd, disk or \
                         READ_LAT/WRITE_LAT/READ_BW/WRITE_BW/CHANNELS (240us/225us/110MB/39MB/8)"
                    ));
                }
                let lat = |x: &str| parse_duration(x).map(|d| d.as_nanos() as u64);
                let bw = |x: &str| {
                    parse_size(x).and_then(|b| {
                        if b == 0 {
                            Err(format!("bandwidth {x:?} must be > 0"))
                        } else {
                            Ok(b)
                        }
                    })
                };
                let channels: usize = f[4]
                    .parse()
                    .ok()
                    .filter(|&c| c > 0 && c <= 4096)
                    .ok_or_else(|| format!("channels {:?}: expected 1..=4096", f[4]))?;
                DeviceModel {
                    read_ns: lat(f[0])?,
                    write_ns: lat(f[1])?,
                    read_bw: bw(f[2])?,
                    write_bw: bw(f[3])?,
                    channels,
                }
            }
        };
        match k {
            "ssd" | "cache" => ssd = m,
            "source" => source = m,
            _ => {
                return Err(format!(
                    "device model {part:?}: unknown device {k:?} (ssd, source)"
                ))
            }
        }
    }
    Ok((ssd, source))
}

/// What the first pass learns about the trace.
struct Survey {
    layout: VolumeLayout,
    requests: u64,
    skipped: u64,
    /// Requests whose time is earlier than the request before them.
    backwards: u64,
    /// The most a request's time is earlier than an earlier request's, nanoseconds.
    max_lag: u64,
    /// Earliest and latest request time.
    times: Option<(u64, u64)>,
}

/// The queue depth of the closed-loop replay of traces without usable timestamps.
const DEFAULT_QUEUE_DEPTH: u32 = 32;

impl Survey {
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
    fn replay(&self, asked: Option<Replay>) -> (Replay, String) {
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

fn survey(a: &SimArgs) -> Result<Survey> {
    let mut layout = VolumeLayout::new(64 << 20);
    let mut reader = TraceReader::open(&a.trace, a.format.clone(), a.skip_bad)?;
    let mut requests = 0;
    let mut backwards = 0;
    let mut max_lag = 0;
    let mut times: Option<(u64, u64)> = None;
    let mut previous = None;
    while let Some(r) = reader.next_request()? {
        if a.reads_only && r.kind != IoKind::Read {
            continue;
        }
        requests += 1;
        backwards += previous.is_some_and(|p| r.time_ns < p) as u64;
        previous = Some(r.time_ns);
        if let Some((_, latest)) = times {
            max_lag = max_lag.max(latest.saturating_sub(r.time_ns));
        }
        times = Some(times.map_or((r.time_ns, r.time_ns), |(lo, hi)| {
            (lo.min(r.time_ns), hi.max(r.time_ns))
        }));
        let vol = if a.hosts > 1 { 0 } else { r.volume };
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

struct Job<'a> {
    name: String,
    kind: Kind,
    args: &'a SimArgs,
    devices: &'a (DeviceModel, DeviceModel),
    layout: &'a VolumeLayout,
    replay: Replay,
    progress: &'a AtomicU64,
}

fn build_stack(job: &Job) -> Result<Stack> {
    let a = job.args;
    let mut hosts = Vec::new();
    for _ in 0..a.hosts.max(1) {
        let flash = match &job.kind {
            Kind::Reference(p) => Flash::Reference(Box::new(BlockCache::new(
                *p,
                (a.cache_size / 4096) as usize,
            ))),
            Kind::Engine(cfg) => Flash::Engine(Box::new(EngineSim::new(
                cfg.clone(),
                job.layout.size(),
                a.cache_size,
                job.devices.0.clone(),
                job.devices.1.clone(),
                a.interval,
            )?)),
        };
        let ram = a.ram_size.map(|s| RamCache::new(s, a.ram_policy));
        hosts
            .push(Host::new(flash, ram).with_devices(job.devices.0.clone(), job.devices.1.clone()));
    }
    Ok(Stack::new(hosts, a.interval).with_replay(job.replay))
}

fn run(job: &Job) -> Result<(StackResult, f64)> {
    let a = job.args;
    let t0 = Instant::now();
    let mut stack = build_stack(job)?;
    let mut reader = TraceReader::open(&a.trace, a.format.clone(), a.skip_bad)?;
    let mut n = 0u64;
    while let Some(r) = reader.next_request()? {
        if a.reads_only && r.kind != IoKind::Read {
            continue;
        }
        let (host, vol) = if a.hosts > 1 {
            (r.volume as usize, 0)
        } else {
            (0, r.volume)
        };
        let Some(off) = job.layout.place(vol, r.offset) else {
            bail!("the trace changed between the two passes (volume {vol})");
        };
        stack.request(host, r.time_ns, r.kind, off, r.len);
        n += 1;
        if n.is_multiple_of(4096) {
            job.progress.fetch_add(4096, Relaxed);
        }
    }
    job.progress.fetch_add(n % 4096, Relaxed);
    Ok((stack.finish(), t0.elapsed().as_secs_f64()))
}

fn aggregate_engines(es: &[EngineResult]) -> EngineResult {
    let mut out = EngineResult::default();
    for e in es {
        out.cache_bytes_written += e.cache_bytes_written;
        out.source_bytes_read += e.source_bytes_read;
        out.source_bytes_written += e.source_bytes_written;
        out.requests += e.requests;
        out.fragments_populated += e.fragments_populated;
        out.fragments_evicted += e.fragments_evicted;
    }
    out
}

/// Metadata of an engine policy's core, counted by the allocator as it is built.
fn engine_metadata_bytes(cfg: &CoreConfig, a: &SimArgs, source_size: u64) -> Result<u64> {
    let before = live_bytes();
    let core = CacheCore::new(cfg.clone(), source_size, a.cache_size)?;
    let bytes = live_bytes().saturating_sub(before);
    drop(core);
    Ok(bytes as u64)
}

fn progress_bar(done: &AtomicBool, progress: &AtomicU64, total: u64) {
    let t0 = Instant::now();
    let mut err = std::io::stderr();
    while !done.load(Relaxed) {
        std::thread::sleep(Duration::from_millis(250));
        let p = progress.load(Relaxed).min(total);
        let frac = p as f64 / total.max(1) as f64;
        let width = 30;
        let filled = (frac * width as f64) as usize;
        let _ = write!(
            err,
            "\r[{}{}] {:5.1}% {:.0}s ",
            "#".repeat(filled),
            " ".repeat(width - filled),
            frac * 100.0,
            t0.elapsed().as_secs_f64()
        );
        let _ = err.flush();
    }
    let _ = write!(err, "\r{}\r", " ".repeat(50));
    let _ = err.flush();
}

/// Runs the simulation.
pub fn sim(a: SimArgs) -> Result<()> {
    let mut kinds = Vec::new();
    for p in &a.policy {
        kinds.push((p.clone(), policy(p, &a)?));
    }
    if a.cache_size < 4096 {
        bail!(
            "invalid --cache-size {}: smaller than one 4 KiB block",
            a.cache_size
        );
    }
    if a.hosts == 0 {
        bail!("invalid --hosts 0: at least one host");
    }
    if kinds.iter().any(|(_, k)| matches!(k, Kind::Reference(_)))
        && a.cache_size / 4096 > BlockCache::MAX_BLOCKS as u64
    {
        bail!(
            "invalid --cache-size {}: the reference policies hold at most {} blocks of 4 KiB",
            format_size(a.cache_size),
            BlockCache::MAX_BLOCKS
        );
    }
    if !(a.interval.is_finite() && a.interval > 0.0) {
        bail!("invalid --interval {}: must be > 0 seconds", a.interval);
    }
    for (name, k) in &kinds {
        if let Kind::Engine(cfg) = k {
            let slots = a.cache_size / cfg.fragment_size.max(1);
            if slots > MAX_ENGINE_SLOTS {
                bail!(
                    "invalid --cache-size {} for {name}: {slots} fragments of {} (the simulator \
                     takes at most {MAX_ENGINE_SLOTS}; use a larger --fragment-size)",
                    format_size(a.cache_size),
                    format_size(cfg.fragment_size)
                );
            }
        }
    }
    let devices = parse_device_models(&a.device_model)
        .map_err(|e| anyhow::anyhow!("invalid --device-model: {e}"))?;
    let s = survey(&a)?;
    let (replay, replay_why) = s.replay(a.replay);
    let mut metadata = Vec::new();
    for (_, k) in &kinds {
        metadata.push(match k {
            Kind::Engine(cfg) => Some(engine_metadata_bytes(cfg, &a, s.layout.size())?),
            // Reference caches grow with what they hold: measured at the end of the run.
            Kind::Reference(_) => None,
        });
    }
    let progress = AtomicU64::new(0);
    let jobs: Vec<Job> = kinds
        .iter()
        .map(|(n, k)| Job {
            name: n.clone(),
            kind: k.clone(),
            args: &a,
            devices: &devices,
            layout: &s.layout,
            replay,
            progress: &progress,
        })
        .collect();
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, jobs.len().max(1));
    let next = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    let show_progress = std::io::stderr().is_terminal() && !a.json;
    let mut outcomes: Vec<Option<Result<(StackResult, f64)>>> =
        (0..jobs.len()).map(|_| None).collect();
    std::thread::scope(|sc| {
        if show_progress {
            let total = s.requests * jobs.len() as u64;
            let (done, progress) = (&done, &progress);
            sc.spawn(move || progress_bar(done, progress, total));
        }
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Relaxed);
                        let Some(job) = jobs.get(i) else { break };
                        mine.push((i, run(job)));
                    }
                    mine
                })
            })
            .collect();
        for w in workers {
            match w.join() {
                Ok(v) => {
                    for (i, r) in v {
                        outcomes[i] = Some(r);
                    }
                }
                Err(_) => {
                    done.store(true, Relaxed);
                    outcomes.push(Some(Err(anyhow::anyhow!("a simulation thread panicked"))));
                }
            }
        }
        done.store(true, Relaxed);
    });
    let mut results = Vec::new();
    for (i, o) in outcomes.into_iter().enumerate() {
        let name = jobs.get(i).map_or("?", |j| j.name.as_str());
        let (r, secs) = o
            .context("a policy was not simulated")?
            .with_context(|| format!("policy {name}"))?;
        results.push(result(name, &r, secs, metadata[i], &a, s.requests));
    }
    if let Some(p) = &a.plot {
        std::fs::write(p, plot_svg(&results, &a, replay))
            .with_context(|| format!("writing the plot {}", p.display()))?;
    }
    let warnings: Vec<String> = results.iter().filter_map(overload_warning).collect();
    if a.json {
        let v = serde_json::json!({
            "trace": a.trace, "format": a.format.to_string(), "cache_size": a.cache_size,
            "reads_only": a.reads_only, "requests": s.requests, "skipped": s.skipped,
            "volumes": s.layout.volumes(), "source_size": s.layout.size(), "hosts": a.hosts,
            "ram_size": a.ram_size, "ram_policy": a.ram_size.map(|_| format!("{:?}", a.ram_policy)),
            "ssd_model": format!("{:?}", devices.0), "source_model": format!("{:?}", devices.1),
            "threads": threads, "replay": replay.to_string(), "replay_reason": replay_why,
            "warnings": warnings, "policies": results,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print_table(&a, &s, &results, (replay, &replay_why), &warnings);
    Ok(())
}

/// The warning line of a policy whose device models the trace overloads in an open-loop
/// replay.
fn overload_warning(r: &PolicyResult) -> Option<String> {
    if !r.overloaded {
        return None;
    }
    let over: Vec<(&str, f64)> = [
        ("source", r.source_utilization),
        ("cache device", r.cache_utilization),
    ]
    .into_iter()
    .filter_map(|(name, u)| u.filter(|u| *u > 1.0).map(|u| (name, u)))
    .collect();
    let names: Vec<&str> = over.iter().map(|x| x.0).collect();
    let utils: Vec<String> = over.iter().map(|x| format!("{:.1}", x.1)).collect();
    Some(format!(
        "warning: {}: the {} model{} overloaded by the trace's timestamps (utilization {}): \
         latencies are queueing; consider --replay closed:QD",
        r.policy,
        names.join(" and "),
        if over.len() > 1 { "s are" } else { " is" },
        utils.join(" and "),
    ))
}

fn result(
    name: &str,
    r: &StackResult,
    secs: f64,
    metadata: Option<u64>,
    a: &SimArgs,
    requests: u64,
) -> PolicyResult {
    let mut out = PolicyResult {
        policy: name.to_string(),
        read_hit_ratio: r.read_hit_ratio(),
        warmup_seconds: r.warmup_seconds,
        metadata_bytes: metadata.unwrap_or(r.reference_bytes),
        writes: r.writes,
        seconds: secs,
        requests_per_second: requests as f64 / secs.max(1e-9),
        intervals: r
            .intervals
            .iter()
            .map(|&(t, h)| (t, (!h.is_nan()).then_some(h)))
            .collect(),
        ..PolicyResult::default()
    };
    if a.ram_size.is_some() {
        out.ram_hit_ratio = Some(r.ram_hit_ratio());
        out.flash_hit_ratio = Some(r.flash_hit_ratio());
    }
    // Modelled latencies and load: every policy runs over the device models.
    let (rl, wl) = (&r.read_latency, &r.write_latency);
    if rl.count() > 0 {
        out.mean_read_latency = Some(rl.mean());
        out.p99_read_latency = Some(rl.quantile(0.99));
    }
    if wl.count() > 0 {
        out.mean_write_latency = Some(wl.mean());
        out.p99_write_latency = Some(wl.quantile(0.99));
    }
    out.source_utilization = Some(r.source_utilization);
    out.cache_utilization = Some(r.cache_utilization);
    out.overloaded =
        r.replay == Replay::Open && (r.source_utilization > 1.0 || r.cache_utilization > 1.0);
    out.interval_cache_bytes_written = r.interval_cache_bytes.clone();
    if a.hosts > 1 {
        out.invalidations_per_write = Some(r.invalidations_per_write());
        out.writes_invalidating = Some(r.writes_invalidating as f64 / r.writes.max(1) as f64);
    }
    if let Some((acc, miss)) = r.reference {
        let m = if acc == 0 {
            0.0
        } else {
            miss as f64 / acc as f64
        };
        out.hit_ratio = Some(1.0 - m);
        out.miss_ratio = Some(m);
        out.accesses = Some(acc);
        out.accesses_per_second = Some(acc as f64 / secs.max(1e-9));
        // 4 KiB per block inserted, every interval's (LARC inserts only what it admits).
        let written: u64 = r.interval_cache_bytes.iter().sum();
        out.cache_bytes_written = Some(written);
        out.cache_bytes_written_per_request = Some(written as f64 / requests.max(1) as f64);
    }
    if !r.engines.is_empty() {
        let e = aggregate_engines(&r.engines);
        out.cache_bytes_written = Some(e.cache_bytes_written);
        out.cache_bytes_written_per_request =
            Some(e.cache_bytes_written as f64 / requests.max(1) as f64);
        out.source_bytes_read = Some(e.source_bytes_read);
        out.source_bytes_written = Some(e.source_bytes_written);
        out.fragments_populated = Some(e.fragments_populated);
    }
    out
}

fn print_table(
    a: &SimArgs,
    s: &Survey,
    results: &[PolicyResult],
    replay: (Replay, &str),
    warnings: &[String],
) {
    println!(
        "{}: {} requests{}, {} volume(s), cache {}{}{}{}",
        a.trace.display(),
        s.requests,
        if s.skipped > 0 {
            format!(" ({} malformed skipped)", s.skipped)
        } else {
            String::new()
        },
        s.layout.volumes(),
        format_size(a.cache_size),
        if a.reads_only { ", reads only" } else { "" },
        a.ram_size.map_or(String::new(), |r| format!(
            ", RAM {} {:?}",
            format_size(r),
            a.ram_policy
        )),
        if a.hosts > 1 {
            format!(", {} hosts", a.hosts)
        } else {
            String::new()
        },
    );
    println!("replay: {} ({})", replay.0, replay.1);
    let f = |x: Option<f64>, p: usize| x.map_or("-".to_string(), |v| format!("{v:.p$}"));
    println!(
        "{:<16} {:>8} {:>8} {:>9} {:>10} {:>10} {:>10} {:>9} {:>10} {:>9} {:>6} {:>6} {:>10} {:>7}",
        "policy",
        "read hit",
        "hit",
        "warm-up s",
        "cache wr",
        "wr/req KiB",
        "rd mean ms",
        "rd p99 ms",
        "wr mean ms",
        "wr p99 ms",
        "src %",
        "ssd %",
        "metadata",
        "sim s"
    );
    for r in results {
        println!(
            "{:<16} {:>8.4} {:>8} {:>9} {:>10} {:>10} {:>10} {:>9} {:>10} {:>9} {:>6} {:>6} {:>10} {:>7.1}",
            r.policy,
            r.read_hit_ratio,
            f(r.hit_ratio, 4),
            f(r.warmup_seconds, 0),
            r.cache_bytes_written.map_or("-".into(), format_size),
            f(r.cache_bytes_written_per_request.map(|b| b / 1024.0), 1),
            f(r.mean_read_latency.map(|s| s * 1e3), 3),
            f(r.p99_read_latency.map(|s| s * 1e3), 3),
            f(r.mean_write_latency.map(|s| s * 1e3), 3),
            f(r.p99_write_latency.map(|s| s * 1e3), 3),
            f(r.source_utilization.map(|u| u * 100.0), 0),
            f(r.cache_utilization.map(|u| u * 100.0), 0),
            format_size(r.metadata_bytes),
            r.seconds,
        );
    }
    for w in warnings {
        println!("{w}");
    }
    for r in results {
        if let (Some(h1), Some(h2)) = (r.ram_hit_ratio, r.flash_hit_ratio) {
            println!(
                "{}: RAM hit ratio h1 {h1:.4}, flash hit ratio on RAM misses h2 {h2:.4}",
                r.policy
            );
        }
        if let (Some(ipw), Some(wi)) = (r.invalidations_per_write, r.writes_invalidating) {
            println!(
                "{}: {} writes, {:.1}% invalidated another host's copy, {ipw:.3} invalidations per write",
                r.policy,
                r.writes,
                wi * 100.0
            );
        }
        if let Some(aps) = r.accesses_per_second {
            println!(
                "{}: {:.2} M block accesses/s (parsing included, one thread)",
                r.policy,
                aps / 1e6
            );
        }
    }
}

/// An SVG plot of two panels over the replay's time, one line per policy: the interval read
/// hit ratio above, the cumulative bytes written to the cache device below.
pub fn plot_svg(results: &[PolicyResult], a: &SimArgs, replay: Replay) -> String {
    const W: f64 = 800.0;
    const L: f64 = 80.0;
    const R: f64 = 170.0;
    const T: f64 = 40.0;
    // Height of a panel, and the gap between them (for the upper one's time labels).
    const P: f64 = 300.0;
    const GAP: f64 = 60.0;
    const T2: f64 = T + P + GAP;
    const H: f64 = T2 + P + 50.0;
    const COLOURS: [&str; 8] = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    ];
    let tmax = results
        .iter()
        .flat_map(|r| r.intervals.iter().map(|x| x.0))
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let bmax = results
        .iter()
        .map(|r| r.interval_cache_bytes_written.iter().sum::<u64>())
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let x = |t: f64| L + t / tmax * (W - L - R);
    let y = |h: f64| T + (1.0 - h) * P;
    let y2 = |b: f64| T2 + (1.0 - b / bmax) * P;
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">{} \u{2014} cache {} \u{2014} replay {replay}</text>\n",
        (W - R + L) / 2.0,
        esc(&a.trace.file_name().map_or(String::new(), |f| f.to_string_lossy().into_owned())),
        format_size(a.cache_size)
    );
    // Grid lines and value labels of both panels.
    for i in 0..=10 {
        let h = i as f64 / 10.0;
        s += &format!(
            "<line x1=\"{L}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{h:.1}</text>\n",
            W - R,
            L - 6.0,
            y(h) + 4.0,
            y = y(h)
        );
    }
    for i in 0..=5 {
        let b = bmax * i as f64 / 5.0;
        s += &format!(
            "<line x1=\"{L}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            W - R,
            L - 6.0,
            y2(b) + 4.0,
            if i == 0 {
                "0".to_string()
            } else {
                format_size(b as u64)
            },
            y = y2(b)
        );
    }
    let time = if replay == Replay::Open {
        "trace time (s)".to_string()
    } else {
        format!("virtual time (s), replay {replay}")
    };
    for (top, title) in [
        (T, format!("read hit ratio per {} s interval", a.interval)),
        (T2, "cache bytes written, cumulative".to_string()),
    ] {
        let bottom = top + P;
        for i in 0..=5 {
            let t = tmax * i as f64 / 5.0;
            s += &format!(
                "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{:.0}</text>\n",
                x(t),
                bottom + 18.0,
                t
            );
        }
        let mid = top + P / 2.0;
        s += &format!(
            "<line x1=\"{L}\" x2=\"{L}\" y1=\"{top}\" y2=\"{bottom}\" stroke=\"black\"/>\
             <line x1=\"{L}\" x2=\"{}\" y1=\"{bottom}\" y2=\"{bottom}\" stroke=\"black\"/>\n\
             <text x=\"16\" y=\"{mid}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {mid})\">{title}</text>\n",
            W - R,
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
        (W - R + L) / 2.0,
        H - 12.0,
        esc(&time)
    );
    for (i, r) in results.iter().enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        // A gap (an interval with no read) breaks the line.
        let mut segs: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
        for &(t, h) in &r.intervals {
            match h {
                Some(h) => segs.last_mut().expect("one").push((x(t), y(h))),
                None => segs.push(Vec::new()),
            }
        }
        // Bytes written accumulate from zero at time zero.
        let mut total = 0u64;
        let mut written = vec![(x(0.0), y2(0.0))];
        for (&(t, _), &b) in r.intervals.iter().zip(&r.interval_cache_bytes_written) {
            total += b;
            written.push((x(t), y2(total as f64)));
        }
        segs.push(written);
        for seg in segs.iter().filter(|s| !s.is_empty()) {
            let pts: Vec<String> = seg.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
            s += &format!(
                "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
                pts.join(" ")
            );
        }
        for (top, label) in [
            (T, format!("{:.3}", r.read_hit_ratio)),
            (T2, format_size(total)),
        ] {
            let ly = top + 10.0 + 20.0 * i as f64;
            s += &format!(
                "<line x1=\"{}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{c}\" stroke-width=\"3\"/>\
                 <text x=\"{}\" y=\"{}\">{} ({label})</text>\n",
                W - R + 10.0,
                W - R + 30.0,
                W - R + 36.0,
                ly + 4.0,
                esc(&r.policy),
            );
        }
    }
    s += "</svg>\n";
    s
}
