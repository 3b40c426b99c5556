//! A whole trace-driven simulation, as `sce sim` runs it. A first streaming pass
//! ([`Survey`]) lays out the volumes of the trace (each its own address space) and counts
//! the requests; then every policy streams the trace again in its own thread (as many at
//! once as [`SimConfig::threads`] allows): the reference policies over 4 KiB blocks and the
//! engine policies, which run the sce-core state machine in virtual time over modelled
//! devices. Each policy runs inside a [`Stack`]: one or several hosts, optionally with a RAM
//! cache above the flash cache. What each comes to is a [`PolicyResult`].

mod devices;
mod result;
mod survey;

pub use devices::parse_device_models;
use result::Metadata;
pub use result::{overload_warning, PolicyResult};
pub use survey::Survey;

use crate::engine::{DeviceModel, EngineSim};
use crate::layers::{Flash, Host, Ownership, RamCache, RamPolicy, Replay, Stack, StackResult};
use crate::reference::{BlockCache, ReferencePolicy};
use crate::request::IoKind;
use crate::trace::{TraceFormat, TraceReader};
use sce_core::units::format_size;
use sce_core::{CacheCore, CoreConfig};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

/// Why a simulation could not be prepared or run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A setting is invalid (the message names it).
    #[error("{0}")]
    Config(String),
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] crate::trace::TraceError),
    /// The core refused its configuration.
    #[error(transparent)]
    Core(#[from] sce_core::ConfigError),
    /// A policy's simulation failed.
    #[error("policy {policy}")]
    Policy {
        /// The policy's name.
        policy: String,
        /// Why.
        #[source]
        source: Box<SimError>,
    },
    /// A simulation thread panicked, or a policy was not simulated.
    #[error("{0}")]
    Failed(String),
}

/// What the simulation's steps return.
pub type Result<T, E = SimError> = std::result::Result<T, E>;

/// Returns a configuration error with a formatted message.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err(SimError::Config(format!($($arg)*)))
    };
}

/// The most cache slots an engine policy may have here (about 6 GiB of core metadata).
const MAX_ENGINE_SLOTS: u64 = 1 << 27;

/// What a policy runs: a reference policy over 4 KiB blocks, or the engine with a
/// configuration. One per policy of a run, so the engine's configuration is kept inline.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum PolicyKind {
    /// A reference policy.
    Reference(ReferencePolicy),
    /// The sce-core state machine with this configuration.
    Engine(CoreConfig),
}

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The trace file.
    pub trace: PathBuf,
    /// Its format.
    pub format: TraceFormat,
    /// Cache size, bytes.
    pub cache_size: u64,
    /// The policies to run side by side, with their names.
    pub policies: Vec<(String, PolicyKind)>,
    /// Length of the intervals of the warm-up curve, in trace seconds.
    pub interval: f64,
    /// Drop writes from the trace.
    pub reads_only: bool,
    /// Count and skip malformed records instead of failing.
    pub skip_bad: bool,
    /// Hosts sharing one volume (the volume field of the trace is the host id).
    pub hosts: u32,
    /// Shared mode's ownership of regions (issue 31, see [`Ownership`]); `None`: every
    /// write is published and acknowledged by every other host (the rule before it).
    pub ownership: Option<Ownership>,
    /// Reports shared mode's etcd operations with one host too (with several hosts they
    /// always are): one host registered in shared mode.
    pub report_coherence: bool,
    /// A RAM cache of this size above each flash cache.
    pub ram_size: Option<u64>,
    /// When the RAM cache writes down to flash.
    pub ram_policy: RamPolicy,
    /// The replay asked for; `None` chooses from the trace's timestamps.
    pub replay: Option<Replay>,
    /// Policies simulated at once (default: the number of cores).
    pub threads: Option<usize>,
    /// Shards of the engine policies' core, as the server's `core_shards` (0: the server's
    /// automatic choice; 1: one unsharded core).
    pub core_shards: usize,
    /// The write-back log's own bytes and the read slots it may lend, in write-back (each
    /// `None`: what `sce format` gives it).
    pub writeback_log: crate::engine::LogSizes,
}

impl SimConfig {
    /// Checks what can be checked before reading the trace.
    pub fn check(&self) -> Result<()> {
        let a = self;
        if a.cache_size < 4096 {
            bail!(
                "invalid --cache-size {}: smaller than one 4 KiB block",
                a.cache_size
            );
        }
        if a.hosts == 0 {
            bail!("invalid --hosts 0: at least one host");
        }
        let writeback = a.policies.iter().any(|(_, k)| {
            matches!(k, PolicyKind::Engine(c) if c.write_mode == sce_core::WriteMode::WriteBack)
        });
        if writeback && a.hosts > 1 {
            bail!(
                "--mode writeback with --hosts {}: hosts sharing a volume in write-back need the \
                 coherence of issue 16 (another host's write would be overwritten by cleaning); \
                 not simulated",
                a.hosts
            );
        }
        if a.policies
            .iter()
            .any(|(_, k)| matches!(k, PolicyKind::Reference(_)))
            && a.cache_size / 4096 > BlockCache::MAX_BLOCKS as u64
        {
            bail!(
                "invalid --cache-size {}: the reference policies hold at most {} blocks of 4 KiB",
                format_size(a.cache_size),
                BlockCache::MAX_BLOCKS
            );
        }
        if !(a.interval.is_finite() && a.interval > 0.0) {
            bail!("invalid --interval {}: must be > 0 seconds", a.interval);
        }
        for (name, k) in &a.policies {
            if let PolicyKind::Engine(cfg) = k {
                let slots = a.cache_size / cfg.fragment_size.max(1);
                if slots > MAX_ENGINE_SLOTS {
                    bail!(
                        "invalid --cache-size {} for {name}: {slots} fragments of {} (the \
                         simulator takes at most {MAX_ENGINE_SLOTS}; use a larger --fragment-size)",
                        format_size(a.cache_size),
                        format_size(cfg.fragment_size)
                    );
                }
            }
        }
        Ok(())
    }
}

/// A simulation ready to run: its trace surveyed, its replay chosen, the metadata of its
/// engine policies measured.
pub struct Simulation {
    cfg: SimConfig,
    devices: (DeviceModel, DeviceModel),
    survey: Survey,
    replay: Replay,
    replay_why: String,
    metadata: Vec<Metadata>,
    threads: usize,
    progress: AtomicU64,
}

impl Simulation {
    /// Checks `cfg`, surveys the trace and measures each engine policy's metadata with
    /// `live_bytes` (the bytes the process has allocated: a counting allocator's count); with
    /// `None` (no counting allocator) engine policies report no metadata bytes. `surveyed`
    /// counts the requests of the survey as it reads them.
    pub fn prepare(
        cfg: SimConfig,
        devices: (DeviceModel, DeviceModel),
        live_bytes: Option<fn() -> usize>,
        surveyed: &std::sync::atomic::AtomicU64,
    ) -> Result<Simulation> {
        cfg.check()?;
        let survey = Survey::take(&cfg, surveyed)?;
        let (replay, replay_why) = survey.replay(cfg.replay);
        let mut metadata = Vec::new();
        for (_, k) in &cfg.policies {
            metadata.push(match (k, live_bytes) {
                (PolicyKind::Engine(core), Some(live_bytes)) => Metadata::Counted(
                    engine_metadata_bytes(core, cfg.cache_size, survey.layout.size(), live_bytes)?,
                ),
                (PolicyKind::Engine(_), None) => Metadata::Uncounted,
                // Reference caches grow with what they hold: measured at the end of the run.
                (PolicyKind::Reference(_), _) => Metadata::AtEnd,
            });
        }
        let threads = cfg
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .clamp(1, cfg.policies.len().max(1));
        Ok(Simulation {
            cfg,
            devices,
            survey,
            replay,
            replay_why,
            metadata,
            threads,
            progress: AtomicU64::new(0),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// The device models: the cache device's and the source's.
    pub fn devices(&self) -> &(DeviceModel, DeviceModel) {
        &self.devices
    }

    /// What the first pass learnt about the trace.
    pub fn survey(&self) -> &Survey {
        &self.survey
    }

    /// The replay that runs, and why (a phrase).
    pub fn replay(&self) -> (Replay, &str) {
        (self.replay, &self.replay_why)
    }

    /// Policies simulated at once.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Requests simulated so far, all policies (for a progress display).
    pub fn progress(&self) -> &AtomicU64 {
        &self.progress
    }

    /// Requests to simulate, all policies.
    pub fn total_requests(&self) -> u64 {
        self.survey.requests * self.cfg.policies.len() as u64
    }

    /// Runs every policy, [`SimConfig::threads`] at once; sets `done` when they are over (or
    /// one panicked), for a progress display to stop.
    pub fn run(&self, done: &AtomicBool) -> Result<Vec<PolicyResult>> {
        let outcomes = self.run_all(done);
        let mut results = Vec::new();
        for (i, o) in outcomes.into_iter().enumerate() {
            let name = self.cfg.policies.get(i).map_or("?", |j| j.0.as_str());
            let (r, secs) = o
                .ok_or_else(|| SimError::Failed("a policy was not simulated".into()))?
                .map_err(|e| SimError::Policy {
                    policy: name.into(),
                    source: Box::new(e),
                })?;
            let requests = self.survey.requests;
            results.push(result::result(
                name,
                &r,
                secs,
                self.metadata[i],
                &self.cfg,
                requests,
            ));
        }
        Ok(results)
    }

    /// Every policy's stack result and seconds, in the order of the policies (and an error
    /// after them if a thread panicked).
    fn run_all(&self, done: &AtomicBool) -> Vec<Option<Result<(StackResult, f64)>>> {
        let jobs = &self.cfg.policies;
        let next = AtomicUsize::new(0);
        let mut outcomes: Vec<Option<Result<(StackResult, f64)>>> =
            (0..jobs.len()).map(|_| None).collect();
        std::thread::scope(|sc| {
            let workers: Vec<_> = (0..self.threads)
                .map(|_| {
                    sc.spawn(|| {
                        let mut mine = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Relaxed);
                            let Some(job) = jobs.get(i) else { break };
                            mine.push((i, self.run_one(&job.1)));
                        }
                        mine
                    })
                })
                .collect();
            for w in workers {
                match w.join() {
                    Ok(v) => {
                        for (i, r) in v {
                            outcomes[i] = Some(r);
                        }
                    }
                    Err(_) => {
                        done.store(true, Relaxed);
                        outcomes.push(Some(Err(SimError::Failed(
                            "a simulation thread panicked".into(),
                        ))));
                    }
                }
            }
            done.store(true, Relaxed);
        });
        outcomes
    }

    /// The hosts of one policy, over the device models.
    fn build_stack(&self, kind: &PolicyKind) -> Result<Stack> {
        let a = &self.cfg;
        let devices = &self.devices;
        let mut hosts = Vec::new();
        for _ in 0..a.hosts.max(1) {
            let flash = match kind {
                PolicyKind::Reference(p) => Flash::Reference(Box::new(BlockCache::new(
                    *p,
                    (a.cache_size / 4096) as usize,
                ))),
                PolicyKind::Engine(cfg) => Flash::Engine(Box::new(EngineSim::with_shards(
                    cfg.clone(),
                    self.survey.layout.size(),
                    a.cache_size,
                    devices.0.clone(),
                    devices.1.clone(),
                    a.interval,
                    a.core_shards,
                    a.writeback_log,
                )?)),
            };
            let ram = a.ram_size.map(|s| RamCache::new(s, a.ram_policy));
            hosts.push(Host::new(flash, ram).with_devices(devices.0.clone(), devices.1.clone()));
        }
        Ok(Stack::new(hosts, a.interval)
            .with_replay(self.replay)
            .with_ownership(a.ownership))
    }

    /// Streams the trace through one policy's stack; its result and the seconds it took.
    fn run_one(&self, kind: &PolicyKind) -> Result<(StackResult, f64)> {
        let a = &self.cfg;
        let layout = &self.survey.layout;
        let t0 = Instant::now();
        let mut stack = self.build_stack(kind)?;
        let mut reader = TraceReader::open(&a.trace, a.format.clone(), a.skip_bad)?;
        let mut n = 0u64;
        while let Some(r) = reader.next_request()? {
            if a.reads_only && r.kind != IoKind::Read {
                continue;
            }
            let (host, vol) = if a.hosts > 1 {
                (r.volume as usize, 0)
            } else {
                (0, r.volume)
            };
            let Some(off) = layout.place(vol, r.offset) else {
                bail!("the trace changed between the two passes (volume {vol})");
            };
            stack.request(host, r.time_ns, r.kind, off, r.len);
            n += 1;
            if n.is_multiple_of(4096) {
                self.progress.fetch_add(4096, Relaxed);
            }
        }
        self.progress.fetch_add(n % 4096, Relaxed);
        Ok((stack.finish(), t0.elapsed().as_secs_f64()))
    }
}

/// Metadata of an engine policy's core, counted by the allocator as it is built.
fn engine_metadata_bytes(
    cfg: &CoreConfig,
    cache_size: u64,
    source_size: u64,
    live_bytes: fn() -> usize,
) -> Result<u64> {
    let before = live_bytes();
    let core = CacheCore::new(cfg.clone(), source_size, cache_size)?;
    let bytes = (live_bytes().wrapping_sub(before) as isize).max(0) as usize;
    drop(core);
    Ok(bytes as u64)
}
