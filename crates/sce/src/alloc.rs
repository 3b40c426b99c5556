//! A counting global allocator: the `footprint` command measures the bytes its data
//! structures really allocate, not a formula, and `sim` the bytes of each engine policy's core.
//!
//! It is installed only in a build with the cargo feature `footprint`
//! (`cargo build --release -p sce --features footprint`): counting puts an atomic add on every
//! allocation and free of the process, `sce serve`'s included, so a default build leaves it
//! out. Without it [`COUNTING`] is false and [`live_bytes`] stays 0.
//!
//! [`uncounted`] runs a closure whose allocations (and deallocations) on the calling thread
//! are left out of the count: the footprint's stand-in devices keep what is written to them
//! that way, so that the count holds only what the cache itself allocates.

#[cfg(feature = "footprint")]
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Whether this build counts allocations (the cargo feature `footprint`).
pub const COUNTING: bool = cfg!(feature = "footprint");

/// What a command that needs the count says in a build without it.
pub const NOT_COUNTING: &str = "this sce was built without the counting allocator, which \
    `sce footprint` needs (counting costs every allocation of `sce serve`, so it is opt-in): \
    build it with `cargo build --release -p sce --features footprint`";

/// Wraps the system allocator and counts live bytes.
#[cfg(feature = "footprint")]
pub struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Set while the thread runs an [`uncounted`] closure. Const-initialised and without a
    /// destructor, so the allocator may read it at any time, even during thread exit.
    static UNCOUNTED: Cell<bool> = const { Cell::new(false) };
}

#[cfg(feature = "footprint")]
fn counted() -> bool {
    !UNCOUNTED.try_with(Cell::get).unwrap_or(false)
}

/// Runs `f` with its allocations and deallocations on this thread left out of
/// [`live_bytes`]. The caller MUST free what `f` allocates inside an `uncounted` closure too
/// (and MUST NOT free there what was allocated outside one), or the count drifts.
pub fn uncounted<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            UNCOUNTED.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(UNCOUNTED.with(|c| c.replace(true)));
    f()
}

#[cfg(feature = "footprint")]
// SAFETY: every method forwards to `System` with the same arguments, which upholds the
// `GlobalAlloc` contract; the counter has no effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours, forwarded.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() && counted() {
            LIVE.fetch_add(layout.size(), Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours, forwarded.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() && counted() {
            LIVE.fetch_add(layout.size(), Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if counted() {
            LIVE.fetch_sub(layout.size(), Relaxed);
        }
        // SAFETY: `ptr` was allocated by `System` with `layout` (we forward every allocation).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as ours, forwarded.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() && counted() {
            LIVE.fetch_sub(layout.size(), Relaxed);
            LIVE.fetch_add(new_size, Relaxed);
        }
        p
    }
}

/// Bytes currently allocated by the whole process (outside [`uncounted`] closures); always
/// 0 unless [`COUNTING`].
pub fn live_bytes() -> usize {
    LIVE.load(Relaxed)
}
