//! Configuration of the cache core, with validation that names the offending field.

use crate::evict::EvictionKind;
use crate::geometry::{DEFAULT_FRAGMENT_SIZE, MAX_FRAGMENT_SIZE, MIN_FRAGMENT_SIZE};
use std::time::Duration;

/// How fragments get into the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Admission {
    /// SCE made flash-conscious (the default): background workers populate the hottest
    /// fragment of the MRU window, throttled by Algorithm 1, but only a fragment touched at
    /// least twice in the window once the cache is full, only by evicting a fragment colder
    /// than it (by `admission_margin`, in a frequency sketch that outlives eviction), never
    /// for sequential streams (with miss fills their reads of a line or more fill free
    /// space from their own data; streams are bypassed once the cache is full), and within
    /// the population budget.
    /// Reads never wait.
    #[default]
    Sce,
    /// SCE's Algorithm 1 as the paper (and sce before issue 11) has it: the hottest fragment
    /// of the window is populated whenever the throttle allows, evicting whatever CLOCK says.
    ScePaper,
    /// Populate inline on every miss: a read miss writes the pages it read into the cache
    /// before completing, and a write to an uncached fragment allocates a slot (flashcache-like).
    Always,
    /// Queue a fragment for background population once it has been accessed `k` times.
    NHit(u32),
}

impl std::str::FromStr for Admission {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sce" => Ok(Admission::Sce),
            "sce-paper" => Ok(Admission::ScePaper),
            "always" => Ok(Admission::Always),
            _ => match s.strip_prefix("nhit:").map(str::parse::<u32>) {
                Some(Ok(k)) if k >= 1 => Ok(Admission::NHit(k)),
                _ => Err(format!(
                    "unknown admission {s:?} (expected sce, sce-paper, always or nhit:K with K >= 1)"
                )),
            },
        }
    }
}

impl std::fmt::Display for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Admission::Sce => f.write_str("sce"),
            Admission::ScePaper => f.write_str("sce-paper"),
            Admission::Always => f.write_str("always"),
            Admission::NHit(k) => write!(f, "nhit:{k}"),
        }
    }
}

/// How writes reach the cache, in the names operators know (casadm, lvmcache, bcache).
///
/// | name | old name | a write | a read |
/// |---|---|---|---|
/// | `writethrough` (default) | `awt` | source, then acknowledged; the cache copy follows asynchronously (SCE's AWT) | cache or source |
/// | `writethrough-sync` (`writethrough` with `--awt off`) | `write-through` | source and cache, acknowledged when both are done | cache or source |
/// | `writearound` | `write-around` | source only; cached pages invalidated | cache or source |
/// | `passthrough` | | source only; cached pages invalidated | source only, nothing populated |
///
/// In these modes the cache never holds data the source does not: each can be switched to
/// any other at any time. `writeback` is the volume's, served by the engine's write-back log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WriteMode {
    /// Asynchronous write-through (SCE 3.3): acknowledge when the source write completes; the
    /// cache copy completes in the background and then re-validates the pages.
    #[default]
    Awt,
    /// Invalidate the written pages; only the source is written.
    WriteAround,
    /// Synchronous write-through: acknowledge when both writes complete.
    WriteThrough,
    /// The cache is not used: reads and writes go to the source, writes invalidate what the
    /// cache holds of their pages, nothing is populated. Cached data stays for later.
    Passthrough,
    /// Write-back (issues 15 and 45): writes land in the cache device only and are cleaned
    /// to the source later. It is the volume's mode, not the core's: the engine (and the
    /// simulator) serve it through the write-back log, on a persistent cache with its write
    /// journal (docs/WRITEBACK.md), and run the core's shards in write-through for it (they
    /// never hold dirty pages). Entered and left at run time by reopening the volume
    /// (`sce ctl set mode`), never by a retune of a running core.
    WriteBack,
}

impl WriteMode {
    /// Every name a mode is parsed from, the operator's first.
    pub const NAMES: &'static str =
        "writethrough, writethrough-sync, writearound, passthrough, writeback (old names: awt, write-through, write-around)";

    /// The mode with asynchronous write-through on or off: `writethrough` and
    /// `writethrough-sync` are one mode with AWT on or off; the others have no such flavour.
    pub fn with_awt(self, on: bool) -> WriteMode {
        match (self, on) {
            (WriteMode::Awt, false) => WriteMode::WriteThrough,
            (WriteMode::WriteThrough, true) => WriteMode::Awt,
            (m, _) => m,
        }
    }

    /// True if reads are served from the cache (all modes but passthrough).
    pub fn caches_reads(self) -> bool {
        self != WriteMode::Passthrough
    }

    /// True if writes place copies in the cache (the two write-through flavours).
    pub fn copies_writes(self) -> bool {
        matches!(self, WriteMode::Awt | WriteMode::WriteThrough)
    }
}

impl std::str::FromStr for WriteMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "writethrough" | "awt" => Ok(WriteMode::Awt),
            "writethrough-sync" | "write-through" => Ok(WriteMode::WriteThrough),
            "writearound" | "write-around" => Ok(WriteMode::WriteAround),
            "passthrough" | "pass-through" => Ok(WriteMode::Passthrough),
            "writeback" | "write-back" => Ok(WriteMode::WriteBack),
            _ => Err(format!(
                "unknown mode {s:?} (expected {})",
                WriteMode::NAMES
            )),
        }
    }
}

impl std::fmt::Display for WriteMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WriteMode::Awt => "writethrough",
            WriteMode::WriteAround => "writearound",
            WriteMode::WriteThrough => "writethrough-sync",
            WriteMode::Passthrough => "passthrough",
            WriteMode::WriteBack => "writeback",
        })
    }
}

/// The population throttle of SCE's Algorithm 1.
#[derive(Clone, Debug, PartialEq)]
pub struct ThrottleConfig {
    /// Populate only while the read miss rate is at least this (0.0..=1.0).
    pub target_missrate: f64,
    /// Populate only while at least this percentage of slots is free, unless eviction is allowed.
    pub min_free_pcnt: f64,
    /// Whether population may evict when free space is below `min_free_pcnt`.
    pub allow_eviction: bool,
    /// Sleep of a worker between population cycles while more than one worker is active.
    pub period: Duration,
    /// Sleep of the single remaining worker once the miss rate is below `low_missrate`.
    pub slow_period: Duration,
    /// Workers while the miss rate is high and free space is plentiful.
    pub max_workers: u32,
    /// Workers between the two miss-rate steps.
    pub mid_workers: u32,
    /// Workers below the low miss-rate step.
    pub min_workers: u32,
    /// Miss rate below which `max_workers` steps down to `mid_workers`.
    pub high_missrate: f64,
    /// Miss rate below which `mid_workers` steps down to `min_workers`.
    pub low_missrate: f64,
    /// Free-space percentage at or below which `max_workers` steps down to `mid_workers`.
    pub low_free_pcnt: f64,
    /// Length of the window over which the miss rate is measured.
    pub missrate_window: Duration,
}

impl Default for ThrottleConfig {
    fn default() -> Self {
        ThrottleConfig {
            target_missrate: 0.01,
            min_free_pcnt: 0.0,
            allow_eviction: true,
            period: Duration::from_millis(20),
            slow_period: Duration::from_millis(500),
            max_workers: 8,
            mid_workers: 4,
            min_workers: 1,
            high_missrate: 0.35,
            low_missrate: 0.15,
            low_free_pcnt: 10.0,
            missrate_window: Duration::from_secs(1),
        }
    }
}

/// Everything the core needs to know besides the two device sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct CoreConfig {
    /// Fragment size in bytes: a power of two from 4 KiB to 64 MiB.
    pub fragment_size: u64,
    /// Admission policy.
    pub admission: Admission,
    /// Write mode.
    pub write_mode: WriteMode,
    /// Eviction policy.
    pub eviction: EvictionKind,
    /// CLOCK counter ceiling (4 in SCE).
    pub clock_ceiling: u8,
    /// Fragments in the MRU hotness window (100 in SCE).
    pub hot_window: usize,
    /// Bytes of AWT copies that may be in flight before writes fall back to write-around.
    pub awt_budget: u64,
    /// Population throttle.
    pub throttle: ThrottleConfig,
    /// Admission `sce`: a candidate that would evict must be hotter than the victim by at
    /// least this many touches in the frequency sketch.
    pub admission_margin: u32,
    /// Admission `sce`: a run of at least this many sequential bytes is a stream whose
    /// requests raise no heat and whose writes bypass the cache (0: no detection).
    pub sequential_cutoff: u64,
    /// Admission `sce`: population bytes per second at most (0: unlimited).
    pub population_rate: u64,
    /// Admission `sce`: adapt the population rate between `population_min_rate` and
    /// `population_rate`, quartering it each second while the hit ratio no longer improves.
    pub population_adaptive: bool,
    /// The floor of the adaptive population rate, bytes per second.
    pub population_min_rate: u64,
    /// Admission `sce`: populate only the 64ths of a fragment that were touched (the slot is
    /// still allocated whole), instead of the whole fragment.
    pub partial_fill: bool,
    /// Admission `sce`: a read miss in a line that population would fill (a line with a
    /// slot, free space, or a region touched before in the window that wins the eviction
    /// duel) writes the pages it read to the cache before completing: the fill costs the
    /// source nothing, so a saturated source still fills the cache. Background population
    /// then only prefetches the rest of a hot line; a driver that can tell runs it only
    /// while the source has room.
    pub miss_fills: bool,
    /// With `miss_fills`: fill from misses only while the cache has free slots (its first
    /// pass: empty, or cold after a restart, when a miss costs a populate-on-miss cache
    /// nothing and population would read the source a second time) or while the driver
    /// says the source is busy ([`CacheCore::set_source_busy`](crate::CacheCore::set_source_busy)),
    /// which is when it also holds background population back; in a full cache over a
    /// source with room, population alone fills (it picks the hottest lines, where a miss
    /// fill takes every line a miss touches that wins the duel). The servers' and the
    /// simulator's `--miss-fills auto`.
    pub miss_fills_when_busy: bool,
    /// Admission `sce`: thousandths of the cache's slots kept as a *recency window* in front
    /// of the frequency duel (W-TinyLFU, Einziger et al.; Caffeine's default is 1%): when the
    /// cache is full, a new line enters without a duel into the window, and the window's
    /// oldest line, to stay, must win the duel against the eviction victim, else it is the
    /// one evicted. It lets recently touched lines of low frequency (data read soon after it
    /// was written, a new burst) be cached the duel alone would refuse. 0: off.
    pub recency_window: u32,
    /// A driver instruction, not a policy: requests are widened to whole 4 KiB pages before
    /// they are planned (a read that covers part of a page reads all of it from the source),
    /// so that misaligned I/O fills and hits whole pages. The simulator's `flashcache-4k`
    /// baseline (issue 30: a 4 KiB cache that handles misalignment, against which
    /// flashcache-like's refusal of misaligned pages is measured) sets it; the server does
    /// not offer it.
    pub widen_to_pages: bool,
    /// Bytes over which heat is tracked (the hotness window, the frequency sketch, the stream
    /// detector and the eviction duel): a fragment in the SCE paper's sense. 0 means
    /// `fragment_size`. When it is larger, `fragment_size` is a *line*: the unit of cache
    /// space and of filling, so that a hot fragment costs only the lines of it that were
    /// touched, not a whole slot of `heat_size` bytes. A power of two, from `fragment_size`
    /// to 64 lines.
    pub heat_size: u64,
    /// Bytes written to the cache device per day at most (population, fills and write
    /// copies, any admission); once reached, the cache serves hits and admits nothing more.
    pub max_cache_writes: Option<u64>,
    /// Whether a write that covers part of a page may re-validate that page (its other bytes
    /// being valid already). Off when the driver keeps per-page checksums: it cannot compute
    /// the checksum of a page it holds only part of.
    pub revalidate_partial_pages: bool,
    /// Write-back's cleaning: watermarks and rate (the server's write-back log).
    pub writeback: crate::WritebackTuning,
    /// Admission `sce`: the page area (issue 47). A read miss in a line without a slot fills
    /// its pages one at a time into packed slots (`crate::pagearea`) until this percentage
    /// of the line's pages (at least one, at most 255) were admitted within the sketch's
    /// horizon; the line is *dense* then, and fills (and is populated) as a line. 0: no
    /// page area, every line is dense.
    pub dense_line_percent: u32,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            fragment_size: DEFAULT_FRAGMENT_SIZE,
            admission: Admission::Sce,
            write_mode: WriteMode::Awt,
            eviction: EvictionKind::Clock,
            clock_ceiling: 4,
            hot_window: 100,
            awt_budget: 8 << 20,
            throttle: ThrottleConfig::default(),
            admission_margin: 1,
            sequential_cutoff: 4 << 20,
            population_rate: 256 << 20,
            population_adaptive: true,
            population_min_rate: 1 << 20,
            partial_fill: false,
            heat_size: 0,
            miss_fills: false,
            miss_fills_when_busy: false,
            recency_window: 0,
            widen_to_pages: false,
            max_cache_writes: None,
            revalidate_partial_pages: true,
            writeback: crate::WritebackTuning::default(),
            dense_line_percent: 6,
        }
    }
}

impl CoreConfig {
    /// True if read misses fill the cache (admission `sce` with `miss_fills`), and so
    /// background population should leave a busy source to the clients.
    pub fn fills_from_misses(&self) -> bool {
        self.admission == Admission::Sce && self.miss_fills
    }

    /// Bytes over which heat is tracked: `heat_size`, or `fragment_size` if that is 0.
    pub fn heat_bytes(&self) -> u64 {
        self.heat_size.max(self.fragment_size)
    }

    /// The flashcache-like baseline: 4 KiB fragments, admission `always`, synchronous
    /// write-through, LRU.
    pub fn flashcache_like() -> Self {
        CoreConfig {
            fragment_size: 4096,
            admission: Admission::Always,
            write_mode: WriteMode::WriteThrough,
            eviction: EvictionKind::Lru,
            ..CoreConfig::default()
        }
    }

    /// Checks every field; the error names the field and the reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fs = self.fragment_size;
        if !fs.is_power_of_two() {
            return Err(ConfigError::new(
                "fragment_size",
                format!("{fs} is not a power of two"),
            ));
        }
        if !(MIN_FRAGMENT_SIZE..=MAX_FRAGMENT_SIZE).contains(&fs) {
            return Err(ConfigError::new(
                "fragment_size",
                format!("{fs} is outside the range 4 KiB ..= 64 MiB"),
            ));
        }
        let hs = self.heat_size;
        if hs != 0 && (!hs.is_power_of_two() || hs < fs || hs / fs > 64) {
            return Err(ConfigError::new(
                "heat_size",
                format!(
                    "{hs} must be a power of two from the line size ({fs}) to 64 lines ({})",
                    fs * 64
                ),
            ));
        }
        if self.recency_window > 500 {
            return Err(ConfigError::new(
                "recency_window",
                format!(
                    "{} thousandths of the cache is more than half of it",
                    self.recency_window
                ),
            ));
        }
        if self.clock_ceiling == 0 {
            return Err(ConfigError::new(
                "clock_ceiling",
                "must be at least 1".into(),
            ));
        }
        if self.hot_window == 0 || self.hot_window > 65_000 {
            return Err(ConfigError::new(
                "hot_window",
                "must be between 1 and 65000".into(),
            ));
        }
        if self.max_cache_writes == Some(0) {
            return Err(ConfigError::new(
                "max_cache_writes",
                "must be positive (leave it out for no limit)".into(),
            ));
        }
        if self.population_adaptive && self.population_rate > 0 && self.population_min_rate == 0 {
            return Err(ConfigError::new(
                "population_min_rate",
                "must be positive when the rate adapts (a rate of 0 could never grow)".into(),
            ));
        }
        if self.population_adaptive
            && self.population_rate > 0
            && self.population_min_rate > self.population_rate
        {
            return Err(ConfigError::new(
                "population_min_rate",
                "must not exceed population_rate".into(),
            ));
        }
        if self.dense_line_percent > 100 {
            return Err(ConfigError::new(
                "dense_line_percent",
                format!("{} is more than 100", self.dense_line_percent),
            ));
        }
        if let Admission::NHit(0) = self.admission {
            return Err(ConfigError::new("admission", "nhit:K needs K >= 1".into()));
        }
        self.writeback.validate()?;
        self.throttle.validate()
    }
}

impl ThrottleConfig {
    /// Checks the throttle's fields (`throttle.*` in errors).
    fn validate(&self) -> Result<(), ConfigError> {
        let t = self;
        for (name, v) in [
            ("throttle.target_missrate", t.target_missrate),
            ("throttle.high_missrate", t.high_missrate),
            ("throttle.low_missrate", t.low_missrate),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(ConfigError::new(
                    name,
                    format!("{v} is not within 0.0 ..= 1.0"),
                ));
            }
        }
        for (name, v) in [
            ("throttle.min_free_pcnt", t.min_free_pcnt),
            ("throttle.low_free_pcnt", t.low_free_pcnt),
        ] {
            if !(0.0..=100.0).contains(&v) {
                return Err(ConfigError::new(
                    name,
                    format!("{v} is not within 0 ..= 100"),
                ));
            }
        }
        if t.max_workers == 0 || t.max_workers > 64 {
            return Err(ConfigError::new(
                "throttle.max_workers",
                "must be between 1 and 64".into(),
            ));
        }
        if t.mid_workers == 0 || t.mid_workers > t.max_workers {
            return Err(ConfigError::new(
                "throttle.mid_workers",
                "must be between 1 and max_workers".into(),
            ));
        }
        if t.min_workers == 0 || t.min_workers > t.mid_workers {
            return Err(ConfigError::new(
                "throttle.min_workers",
                "must be between 1 and mid_workers".into(),
            ));
        }
        if t.missrate_window.is_zero() {
            return Err(ConfigError::new(
                "throttle.missrate_window",
                "must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// An invalid configuration or geometry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct ConfigError {
    /// The field at fault, as named in config files and CLI flags.
    pub field: &'static str,
    /// Why.
    pub reason: String,
}

impl ConfigError {
    /// Builds an error.
    pub fn new(field: &'static str, reason: String) -> Self {
        ConfigError { field, reason }
    }
}
