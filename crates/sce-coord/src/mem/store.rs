//! The in-memory store's data: every key's versions (its history, down to the compacted
//! revision), the events in revision order for watches, and the leases. Plain data: the
//! locking, the faults and the waiting are in `mod.rs`.

use crate::coord::{prefix_end, EtcdError, Event, Kv};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// One version of a key: its value and lease, or a deletion, at a revision.
struct Version {
    rev: i64,
    val: Option<(Vec<u8>, i64)>,
}

struct Lease {
    ttl: i64,
    /// When it expires, on the store's clock.
    deadline: Duration,
    /// The fault domain of the client that granted it.
    owner: u64,
}

/// The store's clock: manual (moves only when told), or real time plus what it was told.
pub(super) struct Clock {
    base: Option<Instant>,
    offset: Duration,
}

impl Clock {
    pub fn new(real: bool) -> Clock {
        Clock {
            base: real.then(Instant::now),
            offset: Duration::ZERO,
        }
    }

    pub fn now(&self) -> Duration {
        self.offset + self.base.map_or(Duration::ZERO, |b| b.elapsed())
    }
}

/// What etcd says of a lease it does not have.
pub(super) fn no_lease() -> EtcdError {
    EtcdError::Server("etcdserver: requested lease not found".into())
}

/// The keys, their history, the events and the leases.
pub(super) struct Store {
    /// The revision of the last change (1 before any, as etcd starts).
    pub rev: i64,
    /// The compacted revision: history before it is gone (0: none).
    pub compacted: i64,
    keys: BTreeMap<Vec<u8>, Vec<Version>>,
    /// Every change at or after `compacted`, in revision order.
    log: Vec<Event>,
    leases: HashMap<i64, Lease>,
    /// Per fault domain, the revision after the last expiry of one of its leases.
    expired: HashMap<u64, i64>,
    next_lease: i64,
    pub clock: Clock,
}

impl Store {
    pub fn new(real_clock: bool) -> Store {
        Store {
            rev: 1,
            compacted: 0,
            keys: BTreeMap::new(),
            log: Vec::new(),
            leases: HashMap::new(),
            expired: HashMap::new(),
            next_lease: 0x5ce0_0000_0000_0001,
            clock: Clock::new(real_clock),
        }
    }

    /// The key as it was at `rev`, if it held a value.
    fn at(&self, key: &[u8], rev: i64) -> Option<Kv> {
        let v = self.keys.get(key)?.iter().rev().find(|v| v.rev <= rev)?;
        let (value, lease) = v.val.clone()?;
        Some(Kv {
            key: key.to_vec(),
            value,
            mod_revision: v.rev,
            lease,
        })
    }

    pub fn get(&self, key: &[u8]) -> Option<Kv> {
        self.at(key, self.rev)
    }

    /// The keys starting with `prefix` as they were at `rev`, in key order.
    pub fn range(&self, prefix: &[u8], rev: i64) -> Result<Vec<Kv>, EtcdError> {
        if rev < self.compacted {
            return Err(EtcdError::Compacted(rev));
        }
        if rev > self.rev {
            return Err(EtcdError::Server(
                "etcdserver: mvcc: required revision is a future revision".into(),
            ));
        }
        let end = prefix_end(prefix);
        let keys = self.keys.range(prefix.to_vec()..end).map(|(k, _)| k);
        Ok(keys.filter_map(|k| self.at(k, rev)).collect())
    }

    fn check_lease(&self, lease: i64) -> Result<(), EtcdError> {
        match lease == 0 || self.leases.contains_key(&lease) {
            true => Ok(()),
            false => Err(no_lease()),
        }
    }

    /// Puts at the current revision (the caller moved it).
    fn put_at(&mut self, key: &[u8], value: &[u8], lease: i64) {
        let rev = self.rev;
        let val = Some((value.to_vec(), lease));
        self.keys
            .entry(key.to_vec())
            .or_default()
            .push(Version { rev, val });
        self.log.push(Event::Put(Kv {
            key: key.to_vec(),
            value: value.to_vec(),
            mod_revision: rev,
            lease,
        }));
    }

    /// Deletes the keys (those that hold a value) at one new revision; how many.
    fn delete_keys(&mut self, keys: Vec<Vec<u8>>) -> usize {
        let live: Vec<Vec<u8>> = keys.into_iter().filter(|k| self.get(k).is_some()).collect();
        if live.is_empty() {
            return 0;
        }
        self.rev += 1;
        let rev = self.rev;
        for k in &live {
            let v = self.keys.entry(k.clone()).or_default();
            v.push(Version { rev, val: None });
            self.log.push(Event::Delete {
                key: k.clone(),
                mod_revision: rev,
            });
        }
        live.len()
    }

    pub fn put(&mut self, key: &[u8], value: &[u8], lease: i64) -> Result<i64, EtcdError> {
        self.check_lease(lease)?;
        self.rev += 1;
        self.put_at(key, value, lease);
        Ok(self.rev)
    }

    /// `Coord::put_if_and`.
    pub fn put_if_and(
        &mut self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        expect: i64,
        also: Option<(&[u8], &[u8])>,
    ) -> Result<Result<i64, Option<Kv>>, EtcdError> {
        let now = self.get(key);
        let matches = match expect {
            0 => now.is_none(),
            r => now.as_ref().is_some_and(|kv| kv.mod_revision == r),
        };
        if !matches {
            return Ok(Err(now));
        }
        self.check_lease(lease)?;
        self.rev += 1;
        self.put_at(key, value, lease);
        if let Some((k, v)) = also {
            self.put_at(k, v, 0);
        }
        Ok(Ok(self.rev))
    }

    pub fn delete_if(&mut self, key: &[u8], expect: i64) -> bool {
        match self.get(key) {
            Some(kv) if kv.mod_revision == expect => self.delete_keys(vec![kv.key]) == 1,
            _ => false,
        }
    }

    pub fn delete_prefix(&mut self, prefix: &[u8]) {
        let end = prefix_end(prefix);
        let keys = self
            .keys
            .range(prefix.to_vec()..end)
            .map(|(k, _)| k.clone());
        let keys = keys.collect();
        self.delete_keys(keys);
    }

    pub fn delete(&mut self, key: &[u8]) {
        self.delete_keys(vec![key.to_vec()]);
    }

    /// Forgets the history before `rev`: what a key held at `rev` stays.
    pub fn compact(&mut self, rev: i64) -> Result<(), EtcdError> {
        if rev <= self.compacted {
            return Err(EtcdError::Server(
                "etcdserver: mvcc: required revision has been compacted".into(),
            ));
        }
        if rev > self.rev {
            return Err(EtcdError::Server(
                "etcdserver: mvcc: required revision is a future revision".into(),
            ));
        }
        self.compacted = rev;
        self.log.retain(|e| e.revision() >= rev);
        for versions in self.keys.values_mut() {
            // The newest version at or before `rev` is what the key held then.
            let keep = versions.iter().rposition(|v| v.rev <= rev).unwrap_or(0);
            versions.drain(..keep);
            if versions
                .first()
                .is_some_and(|v| v.rev <= rev && v.val.is_none())
            {
                versions.remove(0);
            }
        }
        self.keys.retain(|_, v| !v.is_empty());
        Ok(())
    }

    /// The changes of keys starting with `prefix` from revision `from` on.
    pub fn events(&self, prefix: &[u8], from: i64) -> Result<Vec<Event>, EtcdError> {
        if from < self.compacted {
            return Err(EtcdError::Compacted(self.compacted));
        }
        let end = prefix_end(prefix);
        let first = self.log.partition_point(|e| e.revision() < from);
        let key = |e: &Event| match e {
            Event::Put(kv) => kv.key.clone(),
            Event::Delete { key, .. } => key.clone(),
        };
        let inside = |e: &&Event| {
            let k = key(e);
            k.as_slice() >= prefix && k < end
        };
        Ok(self.log[first..].iter().filter(inside).cloned().collect())
    }

    pub fn grant(&mut self, ttl: i64, owner: u64) -> i64 {
        let id = self.next_lease;
        self.next_lease += 1;
        let deadline = self.clock.now() + Duration::from_secs(ttl.max(1) as u64);
        self.leases.insert(
            id,
            Lease {
                ttl: ttl.max(1),
                deadline,
                owner,
            },
        );
        id
    }

    pub fn keep_alive(&mut self, id: i64) -> i64 {
        let now = self.clock.now();
        match self.leases.get_mut(&id) {
            Some(l) => {
                l.deadline = now + Duration::from_secs(l.ttl as u64);
                l.ttl
            }
            None => 0,
        }
    }

    /// Revokes lease `id`: its keys go, at one revision.
    pub fn revoke(&mut self, id: i64) -> Result<(), EtcdError> {
        self.leases.remove(&id).ok_or_else(no_lease)?;
        let keys: Vec<Vec<u8>> = (self.keys.keys())
            .filter(|k| self.get(k).is_some_and(|kv| kv.lease == id))
            .cloned()
            .collect();
        self.delete_keys(keys);
        Ok(())
    }

    /// Expires the leases whose time is up; how many.
    pub fn expire_due(&mut self) -> usize {
        let now = self.clock.now();
        let due: Vec<i64> = (self.leases.iter())
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in &due {
            self.expire(*id);
        }
        due.len()
    }

    /// Expires lease `id` (its time is up, or the test says so): revoked, and the revision
    /// noted for its fault domain. False if there was no such lease.
    pub fn expire(&mut self, id: i64) -> bool {
        let Some(owner) = self.leases.get(&id).map(|l| l.owner) else {
            return false;
        };
        let _ = self.revoke(id);
        self.expired.insert(owner, self.rev);
        true
    }

    /// The revision after the last expiry of a lease of fault domain `owner`.
    pub fn last_expiry(&self, owner: u64) -> Option<i64> {
        self.expired.get(&owner).copied()
    }

    /// The leases granted by clients of fault domain `owner`.
    pub fn leases_of(&self, owner: u64) -> Vec<i64> {
        let mine = self.leases.iter().filter(|(_, l)| l.owner == owner);
        mine.map(|(id, _)| *id).collect()
    }

    pub fn has_lease(&self, id: i64) -> bool {
        self.leases.contains_key(&id)
    }

    /// Moves the clock on by `d`.
    pub fn advance(&mut self, d: Duration) {
        self.clock.offset += d;
    }
}
