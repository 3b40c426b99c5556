//! `CacheVolume`: a source volume cached on a cache device, itself a `BlockDevice`.
//!
//! The core (`sce-core`) is cut into shards by fragment (`ShardMap`), each behind a lock of
//! its own; a lock is held only to plan and to report completions, never across I/O, and a
//! thread holds at most one. Reads run their planned I/O on the caller's thread. Writes
//! send the source write from the caller's thread and, in AWT mode, hand a copy of the data
//! to the AWT writer threads first, so the two writes run in parallel and the caller returns
//! when the source write is done. Background population workers follow Algorithm 1.
//!
//! This file holds the volume's configuration and its public face; `open.rs` opens it,
//! `device.rs` serves requests through the write path chosen at open (`path.rs`), and the
//! engine's subsystems (`engine.rs`) do the work.

use crate::engine::Engine;
use crate::order::{levels, OrderedMutex};
use crate::path::WritePath;
use crate::persist::{PersistConfig, PersistStats};
use crate::stats::VolumeStats;
/// This file's mutexes are leaves of the lock order (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use sce_core::{ConfigError, CoreConfig};
use sce_io::{IoError, IoQueue};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Engine settings besides the core's.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The core's configuration.
    pub core: CoreConfig,
    /// Threads that write AWT copies to the cache device.
    pub awt_threads: usize,
    /// Start the background population workers (off only for tests that drive population
    /// by hand with `populate_now`).
    pub background_population: bool,
    /// Keep a CRC-32C per cached page and verify every read of cached data against it; a
    /// mismatch is served from the source. Always on with persistence.
    pub verify: bool,
    /// Cache-device errors (I/O errors, checksum mismatches, metadata failures) after which
    /// the cache disables itself and passes I/O through to the source.
    pub error_limit: u64,
    /// Write-back: how long a write waits for room (cleaning, a metadata round) before it
    /// fails; the cache device or the source is then not keeping up at all.
    pub writeback_wait: Duration,
    /// Write-back: time without requests after which the cleaner writes everything dirty
    /// to the source ("clean when idle").
    pub writeback_idle: Duration,
    /// Keep the cache contents on the cache device across restarts (see `persist`). The
    /// cache device then holds the metadata as well as the data.
    pub persist: Option<PersistConfig>,
    /// Shards of the core: fragment `f` belongs to shard `f % core_shards`, each shard has
    /// its own slots, map, CLOCK and lock, so that writes and population on one shard do not
    /// stop hits on the others. 0 (the default) picks [`sce_core::AUTO_CORE_SHARDS`], fewer
    /// if the cache holds fewer than [`sce_core::MIN_SLOTS_PER_AUTO_SHARD`] slots per shard
    /// (`sce_core::shards_for`, the simulator's rule too); 1 is the unsharded core. Never
    /// more than half the slots (a shard needs two).
    pub core_shards: usize,
    /// Read the source ahead of streams of large reads (`readahead.rs`). Only where nobody
    /// but this volume writes the source: off in shared mode.
    pub read_ahead: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            core: CoreConfig::default(),
            awt_threads: 2,
            background_population: true,
            verify: true,
            error_limit: 16,
            writeback_wait: Duration::from_secs(120),
            writeback_idle: Duration::from_secs(1),
            persist: None,
            core_shards: 0,
            read_ahead: true,
        }
    }
}

/// Why a volume could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The configuration or the device sizes are invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A device could not be used.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The cache device's contents could not be used.
    #[error(transparent)]
    Store(#[from] sce_store::StoreError),
}

/// What the volume's operator commands and its requests' entry work with (`volume.rs`,
/// `control.rs`, `device.rs`), built by `Engine::admin`: every subsystem but the source's
/// load, for what an operator asks of a volume spans them (its counters, its ranges, its
/// store, its shutdown); the rounds, the store's close and the roles are the engine's.
pub(crate) struct Admin<'a> {
    pub(crate) dev: &'a crate::devices::Devices,
    pub(crate) cores: &'a crate::cores::Cores,
    pub(crate) config:
        &'a crate::order::OrderedMutex<crate::order::levels::EngineConfig, CoreConfig>,
    pub(crate) checks: &'a crate::checks::Checks,
    pub(crate) health: &'a crate::health::Health,
    pub(crate) persist: Option<&'a crate::persist::Persist>,
    pub(crate) counters: &'a crate::stats::Counters,
    pub(crate) signals: &'a crate::engine::Signals,
    pub(crate) fills: &'a crate::fills::FillQueue,
    /// log2 of the fragment size.
    pub(crate) fshift: u32,
}

/// A cached volume. Thread-safe: share it with `Arc` and call it from any number of threads.
pub struct CacheVolume {
    pub(crate) engine: Arc<Engine>,
    pub(crate) path: WritePath,
    pub(crate) threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for CacheVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheVolume")
            .field("size", &self.engine.admin().dev.size)
            .finish()
    }
}

impl CacheVolume {
    /// Serves hits through `queue`, an owned-buffer queue (io_uring) on the cache device
    /// this volume was opened with, or on a device it is a slice of, starting at `base`
    /// there: a read whose every page is a hit is then started by
    /// [`sce_io::QueuedReads::start_read`] and completes on the queue's thread. Once per
    /// volume; false if it already has one. Write-back through the log also starts its
    /// writes of whole pages through it ([`sce_io::QueuedReads::start_write`]), and its
    /// hits of pages the log does not hold.
    pub fn serve_hits_from(&self, queue: Arc<dyn IoQueue>, base: u64) -> bool {
        let data = self
            .engine
            .admin()
            .persist
            .as_ref()
            .map_or(0, |p| p.layout.data_offset);
        match &self.path {
            WritePath::Through(t) => t.serve_hits_from(queue, base + data),
            WritePath::Log(l) => {
                let hits = l.serve_hits_from(queue.clone(), base + data);
                l.serve_writes_from(queue, base) && hits
            }
        }
    }

    /// The queue hits are read (or log writes started) through, if any.
    pub(crate) fn hit_queue(&self) -> Option<Arc<dyn IoQueue>> {
        match &self.path {
            WritePath::Through(t) => t.hit_queue(),
            WritePath::Log(l) => l.queue(),
        }
    }

    /// A snapshot of the counters. It takes only the core shards' shared locks, one at a
    /// time (a metrics scrape never stalls I/O): the read accounting still waiting in the
    /// log shards is added to the cores' counts, not applied.
    pub fn stats(&self) -> VolumeStats {
        let e = self.engine.admin();
        let mut v = VolumeStats::default();
        for k in 0..e.cores.count() {
            e.cores.read_shard(k, |core| {
                if k == 0 {
                    v = e.counters.snapshot(core, e.health.passthrough());
                } else {
                    v.add_core(core);
                }
                // Lock order: core, then a leaf.
                let [requests, full, hit, missed] = e.cores.pending_counts(k);
                v.read_requests += requests;
                v.read_requests_full_hit += full;
                v.read_pages_hit += hit;
                v.read_pages_missed += missed;
            });
        }
        e.counters.unsplit(&mut v);
        if let Some(ra) = &e.dev.read_ahead {
            let s = ra.stats();
            v.source_read_ahead_bytes = s.read.load(std::sync::atomic::Ordering::Relaxed);
            v.source_read_ahead_used_bytes = s.used.load(std::sync::atomic::Ordering::Relaxed);
        }
        // Write-back: the reads the log served are hits the core never saw.
        if let Some(l) = self.path.log() {
            let (pages, whole) = l.read_counts();
            v.read_pages_hit += pages;
            v.read_requests += whole;
            v.read_requests_full_hit += whole;
        }
        v
    }

    /// The number of core shards.
    pub fn core_shards(&self) -> usize {
        self.engine.admin().cores.count()
    }

    /// Runs `f` while this thread holds core shard `k`'s exclusive lock, as a write or a
    /// population step on that shard would (tests: the other shards keep serving). `f`
    /// must not use the volume.
    #[doc(hidden)]
    pub fn with_core_shard_locked<R>(&self, k: usize, f: impl FnOnce() -> R) -> R {
        self.engine.admin().cores.with_shard(k, |_| f())
    }

    /// The persistent store's state and counters (None without persistence).
    pub fn persist_stats(&self) -> Option<PersistStats> {
        let mut s = self.engine.admin().persist.as_ref().map(|p| p.stats())?;
        if let Some(c) = self.engine.admin().checks.cache() {
            s.checksum_units_resident = c.resident() as u64;
            s.checksum_memory_bytes = c.bytes() as u64;
            s.checksum_unit_loads = c.counters.loads.load(std::sync::atomic::Ordering::Relaxed);
            s.checksum_unit_evictions = c
                .counters
                .evictions
                .load(std::sync::atomic::Ordering::Relaxed);
            s.checksum_units_damaged = c
                .counters
                .damaged
                .load(std::sync::atomic::Ordering::Relaxed);
        }
        Some(s)
    }

    /// Fills the page-checksum cache of a persistent volume to its capacity with units
    /// that have nothing to write, and returns how many were added (`sce footprint`: the
    /// checksums' memory once the cache is in use). None without persistence.
    #[doc(hidden)]
    pub fn fill_checksum_cache(&self) -> Option<usize> {
        self.engine
            .admin()
            .checks
            .cache()
            .map(|c| c.fill_for_footprint())
    }

    /// Drops from memory the page checksums of every metadata unit whose records hold
    /// them (tests: the next read of their pages takes them from the device).
    #[doc(hidden)]
    pub fn forget_checksums(&self) {
        if let Some(c) = self.engine.admin().checks.cache() {
            c.evict_clean();
        }
    }

    /// True once the cache disabled itself after device errors.
    pub fn is_passthrough(&self) -> bool {
        self.engine.admin().health.passthrough()
    }

    /// The cache device's errors so far (those counted towards the error limit), and the
    /// last with its time.
    pub fn cache_errors(&self) -> (u64, Option<(std::time::SystemTime, String)>) {
        self.engine.admin().health.last_error()
    }

    /// Runs one metadata flush round now (tests); returns the metadata errors it met.
    pub fn flush_metadata(&self) -> u64 {
        self.engine.flush_metadata()
    }

    /// The core's configuration (the volume's; each shard's is derived from it), as last
    /// retuned.
    pub fn config(&self) -> CoreConfig {
        self.engine.admin().config.lock().clone()
    }

    /// Runs population on the calling thread until nothing more is picked or `max` jobs ran,
    /// ignoring the throttle. Returns the number of fragments populated.
    pub fn populate_now(&self, max: usize) -> usize {
        self.engine.populator().populate_now(max)
    }

    /// Prefetches `[offset, offset + len)` into the cache on the calling thread (NBD CACHE).
    pub fn prefetch(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.engine.populator().prefetch(offset, len)
    }

    /// Waits until no AWT copy is in flight (for tests and orderly shutdown).
    pub fn quiesce(&self) {
        let cores = &self.engine.admin().cores;
        while cores.sum(|c| {
            let (w, p) = c.operations_in_flight();
            w + p
        }) > 0
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Stops the background threads and, with persistence, writes every record and marks the
    /// device cleanly shut down. Returns true if the device was left clean (false without
    /// persistence, or after errors). Idempotent; dropping the volume calls it.
    pub fn shutdown(&self) -> bool {
        let e = self.engine.admin();
        e.signals.stop();
        if let WritePath::Through(t) = &self.path {
            // Closing the queue lets the AWT writers finish what is queued, then exit.
            t.close();
        }
        // So does closing the fill queue (reads from now on write their own fills).
        e.fills.close();
        let threads: Vec<_> = self.threads.lock().drain(..).collect();
        if threads.is_empty() {
            return false;
        }
        for t in threads {
            let _ = t.join();
        }
        if let WritePath::Log(l) = &self.path {
            // A clean stop commits what was written since the last FLUSH (if the ring has
            // room: with the cleaner gone, nothing would make more).
            l.autocommit();
        }
        if e.persist.is_none() || e.health.passthrough() {
            return false;
        }
        self.quiesce();
        self.engine.close_store()
    }
}

impl Drop for CacheVolume {
    fn drop(&mut self) {
        self.shutdown();
    }
}
