//! Lock levels, checked in debug builds.
//!
//! Every lock of a cached volume has an integer level (docs/ARCHITECTURE.md, "Lock order"),
//! carried in its type: [`OrderedMutex<L, T>`], [`OrderedRwLock<L, T>`], or a [`Token<L>`]
//! held beside a lock of another kind (the core shards' big-reader lock, the byte-range
//! locks). A thread may take a lock only while every lock it holds has a lower level; two
//! locks of one level only if the level allows several at once ([`Level::MANY`], taken in
//! an order of the caller's own, such as index order). A debug build (every test) keeps the
//! levels each thread holds and panics, before it blocks, when a lock is taken out of
//! order; a release build keeps nothing and checks nothing (a `Token` is then empty).
//!
//! A `try_` acquisition never blocks, so it cannot close a cycle: it is recorded (what is
//! taken under it is checked) but not itself checked. A lock held by no thread in
//! particular (a write started through the queue holds its byte range until its completion
//! runs on another thread) is not tracked.
//!
//! parking_lot's deadlock detector stays in the concurrency tests: it finds the cycles of
//! the locks this module does not cover, and those of condition variables.

use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// A lock level: a zero-sized type per row of the lock order.
pub trait Level: 'static {
    /// The level: a thread takes levels in increasing order.
    const LEVEL: u8;
    /// What the lock is, for the panic's message.
    const NAME: &'static str;
    /// Several locks of this level may be held at once (in an order of their own).
    const MANY: bool = false;
}

macro_rules! levels {
    ($($(#[$m:meta])* $name:ident = $n:literal $(, $many:ident)?;)*) => {$(
        $(#[$m])*
        pub struct $name;
        impl Level for $name {
            const LEVEL: u8 = $n;
            const NAME: &'static str = stringify!($name);
            $(const MANY: bool = levels!(@$many);)?
        }
    )*};
    (@many) => { true };
}

/// The levels, outermost first (docs/ARCHITECTURE.md, "Lock order", one row each).
pub mod levels {
    use super::Level;

    levels! {
        /// The NBD server's read-modify-write of unaligned writes (sce-nbd): held across the
        /// export's reads and writes, so outside every lock of the volume behind it.
        NbdRmw = 0;
        /// The admin's save of the configuration file (sce-server's `admin/save.rs`): held
        /// across a `set --save`, which takes an export's `ops` under it.
        AdminSave = 0;
        /// `Attachable::ops` (sce-server): one detach, attach or set at a time.
        AttachOps = 1;
        /// `Attachable::gate` (sce-server): every request to a cached export, shared.
        AttachGate = 2;
        /// `Engine::config`: a retune holds it while it takes each core shard in turn.
        EngineConfig = 3;
        /// The write-back log's byte-range lock (writes).
        LogRange = 4;
        /// `LogBack::clean_io`: one cleaning batch or round of making room at a time.
        LogCleanIo = 5;
        /// `LogBack::anchor_io`: one anchor move at a time.
        LogAnchorIo = 6;
        /// `LogBack::source_order`: the byte ranges whose source writes must stay in order.
        LogSourceOrder = 7;
        /// `LogBack::commit_io`: one commit at a time.
        LogCommitIo = 8;
        /// `Persist::round_lock`: one metadata flush round at a time.
        PersistRound = 9;
        /// `Persist::intent_io`: one writer of intent and journal blocks at a time.
        PersistIntentIo = 10;
        /// A core shard (`Cores`): never two at once.
        CoreShard = 11;
        /// `Persist::st`: intents, claims, the journal in memory.
        PersistState = 12;
        /// A unit's checksums in the `CrcCache`.
        CrcUnit = 13;
        /// `Attachable::draining`, `kept` and `carried` (sce-server): the volumes an
        /// export closed or is closing, and their counters, taken under the gate.
        AttachVolumes = 14;
        /// An NBD connection's writer slot and its socket's output (`Session::writer`,
        /// `Out`, sce-nbd): the writer thread's handle is stored under the one, and a reply
        /// written under the other releases its ticket (the server's byte budget).
        NbdConn = 15;
        /// Shared mode's ownership machine (`Regions::st`, sce-server's `coherent/own.rs`):
        /// the copy of its others' regions (`Regions::theirs`, a leaf) is written under it.
        Regions = 16;
        /// A leaf of the volume: nothing of the volume is taken while one is held (a
        /// device's own locks may be, by I/O under it).
        Leaf = 17;
        /// A read-log shard of a core shard (a leaf; the shards are taken in index order).
        LogShard = 17, many;
        /// A device's own locks (sce-io's devices and queues, the NBD client's connection
        /// pool, requests in flight and socket writer): taken under any lock of a volume,
        /// which does I/O under its locks; a device calls nothing back while it holds one
        /// (completions run with no lock of the queue held).
        Device = 18;
        /// The power-cut model's devices (sce-io, tests): a cut takes all of them at once.
        PowerCut = 18, many;
        /// What a device takes under its own lock (the NBD client's reply slots and the
        /// reason its connection broke, under the map of requests in flight).
        DeviceLeaf = 19;
    }
}

#[cfg(debug_assertions)]
thread_local! {
    /// The levels this thread holds: (level, several allowed, name).
    static HELD: std::cell::RefCell<Vec<(u8, bool, &'static str)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A lock of level `L` held by this thread: recorded while it lives (debug builds).
#[must_use = "the level is held only while the token lives"]
pub struct Token<L: Level> {
    // Not Send: the record is this thread's.
    _level: PhantomData<*const L>,
}

impl<L: Level> Token<L> {
    /// Checks that this thread may take a lock of level `L` now, and records it as held:
    /// call it before blocking on the lock. Panics (debug builds) if the thread holds a
    /// lock of a level above `L`, or of `L` itself unless `L` allows several.
    pub fn enter() -> Token<L> {
        #[cfg(debug_assertions)]
        {
            let bad = HELD.with(|h| {
                let h = h.borrow();
                h.iter()
                    .find(|&&(l, many, _)| l > L::LEVEL || (l == L::LEVEL && !(many && L::MANY)))
                    .copied()
            });
            if let Some((l, _, name)) = bad {
                panic!(
                    "lock order: took {} (level {}) while holding {name} (level {l})",
                    L::NAME,
                    L::LEVEL
                );
            }
        }
        Token::record()
    }

    /// Records a lock of level `L` taken without blocking (a `try_` acquisition).
    pub fn record() -> Token<L> {
        #[cfg(debug_assertions)]
        HELD.with(|h| h.borrow_mut().push((L::LEVEL, L::MANY, L::NAME)));
        Token {
            _level: PhantomData,
        }
    }
}

impl<L: Level> Drop for Token<L> {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|&(l, _, _)| l == L::LEVEL) {
                h.remove(i);
            }
        });
    }
}

/// A mutex of level `L`.
pub struct OrderedMutex<L: Level, T> {
    inner: Mutex<T>,
    _level: PhantomData<fn() -> L>,
}

impl<L: Level, T: std::fmt::Debug> std::fmt::Debug for OrderedMutex<L, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: ", L::NAME)?;
        self.inner.fmt(f)
    }
}

impl<L: Level, T: std::fmt::Debug> std::fmt::Debug for OrderedRwLock<L, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: ", L::NAME)?;
        self.inner.fmt(f)
    }
}

impl<L: Level, T: std::fmt::Debug> std::fmt::Debug for OrderedMutexGuard<'_, L, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl<L: Level, T: Default> Default for OrderedMutex<L, T> {
    fn default() -> Self {
        OrderedMutex::new(T::default())
    }
}

/// A held [`OrderedMutex`]. The lock is released before the level is forgotten.
pub struct OrderedMutexGuard<'a, L: Level, T> {
    guard: MutexGuard<'a, T>,
    _token: Token<L>,
}

impl<L: Level, T> OrderedMutex<L, T> {
    /// `value` behind a mutex of level `L`.
    pub const fn new(value: T) -> Self {
        OrderedMutex {
            inner: Mutex::new(value),
            _level: PhantomData,
        }
    }

    /// Takes the lock, checking the order first (debug builds).
    pub fn lock(&self) -> OrderedMutexGuard<'_, L, T> {
        let token = Token::enter();
        OrderedMutexGuard {
            guard: self.inner.lock(),
            _token: token,
        }
    }

    /// Takes the lock if it is free now (never blocks, so the order is not checked).
    pub fn try_lock(&self) -> Option<OrderedMutexGuard<'_, L, T>> {
        let guard = self.inner.try_lock()?;
        Some(OrderedMutexGuard {
            guard,
            _token: Token::record(),
        })
    }

    /// Waits for the lock up to `d`: checked as `lock` (it blocks, if not forever).
    pub fn try_lock_for(&self, d: std::time::Duration) -> Option<OrderedMutexGuard<'_, L, T>> {
        let token = Token::enter();
        Some(OrderedMutexGuard {
            guard: self.inner.try_lock_for(d)?,
            _token: token,
        })
    }

    /// The value, through exclusive access to the lock (no locking).
    pub fn get_mut(&mut self) -> &mut T {
        self.inner.get_mut()
    }

    /// The value, the lock gone.
    pub fn into_inner(self) -> T {
        self.inner.into_inner()
    }
}

impl<L: Level, T> OrderedMutexGuard<'_, L, T> {
    /// Waits on `cv`, releasing the lock meanwhile (the level stays recorded: a thread
    /// waiting takes nothing else).
    pub fn wait(&mut self, cv: &parking_lot::Condvar) {
        cv.wait(&mut self.guard);
    }

    /// Waits on `cv` at most `d`, releasing the lock meanwhile.
    pub fn wait_for(
        &mut self,
        cv: &parking_lot::Condvar,
        d: std::time::Duration,
    ) -> parking_lot::WaitTimeoutResult {
        cv.wait_for(&mut self.guard, d)
    }

    /// Waits on `cv` until `deadline` at most, as `Condvar::wait_until`.
    pub fn wait_until(
        &mut self,
        cv: &parking_lot::Condvar,
        deadline: std::time::Instant,
    ) -> parking_lot::WaitTimeoutResult {
        cv.wait_until(&mut self.guard, deadline)
    }
}

impl<L: Level, T> Deref for OrderedMutexGuard<'_, L, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<L: Level, T> DerefMut for OrderedMutexGuard<'_, L, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

/// A reader-writer lock of level `L`.
pub struct OrderedRwLock<L: Level, T> {
    inner: RwLock<T>,
    _level: PhantomData<fn() -> L>,
}

impl<L: Level, T: Default> Default for OrderedRwLock<L, T> {
    fn default() -> Self {
        OrderedRwLock::new(T::default())
    }
}

/// Shared access to an [`OrderedRwLock`].
pub struct OrderedReadGuard<'a, L: Level, T> {
    guard: RwLockReadGuard<'a, T>,
    _token: Token<L>,
}

/// Exclusive access to an [`OrderedRwLock`].
pub struct OrderedWriteGuard<'a, L: Level, T> {
    guard: RwLockWriteGuard<'a, T>,
    _token: Token<L>,
}

impl<L: Level, T> OrderedRwLock<L, T> {
    /// `value` behind a reader-writer lock of level `L`.
    pub const fn new(value: T) -> Self {
        OrderedRwLock {
            inner: RwLock::new(value),
            _level: PhantomData,
        }
    }

    /// Shared access, checking the order first (debug builds).
    pub fn read(&self) -> OrderedReadGuard<'_, L, T> {
        let token = Token::enter();
        OrderedReadGuard {
            guard: self.inner.read(),
            _token: token,
        }
    }

    /// Exclusive access, checking the order first (debug builds).
    pub fn write(&self) -> OrderedWriteGuard<'_, L, T> {
        let token = Token::enter();
        OrderedWriteGuard {
            guard: self.inner.write(),
            _token: token,
        }
    }

    /// Shared access if no writer holds the lock now (never blocks: not checked).
    pub fn try_read(&self) -> Option<OrderedReadGuard<'_, L, T>> {
        let guard = self.inner.try_read()?;
        Some(OrderedReadGuard {
            guard,
            _token: Token::record(),
        })
    }

    /// Exclusive access if the lock is free now (never blocks: not checked).
    pub fn try_write(&self) -> Option<OrderedWriteGuard<'_, L, T>> {
        let guard = self.inner.try_write()?;
        Some(OrderedWriteGuard {
            guard,
            _token: Token::record(),
        })
    }
}

impl<L: Level, T> Deref for OrderedReadGuard<'_, L, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<L: Level, T> Deref for OrderedWriteGuard<'_, L, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<L: Level, T> DerefMut for OrderedWriteGuard<'_, L, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}
