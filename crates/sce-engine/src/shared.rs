//! The state every thread of a cached volume shares: the devices, the core's shards behind
//! their locks, the checksums, the persistent store, the read accounting shards and the
//! counters. The
//! roles (`read`, `write`, `awt`, `population`, `flusher`, `health`, `verify`) add their
//! methods to [`Shared`] in their own files; this one holds only what all of them use.

use crate::brlock::BrLock;
use crate::persist::Persist;
use crate::stats::Counters;
use parking_lot::{Condvar, Mutex};
use sce_core::slots::PinTable;
use sce_core::{AccessLog, CacheCore, CoreConfig, FragNo, Nanos, RequestError, ShardMap};
use sce_io::{BlockDevice, IoError, Op};
use sce_store::CrcTable;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Shards of deferred read accounting.
pub(crate) const LOG_SHARDS: usize = 32;
/// Reads a shard records before it applies its log to the core, if the core's exclusive
/// lock is free at once.
pub(crate) const LOG_BATCH: u64 = 256;
/// Reads a shard records before it applies its log whatever the wait.
pub(crate) const LOG_CAP: u64 = 1024;

/// One shard of deferred read accounting, on its own cache lines so that threads on
/// different shards do not share them.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct LogShard(pub(crate) Mutex<AccessLog>);

/// What the threads of one cached volume share.
pub(crate) struct Shared {
    pub(crate) source: Arc<dyn BlockDevice>,
    pub(crate) cache: Arc<dyn BlockDevice>,
    /// The core's shards (lock order 2, see docs/ARCHITECTURE.md: a thread holds at most
    /// one of them), each behind a big-reader lock: a hit takes only its thread's reader
    /// shard of its fragment's core shard.
    pub(crate) cores: Box<[BrLock<CacheCore>]>,
    /// Which core shard holds which fragments and slots.
    pub(crate) map: ShardMap,
    /// The volume's core configuration (each shard's is derived from it), as last retuned.
    /// Lock order -1 (outermost): `CacheVolume::retune` holds it while it takes each core
    /// shard in turn, so that two retunes cannot leave the shards differing.
    pub(crate) config: Mutex<CoreConfig>,
    pub(crate) crcs: Option<CrcTable>,
    pub(crate) persist: Option<Persist>,
    pub(crate) errors: AtomicU64,
    pub(crate) error_limit: u64,
    pub(crate) passthrough: AtomicBool,
    pub(crate) source_size: u64,
    pub(crate) fshift: u32,
    /// `LOG_SHARDS` read-log shards per core shard: core shard `k`, thread shard `t` at
    /// `k * LOG_SHARDS + t`.
    pub(crate) logs: Box<[LogShard]>,
    /// Each core shard's pin table.
    pub(crate) pins: Box<[Arc<PinTable>]>,
    pub(crate) counters: Counters,
    pub(crate) epoch: Instant,
    pub(crate) shutdown: AtomicBool,
    pub(crate) sleep_lock: Mutex<()>,
    pub(crate) wake: Condvar,
    pub(crate) lbs: u32,
    /// What seeds page checksums: per volume, in address order, its first page in the
    /// cache's address space and its id (the volume table's, or 1).
    pub(crate) seeds: Vec<(u64, u16)>,
    /// The volumes served (one unless several share the cache device), in address order.
    pub(crate) parts: Vec<crate::parts::PartInfo>,
    /// Source writes and discards started, and completed (successfully or not): the flusher
    /// records the source's identity only when the two are equal.
    pub(crate) source_writes_started: AtomicU64,
    pub(crate) source_writes_done: AtomicU64,
    /// Intents were set ahead of need: the intent writer has work (with `intent_wake`).
    pub(crate) intent_pending: Mutex<bool>,
    pub(crate) intent_wake: Condvar,
    /// The I/O queue hits are read through, once the server gave one
    /// ([`crate::CacheVolume::serve_hits_from`]).
    pub(crate) hits: std::sync::OnceLock<crate::queued::HitQueue>,
    /// Write-back mode's state (None in the other modes).
    pub(crate) wb: Option<crate::wback::WbEngine>,
}

/// The `IoError` for a request the core refused.
pub(crate) fn request_error(
    op: Op,
    e: RequestError,
    offset: u64,
    len: u64,
    size: u64,
    lbs: u32,
) -> IoError {
    match e {
        RequestError::OutOfRange { .. } => IoError::OutOfRange {
            op,
            offset,
            len,
            size,
        },
        RequestError::Unaligned { .. } => IoError::Unaligned {
            op,
            offset,
            len,
            align: lbs,
        },
        RequestError::UnknownId => IoError::Invalid("internal: unknown operation id".into()),
        RequestError::Lost { .. } => crate::wback::lost_error(op, offset, len),
        e @ RequestError::Dirty { .. } => IoError::Invalid(e.to_string()),
    }
}

impl Shared {
    /// The engine's clock, for the core.
    pub(crate) fn now(&self) -> Nanos {
        Nanos::from_duration(self.epoch.elapsed())
    }

    /// The read-log shards of core shard `k`.
    pub(crate) fn logs_of(&self, k: usize) -> &[LogShard] {
        &self.logs[k * LOG_SHARDS..(k + 1) * LOG_SHARDS]
    }

    /// Applies the deferred read accounting of core shard `k` (`core`, locked) to it: every
    /// thread's log at once, so that the reads that missed, in any log, go to the front of
    /// the hotness window (`CacheCore::apply_access_logs`). The log shards are leaf locks,
    /// taken in index order, and nobody holds one while taking another.
    pub(crate) fn apply_logs(&self, k: usize, core: &mut CacheCore) {
        let mut logs: Vec<_> = self.logs_of(k).iter().map(|s| s.0.lock()).collect();
        core.apply_access_logs(&mut logs);
    }

    /// Applies every core shard's deferred read accounting, one core lock at a time.
    pub(crate) fn apply_all_logs(&self) {
        for (k, core) in self.cores.iter().enumerate() {
            self.apply_logs(k, &mut core.write());
        }
    }

    /// The core shard holding global fragment `f`, and `f`'s number there.
    pub(crate) fn frag_shard(&self, f: u64) -> (usize, FragNo) {
        self.map.frag_to_local(FragNo(f))
    }

    /// Splits a cache (or source) offset into its slot (or fragment) number and the page
    /// within it.
    pub(crate) fn slot_page(&self, off: u64) -> (u64, u32) {
        (
            off >> self.fshift,
            ((off & ((1 << self.fshift) - 1)) / sce_core::PAGE_SIZE) as u32,
        )
    }

    /// Writes to the source, counting the bytes that made it.
    pub(crate) fn source_write(&self, offset: u64, data: &[u8]) -> Result<(), IoError> {
        self.note_source_write(offset);
        self.source_writes_started.fetch_add(1, SeqCst);
        let r = self.source.write_at(offset, data);
        self.source_writes_done.fetch_add(1, SeqCst);
        if r.is_ok() {
            self.counters
                .source_bytes_written
                .fetch_add(data.len() as u64, Relaxed);
        }
        r
    }

    /// Sleeps up to `d`, waking early on shutdown. Returns false if shutting down.
    pub(crate) fn sleep(&self, d: Duration) -> bool {
        let mut g = self.sleep_lock.lock();
        if self.shutdown.load(Relaxed) {
            return false;
        }
        self.wake.wait_for(&mut g, d);
        !self.shutdown.load(Relaxed)
    }
}
