//! Writes: invalidation, cache copies (AWT, write-through), duplicate-write tracking and
//! completion.

use super::plan::{CacheWrite, RequestError, WriteId, WriteKind, WritePlan};
use super::{fragments, CacheCore};
use crate::addr::{CacheOffset, FragNo, SlotNo, SourceOffset, PAGE_SIZE};
use crate::bitmap::{self, PageSet};
use crate::config::{Admission, WriteMode};

#[derive(Debug)]
pub(super) struct WritePart {
    pub(super) frag: FragNo,
    pub(super) lo: u32,
    pub(super) hi: u32,
    /// Pages that may be validated when the write completes: `[vlo, vhi)`.
    pub(super) vlo: u32,
    pub(super) vhi: u32,
    pub(super) slot: Option<SlotNo>,
    /// A copy into the page area: the way of page `lo`, which the write refills.
    pub(super) way: Option<u32>,
    pub(super) cache_ok: Option<bool>,
    pub(super) spoiled: Option<PageSet>,
}

#[derive(Debug)]
pub(super) struct WriteState {
    pub(super) parts: Vec<WritePart>,
    pub(super) source_ok: Option<bool>,
    pub(super) cache_pending: u32,
    pub(super) budget: u64,
}

/// What `begin_write` gathers over the fragments of a write.
#[derive(Default)]
struct Planned {
    copy_wanted: bool,
    over_budget: bool,
    parts: Vec<WritePart>,
    cache_writes: Vec<CacheWrite>,
    budget: u64,
    fell_back: bool,
    duplicate: bool,
}

impl CacheCore {
    /// Starts a write (or discard) of `len` bytes at `offset`: invalidates the pages and plans
    /// the cache copies. The caller MUST send the source write after this returns, then report
    /// `write_source_done`, and `write_cache_done` for every listed cache copy.
    pub fn begin_write(
        &mut self,
        offset: SourceOffset,
        len: u64,
        kind: WriteKind,
    ) -> Result<WritePlan, RequestError> {
        self.check(offset.0, len)?;
        self.stats.write_requests += 1;
        let verdict = self.classify(offset.0, len);
        let sequential = self.note_access(offset.0, len, verdict, true);
        let mode = self.cfg.write_mode;
        let copy_wanted = kind == WriteKind::Data && mode.copies_writes() && len > 0 && !sequential;
        let over_budget = mode == WriteMode::Awt && self.awt_in_flight + len > self.cfg.awt_budget;
        let id = WriteId(self.writes.insert(WriteState {
            parts: Vec::new(),
            source_ok: None,
            cache_pending: 0,
            budget: 0,
        }));
        let mut w = Planned {
            copy_wanted,
            over_budget,
            ..Planned::default()
        };
        for (f, lo, hi, a, b) in fragments(self.geo, offset.0, len) {
            let (part, slot, ways) = self.invalidate_part(f, (lo, hi), (a, b), copy_wanted);
            let conflict = self.spoil_overlaps(id, f, lo, hi);
            self.plan_area_copies(&mut w, f, ways, offset.0);
            self.plan_copy(&mut w, part, slot, (a, b), offset.0, conflict);
        }
        if w.fell_back {
            self.stats.awt_fallbacks += 1;
        }
        if w.duplicate {
            self.stats.awt_duplicates += 1;
        }
        if !w.cache_writes.is_empty() {
            self.stats.awt_started += 1;
        }
        if mode == WriteMode::Awt {
            self.awt_in_flight += w.budget;
        } else {
            w.budget = 0;
        }
        let ws = self.writes.get_mut(id.0).expect("just inserted");
        ws.parts = w.parts;
        ws.cache_pending = w.cache_writes.len() as u32;
        ws.budget = w.budget;
        Ok(WritePlan {
            id,
            cache_writes: w.cache_writes,
            synchronous: mode == WriteMode::WriteThrough,
        })
    }

    /// Step 1 of `begin_write` for fragment `f` (pages `[lo, hi)`, bytes `[a, b)` of the
    /// request): counts the pages, allocates a slot if admission `always` wants a copy,
    /// invalidates the written pages and decides which of them may be re-validated (a
    /// partial page only if `revalidate_partial_pages` and it was valid). Returns the part,
    /// the fragment's slot, if any, and (a line without one) the page-area ways of the pages
    /// the write covers whole that it refills (`CacheCore::rewrite_sparse`).
    fn invalidate_part(
        &mut self,
        f: FragNo,
        (lo, hi): (u32, u32),
        (a, b): (u64, u64),
        copy_wanted: bool,
    ) -> (WritePart, Option<SlotNo>, Vec<(u32, u32)>) {
        self.stats.write_pages += (hi - lo) as u64;
        let fstart = self.geo.fragment_start(f).0;
        let head_partial = a > fstart + lo as u64 * PAGE_SIZE;
        let tail_partial = b < self.page_end(f, hi - 1);
        let mut slot = self.map.get(f);
        let mut ways = Vec::new();
        if slot.is_none() {
            let whole = (lo + head_partial as u32, hi - tail_partial as u32);
            ways = self.rewrite_sparse(f, (lo, hi), if copy_wanted { whole } else { (0, 0) });
        }
        if slot.is_none()
            && copy_wanted
            && self.cfg.admission == Admission::Always
            && self.endurance_allows(b - a)
        {
            slot = self.allocate(f);
        }
        let (mut vlo, mut vhi) = (lo, hi);
        if let Some(s) = slot {
            let partial_ok = self.cfg.revalidate_partial_pages;
            if head_partial && !(partial_ok && self.slots.is_valid(s, lo)) {
                vlo = lo + 1;
            }
            if tail_partial && !(partial_ok && self.slots.is_valid(s, hi - 1)) {
                vhi = hi - 1;
            }
            bitmap::clear_range(self.slots.bitmap_mut(s), lo, hi);
        }
        let part = WritePart {
            frag: f,
            lo,
            hi,
            vlo,
            vhi,
            slot: None,
            way: None,
            cache_ok: None,
            spoiled: None,
        };
        (part, slot, ways)
    }

    /// Step 2, duplicate-write tracking: spoils the pages `[lo, hi)` of `f` in whatever else
    /// is in flight on them (a population, other writes) and records write `id` on `f`.
    /// Returns true if anything overlapped.
    fn spoil_overlaps(&mut self, id: WriteId, f: FragNo, lo: u32, hi: u32) -> bool {
        let (conflict, pop_pages) = self.spoil_in_flight(f, lo, hi);
        self.stats.pages_spoiled += pop_pages as u64;
        self.activity.entry(f.0).or_default().writes.push(id);
        conflict
    }

    /// Step 3: plans the cache copy of a part (bytes `[a, b)` of a request at `offset`), if
    /// one is wanted and allowed (no overlap, within the AWT and endurance budgets, the slot
    /// pinned), and adds the part to `w`.
    fn plan_copy(
        &mut self,
        w: &mut Planned,
        mut part: WritePart,
        slot: Option<SlotNo>,
        (a, b): (u64, u64),
        offset: u64,
        conflict: bool,
    ) {
        let (copy_wanted, over_budget) = (w.copy_wanted, w.over_budget);
        if let (true, Some(s)) = (copy_wanted, slot) {
            if conflict {
                w.duplicate = true;
            } else if over_budget {
                w.fell_back = true;
            } else if !self.endure(b - a) {
                // Over the endurance budget: the pages stay invalid (write-around).
            } else if self.slots.pin(s) {
                part.slot = Some(s);
                w.budget += b - a;
                let fstart = self.geo.fragment_start(part.frag).0;
                w.cache_writes.push(CacheWrite {
                    part: w.parts.len() as u32,
                    buf_offset: a - offset,
                    len: b - a,
                    cache: CacheOffset(self.geo.slot_offset(s).0 + (a - fstart)),
                });
            }
        }
        w.parts.push(part);
    }

    /// Step 2b: plans the write's copies into the page area's `ways` (page, way) of line
    /// `f` (refills of pages it held, each one page of the request at `offset`), within the
    /// AWT and endurance budgets; a way whose copy is not sent is emptied.
    fn plan_area_copies(&mut self, w: &mut Planned, f: FragNo, ways: Vec<(u32, u32)>, offset: u64) {
        let fstart = self.geo.fragment_start(f).0;
        for (p, way) in ways {
            let sa = fstart + p as u64 * PAGE_SIZE;
            let len = self.page_end(f, p) - sa;
            if w.over_budget || !self.endure(len) {
                w.fell_back |= w.over_budget;
                self.complete_rewrite(f, p, way, false);
                continue;
            }
            let at = self.sparse.as_ref().expect("area").area.at(way as usize);
            w.budget += len;
            w.cache_writes.push(CacheWrite {
                part: w.parts.len() as u32,
                buf_offset: sa - offset,
                len,
                cache: CacheOffset(self.way_offset(at)),
            });
            w.parts.push(WritePart {
                frag: f,
                lo: p,
                hi: p + 1,
                vlo: p,
                vhi: p + 1,
                slot: None,
                way: Some(way),
                cache_ok: None,
                spoiled: None,
            });
        }
    }

    /// Pages `[lo, hi)` of line `f` (no slot) are written: each the page area holds is
    /// dropped, except those of `[wlo, whi)` (pages the write covers whole, if it copies to
    /// the cache) held valid in a slot no read holds, which the write refills in place:
    /// returns those (page, way). Keeping a written hot page cached matters: a Zipf load
    /// with 13% writes lost them otherwise, and a trace that reads back what it wrote too.
    fn rewrite_sparse(
        &mut self,
        f: FragNo,
        (lo, hi): (u32, u32),
        (wlo, whi): (u32, u32),
    ) -> Vec<(u32, u32)> {
        if !self.area_used() || wlo >= whi {
            self.drop_sparse(f, lo, hi);
            return Vec::new();
        }
        // The pages it covers in part (the first and the last at most) are dropped.
        self.drop_sparse(f, lo, wlo);
        self.drop_sparse(f, whi, hi);
        let base = self.page_no(f, 0);
        let slots = &self.slots;
        let sp = self.sparse.as_mut().expect("area");
        (wlo..whi)
            .filter_map(|p| {
                let w = sp.area.rewrite(base + p as u64, |s| slots.pins(s) > 0)?;
                Some((p, w as u32))
            })
            .collect()
    }

    /// Completes a write's refill of page `p` of line `f` in way `w` of the page area: valid
    /// if `ok` and no later write spoiled it. Returns true if it is valid.
    fn complete_rewrite(&mut self, f: FragNo, p: u32, w: u32, ok: bool) -> bool {
        let page = self.page_no(f, p);
        match self.sparse.as_mut() {
            Some(sp) => sp.area.complete_fill(w as usize, page, ok),
            None => false,
        }
    }

    /// Reports the source half of a write. A failed source write leaves the pages invalid.
    pub fn write_source_done(&mut self, id: WriteId, ok: bool) -> Result<(), RequestError> {
        let ws = self.writes.get_mut(id.0).ok_or(RequestError::UnknownId)?;
        if ws.source_ok.is_some() {
            return Err(RequestError::UnknownId);
        }
        ws.source_ok = Some(ok);
        if !ok {
            self.stats.source_write_failures += 1;
        }
        self.maybe_finish_write(id);
        Ok(())
    }

    /// Reports the cache copy `part` of a write. A failed copy leaves the pages invalid.
    pub fn write_cache_done(
        &mut self,
        id: WriteId,
        part: u32,
        ok: bool,
    ) -> Result<(), RequestError> {
        let ws = self.writes.get_mut(id.0).ok_or(RequestError::UnknownId)?;
        let p = ws
            .parts
            .get_mut(part as usize)
            .ok_or(RequestError::UnknownId)?;
        if (p.slot.is_none() && p.way.is_none()) || p.cache_ok.is_some() {
            return Err(RequestError::UnknownId);
        }
        p.cache_ok = Some(ok);
        ws.cache_pending -= 1;
        if !ok {
            self.stats.awt_cache_failures += 1;
        }
        self.maybe_finish_write(id);
        Ok(())
    }

    pub(super) fn maybe_finish_write(&mut self, id: WriteId) {
        let done = self
            .writes
            .get(id.0)
            .is_some_and(|w| w.source_ok.is_some() && w.cache_pending == 0);
        if !done {
            return;
        }
        let ws = self.writes.remove(id.0).expect("checked");
        let source_ok = ws.source_ok == Some(true);
        let mut validated_any = false;
        for part in ws.parts {
            if let Some(w) = part.way {
                let ok = source_ok && part.cache_ok == Some(true);
                validated_any |= self.complete_rewrite(part.frag, part.lo, w, ok);
            }
            if let Some(s) = part.slot {
                if source_ok && part.cache_ok == Some(true) && part.vlo < part.vhi {
                    debug_assert_eq!(self.slots.fragment(s), Some(part.frag));
                    let bm = self.slots.bitmap_mut(s);
                    match &part.spoiled {
                        None => bitmap::set_range(bm, part.vlo, part.vhi),
                        Some(sp) => {
                            for q in part.vlo..part.vhi {
                                if !sp.contains(q) {
                                    bitmap::set_range(bm, q, q + 1);
                                }
                            }
                            self.stats.pages_spoiled +=
                                bitmap::count(sp.words(), part.vlo, part.vhi) as u64;
                        }
                    }
                    validated_any = true;
                }
                self.slots.unpin(s);
            }
            self.forget_activity(part.frag, |a| a.writes.retain(|w| *w != id));
        }
        if validated_any {
            self.stats.awt_completed += 1;
        }
        self.awt_in_flight -= ws.budget;
    }
}
