//! `CacheVolume`: a source volume cached on a cache device, itself a `BlockDevice`.
//!
//! The core (`sce-core`) is cut into shards by fragment (`ShardMap`), each behind a lock of
//! its own; a lock is held only to plan and to report completions, never across I/O, and a
//! thread holds at most one. Reads run their planned I/O on the caller's thread. Writes
//! send the source write from the caller's thread and, in AWT mode, hand a copy of the data
//! to the AWT writer threads first, so the two writes run in parallel and the caller returns
//! when the source write is done. Background population workers follow Algorithm 1.
//!
//! This file opens and shuts the volume down and dispatches; the roles live in their own
//! files: `read`, `write`, `awt`, `population`, `flusher` (with `persist`), `health` and
//! `verify`, over the state they share (`shared`).

use crate::awt::{awt_writer, AwtJob, AwtQueue};
use crate::brlock::BrLock;
use crate::flusher::{flusher, intent_writer};
use crate::parts::{PartInfo, Placed};
use crate::persist::{OpenVolume, Persist, PersistConfig, PersistStats};
use crate::population::population_worker;
use crate::queued::HitQueue;
use crate::shared::{LogShard, Shared, LOG_SHARDS};
use crate::stats::{Counters, VolumeStats};
use parking_lot::{Condvar, Mutex};
use sce_core::{CacheCore, ConfigError, CoreConfig, ShardMap, SlotNo};
use sce_io::{BlockDevice, IoError, IoQueue, SliceDevice};
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
    /// stop hits on the others. 0 (the default) picks [`AUTO_CORE_SHARDS`], fewer if the
    /// cache holds fewer than [`MIN_SLOTS_PER_AUTO_SHARD`] slots per shard; 1 is the
    /// unsharded core. Never more than half the slots (a shard needs two).
    pub core_shards: usize,
}

/// Core shards of `core_shards: 0` on a large enough cache (see docs/ARCHITECTURE.md).
pub const AUTO_CORE_SHARDS: usize = 4;
/// `core_shards: 0` gives each automatic shard at least this many slots.
pub const MIN_SLOTS_PER_AUTO_SHARD: u64 = 64;

impl EngineConfig {
    /// The shards asked for a cache of `slots` slots (`ShardMap` clamps them further).
    fn shards_for(&self, slots: u64) -> usize {
        match self.core_shards {
            0 => (slots / MIN_SLOTS_PER_AUTO_SHARD).clamp(1, AUTO_CORE_SHARDS as u64) as usize,
            n => n,
        }
    }
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
    pub(crate) shared: Arc<Shared>,
    pub(crate) awt: AwtQueue,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for CacheVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheVolume")
            .field("size", &self.shared.source.size())
            .finish()
    }
}

/// What `open_core` makes: the core shards and their map, the core configuration, the
/// checksums, the store, the data device (the cache device, or its data area with
/// persistence) and the volume id seeding the checksums.
struct OpenedCore {
    cores: Vec<CacheCore>,
    map: ShardMap,
    config: CoreConfig,
    crcs: Option<CrcTable>,
    persist: Option<Persist>,
    data: Arc<dyn BlockDevice>,
    seeds: Vec<(u64, u16)>,
}

/// Refuses what the core has and the engine does not drive yet: write-back (issue 15; see
/// docs/WRITEBACK.md).
pub(crate) fn engine_supports(
    cfg: &CoreConfig,
    persist: Option<&PersistConfig>,
) -> Result<(), ConfigError> {
    if cfg.write_mode == sce_core::WriteMode::WriteBack && !persist.is_some_and(|p| p.journal) {
        return Err(ConfigError::new(
            "mode",
            "writeback needs a persistent cache with its write journal (dirty data must \
             survive a crash); see docs/WRITEBACK.md"
                .into(),
        ));
    }
    Ok(())
}

/// Cuts the core into shards for a cache of `cache_size` bytes and builds them.
fn build_cores(
    cfg: &CoreConfig,
    config: &EngineConfig,
    source_size: u64,
    cache_size: u64,
) -> Result<(Vec<CacheCore>, ShardMap), EngineError> {
    let slots = cache_size / cfg.fragment_size.max(1);
    let wanted = config.shards_for(slots);
    // An invalid fragment size or slot count is reported by the core itself (one shard).
    let ok = cfg.validate().is_ok() && slots < u32::MAX as u64;
    let map = ShardMap::new(
        if ok { wanted } else { 1 },
        cfg.fragment_size,
        source_size,
        slots.min(u32::MAX as u64 - 1) as u32,
    );
    Ok((map.build(cfg, cache_size)?, map))
}

/// Builds the core shards and, with persistence, opens the store on `cache`, restores what
/// it holds into them and starts it.
fn open_core(
    source: &dyn BlockDevice,
    vols: &[OpenVolume],
    cache: Arc<dyn BlockDevice>,
    config: &EngineConfig,
) -> Result<OpenedCore, EngineError> {
    let mut core_cfg = config.core.clone();
    let verify = config.verify || config.persist.is_some();
    if verify {
        core_cfg.revalidate_partial_pages = false;
    }
    let Some(mut pc) = config.persist.clone() else {
        let (mut cores, map) = build_cores(&core_cfg, config, source.size(), cache.size())?;
        crate::parts::apply_shares(&mut cores, &map, vols, core_cfg.fragment_size);
        let slots = cores.iter().map(|c| c.geometry().slots()).sum();
        let ppf = cores[0].geometry().pages_per_fragment();
        let crcs = verify.then(|| CrcTable::new(slots, ppf));
        return Ok(OpenedCore {
            cores,
            map,
            config: core_cfg,
            crcs,
            persist: None,
            data: cache,
            seeds: vols
                .iter()
                .enumerate()
                .map(|(i, v)| (v.base / 4096, i as u16 + 1))
                .collect(),
        });
    };
    pc.writeback = core_cfg.write_mode == sce_core::WriteMode::WriteBack;
    let opened = Persist::open(cache.clone(), pc, core_cfg.fragment_size, vols)?;
    let mut persist = opened.persist;
    let loaded = opened.loaded;
    let seeds = persist.seeds();
    let l = persist.layout;
    let data: Arc<dyn BlockDevice> =
        Arc::new(SliceDevice::new(cache, l.data_offset, l.data_bytes())?);
    let (mut cores, map) = build_cores(&core_cfg, config, source.size(), data.size())?;
    let skipped = crate::wback::restore(&mut cores, &map, &loaded, l.bitmap_words());
    if skipped > 0 {
        return Err(ConfigError::new(
            "core_shards",
            format!(
                "{skipped} dirty (write-back) pages on the cache device belong to records this \
                 start cannot place (the core shard count changed): start with the previous \
                 core_shards setting and run `sce ctl flush --to-source` first"
            ),
        )
        .into());
    }
    crate::wback::check_dirty(&core_cfg, &loaded)?;
    crate::parts::apply_shares(&mut cores, &map, vols, core_cfg.fragment_size);
    crate::wback::hold_dirty(&mut cores, &map, &persist, &loaded);
    persist.start(
        |s| {
            let (k, local) = map.slot_to_local(SlotNo(s));
            let f = cores[k].slot_state(local).0;
            f.map(|f| map.frag_to_global(k, f).0)
        },
        &loaded,
    )?;
    Ok(OpenedCore {
        cores,
        map,
        config: core_cfg,
        crcs: Some(loaded.crcs),
        persist: Some(persist),
        data,
        seeds,
    })
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
    if shared.wb.is_some() {
        for i in 0..crate::cleaner::CLEANERS {
            let name = format!("sce-clean-{i}");
            threads.push(spawn(shared, name, "cleaner", crate::cleaner::cleaner)?);
        }
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
        let pc = config.persist.as_ref();
        let part = PartInfo {
            name: pc.map_or_else(|| "source".into(), |p| p.volume_name.clone()),
            at: Placed {
                base: 0,
                size: source.size(),
            },
            source: source.clone(),
            wrote: Default::default(),
        };
        let vol = OpenVolume {
            name: part.name.clone(),
            size: source.size(),
            base: 0,
            identity: source.identity(),
            source_generation: pc.and_then(|p| p.source_generation.clone()),
            forget: pc.is_some_and(|p| p.forget_volume),
            share: None,
        };
        Self::open_parts(source, vec![part], &[vol], cache, config)
    }

    /// `open` for the volumes `parts` (`vols` as the store opens them) laid out in `source`.
    pub(crate) fn open_parts(
        source: Arc<dyn BlockDevice>,
        parts: Vec<PartInfo>,
        vols: &[OpenVolume],
        cache: Arc<dyn BlockDevice>,
        config: EngineConfig,
    ) -> Result<CacheVolume, EngineError> {
        engine_supports(&config.core, config.persist.as_ref())?;
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
        let o = open_core(&*source, vols, cache, &config)?;
        let shards = o.cores.len();
        let shared = Arc::new(Shared {
            source,
            cache: o.data,
            pins: o.cores.iter().map(|c| c.pin_table()).collect(),
            source_size,
            fshift: o.cores[0].geometry().fragment_shift(),
            cores: o.cores.into_iter().map(BrLock::new).collect(),
            map: o.map,
            config: Mutex::new(o.config),
            crcs: o.crcs,
            persist: o.persist,
            seeds: o.seeds,
            parts,
            errors: AtomicU64::new(0),
            error_limit: config.error_limit.max(1),
            passthrough: AtomicBool::new(false),
            logs: (0..LOG_SHARDS * shards)
                .map(|_| LogShard::default())
                .collect(),
            counters: Counters::default(),
            epoch: Instant::now(),
            shutdown: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            lbs,
            source_writes_started: AtomicU64::new(0),
            source_writes_done: AtomicU64::new(0),
            intent_pending: Mutex::new(false),
            intent_wake: Condvar::new(),
            hits: std::sync::OnceLock::new(),
            wb: (config.core.write_mode == sce_core::WriteMode::WriteBack)
                .then(|| crate::wback::WbEngine::new(config.writeback_wait, config.writeback_idle)),
        });
        if shared.wb.is_some() {
            // Before anything is served: records that the load found superseded (a slot
            // whose dirty claims a later journal entry moved elsewhere) are rewritten now,
            // for such a slot is free again and its record must not vouch for dirty pages
            // once other data lands in it.
            let errors = shared.flush_metadata();
            if errors > 0 {
                return Err(IoError::Invalid(format!(
                    "the cache device's records could not be written at start ({errors} errors)"
                ))
                .into());
            }
        }
        let (tx, rx) = crossbeam_channel::unbounded::<AwtJob>();
        let threads = start_threads(&shared, &config, rx)?;
        Ok(CacheVolume {
            shared,
            awt: AwtQueue::new(tx),
            threads: Mutex::new(threads),
        })
    }

    /// Serves hits through `queue`, an owned-buffer queue (io_uring) on the cache device
    /// this volume was opened with, or on a device it is a slice of, starting at `base`
    /// there: a read whose every page is a hit is then started by
    /// [`QueuedReads::start_read`] and completes on the queue's thread. Once per volume;
    /// false if it already has one.
    pub fn serve_hits_from(&self, queue: Arc<dyn IoQueue>, base: u64) -> bool {
        let data = self
            .shared
            .persist
            .as_ref()
            .map_or(0, |p| p.layout.data_offset);
        self.shared
            .hits
            .set(HitQueue::new(queue, base + data))
            .is_ok()
    }

    /// A snapshot of the counters. It takes only the core shards' shared locks, one at a
    /// time (a metrics scrape never stalls I/O): the read accounting still waiting in the
    /// log shards is added to the cores' counts, not applied.
    pub fn stats(&self) -> VolumeStats {
        let s = &self.shared;
        let mut v = VolumeStats::default();
        for (k, lock) in s.cores.iter().enumerate() {
            let core = lock.read();
            if k == 0 {
                v = s.counters.snapshot(&core, s.passthrough.load(Relaxed));
            } else {
                v.add_core(&core);
            }
            // Lock order: core, then a leaf.
            for shard in s.logs_of(k) {
                let [requests, full, hit, missed] = shard.0.lock().pending_counts();
                v.read_requests += requests;
                v.read_requests_full_hit += full;
                v.read_pages_hit += hit;
                v.read_pages_missed += missed;
            }
        }
        s.counters.unsplit(&mut v);
        v
    }

    /// The number of core shards.
    pub fn core_shards(&self) -> usize {
        self.shared.cores.len()
    }

    /// Runs `f` while this thread holds core shard `k`'s exclusive lock, as a write or a
    /// population step on that shard would (tests: the other shards keep serving). `f`
    /// must not use the volume's shard `k`, nor `stats`, which read every shard.
    #[doc(hidden)]
    pub fn with_core_shard_locked<R>(&self, k: usize, f: impl FnOnce() -> R) -> R {
        let _exclusive = self.shared.cores[k].write();
        f()
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

    /// The core's configuration (the volume's; each shard's is derived from it), as last
    /// retuned.
    pub fn config(&self) -> CoreConfig {
        self.shared.config.lock().clone()
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
            let busy = self.shared.cores.iter().any(|c| {
                let (w, p) = c.read().operations_in_flight();
                w + p > 0
            });
            if !busy {
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
