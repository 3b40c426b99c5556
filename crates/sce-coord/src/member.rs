//! Membership under a lease: a host registers a key attached to an etcd lease and keeps the
//! lease alive from a thread. What matters to a cache is [`Membership::valid`]: a local
//! deadline, never later than the cluster's own expiry of the lease (it counts from before
//! each renewal was sent, less a margin for clock rates), so a host that stops hearing from
//! etcd knows it may have been dropped before anyone can act on it (issue 16: such a host
//! stops serving hits at once).
//!
//! One registration per key: the key's value starts with the registrant's id (a word), and
//! a registration puts the key only if it is absent or already holds that id (this host's
//! own earlier lease: a restart before the lease lapsed), in one etcd transaction. A key
//! another id holds under a live lease is refused ([`EtcdError::Taken`]).

use crate::coord::{Coord, EtcdError};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The registration's state is atomics, not a lock: `valid` and `registration` are asked on
/// every read a shared cache serves. Only the lease thread (and `resign`, after it stopped)
/// writes them.
struct Inner {
    etcd: Box<dyn Coord>,
    key: Vec<u8>,
    value: Vec<u8>,
    ttl: i64,
    /// The lease now.
    lease: AtomicI64,
    /// Until when this host may count on its registration, in nanoseconds of
    /// CLOCK_BOOTTIME (`now_ns`; 0: not at all).
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
    /// The last registration found the key held by another id.
    displaced: AtomicBool,
    /// Registrations that found the key held by another id, ever.
    displacements: AtomicU64,
}

/// The id a registration's value names: its first word.
fn id_of(value: &[u8]) -> &[u8] {
    value.split(|b| *b == b' ').next().unwrap_or_default()
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

/// Now on the clock deadlines are kept on, in nanoseconds: CLOCK_BOOTTIME, which goes on
/// while the machine is suspended (a monotonic clock stops then, and a host resumed after
/// its lease expired would still count on it).
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given, which lives on this stack.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_BOOTTIME) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Inner {
    /// A deadline `d` after the instant `t_ns` (of [`now_ns`]).
    fn at(&self, t_ns: u64, d: Duration) -> u64 {
        t_ns + d.as_nanos() as u64
    }

    /// Grants a new lease and puts the key under it.
    fn register(&self) -> Result<(), EtcdError> {
        // Counting on the old lease ends first: the new key tells the others not to wait
        // for this host for what was published before it, so this host must not serve
        // under the old registration meanwhile. The count rises before the new deadline
        // is set, so whoever sees the deadline sees the count.
        self.until.store(0, SeqCst);
        let sent = now_ns();
        let lease = self.etcd.grant(self.ttl)?;
        let rev = match self.claim(lease) {
            Ok(rev) => rev,
            Err(e) => {
                // The lease holds nothing: let it go now rather than at its expiry.
                let _ = self.etcd.revoke(lease);
                if matches!(e, EtcdError::Taken { .. }) {
                    self.displaced.store(true, SeqCst);
                    self.displacements.fetch_add(1, SeqCst);
                }
                return Err(e);
            }
        };
        self.displaced.store(false, SeqCst);
        self.registered_at.store(rev, SeqCst);
        self.generation.fetch_add(1, SeqCst);
        self.lease.store(lease, SeqCst);
        self.until.store(self.at(sent, usable(self.ttl)), SeqCst);
        Ok(())
    }

    /// Puts the key under `lease` if no one else holds it: it is absent, or it holds this
    /// id under this process's previous lease (a re-registration, which the put moves to
    /// the new one). The same id under another live lease is another process: a clone
    /// whose state directory came with it, or this host's previous life whose lease has
    /// not lapsed yet. It is refused like another id (a start waits for the lease first).
    fn claim(&self, lease: i64) -> Result<i64, EtcdError> {
        let mut expect = 0;
        let mine = self.lease.load(SeqCst);
        for _ in 0..8 {
            match self.etcd.put_if(&self.key, &self.value, lease, expect)? {
                Ok(rev) => return Ok(rev),
                Err(None) => expect = 0,
                Err(Some(kv))
                    if id_of(&kv.value) == id_of(&self.value) && mine != 0 && kv.lease == mine =>
                {
                    expect = kv.mod_revision
                }
                Err(Some(kv)) => {
                    return Err(EtcdError::Taken {
                        key: String::from_utf8_lossy(&self.key).into_owned(),
                        holder: String::from_utf8_lossy(&kv.value).into_owned(),
                    })
                }
            }
        }
        Err(EtcdError::Server(format!(
            "{}: the key kept changing under the registration",
            String::from_utf8_lossy(&self.key)
        )))
    }

    /// One renewal: the lease is renewed, or (expired) replaced.
    fn renew(&self) -> Result<(), EtcdError> {
        let lease = self.lease.load(SeqCst);
        let sent = now_ns();
        match self.etcd.keep_alive(lease)? {
            left if left > 0 => {
                if self.lease.load(SeqCst) == lease {
                    self.until.fetch_max(self.at(sent, usable(left)), SeqCst);
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
            let was_displaced = self.displaced.load(SeqCst);
            match self.renew() {
                Err(EtcdError::Taken { key, holder }) => {
                    self.failures.fetch_add(1, SeqCst);
                    if !was_displaced {
                        tracing::error!(key, holder, "shared mode: another server took this host's name while its lease had lapsed; passing reads through and refusing writes until the name is free (give each server its own --host-name)");
                    }
                }
                Err(_) => {
                    self.failures.fetch_add(1, SeqCst);
                }
                Ok(()) if was_displaced => {
                    tracing::info!(key = %String::from_utf8_lossy(&self.key), "shared mode: this host's name is free again: registered");
                }
                Ok(()) => {}
            }
        }
    }
}

impl Membership {
    /// Registers `key` = `value` under a lease of `ttl` seconds, and keeps it alive. The
    /// value's first word is the registrant's id: a key another id holds is waited for up
    /// to the lease time (a predecessor that died lets it lapse), then refused
    /// ([`EtcdError::Taken`]).
    pub fn join(
        etcd: impl Coord + 'static,
        key: &[u8],
        value: &[u8],
        ttl: i64,
    ) -> Result<Membership, EtcdError> {
        let inner = Arc::new(Inner {
            etcd: Box::new(etcd),
            key: key.to_vec(),
            value: value.to_vec(),
            ttl: ttl.max(1),
            lease: AtomicI64::new(0),
            until: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            registered_at: AtomicI64::new(0),
            stop: AtomicBool::new(false),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            failures: Default::default(),
            displaced: AtomicBool::new(false),
            displacements: Default::default(),
        });
        let deadline = Instant::now() + Duration::from_secs(inner.ttl as u64 + 1);
        loop {
            match inner.register() {
                Err(EtcdError::Taken { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(250))
                }
                r => break r?,
            }
        }
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
        now_ns() < self.inner.until.load(SeqCst)
    }

    /// Until when this host can count on its registration.
    pub fn valid_until(&self) -> Instant {
        let left = self.inner.until.load(SeqCst).saturating_sub(now_ns());
        Instant::now() + Duration::from_nanos(left)
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

    /// True while another id holds this registration's key (found at the last attempt):
    /// whatever this host announces under it, the holder takes for its own.
    pub fn displaced(&self) -> bool {
        self.inner.displaced.load(SeqCst)
    }

    /// How many registrations found the key held by another id (only grows): whatever was
    /// published under the name meanwhile was the holder's, not this host's.
    pub fn displacements(&self) -> u64 {
        self.inner.displacements.load(SeqCst)
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
