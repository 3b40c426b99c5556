//! Tests of the stack under shared mode's ownership of regions (issue 31).

use super::*;
use crate::engine::{DeviceModel, EngineSim};
use crate::reference::BlockCache;
use crate::request::IoKind::{Read, Write};
use crate::ReferencePolicy;

const MIB: u64 = 1 << 20;
const MS: u64 = 1_000_000;

fn lru() -> Host {
    Host::new(
        Flash::Reference(Box::new(BlockCache::new(ReferencePolicy::Lru, 1024))),
        None,
    )
}

/// `hosts` LRU hosts with regions of 1 MiB released after 1 s idle (`on`), or the
/// per-write rule.
fn stack(hosts: usize, on: bool) -> Stack {
    let rule = Ownership {
        region_size: MIB,
        idle_ns: 1000 * MS,
    };
    Stack::new((0..hosts).map(|_| lru()).collect(), 1.0).with_ownership(on.then_some(rule))
}

fn cached(s: &Stack, host: usize, offset: u64) -> bool {
    match &s.hosts[host].flash {
        Flash::Reference(c) => c.contains(offset / PAGE),
        Flash::Engine(_) => unreachable!("reference hosts"),
    }
}

/// One host pays for acquiring its region once, not per write: a thousand writes to one
/// region are one etcd transaction.
#[test]
fn one_host_pays_only_for_acquiring_its_region() {
    let mut s = stack(1, true);
    for i in 0..1000 {
        s.request(0, i * MS, Write, (i % 200) * PAGE, PAGE);
    }
    let r = s.finish();
    assert_eq!(
        (r.writes, r.owned_writes, r.contended_writes),
        (1000, 1000, 0)
    );
    assert_eq!((r.region_acquisitions, r.region_releases), (1, 0));
    assert_eq!((r.publications, r.acknowledgements), (0, 0));
    assert_eq!(r.coherence_ops_per_write(), 0.001);
    // Without ownership every write is published: one put each, no other host to ack.
    let mut s = stack(1, false);
    for i in 0..1000 {
        s.request(0, i * MS, Write, (i % 200) * PAGE, PAGE);
    }
    let r = s.finish();
    assert_eq!((r.owned_writes, r.contended_writes), (0, 1000));
    assert_eq!(r.coherence_ops_per_write(), 1.0);
}

/// Two hosts, each on its own region: no write is contended, neither host drops the
/// other's data, and each keeps hitting its own.
#[test]
fn hosts_on_disjoint_regions_neither_contend_nor_drop_each_others_data() {
    let mut s = stack(2, true);
    for i in 0..100 {
        for h in 0..2u64 {
            let at = h * MIB + (i % 10) * PAGE;
            s.request(h as usize, (2 * i + h) * MS, Write, at, PAGE);
            s.request(h as usize, (2 * i + h) * MS, Read, at, PAGE);
        }
    }
    assert!(cached(&s, 0, 0) && cached(&s, 1, MIB));
    let r = s.finish();
    assert_eq!(
        (r.writes, r.owned_writes, r.contended_writes),
        (200, 200, 0)
    );
    assert_eq!((r.invalidations, r.release_invalidations), (0, 0));
    assert_eq!(
        (r.read_hits, r.read_pages, r.read_pages_bypassed),
        (200, 200, 0)
    );
    // Two acquisitions, each acknowledged by the other host.
    assert_eq!((r.region_acquisitions, r.acknowledgements), (2, 2));
    assert_eq!(r.coherence_ops(), 4);
}

/// Two (three) hosts writing one region at once: the first to write owns it, and every
/// write of the others costs today's per-write rule (a publication, an acknowledgement
/// per other host) and drops the written range from the owner.
#[test]
fn hosts_writing_one_region_at_once_pay_the_per_write_rule() {
    for hosts in [2u64, 3] {
        let mut s = stack(hosts as usize, true);
        for i in 0..300 {
            let h = i % hosts;
            s.request(0, i * MS, Read, PAGE, PAGE);
            s.request(h as usize, i * MS, Write, PAGE, PAGE);
        }
        let r = s.finish();
        let contended = 300 - 300 / hosts;
        assert_eq!(r.owned_writes, 300 / hosts, "{hosts} hosts");
        assert_eq!((r.contended_writes, r.publications), (contended, contended));
        assert_eq!(r.region_acquisitions, 1);
        assert_eq!(r.acknowledgements, (contended + 1) * (hosts - 1));
        // Each contended write is exactly the per-write rule's cost, `hosts` ops.
        let ops = r.coherence_ops() - r.region_acquisitions * hosts;
        assert_eq!(ops, contended * hosts);
        // Host 0 owns the page and reads it before every write: each of the others'
        // writes drops it, and the next read misses; after its own writes it hits.
        assert_eq!(r.writes_invalidating, contended);
        let own_before = (0..299).filter(|i| i % hosts == 0).count() as u64;
        assert_eq!(r.read_hits, own_before, "{hosts} hosts");
    }
}

/// A host reads a region another host owns from the source, never from its caches, and
/// does not fill them; the rest of the same read is cached as usual.
#[test]
fn reads_of_a_region_another_host_owns_never_hit() {
    let mut s = stack(2, true);
    s.request(1, 0, Read, 0, 2 * PAGE);
    s.request(0, MS, Write, 8 * PAGE, PAGE); // host 0 takes region 0: host 1 drops it
    assert!(!cached(&s, 1, 0), "dropped on acquisition");
    for i in 0..5 {
        // Host 1 reads the last two pages of region 0 and the first two of region 1.
        s.request(1, (2 + i) * MS, Read, MIB - 2 * PAGE, 4 * PAGE);
    }
    assert!(!cached(&s, 1, MIB - PAGE), "nothing filled from region 0");
    assert!(cached(&s, 1, MIB), "region 1 is cached");
    let r = s.finish();
    assert_eq!((r.read_pages, r.read_pages_bypassed), (2 + 20, 10));
    assert_eq!(
        r.read_hits,
        4 * 2,
        "region 1's pages, from the second read on"
    );
}

/// The same with the engine: its reads of another host's region go to the source.
#[test]
fn an_engine_host_reads_another_hosts_region_from_the_source() {
    let engine = || {
        let e = EngineSim::new(
            sce_core::CoreConfig::default(),
            64 * MIB,
            16 * MIB,
            DeviceModel::mercury_ssd(),
            DeviceModel::disk(),
            1.0,
        );
        Host::new(Flash::Engine(Box::new(e.expect("valid"))), None)
    };
    let rule = Ownership {
        region_size: 4 * MIB,
        idle_ns: 1000 * MS,
    };
    let mut s = Stack::new(vec![engine(), engine()], 1.0).with_ownership(Some(rule));
    s.request(0, 0, Write, 0, PAGE);
    for i in 1..200 {
        s.request(1, i * MS, Read, (i % 4) * PAGE, PAGE);
    }
    let r = s.finish();
    assert_eq!(
        (r.read_pages, r.read_pages_bypassed, r.read_hits),
        (199, 199, 0)
    );
    assert_eq!(r.engines[1].source_bytes_read, 199 * PAGE);
    assert_eq!(r.engines[1].fragments_populated, 0);
    assert_eq!(
        r.read_latency.count(),
        199,
        "their latencies are the reads'"
    );
}

/// An owner that stops writing its region releases it after the idle time (not before);
/// the other hosts drop the region again, and another host can then take it.
#[test]
fn an_idle_region_is_released_and_the_other_host_can_take_it() {
    let mut s = stack(2, true);
    s.request(0, 0, Write, 0, PAGE); // host 0 acquires region 0
    s.request(1, 500 * MS, Write, PAGE, PAGE); // contended: host 1 caches its write
    s.request(1, 600 * MS, Read, PAGE, PAGE); // bypassed: host 0 owns the region
    s.request(0, 999 * MS, Read, 0, PAGE); // host 0's own region: a hit
    assert!(cached(&s, 1, PAGE));
    // Exactly the idle time after host 0's last write: released, host 1 drops the region,
    // then acquires it with its write.
    s.request(1, 1000 * MS, Write, 2 * PAGE, PAGE);
    assert!(
        !cached(&s, 1, PAGE) && !cached(&s, 0, 0),
        "both dropped region 0"
    );
    s.request(1, 1100 * MS, Read, 2 * PAGE, PAGE); // now host 1's: a hit
    s.request(0, 1200 * MS, Read, 0, PAGE); // now bypassed for host 0
    let r = s.finish();
    assert_eq!((r.region_acquisitions, r.region_releases), (2, 1));
    assert_eq!((r.owned_writes, r.contended_writes), (2, 1));
    assert_eq!(
        r.release_invalidations, 1,
        "host 1 held its contended write"
    );
    assert_eq!((r.read_hits, r.read_pages_bypassed), (2, 2));
    // Two acquisitions, one release, one contended write: 1 op + 1 ack each.
    assert_eq!(r.coherence_ops(), 8);
    assert!((r.coherence_ops_per_write() - 8.0 / 3.0).abs() < 1e-12);
    assert!((r.coherence_puts_per_write() - 7.0 / 3.0).abs() < 1e-12);
}

/// Without ownership every write is contended and the counts are today's: the example of
/// `a_write_invalidates_the_other_hosts_copies`, and `hosts` puts per write.
#[test]
fn ownership_off_is_the_per_write_rule() {
    for hosts in [2u64, 3] {
        let mut s = stack(hosts as usize, false);
        s.request(0, 0, Read, 0, 8192);
        s.request(1, 1, Read, 0, 4096);
        s.request(1, 2, Write, 4096, 4096);
        s.request(0, 3, Read, 0, 8192);
        s.request(0, 4, Write, 1 << 20, 4096);
        let r = s.finish();
        assert_eq!(
            (r.writes, r.writes_invalidating, r.invalidations),
            (2, 1, 1)
        );
        assert_eq!(
            (r.read_hits, r.read_pages, r.read_pages_bypassed),
            (1, 5, 0)
        );
        assert_eq!((r.owned_writes, r.contended_writes), (0, 2));
        assert_eq!((r.region_acquisitions, r.region_releases), (0, 0));
        assert_eq!(r.coherence_ops_per_write(), hosts as f64);
        assert_eq!(r.coherence_puts_per_write(), hosts as f64);
    }
}
