//! The page area's part of the core (issue 47): the fill grain chosen per line from what its
//! pages do.
//!
//! A read miss in a line that has no slot fills the missed pages into the page area
//! ([`crate::pagearea`]), one 4 KiB page each, from the read's own data (no source I/O), if
//! the page wins its set's duel: an empty way, or a page hotter than CLOCK's victim in the
//! page frequency sketch (TinyLFU, page against page). A line whose pages keep being
//! admitted one at a time is *dense*: after `dense_line_percent` admissions within the
//! sketch's horizon it graduates, and its misses fill the line (and population may fill
//! the rest of it) as before; its pages leave the page area when the line gets its slot.
//! So a fragment with a few hot pages costs a few pages of flash writes and of cache space,
//! and a fragment whose pages are all used costs a line and one entry.
//!
//! The area takes its slots from the free space while there is some; once the cache is
//! full, a slot goes to whichever side earned more read hits per slot over the last epoch
//! (a quarter of the cache's pages read): the area grows by evicting a line, or gives its
//! last slot back to a line that needs one.

use super::plan::{FillRun, PopId, PopulationJob, ReadPlan, RunTarget};
use super::population::PopState;
use super::CacheCore;
use crate::addr::{CacheOffset, FragNo, SlotNo, SourceOffset, PAGE_SHIFT, PAGE_SIZE};
use crate::admit::LazySketch;
use crate::bitmap::PageSet;
use crate::pagearea::{Dropped, PageArea, WayAt};

mod split;

/// The page area and what decides for it.
#[derive(Debug)]
pub(super) struct Sparse {
    pub(super) area: PageArea,
    /// Pages of a line admitted one at a time that make it dense.
    dense_pages: u32,
    /// Reads of pages of lines without a slot (the page duel).
    pages: LazySketch,
    /// Pages of each line admitted to the area (graduation), over a horizon of 2.5
    /// admissions per slot (the sketch halves after 10 per item): a line graduates on a
    /// burst of admissions, not on the pages a random load spreads over it in time (a
    /// horizon of 10 per slot graduated most lines of a scattered Zipf load with 8 KiB
    /// reads, 1.7x flashcache-like's cache writes for 0.007 more read hits).
    admitted: LazySketch,
    /// Read pages hit in the area and in lines this epoch, pages missed in dense lines
    /// without a slot, and pages read.
    area_hits: u64,
    line_hits: u64,
    dense_missed: u64,
    epoch_pages: u64,
    /// The last epoch's verdict: slots the area may still take from lines, or should give
    /// back to them, this epoch.
    grow_ok: u32,
    yield_ok: u32,
    /// Pages of sparse lines that reads covered in part, for population.
    pending: std::collections::VecDeque<(FragNo, PageSet)>,
}

impl Sparse {
    pub(super) fn new(pages_per_line: u32, slots: u32, percent: u32) -> Sparse {
        let cache_pages = slots as usize * pages_per_line as usize;
        Sparse {
            dense_pages: (pages_per_line * percent).div_ceil(100).clamp(1, 255),
            area: PageArea::new(pages_per_line),
            pages: LazySketch::new((cache_pages / 2).max(1024)),
            admitted: LazySketch::new((slots as usize / 4).max(256)),
            area_hits: 0,
            line_hits: 0,
            dense_missed: 0,
            epoch_pages: 0,
            grow_ok: Self::step(slots),
            yield_ok: 0,
            pending: std::collections::VecDeque::new(),
        }
    }

    /// Queued partial pages at most.
    const PENDING: usize = 1024;

    /// Bytes of memory: the area and both sketches.
    pub(super) fn memory_bytes(&self) -> usize {
        self.area.memory_bytes() + self.pages.memory_bytes() + self.admitted.memory_bytes()
    }
}

impl CacheCore {
    /// The source page number of page `p` of line `f`.
    #[inline]
    pub(super) fn page_no(&self, f: FragNo, p: u32) -> u64 {
        (self.geo.fragment_start(f).0 >> PAGE_SHIFT) + p as u64
    }

    /// Where way `at` of the page area lies on the cache device.
    #[inline]
    pub(super) fn way_offset(&self, at: WayAt) -> u64 {
        self.geo.slot_offset(at.slot).0 + at.page as u64 * PAGE_SIZE
    }

    /// True if the page area holds or may hold pages.
    #[inline]
    pub(super) fn area_used(&self) -> bool {
        self.sparse.as_ref().is_some_and(|s| s.area.capacity() > 0)
    }

    /// Packed slots and valid pages of the page area (0, 0 without one).
    pub fn page_area(&self) -> (u32, u64) {
        self.sparse.as_ref().map_or((0, 0), |s| {
            (s.area.slots().len() as u32, s.area.valid_pages())
        })
    }

    /// Bytes of memory of the page area and its sketches.
    pub fn page_area_memory(&self) -> usize {
        self.sparse.as_ref().map_or(0, |s| s.memory_bytes())
    }

    /// Packs every free slot into the page area and allocates its sketches, as a load of
    /// sparse reads over the whole cache would: `sce footprint`'s worst case. Returns the
    /// pages the area can then hold.
    pub fn pack_free_slots(&mut self) -> u64 {
        let Some(sp) = self.sparse.as_mut() else {
            return 0;
        };
        while let Some(s) = self.slots.take_free() {
            sp.area.grow(s);
        }
        sp.pages.add(0);
        sp.admitted.add(0);
        sp.area.capacity()
    }

    /// True if line `f` is dense: its pages were admitted one at a time often enough (or
    /// there is no page area in use, and every line is).
    pub(super) fn dense(&self, f: FragNo) -> bool {
        match &self.sparse {
            Some(s) if !self.shares.capped() => s.admitted.estimate(f.0) >= s.dense_pages,
            _ => true,
        }
    }

    /// Plans pages `[lo, hi)` (bytes `[a, b)`) of line `f`, which has no slot, from the page
    /// area: hits pin their packed slot; misses of a dense line count as `dense_missed`.
    /// Returns the missed pages the read covers whole, and those it covers in part.
    pub(super) fn plan_sparse(
        &self,
        f: FragNo,
        (lo, hi): (u32, u32),
        (a, b): (u64, u64),
        plan: &mut ReadPlan,
    ) -> (PageSet, PageSet) {
        let area = &self.sparse.as_ref().expect("area in use").area;
        let fstart = self.geo.fragment_start(f).0;
        let caching = self.cfg.write_mode.caches_reads();
        let mut missed = PageSet::new(self.geo.pages_per_fragment());
        let mut partial = PageSet::new(self.geo.pages_per_fragment());
        let (mut last_pin, mut missed_n) = (None, 0);
        for p in lo..hi {
            let ra = a.max(fstart + p as u64 * PAGE_SIZE);
            let rb = b.min(self.page_end(f, p));
            let buf_offset = ra - plan.offset;
            let at = if caching {
                area.lookup(self.page_no(f, p))
            } else {
                None
            };
            let pinned = at.filter(|w| last_pin == Some(w.slot) || self.slots.pin(w.slot));
            if let Some(w) = pinned {
                if last_pin != Some(w.slot) {
                    plan.pins.push(w.slot);
                    last_pin = Some(w.slot);
                }
                let cache = self.way_offset(w) + (ra - (fstart + p as u64 * PAGE_SIZE));
                plan.push(buf_offset, rb - ra, RunTarget::Cache(CacheOffset(cache)));
                plan.hit_pages += 1;
                plan.area_hits += 1;
            } else {
                plan.push(buf_offset, rb - ra, RunTarget::Source(SourceOffset(ra)));
                missed_n += 1;
                plan.full_hit = false;
                if ra == fstart + p as u64 * PAGE_SIZE && rb == self.page_end(f, p) {
                    missed.insert_range(p, p + 1);
                } else {
                    partial.insert_range(p, p + 1);
                }
            }
        }
        plan.missed_pages += missed_n;
        // A scan's misses are no line's demand.
        if missed_n > 0 && !plan.verdict.sequential && self.dense(f) {
            plan.dense_missed += missed_n;
        }
        (missed, partial)
    }

    /// The pages of `[lo, hi)` of line `f` that bytes `[a, b)` cover only in part.
    pub(super) fn partial_pages(
        &self,
        f: FragNo,
        (lo, hi): (u32, u32),
        (a, b): (u64, u64),
    ) -> PageSet {
        let fstart = self.geo.fragment_start(f).0;
        let mut set = PageSet::new(self.geo.pages_per_fragment());
        for p in [lo, hi - 1] {
            if a > fstart + p as u64 * PAGE_SIZE || b < self.page_end(f, p) {
                set.insert_range(p, p + 1);
            }
        }
        set
    }

    /// Queues pages of sparse line `f` that a read covered in part, for population to fill
    /// into the page area (a miss fill has only part of their bytes). Bounded: the oldest
    /// requests go first.
    pub(super) fn queue_sparse(&mut self, f: FragNo, set: PageSet) {
        if self.map.get(f).is_some() || self.dense(f) {
            return;
        }
        let sp = self.sparse.as_mut().expect("area");
        // Pages a read wants but cannot fill itself are admissions in all but the copy:
        // evidence of a dense line as much as pages filled one at a time.
        for _ in 0..set.len() {
            sp.admitted.add(f.0);
        }
        if sp.pending.len() >= Sparse::PENDING {
            sp.pending.pop_front();
        }
        sp.pending.push_back((f, set));
    }

    /// Population of the page area: the oldest queued pages of a sparse line that win their
    /// duel, as one job (a span of the source, each page written to its way).
    pub(super) fn pick_sparse(&mut self) -> Option<PopulationJob> {
        if !self.endurance_allows(PAGE_SIZE) {
            return None;
        }
        loop {
            let (f, set) = self.sparse.as_mut()?.pending.pop_front()?;
            if self.map.get(f).is_some() || self.dense(f) {
                continue;
            }
            let Some(fill) = self.fillable(f, Some(&set)) else {
                continue;
            };
            let Some((ways, filled)) = self.claim_pages(f, &fill) else {
                continue;
            };
            let bytes = ways.len() as u64 * PAGE_SIZE;
            self.endure(bytes);
            self.budget.take(bytes);
            return Some(self.sparse_job(f, filled, ways));
        }
    }

    /// Registers a page-area population of `ways` (pages `filled` of line `f`) and its job.
    fn sparse_job(&mut self, f: FragNo, filled: PageSet, ways: Vec<(u32, u32)>) -> PopulationJob {
        let fstart = self.geo.fragment_start(f).0;
        let lo = ways.iter().map(|w| w.0).min().expect("a page");
        let hi = ways.iter().map(|w| w.0).max().expect("a page");
        let source = fstart + lo as u64 * PAGE_SIZE;
        let area = &self.sparse.as_ref().expect("area").area;
        let runs: Vec<(u64, u64, CacheOffset)> = ways
            .iter()
            .map(|&(p, w)| {
                let at = area.at(w as usize);
                let sa = fstart + p as u64 * PAGE_SIZE;
                (
                    sa - source,
                    self.page_end(f, p) - sa,
                    CacheOffset(self.way_offset(at)),
                )
            })
            .collect();
        let slot = area.at(ways[0].1 as usize).slot;
        let id = self.register_sparse(f, filled, ways);
        PopulationJob {
            id,
            frag: f,
            slot,
            source: SourceOffset(source),
            len: self.page_end(f, hi) - source,
            runs,
        }
    }

    /// Starts a fill of each page of `fill` (of line `f`) not in the area yet that wins its
    /// set's duel, each way taken at once (the next page of the line may hash to the same
    /// set): the pages and their ways, and the pages as a set. None if no page got a way.
    fn claim_pages(&mut self, f: FragNo, fill: &PageSet) -> Option<(Vec<(u32, u32)>, PageSet)> {
        let mut ways = Vec::new();
        let mut filled = PageSet::new(self.geo.pages_per_fragment());
        for p in fill.iter() {
            let page = self.page_no(f, p);
            if self.sparse.as_ref()?.area.find(page).is_some() {
                continue;
            }
            if let Some(w) = self.admit_page(page) {
                self.sparse.as_mut()?.area.start_fill(w, page);
                ways.push((p, w as u32));
                filled.insert_range(p, p + 1);
            }
        }
        (!ways.is_empty()).then_some((ways, filled))
    }

    /// Registers the page-area population of `ways` (pages `filled` of line `f`), in
    /// flight on `f` until `complete_population`.
    fn register_sparse(&mut self, f: FragNo, filled: PageSet, ways: Vec<(u32, u32)>) -> PopId {
        let id = PopId(self.pops.insert(PopState {
            frag: f,
            slot: SlotNo(u32::MAX),
            fill: filled,
            spoiled: PageSet::new(self.geo.pages_per_fragment()),
            fresh_slot: false,
            ways,
        }));
        self.activity.entry(f.0).or_default().pop = Some(id);
        id
    }

    /// Whether a read may fill the page area with its misses: admission `sce`, a mode that
    /// caches reads, a request shorter than a line and not part of a stream, and no volume
    /// of the device with a cap on its share (the page area's slots are no volume's, so a
    /// capped volume could outgrow its share through them: such devices keep lines only).
    pub(super) fn wants_sparse_fills(
        &self,
        verdict: crate::admit::StreamVerdict,
        len: u64,
    ) -> bool {
        self.sparse.is_some()
            && !self.shares.capped()
            && self.cfg.admission == crate::config::Admission::Sce
            && self.cfg.write_mode.caches_reads()
            && !verdict.sequential
            && len < self.geo.fragment_size()
    }

    /// Under the exclusive lock: fills the pages `set` of line `f` (no slot, not dense) that
    /// win their set's duel into the page area, as one population; its fill runs go into
    /// `plan`. The read's own accounting was applied already.
    pub(super) fn fill_sparse(&mut self, f: FragNo, set: &PageSet, plan: &mut ReadPlan) {
        if self.map.get(f).is_some() {
            return;
        }
        let Some(fill) = self.fillable(f, Some(set)) else {
            return;
        };
        if !self.endurance_allows(fill.len() as u64 * PAGE_SIZE) {
            self.stats.endurance_refusals += 1;
            return;
        }
        let Some((ways, filled)) = self.claim_pages(f, &fill) else {
            return;
        };
        self.endure(ways.len() as u64 * PAGE_SIZE);
        let fstart = self.geo.fragment_start(f).0;
        let pop = self.register_sparse(f, filled, ways.clone());
        self.stats.miss_fills += 1;
        let area = &self.sparse.as_ref().expect("area").area;
        for &(p, w) in &ways {
            let at = area.at(w as usize);
            let sa = fstart + p as u64 * PAGE_SIZE;
            plan.fills.push(FillRun {
                pop,
                buf_offset: sa - plan.offset,
                len: self.page_end(f, p) - sa,
                cache: CacheOffset(self.way_offset(at)),
            });
        }
        plan.pops.push(pop);
    }

    /// The way `page` is admitted to, if it is: an empty way of its set, or the victim's if
    /// `page` is hotter in the page sketch; the area grows first if its set is full, the
    /// area nearly so, and the epoch's verdict (or free space) allows.
    fn admit_page(&mut self, page: u64) -> Option<usize> {
        self.maybe_grow_area(page);
        let slots = &self.slots;
        let sp = self.sparse.as_mut().expect("area");
        let (w, victim) = sp.area.victim(page, |s| slots.pins(s) > 0)?;
        if let Some(v) = victim {
            if sp.pages.estimate(page) <= sp.pages.estimate(v) {
                self.stats.admissions_rejected += 1;
                return None;
            }
        }
        sp.admitted
            .add(page >> (self.geo.fragment_shift() - PAGE_SHIFT));
        Some(w)
    }

    /// Completes a page-area fill (`st.ways`): each way not spoiled becomes valid if `ok`.
    pub(super) fn complete_sparse(&mut self, st: &PopState, ok: bool) {
        let fpage = self.page_no(st.frag, 0);
        let sp = self.sparse.as_mut().expect("area");
        let mut n = 0;
        for &(p, w) in &st.ways {
            let good = ok && !st.spoiled.contains(p);
            n += sp.area.complete_fill(w as usize, fpage + p as u64, good) as u64;
        }
        self.stats.sparse_pages_filled += n;
    }

    /// Drops pages `[lo, hi)` of line `f` from the area (a write, a bad copy, an eviction
    /// by range); returns the valid pages dropped.
    pub(super) fn drop_sparse(&mut self, f: FragNo, lo: u32, hi: u32) -> u64 {
        if !self.area_used() {
            return 0;
        }
        let base = self.page_no(f, 0);
        let slots = &self.slots;
        let sp = self.sparse.as_mut().expect("area");
        let mut n = 0;
        for p in lo..hi {
            n += (sp.area.drop_page(base + p as u64, |s| slots.pins(s) > 0) == Dropped::Valid)
                as u64;
        }
        n
    }

    /// Valid pages of `[lo, hi)` of line `f` in the area.
    pub(super) fn count_sparse(&self, f: FragNo, lo: u32, hi: u32) -> u32 {
        match &self.sparse {
            Some(sp) if sp.area.capacity() > 0 => (lo..hi)
                .filter(|&p| sp.area.lookup(self.page_no(f, p)).is_some())
                .count() as u32,
            _ => 0,
        }
    }

    /// Accounts a read for the page area: a line it covers densely is dense; its pages of
    /// lines without a slot count in the page sketch and, if held, for CLOCK.
    pub(super) fn note_sparse(&mut self, offset: u64, len: u64) {
        let Some(sp) = self.sparse.as_mut() else {
            return;
        };
        let shift = self.geo.fragment_shift() - PAGE_SHIFT;
        // A read of at least `dense_pages` whole pages of a line (and two) is evidence enough
        // that the line is dense: it needs no admissions one page at a time.
        let (whole_lo, whole_hi) = (offset.div_ceil(PAGE_SIZE), (offset + len) >> PAGE_SHIFT);
        let mut page = whole_lo;
        while page < whole_hi {
            let line = page >> shift;
            let end = ((line + 1) << shift).min(whole_hi);
            if end - page >= sp.dense_pages.max(2) as u64 {
                for _ in 0..sp.dense_pages {
                    sp.admitted.add(line);
                }
            }
            page = end;
        }
        if len >= self.geo.fragment_size() {
            return;
        }
        let (first, last) = (offset >> PAGE_SHIFT, (offset + len).div_ceil(PAGE_SIZE));
        let used = self.area_used();
        for page in first..last {
            if self.map.get(FragNo(page >> shift)).is_some() {
                continue;
            }
            let sp = self.sparse.as_mut().expect("area");
            sp.pages.add(page);
            if used {
                sp.area.touch(page);
            }
        }
    }

    /// Forgets the page area's pages (the source changed, or the cache is dropped).
    pub(super) fn forget_sparse(&mut self) -> u64 {
        let slots = &self.slots;
        match self.sparse.as_mut() {
            Some(sp) => sp.area.drop_all(|s| slots.pins(s) > 0),
            None => 0,
        }
    }

    /// Takes packed slot `s` out of the area for the write-back log: false if it cannot be
    /// now (a pin or a fill in flight, on it or on the last packed slot that takes its
    /// place); its pages are dropped either way.
    pub(super) fn unpack_slot(&mut self, s: SlotNo) -> bool {
        let slots = &self.slots;
        let Some(sp) = self.sparse.as_mut() else {
            return true;
        };
        let Some(i) = sp.area.index_of(s) else {
            return true;
        };
        let pinned = |x: SlotNo| slots.pins(x) > 0;
        let busy = pinned(s) || sp.area.slot_filling(i);
        let dropped = sp.area.drop_all_in(i, pinned);
        self.stats.pages_invalidated += dropped;
        if busy || !sp.area.can_shrink(pinned) {
            return false;
        }
        let (last, _) = sp.area.shrink().expect("checked");
        if last != s {
            sp.area.replace(i, last);
        }
        true
    }

    /// True if slot `s` is a packed slot of the page area.
    pub fn slot_is_packed(&self, s: SlotNo) -> bool {
        self.sparse
            .as_ref()
            .is_some_and(|sp| sp.area.index_of(s).is_some())
    }

    /// The fill of a read miss in line `f` with no slot: true if the page area took it (or
    /// refused it: a sparse line never fills a line); false to fill the line instead.
    pub(super) fn sparse_takes(&mut self, f: FragNo, set: &PageSet, plan: &mut ReadPlan) -> bool {
        if self.sparse.is_none() || self.map.get(f).is_some() || self.dense(f) {
            return false;
        }
        self.fill_sparse(f, set, plan);
        true
    }

    /// Line `f` was given a slot: its pages leave the page area.
    pub(super) fn line_allocated(&mut self, f: FragNo) {
        if self.area_used() {
            let n = self.geo.fragment_pages(f);
            self.drop_sparse(f, 0, n);
        }
    }
}
