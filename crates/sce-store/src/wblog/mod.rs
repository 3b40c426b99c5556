//! The write-back data log (issue 29; format 6; the engine's `log/` serves it): dirty data
//! written out of place into a ring on the cache device, made durable by commit records at
//! FLUSH/FUA (group commit), replayed after a crash. See `docs/FORMAT.md`, "Write-back log".
//!
//! * A **data page** is 4 KiB of client data, raw: a write of N pages is one device write of
//!   N x 4 KiB at consecutive log positions ([`LogWriter::allocate`]).
//! * A **commit record** (`record.rs`) is two identical 4 KiB copies: the first in the ring,
//!   the second in the region's **mirror area** (format 8), a separate device write to
//!   another place, so that one bad area of flash does not take both; a device without a
//!   mirror area (format 7), or a commit that finds every mirror slot still needed by replay,
//!   writes the second copy beside the first, in the same device write. A commit of more
//!   entries than one record holds is several consecutive records (seq k, k+1, ...), still
//!   one device write in the ring (and one in the mirror area). Each record names the data pages
//!   whose writes completed since the previous commit (position, volume, page, CRC-32C of
//!   the 4 KiB) and is checksummed with the caller's secret key: CRC-32C over the key
//!   followed by the block with its checksum field zero. Clients cannot read the cache
//!   device, so they do not know the key, and a data page a client wrote (even a perfect
//!   copy of a record's fields) never passes for a commit record.
//! * Records are chained: each holds a hash of the record before it and a random number
//!   of its writer's incarnation, so a record left behind by a torn commit of an earlier
//!   life of the log is never taken for the next one.
//! * [`LogWriter`] is the writer's state in memory (no I/O of its own); [`replay`] reads the
//!   log back from an [`Anchor`] the caller recorded durably.
//!
//! The old version of a page stays intact until a commit naming its newer version is
//! durable: no flush is needed before any write but the commit's own.

mod lend;
mod ops;
mod record;
mod replay;
pub mod state;
mod writer;

pub use lend::{Lend, MAX_LEND_CHUNKS};
pub use record::{
    decode_record, encode_record, record_link, Record, RecordError, RecordHeader, RECORD_ENTRY,
    RECORD_HEADER, WBLOG_MAGIC, WBLOG_VERSION, WBLOG_VERSION_FIRST,
};
pub use replay::{replay, replay_lent, Broken, Replayed};
pub use state::{Dirty, LogState, Stuck};
pub use writer::{Full, LendStep, LogWriter, PreparedCommit};

use std::collections::HashMap;

/// Bytes of a log block.
pub const LOG_BLOCK: u64 = 4096;
/// Entries one commit record holds (167).
pub const ENTRIES_PER_RECORD: usize = (LOG_BLOCK as usize - RECORD_HEADER) / RECORD_ENTRY;
/// Records one commit writes at most (one device write of up to 64 KiB); a commit with more
/// completed entries leaves the rest to the next one.
pub const MAX_COMMIT_RECORDS: usize = 8;
/// The most positions that may separate a commit from the end of the previous one (64 MiB
/// of data), for a ring of at least 4 x this; a smaller ring allows a quarter of its length
/// ([`LogRegion::max_gap`]). The writer refuses a data write that would exceed it (the
/// caller commits first), so that replay knows how far to look for the next record.
pub const MAX_GAP: u64 = 16384;
/// Positions a commit may add past the gap: at most `2 x MAX_COMMIT_RECORDS - 1` skipped at
/// a lap's end, plus the second copy of its first record.
pub const COMMIT_SLACK: u64 = 2 * MAX_COMMIT_RECORDS as u64;
/// Positions a data write leaves free, before the ring reaches the anchor, for the commits
/// of `k` entries: their records (two blocks each) and one skip at a lap's end. The writer
/// counts every position since the tail as an entry to commit, so the commits that drain
/// what is uncommitted always fit; only commits of a few entries each, many in a row after
/// the last data write, can still find the ring full.
pub fn commit_reserve(k: u64) -> u64 {
    2 * k.div_ceil(ENTRIES_PER_RECORD as u64).max(1) + COMMIT_SLACK
}
/// The smallest ring.
pub const MIN_LOG_BLOCKS: u64 = 8 * COMMIT_SLACK;
/// Blocks replay reads per device read (1 MiB).
pub const REPLAY_CHUNK: u64 = 256;

/// The log a device of `device` bytes gets by default (`--writeback-log auto`, and any
/// format for write-back): a sixteenth of it, at least 16 MiB (but at most a quarter of a
/// small device), at most 4 GiB, in whole MiB; none if that is under 1 MiB.
pub fn auto_log_bytes(device: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    let l = (device / 16).max((16 * MIB).min(device / 4)).min(4 << 30);
    let l = l / MIB * MIB;
    if l < MIB {
        0
    } else {
        l
    }
}

/// The read slots a log of `log` bytes on a device of `device` bytes may lend by default
/// (any format for write-back): dirty data may take up to half the device, as
/// dm-writecache's does by its high watermark (none without a log).
pub fn auto_lend_bytes(device: u64, log: u64) -> u64 {
    if log == 0 {
        0
    } else {
        (device / 2).saturating_sub(log)
    }
}

/// Where the log lives on the cache device: a ring of `blocks` blocks of 4 KiB from byte
/// `offset`, and a mirror area of `mirror_blocks` slots (second copies of commit records)
/// from byte `mirror_offset` (none if 0); format 9 adds chunks of read slots a lap may use
/// after its own blocks ([`Lend`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogRegion {
    /// Byte offset of the ring on the device (a multiple of 4 KiB).
    pub offset: u64,
    /// Length of the ring in 4 KiB blocks (at least [`MIN_LOG_BLOCKS`]).
    pub blocks: u64,
    /// Byte offset of the mirror area (a multiple of 4 KiB, outside the ring).
    pub mirror_offset: u64,
    /// Slots of the mirror area, 4 KiB each (0: none, records keep both copies in the ring).
    pub mirror_blocks: u64,
    /// The chunks of read slots a lap may use after `blocks` (none before format 9).
    pub lend: Lend,
}

/// The least mirror area a format gives a log (128 KiB).
pub const MIN_MIRROR_BLOCKS: u64 = 32;
/// The largest mirror area a format gives a log (32 MiB).
pub const MAX_MIRROR_BLOCKS: u64 = 8192;
/// How far apart (bytes) the two copies of a record should lie: one bad area of flash (an
/// erase block) then does not take both. A mirror area smaller than this keeps them as far
/// apart as it can.
pub const COPIES_APART: u64 = 1 << 20;

impl LogRegion {
    /// A ring of `blocks` blocks at `offset` with no mirror area (format 7's layout).
    pub fn ring(offset: u64, blocks: u64) -> Self {
        LogRegion {
            offset,
            blocks,
            mirror_offset: 0,
            mirror_blocks: 0,
            lend: Lend::default(),
        }
    }

    /// How a region of `blocks` blocks at `offset` is laid out by a format: a sixteenth of
    /// it (between [`MIN_MIRROR_BLOCKS`] and [`MAX_MIRROR_BLOCKS`]) is the mirror area, at
    /// its end; the rest is the ring.
    pub fn laid_out(offset: u64, blocks: u64) -> Self {
        let mirror = Self::mirror_for(blocks);
        LogRegion {
            offset,
            blocks: blocks - mirror,
            mirror_offset: offset + (blocks - mirror) * LOG_BLOCK,
            mirror_blocks: mirror,
            lend: Lend::default(),
        }
    }

    /// The mirror area a format gives a region of `blocks` blocks (0 if the ring would be
    /// too small with one).
    pub fn mirror_for(blocks: u64) -> u64 {
        let m = (blocks / 16).clamp(MIN_MIRROR_BLOCKS, MAX_MIRROR_BLOCKS);
        if blocks >= m + MIN_LOG_BLOCKS {
            m
        } else {
            0
        }
    }

    /// Checks the region's geometry.
    pub fn check(&self) -> Result<(), crate::StoreError> {
        let ring_end = self.offset + self.blocks * LOG_BLOCK;
        let mirror_end = self.mirror_offset + self.mirror_blocks * LOG_BLOCK;
        let overlap =
            self.mirror_blocks > 0 && self.mirror_offset < ring_end && self.offset < mirror_end;
        if !self.offset.is_multiple_of(LOG_BLOCK)
            || self.blocks < MIN_LOG_BLOCKS
            || !self.mirror_offset.is_multiple_of(LOG_BLOCK)
            || overlap
        {
            return Err(crate::StoreError::Geometry(format!(
                "a write-back log ring must start on a 4 KiB boundary and hold at least \
                 {MIN_LOG_BLOCKS} blocks, its mirror area apart from it (ring at {} of {} \
                 blocks, mirror at {} of {} blocks)",
                self.offset, self.blocks, self.mirror_offset, self.mirror_blocks
            )));
        }
        self.lend.check().map_err(crate::StoreError::Geometry)
    }

    /// The device byte offset of mirror slot `slot`.
    pub fn mirror_at(&self, slot: u64) -> u64 {
        self.mirror_offset + slot * LOG_BLOCK
    }
    /// Positions of a lap: the log's own blocks, then the lendable chunks'.
    pub fn lap(&self) -> u64 {
        self.blocks + self.lend.blocks()
    }
    /// Where (within a lap) a lap using `u` chunks ends: the end of its last chunk.
    pub fn used_end(&self, u: u64) -> u64 {
        self.blocks + u.min(self.lend.chunks) * self.lend.chunk_blocks
    }
    /// The device byte offset of log position `lpos`.
    pub fn offset_of(&self, lpos: u64) -> u64 {
        let q = lpos % self.lap();
        if q < self.blocks {
            self.offset + q * LOG_BLOCK
        } else {
            let (c, cb) = (q - self.blocks, self.lend.chunk_blocks);
            self.lend.chunk_offset(c / cb) + (c % cb) * LOG_BLOCK
        }
    }
    /// The end of the contiguous stretch of the device `lpos` lies in: the log's own
    /// blocks', or its chunk's.
    pub fn segment_end(&self, lpos: u64) -> u64 {
        let q = lpos % self.lap();
        if q < self.blocks {
            lpos - q + self.blocks
        } else {
            let cb = self.lend.chunk_blocks;
            lpos - (q - self.blocks) % cb + cb
        }
    }
    /// True if a replay that reads the first `lent` chunks of each lap reads `lpos`.
    pub fn is_read(&self, lpos: u64, lent: u64) -> bool {
        lpos % self.lap() < self.used_end(lent)
    }
    /// The most positions between a commit and the end of the previous one (not counting
    /// the positions of chunks a lap skipped).
    pub fn max_gap(&self) -> u64 {
        MAX_GAP.min(self.blocks / 4)
    }
    /// How far past the end of a commit replay looks for the first copy of the next one:
    /// the gap, the commit's slack, and the chunks a lap may skip in between.
    pub fn window(&self) -> u64 {
        self.max_gap() + COMMIT_SLACK + self.lend.blocks()
    }
    /// The most pages one data write may take.
    pub fn max_write(&self) -> u64 {
        let w = self.max_gap() / 2;
        if self.lend.chunks > 0 {
            w.min(self.lend.chunk_blocks)
        } else {
            w
        }
    }
    /// Where `n` consecutive positions at or after `lpos` start: not crossing the end of
    /// the log's own blocks or of a chunk, and in the first `u` chunks of a lap (past them,
    /// the next lap).
    fn place(&self, lpos: u64, n: u64, u: u64) -> u64 {
        let mut at = lpos;
        loop {
            let q = at % self.lap();
            if q >= self.used_end(u) {
                at += self.lap() - q;
                continue;
            }
            let end = self.segment_end(at);
            if at + n > end {
                at = end;
                continue;
            }
            return at;
        }
    }
}

/// Where replay starts, recorded durably by the caller (in its superblock).
///
/// A superblock that keeps only a position and a seq (format 6 does) may replay either kind
/// as `Empty { lpos, next_seq: seq }`: a commit at `lpos` is the first record with that seq
/// in the window, so it is found first; if it is damaged in both copies, replay ends before
/// it (`last_seq` below the newest durable seq the superblock also keeps, which the caller
/// refuses), where `Commit` reports it as [`Replayed::anchor_missing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Anchor {
    /// A commit record known durable: replay starts with it (its own entries are older than
    /// its position, so they are not needed: the caller anchors only at or below the tail).
    Commit {
        /// Its position.
        lpos: u64,
        /// Its sequence number.
        seq: u64,
    },
    /// A log with nothing to replay before `lpos`: the next commit has sequence `next_seq`
    /// and starts within the window after `lpos` (a fresh log, or one cleaned entirely).
    Empty {
        /// Where the log starts.
        lpos: u64,
        /// The next commit's sequence number (at least 1).
        next_seq: u64,
    },
}

impl Anchor {
    /// The first position replay reads.
    pub fn lpos(&self) -> u64 {
        match *self {
            Anchor::Commit { lpos, .. } | Anchor::Empty { lpos, .. } => lpos,
        }
    }
    /// The sequence number of the first record replay looks for.
    pub fn seq(&self) -> u64 {
        match *self {
            Anchor::Commit { seq, .. } => seq,
            Anchor::Empty { next_seq, .. } => next_seq,
        }
    }
}

/// The position a **tombstone** entry names instead of a data page's: the page is lost
/// (its only copy was found damaged), and stays lost until a later entry names a new
/// version of it. The writer carries each lost page forward in such entries, so that the
/// log may drop the damaged version (and the ring move on) without forgetting the loss.
pub const TOMBSTONE: u64 = u64::MAX;

/// The position a **cleaned** entry names instead of a data page's: the source holds the
/// page's newest bytes (a write or a discard that went through to the source, flushed,
/// while the log held a version of the page), so every version of it the log holds before
/// this entry is superseded, and a loss of it is over.
pub const CLEANED: u64 = u64::MAX - 1;

/// A committed data page: what a commit record names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// The data page's log position.
    pub lpos: u64,
    /// The volume's id.
    pub volume: u32,
    /// The 4 KiB page number within the volume.
    pub page: u64,
    /// CRC-32C of the page's 4 KiB.
    pub crc: u32,
}

impl LogEntry {
    /// The tombstone of `page` of `volume` ([`TOMBSTONE`]).
    pub fn tombstone(volume: u32, page: u64) -> Self {
        LogEntry {
            lpos: TOMBSTONE,
            volume,
            page,
            crc: 0,
        }
    }
    /// True if this entry is a tombstone.
    pub fn is_tombstone(&self) -> bool {
        self.lpos == TOMBSTONE
    }
    /// The cleaned entry of `page` of `volume` ([`CLEANED`]).
    pub fn cleaned(volume: u32, page: u64) -> Self {
        LogEntry {
            lpos: CLEANED,
            volume,
            page,
            crc: 0,
        }
    }
    /// True if this entry is a cleaned entry.
    pub fn is_cleaned(&self) -> bool {
        self.lpos == CLEANED
    }
    /// True if this entry names a data page (neither a tombstone nor a cleaned entry).
    pub fn is_data(&self) -> bool {
        self.lpos < CLEANED
    }
}

/// Where the newest version of a page is in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogPage {
    /// Its log position.
    pub lpos: u64,
    /// CRC-32C of its 4 KiB.
    pub crc: u32,
}

/// The newest logged version of each (volume, page).
#[derive(Clone, Debug, Default)]
pub struct LogIndex {
    map: HashMap<(u32, u64), LogPage>,
}

impl LogIndex {
    /// The newest version of `page` of `volume`.
    pub fn get(&self, volume: u32, page: u64) -> Option<LogPage> {
        self.map.get(&(volume, page)).copied()
    }
    /// Records `e` as its page's newest version.
    pub fn insert(&mut self, e: &LogEntry) {
        let v = LogPage {
            lpos: e.lpos,
            crc: e.crc,
        };
        self.map.insert((e.volume, e.page), v);
    }
    /// Forgets a page.
    pub fn remove(&mut self, volume: u32, page: u64) -> Option<LogPage> {
        self.map.remove(&(volume, page))
    }
    /// Forgets every version below `tail` (cleaned to the source).
    pub fn drop_below(&mut self, tail: u64) {
        self.map.retain(|_, v| v.lpos >= tail);
    }
    /// Pages indexed.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// True if no page is indexed.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    /// Every ((volume, page), version), in no order.
    pub fn iter(&self) -> impl Iterator<Item = ((u32, u64), LogPage)> + '_ {
        self.map.iter().map(|(k, v)| (*k, *v))
    }
}

/// CRC-32C of a data page, as entries carry it.
pub fn page_crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}
