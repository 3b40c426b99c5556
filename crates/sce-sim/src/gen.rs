//! A statistical workload generator in the spirit of Holland et al.'s: requests drawn from
//! a Zipf popularity law over the volume, Poisson arrivals, reproducible from a seed (the
//! same seed and parameters give the same trace, byte for byte, from the same build).
//!
//! Popularity: the volume is cut into `request_size` items grouped in clusters of
//! `cluster_size` bytes (like database extents). Item ranks come from Zipf(`skew`) over all
//! items; consecutive ranks share a cluster, and clusters are spread over the volume by a
//! bijective multiplicative permutation, so hot data is neither at the start of the volume
//! nor contiguous beyond a cluster.

use crate::trace::{IoKind, TraceRequest};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, Zipf};

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
}

impl Generator {
    /// Checks the configuration and starts the stream.
    pub fn new(cfg: GenConfig) -> Result<Generator, GenError> {
        let base = match &cfg.workload {
            Workload::Zipf(b)
            | Workload::Scan { base: b, .. }
            | Workload::Phase { base: b, .. }
            | Workload::Shared { base: b, .. } => b.clone(),
        };
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
            Workload::Phase { phases: 0, .. } => return Err(err("phases", "must be >= 1")),
            Workload::Shared { hosts: 0, .. } => return Err(err("hosts", "must be >= 1")),
            _ => {}
        }
        let zipf = if base.skew > 0.0 {
            Some(Zipf::new(items, base.skew).map_err(|e| err("skew", e.to_string()))?)
        } else {
            None
        };
        let gaps = Exp::new(cfg.iops).map_err(|e| err("iops", e.to_string()))?;
        let per_cluster = (base.cluster_size / base.request_size).max(1);
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
            cfg,
        })
    }

    fn rank(&mut self) -> u64 {
        match &self.zipf {
            Some(z) => (z.sample(&mut self.rng) as u64).clamp(1, self.items) - 1,
            None => self.rng.gen_range(0..self.items),
        }
    }
}

impl Iterator for Generator {
    type Item = TraceRequest;

    fn next(&mut self) -> Option<TraceRequest> {
        if self.emitted >= self.cfg.requests {
            return None;
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
                if let Workload::Shared { hosts, .. } = w {
                    volume = self.rng.gen_range(0..hosts);
                }
                let rank = self.rank();
                offset = self.place.item(rank, shift) * self.base.request_size;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(workload: Workload) -> GenConfig {
        GenConfig {
            workload,
            requests: 20_000,
            iops: 1000.0,
            seed: 7,
        }
    }

    #[test]
    fn placement_is_a_bijection() {
        for (items, per) in [(1000u64, 7u64), (1024, 32), (1, 1), (97, 200)] {
            let p = Placement::new(items, per);
            let mut seen = vec![false; items as usize];
            for r in 0..items {
                let it = p.item(r, 5) as usize;
                assert!(!seen[it], "{items} {per}: item {it} twice");
                seen[it] = true;
            }
        }
    }

    #[test]
    fn workloads_have_their_shape() {
        let oltp: Vec<_> = Generator::new(cfg(Workload::Zipf(ZipfParams::oltp(1 << 30))))
            .unwrap()
            .collect();
        assert_eq!(oltp.len(), 20_000);
        let reads = oltp.iter().filter(|r| r.kind == IoKind::Read).count() as f64;
        assert!((reads / 20_000.0 - 0.87).abs() < 0.01, "{reads}");
        assert!(oltp
            .iter()
            .all(|r| r.len == 8192 && r.offset % 8192 == 0 && r.offset < 1 << 30));
        assert!(oltp.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
        let secs = oltp.last().unwrap().time_ns as f64 / 1e9;
        assert!((secs - 20.0).abs() < 1.0, "Poisson at 1000/s: {secs}");
        // Skew: the hottest 1% of items get far more than 1% of the requests.
        let mut counts = std::collections::HashMap::new();
        for r in &oltp {
            *counts.entry(r.offset).or_insert(0u32) += 1;
        }
        let mut c: Vec<_> = counts.into_values().collect();
        c.sort_unstable_by(|a, b| b.cmp(a));
        let top: u32 = c.iter().take(1311).sum();
        assert!(top > 20_000 / 4, "{top}");

        let scan: Vec<_> = Generator::new(cfg(Workload::Scan {
            base: ZipfParams::oltp(1 << 30),
            fraction: 0.2,
            scan_request: 65536,
        }))
        .unwrap()
        .collect();
        let sweeps: Vec<_> = scan.iter().filter(|r| r.len == 65536).collect();
        assert!((sweeps.len() as f64 / 20_000.0 - 0.2).abs() < 0.02);
        assert!(sweeps
            .windows(2)
            .all(|w| w[1].offset == w[0].offset + 65536 && w[1].kind == IoKind::Read));

        let shared: Vec<_> = Generator::new(cfg(Workload::Shared {
            base: ZipfParams::oltp(1 << 30),
            hosts: 3,
        }))
        .unwrap()
        .collect();
        assert!(shared.iter().all(|r| r.volume < 3));
        assert!((0..3).all(|h| shared.iter().filter(|r| r.volume == h).count() > 6000));

        // The hottest item of the first phase is not the hottest of the second.
        let phase: Vec<_> = Generator::new(cfg(Workload::Phase {
            base: ZipfParams::oltp(1 << 30),
            phases: 2,
        }))
        .unwrap()
        .collect();
        let hottest = |rs: &[TraceRequest]| {
            let mut m = std::collections::HashMap::new();
            for r in rs {
                *m.entry(r.offset).or_insert(0u32) += 1;
            }
            m.into_iter().max_by_key(|x| (x.1, x.0)).unwrap().0
        };
        assert_ne!(hottest(&phase[..10_000]), hottest(&phase[10_000..]));
    }

    #[test]
    fn bad_parameters_are_rejected() {
        let mut p = ZipfParams::oltp(1 << 20);
        p.read_fraction = 1.5;
        let e = Generator::new(cfg(Workload::Zipf(p))).err().unwrap();
        assert_eq!(e.field, "read fraction");
        let p = ZipfParams::oltp(4096);
        assert_eq!(
            Generator::new(cfg(Workload::Zipf(p))).err().unwrap().field,
            "size"
        );
        let e = Generator::new(cfg(Workload::Shared {
            base: ZipfParams::oltp(1 << 20),
            hosts: 0,
        }))
        .err()
        .unwrap();
        assert_eq!(e.field, "hosts");
    }
}
