//! Write intents and journal entries: what a write needs durable before it is sent (its
//! slots' intent bits, or journal entries naming its pages), setting bits ahead of need on
//! reads of recently written slots (without the journal), and writing the intent and
//! journal blocks (group commit).

use super::journal::Journal;
use super::{Persist, Ticket};
use sce_io::{AlignedBuf, BlockDevice, IoError};
use sce_store::journal::JournalEntry;
use sce_store::layout::{BLOCK, SLOTS_PER_INTENT_BLOCK};
use sce_store::unit::NO_FRAGMENT;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

pub(super) struct State {
    /// Per slot, the fragment its on-device record may claim, and the inverse.
    pub(super) claims: super::claims::Claims,
    /// The intent bitmap as wanted (one bit per slot).
    pub(super) intents: Vec<u64>,
    /// Per intent block: version of the in-memory content, and version known durable.
    pub(super) version: Vec<u64>,
    pub(super) durable: Vec<u64>,
    /// Per slot, a bit: a write touched its claims since a flush round last looked at its
    /// intent (the round clears it when it looks, and clears the intent only if no write set
    /// it again meanwhile). One bit where a pair of per-slot epoch counters took 8 bytes and
    /// could, in principle, wrap back to the value seen.
    pub(super) touched: Vec<u64>,
    /// Slots whose record must be written next round.
    pub(super) redo: Vec<u32>,
    /// Units to rewrite next round.
    pub(super) units: BTreeSet<u32>,
    /// A unit write went wrong: scan every unit next round for one it may have hit.
    pub(super) scrub: bool,
    /// The intent bits, readable without this lock (kept equal to `intents`).
    pub(super) intent_bits: Arc<[AtomicU64]>,
    /// Per slot: the low 32 bits of the version of its intent block that set its bit (the
    /// bit is durable once the block is durable at that version; [`State::set_version`]).
    pub(super) set_version: Vec<u32>,
    /// The write journal's blocks in memory.
    pub(super) journal: Journal,
}

impl State {
    pub(super) fn intent(&self, s: u32) -> bool {
        sce_store::bit(&self.intents, s)
    }

    pub(super) fn set_intent(&mut self, s: u32, on: bool) {
        let (w, b) = (s as usize / 64, s % 64);
        if on {
            self.intents[w] |= 1 << b;
        } else {
            self.intents[w] &= !(1 << b);
        }
        self.intent_bits[w].store(self.intents[w], Relaxed);
        let block = (s as u64 / SLOTS_PER_INTENT_BLOCK) as usize;
        self.version[block] += 1;
        if on {
            self.set_version[s as usize] = self.version[block] as u32;
        }
    }

    /// The version of slot `s`'s intent block that set its bit, from its low 32 bits: the
    /// newest version not above the block's own with those bits. Exact unless the block
    /// changed 2^32 times since the bit was set; then it is newer than the truth (never above
    /// the block's version), and a write only waits for, or journals under, an intent that
    /// was durable already.
    fn set_version(&self, s: u32) -> u64 {
        let now = self.version[(s as u64 / SLOTS_PER_INTENT_BLOCK) as usize];
        now - u64::from((now as u32).wrapping_sub(self.set_version[s as usize]))
    }

    /// A write touched slot `s`'s claims (see `touched`).
    pub(super) fn mark_touched(&mut self, s: u32) {
        self.touched[s as usize / 64] |= 1 << (s % 64);
    }

    /// Whether a write touched slot `s` since the last look.
    pub(super) fn touched(&self, s: u32) -> bool {
        sce_store::bit(&self.touched, s)
    }

    /// Whether a write touched slot `s` since the last look, and forgets that it did.
    pub(super) fn take_touched(&mut self, s: u32) -> bool {
        let t = self.touched(s);
        self.touched[s as usize / 64] &= !(1 << (s % 64));
        t
    }

    /// A write touches slot `s`'s claims: mark it touched, set its intent; the ticket to wait
    /// for, if the intent is not durable yet. Only the version that set *this* bit matters:
    /// other bits of the block changing since (presets, clears) do not make it wait.
    pub(super) fn touch(&mut self, s: u32) -> Option<Ticket> {
        self.mark_touched(s);
        if !self.intent(s) {
            self.set_intent(s, true);
        }
        let block = (s as u64 / SLOTS_PER_INTENT_BLOCK) as u32;
        let v = self.set_version(s);
        (self.durable[block as usize] < v).then_some(Ticket::Intent { block, version: v })
    }

    /// True if slot `s`'s intent is set, and durable as set.
    pub(super) fn intent_durable(&self, s: u32) -> bool {
        let block = (s as u64 / SLOTS_PER_INTENT_BLOCK) as usize;
        self.intent(s) && self.durable[block] >= self.set_version(s)
    }

    /// True if the ticket's block is durable.
    fn done(&self, t: &Ticket) -> bool {
        match *t {
            Ticket::Intent { block, version } => self.durable[block as usize] >= version,
            Ticket::Journal(seq) => self.journal.durable(seq),
        }
    }
}

fn block_image(intents: &[u64], block: u32) -> AlignedBuf {
    let mut buf = AlignedBuf::new(BLOCK as usize);
    let first = block as usize * (BLOCK as usize / 8);
    for (i, w) in intents
        .iter()
        .skip(first)
        .take(BLOCK as usize / 8)
        .enumerate()
    {
        buf[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    buf
}

impl Persist {
    /// Under the core lock, before a write's source write and cache copies are sent: what it
    /// needs durable. `range` is the piece written (global offset, length), `copies` the
    /// slots its cache copies go to, with the fragment each holds.
    ///
    /// With the journal, a fragment whose record may be claimed by a slot gets an entry
    /// naming the pages written (a full ring falls back to the intent), unless the slot is
    /// *write-hot*: its intent is durably set, which covers the write with no I/O at all
    /// (the write marks the slot touched, so no round clears the bit under it). A slot
    /// written again within `warm_rounds` rounds of a journaled write becomes write-hot: its
    /// intent is set now, made durable by the intent writer in the background
    /// (`take_presets`), and the writes after that wait for nothing, as without the journal
    /// (md's write-intent bitmap). The bit is cleared by the first round after `warm_rounds`
    /// rounds without writes to the slot (`write_hot_lately`). The cost: a crash drops
    /// write-hot slots whole, not page by page.
    pub(crate) fn guard_write(
        &self,
        range: (u64, u64),
        copies: impl Iterator<Item = (u32, u64)>,
    ) -> Vec<Ticket> {
        let (offset, len) = range;
        let fsize = self.layout.fragment_size;
        let mut st = self.st.lock();
        let mut t = Vec::new();
        let warm = self
            .round_no
            .load(Relaxed)
            .saturating_add(self.cfg.warm_rounds);
        for f in offset / fsize..=(offset + len - 1) / fsize {
            let Some(s) = st.claims.owner(f) else {
                continue;
            };
            if self.journal_on() {
                if self.cfg.warm_rounds > 0 && st.intent_durable(s) {
                    // Write-hot: the durable intent covers this write, and is held for
                    // `warm_rounds` rounds after it (`write_hot_lately`).
                    st.touch(s);
                    self.warm_until[s as usize].store(warm, Relaxed);
                    self.counters.intent_hits.fetch_add(1, Relaxed);
                    continue;
                }
                let start = f * fsize;
                let lo = offset.max(start) - start;
                let hi = (offset + len).min(start + fsize) - start;
                let (volume, frag) = self.local(f);
                let e = JournalEntry {
                    frag,
                    volume,
                    first: (lo / sce_core::PAGE_SIZE) as u16,
                    pages: (hi.div_ceil(sce_core::PAGE_SIZE) - lo / sce_core::PAGE_SIZE) as u16,
                    dirty: None,
                };
                let ticket = st.journal.append(e);
                if st.journal.half_full() {
                    self.round_wanted.store(true, Relaxed);
                }
                if let Some(ticket) = ticket {
                    self.counters.journal_appends.fetch_add(1, Relaxed);
                    t.push(ticket);
                    self.write_hot(&mut st, s, warm);
                    continue;
                }
                self.counters.journal_full_fallbacks.fetch_add(1, Relaxed);
            } else {
                self.warm_until[s as usize].store(warm, Relaxed);
            }
            t.extend(st.touch(s));
        }
        for (s, f) in copies {
            let m = st.claims.of(s);
            if m != NO_FRAGMENT && m != f {
                t.extend(st.touch(s));
            }
        }
        t
    }

    /// A journaled write to slot `s` (state locked; `warm`: the round until which it counts
    /// as written lately): a second one within the window sets the slot's intent ahead of
    /// the next write, for the intent writer to make durable (nobody waits for it).
    fn write_hot(&self, st: &mut State, s: u32, warm: u32) {
        if self.cfg.warm_rounds == 0 {
            return;
        }
        let w = &self.warm_until[s as usize];
        if w.load(Relaxed) > self.round_no.load(Relaxed) && !st.intent(s) {
            st.set_intent(s, true);
            st.mark_touched(s);
            self.counters.intent_presets.fetch_add(1, Relaxed);
            self.presets_pending.store(true, Relaxed);
        }
        w.store(warm + 1, Relaxed);
    }

    /// With the journal: slot `s` was written within the last `warm_rounds` rounds, so a
    /// round leaves its intent set even through rounds without writes (a slot written every
    /// few seconds keeps its intent, and its writes wait for nothing; clearing it after one
    /// quiet round made most of them journal again).
    pub(super) fn write_hot_lately(&self, s: u32) -> bool {
        self.journal_on()
            && self.cfg.warm_rounds > 0
            && self
                .warm_until
                .get(s as usize)
                .is_some_and(|w| w.load(Relaxed) > self.round_no.load(Relaxed))
    }

    /// True (once) if writes set intents ahead of need since the last call: the caller
    /// wakes the intent writer.
    pub(crate) fn take_presets(&self) -> bool {
        self.presets_pending.load(Relaxed) && self.presets_pending.swap(false, Relaxed)
    }

    /// The fragment to guard a fill with: the fill of a line's page at source offset `src`
    /// to cache offset `cache` (`line` bytes per slot) is that line's if the page sits at
    /// its own place in the slot; otherwise it is a page of the page area, packed among other
    /// lines' pages, and no record may claim its slot unguarded: [`Self::PACKED`].
    pub(crate) fn fill_fragment(src: u64, cache: u64, line: u64) -> u64 {
        if src % line == cache % line {
            src / line
        } else {
            Self::PACKED
        }
    }

    /// What [`Self::guard_slot`] is given for a packed page: a fragment no record names, so
    /// that any claim of the slot sets its intent.
    pub(crate) const PACKED: u64 = u64::MAX - 1;

    /// Under the core lock, before data for fragment `f` is written into slot `s`
    /// (population, inline fill; `f` is [`Self::PACKED`] for a packed page of the page
    /// area, whose place in the slot is not its place in its line).
    pub(crate) fn guard_slot(&self, s: u32, f: u64) -> Option<Ticket> {
        let mut st = self.st.lock();
        let m = st.claims.of(s);
        if m != NO_FRAGMENT && m != f {
            st.touch(s)
        } else {
            None
        }
    }

    /// Slots `slots` were lent to the write-back log (evicted in the core first): before
    /// the log writes there, no on-device record may claim them unguarded, so each one a
    /// record may still claim gets its intent, made durable before this returns (the flush
    /// round then writes the empty record and clears it, as after an eviction).
    pub(crate) fn guard_lent(&self, slots: std::ops::Range<u32>) -> Result<(), IoError> {
        let tickets: Vec<Ticket> = {
            let mut st = self.st.lock();
            let mut t = Vec::new();
            for s in slots {
                if st.claims.of(s) != NO_FRAGMENT {
                    t.extend(st.touch(s));
                }
            }
            t
        };
        self.sync(&tickets)
    }

    /// A read hit slot `s`. If the slot was written in the last `warm_rounds` flush rounds,
    /// its intent is kept set (or set now, ahead of the next write, which then need not wait
    /// for the cache device). Returns true if an intent was set that the intent writer must
    /// make durable (`write_pending`). Lock-free unless it sets the intent.
    pub(crate) fn preset(&self, s: u32) -> bool {
        if self.journal_on() {
            return false;
        }
        let Some(warm) = self.warm_until.get(s as usize) else {
            return false;
        };
        if warm.load(Relaxed) < self.round_no.load(Relaxed) {
            return false;
        }
        let (w, b) = (s as usize / 64, 1u64 << (s % 64));
        if self.read_touch[w].load(Relaxed) & b == 0 {
            self.read_touch[w].fetch_or(b, Relaxed);
        }
        if self.intent_bits[w].load(Relaxed) & b != 0 {
            return false;
        }
        let mut st = self.st.lock();
        if st.intent(s) {
            return false;
        }
        st.set_intent(s, true);
        self.counters.intent_presets.fetch_add(1, Relaxed);
        true
    }

    /// Slot `s` was just populated: it counts as write-warm for `warm_rounds` flush rounds,
    /// so the first reads of it set its intent ahead of a first write.
    pub(crate) fn warm(&self, s: u32) {
        if self.journal_on() {
            return;
        }
        if let Some(w) = self.warm_until.get(s as usize) {
            let until = self
                .round_no
                .load(Relaxed)
                .saturating_add(self.cfg.warm_rounds);
            w.fetch_max(until, Relaxed);
        }
    }

    /// Writes every intent block whose in-memory content is newer than what is durable
    /// (the intents set ahead of need, and those of writes under way) and the journal
    /// entries pending, without anyone waiting for it. A write that needs one of these
    /// meanwhile waits only for the rest of this write.
    pub(crate) fn write_pending(&self) -> Result<(), IoError> {
        let _io = self.intent_io.lock();
        let (blocks, journal): (Vec<u32>, bool) = {
            let st = self.st.lock();
            let blocks = (0..st.version.len() as u32)
                .filter(|&b| st.durable[b as usize] < st.version[b as usize])
                .collect();
            (blocks, st.journal.has_pending())
        };
        if blocks.is_empty() && !journal {
            return Ok(());
        }
        self.write_intent_blocks(&blocks)
    }

    /// Waits until the intent and journal blocks of `tickets` are durable, writing them if
    /// needed. Concurrent callers share writes (group commit): whoever holds `intent_io`
    /// writes every journal block pending by then, and the others find theirs durable.
    pub(crate) fn sync(&self, tickets: &[Ticket]) -> Result<(), IoError> {
        if tickets.is_empty() {
            return Ok(());
        }
        let _io = self.intent_io.lock();
        let mut blocks: Vec<u32> = {
            let st = self.st.lock();
            if tickets.iter().all(|t| st.done(t)) {
                return Ok(());
            }
            tickets
                .iter()
                .filter_map(|t| match *t {
                    Ticket::Intent { block, version } if st.durable[block as usize] < version => {
                        Some(block)
                    }
                    _ => None,
                })
                .collect()
        };
        blocks.sort_unstable();
        blocks.dedup();
        if !blocks.is_empty() {
            self.counters.intent_syncs.fetch_add(1, Relaxed);
        }
        self.write_intent_blocks(&blocks)?;
        // A journal block another writer took and failed to write is not durable: say so,
        // rather than let the source write go ahead unguarded.
        if !tickets.iter().all(|t| self.st.lock().done(t)) {
            return Err(IoError::Failed(
                "a write journal block could not be written".into(),
            ));
        }
        Ok(())
    }

    /// Writes the journal blocks pending and the current content of intent blocks (caller
    /// holds `intent_io`), then flushes (with the superblock).
    pub(super) fn write_intent_blocks(&self, blocks: &[u32]) -> Result<(), IoError> {
        let journaled = self.write_journal()?;
        let mut done = Vec::new();
        for &b in blocks {
            let (img, v) = {
                let st = self.st.lock();
                (block_image(&st.intents, b), st.version[b as usize])
            };
            self.dev
                .write_at(self.layout.intent_offset + b as u64 * BLOCK, &img)?;
            self.counters
                .metadata_bytes_written
                .fetch_add(BLOCK, Relaxed);
            done.push((b, v));
        }
        // The superblock goes with every intent write, with a new sequence number that the
        // state directory records too: a copy of the device taken before this write (a file
        // copy, a snapshot) then carries an older sequence, and a start that is handed that
        // copy back after a crash recognises it, although the copy's intents and records are
        // each sound. Its write flushes the intent blocks as well.
        {
            let mut sb = self.sb.lock();
            if sb.state == sce_store::DeviceState::Failed {
                self.dev.flush()?;
            } else {
                self.write_sb_with(&mut sb, false)?;
            }
        }
        let mut st = self.st.lock();
        for (b, v) in done {
            let d = &mut st.durable[b as usize];
            *d = (*d).max(v);
        }
        if let Some(last) = journaled {
            st.journal.written(last);
        }
        Ok(())
    }
}
