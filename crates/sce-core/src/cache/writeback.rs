//! Write-back in the core (issue 15; FlashTier's dirty data and `clean`): the state machine
//! of writes that land in the cache only, of the cleaning that copies them to the source,
//! and of pages whose only copy was lost. Drivers (the engine, the simulator) drive it
//! through the guards of `wbguard.rs` ([`super::WriteBackTxn`], [`super::Cleaning`],
//! [`super::SlotHold`]); the property test `tests/writeback.rs` drives the raw calls.
//!
//! # Rules
//! * **A dirty page is the only copy of its data.** It is valid, it is never evicted (the
//!   victim search skips slots holding dirty pages, `evict_range` and `forget` keep dirty
//!   pages), and it is never filled from the source.
//! * **A write-back write** ([`CacheCore::begin_writeback`]) needs a slot for every fragment
//!   it touches (a free one, or a clean victim: else [`WriteBackRefusal::Full`], and the
//!   driver waits for cleaning), whole pages or pages the cache holds (else
//!   [`WriteBackRefusal::PartialPage`]: the driver reads the page first), and no population,
//!   write or cleaning in flight on its pages (else [`WriteBackRefusal::Busy`]: the driver
//!   waits for it). Its pages stay as they are while it is in flight: a dirty page keeps
//!   serving the last acknowledged data, not the source's older bytes. When the cache copy
//!   completes the pages are valid and dirty; when it fails they are invalid, and those
//!   that were dirty are **lost** (their older data is gone too).
//! * **Cleaning** ([`CacheCore::pick_clean`]) takes the dirty fragments in source order from
//!   a cursor (an elevator), one job per fragment: the driver reads the dirty pages from the
//!   cache, writes them to the source, and reports; a success makes them clean, a failure
//!   leaves them dirty. No write-back write starts on a fragment being cleaned.
//! * **A lost page** reads as an error ([`RequestError::Lost`]), never as the source's older
//!   bytes, until a successful write-back write covers it whole.
//! * Write-through writes ([`CacheCore::begin_write`]) refuse dirty pages and pages being
//!   cleaned: a mode switch out of write-back must clean first.

use super::plan::RequestError;
use super::{fragments, CacheCore};
use crate::addr::{CacheOffset, FragNo, SlotNo, SourceOffset, PAGE_SIZE};
use crate::bitmap::{self, PageSet};
use std::collections::BTreeMap;

/// Why a write-back write cannot start now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteBackRefusal {
    /// A bad range.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// Every slot holds dirty or pinned data: clean first.
    #[error("the cache is full of dirty data: waiting for cleaning")]
    Full,
    /// A page the write covers in part is not in the cache: read it first.
    #[error("a page written in part is not cached")]
    PartialPage,
    /// A population, write or cleaning is in flight on these pages: wait for it.
    #[error("other I/O is in flight on these pages")]
    Busy,
    /// The cache is not in writeback mode.
    #[error("the cache is not in writeback mode")]
    NotWriteBack,
}

/// A write-back write in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WriteBackId(pub(super) u64);

/// A cleaning job in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CleanId(pub(super) u64);

/// One cache write of a write-back write: the bytes `[buf_offset, buf_offset + len)` of the
/// request go to `cache`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteBackCopy {
    /// Offset within the request buffer.
    pub buf_offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Destination on the cache device.
    pub cache: CacheOffset,
}

/// The plan of a write-back write: write every copy to the cache device, then report
/// [`super::WriteBackTxn::complete`] (acknowledge the client after a success, once the
/// data and its record are durable as the flush rules require).
#[derive(Debug)]
pub struct WriteBackPlan {
    /// The write's id.
    pub id: WriteBackId,
    /// The cache writes, one per fragment.
    pub copies: Vec<WriteBackCopy>,
}

/// A cleaning job: read each run from the cache, write it to the source, then report
/// [`super::Cleaning::complete`].
#[derive(Debug, Clone)]
pub struct CleanJob {
    /// The job's id.
    pub id: CleanId,
    /// The fragment.
    pub frag: FragNo,
    /// Runs of dirty pages: (source offset, cache offset, length), in source order.
    pub runs: Vec<(SourceOffset, CacheOffset, u64)>,
}

#[derive(Debug)]
pub(super) struct WbPart {
    frag: FragNo,
    slot: SlotNo,
    lo: u32,
    hi: u32,
    /// The first (last) page is written in part.
    head_partial: bool,
    tail_partial: bool,
    /// Pages written in part whose other bytes a `forget` made stale (they were not dirty):
    /// lost when the write completes.
    spoiled: Vec<u32>,
}

/// The write-back state of a core.
#[derive(Debug, Default)]
pub(super) struct WriteBack {
    /// Dirty pages, by fragment (ordered: cleaning goes in source order).
    pub(super) dirty: BTreeMap<u64, PageSet>,
    /// Pages whose only copy was lost, by fragment.
    pub(super) lost: BTreeMap<u64, PageSet>,
    /// Write-back writes in flight.
    writes: crate::slab::Slab<Vec<WbPart>>,
    /// Cleaning in flight: fragment, slot, pages.
    cleans: crate::slab::Slab<(FragNo, SlotNo, PageSet)>,
    /// The next fragment the cleaner looks at.
    cursor: u64,
}

impl WriteBack {
    /// True if slot contents of fragment `f` include dirty pages.
    pub(super) fn is_dirty(&self, f: FragNo) -> bool {
        !self.dirty.is_empty() && self.dirty.contains_key(&f.0)
    }

    /// True if pages `[lo, hi)` of `f` include a dirty page.
    pub(super) fn any_dirty(&self, f: FragNo, lo: u32, hi: u32) -> bool {
        self.dirty
            .get(&f.0)
            .is_some_and(|d| bitmap::any_set(d.words(), lo, hi))
    }

    /// True if pages `[lo, hi)` of `f` include a lost page.
    pub(super) fn any_lost(&self, f: FragNo, lo: u32, hi: u32) -> bool {
        self.lost
            .get(&f.0)
            .is_some_and(|d| bitmap::any_set(d.words(), lo, hi))
    }

    /// True if pages `[lo, hi)` of `f` are being written back or cleaned.
    pub(super) fn busy(&self, f: FragNo, lo: u32, hi: u32) -> bool {
        self.writes
            .iter()
            .flat_map(|(_, parts)| parts.iter())
            .any(|p| p.frag == f && p.lo < hi && lo < p.hi)
            || self
                .cleans
                .iter()
                .any(|(_, c)| c.0 == f && bitmap::any_set(c.2.words(), lo, hi))
    }

    /// True if nothing is dirty or lost and no write-back write or cleaning is in flight.
    pub(super) fn is_clean(&self) -> bool {
        self.dirty.is_empty()
            && self.lost.is_empty()
            && self.writes.len() == 0
            && self.cleans.len() == 0
    }

    /// `forget`: write-back writes in flight that write a page in part that is not dirty
    /// (its other bytes are the source's, which changed) lose that page when they complete.
    pub(super) fn spoil_partial(&mut self) {
        let dirty = &self.dirty;
        let is_dirty = |f: FragNo, q: u32| dirty.get(&f.0).is_some_and(|d| d.contains(q));
        for (_, parts) in self.writes.iter_mut() {
            for p in parts.iter_mut() {
                if p.head_partial && !is_dirty(p.frag, p.lo) {
                    p.spoiled.push(p.lo);
                }
                if p.tail_partial && !is_dirty(p.frag, p.hi - 1) && !p.spoiled.contains(&(p.hi - 1))
                {
                    p.spoiled.push(p.hi - 1);
                }
            }
        }
    }

    /// A write-through write made whole pages `[lo, hi)` of `f` new on the source: they are
    /// no longer lost.
    pub(super) fn found(&mut self, f: FragNo, lo: u32, hi: u32) {
        remove(&mut self.lost, f, lo, hi);
    }

    /// The dirty pages of `f`, if any.
    pub(super) fn dirty_of(&self, f: FragNo) -> Option<&PageSet> {
        self.dirty.get(&f.0)
    }
}

fn add(map: &mut BTreeMap<u64, PageSet>, f: FragNo, lo: u32, hi: u32, pages: u32) {
    map.entry(f.0)
        .or_insert_with(|| PageSet::new(pages))
        .insert_range(lo, hi);
}

fn remove(map: &mut BTreeMap<u64, PageSet>, f: FragNo, lo: u32, hi: u32) {
    if let Some(s) = map.get_mut(&f.0) {
        s.remove_range(lo, hi);
        if s.is_empty() {
            map.remove(&f.0);
        }
    }
}

impl CacheCore {
    /// Starts a write-back write of `len` bytes at `offset` (see the module's rules).
    ///
    /// Raw: the property tests only; drivers use [`super::WriteBackTxn`].
    #[doc(hidden)]
    pub fn begin_writeback(
        &mut self,
        offset: SourceOffset,
        len: u64,
    ) -> Result<WriteBackPlan, WriteBackRefusal> {
        self.check(offset.0, len)?;
        if self.cfg.write_mode != crate::config::WriteMode::WriteBack {
            return Err(WriteBackRefusal::NotWriteBack);
        }
        let parts: Vec<_> = fragments(self.geo, offset.0, len).collect();
        self.writeback_check(&parts)?;
        // The slots the write finds are pinned first, so that allocating the others cannot
        // take one of them as a victim (whose pages the checks above relied on).
        let mut held: Vec<Option<SlotNo>> = Vec::with_capacity(parts.len());
        for &(f, ..) in &parts {
            let s = self.map.get(f).filter(|&s| self.slots.pin(s));
            held.push(s);
        }
        let mut planned: Vec<(FragNo, SlotNo, u32, u32, u64, u64)> = Vec::new();
        for (k, &(f, lo, hi, a, b)) in parts.iter().enumerate() {
            let s = match held[k] {
                Some(s) => Some(s),
                None => self.allocate(f).filter(|&s| self.slots.pin(s)),
            };
            match s {
                Some(s) => planned.push((f, s, lo, hi, a, b)),
                None => {
                    for p in &planned {
                        self.slots.unpin(p.1);
                    }
                    for s in held[k..].iter().flatten() {
                        self.slots.unpin(*s);
                    }
                    return Err(WriteBackRefusal::Full);
                }
            }
        }
        let mut copies = Vec::with_capacity(planned.len());
        let mut wparts = Vec::with_capacity(planned.len());
        for (f, s, lo, hi, a, b) in planned {
            let fstart = self.geo.fragment_start(f).0;
            copies.push(WriteBackCopy {
                buf_offset: a - offset.0,
                len: b - a,
                cache: CacheOffset(self.geo.slot_offset(s).0 + (a - fstart)),
            });
            let head_partial = a > fstart + lo as u64 * PAGE_SIZE;
            let tail_partial = b < self.page_end(f, hi - 1);
            wparts.push(WbPart {
                frag: f,
                slot: s,
                lo,
                hi,
                head_partial,
                tail_partial,
                spoiled: Vec::new(),
            });
            self.evict.accessed(s);
        }
        self.stats.write_requests += 1;
        self.stats.writeback_writes += 1;
        let id = WriteBackId(self.wb.writes.insert(wparts));
        Ok(WriteBackPlan { id, copies })
    }

    /// Why a write-back write over `parts` (fragment, pages, bytes) cannot start now, if so.
    fn writeback_check(
        &self,
        parts: &[(FragNo, u32, u32, u64, u64)],
    ) -> Result<(), WriteBackRefusal> {
        for &(f, lo, hi, a, b) in parts {
            let slot = self.map.get(f);
            let valid = |p: u32| slot.is_some_and(|s| self.slots.is_valid(s, p));
            let fstart = self.geo.fragment_start(f).0;
            let head_partial = a > fstart + lo as u64 * PAGE_SIZE;
            let tail_partial = b < self.page_end(f, hi - 1);
            if (head_partial && !valid(lo)) || (tail_partial && !valid(hi - 1)) {
                return Err(WriteBackRefusal::PartialPage);
            }
            if self.wb.busy(f, lo, hi) || self.population_overlaps(f, lo, hi) {
                return Err(WriteBackRefusal::Busy);
            }
            if self
                .activity
                .get(&f.0)
                .is_some_and(|act| !act.writes.is_empty())
            {
                return Err(WriteBackRefusal::Busy);
            }
        }
        Ok(())
    }

    /// True if a population in flight on `f` fills one of pages `[lo, hi)`.
    fn population_overlaps(&self, f: FragNo, lo: u32, hi: u32) -> bool {
        let pop = self.activity.get(&f.0).and_then(|a| a.pop);
        pop.and_then(|p| self.pops.get(p.0))
            .is_some_and(|p| bitmap::any_set(p.fill.words(), lo, hi))
    }

    /// Reports a write-back write's cache copies: all done (`ok`), or one failed.
    ///
    /// Raw: the property tests only; drivers use [`super::WriteBackTxn`].
    #[doc(hidden)]
    pub fn complete_writeback(&mut self, id: WriteBackId, ok: bool) -> Result<(), RequestError> {
        let parts = self.wb.writes.remove(id.0).ok_or(RequestError::UnknownId)?;
        let ppf = self.geo.pages_per_fragment();
        for p in parts {
            if ok {
                self.slots.touch(p.slot);
                bitmap::set_range(self.slots.bitmap_mut(p.slot), p.lo, p.hi);
                add(&mut self.wb.dirty, p.frag, p.lo, p.hi, ppf);
                remove(&mut self.wb.lost, p.frag, p.lo, p.hi);
                for &q in &p.spoiled {
                    // Its other bytes were the source's of before a `forget`.
                    bitmap::clear_range(self.slots.bitmap_mut(p.slot), q, q + 1);
                    self.lose_dirty(p.frag, q, q + 1);
                }
            } else {
                bitmap::clear_range(self.slots.bitmap_mut(p.slot), p.lo, p.hi);
                self.lose_dirty(p.frag, p.lo, p.hi);
                self.stats.writeback_failures += 1;
            }
            self.slots.unpin(p.slot);
        }
        Ok(())
    }

    /// Gives up a write-back write before any of its data was written (the driver could
    /// not make its records durable): its pages stay exactly as they were.
    ///
    /// Raw: the property tests only; drivers use [`super::WriteBackTxn`].
    #[doc(hidden)]
    pub fn abort_writeback(&mut self, id: WriteBackId) -> Result<(), RequestError> {
        let parts = self.wb.writes.remove(id.0).ok_or(RequestError::UnknownId)?;
        for p in parts {
            self.slots.unpin(p.slot);
        }
        self.stats.writeback_writes -= 1;
        Ok(())
    }

    /// The next cleaning job, in source order from the cleaner's cursor: a dirty fragment
    /// with nothing in flight on it. None if there is none now.
    ///
    /// Raw: the property tests only; drivers use [`super::Cleaning`].
    #[doc(hidden)]
    pub fn pick_clean(&mut self) -> Option<CleanJob> {
        let job = self.pick_in(self.wb.cursor, u64::MAX, true)?;
        self.wb.cursor = job.frag.0 + 1;
        Some(job)
    }

    /// The next cleaning job among the dirty fragments that overlap `[offset, offset+len)`
    /// (`sce ctl clean RANGE`, a detach draining its export), in source order.
    ///
    /// Raw: the property tests only; drivers use [`super::Cleaning`].
    #[doc(hidden)]
    pub fn pick_clean_in(&mut self, offset: SourceOffset, len: u64) -> Option<CleanJob> {
        let (first, end) = self.frag_span(offset, len);
        self.pick_in(first, end, false)
    }

    /// The fragments `[first, end)` that `[offset, offset + len)` touches.
    fn frag_span(&self, offset: SourceOffset, len: u64) -> (u64, u64) {
        let shift = self.geo.fragment_shift();
        (offset.0 >> shift, (offset.0 + len).div_ceil(1 << shift))
    }

    /// The first dirty fragment in `[first, end)` (then, with `wrap`, before `first`) with
    /// nothing in flight on it, as a cleaning job.
    fn pick_in(&mut self, first: u64, end: u64, wrap: bool) -> Option<CleanJob> {
        let ppf = self.geo.pages_per_fragment();
        let before = if wrap { ..first } else { ..0 };
        let f = self
            .wb
            .dirty
            .range(first..end)
            .chain(self.wb.dirty.range(before))
            .map(|(&f, _)| FragNo(f))
            .find(|&f| {
                let writing = self
                    .activity
                    .get(&f.0)
                    .is_some_and(|a| !a.writes.is_empty());
                !writing && !self.wb.busy(f, 0, ppf)
            })?;
        let s = self.map.get(f).expect("dirty fragments are cached");
        if !self.slots.pin(s) {
            return None;
        }
        let pages = self.wb.dirty[&f.0].clone();
        let fstart = self.geo.fragment_start(f).0;
        let base = self.geo.slot_offset(s).0;
        let runs = pages
            .runs(ppf)
            .map(|(lo, hi)| {
                let a = fstart + lo as u64 * PAGE_SIZE;
                let b = self.page_end(f, hi - 1);
                (
                    SourceOffset(a),
                    CacheOffset(base + lo as u64 * PAGE_SIZE),
                    b - a,
                )
            })
            .collect();
        let id = CleanId(self.wb.cleans.insert((f, s, pages)));
        Some(CleanJob { id, frag: f, runs })
    }

    /// Dirty pages in `[offset, offset + len)`.
    pub fn dirty_in(&self, offset: SourceOffset, len: u64) -> u64 {
        let (first, end) = self.frag_span(offset, len);
        self.wb
            .dirty
            .range(first..end)
            .map(|(_, d)| d.len() as u64)
            .sum()
    }

    /// After a restart: pages `[lo, hi)` of fragment `f`, restored valid into its slot, are
    /// dirty (their records said so). False if `f` is not cached.
    pub fn restore_dirty(&mut self, f: FragNo, pages: &PageSet) -> bool {
        let ppf = self.geo.pages_per_fragment();
        let slot = self.map.get(f);
        for (lo, hi) in pages.runs(ppf) {
            for q in lo..hi {
                if slot.is_some_and(|s| self.slots.is_valid(s, q)) {
                    add(&mut self.wb.dirty, f, q, q + 1, ppf);
                } else {
                    // Recorded dirty but not restored (a bad checksum, a dropped record):
                    // its only copy is gone.
                    self.lose_page(f, q);
                }
            }
        }
        slot.is_some()
    }

    /// Reports a cleaning job: its pages are on the source (`ok`: now clean), or not (they
    /// stay dirty).
    ///
    /// Raw: the property tests only; drivers use [`super::Cleaning`].
    #[doc(hidden)]
    pub fn complete_clean(&mut self, id: CleanId, ok: bool) -> Result<(), RequestError> {
        let (f, s, pages) = self.wb.cleans.remove(id.0).ok_or(RequestError::UnknownId)?;
        if ok {
            // Pages the cleaner found damaged were lost meanwhile (`invalidate`), not cleaned.
            let mut n = 0;
            if let Some(d) = self.wb.dirty.get_mut(&f.0) {
                for (lo, hi) in pages.runs(self.geo.pages_per_fragment()) {
                    n += (lo..hi).filter(|&q| d.contains(q)).count() as u64;
                    d.remove_range(lo, hi);
                }
                if d.is_empty() {
                    self.wb.dirty.remove(&f.0);
                }
            }
            self.stats.pages_cleaned += n;
            // Its record must say so.
            self.slots.touch(s);
        } else {
            self.stats.clean_failures += 1;
        }
        self.slots.unpin(s);
        Ok(())
    }

    /// Before a read of `[offset, offset + len)`: an error if it holds lost pages; true if
    /// it holds dirty ones.
    pub(super) fn wb_check_read(&self, offset: u64, len: u64) -> Result<bool, RequestError> {
        if self.wb.dirty.is_empty() && self.wb.lost.is_empty() {
            return Ok(false);
        }
        let mut dirty = false;
        for (f, lo, hi, _, _) in fragments(self.geo, offset, len) {
            if self.wb.any_lost(f, lo, hi) {
                return Err(RequestError::Lost { offset, len });
            }
            dirty |= self.wb.any_dirty(f, lo, hi);
        }
        Ok(dirty)
    }

    /// Before a write-through write of `[offset, offset + len)`: an error if it touches
    /// dirty pages or pages being cleaned (their data is not on the source yet).
    pub(super) fn wb_check_write(&self, offset: u64, len: u64) -> Result<(), RequestError> {
        if self.wb.is_clean() {
            return Ok(());
        }
        for (f, lo, hi, _, _) in fragments(self.geo, offset, len) {
            if self.wb.any_dirty(f, lo, hi) || self.wb.busy(f, lo, hi) {
                return Err(RequestError::Dirty { offset, len });
            }
        }
        Ok(())
    }

    /// True if the page holding source byte `at` is dirty.
    pub fn page_dirty(&self, at: SourceOffset) -> bool {
        let f = FragNo(at.0 >> self.geo.fragment_shift());
        let p = ((at.0 - self.geo.fragment_start(f).0) / PAGE_SIZE) as u32;
        self.wb.any_dirty(f, p, p + 1)
    }

    /// Dirty pages now.
    pub fn dirty_pages(&self) -> u64 {
        self.wb.dirty.values().map(|d| d.len() as u64).sum()
    }

    /// Pages whose only copy was lost, now.
    pub fn lost_pages(&self) -> u64 {
        self.wb.lost.values().map(|d| d.len() as u64).sum()
    }

    /// A cached page of `f` went bad (`[lo, hi)`): those that were dirty are lost.
    pub(super) fn lose_dirty(&mut self, f: FragNo, lo: u32, hi: u32) {
        let gone: Vec<u32> = match self.wb.dirty.get(&f.0) {
            Some(d) => (lo..hi).filter(|&q| d.contains(q)).collect(),
            None => return,
        };
        for q in gone {
            self.lose_page(f, q);
        }
        remove(&mut self.wb.dirty, f, lo, hi);
    }

    /// Page `q` of `f` had the only copy of its data, and it is gone.
    pub(super) fn lose_page(&mut self, f: FragNo, q: u32) {
        add(
            &mut self.wb.lost,
            f,
            q,
            q + 1,
            self.geo.pages_per_fragment(),
        );
        self.stats.pages_lost += 1;
    }
}
