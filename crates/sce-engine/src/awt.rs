//! Asynchronous write-through: a write hands a copy of its data and its cache-copy tokens
//! to the AWT writer threads before it sends the source write, so both run in parallel;
//! the writers write the copies and complete them. Write-through mode writes the copies on
//! the caller's thread with the same `copy_to_cache`.

use crate::shared::Shared;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use sce_core::CacheCopy;
use sce_io::AlignedBuf;
use std::sync::Arc;

/// A write's cache copies, queued for the AWT writers.
pub(crate) struct AwtJob {
    offset: u64,
    data: Arc<AlignedBuf>,
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

    /// Queues the cache `copies` of a write of `data` at source offset `offset`. If the
    /// writers are gone (the volume is closing), the copies fail and their pages stay invalid.
    pub(crate) fn send(&self, s: &Shared, offset: u64, data: &[u8], copies: Vec<CacheCopy>) {
        let mut copy = AlignedBuf::new(data.len());
        copy.copy_from_slice(data);
        let job = AwtJob {
            offset,
            data: Arc::new(copy),
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
