//! `CacheVolume` as a `BlockDevice` (and as a source of queued hits): the range checked,
//! then the write path chosen at open (`path.rs`). Every request enters the engine here.

use crate::through::Payload;
use crate::volume::CacheVolume;
use sce_io::{
    check_range, BlockDevice, IoError, IoQueue, Op, QueuedReads, SharedBytes, StartedRead,
    StartedWrite,
};
use std::sync::Arc;

impl CacheVolume {
    /// Checks a request against the volume's size and block size.
    fn check(&self, op: Op, offset: u64, len: u64) -> Result<(), IoError> {
        let d = self.engine.admin().dev;
        check_range(op, offset, len, d.size, d.lbs)
    }

    /// Runs a write or discard, counted in flight and timed into the write histogram.
    fn timed_write(&self, f: impl FnOnce() -> Result<(), IoError>) -> Result<(), IoError> {
        let lat = &self.engine.admin().counters.latencies;
        let _in_flight = crate::stats::InFlight::new(&lat.in_flight);
        let t0 = std::time::Instant::now();
        let r = f();
        lat.write.record_since(t0);
        r
    }

    /// `read_at` that tells whether every byte came from the cache (a hit).
    #[inline]
    pub fn read_hit(&self, offset: u64, buf: &mut [u8]) -> Result<bool, IoError> {
        self.check(Op::Read, offset, buf.len() as u64)?;
        self.path.read(&self.engine, offset, buf)
    }
}

impl QueuedReads for CacheVolume {
    fn start_read(&self, offset: u64, len: u64) -> Option<StartedRead> {
        self.check(Op::Read, offset, len).ok()?;
        self.path.start_read(&self.engine, offset, len)
    }

    fn queue(&self) -> Option<Arc<dyn IoQueue>> {
        self.hit_queue()
    }

    /// Write-back through the log: a write of whole pages is one append to the log on the
    /// cache device (no edge pages to read, perhaps from the source), and a flush one
    /// commit; both take about what the device's own write or flush takes.
    fn runs_locally(&self, op: Op, offset: u64, len: u64) -> bool {
        let ps = sce_core::PAGE_SIZE;
        let Some(log) = self.path.log() else {
            return false;
        };
        // A drain sends writes through to the source, and FLUSH flushes it.
        if self.engine.admin().health.passthrough() || log.drain_under_way() {
            return false;
        }
        match op {
            Op::Write => {
                offset.is_multiple_of(ps)
                    && len.is_multiple_of(ps)
                    && self.check(op, offset, len).is_ok()
                    && !log.sequential(offset, len)
            }
            Op::Flush => true,
            Op::Read | Op::Discard => false,
        }
    }

    /// Write-back through the log, with a queue: a write of whole pages that needs no
    /// waiting (`log/queued.rs`).
    fn start_write(&self, offset: u64, len: u64) -> Option<(StartedWrite, Arc<dyn IoQueue>)> {
        self.check(Op::Write, offset, len).ok()?;
        self.path.log()?.start_write(&self.engine, offset, len)
    }
}

impl BlockDevice for CacheVolume {
    fn size(&self) -> u64 {
        self.engine.admin().dev.size
    }

    fn logical_block_size(&self) -> u32 {
        self.engine.admin().dev.lbs
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.read_hit(offset, buf).map(|_| ())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.check(Op::Write, offset, buf.len() as u64)?;
        self.timed_write(|| {
            self.path
                .write(&self.engine, offset, Payload::Borrowed(buf))
        })
    }

    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        self.check(Op::Write, offset, data.len() as u64)?;
        self.timed_write(|| self.path.write(&self.engine, offset, Payload::Shared(data)))
    }

    fn flush(&self) -> Result<(), IoError> {
        self.path.flush(&self.engine)
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.check(Op::Discard, offset, len)?;
        self.timed_write(|| self.path.discard(&self.engine, offset, len))
    }

    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<sce_io::Extent>, IoError> {
        self.path.extents(self.engine.admin().dev, offset, len, max)
    }

    fn extents_are_local(&self) -> bool {
        self.path.extents_are_local(self.engine.admin().dev)
    }
}
