//! What sce asks of its coordination store, as a trait: etcd's keys with revisions,
//! transactions, compaction, leases and watches from a revision, exactly as far as the
//! shared mode uses them. [`crate::Etcd`] is the real one (etcd's JSON gateway);
//! [`crate::mem::MemEtcd`] hands out in-memory clients with faults on command, for tests
//! that run several hosts in one process.
//!
//! Coordination is off the per-I/O hot path (a read never calls it; a write that is not
//! owned calls it once per batch of writes), so the users take `&dyn Coord` or own a
//! `Box<dyn Coord>`: one virtual call per etcd round trip.

use std::time::Duration;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No member answered.
    #[error("no etcd member answered ({0})")]
    Unreachable(String),
    /// A member answered with an error.
    #[error("etcd: {0}")]
    Server(String),
    /// An answer that is not what the gateway sends.
    #[error("etcd: bad answer: {0}")]
    Protocol(String),
    /// A bad endpoint.
    #[error("etcd endpoint {0:?}: {1}")]
    Endpoint(String, String),
    /// A watch asked for revisions the cluster has compacted away (the oldest it keeps).
    #[error("etcd: revisions before {0} are compacted")]
    Compacted(i64),
    /// A registration found its key held by someone else's live lease.
    #[error("{key} is held by another live registration ({holder})")]
    Taken {
        /// The key.
        key: String,
        /// What the holder put there.
        holder: String,
    },
}

/// A key, its value, and the revision that last changed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// The cluster revision of its last change.
    pub mod_revision: i64,
    /// The lease it is attached to (0: none).
    pub lease: i64,
}

/// A change a watch saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A key was put.
    Put(Kv),
    /// A key was deleted (or its lease expired), at this revision.
    Delete {
        /// The key.
        key: Vec<u8>,
        /// The revision of the deletion.
        mod_revision: i64,
    },
}

impl Event {
    /// The revision of the change.
    pub fn revision(&self) -> i64 {
        match self {
            Event::Put(kv) => kv.mod_revision,
            Event::Delete { mod_revision, .. } => *mod_revision,
        }
    }
}

/// The end of the range of keys starting with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The source of a watch's events (an HTTP stream, or the in-memory store).
pub trait Events: Send {
    /// See [`Watch::next_events`].
    fn next_events(&mut self, timeout: Duration) -> Result<Vec<Event>, EtcdError>;
}

/// A watch: its events, in revision order, as they come.
pub struct Watch(Box<dyn Events>);

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Watch")
    }
}

impl Watch {
    /// A watch over `events`.
    pub fn new(events: impl Events + 'static) -> Watch {
        Watch(Box::new(events))
    }

    /// The next batch of events; waits up to `timeout`. An empty batch: nothing came. An
    /// error: the watch ended (start another from the last revision seen plus one);
    /// [`EtcdError::Compacted`] if the revisions it was to send next are compacted.
    pub fn next_events(&mut self, timeout: Duration) -> Result<Vec<Event>, EtcdError> {
        self.0.next_events(timeout)
    }
}

/// A client of the coordination store: etcd's semantics, as sce relies on them.
///
/// Revisions are the store's, one per change (a transaction's puts share one); a value put
/// under a lease goes when the lease is revoked or expires (a deletion event at a revision
/// of its own). Calls that cannot reach the store fail with [`EtcdError::Unreachable`]; a
/// read of history or a watch from before the compacted revision with
/// [`EtcdError::Compacted`].
pub trait Coord: Send + Sync + std::fmt::Debug {
    /// Puts `value` at `key` (attached to `lease` unless 0); the revision it made.
    fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<i64, EtcdError>;

    /// Puts `value` at `key` under `lease`, in one transaction, only if the key is absent
    /// (`expect` 0) or was last changed at revision `expect`. Ok(revision made), or
    /// Err(what the key holds instead: None if it is absent).
    fn put_if(
        &self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        expect: i64,
    ) -> Result<Result<i64, Option<Kv>>, EtcdError> {
        self.put_if_and(key, value, lease, expect, None)
    }

    /// `put_if`, putting `also` (a key and a value, with no lease) in the same transaction
    /// when it succeeds: both get the same revision.
    fn put_if_and(
        &self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        expect: i64,
        also: Option<(&[u8], &[u8])>,
    ) -> Result<Result<i64, Option<Kv>>, EtcdError>;

    /// The keys starting with `prefix`, and the store's revision.
    fn range_prefix(&self, prefix: &[u8]) -> Result<(Vec<Kv>, i64), EtcdError>;

    /// The keys starting with `prefix` as they were at `revision` (a read of history).
    /// [`EtcdError::Compacted`] if the store no longer keeps it.
    fn range_prefix_at(&self, prefix: &[u8], revision: i64) -> Result<Vec<Kv>, EtcdError>;

    /// The key `key` exactly with its revision and lease, if there is one.
    fn get_kv(&self, key: &[u8]) -> Result<Option<Kv>, EtcdError>;

    /// The value at `key` exactly, if there is one.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, EtcdError> {
        Ok(self.get_kv(key)?.map(|kv| kv.value))
    }

    /// Deletes `key` in one transaction only if it was last changed at revision `expect`;
    /// false if it was not (changed since, or absent).
    fn delete_if(&self, key: &[u8], expect: i64) -> Result<bool, EtcdError>;

    /// Deletes `key`.
    fn delete(&self, key: &[u8]) -> Result<(), EtcdError>;

    /// Deletes every key starting with `prefix`.
    fn delete_prefix(&self, prefix: &[u8]) -> Result<(), EtcdError>;

    /// Compacts the key history up to `revision`: watches can no longer start before it.
    fn compact(&self, revision: i64) -> Result<(), EtcdError>;

    /// A lease of `ttl` seconds; its id.
    fn grant(&self, ttl: i64) -> Result<i64, EtcdError>;

    /// Renews lease `id`; the seconds it has left (0 or less: it has expired).
    fn keep_alive(&self, id: i64) -> Result<i64, EtcdError>;

    /// Revokes lease `id`: its keys are deleted.
    fn revoke(&self, id: i64) -> Result<(), EtcdError>;

    /// Watches the keys starting with `prefix` from revision `from` (0: from now on).
    fn watch_prefix(&self, prefix: &[u8], from: i64) -> Result<Watch, EtcdError>;
}

/// A boxed client is a client (what a host hands its threads).
impl<T: Coord + ?Sized> Coord for Box<T> {
    fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<i64, EtcdError> {
        (**self).put(key, value, lease)
    }
    fn put_if_and(
        &self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        expect: i64,
        also: Option<(&[u8], &[u8])>,
    ) -> Result<Result<i64, Option<Kv>>, EtcdError> {
        (**self).put_if_and(key, value, lease, expect, also)
    }
    fn range_prefix(&self, prefix: &[u8]) -> Result<(Vec<Kv>, i64), EtcdError> {
        (**self).range_prefix(prefix)
    }
    fn range_prefix_at(&self, prefix: &[u8], revision: i64) -> Result<Vec<Kv>, EtcdError> {
        (**self).range_prefix_at(prefix, revision)
    }
    fn get_kv(&self, key: &[u8]) -> Result<Option<Kv>, EtcdError> {
        (**self).get_kv(key)
    }
    fn delete_if(&self, key: &[u8], expect: i64) -> Result<bool, EtcdError> {
        (**self).delete_if(key, expect)
    }
    fn delete(&self, key: &[u8]) -> Result<(), EtcdError> {
        (**self).delete(key)
    }
    fn delete_prefix(&self, prefix: &[u8]) -> Result<(), EtcdError> {
        (**self).delete_prefix(prefix)
    }
    fn compact(&self, revision: i64) -> Result<(), EtcdError> {
        (**self).compact(revision)
    }
    fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        (**self).grant(ttl)
    }
    fn keep_alive(&self, id: i64) -> Result<i64, EtcdError> {
        (**self).keep_alive(id)
    }
    fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        (**self).revoke(id)
    }
    fn watch_prefix(&self, prefix: &[u8], from: i64) -> Result<Watch, EtcdError> {
        (**self).watch_prefix(prefix, from)
    }
}
