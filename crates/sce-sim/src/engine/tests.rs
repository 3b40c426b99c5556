//! Tests of the engine simulation.

use super::*;
use sce_core::CacheOffset;

fn sim(ssd: DeviceModel) -> EngineSim {
    EngineSim::new(
        CoreConfig::default(),
        64 << 20,
        16 << 20,
        ssd,
        DeviceModel::disk(),
        1.0,
    )
    .expect("valid")
}

fn service(model: &DeviceModel, bytes: u64, write: bool) -> u64 {
    let (lat, bw) = if write {
        (model.write_ns, model.write_bw)
    } else {
        (model.read_ns, model.read_bw)
    };
    lat + bytes * 1_000_000_000 / bw
}

/// A population completes when the last of its cache writes does, not when the write of
/// its last run does: with several channels a long first run outlasts a short last one.
#[test]
fn a_population_completes_with_its_slowest_write() {
    // A 1 MiB span of which the cache already holds one page, the second last: two runs.
    let runs = [
        (0, 1_040_384, CacheOffset(0)),
        (1_044_480, 4096, CacheOffset(1_044_480)),
    ];
    let disk = DeviceModel::disk();
    let read_done = service(&disk, 1 << 20, false);
    let ssd = DeviceModel::mercury_ssd();
    let (long, short) = (service(&ssd, 1_040_384, true), service(&ssd, 4096, true));
    assert!(long > short);
    // Eight channels: both runs start when the source read is done.
    let mut s = sim(ssd.clone());
    assert_eq!(s.population_io(0, 1 << 20, &runs), read_done + long);
    assert_eq!(s.res.cache_bytes_written, (1 << 20) - 4096);
    assert_eq!(s.res.source_bytes_read, 1 << 20);
    // One channel: the runs queue, and the last is also the latest.
    let mut s = sim(DeviceModel {
        channels: 1,
        ..ssd.clone()
    });
    assert_eq!(s.population_io(0, 1 << 20, &runs), read_done + long + short);
    // The device's busy time is the service times over the channels.
    assert_eq!(s.ssd.busy_ns(), long + short);
    let mut s = sim(ssd);
    s.population_io(0, 1 << 20, &runs);
    assert_eq!(s.ssd.busy_ns(), (long + short) / 8);
}

#[test]
fn histogram_mean_quantiles_and_merge() {
    let mut h = LatencyHistogram::new();
    assert_eq!((h.count(), h.mean(), h.quantile(0.99)), (0, 0.0, 0.0));
    for _ in 0..99 {
        h.record(1_000_000);
    }
    h.record(1_000_000_000);
    assert_eq!(h.count(), 100);
    assert!((h.mean() - (99.0 * 1e-3 + 1.0) / 100.0).abs() < 1e-12);
    // Quantiles are their bucket's upper bound: at most 2^(1/8) above the value.
    let p99 = h.quantile(0.99);
    assert!((1e-3..1e-3 * 1.091).contains(&p99), "{p99}");
    let max = h.quantile(1.0);
    assert!((1.0..1.091).contains(&max), "{max}");
    let mut g = LatencyHistogram::new();
    g.record(1_000_000_000);
    g.merge(&h);
    assert_eq!(g.count(), 101);
    assert!(g.quantile(0.99) >= 1.0);
}
