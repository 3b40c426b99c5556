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
//! * **Guards.** Drivers use the typed guards of [`guard`](self::PinnedRead) on top of these
//!   calls: a [`PinnedRead`] owns its pins and releases them when dropped; a [`WriteTxn`]
//!   splits into a [`SourceWrite`] and [`CacheCopy`] tokens and a [`Population`] holds a
//!   [`Populating`] token, each completed by a method that consumes it (a token dropped
//!   uncompleted fails a debug assertion).
//!
//! Write-back is not the core's: the engine serves it through its write-back log, and the
//! core's shards of a write-back volume run in write-through (they never hold dirty pages).
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

mod evict;
mod guard;
mod heat;
mod pages;
mod plan;
mod population;
mod read;
mod share;
mod write;

pub use guard::{CacheCopy, HeldRead, PinnedRead, Populating, Population, SourceWrite, WriteTxn};
pub use plan::{
    AccessLog, CacheWrite, FillRun, PopId, PopulationJob, ReadPlan, ReadRun, RequestError,
    RunTarget, WriteId, WriteKind, WritePlan,
};

use crate::addr::{FragNo, Nanos, SlotNo, SourceOffset, PAGE_SHIFT, PAGE_SIZE, SECTOR_SIZE};
use crate::admit::{Endurance, FreqSketch, PopBudget, StreamVerdict, Streams};
use crate::bitmap;
use crate::config::{Admission, ConfigError, CoreConfig, WriteMode};
use crate::evict::Eviction;
use crate::geometry::Geometry;
use crate::hotness::{IntMap, MruWindow};
use crate::map::FragmentMap;
use crate::slab::Slab;
use crate::slots::SlotTable;
use crate::stats::CoreStats;
use crate::throttle::{self, MissRate, ThrottleState};
use population::{NHitFilter, PopState};
use write::WriteState;

#[derive(Debug, Default)]
struct FragActivity {
    writes: Vec<WriteId>,
    pop: Option<PopId>,
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
    /// The recency window's lines, oldest first (`CoreConfig::recency_window`; an entry
    /// whose line left the cache since is skipped).
    recent: std::collections::VecDeque<FragNo>,
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
    /// Caps of the volumes that share the device, if any.
    shares: share::Shares,
    /// The driver's word that the source has no room for population now.
    source_busy: bool,
    /// The page area (admission `sce` with `dense_line_percent`), see `pages.rs`.
    sparse: Option<pages::Sparse>,
}

/// The admission policy's state, built from the configuration: rebuilt whole when a
/// running cache is retuned.
struct Policy {
    nhit: Option<NHitFilter>,
    sketch: Option<FreqSketch>,
    streams: Option<std::sync::Mutex<Streams>>,
    budget: PopBudget,
}

impl Policy {
    fn new(cfg: &CoreConfig, geo: &Geometry) -> Policy {
        let slots = geo.slots() as usize;
        let nhit = match cfg.admission {
            Admission::NHit(k) => Some(NHitFilter::new(k, (slots * 2).clamp(1024, 1 << 20))),
            _ => None,
        };
        let selective = cfg.admission == Admission::Sce;
        let sketch = selective.then(|| FreqSketch::new(slots.max(cfg.hot_window)));
        let streams = (selective && cfg.sequential_cutoff > 0).then(|| {
            std::sync::Mutex::new(Streams::new(
                cfg.sequential_cutoff,
                cfg.heat_bytes().trailing_zeros(),
            ))
        });
        let budget = PopBudget::new(
            if selective { cfg.population_rate } else { 0 },
            cfg.population_min_rate,
            cfg.population_adaptive,
            CacheCore::BUDGET_EPOCH_NS,
        );
        Policy {
            nhit,
            sketch,
            streams,
            budget,
        }
    }
}

/// What a running cache lets an operator change (`sce ctl set`): each field given replaces
/// the configuration's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Retune {
    /// The write mode.
    pub write_mode: Option<WriteMode>,
    /// The admission policy (its learnt state starts over).
    pub admission: Option<Admission>,
    /// Admission `sce`: the sequential cutoff in bytes (0: no detection).
    pub sequential_cutoff: Option<u64>,
    /// Admission `sce`: the population rate ceiling in bytes per second (0: unlimited), and
    /// whether it adapts.
    pub population_rate: Option<(u64, bool)>,
    /// Write-back: the cleaner's low and high watermarks (shares of the log) and its
    /// background rate in bytes per second (0: no limit).
    pub writeback_low_watermark: Option<f64>,
    /// See `writeback_low_watermark`.
    pub writeback_high_watermark: Option<f64>,
    /// See `writeback_low_watermark`.
    pub writeback_rate: Option<u64>,
}

impl Retune {
    /// Every setting a running cache may change, as `cfg` has it: what puts a reopened
    /// cache back where an operator left it.
    pub fn all_of(cfg: &CoreConfig) -> Retune {
        Retune {
            write_mode: Some(cfg.write_mode),
            admission: Some(cfg.admission),
            sequential_cutoff: Some(cfg.sequential_cutoff),
            population_rate: Some((cfg.population_rate, cfg.population_adaptive)),
            writeback_low_watermark: Some(cfg.writeback.low_watermark),
            writeback_high_watermark: Some(cfg.writeback.high_watermark),
            writeback_rate: Some(cfg.writeback.rate),
        }
    }

    /// `cfg` with the fields given here replaced (not validated).
    pub fn applied_to(&self, cfg: &CoreConfig) -> CoreConfig {
        let mut cfg = cfg.clone();
        if let Some(m) = self.write_mode {
            cfg.write_mode = m;
        }
        if let Some(a) = self.admission {
            cfg.admission = a;
        }
        if let Some(c) = self.sequential_cutoff {
            cfg.sequential_cutoff = c;
        }
        if let Some((r, adaptive)) = self.population_rate {
            cfg.population_rate = r;
            cfg.population_adaptive = adaptive;
        }
        if let Some(w) = self.writeback_low_watermark {
            cfg.writeback.low_watermark = w;
        }
        if let Some(w) = self.writeback_high_watermark {
            cfg.writeback.high_watermark = w;
        }
        if let Some(r) = self.writeback_rate {
            cfg.writeback.rate = r;
        }
        cfg
    }
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
        let Policy {
            nhit,
            sketch,
            streams,
            budget,
        } = Policy::new(&cfg, &geo);
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
            recent: std::collections::VecDeque::new(),
            nhit,
            missrate: MissRate::default(),
            writes: Slab::default(),
            pops: Slab::default(),
            activity: IntMap::default(),
            awt_in_flight: 0,
            stats: CoreStats::default(),
            shares: share::Shares::default(),
            source_busy: false,
            sparse: Self::sparse_for(&cfg, &geo),
            geo,
            cfg,
        })
    }

    /// The page area a core of `cfg` and `geo` keeps, if any: admission `sce` with
    /// `dense_line_percent`, lines of at least a set of pages, a source within its page numbers.
    fn sparse_for(cfg: &CoreConfig, geo: &Geometry) -> Option<pages::Sparse> {
        let ppf = geo.pages_per_fragment();
        (cfg.admission == Admission::Sce
            && cfg.dense_line_percent > 0
            && ppf >= crate::pagearea::WAYS
            && geo.source_size() / PAGE_SIZE <= crate::pagearea::MAX_PAGE)
            .then(|| pages::Sparse::new(ppf, geo.slots(), cfg.dense_line_percent))
    }

    /// The geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }
    /// The configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// Changes what a running cache may change (see [`Retune`]); the fragments it holds stay.
    /// A change of admission, sequential cutoff or population rate starts the admission
    /// state over (sketch, filters, streams, budget). Nothing is changed if the result
    /// would not validate.
    pub fn retune(&mut self, t: &Retune) -> Result<(), ConfigError> {
        let cfg = t.applied_to(&self.cfg);
        cfg.validate()?;
        let policy_changed = cfg.admission != self.cfg.admission
            || cfg.sequential_cutoff != self.cfg.sequential_cutoff
            || cfg.population_rate != self.cfg.population_rate
            || cfg.population_adaptive != self.cfg.population_adaptive;
        self.cfg = cfg;
        if policy_changed {
            let p = Policy::new(&self.cfg, &self.geo);
            (self.nhit, self.sketch, self.streams, self.budget) =
                (p.nhit, p.sketch, p.streams, p.budget);
        }
        Ok(())
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

    /// True if slot `s` is lent to the write-back log (never free nor allocated meanwhile).
    pub fn slot_is_lent(&self, s: SlotNo) -> bool {
        self.slots.is_lent(s)
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
            self.share_count(f, true);
            n += 1;
        }
        self.slots.rebuild_free();
        self.slots.take_dirty();
        n
    }

    /// Marks pages `[lo, hi)` of fragment `f` invalid (their cached copy was found bad).
    pub fn invalidate(&mut self, f: FragNo, lo: u32, hi: u32) {
        let dropped = self.drop_sparse(f, lo, hi.min(self.geo.pages_per_fragment()));
        self.stats.pages_invalidated += dropped;
        if let Some(s) = self.map.get(f) {
            let hi = hi.min(self.geo.pages_per_fragment());
            if lo < hi {
                bitmap::clear_range(self.slots.bitmap_mut(s), lo, hi);
                self.stats.pages_invalidated += (hi - lo) as u64;
            }
        }
    }

    /// FlashTier's `exists`: the slot holding fragment `f` and how many of its pages are valid.
    pub fn exists(&self, f: FragNo) -> Option<(SlotNo, u32)> {
        let s = self.map.get(f)?;
        Some((
            s,
            bitmap::count(self.slots.bitmap(s), 0, self.geo.pages_per_fragment()),
        ))
    }

    /// FlashTier's `exists` over a range: the fragments of `[offset, offset+len)` the cache
    /// holds, each as (its source offset, valid pages within the range), in source order.
    pub fn exists_range(&self, offset: SourceOffset, len: u64) -> Vec<(SourceOffset, u32)> {
        let mut out = Vec::new();
        if len == 0 {
            return out;
        }
        let end = (offset.0.saturating_add(len)).min(self.geo.source_size());
        if offset.0 >= end {
            return out;
        }
        for (f, lo, hi, _, _) in fragments(self.geo, offset.0, end - offset.0) {
            let n = match self.map.get(f) {
                Some(s) => bitmap::count(self.slots.bitmap(s), lo, hi),
                None => self.count_sparse(f, lo, hi),
            };
            if n > 0 {
                out.push((self.geo.fragment_start(f), n));
            }
        }
        out
    }

    /// The heat of the fragment holding byte `offset` (its region's count in the frequency
    /// sketch; 0 without one): what a hand-off orders its list by.
    pub fn heat_at(&self, offset: SourceOffset) -> u32 {
        self.heat(self.geo.fragment_of(offset))
    }

    /// True if byte `offset` of the source is in a valid cached page.
    pub fn is_cached(&self, offset: SourceOffset) -> bool {
        let f = self.geo.fragment_of(offset);
        let p = ((offset.0 - self.geo.fragment_start(f).0) >> PAGE_SHIFT) as u32;
        match self.map.get(f) {
            Some(s) => self.slots.is_valid(s, p),
            None => self.count_sparse(f, p, p + 1) > 0,
        }
    }

    /// Tells the core the time, for the endurance budget's allowance (which grows with it).
    /// `throttle` and `pick_population` do this too; a driver without population workers
    /// (admission `always`) calls it with its requests.
    pub fn advance_clock(&mut self, now: Nanos) {
        if let Some(e) = &mut self.endurance {
            e.advance(now);
        }
        if self.cfg.fills_from_misses() {
            // The adaptive budget follows the hit ratio also while no population runs.
            let full = self.slots.free_count() == 0;
            self.budget.advance(now, full, self.geo.fragment_size());
        }
    }

    /// The driver's word on the source: `busy` while it holds background population back
    /// for want of room (with `miss_fills_when_busy`, misses of a full cache fill it only
    /// then).
    pub fn set_source_busy(&mut self, busy: bool) {
        self.source_busy = busy;
    }

    /// The population throttle's view now (Algorithm 1).
    pub fn throttle(&mut self, now: Nanos) -> ThrottleState {
        self.advance_clock(now);
        let rate = self.missrate.rate(now, self.cfg.throttle.missrate_window);
        let free = 100.0 * self.slots.free_count() as f64 / self.geo.slots() as f64;
        throttle::decide(&self.cfg.throttle, rate, free, self.budget.moving())
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
    /// sequential). Called once per request, when it is planned. Readers on other threads
    /// never wait for the detector: a request that finds it busy goes unobserved and counts
    /// as random (a stream skips it within `Streams::GAP`), so the hit path has no lock that
    /// blocks. A single-threaded driver (the simulator) always gets it.
    fn classify(&self, offset: u64, len: u64) -> StreamVerdict {
        match &self.streams {
            Some(st) if len > 0 => match st.try_lock() {
                Ok(mut g) => g.observe(offset, len),
                Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().observe(offset, len),
                Err(std::sync::TryLockError::WouldBlock) => StreamVerdict::default(),
            },
            _ => StreamVerdict::default(),
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

    fn forget_activity(&mut self, f: FragNo, change: impl FnOnce(&mut FragActivity)) {
        if let Some(a) = self.activity.get_mut(&f.0) {
            change(a);
            if a.writes.is_empty() && a.pop.is_none() {
                self.activity.remove(&f.0);
            }
        }
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
