//! What one policy's simulation comes to: [`PolicyResult`], assembled from the stack's
//! counts, and the warning of an overloaded device model.

use super::SimConfig;
use crate::engine::EngineResult;
use crate::layers::{Replay, StackResult};
use serde::Serialize;

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
    /// Bytes written to the cache devices (engine policies: the engine's count; reference
    /// policies: 4 KiB per block inserted and per block a write hit rewrote).
    pub cache_bytes_written: Option<u64>,
    /// Blocks reference policies rewrote for write hits (part of `cache_bytes_written`).
    pub cache_blocks_rewritten: Option<u64>,
    /// Bytes written to the cache devices per trace request.
    pub cache_bytes_written_per_request: Option<f64>,
    /// Bytes read from the source.
    pub source_bytes_read: Option<u64>,
    /// Bytes written to the source.
    pub source_bytes_written: Option<u64>,
    /// Modelled mean read latency at the flash layer, seconds (engine policies).
    #[serde(rename = "mean_read_latency_seconds")]
    pub mean_read_latency: Option<f64>,
    /// Modelled p99 read latency at the flash layer, seconds (all hosts).
    #[serde(rename = "p99_read_latency_seconds")]
    pub p99_read_latency: Option<f64>,
    /// Modelled mean write latency at the flash layer, until acknowledged, seconds.
    #[serde(rename = "mean_write_latency_seconds")]
    pub mean_write_latency: Option<f64>,
    /// Modelled p99 write latency at the flash layer, seconds (all hosts).
    #[serde(rename = "p99_write_latency_seconds")]
    pub p99_write_latency: Option<f64>,
    /// With --ram-size: the mean read latency the application sees, RAM hits (which cost
    /// nothing) included, seconds.
    #[serde(rename = "app_mean_read_latency_seconds")]
    pub app_mean_read_latency: Option<f64>,
    /// With --ram-size: the mean write latency the application sees, until the RAM cache's
    /// policy acknowledges the write, seconds.
    #[serde(rename = "app_mean_write_latency_seconds")]
    pub app_mean_write_latency: Option<f64>,
    /// Busy time of the source model (service time per channel) over the duration of the
    /// replay; the most loaded host's. Null if infinite (work in a zero-length replay).
    pub source_utilization: Option<f64>,
    /// The same for the cache device model.
    pub cache_utilization: Option<f64>,
    /// A device model's utilization is above 1 under open-loop replay: the trace offers more
    /// than the model sustains, and the latencies are mostly queueing.
    pub overloaded: bool,
    /// Fragments populated (engine policies): background populations and miss fills.
    pub fragments_populated: Option<u64>,
    /// Read misses whose own data filled the cache (admission `sce`).
    pub miss_fills: Option<u64>,
    /// Population wake-ups that left the source to the clients because it had no room.
    pub population_source_busy: Option<u64>,
    /// Metadata bytes of one host's flash cache: for the engine, counted by the allocator
    /// when the core is built (none when the process has no counting allocator); for the
    /// reference policies, their structures at the end.
    pub metadata_bytes: Option<u64>,
    /// Write requests.
    pub writes: u64,
    /// Other hosts' caches holding a copy, per write (with --hosts).
    pub invalidations_per_write: Option<f64>,
    /// Fraction of writes that invalidated a copy on another host (Holland's Figure 4).
    pub writes_invalidating: Option<f64>,
    /// etcd operations per write under `sce serve --shared`'s protocol (docs/SHARED.md),
    /// with --hosts: contended writes' publications, region acquisitions (a transaction
    /// each), releases (a delete each), and every other host's acknowledgement of each of
    /// these (a put each, also delivered to the watchers; counted for releases too, to be
    /// conservative). The server's group commit shares puts among writes in flight
    /// together, which the replay does not model: an upper bound.
    pub coherence_ops_per_write: Option<f64>,
    /// The same without the releases' deletes: etcd puts per write. Without ownership
    /// (`--ownership off`), the number of hosts: the writer's publication and every other
    /// host's acknowledgement.
    pub coherence_puts_per_write: Option<f64>,
    /// Writes by the owner of every region they touch: no etcd operation.
    pub owned_writes: Option<u64>,
    /// Published writes: to a region another host owns or that the writer counts as
    /// contended (several hosts wrote it within `--ownership-idle`), or every write with
    /// `--ownership off`; a publication and an acknowledgement per other host each.
    pub contended_writes: Option<u64>,
    /// Regions acquired by a write (their other hosts dropped them).
    pub region_acquisitions: Option<u64>,
    /// Regions released by their owner: after `--ownership-idle` without a write, or on
    /// hearing another host's write there.
    pub region_releases: Option<u64>,
    /// Of `region_releases`, those on hearing another host's write (contention).
    pub contention_releases: Option<u64>,
    /// Read pages served from the source past the caches because another host owned their
    /// region (counted in the read hit ratio as misses).
    pub read_pages_bypassed: Option<u64>,
    /// Seconds this policy took to simulate (including parsing the trace).
    #[serde(rename = "wall_seconds")]
    pub seconds: f64,
    /// Trace requests per second of simulation.
    #[serde(rename = "requests_per_wall_second")]
    pub requests_per_second: f64,
    /// Block accesses per second (reference policies).
    #[serde(rename = "accesses_per_wall_second")]
    pub accesses_per_second: Option<f64>,
    /// Warm-up curve: (trace seconds, interval read hit ratio; null if no read).
    pub intervals: Vec<(f64, Option<f64>)>,
    /// Cache bytes written in each interval of `intervals` (engine: its cache writes,
    /// reference: 4 KiB per block inserted and per block a write hit rewrote).
    pub interval_cache_bytes_written: Vec<u64>,
    /// Write-back (`--mode writeback`, engine policies): bytes the cleaner wrote to the
    /// source.
    pub bytes_written_back: Option<u64>,
    /// Write-back: the cleaner's source writes (runs of up to 1 MiB).
    pub writeback_source_writes: Option<u64>,
    /// Write-back: bytes of the write-back log (per host).
    pub writeback_log_bytes: Option<u64>,
    /// Write-back: the most the log may hold (its region and every chunk of read slots it
    /// may lend; per host).
    pub writeback_log_max_bytes: Option<u64>,
    /// Write-back: chunks of read slots the log lent.
    pub writeback_log_lends: Option<u64>,
    /// Write-back: chunks of read slots the log gave back.
    pub writeback_log_give_backs: Option<u64>,
    /// Write-back: the log's commits (records written).
    pub writeback_commits: Option<u64>,
    /// Write-back: read pages served from the log (hits).
    pub writeback_log_read_pages: Option<u64>,
    /// Write-back: writes that never got log positions (nothing could make room; 0 on
    /// any trace a working cache serves).
    pub writeback_writes_given_up: Option<u64>,
    /// Write-back: dirty bytes still in the log at the end of the trace.
    pub dirty_bytes_at_end: Option<u64>,
    /// Write-back: writes that waited for room in the log.
    pub writeback_waits: Option<u64>,
    /// Write-back: share of the log in use at the end of each interval, parallel to
    /// `intervals` (the first host's).
    pub interval_dirty_share: Vec<f64>,
}

fn aggregate_engines(es: &[EngineResult]) -> EngineResult {
    let mut out = EngineResult::default();
    for e in es {
        out.cache_bytes_written += e.cache_bytes_written;
        out.source_bytes_read += e.source_bytes_read;
        out.source_bytes_written += e.source_bytes_written;
        out.requests += e.requests;
        out.fragments_populated += e.fragments_populated;
        out.miss_fills += e.miss_fills;
        out.population_source_busy += e.population_source_busy;
        out.fragments_evicted += e.fragments_evicted;
        out.bytes_written_back += e.bytes_written_back;
        out.dirty_bytes_at_end += e.dirty_bytes_at_end;
        out.writeback_waits += e.writeback_waits;
        if let Some(w) = &e.writeback {
            let o = out.writeback.get_or_insert_with(Default::default);
            o.log_bytes = w.log_bytes;
            o.log_max_bytes = w.log_max_bytes;
            o.lends += w.lends;
            o.give_backs += w.give_backs;
            o.source_writes += w.source_writes;
            o.batches += w.batches;
            o.commits += w.commits;
            o.log_read_pages += w.log_read_pages;
            o.writes_given_up += w.writes_given_up;
        }
    }
    out
}

/// The warning line of a policy whose device models the trace overloads in an open-loop
/// replay.
pub fn overload_warning(r: &PolicyResult) -> Option<String> {
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

/// Where a policy's metadata bytes come from.
#[derive(Clone, Copy, Debug)]
pub(super) enum Metadata {
    /// An engine policy's core, counted by the allocator as it was built.
    Counted(u64),
    /// An engine policy's core, with no counting allocator to count it.
    Uncounted,
    /// A reference policy: its structures at the end of the run.
    AtEnd,
}

impl Metadata {
    /// The bytes to report, given what a reference policy's structures came to.
    fn bytes(self, reference_bytes: u64) -> Option<u64> {
        match self {
            Metadata::Counted(n) => Some(n),
            Metadata::Uncounted => None,
            Metadata::AtEnd => Some(reference_bytes),
        }
    }
}

/// A reference policy's own figures: its block accesses and misses (`counts`), and its
/// cache writes.
fn reference_figures(
    out: &mut PolicyResult,
    r: &StackResult,
    (acc, miss): (u64, u64),
    secs: f64,
    requests: u64,
) {
    let m = if acc == 0 {
        0.0
    } else {
        miss as f64 / acc as f64
    };
    out.hit_ratio = Some(1.0 - m);
    out.miss_ratio = Some(m);
    out.accesses = Some(acc);
    out.accesses_per_second = Some(acc as f64 / secs.max(1e-9));
    // 4 KiB per block inserted (LARC inserts only what it admits) and per block a write hit
    // rewrote, every interval's.
    let written: u64 = r.interval_cache_bytes.iter().sum();
    out.cache_bytes_written = Some(written);
    out.cache_blocks_rewritten = Some(r.reference_updates);
    out.cache_bytes_written_per_request = Some(written as f64 / requests.max(1) as f64);
}

/// Shared mode's figures: invalidations and etcd operations.
fn coherence_figures(out: &mut PolicyResult, r: &StackResult) {
    out.invalidations_per_write = Some(r.invalidations_per_write());
    out.writes_invalidating = Some(r.writes_invalidating as f64 / r.writes.max(1) as f64);
    out.coherence_ops_per_write = Some(r.coherence_ops_per_write());
    out.coherence_puts_per_write = Some(r.coherence_puts_per_write());
    out.owned_writes = Some(r.owned_writes);
    out.contended_writes = Some(r.contended_writes);
    out.region_acquisitions = Some(r.region_acquisitions);
    out.region_releases = Some(r.region_releases);
    out.contention_releases = Some(r.contention_releases);
    out.read_pages_bypassed = Some(r.read_pages_bypassed);
}

pub(super) fn result(
    name: &str,
    r: &StackResult,
    secs: f64,
    metadata: Metadata,
    a: &SimConfig,
    requests: u64,
) -> PolicyResult {
    let mut out = PolicyResult {
        policy: name.to_string(),
        read_hit_ratio: r.read_hit_ratio(),
        warmup_seconds: r.warmup_seconds,
        metadata_bytes: metadata.bytes(r.reference_bytes),
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
        let (ar, aw) = (&r.app_read_latency, &r.app_write_latency);
        out.app_mean_read_latency = (ar.count() > 0).then(|| ar.mean());
        out.app_mean_write_latency = (aw.count() > 0).then(|| aw.mean());
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
    if a.hosts > 1 || a.report_coherence {
        coherence_figures(&mut out, r);
    }
    if let Some(counts) = r.reference {
        reference_figures(&mut out, r, counts, secs, requests);
    }
    if !r.engines.is_empty() {
        let e = aggregate_engines(&r.engines);
        out.cache_bytes_written = Some(e.cache_bytes_written);
        out.cache_bytes_written_per_request =
            Some(e.cache_bytes_written as f64 / requests.max(1) as f64);
        out.source_bytes_read = Some(e.source_bytes_read);
        out.source_bytes_written = Some(e.source_bytes_written);
        out.fragments_populated = Some(e.fragments_populated);
        out.miss_fills = Some(e.miss_fills);
        out.population_source_busy = Some(e.population_source_busy);
        if !r.engines[0].dirty_intervals.is_empty() || e.writeback.is_some() {
            out.bytes_written_back = Some(e.bytes_written_back);
            out.dirty_bytes_at_end = Some(e.dirty_bytes_at_end);
            out.writeback_waits = Some(e.writeback_waits);
            if let Some(w) = &e.writeback {
                out.writeback_source_writes = Some(w.source_writes);
                out.writeback_log_bytes = Some(w.log_bytes);
                out.writeback_log_max_bytes = Some(w.log_max_bytes);
                out.writeback_log_lends = Some(w.lends);
                out.writeback_log_give_backs = Some(w.give_backs);
                out.writeback_commits = Some(w.commits);
                out.writeback_log_read_pages = Some(w.log_read_pages);
                out.writeback_writes_given_up = Some(w.writes_given_up);
            }
            out.interval_dirty_share = r.engines[0].dirty_intervals.iter().map(|x| x.1).collect();
        }
    }
    out
}
