//! Invalidate before acknowledge (docs/SHARED.md), the etcd half: a host publishes the page
//! range of a write as a key under the volume's prefix (one cluster revision), and waits
//! until every other registered host has acknowledged that revision, or left (its lease
//! expired, so its key is gone). Each host's [`Listener`] watches the prefix from the last
//! revision it processed, hands each invalidation to the cache (which drops those pages),
//! then acknowledges it.
//!
//! Keys under `PREFIX`: `hosts/HOST` (a [`crate::Membership`]), `inval/HOST` (the last
//! invalidation HOST published: `OFFSET LEN`), `ack/HOST` (the last revision HOST
//! processed, under its lease).

use crate::etcd::{Etcd, EtcdError, Event};
use std::time::{Duration, Instant};

fn key(prefix: &str, kind: &str, host: &str) -> Vec<u8> {
    format!("{prefix}/{kind}/{host}").into_bytes()
}

/// The hosts registered under `prefix`, but `me`.
fn others(etcd: &Etcd, prefix: &str, me: &str) -> Result<Vec<String>, EtcdError> {
    let (kvs, _) = etcd.range_prefix(format!("{prefix}/hosts/").as_bytes())?;
    Ok(kvs
        .iter()
        .filter_map(|kv| {
            let k = String::from_utf8_lossy(&kv.key);
            k.rsplit('/').next().map(str::to_string)
        })
        .filter(|h| h != me)
        .collect())
}

/// Publishes that host `me` is about to write `[offset, offset + len)`, and waits until
/// every other host registered under `prefix` has processed it (or left), up to `timeout`.
/// Returns the invalidation's revision. An error: the write must not go ahead as a cached
/// one (the caller's host passes I/O through until it can publish again).
pub fn publish(
    etcd: &Etcd,
    prefix: &str,
    me: &str,
    (offset, len): (u64, u64),
    timeout: Duration,
) -> Result<i64, EtcdError> {
    let rev = etcd.put(
        &key(prefix, "inval", me),
        format!("{offset} {len}").as_bytes(),
        0,
    )?;
    let t0 = Instant::now();
    loop {
        let hosts = others(etcd, prefix, me)?;
        let (acks, _) = etcd.range_prefix(format!("{prefix}/ack/").as_bytes())?;
        let acked = |h: &String| {
            acks.iter().any(|kv| {
                kv.key == key(prefix, "ack", h)
                    && String::from_utf8_lossy(&kv.value)
                        .parse::<i64>()
                        .unwrap_or(0)
                        >= rev
            })
        };
        if hosts.iter().all(acked) {
            return Ok(rev);
        }
        if t0.elapsed() > timeout {
            let late: Vec<&String> = hosts.iter().filter(|h| !acked(h)).collect();
            return Err(EtcdError::Server(format!(
                "hosts {late:?} did not acknowledge invalidation {rev} in time"
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A host's side: the invalidations the others publish, in revision order.
pub struct Listener {
    prefix: String,
    me: String,
    /// The last revision processed.
    done: i64,
    watch: crate::etcd::Watch,
}

impl Listener {
    /// Listens from revision `from` (the last one this host processed, plus one; 0: from
    /// now on).
    pub fn new(etcd: &Etcd, prefix: &str, me: &str, from: i64) -> Result<Listener, EtcdError> {
        let watch = etcd.watch_prefix(format!("{prefix}/inval/").as_bytes(), from)?;
        Ok(Listener {
            prefix: prefix.to_string(),
            me: me.to_string(),
            done: from.saturating_sub(1),
            watch,
        })
    }

    /// Waits up to `timeout` for invalidations; hands each one (offset, length) of another
    /// host to `drop_pages` (which must have dropped them when it returns), then
    /// acknowledges the last revision under `lease`. Returns the invalidations handled.
    pub fn pump(
        &mut self,
        etcd: &Etcd,
        lease: i64,
        timeout: Duration,
        drop_pages: &mut dyn FnMut(u64, u64),
    ) -> Result<usize, EtcdError> {
        let events = self.watch.next_events(timeout)?;
        let mut n = 0;
        for e in events {
            let Event::Put(kv) = e else { continue };
            let from_me = kv.key == key(&self.prefix, "inval", &self.me);
            if !from_me {
                let text = String::from_utf8_lossy(&kv.value).to_string();
                let mut it = text.split(' ').map(|x| x.parse::<u64>());
                match (it.next(), it.next()) {
                    (Some(Ok(o)), Some(Ok(l))) => drop_pages(o, l),
                    _ => {
                        return Err(EtcdError::Protocol(format!(
                            "bad invalidation {text:?} at revision {}",
                            kv.mod_revision
                        )))
                    }
                }
                n += 1;
            }
            self.done = self.done.max(kv.mod_revision);
        }
        if self.done > 0 {
            etcd.put(
                &key(&self.prefix, "ack", &self.me),
                self.done.to_string().as_bytes(),
                lease,
            )?;
        }
        Ok(n)
    }

    /// The last revision processed.
    pub fn done(&self) -> i64 {
        self.done
    }
}
