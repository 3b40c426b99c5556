//! `SparseDevice`: a block device of any size that stores only what is written to it, for
//! `sce footprint`, which opens a real cached volume over two of them (a 100 TiB source, a
//! 2 TiB cache) to count what the volume allocates.
//!
//! Never-written ranges read as zeroes. Written 4 KiB blocks are kept in memory, except
//! all-zero ones, which are dropped (they read back as zeroes anyway): opening a cache writes
//! only its superblocks and intent bitmap, a few hundred KiB at most, and no data is ever
//! written because nothing reads or writes through the volume. The blocks are allocated
//! inside [`crate::alloc::uncounted`], so the allocator's count holds only the cache's own
//! structures.

use crate::alloc::uncounted;
use sce_io::order::{levels, OrderedMutex};
/// A device's own lock (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use sce_io::{check_range, BlockDevice, IoError, Op};
use std::collections::BTreeMap;

const BLOCK: u64 = 4096;

/// A device of `size` bytes that keeps only the non-zero blocks written to it.
pub struct SparseDevice {
    size: u64,
    blocks: Mutex<BTreeMap<u64, Box<[u8]>>>,
}

impl SparseDevice {
    /// A zeroed device of `size` bytes (a multiple of 512) with 512-byte blocks.
    pub fn new(size: u64) -> Result<Self, IoError> {
        if size == 0 || !size.is_multiple_of(512) {
            return Err(IoError::Invalid(format!(
                "device size {size} is not a positive multiple of 512"
            )));
        }
        Ok(SparseDevice {
            size,
            blocks: Mutex::new(BTreeMap::new()),
        })
    }

    /// The 4 KiB pieces of `[offset, offset + len)`: (block index, offset in the block, offset
    /// in the caller's buffer, length).
    fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize, usize)> {
        let end = offset + len;
        let mut at = offset;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let n = (BLOCK - at % BLOCK).min(end - at);
            let item = (
                at / BLOCK,
                (at % BLOCK) as usize,
                (at - offset) as usize,
                n as usize,
            );
            at += n;
            Some(item)
        })
    }
}

impl Drop for SparseDevice {
    fn drop(&mut self) {
        // Freed uncounted, as they were allocated.
        let blocks = std::mem::take(self.blocks.get_mut());
        uncounted(move || drop(blocks));
    }
}

impl BlockDevice for SparseDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_size(&self) -> u32 {
        512
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        check_range(Op::Read, offset, buf.len() as u64, self.size, 512)?;
        buf.fill(0);
        let blocks = self.blocks.lock();
        let first = offset / BLOCK;
        let last = (offset + buf.len() as u64).div_ceil(BLOCK);
        for (&b, data) in blocks.range(first..last) {
            let lo = (b * BLOCK).max(offset);
            let hi = ((b + 1) * BLOCK).min(offset + buf.len() as u64);
            let (at, from) = ((lo - offset) as usize, (lo - b * BLOCK) as usize);
            let n = (hi - lo) as usize;
            buf[at..at + n].copy_from_slice(&data[from..from + n]);
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        check_range(Op::Write, offset, buf.len() as u64, self.size, 512)?;
        let mut blocks = self.blocks.lock();
        uncounted(|| {
            for (b, o, at, n) in Self::pieces(offset, buf.len() as u64) {
                let src = &buf[at..at + n];
                match blocks.get_mut(&b) {
                    Some(data) => data[o..o + n].copy_from_slice(src),
                    None if src.iter().all(|&x| x == 0) => continue,
                    None => {
                        let mut data = vec![0u8; BLOCK as usize].into_boxed_slice();
                        data[o..o + n].copy_from_slice(src);
                        blocks.insert(b, data);
                        continue;
                    }
                }
                if blocks[&b].iter().all(|&x| x == 0) {
                    blocks.remove(&b);
                }
            }
        });
        Ok(())
    }

    fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(Op::Discard, offset, len, self.size, 512)?;
        let zero = vec![0u8; BLOCK as usize];
        for (b, o, _, n) in Self::pieces(offset, len) {
            self.write_at(b * BLOCK + o as u64, &zero[..n])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conformance() {
        sce_io::conformance::run_all(&SparseDevice::new(16 << 20).unwrap());
    }
}
