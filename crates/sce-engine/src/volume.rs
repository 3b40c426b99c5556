//! `CacheVolume`: a source volume cached on a cache device, itself a `BlockDevice`.
//!
//! The core (`sce-core`) sits behind one mutex; the lock is held only to plan and to report
//! completions, never across I/O. Reads run their planned I/O on the caller's thread. Writes
//! send the source write from the caller's thread and, in AWT mode, hand a copy of the data
//! to the AWT writer threads first, so the two writes run in parallel and the caller returns
//! when the source write is done. Background population workers follow Algorithm 1.

use crate::persist::{Persist, PersistConfig, PersistStats, Ticket};
use crate::stats::{Counters, VolumeStats};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex, RwLock};
use sce_core::slots::PinTable;
use sce_core::{
    AccessLog, CacheCore, CacheWrite, ConfigError, CoreConfig, Nanos, PopulationJob, ReadPlan,
    RequestError, RunTarget, SourceOffset, WriteId, WriteKind, WritePlan,
};
use sce_io::{check_range, AlignedBuf, BlockDevice, IoError, Op, SliceDevice};
use sce_store::{page_checksum, page_seed, CrcTable};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
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

struct AwtJob {
    id: WriteId,
    offset: u64,
    data: Arc<AlignedBuf>,
    writes: Vec<CacheWrite>,
}

pub(crate) struct Shared {
    source: Arc<dyn BlockDevice>,
    cache: Arc<dyn BlockDevice>,
    pub(crate) core: RwLock<CacheCore>,
    pub(crate) crcs: Option<CrcTable>,
    persist: Option<Persist>,
    errors: AtomicU64,
    error_limit: u64,
    passthrough: AtomicBool,
    source_size: u64,
    fshift: u32,
    logs: Box<[LogShard]>,
    pins: Arc<PinTable>,
    counters: Counters,
    epoch: Instant,
    shutdown: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    lbs: u32,
    /// The volume id that seeds page checksums (the volume table's, or 1).
    vol_id: u16,
    /// Source writes and discards started, and completed (successfully or not): the flusher
    /// records the source's identity only when the two are equal.
    source_writes_started: AtomicU64,
    source_writes_done: AtomicU64,
    /// Intents were set ahead of need: the intent writer has work (with `intent_wake`).
    intent_pending: Mutex<bool>,
    intent_wake: Condvar,
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

/// A read's plan and the checksums its cached pages had when it was planned.
#[derive(Default)]
struct PlannedRead {
    plan: ReadPlan,
    /// For each `RunTarget::Cache` run, in order: the expected checksum of every page the run
    /// touches, taken under the core lock that made the pages hits.
    want: Vec<u32>,
}

thread_local! {
    static PLAN: RefCell<PlannedRead> = RefCell::new(PlannedRead::default());
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
        let source_size = source.size();
        let mut core_cfg = config.core.clone();
        let verify = config.verify || config.persist.is_some();
        if verify {
            core_cfg.revalidate_partial_pages = false;
        }
        let mut vol_id = 1;
        let (core, crcs, persist, cache) = match config.persist.clone() {
            None => {
                let core = CacheCore::new(core_cfg, source.size(), cache.size())?;
                let g = core.geometry();
                let crcs = verify.then(|| CrcTable::new(g.slots(), g.pages_per_fragment()));
                (core, crcs, None, cache)
            }
            Some(pc) => {
                let opened = Persist::open(
                    cache.clone(),
                    pc,
                    core_cfg.fragment_size,
                    source.size(),
                    source.identity(),
                )?;
                let mut persist = opened.persist;
                let loaded = opened.loaded;
                vol_id = persist.volume_id();
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
                (core, Some(loaded.crcs), Some(persist), data)
            }
        };
        let workers = if config.background_population {
            config.core.throttle.max_workers
        } else {
            0
        };
        let shared = Arc::new(Shared {
            source,
            cache,
            pins: core.pin_table(),
            source_size,
            fshift: core.geometry().fragment_shift(),
            core: RwLock::new(core),
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
        if shared.persist.is_some() {
            let s = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("sce-meta".into())
                    .spawn(move || flusher(&s))
                    .map_err(|e| IoError::Invalid(format!("cannot start metadata thread: {e}")))?,
            );
            let s = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("sce-intent".into())
                    .spawn(move || intent_writer(&s))
                    .map_err(|e| IoError::Invalid(format!("cannot start intent thread: {e}")))?,
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
        self.shared.apply_logs(&mut core);
        self.shared
            .counters
            .snapshot(&core, self.shared.passthrough.load(Relaxed))
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
        match &self.shared.persist {
            Some(p) => p.round(&self.shared, false),
            None => 0,
        }
    }

    /// The core's configuration.
    pub fn config(&self) -> CoreConfig {
        self.shared.core.write().config().clone()
    }

    /// Runs population on the calling thread until nothing more is picked or `max` jobs ran,
    /// ignoring the throttle. Returns the number of fragments populated.
    pub fn populate_now(&self, max: usize) -> usize {
        // Reads not yet accounted count as accesses for the pick.
        self.shared.apply_logs(&mut self.shared.core.write());
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
        if s.passthrough.load(Relaxed) {
            return s.source_write(offset, data);
        }
        let (plan, tickets) = s.begin_write(offset, len, WriteKind::Data)?;
        let WritePlan {
            id,
            mut cache_writes,
            synchronous,
        } = plan;
        if !s.wait_intents(&tickets) {
            // The intents could not be made durable; the cache is now disabled. Send no copy.
            let mut core = s.core.write();
            for w in cache_writes.drain(..) {
                let _ = core.write_cache_done(id, w.part, false);
            }
        }
        if synchronous {
            // Write-through: the source, then the cache copies, before acknowledging.
            let result = s.source_write(offset, data);
            s.copy_to_cache(id, offset, &cache_writes, data);
            let _ = s.core.write().write_source_done(id, result.is_ok());
            return result;
        }
        if !cache_writes.is_empty() {
            // AWT: hand a copy to the writers before the source write, so both run in parallel.
            let mut copy = AlignedBuf::new(data.len());
            copy.copy_from_slice(data);
            let job = AwtJob {
                id,
                offset,
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
    /// Plans a write or discard and, with persistence, sets the intents it needs (under the
    /// core lock); the caller waits for the tickets before sending anything.
    fn begin_write(
        &self,
        offset: u64,
        len: u64,
        kind: WriteKind,
    ) -> Result<(WritePlan, Vec<Ticket>), IoError> {
        let op = if kind == WriteKind::Data {
            Op::Write
        } else {
            Op::Discard
        };
        let mut core = self.core.write();
        core.advance_clock(self.now());
        let plan = core
            .begin_write(SourceOffset(offset), len, kind)
            .map_err(|e| request_error(op, e, offset, len, self.source_size, self.lbs))?;
        let tickets = match &self.persist {
            Some(p) if len > 0 => {
                let first = offset >> self.fshift;
                let last = (offset + len - 1) >> self.fshift;
                let core = &*core;
                let fshift = self.fshift;
                p.guard_write(
                    first..=last,
                    plan.cache_writes.iter().map(move |w| {
                        let slot = (w.cache.0 >> fshift) as u32;
                        let f = core.slot_state(sce_core::SlotNo(slot)).0;
                        (slot, f.map_or(u64::MAX, |f| f.0))
                    }),
                )
            }
            _ => Vec::new(),
        };
        Ok((plan, tickets))
    }

    /// Waits for intents to be durable. False if they could not be written: the cache device
    /// failed, and the cache is disabled (so nothing it holds is served or trusted again).
    fn wait_intents(&self, tickets: &[Ticket]) -> bool {
        let Some(p) = &self.persist else { return true };
        match p.sync(tickets) {
            Ok(()) => true,
            Err(e) => {
                self.disable(&format!("cannot write the write-intent bitmap: {e}"));
                false
            }
        }
    }

    /// Counts `n` cache-device errors; disables the cache once they reach the limit.
    fn device_errors(&self, n: u64, what: &str) {
        let total = self.errors.fetch_add(n, Relaxed) + n;
        if total >= self.error_limit {
            self.disable(&format!("{total} cache device errors, the last: {what}"));
        }
    }

    /// Disables the cache: from now on I/O passes through to the source.
    fn disable(&self, why: &str) {
        if self.passthrough.swap(true, Relaxed) {
            return;
        }
        tracing::error!("cache disabled, passing I/O through to the source: {why}");
        if let Some(p) = &self.persist {
            if let Err(e) = p.fail() {
                tracing::error!(
                    "could not mark the cache device failed ({e}); reformat it before reusing it"
                );
            }
        }
        self.core.write().drop_all();
    }

    /// Applies every shard's deferred read accounting to the core.
    fn apply_logs(&self, core: &mut CacheCore) {
        for shard in self.logs.iter() {
            core.apply_access_log(&mut shard.0.lock());
        }
    }

    /// Splits a cache (or source) offset into its slot (or fragment) number and the page
    /// within it.
    fn slot_page(&self, off: u64) -> (u64, u32) {
        (
            off >> self.fshift,
            ((off & ((1 << self.fshift) - 1)) / sce_core::PAGE_SIZE) as u32,
        )
    }

    /// Counts a failed cache read towards the error limit.
    fn cache_read_failed(&self, e: &IoError) {
        self.counters.cache_read_errors.fetch_add(1, Relaxed);
        self.device_errors(1, &format!("read error: {e}"));
    }

    /// Stores the checksums of the whole pages of a cache write of `data` at source offset
    /// `src` and cache offset `cache` (the same position within their pages).
    fn record_crcs(&self, src: u64, cache: u64, data: &[u8]) {
        let Some(crcs) = &self.crcs else { return };
        let ps = sce_core::PAGE_SIZE;
        let end = src + data.len() as u64;
        let mut sp = src.div_ceil(ps) * ps;
        while sp < end {
            let pe = (sp + ps).min(self.source_size);
            if pe > end {
                break;
            }
            let (slot, p) = self.slot_page(cache + (sp - src));
            let bytes = &data[(sp - src) as usize..(pe - src) as usize];
            crcs.set(slot as u32, p, page_checksum(bytes, self.seed(sp)));
            sp += ps;
        }
    }

    /// Sets ahead of need the intents of recently written slots that this read hits, and
    /// wakes the intent writer if any was set (see `Persist::preset`).
    fn preset_intents(&self, plan: &ReadPlan) {
        let Some(p) = &self.persist else { return };
        let mut last = u32::MAX;
        let mut any = false;
        for run in &plan.runs {
            if let RunTarget::Cache(c) = run.target {
                let slot = (c.0 >> self.fshift) as u32;
                if slot != last {
                    any |= p.preset(slot);
                    last = slot;
                }
            }
        }
        if any {
            *self.intent_pending.lock() = true;
            self.intent_wake.notify_one();
        }
    }

    /// The pages a cache run of `len` bytes at cache offset `c` touches.
    fn run_pages(&self, c: u64, len: u64) -> usize {
        let ps = sce_core::PAGE_SIZE;
        ((c + len).div_ceil(ps) - c / ps) as usize
    }

    /// Appends to `want` the checksum of every page of every cache run of `plan`. The caller
    /// holds the core lock (read or write) under which the plan was made: a page that is
    /// valid under it has its final checksum recorded (writers record a page's checksum
    /// before the core marks it valid, and invalidate it before they change it).
    fn expected_crcs(&self, plan: &ReadPlan, want: &mut Vec<u32>) {
        want.clear();
        let Some(crcs) = &self.crcs else { return };
        let ps = sce_core::PAGE_SIZE;
        for run in &plan.runs {
            if let RunTarget::Cache(c) = run.target {
                let first = c.0 / ps;
                for k in 0..self.run_pages(c.0, run.len) as u64 {
                    let (slot, p) = self.slot_page((first + k) * ps);
                    want.push(crcs.get(slot as u32, p));
                }
            }
        }
    }

    /// The checksum seed of the page at source offset `src` (page-aligned).
    fn seed(&self, src: u64) -> u64 {
        page_seed(self.vol_id, src / sce_core::PAGE_SIZE)
    }

    /// Reads a run of cached data at cache offset `c` (source offset `src`) into `dst` and
    /// verifies each page against `want` (the checksums taken when the read was planned).
    /// False if the cache could not supply correct data (the caller reads the source
    /// instead). A mismatch is a device error only if the page is still valid with the same
    /// checksum and a re-read, under the core lock so that no write can start on the page,
    /// still mismatches; otherwise a write replaced the page since the read was planned.
    fn read_cache_run(&self, c: u64, src: u64, dst: &mut [u8], want: &[u32]) -> bool {
        if self.crcs.is_none() {
            let r = self.cache.read_at(c, dst);
            if let Err(e) = &r {
                self.cache_read_failed(e);
            }
            return r.is_ok();
        }
        let ps = sce_core::PAGE_SIZE;
        let head = src % ps;
        let len = dst.len() as u64;
        let aligned =
            head == 0 && ((src + len).is_multiple_of(ps) || src + len == self.source_size);
        let mut tmp = None;
        let r = if aligned {
            self.cache.read_at(c, dst)
        } else {
            let span = (head + len).div_ceil(ps) * ps;
            let mut b = AlignedBuf::new(span as usize);
            let r = self.cache.read_at(c - head, &mut b);
            tmp = Some(b);
            r
        };
        if let Err(e) = r {
            self.cache_read_failed(&e);
            // Drop the pages: the device may keep failing there.
            let (f, p0) = self.slot_page(src);
            let p1 = p0 + (head + len).div_ceil(ps) as u32;
            self.core.write().invalidate(sce_core::FragNo(f), p0, p1);
            return false;
        }
        let (bytes, c0, src0): (&[u8], u64, u64) = match &tmp {
            Some(b) => (&b[..], c - head, src - head),
            None => (&*dst, c, src),
        };
        let mut k = 0u64;
        let mut i = 0;
        while k < bytes.len() as u64 && src0 + k < self.source_size {
            let sp = src0 + k;
            let plen = ps.min(self.source_size - sp);
            let end = (k + plen).min(bytes.len() as u64);
            let expect = want[i];
            if page_checksum(&bytes[k as usize..end as usize], self.seed(sp)) != expect {
                if self.genuine_mismatch(c0 + k, sp, plen, expect) {
                    self.counters.cache_checksum_errors.fetch_add(1, Relaxed);
                    let (_, p) = self.slot_page(c0 + k);
                    self.core
                        .write()
                        .invalidate(sce_core::FragNo(sp >> self.fshift), p, p + 1);
                    self.device_errors(1, "checksum mismatch");
                }
                return false;
            }
            k += ps;
            i += 1;
        }
        if let Some(b) = tmp {
            dst.copy_from_slice(&b[head as usize..(head + len) as usize]);
        }
        true
    }

    /// After a checksum mismatch on the page at cache offset `c` (source offset `sp`, `plen`
    /// bytes): true if the page is still valid with checksum `expect` and a re-read still
    /// mismatches. The re-read runs under the core's read lock, so no write can invalidate
    /// and rewrite the page meanwhile (writers take the write lock first); this holds the
    /// lock across one 4 KiB read, on this error path only.
    fn genuine_mismatch(&self, c: u64, sp: u64, plen: u64, expect: u32) -> bool {
        let Some(crcs) = &self.crcs else { return false };
        let (slot, p) = self.slot_page(c);
        let core = self.core.read();
        let still = core.is_cached(SourceOffset(sp))
            && core
                .exists(sce_core::FragNo(sp >> self.fshift))
                .map(|x| x.0 .0)
                == Some(slot as u32)
            && crcs.get(slot as u32, p) == expect;
        if !still {
            return false;
        }
        let mut page = AlignedBuf::new(sce_core::PAGE_SIZE as usize);
        match self.cache.read_at(c, &mut page) {
            Ok(()) => page_checksum(&page[..plen as usize], self.seed(sp)) != expect,
            // A read error is a device error in its own right.
            Err(_) => true,
        }
    }

    /// Writes a write's cache copies (`data` is the whole request buffer, at source offset
    /// `offset`) and reports each to the core; a failed copy is reported as failed, so its
    /// pages stay invalid.
    fn copy_to_cache(&self, id: WriteId, offset: u64, writes: &[CacheWrite], data: &[u8]) {
        let results: Vec<(u32, bool)> = writes
            .iter()
            .map(|w| {
                let piece = &data[w.buf_offset as usize..(w.buf_offset + w.len) as usize];
                self.record_crcs(offset + w.buf_offset, w.cache.0, piece);
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

    fn cache_write(&self, offset: u64, data: &[u8]) -> bool {
        match self.cache.write_at(offset, data) {
            Ok(()) => {
                self.counters
                    .cache_bytes_written
                    .fetch_add(data.len() as u64, Relaxed);
                true
            }
            Err(e) => {
                self.counters.cache_write_errors.fetch_add(1, Relaxed);
                self.device_errors(1, &format!("write error: {e}"));
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
        s.copy_to_cache(job.id, job.offset, &job.writes, &job.data);
    }
}

fn run_population(s: &Shared, job: &PopulationJob, buf: &mut AlignedBuf) {
    if let Some(p) = &s.persist {
        // Data of another fragment may still be claimed by this slot's record.
        let t: Vec<Ticket> = p.guard_slot(job.slot.0, job.frag.0).into_iter().collect();
        if !s.wait_intents(&t) {
            let _ = s.core.write().complete_population(job.id, false);
            return;
        }
    }
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
            s.record_crcs(job.source.0 + o, c.0, &buf[o as usize..(o + l) as usize]);
        }
        for &(o, l, c) in &job.runs {
            ok &= s.cache_write(c.0, &buf[o as usize..(o + l) as usize]);
            if !ok {
                break;
            }
        }
    }
    let _ = s.core.write().complete_population(job.id, ok);
    if let (true, Some(p)) = (ok, &s.persist) {
        p.warm(job.slot.0);
    }
}

fn population_worker(s: &Shared, index: u32) {
    let fsize = s.core.write().geometry().fragment_size() as usize;
    let mut buf: Option<AlignedBuf> = None;
    loop {
        let st = {
            let mut core = s.core.write();
            if index == 0 {
                // Reads batch their accounting per shard; a slow trickle of reads would
                // otherwise never reach the hotness window and the miss rate.
                s.apply_logs(&mut core);
            }
            core.throttle(s.now())
        };
        if index == 0 {
            s.counters
                .active_workers
                .store(st.active_workers as u64, Relaxed);
        }
        if !s.sleep(st.period) {
            return;
        }
        if index >= st.active_workers || s.passthrough.load(Relaxed) {
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
        if s.passthrough.load(Relaxed) {
            let r = s.source.read_at(offset, buf);
            if r.is_ok() {
                s.counters.source_bytes_read.fetch_add(len, Relaxed);
            }
            return r;
        }
        PLAN.with(|cell| {
            let mut planned = cell.borrow_mut();
            let PlannedRead { plan, want } = &mut *planned;
            let err = |e| request_error(Op::Read, e, offset, len, s.source.size(), s.lbs);
            // Shared path: plan under the read lock, defer the accounting to a log shard.
            let shared = {
                let core = s.core.read();
                core.plan_read(SourceOffset(offset), len, plan)
                    .map_err(err)?;
                s.expected_crcs(plan, want);
                !plan.needs_commit()
            };
            if shared {
                // Lock order: a log shard is a leaf lock. A full batch is taken out of the
                // shard and the shard released before the core lock is taken.
                let shard = &s.logs[SHARD.with(|i| *i)];
                let full = {
                    let mut log = shard.0.lock();
                    log.record(plan);
                    (log.requests() >= LOG_BATCH).then(|| std::mem::take(&mut *log))
                };
                if let Some(mut batch) = full {
                    s.core.write().apply_access_log(&mut batch);
                }
            } else {
                // An inline fill is wanted (admission `always`): redo it exclusively.
                plan.release_pins(&s.pins);
                let mut core = s.core.write();
                core.advance_clock(s.now());
                core.begin_read(SourceOffset(offset), len, plan)
                    .map_err(err)?;
                s.expected_crcs(plan, want);
                if let Some(p) = &s.persist {
                    // Inline fills go to freshly allocated slots: guard them as populations.
                    let mut t = Vec::new();
                    for f in &plan.fills {
                        let slot = (f.cache.0 >> s.fshift) as u32;
                        let frag = (offset + f.buf_offset) >> s.fshift;
                        t.extend(p.guard_slot(slot, frag));
                    }
                    drop(core);
                    if !s.wait_intents(&t) {
                        plan.fills.clear();
                    }
                }
            }
            s.preset_intents(plan);
            let mut result = Ok(());
            let (mut from_source, mut from_cache) = (0, 0);
            let mut w = 0;
            for run in &plan.runs {
                let dst = &mut buf[run.buf_offset as usize..(run.buf_offset + run.len) as usize];
                let src_off = offset + run.buf_offset;
                match run.target {
                    RunTarget::Cache(c) => {
                        // Without checksums (`verify` off) `want` is empty.
                        let n = s.run_pages(c.0, run.len);
                        let expect = want.get(w..w + n).unwrap_or(&[]);
                        w += n;
                        if s.read_cache_run(c.0, src_off, dst, expect) {
                            from_cache += run.len;
                        } else {
                            // Unreadable or bad cached data: serve the run from the source.
                            match s.source.read_at(src_off, dst) {
                                Ok(()) => from_source += run.len,
                                Err(e) => result = Err(e),
                            }
                        }
                    }
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
                        let fills = plan.fills.iter().filter(|f| f.pop == pop);
                        ok &= fills.clone().next().is_some();
                        for f in fills {
                            let piece =
                                &buf[f.buf_offset as usize..(f.buf_offset + f.len) as usize];
                            s.record_crcs(offset + f.buf_offset, f.cache.0, piece);
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
                core.end_read(plan);
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
        // The source is the system of record: every acknowledged write is on it. The cache's
        // records need no flush here: their ordering is the intents' business.
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
        if s.passthrough.load(Relaxed) {
            return s.source.discard(offset, len);
        }
        let (plan, tickets) = s.begin_write(offset, len, WriteKind::Discard)?;
        s.wait_intents(&tickets);
        s.source_writes_started.fetch_add(1, SeqCst);
        let result = s.source.discard(offset, len);
        s.source_writes_done.fetch_add(1, SeqCst);
        let _ = s.core.write().write_source_done(plan.id, result.is_ok());
        result
    }
}

impl CacheVolume {
    /// Stops the background threads and, with persistence, writes every record and marks the
    /// device cleanly shut down. Returns true if the device was left clean (false without
    /// persistence, or after errors). Idempotent; dropping the volume calls it.
    pub fn shutdown(&self) -> bool {
        self.shared.shutdown.store(true, Relaxed);
        {
            let _g = self.shared.sleep_lock.lock();
            self.shared.wake.notify_all();
        }
        {
            let _g = self.shared.intent_pending.lock();
            self.shared.intent_wake.notify_all();
        }
        // Closing the channel lets the AWT writers finish what is queued, then exit.
        self.awt_tx.lock().take();
        let threads: Vec<_> = self.threads.lock().drain(..).collect();
        if threads.is_empty() {
            return false;
        }
        for t in threads {
            let _ = t.join();
        }
        let s = &self.shared;
        match &s.persist {
            Some(p) if !s.passthrough.load(Relaxed) => {
                self.quiesce();
                p.close(s, s.source.identity(), s.source_writes_done.load(SeqCst))
            }
            _ => false,
        }
    }
}

impl Drop for CacheVolume {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Makes the intents set ahead of need durable, in the background, as they come.
fn intent_writer(s: &Shared) {
    let Some(p) = &s.persist else { return };
    loop {
        {
            let mut pending = s.intent_pending.lock();
            while !*pending && !s.shutdown.load(Relaxed) {
                s.intent_wake.wait(&mut pending);
            }
            if s.shutdown.load(Relaxed) {
                return;
            }
            *pending = false;
        }
        if s.passthrough.load(Relaxed) {
            continue;
        }
        if let Err(e) = p.write_pending() {
            s.device_errors(1, &format!("intent write failed: {e}"));
        }
    }
}

fn flusher(s: &Shared) {
    let Some(p) = &s.persist else { return };
    loop {
        if !s.sleep(p.cfg.flush_interval) {
            return;
        }
        if s.passthrough.load(Relaxed) {
            continue;
        }
        let mut errors = p.round(s, false);
        // Record the source's identity once its writes have settled (our own writes change
        // a file's modification time), so that a start after a crash can tell whether anyone
        // else changed it since.
        let done = s.source_writes_done.load(SeqCst);
        if s.source_writes_started.load(SeqCst) == done {
            let identity = s.source.identity();
            if s.source_writes_started.load(SeqCst) == done
                && p.record_identity(identity, done).is_err()
            {
                errors += 1;
            }
        }
        if errors > 0 {
            s.device_errors(errors, "metadata write failed or read back wrong");
        }
    }
}
