//! Address newtypes: one type per address space, so that a source offset can never be used
//! where a cache-device offset or a fragment number is expected.

use std::fmt;

/// Size of a page: the unit of hits, invalidation and write-through.
pub const PAGE_SIZE: u64 = 4096;
/// `log2(PAGE_SIZE)`.
pub const PAGE_SHIFT: u32 = 12;
/// Smallest I/O granularity accepted from clients (a sector).
pub const SECTOR_SIZE: u64 = 512;

/// A byte offset on the source volume (the system of record).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SourceOffset(pub u64);

/// A byte offset on the cache device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct CacheOffset(pub u64);

/// Index of a fragment of the source volume (source offset / fragment size).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FragNo(pub u64);

/// Index of a fragment-sized slot on the cache device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotNo(pub u32);

/// A point in time in nanoseconds since an arbitrary epoch chosen by the driver
/// (wall clock for the engine, virtual time for the simulator).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct Nanos(pub u64);

impl Nanos {
    /// Converts from a `Duration` since the epoch.
    pub fn from_duration(d: std::time::Duration) -> Self {
        Nanos(d.as_nanos().min(u64::MAX as u128) as u64)
    }
    /// Saturating difference `self - earlier`.
    pub fn since(self, earlier: Nanos) -> std::time::Duration {
        std::time::Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    )*};
}
display_inner!(SourceOffset, CacheOffset, FragNo, SlotNo);
