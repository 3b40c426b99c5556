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

/// Two (three) hosts writing one region at once: the first to write owns it; the second's
/// write is contended (today's per-write rule) and makes the owner release it at once; from
/// then on nobody owns it, every write is published (the same cost), and every host caches
/// it: their reads of a page nobody writes hit.
#[test]
fn hosts_writing_one_region_at_once_leave_it_nobodys_and_all_cache_it() {
    for hosts in [2u64, 3] {
        let mut s = stack(hosts as usize, true);
        for i in 0..300 {
            let h = i % hosts;
            s.request(h as usize, i * MS, Write, (1 + h) * PAGE, PAGE);
            s.request(h as usize, i * MS, Read, 64 * PAGE, PAGE);
        }
        let o = s.owners.as_ref().expect("ownership on");
        assert_eq!(o.owner(0), None, "{hosts} hosts");
        // Each host caches the page nobody writes and its own last write.
        let own = |h: usize| (1 + h as u64) * PAGE;
        assert!((0..hosts as usize).all(|h| cached(&s, h, 64 * PAGE) && cached(&s, h, own(h))));
        let r = s.finish();
        assert_eq!(
            (r.writes, r.owned_writes, r.contended_writes),
            (300, 1, 299)
        );
        assert_eq!((r.region_acquisitions, r.publications), (1, 299));
        assert_eq!((r.region_releases, r.contention_releases), (1, 1));
        // Every published write costs exactly the per-write rule, `hosts` ops; the one
        // acquisition and the one release `hosts` each.
        assert_eq!(r.acknowledgements, (1 + 299 + 1) * (hosts - 1));
        assert_eq!(r.coherence_ops(), (1 + 299 + 1) * hosts);
        // Host 1's write was in its cache when host 0 released the region: dropped.
        assert_eq!(r.release_invalidations, 1);
        // Each host misses its first read only; none is bypassed.
        assert_eq!((r.read_pages, r.read_pages_bypassed), (300, 0));
        assert_eq!(r.read_hits, 300 - hosts, "{hosts} hosts");
    }
}

/// A region two hosts write in turn, each for longer than the idle time, moves from one to
/// the other: the newcomer's first write is contended and the owner releases the region;
/// the newcomer publishes until its own mark of contention lapses, then acquires it.
#[test]
fn a_region_written_in_long_turns_moves_between_the_hosts() {
    let mut s = stack(2, true);
    for turn in 0..4u64 {
        let h = (turn % 2) as usize;
        for j in 0..300 {
            s.request(
                h,
                turn * 3000 * MS + j * 10 * MS,
                Write,
                (j % 200) * PAGE,
                PAGE,
            );
        }
        let o = s.owners.as_ref().expect("ownership on");
        assert_eq!(o.owner(0), Some(h), "turn {turn}");
    }
    let r = s.finish();
    // The first turn owned throughout; each later one published for 1 s (100 writes), then
    // owned: 200 writes.
    assert_eq!(
        (r.owned_writes, r.contended_writes),
        (300 + 3 * 200, 3 * 100)
    );
    assert_eq!((r.region_acquisitions, r.region_releases), (4, 3));
    assert_eq!(r.contention_releases, 3);
    // With a pause longer than the idle time between the turns, the owner releases the
    // region idle and the next writer acquires it at once: every write owned.
    let mut s = stack(2, true);
    for turn in 0..4u64 {
        for j in 0..300 {
            let at = turn * 5000 * MS + j * 10 * MS;
            s.request((turn % 2) as usize, at, Write, (j % 200) * PAGE, PAGE);
        }
    }
    let r = s.finish();
    assert_eq!((r.owned_writes, r.contended_writes), (1200, 0));
    assert_eq!((r.region_acquisitions, r.region_releases), (4, 3));
    assert_eq!(r.contention_releases, 0);
}

/// A write over several regions takes them in order, as the server's does, and stops at
/// the first it cannot take: the free regions before it are acquired (and stay the
/// writer's), those after it are not; the write is published, and the other hosts release
/// the regions of it they own.
#[test]
fn a_write_over_several_regions_takes_them_in_order_until_one_fails() {
    let mut s = stack(2, true);
    s.request(1, 0, Write, MIB, PAGE); // host 1 owns region 1
    s.request(0, MS, Write, MIB - PAGE, 2 * PAGE); // region 0 free, region 1 host 1's
    let o = s.owners.as_ref().expect("ownership on");
    assert_eq!((o.owner(0), o.owner(1)), (Some(0), None));
    s.request(1, 2 * MS, Write, 3 * MIB, PAGE); // host 1 owns region 3
    s.request(0, 3 * MS, Write, 3 * MIB - PAGE, 2 * PAGE); // region 2 free, region 3 not
    s.request(0, 4 * MS, Write, 4 * MIB - PAGE, 2 * PAGE); // region 3 contended for host 0
    let o = s.owners.as_ref().expect("ownership on");
    assert_eq!((o.owner(2), o.owner(3), o.owner(4)), (Some(0), None, None));
    let r = s.finish();
    assert_eq!((r.owned_writes, r.contended_writes), (2, 3));
    assert_eq!((r.region_acquisitions, r.region_releases), (4, 2));
    assert_eq!(r.contention_releases, 2);
}

/// One writer keeps its region however often another host reads it: no publication, and
/// the reader's reads go to the source.
#[test]
fn a_lone_writer_keeps_its_region_while_another_host_reads_it() {
    let mut s = stack(2, true);
    for i in 0..5000 {
        s.request(0, i * MS, Write, (i % 100) * PAGE, PAGE);
        s.request(1, i * MS, Read, (i % 100) * PAGE, PAGE);
    }
    let r = s.finish();
    assert_eq!((r.owned_writes, r.contended_writes), (5000, 0));
    assert_eq!((r.region_acquisitions, r.region_releases), (1, 0));
    assert_eq!((r.read_pages_bypassed, r.read_hits), (5000, 0));
    assert_eq!(r.coherence_ops(), 2);
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
/// another host can then take it, and the former owner's reads go to the source.
#[test]
fn an_idle_region_is_released_and_the_other_host_can_take_it() {
    let mut s = stack(2, true);
    s.request(0, 0, Write, 0, PAGE); // host 0 acquires region 0
    s.request(1, 600 * MS, Read, PAGE, PAGE); // bypassed: host 0 owns the region
    s.request(0, 999 * MS, Read, 0, PAGE); // host 0's own region: a hit
    assert_eq!(s.owners.as_ref().and_then(|o| o.owner(0)), Some(0));
    // Exactly the idle time after host 0's last write: released; host 1 acquires it with
    // its write, and host 0 drops the region.
    s.request(1, 1000 * MS, Write, 2 * PAGE, PAGE);
    assert!(!cached(&s, 0, 0), "host 0 dropped region 0");
    s.request(1, 1100 * MS, Read, 2 * PAGE, PAGE); // now host 1's: a hit
    s.request(0, 1200 * MS, Read, 0, PAGE); // now bypassed for host 0
    let r = s.finish();
    assert_eq!((r.region_acquisitions, r.region_releases), (2, 1));
    assert_eq!((r.owned_writes, r.contended_writes), (2, 0));
    assert_eq!((r.contention_releases, r.release_invalidations), (0, 0));
    assert_eq!((r.invalidations, r.writes_invalidating), (1, 1));
    assert_eq!((r.read_hits, r.read_pages_bypassed), (2, 2));
    // Two acquisitions and one release: 1 op + 1 ack each.
    assert_eq!(r.coherence_ops(), 6);
    assert_eq!(r.coherence_ops_per_write(), 3.0);
    assert_eq!(r.coherence_puts_per_write(), 2.5);
}

/// Without ownership every write is published and the counts are today's: the example of
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

/// Regions are released oldest first once their owner has not written them for the idle
/// time, each once (the table's test before the hosts ran the server's machine); the
/// regions of a range, and the settings' checks.
#[test]
fn regions_are_released_oldest_first_once_idle() {
    let mut s = stack(2, true);
    let o = s.owners.as_ref().expect("ownership on");
    assert_eq!(o.regions(0, 0), 0..0);
    assert_eq!(o.regions(MIB - 1, 2), 0..2);
    assert_eq!(o.regions(3 * MIB, MIB), 3..4);
    s.request(1, 10 * MS, Write, 5 * MIB, PAGE); // acquired
    s.request(0, 20 * MS, Write, 2 * MIB, PAGE);
    s.request(1, 30 * MS, Write, 5 * MIB, PAGE); // owned: no acquisition
    let owners = |s: &Stack| {
        let o = s.owners.as_ref().expect("ownership on");
        (o.owner(5), o.owner(2), o.len())
    };
    assert_eq!(owners(&s), (Some(1), Some(0), 2));
    s.request(0, 1019 * MS, Read, 9 * MIB, PAGE);
    assert_eq!(
        owners(&s),
        (Some(1), Some(0), 2),
        "region 2 idle for 999 ms"
    );
    s.request(0, 1020 * MS, Read, 9 * MIB, PAGE);
    assert_eq!(owners(&s), (Some(1), None, 1));
    s.request(0, 1029 * MS, Read, 9 * MIB, PAGE);
    assert_eq!(
        owners(&s),
        (Some(1), None, 1),
        "region 5 was rewritten at 30 ms"
    );
    s.request(0, 1030 * MS, Read, 9 * MIB, PAGE);
    assert_eq!(owners(&s), (None, None, 0));
    let r = s.finish();
    assert_eq!((r.owned_writes, r.region_acquisitions), (3, 2));
    assert_eq!((r.region_releases, r.contention_releases), (2, 0));
    assert!(Ownership::new(1000, 1.0).is_err());
    assert!(Ownership::new(4096, -1.0).is_err());
    assert_eq!(Ownership::new(1 << 30, 10.0), Ok(Ownership::default()));
}

/// A write over more than `MAX_OWNED_SPAN` regions is published, as the server's is
/// (the simulator's own rule took them all before it ran the server's machine).
#[test]
fn a_write_over_too_many_regions_is_published() {
    let span = sce_core::regions::MAX_OWNED_SPAN;
    let mut s = stack(2, true);
    s.request(0, 0, Write, 0, (span + 1) * MIB);
    s.request(0, MS, Write, 0, span * MIB);
    let r = s.finish();
    assert_eq!((r.owned_writes, r.contended_writes), (1, 1));
    assert_eq!(r.region_acquisitions, span);
}
