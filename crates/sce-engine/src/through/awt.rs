//! Asynchronous write-through: a write hands a copy of its data and its cache-copy tokens
//! to the AWT writer threads before it sends the source write, so both run in parallel;
//! the writers write the copies and complete them. Write-through mode writes the copies on
//! the caller's thread with the same `copy_to_cache`.

use super::write::Writer;
use crate::engine::Engine;
use crate::order::{levels, OrderedMutex};
use crossbeam_channel::{Receiver, Sender};
/// This file's mutexes are leaves of the lock order (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use sce_core::CacheCopy;
use sce_io::{AlignedBuf, SharedBytes};
use std::sync::Arc;

/// A write's data: borrowed from the caller (AWT copies it), or given away with
/// `write_shared` (AWT keeps a reference to it until its cache copy is written).
pub(crate) enum Payload<'a> {
    Borrowed(&'a [u8]),
    Shared(SharedBytes),
}

impl Payload<'_> {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Payload::Borrowed(d) => d,
            Payload::Shared(d) => d,
        }
    }
}

/// The cache copies of one piece of a write (one core shard's): `len` bytes at `start` in
/// the write's data, at global source offset `offset`.
pub(crate) struct CopyPiece {
    pub(crate) shard: usize,
    pub(crate) offset: u64,
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) copies: Vec<CacheCopy>,
}

/// A write's cache copies, queued for the AWT writers.
pub(crate) struct AwtJob {
    data: SharedBytes,
    pieces: Vec<CopyPiece>,
}

/// The AWT writers' queue (a leaf lock: `awt_tx` in the lock order).
pub(crate) struct AwtQueue {
    tx: Mutex<Option<Sender<AwtJob>>>,
}

impl AwtQueue {
    /// A queue feeding the writers that receive from the other end of `tx`.
    pub(crate) fn new(tx: Sender<AwtJob>) -> Self {
        AwtQueue {
            tx: Mutex::new(Some(tx)),
        }
    }

    /// Closes the queue: the writers finish what is queued, then exit.
    pub(crate) fn close(&self) {
        self.tx.lock().take();
    }

    /// Queues the cache copies of a write of `data`, piece by piece: the client's own
    /// buffer when it gave it away (`write_shared`), else a copy. If the writers are gone
    /// (the volume is closing), the copies fail and their pages stay invalid.
    pub(crate) fn send(&self, s: &Writer, data: &Payload, pieces: Vec<CopyPiece>) {
        let data: SharedBytes = match data {
            Payload::Shared(d) => d.clone(),
            Payload::Borrowed(d) => {
                let mut copy = AlignedBuf::new(d.len());
                copy.copy_from_slice(d);
                Arc::new(copy)
            }
        };
        let job = AwtJob { data, pieces };
        let unsent = match self.tx.lock().as_ref() {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            s.fail_copies(job.pieces);
        }
    }
}

/// An AWT writer thread: writes the queued copies until the queue is closed and empty.
pub(crate) fn awt_writer(s: &Engine, rx: Receiver<AwtJob>) {
    for job in rx.iter() {
        for p in job.pieces {
            let piece = &job.data[p.start..p.start + p.len];
            s.writer().copy_to_cache(p.shard, p.offset, p.copies, piece);
        }
    }
}

impl Writer<'_> {
    /// Writes the cache copies of a piece of a write planned by core shard `k` (`data` is
    /// the piece's buffer, at global source offset `offset`) and completes each; a failed
    /// copy is reported as failed, so its pages stay invalid.
    pub(crate) fn copy_to_cache(&self, k: usize, offset: u64, copies: Vec<CacheCopy>, data: &[u8]) {
        let results: Vec<(CacheCopy, bool)> = copies
            .into_iter()
            .map(|copy| {
                let w = *copy.write();
                let piece = &data[w.buf_offset as usize..(w.buf_offset + w.len) as usize];
                let cache = w.cache.0;
                self.checks.record(offset + w.buf_offset, cache, piece);
                let ok = self.faults.cache_write(cache, piece);
                (copy, ok)
            })
            .collect();
        self.cores.with_shard(k, |core| {
            for (copy, ok) in results {
                copy.done(core, ok);
            }
        });
    }

    /// Completes the copies of write pieces as failed, one core shard lock at a time.
    pub(crate) fn fail_copies(&self, pieces: Vec<CopyPiece>) {
        for p in pieces {
            self.cores.with_shard(p.shard, |core| {
                for copy in p.copies {
                    copy.done(core, false);
                }
            });
        }
    }
}
