//! `SliceDevice`: a window `[offset, offset + len)` of another device, addressed from 0.

use crate::{check_range, BlockDevice, IoError, Op};
use std::sync::Arc;

/// A window of another device, like a partition. Requests are checked against the window and
/// shifted by its offset.
pub struct SliceDevice {
    inner: Arc<dyn BlockDevice>,
    offset: u64,
    len: u64,
}

impl std::fmt::Debug for SliceDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SliceDevice")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl SliceDevice {
    /// The window `[offset, offset + len)` of `inner`. Both must be multiples of the inner
    /// device's logical block size and lie inside it.
    pub fn new(inner: Arc<dyn BlockDevice>, offset: u64, len: u64) -> Result<Self, IoError> {
        let lbs = inner.logical_block_size() as u64;
        let size = inner.size();
        if !offset.is_multiple_of(lbs)
            || !len.is_multiple_of(lbs)
            || offset.checked_add(len).is_none_or(|e| e > size)
        {
            return Err(IoError::Invalid(format!(
                "slice [{offset}, +{len}) does not fit a {size}-byte device with {lbs}-byte blocks"
            )));
        }
        Ok(SliceDevice { inner, offset, len })
    }
}

impl BlockDevice for SliceDevice {
    fn identity(&self) -> Option<String> {
        self.inner
            .identity()
            .map(|i| format!("{i}:slice={}+{}", self.offset, self.len))
    }
    fn size(&self) -> u64 {
        self.len
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        check_range(
            Op::Read,
            offset,
            buf.len() as u64,
            self.len,
            self.logical_block_size(),
        )?;
        self.inner.read_at(self.offset + offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        check_range(
            Op::Write,
            offset,
            buf.len() as u64,
            self.len,
            self.logical_block_size(),
        )?;
        self.inner.write_at(self.offset + offset, buf)
    }
    fn flush(&self) -> Result<(), IoError> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(
            Op::Discard,
            offset,
            len,
            self.len,
            self.logical_block_size(),
        )?;
        self.inner.discard(self.offset + offset, len)
    }
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<crate::Extent>, IoError> {
        check_range(Op::Read, offset, len, self.len, self.logical_block_size())?;
        self.inner.extents(self.offset + offset, len, max)
    }
    fn extents_are_local(&self) -> bool {
        self.inner.extents_are_local()
    }
}
