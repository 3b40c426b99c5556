//! Tests of the generator.

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

    let shared = |disjoint| -> Vec<_> {
        Generator::new(cfg(Workload::Shared {
            base: ZipfParams::oltp(1 << 30),
            hosts: 3,
            disjoint,
        }))
        .unwrap()
        .collect()
    };
    let (one, own) = (shared(false), shared(true));
    assert!(one
        .iter()
        .all(|r| r.volume < 3 && r.offset + r.len <= 1 << 30));
    assert!((0..3).all(|h| one.iter().filter(|r| r.volume == h).count() > 6000));
    // Disjoint: the same requests, each host's moved to its own GiB.
    assert_eq!(one.len(), own.len());
    assert!(one.iter().zip(&own).all(|(a, b)| b.volume == a.volume
        && b.offset == a.offset + ((a.volume as u64) << 30)
        && (b.time_ns, b.kind, b.len) == (a.time_ns, a.kind, a.len)));

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

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn run(workload: Workload, requests: u64, seed: u64) -> Vec<TraceRequest> {
    Generator::new(GenConfig {
        workload,
        requests,
        iops: 1000.0,
        seed,
    })
    .unwrap()
    .collect()
}

fn hotscan(scan_size: u64) -> Workload {
    Workload::HotScan {
        base: ZipfParams::oltp(GIB),
        scan: ScanBurst {
            size: scan_size,
            request: 256 * KIB,
            duration: 5.0,
        },
        every: 20.0,
    }
}

/// Takes the Zipf requests out: what is left must be the plain `oltp` trace's start.
fn assert_zipf_part_is_oltp(trace: &[TraceRequest], zipf: &[&TraceRequest], seed: u64) {
    let oltp = run(
        Workload::Zipf(ZipfParams::oltp(GIB)),
        zipf.len() as u64,
        seed,
    );
    assert_eq!(zipf.len(), oltp.len());
    assert!(zipf.iter().zip(&oltp).all(|(a, b)| **a == *b));
    assert!(trace.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
}

#[test]
fn hotscan_has_periodic_sequential_bursts() {
    // 60,000 requests at 1000/s of Zipf: about 59 s, so scans start at 20 s and 40 s.
    let t = run(hotscan(64 * MIB), 60_000, 3);
    assert_eq!(t.len(), 60_000);
    let (scan, zipf): (Vec<&TraceRequest>, Vec<_>) = t.iter().partition(|r| r.len == 256 * KIB);
    assert_eq!(scan.len(), 2 * 256, "two scans of 64 MiB in 256 KiB");
    assert!(zipf.iter().all(|r| r.len == 8192 && r.offset < GIB));
    assert!(scan.iter().all(|r| r.kind == IoKind::Read));
    // One sweep over the volume: the second scan continues where the first ended.
    for (i, r) in scan.iter().enumerate() {
        assert_eq!(r.offset, i as u64 * 256 * KIB, "scan request {i}");
    }
    // Scan k runs from 20k s for 5 s, evenly: request j at 20k + j * 5/256 s.
    for (i, r) in scan.iter().enumerate() {
        let (k, j) = (i as u64 / 256 + 1, i as u64 % 256);
        let want = k as f64 * 20.0 + j as f64 * 5.0 / 256.0;
        assert!((r.time_ns as f64 / 1e9 - want).abs() < 1e-6, "{i}: {r:?}");
    }
    // Interleaved: Zipf requests keep arriving during a scan.
    let during = zipf
        .iter()
        .filter(|r| (20e9..25e9).contains(&(r.time_ns as f64)))
        .count();
    assert!((4000..6000).contains(&during), "{during}");
    assert_zipf_part_is_oltp(&t, &zipf, 3);

    // The sweep wraps where a request would pass the end of the volume.
    let w = run(hotscan(GIB - 128 * KIB), 60_000, 3);
    let scan: Vec<_> = w.iter().filter(|r| r.len >= 128 * KIB).collect();
    assert_eq!(scan.len(), 2 * 4096);
    assert_eq!(
        scan[4095].len,
        128 * KIB,
        "the last request of a scan is shorter"
    );
    assert_eq!(scan[4095].offset, GIB - 256 * KIB);
    // The second scan starts at GiB - 128 KiB, where 256 KiB does not fit: it wraps.
    assert_eq!(scan[4096].offset, 0);
    assert_eq!(scan[4097].offset, 256 * KIB);
}

#[test]
fn scanmid_has_one_scan_in_the_middle_outside_the_volume() {
    let mid = |seed| {
        run(
            Workload::MidScan {
                base: ZipfParams::oltp(GIB),
                scan: ScanBurst {
                    size: 128 * MIB,
                    request: 256 * KIB,
                    duration: 4.0,
                },
            },
            40_000,
            seed,
        )
    };
    let t = mid(5);
    assert_eq!(t.len(), 40_000);
    let at: Vec<usize> = (0..t.len()).filter(|&i| t[i].offset >= GIB).collect();
    assert_eq!(at.len(), 512, "128 MiB in 256 KiB requests");
    // The region rule and the size rule name the same requests.
    assert!(t.iter().all(|r| (r.offset >= GIB) == (r.len >= 64 * KIB)));
    for (j, &i) in at.iter().enumerate() {
        let r = &t[i];
        assert_eq!(r.kind, IoKind::Read);
        assert_eq!((r.offset, r.len), (GIB + j as u64 * 256 * KIB, 256 * KIB));
    }
    // In the middle: the Zipf run is 39,488 requests, about 39.5 s; the scan is 4 s
    // from 17.7 s; about as many Zipf requests before as after, ~4000 during.
    let (first, last) = (at[0], at[511]);
    let start = t[first].time_ns as f64 / 1e9;
    assert!((start - (39.488 - 4.0) / 2.0).abs() < 1e-6, "{start}");
    let before = first;
    let after = t.len() - 1 - last;
    let during = last - first + 1 - 512;
    assert!(
        before.abs_diff(after) < 1000,
        "{before} before, {after} after"
    );
    assert!(
        (3500..4500).contains(&during),
        "{during} Zipf requests during the scan"
    );
    let zipf: Vec<_> = t.iter().filter(|r| r.offset < GIB).collect();
    assert!(zipf.iter().all(|r| r.len == 8192));
    assert_zipf_part_is_oltp(&t, &zipf, 5);
    assert_eq!(t, mid(5), "same seed, same trace");
    assert_ne!(t, mid(6));

    // A size that 256 KiB does not divide: the last request carries the rest.
    let odd = run(
        Workload::MidScan {
            base: ZipfParams::oltp(GIB),
            scan: ScanBurst {
                size: MIB + 4 * KIB,
                request: 256 * KIB,
                duration: 1.0,
            },
        },
        1000,
        1,
    );
    let scan: Vec<_> = odd.iter().filter(|r| r.offset >= GIB).collect();
    assert_eq!(
        scan.iter().map(|r| r.len).collect::<Vec<_>>(),
        [256 * KIB, 256 * KIB, 256 * KIB, 256 * KIB, 4 * KIB]
    );
    assert_eq!(odd.len(), 1000);
}

#[test]
fn bad_scans_are_rejected() {
    let field = |w: Workload, requests| {
        Generator::new(GenConfig {
            workload: w,
            requests,
            iops: 1000.0,
            seed: 1,
        })
        .err()
        .map(|e| e.field)
    };
    let Workload::HotScan { base, scan, .. } = hotscan(64 * MIB) else {
        unreachable!()
    };
    let hot = |scan: ScanBurst, every| Workload::HotScan {
        base: base.clone(),
        scan,
        every,
    };
    assert_eq!(field(hot(scan.clone(), 20.0), 10), None);
    assert_eq!(field(hot(scan.clone(), 4.0), 10), Some("scan duration"));
    assert_eq!(field(hot(scan.clone(), 0.0), 10), Some("scan interval"));
    let big = ScanBurst {
        size: 2 * GIB,
        ..scan.clone()
    };
    assert_eq!(field(hot(big, 20.0), 10), Some("scan size"));
    let zero = ScanBurst {
        request: 0,
        ..scan.clone()
    };
    assert_eq!(field(hot(zero, 20.0), 10), Some("scan request size"));
    let mid = Workload::MidScan {
        base: base.clone(),
        scan: scan.clone(),
    };
    assert_eq!(field(mid.clone(), 256), None);
    assert_eq!(field(mid, 255), Some("scan size"), "256 scan requests");
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
        disjoint: false,
    }))
    .err()
    .unwrap();
    assert_eq!(e.field, "hosts");
}
