//! `BrLock`: a reader-writer lock whose readers share no cache line (a "big-reader" lock).
//!
//! A plain `RwLock` counts its readers in one word: every hit, on every thread, writes that
//! word twice, and with two threads the line bounces between the cores on every read. Here
//! each thread reads through one of [`SHARDS`] reader locks of its own (chosen once per
//! thread), on its own cache line; a writer takes all of them, always in index order. So
//! readers on different shards never touch the same line, and a writer still excludes
//! every reader. Writers pay `SHARDS` uncontended lock operations, which the write paths
//! (a few per write, one per population step) can afford.
//!
//! Lock order: the shards count as one lock (level `CoreShard`, `order.rs`, which `Cores`
//! records around every acquisition): a writer takes them all in index order, a reader
//! takes one, and nobody holds a shard while taking another core shard or a lock above it.

use crate::shard::thread_index;
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

/// Reader shards. More than the cores of the machines sce runs on, so that threads rarely
/// share one; a writer takes them all.
pub(crate) const SHARDS: usize = 16;

#[repr(align(128))]
#[derive(Default)]
struct Shard(RwLock<()>);

/// A value behind a big-reader lock.
pub(crate) struct BrLock<T> {
    shards: [Shard; SHARDS],
    value: UnsafeCell<T>,
}

// SAFETY: access to `value` follows the locks: shared references only under a reader shard
// (which excludes every writer), the mutable one only under all shards (which excludes every
// reader and writer), exactly like `RwLock<T>`, which is Send/Sync under these bounds.
unsafe impl<T: Send> Send for BrLock<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for BrLock<T> {}

impl<T> BrLock<T> {
    pub(crate) fn new(value: T) -> Self {
        BrLock {
            shards: Default::default(),
            value: UnsafeCell::new(value),
        }
    }

    /// Shared access, through this thread's reader shard.
    pub(crate) fn read(&self) -> BrReadGuard<'_, T> {
        let guard = self.shards[thread_index() % SHARDS].0.read();
        BrReadGuard {
            _guard: guard,
            value: &self.value,
        }
    }

    /// Exclusive access: every shard, in index order.
    pub(crate) fn write(&self) -> BrWriteGuard<'_, T> {
        let guards = std::array::from_fn(|i| self.shards[i].0.write());
        BrWriteGuard {
            _guards: guards,
            value: &self.value,
        }
    }

    /// Exclusive access if no thread holds or waits for any shard now; never blocks (and
    /// allocates nothing: it is tried on the read path).
    pub(crate) fn try_write(&self) -> Option<BrWriteGuard<'_, T>> {
        let mut got: [Option<RwLockWriteGuard<'_, ()>>; SHARDS] = Default::default();
        for (slot, s) in got.iter_mut().zip(&self.shards) {
            // On failure the shards taken so far are released as `got` drops.
            *slot = Some(s.0.try_write()?);
        }
        Some(BrWriteGuard {
            _guards: got.map(|g| g.expect("every shard was taken")),
            value: &self.value,
        })
    }
}

/// Shared access to a [`BrLock`]'s value.
pub(crate) struct BrReadGuard<'a, T> {
    _guard: RwLockReadGuard<'a, ()>,
    value: &'a UnsafeCell<T>,
}

impl<T> Deref for BrReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard holds a reader shard, so no writer (which needs all shards)
        // holds a mutable reference while it lives.
        unsafe { &*self.value.get() }
    }
}

/// Exclusive access to a [`BrLock`]'s value.
pub(crate) struct BrWriteGuard<'a, T> {
    _guards: [RwLockWriteGuard<'a, ()>; SHARDS],
    value: &'a UnsafeCell<T>,
}

impl<T> Deref for BrWriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard holds every shard exclusively: no other reference exists.
        unsafe { &*self.value.get() }
    }
}

impl<T> DerefMut for BrWriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this the only use of the guard.
        unsafe { &mut *self.value.get() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn writers_exclude_readers_on_every_shard() {
        let lock = Arc::new(BrLock::new((0u64, 0u64)));
        // Writers keep both halves equal; readers on many threads (so many shards) must
        // never see them differ.
        let writers: Vec<_> = (0..2)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let mut g = lock.write();
                        g.0 += 1;
                        g.1 += 1;
                    }
                })
            })
            .collect();
        let readers: Vec<_> = (0..SHARDS + 3)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let g = lock.read();
                        assert_eq!(g.0, g.1, "a reader saw a write half done");
                    }
                })
            })
            .collect();
        for t in writers.into_iter().chain(readers) {
            t.join().unwrap();
        }
        assert_eq!(*lock.read(), (40_000, 40_000));
    }

    #[test]
    fn try_write_fails_while_any_reader_holds_a_shard() {
        let lock = BrLock::new(1u32);
        let r = lock.read();
        assert!(lock.try_write().is_none());
        drop(r);
        *lock.try_write().expect("free") += 1;
        assert_eq!(*lock.read(), 2);
    }
}
