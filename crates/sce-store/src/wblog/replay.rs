//! Replay of the write-back log after a crash (or a clean stop).

use super::record::{decode_record, looks_like_record, record_link, Record};
use super::{page_crc, Anchor, LogIndex, LogRegion, LOG_BLOCK, REPLAY_CHUNK};
use crate::StoreError;
use sce_io::{AlignedBuf, BlockDevice};
use std::collections::HashMap;

/// What replaying the log found.
#[derive(Clone, Debug)]
pub struct Replayed {
    /// The newest version of every page with one at or above the tail whose data matched
    /// its checksum.
    pub index: LogIndex,
    /// Pages whose newest committed version failed its checksum although its commit was
    /// followed by a later one (so its flush completed): **damage**, not a torn write. The
    /// page's older versions are not served: reads of it should fail (lost), never return
    /// older bytes. So is a page whose newest entry is a tombstone (a loss found before and
    /// carried forward). (volume, page), sorted.
    pub lost: Vec<(u32, u64)>,
    /// Where the log records each lost page's loss: the damaged version's position, or the
    /// commit whose tombstone carries it. A writer that goes on keeps that position (its
    /// tail may not pass it) until a later commit carries the loss again.
    pub lost_at: HashMap<(u32, u64), u64>,
    /// Where writing resumes: the end of the last commit found.
    pub head: u64,
    /// The next commit's sequence number.
    pub next_seq: u64,
    /// The last commit's sequence number (`next_seq - 1`). A commit whose record is damaged
    /// in both copies ends the log there, as if it had never been written, and so does any
    /// damage that breaks the chain: the caller must record the last commit's seq durably
    /// elsewhere now and then (at its metadata rounds, say) and refuse a replay whose
    /// `last_seq` is below it.
    pub last_seq: u64,
    /// The tail: the last commit's, or the anchor's position if higher.
    pub tail: u64,
    /// The anchor replay started from.
    pub anchor: Anchor,
    /// Commit records found.
    pub commits: u64,
    /// Entries whose data matched (each version counted).
    pub pages: u64,
    /// Entries of the last commits (whose flush may not have completed) whose data did not
    /// match: torn, or never written; their pages keep their older version.
    pub skipped: u64,
    /// The link of the last record found, for the writer that continues the log.
    pub link: Option<u64>,
    /// The first seq of the commit replay ended with.
    pub last_group_first: Option<u64>,
    /// The last commit found: (position, seq) of its first record.
    pub last_commit: Option<(u64, u64)>,
}

impl Replayed {
    /// True if replay started from a commit (`Anchor::Commit`) that it did not find: its
    /// record is damaged in both copies, although the caller knew it durable. Such a log
    /// must not be resumed (what followed the anchor cannot be found).
    pub fn anchor_missing(&self) -> bool {
        matches!(self.anchor, Anchor::Commit { seq, .. } if self.last_seq < seq)
    }
}

/// A record found, with whether each entry's data matched.
struct Found {
    rec: Record,
    ok: Vec<bool>,
}

/// The forward scan: block checksums since the anchor and the chain of records.
struct Scan<'a> {
    region: LogRegion,
    key: &'a [u8; 16],
    start: u64,
    crcs: Vec<u32>,
    expect_seq: u64,
    expect_at: Option<u64>,
    link: Option<u64>,
    end: u64,
    window_end: u64,
    found: Vec<Found>,
}

impl Scan<'_> {
    /// Looks at block `p` (its bytes `b`, its checksum already recorded).
    fn block(&mut self, p: u64, b: &[u8]) {
        if !looks_like_record(b) {
            return;
        }
        let Ok(rec) = decode_record(self.key, b) else {
            return;
        };
        let h = &rec.header;
        let placed = h.lpos == p || h.lpos + 1 == p;
        if !placed || h.lpos < self.start || h.seq != self.expect_seq {
            return;
        }
        if self.expect_at.is_some_and(|a| a != h.lpos) || self.link.is_some_and(|l| l != h.link) {
            return;
        }
        let ok = rec
            .entries
            .iter()
            .map(|e| {
                e.lpos >= self.start
                    && e.lpos < h.lpos
                    && self.crcs[(e.lpos - self.start) as usize] == e.crc
            })
            .collect();
        self.link = Some(record_link(b));
        self.expect_seq += 1;
        self.expect_at = None;
        self.end = h.lpos + 2;
        self.window_end = self.end + self.region.window();
        self.found.push(Found { rec, ok });
    }
}

/// Replays the log of `region` on `dev` from `anchor`: reads forward in chunks of 1 MiB,
/// finds each next commit record (either copy sound, the expected seq, its own position,
/// chained to the one before), and applies its entries in order. The log ends where no
/// next record lies within [`LogRegion::window`] positions of the last one's end.
///
/// An entry whose data matches its checksum is its page's newest version. One that does
/// not, in a commit whose flush may not have completed (the last commit found, or one a
/// later writer named as where its replay ended), was torn or never written: skipped, the
/// page keeps its older version. Anywhere else it is damage: the page is [`Replayed::lost`].
pub fn replay(
    dev: &dyn BlockDevice,
    region: LogRegion,
    key: &[u8; 16],
    anchor: Anchor,
) -> Result<Replayed, StoreError> {
    region.check()?;
    let start = anchor.lpos();
    let (expect_at, window_end) = match anchor {
        Anchor::Commit { lpos, .. } => (Some(lpos), lpos + 2),
        Anchor::Empty { lpos, .. } => (None, lpos + region.window()),
    };
    let mut s = Scan {
        region,
        key,
        start,
        crcs: Vec::new(),
        expect_seq: anchor.seq(),
        expect_at,
        link: None,
        end: start,
        window_end,
        found: Vec::new(),
    };
    let limit = start + region.blocks;
    let block = LOG_BLOCK as usize;
    let mut buf = AlignedBuf::new(REPLAY_CHUNK as usize * block);
    let mut p = start;
    while p < s.window_end.min(limit) {
        let to = s.window_end.min(limit);
        let n = REPLAY_CHUNK
            .min(to - p)
            .min(region.blocks - p % region.blocks);
        let bytes = &mut buf[..n as usize * block];
        dev.read_at(region.offset_of(p), bytes)?;
        for (k, b) in bytes.chunks_exact(block).enumerate() {
            s.crcs.push(page_crc(b));
            s.block(p + k as u64, b);
        }
        p += n;
    }
    Ok(apply(s, anchor))
}

/// Applies the records found, in order.
fn apply(s: Scan<'_>, anchor: Anchor) -> Replayed {
    let last = s.found.last().map(|f| f.rec.header);
    let last_group_first = last.map(|h| h.seq - h.group_index as u64);
    // Commits whose flush may not have completed: the last one, and those a writer that
    // resumed after a replay named.
    let mut unsure: Vec<(u64, u64)> = s
        .found
        .iter()
        .filter(|f| f.rec.header.resumed_from != 0)
        .map(|f| (f.rec.header.resumed_from, f.rec.header.seq))
        .collect();
    if let Some(g) = last_group_first {
        unsure.push((g, u64::MAX));
    }
    let mut index = LogIndex::default();
    let mut lost: HashMap<(u32, u64), u64> = HashMap::new();
    let (mut pages, mut skipped) = (0, 0);
    for f in &s.found {
        let seq = f.rec.header.seq;
        let may_be_torn = unsure.iter().any(|&(lo, hi)| seq >= lo && seq < hi);
        for (e, &ok) in f.rec.entries.iter().zip(&f.ok) {
            if e.is_tombstone() {
                // A loss carried forward: it holds in any commit, the last one too (a
                // tombstone names no data that a crash could have torn).
                index.remove(e.volume, e.page);
                lost.insert((e.volume, e.page), f.rec.header.lpos);
                continue;
            }
            if e.lpos < s.start {
                // A version the tail passed: cleaned to the source (or replaced by a newer
                // entry, which follows). A loss recorded before it is over.
                lost.remove(&(e.volume, e.page));
                continue;
            }
            if ok {
                index.insert(e);
                lost.remove(&(e.volume, e.page));
                pages += 1;
            } else if may_be_torn {
                skipped += 1;
            } else {
                index.remove(e.volume, e.page);
                lost.insert((e.volume, e.page), e.lpos);
            }
        }
    }
    let tail = last.map_or(s.start, |h| h.tail.max(s.start));
    index.drop_below(tail);
    lost.retain(|_, lpos| *lpos >= tail);
    let mut lost_at = lost;
    let mut lost: Vec<(u32, u64)> = lost_at.keys().copied().collect();
    lost.sort_unstable();
    let next_seq = s.expect_seq;
    Replayed {
        index,
        lost,
        lost_at: std::mem::take(&mut lost_at),
        head: s.end,
        next_seq,
        last_seq: next_seq - 1,
        tail,
        anchor,
        commits: s.found.len() as u64,
        pages,
        skipped,
        link: s.link,
        last_group_first,
        last_commit: last.map(|h| {
            (
                h.lpos - 2 * h.group_index as u64,
                h.seq - h.group_index as u64,
            )
        }),
    }
}
