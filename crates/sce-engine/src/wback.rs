//! Write-back in the engine (issue 15): a write lands in the cache only and is acknowledged
//! once its dirty entries are durable and its data written; the cleaner (`cleaner.rs`)
//! copies dirty pages to the source later.
//!
//! # A write-back write
//! 1. Takes its pages exclusively in the range lock (reads of them and other writes wait:
//!    a read must never see a page half rewritten in place, whose checksum would then
//!    look like device damage).
//! 2. Reads the edge pages it covers in part (through the cache: the newest bytes) and
//!    writes whole pages from then on, in chunks of at most [`CHUNK`] bytes.
//! 3. Per chunk and core shard: `begin_writeback` under the core lock; the dirty entries
//!    appended under the same lock (`Persist::guard_writeback`); the slots held. A full cache
//!    or I/O in flight on the pages waits for progress (cleaning, a round) and retries:
//!    backpressure, never an error.
//! 4. Waits until the entries are durable, then writes the data, then completes.
//!
//! Without FUA the data may still sit in the cache device's volatile cache; NBD FLUSH (and
//! FUA) flush the cache device (`CacheVolume::flush`).
//!
//! Lock order: the range lock is outermost (taken before any core lock, never while one is
//! held); `progress` is a leaf.

use crate::persist::{WbGuard, WbPage};
use crate::shared::{request_error, Shared};
use parking_lot::{Condvar, Mutex};
use sce_core::{CacheCore, RequestError, SourceOffset, WriteBackPlan, WriteBackRefusal, PAGE_SIZE};
use sce_io::{AlignedBuf, IoError, Op};
use sce_store::journal::PrevPage;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// What `wb_begin` came to.
enum Begun {
    Started(WriteBackPlan, WbGuard),
    /// I/O in flight on the pages.
    Busy,
    /// No clean slot.
    Full,
    /// No room in the journal ring.
    NoJournal,
}

/// Bytes of one write-back step (its entries must fit the journal ring at once).
pub(crate) const CHUNK: u64 = 256 << 10;

/// The engine's write-back state.
#[derive(Default)]
pub(crate) struct WbEngine {
    /// Byte ranges in use: (start, end, exclusive).
    ranges: Mutex<Vec<(u64, u64, bool)>>,
    ranges_cv: Condvar,
    /// Bumped on every completion that may let a waiting write go on.
    progress: Mutex<u64>,
    progress_cv: Condvar,
    /// `flush --to-source` calls waiting: the cleaner cleans everything meanwhile.
    pub(crate) forced: AtomicU64,
    /// Nanoseconds (engine clock) of the last client request: the cleaner cleans all when
    /// idle.
    pub(crate) last_request: AtomicU64,
    /// Writes that waited for cleaning or a round, and when one last did (engine clock).
    pub(crate) waits: AtomicU64,
    pub(crate) last_wait: AtomicU64,
    /// Cleaning: bytes written to the source, failed jobs, the last failure.
    pub(crate) bytes_cleaned: AtomicU64,
    pub(crate) clean_errors: AtomicU64,
    pub(crate) last_clean_error: Mutex<String>,
    /// The current source outage, for rate-limited logs.
    pub(crate) outage: crate::outage::OutageLog,
    /// Bumped by every `flush --to-source`: cuts the cleaners' backoff short.
    pub(crate) kicks: AtomicU64,
    /// How long a write waits for room before it fails.
    wait_limit: Duration,
    /// Time without requests after which the cleaner cleans everything.
    pub(crate) idle: Duration,
}

/// A held byte range; released when dropped.
pub(crate) struct RangeGuard<'a> {
    wb: &'a WbEngine,
    range: (u64, u64, bool),
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut r = self.wb.ranges.lock();
        if let Some(i) = r.iter().position(|x| *x == self.range) {
            r.swap_remove(i);
        }
        drop(r);
        self.wb.ranges_cv.notify_all();
    }
}

impl WbEngine {
    pub(crate) fn new(wait_limit: Duration, idle: Duration) -> Self {
        WbEngine {
            wait_limit,
            idle,
            ..WbEngine::default()
        }
    }

    /// Takes `[start, end)`, shared (reads) or exclusive (writes), waiting for conflicts.
    pub(crate) fn lock(&self, start: u64, end: u64, exclusive: bool) -> RangeGuard<'_> {
        let mut r = self.ranges.lock();
        while r
            .iter()
            .any(|&(s, e, x)| s < end && start < e && (x || exclusive))
        {
            self.ranges_cv.wait(&mut r);
        }
        r.push((start, end, exclusive));
        RangeGuard {
            wb: self,
            range: (start, end, exclusive),
        }
    }

    /// Something completed: waiting writes retry.
    pub(crate) fn progressed(&self) {
        *self.progress.lock() += 1;
        self.progress_cv.notify_all();
    }

    /// Waits for progress, at most `d`.
    fn wait_progress(&self, seen: u64, d: Duration) {
        let mut p = self.progress.lock();
        if *p == seen {
            self.progress_cv.wait_for(&mut p, d);
        }
    }

    fn progress_now(&self) -> u64 {
        *self.progress.lock()
    }
}

/// An I/O error for a range whose dirty data was lost.
pub(crate) fn lost_error(op: Op, offset: u64, len: u64) -> IoError {
    IoError::Io {
        op,
        offset,
        len,
        source: std::io::Error::other(
            "the only copy of dirty (write-back) data here was lost on the cache device",
        ),
    }
}

impl Shared {
    /// A write in write-back mode (`offset`, `data`: a range the caller checked).
    pub(crate) fn wb_write(&self, offset: u64, data: &[u8]) -> Result<(), IoError> {
        let wb = self.wb.as_ref().expect("write-back");
        wb.last_request.store(self.now().0, Relaxed);
        if self.passthrough.load(Relaxed) {
            return Err(IoError::Io {
                op: Op::Write,
                offset,
                len: data.len() as u64,
                source: std::io::Error::other(
                    "the cache device failed: write-back cannot take writes (see the log)",
                ),
            });
        }
        let ps = PAGE_SIZE;
        let end = offset + data.len() as u64;
        let a0 = offset / ps * ps;
        let a1 = (end.div_ceil(ps) * ps).min(self.source_size);
        // The wait limit counts from here, for the whole write, however many pieces.
        let started = std::time::Instant::now();
        let _g = wb.lock(a0, a1, true);
        let merged;
        let bytes: &[u8] = if a0 == offset && a1 == end {
            data
        } else {
            // Whole pages from here on: the edges as they read now (we hold them).
            let mut b = AlignedBuf::new((a1 - a0) as usize);
            if a0 < offset {
                let e = (a0 + ps).min(a1);
                self.read(a0, &mut b[..(e - a0) as usize])?;
            }
            let last = (end - 1) / ps * ps;
            if end < a1 && (last > a0 || a0 == offset) {
                self.read(last, &mut b[(last - a0) as usize..])?;
            }
            b[(offset - a0) as usize..(end - a0) as usize].copy_from_slice(data);
            merged = b;
            &merged
        };
        let mut at = a0;
        while at < a1 {
            let n = CHUNK.min(a1 - at);
            let piece = &bytes[(at - a0) as usize..(at - a0 + n) as usize];
            for p in self.map.pieces(at, n) {
                let buf = &piece[p.buf_offset as usize..(p.buf_offset + p.len) as usize];
                self.wb_piece(p.shard, (p.offset, p.local), buf, started)?;
            }
            at += n;
        }
        Ok(())
    }

    /// True if `[offset, offset + len)` holds a page only the cache has or had (dirty or
    /// lost): in passthrough, reads of it fail.
    pub(crate) fn unavailable_now(&self, offset: u64, len: u64) -> bool {
        self.wb_any(offset, len, CacheCore::dirty_or_lost_in)
    }

    /// True if `[offset, offset + len)` holds a page whose dirty data was lost.
    pub(crate) fn lost_now(&self, offset: u64, len: u64) -> bool {
        self.wb_any(offset, len, CacheCore::lost_in)
    }

    /// In write-back: true if `pages` holds for a piece of `[offset, offset + len)`, each
    /// asked of its core shard.
    fn wb_any(
        &self,
        offset: u64,
        len: u64,
        pages: fn(&CacheCore, SourceOffset, u64) -> bool,
    ) -> bool {
        self.wb.is_some()
            && self
                .map
                .pieces(offset, len)
                .any(|p| pages(&self.cores[p.shard].read(), SourceOffset(p.local), p.len))
    }

    /// Zeroes `[offset, offset + len)` in write-back mode (a discard: the dirty pages there
    /// must read as zeroes too, and the source is older).
    pub(crate) fn wb_zero(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let zeros = AlignedBuf::new(CHUNK.min(len) as usize);
        let mut at = offset;
        while at < offset + len {
            let n = CHUNK.min(offset + len - at);
            self.wb_write(at, &zeros[..n as usize])?;
            at += n;
        }
        Ok(())
    }

    /// One piece of a chunk, on core shard `k` (`at`: its global and local offsets; whole
    /// pages).
    fn wb_piece(
        &self,
        k: usize,
        at: (u64, u64),
        data: &[u8],
        started: std::time::Instant,
    ) -> Result<(), IoError> {
        let wb = self.wb.as_ref().expect("write-back");
        let persist = self.persist.as_ref().expect("write-back needs persistence");
        let len = data.len() as u64;
        let (plan, guard) = self.wb_start(k, at, data, started)?;
        let ok = if persist.sync(&guard.tickets).is_ok() {
            plan.copies.iter().all(|c| {
                let cache = self.map.cache_to_global(k, c.cache).0;
                let piece = &data[c.buf_offset as usize..(c.buf_offset + c.len) as usize];
                self.record_crcs(at.0 + c.buf_offset, cache, piece);
                self.cache_write(cache, piece)
            })
        } else {
            // The entries are not durable: nothing was written, the pages are as they were.
            let mut core = self.cores[k].write();
            let _ = core.abort_writeback(plan.id);
            drop(core);
            persist.writeback_done(guard.first);
            wb.progressed();
            return Err(IoError::Invalid(
                "the write-back journal could not be written to the cache device".into(),
            ));
        };
        let mut core = self.cores[k].write();
        let _ = core.complete_writeback(plan.id, ok);
        drop(core);
        persist.writeback_done(guard.first);
        wb.progressed();
        if ok {
            Ok(())
        } else {
            Err(lost_error(Op::Write, at.0, len))
        }
    }

    /// Starts a write-back write of `data` at `at` on core shard `k`, waiting for room or
    /// for I/O in flight on its pages (backpressure) up to the wait limit.
    fn wb_start(
        &self,
        k: usize,
        at: (u64, u64),
        data: &[u8],
        started: std::time::Instant,
    ) -> Result<(WriteBackPlan, WbGuard), IoError> {
        let wb = self.wb.as_ref().expect("write-back");
        let persist = self.persist.as_ref().expect("write-back needs persistence");
        let len = data.len() as u64;
        loop {
            let seen = wb.progress_now();
            let room = match self.wb_begin(k, at, data) {
                Ok(Begun::Started(plan, guard)) => return Ok((plan, guard)),
                Ok(Begun::Busy) => None,
                Ok(Begun::Full) => Some(true),
                Ok(Begun::NoJournal) => Some(false),
                Err(e) => {
                    return Err(request_error(
                        Op::Write,
                        e,
                        at.0,
                        len,
                        self.source_size,
                        self.lbs,
                    ))
                }
            };
            // I/O in flight on the pages: wait for it. No room in the journal: a round
            // frees it. A full cache: cleaning (and a round, which releases cleaned slots).
            wb.waits.fetch_add(1, Relaxed);
            if let Some(full) = room {
                if full {
                    wb.last_wait.store(self.now().0, Relaxed);
                }
                persist.want_round();
            }
            *self.intent_pending.lock() = true;
            self.intent_wake.notify_one();
            self.wake.notify_all();
            wb.wait_progress(seen, Duration::from_millis(20));
            if self.shutdown.load(Relaxed) || self.passthrough.load(Relaxed) {
                return Err(IoError::Invalid(
                    "the cache is shutting down or disabled".into(),
                ));
            }
            if started.elapsed() > wb.wait_limit {
                return Err(IoError::Io {
                    op: Op::Write,
                    offset: at.0,
                    len,
                    source: std::io::Error::other(format!(
                        "no room for write-back data after {:?}: the cache is full of dirty \
                         data the source is not taking, or metadata cannot be written",
                        wb.wait_limit
                    )),
                });
            }
        }
    }

    /// Under core shard `k`'s lock: starts the write-back write of `data` at `at` and
    /// appends its dirty entries, or says why it must wait (and retry).
    fn wb_begin(&self, k: usize, at: (u64, u64), data: &[u8]) -> Result<Begun, RequestError> {
        let persist = self.persist.as_ref().expect("write-back needs persistence");
        let mut core = self.cores[k].write();
        core.advance_clock(self.now());
        let plan = match core.begin_writeback(SourceOffset(at.1), data.len() as u64) {
            Ok(plan) => plan,
            Err(WriteBackRefusal::Request(e)) => return Err(e),
            Err(WriteBackRefusal::NotWriteBack) => {
                return Err(RequestError::Dirty {
                    offset: at.0,
                    len: data.len() as u64,
                })
            }
            Err(WriteBackRefusal::Busy | WriteBackRefusal::PartialPage) => return Ok(Begun::Busy),
            Err(WriteBackRefusal::Full) => return Ok(Begun::Full),
        };
        let crcs = self.crcs.as_ref().expect("checksums");
        let ps = PAGE_SIZE;
        let mut pages = Vec::new();
        let mut copies = Vec::new();
        for c in &plan.copies {
            let cache = self.map.cache_to_global(k, c.cache).0;
            let slot = (cache >> self.fshift) as u32;
            let src = at.0 + c.buf_offset;
            let frag = src >> self.fshift;
            copies.push((slot, frag));
            let mut q = 0;
            while q < c.len {
                let sp = src + q;
                let page = ((sp - (frag << self.fshift)) / ps) as u32;
                let n = ps.min(c.len - q);
                let bytes = &data[(c.buf_offset + q) as usize..(c.buf_offset + q + n) as usize];
                let local = SourceOffset(at.1 + c.buf_offset + q);
                let prev = if !core.is_cached(local) {
                    PrevPage::Invalid
                } else if core.page_dirty(local) {
                    PrevPage::Dirty(crcs.get(slot, page))
                } else {
                    PrevPage::Clean(crcs.get(slot, page))
                };
                pages.push(WbPage {
                    slot,
                    frag,
                    page,
                    crc: sce_store::page_checksum(bytes, self.seed(sp)),
                    len: n as u16,
                    prev,
                });
                q += n;
            }
        }
        let Some(guard) = persist.guard_writeback(&pages, copies.into_iter()) else {
            let _ = core.abort_writeback(plan.id);
            return Ok(Begun::NoJournal);
        };
        for &s in &guard.hold {
            let local = self.map.slot_to_local(sce_core::SlotNo(s)).1;
            core.hold_slot(local);
        }
        Ok(Begun::Started(plan, guard))
    }
}

impl Shared {
    /// A client's read: in write-back, its pages are taken shared in the range lock first.
    pub(crate) fn read_locked(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.read_hit_locked(offset, buf).map(|_| ())
    }

    /// `read_locked`, telling whether every byte came from the cache.
    pub(crate) fn read_hit_locked(&self, offset: u64, buf: &mut [u8]) -> Result<bool, IoError> {
        let Some(wb) = &self.wb else {
            return self.read_hit(offset, buf);
        };
        wb.last_request.store(self.now().0, Relaxed);
        let ps = PAGE_SIZE;
        let end = offset + buf.len() as u64;
        let _g = wb.lock(offset / ps * ps, end.div_ceil(ps) * ps, false);
        self.read_hit(offset, buf)
    }
}

/// Restores what the store loaded into the core shards: each record goes to the shard that
/// owns its (global) slot, and is dropped if its fragment belongs to another shard (the
/// shard count changed): `Persist::start` then puts an intent on the slot, so the record is
/// never trusted again. Dirty pages come back dirty, and lost ones (a dirty bit on an
/// invalid page) lost, both by `restore_dirty`. Returns the dirty pages
/// of records it could not restore (their data is on the device, but this start cannot
/// serve it: the caller refuses to start).
pub(crate) fn restore(
    cores: &mut [CacheCore],
    map: &sce_core::ShardMap,
    loaded: &sce_store::Loaded,
    words: usize,
) -> u64 {
    let mut skipped = 0;
    use sce_core::{FragNo, SlotNo};
    type Restored<'a> = (SlotNo, FragNo, &'a [u64]);
    let mut per: Vec<Vec<Restored>> = vec![Vec::new(); cores.len()];
    let mut dirty: Vec<Vec<(FragNo, &[u64])>> = vec![Vec::new(); cores.len()];
    for (i, &(s, f)) in loaded.entries.iter().enumerate() {
        let (k, local) = map.slot_to_local(SlotNo(s));
        let (kf, lf) = map.frag_to_local(FragNo(f));
        if k == kf && local.0 < map.slots(k) {
            per[k].push((local, lf, &loaded.bitmaps[i * words..(i + 1) * words]));
            let d = &loaded.dirty[i * words..(i + 1) * words];
            if d.iter().any(|&w| w != 0) {
                dirty[k].push((lf, d));
            }
        } else {
            let d = &loaded.dirty[i * words..(i + 1) * words];
            skipped += d.iter().map(|w| w.count_ones() as u64).sum::<u64>();
        }
    }
    for ((core, entries), dirty) in cores.iter_mut().zip(per).zip(dirty) {
        core.track_dirty();
        core.restore(entries);
        let ppf = core.geometry().pages_per_fragment();
        for (f, words) in dirty {
            let mut pages = sce_core::bitmap::PageSet::new(ppf);
            for p in 0..ppf {
                if words[p as usize / 64] >> (p % 64) & 1 == 1 {
                    pages.insert_range(p, p + 1);
                }
            }
            core.restore_dirty(f, &pages);
        }
    }
    skipped
}

/// Refuses to start a cache device holding dirty data in a mode other than writeback: the
/// source is older than the cache there.
pub(crate) fn check_dirty(
    cfg: &sce_core::CoreConfig,
    loaded: &sce_store::Loaded,
) -> Result<(), crate::EngineError> {
    let r = &loaded.report;
    if cfg.write_mode == sce_core::WriteMode::WriteBack
        || (r.pages_dirty == 0 && r.dirty_pages_lost == 0)
    {
        return Ok(());
    }
    Err(sce_core::ConfigError::new(
        "mode",
        format!(
            "the cache device holds {} dirty pages (write-back data not yet on the source){}: \
             start it with --mode writeback and run `sce ctl flush --to-source` before \
             changing the mode",
            r.pages_dirty,
            if r.dirty_pages_lost == 0 {
                String::new()
            } else {
                format!(" and {} lost ones", r.dirty_pages_lost)
            }
        ),
    )
    .into())
}

/// Holds the slots that came back with dirty pages (their records claim them).
pub(crate) fn hold_dirty(
    cores: &mut [CacheCore],
    map: &sce_core::ShardMap,
    persist: &crate::persist::Persist,
    loaded: &sce_store::Loaded,
) {
    let words = loaded.superblock.layout.bitmap_words();
    for (i, &(s, _)) in loaded.entries.iter().enumerate() {
        if loaded.dirty[i * words..(i + 1) * words]
            .iter()
            .any(|&w| w != 0)
        {
            let (k, local) = map.slot_to_local(sce_core::SlotNo(s));
            if local.0 < map.slots(k) && cores[k].hold_slot(local) {
                persist.restored_dirty(s);
            }
        }
    }
}
