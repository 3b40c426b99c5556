//! Reads: planning (shared or exclusive), accounting, inline fills, pins.

use super::plan::{AccessLog, FillRun, ReadPlan, RequestError, RunTarget};
use super::{fragments, CacheCore};
use crate::addr::{CacheOffset, FragNo, SourceOffset, PAGE_SIZE};
use crate::bitmap::{self, PageSet};
use crate::config::Admission;
use crate::slots::PinTable;
use std::ops::DerefMut;
use std::sync::Arc;

impl CacheCore {
    /// Plans a read of `len` bytes at `offset`. The caller MUST perform every run, then (for
    /// fills) write the fills and complete their populations, and finally call `end_read`.
    pub fn begin_read(
        &mut self,
        offset: SourceOffset,
        len: u64,
        plan: &mut ReadPlan,
    ) -> Result<(), RequestError> {
        self.plan_read(offset, len, plan)?;
        self.commit_read(plan);
        Ok(())
    }

    /// `begin_read` again for a read planned under the shared lock that wants inline fills
    /// (`PinnedRead::commit`): planned afresh, but with the verdict it was classified with.
    pub(super) fn redo_read(
        &mut self,
        offset: SourceOffset,
        len: u64,
        plan: &mut ReadPlan,
    ) -> Result<(), RequestError> {
        let verdict = plan.verdict;
        self.plan_read_as(offset, len, plan, Some(verdict))?;
        self.commit_read(plan);
        Ok(())
    }

    /// The read-only half of `begin_read`, for drivers that share the core among threads
    /// behind a read-write lock: plans the runs and takes the pins (atomically) without
    /// changing anything else. If `plan.needs_commit()` (an inline fill is wanted), the
    /// caller MUST release the pins and redo the read with `begin_read` under its exclusive
    /// lock; otherwise it records the plan in an [`AccessLog`] that it applies later with
    /// `apply_access_log`.
    pub fn plan_read(
        &self,
        offset: SourceOffset,
        len: u64,
        plan: &mut ReadPlan,
    ) -> Result<(), RequestError> {
        self.plan_read_as(offset, len, plan, None)
    }

    /// `plan_read`, with the stream detector's verdict given when the read was classified
    /// already (a redo under the exclusive lock: observing the same request twice would
    /// look like a new stream to the detector).
    pub(super) fn plan_read_as(
        &self,
        offset: SourceOffset,
        len: u64,
        plan: &mut ReadPlan,
        verdict: Option<crate::admit::StreamVerdict>,
    ) -> Result<(), RequestError> {
        self.check(offset.0, len)?;
        plan.clear();
        plan.offset = offset.0;
        plan.len = len;
        plan.verdict = verdict.unwrap_or_else(|| self.classify(offset.0, len));
        // Passthrough: every run goes to the source, and nothing is filled.
        let caching = self.cfg.write_mode.caches_reads();
        let want_fills = caching && self.wants_fills(plan.verdict, len);
        let want_sparse = self.wants_sparse_fills(plan.verdict, len);
        let collect = want_fills || want_sparse;
        let area = self.area_used();
        for (f, lo, hi, a, b) in fragments(self.geo, offset.0, len) {
            let fstart = self.geo.fragment_start(f).0;
            let slot = self.map.get(f);
            if slot.is_none() && area {
                let (set, partial) = self.plan_sparse(f, (lo, hi), (a, b), plan);
                self.want_fill(f, set, (want_fills, want_sparse), plan);
                self.want_partial(f, || partial, want_sparse, plan);
                continue;
            }
            let mut pinned = false;
            let mut missed_full = None::<PageSet>;
            let mut p = lo;
            while p < hi {
                let valid = caching && slot.is_some_and(|s| self.slots.is_valid(s, p));
                let run_hi = match slot {
                    Some(s) => bitmap::run_end(self.slots.bitmap(s), p, hi),
                    None => hi,
                };
                let ra = a.max(fstart + p as u64 * PAGE_SIZE);
                let rb = b.min(fstart + run_hi as u64 * PAGE_SIZE);
                let buf_offset = ra - offset.0;
                let mut hit = false;
                if valid {
                    let s = slot.expect("valid implies slot");
                    if pinned || self.slots.pin(s) {
                        if !pinned {
                            plan.pins.push(s);
                            pinned = true;
                        }
                        hit = true;
                        let cache = self.geo.slot_offset(s).0 + (ra - fstart);
                        plan.push(buf_offset, rb - ra, RunTarget::Cache(CacheOffset(cache)));
                        plan.hit_pages += (run_hi - p) as u64;
                    }
                }
                if !hit {
                    plan.push(buf_offset, rb - ra, RunTarget::Source(SourceOffset(ra)));
                    plan.missed_pages += (run_hi - p) as u64;
                    plan.full_hit = false;
                    if collect {
                        // Pages of this run that the read covers entirely can be filled.
                        let set = missed_full
                            .get_or_insert_with(|| PageSet::new(self.geo.pages_per_fragment()));
                        for q in p..run_hi {
                            let qs = fstart + q as u64 * PAGE_SIZE;
                            if qs >= a && self.page_end(f, q) <= b {
                                set.insert_range(q, q + 1);
                            }
                        }
                    }
                }
                p = run_hi;
            }
            if let Some(set) = missed_full {
                let sparse = want_sparse && slot.is_none();
                self.want_partial(f, || self.partial_pages(f, (lo, hi), (a, b)), sparse, plan);
                self.want_fill(f, set, (want_fills, sparse), plan);
            }
        }
        Ok(())
    }

    /// Records in `plan` the missed pages of sparse line `f` that the read covers in part
    /// (`partial`, worked out only then), for population to fill into the page area, if
    /// `sparse` allows.
    fn want_partial(
        &self,
        f: FragNo,
        partial: impl FnOnce() -> PageSet,
        sparse: bool,
        plan: &mut ReadPlan,
    ) {
        if sparse && !self.dense(f) {
            let partial = partial();
            if !partial.is_empty() {
                plan.partial_wanted.push((f, partial));
            }
        }
    }

    /// Records in `plan` that the missed pages `set` of line `f` may be filled: as a line
    /// (if `line`: admission `always`, or a miss fill population would make) or into the
    /// page area (if `sparse`); `commit_read` decides which.
    fn want_fill(
        &self,
        f: FragNo,
        set: PageSet,
        (line, sparse): (bool, bool),
        plan: &mut ReadPlan,
    ) {
        if set.is_empty() {
            return;
        }
        let line = line && (self.cfg.admission == Admission::Always || self.miss_fill_wanted(f));
        // A dense line's misses are population's (a read that needs no commit keeps its
        // accounting in the read log, applied after the hits: see `apply_access_logs`).
        let sparse = sparse && !self.dense(f);
        if line || sparse {
            plan.fill_wanted.push((f, set, line, sparse));
        }
    }

    /// The mutating half of `begin_read`: accounting, and the inline fills of `always`.
    pub(super) fn commit_read(&mut self, plan: &mut ReadPlan) {
        let offset = plan.offset;
        self.note_access(offset, plan.len, plan.verdict, false);
        self.account_read(1, plan.full_hit as u64, plan.hit_pages, plan.missed_pages);
        self.epoch_sparse(
            plan.hit_pages,
            plan.area_hits,
            plan.missed_pages,
            plan.dense_missed,
        );
        for (f, set) in std::mem::take(&mut plan.partial_wanted) {
            self.queue_sparse(f, set);
        }
        for (f, set, line, sparse) in std::mem::take(&mut plan.fill_wanted) {
            if sparse && self.sparse_takes(f, &set, plan) {
                continue;
            }
            if !line {
                continue;
            }
            let selective = self.cfg.admission == Admission::Sce;
            let mut completes_line = false;
            if selective {
                match self.admit_miss_fill(f, &set) {
                    None => continue,
                    Some(c) => completes_line = c,
                }
            }
            let Ok(pop) = self.start_population_as(f, Some(&set), selective) else {
                continue;
            };
            if selective {
                self.stats.miss_fills += 1;
                if completes_line {
                    // Nothing left of the line to prefetch: it owes the window nothing.
                    self.line_picked(f);
                }
            }
            let fstart = self.geo.fragment_start(f).0;
            let st = self.pops.get(pop.0).expect("just started");
            let slot_off = self.geo.slot_offset(st.slot).0;
            let runs: Vec<(u32, u32)> = st.fill.runs(self.geo.pages_per_fragment()).collect();
            for (q0, q1) in runs {
                let sa = fstart + q0 as u64 * PAGE_SIZE;
                let sb = self.page_end(f, q1 - 1);
                plan.fills.push(FillRun {
                    pop,
                    buf_offset: sa - offset,
                    len: sb - sa,
                    cache: CacheOffset(slot_off + (sa - fstart)),
                });
            }
            plan.pops.push(pop);
        }
    }

    /// Whether a read of `len` bytes may fill the cache with its misses: always under
    /// admission `always`; under `sce` with miss fills, a read of a stream that population
    /// leaves to its own fills (`stream_fills`) while the cache has free space; any other
    /// read that is not a stream's while the cache has free space (the first pass); and,
    /// once it is full, any read but a stream's when the source is busy or miss fills are
    /// not kept for a busy source.
    fn wants_fills(&self, verdict: crate::admit::StreamVerdict, len: u64) -> bool {
        match self.cfg.admission {
            Admission::Always => true,
            Admission::Sce => {
                let full = self.slots.free_count() == 0;
                self.cfg.fills_from_misses()
                    && self.cfg.write_mode.caches_reads()
                    && if verdict.sequential && self.stream_fills(len, false) {
                        !full
                    } else {
                        // Free space: every miss but a stream's fills (the first pass);
                        // otherwise only while the source is busy, with `auto`; a stream
                        // never once the cache is full.
                        let first_pass = !full && !verdict.sequential;
                        (self.source_busy || !self.cfg.miss_fills_when_busy || first_pass)
                            && !(verdict.sequential && full)
                    }
            }
            _ => false,
        }
    }

    /// Admission `sce`: whether a read miss in line `f` should fill the pages it reads (the
    /// cheap test, made while planning under a shared lock): the line has a slot, or the
    /// cache has free space, or the line's region was touched before in the window (this
    /// miss is its second touch, when population would consider it).
    fn miss_fill_wanted(&self, f: crate::addr::FragNo) -> bool {
        self.map.get(f).is_some()
            || self.slots.free_count() > 0
            || self.window.count(self.region(f)) >= 1
    }

    /// Admission `sce`: decides a miss fill into line `f` under the exclusive lock: if a
    /// slot must be taken from another line, only by winning the duel against the eviction
    /// victim, which is then evicted. The population budget does not apply: it bounds the
    /// source reads of population, and a miss fill reads nothing; the endurance budget
    /// does. Nothing is evicted unless the fill can then start (it has pages to fill, within
    /// the endurance budget). None skips the fill; otherwise, whether it leaves nothing of
    /// the line to fill.
    fn admit_miss_fill(&mut self, f: crate::addr::FragNo, set: &PageSet) -> Option<bool> {
        let fill = self.fillable(f, Some(set))?;
        if !self.endurance_allows(fill.len() as u64 * PAGE_SIZE) {
            self.stats.endurance_refusals += 1;
            return None;
        }
        let rest = self.fillable(f, None);
        let completes =
            rest.is_none_or(|r| r.words().iter().zip(fill.words()).all(|(r, s)| r & !s == 0));
        self.room_by_duel(f).ok()?;
        Some(completes)
    }

    pub(super) fn account_read(&mut self, requests: u64, full_hits: u64, hits: u64, misses: u64) {
        self.stats.read_requests += requests;
        self.stats.read_requests_full_hit += full_hits;
        self.stats.read_pages_hit += hits;
        self.stats.read_pages_missed += misses;
        self.missrate.record(hits, misses);
        self.budget.record_reads(hits, misses);
    }

    /// Applies the accounting of reads planned with `plan_read`, and empties the log.
    pub fn apply_access_log(&mut self, log: &mut AccessLog) {
        self.apply_access_logs(&mut [log]);
    }

    /// Applies several logs at once (a shard's, one per thread), and empties them: the reads
    /// that hit first, then those that missed. The order of reads across logs is lost
    /// anyway; this one keeps the fragments that missed, those population looks for, at the
    /// front of the hotness window. Otherwise one thread's batch of hits, applied after
    /// another's misses, pushes every one of them out of the window (the window holds a few
    /// dozen fragments, a batch of hits hundreds), and population finds nothing to pick
    /// while the misses go on.
    pub fn apply_access_logs(&mut self, logs: &mut [impl DerefMut<Target = AccessLog>]) {
        let [mut requests, mut full_hits, mut hits, mut misses, mut area, mut dense] = [0u64; 6];
        for log in logs.iter() {
            for &(offset, len, verdict) in &log.reads {
                self.note_access(offset, len, verdict, false);
            }
        }
        for log in logs.iter_mut() {
            for &(offset, len, verdict) in &log.missed {
                self.note_access(offset, len, verdict, false);
            }
            requests += log.requests;
            full_hits += log.full_hits;
            hits += log.hit_pages;
            misses += log.missed_pages;
            area += log.area_hits;
            dense += log.dense_missed;
            (log.area_hits, log.dense_missed) = (0, 0);
            // Emptied, not replaced: the hit path records without allocating.
            log.reads.clear();
            log.missed.clear();
            (log.requests, log.full_hits, log.hit_pages, log.missed_pages) = (0, 0, 0, 0);
        }
        self.account_read(requests, full_hits, hits, misses);
        self.epoch_sparse(hits, area, misses, dense);
    }

    /// Releases the pins of a read. The caller guarantees that the plan's I/O is finished and
    /// its populations completed.
    pub fn end_read(&mut self, plan: &mut ReadPlan) {
        plan.release_pins(self.slots.pin_table());
    }

    /// The pin table, for drivers that release read pins without taking their lock
    /// (`ReadPlan::release_pins`).
    pub fn pin_table(&self) -> Arc<PinTable> {
        self.slots.pin_table().clone()
    }
}
