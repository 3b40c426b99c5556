//! The plans and ids the core hands to drivers, and the read accounting log.

use crate::addr::{CacheOffset, FragNo, SlotNo, SourceOffset};
use crate::admit::StreamVerdict;
use crate::bitmap::PageSet;
use crate::slots::PinTable;

/// Identifies an in-flight write.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct WriteId(pub(super) u64);

/// Identifies an in-flight population (background or inline).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct PopId(pub(super) u64);

/// A request the core refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The range goes beyond the end of the volume.
    #[error("{len} bytes at offset {offset} go beyond the end of the volume ({size} bytes)")]
    OutOfRange {
        /// Request offset.
        offset: u64,
        /// Request length.
        len: u64,
        /// Volume size.
        size: u64,
    },
    /// Offset or length is not a multiple of 512 bytes.
    #[error("offset {offset} or length {len} is not a multiple of 512 bytes")]
    Unaligned {
        /// Request offset.
        offset: u64,
        /// Request length.
        len: u64,
    },
    /// An id that is not in flight (a driver bug, reported instead of corrupting state).
    #[error("unknown or completed operation id")]
    UnknownId,
}

/// Where one run of a read comes from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RunTarget {
    /// Read from the source at this offset.
    Source(SourceOffset),
    /// Read from the cache device at this offset.
    Cache(CacheOffset),
}

/// One I/O of a read: `len` bytes into the request buffer at `buf_offset`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ReadRun {
    /// Offset within the request buffer.
    pub buf_offset: u64,
    /// Length in bytes (a multiple of 512).
    pub len: u64,
    /// Where to read it from.
    pub target: RunTarget,
}

/// An inline fill: after the source runs succeed, write `len` bytes of the request buffer at
/// `buf_offset` to the cache device at `cache`, then complete population `pop`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FillRun {
    /// The population this fill belongs to.
    pub pop: PopId,
    /// Offset within the request buffer.
    pub buf_offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Destination on the cache device.
    pub cache: CacheOffset,
}

/// The plan for one read; reusable across reads to avoid allocation.
#[derive(Debug, Default)]
pub struct ReadPlan {
    /// The runs, in buffer order, covering the whole request.
    pub runs: Vec<ReadRun>,
    /// Inline fills (admission `always` only).
    pub fills: Vec<FillRun>,
    /// Populations started by this read; each must be completed.
    pub pops: Vec<PopId>,
    /// True if every page was a hit.
    pub full_hit: bool,
    /// Pages served from the cache.
    pub hit_pages: u64,
    /// Pages served from the source.
    pub missed_pages: u64,
    pub(super) pins: Vec<SlotNo>,
    /// Missed pages that may be filled: line, pages, as a line, into the page area.
    pub(super) fill_wanted: Vec<(FragNo, PageSet, bool, bool)>,
    /// Pages of `hit_pages` hit in the page area.
    pub(super) area_hits: u64,
    /// Pages of `missed_pages` in dense lines without a slot: what lines would have served.
    pub(super) dense_missed: u64,
    /// Missed pages of sparse lines the read covers only in part: the page area may take
    /// them by population (`pages.rs`).
    pub(super) partial_wanted: Vec<(FragNo, PageSet)>,
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) verdict: StreamVerdict,
}

/// Accounting of reads planned with `CacheCore::plan_read` and not yet applied: which
/// fragments were touched and how many pages hit or missed. Drivers keep one per thread (or
/// shard) and apply it in batches, so that read hits share the core without writing to it.
/// The reads that missed are kept apart from those that hit: they are applied last (see
/// `CacheCore::apply_access_logs`).
#[derive(Debug, Default)]
pub struct AccessLog {
    pub(super) reads: Vec<(u64, u64, StreamVerdict)>,
    pub(super) missed: Vec<(u64, u64, StreamVerdict)>,
    pub(super) requests: u64,
    pub(super) full_hits: u64,
    pub(super) hit_pages: u64,
    pub(super) missed_pages: u64,
    pub(super) area_hits: u64,
    pub(super) dense_missed: u64,
}

impl AccessLog {
    /// Records a planned read.
    pub fn record(&mut self, plan: &ReadPlan) {
        let read = (plan.offset, plan.len, plan.verdict);
        if plan.missed_pages > 0 {
            self.missed.push(read);
        } else {
            self.reads.push(read);
        }
        self.requests += 1;
        self.full_hits += plan.full_hit as u64;
        self.hit_pages += plan.hit_pages;
        self.missed_pages += plan.missed_pages;
        self.area_hits += plan.area_hits;
        self.dense_missed += plan.dense_missed;
    }
    /// Reads recorded since the last apply.
    pub fn requests(&self) -> u64 {
        self.requests
    }
    /// What the log adds to the core's read counters once applied: requests, full hits, hit
    /// pages, missed pages (for exact counters without applying it).
    pub fn pending_counts(&self) -> [u64; 4] {
        [
            self.requests,
            self.full_hits,
            self.hit_pages,
            self.missed_pages,
        ]
    }
}

impl ReadPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }
    /// Releases the plan's pins through the shared pin table, without the core's lock. The
    /// caller guarantees that the plan's I/O is finished and that it has no populations left
    /// to complete (`pops` empty); otherwise it must use `CacheCore::end_read` after them.
    pub fn release_pins(&mut self, pins: &PinTable) {
        for s in self.pins.drain(..) {
            pins.release(s);
        }
    }

    /// True if the read wants inline fills, which only `begin_read` can start.
    pub fn needs_commit(&self) -> bool {
        !self.fill_wanted.is_empty() || !self.partial_wanted.is_empty()
    }

    pub(super) fn clear(&mut self) {
        self.runs.clear();
        self.fills.clear();
        self.pops.clear();
        self.pins.clear();
        self.fill_wanted.clear();
        self.partial_wanted.clear();
        self.full_hit = true;
        self.hit_pages = 0;
        self.missed_pages = 0;
        self.area_hits = 0;
        self.dense_missed = 0;
    }
    pub(super) fn push(&mut self, buf_offset: u64, len: u64, target: RunTarget) {
        if let Some(last) = self.runs.last_mut() {
            let contiguous = match (last.target, target) {
                (RunTarget::Source(a), RunTarget::Source(b)) => a.0 + last.len == b.0,
                (RunTarget::Cache(a), RunTarget::Cache(b)) => a.0 + last.len == b.0,
                _ => false,
            };
            if contiguous && last.buf_offset + last.len == buf_offset {
                last.len += len;
                return;
            }
        }
        self.runs.push(ReadRun {
            buf_offset,
            len,
            target,
        });
    }
}

/// What distinguishes a data write from a discard.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WriteKind {
    /// A write of data: may be copied to the cache.
    Data,
    /// A discard or write-zeroes: only invalidates (the source does the work).
    Discard,
}

/// A cache copy the driver must write: `len` bytes of the request buffer at `buf_offset` to
/// the cache device at `cache`, then report `write_cache_done(id, part)`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CacheWrite {
    /// Index to pass back to `write_cache_done`.
    pub part: u32,
    /// Offset within the request buffer.
    pub buf_offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Destination on the cache device.
    pub cache: CacheOffset,
}

/// The plan for one write.
#[derive(Debug)]
pub struct WritePlan {
    /// The write's id.
    pub id: WriteId,
    /// Cache copies to issue (empty for write-around, fallbacks and duplicates).
    pub cache_writes: Vec<CacheWrite>,
    /// True in synchronous write-through mode: acknowledge only after the cache copies.
    pub synchronous: bool,
}

/// A background population the driver must perform: read `len` bytes of the source at
/// `source` into a buffer, write each run to the cache, then `complete_population(id, ok)`.
#[derive(Debug, Clone)]
pub struct PopulationJob {
    /// The population's id.
    pub id: PopId,
    /// The fragment being populated.
    pub frag: FragNo,
    /// The slot it goes to.
    pub slot: SlotNo,
    /// Start of the source span to read.
    pub source: SourceOffset,
    /// Length of the span.
    pub len: u64,
    /// Runs of the span to write to the cache: (offset within the span, length, destination).
    pub runs: Vec<(u64, u64, CacheOffset)>,
}
