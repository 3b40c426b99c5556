//! Metadata units: a 64-byte header and the entries of `slots_per_unit` consecutive slots.
//!
//! The header carries the unit's own index and the device UUID, and its checksum covers the
//! whole unit, so a torn unit, a unit written to the wrong place and a unit of another device
//! are all rejected on load.

use crate::layout::{Layout, ENTRY_HEADER, UNIT_HEADER};
use crate::superblock::{rd16, rd32, rd64, FORMAT_VERSION};

/// First bytes of a unit.
pub const UNIT_MAGIC: u32 = u32::from_le_bytes(*b"SCMU");
/// `frag` value of an entry that holds nothing.
pub const NO_FRAGMENT: u64 = u64::MAX;
const CRC_AT: usize = 40;
/// Where a unit keeps its journal note (format 4).
const NOTE_AT: usize = 44;
/// Entry flag: the record reflects every journal entry below its unit's note.
const REFLECTS: u16 = 1;

/// Why a unit was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitError {
    /// All zero: never written.
    Blank,
    /// Wrong magic or version: not a unit, or garbage.
    NotAUnit,
    /// The checksum does not match: torn or corrupted.
    Checksum,
    /// A valid unit of this device but for another position: a misdirected write.
    Misplaced(u32),
    /// A valid unit of another device.
    Foreign,
}

impl std::fmt::Display for UnitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UnitError::Blank => f.write_str("never written"),
            UnitError::NotAUnit => f.write_str("not a metadata unit"),
            UnitError::Checksum => f.write_str("checksum mismatch (torn or corrupted)"),
            UnitError::Misplaced(u) => write!(f, "holds unit {u} (misdirected write)"),
            UnitError::Foreign => f.write_str("belongs to another cache device"),
        }
    }
}

/// Builds the image of one unit.
pub struct UnitBuilder<'a> {
    layout: &'a Layout,
    buf: Vec<u8>,
}

/// One slot's record, as written.
pub struct EntryIn<'a> {
    /// The fragment the slot holds.
    pub frag: u64,
    /// Volume id.
    pub volume: u16,
    /// Volume generation.
    pub generation: u32,
    /// Page-validity bitmap (`layout.bitmap_words()` words).
    pub bitmap: &'a [u64],
    /// Pages only the cache holds (write-back): valid ones are dirty, invalid ones lost (their
    /// only copy went bad; reads of them fail). Empty for none.
    pub dirty: &'a [u64],
}

impl<'a> UnitBuilder<'a> {
    /// An image of unit `unit` with every entry empty.
    pub fn new(layout: &'a Layout, uuid: &[u8; 16], unit: u32, seq: u64) -> Self {
        let mut buf = vec![0u8; layout.unit_size as usize];
        buf[0..4].copy_from_slice(&UNIT_MAGIC.to_le_bytes());
        buf[4..8].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf[8..12].copy_from_slice(&unit.to_le_bytes());
        buf[12..16].copy_from_slice(&layout.slots_per_unit.to_le_bytes());
        buf[16..32].copy_from_slice(uuid);
        buf[32..40].copy_from_slice(&seq.to_le_bytes());
        let mut b = UnitBuilder { layout, buf };
        for i in 0..layout.slots_per_unit {
            let e = b.entry_mut(i);
            e[0..8].copy_from_slice(&NO_FRAGMENT.to_le_bytes());
            e[14..16].copy_from_slice(&REFLECTS.to_le_bytes());
        }
        b
    }

    /// The journal block below which every entry is reflected in the unit's records (the
    /// round noted it before its snapshot): a load replays older dirty entries of a slot
    /// only if its record says it does not reflect them.
    pub fn set_note(&mut self, note: u64) {
        self.buf[NOTE_AT..NOTE_AT + 8].copy_from_slice(&note.to_le_bytes());
    }

    /// Entry `i` does not reflect the journal (a record the round had to leave empty).
    pub fn unreflect(&mut self, i: u32) {
        self.entry_mut(i)[14..16].copy_from_slice(&0u16.to_le_bytes());
    }

    fn entry_mut(&mut self, i: u32) -> &mut [u8] {
        let es = self.layout.entry_size as usize;
        let at = UNIT_HEADER as usize + i as usize * es;
        &mut self.buf[at..at + es]
    }

    /// Sets entry `i` (the slot's index in the unit); `crc(p)` gives the checksum of page `p`,
    /// asked only for valid pages (an invalid page's is 0).
    pub fn set(&mut self, i: u32, e: &EntryIn<'_>, crc: impl Fn(u32) -> u32) {
        self.set_entry(i, e);
        let valid = |p: u32| e.bitmap[p as usize / 64] >> (p % 64) & 1 == 1;
        self.set_crcs(i, |p| if valid(p) { crc(p) } else { 0 });
    }

    /// Sets entry `i`'s fragment, generation, volume and bitmaps, not its page checksums
    /// (`set_crcs` writes those).
    pub fn set_entry(&mut self, i: u32, e: &EntryIn<'_>) {
        let words = self.layout.bitmap_words();
        let b = self.entry_mut(i);
        b[0..8].copy_from_slice(&e.frag.to_le_bytes());
        b[8..12].copy_from_slice(&e.generation.to_le_bytes());
        b[12..14].copy_from_slice(&e.volume.to_le_bytes());
        for (w, v) in e.bitmap.iter().take(words).enumerate() {
            let at = ENTRY_HEADER as usize + w * 8;
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            // A dirty bit on an invalid page says the page is lost (its only copy went bad).
            let d = e.dirty.get(w).copied().unwrap_or(0);
            let at = ENTRY_HEADER as usize + (words + w) * 8;
            b[at..at + 8].copy_from_slice(&d.to_le_bytes());
        }
    }

    /// Sets the page checksums of entry `i` to `crc(p)` for every page, valid or not (a
    /// cache that keeps checksums in memory only for the units in use writes every page's
    /// checksum it knows: a page whose write completes after the round is valid with the
    /// checksum the record holds, though the round saw it invalid).
    pub fn set_crcs(&mut self, i: u32, crc: impl Fn(u32) -> u32) {
        let words = self.layout.bitmap_words();
        let pages = self.layout.pages_per_fragment;
        let b = self.entry_mut(i);
        let crcs = ENTRY_HEADER as usize + 2 * words * 8;
        for p in 0..pages {
            let at = crcs + p as usize * 4;
            b[at..at + 4].copy_from_slice(&crc(p).to_le_bytes());
        }
    }

    /// Seals the unit (computes its checksum) and returns its image.
    pub fn finish(mut self) -> Vec<u8> {
        self.buf[CRC_AT..CRC_AT + 4].fill(0);
        let crc = crc32c::crc32c(&self.buf);
        self.buf[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        self.buf
    }
}

/// A decoded entry, borrowing the unit image.
#[derive(Clone, Copy)]
pub struct EntryRef<'a> {
    bytes: &'a [u8],
    words: usize,
}

impl EntryRef<'_> {
    /// The fragment, or `NO_FRAGMENT`.
    pub fn frag(&self) -> u64 {
        rd64(self.bytes, 0)
    }
    /// Volume generation.
    pub fn generation(&self) -> u32 {
        rd32(self.bytes, 8)
    }
    /// Volume id.
    pub fn volume(&self) -> u16 {
        rd16(self.bytes, 12)
    }
    /// True if the record reflects every journal entry below its unit's note.
    pub fn reflects(&self) -> bool {
        rd16(self.bytes, 14) & REFLECTS != 0
    }
    /// Bitmap word `w`.
    pub fn bitmap_word(&self, w: usize) -> u64 {
        rd64(self.bytes, ENTRY_HEADER as usize + w * 8)
    }
    /// The page-validity bitmap.
    pub fn bitmap(&self) -> Vec<u64> {
        (0..self.words).map(|w| self.bitmap_word(w)).collect()
    }
    /// Dirty-bitmap word `w`: pages only the cache holds (valid ones), or whose only copy
    /// was lost (invalid ones).
    pub fn dirty_word(&self, w: usize) -> u64 {
        rd64(self.bytes, ENTRY_HEADER as usize + (self.words + w) * 8)
    }
    /// The checksum of page `p`.
    pub fn crc(&self, p: u32) -> u32 {
        rd32(
            self.bytes,
            ENTRY_HEADER as usize + 2 * self.words * 8 + p as usize * 4,
        )
    }
}

/// The journal note of a unit (valid units only; see [`UnitBuilder::set_note`]).
pub fn unit_note(buf: &[u8]) -> u64 {
    rd64(buf, NOTE_AT)
}

/// The sequence number a unit was written with (valid units only).
pub fn unit_seq(buf: &[u8]) -> u64 {
    rd64(buf, 32)
}

/// Checks the image of unit `unit` and calls `each(index_in_unit, entry)` for every entry if
/// it is sound.
pub fn decode_unit(
    layout: &Layout,
    uuid: &[u8; 16],
    unit: u32,
    buf: &[u8],
    mut each: impl FnMut(u32, EntryRef<'_>),
) -> Result<(), UnitError> {
    let n = layout.unit_size as usize;
    if buf.len() < n {
        return Err(UnitError::NotAUnit);
    }
    let buf = &buf[..n];
    if buf.iter().all(|&b| b == 0) {
        return Err(UnitError::Blank);
    }
    if rd32(buf, 0) != UNIT_MAGIC
        || rd32(buf, 4) != FORMAT_VERSION
        || rd32(buf, 12) != layout.slots_per_unit
    {
        return Err(UnitError::NotAUnit);
    }
    let stored = rd32(buf, CRC_AT);
    let mut h = crc32c::crc32c(&buf[..CRC_AT]);
    h = crc32c::crc32c_append(h, &[0; 4]);
    h = crc32c::crc32c_append(h, &buf[CRC_AT + 4..]);
    if h != stored {
        return Err(UnitError::Checksum);
    }
    if buf[16..32] != uuid[..] {
        return Err(UnitError::Foreign);
    }
    let at = rd32(buf, 8);
    if at != unit {
        return Err(UnitError::Misplaced(at));
    }
    let es = layout.entry_size as usize;
    let words = layout.bitmap_words();
    for i in 0..layout.slots_per_unit {
        let at = UNIT_HEADER as usize + i as usize * es;
        each(
            i,
            EntryRef {
                bytes: &buf[at..at + es],
                words,
            },
        );
    }
    Ok(())
}
