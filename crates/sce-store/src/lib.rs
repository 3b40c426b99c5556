//! `sce-store`: the on-device format of sce's persistent cache (see `docs/FORMAT.md`).
//!
//! * [`layout`]: where the superblocks, the write-intent bitmap, the metadata units and the
//!   data slots live.
//! * [`superblock`]: the superblock (two alternating copies) and its volume table.
//! * [`journal`]: the write journal, a ring naming the pages writes are about to change.
//! * [`wblog`]: the write-back data log (formats 6 and 7; the engine's `log/` serves it): dirty data
//!   written out of place, committed at FLUSH, replayed after a crash.
//! * [`unit`](mod@unit): metadata units holding per-slot records: fragment, volume generation,
//!   page-validity bitmap and per-page CRC-32C checksums.
//! * This module: formatting ([`format()`]), loading ([`load`]), checking ([`check`]) and the
//!   checksums: the in-memory table of a cache without persistence ([`CrcTable`]) and a
//!   unit's checksums read back from the device ([`read_unit_crcs`]).
//!
//! The ordering rules that make the records safe to trust after a crash are the engine's
//! (`sce-engine`'s `persist` module); this crate only reads and writes the structures.

mod crcs;
mod format;
pub use crcs::{image_crcs, read_unit_crcs, CrcTable, UnitCrcs};
pub use format::{format, reformat, FormatOptions};
pub mod journal;
pub mod layout;
mod load;
mod replay;
pub mod superblock;
pub mod unit;
pub mod volumes;
pub mod wblog;
pub use volumes::{dirty_by_volume, ensure_volumes, find_volume, refuse_dirty_drop, VolumeDirt};

pub use layout::Layout;
pub use load::{load, load_volumes, LoadVolume};
pub use superblock::{
    uuid_string, DeviceState, LogInfo, Superblock, Volume, FORMAT_VERSION, LOG_FORMAT_VERSION,
};

use layout::{BLOCK, SLOTS_PER_INTENT_BLOCK};
use sce_io::{AlignedBuf, BlockDevice, IoError};
use unit::{decode_unit, UnitError};

/// Why a cache device cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The device does not start with an sce superblock.
    #[error("the device is not an sce cache device (no superblock); create one with `sce format` or pass --reformat")]
    NotFormatted,
    /// The superblock is damaged.
    #[error("the cache device's superblock is corrupt: {0}")]
    Corrupt(String),
    /// Written by a newer sce.
    #[error("the cache device has format version {0}, newer than this sce's {LOG_FORMAT_VERSION}; use a newer sce or pass --reformat")]
    Version(u32),
    /// The device caches another source.
    #[error("the cache device belongs to another source ({0}); pass --reformat to reuse it for this one")]
    Foreign(String),
    /// Written by an older sce whose format this one does not read.
    #[error("the cache device has format version {0}, older than this sce's {FORMAT_VERSION}; this version cannot trust its contents: pass --reformat (or run `sce format --force`) to reformat it, which starts the cache cold")]
    OldVersion(u32),
    /// The device was disabled after errors.
    #[error("the cache device was disabled after device errors; pass --reformat to reuse it")]
    Failed,
    /// The action would drop dirty (write-back) data the operator did not give up.
    #[error("{0}")]
    DirtyData(String),
    /// Metadata damaged in both copies, on a device whose data may be the only copy.
    #[error("{0}")]
    Unlocatable(String),
    /// The geometry is impossible.
    #[error("{0}")]
    Geometry(String),
    /// A device error.
    #[error(transparent)]
    Io(#[from] IoError),
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes the superblock copy its sequence number selects, and flushes.
pub fn write_superblock(dev: &dyn BlockDevice, sb: &Superblock) -> Result<(), IoError> {
    let img = sb.encode();
    let mut buf = AlignedBuf::new(BLOCK as usize);
    buf.copy_from_slice(&img);
    dev.write_at(Superblock::copy_offset(sb.seq), &buf)?;
    dev.flush()
}

/// Reads both superblock copies and returns the valid one with the higher sequence number.
pub fn read_superblock(dev: &dyn BlockDevice) -> Result<Superblock, StoreError> {
    if dev.size() < 2 * BLOCK {
        return Err(StoreError::NotFormatted);
    }
    let mut buf = AlignedBuf::new(2 * BLOCK as usize);
    dev.read_at(0, &mut buf)?;
    let a = Superblock::decode(&buf[..BLOCK as usize]);
    let b = Superblock::decode(&buf[BLOCK as usize..]);
    let sb = match (a, b) {
        (Ok(a), Ok(b)) => {
            if a.seq >= b.seq {
                a
            } else {
                b
            }
        }
        // The other copy damaged (not merely unwritten, as on a device formatted by hand):
        // the one found may be one write older than the device's newest state.
        (Ok(mut s), Err(e)) | (Err(e), Ok(mut s)) => {
            s.other_copy_damaged = !matches!(e, StoreError::NotFormatted);
            s
        }
        (Err(StoreError::NotFormatted), Err(StoreError::NotFormatted)) => {
            return Err(StoreError::NotFormatted)
        }
        (Err(e @ StoreError::Version(_)), _) | (_, Err(e @ StoreError::Version(_))) => {
            return Err(e)
        }
        (Err(e), Err(_)) => return Err(e),
    };
    let end = match &sb.log {
        Some(log) => superblock::LogInfo::offset(&sb.layout) + log.blocks * BLOCK,
        None => sb.layout.cache_size,
    };
    if end > dev.size() {
        return Err(StoreError::Corrupt(format!(
            "the superblock describes {end} bytes but the device has {}",
            dev.size()
        )));
    }
    Ok(sb)
}

/// The checksum sce keeps for a page of data: the low 32 bits of XXH3-64 seeded with the
/// page's address ([`page_seed`]). It runs at about 15 GB/s here against 3.5 GB/s for the
/// `crc32c` crate, and every cache hit pays it; a random corruption escapes it with
/// probability 2^-32, as with a CRC-32. Because the seed is the page's volume and source
/// page number, the same bytes at another address have another checksum: a relabelled entry
/// or a misdirected data write fails verification. (Metadata, off the hot path, uses
/// CRC-32C.)
#[inline]
pub fn page_checksum(data: &[u8], seed: u64) -> u32 {
    xxhash_rust::xxh3::xxh3_64_with_seed(data, seed) as u32
}

/// The checksum seed of source page `page` (source byte offset / 4 KiB) of volume `volume`.
#[inline]
pub fn page_seed(volume: u16, page: u64) -> u64 {
    // Source pages fit in 52 bits (a 16 EiB source); the volume id takes the top bits.
    page ^ ((volume as u64) << 52)
}

/// The identity hash stored in the volume table for an identity description; all zero
/// stands for "unknown", so a real description never hashes to it.
pub fn identity_hash(description: &str) -> [u8; superblock::IDENTITY_BYTES] {
    let h = xxhash_rust::xxh3::xxh3_128(description.as_bytes()).max(1);
    h.to_le_bytes()
}

/// What scanning the metadata found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ScanReport {
    /// Units that decoded.
    pub units_ok: u32,
    /// Units never written.
    pub units_blank: u32,
    /// Units with a bad checksum (torn or corrupted) or garbage.
    pub units_corrupt: u32,
    /// Units holding another unit's image (misdirected writes).
    pub units_misplaced: u32,
    /// Units that never were this device's in either copy: another device's, another
    /// format's, or what the device held before it was formatted.
    pub units_foreign: u32,
    /// Units one of whose two copies was damaged, loaded from the other (and rewritten).
    pub units_repaired: u32,
    /// Entries that may be loaded: this volume's generation, no intent.
    pub slots_valid: u64,
    /// Entries of this volume dropped because their slot's write-intent bit is set.
    pub slots_dropped_intent: u64,
    /// Entries of an older generation or another volume.
    pub slots_stale: u64,
    /// Entries dropped because their fragment lies beyond the source.
    pub slots_out_of_range: u64,
    /// Entries dropped because their units were rejected (an upper bound: all their slots).
    pub slots_in_bad_units: u64,
    /// Write-intent bits set.
    pub intents_set: u64,
    /// Valid pages in the loadable entries (after the journal's drops).
    pub pages_valid: u64,
    /// Live write-journal blocks (sequence at or above the tail).
    pub journal_blocks_live: u64,
    /// Journal block copies that failed their checksum (torn or damaged).
    pub journal_blocks_bad: u64,
    /// Live journal blocks read from their other copy because one was damaged.
    pub journal_blocks_repaired: u64,
    /// Journal blocks of earlier commits that neither copy holds: damage whose pages are
    /// unknown (no clean page is trusted; a write-back start is refused).
    pub journal_blocks_missing: u64,
    /// Pages of loadable entries dropped because a live journal entry names them.
    pub journal_pages_dropped: u64,
    /// Loadable entries that lost pages to the journal.
    pub journal_fragments_hit: u64,
    /// Dirty pages loaded (write-back data only the cache holds).
    pub pages_dirty: u64,
    /// Pages of live dirty journal entries checked against the data.
    pub dirty_pages_replayed: u64,
    /// Dirty pages whose data was torn or bad: their only copy is gone (their dirty bits stay
    /// on invalid pages in `Loaded::dirty`, so reads of them fail).
    pub dirty_pages_lost: u64,
}

impl ScanReport {
    /// True if something was damaged (not just dropped by design).
    pub fn damaged(&self) -> bool {
        self.unrepairable() || self.units_repaired > 0 || self.journal_blocks_bad > 0
    }

    /// True if damage hit both copies of something of this device's: what it held cannot
    /// be located. (Units of another device are not counted: a reformatted device keeps
    /// its previous life's units until they are rewritten.)
    pub fn unrepairable(&self) -> bool {
        self.units_corrupt + self.units_misplaced > 0 || self.journal_blocks_missing > 0
    }
}

/// A loaded cache device, ready to restore into a core.
#[derive(Debug)]
pub struct Loaded {
    /// The superblock as found.
    pub superblock: Superblock,
    /// Index of the volume in the volume table.
    pub volume: usize,
    /// Loadable slots: (slot, fragment).
    pub entries: Vec<(u32, u64)>,
    /// Their bitmaps, `layout.bitmap_words()` words each, in `entries` order.
    pub bitmaps: Vec<u64>,
    /// Their dirty pages (write-back), laid out as `bitmaps`.
    pub dirty: Vec<u64>,
    /// Per slot: the journal block below which its record reflects every entry (0: none).
    pub notes: Vec<u64>,
    /// Checksums the journal's replay gave pages of loaded slots (slot, page, checksum),
    /// newer than their records' (which hold every other valid page's checksum: see
    /// [`read_unit_crcs`]).
    pub replayed_crcs: Vec<(u32, u32, u32)>,
    /// Per unit, the low 32 bits of the round sequence of the copy loaded (0: none): a
    /// primary copy that still has it is the one to trust ([`read_unit_crcs`]).
    pub unit_seqs: Vec<u32>,
    /// The write-intent bitmap as found (one bit per slot).
    pub intents: Vec<u64>,
    /// Slots whose on-device entry claims pages but which were not loaded (a set intent, an
    /// out-of-range fragment): their entries must be rewritten before the intent is cleared.
    pub unloaded_claims: Vec<u32>,
    /// Units that should be rewritten (rejected or holding dropped entries).
    pub rewrite_units: Vec<u32>,
    /// (slot, fragment in the caller's address space) of the records dropped for their
    /// slot's write intent: recently written, so likely hot. The engine fills them again
    /// from the source after the start (their old copies are never trusted).
    pub refill: Vec<(u32, u64)>,
    /// What the scan found.
    pub report: ScanReport,
    /// The write journal as found.
    pub journal: journal::JournalScan,
    /// Loaded slots whose records lost pages to the journal (their on-device records still
    /// claim them: the engine sets their intents before it resets the journal).
    pub journal_slots: Vec<u32>,
}

/// Reads the write-intent bitmap. Every bit past the last slot (the padding of the last
/// word and of the last block) must be clear: a set one is damage, and is refused rather
/// than trusted.
fn read_intents(dev: &dyn BlockDevice, l: &Layout) -> Result<Vec<u64>, StoreError> {
    let bytes = l.intent_blocks as usize * BLOCK as usize;
    let mut buf = AlignedBuf::new(bytes);
    dev.read_at(l.intent_offset, &mut buf)?;
    let slots = l.slots as usize;
    let words = slots.div_ceil(64);
    let mut intents: Vec<u64> = (0..words)
        .map(|w| u64::from_le_bytes(buf[w * 8..w * 8 + 8].try_into().expect("8 bytes")))
        .collect();
    let tail_bits = slots % 64;
    let stray_in_word = tail_bits != 0 && intents[words - 1] >> tail_bits != 0;
    let stray_past = buf[words * 8..].iter().any(|&b| b != 0);
    if stray_in_word || stray_past {
        return Err(StoreError::Corrupt(format!(
            "the write-intent bitmap has bits set past its last slot ({})",
            l.slots - 1
        )));
    }
    if tail_bits != 0 {
        intents[words - 1] &= (1u64 << tail_bits) - 1;
    }
    Ok(intents)
}

/// Tests bit `s` of a bitmap.
#[inline]
pub fn bit(words: &[u64], s: u32) -> bool {
    words[s as usize / 64] >> (s % 64) & 1 == 1
}

/// Scans every unit of `dev`, calling `each(slot, entry, note)` for the entries of each
/// unit's chosen copy and `bad(unit, error)` for units neither of whose copies is valid
/// (the primary's error, unless it is blank and the mirror is not). Of two valid copies the
/// one written by the later round wins (a crash between the two writes leaves the primary
/// newer); `repaired(unit)` is called for a unit one of whose copies is damaged (torn,
/// misdirected, foreign or garbage) while the other is valid. Reads in large sequential
/// chunks.
fn scan_units(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    mut each: impl FnMut(u32, unit::EntryRef<'_>, u64),
    mut bad: impl FnMut(u32, UnitError),
    mut repaired: impl FnMut(u32),
    mut chosen: impl FnMut(u32, u64),
) -> Result<(), IoError> {
    let l = &sb.layout;
    let us = l.unit_size as usize;
    let per_chunk = ((4 << 20) / l.unit_size).max(1);
    let mut prim = AlignedBuf::new(per_chunk as usize * us);
    let mut mirr = AlignedBuf::new(per_chunk as usize * us);
    let mut u = 0;
    while u < l.units {
        let n = per_chunk.min(l.units - u);
        let bytes = n as usize * us;
        dev.read_at(l.unit_offset(u), &mut prim[..bytes])?;
        dev.read_at(l.unit_mirror_offset(u), &mut mirr[..bytes])?;
        for k in 0..n as usize {
            let unit = u + k as u32;
            let copies = [&prim[k * us..(k + 1) * us], &mirr[k * us..(k + 1) * us]];
            let img = match choose_copy(l, &sb.uuid, unit, copies) {
                Ok((img, one_bad)) => {
                    if one_bad {
                        repaired(unit);
                    }
                    img
                }
                Err(e) => {
                    bad(unit, e);
                    continue;
                }
            };
            let Some(img) = img else {
                bad(unit, UnitError::Blank);
                continue;
            };
            let (first, end) = l.unit_slots(unit);
            let note = unit::unit_note(img);
            chosen(unit, unit::unit_seq(img));
            let r = decode_unit(l, &sb.uuid, unit, img, |i, e| {
                if first + i < end {
                    each(first + i, e, note)
                }
            });
            debug_assert!(r.is_ok(), "the chosen copy decodes");
        }
        u += n;
    }
    Ok(())
}

/// True if a rejected unit copy was this device's unit (damaged since), not something that
/// never was one.
fn ours(e: UnitError) -> bool {
    matches!(e, UnitError::Checksum | UnitError::Misplaced(_))
}

/// Of a unit's two copies (primary, mirror): the valid one, or of two valid ones the one of
/// the later round; with whether the other is damaged (not blank, not valid). A copy that
/// is not this device's unit at all (blank, garbage of another format or of what the device
/// held before it was formatted, another device's unit) held nothing of ours: beside it, a
/// damaged copy is a unit no round completed (a round writes the mirror only after the
/// primary is durable, and moves the journal's tail only after both): blank (None), its
/// damaged copy to be rewritten. Only two copies that were both this device's units and are
/// both damaged (torn, corrupt, misdirected) lose what the unit held.
#[allow(clippy::type_complexity)]
pub(crate) fn choose_copy<'a>(
    l: &Layout,
    uuid: &[u8; 16],
    unit: u32,
    copies: [&'a [u8]; 2],
) -> Result<(Option<&'a [u8]>, bool), UnitError> {
    let check = |img: &[u8]| decode_unit(l, uuid, unit, img, |_, _| {});
    match (check(copies[0]), check(copies[1])) {
        (Ok(()), Ok(())) => {
            let newer = unit::unit_seq(copies[1]) > unit::unit_seq(copies[0]);
            Ok((Some(copies[newer as usize]), false))
        }
        (Ok(()), Err(e)) => Ok((Some(copies[0]), e != UnitError::Blank)),
        (Err(e), Ok(())) => Ok((Some(copies[1]), e != UnitError::Blank)),
        (Err(a), Err(b)) => match (ours(a), ours(b)) {
            (true, true) => Err(a),
            (true, false) | (false, true) => Ok((None, true)),
            (false, false) if a == UnitError::Blank && b == UnitError::Blank => {
                Err(UnitError::Blank)
            }
            // Never this device's unit: counted as foreign (another device's, another
            // format's, or what the device held before it was formatted).
            (false, false) => Err(UnitError::Foreign),
        },
    }
}

fn any_valid(e: &unit::EntryRef<'_>, words: usize) -> bool {
    (0..words).any(|w| e.bitmap_word(w) != 0)
}

/// Counts the units that failed to load by why; every bad unit but a blank one is to be
/// rewritten.
fn count_bad_units(
    l: &Layout,
    bad_units: &[(u32, UnitError)],
    report: &mut ScanReport,
    rewrite: &mut std::collections::BTreeSet<u32>,
) {
    for &(u, ref err) in bad_units {
        let (first, end) = l.unit_slots(u);
        match err {
            UnitError::Blank => report.units_blank += 1,
            UnitError::Misplaced(_) => report.units_misplaced += 1,
            UnitError::Foreign => report.units_foreign += 1,
            UnitError::Checksum | UnitError::NotAUnit => report.units_corrupt += 1,
        }
        if *err != UnitError::Blank {
            report.slots_in_bad_units += (end - first) as u64;
            rewrite.insert(u);
        }
    }
    report.units_ok = l.units
        - report.units_blank
        - report.units_corrupt
        - report.units_misplaced
        - report.units_foreign;
}

/// What `sce check` reports.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckReport {
    /// The superblock.
    pub superblock: Superblock,
    /// Bytes of metadata on the device.
    pub metadata_bytes: u64,
    /// The metadata scan, per volume of the table.
    pub volumes: Vec<(String, ScanReport)>,
    /// Valid pages whose data was read and checked (with data verification).
    pub data_pages_checked: u64,
    /// Valid pages whose data did not match its checksum, or could not be read.
    pub data_pages_bad: u64,
    /// Of those, dirty pages (write-back): their only copy is damaged, and they are lost.
    pub data_dirty_pages_bad: u64,
    /// The other superblock copy is damaged (not merely unwritten).
    pub superblock_copy_damaged: bool,
    /// The write-back log's replay (format 6 devices with a log).
    pub log: Option<volumes::LogCheck>,
}

impl CheckReport {
    /// True if anything was damaged.
    pub fn damaged(&self) -> bool {
        self.data_pages_bad > 0
            || self.superblock_copy_damaged
            || self.volumes.iter().any(|(_, r)| r.damaged())
            || self.log.as_ref().is_some_and(|l| l.damaged())
    }
}

/// Checks a cache device like fsck: superblock, units, and (with `verify_data`) the data of
/// every valid page against its checksum. Never modifies the device.
pub fn check(dev: &dyn BlockDevice, verify_data: bool) -> Result<CheckReport, StoreError> {
    let sb = read_superblock(dev)?;
    let sb_damaged = sb.other_copy_damaged;
    let mut volumes = Vec::new();
    let (mut checked, mut bad, mut dirty_bad) = (0, 0, 0);
    for (i, v) in sb.volumes.iter().enumerate() {
        let frags = v.source_size.div_ceil(sb.layout.fragment_size);
        let loaded = load(dev, sb.clone(), i, frags)?;
        if verify_data {
            let l = &sb.layout;
            let mut page = AlignedBuf::new(4096);
            let words = l.bitmap_words();
            let replayed: std::collections::HashMap<(u32, u32), u32> = loaded
                .replayed_crcs
                .iter()
                .map(|&(s, p, c)| ((s, p), c))
                .collect();
            let mut unit_crcs = std::collections::HashMap::new();
            for (k, &(s, f)) in loaded.entries.iter().enumerate() {
                let (u, i) = l.unit_of(s);
                if let std::collections::hash_map::Entry::Vacant(v) = unit_crcs.entry(u) {
                    v.insert(read_unit_crcs(dev, l, &sb.uuid, u, 0)?);
                }
                let recorded = |p: u32| match &unit_crcs[&u] {
                    UnitCrcs::Found(c) => c[(i * l.pages_per_fragment + p) as usize],
                    _ => 0,
                };
                let bits = &loaded.bitmaps[k * words..(k + 1) * words];
                let dirty = &loaded.dirty[k * words..(k + 1) * words];
                for p in 0..l.pages_per_fragment {
                    if !bit(bits, p) {
                        continue;
                    }
                    let start = f * l.fragment_size + p as u64 * 4096;
                    if start >= v.source_size {
                        // Past the volume's end, in its last fragment: never served.
                        continue;
                    }
                    let len = (v.source_size - start).min(4096) as usize;
                    checked += 1;
                    let at = l.data_offset + s as u64 * l.fragment_size + p as u64 * 4096;
                    let seed = page_seed(v.id, start / 4096);
                    let ok = dev.read_at(at, &mut page).is_ok()
                        && page_checksum(&page[..len], seed)
                            == replayed
                                .get(&(s, p))
                                .copied()
                                .unwrap_or_else(|| recorded(p));
                    if !ok {
                        bad += 1;
                        dirty_bad += bit(dirty, p) as u64;
                    }
                }
            }
        }
        volumes.push((v.name.clone(), loaded.report));
    }
    let log = volumes::check_log(dev, &sb)?;
    Ok(CheckReport {
        log,
        metadata_bytes: sb.layout.metadata_bytes(),
        superblock: sb,
        volumes,
        data_pages_checked: checked,
        data_pages_bad: bad,
        data_dirty_pages_bad: dirty_bad,
        superblock_copy_damaged: sb_damaged,
    })
}

/// Slots covered by intent block `b`.
pub fn intent_block_slots(b: u32) -> (u64, u64) {
    let first = b as u64 * SLOTS_PER_INTENT_BLOCK;
    (first, first + SLOTS_PER_INTENT_BLOCK)
}
