//! The options of flash-conscious admission, shared by `serve`, `demo` and `sim` so that the
//! three run the same policy with the same knobs. The command line's flags for them
//! (`sce`'s `AdmissionArgs`) and an export's TOML fields both come down to
//! [`AdmissionOptions`].

use sce_core::units::{format_size, parse_size};
use sce_core::CoreConfig;

/// How fast population may write, in bytes per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PopulationRate {
    /// Adaptive between the floor and the ceiling of the core's defaults.
    Auto,
    /// Adaptive with this ceiling.
    AutoUpTo(u64),
    /// A fixed limit.
    Fixed(u64),
    /// No limit.
    Unlimited,
}

impl std::str::FromStr for PopulationRate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(PopulationRate::Auto),
            "unlimited" => Ok(PopulationRate::Unlimited),
            _ => {
                let (auto, size) = match s.strip_prefix("auto:") {
                    Some(rest) => (true, rest),
                    None => (false, s),
                };
                let size = size.strip_suffix("/s").unwrap_or(size);
                let n = parse_size(size).map_err(|e| {
                    format!("population rate {s:?}: {e} (auto, auto:SIZE, SIZE or unlimited)")
                })?;
                if n == 0 {
                    return Err(format!(
                        "population rate {s:?} must be positive (use unlimited for no limit)"
                    ));
                }
                Ok(if auto {
                    PopulationRate::AutoUpTo(n)
                } else {
                    PopulationRate::Fixed(n)
                })
            }
        }
    }
}

/// An endurance budget: bytes per day, or drive writes per day of the cache device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WriteBudget {
    /// Bytes per day.
    Bytes(u64),
    /// Drive writes per day (a multiple of the cache size).
    Dwpd(f64),
}

impl std::str::FromStr for WriteBudget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s0 = s.trim();
        if let Some(x) = s0.strip_suffix("dwpd").or_else(|| s0.strip_suffix("DWPD")) {
            let v: f64 = x.trim().parse().map_err(|_| {
                format!("write budget {s:?}: {x:?} is not a number of drive writes per day")
            })?;
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("write budget {s:?}: must be > 0"));
            }
            return Ok(WriteBudget::Dwpd(v));
        }
        let b = s0.strip_suffix("/day").unwrap_or(s0);
        let n = parse_size(b)
            .map_err(|e| format!("write budget {s:?}: {e} (SIZE per day, or N dwpd)"))?;
        if n == 0 {
            return Err(format!("write budget {s:?}: must be > 0"));
        }
        Ok(WriteBudget::Bytes(n))
    }
}

impl WriteBudget {
    /// Bytes per day for a cache device of `cache_size` bytes.
    pub fn per_day(self, cache_size: u64) -> u64 {
        match self {
            WriteBudget::Bytes(n) => n,
            WriteBudget::Dwpd(d) => ((cache_size as f64 * d) as u64).max(1),
        }
    }
}

/// Options of admission `sce` (and the endurance budget, which holds for any admission).
/// `None` (and `false`) keep the core's defaults.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdmissionOptions {
    /// Population bandwidth.
    pub population_rate: Option<PopulationRate>,
    /// Bytes of a sequential run from which it is bypassed once the cache is full, and its reads of a line or more fill free space from their own data before (0: never).
    pub sequential_cutoff: Option<u64>,
    /// Touches by which a candidate must beat its victim in the frequency sketch.
    pub admission_margin: Option<u32>,
    /// Populate only the touched parts of a fragment.
    pub partial_fill: bool,
    /// Fill the cache from read misses' own data (and populate only while the source has
    /// room): on, off, or auto (while the cache has free space or the source is busy); None is
    /// [`DEFAULT_MISS_FILLS`].
    pub miss_fills: Option<MissFills>,
    /// The recency window in front of the frequency duel.
    pub recency_window: Option<RecencyWindow>,
    /// The page area: when a line is dense enough to fill as a line (or off).
    pub dense_line: Option<DenseLine>,
    /// Endurance budget of the cache device.
    pub max_cache_writes: Option<WriteBudget>,
}

/// The line of admission sce's default geometry: heat is counted per 1 MiB fragment (the
/// SCE paper's), cache space is allocated and filled per 512 KiB line of one, so a fragment
/// whose hot part is small costs half a MiB of cache, not a whole one. Measured on the
/// policy matrix, PostgreSQL and the memory footprint (docs/SIM-REPORT.md, issue 30):
/// 256 KiB lines hit a little more but cost 245 B of RAM per cached MiB, over the 160 B goal.
pub const DEFAULT_LINE_SIZE: u64 = 512 << 10;

/// Miss fills of admission sce by default: while the cache has free space or the source is
/// busy.
pub const DEFAULT_MISS_FILLS: MissFills = MissFills::Auto;

/// Sets `cfg`'s geometry (its admission already set) from the sizes asked for: heat per
/// `fragment` (default: `cfg`'s fragment size), cache space per `line` (default: the
/// fragment). With neither asked for, admission sce gets the default lines: its fragments,
/// still counted for heat, are cut into lines of [`DEFAULT_LINE_SIZE`]; other admissions
/// keep whole fragments. A line larger than its fragment is left for the caller to refuse
/// (`CoreConfig::validate` does).
pub fn geometry(cfg: &mut CoreConfig, fragment: Option<u64>, line: Option<u64>) {
    let f = fragment.unwrap_or(cfg.fragment_size);
    cfg.heat_size = f;
    cfg.fragment_size = line.unwrap_or(f);
    let asked = fragment.is_some() || line.is_some();
    if !asked && cfg.admission == sce_core::Admission::Sce && f > DEFAULT_LINE_SIZE {
        cfg.fragment_size = DEFAULT_LINE_SIZE;
    }
}

/// `on` or `off` (also true/false, yes/no).
pub fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => Err(format!("{s}: expected on or off")),
    }
}

/// A TOML setting that is a boolean or a word ("auto").
#[derive(serde::Deserialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum OnOffAuto {
    /// true or false.
    Bool(bool),
    /// A word, parsed by the setting.
    Word(String),
}

impl OnOffAuto {
    /// As text: "on", "off", or the word.
    pub fn text(&self) -> String {
        match self {
            OnOffAuto::Bool(true) => "on".into(),
            OnOffAuto::Bool(false) => "off".into(),
            OnOffAuto::Word(w) => w.clone(),
        }
    }
}

/// Fills from read misses (`CoreConfig::miss_fills`, `miss_fills_when_busy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissFills {
    /// Population alone fills the cache.
    Off,
    /// Every read miss that population would fill fills the cache with its own data;
    /// population re-reads the source only while it has room.
    On,
    /// Misses fill while the cache has free space (its first pass) and while the source is
    /// busy (when population waits for room), so a cold cache fills as fast as a
    /// populate-on-miss one and a saturated source still fills the cache; a full cache over
    /// an idle source is left to population.
    Auto,
}

impl std::str::FromStr for MissFills {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match (s, parse_on_off(s)) {
            ("auto", _) => Ok(MissFills::Auto),
            (_, Ok(on)) => Ok(if on { MissFills::On } else { MissFills::Off }),
            (_, Err(_)) => Err(format!("{s}: expected on, off or auto")),
        }
    }
}

impl MissFills {
    /// The setting of `cfg`.
    pub fn of(cfg: &CoreConfig) -> Self {
        match (cfg.miss_fills, cfg.miss_fills_when_busy) {
            (false, _) => MissFills::Off,
            (true, false) => MissFills::On,
            (true, true) => MissFills::Auto,
        }
    }

    /// Sets `cfg` to it.
    pub fn apply(self, cfg: &mut CoreConfig) {
        cfg.miss_fills = self != MissFills::Off;
        cfg.miss_fills_when_busy = self == MissFills::Auto;
    }
}

impl std::fmt::Display for MissFills {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MissFills::Off => "off",
            MissFills::On => "on",
            MissFills::Auto => "auto",
        })
    }
}

/// The recency window of admission `sce` (`CoreConfig::recency_window`): a share of the
/// cache's slots, given as a percentage ("1%", "0.5%") or "off"; kept in thousandths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecencyWindow(pub u32);

impl std::str::FromStr for RecencyWindow {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if matches!(s, "off" | "0" | "0%") {
            return Ok(RecencyWindow(0));
        }
        let pct = s
            .strip_suffix('%')
            .and_then(|n| n.parse::<f64>().ok())
            .filter(|p| p.is_finite() && (0.0..=50.0).contains(p))
            .ok_or_else(|| {
                format!(
                    "{s}: expected a percentage of the cache from 0.1% to 50% (e.g. 1%), or off"
                )
            })?;
        let permille = (pct * 10.0).round() as u32;
        if permille == 0 && pct > 0.0 {
            return Err(format!("{s}: the smallest window is 0.1% of the cache"));
        }
        Ok(RecencyWindow(permille))
    }
}

/// When admission `sce` fills a line rather than single pages into the page area
/// (`CoreConfig::dense_line_percent`, issue 47): once this percentage of the line's pages
/// were admitted one at a time ("6%"), or "off" (no page area: every line fills as a line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseLine(pub u32);

impl std::str::FromStr for DenseLine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if matches!(s, "off" | "0" | "0%") {
            return Ok(DenseLine(0));
        }
        s.strip_suffix('%')
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|p| (1..=100).contains(p))
            .map(DenseLine)
            .ok_or_else(|| format!("{s}: expected a percentage of a line's pages from 1% to 100% (e.g. 6%), or off"))
    }
}

impl AdmissionOptions {
    /// Applies the options to `cfg`, for a cache device of `cache_size` bytes.
    pub fn apply(&self, cfg: &mut CoreConfig, cache_size: u64) {
        match self.population_rate {
            None | Some(PopulationRate::Auto) => {}
            Some(PopulationRate::AutoUpTo(n)) => {
                cfg.population_rate = n;
                cfg.population_adaptive = true;
                cfg.population_min_rate = cfg.population_min_rate.min(n);
            }
            Some(PopulationRate::Fixed(n)) => {
                cfg.population_rate = n;
                cfg.population_adaptive = false;
            }
            Some(PopulationRate::Unlimited) => {
                cfg.population_rate = 0;
                cfg.population_adaptive = false;
            }
        }
        if let Some(c) = self.sequential_cutoff {
            cfg.sequential_cutoff = c;
        }
        if let Some(m) = self.admission_margin {
            cfg.admission_margin = m;
        }
        if self.partial_fill {
            cfg.partial_fill = true;
        }
        self.miss_fills.unwrap_or(DEFAULT_MISS_FILLS).apply(cfg);
        if let Some(RecencyWindow(w)) = self.recency_window {
            cfg.recency_window = w;
        }
        if let Some(DenseLine(p)) = self.dense_line {
            cfg.dense_line_percent = p;
        }
        if let Some(b) = self.max_cache_writes {
            cfg.max_cache_writes = Some(b.per_day(cache_size));
        }
    }

    /// A one-line description of the settings that differ from the defaults.
    pub fn describe(cfg: &CoreConfig) -> String {
        let rate = match (cfg.population_rate, cfg.population_adaptive) {
            (0, _) => "unlimited".to_string(),
            (n, true) => format!("auto up to {}/s", format_size(n)),
            (n, false) => format!("{}/s", format_size(n)),
        };
        let budget = cfg
            .max_cache_writes
            .map_or("none".to_string(), |b| format!("{}/day", format_size(b)));
        format!(
            "population rate {rate}, sequential cutoff {}, margin {}, partial fill {}, \
             miss fills {}, recency window {}, page area {}, cache write budget {budget}",
            format_size(cfg.sequential_cutoff),
            cfg.admission_margin,
            if cfg.partial_fill { "on" } else { "off" },
            MissFills::of(cfg),
            match cfg.recency_window {
                0 => "off".to_string(),
                w => format!("{}%", w as f64 / 10.0),
            },
            match cfg.dense_line_percent {
                0 => "off".to_string(),
                p => format!("lines dense at {p}%"),
            },
        )
    }
}
