//! `sce sim`: trace-driven simulation. The reference policies (`lru`, `fifo` over 4 KiB
//! blocks, every block access a lookup that inserts on a miss) stream the trace once
//! together. The engine policies (`sce`, `flashcache-like`, `always`, `nhit:K`) run the
//! sce-core state machine in virtual time over modelled devices, one thread and one streaming
//! pass each.

use crate::alloc::live_bytes;
use crate::units::{format_size, parse_size};
use anyhow::{bail, Result};
use sce_core::{Admission, CacheCore, CoreConfig, WriteMode};
use sce_sim::{
    BlockCache, DeviceModel, EngineSim, IoKind, ReferencePolicy, TraceFormat, TraceReader,
};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// Options of `sce sim`.
#[derive(clap::Args, Debug)]
pub struct SimArgs {
    /// The trace file (gzip is read directly).
    #[arg(long)]
    pub trace: PathBuf,
    /// Its format: vscsi, msr, systor, tencent or disksim.
    #[arg(long)]
    pub format: TraceFormat,
    /// Cache size (4 KiB blocks of it for the reference policies).
    #[arg(long, value_parser = parse_size)]
    pub cache_size: u64,
    /// Policies to run side by side (repeatable or comma-separated): the engine's sce,
    /// flashcache-like, always, nhit:K; the reference lru, fifo.
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
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// The result of one policy.
#[derive(Serialize, Debug, Default)]
pub struct PolicyResult {
    /// Policy name.
    pub policy: String,
    /// Read pages hit over read pages (engine policies).
    pub read_hit_ratio: Option<f64>,
    /// Block accesses hit over block accesses (reference policies).
    pub hit_ratio: Option<f64>,
    /// Block misses over block accesses (reference policies).
    pub miss_ratio: Option<f64>,
    /// Block accesses (reference policies).
    pub accesses: Option<u64>,
    /// Trace seconds until the interval read hit ratio first reached 90% of its final value.
    pub warmup_seconds: Option<f64>,
    /// Bytes written to the cache device.
    pub cache_bytes_written: Option<u64>,
    /// Bytes written to the cache device per request.
    pub cache_bytes_written_per_request: Option<f64>,
    /// Bytes read from the source.
    pub source_bytes_read: Option<u64>,
    /// Bytes written to the source.
    pub source_bytes_written: Option<u64>,
    /// Modelled mean read latency, seconds.
    pub mean_read_latency: Option<f64>,
    /// Modelled p99 read latency, seconds.
    pub p99_read_latency: Option<f64>,
    /// Metadata bytes of the core, counted by the allocator.
    pub metadata_bytes: Option<u64>,
    /// Warm-up curve: (trace seconds, interval read hit ratio).
    pub intervals: Vec<(f64, f64)>,
}

enum Kind {
    Reference(ReferencePolicy),
    Engine(CoreConfig),
}

fn policy(p: &str, a: &SimArgs) -> Result<Kind> {
    let engine = |admission| CoreConfig {
        fragment_size: a.fragment_size,
        admission,
        write_mode: a.mode,
        ..CoreConfig::default()
    };
    Ok(match p {
        "lru" => Kind::Reference(ReferencePolicy::Lru),
        "fifo" => Kind::Reference(ReferencePolicy::Fifo),
        "sce" => Kind::Engine(engine(Admission::Sce)),
        "always" => Kind::Engine(engine(Admission::Always)),
        "flashcache-like" => Kind::Engine(CoreConfig::flashcache_like()),
        _ => match p.parse::<Admission>() {
            Ok(adm @ Admission::NHit(_)) => Kind::Engine(engine(adm)),
            _ => bail!("unknown policy {p:?} (sce, flashcache-like, always, nhit:K, lru, fifo)"),
        },
    })
}

fn run_engine(a: &SimArgs, cfg: CoreConfig, source_size: u64) -> Result<sce_sim::EngineResult> {
    let mut sim = EngineSim::new(
        cfg,
        source_size,
        a.cache_size,
        DeviceModel::mercury_ssd(),
        DeviceModel::disk(),
        a.interval,
    )?;
    let mut reader = TraceReader::open(&a.trace, a.format, a.skip_bad)?;
    while let Some(r) = reader.next_request()? {
        if a.reads_only && r.kind != IoKind::Read {
            continue;
        }
        sim.request(&r);
    }
    Ok(sim.finish())
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
    let engines: Vec<_> = kinds
        .iter()
        .filter_map(|(n, k)| {
            if let Kind::Engine(c) = k {
                Some((n.clone(), c.clone()))
            } else {
                None
            }
        })
        .collect();
    // The engine needs the size of the address space: one streaming pass finds it.
    let mut source_size = 0u64;
    let mut requests = 0u64;
    let mut reader = TraceReader::open(&a.trace, a.format, a.skip_bad)?;
    let t0 = Instant::now();
    let mut refs: Vec<(String, BlockCache)> = kinds
        .iter()
        .filter_map(|(n, k)| {
            if let Kind::Reference(p) = k {
                Some((
                    n.clone(),
                    BlockCache::new(*p, (a.cache_size / 4096) as usize),
                ))
            } else {
                None
            }
        })
        .collect();
    while let Some(r) = reader.next_request()? {
        if a.reads_only && r.kind != IoKind::Read {
            continue;
        }
        requests += 1;
        source_size = source_size.max(r.offset.saturating_add(r.len));
        for (_, c) in &mut refs {
            c.request(r.offset, r.len);
        }
    }
    let ref_secs = t0.elapsed().as_secs_f64();
    let source_size = source_size.div_ceil(1 << 20).max(1) * (1 << 20);
    let mut metadata = Vec::new();
    for (_, cfg) in &engines {
        let before = live_bytes();
        let core = CacheCore::new(cfg.clone(), source_size, a.cache_size)?;
        metadata.push((live_bytes() - before) as u64);
        drop(core);
    }
    let t1 = Instant::now();
    let engine_results: Vec<Result<sce_sim::EngineResult>> = std::thread::scope(|s| {
        let hs: Vec<_> = engines
            .iter()
            .map(|(_, cfg)| s.spawn(|| run_engine(&a, cfg.clone(), source_size)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a simulation thread panicked")))
            })
            .collect()
    });
    let engine_secs = t1.elapsed().as_secs_f64();
    let mut results = Vec::new();
    let mut ei = 0;
    for (name, k) in &kinds {
        match k {
            Kind::Reference(_) => {
                let c = &refs.iter().find(|(n, _)| n == name).expect("built").1;
                results.push(PolicyResult {
                    policy: name.clone(),
                    hit_ratio: Some(1.0 - c.miss_ratio()),
                    miss_ratio: Some(c.miss_ratio()),
                    accesses: Some(c.accesses),
                    ..PolicyResult::default()
                });
            }
            Kind::Engine(_) => {
                let r = engine_results[ei]
                    .as_ref()
                    .map_err(|e| anyhow::anyhow!("{name}: {e:#}"))?;
                results.push(PolicyResult {
                    policy: name.clone(),
                    read_hit_ratio: Some(r.read_hit_ratio),
                    warmup_seconds: r.warmup_seconds,
                    cache_bytes_written: Some(r.cache_bytes_written),
                    cache_bytes_written_per_request: Some(
                        r.cache_bytes_written as f64 / r.requests.max(1) as f64,
                    ),
                    source_bytes_read: Some(r.source_bytes_read),
                    source_bytes_written: Some(r.source_bytes_written),
                    mean_read_latency: Some(r.mean_read_latency),
                    p99_read_latency: Some(r.p99_read_latency),
                    metadata_bytes: Some(metadata[ei]),
                    intervals: r.intervals.clone(),
                    ..PolicyResult::default()
                });
                ei += 1;
            }
        }
    }
    let accesses: u64 = refs.iter().map(|(_, c)| c.accesses).sum();
    if a.json {
        let v = serde_json::json!({
            "trace": a.trace, "cache_size": a.cache_size, "reads_only": a.reads_only,
            "requests": requests, "skipped": reader.skipped(), "source_size": source_size,
            "reference_seconds": ref_secs, "engine_seconds": engine_secs,
            "reference_accesses_per_second": accesses as f64 / ref_secs.max(1e-9),
            "policies": results,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{}: {requests} requests{}, cache {}{}",
        a.trace.display(),
        if reader.skipped() > 0 {
            format!(" ({} malformed skipped)", reader.skipped())
        } else {
            String::new()
        },
        format_size(a.cache_size),
        if a.reads_only { ", reads only" } else { "" }
    );
    let f = |x: Option<f64>, p: usize| x.map_or("-".to_string(), |v| format!("{v:.p$}"));
    println!(
        "{:<16} {:>9} {:>9} {:>9} {:>10} {:>12} {:>10} {:>10} {:>10}",
        "policy",
        "read hit",
        "hit",
        "warm-up s",
        "cache wr",
        "wr/request",
        "mean ms",
        "p99 ms",
        "metadata"
    );
    for r in &results {
        println!(
            "{:<16} {:>9} {:>9} {:>9} {:>10} {:>12} {:>10} {:>10} {:>10}",
            r.policy,
            f(r.read_hit_ratio, 4),
            f(r.hit_ratio, 4),
            f(r.warmup_seconds, 0),
            r.cache_bytes_written.map_or("-".into(), format_size),
            f(r.cache_bytes_written_per_request.map(|b| b / 1024.0), 1)
                + if r.cache_bytes_written_per_request.is_some() {
                    " KiB"
                } else {
                    ""
                },
            f(r.mean_read_latency.map(|s| s * 1e3), 3),
            f(r.p99_read_latency.map(|s| s * 1e3), 3),
            r.metadata_bytes.map_or("-".into(), format_size),
        );
    }
    if !refs.is_empty() {
        println!(
            "reference policies: {:.1} M block accesses/s (parsing included)",
            accesses as f64 / ref_secs.max(1e-9) / 1e6
        );
    }
    Ok(())
}
