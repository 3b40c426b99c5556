//! `sce gen`: writes a synthetic trace from a statistical workload model (see
//! `sce_sim::gen`), reproducibly from a seed, in any format `sce sim` reads.

use crate::units::parse_size;
use anyhow::Result;
use sce_sim::{GenConfig, Generator, TraceFormat, TraceWriter, Workload, ZipfParams};
use std::path::PathBuf;

/// The workloads.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    /// TPC-E-like (the SCE paper's mix): 87% reads, random 8 KiB, Zipf 1.0 in 256 KiB extents.
    Oltp,
    /// Zipf-distributed random requests; by default reads only, 4 KiB, no extents.
    Zipf,
    /// Sequential read sweeps over the volume (--scan-fraction of the requests, in
    /// --scan-request units) mixed into the OLTP mix.
    Scan,
    /// The OLTP mix whose working set moves --phases times.
    Phase,
    /// --hosts hosts over one volume, OLTP-like with 30% writes (Holland); the host id is
    /// written in the volume field.
    Shared,
}

/// Options of `sce gen`.
#[derive(clap::Args, Debug)]
pub struct GenArgs {
    /// The workload.
    pub workload: WorkloadKind,
    /// Where to write the trace.
    #[arg(long)]
    pub out: PathBuf,
    /// Its format: sce (default), csv, csv:SPEC, vscsi, msr, systor, tencent, disksim.
    #[arg(long, default_value = "sce")]
    pub out_format: TraceFormat,
    /// Number of requests.
    #[arg(long, default_value_t = 1_000_000)]
    pub requests: u64,
    /// Mean request rate per second (Poisson arrivals).
    #[arg(long, default_value_t = 1000.0)]
    pub iops: f64,
    /// Seed of the random stream: the same seed gives the same trace.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Bytes of volume the workload addresses.
    #[arg(long, default_value = "4GiB", value_parser = parse_size)]
    pub size: u64,
    /// Zipf exponent (0 = uniform) [default: 1.0].
    #[arg(long)]
    pub skew: Option<f64>,
    /// Fraction of requests that are reads [default: per workload].
    #[arg(long)]
    pub read_fraction: Option<f64>,
    /// Bytes per request [default: 8KiB, zipf 4KiB].
    #[arg(long, value_parser = parse_size)]
    pub request_size: Option<u64>,
    /// Bytes of consecutively ranked data (extents) [default: 256KiB, zipf the request size].
    #[arg(long, value_parser = parse_size)]
    pub cluster_size: Option<u64>,
    /// scan: fraction of requests that belong to the sweeps.
    #[arg(long, default_value_t = 0.1)]
    pub scan_fraction: f64,
    /// scan: bytes per sweep request.
    #[arg(long, default_value = "256KiB", value_parser = parse_size)]
    pub scan_request: u64,
    /// phase: number of phases.
    #[arg(long, default_value_t = 2)]
    pub phases: u32,
    /// shared: number of hosts.
    #[arg(long, default_value_t = 2)]
    pub hosts: u32,
}

/// The generator configuration the options describe.
pub fn config(a: &GenArgs) -> GenConfig {
    let mut base = ZipfParams::oltp(a.size);
    match a.workload {
        WorkloadKind::Zipf => {
            base.read_fraction = 1.0;
            base.request_size = 4096;
            base.cluster_size = a.request_size.unwrap_or(4096);
        }
        WorkloadKind::Shared => base.read_fraction = 0.7,
        _ => {}
    }
    if let Some(s) = a.skew {
        base.skew = s;
    }
    if let Some(r) = a.read_fraction {
        base.read_fraction = r;
    }
    if let Some(r) = a.request_size {
        base.request_size = r;
    }
    if let Some(c) = a.cluster_size {
        base.cluster_size = c;
    }
    let workload = match a.workload {
        WorkloadKind::Oltp | WorkloadKind::Zipf => Workload::Zipf(base),
        WorkloadKind::Scan => Workload::Scan {
            base,
            fraction: a.scan_fraction,
            scan_request: a.scan_request,
        },
        WorkloadKind::Phase => Workload::Phase {
            base,
            phases: a.phases,
        },
        WorkloadKind::Shared => Workload::Shared {
            base,
            hosts: a.hosts,
        },
    };
    GenConfig {
        workload,
        requests: a.requests,
        iops: a.iops,
        seed: a.seed,
    }
}

/// Runs `sce gen`.
pub fn gen(a: GenArgs) -> Result<()> {
    let generator = Generator::new(config(&a))?;
    let mut w = TraceWriter::create(&a.out, a.out_format.clone())?;
    for r in generator {
        w.write(&r)?;
    }
    let n = w.finish()?;
    eprintln!(
        "wrote {n} requests ({:?}, seed {}) to {} as {}",
        a.workload,
        a.seed,
        a.out.display(),
        a.out_format
    );
    Ok(())
}
