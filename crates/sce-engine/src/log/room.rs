//! Room in the ring (issue 44): one page the cleaner cannot take holds back at most its own
//! room, never the ring.
//!
//! The ring is freed from its tail only, so a version that stays behind (its source write
//! fails: *stuck*) or the record of a loss would hold every position after it, and the log
//! would fill behind it. When the log wants room the cleaner copies each stuck version that
//! holds the tail to the head (a new version of the same bytes, committed, after which the
//! old one is no longer needed: a log-structured store's garbage collection) and carries
//! each loss that holds it forward in a tombstone. The copies allocate from a spare that
//! clients' writes leave free ([`LogBack::spare`]), so they always find room.
//!
//! On a device several exports share, a volume whose source fails writes takes at most its
//! share of the ring, so that one failing source never stops another export's writes.

use super::batch::Unread;
use super::commit::Try;
use super::LogBack;
use sce_core::PAGE_SIZE;
use sce_io::AlignedBuf;
use sce_store::wblog::Dirty;
use sce_store::wblog::{page_crc, LogWriter};
use std::sync::atomic::Ordering::Relaxed;

impl LogBack {
    /// True if the log wants room now: the low watermark reached or the high one passed (the anchor may lag the tail: after a restart, until a commit at or below the
    /// tail is durable), or a drain under way.
    pub(super) fn room_wanted(&self) -> bool {
        let (low, high) = {
            let st = self.st.lock();
            (st.w.used() >= self.low_blocks(&st.w), self.past_high(&st.w))
        };
        low || high || self.forced.load(Relaxed) > 0 || self.waiting.load(Relaxed) > 0
    }

    /// Frees what holds the tail and cannot be cleaned: losses carried forward, stuck
    /// versions copied to the head. Returns the versions copied. The cleaner's (one round
    /// at a time: it holds `clean_io`).
    pub(super) fn make_room(&self) -> u64 {
        let _one = self.clean_io.lock();
        let data_tail = self.st.lock().tail_of_data();
        self.carry_losses(data_tail);
        let holders = self.holders();
        let moved = holders
            .into_iter()
            .filter(|&(g, d)| self.relocate(g, d))
            .count() as u64;
        if moved > 0 {
            self.relocated.fetch_add(moved, Relaxed);
            // The copies committed, the old versions are no longer needed.
            self.autocommit();
            self.settle_tail();
        }
        moved
    }

    /// The stuck versions at the tail worth copying forward: those before the first live
    /// version that is not stuck (at most a round's worth), if copying them frees at least
    /// twice the room the copies take. (Under an outage of the only source every version is
    /// stuck, side by side: copying them would free nothing and only rewrite the log.) At
    /// most a round's worth (`LogWriter::copies_per_round`), which the writer keeps room
    /// for.
    fn holders(&self) -> Vec<(u64, Dirty)> {
        let st = self.st.lock();
        let mut out = Vec::new();
        let mut next = st.w.head();
        let max = LogWriter::copies_per_round(self.region) as usize;
        for (&l, &g) in &st.live {
            let newest = st.index.get(&g).filter(|d| d.lpos == l);
            match (newest, st.stuck.contains_key(&g)) {
                (Some(&d), true) if out.len() < max => out.push((g, d)),
                _ => {
                    next = l;
                    break;
                }
            }
        }
        let first = out.first().map_or(next, |(_, d)| d.lpos);
        if next - first < 2 * out.len() as u64 {
            out.clear();
        }
        out
    }

    /// Copies page `g`'s version `d` to the head: a new version of the same bytes, which
    /// counts only if `d` is still the newest when it lands (a client's write meanwhile
    /// wins). False if it could not be read or written, or there was no room.
    fn relocate(&self, g: u64, d: Dirty) -> bool {
        let mut page = AlignedBuf::new(PAGE_SIZE as usize);
        match self.read_checked(d, &mut page) {
            Ok(()) => {}
            Err(Unread::Damaged) => {
                self.found_damaged(g, d);
                return false;
            }
            Err(Unread::Io(_)) => return false,
        }
        let lpos = {
            let mut st = self.st.lock();
            match st.allocate_copy(1) {
                Ok(l) => l,
                Err(_) => return false,
            }
        };
        let written = self.dev.write_at(self.at(lpos), &page);
        let (crc, local) = (page_crc(&page), self.local(g));
        (self.st.lock()).copied(g, d, lpos, crc, written.is_ok(), local)
    }

    /// Carries forward each loss recorded below position `before` (all: `u64::MAX`): a
    /// tombstone for the page in a commit of its own, after which the tail, and the anchor,
    /// may pass the damaged version or the older tombstone. A lost page then never stops
    /// the ring.
    pub(super) fn carry_losses(&self, before: u64) {
        let mark = {
            let mut st = self.st.lock();
            if st.loss_at.is_empty() {
                return;
            }
            if st.carry_losses(before, |g| self.local(g)) == 0 {
                return;
            }
            st.written
        };
        loop {
            match self.try_commit_forced(mark) {
                Ok(Try::More) => {}
                Ok(_) => return,
                Err(err) => {
                    // Retried with the next commit (its entries stay in the writer).
                    tracing::warn!("write-back log: carrying lost pages forward failed: {err}");
                    return;
                }
            }
        }
    }
}
