//! The commit record of the write-back log: one 4 KiB block, written twice.
//!
//! | at | type | field |
//! |---|---|---|
//! | 0 | [u8; 8] | magic `SCEWBLOG` |
//! | 8 | u32 | record version: 8 (7 before `copy2` and cleaned entries, 6 before tombstones; all are read) |
//! | 12 | u32 | CRC-32C of the caller's 16-byte key followed by the block with this field zero |
//! | 16 | u64 | seq: the commit's number (each the previous + 1) |
//! | 24 | u64 | lpos: its own log position (of the first copy) |
//! | 32 | u64 | tail: the oldest position its writer still needed |
//! | 40 | u64 | link: XXH3-64 of the record before it (0 for a writer's first record) |
//! | 48 | u64 | epoch: random, one per writer incarnation |
//! | 56 | u64 | resumed_from: in the first commit after a replay, the first seq of the commit the replay ended with (its data may be torn); else 0 |
//! | 64 | u32 | entries (at most 167) |
//! | 68 | u16, u16 | index of this record in its commit, records in the commit |
//! | 72 | u32 | copy2: where the record's second copy is: 0 beside the first (position + 1, as versions 6 and 7 always had it), k > 0 in slot k - 1 of the log's mirror area |
//! | 76 | [u8; 4] | zero |
//! | 80 + 24*i | entry | data position u64, page u64, volume u32, CRC-32C of the page u32; a position of `u64::MAX` is a tombstone (the page is lost; CRC 0), `u64::MAX - 1` a cleaned entry (the source holds the page's newest bytes; CRC 0) |
//!
//! Records of version 7 may hold tombstones, and of version 8 cleaned entries and copies in
//! the mirror area; the superblock of a device that may hold them is format 7 or 8, which a
//! build that reads only an older format refuses.

use super::{LogEntry, ENTRIES_PER_RECORD, LOG_BLOCK};
use crate::superblock::{rd16, rd32, rd64};

/// First bytes of a commit record.
pub const WBLOG_MAGIC: [u8; 8] = *b"SCEWBLOG";
/// The record version written (8: a second copy may lie in the mirror area, and entries may
/// be cleaned entries; 7: entries may be tombstones).
pub const WBLOG_VERSION: u32 = 8;
/// The oldest record version read (6: written before tombstones; a log goes on from it).
pub const WBLOG_VERSION_FIRST: u32 = 6;
/// Bytes of a record's header.
pub const RECORD_HEADER: usize = 80;
/// Bytes of one entry.
pub const RECORD_ENTRY: usize = 24;
const CRC_AT: usize = 12;

/// A commit record's fields but its entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordHeader {
    /// Commit number.
    pub seq: u64,
    /// Its own position (of the first copy).
    pub lpos: u64,
    /// The oldest position its writer still needed.
    pub tail: u64,
    /// [`record_link`] of the record before it (0: none).
    pub link: u64,
    /// The writer's incarnation.
    pub epoch: u64,
    /// In a writer's first commit after a replay: the first seq of the commit that replay
    /// ended with, whose data pages may be torn (0: none).
    pub resumed_from: u64,
    /// Index of the record within its commit.
    pub group_index: u16,
    /// Records in its commit.
    pub group_len: u16,
    /// Where its second copy is: 0 beside the first (at `lpos + 1`), `k > 0` in slot `k - 1`
    /// of the mirror area.
    pub copy2: u32,
}

impl RecordHeader {
    /// The first seq of the commit this record belongs to.
    pub fn group_first(&self) -> u64 {
        self.seq - self.group_index as u64
    }
    /// The ring positions its copies take there: 2 beside each other, 1 with the second in
    /// the mirror area.
    pub fn ring_blocks(&self) -> u64 {
        if self.copy2 == 0 {
            2
        } else {
            1
        }
    }
}

/// A decoded commit record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Its header.
    pub header: RecordHeader,
    /// The data pages it commits, in the order their writes completed.
    pub entries: Vec<LogEntry>,
}

/// Why a block is not a commit record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordError {
    /// Wrong magic, version or entry count: data, or garbage.
    NotARecord,
    /// The keyed checksum does not match: torn, damaged, or not written with this key.
    Checksum,
}

fn keyed_crc(key: &[u8; 16], b: &[u8]) -> u32 {
    let mut h = crc32c::crc32c(key);
    h = crc32c::crc32c_append(h, &b[..CRC_AT]);
    h = crc32c::crc32c_append(h, &[0; 4]);
    crc32c::crc32c_append(h, &b[CRC_AT + 4..])
}

/// Writes the image of a record into `out` (4 KiB).
///
/// # Panics
/// If `entries` holds more than [`ENTRIES_PER_RECORD`] or `out` is not 4 KiB.
pub fn encode_record(key: &[u8; 16], h: &RecordHeader, entries: &[LogEntry], out: &mut [u8]) {
    assert!(entries.len() <= ENTRIES_PER_RECORD, "a record overflows");
    assert_eq!(out.len(), LOG_BLOCK as usize, "a record is one block");
    out.fill(0);
    out[0..8].copy_from_slice(&WBLOG_MAGIC);
    out[8..12].copy_from_slice(&WBLOG_VERSION.to_le_bytes());
    for (at, v) in [
        (16, h.seq),
        (24, h.lpos),
        (32, h.tail),
        (40, h.link),
        (48, h.epoch),
        (56, h.resumed_from),
    ] {
        out[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
    out[64..68].copy_from_slice(&(entries.len() as u32).to_le_bytes());
    out[68..70].copy_from_slice(&h.group_index.to_le_bytes());
    out[70..72].copy_from_slice(&h.group_len.to_le_bytes());
    out[72..76].copy_from_slice(&h.copy2.to_le_bytes());
    for (i, e) in entries.iter().enumerate() {
        let at = RECORD_HEADER + i * RECORD_ENTRY;
        out[at..at + 8].copy_from_slice(&e.lpos.to_le_bytes());
        out[at + 8..at + 16].copy_from_slice(&e.page.to_le_bytes());
        out[at + 16..at + 20].copy_from_slice(&e.volume.to_le_bytes());
        out[at + 20..at + 24].copy_from_slice(&e.crc.to_le_bytes());
    }
    let crc = keyed_crc(key, out);
    out[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
}

/// True if `b` may be a record: the cheap test before the checksum.
pub(super) fn looks_like_record(b: &[u8]) -> bool {
    b.len() >= RECORD_HEADER && b[0..8] == WBLOG_MAGIC
}

/// Decodes a record written with `key`.
pub fn decode_record(key: &[u8; 16], b: &[u8]) -> Result<Record, RecordError> {
    let b = b.get(..LOG_BLOCK as usize).ok_or(RecordError::NotARecord)?;
    let n = rd32(b, 64) as usize;
    let version = rd32(b, 8);
    let known = (WBLOG_VERSION_FIRST..=WBLOG_VERSION).contains(&version);
    if !looks_like_record(b) || !known || n > ENTRIES_PER_RECORD {
        return Err(RecordError::NotARecord);
    }
    if keyed_crc(key, b) != rd32(b, CRC_AT) {
        return Err(RecordError::Checksum);
    }
    let header = RecordHeader {
        seq: rd64(b, 16),
        lpos: rd64(b, 24),
        tail: rd64(b, 32),
        link: rd64(b, 40),
        epoch: rd64(b, 48),
        resumed_from: rd64(b, 56),
        group_index: rd16(b, 68),
        group_len: rd16(b, 70),
        copy2: rd32(b, 72),
    };
    let entries = (0..n)
        .map(|i| {
            let at = RECORD_HEADER + i * RECORD_ENTRY;
            LogEntry {
                lpos: rd64(b, at),
                page: rd64(b, at + 8),
                volume: rd32(b, at + 16),
                crc: rd32(b, at + 20),
            }
        })
        .collect();
    Ok(Record { header, entries })
}

/// The hash the next record carries as its `link`: XXH3-64 of this record's 4 KiB image.
pub fn record_link(img: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(img)
}
