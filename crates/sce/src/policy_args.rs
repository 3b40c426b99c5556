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
    /// raise no heat, are not admitted, and their writes bypass the cache (0 disables)
    /// [default: 4MiB].
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
