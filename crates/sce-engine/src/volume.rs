//! `CacheVolume`: a source volume cached on a cache device, itself a `BlockDevice`.
//!
//! The core (`sce-core`) sits behind one lock; the lock is held only to plan and to report
//! completions, never across I/O. Reads run their planned I/O on the caller's thread. Writes
//! send the source write from the caller's thread and, in AWT mode, hand a copy of the data
//! to the AWT writer threads first, so the two writes run in parallel and the caller returns
//! when the source write is done. Background population workers follow Algorithm 1.
//!
//! This file opens and shuts the volume down and dispatches; the roles live in their own
//! files: `read`, `write`, `awt`, `population`, `flusher` (with `persist`), `health` and
//! `verify`, over the state they share (`shared`).

use crate::awt::{awt_writer, AwtJob, AwtQueue, Payload};
use crate::brlock::BrLock;
use crate::flusher::{flusher, intent_writer};
use crate::persist::{Persist, PersistConfig, PersistStats};
use crate::population::population_worker;
use crate::shared::{LogShard, Shared, LOG_SHARDS};
use crate::stats::{Counters, VolumeStats};
use parking_lot::{Condvar, Mutex};
use sce_core::{CacheCore, ConfigError, CoreConfig};
use sce_io::{check_range, BlockDevice, IoError, Op, SharedBytes, SliceDevice};
use sce_store::CrcTable;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
    /// Keep the cache contents on the cache device across restarts (see `persist`). The
    /// cache device then holds the metadata as well as the data.
    pub persist: Option<PersistConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            core: CoreConfig::default(),
            awt_threads: 2,
            background_population: true,
            verify: true,
            error_limit: 16,
            persist: None,
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

/// A cached volume. Thread-safe: share it with `Arc` and call it from any number of threads.
pub struct CacheVolume {
    shared: Arc<Shared>,
    awt: AwtQueue,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for CacheVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheVolume")
            .field("size", &self.shared.source.size())
            .finish()
    }
}

/// What `open_core` makes: the core, the checksums, the store, the data device (the cache
/// device, or its data area with persistence) and the volume id seeding the checksums.
type OpenedCore = (
    CacheCore,
    Option<CrcTable>,
    Option<Persist>,
    Arc<dyn BlockDevice>,
    u16,
);

/// Builds the core and, with persistence, opens the store on `cache`, restores what it
/// holds into the core and starts it.
fn open_core(
    source: &dyn BlockDevice,
    cache: Arc<dyn BlockDevice>,
    config: &EngineConfig,
) -> Result<OpenedCore, EngineError> {
    let mut core_cfg = config.core.clone();
    let verify = config.verify || config.persist.is_some();
    if verify {
        core_cfg.revalidate_partial_pages = false;
    }
    let Some(pc) = config.persist.clone() else {
        let core = CacheCore::new(core_cfg, source.size(), cache.size())?;
        let g = core.geometry();
        let crcs = verify.then(|| CrcTable::new(g.slots(), g.pages_per_fragment()));
        return Ok((core, crcs, None, cache, 1));
    };
    let opened = Persist::open(
        cache.clone(),
        pc,
        core_cfg.fragment_size,
        source.size(),
        source.identity(),
    )?;
    let mut persist = opened.persist;
    let loaded = opened.loaded;
    let vol_id = persist.volume_id();
    let l = persist.layout;
    let data: Arc<dyn BlockDevice> =
        Arc::new(SliceDevice::new(cache, l.data_offset, l.data_bytes())?);
    let mut core = CacheCore::new(core_cfg, source.size(), data.size())?;
    core.track_dirty();
    let words = l.bitmap_words();
    core.restore(loaded.entries.iter().enumerate().map(|(i, &(s, f))| {
        (
            sce_core::SlotNo(s),
            sce_core::FragNo(f),
            &loaded.bitmaps[i * words..(i + 1) * words],
        )
    }));
    persist.start(&core, &loaded)?;
    Ok((core, Some(loaded.crcs), Some(persist), data, vol_id))
}

/// Starts a named thread running `f` on the shared state.
fn spawn(
    shared: &Arc<Shared>,
    name: String,
    what: &str,
    f: impl FnOnce(&Shared) + Send + 'static,
) -> Result<JoinHandle<()>, IoError> {
    let s = shared.clone();
    std::thread::Builder::new()
        .name(name)
        .spawn(move || f(&s))
        .map_err(|e| IoError::Invalid(format!("cannot start {what} thread: {e}")))
}

/// Starts the AWT writers, the population workers and, with persistence, the flusher and
/// the intent writer.
fn start_threads(
    shared: &Arc<Shared>,
    config: &EngineConfig,
    rx: crossbeam_channel::Receiver<AwtJob>,
) -> Result<Vec<JoinHandle<()>>, IoError> {
    let workers = if config.background_population {
        config.core.throttle.max_workers
    } else {
        0
    };
    let mut threads = Vec::new();
    for i in 0..config.awt_threads.max(1) {
        let rx = rx.clone();
        threads.push(spawn(shared, format!("sce-awt-{i}"), "AWT", move |s| {
            awt_writer(s, rx)
        })?);
    }
    for i in 0..workers {
        threads.push(spawn(
            shared,
            format!("sce-pop-{i}"),
            "population",
            move |s| population_worker(s, i),
        )?);
    }
    if shared.persist.is_some() {
        threads.push(spawn(shared, "sce-meta".into(), "metadata", flusher)?);
        threads.push(spawn(shared, "sce-intent".into(), "intent", intent_writer)?);
    }
    Ok(threads)
}

impl CacheVolume {
    /// Opens a cached volume over `source`, using `cache` as the cache device. The cache holds
    /// `cache.size() / fragment_size` slots. Starts the AWT writers and, unless disabled, the
    /// population workers.
    pub fn open(
        source: Arc<dyn BlockDevice>,
        cache: Arc<dyn BlockDevice>,
        config: EngineConfig,
    ) -> Result<CacheVolume, EngineError> {
        let lbs = source
            .logical_block_size()
            .max(cache.logical_block_size())
            .max(512);
        if lbs > 4096 {
            return Err(ConfigError::new(
                "logical_block_size",
                format!("{lbs} bytes is larger than a 4 KiB page"),
            )
            .into());
        }
        let source_size = source.size();
        let (core, crcs, persist, cache, vol_id) = open_core(&*source, cache, &config)?;
        let shared = Arc::new(Shared {
            source,
            cache,
            pins: core.pin_table(),
            source_size,
            fshift: core.geometry().fragment_shift(),
            core: BrLock::new(core),
            crcs,
            persist,
            errors: AtomicU64::new(0),
            error_limit: config.error_limit.max(1),
            passthrough: AtomicBool::new(false),
            logs: (0..LOG_SHARDS).map(|_| LogShard::default()).collect(),
            counters: Counters::default(),
            epoch: Instant::now(),
            shutdown: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            lbs,
            vol_id,
            source_writes_started: AtomicU64::new(0),
            source_writes_done: AtomicU64::new(0),
            intent_pending: Mutex::new(false),
            intent_wake: Condvar::new(),
        });
        let (tx, rx) = crossbeam_channel::unbounded::<AwtJob>();
        let threads = start_threads(&shared, &config, rx)?;
        Ok(CacheVolume {
            shared,
            awt: AwtQueue::new(tx),
            threads: Mutex::new(threads),
        })
    }

    /// A snapshot of the counters. It takes only the core's shared lock (a metrics scrape
    /// never stalls I/O): the read accounting still waiting in the log shards is added to
    /// the core's counts, not applied.
    pub fn stats(&self) -> VolumeStats {
        let core = self.shared.core.read();
        let mut v = self
            .shared
            .counters
            .snapshot(&core, self.shared.passthrough.load(Relaxed));
        // Lock order: core, then a leaf.
        for shard in self.shared.logs.iter() {
            let [requests, full, hit, missed] = shard.0.lock().pending_counts();
            v.read_requests += requests;
            v.read_requests_full_hit += full;
            v.read_pages_hit += hit;
            v.read_pages_missed += missed;
        }
        v
    }

    /// The persistent store's state and counters (None without persistence).
    pub fn persist_stats(&self) -> Option<PersistStats> {
        self.shared.persist.as_ref().map(|p| p.stats())
    }

    /// True once the cache disabled itself after device errors.
    pub fn is_passthrough(&self) -> bool {
        self.shared.passthrough.load(Relaxed)
    }

    /// Runs one metadata flush round now (tests); returns the metadata errors it met.
    pub fn flush_metadata(&self) -> u64 {
        self.shared.flush_metadata()
    }

    /// The core's configuration.
    pub fn config(&self) -> CoreConfig {
        self.shared.core.read().config().clone()
    }

    /// Runs population on the calling thread until nothing more is picked or `max` jobs ran,
    /// ignoring the throttle. Returns the number of fragments populated.
    pub fn populate_now(&self, max: usize) -> usize {
        self.shared.populate_now(max)
    }

    /// Prefetches `[offset, offset + len)` into the cache on the calling thread (NBD CACHE).
    pub fn prefetch(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.shared.prefetch(offset, len)
    }

    /// Waits until no AWT copy is in flight (for tests and orderly shutdown).
    pub fn quiesce(&self) {
        loop {
            let (w, p) = self.shared.core.read().operations_in_flight();
            if w == 0 && p == 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Stops the background threads and, with persistence, writes every record and marks the
    /// device cleanly shut down. Returns true if the device was left clean (false without
    /// persistence, or after errors). Idempotent; dropping the volume calls it.
    pub fn shutdown(&self) -> bool {
        let s = &self.shared;
        s.shutdown.store(true, Relaxed);
        {
            let _g = s.sleep_lock.lock();
            s.wake.notify_all();
        }
        {
            let _g = s.intent_pending.lock();
            s.intent_wake.notify_all();
        }
        // Closing the queue lets the AWT writers finish what is queued, then exit.
        self.awt.close();
        let threads: Vec<_> = self.threads.lock().drain(..).collect();
        if threads.is_empty() {
            return false;
        }
        for t in threads {
            let _ = t.join();
        }
        if s.persist.is_none() || s.passthrough.load(Relaxed) {
            return false;
        }
        self.quiesce();
        s.close_store()
    }
}

impl Drop for CacheVolume {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl BlockDevice for CacheVolume {
    fn size(&self) -> u64 {
        self.shared.source.size()
    }

    fn logical_block_size(&self) -> u32 {
        self.shared.lbs
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let s = &self.shared;
        check_range(Op::Read, offset, buf.len() as u64, s.source.size(), s.lbs)?;
        s.read(offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let s = &self.shared;
        check_range(Op::Write, offset, buf.len() as u64, s.source.size(), s.lbs)?;
        s.write(&self.awt, offset, Payload::Borrowed(buf))
    }

    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        let s = &self.shared;
        check_range(Op::Write, offset, data.len() as u64, s.source.size(), s.lbs)?;
        s.write(&self.awt, offset, Payload::Shared(data))
    }

    fn flush(&self) -> Result<(), IoError> {
        // The source is the system of record: every acknowledged write is on it. The cache's
        // records need no flush here: their ordering is the intents' business.
        self.shared.source.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let s = &self.shared;
        check_range(Op::Discard, offset, len, s.source.size(), s.lbs)?;
        s.discard(offset, len)
    }
}
