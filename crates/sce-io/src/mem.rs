//! `MemDevice`: a block device in memory, split into 1 MiB chunks that are allocated on first
//! write (absent chunks read as zeroes), each behind its own read-write lock.

use crate::error::{check_range, IoError, Op};
use crate::BlockDevice;
use parking_lot::RwLock;

const CHUNK_SHIFT: u32 = 20;
const CHUNK: u64 = 1 << CHUNK_SHIFT;

/// One 1 MiB chunk, allocated on first write.
type Chunk = RwLock<Option<Box<[u8]>>>;

/// A memory-backed block device.
#[derive(Debug)]
pub struct MemDevice {
    chunks: Box<[Chunk]>,
    size: u64,
    lbs: u32,
}

impl MemDevice {
    /// A zeroed device of `size` bytes with 512-byte blocks. Panics with a clear message if
    /// `size` is not a positive multiple of 512 (use `try_new` to get an error instead).
    pub fn new(size: u64) -> Self {
        Self::try_new(size, 512).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A zeroed device of `size` bytes with `lbs`-byte blocks.
    pub fn try_new(size: u64, lbs: u32) -> Result<Self, IoError> {
        if lbs == 0 || !lbs.is_power_of_two() || size == 0 || !size.is_multiple_of(lbs as u64) {
            return Err(IoError::Invalid(format!(
                "memory device size {size} is not a positive multiple of its block size {lbs}"
            )));
        }
        let n = size.div_ceil(CHUNK) as usize;
        let chunks = (0..n)
            .map(|_| RwLock::new(None))
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Ok(MemDevice { chunks, size, lbs })
    }

    /// Visits the chunk pieces of `[offset, offset + len)`: (chunk index, offset in chunk,
    /// offset in the caller's buffer, length).
    fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (usize, usize, usize, usize)> {
        let end = offset + len;
        let mut at = offset;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let c = at >> CHUNK_SHIFT;
            let in_chunk = (at & (CHUNK - 1)) as usize;
            let n = (CHUNK - in_chunk as u64).min(end - at) as usize;
            let item = (c as usize, in_chunk, (at - offset) as usize, n);
            at += n as u64;
            Some(item)
        })
    }

    fn chunk_len(&self, c: usize) -> usize {
        (self.size - ((c as u64) << CHUNK_SHIFT)).min(CHUNK) as usize
    }
}

impl BlockDevice for MemDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_size(&self) -> u32 {
        self.lbs
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        check_range(Op::Read, offset, buf.len() as u64, self.size, self.lbs)?;
        for (c, o, b, n) in Self::pieces(offset, buf.len() as u64) {
            let g = self.chunks[c].read();
            match g.as_deref() {
                Some(data) => buf[b..b + n].copy_from_slice(&data[o..o + n]),
                None => buf[b..b + n].fill(0),
            }
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        check_range(Op::Write, offset, buf.len() as u64, self.size, self.lbs)?;
        for (c, o, b, n) in Self::pieces(offset, buf.len() as u64) {
            let mut g = self.chunks[c].write();
            let len = self.chunk_len(c);
            let data = g.get_or_insert_with(|| vec![0u8; len].into_boxed_slice());
            data[o..o + n].copy_from_slice(&buf[b..b + n]);
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(Op::Discard, offset, len, self.size, self.lbs)?;
        for (c, o, _, n) in Self::pieces(offset, len) {
            let mut g = self.chunks[c].write();
            if o == 0 && n == self.chunk_len(c) {
                *g = None;
            } else if let Some(data) = g.as_deref_mut() {
                data[o..o + n].fill(0);
            }
        }
        Ok(())
    }
}
