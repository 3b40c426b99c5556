//! `sce gen`: writes a synthetic trace from a statistical workload model (see
//! `sce_sim::gen`), reproducibly from a seed, in any format `sce sim` reads.

use crate::units::parse_size;
use anyhow::Result;
use sce_sim::gen::ScanBurst;
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
    /// written in the volume field (--disjoint: each host on a part of its own).
    Shared,
    /// The OLTP mix with periodic sequential read scans (bursts) over the volume: every
    /// --scan-every s a scan of --scan-size in --scan-request reads over --scan-duration s.
    Hotscan,
    /// The OLTP mix and one sequential read scan of --scan-size in the middle of the run, in
    /// its own region after the OLTP volume (offset >= --size), interleaved with the OLTP.
    Scanmid,
}

const GEN_HELP: &str = "\
Scans in bursts (hotscan, scanmid): a scan reads --scan-size bytes in --scan-request reads at
consecutive offsets (the last read shorter if the request size does not divide the scan size),
their starts spaced evenly over --scan-duration seconds and merged by time with the OLTP
requests, which arrive at --iops on their own. --requests counts both. The OLTP requests are
those of `sce gen oltp` with the same seed and options: without the scan requests, a hotscan or
scanmid trace is the start of that trace.

hotscan: scans start at 1x, 2x, 3x... --scan-every seconds, each where the previous one ended:
a sweep over the volume that wraps to offset 0 where a read would pass --size. The defaults
(1 GiB every 200 s in 50 s, 20 MiB/s) give 1,000,000 requests (about 984 s) 4 scans of a
quarter of the 4 GiB volume each, larger than a cache of a fraction of the 1.4 GiB the OLTP
requests touch.

scanmid: one scan, centred on the middle of the run's expected time (the OLTP requests at
--iops), of its own region [--size, --size + --scan-size): the trace addresses --size +
--scan-size bytes and the scan never touches the OLTP data. The rule to tell them apart
afterwards: a request is a scan request exactly when its offset is >= --size. (With the default
--scan-request and a --scan-size that is a multiple of it, the scan requests are also exactly
those of >= 64 KiB: 256 KiB against the OLTP's 8 KiB.) --scan-duration defaults to a tenth of
the run. Set --scan-size to the multiple of the cache size under test, e.g. 4x.

Examples:
  sce gen oltp --seed 7 --out /tmp/oltp.sce
  sce gen zipf --size 4GiB --skew 1.1 --out /tmp/zipf.csv --out-format csv";

/// Options of `sce gen`.
#[derive(clap::Args, Debug)]
#[command(after_long_help = GEN_HELP)]
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
    /// scan, hotscan, scanmid: bytes per scan request.
    #[arg(long, default_value = "256KiB", value_parser = parse_size)]
    pub scan_request: u64,
    /// hotscan, scanmid: bytes each scan reads.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub scan_size: u64,
    /// hotscan: seconds between the starts of two scans (the first starts then too).
    #[arg(long, default_value_t = 200.0)]
    pub scan_every: f64,
    /// hotscan, scanmid: seconds each scan takes [default: hotscan 50, scanmid a tenth of
    /// the run].
    #[arg(long)]
    pub scan_duration: Option<f64>,
    /// phase: number of phases.
    #[arg(long, default_value_t = 2)]
    pub phases: u32,
    /// shared: number of hosts.
    #[arg(long, default_value_t = 2)]
    pub hosts: u32,
    /// shared: each host on a part of the volume of its own, host h addressing --size bytes
    /// from h x --size (as VMs each with its own disk); by default all hosts address the
    /// same --size bytes.
    #[arg(long)]
    pub disjoint: bool,
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
            disjoint: a.disjoint,
        },
        WorkloadKind::Hotscan => Workload::HotScan {
            base,
            scan: ScanBurst {
                size: a.scan_size,
                request: a.scan_request,
                duration: a.scan_duration.unwrap_or(50.0),
            },
            every: a.scan_every,
        },
        WorkloadKind::Scanmid => {
            let mut scan = ScanBurst {
                size: a.scan_size,
                request: a.scan_request,
                duration: 0.0,
            };
            // A tenth of the OLTP requests' expected time (Generator::new checks the counts).
            let run = a.requests.saturating_sub(scan.requests()) as f64 / a.iops;
            scan.duration = a.scan_duration.unwrap_or(run / 10.0);
            Workload::MidScan { base, scan }
        }
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
        "wrote {n} requests ({}, seed {}) to {} as {}",
        clap::ValueEnum::to_possible_value(&a.workload).map_or_else(
            || format!("{:?}", a.workload).to_lowercase(),
            |v| v.get_name().to_string()
        ),
        a.seed,
        a.out.display(),
        a.out_format
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use sce_sim::{IoKind, TraceReader};

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        gen: GenArgs,
    }

    fn args(list: &[&str]) -> GenArgs {
        Cli::try_parse_from(std::iter::once("gen").chain(list.iter().copied()))
            .expect("valid options")
            .gen
    }

    /// The defaults of hotscan give a run of 1,000,000 requests several scans, each larger
    /// than the caches of a fraction of the working set `sce gen oltp` has (1.37 GiB).
    #[test]
    fn hotscan_defaults_have_several_large_scans() {
        let a = args(&["hotscan", "--out", "unused"]);
        // Bytes per scan; a scan request more than 10 s after the previous one starts a scan.
        let mut scans: Vec<u64> = Vec::new();
        let (mut last_t, mut next_off) = (None, 0);
        for r in Generator::new(config(&a)).unwrap() {
            if r.len == a.scan_request {
                assert_eq!(r.kind, IoKind::Read);
                assert_eq!(
                    r.offset, next_off,
                    "one sweep: each scan continues the last"
                );
                next_off = (r.offset + r.len) % (4 << 30);
                if last_t.is_none_or(|t| r.time_ns > t + 10_000_000_000) {
                    scans.push(0);
                }
                *scans.last_mut().unwrap() += r.len;
                last_t = Some(r.time_ns);
            }
        }
        assert_eq!(
            scans,
            [1 << 30; 4],
            "4 scans of 1 GiB in 1,000,000 requests"
        );
    }

    /// scanmid's scan lasts a tenth of the run unless told, and the trace is the same file,
    /// byte for byte, from the same seed.
    #[test]
    fn scanmid_is_reproducible_and_identifiable() {
        let d = tempfile::tempdir().unwrap();
        let run = |seed: &str, name: &str| {
            let out = d.path().join(name);
            let a = args(&[
                "scanmid",
                "--requests",
                "20000",
                "--size",
                "256MiB",
                "--scan-size",
                "64MiB",
                "--seed",
                seed,
                "--out",
                out.to_str().unwrap(),
            ]);
            let Workload::MidScan { scan, .. } = &config(&a).workload else {
                panic!("scanmid is a MidScan");
            };
            // 256 scan requests; the OLTP ones take 19.744 s at 1000/s.
            assert!((scan.duration - 1.9744).abs() < 1e-9, "{}", scan.duration);
            gen(a).unwrap();
            (std::fs::read(&out).unwrap(), out)
        };
        let (a, path) = run("3", "a.sce");
        assert_eq!(a, run("3", "b.sce").0, "same seed, same bytes");
        assert_ne!(a, run("4", "c.sce").0, "another seed");
        let mut reader = TraceReader::open(&path, TraceFormat::Sce, false).unwrap();
        let mut scan = Vec::new();
        while let Some(r) = reader.next_request().unwrap() {
            if r.offset >= 256 << 20 {
                scan.push(r.offset);
            }
        }
        let want: Vec<u64> = (0..256).map(|j| (256 << 20) + j * (256 << 10)).collect();
        assert_eq!(scan, want);
    }
}
