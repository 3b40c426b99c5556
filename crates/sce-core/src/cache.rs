//! `CacheCore`: the sans-I/O cache state machine.
//!
//! The core does no I/O, starts no thread and reads no clock. A driver (the engine with real
//! devices, or the simulator in virtual time) asks it what to do and reports back:
//!
//! * **Reads.** [`CacheCore::begin_read`] fills a [`ReadPlan`]: the request split into runs of
//!   hits (read from a cache slot) and misses (read from the source), each run one I/O. Slots
//!   read from are pinned until [`CacheCore::end_read`], so they cannot be evicted and reused
//!   under the read. With admission `always` the plan also carries *fills*: pages read from
//!   the source that the driver writes into the cache before completing the read, then reports
//!   with [`CacheCore::complete_population`].
//! * **Writes.** [`CacheCore::begin_write`] invalidates the written pages and returns a
//!   [`WritePlan`]: the driver writes the source, plus the cache copies the plan lists
//!   (AWT or synchronous write-through), and reports each half with
//!   [`CacheCore::write_source_done`] and [`CacheCore::write_cache_done`]. Pages are
//!   re-validated only when both halves succeeded and no other write or population touched
//!   them meanwhile.
//! * **Population.** [`CacheCore::pick_population`] (background, throttled by
//!   Algorithm 1) returns a [`PopulationJob`]: read a span of the source, write the listed
//!   runs to the slot, report with [`CacheCore::complete_population`].
//!
//! # The invariant
//! A page is marked valid only if its slot content equals the source content and no source
//! write to it is in flight. Ways it is kept:
//! 1. A write invalidates its pages before the driver sends anything.
//! 2. A population's fill set excludes pages under an in-flight write when it is picked; a
//!    write that arrives while it is in flight *spoils* the pages it touches, and spoiled
//!    pages are not validated.
//! 3. At most one cache-device write per page is in flight: a write that overlaps another
//!    in-flight write or population on a page sends no cache copy, and both spoil the overlap
//!    (the duplicate-write tracking of SCE 3.3, made safe against reordering on the device).
//! 4. Slots with pins (reads, populations or cache copies in flight) are never evicted.

use crate::addr::{
    CacheOffset, FragNo, Nanos, SlotNo, SourceOffset, PAGE_SHIFT, PAGE_SIZE, SECTOR_SIZE,
};
use crate::admit::{Endurance, FreqSketch, PopBudget, StreamVerdict, Streams};
use crate::bitmap::{self, PageSet};
use crate::config::{Admission, ConfigError, CoreConfig, WriteMode};
use crate::evict::Eviction;
use crate::geometry::Geometry;
use crate::hotness::{IntMap, MruWindow};
use crate::map::FragmentMap;
use crate::slab::Slab;
use crate::slots::{PinTable, SlotTable};
use crate::stats::CoreStats;
use crate::throttle::{self, MissRate, ThrottleState};
use std::collections::VecDeque;
use std::sync::Arc;

/// Identifies an in-flight write.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct WriteId(u64);

/// Why `start_population` started nothing.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum NoPop {
    /// No page to fill (all valid, under writes, or a population in flight).
    Nothing,
    /// The endurance budget would be exceeded.
    Endurance,
    /// No slot could be allocated or pinned.
    NoSlot,
}

/// Identifies an in-flight population (background or inline).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct PopId(u64);

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
    pins: Vec<SlotNo>,
    fill_wanted: Vec<(FragNo, PageSet)>,
    offset: u64,
    len: u64,
    verdict: StreamVerdict,
}

/// Accounting of reads planned with `CacheCore::plan_read` and not yet applied: which
/// fragments were touched and how many pages hit or missed. Drivers keep one per thread (or
/// shard) and apply it in batches, so that read hits share the core without writing to it.
#[derive(Debug, Default)]
pub struct AccessLog {
    reads: Vec<(u64, u64, StreamVerdict)>,
    requests: u64,
    full_hits: u64,
    hit_pages: u64,
    missed_pages: u64,
}

impl AccessLog {
    /// Records a planned read.
    pub fn record(&mut self, plan: &ReadPlan) {
        self.reads.push((plan.offset, plan.len, plan.verdict));
        self.requests += 1;
        self.full_hits += plan.full_hit as u64;
        self.hit_pages += plan.hit_pages;
        self.missed_pages += plan.missed_pages;
    }
    /// Reads recorded since the last apply.
    pub fn requests(&self) -> u64 {
        self.requests
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
        !self.fill_wanted.is_empty()
    }

    fn clear(&mut self) {
        self.runs.clear();
        self.fills.clear();
        self.pops.clear();
        self.pins.clear();
        self.fill_wanted.clear();
        self.full_hit = true;
        self.hit_pages = 0;
        self.missed_pages = 0;
    }
    fn push(&mut self, buf_offset: u64, len: u64, target: RunTarget) {
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

#[derive(Debug)]
struct WritePart {
    frag: FragNo,
    lo: u32,
    hi: u32,
    /// Pages that may be validated when the write completes: `[vlo, vhi)`.
    vlo: u32,
    vhi: u32,
    slot: Option<SlotNo>,
    cache_ok: Option<bool>,
    spoiled: Option<PageSet>,
}

#[derive(Debug)]
struct WriteState {
    parts: Vec<WritePart>,
    source_ok: Option<bool>,
    cache_pending: u32,
    budget: u64,
}

#[derive(Debug)]
struct PopState {
    frag: FragNo,
    slot: SlotNo,
    fill: PageSet,
    spoiled: PageSet,
    fresh_slot: bool,
}

#[derive(Debug, Default)]
struct FragActivity {
    writes: Vec<WriteId>,
    pop: Option<PopId>,
}

/// Direct-mapped access counters for `nhit:K` admission.
#[derive(Debug)]
struct NHitFilter {
    k: u32,
    tags: Box<[u64]>,
    counts: Box<[u32]>,
    queue: VecDeque<FragNo>,
}

impl NHitFilter {
    const QUEUE_MAX: usize = 4096;

    fn new(k: u32, entries: usize) -> Self {
        let n = entries.next_power_of_two();
        NHitFilter {
            k,
            tags: vec![u64::MAX; n].into_boxed_slice(),
            counts: vec![0; n].into_boxed_slice(),
            queue: VecDeque::new(),
        }
    }

    fn touch(&mut self, f: FragNo) {
        let i = (f.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize & (self.tags.len() - 1);
        if self.tags[i] != f.0 {
            self.tags[i] = f.0;
            self.counts[i] = 0;
        }
        self.counts[i] = self.counts[i].saturating_add(1);
        if self.counts[i] == self.k && self.queue.len() < Self::QUEUE_MAX {
            self.queue.push_back(f);
        }
    }
}

/// The cache state machine. Not thread-safe by itself: the engine wraps it in a lock.
#[derive(Debug)]
pub struct CacheCore {
    cfg: CoreConfig,
    geo: Geometry,
    map: FragmentMap,
    slots: SlotTable,
    evict: Eviction,
    window: MruWindow,
    nhit: Option<NHitFilter>,
    sketch: Option<FreqSketch>,
    /// The stream detector, a leaf lock: requests are classified when they are planned,
    /// in the order they arrive, also under the engine's shared lock.
    streams: Option<std::sync::Mutex<Streams>>,
    budget: PopBudget,
    endurance: Option<Endurance>,
    missrate: MissRate,
    writes: Slab<WriteState>,
    pops: Slab<PopState>,
    activity: IntMap<u64, FragActivity>,
    awt_in_flight: u64,
    stats: CoreStats,
}

impl CacheCore {
    /// How often the adaptive population rate is re-decided (virtual or real time).
    const BUDGET_EPOCH_NS: u64 = 1_000_000_000;

    /// Builds a core for a source of `source_size` bytes and a cache device of `cache_size`
    /// bytes. Errors name the field at fault.
    pub fn new(cfg: CoreConfig, source_size: u64, cache_size: u64) -> Result<Self, ConfigError> {
        cfg.validate()?;
        if source_size == 0 || !source_size.is_multiple_of(SECTOR_SIZE) {
            return Err(ConfigError::new(
                "source_size",
                format!("{source_size} is not a positive multiple of 512 bytes"),
            ));
        }
        let slots = cache_size / cfg.fragment_size;
        if slots < 2 {
            return Err(ConfigError::new(
                "cache_size",
                format!(
                    "{cache_size} bytes hold {slots} fragment(s) of {} bytes; at least 2 are needed",
                    cfg.fragment_size
                ),
            ));
        }
        if slots >= u32::MAX as u64 {
            return Err(ConfigError::new(
                "cache_size",
                format!("{slots} slots is too many; use a larger fragment_size"),
            ));
        }
        let geo = Geometry::new(cfg.fragment_size, source_size, slots as u32);
        let nhit = match cfg.admission {
            Admission::NHit(k) => Some(NHitFilter::new(
                k,
                (slots as usize * 2).clamp(1024, 1 << 20),
            )),
            _ => None,
        };
        let selective = cfg.admission == Admission::Sce;
        let sketch = selective.then(|| FreqSketch::new((slots as usize).max(cfg.hot_window)));
        let streams = (selective && cfg.sequential_cutoff > 0).then(|| {
            std::sync::Mutex::new(Streams::new(cfg.sequential_cutoff, geo.fragment_shift()))
        });
        let budget = PopBudget::new(
            if selective { cfg.population_rate } else { 0 },
            cfg.population_min_rate,
            cfg.population_adaptive,
            Self::BUDGET_EPOCH_NS,
        );
        let endurance = cfg.max_cache_writes.map(Endurance::new);
        Ok(CacheCore {
            sketch,
            streams,
            budget,
            endurance,
            map: FragmentMap::new(geo.source_fragments(), geo.slots()),
            slots: SlotTable::new(geo.slots(), geo.bitmap_words()),
            evict: Eviction::new(cfg.eviction, geo.slots(), cfg.clock_ceiling),
            window: MruWindow::new(cfg.hot_window),
            nhit,
            missrate: MissRate::default(),
            writes: Slab::default(),
            pops: Slab::default(),
            activity: IntMap::default(),
            awt_in_flight: 0,
            stats: CoreStats::default(),
            geo,
            cfg,
        })
    }

    /// The geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }
    /// The configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }
    /// The counters.
    pub fn stats(&self) -> &CoreStats {
        &self.stats
    }
    /// Free slots.
    pub fn free_slots(&self) -> u32 {
        self.slots.free_count()
    }
    /// Bytes of AWT copies in flight.
    pub fn awt_bytes_in_flight(&self) -> u64 {
        self.awt_in_flight
    }
    /// Writes and populations in flight.
    pub fn operations_in_flight(&self) -> (usize, usize) {
        (self.writes.len(), self.pops.len())
    }
    /// The fragment map (for footprint measurement).
    pub fn map_mut(&mut self) -> &mut FragmentMap {
        &mut self.map
    }

    /// Starts recording which slots change, for `take_dirty` (a persistent driver).
    pub fn track_dirty(&mut self) {
        self.slots.track_dirty();
    }

    /// Slots whose fragment or page validity changed since the last call (with
    /// `track_dirty` on).
    pub fn take_dirty(&mut self) -> Vec<SlotNo> {
        self.slots.take_dirty()
    }

    /// The fragment slot `s` holds and its page-validity bitmap.
    pub fn slot_state(&self, s: SlotNo) -> (Option<FragNo>, &[u64]) {
        (self.slots.fragment(s), self.slots.bitmap(s))
    }

    /// True if a write or a population is in flight on fragment `f`.
    pub fn fragment_busy(&self, f: FragNo) -> bool {
        self.activity.contains_key(&f.0)
    }

    /// Loads saved contents into a core that has served nothing yet: each entry gives a slot,
    /// the fragment it holds and its page-validity bitmap. Entries with an out-of-range slot
    /// or fragment, a fragment already placed, or a slot already used are skipped; the number
    /// restored is returned. Restored slots are not reported dirty.
    pub fn restore<'a>(
        &mut self,
        entries: impl IntoIterator<Item = (SlotNo, FragNo, &'a [u64])>,
    ) -> u32 {
        let words = self.geo.bitmap_words();
        let mut n = 0;
        for (s, f, bits) in entries {
            if s.0 >= self.geo.slots()
                || f.0 >= self.geo.source_fragments()
                || self.slots.fragment(s).is_some()
                || self.map.get(f).is_some()
                || bits.len() != words
            {
                continue;
            }
            self.slots.assign(s, Some(f));
            let pages = self.geo.fragment_pages(f);
            let bm = self.slots.bitmap_mut(s);
            bm.copy_from_slice(bits);
            bitmap::clear_range(bm, pages, (words * 64) as u32);
            self.map.set(f, Some(s));
            self.evict.inserted(s);
            n += 1;
        }
        self.slots.rebuild_free();
        self.slots.take_dirty();
        n
    }

    /// Marks pages `[lo, hi)` of fragment `f` invalid (their cached copy was found bad).
    pub fn invalidate(&mut self, f: FragNo, lo: u32, hi: u32) {
        if let Some(s) = self.map.get(f) {
            let hi = hi.min(self.geo.pages_per_fragment());
            if lo < hi {
                bitmap::clear_range(self.slots.bitmap_mut(s), lo, hi);
                self.stats.pages_invalidated += (hi - lo) as u64;
            }
        }
    }

    /// Drops every cached fragment that no operation pins (the volume was forgotten or the
    /// cache device failed). Returns how many were dropped.
    pub fn drop_all(&mut self) -> u32 {
        let mut n = 0;
        for s in 0..self.geo.slots() {
            let s = SlotNo(s);
            if self.slots.fragment(s).is_some() && self.slots.pins(s) == 0 {
                self.evict_slot(s);
                self.slots.put_free(s);
                n += 1;
            }
        }
        n
    }

    /// FlashTier's `exists`: the slot holding fragment `f` and how many of its pages are valid.
    pub fn exists(&self, f: FragNo) -> Option<(SlotNo, u32)> {
        let s = self.map.get(f)?;
        Some((
            s,
            bitmap::count(self.slots.bitmap(s), 0, self.geo.pages_per_fragment()),
        ))
    }

    /// True if byte `offset` of the source is in a valid cached page.
    pub fn is_cached(&self, offset: SourceOffset) -> bool {
        let f = self.geo.fragment_of(offset);
        let p = ((offset.0 - self.geo.fragment_start(f).0) >> PAGE_SHIFT) as u32;
        self.map.get(f).is_some_and(|s| self.slots.is_valid(s, p))
    }

    /// FlashTier's `evict`: drops fragment `f` from the cache. Returns false if it is not
    /// cached or its slot is pinned by an operation in flight.
    pub fn evict_fragment(&mut self, f: FragNo) -> bool {
        match self.map.get(f) {
            Some(s) if self.slots.pins(s) == 0 => {
                self.evict_slot(s);
                self.slots.put_free(s);
                true
            }
            _ => false,
        }
    }

    /// Evicts the policy's victim, if there is one that is not pinned. Returns its fragment.
    pub fn evict_one(&mut self) -> Option<FragNo> {
        let s = self.victim()?;
        let f = self.slots.fragment(s);
        self.evict_slot(s);
        self.slots.put_free(s);
        f
    }

    /// Tells the core the time, for the endurance budget's allowance (which grows with it).
    /// `throttle` and `pick_population` do this too; a driver without population workers
    /// (admission `always`) calls it with its requests.
    pub fn advance_clock(&mut self, now: Nanos) {
        if let Some(e) = &mut self.endurance {
            e.advance(now);
        }
    }

    /// The population throttle's view now (Algorithm 1).
    pub fn throttle(&mut self, now: Nanos) -> ThrottleState {
        self.advance_clock(now);
        let rate = self.missrate.rate(now, self.cfg.throttle.missrate_window);
        let free = 100.0 * self.slots.free_count() as f64 / self.geo.slots() as f64;
        throttle::decide(&self.cfg.throttle, rate, free)
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), RequestError> {
        let size = self.geo.source_size();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(RequestError::OutOfRange { offset, len, size });
        }
        if !offset.is_multiple_of(SECTOR_SIZE) || !len.is_multiple_of(SECTOR_SIZE) {
            return Err(RequestError::Unaligned { offset, len });
        }
        Ok(())
    }

    /// End of page `p` of fragment `f`, clipped to the source end.
    fn page_end(&self, f: FragNo, p: u32) -> u64 {
        (self.geo.fragment_start(f).0 + (p as u64 + 1) * PAGE_SIZE).min(self.geo.source_size())
    }

    /// Classifies a request with the stream detector (admission `sce`; otherwise never
    /// sequential). Called once per request, when it is planned.
    fn classify(&self, offset: u64, len: u64) -> StreamVerdict {
        match &self.streams {
            Some(st) if len > 0 => st
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .observe(offset, len),
            _ => StreamVerdict::default(),
        }
    }

    /// The 64ths of a fragment that pages `[lo, hi)` fall in.
    fn parts_mask(&self, lo: u32, hi: u32) -> u64 {
        let per = self.geo.pages_per_fragment().div_ceil(64).max(1);
        let (a, b) = (lo / per, (hi.max(lo + 1) - 1) / per);
        let upper = if b >= 63 {
            u64::MAX
        } else {
            (1u64 << (b + 1)) - 1
        };
        upper & !((1u64 << a) - 1)
    }

    /// Accounts one request of `len` bytes at `offset` (a read or a write): per fragment it
    /// covers, one touch of the hotness window, the sketch, the `nhit` counters and the
    /// eviction policy. Under admission `sce`, a request that continues a stream inside the
    /// fragment it last touched adds no touch, and a request of a sequential stream adds
    /// nothing at all; returns true for those.
    fn note_access(&mut self, offset: u64, len: u64, verdict: StreamVerdict) -> bool {
        // A stream is bypassed only once the cache is full: free space is there to be
        // filled, and data read or written in sequence is often read again.
        if verdict.sequential && self.slots.free_count() == 0 {
            self.stats.sequential_requests += 1;
            return true;
        }
        for (f, lo, hi, _, _) in fragments(self.geo, offset, len) {
            let parts = self.parts_mask(lo, hi);
            if verdict.same_fragment {
                self.window.add_parts(f, parts);
                continue;
            }
            self.window.touch_parts(f, parts);
            if let Some(sk) = &mut self.sketch {
                sk.add(f.0);
            }
            let slot = self.map.get(f);
            if let Some(n) = &mut self.nhit {
                if slot.is_none() {
                    n.touch(f);
                }
            }
            if let Some(s) = slot {
                self.evict.accessed(s);
            }
        }
        false
    }

    // ----- reads -----

    /// Plans a read of `len` bytes at `offset`. The caller MUST perform every run, then (for
    /// fills) write the fills and complete their populations, and finally call `end_read`.
    pub fn begin_read(
        &mut self,
        offset: SourceOffset,
        len: u64,
        plan: &mut ReadPlan,
    ) -> Result<(), RequestError> {
        self.plan_read(offset, len, plan)?;
        self.commit_read(plan);
        Ok(())
    }

    /// The read-only half of `begin_read`, for drivers that share the core among threads
    /// behind a read-write lock: plans the runs and takes the pins (atomically) without
    /// changing anything else. If `plan.needs_commit()` (an inline fill is wanted), the
    /// caller MUST release the pins and redo the read with `begin_read` under its exclusive
    /// lock; otherwise it records the plan in an [`AccessLog`] that it applies later with
    /// `apply_access_log`.
    pub fn plan_read(
        &self,
        offset: SourceOffset,
        len: u64,
        plan: &mut ReadPlan,
    ) -> Result<(), RequestError> {
        self.check(offset.0, len)?;
        plan.clear();
        plan.offset = offset.0;
        plan.len = len;
        plan.verdict = self.classify(offset.0, len);
        let want_fills = self.cfg.admission == Admission::Always;
        for (f, lo, hi, a, b) in fragments(self.geo, offset.0, len) {
            let fstart = self.geo.fragment_start(f).0;
            let slot = self.map.get(f);
            let mut pinned = false;
            let mut missed_full = None::<PageSet>;
            let mut p = lo;
            while p < hi {
                let valid = slot.is_some_and(|s| self.slots.is_valid(s, p));
                let run_hi = match slot {
                    Some(s) => bitmap::run_end(self.slots.bitmap(s), p, hi),
                    None => hi,
                };
                let ra = a.max(fstart + p as u64 * PAGE_SIZE);
                let rb = b.min(fstart + run_hi as u64 * PAGE_SIZE);
                let buf_offset = ra - offset.0;
                let mut hit = false;
                if valid {
                    let s = slot.expect("valid implies slot");
                    if pinned || self.slots.pin(s) {
                        if !pinned {
                            plan.pins.push(s);
                            pinned = true;
                        }
                        hit = true;
                        let cache = self.geo.slot_offset(s).0 + (ra - fstart);
                        plan.push(buf_offset, rb - ra, RunTarget::Cache(CacheOffset(cache)));
                        plan.hit_pages += (run_hi - p) as u64;
                    }
                }
                if !hit {
                    plan.push(buf_offset, rb - ra, RunTarget::Source(SourceOffset(ra)));
                    plan.missed_pages += (run_hi - p) as u64;
                    plan.full_hit = false;
                    if want_fills {
                        // Pages of this run that the read covers entirely can be filled.
                        let set = missed_full
                            .get_or_insert_with(|| PageSet::new(self.geo.pages_per_fragment()));
                        for q in p..run_hi {
                            let qs = fstart + q as u64 * PAGE_SIZE;
                            if qs >= a && self.page_end(f, q) <= b {
                                set.insert_range(q, q + 1);
                            }
                        }
                    }
                }
                p = run_hi;
            }
            if let Some(set) = missed_full.filter(|s| !s.is_empty()) {
                plan.fill_wanted.push((f, set));
            }
        }
        Ok(())
    }

    /// The mutating half of `begin_read`: accounting, and the inline fills of `always`.
    fn commit_read(&mut self, plan: &mut ReadPlan) {
        let offset = plan.offset;
        self.note_access(offset, plan.len, plan.verdict);
        self.account_read(1, plan.full_hit as u64, plan.hit_pages, plan.missed_pages);
        for (f, set) in std::mem::take(&mut plan.fill_wanted) {
            let Ok(pop) = self.start_population(f, Some(&set)) else {
                continue;
            };
            let fstart = self.geo.fragment_start(f).0;
            let st = self.pops.get(pop.0).expect("just started");
            let slot_off = self.geo.slot_offset(st.slot).0;
            let runs: Vec<(u32, u32)> = st.fill.runs(self.geo.pages_per_fragment()).collect();
            for (q0, q1) in runs {
                let sa = fstart + q0 as u64 * PAGE_SIZE;
                let sb = self.page_end(f, q1 - 1);
                plan.fills.push(FillRun {
                    pop,
                    buf_offset: sa - offset,
                    len: sb - sa,
                    cache: CacheOffset(slot_off + (sa - fstart)),
                });
            }
            plan.pops.push(pop);
        }
    }

    /// True if the endurance budget (if any) would allow `bytes` more cache writes now.
    fn endurance_allows(&self, bytes: u64) -> bool {
        self.endurance.as_ref().is_none_or(|e| e.allows(bytes))
    }

    /// True if the endurance budget (if any) allows `bytes` more cache writes; counts them.
    fn endure(&mut self, bytes: u64) -> bool {
        if let Some(e) = &mut self.endurance {
            if !e.take(bytes) {
                self.stats.endurance_refusals += 1;
                return false;
            }
        }
        self.stats.cache_bytes_planned += bytes;
        true
    }

    fn account_read(&mut self, requests: u64, full_hits: u64, hits: u64, misses: u64) {
        self.stats.read_requests += requests;
        self.stats.read_requests_full_hit += full_hits;
        self.stats.read_pages_hit += hits;
        self.stats.read_pages_missed += misses;
        self.missrate.record(hits, misses);
        self.budget.record_reads(hits, misses);
    }

    /// Applies the accounting of reads planned with `plan_read`, and empties the log.
    pub fn apply_access_log(&mut self, log: &mut AccessLog) {
        for i in 0..log.reads.len() {
            let (offset, len, verdict) = log.reads[i];
            self.note_access(offset, len, verdict);
        }
        self.account_read(log.requests, log.full_hits, log.hit_pages, log.missed_pages);
        *log = AccessLog {
            reads: std::mem::take(&mut log.reads),
            ..AccessLog::default()
        };
        log.reads.clear();
    }

    /// Releases the pins of a read. The caller guarantees that the plan's I/O is finished and
    /// its populations completed.
    pub fn end_read(&mut self, plan: &mut ReadPlan) {
        plan.release_pins(self.slots.pin_table());
    }

    /// The pin table, for drivers that release read pins without taking their lock
    /// (`ReadPlan::release_pins`).
    pub fn pin_table(&self) -> Arc<PinTable> {
        self.slots.pin_table().clone()
    }

    // ----- writes -----

    /// Starts a write (or discard) of `len` bytes at `offset`: invalidates the pages and plans
    /// the cache copies. The caller MUST send the source write after this returns, then report
    /// `write_source_done`, and `write_cache_done` for every listed cache copy.
    pub fn begin_write(
        &mut self,
        offset: SourceOffset,
        len: u64,
        kind: WriteKind,
    ) -> Result<WritePlan, RequestError> {
        self.check(offset.0, len)?;
        self.stats.write_requests += 1;
        let verdict = self.classify(offset.0, len);
        let sequential = self.note_access(offset.0, len, verdict);
        let mode = self.cfg.write_mode;
        let copy_wanted =
            kind == WriteKind::Data && mode != WriteMode::WriteAround && len > 0 && !sequential;
        let over_budget = mode == WriteMode::Awt && self.awt_in_flight + len > self.cfg.awt_budget;
        let id = WriteId(self.writes.insert(WriteState {
            parts: Vec::new(),
            source_ok: None,
            cache_pending: 0,
            budget: 0,
        }));
        let mut parts = Vec::new();
        let mut cache_writes = Vec::new();
        let mut budget = 0;
        let mut fell_back = false;
        let mut duplicate = false;
        for (f, lo, hi, a, b) in fragments(self.geo, offset.0, len) {
            self.stats.write_pages += (hi - lo) as u64;
            let fstart = self.geo.fragment_start(f).0;
            let head_partial = a > fstart + lo as u64 * PAGE_SIZE;
            let tail_partial = b < self.page_end(f, hi - 1);
            let mut slot = self.map.get(f);
            if slot.is_none()
                && copy_wanted
                && self.cfg.admission == Admission::Always
                && self.endurance_allows(b - a)
            {
                slot = self.allocate(f);
            }
            let (mut vlo, mut vhi) = (lo, hi);
            if let Some(s) = slot {
                let partial_ok = self.cfg.revalidate_partial_pages;
                if head_partial && !(partial_ok && self.slots.is_valid(s, lo)) {
                    vlo = lo + 1;
                }
                if tail_partial && !(partial_ok && self.slots.is_valid(s, hi - 1)) {
                    vhi = hi - 1;
                }
                bitmap::clear_range(self.slots.bitmap_mut(s), lo, hi);
            }
            // Duplicate-write tracking: spoil whatever else is in flight on these pages.
            let mut conflict = false;
            let act = self.activity.entry(f.0).or_default();
            if let Some(pid) = act.pop {
                if let Some(pop) = self.pops.get_mut(pid.0) {
                    if bitmap::any_set(pop.fill.words(), lo, hi) {
                        conflict = true;
                        let n = bitmap::count(pop.fill.words(), lo, hi);
                        self.stats.pages_spoiled += n as u64;
                        pop.spoiled.insert_range(lo, hi);
                    }
                }
            }
            for &w in &act.writes {
                if let Some(ws) = self.writes.get_mut(w.0) {
                    for part in ws.parts.iter_mut().filter(|p| p.frag == f) {
                        let (ol, oh) = (part.lo.max(lo), part.hi.min(hi));
                        if ol < oh {
                            conflict = true;
                            part.spoiled
                                .get_or_insert_with(|| PageSet::new(self.geo.pages_per_fragment()))
                                .insert_range(ol, oh);
                        }
                    }
                }
            }
            act.writes.push(id);
            let mut part = WritePart {
                frag: f,
                lo,
                hi,
                vlo,
                vhi,
                slot: None,
                cache_ok: None,
                spoiled: None,
            };
            if let (true, Some(s)) = (copy_wanted, slot) {
                if conflict {
                    duplicate = true;
                } else if over_budget {
                    fell_back = true;
                } else if !self.endure(b - a) {
                    // Over the endurance budget: the pages stay invalid (write-around).
                } else if self.slots.pin(s) {
                    part.slot = Some(s);
                    budget += b - a;
                    cache_writes.push(CacheWrite {
                        part: parts.len() as u32,
                        buf_offset: a - offset.0,
                        len: b - a,
                        cache: CacheOffset(self.geo.slot_offset(s).0 + (a - fstart)),
                    });
                }
            }
            parts.push(part);
        }
        if fell_back {
            self.stats.awt_fallbacks += 1;
        }
        if duplicate {
            self.stats.awt_duplicates += 1;
        }
        if !cache_writes.is_empty() {
            self.stats.awt_started += 1;
        }
        if mode == WriteMode::Awt {
            self.awt_in_flight += budget;
        } else {
            budget = 0;
        }
        let ws = self.writes.get_mut(id.0).expect("just inserted");
        ws.parts = parts;
        ws.cache_pending = cache_writes.len() as u32;
        ws.budget = budget;
        Ok(WritePlan {
            id,
            cache_writes,
            synchronous: mode == WriteMode::WriteThrough,
        })
    }

    /// Reports the source half of a write. A failed source write leaves the pages invalid.
    pub fn write_source_done(&mut self, id: WriteId, ok: bool) -> Result<(), RequestError> {
        let ws = self.writes.get_mut(id.0).ok_or(RequestError::UnknownId)?;
        if ws.source_ok.is_some() {
            return Err(RequestError::UnknownId);
        }
        ws.source_ok = Some(ok);
        if !ok {
            self.stats.source_write_failures += 1;
        }
        self.maybe_finish_write(id);
        Ok(())
    }

    /// Reports the cache copy `part` of a write. A failed copy leaves the pages invalid.
    pub fn write_cache_done(
        &mut self,
        id: WriteId,
        part: u32,
        ok: bool,
    ) -> Result<(), RequestError> {
        let ws = self.writes.get_mut(id.0).ok_or(RequestError::UnknownId)?;
        let p = ws
            .parts
            .get_mut(part as usize)
            .ok_or(RequestError::UnknownId)?;
        if p.slot.is_none() || p.cache_ok.is_some() {
            return Err(RequestError::UnknownId);
        }
        p.cache_ok = Some(ok);
        ws.cache_pending -= 1;
        if !ok {
            self.stats.awt_cache_failures += 1;
        }
        self.maybe_finish_write(id);
        Ok(())
    }

    fn maybe_finish_write(&mut self, id: WriteId) {
        let done = self
            .writes
            .get(id.0)
            .is_some_and(|w| w.source_ok.is_some() && w.cache_pending == 0);
        if !done {
            return;
        }
        let ws = self.writes.remove(id.0).expect("checked");
        let source_ok = ws.source_ok == Some(true);
        let mut validated_any = false;
        for part in ws.parts {
            if let Some(s) = part.slot {
                if source_ok && part.cache_ok == Some(true) && part.vlo < part.vhi {
                    debug_assert_eq!(self.slots.fragment(s), Some(part.frag));
                    let bm = self.slots.bitmap_mut(s);
                    match &part.spoiled {
                        None => bitmap::set_range(bm, part.vlo, part.vhi),
                        Some(sp) => {
                            for q in part.vlo..part.vhi {
                                if !sp.contains(q) {
                                    bitmap::set_range(bm, q, q + 1);
                                }
                            }
                            self.stats.pages_spoiled +=
                                bitmap::count(sp.words(), part.vlo, part.vhi) as u64;
                        }
                    }
                    validated_any = true;
                }
                self.slots.unpin(s);
            }
            self.forget_activity(part.frag, |a| a.writes.retain(|w| *w != id));
        }
        if validated_any {
            self.stats.awt_completed += 1;
        }
        self.awt_in_flight -= ws.budget;
    }

    fn forget_activity(&mut self, f: FragNo, change: impl FnOnce(&mut FragActivity)) {
        if let Some(a) = self.activity.get_mut(&f.0) {
            change(a);
            if a.writes.is_empty() && a.pop.is_none() {
                self.activity.remove(&f.0);
            }
        }
    }

    // ----- population and eviction -----

    fn victim(&mut self) -> Option<SlotNo> {
        let slots = &self.slots;
        self.evict
            .victim(|s| slots.pins(s) > 0 || slots.fragment(s).is_none())
    }

    fn evict_slot(&mut self, s: SlotNo) {
        if let Some(f) = self.slots.fragment(s) {
            self.map.set(f, None);
            self.stats.fragments_evicted += 1;
        }
        self.slots.assign(s, None);
        self.evict.removed(s);
    }

    /// Gives fragment `f` a slot: a free one, or the eviction policy's victim.
    fn allocate(&mut self, f: FragNo) -> Option<SlotNo> {
        let s = match self.slots.take_free() {
            Some(s) => s,
            None => {
                let s = self.victim()?;
                self.evict_slot(s);
                s
            }
        };
        self.slots.assign(s, Some(f));
        self.map.set(f, Some(s));
        self.evict.inserted(s);
        Some(s)
    }

    /// Pages of `f` a population could fill now: not valid, not under a write in flight,
    /// restricted to `hint` if given. None if a population is already in flight on `f`.
    fn fillable(&self, f: FragNo, hint: Option<&PageSet>) -> Option<PageSet> {
        let act = self.activity.get(&f.0);
        if act.is_some_and(|a| a.pop.is_some()) {
            return None;
        }
        let n = self.geo.fragment_pages(f);
        let mut fill = match hint {
            Some(h) => h.clone(),
            None => {
                let mut s = PageSet::new(self.geo.pages_per_fragment());
                s.insert_range(0, n);
                s
            }
        };
        if let Some(s) = self.map.get(f) {
            for (w, v) in fill.words_mut().iter_mut().zip(self.slots.bitmap(s)) {
                *w &= !v;
            }
        }
        if let Some(a) = act {
            for w in &a.writes {
                if let Some(ws) = self.writes.get(w.0) {
                    for p in ws.parts.iter().filter(|p| p.frag == f) {
                        fill.remove_range(p.lo, p.hi);
                    }
                }
            }
        }
        (!fill.is_empty()).then_some(fill)
    }

    /// True if a population of `f` would fill at least one page now. Cheap unless writes
    /// are in flight on `f`.
    fn worth_populating(&self, f: FragNo) -> bool {
        if f.0 >= self.geo.source_fragments() {
            return false;
        }
        match self.activity.get(&f.0) {
            Some(a) if a.pop.is_some() => false,
            Some(_) => self.fillable(f, None).is_some(),
            None => match self.map.get(f) {
                None => true,
                Some(s) => !bitmap::all_set(self.slots.bitmap(s), 0, self.geo.fragment_pages(f)),
            },
        }
    }

    /// Starts a population of the pages of `f` that `fillable` gives, within the endurance
    /// budget (checked before a slot is allocated, so that a refusal evicts nothing), and
    /// counts its bytes against it.
    fn start_population(&mut self, f: FragNo, hint: Option<&PageSet>) -> Result<PopId, NoPop> {
        let fill = self.fillable(f, hint).ok_or(NoPop::Nothing)?;
        let bytes = fill.len() as u64 * PAGE_SIZE;
        if !self.endurance_allows(bytes) {
            self.stats.endurance_refusals += 1;
            return Err(NoPop::Endurance);
        }
        let (slot, fresh_slot) = match self.map.get(f) {
            Some(s) => (s, false),
            None => (self.allocate(f).ok_or(NoPop::NoSlot)?, true),
        };
        if !self.slots.pin(slot) {
            return Err(NoPop::NoSlot);
        }
        self.endure(bytes);
        let spoiled = PageSet::new(self.geo.pages_per_fragment());
        let id = PopId(self.pops.insert(PopState {
            frag: f,
            slot,
            fill,
            spoiled,
            fresh_slot,
        }));
        self.activity.entry(f.0).or_default().pop = Some(id);
        self.window.reset(f);
        self.stats.populations_started += 1;
        Ok(id)
    }

    /// Algorithm 1's promotion step: if the throttle allows it now, picks the hottest fragment
    /// worth populating (SCE) or the next admitted one (`nhit:K`) and returns the job.
    pub fn pick_population(&mut self, now: Nanos) -> Option<PopulationJob> {
        if !self.throttle(now).may_populate {
            return None;
        }
        if self.cfg.admission == Admission::Sce {
            let full = self.slots.free_count() == 0;
            self.budget.advance(now, full, self.geo.fragment_size());
            if self.budget.exhausted() {
                self.stats.population_budget_waits += 1;
                return None;
            }
        }
        self.pick_population_unthrottled()
    }

    /// The current population rate limit in bytes per second (0: unlimited).
    pub fn population_rate(&self) -> u64 {
        self.budget.rate()
    }

    /// Admission `sce`: the hottest candidate of the window, if it earns its place. Once the
    /// cache is full a candidate needs two touches in the window, and a fragment not cached
    /// must win a duel against the eviction victim in the frequency sketch.
    fn pick_selective(&mut self) -> Option<PopulationJob> {
        let full = self.slots.free_count() == 0;
        let this = &*self;
        let f = self.window.hottest_by(|f, n| {
            // A fragment with a slot only needs filling, which evicts nothing. Another
            // needs a second touch in the window once the cache is full.
            let eligible = n >= 2 || !full || this.map.get(f).is_some();
            eligible
                && this.worth_populating(f)
                && (!this.cfg.partial_fill
                    || this.fillable(f, this.fill_hint(f).as_ref()).is_some())
        })?;
        let hint = self.fill_hint(f);
        let Some(fill) = self.fillable(f, hint.as_ref()) else {
            self.window.reset(f);
            return None;
        };
        let bytes = fill.len() as u64 * PAGE_SIZE;
        if !self.endurance_allows(bytes) {
            self.stats.endurance_refusals += 1;
            return None;
        }
        if self.map.get(f).is_none() && self.slots.free_count() == 0 {
            let victim = self.victim()?;
            let heat = |core: &Self, g: FragNo| core.sketch.as_ref().map_or(0, |s| s.estimate(g.0));
            let vf = self.slots.fragment(victim).expect("victims hold fragments");
            if heat(self, f) < heat(self, vf).saturating_add(self.cfg.admission_margin) {
                self.stats.admissions_rejected += 1;
                self.window.reset(f);
                return None;
            }
            self.evict_slot(victim);
            self.slots.put_free(victim);
        }
        self.budget.take(bytes);
        let Ok(id) = self.start_population(f, Some(&fill)) else {
            self.window.reset(f);
            return None;
        };
        Some(self.job(id))
    }

    /// With `partial_fill`, the pages of the 64ths of `f` touched since it was last picked;
    /// the whole fragment if half of it or more was touched.
    fn fill_hint(&self, f: FragNo) -> Option<PageSet> {
        if !self.cfg.partial_fill {
            return None;
        }
        let parts = self.window.parts(f);
        let parts_per_fragment = self.geo.pages_per_fragment().min(64);
        if parts.count_ones() * 2 >= parts_per_fragment || parts == 0 {
            return None;
        }
        let per = self.geo.pages_per_fragment().div_ceil(64).max(1);
        let mut set = PageSet::new(self.geo.pages_per_fragment());
        let n = self.geo.fragment_pages(f);
        for i in 0..64 {
            if parts & (1 << i) != 0 {
                let lo = (i * per).min(n);
                let hi = ((i + 1) * per).min(n);
                if lo < hi {
                    set.insert_range(lo, hi);
                }
            }
        }
        Some(set)
    }

    /// Like `pick_population` but ignores the throttle (for tests and explicit prefetch).
    /// Under admission `sce` the candidate must still earn its place (but the population
    /// budget is not consulted).
    pub fn pick_population_unthrottled(&mut self) -> Option<PopulationJob> {
        let f = match self.cfg.admission {
            Admission::Always => None,
            Admission::Sce => return self.pick_selective(),
            Admission::ScePaper => {
                let this = &*self;
                // Eligible: something to fill now. A hot cached fragment whose only invalid
                // pages are under writes in flight (AWT copies) is not, or it would win every
                // pick and starve the rest.
                self.window.hottest(|f| this.worth_populating(f))
            }
            Admission::NHit(_) => {
                let mut found = None;
                while let Some(f) = self.nhit.as_mut().and_then(|n| n.queue.pop_front()) {
                    if self.worth_populating(f) {
                        found = Some(f);
                        break;
                    }
                }
                found
            }
        }?;
        match self.start_population(f, None) {
            Ok(id) => Some(self.job(id)),
            // Over the endurance budget: the candidate keeps its heat.
            Err(NoPop::Endurance) => None,
            Err(_) => {
                // No slot could be had (all pinned): try again next cycle.
                self.window.reset(f);
                None
            }
        }
    }

    /// Starts a population of the fragment holding `offset` (NBD CACHE, prefetch), ignoring
    /// the throttle. None if there is nothing to fill or no slot can be had.
    pub fn prefetch(&mut self, offset: SourceOffset) -> Option<PopulationJob> {
        if offset.0 >= self.geo.source_size() {
            return None;
        }
        let id = self
            .start_population(self.geo.fragment_of(offset), None)
            .ok()?;
        Some(self.job(id))
    }

    fn job(&self, id: PopId) -> PopulationJob {
        let st = self.pops.get(id.0).expect("live population");
        let f = st.frag;
        let fstart = self.geo.fragment_start(f).0;
        let slot_off = self.geo.slot_offset(st.slot).0;
        let runs: Vec<(u32, u32)> = st.fill.runs(self.geo.pages_per_fragment()).collect();
        let span_lo = runs.first().map_or(0, |r| r.0);
        let span_hi = runs.last().map_or(0, |r| r.1);
        let source = fstart + span_lo as u64 * PAGE_SIZE;
        let len = self.page_end(f, span_hi - 1) - source;
        let runs = runs
            .into_iter()
            .map(|(a, b)| {
                let sa = fstart + a as u64 * PAGE_SIZE;
                let sb = self.page_end(f, b - 1);
                (sa - source, sb - sa, CacheOffset(slot_off + (sa - fstart)))
            })
            .collect();
        PopulationJob {
            id,
            frag: f,
            slot: st.slot,
            source: SourceOffset(source),
            len,
            runs,
        }
    }

    /// Reports a population (background or inline fill): `ok` if the source read and every
    /// cache write succeeded. Validates the filled pages that no write spoiled meanwhile.
    pub fn complete_population(&mut self, id: PopId, ok: bool) -> Result<(), RequestError> {
        let st = self.pops.remove(id.0).ok_or(RequestError::UnknownId)?;
        let s = st.slot;
        debug_assert_eq!(self.slots.fragment(s), Some(st.frag));
        if ok {
            let bm = self.slots.bitmap_mut(s);
            let mut n = 0;
            for (v, (fw, sw)) in bm
                .iter_mut()
                .zip(st.fill.words().iter().zip(st.spoiled.words()))
            {
                let add = fw & !sw;
                n += add.count_ones();
                *v |= add;
            }
            self.stats.pages_populated += n as u64;
            self.stats.populations_completed += 1;
        } else {
            self.stats.populations_failed += 1;
        }
        self.slots.unpin(s);
        self.forget_activity(st.frag, |a| a.pop = None);
        let empty = !bitmap::any_set(self.slots.bitmap(s), 0, self.geo.pages_per_fragment());
        if !ok && st.fresh_slot && empty && self.slots.pins(s) == 0 {
            self.evict_slot(s);
            self.slots.put_free(s);
        }
        Ok(())
    }
}

/// Visits each fragment overlapping `[offset, offset + len)`: the fragment, the page range of
/// the request inside it, and the byte range `[a, b)` of the request inside it.
fn fragments(
    geo: Geometry,
    offset: u64,
    len: u64,
) -> impl Iterator<Item = (FragNo, u32, u32, u64, u64)> {
    let fsize = geo.fragment_size();
    let shift = geo.fragment_shift();
    let end = offset + len;
    let first = offset >> shift;
    let last = if len == 0 { first } else { (end - 1) >> shift };
    (first..=last).filter(move |_| len > 0).map(move |f| {
        let fs = f << shift;
        let a = offset.max(fs);
        let b = end.min(fs + fsize);
        let lo = ((a - fs) >> PAGE_SHIFT) as u32;
        let hi = (b - fs).div_ceil(PAGE_SIZE) as u32;
        (FragNo(f), lo, hi, a, b)
    })
}
