//! Asynchronous write-through: a write hands a copy of its data and its cache-copy tokens
//! to the AWT writer threads before it sends the source write, so both run in parallel;
//! the writers write the copies and complete them. Write-through mode writes the copies on
//! the caller's thread with the same `copy_to_cache`.

use crate::shared::Shared;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
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

/// A write's cache copies, queued for the AWT writers.
pub(crate) struct AwtJob {
    offset: u64,
    data: SharedBytes,
    copies: Vec<CacheCopy>,
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

    /// Queues the cache `copies` of a write of `data` at source offset `offset`: the
    /// client's own buffer when it gave it away (`write_shared`), else a copy. If the
    /// writers are gone (the volume is closing), the copies fail and their pages stay
    /// invalid.
    pub(crate) fn send(&self, s: &Shared, offset: u64, data: &Payload, copies: Vec<CacheCopy>) {
        let data: SharedBytes = match data {
            Payload::Shared(d) => d.clone(),
            Payload::Borrowed(d) => {
                let mut copy = AlignedBuf::new(d.len());
                copy.copy_from_slice(d);
                Arc::new(copy)
            }
        };
        let job = AwtJob {
            offset,
            data,
            copies,
        };
        let unsent = match self.tx.lock().as_ref() {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            let mut core = s.core.write();
            for copy in job.copies {
                copy.done(&mut core, false);
            }
        }
    }
}

/// An AWT writer thread: writes the queued copies until the queue is closed and empty.
pub(crate) fn awt_writer(s: &Shared, rx: Receiver<AwtJob>) {
    for job in rx.iter() {
        s.copy_to_cache(job.offset, job.copies, &job.data);
    }
}

impl Shared {
    /// Writes a write's cache copies (`data` is the whole request buffer, at source offset
    /// `offset`) and completes each; a failed copy is reported as failed, so its pages stay
    /// invalid.
    pub(crate) fn copy_to_cache(&self, offset: u64, copies: Vec<CacheCopy>, data: &[u8]) {
        let results: Vec<(CacheCopy, bool)> = copies
            .into_iter()
            .map(|copy| {
                let w = *copy.write();
                let piece = &data[w.buf_offset as usize..(w.buf_offset + w.len) as usize];
                self.record_crcs(offset + w.buf_offset, w.cache.0, piece);
                let ok = self.cache_write(w.cache.0, piece);
                (copy, ok)
            })
            .collect();
        let mut core = self.core.write();
        for (copy, ok) in results {
            copy.done(&mut core, ok);
        }
    }
}
