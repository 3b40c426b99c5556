//! A number per thread, handed out in turn, that picks the thread's shard of the engine's
//! per-thread structures: its reader shard of the core's lock (`brlock.rs`), its read-log
//! shard (`read.rs`) and its shard of the hot counters (`stats.rs`).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

static NEXT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static MINE: usize = NEXT.fetch_add(1, Relaxed);
}

/// This thread's number: the first thread to ask gets 0, the next 1, and so on. Take it
/// modulo the number of shards.
pub(crate) fn thread_index() -> usize {
    MINE.with(|m| *m)
}
