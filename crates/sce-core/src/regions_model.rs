//! Many hosts' machines stepped at random against a model of etcd's owner keys: every
//! change of a key, and every publication, goes to every host's queue in revision order,
//! delivered whenever the random order says; an acquisition is granted only once every
//! other host has processed its key (the acknowledgements the server waits for); a new
//! lease deletes the host's keys. After every step the invariants are checked.

use super::super::*;
use proptest::prelude::*;
use std::collections::{HashMap, VecDeque};

const REGIONS: u64 = 4;
const SIZE: u64 = 1 << 20;

/// What a host's listener hears, in revision order.
#[derive(Debug, Clone, Copy)]
enum Event {
    Put { r: u64, lease: i64, rev: i64 },
    Del { r: u64, rev: i64 },
    Published { r: u64 },
}

/// An acquisition under way: the key put at `rev` (None: refused).
#[derive(Debug)]
struct Acq {
    r: u64,
    token: u64,
    rev: Option<i64>,
}

/// A write taking its regions in order.
#[derive(Debug)]
struct Write {
    h: usize,
    lease: i64,
    regions: Vec<u64>,
    taken: Vec<(u64, u64)>,
    acq: Option<Acq>,
}

/// An owned write in flight: host, lease, (region, token)s.
type Owned = (usize, i64, Vec<(u64, u64)>);

struct Host {
    g: Regions,
    lease: i64,
    inbox: VecDeque<(i64, Event)>,
    /// The last revision processed.
    done: i64,
    /// The regions whose key this host last heard of (and acknowledged) was another's.
    heard: HashMap<u64, bool>,
}

struct World {
    hosts: Vec<Host>,
    /// Region -> (lease, revision) of its owner key.
    keys: HashMap<u64, (i64, i64)>,
    rev: i64,
    next_lease: i64,
    now: u64,
    writes: Vec<Write>,
    /// Owned writes in flight: host, lease, (region, token)s.
    owned: Vec<Owned>,
    /// Checks made, to show that the steps did something.
    owned_seen: u64,
}

impl World {
    fn new(n: usize) -> World {
        let hosts = (0..n)
            .map(|i| Host {
                g: Regions::new(SIZE, true, 50),
                lease: i as i64 + 1,
                inbox: VecDeque::new(),
                done: 0,
                heard: HashMap::new(),
            })
            .collect();
        World {
            hosts,
            keys: HashMap::new(),
            rev: 0,
            next_lease: n as i64 + 1,
            now: 0,
            writes: Vec::new(),
            owned: Vec::new(),
            owned_seen: 0,
        }
    }

    /// A new revision: `e` goes to every host's queue but `except`'s.
    fn emit(&mut self, e: impl Fn(i64) -> Event, except: Option<usize>) -> i64 {
        self.rev += 1;
        let rev = self.rev;
        for (i, h) in self.hosts.iter_mut().enumerate() {
            if Some(i) != except {
                h.inbox.push_back((rev, e(rev)));
            }
        }
        rev
    }

    /// etcd's delete of region `r`'s key if its revision is still `rev`.
    fn delete(&mut self, r: u64, rev: i64) -> bool {
        if self.keys.get(&r).is_none_or(|k| k.1 != rev) {
            return false;
        }
        self.keys.remove(&r);
        self.emit(|rev| Event::Del { r, rev }, None);
        true
    }

    /// etcd's put of an owner key under `lease` if free (or already this lease's).
    fn put(&mut self, r: u64, lease: i64) -> Option<i64> {
        if self.keys.get(&r).is_some_and(|k| k.0 != lease) {
            return None;
        }
        let rev = self.emit(|rev| Event::Put { r, lease, rev }, None);
        self.keys.insert(r, (lease, rev));
        Some(rev)
    }

    fn step(&mut self, op: u8, a: usize, b: u64) {
        let n = self.hosts.len();
        match op % 9 {
            0 | 1 => {
                let h = a % n;
                let lease = self.hosts[h].lease;
                let first = b % REGIONS;
                let regions = (first..(first + 1 + b / 8 % 2).min(REGIONS)).collect();
                let w = Write {
                    h,
                    lease,
                    regions,
                    taken: vec![],
                    acq: None,
                };
                self.writes.push(w);
                self.advance(self.writes.len() - 1);
            }
            2 | 3 => {
                for _ in 0..=b % 8 {
                    self.deliver(a % n);
                }
            }
            4 if !self.writes.is_empty() => {
                let i = a % self.writes.len();
                self.grant(i, !b.is_multiple_of(4));
            }
            5 if !self.owned.is_empty() => self.end_owned(a % self.owned.len()),
            6 => {
                self.now += b % 40;
                self.release(a % n);
            }
            7 if b.is_multiple_of(32) => self.new_lease(a % n),
            8 => self.stale_outcome(a % n, b),
            _ => {}
        }
        self.check();
    }

    /// Takes write `i`'s regions in order until one waits, needs an acquisition, or fails.
    fn advance(&mut self, i: usize) {
        let w = &mut self.writes[i];
        let host = &mut self.hosts[w.h];
        let current = Some(host.lease);
        while w.taken.len() < w.regions.len() && w.acq.is_none() {
            let r = w.regions[w.taken.len()];
            match host
                .g
                .take(r, w.lease, current, !w.taken.is_empty(), self.now)
            {
                Take::Owned(t) => {
                    // Decided owned: this host's key, under the write's lease, in etcd.
                    assert_eq!(self.keys.get(&r).map(|k| k.0), Some(w.lease), "{r}");
                    self.owned_seen += 1;
                    w.taken.push((r, t));
                }
                Take::Acquire(token) => {
                    w.acq = Some(Acq {
                        r,
                        token,
                        rev: None,
                    });
                    break;
                }
                Take::Wait => return,
                Take::Publish => {
                    host.g.put_back(&w.taken, self.now);
                    let (h, regions) = (w.h, w.regions.clone());
                    self.writes.remove(i);
                    for r in regions {
                        self.emit(|_| Event::Published { r }, Some(h));
                    }
                    return;
                }
            }
        }
        if let Some(acq) = &mut w.acq {
            if acq.rev.is_none() {
                let (r, lease) = (acq.r, w.lease);
                let got = self.put(r, lease);
                let w = &mut self.writes[i];
                let acq = w.acq.as_mut().expect("acquiring");
                acq.rev = got;
                if got.is_none() {
                    let (r, token) = (acq.r, acq.token);
                    w.acq = None;
                    let ok = self.hosts[w.h].g.acquired(r, token, None, self.now);
                    assert!(!ok);
                    // Published: the next take says so.
                    self.advance(i);
                }
            }
            return;
        }
        let w = self.writes.remove(i);
        self.owned.push((w.h, w.lease, w.taken));
    }

    /// Ends write `i`'s acquisition: granted once every other host acknowledged its key
    /// (`acked`), or given up (the key deleted again).
    fn grant(&mut self, i: usize, acked: bool) {
        let Some(acq) = self.writes[i].acq.take() else {
            return self.advance(i);
        };
        let h = self.writes[i].h;
        let rev = acq.rev.expect("put");
        let all = (0..self.hosts.len()).all(|o| o == h || self.hosts[o].done >= rev);
        let got = if acked && all {
            Some(rev)
        } else {
            self.delete(acq.r, rev);
            None
        };
        if self.hosts[h].g.acquired(acq.r, acq.token, got, self.now) {
            self.owned_seen += 1;
            self.writes[i].taken.push((acq.r, acq.token));
        }
        self.advance(i);
    }

    /// Host `h`'s listener processes its next event.
    fn deliver(&mut self, h: usize) {
        let now = self.now;
        let host = &mut self.hosts[h];
        let Some((rev, e)) = host.inbox.pop_front() else {
            return;
        };
        let lease = host.lease;
        let heard = match e {
            Event::Put { r, lease: kl, rev } => {
                host.heard.insert(r, kl != lease);
                Some((r, host.g.owner_put(r, (kl, rev, false), rev, lease)))
            }
            Event::Del { r, rev } => {
                host.heard.remove(&r);
                Some((r, host.g.owner_deleted(r, rev, lease)))
            }
            Event::Published { r } => {
                host.g.foreign_write(r * SIZE, 4096, now);
                None
            }
        };
        if let Some((r, Heard::Drop(after))) = heard {
            host.g.dropped(r, after, lease, now);
        }
        host.done = rev;
        for (r, rev) in host.g.take_stray() {
            self.delete(r, rev);
        }
    }

    fn end_owned(&mut self, i: usize) {
        let (h, lease, regions) = self.owned.remove(i);
        let host = &mut self.hosts[h];
        if host
            .g
            .end_write(&regions, lease, Some(host.lease), self.now)
        {
            for (r, _) in &regions {
                let key = self.keys.get(r).map(|k| k.0);
                assert_eq!(
                    key,
                    Some(lease),
                    "an owned write stands: its key is still held"
                );
            }
        }
    }

    fn release(&mut self, h: usize) {
        while let Some(rel) = self.hosts[h].g.next_release(self.now) {
            let ok = self.delete(rel.region, rel.revision);
            self.hosts[h]
                .g
                .released(rel.region, rel.token, rel.revision, ok);
        }
    }

    /// Host `h` registers again: its keys go with its old lease.
    fn new_lease(&mut self, h: usize) {
        let old = self.hosts[h].lease;
        self.hosts[h].lease = self.next_lease;
        self.next_lease += 1;
        let mut gone: Vec<(u64, i64)> = (self.keys.iter())
            .filter(|(_, k)| k.0 == old)
            .map(|(r, k)| (*r, k.1))
            .collect();
        gone.sort();
        for (r, rev) in gone {
            self.delete(r, rev);
        }
    }

    /// An outcome with a token no entry holds changes no entry.
    fn stale_outcome(&mut self, h: usize, b: u64) {
        let g = &mut self.hosts[h].g;
        let r = b % REGIONS;
        let stale = g.mine(r).map_or(0, |m| m.token + 1 + b);
        let before: Vec<Option<Mine>> = (0..REGIONS).map(|r| g.mine(r).cloned()).collect();
        assert!(!g.put_back(&[(r, stale)], self.now));
        assert!(!g.acquired(r, stale, Some(1 << 40), self.now));
        g.released(r, stale, 1 << 40, true);
        let after: Vec<Option<Mine>> = (0..REGIONS).map(|r| g.mine(r).cloned()).collect();
        assert_eq!(before, after, "a stale token changed an entry");
        g.take_stray();
    }

    fn check(&self) {
        for r in 0..REGIONS {
            let owners: Vec<usize> = (0..self.hosts.len())
                .filter(|&h| {
                    let host = &self.hosts[h];
                    (host.g.mine(r))
                        .is_some_and(|m| m.phase == Phase::Held && m.lease == host.lease)
                })
                .collect();
            assert!(owners.len() <= 1, "region {r} held by hosts {owners:?}");
            for &h in &owners {
                let held = self.hosts[h].g.mine(r).map(|m| (m.lease, m.revision));
                assert_eq!(
                    self.keys.get(&r).copied(),
                    held,
                    "host {h} holds {r} without its key"
                );
            }
            for (h, host) in self.hosts.iter().enumerate() {
                if host.heard.get(&r) == Some(&true) {
                    let cached = !host.g.theirs_in(r * SIZE, 1);
                    assert!(
                        !cached,
                        "host {h} would serve region {r}, acknowledged as another's"
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn hosts_stepped_at_random_keep_the_invariants(
        n in 2usize..5,
        ops in prop::collection::vec((any::<u8>(), any::<u8>(), any::<u64>()), 1..300),
    ) {
        let mut w = World::new(n);
        for (op, a, b) in ops {
            w.step(op, a as usize, b);
        }
    }
}

/// The random steps reach owned writes (the invariants are not checked on nothing).
#[test]
fn random_steps_reach_owned_writes() {
    let mut w = World::new(3);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.step(x as u8, (x >> 8) as u8 as usize, x >> 16);
    }
    assert!(w.owned_seen > 100, "{}", w.owned_seen);
}
