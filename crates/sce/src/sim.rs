//! `sce sim`: trace-driven simulation. The simulation itself ([`sce_sim::run`]: the survey
//! of the trace, every policy in its own thread, what each comes to) and its plot
//! ([`sce_sim::plot`]) live in the library; this module turns the arguments into a
//! [`SimConfig`], shows the progress, and prints the results as a table or JSON.

use crate::alloc::{counting, live_bytes};
use crate::units::{format_size, parse_size};
use anyhow::{bail, Context, Result};
use sce_core::{Admission, CoreConfig, EvictionKind, WriteMode};
use sce_sim::layers::{Ownership, RamPolicy, Replay};
use sce_sim::plot::plot_svg;
use sce_sim::run::{
    overload_warning, parse_device_models, PolicyKind, PolicyResult, SimConfig, Simulation,
};
use sce_sim::{FormatChoice, ReferencePolicy, TraceFormat};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Options of `sce sim`.
#[derive(clap::Args, Debug)]
#[command(after_long_help = SIM_HELP)]
pub struct SimArgs {
    /// The trace file (gzip, bzip2 and xz are read directly).
    #[arg(long)]
    pub trace: PathBuf,
    /// Its format: auto (recognised from the file), vscsi, msr, systor, tencent, disksim,
    /// sce, csv or csv:SPEC (see below).
    #[arg(long, default_value = "auto")]
    pub format: FormatChoice,
    /// Cache size (4 KiB blocks of it for the reference policies).
    #[arg(long, value_parser = parse_size)]
    pub cache_size: u64,
    /// Policies to run side by side (repeatable or comma-separated): the engine's sce,
    /// sce-paper (the paper's Algorithm 1 as written), always, nhit:K, flashcache-like,
    /// flashcache-4k (flashcache-like with misaligned requests widened to whole pages, so
    /// that it caches them); the reference lru, fifo, lfu, s3fifo, larc.
    #[arg(long, value_delimiter = ',', default_value = "sce")]
    pub policy: Vec<String>,
    /// Fragment size of the engine policies (flashcache-like always uses 4KiB).
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    pub fragment_size: u64,
    /// Line size of the engine policies: the unit of cache space and of filling inside a
    /// fragment, whose heat decides what is populated (a power of two from fragment/64 to
    /// it) [default: 512KiB for sce with 1MiB fragments, as serve; else the fragment size].
    #[arg(long, value_parser = parse_size)]
    pub line_size: Option<u64>,
    /// Cache mode of the engine policies: writethrough (asynchronous), writethrough-sync,
    /// writearound, passthrough or writeback (as `sce serve`'s, on its log state: a log of
    /// --writeback-log bytes of the cache, cleaned oldest first in runs of up to 1 MiB; JSON
    /// adds bytes_written_back, writeback_source_writes, writeback_waits and the log in use
    /// per interval). flashcache-like always uses writethrough-sync.
    #[arg(long, default_value = "writethrough")]
    pub mode: WriteMode,
    #[command(flatten)]
    pub writeback: crate::policy_args::WritebackSimArgs,
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
    /// each host has its own caches, and writes invalidate the others' copies as
    /// `sce serve --shared` does (see --ownership).
    #[arg(long, default_value_t = 1, help_heading = SHARED)]
    pub hosts: u32,
    /// Shared mode's coherence: on, ownership of regions (a host's writes to a region it
    /// owns need no etcd operation; see below), or off, every write published and
    /// acknowledged by every other host (the rule before ownership). Given with --hosts 1,
    /// the etcd figures are reported for one host in shared mode. [default: on]
    #[arg(long, value_name = "on|off", value_parser = crate::policy_args::parse_on_off, help_heading = SHARED)]
    pub ownership: Option<bool>,
    /// Bytes per region of --ownership on.
    #[arg(long, default_value = "1GiB", value_parser = parse_size, help_heading = SHARED)]
    pub region_size: u64,
    /// Virtual seconds without a write after which the owner of a region releases it, and
    /// for which a region written by two hosts counts as contended (default: the server's).
    #[arg(long, default_value_t = Ownership::DEFAULT_IDLE_SECS, value_name = "SECONDS", help_heading = SHARED)]
    pub ownership_idle: f64,
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
    /// Shards of the engine policies' core, as the server's core_shards setting: 0 (the
    /// default) is the server's automatic choice (up to 4 shards of at least 64 slots
    /// each), so that the results say what the server does; 1 is one unsharded core.
    #[arg(long, default_value_t = 0)]
    pub core_shards: usize,
    /// Eviction of every engine policy, flashcache-like included: clock (generalized CLOCK,
    /// sce's default), lru (flashcache-like's default) or fifo, e.g. to check Mercury's
    /// finding that FIFO does about as well as CLOCK. [default: each policy's own]
    #[arg(long, value_name = "clock|lru|fifo")]
    pub eviction: Option<EvictionKind>,
    /// Options of admission sce (and the endurance budget of every engine policy).
    #[command(flatten)]
    pub admission_opts: crate::policy_args::AdmissionArgs,
}

/// The help heading of the options of shared mode.
const SHARED: &str = "Shared mode (several hosts)";

const SIM_HELP: &str = "\
Formats: auto (the default) recognises vscsi, msr, systor, tencent, disksim, sce and sce's own
csv from the file's first bytes and lines (after decompression).

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
ghost queue of recent misses. Their cache bytes written are 4 KiB per block written: each
block inserted, and each block a write finds cached (its copy is rewritten).

Output per policy: read hit ratio (4 KiB pages of reads, RAM and flash), hit ratio of all
block accesses (reference policies, comparable to libCacheSim), warm-up seconds (until the
interval read hit ratio first reaches 90% of its final value), cache bytes written (and per
request), source bytes, modelled mean/p99 read and write latency at the flash layer (a RAM
hit costs nothing), source and cache device utilization (busy time per channel over the
replay's duration: open loop the trace's span, closed loop until the last request completes;
the most loaded host's; above 1 in an open-loop replay, a warning says the latencies are
queueing), metadata bytes (engine: allocated when the core is built, counted by the allocator;
reference: its structures at the end), and with
--hosts the invalidations per write and the etcd operations of shared mode (below). JSON keys carry their units (cache_size_bytes, mean_read_latency_seconds, wall_seconds, ...; ratios are plain);
`intervals` holds [end of the interval in seconds, read hit ratio or null]. JSON adds per interval
the cache bytes written (interval_cache_bytes_written, parallel to intervals); --plot draws
them, cumulated, under the hit ratio.

Shared mode (--hosts N, the volume field of the trace the host id): the rule of `sce serve
--shared`. With --ownership on (the default), the volume is cut into regions of --region-size
bytes, each with at most one owner host. A write by the owner costs no etcd operation (owned);
a write to a free region first acquires it: one transaction and one acknowledgement per other
host, which drop all they cache of the region. A write to a region another host owns is
contended: published, one publication and one acknowledgement per other host, which drop the
written range; the writer and every host that hears it count the region as contended for
--ownership-idle virtual seconds, and its owner releases it at once. A free region the writer
counts as contended is not acquired: the write is published the same way. So a region several
hosts write at once becomes nobody's, every write there published (the rule before
ownership), while a region one host writes stays its. After --ownership-idle virtual seconds
without a write from it, the owner releases its region. A release costs one delete and
(counted to be conservative) one acknowledgement per other host, which drop the region again.
A host reads a region another host owns from the source: no hit, no fill; a region nobody
owns every host caches. With --ownership off every write is published. Reported:
coherence_ops_per_write (all of these), coherence_puts_per_write (all but the deletes;
--ownership off: N), owned_writes, contended_writes (the published ones), region_acquisitions,
region_releases, contention_releases (of those, by an owner that heard another host's write),
read_pages_bypassed. The replay does not model the server's group commit: the figures are an
upper bound.

Examples:
  sce sim --trace ../shared/traces/msr-cambridge1-sample.csv --cache-size 64MiB \\
          --policy sce,flashcache-like,lru
  sce gen oltp --seed 7 --out /tmp/oltp.sce && \\
    sce sim --trace /tmp/oltp.sce --cache-size 256MiB --json";

/// Every policy `--policy` takes (`nhit:K` for any K): the engine's, then the reference
/// ones. The help texts name each (a test checks them against this list, and this list
/// against `policy`).
pub const POLICIES: [&str; 11] = [
    "sce",
    "sce-paper",
    "always",
    "nhit:K",
    "flashcache-like",
    "flashcache-4k",
    "lru",
    "fifo",
    "lfu",
    "s3fifo",
    "larc",
];

/// The policy named `p`, with the engine options of `a`.
fn policy(p: &str, a: &SimArgs) -> Result<PolicyKind> {
    if let Some(l) = a.line_size.filter(|&l| l > a.fragment_size) {
        let (l, f) = (format_size(l), format_size(a.fragment_size));
        bail!("invalid --line-size {l}: larger than --fragment-size {f} (a line is a part of one)");
    }
    let engine = |admission| {
        let mut cfg = CoreConfig {
            admission,
            write_mode: a.mode,
            ..CoreConfig::default()
        };
        a.writeback.apply(&mut cfg.writeback);
        // serve's default geometry unless sizes are given (1 MiB given counts as none)
        let fragment = (a.fragment_size != 1 << 20).then_some(a.fragment_size);
        sce_server::admission::geometry(&mut cfg, fragment, a.line_size);
        a.admission_opts.apply(&mut cfg, a.cache_size);
        if let Some(k) = a.eviction {
            cfg.eviction = k;
        }
        cfg
    };
    // The baseline as it is (`widen`: with misaligned requests widened to whole pages, so
    // that it caches them), but under the same endurance budget and eviction if set.
    let flashcache = |widen| {
        let mut cfg = CoreConfig::flashcache_like();
        let like = engine(Admission::Always);
        cfg.max_cache_writes = like.max_cache_writes;
        if a.eviction.is_some() {
            cfg.eviction = like.eviction;
        }
        cfg.widen_to_pages = widen;
        cfg
    };
    Ok(match p {
        "lru" => PolicyKind::Reference(ReferencePolicy::Lru),
        "fifo" => PolicyKind::Reference(ReferencePolicy::Fifo),
        "lfu" => PolicyKind::Reference(ReferencePolicy::Lfu),
        "s3fifo" => PolicyKind::Reference(ReferencePolicy::S3Fifo),
        "larc" => PolicyKind::Reference(ReferencePolicy::Larc),
        "sce" => PolicyKind::Engine(engine(Admission::Sce)),
        "sce-paper" => PolicyKind::Engine(engine(Admission::ScePaper)),
        "always" => PolicyKind::Engine(engine(Admission::Always)),
        "flashcache-like" => PolicyKind::Engine(flashcache(false)),
        "flashcache-4k" => PolicyKind::Engine(flashcache(true)),
        _ => match p.parse::<Admission>() {
            Ok(adm @ Admission::NHit(_)) => PolicyKind::Engine(engine(adm)),
            _ => {
                bail!("unknown policy {p:?} (one of: {})", POLICIES.join(", "))
            }
        },
    })
}

/// The library's configuration from the arguments (the policies parsed, the format
/// resolved, nothing else checked).
fn config(a: &SimArgs, format: TraceFormat) -> Result<SimConfig> {
    let mut policies = Vec::new();
    for p in &a.policy {
        policies.push((p.clone(), policy(p, a)?));
    }
    Ok(SimConfig {
        trace: a.trace.clone(),
        format,
        cache_size: a.cache_size,
        policies,
        interval: a.interval,
        reads_only: a.reads_only,
        skip_bad: a.skip_bad,
        hosts: a.hosts,
        ownership: match a.ownership {
            Some(false) => None,
            _ => Some(Ownership::new(a.region_size, a.ownership_idle).map_err(anyhow::Error::msg)?),
        },
        report_coherence: a.ownership.is_some(),
        ram_size: a.ram_size,
        ram_policy: a.ram_policy,
        replay: a.replay,
        threads: a.threads,
        core_shards: a.core_shards,
        writeback_log: a.writeback.log_sizes(a.mode, a.cache_size)?,
    })
}

/// Runs the simulation.
pub fn sim(a: SimArgs) -> Result<()> {
    let (format, detected) = a.format.resolve(&a.trace)?;
    let cfg = config(&a, format)?;
    cfg.check()?;
    let devices = parse_device_models(&a.device_model)
        .map_err(|e| anyhow::anyhow!("invalid --device-model: {e}"))?;
    let show_progress = std::io::stderr().is_terminal() && !a.json;
    let (surveyed, survey_done) = (AtomicU64::new(0), AtomicBool::new(false));
    let sim = std::thread::scope(|sc| {
        if show_progress {
            let (done, seen) = (&survey_done, &surveyed);
            sc.spawn(move || progress_bar("reading the trace", done, seen, None));
        }
        // The allocator counts while `prepare` measures the cores, not through the replays.
        let sim = counting(|| Simulation::prepare(cfg, devices, Some(live_bytes), &surveyed));
        survey_done.store(true, Relaxed);
        sim
    })?;
    let done = AtomicBool::new(false);
    let results = std::thread::scope(|sc| {
        if show_progress {
            let (done, sim) = (&done, &sim);
            let total = Some(sim.total_requests());
            sc.spawn(move || progress_bar("simulating", done, sim.progress(), total));
        }
        sim.run(&done)
    })?;
    let (replay, _) = sim.replay();
    if let Some(p) = &a.plot {
        std::fs::write(p, plot_svg(&results, sim.config(), replay))
            .with_context(|| format!("writing the plot {}", p.display()))?;
    }
    let warnings: Vec<String> = results.iter().filter_map(overload_warning).collect();
    if a.json {
        print_json(&a, detected, &sim, &results, &warnings)?;
        return Ok(());
    }
    print_table(&a, detected, &sim, &results, &warnings);
    Ok(())
}

/// Prints the results as one JSON document.
fn print_json(
    a: &SimArgs,
    detected: bool,
    sim: &Simulation,
    results: &[PolicyResult],
    warnings: &[String],
) -> Result<()> {
    let (s, devices, (replay, replay_why)) = (sim.survey(), sim.devices(), sim.replay());
    let v = serde_json::json!({
        "trace": a.trace, "format": sim.config().format.to_string(), "format_detected": detected,
        "cache_size_bytes": a.cache_size, "reads_only": a.reads_only, "requests": s.requests,
        "skipped": s.skipped, "volumes": s.layout.volumes(), "source_size_bytes": s.layout.size(),
        "hosts": a.hosts, "ownership": ownership_json(sim.config()), "ram_size_bytes": a.ram_size,
        "ram_policy": a.ram_size.map(|_| a.ram_policy.to_string()),
        "ssd_model": model_json(&devices.0), "source_model": model_json(&devices.1),
        "threads": sim.threads(), "replay": replay.to_string(), "replay_reason": replay_why,
        "interval_seconds": a.interval, "core_shards": a.core_shards,
        "eviction": a.eviction.map(|k| k.to_string()), "warnings": warnings,
        "policies": results,
    });
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// Shared mode's ownership as JSON: null if off (or not simulated: one host, not asked).
fn ownership_json(c: &SimConfig) -> serde_json::Value {
    match c.ownership {
        Some(o) if c.hosts > 1 || c.report_coherence => serde_json::json!({
            "region_size_bytes": o.region_size, "idle_seconds": o.idle_ns as f64 / 1e9,
        }),
        _ => serde_json::Value::Null,
    }
}

/// A device model as JSON, with units in its keys.
fn model_json(m: &sce_sim::DeviceModel) -> serde_json::Value {
    serde_json::json!({
        "read_latency_seconds": m.read_ns as f64 / 1e9,
        "write_latency_seconds": m.write_ns as f64 / 1e9,
        "read_bandwidth_bytes_per_second": m.read_bw,
        "write_bandwidth_bytes_per_second": m.write_bw,
        "channels": m.channels,
    })
}

/// Prints the results as a table, the warnings, and what some policies add.
fn print_table(
    a: &SimArgs,
    detected: bool,
    sim: &Simulation,
    results: &[PolicyResult],
    warnings: &[String],
) {
    print_heading(a, detected, sim);
    print_rows(results);
    for w in warnings {
        println!("{w}");
    }
    print_notes(results);
}

/// The trace, the cache, and the replay.
fn print_heading(a: &SimArgs, detected: bool, sim: &Simulation) {
    let s = sim.survey();
    let format = sim.config().format.to_string();
    println!(
        "{} ({format}{}): {} requests{}, {} volume(s), cache {}{}{}{}",
        a.trace.display(),
        if detected { ", detected" } else { "" },
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
            ", RAM {} {}",
            format_size(r),
            a.ram_policy
        )),
        shared_heading(sim.config()),
    );
    let (replay, why) = sim.replay();
    println!("replay: {replay} ({why})");
}

/// The hosts and their coherence rule, if shared mode is simulated.
fn shared_heading(c: &SimConfig) -> String {
    if c.hosts <= 1 && !c.report_coherence {
        return String::new();
    }
    let rule = match c.ownership {
        Some(o) => format!(
            "ownership of {} regions, released after {} s idle",
            format_size(o.region_size),
            o.idle_ns as f64 / 1e9
        ),
        None => "ownership off: every write published".into(),
    };
    format!(
        ", {} host{}, {rule}",
        c.hosts,
        if c.hosts > 1 { "s" } else { "" }
    )
}

/// One row per policy, under a header.
fn print_rows(results: &[PolicyResult]) {
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
            r.metadata_bytes.map_or("-".into(), format_size),
            r.seconds,
        );
    }
}

/// What some policies add: the RAM and flash hit ratios, the invalidations, the speed.
fn print_notes(results: &[PolicyResult]) {
    for r in results {
        if let (Some(h1), Some(h2)) = (r.ram_hit_ratio, r.flash_hit_ratio) {
            println!(
                "{}: RAM hit ratio h1 {h1:.4}, flash hit ratio on RAM misses h2 {h2:.4}",
                r.policy
            );
        }
        if let (Some(ipw), Some(wi)) = (r.invalidations_per_write, r.writes_invalidating) {
            println!(
                "{}: {} writes ({} owned, {} published), {:.1}% invalidated another host's copy, {ipw:.3} invalidations per write",
                r.policy,
                r.writes,
                r.owned_writes.unwrap_or(0),
                r.contended_writes.unwrap_or(0),
                wi * 100.0,
            );
            println!(
                "{}: {:.4} etcd ops per write ({:.4} puts; sce serve --shared, no group commit), {} region acquisitions, {} releases ({} on contention), {} read pages from the source (another host's region)",
                r.policy,
                r.coherence_ops_per_write.unwrap_or(0.0),
                r.coherence_puts_per_write.unwrap_or(0.0),
                r.region_acquisitions.unwrap_or(0),
                r.region_releases.unwrap_or(0),
                r.contention_releases.unwrap_or(0),
                r.read_pages_bypassed.unwrap_or(0),
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

/// A progress line on standard error (a terminal), from one second into a phase on, so
/// that short runs stay quiet: a bar with the percentage, elapsed time and an estimate of
/// the time left when the total is known, else a count of requests.
fn progress_bar(what: &str, done: &AtomicBool, progress: &AtomicU64, total: Option<u64>) {
    let t0 = Instant::now();
    let mut err = std::io::stderr();
    let mut drawn = false;
    while !done.load(Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
        let secs = t0.elapsed().as_secs_f64();
        if secs < 1.0 || done.load(Relaxed) {
            continue;
        }
        let p = progress.load(Relaxed);
        let line = match total {
            Some(total) => {
                let frac = (p.min(total) as f64 / total.max(1) as f64).clamp(0.0, 1.0);
                let width = 30;
                let filled = (frac * width as f64) as usize;
                let left = if frac > 0.01 {
                    format!(", about {:.0} s left", secs / frac - secs)
                } else {
                    String::new()
                };
                format!(
                    "{what} [{}{}] {:5.1}% {secs:.0} s{left}",
                    "#".repeat(filled),
                    " ".repeat(width - filled),
                    frac * 100.0,
                )
            }
            None => format!("{what}: {p} requests, {secs:.0} s"),
        };
        let _ = write!(err, "\r{line:<78}");
        let _ = err.flush();
        drawn = true;
    }
    if drawn {
        let _ = write!(err, "\r{}\r", " ".repeat(78));
        let _ = err.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: SimArgs,
    }

    /// Every name in POLICIES is one `policy` takes, and nothing else is.
    #[test]
    fn the_list_of_policies_is_what_policy_takes() {
        let a = Cli::parse_from(["sim", "--trace", "t", "--cache-size", "64MiB"]).a;
        for name in POLICIES {
            let name = name.replace(":K", ":2");
            assert!(policy(&name, &a).is_ok(), "{name} is listed but refused");
        }
        let err = policy("mru", &a).err().unwrap().to_string();
        assert!(err.contains(&POLICIES.join(", ")), "{err}");
    }
}
