//! The part of the ring lent from the read slots (format 9, issue 45: room that follows the
//! work).
//!
//! A lap of the ring is the log's own region (`LogRegion::blocks`) followed by `chunks`
//! **chunks** of read slots. A lap uses the first `u` chunks, `u` being what the engine has
//! lent when the head gets there (it may lend more while the head is still before them), and
//! skips the rest: the head goes from the end of the last chunk used to the next lap. So
//! while little is dirty the head goes round the log's own region alone and never touches
//! read data; as a burst fills it, the engine lends the next chunk ahead of the head (evicts
//! its slots, makes that durable, records the chunks lent in the superblock) and the same
//! lap grows into it, up to every chunk; once cleaning emptied them and the durable anchor
//! passed them, they go back to the read cache. Positions keep the fixed arithmetic of a
//! ring of `lap()` positions: skipped ones count as used, which is exactly what the
//! physical places allow (a lap never writes past the anchor's place one lap on).
//!
//! The chunks lie at the ends of `chunks` equal bands of the slot area, taken in
//! bit-reversed order (the first lent in the first band, the second in the middle one, ...),
//! so that whatever cuts the slots into ranges (the engine's shards) loses slots evenly.

/// The most chunks a ring lends from (a power of two).
pub const MAX_LEND_CHUNKS: u64 = 64;

/// Where the lendable chunks are: their count and size, and the slot area they lie in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lend {
    /// Chunks (0: none, the ring is the log's own region only; else a power of two, at most
    /// [`MAX_LEND_CHUNKS`]).
    pub chunks: u64,
    /// 4 KiB blocks per chunk (whole slots).
    pub chunk_blocks: u64,
    /// Byte offset of the slot area on the device.
    pub area_offset: u64,
    /// Slots of the slot area.
    pub area_slots: u64,
    /// Bytes per slot.
    pub slot_bytes: u64,
}

impl Lend {
    /// The chunks a format lays out for `bytes` of lendable room over a slot area of
    /// `area_slots` slots of `slot_bytes` from `area_offset`: 16 chunks (64 if that makes them
    /// over 1 GiB), each whole slots and at most its band; none if a chunk would be under
    /// 1 MiB.
    pub fn laid_out(bytes: u64, area_offset: u64, area_slots: u64, slot_bytes: u64) -> Lend {
        let chunks = if bytes / 16 > 1 << 30 { 64 } else { 16 };
        let band = area_slots / chunks;
        let slots = (bytes / chunks / slot_bytes.max(1)).min(band);
        let chunk_bytes = slots * slot_bytes;
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(super::LOG_BLOCK) || chunk_bytes < 1 << 20
        {
            return Lend::default();
        }
        Lend {
            chunks,
            chunk_blocks: chunk_bytes / super::LOG_BLOCK,
            area_offset,
            area_slots,
            slot_bytes,
        }
    }

    /// Checks the geometry (a corrupt superblock must not place chunks outside the slots).
    pub fn check(&self) -> Result<(), String> {
        if self.chunks == 0 {
            return Ok(());
        }
        let bytes = self.chunk_blocks * super::LOG_BLOCK;
        let ok = self.chunks.is_power_of_two()
            && self.chunks <= MAX_LEND_CHUNKS
            && self.chunk_blocks > 0
            && self.slot_bytes > 0
            && bytes.is_multiple_of(self.slot_bytes)
            && bytes / self.slot_bytes <= self.area_slots / self.chunks;
        if ok {
            Ok(())
        } else {
            Err(format!(
                "{} lendable chunks of {} blocks do not fit {} slots of {} bytes",
                self.chunks, self.chunk_blocks, self.area_slots, self.slot_bytes
            ))
        }
    }

    /// Positions of the lendable part of a lap.
    pub fn blocks(&self) -> u64 {
        self.chunks * self.chunk_blocks
    }

    /// Slots per chunk.
    pub fn chunk_slots(&self) -> u64 {
        if self.chunks == 0 {
            return 0;
        }
        self.chunk_blocks * super::LOG_BLOCK / self.slot_bytes
    }

    /// The band of chunk `i` (in lap order, which is the order they are lent in).
    fn band(&self, i: u64) -> u64 {
        let bits = self.chunks.trailing_zeros();
        if bits == 0 {
            0
        } else {
            i.reverse_bits() >> (64 - bits)
        }
    }

    /// The first slot of chunk `i` (in lap order).
    pub fn first_slot(&self, i: u64) -> u64 {
        let b = self.band(i);
        (b + 1) * self.area_slots / self.chunks - self.chunk_slots()
    }

    /// The slots of the `c`-th chunk lent (0: the first), chunk `c` in lap order.
    pub fn slots_of_lent(&self, c: u64) -> std::ops::Range<u64> {
        let first = self.first_slot(c);
        first..first + self.chunk_slots()
    }

    /// The device offset of chunk `i`'s first block.
    pub fn chunk_offset(&self, i: u64) -> u64 {
        self.area_offset + self.first_slot(i) * self.slot_bytes
    }
}
