//! Invalidate before acknowledge (docs/SHARED.md), the etcd half: a host publishes the page
//! range of a write as a key under the volume's prefix (one cluster revision), and waits
//! until every other registered host has acknowledged that revision, or left (its lease
//! expired, so its key is gone): [`crate::Tracker::publish`]. Each host's [`Listener`]
//! watches the prefix from the last
//! revision it processed, hands each invalidation to the cache (which drops those pages),
//! then acknowledges it.
//!
//! Keys under `PREFIX`: `hosts/HOST` (a [`crate::Membership`]), `inval/HOST` (the last
//! invalidation HOST published: `OFFSET LEN`), `ack/HOST` (the last revision HOST
//! processed, under its lease).

use crate::coord::{Coord, EtcdError, Event};
use std::time::Duration;

pub(crate) fn key(prefix: &str, kind: &str, host: &str) -> Vec<u8> {
    format!("{prefix}/{kind}/{host}").into_bytes()
}

/// The host a key under `PREFIX/KIND/` names, if the key is of that kind.
pub(crate) fn host_of<'a>(prefix: &str, kind: &str, k: &'a [u8]) -> Option<&'a str> {
    let k = std::str::from_utf8(k).ok()?;
    k.strip_prefix(prefix)?
        .strip_prefix('/')?
        .strip_prefix(kind)?
        .strip_prefix('/')
}

/// An invalidation's value: its ranges, `OFFSET LEN` per line.
pub fn encode(ranges: &[(u64, u64)]) -> String {
    let lines: Vec<String> = ranges.iter().map(|(o, l)| format!("{o} {l}")).collect();
    lines.join("\n")
}

/// The ranges of an invalidation's value; None if it is not one.
pub fn decode(text: &str) -> Option<Vec<(u64, u64)>> {
    text.lines()
        .map(|line| {
            let mut it = line.split(' ').map(|x| x.parse::<u64>().ok());
            match (it.next()??, it.next()??, it.next()) {
                (o, l, None) => Some((o, l)),
                _ => None,
            }
        })
        .collect()
}

/// The newest invalidation or acquisition any host published under `prefix` (0: none): a
/// host that registers again has processed everything others may have stopped waiting for
/// once its listener is past it. (A release is not among them: until its listener passes
/// one, a host counts the region as another's, which only passes its reads through.)
pub fn newest(etcd: &dyn Coord, prefix: &str) -> Result<i64, EtcdError> {
    let (kvs, _) = etcd.range_prefix(format!("{prefix}/inval/").as_bytes())?;
    let mut newest = kvs.iter().map(|kv| kv.mod_revision).max().unwrap_or(0);
    // The owner keys the listener applies, and the trace of every acquisition (an owner
    // key released since has gone, but not its acquisition's revision).
    let (kvs, _) = etcd.range_prefix(format!("{prefix}/owner/").as_bytes())?;
    let owners = kvs
        .iter()
        .filter(|kv| crate::own::region_of(prefix, &kv.key).is_some());
    newest = owners.map(|kv| kv.mod_revision).fold(newest, i64::max);
    let trace = etcd.get_kv(&crate::own::trace_key(prefix))?;
    Ok(trace.map_or(newest, |kv| newest.max(kv.mod_revision)))
}

/// What a listener hands the cache, in revision order.
#[derive(Debug)]
pub enum Change<'a> {
    /// Another host wrote this range (offset, length): drop its pages.
    Drop(u64, u64),
    /// The owner of a region changed (`crate::own`): the key as it is now, None if it was
    /// deleted (released, or its lease expired).
    Owner {
        /// The region.
        region: u64,
        /// The owner's key, or None.
        holder: Option<&'a crate::coord::Kv>,
        /// The revision of the change.
        revision: i64,
    },
}

/// A host's side: the invalidations the others publish, in revision order.
pub struct Listener {
    prefix: String,
    me: String,
    /// The last revision processed.
    done: i64,
    /// The last acknowledgement put (revision, lease): not put again while unchanged.
    acked: (i64, i64),
    /// This host's registration: invalidations under its name from before it are another
    /// server's (a clone that held the name meanwhile), or its own earlier ones: dropped.
    registered: i64,
    watch: crate::coord::Watch,
    /// Acknowledgements put so far.
    acks: u64,
}

impl Listener {
    /// Listens from revision `from` (the last one this host processed, plus one; 0: from
    /// now on).
    pub fn new(etcd: &dyn Coord, prefix: &str, me: &str, from: i64) -> Result<Listener, EtcdError> {
        // The whole volume, so that invalidations and ownership come in one revision order;
        // the other keys' changes (acknowledgements, registrations) are passed over.
        let watch = etcd.watch_prefix(format!("{prefix}/").as_bytes(), from)?;
        Ok(Listener {
            prefix: prefix.to_string(),
            me: me.to_string(),
            done: from.saturating_sub(1),
            acked: (0, 0),
            registered: 0,
            watch,
            acks: 0,
        })
    }

    /// The revision of this host's current registration (`Membership::registered_at`):
    /// only invalidations under its own name published after it are skipped as its own.
    pub fn set_registered(&mut self, revision: i64) {
        self.registered = revision;
    }

    /// Waits up to `timeout` for invalidations; hands each one (offset, length) of another
    /// host to `drop_pages` (which must have dropped them when it returns), then
    /// acknowledges the last revision under `lease`. Returns the invalidations handled.
    pub fn pump(
        &mut self,
        etcd: &dyn Coord,
        lease: i64,
        timeout: Duration,
        drop_pages: &mut dyn FnMut(u64, u64),
    ) -> Result<usize, EtcdError> {
        self.pump_all(etcd, lease, timeout, &mut |c| {
            if let Change::Drop(o, n) = c {
                drop_pages(o, n)
            }
        })
    }

    /// `pump`, with the changes of regions' owners too: each invalidation of another host
    /// and each change of an owner key goes to `on` (which must have applied it when it
    /// returns) before the revision is acknowledged.
    pub fn pump_all(
        &mut self,
        etcd: &dyn Coord,
        lease: i64,
        timeout: Duration,
        on: &mut dyn FnMut(Change),
    ) -> Result<usize, EtcdError> {
        let events = self.watch.next_events(timeout)?;
        let mut n = 0;
        for e in events {
            let (k, revision, holder) = match &e {
                Event::Put(kv) => (&kv.key, kv.mod_revision, Some(kv)),
                Event::Delete { key, mod_revision } => (key, *mod_revision, None),
            };
            if let Some(region) = crate::own::region_of(&self.prefix, k) {
                on(Change::Owner {
                    region,
                    holder,
                    revision,
                });
                self.done = self.done.max(revision);
                continue;
            }
            let Event::Put(kv) = e else { continue };
            if host_of(&self.prefix, "inval", &kv.key).is_none() {
                continue;
            }
            let from_me =
                kv.key == key(&self.prefix, "inval", &self.me) && kv.mod_revision > self.registered;
            if !from_me {
                let text = String::from_utf8_lossy(&kv.value).to_string();
                // One this host cannot read drops everything: it never acknowledges an
                // invalidation it did not apply, and never stops acknowledging.
                let ranges = decode(&text).unwrap_or_else(|| {
                    tracing::warn!(
                        revision = kv.mod_revision,
                        "an invalidation that is not OFFSET LEN lines: dropping the whole volume"
                    );
                    vec![(0, u64::MAX)]
                });
                for (o, l) in ranges {
                    on(Change::Drop(o, l));
                }
                n += 1;
            }
            self.done = self.done.max(kv.mod_revision);
        }
        if self.done > 0 && self.acked != (self.done, lease) {
            self.acked = (self.done, lease);
            etcd.put(
                &key(&self.prefix, "ack", &self.me),
                self.done.to_string().as_bytes(),
                lease,
            )?;
            self.acks += 1;
        }
        Ok(n)
    }

    /// Acknowledgements put so far (etcd puts).
    pub fn acks(&self) -> u64 {
        self.acks
    }

    /// The last revision processed.
    pub fn done(&self) -> i64 {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalidations_round_trip_and_bad_ones_are_refused() {
        let r = vec![(0, 4096), (1 << 40, 512)];
        assert_eq!(decode(&encode(&r)), Some(r));
        assert_eq!(decode("1 2 3"), None);
        assert_eq!(decode("1"), None);
        assert_eq!(decode("x 2"), None);
        assert_eq!(host_of("/p/v", "ack", b"/p/v/ack/h1"), Some("h1"));
        assert_eq!(host_of("/p/v", "ack", b"/p/v/hosts/h1"), None);
    }
}
