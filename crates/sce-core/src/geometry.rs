//! Geometry: how the source volume is cut into fragments and pages, and how the cache device
//! is cut into fragment-sized slots.

use crate::addr::{CacheOffset, FragNo, SlotNo, SourceOffset, PAGE_SHIFT, PAGE_SIZE};

/// Smallest fragment size: one page (the flashcache-like baseline).
pub const MIN_FRAGMENT_SIZE: u64 = PAGE_SIZE;
/// Largest fragment size: 64 MiB.
pub const MAX_FRAGMENT_SIZE: u64 = 64 << 20;
/// Default fragment size: 1 MiB (the SCE paper's choice).
pub const DEFAULT_FRAGMENT_SIZE: u64 = 1 << 20;

/// The fixed shape of one cache: fragment size, source size and number of cache slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    frag_shift: u32,
    source_size: u64,
    slots: u32,
}

impl Geometry {
    /// Builds a geometry. The caller guarantees that `fragment_size` is a power of two within
    /// `MIN_FRAGMENT_SIZE..=MAX_FRAGMENT_SIZE` and `slots >= 1` (config validation checks this).
    pub fn new(fragment_size: u64, source_size: u64, slots: u32) -> Self {
        debug_assert!(fragment_size.is_power_of_two());
        Geometry {
            frag_shift: fragment_size.trailing_zeros(),
            source_size,
            slots,
        }
    }
    /// Fragment size in bytes.
    pub fn fragment_size(&self) -> u64 {
        1 << self.frag_shift
    }
    /// `log2(fragment_size)`.
    pub fn fragment_shift(&self) -> u32 {
        self.frag_shift
    }
    /// Pages per fragment.
    pub fn pages_per_fragment(&self) -> u32 {
        1 << (self.frag_shift - PAGE_SHIFT)
    }
    /// 64-bit words in one page-validity bitmap.
    pub fn bitmap_words(&self) -> usize {
        (self.pages_per_fragment() as usize).div_ceil(64)
    }
    /// Source volume size in bytes.
    pub fn source_size(&self) -> u64 {
        self.source_size
    }
    /// Number of fragments covering the source (the last one may be partial).
    pub fn source_fragments(&self) -> u64 {
        self.source_size.div_ceil(self.fragment_size())
    }
    /// Number of cache slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }
    /// Bytes of the cache device used for slots.
    pub fn cache_bytes(&self) -> u64 {
        self.slots as u64 * self.fragment_size()
    }
    /// The fragment holding a source offset.
    pub fn fragment_of(&self, off: SourceOffset) -> FragNo {
        FragNo(off.0 >> self.frag_shift)
    }
    /// First byte of a fragment.
    pub fn fragment_start(&self, f: FragNo) -> SourceOffset {
        SourceOffset(f.0 << self.frag_shift)
    }
    /// Bytes of fragment `f` that exist on the source (less than a fragment for the last one).
    pub fn fragment_len(&self, f: FragNo) -> u64 {
        let start = f.0 << self.frag_shift;
        self.fragment_size()
            .min(self.source_size.saturating_sub(start))
    }
    /// Pages of fragment `f` that exist on the source.
    pub fn fragment_pages(&self, f: FragNo) -> u32 {
        self.fragment_len(f).div_ceil(PAGE_SIZE) as u32
    }
    /// First byte of a slot on the cache device.
    pub fn slot_offset(&self, s: SlotNo) -> CacheOffset {
        CacheOffset((s.0 as u64) << self.frag_shift)
    }
}
