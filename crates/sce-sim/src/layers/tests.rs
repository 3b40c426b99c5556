//! Tests of the layers.

use super::*;
use crate::reference::BlockCache;
use crate::request::IoKind;
use crate::ReferencePolicy;

#[test]
fn volumes_are_separate_address_spaces() {
    let mut l = VolumeLayout::new(1 << 20);
    l.observe(7, 10);
    l.observe(3, (5 << 20) + 1);
    l.observe(7, 3 << 20);
    l.finish();
    assert_eq!(l.place(3, 0), Some(0));
    assert_eq!(
        l.place(7, 0),
        Some(6 << 20),
        "volume 3 spans 6 MiB, aligned"
    );
    assert_eq!(l.place(9, 0), None);
    assert_eq!(l.size(), 9 << 20);
    assert_eq!(l.volumes(), 2);
}

fn lru(blocks: usize) -> Flash {
    Flash::Reference(Box::new(BlockCache::new(ReferencePolicy::Lru, blocks)))
}

#[test]
fn a_write_invalidates_the_other_hosts_copies() {
    let mut s = Stack::new(vec![Host::new(lru(8), None), Host::new(lru(8), None)], 1.0);
    s.request(0, 0, IoKind::Read, 0, 8192);
    s.request(1, 1, IoKind::Read, 0, 4096);
    // Host 1 writes a block host 0 holds: one invalidation.
    s.request(1, 2, IoKind::Write, 4096, 4096);
    // Host 0 rereads: page 0 hits, page 1 was invalidated and misses.
    s.request(0, 3, IoKind::Read, 0, 8192);
    // A write to a block nobody else holds invalidates nothing.
    s.request(0, 4, IoKind::Write, 1 << 20, 4096);
    let r = s.finish();
    assert_eq!(
        (r.writes, r.writes_invalidating, r.invalidations),
        (2, 1, 1)
    );
    assert_eq!((r.read_hits, r.read_pages), (1, 5));
    assert_eq!(r.invalidations_per_write(), 0.5);
}

#[test]
fn ram_policies_decide_when_writes_reach_flash() {
    for (policy, after_write, at_end) in [
        (RamPolicy::Sync, 1, 1),
        (RamPolicy::Async, 1, 1),
        (RamPolicy::None, 0, 1),
        (RamPolicy::Periodic(10_000_000_000), 0, 1),
    ] {
        let mut s = Stack::new(
            vec![Host::new(lru(64), Some(RamCache::new(4 * PAGE, policy)))],
            1.0,
        );
        s.request(0, 0, IoKind::Write, 0, 4096);
        s.request(0, 1_000, IoKind::Write, 0, 4096);
        let down = s.hosts[0].ram.as_ref().unwrap().pages_written_down;
        assert_eq!(
            down,
            after_write * 2,
            "{policy:?}: write-through sends both writes"
        );
        // The period passes: a periodic RAM cache writes the page down once.
        s.request(0, 11_000_000_000, IoKind::Read, 1 << 20, 4096);
        let r = s.finish();
        let want = if after_write == 1 { 2 } else { at_end };
        assert_eq!(r.ram_pages_written_down, want, "{policy:?}");
    }
    // A modified page evicted from RAM goes down at once.
    let mut s = Stack::new(
        vec![Host::new(
            lru(64),
            Some(RamCache::new(PAGE, RamPolicy::None)),
        )],
        1.0,
    );
    s.request(0, 0, IoKind::Write, 0, 4096);
    s.request(0, 1, IoKind::Read, 8192, 4096);
    assert_eq!(s.hosts[0].ram.as_ref().unwrap().pages_written_down, 1);
    // RAM hits are not seen by the flash layer.
    s.request(0, 2, IoKind::Read, 8192, 4096);
    let r = s.finish();
    assert_eq!((r.read_pages, r.ram_hits, r.flash_read_pages), (2, 1, 1));
    assert_eq!(r.flash_read_hits, 0);
}

#[test]
fn ram_policy_parses() {
    assert_eq!(
        "periodic:30".parse(),
        Ok(RamPolicy::Periodic(30_000_000_000))
    );
    assert!("periodic:0".parse::<RamPolicy>().is_err());
    assert!("sometimes".parse::<RamPolicy>().is_err());
}

/// Flash writes of a reference policy count every 4 KiB it writes to the cache device: an
/// insertion, and a write that finds its block cached and rewrites it (issue 30: the
/// matrix counted insertions only, so LRU's writes looked a third of what they are on
/// cloudPhysics). Read hits write nothing.
#[test]
fn a_write_hit_in_a_reference_cache_counts_4_kib_of_flash_writes() {
    let mut s = Stack::new(vec![Host::new(lru(8), None)], 1.0);
    s.request(0, 0, IoKind::Read, 0, 8192); // two insertions
    s.request(0, 1, IoKind::Read, 0, 8192); // two read hits: nothing written
    s.request(0, 2, IoKind::Write, 4096, 4096); // a write hit: one update
    s.request(0, 3, IoKind::Write, 1 << 20, 8192); // two write misses: two insertions
    let r = s.finish();
    let written: u64 = r.interval_cache_bytes.iter().sum();
    assert_eq!(written, 5 * PAGE, "2 + 1 + 2 blocks");
    let mut c = BlockCache::new(ReferencePolicy::Lru, 4);
    assert_eq!(c.write(0, 12288), 3);
    assert_eq!(c.write(4096, 4096), 1);
    assert_eq!((c.inserts, c.updates, c.blocks_written()), (3, 1, 4));
    // LARC admits a block on its second miss: a first write to it writes nothing.
    let mut l = BlockCache::new(ReferencePolicy::Larc, 4);
    assert_eq!(l.write(0, 4096), 0);
    assert_eq!(l.blocks_written(), 0);
}
