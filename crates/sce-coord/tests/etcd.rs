//! The etcd client against a real three-member etcd cluster on loopback (Debian's
//! etcd-server): keys and revisions, a lease that expires when it is not kept alive, a
//! watch from a revision, and a member killed while the cluster serves on.

mod common;

use sce_coord::{Coord, Etcd, Event};
use sce_testkit::etcd::Cluster;
use sce_testkit::wait_until;
use std::time::{Duration, Instant};

/// Waits (up to 60 s) until a put succeeds.
fn ready(e: &Etcd) {
    wait_until("etcd never came up", 60, || {
        e.put(b"/sce-test/ready", b"1", 0).is_ok()
    });
}

/// A 3-member etcd cluster in a temporary directory.
struct Ground {
    _dir: tempfile::TempDir,
    cluster: Cluster,
}

impl Ground {
    /// A client of every member.
    fn client(&self) -> Etcd {
        client_of(&self.cluster)
    }
}

/// A 3-member etcd cluster, answering (None: etcd is not installed and this is not CI: the
/// test is skipped).
fn ground() -> Option<Ground> {
    if !sce_testkit::require_known_tool("etcd") {
        return None;
    }
    let d = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(d.path());
    ready(&client_of(&cluster));
    Some(Ground { _dir: d, cluster })
}

/// A client of every member of `cluster`.
fn client_of(cluster: &Cluster) -> Etcd {
    let eps: Vec<&str> = cluster.endpoints.iter().map(String::as_str).collect();
    Etcd::new(&eps, Duration::from_secs(2)).unwrap()
}

#[test]
fn keys_leases_watches_and_a_lost_member() {
    let Some(Ground { _dir, mut cluster }) = ground() else {
        return;
    };
    let endpoints = cluster.endpoints.clone();
    let eps: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    let e = Etcd::new(&eps, Duration::from_secs(5)).unwrap();
    // Keys and revisions.
    let r1 = e.put(b"/sce/vol/a", b"one", 0).unwrap();
    let r2 = e.put(b"/sce/vol/b", b"two", 0).unwrap();
    assert!(r2 > r1, "revisions grow: {r1} {r2}");
    let (kvs, rev) = e.range_prefix(b"/sce/vol/").unwrap();
    assert_eq!(kvs.len(), 2);
    assert_eq!(kvs[0].value, b"one");
    assert_eq!(kvs[1].mod_revision, r2);
    assert!(rev >= r2);
    // One key exactly: not another that it is a prefix of.
    e.put(b"/sce/get/h10", b"ten", 0).unwrap();
    assert_eq!(e.get(b"/sce/get/h1").unwrap(), None);
    assert_eq!(e.get(b"/sce/get/h10").unwrap(), Some(b"ten".to_vec()));
    // A watch from r1 sees both puts, then a new one.
    let mut w = e.watch_prefix(b"/sce/vol/", r1).unwrap();
    let mut seen = Vec::new();
    let t0 = Instant::now();
    while seen.len() < 2 && t0.elapsed() < Duration::from_secs(20) {
        seen.extend(w.next_events(Duration::from_secs(1)).unwrap());
    }
    let r3 = e.put(b"/sce/vol/a", b"three", 0).unwrap();
    while seen.len() < 3 && t0.elapsed() < Duration::from_secs(20) {
        seen.extend(w.next_events(Duration::from_secs(1)).unwrap());
    }
    let revs: Vec<i64> = seen
        .iter()
        .map(|ev| match ev {
            Event::Put(kv) => kv.mod_revision,
            Event::Delete { mod_revision, .. } => *mod_revision,
        })
        .collect();
    assert_eq!(revs, vec![r1, r2, r3], "{seen:?}");
    // A lease kept alive stays; left alone it expires and takes its key along.
    let lease = e.grant(2).unwrap();
    e.put(b"/sce/hosts/h1", b"alive", lease).unwrap();
    assert!(e.keep_alive(lease).unwrap() > 0);
    wait_until("the lease never expired", 30, || {
        let (kvs, _) = e.range_prefix(b"/sce/hosts/").unwrap();
        assert!(kvs.iter().all(|kv| kv.lease == lease));
        kvs.is_empty()
    });
    // One member dies: the two others keep a quorum, and calls go to them.
    cluster.kill(0);
    let r4 = e.put(b"/sce/vol/c", b"four", 0).unwrap();
    assert!(r4 > r3);
    let (kvs, _) = e.range_prefix(b"/sce/vol/").unwrap();
    assert_eq!(kvs.len(), 3);
    // A watch on the last member, which then loses its leader (a second member dies): the
    // watch ends with an error instead of going silent for good (a host would otherwise
    // never hear of invalidations again while its lease renews elsewhere).
    let last = Etcd::new(&[endpoints[2].as_str()], Duration::from_secs(2)).unwrap();
    let mut w = last.watch_prefix(b"/sce/vol/", 0).unwrap();
    cluster.kill(1);
    let mut ended = false;
    for _ in 0..60 {
        if w.next_events(Duration::from_secs(1)).is_err() {
            ended = true;
            break;
        }
    }
    assert!(ended, "a watch on a member without a leader stayed open");
}

/// What sce relies on of the store (`common/mod.rs`), against the real one: the in-memory
/// store (`tests/mem.rs`) passes the same assertions.
#[test]
fn the_store_semantics_sce_relies_on() {
    let Some(g) = ground() else { return };
    let e = g.client();
    common::keys_and_revisions(&e, "/t/keys");
    common::transactions(&e, "/t/txn");
    common::history_and_watches(&e, "/t/hist");
    // Expired: not renewed, it lapses after its TTL (2 s).
    let expired = |_| {
        wait_until("the lease never expired", 30, || {
            e.get(b"/t/lease/h2").unwrap().is_none()
        })
    };
    common::leases(&e, "/t/lease", &expired);
    common::compaction(&e, "/t/compact");
}

/// Waits (up to 60 s) until the host's key is there, once.
fn registered(e: &Etcd) {
    wait_until("never registered", 60, || {
        let (kvs, _) = e.range_prefix(b"/sce/hosts/").unwrap();
        assert!(kvs.len() <= 1, "registered twice: {kvs:?}");
        kvs.len() == 1
    });
}

/// A host's registration under a lease: valid while etcd renews it; when the whole cluster
/// is gone the host stops counting on it within the lease's time (and never after the
/// cluster could expire it); when the cluster is back, the host is registered again.
#[test]
fn membership_lapses_without_etcd_and_comes_back() {
    let Some(mut g) = ground() else { return };
    let e = g.client();
    let m = sce_coord::Membership::join(g.client(), b"/sce/hosts/h1", b"h1", 2).unwrap();
    let first = m.valid_until();
    // Renewed: the deadline moves past the first lease's (no bound on when: a loaded
    // machine may be slow, but a renewal must come).
    wait_until("never renewed", 60, || {
        m.valid_until() > first + Duration::from_millis(500)
    });
    registered(&e);
    // The whole cluster goes away: the registration lapses.
    g.cluster.stop_all();
    wait_until("still counting on a lease nobody renews", 30, || !m.valid());
    wait_until("no renewal failed", 30, || m.failures() > 0);
    // Back: renewed or registered again.
    g.cluster.start_all();
    wait_until("never registered again", 60, || m.valid());
    ready(&e);
    registered(&e);
    m.leave().unwrap();
    let (kvs, _) = e.range_prefix(b"/sce/hosts/").unwrap();
    assert!(kvs.is_empty(), "leave revokes the lease and its key");
}

/// Invalidate before acknowledge: a write's range is published, and `publish` returns only
/// once the other host has dropped those pages (its callback ran before it acknowledged);
/// a host that left is not waited for; one that stops listening makes `publish` fail, until
/// its lease lapses and it counts as gone.
#[test]
fn invalidations_are_dropped_everywhere_before_publish_returns() {
    use sce_coord::inval::Listener;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};
    let Some(g) = ground() else { return };
    let a = g.client();
    let p = "/sce/vol0";
    let ma = sce_coord::Membership::join(g.client(), b"/sce/vol0/hosts/a", b"a", 2).unwrap();
    let tracker = sce_coord::Tracker::start(g.client(), p, "a").unwrap();
    let publish =
        |_: &Etcd, _: &str, _: &str, r: &[(u64, u64)], t: Duration| tracker.publish(&a, r, t);
    let mb = sce_coord::Membership::join(g.client(), b"/sce/vol0/hosts/b", b"b", 2).unwrap();
    // Host b listens in a thread, recording what it dropped.
    let dropped = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let b = {
        let (dropped, stop) = (dropped.clone(), stop.clone());
        let lease = mb.lease();
        let eb = g.client();
        let mut l = Listener::new(&eb, p, "b", 0).unwrap();
        std::thread::spawn(move || {
            while !stop.load(SeqCst) {
                let _ = l.pump(&eb, lease, Duration::from_millis(200), &mut |o, n| {
                    dropped.lock().unwrap().push((o, n))
                });
            }
        })
    };
    for i in 0..5u64 {
        let range = (i * 4096, 4096);
        let rev = publish(&a, p, "a", &[range], Duration::from_secs(30)).unwrap();
        assert!(rev > 0);
        assert!(
            dropped.lock().unwrap().contains(&range),
            "publish returned before b dropped {range:?}"
        );
    }
    // b stops listening but stays registered: a cannot go ahead (never a stale hit on b).
    stop.store(true, SeqCst);
    b.join().unwrap();
    let e = publish(&a, p, "a", &[(0, 512)], Duration::from_millis(500)).unwrap_err();
    assert!(e.to_string().contains("did not acknowledge"), "{e}");
    // b's lease lapses (no renewal): b is gone, and a goes ahead without it.
    drop(mb);
    let last = publish(
        &a,
        p,
        "a",
        &[(512, 512), (8192, 4096)],
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(sce_coord::inval::newest(&a, p).unwrap(), last);
    // An invalidation a host cannot read drops everything, and is acknowledged.
    let mut l = Listener::new(&a, p, "b2", last + 1).unwrap();
    let bad = a.put(b"/sce/vol0/inval/x", b"not ranges", 0).unwrap();
    let mut got = Vec::new();
    for _ in 0..12 {
        if l.done() >= bad {
            break;
        }
        l.pump(&a, 0, Duration::from_secs(5), &mut |o, n| got.push((o, n)))
            .unwrap();
    }
    assert_eq!(got, vec![(0, u64::MAX)], "done {} of {bad}", l.done());
    let last = bad;
    // A listener that would start before the compacted history learns so (its host then
    // forgets the volume instead of catching up).
    a.compact(last).unwrap();
    match Listener::new(&a, p, "b", last - 1) {
        Err(sce_coord::EtcdError::Compacted(r)) => assert!(r >= last - 1, "{r}"),
        Err(e) => panic!("a watch from a compacted revision: {e}"),
        Ok(mut l) => {
            let e = l.pump(&a, 0, Duration::from_secs(5), &mut |_, _| {});
            assert!(
                matches!(e, Err(sce_coord::EtcdError::Compacted(_))),
                "{e:?}"
            );
        }
    }
    ma.leave().unwrap();
}

/// One registration per key (issue 27, item 6): the value's first word is the registrant's
/// id. A second id is refused while the first's lease lives (after waiting up to the TTL for
/// it to lapse), naming the holder; the first id registering again while its old lease
/// still lives (a restart) takes the key over at once; once the holder's lease lapses, the
/// other id gets the name. `put_if` itself creates only an absent key.
#[test]
fn a_registration_under_a_key_another_id_holds_is_refused() {
    use sce_coord::EtcdError;
    let Some(g) = ground() else { return };
    let e = g.client();
    // The transaction: an absent key is created, a present one is left as it is.
    let r = e.put_if(b"/sce/once", b"first", 0, 0).unwrap().unwrap();
    let held = e
        .put_if(b"/sce/once", b"second", 0, 0)
        .unwrap()
        .unwrap_err();
    assert_eq!(
        held.map(|kv| (kv.value, kv.mod_revision)),
        Some((b"first".to_vec(), r))
    );
    assert_eq!(e.get(b"/sce/once").unwrap(), Some(b"first".to_vec()));

    let key = b"/sce/vol/hosts/vm";
    let join = |value: &[u8]| sce_coord::Membership::join(g.client(), key, value, 2);
    let first = join(b"id-a pid=1").unwrap();
    let t0 = Instant::now();
    let Err(EtcdError::Taken { holder, .. }) = join(b"id-b pid=2") else {
        panic!("a second id registered under a key a live lease holds");
    };
    eprintln!("refused after {:?}", t0.elapsed());
    assert_eq!(holder, "id-a pid=1");
    assert_eq!(e.get(key).unwrap(), Some(b"id-a pid=1".to_vec()));
    // The first host dies (no revoke: its lease lives on) and restarts: the same id under
    // another live lease may be a clone, so it waits for that lease to lapse, then registers.
    drop(first);
    let again = join(b"id-a pid=3").unwrap();
    assert_eq!(e.get(key).unwrap(), Some(b"id-a pid=3".to_vec()));
    assert!(again.valid() && !again.displaced());
    // It dies again; once its lease lapses, another id may have the name.
    drop(again);
    let other = join(b"id-b pid=4").unwrap();
    assert_eq!(e.get(key).unwrap(), Some(b"id-b pid=4".to_vec()));
    other.leave().unwrap();
}

/// An invalidation under this host's own name from before its registration (a clone that
/// held the name, or this host's previous life) is dropped like another host's; one after
/// it is this host's own write and skipped.
#[test]
fn invalidations_under_my_name_from_before_my_registration_are_dropped() {
    use sce_coord::inval::Listener;
    let Some(g) = ground() else { return };
    let e = g.client();
    let p = "/sce/vol9";
    let tracker = sce_coord::Tracker::start(g.client(), p, "vm").unwrap();
    let publish = |o: u64| tracker.publish(&e, &[(o, 4096)], Duration::from_secs(30));
    let clones = publish(0).unwrap();
    let me = sce_coord::Membership::join(g.client(), b"/sce/vol9/hosts/vm", b"id-a", 2).unwrap();
    let mine = publish(8192).unwrap();
    assert!(clones < me.registered_at() && me.registered_at() < mine);
    let mut l = Listener::new(&e, p, "vm", clones).unwrap();
    l.set_registered(me.registered_at());
    let mut dropped = Vec::new();
    while l.done() < mine {
        l.pump(&e, me.lease(), Duration::from_millis(200), &mut |o, n| {
            dropped.push((o, n))
        })
        .unwrap();
    }
    assert_eq!(dropped, vec![(0, 4096)]);
    me.leave().unwrap();
}

/// A host cut off from etcd long enough for its lease to lapse, whose name another id
/// takes meanwhile, is displaced when it comes back: it does not register (it stays not
/// valid, and counts the displacement), until the other leaves and the name is free.
#[test]
fn a_host_whose_name_was_taken_while_it_was_away_is_displaced() {
    use sce_testkit::etcd::Proxy;
    let Some(g) = ground() else { return };
    let e = g.client();
    let proxies: Vec<Proxy> = g
        .cluster
        .endpoints
        .iter()
        .map(|ep| Proxy::start(ep))
        .collect();
    let via: Vec<&str> = proxies.iter().map(|p| p.endpoint.as_str()).collect();
    let key = b"/sce/vol/hosts/vm";
    let away = Etcd::new(&via, Duration::from_secs(2)).unwrap();
    let a = sce_coord::Membership::join(away, key, b"id-a", 2).unwrap();
    proxies.iter().for_each(|p| p.cut(true));
    wait_until("a's key never lapsed", 60, || e.get(key).unwrap().is_none());
    let b = sce_coord::Membership::join(g.client(), key, b"id-b", 2).unwrap();
    proxies.iter().for_each(|p| p.cut(false));
    wait_until("a never found its name taken", 60, || a.displacements() > 0);
    assert!(!a.valid());
    assert_eq!(e.get(key).unwrap(), Some(b"id-b".to_vec()));
    b.leave().unwrap();
    wait_until("a never registered again", 60, || {
        a.valid() && !a.displaced()
    });
    assert_eq!(e.get(key).unwrap(), Some(b"id-a".to_vec()));
    a.leave().unwrap();
}

/// Ownership's keys (issue 31): an acquisition succeeds only for an absent key; a release
/// deletes only the key it names; a move changes the holder's lease; every acquisition
/// leaves a trace that outlives its key, so that a host catching up counts it in its target
/// (`inval::newest`); the history read sees the owners of a past revision; the first host
/// sets the volume's region size for all.
#[test]
fn owner_keys_acquire_release_move_and_leave_a_trace() {
    use sce_coord::own;
    let Some(g) = ground() else { return };
    let e = g.client();
    let p = "/sce/own";
    let (la, lb) = (e.grant(30).unwrap(), e.grant(30).unwrap());
    let rev = own::acquire(&e, p, 3, "a id", la).unwrap().unwrap();
    let held = own::acquire(&e, p, 3, "b id", lb)
        .unwrap()
        .unwrap_err()
        .unwrap();
    assert_eq!((held.lease, held.mod_revision), (la, rev));
    // Released: the key is gone, its acquisition still counts.
    assert!(
        !own::release(&e, p, 3, rev - 1).unwrap(),
        "another revision's key"
    );
    assert!(own::release(&e, p, 3, rev).unwrap());
    assert!(sce_coord::inval::newest(&e, p).unwrap() >= rev);
    assert_eq!(own::owners_at(&e, p, rev).unwrap().len(), 1);
    assert!(own::owners_at(&e, p, 0).unwrap().is_empty());
    // Taken again, then moved to b's lease.
    let r2 = own::acquire(&e, p, 3, "a id", la).unwrap().unwrap();
    let r3 = own::transfer(&e, p, 3, r2, "b - handoff a", lb)
        .unwrap()
        .unwrap();
    let owners = own::owners_at(&e, p, 0).unwrap();
    assert_eq!(owners.len(), 1);
    assert_eq!((owners[0].1.lease, owners[0].1.mod_revision), (lb, r3));
    assert!(own::is_handoff(&owners[0].1.value));
    assert!(
        own::transfer(&e, p, 3, r2, "a id", la).unwrap().is_err(),
        "a stale move"
    );
    assert_eq!(sce_coord::inval::newest(&e, p).unwrap(), r3);
    // The region size: the first one stays.
    assert_eq!(own::agree_size(&e, p, 1 << 30).unwrap(), 1 << 30);
    assert_eq!(own::agree_size(&e, p, 1 << 20).unwrap(), 1 << 30);
}
