//! `CacheVolume` as a `BlockDevice` (and as a source of queued hits): range checks, then
//! the write mode's path (`read`, `write`/`awt`, or `wback` in write-back).

use crate::awt::Payload;
use crate::volume::CacheVolume;
use sce_io::{
    check_range, BlockDevice, IoError, IoQueue, Op, QueuedReads, SharedBytes, StartedRead,
};
use std::sync::Arc;

impl QueuedReads for CacheVolume {
    fn start_read(&self, offset: u64, len: u64) -> Option<StartedRead> {
        check_range(
            Op::Read,
            offset,
            len,
            self.shared.source_size,
            self.shared.lbs,
        )
        .ok()?;
        if self.shared.wb.is_some() {
            // Reads take the write-back range lock: no queued hits.
            return None;
        }
        self.shared.start_hit(offset, len)
    }

    fn queue(&self) -> Option<Arc<dyn IoQueue>> {
        self.shared.hit_queue()
    }
}

impl BlockDevice for CacheVolume {
    fn size(&self) -> u64 {
        self.shared.source.size()
    }

    fn logical_block_size(&self) -> u32 {
        self.shared.lbs
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let s = &self.shared;
        check_range(Op::Read, offset, buf.len() as u64, s.source.size(), s.lbs)?;
        s.read_locked(offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let s = &self.shared;
        check_range(Op::Write, offset, buf.len() as u64, s.source.size(), s.lbs)?;
        if s.wb.is_some() {
            return self.timed_write(|| s.wb_write(offset, buf));
        }
        self.timed_write(|| s.write(&self.awt, offset, Payload::Borrowed(buf)))
    }

    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        let s = &self.shared;
        check_range(Op::Write, offset, data.len() as u64, s.source.size(), s.lbs)?;
        if s.wb.is_some() {
            return self.timed_write(|| s.wb_write(offset, &data));
        }
        self.timed_write(|| s.write(&self.awt, offset, Payload::Shared(data)))
    }

    fn flush(&self) -> Result<(), IoError> {
        // Write-through: the source is the system of record, every acknowledged write is on
        // it, and the cache's records need no flush here (their ordering is the intents'
        // business). Write-back: acknowledged writes must be durable on the cache device.
        if self.shared.wb.is_some() {
            // What the flush covers is noted before it; the superblock then says so, so
            // that a restart tells a flushed page damaged since from a torn one.
            let persist = self.shared.persist.as_ref();
            let mark = persist.map(|p| p.landed_mark());
            self.shared.cache.flush()?;
            if let (Some(p), Some(mark)) = (persist, mark) {
                p.record_landed(mark)?;
            }
        }
        self.shared.source.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let s = &self.shared;
        check_range(Op::Discard, offset, len, s.source.size(), s.lbs)?;
        if s.wb.is_some() {
            return self.timed_write(|| s.wb_zero(offset, len));
        }
        self.timed_write(|| s.discard(offset, len))
    }

    /// The source's allocation: the source is the system of record, holding every
    /// acknowledged write (and a discard punches its hole there). In write-back it is not:
    /// everything is reported as data.
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<sce_io::Extent>, IoError> {
        if self.shared.wb.is_some() {
            let _ = offset;
            return Ok(vec![sce_io::Extent::data(len)]);
        }
        self.shared.source.extents(offset, len)
    }
}
