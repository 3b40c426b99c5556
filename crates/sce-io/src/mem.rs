//! `MemDevice`: a block device in memory, split into 1 MiB chunks that are allocated on first
//! write (absent chunks read as zeroes), each behind its own read-write lock. A 100 GiB device
//! costs a few MiB of lock array until it is written; discarding a whole chunk frees it.

use crate::error::{check_range, IoError, Op};
use crate::order::{levels, OrderedRwLock};
use crate::BlockDevice;
/// This file's locks are a device's own (`order.rs`).
type RwLock<T> = OrderedRwLock<levels::Device, T>;

const CHUNK_SHIFT: u32 = 20;
const CHUNK: u64 = 1 << CHUNK_SHIFT;

/// One 1 MiB chunk, allocated on first write.
type Chunk = RwLock<Option<Box<[u8]>>>;

/// A memory-backed block device. Nothing is durable; `flush` does nothing.
pub struct MemDevice {
    chunks: Box<[Chunk]>,
    size: u64,
    lbs: u32,
    id: u64,
}

/// Numbers memory devices, for their identity.
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl MemDevice {
    /// A zeroed device of `size` bytes with 512-byte blocks. Panics with a clear message if
    /// `size` is not a positive multiple of 512 (use `try_new` to get an error instead).
    pub fn new(size: u64) -> Self {
        Self::try_new(size).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A zeroed device of `size` bytes with 512-byte blocks; `IoError::Invalid` if `size` is
    /// not a positive multiple of 512.
    pub fn try_new(size: u64) -> Result<Self, IoError> {
        Self::with_block_size(size, 512)
    }

    /// A zeroed device of `size` bytes with `lbs`-byte blocks; `IoError::Invalid` if `lbs` is
    /// not a power of two or `size` is not a positive multiple of it.
    pub fn with_block_size(size: u64, lbs: u32) -> Result<Self, IoError> {
        if lbs == 0 || !lbs.is_power_of_two() || size == 0 || !size.is_multiple_of(lbs as u64) {
            return Err(IoError::Invalid(format!(
                "memory device size {size} is not a positive multiple of its block size {lbs}"
            )));
        }
        let n = usize::try_from(size.div_ceil(CHUNK))
            .map_err(|_| IoError::Invalid(format!("memory device size {size} is too large")))?;
        let chunks = (0..n)
            .map(|_| RwLock::new(None))
            .collect::<Vec<_>>()
            .into_boxed_slice();
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(MemDevice {
            chunks,
            size,
            lbs,
            id,
        })
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

    /// Bytes of memory currently allocated for data (chunks written and not discarded since).
    pub fn allocated_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .map(|c| c.read().as_ref().map_or(0, |d| d.len() as u64))
            .sum()
    }
}

impl std::fmt::Debug for MemDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the data: a device may hold gigabytes.
        f.debug_struct("MemDevice")
            .field("size", &self.size)
            .field("lbs", &self.lbs)
            .field("allocated_bytes", &self.allocated_bytes())
            .finish()
    }
}

impl BlockDevice for MemDevice {
    /// The device's number in this process: nobody but its users in this process can change
    /// its content, and it does not outlive the process.
    fn extents_are_local(&self) -> bool {
        true
    }
    fn identity(&self) -> Option<String> {
        Some(format!(
            "memory:{}:{}:{}",
            std::process::id(),
            self.id,
            self.size
        ))
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_allocated_on_write_and_freed_by_whole_discards() {
        let d = MemDevice::new(100 << 30);
        assert_eq!(d.allocated_bytes(), 0, "a fresh device holds no data");
        let mut b = vec![1u8; 8192];
        d.read_at(50 << 30, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0), "absent chunks read as zeroes");
        assert_eq!(d.allocated_bytes(), 0, "reads allocate nothing");
        // A write crossing a chunk boundary allocates both chunks.
        d.write_at(CHUNK - 4096, &[7u8; 8192]).unwrap();
        assert_eq!(d.allocated_bytes(), 2 * CHUNK);
        d.read_at(CHUNK - 4096, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 7));
        // A partial discard zeroes but keeps the chunk; a whole-chunk discard frees it.
        d.discard(CHUNK, 4096).unwrap();
        assert_eq!(d.allocated_bytes(), 2 * CHUNK);
        d.discard(0, CHUNK).unwrap();
        assert_eq!(d.allocated_bytes(), CHUNK);
        d.read_at(CHUNK - 4096, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0));
        assert!(
            !format!("{d:?}").contains("[0, 0"),
            "Debug must not dump data"
        );
    }

    #[test]
    fn bad_sizes_are_errors() {
        for (size, lbs) in [(0, 512), (1000, 512), (4096, 0), (4096, 1000), (6144, 4096)] {
            assert!(
                matches!(
                    MemDevice::with_block_size(size, lbs),
                    Err(IoError::Invalid(_))
                ),
                "size {size} lbs {lbs}"
            );
        }
        assert!(MemDevice::try_new(1000).is_err());
        let d = MemDevice::with_block_size((3 << 20) + 4096, 4096).unwrap();
        assert_eq!((d.size(), d.logical_block_size()), ((3 << 20) + 4096, 4096));
        // The short last chunk works.
        d.write_at(3 << 20, &[9u8; 4096]).unwrap();
    }
}
