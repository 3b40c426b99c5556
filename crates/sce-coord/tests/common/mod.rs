//! What sce relies on of its coordination store, as assertions over any [`Coord`]: run
//! against a real etcd cluster (`tests/etcd.rs`) and against the in-memory store
//! (`tests/mem.rs`), so that the fake is held to what the real one does. Each takes a
//! prefix of its own; `compaction` compacts the whole store, so it runs last.

#![allow(dead_code)]

use sce_coord::{Coord, EtcdError, Event, Watch};
use std::time::{Duration, Instant};

fn revs(events: &[Event]) -> Vec<i64> {
    events.iter().map(Event::revision).collect()
}

/// The events of `w` until `n` came (up to 20 s).
pub fn collect(w: &mut Watch, n: usize) -> Vec<Event> {
    let mut seen = Vec::new();
    let t0 = Instant::now();
    while seen.len() < n && t0.elapsed() < Duration::from_secs(20) {
        seen.extend(w.next_events(Duration::from_millis(500)).unwrap());
    }
    seen
}

/// Puts, exact gets, ranges in key order with their revisions, deletions.
pub fn keys_and_revisions(e: &dyn Coord, p: &str) {
    let k = |s: &str| format!("{p}/{s}").into_bytes();
    let r1 = e.put(&k("a"), b"one", 0).unwrap();
    let r2 = e.put(&k("b"), b"two", 0).unwrap();
    assert!(r2 > r1, "revisions grow: {r1} {r2}");
    let (kvs, rev) = e.range_prefix(&k("")).unwrap();
    assert_eq!(kvs.len(), 2);
    assert_eq!(
        (kvs[0].key.clone(), kvs[0].value.clone()),
        (k("a"), b"one".to_vec())
    );
    assert_eq!((kvs[0].mod_revision, kvs[1].mod_revision), (r1, r2));
    assert!(rev >= r2);
    // One key exactly: not another that it is a prefix of.
    e.put(&k("h10"), b"ten", 0).unwrap();
    assert_eq!(e.get(&k("h1")).unwrap(), None);
    assert_eq!(e.get(&k("h10")).unwrap(), Some(b"ten".to_vec()));
    let kv = e.get_kv(&k("a")).unwrap().unwrap();
    assert_eq!((kv.mod_revision, kv.lease), (r1, 0));
    // Deleting an absent key is no error; a prefix goes whole, and only it.
    e.delete(&k("nothing")).unwrap();
    e.put(&k("sub/x"), b"x", 0).unwrap();
    e.put(&k("sub/y"), b"y", 0).unwrap();
    e.put(&k("subway"), b"z", 0).unwrap();
    e.delete_prefix(&k("sub/")).unwrap();
    let (kvs, _) = e.range_prefix(&k("sub")).unwrap();
    assert_eq!(
        kvs.iter().map(|kv| kv.key.clone()).collect::<Vec<_>>(),
        vec![k("subway")]
    );
    e.delete(&k("a")).unwrap();
    assert_eq!(e.get_kv(&k("a")).unwrap(), None);
}

/// Transactions: put only if absent or unchanged since a revision, with a second key at
/// the same revision; delete only if unchanged.
pub fn transactions(e: &dyn Coord, p: &str) {
    let k = |s: &str| format!("{p}/{s}").into_bytes();
    let r = e.put_if(&k("once"), b"first", 0, 0).unwrap().unwrap();
    let held = e.put_if(&k("once"), b"second", 0, 0).unwrap().unwrap_err();
    assert_eq!(
        held.map(|kv| (kv.value, kv.mod_revision)),
        Some((b"first".to_vec(), r))
    );
    assert_eq!(e.put_if(&k("gone"), b"v", 0, 7).unwrap(), Err(None));
    assert!(e.put_if(&k("once"), b"x", 0, r + 100).unwrap().is_err());
    let also = Some((&k("trace")[..], &b"3"[..]));
    let r2 = e
        .put_if_and(&k("once"), b"third", 0, r, also)
        .unwrap()
        .unwrap();
    assert!(r2 > r);
    assert_eq!(e.get_kv(&k("trace")).unwrap().unwrap().mod_revision, r2);
    assert_eq!(e.get(&k("once")).unwrap(), Some(b"third".to_vec()));
    // A failed transaction does not put `also`.
    let also = Some((&k("trace2")[..], &b"4"[..]));
    assert!(e.put_if_and(&k("once"), b"x", 0, r, also).unwrap().is_err());
    assert_eq!(e.get(&k("trace2")).unwrap(), None);
    assert!(
        !e.delete_if(&k("once"), r).unwrap(),
        "another revision's key"
    );
    assert!(!e.delete_if(&k("absent"), r).unwrap());
    assert!(e.delete_if(&k("once"), r2).unwrap());
    assert_eq!(e.get(&k("once")).unwrap(), None);
}

/// History: a range at a past revision, and a watch from a revision sees every change
/// after it in order (puts and deletions), then the new ones.
pub fn history_and_watches(e: &dyn Coord, p: &str) {
    let k = |s: &str| format!("{p}/{s}").into_bytes();
    let r1 = e.put(&k("a"), b"one", 0).unwrap();
    let r2 = e.put(&k("b"), b"two", 0).unwrap();
    e.delete(&k("a")).unwrap();
    let (_, r3) = e.range_prefix(&k("")).unwrap();
    assert_eq!(e.range_prefix_at(&k(""), r1).unwrap().len(), 1);
    let at2 = e.range_prefix_at(&k(""), r2).unwrap();
    assert_eq!(
        at2.iter().map(|kv| kv.mod_revision).collect::<Vec<_>>(),
        vec![r1, r2]
    );
    assert_eq!(e.range_prefix_at(&k(""), r3).unwrap().len(), 1);
    // Another prefix's changes are not this watch's.
    e.put(format!("{p}x/other").as_bytes(), b"o", 0).unwrap();
    let mut w = e.watch_prefix(&k(""), r1).unwrap();
    let seen = collect(&mut w, 3);
    assert_eq!(revs(&seen), vec![r1, r2, r3], "{seen:?}");
    assert!(
        matches!(&seen[2], Event::Delete { key, .. } if *key == k("a")),
        "{seen:?}"
    );
    // From now on (0): only what comes next.
    let mut now = e.watch_prefix(&k(""), 0).unwrap();
    let r4 = e.put(&k("c"), b"three", 0).unwrap();
    assert_eq!(revs(&collect(&mut w, 1)), vec![r4]);
    assert_eq!(revs(&collect(&mut now, 1)), vec![r4]);
    // Nothing more: an empty batch after the timeout, not an error.
    assert!(w
        .next_events(Duration::from_millis(300))
        .unwrap()
        .is_empty());
}

/// Leases: a key under a lease goes with it (revoked, or expired by `expire`, which
/// returns once the store expired it), and a watch sees that deletion; a lease that is gone
/// renews to 0; a put under an unknown lease fails.
pub fn leases(e: &dyn Coord, p: &str, expire: &dyn Fn(i64)) {
    let k = |s: &str| format!("{p}/{s}").into_bytes();
    let l = e.grant(30).unwrap();
    let r = e.put(&k("h1"), b"alive", l).unwrap();
    assert_eq!(e.get_kv(&k("h1")).unwrap().unwrap().lease, l);
    assert!(e.keep_alive(l).unwrap() > 0);
    e.put(&k("free"), b"f", 0).unwrap();
    let mut w = e.watch_prefix(&k(""), r + 1).unwrap();
    e.revoke(l).unwrap();
    assert_eq!(e.get(&k("h1")).unwrap(), None);
    assert_eq!(e.get(&k("free")).unwrap(), Some(b"f".to_vec()));
    assert!(e.keep_alive(l).unwrap() <= 0, "a revoked lease renewed");
    assert!(e.revoke(l).is_err(), "a revoked lease revoked again");
    assert!(
        e.put(&k("x"), b"x", l).is_err(),
        "a put under a revoked lease"
    );
    let seen = collect(&mut w, 2);
    assert!(
        matches!(&seen[1], Event::Delete { key, .. } if *key == k("h1")),
        "{seen:?}"
    );
    // Expired: its keys go too, and the lease renews to 0.
    let l2 = e.grant(2).unwrap();
    e.put(&k("h2"), b"alive", l2).unwrap();
    e.put(&k("h3"), b"alive", l2).unwrap();
    expire(l2);
    let (kvs, _) = e.range_prefix(&k("h")).unwrap();
    assert!(kvs.is_empty(), "{kvs:?}");
    assert!(e.keep_alive(l2).unwrap() <= 0);
    // Both keys went at one revision.
    let seen = collect(&mut w, 4);
    let dels: Vec<i64> = seen[2..].iter().map(Event::revision).collect();
    assert_eq!(dels.len(), 2);
    assert_eq!(dels[0], dels[1], "{seen:?}");
}

/// Compaction: history before the compacted revision is gone for ranges and watches, with
/// [`EtcdError::Compacted`]; at it and after, it is there.
pub fn compaction(e: &dyn Coord, p: &str) {
    let k = |s: &str| format!("{p}/{s}").into_bytes();
    let r1 = e.put(&k("a"), b"1", 0).unwrap();
    let r2 = e.put(&k("a"), b"2", 0).unwrap();
    let r3 = e.put(&k("b"), b"3", 0).unwrap();
    e.compact(r2).unwrap();
    match e.range_prefix_at(&k(""), r1) {
        Err(EtcdError::Compacted(r)) => assert_eq!(r, r1),
        other => panic!("a read of compacted history: {other:?}"),
    }
    let at2 = e.range_prefix_at(&k(""), r2).unwrap();
    assert_eq!(at2.len(), 1);
    assert_eq!(
        (at2[0].value.clone(), at2[0].mod_revision),
        (b"2".to_vec(), r2)
    );
    // A watch from before the compaction fails when it starts or at its first batch.
    match e.watch_prefix(&k(""), r1) {
        Err(EtcdError::Compacted(r)) => assert!(r >= r1, "{r}"),
        Err(e) => panic!("a watch from a compacted revision: {e}"),
        Ok(mut w) => {
            let got = w.next_events(Duration::from_secs(5));
            assert!(matches!(got, Err(EtcdError::Compacted(_))), "{got:?}");
        }
    }
    let mut w = e.watch_prefix(&k(""), r2).unwrap();
    assert_eq!(revs(&collect(&mut w, 2)), vec![r2, r3]);
    assert!(e.compact(r1).is_err(), "compacting an older revision again");
}
