//! The log writer's state: positions, sequence numbers, what is completed and not yet
//! committed. No I/O: the caller holds it under a mutex and does the device writes.

mod lending;
pub use lending::LendStep;
mod records;

use super::record::record_link;
use super::{
    commit_reserve, Anchor, LogEntry, LogRegion, Replayed, ENTRIES_PER_RECORD, LOG_BLOCK,
    MAX_COMMIT_RECORDS,
};
use sce_io::AlignedBuf;
use std::collections::VecDeque;
use std::ops::Range;

/// Why [`LogWriter::allocate`] or [`LogWriter::prepare_commit`] refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    /// Commit first: the write would put more than [`LogRegion::max_gap`] positions between
    /// the last commit and the next. The next `prepare_commit` returns a commit (empty if
    /// nothing completed).
    Commit,
    /// The ring is full up to the durable anchor: clean, move the tail, make a newer anchor
    /// durable ([`LogWriter::anchor_candidate`]) and call `set_anchor`.
    Ring,
    /// More pages than [`LogRegion::max_write`]: split the write.
    TooLarge,
}

/// A commit ready to be written: `bytes` at log position `lpos` (device offset
/// `region.offset_of(lpos)`) as one device write, and the same `bytes` at `mirror_at` if
/// set (the second copies, in the mirror area: another device write, which may run beside
/// the first), then a flush of the device, then [`LogWriter::committed`] (or
/// [`LogWriter::commit_failed`]).
#[derive(Debug)]
pub struct PreparedCommit {
    /// Its first record's position.
    pub lpos: u64,
    /// The sequence numbers of its records.
    pub seqs: Range<u64>,
    /// The records: once each (`records` blocks) when their second copies go to the mirror
    /// area, else each twice, side by side (`2 x records` blocks).
    pub bytes: AlignedBuf,
    /// Where the second copies go on the device (the mirror area), if they do not lie in
    /// `bytes`.
    pub mirror_at: Option<u64>,
    /// Entries it commits.
    pub entries: usize,
}

impl PreparedCommit {
    /// The anchor naming this commit (valid once it is durable).
    pub fn anchor(&self) -> Anchor {
        Anchor::Commit {
            lpos: self.lpos,
            seq: self.seqs.start,
        }
    }
}

/// A commit written and not yet known durable.
#[derive(Debug)]
struct InFlight {
    lpos: u64,
    first_seq: u64,
    entries: Vec<LogEntry>,
    tail: u64,
    mirror_slot: Option<u64>,
    failed: bool,
}

/// The writer's state of one log (see the module's doc).
#[derive(Debug)]
pub struct LogWriter {
    region: LogRegion,
    key: [u8; 16],
    epoch: u64,
    head: u64,
    tail: u64,
    anchor: Anchor,
    next_seq: u64,
    /// [`record_link`] of the last committed record (None: none since the anchor).
    link: Option<u64>,
    committed_end: u64,
    resumed_from: u64,
    pending: Vec<LogEntry>,
    in_flight: Option<InFlight>,
    need_commit: bool,
    /// (position, seq) of the first record of each committed commit since the anchor.
    commits: VecDeque<(u64, u64)>,
    /// Lost pages carried forward in tombstones ([`Self::set_carried`]).
    carried: u64,
    /// The seq of the record each mirror slot holds (0: none known).
    mirror_seq: Vec<u64>,
    /// The mirror slot the next commit's second copies go to first.
    mirror_next: u64,
    /// Commits whose second copies went beside the first because every mirror slot was
    /// still needed by replay.
    beside: u64,
    /// The tail the newest durable commit records: a replay drops every version below it.
    committed_tail: u64,
    /// Positions before the anchor that only copies ([`Self::allocate_copy`]) and the commit
    /// that follows them may take ([`LogWriter::copy_reserve`]).
    copy_reserve: u64,
    /// Copies were allocated (or a loss carried) since the last commit: the next one may
    /// use the reserve.
    copies: bool,
    /// Lent chunks ([`super::Lend`]): the lap the last position taken is in, the chunks
    /// written in it and in the lap before, and the chunks writes may use from now on.
    head_lap: u64,
    head_chunks: u64,
    prev_chunks: u64,
    usable: u64,
    /// Positions skipped (start, length, of which the gap between commits does not count)
    /// since the anchor: chunks a lap did not use, ends of
    /// chunks and laps a write did not fit.
    skips: VecDeque<(u64, u64, u64)>,
}

impl LogWriter {
    /// A writer of a fresh log starting at `lpos` whose first commit has seq `next_seq`
    /// (at least 1): its durable anchor is `Anchor::Empty { lpos, next_seq }`.
    pub fn new(
        region: LogRegion,
        key: [u8; 16],
        lpos: u64,
        next_seq: u64,
    ) -> Result<Self, crate::StoreError> {
        region.check()?;
        assert!(next_seq >= 1, "sequence numbers start at 1");
        Ok(LogWriter {
            region,
            key,
            epoch: rand::random(),
            head: lpos,
            tail: lpos,
            anchor: Anchor::Empty { lpos, next_seq },
            next_seq,
            link: None,
            committed_end: lpos,
            resumed_from: 0,
            pending: Vec::new(),
            in_flight: None,
            need_commit: false,
            commits: VecDeque::new(),
            carried: 0,
            mirror_seq: vec![0; region.mirror_blocks as usize],
            mirror_next: 0,
            beside: 0,
            committed_tail: lpos,
            copy_reserve: Self::copy_reserve(region),
            copies: false,
            head_lap: lpos / region.lap(),
            head_chunks: 0,
            prev_chunks: 0,
            usable: 0,
            skips: VecDeque::new(),
        })
    }

    /// The writer that continues a replayed log (`r` from [`super::replay`] with the same
    /// region and key). Its first commit names the commit replay ended with, whose data may
    /// be torn, so that a later replay does not take those pages for damage.
    ///
    /// # Panics
    /// If the replay did not find its anchor ([`Replayed::anchor_missing`]).
    pub fn resume(region: LogRegion, key: [u8; 16], r: &Replayed) -> Self {
        assert!(!r.anchor_missing(), "the replay lost its anchor commit");
        let mut mirror_seq = r.mirror_seqs.clone();
        mirror_seq.resize(region.mirror_blocks as usize, 0);
        // After the newest record the mirror holds: the oldest come next.
        let newest = (mirror_seq.iter().enumerate())
            .max_by_key(|&(_, &s)| s)
            .filter(|&(_, &s)| s > 0)
            .map(|(i, _)| i as u64 + 1);
        LogWriter {
            region,
            key,
            epoch: rand::random(),
            head: r.head,
            tail: r.tail,
            anchor: r.anchor,
            next_seq: r.next_seq,
            link: r.link,
            committed_end: r.head,
            resumed_from: r.last_group_first.unwrap_or(0),
            pending: Vec::new(),
            in_flight: None,
            need_commit: false,
            commits: r.last_commit.into_iter().collect(),
            carried: 0,
            mirror_seq,
            mirror_next: newest.unwrap_or(0) % region.mirror_blocks.max(1),
            beside: 0,
            committed_tail: r.tail,
            copy_reserve: Self::copy_reserve(region),
            copies: false,
            // The laps since the anchor used at most the chunks lent when it crashed.
            head_lap: r.head.saturating_sub(1) / region.lap(),
            head_chunks: r.lent,
            prev_chunks: r.lent,
            usable: r.lent,
            skips: VecDeque::new(),
        }
    }

    /// The most versions one round of copies moves forward ([`Self::allocate_copy`]): 64,
    /// or a 32nd of the ring if less.
    pub fn copies_per_round(region: LogRegion) -> u64 {
        (region.blocks / 32).clamp(1, 64)
    }

    /// Positions kept before the anchor for one round of copies and their commit: no
    /// client write and no other commit takes them, so that a ring full behind a version
    /// that cannot be cleaned can always move it forward, after a restart too.
    fn copy_reserve(region: LogRegion) -> u64 {
        let n = Self::copies_per_round(region);
        n + commit_reserve(n)
    }

    /// The log's region.
    pub fn region(&self) -> LogRegion {
        self.region
    }
    /// The next free position.
    pub fn head(&self) -> u64 {
        self.head
    }
    /// The oldest position still needed.
    pub fn tail(&self) -> u64 {
        self.tail
    }
    /// Positions in use: written and not yet released by the tail (skipped ones not
    /// counted).
    pub fn used(&self) -> u64 {
        self.head - self.tail - self.skipped_since(self.tail)
    }
    /// The durable anchor.
    pub fn anchor(&self) -> Anchor {
        self.anchor
    }
    /// The next commit's sequence number.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }
    /// Where the last committed commit ends.
    pub fn committed_end(&self) -> u64 {
        self.committed_end
    }
    /// Positions left before the ring reaches the durable anchor, were every lendable
    /// chunk lent (skipped positions not counted as used).
    pub fn room(&self) -> u64 {
        let a = self.anchor.lpos();
        let used = self.head.saturating_sub(a) - self.skipped_since(a);
        self.region.lap().saturating_sub(used)
    }

    /// Completed entries no commit has taken yet.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
    /// The lowest position a replay may still bring a version back from: versions below it
    /// are below the durable anchor, or below the tail the newest durable commit records.
    /// (A version the caller cleaned at or above it would come back after a crash: harmless
    /// while the source holds those bytes, stale once the source was written behind the
    /// log, which a cleaned entry must then supersede.)
    pub fn replay_floor(&self) -> u64 {
        self.committed_tail.max(self.anchor.lpos())
    }

    /// True if the records committed since the anchor take three quarters of the mirror
    /// area: only cleaning (which moves the anchor) frees its slots, and once they are all
    /// needed, the second copies go beside the first.
    pub fn mirror_short(&self) -> bool {
        let m = self.region.mirror_blocks;
        m > 0 && self.next_seq.saturating_sub(self.anchor.seq()) * 4 >= m * 3
    }

    /// Commits whose second copies went beside the first, in the ring, because every slot
    /// of the mirror area still held a record replay needs (or the region has none).
    pub fn commits_beside(&self) -> u64 {
        self.beside
    }
    /// True while a prepared commit is neither committed nor failed.
    pub fn commit_in_flight(&self) -> bool {
        self.in_flight.as_ref().is_some_and(|f| !f.failed)
    }

    /// Where data writes and commits other than the copies' must end: the copy reserve
    /// before the anchor's position one lap on.
    fn limit_but_copies(&self) -> u64 {
        self.limit() - self.copy_reserve
    }

    fn limit(&self) -> u64 {
        self.anchor.lpos() + self.region.lap()
    }

    /// `n` consecutive positions for a data write of `n` pages, never crossing the ring's
    /// end (the positions skipped at the end of a lap stay unused). Refuses if the write,
    /// with room for the commits that must follow ([`super::commit_reserve`]), would reach
    /// the durable anchor's position one lap on, or lie more than `max_gap` positions past
    /// the last commit.
    pub fn allocate(&mut self, n: u64) -> Result<u64, Full> {
        self.allocate_leaving(n, 0)
    }

    /// `n` positions for copies of versions the caller moves forward (from the tail to
    /// the head: the same bytes, committed as new versions), reserving room only for the
    /// commits of what is uncommitted now (positions allocated since the last commit, the
    /// pending entries, these copies and carried losses), not for every position since the
    /// tail as [`Self::allocate`] does: the copies are what lets the tail move when the ring
    /// is full behind a version that cannot be cleaned. Clients' writes leave a spare for
    /// them ([`Self::allocate_leaving`]).
    pub fn allocate_copy(&mut self, n: u64) -> Result<u64, Full> {
        if n == 0 || n > self.region.max_write() {
            return Err(Full::TooLarge);
        }
        let at = self.place(n);
        let end = at + n;
        let uncommitted = end - self.committed_end + self.pending.len() as u64 + self.carried;
        if end + self.reserve_after(end, uncommitted) > self.limit() {
            return Err(Full::Ring);
        }
        if self.gap(at, end) > self.region.max_gap() {
            self.need_commit = true;
            return Err(Full::Commit);
        }
        self.advance(at, end);
        self.copies = true;
        Ok(at)
    }

    /// [`Self::allocate`], leaving `spare` more positions free before the anchor: what a
    /// client's write leaves for the writes that copy forward the versions holding the tail
    /// (which allocate with none), so that those always find room.
    pub fn allocate_leaving(&mut self, n: u64, spare: u64) -> Result<u64, Full> {
        if n == 0 || n > self.region.max_write() {
            return Err(Full::TooLarge);
        }
        let at = self.place(n);
        let end = at + n;
        let k = end - self.tail - self.skipped_since(self.tail) - (at - self.head) + self.carried;
        if end + self.reserve_after(end, k) + spare > self.limit_but_copies() {
            return Err(Full::Ring);
        }
        if self.gap(at, end) > self.region.max_gap() {
            self.need_commit = true;
            return Err(Full::Commit);
        }
        self.advance(at, end);
        Ok(at)
    }

    /// These data pages' writes completed (were acknowledged), in this order. A page must
    /// not have two writes in flight at once (the newest completion is its newest version).
    pub fn completed(&mut self, entries: &[LogEntry]) {
        debug_assert!(entries
            .iter()
            .all(|e| !e.is_data() || (e.lpos >= self.tail && e.lpos < self.head)));
        self.pending.extend_from_slice(entries);
    }

    /// The source now holds the newest bytes of `page` of `volume` (written there and
    /// flushed): a cleaned entry for it goes into the next commit, after which no replay
    /// brings back a version of it the log held before. The caller makes sure the source
    /// write is durable before the commit is. `frees_tail`: the caller holds versions of the
    /// page (or a loss) at the tail until this entry is durable, so its commit may take the
    /// copy reserve (as a tombstone's): else a ring full up to that reserve would wait for
    /// room only this commit's durability frees.
    pub fn supersede(&mut self, volume: u32, page: u64, frees_tail: bool) {
        self.pending.push(LogEntry::cleaned(volume, page));
        self.need_commit = true;
        self.copies |= frees_tail;
    }

    /// Carries the loss of `page` of `volume` forward: a tombstone for it goes into the next
    /// commit (which is then wanted even if no write completed), after which the caller may
    /// let its tail pass where the loss was recorded before.
    pub fn carry_lost(&mut self, volume: u32, page: u64) {
        self.pending.push(LogEntry::tombstone(volume, page));
        self.need_commit = true;
        // It lets the tail move past the loss: its commit may take the copy reserve.
        self.copies = true;
    }

    /// Lost pages the caller carries forward: [`Self::allocate`] keeps room for commits of
    /// that many tombstones besides the entries of every position since the tail, so that
    /// a loss holding the tail can always be carried on and the ring never stops for it.
    pub fn set_carried(&mut self, lost: u64) {
        self.carried = lost;
    }

    /// The next [`Self::prepare_commit`] writes a commit even with no entry pending: a *seal*
    /// written after the last commit's flush completed, which proves to a replay that this
    /// commit was durable (a replay treats the last commit's damaged entries as possibly
    /// torn, for its flush may not have completed; with a seal after it, they are damage).
    pub fn request_seal(&mut self) {
        self.need_commit = true;
    }

    /// True if the next [`Self::prepare_commit`] writes a commit even with no entry pending
    /// (a seal was asked for, or [`Self::allocate`] said `Full::Commit`).
    pub fn commit_wanted(&self) -> bool {
        self.need_commit
    }

    /// A commit of every completed, uncommitted entry (at most [`MAX_COMMIT_RECORDS`]
    /// records' worth, and fewer if the ring has room for fewer: call again for the rest),
    /// or None if there is nothing to commit.
    /// After [`Self::commit_failed`] it returns the same commit again (same position, same
    /// bytes), to be retried. One commit at a time: the caller serialises them.
    /// `Full::Ring` (rare, see [`super::commit_reserve`]): clean, move the tail and the
    /// anchor, and call again.
    ///
    /// # Panics
    /// If a commit is in flight.
    pub fn prepare_commit(&mut self) -> Result<Option<PreparedCommit>, Full> {
        if let Some(f) = &mut self.in_flight {
            assert!(f.failed, "a commit is already in flight");
            f.failed = false;
            let (lpos, seq, tail, slot) = (f.lpos, f.first_seq, f.tail, f.mirror_slot);
            let entries = std::mem::take(&mut f.entries);
            let p = self.encode(lpos, seq, tail, &entries, slot);
            self.in_flight.as_mut().expect("in flight").entries = entries;
            return Ok(Some(p));
        }
        if self.pending.is_empty() && !self.need_commit {
            return Ok(None);
        }
        let want = (self.pending.len())
            .min(MAX_COMMIT_RECORDS * ENTRIES_PER_RECORD)
            .div_ceil(ENTRIES_PER_RECORD)
            .max(1) as u64;
        let limit = if self.copies {
            self.limit()
        } else {
            self.limit_but_copies()
        };
        // As many records as fit, down to one: a ring short of room commits the oldest
        // entries first, and what they release (versions a cleaned entry supersedes hold
        // the tail until it is durable) makes room for the rest. All or nothing, a commit of
        // many cleaned entries could wait for room only its own durability frees.
        let placed = (1..=want).rev().find_map(|records| {
            // Second copies in the mirror area when a slot run is free there; else beside
            // the first copies.
            let slot = self.mirror_slots(records, self.place(records));
            let ring = if slot.is_some() { records } else { 2 * records };
            let at = self.place(ring);
            (at + ring <= limit).then_some((records, slot, ring, at))
        });
        let Some((records, slot, ring, at)) = placed else {
            return Err(Full::Ring);
        };
        let take = (self.pending.len()).min(records as usize * ENTRIES_PER_RECORD);
        if slot.is_none() {
            self.beside += 1;
        }
        if let Some(s) = slot {
            for i in 0..records {
                self.mirror_seq[(s + i) as usize] = self.next_seq + i;
            }
            self.mirror_next = (s + records) % self.region.mirror_blocks;
        }
        self.advance(at, at + ring);
        self.need_commit = false;
        // The reserve stays open to the rest if this commit took only part (the entry that
        // opened it may be in the rest).
        self.copies &= take < self.pending.len();
        let entries: Vec<LogEntry> = self.pending.drain(..take).collect();
        let p = self.encode(at, self.next_seq, self.tail, &entries, slot);
        self.in_flight = Some(InFlight {
            lpos: at,
            first_seq: self.next_seq,
            entries,
            tail: self.tail,
            mirror_slot: slot,
            failed: false,
        });
        Ok(Some(p))
    }

    /// `p` is durable (its write and the flush after it completed).
    pub fn committed(&mut self, p: &PreparedCommit) {
        let f = self.in_flight.take().expect("a commit in flight");
        assert_eq!(
            (f.lpos, f.first_seq),
            (p.lpos, p.seqs.start),
            "another commit"
        );
        let block = LOG_BLOCK as usize;
        let last = p.bytes.len() - block;
        self.link = Some(record_link(&p.bytes[last..last + block]));
        self.next_seq = p.seqs.end;
        self.committed_end = p.lpos + (p.bytes.len() / block) as u64;
        self.resumed_from = 0;
        self.committed_tail = self.committed_tail.max(f.tail);
        self.commits.push_back((p.lpos, p.seqs.start));
    }

    /// `p`'s write or flush failed: the next [`Self::prepare_commit`] returns it again.
    pub fn commit_failed(&mut self, p: &PreparedCommit) {
        let f = self.in_flight.as_mut().expect("a commit in flight");
        assert_eq!(
            (f.lpos, f.first_seq),
            (p.lpos, p.seqs.start),
            "another commit"
        );
        f.failed = true;
    }

    /// Positions below `lpos` are no longer needed. Before the tail passes *any* version of
    /// a page, the caller must have written that page's newest completed version (wherever
    /// it lies in the log) to the source and flushed the source: replay drops every version
    /// below the tail and may skip the page's newer versions above it (torn: their commit's
    /// flush never completed), and then the page reads from the source. (Cleaning only the
    /// pages whose newest version lies below the tail serves older bytes after a crash: the
    /// crash model fails.) `lpos` may not pass a data write still in flight: its entry would
    /// be committed below the tail and dropped.
    pub fn set_tail(&mut self, lpos: u64) {
        assert!(lpos <= self.head, "the tail passes the head");
        self.tail = self.tail.max(lpos);
    }

    /// The caller made `anchor` durable (in its superblock): replay will start there, so
    /// positions below it may be overwritten one lap on. It must be at or below the tail
    /// (see [`Self::anchor_candidate`]).
    pub fn set_anchor(&mut self, anchor: Anchor) {
        assert!(anchor.lpos() <= self.tail, "an anchor above the tail");
        assert!(anchor.lpos() >= self.anchor.lpos(), "an anchor moved back");
        self.anchor = anchor;
        while self.commits.front().is_some_and(|c| c.0 < anchor.lpos()) {
            self.commits.pop_front();
        }
        while self.skips.front().is_some_and(|s| s.0 < anchor.lpos()) {
            self.skips.pop_front();
        }
    }

    /// The newest anchor the caller may make durable now: the end of the log if everything
    /// committed is older than the tail, else the newest committed commit at or below the
    /// tail, else the current anchor.
    pub fn anchor_candidate(&self) -> Anchor {
        if self.in_flight.is_none() && self.tail >= self.committed_end {
            return Anchor::Empty {
                lpos: self.committed_end,
                next_seq: self.next_seq,
            };
        }
        self.commits
            .iter()
            .rev()
            .find(|c| c.0 <= self.tail)
            .map_or(self.anchor, |&(lpos, seq)| Anchor::Commit { lpos, seq })
    }
}
