//! `CacheVolume`: a source volume cached on a cache device, itself a `BlockDevice`.
//!
//! The core (`sce-core`) sits behind one mutex; the lock is held only to plan and to report
//! completions, never across I/O. Reads run their planned I/O on the caller's thread. Writes
//! send the source write from the caller's thread and, in AWT mode, hand a copy of the data
//! to the AWT writer threads first, so the two writes run in parallel and the caller returns
//! when the source write is done. Background population workers follow Algorithm 1.

use crate::stats::{Counters, VolumeStats};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex, RwLock};
use sce_core::slots::PinTable;
use sce_core::{
    AccessLog, CacheCore, CacheWrite, ConfigError, CoreConfig, Nanos, PopulationJob, ReadPlan,
    RequestError, RunTarget, SourceOffset, WriteId, WriteKind, WritePlan,
};
use sce_io::{check_range, AlignedBuf, BlockDevice, IoError, Op};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
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
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            core: CoreConfig::default(),
            awt_threads: 2,
            background_population: true,
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
}

struct AwtJob {
    id: WriteId,
    data: Arc<AlignedBuf>,
    writes: Vec<CacheWrite>,
}

struct Shared {
    source: Arc<dyn BlockDevice>,
    cache: Arc<dyn BlockDevice>,
    core: RwLock<CacheCore>,
    logs: Box<[LogShard]>,
    pins: Arc<PinTable>,
    counters: Counters,
    epoch: Instant,
    shutdown: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    lbs: u32,
}

/// A cached volume. Thread-safe: share it with `Arc` and call it from any number of threads.
pub struct CacheVolume {
    shared: Arc<Shared>,
    awt_tx: Mutex<Option<Sender<AwtJob>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for CacheVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheVolume")
            .field("size", &self.shared.source.size())
            .finish()
    }
}

thread_local! {
    static PLAN: RefCell<ReadPlan> = RefCell::new(ReadPlan::new());
    static SHARD: usize = NEXT_SHARD.fetch_add(1, Relaxed) % LOG_SHARDS;
}

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);
const LOG_SHARDS: usize = 32;
/// Reads a shard records before it applies its log to the core.
const LOG_BATCH: u64 = 64;

/// One shard of deferred read accounting, on its own cache lines so that threads on
/// different shards do not share them.
#[derive(Default)]
#[repr(align(128))]
struct LogShard(Mutex<AccessLog>);

fn request_error(op: Op, e: RequestError, offset: u64, len: u64, size: u64, lbs: u32) -> IoError {
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
    }
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
        let core = CacheCore::new(config.core.clone(), source.size(), cache.size())?;
        let workers = if config.background_population {
            config.core.throttle.max_workers
        } else {
            0
        };
        let shared = Arc::new(Shared {
            source,
            cache,
            pins: core.pin_table(),
            core: RwLock::new(core),
            logs: (0..LOG_SHARDS).map(|_| LogShard::default()).collect(),
            counters: Counters::default(),
            epoch: Instant::now(),
            shutdown: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            lbs,
        });
        let (tx, rx) = crossbeam_channel::unbounded::<AwtJob>();
        let mut threads = Vec::new();
        for i in 0..config.awt_threads.max(1) {
            let (s, rx) = (shared.clone(), rx.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("sce-awt-{i}"))
                    .spawn(move || awt_writer(&s, rx))
                    .map_err(|e| IoError::Invalid(format!("cannot start AWT thread: {e}")))?,
            );
        }
        for i in 0..workers {
            let s = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("sce-pop-{i}"))
                    .spawn(move || population_worker(&s, i))
                    .map_err(|e| {
                        IoError::Invalid(format!("cannot start population thread: {e}"))
                    })?,
            );
        }
        Ok(CacheVolume {
            shared,
            awt_tx: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
        })
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> VolumeStats {
        let mut core = self.shared.core.write();
        for shard in self.shared.logs.iter() {
            core.apply_access_log(&mut shard.0.lock());
        }
        self.shared.counters.snapshot(&core)
    }

    /// The core's configuration.
    pub fn config(&self) -> CoreConfig {
        self.shared.core.write().config().clone()
    }

    /// Runs population on the calling thread until nothing more is picked or `max` jobs ran,
    /// ignoring the throttle. Returns the number of fragments populated.
    pub fn populate_now(&self, max: usize) -> usize {
        let mut buf = AlignedBuf::new(self.shared.core.write().geometry().fragment_size() as usize);
        let mut n = 0;
        while n < max {
            let job = self.shared.core.write().pick_population_unthrottled();
            let Some(job) = job else { break };
            run_population(&self.shared, &job, &mut buf);
            n += 1;
        }
        n
    }

    /// Prefetches `[offset, offset + len)` into the cache on the calling thread (NBD CACHE).
    pub fn prefetch(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let size = self.shared.source.size();
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(IoError::OutOfRange {
                op: Op::Read,
                offset,
                len,
                size,
            });
        }
        let fsize = self.shared.core.write().geometry().fragment_size();
        let mut buf = AlignedBuf::new(fsize as usize);
        let mut at = offset - offset % fsize;
        while at < offset + len {
            let job = self.shared.core.write().prefetch(SourceOffset(at));
            if let Some(job) = job {
                run_population(&self.shared, &job, &mut buf);
            }
            at += fsize;
        }
        Ok(())
    }

    /// Waits until no AWT copy is in flight (for tests and orderly shutdown).
    pub fn quiesce(&self) {
        loop {
            let (w, p) = self.shared.core.write().operations_in_flight();
            if w == 0 && p == 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn write_data(&self, offset: u64, data: &[u8]) -> Result<(), IoError> {
        let s = &self.shared;
        let len = data.len() as u64;
        let WritePlan {
            id,
            cache_writes,
            synchronous,
        } = s
            .core
            .write()
            .begin_write(SourceOffset(offset), len, WriteKind::Data)
            .map_err(|e| request_error(Op::Write, e, offset, len, s.source.size(), s.lbs))?;
        if synchronous {
            // Write-through: the source, then the cache copies, before acknowledging.
            let result = s.source_write(offset, data);
            s.copy_to_cache(id, &cache_writes, data);
            let _ = s.core.write().write_source_done(id, result.is_ok());
            return result;
        }
        if !cache_writes.is_empty() {
            // AWT: hand a copy to the writers before the source write, so both run in parallel.
            let mut copy = AlignedBuf::new(data.len());
            copy.copy_from_slice(data);
            let job = AwtJob {
                id,
                data: Arc::new(copy),
                writes: cache_writes,
            };
            // Writers gone (volume closing): the copies fail and the pages stay invalid.
            let unsent = match self.awt_tx.lock().as_ref() {
                Some(tx) => tx.send(job).err().map(|e| e.0),
                None => Some(job),
            };
            if let Some(job) = unsent {
                let mut core = s.core.write();
                for w in &job.writes {
                    let _ = core.write_cache_done(id, w.part, false);
                }
            }
        }
        let result = s.source_write(offset, data);
        let _ = s.core.write().write_source_done(id, result.is_ok());
        result
    }
}

impl Shared {
    /// Writes a write's cache copies (`data` is the whole request buffer) and reports each
    /// to the core; a failed copy is reported as failed, so its pages stay invalid.
    fn copy_to_cache(&self, id: WriteId, writes: &[CacheWrite], data: &[u8]) {
        let results: Vec<(u32, bool)> = writes
            .iter()
            .map(|w| {
                let piece = &data[w.buf_offset as usize..(w.buf_offset + w.len) as usize];
                (w.part, self.cache_write(w.cache.0, piece))
            })
            .collect();
        let mut core = self.core.write();
        for (part, ok) in results {
            let _ = core.write_cache_done(id, part, ok);
        }
    }

    fn now(&self) -> Nanos {
        Nanos::from_duration(self.epoch.elapsed())
    }

    /// Writes to the source, counting the bytes that made it.
    fn source_write(&self, offset: u64, data: &[u8]) -> Result<(), IoError> {
        let r = self.source.write_at(offset, data);
        if r.is_ok() {
            self.counters
                .source_bytes_written
                .fetch_add(data.len() as u64, Relaxed);
        }
        r
    }

    fn cache_write(&self, offset: u64, data: &[u8]) -> bool {
        match self.cache.write_at(offset, data) {
            Ok(()) => {
                self.counters
                    .cache_bytes_written
                    .fetch_add(data.len() as u64, Relaxed);
                true
            }
            Err(_) => {
                self.counters.cache_write_errors.fetch_add(1, Relaxed);
                false
            }
        }
    }

    /// Sleeps up to `d`, waking early on shutdown. Returns false if shutting down.
    fn sleep(&self, d: Duration) -> bool {
        let mut g = self.sleep_lock.lock();
        if self.shutdown.load(Relaxed) {
            return false;
        }
        self.wake.wait_for(&mut g, d);
        !self.shutdown.load(Relaxed)
    }
}

fn awt_writer(s: &Shared, rx: Receiver<AwtJob>) {
    for job in rx.iter() {
        s.copy_to_cache(job.id, &job.writes, &job.data);
    }
}

fn run_population(s: &Shared, job: &PopulationJob, buf: &mut AlignedBuf) {
    let span = &mut buf[..job.len as usize];
    let mut ok = match s.source.read_at(job.source.0, span) {
        Ok(()) => {
            s.counters.source_bytes_read.fetch_add(job.len, Relaxed);
            true
        }
        Err(_) => false,
    };
    if ok {
        for &(o, l, c) in &job.runs {
            ok &= s.cache_write(c.0, &buf[o as usize..(o + l) as usize]);
            if !ok {
                break;
            }
        }
    }
    let _ = s.core.write().complete_population(job.id, ok);
}

fn population_worker(s: &Shared, index: u32) {
    let fsize = s.core.write().geometry().fragment_size() as usize;
    let mut buf: Option<AlignedBuf> = None;
    loop {
        let st = s.core.write().throttle(s.now());
        if index == 0 {
            s.counters
                .active_workers
                .store(st.active_workers as u64, Relaxed);
        }
        if !s.sleep(st.period) {
            return;
        }
        if index >= st.active_workers {
            continue;
        }
        let job = s.core.write().pick_population(s.now());
        if let Some(job) = job {
            let b = buf.get_or_insert_with(|| AlignedBuf::new(fsize));
            run_population(s, &job, b);
        }
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
        let len = buf.len() as u64;
        check_range(Op::Read, offset, len, s.source.size(), s.lbs)?;
        PLAN.with(|cell| {
            let mut plan = cell.borrow_mut();
            let err = |e| request_error(Op::Read, e, offset, len, s.source.size(), s.lbs);
            // Shared path: plan under the read lock, defer the accounting to a log shard.
            let shared = {
                let core = s.core.read();
                core.plan_read(SourceOffset(offset), len, &mut plan)
                    .map_err(err)?;
                !plan.needs_commit()
            };
            if shared {
                let shard = &s.logs[SHARD.with(|i| *i)];
                let mut log = shard.0.lock();
                log.record(&plan);
                if log.requests() >= LOG_BATCH {
                    s.core.write().apply_access_log(&mut log);
                }
            } else {
                // An inline fill is wanted (admission `always`): redo it exclusively.
                plan.release_pins(&s.pins);
                s.core
                    .write()
                    .begin_read(SourceOffset(offset), len, &mut plan)
                    .map_err(err)?;
            }
            let mut result = Ok(());
            let (mut from_source, mut from_cache) = (0, 0);
            for run in &plan.runs {
                let dst = &mut buf[run.buf_offset as usize..(run.buf_offset + run.len) as usize];
                let src_off = offset + run.buf_offset;
                match run.target {
                    RunTarget::Cache(c) => match s.cache.read_at(c.0, dst) {
                        Ok(()) => from_cache += run.len,
                        Err(_) => {
                            // The cache device failed: serve the run from the source instead.
                            s.counters.cache_read_errors.fetch_add(1, Relaxed);
                            match s.source.read_at(src_off, dst) {
                                Ok(()) => from_source += run.len,
                                Err(e) => result = Err(e),
                            }
                        }
                    },
                    RunTarget::Source(so) => match s.source.read_at(so.0, dst) {
                        Ok(()) => from_source += run.len,
                        Err(e) => result = Err(e),
                    },
                }
            }
            s.counters.source_bytes_read.fetch_add(from_source, Relaxed);
            s.counters.cache_bytes_read.fetch_add(from_cache, Relaxed);
            let mut fill_ok: Vec<(sce_core::PopId, bool)> = Vec::new();
            if !plan.pops.is_empty() {
                for &pop in &plan.pops {
                    let mut ok = result.is_ok();
                    if ok {
                        for f in plan.fills.iter().filter(|f| f.pop == pop) {
                            let piece =
                                &buf[f.buf_offset as usize..(f.buf_offset + f.len) as usize];
                            ok &= s.cache_write(f.cache.0, piece);
                        }
                    }
                    fill_ok.push((pop, ok));
                }
            }
            if fill_ok.is_empty() {
                // The common case (no inline fill): no second trip through the lock.
                plan.release_pins(&s.pins);
            } else {
                let mut core = s.core.write();
                for (pop, ok) in fill_ok {
                    let _ = core.complete_population(pop, ok);
                }
                core.end_read(&mut plan);
            }
            result
        })
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        check_range(
            Op::Write,
            offset,
            len,
            self.shared.source.size(),
            self.shared.lbs,
        )?;
        self.write_data(offset, buf)
    }

    fn flush(&self) -> Result<(), IoError> {
        // The source is the system of record: every acknowledged write is on it.
        self.shared.source.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(
            Op::Discard,
            offset,
            len,
            self.shared.source.size(),
            self.shared.lbs,
        )?;
        self.write_discard(offset, len)
    }
}

impl CacheVolume {
    fn write_discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let s = &self.shared;
        let plan = s
            .core
            .write()
            .begin_write(SourceOffset(offset), len, WriteKind::Discard)
            .map_err(|e| request_error(Op::Discard, e, offset, len, s.source.size(), s.lbs))?;
        let result = s.source.discard(offset, len);
        let _ = s.core.write().write_source_done(plan.id, result.is_ok());
        result
    }
}

impl Drop for CacheVolume {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Relaxed);
        {
            let _g = self.shared.sleep_lock.lock();
            self.shared.wake.notify_all();
        }
        // Closing the channel lets the AWT writers finish what is queued, then exit.
        self.awt_tx.lock().take();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}
