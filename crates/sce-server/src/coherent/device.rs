//! The export of a shared volume: the cached export, with writes published to the other
//! hosts before they are acknowledged and reads passed through to the source while this
//! host cannot vouch for its cache.

use super::own::WriteKind;
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

    /// Runs the write `w` of `[offset, offset+len)`: in a region this host owns, with no
    /// etcd call (fenced by the lease when it ends); elsewhere published once the source
    /// answered. A published write that failed is announced too (part of it may have
    /// landed), and fails with its own error.
    fn written(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        w: impl FnOnce() -> Result<(), IoError>,
    ) -> Result<(), IoError> {
        self.coherence.check_writable(op, offset, len)?;
        if len == 0 {
            return w();
        }
        match self.coherence.begin_write(offset, len) {
            WriteKind::Owned { regions, lease } => {
                let r = w();
                (self.coherence).end_owned((&regions, lease), r, offset, len)
            }
            WriteKind::Published => {
                let r = w();
                let announced = self.coherence.publish(offset, len);
                r.and(announced)
            }
        }
    }

    /// True if a read of `[offset, offset+len)` may be served by the cache: this host can
    /// vouch for it, and no other host owns a region of it.
    fn cached_read(&self, offset: u64, len: u64) -> bool {
        self.coherence.serving_logged() && !self.coherence.others_own(offset, len)
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
        if self.cached_read(offset, buf.len() as u64) {
            return self.att.read_at(offset, buf);
        }
        let c = &self.coherence.counters;
        match self.coherence.serving() {
            true => c.region_reads.fetch_add(1, SeqCst),
            false => c.passthrough_reads.fetch_add(1, SeqCst),
        };
        sce_io::check_range(sce_io::Op::Read, offset, buf.len() as u64, self.size(), 1)?;
        self.att.source().read_at(offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        self.written(Op::Write, offset, len, || self.att.write_at(offset, buf))
    }

    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        let len = data.len() as u64;
        self.written(Op::Write, offset, len, || {
            self.att.write_shared(offset, data)
        })
    }

    fn identity(&self) -> Option<String> {
        self.att.identity()
    }

    fn flush(&self) -> Result<(), IoError> {
        self.att.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.written(Op::Discard, offset, len, || self.att.discard(offset, len))
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
        // Not served from the cache: the read goes to the workers, and `read_at` passes it
        // through.
        if !self.cached_read(offset, len) {
            return None;
        }
        self.att.start_read(offset, len)
    }

    fn queue(&self) -> Option<Arc<dyn IoQueue>> {
        self.att.queue()
    }
}
