//! What a publishing host must know of the others: which hosts are registered under the
//! volume's prefix and the last invalidation each acknowledged, kept current by one watch
//! for the host's life (a snapshot, then the changes after it, in revision order). A
//! publication then costs one put, and waits on this state rather than opening a watch and
//! reading the prefix per write.

use crate::coord::{Coord, Event, Kv};
use crate::inval::{encode, host_of, key};
use crate::EtcdError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    /// The revision the state reflects (0: none yet, or the watch broke).
    rev: i64,
    /// Registered hosts, with the revision of their registration.
    hosts: HashMap<String, i64>,
    /// The last revision each host acknowledged.
    acks: HashMap<String, i64>,
    /// Registered hosts' leases.
    leases: HashMap<String, i64>,
}

impl State {
    fn apply(&mut self, prefix: &str, e: &Event) {
        match e {
            Event::Put(kv) => self.put(prefix, kv),
            Event::Delete { key, mod_revision } => {
                if let Some(h) = host_of(prefix, "hosts", key) {
                    self.hosts.remove(h);
                    self.leases.remove(h);
                }
                if let Some(h) = host_of(prefix, "ack", key) {
                    self.acks.remove(h);
                }
                self.rev = self.rev.max(*mod_revision);
            }
        }
    }

    fn put(&mut self, prefix: &str, kv: &Kv) {
        if let Some(h) = host_of(prefix, "hosts", &kv.key) {
            self.hosts.insert(h.to_string(), kv.mod_revision);
            self.leases.insert(h.to_string(), kv.lease);
        }
        if let Some(h) = host_of(prefix, "ack", &kv.key) {
            let r = String::from_utf8_lossy(&kv.value).parse().unwrap_or(0);
            self.acks.insert(h.to_string(), r);
        }
        self.rev = self.rev.max(kv.mod_revision);
    }

    /// The hosts but `me`, registered before `rev`, that have not acknowledged it.
    fn pending(&self, me: &str, rev: i64) -> Vec<String> {
        self.hosts
            .iter()
            .filter(|(h, since)| *h != me && **since < rev)
            .filter(|(h, _)| self.acks.get(*h).is_none_or(|a| *a < rev))
            .map(|(h, _)| h.clone())
            .collect()
    }
}

struct Shared {
    prefix: String,
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
}

/// The other hosts of a volume, as a publishing host sees them.
pub struct Tracker {
    shared: Arc<Shared>,
    me: String,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Tracker {
    /// Tracks the hosts under `prefix` for host `me`, through `etcd` (a client of its own).
    pub fn start(etcd: impl Coord + 'static, prefix: &str, me: &str) -> Result<Tracker, EtcdError> {
        let shared = Arc::new(Shared {
            prefix: prefix.to_string(),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("sce-tracker".into())
            .spawn(move || s.run(&etcd))
            .map_err(|e| EtcdError::Protocol(format!("cannot start the tracker: {e}")))?;
        Ok(Tracker {
            shared,
            me: me.to_string(),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Publishes that this host wrote `ranges` (one put under `inval/ME`), and waits until
    /// every other host registered before it has acknowledged it, or left, up to `timeout`.
    /// Returns the invalidation's revision.
    pub fn publish(
        &self,
        etcd: &dyn Coord,
        ranges: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<i64, EtcdError> {
        let deadline = Instant::now() + timeout;
        let p = &self.shared.prefix;
        let rev = etcd.put(&key(p, "inval", &self.me), encode(ranges).as_bytes(), 0)?;
        self.wait_acked(rev, deadline)?;
        Ok(rev)
    }

    /// Waits until every other host registered before revision `rev` has acknowledged it
    /// (its listener processed every change up to it), or left, until `deadline`.
    pub fn wait_acked(&self, rev: i64, deadline: Instant) -> Result<(), EtcdError> {
        let mut st = self.shared.state.lock().unwrap();
        loop {
            // Only a state at or past the revision knows every host registered before it.
            let pending = (st.rev >= rev).then(|| st.pending(&self.me, rev));
            if pending.as_ref().is_some_and(Vec::is_empty) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(EtcdError::Server(match pending {
                    Some(p) => format!("hosts {p:?} did not acknowledge revision {rev} in time"),
                    None => format!("etcd's changes up to {rev} did not come in time"),
                }));
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap()
                .0;
        }
    }

    /// The lease of host `host`'s registration, as the tracker last saw it (None: not
    /// registered).
    pub fn lease_of(&self, host: &str) -> Option<i64> {
        self.shared.state.lock().unwrap().leases.get(host).copied()
    }
}

impl Shared {
    /// A snapshot of the prefix, then its changes; again after any error.
    fn run(&self, etcd: &dyn Coord) {
        while !self.stop.load(SeqCst) {
            if let Err(e) = self.follow(etcd) {
                tracing::debug!(prefix = %self.prefix, "tracker: following again ({e})");
                self.state.lock().unwrap().rev = 0;
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    fn follow(&self, etcd: &dyn Coord) -> Result<(), EtcdError> {
        let p = format!("{}/", self.prefix);
        let (kvs, at) = etcd.range_prefix(p.as_bytes())?;
        let mut watch = etcd.watch_prefix(p.as_bytes(), at + 1)?;
        {
            let mut st = self.state.lock().unwrap();
            *st = State::default();
            for kv in &kvs {
                st.put(&self.prefix, kv);
            }
            st.rev = at;
        }
        self.changed.notify_all();
        while !self.stop.load(SeqCst) {
            let events = watch.next_events(Duration::from_millis(200))?;
            if events.is_empty() {
                continue;
            }
            let mut st = self.state.lock().unwrap();
            for e in &events {
                st.apply(&self.prefix, e);
            }
            drop(st);
            self.changed.notify_all();
        }
        Ok(())
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(k: &str, v: &str, rev: i64) -> Kv {
        Kv {
            key: k.as_bytes().to_vec(),
            value: v.as_bytes().to_vec(),
            mod_revision: rev,
            lease: 0,
        }
    }

    /// Pending: other hosts registered before the revision that have not acknowledged it.
    #[test]
    fn pending_hosts() {
        let mut st = State::default();
        st.put("/p", &kv("/p/hosts/a", "", 2));
        st.put("/p", &kv("/p/hosts/b", "", 3));
        st.put("/p", &kv("/p/hosts/c", "", 9));
        st.put("/p", &kv("/p/ack/b", "7", 8));
        assert_eq!(st.pending("a", 7), Vec::<String>::new());
        // c registered after 8: not waited for.
        assert_eq!(st.pending("a", 8), vec!["b".to_string()]);
        let mut p = st.pending("a", 10);
        p.sort();
        assert_eq!(p, vec!["b".to_string(), "c".to_string()]);
        st.apply(
            "/p",
            &Event::Delete {
                key: b"/p/hosts/b".to_vec(),
                mod_revision: 10,
            },
        );
        assert_eq!(st.pending("a", 10), vec!["c".to_string()]);
        assert_eq!(st.rev, 10);
    }
}
