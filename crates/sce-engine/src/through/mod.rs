//! The write-through path (write-through, AWT and write-around): the source is the system
//! of record and holds every acknowledged write. A write goes to the source from the
//! caller's thread, its cache copies synchronously (write-through) or through the AWT
//! writer threads (`awt.rs`); reads go through the cache (`read.rs`), hits of whole pages
//! through the I/O queue when the server gave one (`hits.rs`).

mod awt;
mod hits;
mod write;

pub(crate) use awt::{awt_writer, AwtJob, Payload};
pub(crate) use hits::HitIo;
pub(crate) use write::Writer;

use crate::engine::Engine;
use awt::AwtQueue;
use hits::HitQueue;
use sce_io::{IoError, IoQueue, StartedRead};
use std::sync::{Arc, OnceLock};

/// The write-through path's own state: the AWT queue and the hit queue.
pub(crate) struct WriteThrough {
    awt: AwtQueue,
    hits: OnceLock<HitQueue>,
}

impl WriteThrough {
    /// The path, its AWT copies sent to the writers receiving from `tx`'s other end.
    pub(crate) fn new(tx: crossbeam_channel::Sender<AwtJob>) -> WriteThrough {
        WriteThrough {
            awt: AwtQueue::new(tx),
            hits: OnceLock::new(),
        }
    }

    /// A client's write (a range the caller checked).
    pub(crate) fn write(&self, w: &Writer, offset: u64, data: Payload) -> Result<(), IoError> {
        w.write(&self.awt, offset, data)
    }

    /// A client's discard: the cached pages invalidated, the source discarded.
    pub(crate) fn discard(&self, w: &Writer, offset: u64, len: u64) -> Result<(), IoError> {
        w.discard(offset, len)
    }

    /// Every acknowledged write is on the source, and the cache's records need no flush
    /// here (their ordering is the intents' business).
    pub(crate) fn flush(&self, w: &Writer) -> Result<(), IoError> {
        w.dev.flush_source()
    }

    /// Serves whole-page hits through `queue`, the cache device's data area starting at
    /// `base` there. False if it already has one.
    pub(crate) fn serve_hits_from(&self, queue: Arc<dyn IoQueue>, base: u64) -> bool {
        self.hits.set(HitQueue::new(queue, base)).is_ok()
    }

    /// The queue hits are read through.
    pub(crate) fn hit_queue(&self) -> Option<Arc<dyn IoQueue>> {
        self.hits.get().map(|h| h.queue.clone())
    }

    /// Starts a hit through the queue (see `HitQueue::start`).
    pub(crate) fn start_read(&self, e: &Arc<Engine>, offset: u64, len: u64) -> Option<StartedRead> {
        self.hits.get()?.start(e, offset, len)
    }

    /// Closes the AWT queue: the writers finish what is queued, then exit.
    pub(crate) fn close(&self) {
        self.awt.close();
    }
}
