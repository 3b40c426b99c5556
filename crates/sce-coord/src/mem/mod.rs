//! An in-memory coordination store with etcd's semantics as [`crate::Coord`] states them,
//! for tests that run several hosts in one process: one store ([`MemEtcd`]) with a global
//! revision, each key's history down to the compacted revision (reads at a revision,
//! watches from a revision), and leases on the store's clock (manual by default: a lease
//! expires only when the test says so, or moves the clock on).
//!
//! Each client belongs to a fault domain ([`Faults`], one per host as a rule), which the
//! test controls:
//! - [`Faults::pause`]: calls wait before they reach the store, until resumed, or fail
//!   after the client's timeout as on a slow network; watches go quiet;
//! - [`Faults::hold_replies`]: calls reach the store, then their answers wait (a lost or
//!   late answer: the change is made, the caller does not know yet); watches already open
//!   go on delivering (a slow answer, not a dead link);
//! - [`Faults::partition`]: calls fail at once, and open watches end;
//! - [`Faults::heal`]: all of them end.
//!
//! The store: [`MemEtcd::compact`], [`MemEtcd::expire_lease`],
//! [`MemEtcd::expire_leases_of`] (a host's leases, as the cluster expires them after a
//! partition), [`MemEtcd::advance`] (the clock).
//!
//! Locks: the store's (`Shared::store`) and each fault domain's (`Faults::st`) are leaves,
//! never held together nor while calling anything outside this module; a paused call waits
//! on its domain's condition variable, with the store unlocked.

mod store;

use crate::coord::{Coord, EtcdError, Event, Events, Kv, Watch};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use store::Store;

/// The longest a waiting watch sleeps before it looks at the clock's leases again.
const TICK: Duration = Duration::from_millis(20);

struct Shared {
    store: Mutex<Store>,
    /// Signalled at every change.
    changed: Condvar,
    next_domain: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        let mut st = self.store.lock().unwrap_or_else(|e| e.into_inner());
        if st.expire_due() > 0 {
            self.changed.notify_all();
        }
        st
    }
}

/// An in-memory store; cloning it gives another handle on the same store.
#[derive(Clone)]
pub struct MemEtcd {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MemEtcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemEtcd")
            .field("revision", &self.revision())
            .finish()
    }
}

impl Default for MemEtcd {
    fn default() -> Self {
        MemEtcd::new()
    }
}

impl MemEtcd {
    /// An empty store on a manual clock.
    pub fn new() -> MemEtcd {
        Self::with_clock(false)
    }

    /// An empty store whose clock runs in real time (leases expire by themselves).
    pub fn with_real_clock() -> MemEtcd {
        Self::with_clock(true)
    }

    fn with_clock(real: bool) -> MemEtcd {
        MemEtcd {
            shared: Arc::new(Shared {
                store: Mutex::new(Store::new(real)),
                changed: Condvar::new(),
                next_domain: AtomicU64::new(1),
            }),
        }
    }

    /// A new fault domain (a host's network).
    pub fn faults(&self) -> Arc<Faults> {
        Arc::new(Faults {
            id: self.shared.next_domain.fetch_add(1, SeqCst),
            st: Mutex::new(FaultState::default()),
            changed: Condvar::new(),
            failed: AtomicU64::new(0),
        })
    }

    /// A client in fault domain `faults` whose calls give up after `timeout`.
    pub fn client(&self, faults: &Arc<Faults>, timeout: Duration) -> MemClient {
        MemClient {
            shared: self.shared.clone(),
            faults: faults.clone(),
            timeout,
        }
    }

    fn changed<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        let out = f(&mut self.shared.lock());
        self.shared.changed.notify_all();
        out
    }

    /// The revision of the last change.
    pub fn revision(&self) -> i64 {
        self.shared.lock().rev
    }

    /// The compacted revision (0: none).
    pub fn compacted(&self) -> i64 {
        self.shared.lock().compacted
    }

    /// Compacts the history before `revision` (as [`Coord::compact`], with no fault).
    pub fn compact(&self, revision: i64) -> Result<(), EtcdError> {
        self.changed(|st| st.compact(revision))
    }

    /// Expires lease `id` now, as the cluster does when its time is up: its keys go. False
    /// if there was no such lease.
    pub fn expire_lease(&self, id: i64) -> bool {
        self.changed(|st| st.expire(id))
    }

    /// Expires every lease a client of `faults` granted: the store's revision after their
    /// keys went (None: there was none).
    pub fn expire_leases_of(&self, faults: &Faults) -> Option<i64> {
        self.changed(|st| {
            let ids = st.leases_of(faults.id);
            let n = ids.iter().filter(|id| st.expire(**id)).count();
            (n > 0).then_some(st.rev)
        })
    }

    /// The store's revision after the last expiry (by the clock or on command) of a lease a
    /// client of `faults` granted; None if none expired.
    pub fn last_expiry_of(&self, faults: &Faults) -> Option<i64> {
        self.shared.lock().last_expiry(faults.id)
    }

    /// The live leases a client of `faults` granted.
    pub fn leases_of(&self, faults: &Faults) -> Vec<i64> {
        self.shared.lock().leases_of(faults.id)
    }

    /// True while lease `id` lives.
    pub fn has_lease(&self, id: i64) -> bool {
        self.shared.lock().has_lease(id)
    }

    /// Moves the store's clock on by `d`: the leases not renewed within their TTL expire.
    pub fn advance(&self, d: Duration) {
        self.changed(|st| {
            st.advance(d);
            st.expire_due();
        })
    }
}

#[derive(Default, Debug, Clone, Copy)]
struct FaultState {
    paused: bool,
    holding: bool,
    partitioned: bool,
}

/// A fault domain: what the test does to the network of the clients in it.
#[derive(Debug)]
pub struct Faults {
    id: u64,
    st: Mutex<FaultState>,
    changed: Condvar,
    /// Calls that failed (partitioned, timed out).
    failed: AtomicU64,
}

impl Faults {
    fn set(&self, f: impl FnOnce(&mut FaultState)) {
        f(&mut self.st.lock().unwrap_or_else(|e| e.into_inner()));
        self.changed.notify_all();
    }

    /// Calls wait before they reach the store (see the module's doc).
    pub fn pause(&self) {
        self.set(|s| s.paused = true)
    }

    /// Calls reach the store; their answers wait. Open watches still deliver.
    pub fn hold_replies(&self) {
        self.set(|s| s.holding = true)
    }

    /// Calls fail at once; watches end.
    pub fn partition(&self) {
        self.set(|s| s.partitioned = true)
    }

    /// Ends pauses, held answers and partitions.
    pub fn heal(&self) {
        self.set(|s| *s = FaultState::default())
    }

    /// Calls that failed so far.
    pub fn failed(&self) -> u64 {
        self.failed.load(SeqCst)
    }

    fn fail(&self, why: &str) -> EtcdError {
        self.failed.fetch_add(1, SeqCst);
        EtcdError::Unreachable(format!("in-memory store: {why}"))
    }

    /// Waits while `blocked` holds, up to `deadline`: Ok(true) if it no longer does, Ok(false)
    /// at the deadline; Err when partitioned.
    fn wait_while(
        &self,
        deadline: Instant,
        blocked: impl Fn(&FaultState) -> bool,
    ) -> Result<bool, EtcdError> {
        let mut st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if st.partitioned {
                drop(st);
                return Err(self.fail("partitioned"));
            }
            if !blocked(&st) {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            st = (self.changed.wait_timeout(st, deadline - now))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// A client of a [`MemEtcd`], in a fault domain.
pub struct MemClient {
    shared: Arc<Shared>,
    faults: Arc<Faults>,
    timeout: Duration,
}

impl std::fmt::Debug for MemClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemClient")
            .field("faults", &self.faults.id)
            .finish()
    }
}

impl MemClient {
    /// One call: through the faults on the way in, to the store, through them on the way
    /// out.
    fn call<T>(&self, f: impl FnOnce(&mut Store) -> Result<T, EtcdError>) -> Result<T, EtcdError> {
        let deadline = Instant::now() + self.timeout;
        if !self.faults.wait_while(deadline, |s| s.paused)? {
            return Err(self.faults.fail("timed out (paused)"));
        }
        let out = f(&mut self.shared.lock());
        self.shared.changed.notify_all();
        if !self.faults.wait_while(deadline, |s| s.holding)? {
            return Err(self.faults.fail("the answer timed out"));
        }
        out
    }
}

impl Coord for MemClient {
    fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<i64, EtcdError> {
        self.call(|st| st.put(key, value, lease))
    }

    fn put_if_and(
        &self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        expect: i64,
        also: Option<(&[u8], &[u8])>,
    ) -> Result<Result<i64, Option<Kv>>, EtcdError> {
        self.call(|st| st.put_if_and(key, value, lease, expect, also))
    }

    fn range_prefix(&self, prefix: &[u8]) -> Result<(Vec<Kv>, i64), EtcdError> {
        self.call(|st| Ok((st.range(prefix, st.rev)?, st.rev)))
    }

    fn range_prefix_at(&self, prefix: &[u8], revision: i64) -> Result<Vec<Kv>, EtcdError> {
        self.call(|st| st.range(prefix, revision))
    }

    fn get_kv(&self, key: &[u8]) -> Result<Option<Kv>, EtcdError> {
        self.call(|st| Ok(st.get(key)))
    }

    fn delete_if(&self, key: &[u8], expect: i64) -> Result<bool, EtcdError> {
        self.call(|st| Ok(st.delete_if(key, expect)))
    }

    fn delete(&self, key: &[u8]) -> Result<(), EtcdError> {
        self.call(|st| {
            st.delete(key);
            Ok(())
        })
    }

    fn delete_prefix(&self, prefix: &[u8]) -> Result<(), EtcdError> {
        self.call(|st| {
            st.delete_prefix(prefix);
            Ok(())
        })
    }

    fn compact(&self, revision: i64) -> Result<(), EtcdError> {
        self.call(|st| st.compact(revision))
    }

    fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        let owner = self.faults.id;
        self.call(|st| Ok(st.grant(ttl, owner)))
    }

    fn keep_alive(&self, id: i64) -> Result<i64, EtcdError> {
        self.call(|st| Ok(st.keep_alive(id)))
    }

    fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.call(|st| st.revoke(id))
    }

    fn watch_prefix(&self, prefix: &[u8], from: i64) -> Result<Watch, EtcdError> {
        let next = self.call(|st| match from {
            0 => Ok(st.rev + 1),
            f if f < st.compacted => Err(EtcdError::Compacted(st.compacted)),
            f => Ok(f),
        })?;
        Ok(Watch::new(MemWatch {
            shared: self.shared.clone(),
            faults: self.faults.clone(),
            prefix: prefix.to_vec(),
            next,
        }))
    }
}

/// A watch on the store: the events from `next` on.
struct MemWatch {
    shared: Arc<Shared>,
    faults: Arc<Faults>,
    prefix: Vec<u8>,
    next: i64,
}

impl Events for MemWatch {
    fn next_events(&mut self, timeout: Duration) -> Result<Vec<Event>, EtcdError> {
        let deadline = Instant::now() + timeout;
        loop {
            // A paused network: nothing comes; a partition ends the watch.
            if !self.faults.wait_while(deadline, |s| s.paused)? {
                return Ok(Vec::new());
            }
            let st = self.shared.lock();
            let events = st.events(&self.prefix, self.next)?;
            if let Some(last) = events.last() {
                self.next = last.revision() + 1;
                return Ok(events);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(Vec::new());
            }
            let wait = (deadline - now).min(TICK);
            drop(self.shared.changed.wait_timeout(st, wait));
        }
    }
}
