//! `sce sim`: trace-driven simulation. This version runs the classic reference policies
//! (`lru`, `fifo` over 4 KiB blocks, every block access a lookup that inserts on a miss),
//! streaming the trace once into every policy asked for. The engine policies (`sce`,
//! `flashcache-like`, `nhit:K`) driven through sce-core in virtual time are not built yet and
//! are refused with a message that says so.

use crate::units::{format_size, parse_size};
use anyhow::{bail, Result};
use sce_sim::{BlockCache, IoKind, ReferencePolicy, TraceFormat, TraceReader};
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
    /// Policies to run side by side: lru, fifo (repeatable or comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "lru")]
    pub policy: Vec<String>,
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
#[derive(Serialize, Debug)]
pub struct PolicyResult {
    /// Policy name.
    pub policy: String,
    /// Block accesses.
    pub accesses: u64,
    /// Block misses.
    pub misses: u64,
    /// Misses over accesses.
    pub miss_ratio: f64,
    /// 1 - miss ratio.
    pub hit_ratio: f64,
}

/// Runs the simulation.
pub fn sim(a: SimArgs) -> Result<()> {
    let mut caches = Vec::new();
    for p in &a.policy {
        let policy = match p.as_str() {
            "lru" => ReferencePolicy::Lru,
            "fifo" => ReferencePolicy::Fifo,
            "sce" | "flashcache-like" | "always" => {
                bail!("policy {p:?}: the engine policies are not in the simulator yet (available: lru, fifo)")
            }
            p if p.starts_with("nhit:") => {
                bail!("policy {p:?}: the engine policies are not in the simulator yet (available: lru, fifo)")
            }
            _ => bail!("unknown policy {p:?} (available: lru, fifo)"),
        };
        let blocks = (a.cache_size / 4096) as usize;
        if blocks == 0 {
            bail!(
                "invalid --cache-size {}: smaller than one 4 KiB block",
                a.cache_size
            );
        }
        caches.push((p.clone(), BlockCache::new(policy, blocks)));
    }
    let mut reader = TraceReader::open(&a.trace, a.format, a.skip_bad)?;
    let t0 = Instant::now();
    let mut requests = 0u64;
    while let Some(r) = reader.next_request()? {
        if a.reads_only && r.kind != IoKind::Read {
            continue;
        }
        requests += 1;
        for (_, c) in &mut caches {
            c.request(r.offset, r.len);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let results: Vec<PolicyResult> = caches
        .iter()
        .map(|(p, c)| PolicyResult {
            policy: p.clone(),
            accesses: c.accesses,
            misses: c.misses,
            miss_ratio: c.miss_ratio(),
            hit_ratio: 1.0 - c.miss_ratio(),
        })
        .collect();
    let accesses: u64 = results.iter().map(|r| r.accesses).sum();
    if a.json {
        let v = serde_json::json!({
            "trace": a.trace, "cache_size": a.cache_size, "reads_only": a.reads_only,
            "requests": requests, "skipped": reader.skipped(), "seconds": secs,
            "accesses_per_second": accesses as f64 / secs.max(1e-9), "policies": results,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
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
        println!(
            "{:<8} {:>12} {:>12} {:>10} {:>10}",
            "policy", "accesses", "misses", "miss", "hit"
        );
        for r in &results {
            println!(
                "{:<8} {:>12} {:>12} {:>10.4} {:>10.4}",
                r.policy, r.accesses, r.misses, r.miss_ratio, r.hit_ratio
            );
        }
        println!(
            "{:.1} M block accesses/s (parsing included)",
            accesses as f64 / secs.max(1e-9) / 1e6
        );
    }
    Ok(())
}
