//! Write-back in the persistent store: dirty journal entries before the data, dirty bitmaps
//! in the records, and the two holds that keep dirty data claimed on the device.
//!
//! # The rules
//! * **A write-back write** appends one dirty entry per page (slot, fragment, page, the new
//!   checksum and what the page held before) and waits until they are durable *before* it
//!   writes the data: a crash at any point then leaves the page holding bytes that one of
//!   its checksums names (`sce_store::replay`).
//! * **The journal's tail** never passes an entry that may be the only durable claim of a
//!   dirty page: not the first entry of a write still in flight (a round may snapshot its
//!   pages before they are written, with the older checksum), nor any entry of a slot whose
//!   record has not been written since (`from`). A round that wrote a slot's record moves
//!   the slot's `from` to the round's noted block, or clears it if the slot had no entry
//!   since.
//! * **A slot is held** (pinned in the core: never evicted, never given to another fragment)
//!   from its first dirty entry until its durable record claims no dirty page and no live
//!   entry names it. So whatever the device says is dirty in a slot, under an intent or not,
//!   is the slot's own data: a load trusts dirty claims even under a set intent.
//! * Write-back needs the journal (refused without it).

use super::{Persist, State, Ticket};
use sce_core::SlotHold;
use sce_io::IoError;
use sce_store::journal::{DirtyPage, JournalEntry, PrevPage};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

/// No live entry.
const NONE: u64 = u64::MAX;

/// The write-back state of one slot. A slot has one only while some of it is not the
/// default: a cache served in write-through (or a write-back cache's clean slots) keeps none,
/// so write-back costs memory per slot it holds, not per slot of the device.
#[derive(Debug)]
struct WbSlot {
    /// The first journal block its dirty claims may still need (`NONE`: none).
    from: u64,
    /// The block of its newest dirty entry.
    last: u64,
    /// Its last durable record claims dirty pages.
    rec_dirty: bool,
    /// The record being written claims dirty pages; it was refused its claim (written
    /// empty without reflecting the journal).
    snap_dirty: bool,
    snap_refused: bool,
    /// Its hold in the core, if held.
    held: Option<SlotHold>,
}

impl Default for WbSlot {
    fn default() -> Self {
        WbSlot {
            from: NONE,
            last: 0,
            rec_dirty: false,
            snap_dirty: false,
            snap_refused: false,
            held: None,
        }
    }
}

impl WbSlot {
    /// Nothing of it differs from a slot without write-back state.
    fn idle(&self) -> bool {
        self.from == NONE
            && !self.rec_dirty
            && !self.snap_dirty
            && !self.snap_refused
            && self.held.is_none()
    }
}

/// The write-back state of the store (part of the persistence state, under its lock).
#[derive(Debug, Default)]
pub(super) struct Wb {
    /// The slots with write-back state, by global slot (ordered: a shard releases its range).
    slots: BTreeMap<u32, WbSlot>,
    /// Write-back writes in flight, by the block of their first entry.
    inflight: BTreeMap<u64, usize>,
}

impl Drop for Wb {
    /// The store goes away with the cores: the holds are given up with them.
    fn drop(&mut self) {
        for h in self.slots.values_mut().filter_map(|w| w.held.take()) {
            h.abandon();
        }
    }
}

impl Wb {
    /// Slot `s`'s state, made if it had none.
    fn slot(&mut self, s: u32) -> &mut WbSlot {
        self.slots.entry(s).or_default()
    }

    /// Forgets slot `s`'s state if none of it is left.
    fn prune(&mut self, s: u32) {
        if self.slots.get(&s).is_some_and(WbSlot::idle) {
            self.slots.remove(&s);
        }
    }

    /// The tail a round that noted `covered` may establish.
    pub(super) fn tail(&self, covered: u64) -> u64 {
        let inflight = self.inflight.keys().next().copied().unwrap_or(NONE);
        let from = self.slots.values().map(|w| w.from).min().unwrap_or(NONE);
        covered.min(inflight).min(from)
    }

    /// The block a round noting `covered` now may say its records cover: not past the
    /// first entry of a write-back write in flight.
    pub(super) fn held_from(&self, covered: u64) -> u64 {
        covered.min(self.inflight.keys().next().copied().unwrap_or(NONE))
    }

    /// The record of slot `s` being written claims dirty pages (`dirty`), or was refused
    /// its claim (`refused`).
    pub(super) fn snapshot(&mut self, s: u32, dirty: bool, refused: bool) {
        if !dirty && !refused && !self.slots.contains_key(&s) {
            return;
        }
        let w = self.slot(s);
        w.snap_dirty = dirty;
        w.snap_refused = refused;
        self.prune(s);
    }

    /// The record of slot `s` taken after `covered` was noted is durable (`claimed`: it
    /// claims its fragment's pages). True if the slot's record must be written again: it
    /// may not reflect entries from `covered` on, and until a record does they hold the
    /// journal (a slot written no more would hold it for ever).
    pub(super) fn settled(&mut self, s: u32, claimed: bool, covered: u64) -> bool {
        let Some(w) = self.slots.get_mut(&s) else {
            return false;
        };
        let again = w.settle(claimed, covered);
        self.prune(s);
        again
    }

    /// True if nothing holds the journal for write-back.
    pub(super) fn quiet(&self) -> bool {
        self.inflight.is_empty() && self.slots.values().all(|w| w.from == NONE)
    }

    /// A restart restored dirty pages into slot `s` from records and the live journal
    /// from block `tail`.
    pub(super) fn restored(&mut self, s: u32, tail: u64, hold: SlotHold) {
        let w = self.slot(s);
        w.held = Some(hold);
        w.rec_dirty = true;
        w.from = tail;
    }

    /// Some slot is held.
    fn any_held(&self) -> bool {
        self.slots.values().any(|w| w.held.is_some())
    }
}

impl WbSlot {
    /// [`Wb::settled`] for this slot; the snapshot's flags are used up.
    fn settle(&mut self, claimed: bool, covered: u64) -> bool {
        self.rec_dirty = claimed && self.snap_dirty;
        let refused = self.snap_refused;
        (self.snap_dirty, self.snap_refused) = (false, false);
        if self.from == NONE {
            return false;
        }
        // A record that claims nothing because the slot holds nothing (not one refused its
        // claim) reflects the journal as well: its entries are over.
        let reflects = claimed || !refused;
        if reflects && self.last < covered {
            self.from = NONE;
            return false;
        }
        if reflects {
            self.from = covered;
        }
        true
    }
}

/// A page a write-back write is about to write into the cache.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WbPage {
    /// Global slot and fragment, and the page within it.
    pub slot: u32,
    pub frag: u64,
    pub page: u32,
    /// Checksum of the new content, bytes of the page, what it held before.
    pub crc: u32,
    pub len: u16,
    pub prev: PrevPage,
}

/// What a write-back write waits for, and what it must do under the core lock.
pub(crate) struct WbGuard {
    pub tickets: Vec<Ticket>,
    /// The block of its first entry (pass to `writeback_done`).
    pub first: u64,
    /// Global slots to hold in the core now.
    pub hold: Vec<u32>,
}

impl Persist {
    /// Under the core lock, after the core planned a write-back write of `pages` whose
    /// copies go to `copies` (global slot, fragment): appends the dirty entries and sets the
    /// intents of slots whose records may claim another fragment. None if the journal ring
    /// has no room now: the caller gives the write up and waits for a flush round.
    pub(crate) fn guard_writeback(
        &self,
        pages: &[WbPage],
        copies: impl Iterator<Item = (u32, u64)>,
    ) -> Option<WbGuard> {
        let mut st = self.st.lock();
        if !st.journal.room_for(pages.len()) {
            self.round_wanted.store(true, Relaxed);
            return None;
        }
        let first = st.journal.covered();
        let mut last = None;
        let mut hold = Vec::new();
        for p in pages {
            let (volume, frag) = self.local(p.frag);
            let e = JournalEntry {
                frag,
                volume,
                first: p.page as u16,
                pages: 1,
                dirty: Some(DirtyPage {
                    slot: p.slot,
                    crc: p.crc,
                    prev: p.prev,
                    len: p.len,
                }),
            };
            let Some(Ticket::Journal(seq)) = st.journal.append(e) else {
                unreachable!("room was checked");
            };
            last = Some(Ticket::Journal(seq));
            let w = st.wb.slot(p.slot);
            w.last = seq;
            if w.from == NONE {
                w.from = seq;
            }
            if w.held.is_none() && !hold.contains(&p.slot) {
                hold.push(p.slot);
            }
        }
        *st.wb.inflight.entry(first).or_default() += 1;
        let mut tickets: Vec<Ticket> = last.into_iter().collect();
        for (s, f) in copies {
            let m = st.claims.of(s);
            if m != sce_store::unit::NO_FRAGMENT && m != f {
                tickets.extend(st.touch(s));
            }
        }
        if st.journal.half_full() {
            self.round_wanted.store(true, Relaxed);
        }
        self.counters
            .journal_appends
            .fetch_add(pages.len() as u64, Relaxed);
        Some(WbGuard {
            tickets,
            first,
            hold,
        })
    }

    /// After the device was flushed for an NBD FLUSH or FUA: records in the superblock that
    /// every dirty entry below the journal block it returns belongs to a write whose data
    /// that flush made durable, so that a load tells a damaged page from a torn one (see
    /// `sce_store::Superblock::journal_landed`). Call `landed_mark` *before* the device
    /// flush and pass its value here after it: only writes whose data writes had completed
    /// when the mark was taken are covered.
    pub(crate) fn record_landed(&self, mark: u64) -> Result<(), IoError> {
        let mut sb = self.sb.lock();
        if mark <= sb.journal_landed || sb.state == sce_store::DeviceState::Failed {
            return Ok(());
        }
        sb.journal_landed = mark;
        self.write_sb_with(&mut sb, false)
    }

    /// The journal block below which every dirty entry belongs to a write whose data write
    /// has completed: the lowest first block of a write-back write in flight, or the durable
    /// end of the journal.
    pub(crate) fn landed_mark(&self) -> u64 {
        let st = self.st.lock();
        let durable = st.journal.durable_end();
        st.wb
            .inflight
            .keys()
            .next()
            .map_or(durable, |&f| f.min(durable))
    }

    /// A write-back write whose first entry is in block `first` completed (or failed).
    pub(crate) fn writeback_done(&self, first: u64) {
        let mut st = self.st.lock();
        if let Some(n) = st.wb.inflight.get_mut(&first) {
            *n -= 1;
            if *n == 0 {
                st.wb.inflight.remove(&first);
            }
        }
    }

    /// Under core shard `k`'s lock: the global slots of `[lo, hi)` whose holds can go (their
    /// durable records claim no dirty page and no live entry names them), given
    /// `dirty(s)`: the slot has dirty pages in the core. Marks them released.
    pub(crate) fn releasable(
        &self,
        lo: u32,
        hi: u32,
        dirty: impl Fn(u32) -> bool,
    ) -> Vec<SlotHold> {
        let mut st = self.st.lock();
        let wb = &mut st.wb;
        let mut out = Vec::new();
        let mut gone = Vec::new();
        for (&s, w) in wb.slots.range_mut(lo..hi) {
            if w.held.is_some() && !w.rec_dirty && w.from == NONE && !dirty(s) {
                out.extend(w.held.take());
                gone.push(s);
            }
        }
        for s in gone {
            wb.prune(s);
        }
        out
    }

    /// Under the core lock that took them: keeps the holds of slots `guard_writeback` asked
    /// for (global slot, hold), until a round finds their claims gone.
    pub(crate) fn keep_holds(&self, holds: Vec<(u32, SlotHold)>) {
        let mut st = self.st.lock();
        for (s, h) in holds {
            if let Some(old) = st.wb.slot(s).held.replace(h) {
                // Never: a slot is asked to be held only while it is not. Give it up rather
                // than lose it.
                debug_assert!(false, "slot {s} held twice");
                old.abandon();
            }
        }
    }

    /// After a round: releases the holds of slots whose dirty claims are gone from the
    /// device (core, then state, shard by shard).
    pub(super) fn release_holds(&self, cores: &crate::cores::Cores) {
        if !self.st.lock().wb.any_held() {
            return;
        }
        cores.each_shard(|k, core| {
            let (lo, hi) = cores.slot_range(k);
            let released = self.releasable(lo, hi, |s| {
                let f = core.slot_state(cores.slot(s).1).0;
                f.is_some_and(|f| {
                    core.dirty_pages_of(f).is_some() || core.lost_pages_of(f).is_some()
                })
            });
            for hold in released {
                hold.release(core);
            }
        });
    }

    /// At start: slot `s` came back with dirty pages (the caller holds it in the core).
    pub(crate) fn restored_dirty(&self, s: u32, hold: SlotHold) {
        // The live journal may hold the only durable claims of these pages: keep it until a
        // round has written their records.
        let tail = self.sb.lock().journal_tail;
        let mut st = self.st.lock();
        st.journal.keep_from(tail);
        st.wb.restored(s, tail, hold);
        let u = self.layout.unit_of(s).0;
        st.units.insert(u);
    }
}

impl State {
    /// True if no write-back claim keeps the journal.
    pub(super) fn wb_quiet(&self) -> bool {
        self.wb.quiet()
    }
}
