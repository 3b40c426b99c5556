//! The write journal (Mercury's persistent invalidation, page-granular): before a source
//! write to pages that a slot's durable record may claim, the write appends an entry naming
//! the pages and waits until a journal block holding it is durable. Concurrent writers share
//! one block: the entries accumulate in the *open* block under the state lock, and whoever
//! next holds `intent_io` seals and writes every pending block and flushes once (group
//! commit, leader and followers; the followers find their block durable when they get the
//! lock). At load the live entries drop exactly their pages (`sce_store::journal`).
//!
//! # The tail
//! A flush round notes the open block's sequence number before its snapshot: every entry of
//! a lower block was appended before the snapshot, under the core lock of the write that
//! invalidated its pages in the core, so the invalidation made the slot dirty before the
//! snapshot (or an earlier round already wrote a record taken after it). Once the round
//! wrote its records without an error, those blocks are no longer needed: the ring may
//! reuse them and the superblock records the new tail, below which a load ignores blocks.
//! The open block itself stays needed (entries may join it after the note).
//!
//! # The ring
//! Block `seq` lives at ring position `seq % ring`, and again at that position plus half the
//! region (its mirror copy: a damaged copy is read from the other), and is written only if
//! `seq < tail + ring`: a block is never overwritten while its entries may be needed, so a
//! torn block only loses entries of writes that never reached the source. When the ring is
//! full, a write falls back to its slot's write intent (`journal_full_fallbacks`). Once half
//! the ring is taken, the write asks for an early flush round (`round_wanted`), which the
//! intent writer thread runs, so that the ring rarely fills up under a steady write load.

use super::{Persist, Ticket};
use sce_io::{AlignedBuf, BlockDevice, IoError};
use sce_store::journal::{encode_commit_block, JournalEntry, ENTRIES_PER_BLOCK};
use sce_store::layout::BLOCK;
use std::sync::atomic::Ordering::Relaxed;

/// The journal's in-memory state (part of the persistence state, under its lock).
#[derive(Debug)]
pub(super) struct Journal {
    /// Ring blocks in use (at most the layout's).
    ring: u64,
    /// The open block: its sequence number and the entries appended to it so far.
    open_seq: u64,
    open: Vec<JournalEntry>,
    /// Sealed blocks waiting to be written, in sequence order.
    sealed: Vec<(u64, Vec<JournalEntry>)>,
    /// Every block below this sequence number is durable (or was never needed).
    durable: u64,
    /// The lowest sequence number still needed: blocks below it may be overwritten.
    tail: u64,
    /// Blocks whose write failed: never durable, whatever later blocks become.
    failed: std::collections::BTreeSet<u64>,
}

/// Blocks taken by a commit: (sequence number, entries).
pub(super) type Pending = Vec<(u64, Vec<JournalEntry>)>;

impl Journal {
    /// A journal of `ring` blocks whose next block has sequence number `next`.
    pub(super) fn new(ring: u64, next: u64) -> Self {
        Journal {
            ring: ring.max(1),
            open_seq: next,
            open: Vec::new(),
            sealed: Vec::new(),
            durable: next,
            tail: next,
            failed: Default::default(),
        }
    }

    /// Appends `e`; the ticket to wait for, or None if the ring is full (the caller falls
    /// back to the slot's write intent).
    pub(super) fn append(&mut self, e: JournalEntry) -> Option<Ticket> {
        if let Some(last) = self.open.last() {
            // The same pages again (a rewrite before the commit): one entry covers both.
            if *last == e {
                return Some(Ticket::Journal(self.open_seq));
            }
        }
        if self.open.len() == ENTRIES_PER_BLOCK {
            self.sealed
                .push((self.open_seq, std::mem::take(&mut self.open)));
            self.open_seq += 1;
        }
        if self.open_seq >= self.tail + self.ring {
            return None;
        }
        self.open.push(e);
        Some(Ticket::Journal(self.open_seq))
    }

    /// True once half the ring is taken: a flush round should run now rather than at its
    /// interval, to free blocks before writes fall back to intents.
    pub(super) fn half_full(&self) -> bool {
        self.open_seq - self.tail >= self.ring.div_ceil(2)
    }

    /// True if block `seq` is durable.
    pub(super) fn durable(&self, seq: u64) -> bool {
        seq < self.durable && !self.failed.contains(&seq)
    }

    /// Blocks `seqs` could not be written (their entries are gone).
    pub(super) fn failed(&mut self, seqs: impl Iterator<Item = u64>) {
        self.failed.extend(seqs);
    }

    /// True if entries wait to be written (in the open block or sealed ones).
    pub(super) fn has_pending(&self) -> bool {
        !self.open.is_empty() || !self.sealed.is_empty()
    }

    /// Seals the open block and takes every block waiting to be written.
    pub(super) fn take_pending(&mut self) -> Pending {
        if !self.open.is_empty() {
            self.sealed
                .push((self.open_seq, std::mem::take(&mut self.open)));
            self.open_seq += 1;
        }
        std::mem::take(&mut self.sealed)
    }

    /// The blocks up to `last` were written and flushed.
    pub(super) fn written(&mut self, last: u64) {
        self.durable = self.durable.max(last + 1);
    }

    /// The tail a flush round starting now may establish: the open block's sequence number.
    pub(super) fn covered(&self) -> u64 {
        self.open_seq
    }

    /// A round made the records durable that cover every block below `tail`. Returns true
    /// if the tail moved.
    pub(super) fn advance(&mut self, tail: u64) -> bool {
        let moved = tail > self.tail;
        self.tail = self.tail.max(tail);
        moved
    }

    /// At a clean close (every record durable, nothing in flight): forgets what was never
    /// written and returns a tail above every block, so the next load replays none.
    pub(super) fn take_pending_tail(&mut self) -> u64 {
        self.take_pending();
        self.tail = self.open_seq;
        self.tail
    }

    /// The current tail.
    pub(super) fn tail(&self) -> u64 {
        self.tail
    }

    /// The ring position of block `seq`.
    fn position(&self, seq: u64) -> u32 {
        (seq % self.ring) as u32
    }
}

/// The journal region's halves: block `b` of the ring is written at `b` and at `b + half`.
/// The ring uses at most `half` blocks.
pub(super) fn mirror_half(l: &sce_store::Layout) -> u32 {
    (l.journal_blocks / 2).max(1)
}

impl Persist {
    /// True if writes are journaled.
    pub(super) fn journal_on(&self) -> bool {
        self.cfg.journal
    }

    /// True if the journal ring filled up to half (or overflowed) since the last round: the
    /// caller should wake a thread to run a flush round early (`take_round_wanted`).
    pub(crate) fn round_wanted(&self) -> bool {
        self.round_wanted.load(Relaxed)
    }

    /// Clears and returns `round_wanted`.
    pub(crate) fn take_round_wanted(&self) -> bool {
        self.round_wanted.swap(false, Relaxed)
    }

    /// Writes the journal blocks waiting to be written (the caller holds `intent_io` and
    /// flushes the device afterwards). Returns the last sequence number written, if any.
    pub(super) fn write_journal(&self) -> Result<Option<u64>, IoError> {
        let (pending, positions): (Pending, Vec<u32>) = {
            let mut st = self.st.lock();
            let p = st.journal.take_pending();
            let pos = p.iter().map(|(seq, _)| st.journal.position(*seq)).collect();
            (p, pos)
        };
        let (Some(first), Some(last)) = (pending.first().map(|b| b.0), pending.last().map(|b| b.0))
        else {
            return Ok(None);
        };
        let half = mirror_half(&self.layout);
        let ring = self.st.lock().journal.ring as u32;
        let mut buf = AlignedBuf::new(BLOCK as usize);
        // Each block twice, at its position in each half of the region: damage to one copy
        // loses nothing. Both copies go before the commit's one flush: a crash may tear
        // both, but only blocks of this commit, whose writes were not acknowledged.
        for mirror in [0, half] {
            for ((seq, entries), &at) in pending.iter().zip(&positions) {
                let r = self.write_block(&mut buf, (*seq, at + mirror), (first, ring), entries);
                if let Err(e) = r {
                    // Whoever waits for these blocks must not find them durable later, when
                    // a following commit moves the durable mark past them.
                    let seqs = pending.iter().map(|b| b.0);
                    self.st.lock().journal.failed(seqs);
                    return Err(e);
                }
                // Blocks count once; bytes count both copies (what the device wrote).
                self.counters
                    .journal_blocks
                    .fetch_add((mirror == 0) as u64, Relaxed);
                self.counters.journal_bytes.fetch_add(BLOCK, Relaxed);
            }
        }
        Ok(Some(last))
    }

    /// At a start, before anything is served: writes an empty block (both copies) for each
    /// block the load found gone (`gaps`: torn blocks of the last commit, or damage that the
    /// load already answered for), at its position in the ring it was written in, so that
    /// the journal is whole again: otherwise, once later commits follow, a torn block of an
    /// unacknowledged commit would look like damage to an acknowledged one. The start's
    /// superblock write flushes them.
    pub(super) fn fill_journal_gaps(&self, (gaps, ring): &(Vec<u64>, u32)) -> Result<(), IoError> {
        let Some(&first) = gaps.first() else {
            return Ok(());
        };
        let (half, ring) = (mirror_half(&self.layout), (*ring).max(1));
        let mut buf = AlignedBuf::new(BLOCK as usize);
        for &seq in gaps {
            let at = (seq % ring as u64) as u32;
            for pos in [at, at + half] {
                if pos >= self.layout.journal_blocks {
                    continue;
                }
                self.write_block(&mut buf, (seq, pos), (first, ring), &[])?;
            }
        }
        Ok(())
    }

    /// Writes one copy of journal block `seq`, of the group commit `(first block, ring
    /// length)`, holding `entries`, at position `pos` of the region.
    fn write_block(
        &self,
        buf: &mut AlignedBuf,
        (seq, pos): (u64, u32),
        commit: (u64, u32),
        entries: &[JournalEntry],
    ) -> Result<(), IoError> {
        buf.copy_from_slice(&encode_commit_block(
            &self.uuid,
            (seq, pos),
            commit,
            entries,
        ));
        self.dev
            .write_at(self.layout.journal_block_offset(pos), buf)
    }

    /// After a flush round that wrote every record it had to without an error: the blocks
    /// below `covered` are no longer needed. Records the new tail in the superblock.
    pub(super) fn advance_journal(&self, covered: u64) -> Result<(), IoError> {
        if !self.journal_on() || !self.st.lock().journal.advance(covered) {
            return Ok(());
        }
        let tail = self.st.lock().journal.tail();
        let mut sb = self.sb.lock();
        if sb.state == sce_store::DeviceState::Failed || sb.journal_tail >= tail {
            return Ok(());
        }
        sb.journal_tail = tail;
        self.write_sb_with(&mut sb, false)
    }
}
