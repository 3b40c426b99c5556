//! `BufPool`: aligned buffers reused between requests instead of allocated and zeroed for
//! each. A buffer is taken at the next power of two of the length asked (at least 4 KiB) and
//! goes back to its size class when dropped, as long as the pool holds less than its cap.
//!
//! A reused buffer holds the bytes of its last use: it suits what will be filled whole
//! before anybody reads it (a read's destination, a write's payload read from a socket),
//! not what must start as zeroes (use [`AlignedBuf::new`] for that).

use crate::buf::AlignedBuf;
use crate::order::{levels, OrderedMutex};
/// This file's locks are a device's own (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Smallest size class: 4 KiB.
const MIN_SHIFT: u32 = 12;
/// Size classes: 4 KiB to 64 MiB.
const CLASSES: usize = 15;

/// A pool of aligned buffers by power-of-two size class.
pub struct BufPool {
    classes: Vec<Mutex<Vec<AlignedBuf>>>,
    cap: u64,
    held: AtomicU64,
    reused: AtomicU64,
    allocated: AtomicU64,
}

impl std::fmt::Debug for BufPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufPool")
            .field("cap", &self.cap)
            .field("held", &self.held.load(Relaxed))
            .finish()
    }
}

impl BufPool {
    /// A pool that keeps at most `cap` bytes of idle buffers.
    pub fn new(cap: u64) -> Arc<BufPool> {
        Arc::new(BufPool {
            classes: (0..CLASSES).map(|_| Mutex::new(Vec::new())).collect(),
            cap,
            held: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
        })
    }

    /// A buffer of `len` bytes (its contents are those of its last use).
    pub fn take(self: &Arc<Self>, len: usize) -> PooledBuf {
        let class = class_of(len);
        let buf = match class {
            Some(c) => match self.classes[c].lock().pop() {
                Some(b) => {
                    self.held.fetch_sub(b.len() as u64, Relaxed);
                    self.reused.fetch_add(1, Relaxed);
                    b
                }
                None => {
                    self.allocated.fetch_add(1, Relaxed);
                    AlignedBuf::new(1 << (c as u32 + MIN_SHIFT))
                }
            },
            // Larger than the largest class: not pooled.
            None => AlignedBuf::new(len),
        };
        PooledBuf {
            buf: Some(buf),
            len,
            pool: class.map(|_| self.clone()),
        }
    }

    /// Bytes of idle buffers held now.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Relaxed)
    }

    /// Buffers handed out again, and buffers allocated, so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.reused.load(Relaxed), self.allocated.load(Relaxed))
    }

    fn give_back(&self, b: AlignedBuf) {
        let size = b.len() as u64;
        let Some(c) = class_of(b.len()) else { return };
        // Over the cap the buffer is freed.
        if self.held.fetch_add(size, Relaxed) + size > self.cap {
            self.held.fetch_sub(size, Relaxed);
            return;
        }
        self.classes[c].lock().push(b);
    }
}

/// The size class of a buffer of `len` bytes; `None` above the largest.
fn class_of(len: usize) -> Option<usize> {
    let shift = len.max(1 << MIN_SHIFT).next_power_of_two().trailing_zeros();
    let c = (shift - MIN_SHIFT) as usize;
    (c < CLASSES).then_some(c)
}

/// A buffer taken from a [`BufPool`]; derefs to exactly the length asked, and goes back to
/// the pool when dropped.
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    len: usize,
    pool: Option<Arc<BufPool>>,
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf.as_ref().expect("present until drop")[..self.len]
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf.as_mut().expect("present until drop")[..self.len]
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let (Some(b), Some(p)) = (self.buf.take(), &self.pool) {
            p.give_back(b);
        }
    }
}

impl std::fmt::Debug for PooledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledBuf").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_by_class_aligned_and_capped() {
        let pool = BufPool::new(1 << 20);
        let a = pool.take(4096);
        assert_eq!(a.len(), 4096);
        assert_eq!(a.as_ptr() as usize % 4096, 0);
        let ptr = a.as_ptr();
        drop(a);
        assert_eq!(pool.held_bytes(), 4096);
        // 3000 bytes fall in the same 4 KiB class: the same buffer comes back.
        let b = pool.take(3000);
        assert_eq!(b.len(), 3000);
        assert_eq!(b.as_ptr(), ptr);
        assert_eq!(pool.counts(), (1, 1));
        drop(b);
        // Over the cap: freed, not kept.
        let big: Vec<_> = (0..3).map(|_| pool.take(512 << 10)).collect();
        drop(big);
        assert!(pool.held_bytes() <= 1 << 20, "{}", pool.held_bytes());
        // Above the largest class: plain allocation, never pooled.
        let huge = pool.take(128 << 20);
        assert_eq!(huge.len(), 128 << 20);
        drop(huge);
        assert!(pool.held_bytes() <= 1 << 20);
    }

    #[test]
    fn classes() {
        assert_eq!(class_of(0), Some(0));
        assert_eq!(class_of(4096), Some(0));
        assert_eq!(class_of(4097), Some(1));
        assert_eq!(class_of(32 << 20), Some(13));
        assert_eq!(class_of(64 << 20), Some(14));
        assert_eq!(class_of((64 << 20) + 1), None);
    }
}
