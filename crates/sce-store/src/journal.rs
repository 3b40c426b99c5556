//! The write journal: a ring of 4 KiB blocks naming the pages that writes are about to
//! change on the source (Mercury's persistent invalidation, at page granularity).
//!
//! Before a source write to pages that a slot's durable record may claim, the engine appends
//! an entry (fragment, first page, page count) and waits until a block holding it is durable;
//! concurrent writers share one block (group commit). At load, every entry of a live block
//! (this device's, checksum right, sequence at or above the superblock's journal tail) drops
//! exactly those pages from the loaded records. Each commit writes a fresh block at ring
//! position `seq % ring`; a block is overwritten only once a flush round made durable the
//! records its entries vouch for, so a torn write only loses entries whose source writes
//! were never sent.
//!
//! Block layout (all little-endian):
//!
//! | at | type | field |
//! |---|---|---|
//! | 0 | u32 | magic `SCEJ` |
//! | 4 | u32 | format version |
//! | 8 | u32 | CRC-32C of the block with this field zero |
//! | 12 | u32 | entries in the block |
//! | 16 | [u8; 16] | device UUID |
//! | 32 | u64 | sequence number |
//! | 40 | u32 | the block's index in the ring |
//! | 44 | u64 | the first sequence number of the group commit that wrote it (format 5) |
//! | 52 | u32 | the ring's length in blocks when it was written (format 5; 0: unknown) |
//! | 64 + 32*i | entry | see below |
//!
//! An entry (32 bytes): fragment u64, volume id u16, kind u16 (0: pages about to change on
//! the source, 1: a dirty page), first page u16, pages u16, then for a dirty page (format 4,
//! write-back): slot u32, the page's new checksum u32, its previous checksum u32, what the
//! page was before (u8: 0 not valid, 1 clean, 2 dirty), reserved u8, the page's length u16.
//!
//! # Dirty entries (write-back)
//! A write-back write appends one dirty entry per page it writes, and waits until they are
//! durable, *before* it writes the data into the slot. At load the live entries are
//! replayed in sequence order over the records: a dirty entry makes its slot hold its
//! fragment and the page a candidate, and the page's data is read and checked: the new
//! checksum means the write landed (valid, dirty), the previous one that it did not (valid,
//! as it was before), neither that the data is torn: the page is invalid, and **lost** if it
//! was dirty before (the older bytes are gone and the source's are older still).

use crate::layout::{Layout, BLOCK};
use crate::superblock::{rd16, rd32, rd64, FORMAT_VERSION};
use crate::Superblock;
use sce_io::{AlignedBuf, BlockDevice, IoError};

/// First bytes of a journal block.
pub const JOURNAL_MAGIC: u32 = u32::from_le_bytes(*b"SCEJ");
/// Bytes of a journal block header.
pub const JOURNAL_HEADER: usize = 64;
/// Bytes of one journal entry.
pub const JOURNAL_ENTRY: usize = 32;
/// Entries one journal block holds (126).
pub const ENTRIES_PER_BLOCK: usize = (BLOCK as usize - JOURNAL_HEADER) / JOURNAL_ENTRY;
const CRC_AT: usize = 8;

/// Pages of a fragment about to be written on the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct JournalEntry {
    /// The (global) fragment.
    pub frag: u64,
    /// The volume's id in the table.
    pub volume: u16,
    /// First page of the range within the fragment.
    pub first: u16,
    /// Pages in the range (at least 1).
    pub pages: u16,
    /// A dirty page (write-back): `first` is the page and `pages` 1. None: the pages are
    /// about to change on the source.
    pub dirty: Option<DirtyPage>,
}

/// A page a write-back write is about to write into a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DirtyPage {
    /// The slot.
    pub slot: u32,
    /// The checksum of the page's new content.
    pub crc: u32,
    /// What the page held before.
    pub prev: PrevPage,
    /// Bytes of the page (less than 4 KiB only at the end of a source).
    pub len: u16,
}

/// What a page held before a write-back write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum PrevPage {
    /// Nothing valid.
    Invalid,
    /// A clean copy (the source has it) with this checksum.
    Clean(u32),
    /// Dirty data (only the cache has it) with this checksum.
    Dirty(u32),
}

/// Why a journal block was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JournalError {
    /// All zero: never written.
    Blank,
    /// Wrong magic, version or entry count: not a journal block, or garbage.
    NotABlock,
    /// The checksum does not match: torn or corrupted.
    Checksum,
    /// A sound block of another device.
    Foreign,
}

/// The image of journal block `index` with sequence `seq` holding `entries`, as a commit of
/// its own in a ring of unknown length (see [`encode_commit_block`]).
pub fn encode_block(uuid: &[u8; 16], seq: u64, index: u32, entries: &[JournalEntry]) -> Vec<u8> {
    encode_commit_block(uuid, (seq, index), (seq, 0), entries)
}

/// The image of journal block `index` with sequence `seq` holding `entries` (at most
/// [`ENTRIES_PER_BLOCK`]), written by the group commit whose first block is `commit_first`
/// into a ring of `ring` blocks. Every block below `commit_first` was made durable by an
/// earlier commit: at load, one missing from the live range is damage, not a torn write.
pub fn encode_commit_block(
    uuid: &[u8; 16],
    (seq, index): (u64, u32),
    (commit_first, ring): (u64, u32),
    entries: &[JournalEntry],
) -> Vec<u8> {
    assert!(
        entries.len() <= ENTRIES_PER_BLOCK,
        "a journal block overflows"
    );
    let mut b = vec![0u8; BLOCK as usize];
    b[0..4].copy_from_slice(&JOURNAL_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&(entries.len() as u32).to_le_bytes());
    b[16..32].copy_from_slice(uuid);
    b[32..40].copy_from_slice(&seq.to_le_bytes());
    b[40..44].copy_from_slice(&index.to_le_bytes());
    b[44..52].copy_from_slice(&commit_first.to_le_bytes());
    b[52..56].copy_from_slice(&ring.to_le_bytes());
    for (i, e) in entries.iter().enumerate() {
        let at = JOURNAL_HEADER + i * JOURNAL_ENTRY;
        b[at..at + 8].copy_from_slice(&e.frag.to_le_bytes());
        b[at + 8..at + 10].copy_from_slice(&e.volume.to_le_bytes());
        b[at + 12..at + 14].copy_from_slice(&e.first.to_le_bytes());
        b[at + 14..at + 16].copy_from_slice(&e.pages.to_le_bytes());
        if let Some(d) = e.dirty {
            b[at + 10..at + 12].copy_from_slice(&1u16.to_le_bytes());
            b[at + 16..at + 20].copy_from_slice(&d.slot.to_le_bytes());
            b[at + 20..at + 24].copy_from_slice(&d.crc.to_le_bytes());
            let (kind, prev) = match d.prev {
                PrevPage::Invalid => (0u8, 0),
                PrevPage::Clean(c) => (1, c),
                PrevPage::Dirty(c) => (2, c),
            };
            b[at + 24..at + 28].copy_from_slice(&prev.to_le_bytes());
            b[at + 28] = kind;
            b[at + 30..at + 32].copy_from_slice(&d.len.to_le_bytes());
        }
    }
    let crc = crc32c::crc32c(&b);
    b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    b
}

/// A decoded journal block: its sequence number, the ring index it was written for, its
/// entries.
pub type DecodedBlock = (u64, u32, Vec<JournalEntry>);

/// Decodes a journal block of device `uuid`. The ring index it names is returned, not
/// checked: a sound block of this device found at another position (a misdirected write)
/// still names pages that may have been written, and dropping them is always safe.
pub fn decode_block(uuid: &[u8; 16], buf: &[u8]) -> Result<DecodedBlock, JournalError> {
    let b = buf.get(..BLOCK as usize).ok_or(JournalError::NotABlock)?;
    if b.iter().all(|&x| x == 0) {
        return Err(JournalError::Blank);
    }
    let n = rd32(b, 12) as usize;
    if rd32(b, 0) != JOURNAL_MAGIC || rd32(b, 4) != FORMAT_VERSION || n > ENTRIES_PER_BLOCK {
        return Err(JournalError::NotABlock);
    }
    let mut h = crc32c::crc32c(&b[..CRC_AT]);
    h = crc32c::crc32c_append(h, &[0; 4]);
    h = crc32c::crc32c_append(h, &b[CRC_AT + 4..]);
    if h != rd32(b, CRC_AT) {
        return Err(JournalError::Checksum);
    }
    if b[16..32] != uuid[..] {
        return Err(JournalError::Foreign);
    }
    let entries = (0..n)
        .map(|i| {
            let at = JOURNAL_HEADER + i * JOURNAL_ENTRY;
            let prev = rd32(b, at + 24);
            let dirty = (rd16(b, at + 10) == 1).then(|| DirtyPage {
                slot: rd32(b, at + 16),
                crc: rd32(b, at + 20),
                prev: match b[at + 28] {
                    1 => PrevPage::Clean(prev),
                    2 => PrevPage::Dirty(prev),
                    _ => PrevPage::Invalid,
                },
                len: rd16(b, at + 30),
            });
            JournalEntry {
                frag: rd64(b, at),
                volume: rd16(b, at + 8),
                first: rd16(b, at + 12),
                pages: rd16(b, at + 14),
                dirty,
            }
        })
        .collect();
    Ok((rd64(b, 32), rd32(b, 40), entries))
}

/// What scanning the journal ring found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct JournalScan {
    /// Entries of the live blocks (sequence at or above the tail), in sequence order.
    #[serde(skip)]
    pub entries: Vec<JournalEntry>,
    /// The block of each entry.
    #[serde(skip)]
    pub seqs: Vec<u64>,
    /// Live blocks (each counted once, whether one copy or both were sound).
    pub blocks_live: u32,
    /// Sound blocks of this device below the tail (older laps, already covered by records).
    pub blocks_old: u32,
    /// Blocks never written.
    pub blocks_blank: u32,
    /// Torn or damaged blocks (a live block whose other copy is sound loses nothing).
    pub blocks_bad: u32,
    /// Sound blocks of another device (ignored).
    pub blocks_foreign: u32,
    /// Live blocks found in one copy only, the other position holding a damaged block.
    pub blocks_repaired: u32,
    /// Blocks of an earlier group commit (so made durable before a later one was written)
    /// that neither copy holds any more, though no later lap overwrote them: damage. Their
    /// entries, whatever pages they named, are gone.
    pub blocks_missing: u32,
    /// Every block the ring should hold and does not (those of `blocks_missing`, and torn
    /// blocks of the last commit), with the ring length they were written in: a start
    /// writes an empty block for each before anything is served, so that the journal is
    /// whole again and a torn commit is not taken for damage once later commits follow it.
    #[serde(skip)]
    pub gaps: (Vec<u64>, u32),
    /// The highest sequence number of any sound block of this device (None: none).
    pub max_seq: Option<u64>,
}

impl JournalScan {
    /// The first sequence number a restarted journal may use: above every block on the
    /// device and at least the tail, so no block written before counts as live again.
    pub fn next_seq(&self, tail: u64) -> u64 {
        self.max_seq.map_or(tail, |m| (m + 1).max(tail))
    }
}

/// A sound block as found: sequence, ring position, first block of its commit, ring length,
/// entries.
struct Found {
    seq: u64,
    at: u32,
    commit_first: u64,
    ring: u32,
    entries: Vec<JournalEntry>,
}

/// Reads the whole journal ring of `sb`'s device and keeps the entries of its live blocks.
/// The engine writes each block twice (at its position in each half of the region); a
/// block counts once if either copy is sound.
pub fn scan_journal(dev: &dyn BlockDevice, sb: &Superblock) -> Result<JournalScan, IoError> {
    let l: &Layout = &sb.layout;
    let mut scan = JournalScan::default();
    let per_chunk = 256u32;
    let mut buf = AlignedBuf::new((per_chunk as u64 * BLOCK) as usize);
    let mut found: Vec<Found> = Vec::new();
    let mut bad_at: Vec<u32> = Vec::new();
    let mut b = 0;
    while b < l.journal_blocks {
        let n = per_chunk.min(l.journal_blocks - b);
        let bytes = (n as u64 * BLOCK) as usize;
        dev.read_at(l.journal_block_offset(b), &mut buf[..bytes])?;
        for k in 0..n {
            let img = &buf[(k as u64 * BLOCK) as usize..((k + 1) as u64 * BLOCK) as usize];
            match decode_block(&sb.uuid, img) {
                Ok((seq, _, entries)) => {
                    scan.max_seq = Some(scan.max_seq.map_or(seq, |m| m.max(seq)));
                    let (commit_first, ring) = (rd64(img, 44), rd32(img, 52));
                    let at = b + k;
                    found.push(Found {
                        seq,
                        at,
                        commit_first,
                        ring,
                        entries,
                    });
                }
                Err(JournalError::Blank) => scan.blocks_blank += 1,
                Err(JournalError::NotABlock | JournalError::Checksum) => {
                    scan.blocks_bad += 1;
                    bad_at.push(b + k);
                }
                Err(JournalError::Foreign) => scan.blocks_foreign += 1,
            }
        }
        b += n;
    }
    found.sort_by_key(|f| (f.seq, f.at));
    let landed = sb.journal_landed;
    scan.gaps = gaps(
        &found,
        sb.journal_tail,
        landed,
        (l.journal_blocks / 2).max(1),
    );
    // Durable for sure: blocks of an earlier commit than the newest sound block's, and
    // every block below `journal_landed` (a completed FLUSH came after them).
    let durable = found.last().map_or(0, |n| n.commit_first).max(landed);
    scan.blocks_missing = scan.gaps.0.iter().filter(|&&s| s < durable).count() as u32;
    let mut live: Vec<(u64, Vec<JournalEntry>)> = Vec::new();
    let mut copies = 0;
    for f in found {
        if f.seq < sb.journal_tail {
            scan.blocks_old += 1;
            continue;
        }
        if live.last().is_some_and(|b| b.0 == f.seq) {
            copies += 1;
            continue;
        }
        scan.blocks_live += 1;
        live.push((f.seq, f.entries));
    }
    // Live blocks with one sound copy whose other copy's place holds a damaged block.
    let half = l.journal_blocks / 2;
    scan.blocks_repaired = (scan.blocks_live - copies).min(
        bad_at
            .iter()
            .filter(|&&at| half > 0 && at < 2 * half)
            .count() as u32,
    );
    // Dirty entries are replayed in the order they were written.
    scan.seqs = live
        .iter()
        .flat_map(|b| std::iter::repeat_n(b.0, b.1.len()))
        .collect();
    scan.entries = live.into_iter().flat_map(|b| b.1).collect();
    Ok(scan)
}

/// The blocks from the tail up to the newest sound block, or up to `landed` if that is
/// higher, that are gone, with the ring length (the newest block's, else `half`): a block
/// whose position holds a sound block with a higher sequence number was replaced by a later
/// lap (the tail had moved past it, even if the superblock that says so is the older copy)
/// and is not missing. Those below the first block of the newest block's commit, or below
/// `landed`, were made durable: their loss is damage. Those of the newest commit may be
/// torn by a crash: their writes were never acknowledged.
fn gaps(found: &[Found], tail: u64, landed: u64, half: u32) -> (Vec<u64>, u32) {
    let ring = found.last().map_or(half, |n| n.ring) as u64;
    // The highest block that must be there: the newest sound one, or the last below
    // `landed`.
    let Some(top) = found.last().map(|n| n.seq).max(landed.checked_sub(1)) else {
        return (Vec::new(), 0);
    };
    if ring == 0 || top < tail {
        return (Vec::new(), 0);
    }
    let present: std::collections::BTreeSet<u64> = found.iter().map(|f| f.seq).collect();
    let mut newest_at: std::collections::HashMap<u64, u64> = Default::default();
    for f in found {
        let e = newest_at.entry(f.seq % ring).or_insert(f.seq);
        *e = (*e).max(f.seq);
    }
    // A block a whole ring below the top was overwritten by a later lap anyway.
    let from = tail.max((top + 1).saturating_sub(ring));
    let gone = (from..=top)
        .filter(|s| !present.contains(s))
        .filter(|s| newest_at.get(&(s % ring)).is_none_or(|&n| n < *s))
        .collect();
    (gone, ring as u32)
}
