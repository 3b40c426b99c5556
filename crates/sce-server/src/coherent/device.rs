//! The export of a shared volume: the cached export, with writes published to the other
//! hosts before they are acknowledged and reads passed through to the source while this
//! host cannot vouch for its cache.

use super::Coherence;
use crate::attach::Attachable;
use sce_io::{BlockDevice, IoError, IoQueue, Op, QueuedReads, SharedBytes, StartedRead};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

/// A cached export in shared mode.
pub struct Coherent {
    att: Arc<Attachable>,
    coherence: Arc<Coherence>,
}

impl Coherent {
    /// `att` under `coherence`.
    pub fn new(att: Arc<Attachable>, coherence: Arc<Coherence>) -> Arc<Coherent> {
        Arc::new(Coherent { att, coherence })
    }

    /// Publishes a write once the source answered. A write that failed is announced too
    /// (part of it may have landed), and fails with its own error.
    fn published(&self, result: Result<(), IoError>, offset: u64, len: u64) -> Result<(), IoError> {
        if len == 0 {
            return result;
        }
        let announced = self.coherence.publish(offset, len);
        result.and(announced)
    }
}

impl BlockDevice for Coherent {
    fn size(&self) -> u64 {
        self.att.size()
    }

    fn logical_block_size(&self) -> u32 {
        self.att.logical_block_size()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        if self.coherence.serving_logged() {
            return self.att.read_at(offset, buf);
        }
        self.coherence
            .counters
            .passthrough_reads
            .fetch_add(1, SeqCst);
        sce_io::check_range(sce_io::Op::Read, offset, buf.len() as u64, self.size(), 1)?;
        self.att.source().read_at(offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        (self.coherence).check_writable(Op::Write, offset, buf.len() as u64)?;
        let r = self.att.write_at(offset, buf);
        self.published(r, offset, buf.len() as u64)
    }

    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        let len = data.len() as u64;
        (self.coherence).check_writable(Op::Write, offset, len)?;
        let r = self.att.write_shared(offset, data);
        self.published(r, offset, len)
    }

    fn identity(&self) -> Option<String> {
        self.att.identity()
    }

    fn flush(&self) -> Result<(), IoError> {
        self.att.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        (self.coherence).check_writable(Op::Discard, offset, len)?;
        let r = self.att.discard(offset, len);
        self.published(r, offset, len)
    }

    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<sce_io::Extent>, IoError> {
        self.att.extents(offset, len, max)
    }

    fn extents_are_local(&self) -> bool {
        self.att.extents_are_local()
    }
}

impl QueuedReads for Coherent {
    fn start_read(&self, offset: u64, len: u64) -> Option<StartedRead> {
        // Not serving: the read goes to the workers, and `read_at` passes it through.
        if !self.coherence.serving_logged() {
            return None;
        }
        self.att.start_read(offset, len)
    }

    fn queue(&self) -> Option<Arc<dyn IoQueue>> {
        self.att.queue()
    }
}
