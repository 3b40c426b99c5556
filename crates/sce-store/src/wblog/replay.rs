//! Replay of the write-back log after a crash (or a clean stop).
//!
//! Replay reads the mirror area and one whole lap of the ring from the anchor, keeping every
//! sound commit record (either copy) at or after the anchor's seq, then follows the chain
//! from the anchor: each next record has the next seq, its own position (within the window
//! after the previous one's end) and the previous record's link. Where the chain ends, the
//! records left over tell a torn end from damage: a torn commit is the last write of its
//! writer (the next commit is prepared only once its flush completed), so a sound record of
//! a *later* commit than the one that cannot be read means that commit was durable and is
//! now damaged in both copies: [`Replayed::broken`], never the end of the log.

use super::record::{decode_record, looks_like_record, record_link, Record};
use super::{page_crc, Anchor, LogIndex, LogRegion, LOG_BLOCK, REPLAY_CHUNK};
use crate::StoreError;
use sce_io::{AlignedBuf, BlockDevice};
use std::collections::{BTreeMap, HashMap};

/// A break in the commit chain that damage made: the commit of seq `missing` cannot be
/// read (both copies damaged), yet a later commit (`evidence`, its first record's seq) was
/// written after it, so it was durable. The pages it named cannot be told: a log with a
/// break must not be served as if it ended there (that would return older bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Broken {
    /// The first seq the chain could not find.
    pub missing: u64,
    /// The first seq of a sound later commit.
    pub evidence: u64,
    /// Where that later commit's record lies (its ring position).
    pub evidence_lpos: u64,
}

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
    /// in both copies ends the chain there; a later commit found past it is reported in
    /// [`Self::broken`], but if none was written (or all are damaged too) only the caller's
    /// own record of the newest durable seq (the superblock's) can tell: it must refuse a
    /// replay whose `last_seq` is below it.
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
    /// Damage broke the chain: the log must not be served as replayed.
    pub broken: Option<Broken>,
    /// Records of the chain whose copy in the ring was damaged and were read from their
    /// second copy (beside it, or in the mirror area).
    pub repaired: u64,
    /// The seq of the sound record each mirror slot holds (0: none), for the writer that
    /// continues the log.
    pub mirror_seqs: Vec<u64>,
    /// The chunks lent ([`super::Lend`]) replay read: the writer that continues the log
    /// uses them.
    pub lent: u64,
}

impl Replayed {
    /// True if replay started from a commit (`Anchor::Commit`) that it did not find: its
    /// record is damaged in both copies, although the caller knew it durable. Such a log
    /// must not be resumed (what followed the anchor cannot be found).
    pub fn anchor_missing(&self) -> bool {
        matches!(self.anchor, Anchor::Commit { seq, .. } if self.last_seq < seq)
    }
}

/// A sound record found on the device.
struct Cand {
    rec: Record,
    /// [`record_link`] of its image: what the next record's link must be.
    link: u64,
    /// Read from the ring at its own position (else from its second copy).
    first_copy: bool,
}

/// A record of the chain, with whether each entry's data matched.
struct Found {
    rec: Record,
    ok: Vec<bool>,
}

/// What reading the device gave: each ring block's checksum from the anchor on, and the
/// sound records at or after the anchor's seq, by seq.
struct Read {
    crcs: Vec<u32>,
    cands: BTreeMap<u64, Vec<Cand>>,
    mirror_seqs: Vec<u64>,
}

/// Reads the mirror area and one lap of the ring from `start`.
fn read_all(
    dev: &dyn BlockDevice,
    region: LogRegion,
    key: &[u8; 16],
    start: u64,
    min_seq: u64,
    lent: u64,
) -> Result<Read, StoreError> {
    let block = LOG_BLOCK as usize;
    let mut buf = AlignedBuf::new(REPLAY_CHUNK as usize * block);
    let mut read = Read {
        crcs: Vec::with_capacity(region.lap() as usize),
        cands: BTreeMap::new(),
        mirror_seqs: vec![0; region.mirror_blocks as usize],
    };
    let keep = |rec: Record, b: &[u8], first_copy: bool, cands: &mut BTreeMap<u64, Vec<Cand>>| {
        if rec.header.seq >= min_seq {
            let c = Cand {
                link: record_link(b),
                rec,
                first_copy,
            };
            cands.entry(c.rec.header.seq).or_default().push(c);
        }
    };
    let mut s = 0;
    while s < region.mirror_blocks {
        let n = REPLAY_CHUNK.min(region.mirror_blocks - s);
        let bytes = &mut buf[..n as usize * block];
        dev.read_at(region.mirror_at(s), bytes)?;
        for (k, b) in bytes.chunks_exact(block).enumerate() {
            let slot = s + k as u64;
            let Some(rec) = looks_like_record(b)
                .then(|| decode_record(key, b).ok())
                .flatten()
            else {
                continue;
            };
            if rec.header.copy2 as u64 == slot + 1 {
                read.mirror_seqs[slot as usize] = rec.header.seq;
                keep(rec, b, false, &mut read.cands);
            }
        }
        s += n;
    }
    let limit = start + region.lap();
    let mut p = start;
    while p < limit {
        let n = REPLAY_CHUNK.min(limit - p).min(region.segment_end(p) - p);
        if !region.is_read(p, lent) {
            // A chunk of read slots no lap since the anchor used: never read (its crc 0 is
            // never trusted, see `apply_entries`).
            read.crcs.extend(std::iter::repeat_n(0, n as usize));
            p += n;
            continue;
        }
        let bytes = &mut buf[..n as usize * block];
        dev.read_at(region.offset_of(p), bytes)?;
        for (k, b) in bytes.chunks_exact(block).enumerate() {
            read.crcs.push(page_crc(b));
            let at = p + k as u64;
            let Some(rec) = looks_like_record(b)
                .then(|| decode_record(key, b).ok())
                .flatten()
            else {
                continue;
            };
            let h = &rec.header;
            // Its own position, or (beside) the one after it.
            let first = h.lpos == at;
            if first || (h.copy2 == 0 && h.lpos + 1 == at) {
                keep(rec, b, first, &mut read.cands);
            }
        }
        p += n;
    }
    Ok(read)
}

/// Replays the log of `region` on `dev` from `anchor`: reads the mirror area and one lap of
/// the ring in chunks of 1 MiB, follows the chain of commit records (either copy sound, the
/// expected seq, its own position within [`LogRegion::window`] of the previous one's end,
/// chained to the one before), and applies its entries in order. Where the chain ends, a
/// sound record of a later commit means damage ([`Replayed::broken`]); else the log ends
/// there.
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
    replay_lent(dev, region, key, anchor, region.lend.chunks)
}

/// [`replay`] of a log whose laps since the anchor used at most the last `lent` chunks of
/// read slots ([`super::Lend`]; the superblock records it before a lap uses more): the
/// others are not read (they may hold read data since).
pub fn replay_lent(
    dev: &dyn BlockDevice,
    region: LogRegion,
    key: &[u8; 16],
    anchor: Anchor,
    lent: u64,
) -> Result<Replayed, StoreError> {
    region.check()?;
    let lent = lent.min(region.lend.chunks);
    let start = anchor.lpos();
    let read = read_all(dev, region, key, start, anchor.seq(), lent)?;
    let mut found: Vec<Found> = Vec::new();
    let mut repaired = 0;
    let mut expect_seq = anchor.seq();
    let mut link: Option<u64> = None;
    // Where the next record may start: [lo, hi).
    let (mut lo, mut hi) = match anchor {
        Anchor::Commit { lpos, .. } => (lpos, lpos + 1),
        Anchor::Empty { lpos, .. } => (lpos, lpos + region.window()),
    };
    let mut end = start;
    loop {
        let next = read.cands.get(&expect_seq).and_then(|cs| {
            (cs.iter())
                .filter(|c| {
                    c.rec.header.lpos >= lo && c.rec.header.lpos < hi.min(start + region.lap())
                })
                .filter(|c| link.is_none_or(|l| l == c.rec.header.link))
                .min_by_key(|c| (c.rec.header.lpos, !c.first_copy))
        });
        let Some(c) = next else { break };
        let h = c.rec.header;
        repaired += !c.first_copy as u64;
        let ok = (c.rec.entries.iter())
            .map(|e| {
                e.is_data()
                    && e.lpos >= start
                    && e.lpos < h.lpos
                    && region.is_read(e.lpos, lent)
                    && read.crcs[(e.lpos - start) as usize] == e.crc
            })
            .collect();
        link = Some(c.link);
        expect_seq += 1;
        end = h.lpos + h.ring_blocks();
        (lo, hi) = (end, end + region.window());
        found.push(Found {
            rec: c.rec.clone(),
            ok,
        });
    }
    // A sound record of a commit after the one that is missing: that one was durable.
    // (Records of the missing seq's own commit may survive a tear of its one write.)
    let broken = (read.cands.range(expect_seq..).flat_map(|(_, cs)| cs))
        .filter(|c| c.rec.header.group_first() > expect_seq)
        .min_by_key(|c| c.rec.header.group_first())
        .map(|c| Broken {
            missing: expect_seq,
            evidence: c.rec.header.group_first(),
            evidence_lpos: c.rec.header.lpos,
        });
    Ok(apply(
        found,
        anchor,
        start,
        end,
        expect_seq,
        link,
        Extra {
            broken,
            repaired,
            mirror_seqs: read.mirror_seqs,
            lent,
        },
    ))
}

/// What the scan adds to the applied chain.
struct Extra {
    broken: Option<Broken>,
    repaired: u64,
    mirror_seqs: Vec<u64>,
    lent: u64,
}

/// Applies the records found, in order.
fn apply(
    found: Vec<Found>,
    anchor: Anchor,
    start: u64,
    end: u64,
    next_seq: u64,
    link: Option<u64>,
    x: Extra,
) -> Replayed {
    let last = found.last().map(|f| f.rec.header);
    let last_group_first = last.map(|h| h.group_first());
    let unsure = unsure_commits(&found, last_group_first);
    let Applied {
        mut index,
        mut lost,
        pages,
        skipped,
    } = apply_entries(&found, &unsure, start);
    let tail = last.map_or(start, |h| h.tail.max(start));
    index.drop_below(tail);
    lost.retain(|_, lpos| *lpos >= tail);
    let mut lost_at = lost;
    let mut lost: Vec<(u32, u64)> = lost_at.keys().copied().collect();
    lost.sort_unstable();
    Replayed {
        index,
        lost,
        lost_at: std::mem::take(&mut lost_at),
        head: end,
        next_seq,
        last_seq: next_seq - 1,
        tail,
        anchor,
        commits: found.len() as u64,
        pages,
        skipped,
        link,
        last_group_first,
        last_commit: last.map(|h| {
            (
                h.lpos - h.ring_blocks() * h.group_index as u64,
                h.group_first(),
            )
        }),
        broken: x.broken,
        repaired: x.repaired,
        mirror_seqs: x.mirror_seqs,
        lent: x.lent,
    }
}

/// Commits whose flush may not have completed, as seq ranges `[lo, hi)`: the last one
/// (from `last_group_first` on), and those a writer that resumed after a replay named.
fn unsure_commits(found: &[Found], last_group_first: Option<u64>) -> Vec<(u64, u64)> {
    let mut unsure: Vec<(u64, u64)> = (found.iter())
        .filter(|f| f.rec.header.resumed_from != 0)
        .map(|f| (f.rec.header.resumed_from, f.rec.header.seq))
        .collect();
    if let Some(g) = last_group_first {
        unsure.push((g, u64::MAX));
    }
    unsure
}

/// What applying the entries of the chain gave, before the tail cuts it.
struct Applied {
    index: LogIndex,
    /// Lost pages, with where the log records each loss.
    lost: HashMap<(u32, u64), u64>,
    pages: u64,
    skipped: u64,
}

/// Applies the entries of the records found, in order. A record whose seq is in one of
/// the `unsure` ranges may be torn: its entries whose data did not match are skipped.
fn apply_entries(found: &[Found], unsure: &[(u64, u64)], start: u64) -> Applied {
    let mut index = LogIndex::default();
    let mut lost: HashMap<(u32, u64), u64> = HashMap::new();
    let (mut pages, mut skipped) = (0, 0);
    for f in found {
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
            if e.is_cleaned() {
                // The source holds the page's newest bytes: every version before is gone,
                // and so is a loss of it.
                index.remove(e.volume, e.page);
                lost.remove(&(e.volume, e.page));
                continue;
            }
            if e.lpos < start {
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
    Applied {
        index,
        lost,
        pages,
        skipped,
    }
}
