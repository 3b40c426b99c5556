//! Simulation speed on the 4 KiB-split `cloudPhysicsIO.vscsi` (113,872 requests, 1,141,869
//! block accesses): the reference LRU and FIFO in block accesses per second, with the trace
//! in memory and end to end (parsing included), and the engine policies in trace requests
//! per second. Run: `cargo bench -p sce-sim --bench sim_speed`. `cargo test --benches` runs
//! one short round as a smoke test; without ../shared/traces it uses a generated trace.

use sce_core::CoreConfig;
use sce_sim::{
    BlockCache, DeviceModel, EngineSim, GenConfig, Generator, ReferencePolicy, TraceFormat,
    TraceReader, TraceRequest, Workload, ZipfParams,
};
use std::path::PathBuf;
use std::time::Instant;

fn trace_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces/cloudPhysicsIO.vscsi")
}

fn load(quick: bool) -> (String, Vec<TraceRequest>) {
    let p = trace_path();
    if p.exists() {
        let v: Vec<_> = TraceReader::open(&p, TraceFormat::Vscsi, false)
            .and_then(|r| r.collect::<Result<Vec<_>, _>>())
            .expect("the shared trace parses");
        let n = if quick { 5_000 } else { v.len() };
        return (
            "cloudPhysicsIO.vscsi".into(),
            v.into_iter().take(n).collect(),
        );
    }
    let g = Generator::new(GenConfig {
        workload: Workload::Zipf(ZipfParams::oltp(4 << 30)),
        requests: if quick { 5_000 } else { 200_000 },
        iops: 1000.0,
        seed: 1,
    })
    .expect("valid");
    (
        "generated oltp (shared trace not found)".into(),
        g.collect(),
    )
}

/// Best of `rounds` runs of `f`, in seconds.
fn best(rounds: usize, mut f: impl FnMut() -> u64) -> (f64, u64) {
    let mut best = f64::MAX;
    let mut out = 0;
    for _ in 0..rounds {
        let t = Instant::now();
        out = std::hint::black_box(f());
        best = best.min(t.elapsed().as_secs_f64());
    }
    (best, out)
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing: keep that run short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let rounds = if quick { 1 } else { 5 };
    let (name, trace) = load(quick);
    println!("{name}: {} requests", trace.len());
    for (policy, label) in [
        (ReferencePolicy::Lru, "lru"),
        (ReferencePolicy::Fifo, "fifo"),
    ] {
        for mib in [64u64, 256, 512] {
            let (secs, accesses) = best(rounds, || {
                let mut c = BlockCache::new(policy, (mib << 20) as usize / 4096);
                for r in &trace {
                    c.request(r.offset, r.len);
                }
                c.accesses
            });
            println!(
                "{label:<5} {mib:>4} MiB, trace in memory: {:>6.2} M block accesses/s ({accesses} in {:.3} s)",
                accesses as f64 / secs / 1e6,
                secs
            );
        }
    }
    if trace_path().exists() {
        let (secs, accesses) = best(rounds, || {
            let mut c = BlockCache::new(ReferencePolicy::Lru, (256 << 20) / 4096);
            let mut r = TraceReader::open(&trace_path(), TraceFormat::Vscsi, false).expect("open");
            let mut n = 0;
            while let Some(q) = r.next_request().expect("parse") {
                c.request(q.offset, q.len);
                n += 1;
                if quick && n == 5_000 {
                    break;
                }
            }
            c.accesses
        });
        println!(
            "lru    256 MiB, parsing included:  {:>6.2} M block accesses/s ({accesses} in {:.3} s)",
            accesses as f64 / secs / 1e6,
            secs
        );
    }
    let source = trace
        .iter()
        .map(|r| r.offset + r.len)
        .max()
        .unwrap_or(1)
        .div_ceil(1 << 20)
        * (1 << 20);
    for (label, cfg) in [
        ("sce", CoreConfig::default()),
        ("flashcache-like", CoreConfig::flashcache_like()),
    ] {
        let (secs, requests) = best(rounds.min(3), || {
            let mut s = EngineSim::new(
                cfg.clone(),
                source,
                256 << 20,
                DeviceModel::mercury_ssd(),
                DeviceModel::disk(),
                60.0,
            )
            .expect("valid");
            for r in &trace {
                s.request(r);
            }
            s.finish().requests
        });
        println!(
            "{label:<15} 256 MiB: {:>8.0} k requests/s ({requests} in {:.3} s)",
            requests as f64 / secs / 1e3,
            secs
        );
    }
}
