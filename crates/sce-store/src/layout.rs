//! Where everything lives on the cache device.
//!
//! ```text
//! 0        superblock copy A (4 KiB)
//! 4 KiB    superblock copy B (4 KiB)
//! 8 KiB    write-intent bitmap: one bit per slot, in 4 KiB blocks
//! ...      write journal: a ring of `journal_blocks` 4 KiB blocks (`crate::journal`)
//! ...      metadata units: `units` x `unit_size` bytes, each holding `slots_per_unit` slot
//!          entries
//! ...      their mirror (format 5): the same units again, each a copy of its primary,
//!          written after the primaries were flushed (so a crash tears at most one copy,
//!          and damage to one copy is repaired from the other)
//! ...      data: `slots` x `fragment_size` bytes, starting on a 1 MiB (or fragment) boundary
//! ```

use crate::StoreError;

/// The metadata block size; every region starts on a multiple of it.
pub const BLOCK: u64 = 4096;
/// Bytes of a unit header.
pub const UNIT_HEADER: u64 = 64;
/// Bytes of a slot entry header (fragment, generation, volume, flags).
pub const ENTRY_HEADER: u64 = 16;
/// Slots one intent block covers.
pub const SLOTS_PER_INTENT_BLOCK: u64 = BLOCK * 8;
/// Offset of the intent bitmap.
pub const INTENT_OFFSET: u64 = 2 * BLOCK;
/// Fewest blocks of a write journal ring.
pub const MIN_JOURNAL_BLOCKS: u64 = 16;
/// Most blocks of a write journal ring (4 MiB).
pub const MAX_JOURNAL_BLOCKS: u64 = 1024;

/// The write journal's blocks for a device of `cache_size` bytes: 1/256 of the device
/// (0.4%, as much as the metadata of 1 MiB slots), at least 16 blocks and at most 1,024
/// (4 MiB). Each group commit takes one block, and blocks come back once a flush round made
/// the records they vouch for durable (every `--metadata-interval`): 1,024 blocks keep up
/// with some 500 group commits a second at the default 1 s interval; beyond, writes fall
/// back to write intents (the previous behaviour) until the next round frees the ring.
pub fn journal_blocks_for(cache_size: u64) -> u64 {
    (cache_size / 256 / BLOCK).clamp(MIN_JOURNAL_BLOCKS, MAX_JOURNAL_BLOCKS)
}

/// The geometry of a formatted cache device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Layout {
    /// Bytes of the device the layout uses.
    pub cache_size: u64,
    /// Bytes of a fragment (a slot's data).
    pub fragment_size: u64,
    /// 4 KiB pages per fragment.
    pub pages_per_fragment: u32,
    /// Data slots.
    pub slots: u32,
    /// Bytes of one slot entry in a unit.
    pub entry_size: u32,
    /// Bytes of one metadata unit (a multiple of 4 KiB).
    pub unit_size: u32,
    /// Slot entries per unit.
    pub slots_per_unit: u32,
    /// Number of metadata units.
    pub units: u32,
    /// Offset of the intent bitmap.
    pub intent_offset: u64,
    /// 4 KiB blocks of the intent bitmap.
    pub intent_blocks: u32,
    /// Offset of the write journal (right after the intent bitmap).
    pub journal_offset: u64,
    /// 4 KiB blocks of the write journal ring.
    pub journal_blocks: u32,
    /// Offset of the first unit.
    pub meta_offset: u64,
    /// Offset of slot 0's data.
    pub data_offset: u64,
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

impl Layout {
    /// The layout for a device of `cache_size` bytes and fragments of `fragment_size` bytes
    /// (a power of two from 4 KiB to 64 MiB): as many slots as fit with their metadata.
    pub fn compute(cache_size: u64, fragment_size: u64) -> Result<Layout, StoreError> {
        if !fragment_size.is_power_of_two() || !(4096..=64 << 20).contains(&fragment_size) {
            return Err(StoreError::Geometry(format!(
                "fragment size {fragment_size} is not a power of two from 4 KiB to 64 MiB"
            )));
        }
        let pages = fragment_size / 4096;
        let words = pages.div_ceil(64);
        // Header, validity bitmap, dirty bitmap (format 4), page checksums.
        let entry_size = ENTRY_HEADER + 2 * words * 8 + pages * 4;
        let unit_size = round_up(UNIT_HEADER + entry_size, BLOCK);
        let slots_per_unit = (unit_size - UNIT_HEADER) / entry_size;
        let data_align = fragment_size.clamp(BLOCK, 1 << 20);
        let journal_blocks = journal_blocks_for(cache_size);
        let layout_for = |slots: u64| {
            let intent_blocks = slots.div_ceil(SLOTS_PER_INTENT_BLOCK).max(1);
            let units = slots.div_ceil(slots_per_unit);
            let journal_offset = INTENT_OFFSET + intent_blocks * BLOCK;
            let meta_offset = journal_offset + journal_blocks * BLOCK;
            // The units, then their mirror copies.
            let data_offset = round_up(meta_offset + 2 * units * unit_size, data_align);
            (intent_blocks, units, meta_offset, data_offset)
        };
        // Start from an upper bound and step down until the slots and their metadata fit.
        let mut slots = cache_size / (fragment_size + 2 * unit_size / slots_per_unit);
        loop {
            let (_, _, _, data) = layout_for(slots);
            if slots == 0 || data + slots * fragment_size <= cache_size {
                break;
            }
            slots -= 1;
        }
        if slots < 2 {
            return Err(StoreError::Geometry(format!(
                "a {cache_size}-byte device holds fewer than 2 fragments of {fragment_size} bytes with their metadata"
            )));
        }
        if slots >= u32::MAX as u64 / 2 {
            return Err(StoreError::Geometry(format!(
                "{slots} slots is too many; use a larger fragment size"
            )));
        }
        let (intent_blocks, units, meta_offset, data_offset) = layout_for(slots);
        Ok(Layout {
            cache_size,
            fragment_size,
            pages_per_fragment: pages as u32,
            slots: slots as u32,
            entry_size: entry_size as u32,
            unit_size: unit_size as u32,
            slots_per_unit: slots_per_unit as u32,
            units: units as u32,
            intent_offset: INTENT_OFFSET,
            intent_blocks: intent_blocks as u32,
            journal_offset: INTENT_OFFSET + intent_blocks * BLOCK,
            journal_blocks: journal_blocks as u32,
            meta_offset,
            data_offset,
        })
    }

    /// Bitmap words per slot entry.
    pub fn bitmap_words(&self) -> usize {
        (self.pages_per_fragment as usize).div_ceil(64)
    }

    /// Offset of unit `u`.
    pub fn unit_offset(&self, u: u32) -> u64 {
        self.meta_offset + u as u64 * self.unit_size as u64
    }

    /// Offset of unit `u`'s mirror copy.
    pub fn unit_mirror_offset(&self, u: u32) -> u64 {
        self.meta_offset + (self.units as u64 + u as u64) * self.unit_size as u64
    }

    /// The unit holding slot `s`, and the slot's index in it.
    pub fn unit_of(&self, s: u32) -> (u32, u32) {
        (s / self.slots_per_unit, s % self.slots_per_unit)
    }

    /// Slots held by unit `u`: `[first, end)`.
    pub fn unit_slots(&self, u: u32) -> (u32, u32) {
        let first = u * self.slots_per_unit;
        (first, (first + self.slots_per_unit).min(self.slots))
    }

    /// Bytes of data: `slots * fragment_size`.
    pub fn data_bytes(&self) -> u64 {
        self.slots as u64 * self.fragment_size
    }

    /// Offset of journal block `b`.
    pub fn journal_block_offset(&self, b: u32) -> u64 {
        self.journal_offset + b as u64 * BLOCK
    }

    /// Bytes of metadata (superblocks, intents, the journal and units).
    pub fn metadata_bytes(&self) -> u64 {
        self.data_offset
    }
}
