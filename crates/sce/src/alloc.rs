//! A counting global allocator: the `footprint` command measures the bytes its data
//! structures really allocate, not a formula, and `sim` the bytes of each engine policy's core.
//!
//! It is every build's global allocator, and counts only once [`start_counting`] was called,
//! which `footprint` does before it measures and `sim` while it builds its cores: in every
//! other command (`serve`'s included) an allocation or free costs one relaxed load of a flag
//! that never changes and a branch beside the system allocator's own work (docs/MEMORY.md
//! has the A/B of the hit path). While counting, each allocation and free adds one atomic add.
//!
//! [`uncounted`] runs a closure whose allocations (and deallocations) on the calling thread
//! are left out of the count: the footprint's stand-in devices keep what is written to them
//! that way, so that the count holds only what the cache itself allocates.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering::Relaxed};

/// Whether this process counts its allocations (`start_counting` was called).
static ON: AtomicBool = AtomicBool::new(false);

/// Turns counting on for the rest of the process. Call it before what is to be measured is
/// allocated: a block allocated before and freed after comes off the count (which is why
/// the count is signed, and [`live_bytes`] wraps).
pub fn start_counting() {
    ON.store(true, Relaxed);
}

/// Runs `f` with the allocator counting, and turns counting off again after it.
pub fn counting<R>(f: impl FnOnce() -> R) -> R {
    start_counting();
    let r = f();
    ON.store(false, Relaxed);
    r
}

/// Wraps the system allocator and counts live bytes.
pub struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    /// Set while the thread runs an [`uncounted`] closure. Const-initialised and without a
    /// destructor, so the allocator may read it at any time, even during thread exit.
    static UNCOUNTED: Cell<bool> = const { Cell::new(false) };
}

/// Whether an allocation or free here and now counts: counting is on and the thread is not
/// in an [`uncounted`] closure (the flag first: it is all a command that does not count
/// pays).
#[inline(always)]
fn counted() -> bool {
    ON.load(Relaxed) && !UNCOUNTED.try_with(Cell::get).unwrap_or(false)
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

// SAFETY: every method forwards to `System` with the same arguments, which upholds the
// `GlobalAlloc` contract; the counter has no effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours, forwarded.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() && counted() {
            LIVE.fetch_add(layout.size() as isize, Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours, forwarded.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() && counted() {
            LIVE.fetch_add(layout.size() as isize, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if counted() {
            LIVE.fetch_sub(layout.size() as isize, Relaxed);
        }
        // SAFETY: `ptr` was allocated by `System` with `layout` (we forward every allocation).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as ours, forwarded.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() && counted() {
            LIVE.fetch_sub(layout.size() as isize, Relaxed);
            LIVE.fetch_add(new_size as isize, Relaxed);
        }
        p
    }
}

/// Bytes currently allocated by the whole process since counting started (outside
/// [`uncounted`] closures), as a wrapping count: blocks allocated before counting started and
/// freed since take it below 0, so what a part took is `after.wrapping_sub(before)`, never a
/// reading alone. 0 while counting is off.
pub fn live_bytes() -> usize {
    LIVE.load(Relaxed) as usize
}

/// Bytes allocated since [`live_bytes`] read `before` (0 if more was freed than allocated).
pub fn grown_since(before: usize) -> u64 {
    (live_bytes().wrapping_sub(before) as isize).max(0) as u64
}
