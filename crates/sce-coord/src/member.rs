//! Membership under a lease: a host registers a key attached to an etcd lease and keeps the
//! lease alive from a thread. What matters to a cache is [`Membership::valid`]: a local
//! deadline, never later than the cluster's own expiry of the lease (it counts from before
//! each renewal was sent, less a margin for clock rates), so a host that stops hearing from
//! etcd knows it may have been dropped before anyone can act on it (issue 16: such a host
//! stops serving hits at once).

use crate::etcd::{Etcd, EtcdError};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The registration's state is atomics, not a lock: `valid` and `registration` are asked on
/// every read a shared cache serves. Only the lease thread (and `resign`, after it stopped)
/// writes them.
struct Inner {
    etcd: Etcd,
    key: Vec<u8>,
    value: Vec<u8>,
    ttl: i64,
    /// The origin of the deadlines below.
    base: Instant,
    /// The lease now.
    lease: AtomicI64,
    /// Until when this host may count on its registration, in nanoseconds after `base`
    /// (0: not at all).
    until: AtomicU64,
    /// Registrations so far, and the revision of the last one's put.
    generation: AtomicU64,
    registered_at: AtomicI64,
    stop: AtomicBool,
    /// What the lease thread sleeps on between renewals.
    sleep: Mutex<()>,
    wake: Condvar,
    /// Renewals and re-registrations that failed (etcd unreachable, lease gone).
    failures: AtomicU64,
}

/// A host's registration, kept alive in the background until [`Membership::leave`].
pub struct Membership {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The part of a lease of `ttl` seconds a host counts on: the rest covers clock rates.
fn usable(ttl: i64) -> Duration {
    Duration::from_millis((ttl.max(1) as u64) * 900)
}

impl Inner {
    /// `t` as a deadline: nanoseconds after `base`.
    fn at(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.base).as_nanos() as u64
    }

    /// Grants a new lease and puts the key under it.
    fn register(&self) -> Result<(), EtcdError> {
        // Counting on the old lease ends first: the new key tells the others not to wait
        // for this host for what was published before it, so this host must not serve
        // under the old registration meanwhile. The count rises before the new deadline
        // is set, so whoever sees the deadline sees the count.
        self.until.store(0, SeqCst);
        let sent = Instant::now();
        let lease = self.etcd.grant(self.ttl)?;
        let rev = self.etcd.put(&self.key, &self.value, lease)?;
        self.registered_at.store(rev, SeqCst);
        self.generation.fetch_add(1, SeqCst);
        self.lease.store(lease, SeqCst);
        self.until.store(self.at(sent + usable(self.ttl)), SeqCst);
        Ok(())
    }

    /// One renewal: the lease is renewed, or (expired) replaced.
    fn renew(&self) -> Result<(), EtcdError> {
        let lease = self.lease.load(SeqCst);
        let sent = Instant::now();
        match self.etcd.keep_alive(lease)? {
            left if left > 0 => {
                if self.lease.load(SeqCst) == lease {
                    self.until.fetch_max(self.at(sent + usable(left)), SeqCst);
                }
                Ok(())
            }
            _ => self.register(),
        }
    }

    fn run(&self) {
        let period = Duration::from_millis((self.ttl.max(1) as u64) * 1000 / 3);
        loop {
            let g = self.sleep.lock().unwrap();
            if self.stop.load(SeqCst) {
                return;
            }
            let (g, _) = self.wake.wait_timeout(g, period).unwrap();
            drop(g);
            if self.stop.load(SeqCst) {
                return;
            }
            if self.renew().is_err() {
                self.failures.fetch_add(1, SeqCst);
            }
        }
    }
}

impl Membership {
    /// Registers `key` = `value` under a lease of `ttl` seconds, and keeps it alive.
    pub fn join(etcd: Etcd, key: &[u8], value: &[u8], ttl: i64) -> Result<Membership, EtcdError> {
        let inner = Arc::new(Inner {
            etcd,
            key: key.to_vec(),
            value: value.to_vec(),
            ttl: ttl.max(1),
            base: Instant::now(),
            lease: AtomicI64::new(0),
            until: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            registered_at: AtomicI64::new(0),
            stop: AtomicBool::new(false),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            failures: Default::default(),
        });
        inner.register()?;
        let i = inner.clone();
        let thread = std::thread::Builder::new()
            .name("sce-lease".into())
            .spawn(move || i.run())
            .map_err(|e| EtcdError::Protocol(format!("cannot start the lease thread: {e}")))?;
        Ok(Membership {
            inner,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// True while this host can count on its registration (see the module's doc).
    pub fn valid(&self) -> bool {
        self.inner.at(Instant::now()) < self.inner.until.load(SeqCst)
    }

    /// Until when this host can count on its registration.
    pub fn valid_until(&self) -> Instant {
        self.inner.base + Duration::from_nanos(self.inner.until.load(SeqCst))
    }

    /// The lease now.
    pub fn lease(&self) -> i64 {
        self.inner.lease.load(SeqCst)
    }

    /// Registrations so far. A registration after the first means the lease lapsed: others
    /// may have stopped waiting for this host in between, so it must catch up on what they
    /// published before it counts on its cache.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(SeqCst)
    }

    /// The revision of the last registration.
    pub fn registered_at(&self) -> i64 {
        self.inner.registered_at.load(SeqCst)
    }

    /// Renewals that failed so far.
    pub fn failures(&self) -> u64 {
        self.inner.failures.load(SeqCst)
    }

    /// Stops renewing and revokes the lease (its key goes with it).
    pub fn leave(self) -> Result<(), EtcdError> {
        self.resign()
    }

    /// `leave` through a shared reference: stops renewing (no registration comes back) and
    /// revokes the lease; the host no longer counts on it.
    pub fn resign(&self) -> Result<(), EtcdError> {
        self.stop();
        self.inner.until.store(0, SeqCst);
        let lease = self.lease();
        self.inner.etcd.revoke(lease)
    }

    fn stop(&self) {
        {
            // Under the lock the thread waits with: it is waiting, or will see the flag.
            let _g = self.inner.sleep.lock().unwrap();
            self.inner.stop.store(true, SeqCst);
            self.inner.wake.notify_all();
        }
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.stop();
    }
}
