//! A statistical workload generator in the spirit of Holland et al.'s: requests drawn from
//! a Zipf popularity law over the volume, Poisson arrivals, reproducible from a seed (the
//! same seed and parameters give the same trace, byte for byte, from the same build).
//!
//! Popularity: the volume is cut into `request_size` items grouped in clusters of
//! `cluster_size` bytes (like database extents). Item ranks come from Zipf(`skew`) over all
//! items; consecutive ranks share a cluster, and clusters are spread over the volume by a
//! bijective multiplicative permutation, so hot data is neither at the start of the volume
//! nor contiguous beyond a cluster.
//!
//! Scans: [`Workload::Scan`] mixes a sweep into every request at random; [`Workload::HotScan`]
//! and [`Workload::MidScan`] instead run sequential read scans as bursts ([`ScanBurst`]): a
//! second, evenly paced stream of requests merged by time with the Zipf stream. The Zipf
//! requests of those two draw the same random numbers as [`Workload::Zipf`] with the same
//! seed, so with the scan requests taken out they are the first requests of that trace.

use crate::request::{IoKind, TraceRequest};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, Zipf};

#[cfg(test)]
mod tests;

/// The popularity and mix of a Zipf workload.
#[derive(Clone, Debug, PartialEq)]
pub struct ZipfParams {
    /// Bytes of the volume the workload addresses.
    pub size: u64,
    /// Zipf exponent (0 is uniform, 1 is the classic Zipf's law).
    pub skew: f64,
    /// Fraction of requests that are reads.
    pub read_fraction: f64,
    /// Bytes per request, and per item of the popularity law.
    pub request_size: u64,
    /// Bytes per cluster of consecutively ranked items.
    pub cluster_size: u64,
}

impl ZipfParams {
    /// The TPC-E-like mix of the SCE paper: 87% reads, random 8 KiB requests, Zipf 1.0
    /// skew in 256 KiB extents.
    pub fn oltp(size: u64) -> Self {
        ZipfParams {
            size,
            skew: 1.0,
            read_fraction: 0.87,
            request_size: 8192,
            cluster_size: 256 << 10,
        }
    }
}

/// One sequential read scan: `size` bytes read in `request`-byte requests at consecutive
/// offsets (the last one shorter if `request` does not divide `size`), their start times
/// evenly spaced over `duration` seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct ScanBurst {
    /// Bytes the scan reads.
    pub size: u64,
    /// Bytes per scan request.
    pub request: u64,
    /// Seconds from the first scan request to the last one's start plus one spacing.
    pub duration: f64,
}

impl ScanBurst {
    /// Requests of one scan.
    pub fn requests(&self) -> u64 {
        self.size.div_ceil(self.request.max(1))
    }

    /// Seconds between two requests of the scan.
    fn spacing(&self) -> f64 {
        self.duration / self.requests().max(1) as f64
    }

    /// The length of request `j` of the scan.
    fn len(&self, j: u64) -> u64 {
        self.request.min(self.size - j * self.request)
    }
}

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub enum Workload {
    /// Zipf-distributed random requests (`oltp` is a preset of this).
    Zipf(ZipfParams),
    /// Sequential read sweeps over the whole volume mixed into a Zipf workload, as
    /// Mercury's background maintenance (backup, virus scan): each request is, with
    /// probability `fraction`, the next `scan_request` bytes of the sweep.
    Scan {
        /// The foreground workload.
        base: ZipfParams,
        /// Fraction of requests that belong to the sweep.
        fraction: f64,
        /// Bytes per sweep request.
        scan_request: u64,
    },
    /// The working set moves: the trace is cut into `phases` equal parts, and at each
    /// boundary the hot clusters move to other addresses.
    Phase {
        /// The workload within a phase.
        base: ZipfParams,
        /// Number of phases (at least 1).
        phases: u32,
    },
    /// Several hosts over one volume, all with the same popularity law; the host id
    /// (`0..hosts`) is written in the volume field.
    Shared {
        /// The workload of each host.
        base: ZipfParams,
        /// Number of hosts.
        hosts: u32,
        /// Each host on a part of the volume of its own: host `h` addresses `base.size`
        /// bytes from `h * base.size` (VMs each with its own disk on a shared LUN), rather
        /// than all hosts the same `base.size` bytes.
        disjoint: bool,
    },
    /// A Zipf workload with periodic sequential read scans over its volume (a nightly
    /// backup, a report): a scan starts at every multiple of `every` seconds (the first at
    /// `every`), in addition to the Zipf requests, and lasts `scan.duration` seconds. The
    /// scans sweep the volume: each starts where the previous one ended, and the sweep
    /// wraps to offset 0 where a request would pass the end of the volume.
    HotScan {
        /// The foreground workload (its `iops` is the Zipf stream's alone).
        base: ZipfParams,
        /// Each scan; `scan.size` at most the volume, `scan.duration` at most `every`.
        scan: ScanBurst,
        /// Seconds between the starts of two scans.
        every: f64,
    },
    /// A Zipf workload for the whole run and exactly one sequential read scan, outside the
    /// Zipf volume: the scan reads `[base.size, base.size + scan.size)` from its start, so
    /// a request is a scan request exactly when its offset is at least `base.size`. The
    /// scan is centred on the middle of the run's expected duration (the Zipf requests,
    /// `requests - scan.requests()` of them, at `iops`) and interleaved by time with the
    /// Zipf requests.
    MidScan {
        /// The foreground workload.
        base: ZipfParams,
        /// The scan.
        scan: ScanBurst,
    },
}

/// A generation run.
#[derive(Clone, Debug, PartialEq)]
pub struct GenConfig {
    /// The workload.
    pub workload: Workload,
    /// Number of requests.
    pub requests: u64,
    /// Mean arrival rate, requests per second (Poisson arrivals).
    pub iops: f64,
    /// Seed of the random stream.
    pub seed: u64,
}

/// A generator configuration that cannot work.
#[derive(Debug, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct GenError {
    /// The parameter at fault.
    pub field: &'static str,
    /// Why.
    pub reason: String,
}

fn err(field: &'static str, reason: impl Into<String>) -> GenError {
    GenError {
        field,
        reason: reason.into(),
    }
}

fn check_scan(scan: &ScanBurst) -> Result<(), GenError> {
    if scan.request == 0 || scan.request > u32::MAX as u64 {
        return Err(err("scan request size", "must be 1 B ..= 4 GiB"));
    }
    if scan.size == 0 {
        return Err(err("scan size", "must be > 0"));
    }
    if !(scan.duration.is_finite() && scan.duration >= 0.0) {
        return Err(err("scan duration", "must be >= 0 seconds"));
    }
    Ok(())
}

/// Maps Zipf ranks to item numbers (see the module documentation): items of consecutive
/// rank form clusters (extents), and clusters are spread over the volume by a bijective
/// multiplicative permutation.
#[derive(Clone, Debug)]
pub struct Placement {
    items: u64,
    per_cluster: u64,
    clusters: u64,
    mult: u64,
}

impl Placement {
    /// A placement of `items` items in clusters of `per_cluster` (clamped to 1..=items).
    pub fn new(items: u64, per_cluster: u64) -> Self {
        let per_cluster = per_cluster.clamp(1, items);
        let clusters = items / per_cluster;
        let gcd = |mut a: u64, mut b: u64| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let mut mult = ((clusters as f64 * 0.618_033_988_75) as u64) | 1;
        while gcd(mult, clusters) != 1 {
            mult += 2;
        }
        Placement {
            items,
            per_cluster,
            clusters,
            mult,
        }
    }

    /// The item of `rank` (0-based) when the hot set is shifted by `shift` clusters.
    pub fn item(&self, rank: u64, shift: u64) -> u64 {
        let c = rank / self.per_cluster;
        if c >= self.clusters {
            return rank % self.items;
        }
        let pc = ((c as u128 * self.mult as u128 + shift as u128) % self.clusters as u128) as u64;
        pc * self.per_cluster + rank % self.per_cluster
    }
}

/// The Zipf parameters every workload has.
fn base_params(workload: &Workload) -> ZipfParams {
    match workload {
        Workload::Zipf(b)
        | Workload::Scan { base: b, .. }
        | Workload::Phase { base: b, .. }
        | Workload::Shared { base: b, .. }
        | Workload::HotScan { base: b, .. }
        | Workload::MidScan { base: b, .. } => b.clone(),
    }
}

/// Checks the parameters every workload has; returns the number of items of the volume.
fn check_base(base: &ZipfParams, cfg: &GenConfig) -> Result<u64, GenError> {
    if base.request_size == 0 || base.request_size > u32::MAX as u64 {
        return Err(err("request size", "must be 1 B ..= 4 GiB"));
    }
    let items = base.size / base.request_size;
    if items == 0 {
        return Err(err("size", "smaller than one request"));
    }
    if !(base.skew.is_finite() && base.skew >= 0.0) {
        return Err(err("skew", "must be a number >= 0"));
    }
    if !(0.0..=1.0).contains(&base.read_fraction) {
        return Err(err("read fraction", "must be in 0..=1"));
    }
    if !(cfg.iops.is_finite() && cfg.iops > 0.0) {
        return Err(err("iops", "must be > 0"));
    }
    Ok(items)
}

/// Checks the parameters of the workload's own kind.
fn check_workload(cfg: &GenConfig, base: &ZipfParams) -> Result<(), GenError> {
    match &cfg.workload {
        Workload::Scan {
            fraction,
            scan_request,
            ..
        } => {
            if !(0.0..=1.0).contains(fraction) {
                return Err(err("scan fraction", "must be in 0..=1"));
            }
            if *scan_request == 0 || *scan_request > base.size.min(u32::MAX as u64) {
                return Err(err(
                    "scan request size",
                    "must be > 0, at most the size and 4 GiB",
                ));
            }
        }
        Workload::HotScan { scan, every, .. } => {
            check_scan(scan)?;
            if !(every.is_finite() && *every > 0.0) {
                return Err(err("scan interval", "must be > 0 seconds"));
            }
            if scan.duration > *every {
                return Err(err(
                    "scan duration",
                    format!(
                        "{} s is longer than the {every} s between scans",
                        scan.duration
                    ),
                ));
            }
            if scan.size > base.size {
                return Err(err("scan size", "must be at most the size of the volume"));
            }
        }
        Workload::MidScan { scan, .. } => {
            check_scan(scan)?;
            if base.size.checked_add(scan.size).is_none() {
                return Err(err("scan size", "the volume and the scan pass 2^64 bytes"));
            }
            if scan.requests() > cfg.requests {
                return Err(err(
                    "scan size",
                    format!(
                        "the scan takes {} requests, more than the {} of the trace",
                        scan.requests(),
                        cfg.requests
                    ),
                ));
            }
        }
        Workload::Phase { phases: 0, .. } => return Err(err("phases", "must be >= 1")),
        Workload::Shared { hosts: 0, .. } => return Err(err("hosts", "must be >= 1")),
        Workload::Shared {
            hosts,
            disjoint: true,
            ..
        } if base.size.checked_mul(*hosts as u64).is_none() => {
            return Err(err("size", "the hosts' disjoint parts pass 2^64 bytes"))
        }
        _ => {}
    }
    Ok(())
}

/// The stream of generated requests.
pub struct Generator {
    cfg: GenConfig,
    base: ZipfParams,
    rng: StdRng,
    zipf: Option<Zipf<f64>>,
    gaps: Exp<f64>,
    place: Placement,
    items: u64,
    emitted: u64,
    time_s: f64,
    sweep: u64,
    /// Arrival time of the next Zipf request, once drawn (burst workloads).
    zipf_next: Option<f64>,
    /// Zipf requests emitted (burst workloads).
    zipf_emitted: u64,
    /// The scan to come or in progress (from 0; `MidScan` has only scan 0) and its next
    /// request.
    burst: u64,
    burst_req: u64,
    /// Start time of scan 0 of `MidScan`.
    mid_start: f64,
}

impl Generator {
    /// Checks the configuration and starts the stream.
    pub fn new(cfg: GenConfig) -> Result<Generator, GenError> {
        let base = base_params(&cfg.workload);
        let items = check_base(&base, &cfg)?;
        check_workload(&cfg, &base)?;
        let zipf = if base.skew > 0.0 {
            Some(Zipf::new(items, base.skew).map_err(|e| err("skew", e.to_string()))?)
        } else {
            None
        };
        let gaps = Exp::new(cfg.iops).map_err(|e| err("iops", e.to_string()))?;
        let per_cluster = (base.cluster_size / base.request_size).max(1);
        let mid_start = match &cfg.workload {
            Workload::MidScan { scan, .. } => {
                let run = (cfg.requests - scan.requests()) as f64 / cfg.iops;
                ((run - scan.duration) / 2.0).max(0.0)
            }
            _ => 0.0,
        };
        Ok(Generator {
            rng: StdRng::seed_from_u64(cfg.seed),
            place: Placement::new(items, per_cluster),
            items,
            base,
            zipf,
            gaps,
            emitted: 0,
            time_s: 0.0,
            sweep: 0,
            zipf_next: None,
            zipf_emitted: 0,
            burst: 0,
            burst_req: 0,
            mid_start,
            cfg,
        })
    }

    fn rank(&mut self) -> u64 {
        match &self.zipf {
            Some(z) => (z.sample(&mut self.rng) as u64).clamp(1, self.items) - 1,
            None => self.rng.gen_range(0..self.items),
        }
    }

    /// The next request of `HotScan` and `MidScan`: the earlier of the next Zipf arrival
    /// and the next scan request (the scan on a tie).
    fn next_burst(&mut self) -> TraceRequest {
        let (scan, every) = match &self.cfg.workload {
            Workload::HotScan { scan, every, .. } => (scan.clone(), Some(*every)),
            Workload::MidScan { scan, .. } => (scan.clone(), None),
            _ => unreachable!("only burst workloads"),
        };
        let n = scan.requests();
        let scan_t = match every {
            Some(every) => Some((self.burst + 1) as f64 * every),
            None => (self.burst == 0).then_some(self.mid_start),
        }
        .map(|start| start + self.burst_req as f64 * scan.spacing());
        let zipf_left = every.is_some() || self.zipf_emitted + n < self.cfg.requests;
        let zipf_t = if zipf_left {
            let (now, gaps, rng) = (self.time_s, &self.gaps, &mut self.rng);
            Some(*self.zipf_next.get_or_insert_with(|| now + gaps.sample(rng)))
        } else {
            None
        };
        let scan_next = match (scan_t, zipf_t) {
            (Some(s), Some(z)) => (s <= z).then_some(s),
            (s, _) => s,
        };
        if let Some(t) = scan_next {
            let j = self.burst_req;
            let len = scan.len(j);
            let offset = if every.is_some() {
                if self.sweep + len > self.base.size {
                    self.sweep = 0;
                }
                self.sweep += len;
                self.sweep - len
            } else {
                self.base.size + j * scan.request
            };
            self.burst_req += 1;
            if self.burst_req == n {
                self.burst += 1;
                self.burst_req = 0;
            }
            self.time_s = t;
            return TraceRequest {
                time_ns: (t * 1e9) as u64,
                kind: IoKind::Read,
                volume: 0,
                offset,
                len,
            };
        }
        let t = zipf_t.expect("requests left but no stream has any");
        self.zipf_next = None;
        self.zipf_emitted += 1;
        self.time_s = t;
        // The same draws, in the same order, as a Zipf workload's request.
        let read = self.rng.gen_bool(self.base.read_fraction);
        let rank = self.rank();
        TraceRequest {
            time_ns: (t * 1e9) as u64,
            kind: if read { IoKind::Read } else { IoKind::Write },
            volume: 0,
            offset: self.place.item(rank, 0) * self.base.request_size,
            len: self.base.request_size,
        }
    }
}

impl Iterator for Generator {
    type Item = TraceRequest;

    fn next(&mut self) -> Option<TraceRequest> {
        if self.emitted >= self.cfg.requests {
            return None;
        }
        if matches!(
            self.cfg.workload,
            Workload::HotScan { .. } | Workload::MidScan { .. }
        ) {
            self.emitted += 1;
            return Some(self.next_burst());
        }
        self.time_s += self.gaps.sample(&mut self.rng);
        let time_ns = (self.time_s * 1e9) as u64;
        let i = self.emitted;
        self.emitted += 1;
        let read = self.rng.gen_bool(self.base.read_fraction);
        let mut kind = if read { IoKind::Read } else { IoKind::Write };
        let mut volume = 0;
        let mut shift = 0;
        let mut len = self.base.request_size;
        let offset;
        match self.cfg.workload.clone() {
            Workload::Scan {
                fraction,
                scan_request,
                ..
            } if self.rng.gen_bool(fraction) => {
                if self.sweep + scan_request > self.base.size {
                    self.sweep = 0;
                }
                offset = self.sweep;
                self.sweep += scan_request;
                len = scan_request;
                kind = IoKind::Read;
            }
            w => {
                if let Workload::Phase { phases, .. } = w {
                    let phase = i * phases as u64 / self.cfg.requests;
                    // Move the hot set by a large, fixed fraction of the clusters each phase.
                    shift = phase * (self.place.clusters / 3 + 1);
                }
                let mut part = 0;
                if let Workload::Shared {
                    hosts, disjoint, ..
                } = w
                {
                    volume = self.rng.gen_range(0..hosts);
                    part = if disjoint {
                        volume as u64 * self.base.size
                    } else {
                        0
                    };
                }
                let rank = self.rank();
                offset = part + self.place.item(rank, shift) * self.base.request_size;
            }
        }
        Some(TraceRequest {
            time_ns,
            kind,
            volume,
            offset,
            len,
        })
    }
}
