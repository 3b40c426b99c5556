//! `sce-io`: the block-device layer of sce.
//!
//! [`BlockDevice`] is what every layer above speaks: the cached volume is one, the NBD server
//! serves one. Implementations: [`FileDevice`] (files and block devices, O_DIRECT),
//! [`MemDevice`], [`PowerCutDevice`] (a volatile write cache that loses power, for crash
//! tests), and the wrappers [`LatencyDevice`] (a slow SAN or disk) and [`FaultDevice`]
//! (injected faults). [`conformance`] is the one test suite they all pass.

/// Inside a wrapper's `impl BlockDevice`: the metadata methods (identity, extents, size,
/// logical block size), answered by the wrapped device `self.inner` unchanged.
macro_rules! forward_metadata {
    () => {
        fn identity(&self) -> Option<String> {
            self.inner.identity()
        }
        fn extents(
            &self,
            offset: u64,
            len: u64,
            max: usize,
        ) -> Result<Vec<crate::Extent>, IoError> {
            self.inner.extents(offset, len, max)
        }
        fn extents_are_local(&self) -> bool {
            self.inner.extents_are_local()
        }
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn logical_block_size(&self) -> u32 {
            self.inner.logical_block_size()
        }
    };
}

pub mod buf;
pub mod conformance;
pub mod error;
pub mod extent;
pub mod fault;
pub mod file;
pub mod latency;
pub mod mem;
pub mod order;
pub mod outage;
pub mod pool;
pub mod powercut;
pub mod queue;
pub mod slice;
pub mod thread;
pub mod watch;

pub use buf::{AlignedBuf, DIRECT_IO_ALIGN};
pub use error::{check_range, IoError, Op};
pub use extent::Extent;
pub use fault::{FaultControl, FaultDevice};
pub use file::{DirectMode, FileDevice, FileOptions, LockMode};
pub use latency::{Delay, LatencyConfig, LatencyDevice};
pub use mem::MemDevice;
pub use pool::{BufPool, PooledBuf};
pub use powercut::{CutCounts, Power, PowerCutDevice};
pub use queue::{
    open_queue, Backend, IoDone, IoOp, IoQueue, OnDone, QueuedReads, StartedRead, StartedWrite,
    ThreadQueue, UringQueue,
};
pub use slice::SliceDevice;
pub use watch::{WatchedDevice, WatchedQueue};

use std::sync::Arc;

/// A block device: a fixed-size array of bytes addressed by offset. Thread-safe: any number
/// of threads may call any method concurrently.
///
/// Contract of every implementation (`check_range` implements the first two, and
/// `conformance::run_all` checks all of them):
/// - `offset + len` MUST be at most `size()`, checked without overflow, else
///   `IoError::OutOfRange` (this check comes first);
/// - offsets and lengths MUST be multiples of `logical_block_size()`, else
///   `IoError::Unaligned`;
/// - zero-length operations in range (including at `offset == size()`) MUST succeed and do
///   nothing;
/// - buffers MUST be accepted at any memory address: a device that needs aligned memory
///   (O_DIRECT) bounces through an aligned buffer when the caller's is not aligned, and uses
///   the caller's buffer directly when it is;
/// - after a successful `discard`, the range MUST read back as zeroes;
/// - every method MUST be callable from any number of threads at once.
pub trait BlockDevice: Send + Sync {
    /// Size in bytes; a multiple of `logical_block_size()`.
    fn size(&self) -> u64;
    /// The granularity of offsets and lengths (512 or 4096 typically).
    fn logical_block_size(&self) -> u32;
    /// Reads `buf.len()` bytes at `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError>;
    /// Writes `buf` at `offset`. Durable only after `flush` (unless the device says otherwise).
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError>;
    /// Makes all completed writes durable.
    fn flush(&self) -> Result<(), IoError>;
    /// Discards a range. After success the range reads back as zeroes.
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError>;
    /// A description of what identifies the device's content version, if the device knows
    /// one: it MUST change whenever the content may have been changed by anyone else (a
    /// file's inode, size and times; a block device's number and serial; an NBD export's
    /// name and size). A persistent cache compares it across restarts and drops what it held
    /// when it changed. None: the device cannot be identified (a cache then never trusts
    /// what it held for it across a restart).
    fn identity(&self) -> Option<String> {
        None
    }
    /// Writes a buffer the caller gives away, at `offset`: the same as `write_at`, but a
    /// device that keeps the data after returning (a cache's asynchronous copy) may hold on
    /// to `data` instead of copying it. The default writes it with `write_at`.
    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        self.write_at(offset, &data)
    }
    /// The allocation of `[offset, offset + len)`: extents in order from `offset`, covering
    /// the range or a nonempty prefix of it (at most `max` extents, and fewer for a badly
    /// fragmented range); empty for `len` 0. Each extent but a cut last one is whole, so
    /// `max` 1 (NBD's REQ_ONE, what qemu asks) costs one look, not a walk of the range. A
    /// hole reads as zeroes. Range rules as for `read_at`. The default, for a device that
    /// cannot tell, is one data extent, which is always true.
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, IoError> {
        let _ = max;
        extent::all_data(offset, len, self.size(), self.logical_block_size())
    }
    /// Whether `extents` is answered on this host alone, in about a system call's time (a
    /// local file's `lseek`, or memory), never waiting on a network: a server may then
    /// answer block status on the thread that received the request. Default: no.
    fn extents_are_local(&self) -> bool {
        false
    }
}

/// Bytes shared between threads without copying: a write's payload handed to
/// [`BlockDevice::write_shared`] (an NBD server's pooled buffer, an `AlignedBuf`, a `Vec`).
pub type SharedBytes = Arc<dyn std::ops::Deref<Target = [u8]> + Send + Sync>;

macro_rules! forward {
    ($ptr:ident) => {
        impl<T: BlockDevice + ?Sized> BlockDevice for $ptr<T> {
            fn size(&self) -> u64 {
                (**self).size()
            }
            fn logical_block_size(&self) -> u32 {
                (**self).logical_block_size()
            }
            fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
                (**self).read_at(offset, buf)
            }
            fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
                (**self).write_at(offset, buf)
            }
            fn flush(&self) -> Result<(), IoError> {
                (**self).flush()
            }
            fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
                (**self).discard(offset, len)
            }
            fn identity(&self) -> Option<String> {
                (**self).identity()
            }
            fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
                (**self).write_shared(offset, data)
            }
            fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, IoError> {
                (**self).extents(offset, len, max)
            }
            fn extents_are_local(&self) -> bool {
                (**self).extents_are_local()
            }
        }
    };
}
forward!(Arc);
forward!(Box);
