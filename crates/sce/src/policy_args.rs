//! The command-line flags of flash-conscious admission, shared by `serve`, `demo` and `sim`
//! so that the three run the same policy with the same knobs. The options themselves, and
//! how they change a `CoreConfig`, are `sce_server::admission`'s.

use crate::units::parse_size;
use sce_core::CoreConfig;
use sce_server::admission::{AdmissionOptions, PopulationRate, WriteBudget};

/// Options of admission `sce` (and the endurance budget, which holds for any admission).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct AdmissionArgs {
    /// Admission sce: population bandwidth, bytes per second: auto (adaptive up to 256MiB/s,
    /// down to 1MiB/s while the hit ratio no longer improves), auto:SIZE, a fixed SIZE, or
    /// unlimited.
    #[arg(long, value_name = "RATE")]
    pub population_rate: Option<PopulationRate>,
    /// Admission sce: once the cache is full, sequential runs of at least this many bytes
    /// raise no heat, are not admitted, and their writes bypass the cache; before that,
    /// with miss fills, their reads of a cache line or more fill free space from their own
    /// data and are never read again by population (0 disables). In
    /// write-back, writes of 128KiB or more in such a run go through to the source instead
    /// of into the log [default: 4MiB].
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub sequential_cutoff: Option<u64>,
    /// Admission sce: a fragment that would evict must be hotter than its victim by this many
    /// touches in the frequency sketch [default: 1].
    #[arg(long, value_name = "N")]
    pub admission_margin: Option<u32>,
    /// Admission sce: populate only the 64ths of a fragment that were touched (the slot is
    /// still allocated whole) unless half of it was.
    #[arg(long)]
    pub partial_fill: bool,
    /// Admission sce: a read miss in a line population would fill writes the pages it read
    /// to the cache with the read (no second source read), and background population runs
    /// only while the source shows no queue, so a saturated source still fills the cache;
    /// auto: misses fill while the cache has free space or the source shows a queue,
    /// population alone otherwise [default: auto].
    #[arg(long, value_name = "on|off|auto")]
    pub miss_fills: Option<sce_server::admission::MissFills>,
    /// Admission sce: a share of the cache kept as a recency window in front of the
    /// frequency duel (W-TinyLFU): a new line enters it without a duel, and stays once it
    /// leaves the window only by out-heating the eviction victim; a percentage (e.g. 1%) or
    /// off [default: off].
    #[arg(long, value_name = "PERCENT")]
    pub recency_window: Option<sce_server::admission::RecencyWindow>,
    /// Admission sce: the page area. A read miss in a line without a slot fills only the
    /// pages it read, packed with other lines' pages, until this share of the line's pages
    /// was admitted one at a time lately (within the last 2.5 admissions per cache slot);
    /// the line then fills (and is populated) as a line. A write refills the packed pages
    /// it covers whole. A percentage (e.g. 6%) or off (every line fills as a line)
    /// [default: 6%].
    #[arg(long, value_name = "PERCENT")]
    pub dense_line: Option<sce_server::admission::DenseLine>,
    /// Endurance budget of the cache device: SIZE per day (e.g. 200GiB) or N dwpd (drive
    /// writes per day of the cache size). Population, fills and write copies stop once it is
    /// spent; hits continue. [default: none]
    #[arg(long, value_name = "BUDGET")]
    pub max_cache_writes: Option<WriteBudget>,
}

impl AdmissionArgs {
    /// The options the flags give.
    pub fn options(&self) -> AdmissionOptions {
        AdmissionOptions {
            population_rate: self.population_rate,
            sequential_cutoff: self.sequential_cutoff,
            admission_margin: self.admission_margin,
            partial_fill: self.partial_fill,
            miss_fills: self.miss_fills,
            recency_window: self.recency_window,
            dense_line: self.dense_line,
            max_cache_writes: self.max_cache_writes,
        }
    }

    /// Applies the options to `cfg`, for a cache device of `cache_size` bytes.
    pub fn apply(&self, cfg: &mut CoreConfig, cache_size: u64) {
        self.options().apply(cfg, cache_size);
    }

    /// A one-line description of the settings that differ from the defaults.
    pub fn describe(cfg: &CoreConfig) -> String {
        AdmissionOptions::describe(cfg)
    }
}

/// The tuning knobs of the cache engine, the same in `demo`, `serve` and (as an export's
/// fields) the TOML file. Each left out keeps the engine's default.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TuningArgs {
    /// Asynchronous write-through: on (writes are acknowledged when the source has them, the
    /// cache copy follows) or off (acknowledged when both have them: `writethrough-sync`).
    /// Applies to --mode writethrough. [default: on]
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub awt: Option<bool>,
    /// Fragments in the MRU hotness window that population picks from [default: 100].
    #[arg(long, value_name = "N")]
    pub hot_window: Option<usize>,
    /// Bytes of AWT copies in flight before writes fall back to write-around
    /// [default: 8MiB].
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub awt_budget: Option<u64>,
    /// Algorithm 1: sleep of a population worker between cycles [default: 20ms].
    #[arg(long, value_parser = crate::units::parse_duration, value_name = "DURATION")]
    pub period: Option<std::time::Duration>,
    /// Algorithm 1: populate only while this percentage of slots is free, unless eviction
    /// for population is allowed [default: 0].
    #[arg(long, value_name = "PERCENT")]
    pub min_free_pcnt: Option<f64>,
    /// Algorithm 1: do not evict to populate (population stops when free space falls below
    /// --min-free-pcnt).
    #[arg(long)]
    pub no_evict_for_population: bool,
}

pub use sce_server::admission::parse_on_off;

impl TuningArgs {
    /// Applies the knobs given to `cfg` (`--awt` turns its write-through mode's flavour).
    pub fn apply(&self, cfg: &mut CoreConfig) {
        if let Some(on) = self.awt {
            cfg.write_mode = cfg.write_mode.with_awt(on);
        }
        if let Some(n) = self.hot_window {
            cfg.hot_window = n;
        }
        if let Some(b) = self.awt_budget {
            cfg.awt_budget = b;
        }
        if let Some(p) = self.period {
            cfg.throttle.period = p;
        }
        if let Some(p) = self.min_free_pcnt {
            cfg.throttle.min_free_pcnt = p;
        }
        if self.no_evict_for_population {
            cfg.throttle.allow_eviction = false;
        }
    }
}

/// `sce sim`'s write-back options: the log's size and the cleaner's settings, as `sce
/// serve` takes them.
#[derive(clap::Args, Debug, Clone)]
pub struct WritebackSimArgs {
    /// Write-back: bytes of the cache that are the write-back log (auto: what `sce format`
    /// gives a device of --cache-size: a sixteenth, between 16 MiB and 4 GiB).
    #[arg(long, default_value = "auto", value_name = "auto|SIZE")]
    pub writeback_log: sce_server::config::LogSize,
    /// Write-back: how much of the read slots the log may borrow as dirty data outgrows it,
    /// as `sce format`'s (auto: up to half of --cache-size in all; 0: none).
    #[arg(long, default_value = "auto", value_name = "auto|SIZE")]
    pub writeback_grow: sce_server::config::LogSize,
    /// Write-back: the share of the most the log may hold in use from which the cleaner
    /// cleans in the background, as serve's. [default: 25%]
    #[arg(long, value_name = "SHARE", value_parser = sce_core::wbtune::parse_share)]
    pub writeback_low_watermark: Option<f64>,
    /// Write-back: the share of the log in use above which cleaning is urgent, as serve's.
    /// [default: 75%]
    #[arg(long, value_name = "SHARE", value_parser = sce_core::wbtune::parse_share)]
    pub writeback_high_watermark: Option<f64>,
    /// Write-back: the most background cleaning writes to the source per (virtual) second
    /// (SIZE, or unlimited), as serve's. [default: unlimited]
    #[arg(long, value_name = "RATE", value_parser = sce_core::wbtune::parse_rate)]
    pub writeback_rate: Option<u64>,
}

impl WritebackSimArgs {
    /// The log's bytes for a cache of `cache_size` (checked in write-back: at least 1 MiB,
    /// at most half the cache).
    pub fn log_bytes(&self, mode: sce_core::WriteMode, cache_size: u64) -> anyhow::Result<u64> {
        let log = self.writeback_log.bytes(cache_size);
        if mode == sce_core::WriteMode::WriteBack && (log < 1 << 20 || log > cache_size / 2) {
            anyhow::bail!(
                "invalid --writeback-log {}: write-back needs a log of at least 1 MiB and at \
                 most half of --cache-size",
                sce_core::units::format_size(log)
            );
        }
        Ok(log)
    }

    /// The log's sizes for a cache of `cache_size` ([`Self::log_bytes`], and the read slots
    /// it may lend: `None` for auto).
    pub fn log_sizes(
        &self,
        mode: sce_core::WriteMode,
        cache_size: u64,
    ) -> anyhow::Result<sce_sim::LogSizes> {
        Ok(sce_sim::LogSizes {
            log: Some(self.log_bytes(mode, cache_size)?),
            grow: self.writeback_grow.explicit(),
        })
    }

    /// The cleaner's settings over `t`'s.
    pub fn apply(&self, t: &mut sce_core::WritebackTuning) {
        t.low_watermark = self.writeback_low_watermark.unwrap_or(t.low_watermark);
        t.high_watermark = self.writeback_high_watermark.unwrap_or(t.high_watermark);
        t.rate = self.writeback_rate.unwrap_or(t.rate);
    }
}
