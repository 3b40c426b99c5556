//! The in-memory store (`sce_coord::mem`): the same assertions as the real etcd's
//! (`common/mod.rs`), then its faults: a paused client waits and times out, a held answer
//! is applied but lost, a partitioned client fails and its watch ends, a host's leases
//! expire on command or with the clock.

mod common;

use sce_coord::{Coord, EtcdError, MemEtcd};
use std::time::{Duration, Instant};

#[test]
fn the_store_semantics_sce_relies_on() {
    let m = MemEtcd::new();
    let f = m.faults();
    let e = m.client(&f, Duration::from_secs(2));
    common::keys_and_revisions(&e, "/t/keys");
    common::transactions(&e, "/t/txn");
    common::history_and_watches(&e, "/t/hist");
    common::leases(&e, "/t/lease", &|id| assert!(m.expire_lease(id)));
    common::compaction(&e, "/t/compact");
    // The same through a boxed client (what a host's threads hold).
    let boxed: Box<dyn Coord> = Box::new(m.client(&f, Duration::from_secs(2)));
    common::transactions(&boxed, "/t/boxed");
}

/// A lease not renewed within its TTL expires when the clock moves past it; one renewed
/// does not. On the real clock, it expires by itself.
#[test]
fn leases_follow_the_clock() {
    let m = MemEtcd::new();
    let (fa, fb) = (m.faults(), m.faults());
    let (a, b) = (
        m.client(&fa, Duration::from_secs(1)),
        m.client(&fb, Duration::from_secs(1)),
    );
    let (la, lb) = (a.grant(5).unwrap(), b.grant(5).unwrap());
    a.put(b"/h/a", b"", la).unwrap();
    b.put(b"/h/b", b"", lb).unwrap();
    m.advance(Duration::from_secs(4));
    assert_eq!(a.keep_alive(la).unwrap(), 5);
    m.advance(Duration::from_secs(2));
    assert!(m.has_lease(la) && !m.has_lease(lb));
    assert_eq!(m.last_expiry_of(&fb), Some(m.revision()));
    assert_eq!(m.last_expiry_of(&fa), None);
    assert_eq!(b.get(b"/h/b").unwrap(), None);
    assert_eq!(m.leases_of(&fa), vec![la]);
    assert_eq!(m.expire_leases_of(&fa), Some(m.revision()));
    assert_eq!(m.expire_leases_of(&fa), None);
    assert_eq!(a.get(b"/h/a").unwrap(), None);
    let real = MemEtcd::with_real_clock();
    let f = real.faults();
    let c = real.client(&f, Duration::from_secs(1));
    let l = c.grant(1).unwrap();
    c.put(b"/r", b"", l).unwrap();
    sce_testkit::wait_until("a lease on the real clock never expired", 30, || {
        c.get(b"/r").unwrap().is_none()
    });
}

/// Pause: calls wait until resumed (then go through), or fail after the client's timeout;
/// a watch goes quiet meanwhile and then delivers what it missed. Held answers: the change
/// is made, the caller hears of it only when released, or times out not knowing. A
/// partition fails calls at once and ends watches. Other domains are not touched.
#[test]
fn pauses_held_answers_and_partitions() {
    let m = MemEtcd::new();
    let (fa, fb) = (m.faults(), m.faults());
    let a = m.client(&fa, Duration::from_millis(300));
    let b = m.client(&fb, Duration::from_secs(5));
    let mut w = a.watch_prefix(b"/k/", 0).unwrap();
    fa.pause();
    let t0 = Instant::now();
    assert!(matches!(
        a.put(b"/k/1", b"", 0),
        Err(EtcdError::Unreachable(_))
    ));
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert_eq!(
        b.get(b"/k/1").unwrap(),
        None,
        "a paused call reached the store"
    );
    let r = b.put(b"/k/2", b"", 0).unwrap();
    assert!(w
        .next_events(Duration::from_millis(100))
        .unwrap()
        .is_empty());
    // Resumed while a call waits: it goes through.
    let waiter = {
        let c = m.client(&fa, Duration::from_secs(30));
        std::thread::spawn(move || c.put(b"/k/3", b"", 0))
    };
    std::thread::sleep(Duration::from_millis(50));
    fa.heal();
    let r3 = waiter.join().unwrap().unwrap();
    assert_eq!(
        common::collect(&mut w, 2)
            .iter()
            .map(|e| e.revision())
            .collect::<Vec<_>>(),
        vec![r, r3]
    );
    // Held answers: applied, but the caller times out.
    fa.hold_replies();
    assert!(a.put(b"/k/4", b"held", 0).is_err());
    assert_eq!(b.get(b"/k/4").unwrap(), Some(b"held".to_vec()));
    fa.heal();
    // Partitioned: at once, and the watch ends.
    fa.partition();
    let t0 = Instant::now();
    assert!(matches!(a.get(b"/k/4"), Err(EtcdError::Unreachable(_))));
    assert!(t0.elapsed() < Duration::from_millis(300));
    assert!(w.next_events(Duration::from_millis(100)).is_err());
    assert!(a.watch_prefix(b"/k/", 0).is_err());
    assert!(b.put(b"/k/5", b"", 0).is_ok(), "another domain was cut");
    assert!(fa.failed() >= 4, "{}", fa.failed());
    fa.heal();
    assert_eq!(a.get(b"/k/5").unwrap(), Some(Vec::new()));
}
