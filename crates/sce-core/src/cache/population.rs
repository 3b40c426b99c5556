//! Population: picking (Algorithm 1, `sce`, `nhit:K`), starting and completing it.

use super::heat::Duel;
use super::plan::{PopId, PopulationJob, RequestError};
use super::CacheCore;
use crate::addr::{CacheOffset, FragNo, Nanos, SlotNo, SourceOffset, PAGE_SIZE};
use crate::bitmap::{self, PageSet};
use crate::config::Admission;
use std::collections::VecDeque;

/// Why `start_population` started nothing.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum NoPop {
    /// No page to fill (all valid, under writes, or a population in flight).
    Nothing,
    /// The endurance budget would be exceeded.
    Endurance,
    /// No slot could be allocated or pinned.
    NoSlot,
}

#[derive(Debug)]
pub(super) struct PopState {
    pub(super) frag: FragNo,
    pub(super) slot: SlotNo,
    pub(super) fill: PageSet,
    pub(super) spoiled: PageSet,
    pub(super) fresh_slot: bool,
    /// A fill of the page area (`pages.rs`): each page of the line filled and its way
    /// (`slot` is not used then).
    pub(super) ways: Vec<(u32, u32)>,
}

/// Direct-mapped access counters for `nhit:K` admission.
#[derive(Debug)]
pub(super) struct NHitFilter {
    pub(super) k: u32,
    pub(super) tags: Box<[u64]>,
    pub(super) counts: Box<[u32]>,
    pub(super) queue: VecDeque<FragNo>,
}

impl NHitFilter {
    const QUEUE_MAX: usize = 4096;

    pub(super) fn new(k: u32, entries: usize) -> Self {
        let n = entries.next_power_of_two();
        NHitFilter {
            k,
            tags: vec![u64::MAX; n].into_boxed_slice(),
            counts: vec![0; n].into_boxed_slice(),
            queue: VecDeque::new(),
        }
    }

    pub(super) fn touch(&mut self, f: FragNo) {
        let i = (f.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize & (self.tags.len() - 1);
        if self.tags[i] != f.0 {
            self.tags[i] = f.0;
            self.counts[i] = 0;
        }
        self.counts[i] = self.counts[i].saturating_add(1);
        if self.counts[i] == self.k && self.queue.len() < Self::QUEUE_MAX {
            self.queue.push_back(f);
        }
    }
}

impl CacheCore {
    /// Pages of `f` a population could fill now: not valid, not under a write in flight,
    /// restricted to `hint` if given. None if a population is already in flight on `f`.
    pub(super) fn fillable(&self, f: FragNo, hint: Option<&PageSet>) -> Option<PageSet> {
        let act = self.activity.get(&f.0);
        if act.is_some_and(|a| a.pop.is_some()) || self.disabled(f) {
            return None;
        }
        let n = self.geo.fragment_pages(f);
        let mut fill = match hint {
            Some(h) => h.clone(),
            None => {
                let mut s = PageSet::new(self.geo.pages_per_fragment());
                s.insert_range(0, n);
                s
            }
        };
        if let Some(s) = self.map.get(f) {
            for (w, v) in fill.words_mut().iter_mut().zip(self.slots.bitmap(s)) {
                *w &= !v;
            }
        }
        if let Some(a) = act {
            for w in &a.writes {
                if let Some(ws) = self.writes.get(w.0) {
                    for p in ws.parts.iter().filter(|p| p.frag == f) {
                        fill.remove_range(p.lo, p.hi);
                    }
                }
            }
        }
        (!fill.is_empty()).then_some(fill)
    }

    /// True if a population of `f` would fill at least one page now. Cheap unless writes
    /// are in flight on `f`.
    pub(super) fn worth_populating(&self, f: FragNo) -> bool {
        if f.0 >= self.geo.source_fragments() {
            return false;
        }
        match self.activity.get(&f.0) {
            Some(a) if a.pop.is_some() => false,
            Some(_) => self.fillable(f, None).is_some(),
            None => match self.map.get(f) {
                None => true,
                Some(s) => !bitmap::all_set(self.slots.bitmap(s), 0, self.geo.fragment_pages(f)),
            },
        }
    }

    /// Starts a population of the pages of `f` that `fillable` gives, within the endurance
    /// budget (checked before a slot is allocated, so that a refusal evicts nothing), and
    /// counts its bytes against it.
    pub(super) fn start_population(
        &mut self,
        f: FragNo,
        hint: Option<&PageSet>,
    ) -> Result<PopId, NoPop> {
        self.start_population_as(f, hint, false)
    }

    /// `start_population`; an `inline` fill (from a read's own data) leaves the hotness
    /// window as it is, so that the rest of the line may still be prefetched.
    pub(super) fn start_population_as(
        &mut self,
        f: FragNo,
        hint: Option<&PageSet>,
        inline: bool,
    ) -> Result<PopId, NoPop> {
        let fill = self.fillable(f, hint).ok_or(NoPop::Nothing)?;
        let bytes = fill.len() as u64 * PAGE_SIZE;
        if !self.endurance_allows(bytes) {
            self.stats.endurance_refusals += 1;
            return Err(NoPop::Endurance);
        }
        let (slot, fresh_slot) = match self.map.get(f) {
            Some(s) => (s, false),
            None => (self.allocate(f).ok_or(NoPop::NoSlot)?, true),
        };
        if !self.slots.pin(slot) {
            return Err(NoPop::NoSlot);
        }
        self.endure(bytes);
        let spoiled = PageSet::new(self.geo.pages_per_fragment());
        let id = PopId(self.pops.insert(PopState {
            frag: f,
            slot,
            fill,
            spoiled,
            fresh_slot,
            ways: Vec::new(),
        }));
        self.activity.entry(f.0).or_default().pop = Some(id);
        if !inline {
            self.line_picked(f);
        }
        self.stats.populations_started += 1;
        Ok(id)
    }

    /// Algorithm 1's promotion step: if the throttle allows it now, picks the hottest fragment
    /// worth populating (SCE) or the next admitted one (`nhit:K`) and returns the job.
    pub fn pick_population(&mut self, now: Nanos) -> Option<PopulationJob> {
        if !self.cfg.write_mode.caches_reads() || !self.throttle(now).may_populate {
            return None;
        }
        if self.cfg.admission == Admission::Sce {
            let full = self.slots.free_count() == 0;
            self.budget.advance(now, full, self.geo.fragment_size());
            if self.budget.exhausted() {
                self.stats.population_budget_waits += 1;
                return None;
            }
        }
        self.pick_population_unthrottled()
    }

    /// The current population rate limit in bytes per second (0: unlimited).
    pub fn population_rate(&self) -> u64 {
        self.budget.rate()
    }

    /// Admission `sce`: a line of the hottest region of the window, if it earns its place.
    /// Once the cache is full a region needs two touches in the window unless the line has
    /// a slot already (filling it evicts nothing), and a line not cached must win a duel
    /// against the eviction victim in the frequency sketch (region against region).
    pub(super) fn pick_selective(&mut self) -> Option<PopulationJob> {
        if let Some(job) = self.pick_sparse() {
            return Some(job);
        }
        let full = self.slots.free_count() == 0;
        let this = &*self;
        let r = self
            .window
            .hottest_by(|r, n| this.candidate_line(r, full && n < 2).is_some())?;
        let n = self.window.count(r);
        let f = self.candidate_line(r, full && n < 2)?;
        let hint = self.fill_hint(f);
        let Some(fill) = self.fillable(f, hint.as_ref()) else {
            self.window.reset(r);
            return None;
        };
        let bytes = fill.len() as u64 * PAGE_SIZE;
        if !self.endurance_allows(bytes) {
            self.stats.endurance_refusals += 1;
            return None;
        }
        match self.room_by_duel(f) {
            Ok(()) => {}
            Err(Duel::NoVictim) => return None,
            Err(Duel::Lost) => {
                self.window.reset(r);
                return None;
            }
        }
        self.budget.take(bytes);
        let Ok(id) = self.start_population(f, Some(&fill)) else {
            self.window.reset(r);
            return None;
        };
        Some(self.job(id))
    }

    /// Like `pick_population` but ignores the throttle (for tests and explicit prefetch).
    /// Under admission `sce` the candidate must still earn its place (but the population
    /// budget is not consulted).
    pub fn pick_population_unthrottled(&mut self) -> Option<PopulationJob> {
        if !self.cfg.write_mode.caches_reads() {
            return None;
        }
        let f = match self.cfg.admission {
            Admission::Always => None,
            Admission::Sce => return self.pick_selective(),
            Admission::ScePaper => {
                let this = &*self;
                // Eligible: something to fill now. A hot cached fragment whose only invalid
                // pages are under writes in flight (AWT copies) is not, or it would win every
                // pick and starve the rest.
                let r = self
                    .window
                    .hottest(|r| this.candidate_line(r, false).is_some())?;
                self.candidate_line(r, false)
            }
            Admission::NHit(_) => {
                let mut found = None;
                while let Some(f) = self.nhit.as_mut().and_then(|n| n.queue.pop_front()) {
                    if self.worth_populating(f) {
                        found = Some(f);
                        break;
                    }
                }
                found
            }
        }?;
        match self.start_population(f, None) {
            Ok(id) => Some(self.job(id)),
            // Over the endurance budget: the candidate keeps its heat.
            Err(NoPop::Endurance) => None,
            Err(_) => {
                // No slot could be had (all pinned): try again next cycle.
                let r = self.region(f);
                self.window.reset(r);
                None
            }
        }
    }

    /// Starts a population of the fragment holding `offset` (NBD CACHE, prefetch), ignoring
    /// the throttle. None if there is nothing to fill, no slot can be had, or the cache is in
    /// passthrough.
    pub fn prefetch(&mut self, offset: SourceOffset) -> Option<PopulationJob> {
        if !self.cfg.write_mode.caches_reads() || offset.0 >= self.geo.source_size() {
            return None;
        }
        let id = self
            .start_population(self.geo.fragment_of(offset), None)
            .ok()?;
        Some(self.job(id))
    }

    pub(super) fn job(&self, id: PopId) -> PopulationJob {
        let st = self.pops.get(id.0).expect("live population");
        let f = st.frag;
        let fstart = self.geo.fragment_start(f).0;
        let slot_off = self.geo.slot_offset(st.slot).0;
        let runs: Vec<(u32, u32)> = st.fill.runs(self.geo.pages_per_fragment()).collect();
        let span_lo = runs.first().map_or(0, |r| r.0);
        let span_hi = runs.last().map_or(0, |r| r.1);
        let source = fstart + span_lo as u64 * PAGE_SIZE;
        let len = self.page_end(f, span_hi - 1) - source;
        let runs = runs
            .into_iter()
            .map(|(a, b)| {
                let sa = fstart + a as u64 * PAGE_SIZE;
                let sb = self.page_end(f, b - 1);
                (sa - source, sb - sa, CacheOffset(slot_off + (sa - fstart)))
            })
            .collect();
        PopulationJob {
            id,
            frag: f,
            slot: st.slot,
            source: SourceOffset(source),
            len,
            runs,
        }
    }

    /// Reports a population (background or inline fill): `ok` if the source read and every
    /// cache write succeeded. Validates the filled pages that no write spoiled meanwhile.
    pub fn complete_population(&mut self, id: PopId, ok: bool) -> Result<(), RequestError> {
        let st = self.pops.remove(id.0).ok_or(RequestError::UnknownId)?;
        if !st.ways.is_empty() {
            // Pages, not fragments: counted in `sparse_pages_filled` only.
            self.complete_sparse(&st, ok);
            self.forget_activity(st.frag, |a| a.pop = None);
            return Ok(());
        }
        let s = st.slot;
        debug_assert_eq!(self.slots.fragment(s), Some(st.frag));
        if ok {
            let bm = self.slots.bitmap_mut(s);
            let mut n = 0;
            for (v, (fw, sw)) in bm
                .iter_mut()
                .zip(st.fill.words().iter().zip(st.spoiled.words()))
            {
                let add = fw & !sw;
                n += add.count_ones();
                *v |= add;
            }
            self.stats.pages_populated += n as u64;
            self.stats.populations_completed += 1;
        } else {
            self.stats.populations_failed += 1;
        }
        self.slots.unpin(s);
        self.forget_activity(st.frag, |a| a.pop = None);
        let empty = !bitmap::any_set(self.slots.bitmap(s), 0, self.geo.pages_per_fragment());
        if !ok && st.fresh_slot && empty && self.slots.pins(s) == 0 {
            self.evict_slot(s);
            self.slots.put_free(s);
        }
        Ok(())
    }
}
