//! The engine policies in virtual time: the very `sce-core` state machine the server runs,
//! driven by a trace instead of clients and by modelled devices instead of real ones. The
//! core is cut into shards as the server cuts it (`sce_core::ShardedCore`, its `core_shards`
//! rule): each population worker visits the shards in turn, and the cleaner asks them in
//! turn.
//!
//! Events run in time order. A trace request is planned by the core (`begin_read`,
//! `begin_write`); its I/O goes to the modelled cache device or source, whose completion
//! times come from a latency + bandwidth model with a number of parallel channels. The
//! halves of an AWT write and population jobs complete as events later. Population workers
//! wake as Algorithm 1 says (`throttle`), pick with `pick_population`, and sleep `period`
//! (`after_pick` after a pick).
//!
//! Every request gets a modelled latency: a read until its runs (and inline fills) are
//! done, a write until it is acknowledged (AWT and write-around: the source write done;
//! synchronous write-through: the source write and every cache copy done). Each device
//! counts its busy time, from which a driver computes its utilization over the trace.

use crate::trace::{IoKind, TraceRequest};
use sce_core::{
    CacheCopy, CoreConfig, Nanos, OnShard, Populating, ShardedCore, SourceWrite, WriteMode,
    PAGE_SIZE,
};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

mod device;
mod passthrough;
mod requests;
#[cfg(test)]
mod tests;
mod writeback;

pub(crate) use device::Device;
pub use device::{DeviceModel, LatencyHistogram};
pub use writeback::WritebackResult;

/// The write-back log's sizes, as `sce format` takes them (`None`: its `auto`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogSizes {
    /// Bytes of the cache that are the log's own region (`--writeback-log`; auto:
    /// `sce_store::wblog::auto_log_bytes`).
    pub log: Option<u64>,
    /// Bytes of read slots it may lend as dirty data outgrows it (`--writeback-grow`;
    /// auto: `sce_store::wblog::auto_lend_bytes`, up to half the cache in all).
    pub grow: Option<u64>,
}

/// An event; the completions carry the core's completion tokens (`sce_core::WriteTxn`),
/// each with its core shard.
#[derive(Debug)]
enum Event {
    Wake(u32),
    PopDone(OnShard<Populating>),
    SourceDone(OnShard<SourceWrite>),
    CacheDone(OnShard<CacheCopy>),
    /// The write-back log's cleaner looks at the log, and commits.
    CleanWake,
    /// A run of the cleaning batch is on the source.
    RunCleaned,
    /// A write-back write's log append is on the device: (first global page, log
    /// position, pages).
    Appended(u64, u64, u64),
}

/// An event due at `t`; ties run in the order they were scheduled (`seq`).
#[derive(Debug)]
struct Due {
    t: u64,
    seq: u64,
    e: Event,
}

impl PartialEq for Due {
    fn eq(&self, o: &Self) -> bool {
        (self.t, self.seq) == (o.t, o.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Due {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.t, self.seq).cmp(&(o.t, o.seq))
    }
}

/// Results of one engine policy on one trace.
#[derive(Debug, Clone, Default)]
pub struct EngineResult {
    /// Read pages served from the cache over all read pages.
    pub read_hit_ratio: f64,
    /// Read hit ratio per interval: (end of interval in seconds, ratio).
    pub intervals: Vec<(f64, f64)>,
    /// Trace seconds until the interval hit ratio first reached 90% of its final value.
    pub warmup_seconds: Option<f64>,
    /// Bytes written to the cache device (population, inline fills, AWT copies).
    pub cache_bytes_written: u64,
    /// Bytes read from the source.
    pub source_bytes_read: u64,
    /// Bytes written to the source.
    pub source_bytes_written: u64,
    /// Requests simulated.
    pub requests: u64,
    /// Modelled mean read latency, seconds.
    pub mean_read_latency: f64,
    /// Modelled 99th percentile read latency, seconds (bucketed, within 9%).
    pub p99_read_latency: f64,
    /// Modelled mean write latency, seconds: until the write is acknowledged (AWT and
    /// write-around: the source write done; synchronous write-through: the source write and
    /// every cache copy done).
    pub mean_write_latency: f64,
    /// Modelled 99th percentile write latency, seconds (bucketed, within 9%).
    pub p99_write_latency: f64,
    /// Every modelled read latency.
    pub read_latency: LatencyHistogram,
    /// Every modelled write latency.
    pub write_latency: LatencyHistogram,
    /// Busy time of the source model per channel (summed service times over channels), ns.
    pub source_busy_ns: u64,
    /// Busy time of the cache device model per channel, ns.
    pub cache_busy_ns: u64,
    /// Fragments populated.
    pub fragments_populated: u64,
    /// Population wake-ups that found the source busy and left it to the clients.
    pub population_source_busy: u64,
    /// Read misses whose own data filled the cache (admission `sce`).
    pub miss_fills: u64,
    /// Fragments evicted.
    pub fragments_evicted: u64,
    /// Write-back: bytes the cleaner wrote to the source.
    pub bytes_written_back: u64,
    /// Write-back: dirty bytes left in the log at the end.
    pub dirty_bytes_at_end: u64,
    /// Write-back: share of the log in use, per interval: (end of interval in seconds,
    /// share).
    pub dirty_intervals: Vec<(f64, f64)>,
    /// Write-back: times a write waited for room in the log.
    pub writeback_waits: u64,
    /// Write-back: the log's size, the cleaner's source writes, batches, commits, reads
    /// served from the log.
    pub writeback: Option<WritebackResult>,
    /// Bytes read from the cache device by cleaning.
    pub cache_bytes_read: u64,
}

/// Simulates `cfg` with a cache of `cache_size` bytes over a source of `source_size` bytes.
pub struct EngineSim {
    /// The core, cut into shards as the server cuts it.
    core: ShardedCore,
    ssd: Device,
    source: Device,
    events: BinaryHeap<Reverse<Due>>,
    seq: u64,
    /// Per population worker: the core shard it visits next (one per wake-up, in turn, as
    /// the server's workers do).
    turns: Vec<usize>,
    lat: LatencyHistogram,
    wlat: LatencyHistogram,
    res: EngineResult,
    interval_ns: u64,
    next_interval: u64,
    last_pages: (u64, u64),
    origin: Option<u64>,
    now: u64,
    workers: u32,
    /// The write-back log (write-back mode) and its counters.
    log: Option<writeback::LogSim>,
    wb: WritebackResult,
    /// The configuration as given (the core's shards run write-back in write-through).
    cfg: CoreConfig,
    /// When the last request came (write-back's idle rule).
    last_request: u64,
}

impl EngineSim {
    /// A simulation with the server's automatic core shards (`core_shards` 0, see
    /// [`EngineSim::with_shards`]); errors name the config field at fault.
    pub fn new(
        cfg: CoreConfig,
        source_size: u64,
        cache_size: u64,
        ssd: DeviceModel,
        source: DeviceModel,
        interval_secs: f64,
    ) -> Result<Self, sce_core::ConfigError> {
        Self::with_shards(
            cfg,
            source_size,
            cache_size,
            ssd,
            source,
            interval_secs,
            0,
            LogSizes::default(),
        )
    }

    /// A simulation whose core is cut into `core_shards` shards as the server's
    /// `core_shards` setting would cut it (0: the server's automatic choice,
    /// `sce_core::shards_for`; 1: one unsharded core). In write-back, `writeback_log` says
    /// how many bytes of the cache are the write-back log and how much of the read slots it
    /// may lend, as a format of the device would.
    #[allow(clippy::too_many_arguments)]
    pub fn with_shards(
        cfg: CoreConfig,
        source_size: u64,
        cache_size: u64,
        ssd: DeviceModel,
        source: DeviceModel,
        interval_secs: f64,
        core_shards: usize,
        writeback_log: LogSizes,
    ) -> Result<Self, sce_core::ConfigError> {
        let workers = cfg.throttle.max_workers;
        let uses_workers = cfg.admission != sce_core::Admission::Always;
        let log_bytes = (cfg.write_mode == WriteMode::WriteBack).then(|| {
            (writeback_log.log)
                .unwrap_or_else(|| sce_store::wblog::auto_log_bytes(cache_size))
                .max(128 * 4096)
                .min(cache_size / 2)
                / PAGE_SIZE
                * PAGE_SIZE
        });
        let shard_cfg = CoreConfig {
            write_mode: if log_bytes.is_some() {
                WriteMode::WriteThrough
            } else {
                cfg.write_mode
            },
            ..cfg.clone()
        };
        let read_slots = cache_size - log_bytes.unwrap_or(0);
        let core = ShardedCore::new(shard_cfg, source_size, read_slots, core_shards)?;
        // The log, and the chunks of read slots it may lend, as a format lays them out.
        let log = log_bytes.map(|bytes| {
            let grow = (writeback_log.grow)
                .unwrap_or_else(|| sce_store::wblog::auto_lend_bytes(cache_size, bytes));
            let slots = core.geometry().slots() as u64;
            let lend = sce_store::wblog::Lend::laid_out(grow, 0, slots, cfg.fragment_size);
            writeback::LogSim::new(bytes, lend, cfg.writeback)
        });
        let log_bytes = log.as_ref().map_or(0, |l| l.bytes());
        let interval_ns = (interval_secs * 1e9).max(1.0) as u64;
        let workers = if uses_workers { workers } else { 0 };
        let mut s = EngineSim {
            turns: (0..workers as usize).map(|w| w % core.shards()).collect(),
            core,
            ssd: Device::new(ssd),
            source: Device::new(source),
            events: BinaryHeap::new(),
            seq: 0,
            lat: LatencyHistogram::new(),
            wlat: LatencyHistogram::new(),
            res: EngineResult::default(),
            interval_ns,
            next_interval: interval_ns,
            last_pages: (0, 0),
            origin: None,
            now: 0,
            workers,
            wb: WritebackResult {
                log_bytes,
                log_max_bytes: log.as_ref().map_or(0, |l| l.max_bytes()),
                ..Default::default()
            },
            log,
            cfg,
            last_request: 0,
        };
        for w in 0..s.workers {
            s.push(0, Event::Wake(w));
        }
        if s.log.is_some() {
            s.push(0, Event::CleanWake);
        }
        Ok(s)
    }

    fn push(&mut self, t: u64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse(Due {
            t,
            seq: self.seq,
            e,
        }));
    }

    fn close_intervals(&mut self, upto: u64) {
        while self.next_interval <= upto {
            let (hit, missed) = self.read_pages();
            let (h, m) = (hit - self.last_pages.0, missed - self.last_pages.1);
            self.last_pages = (hit, missed);
            let ratio = if h + m == 0 {
                f64::NAN
            } else {
                h as f64 / (h + m) as f64
            };
            self.res
                .intervals
                .push((self.next_interval as f64 / 1e9, ratio));
            if self.log.is_some() {
                let share = self.dirty_share();
                self.res
                    .dirty_intervals
                    .push((self.next_interval as f64 / 1e9, share));
            }
            self.next_interval += self.interval_ns;
        }
    }

    /// When the next event is due, if any (the cleaner's wake-ups aside).
    fn next_event_time(&self) -> Option<u64> {
        self.events
            .iter()
            .filter(|Reverse(d)| !matches!(d.e, Event::Wake(_) | Event::CleanWake))
            .map(|Reverse(d)| d.t)
            .min()
    }

    /// Runs every event due up to `t`, closing the warm-up intervals it passes.
    fn run_until(&mut self, t: u64) {
        self.run_events(t, true);
    }

    fn run_events(&mut self, t: u64, intervals: bool) {
        while let Some(Reverse(d)) = self.events.peek() {
            if d.t > t {
                break;
            }
            let et = d.t;
            let Some(Reverse(Due { e, .. })) = self.events.pop() else {
                break;
            };
            self.now = et;
            if intervals {
                self.close_intervals(et);
            }
            match e {
                Event::Wake(w) => {
                    let k = self.turns[w as usize];
                    self.turns[w as usize] = (k + 1) % self.core.shards();
                    let st = self.core.throttle(k, Nanos(et));
                    let mut next = et + st.period.as_nanos() as u64;
                    // With miss fills, background population (which re-reads the source) is
                    // spent only while the source has room (a read issued now would not
                    // queue behind more than one request's worth of work): a saturated
                    // source serves its clients, and the cache fills from their misses.
                    let room = !self.core.config().fills_from_misses()
                        || self.source.backlog_ns(et) <= self.source.read_service_ns(64 << 10);
                    self.core.set_source_busy(k, !room);
                    if !room && w < st.active_workers {
                        self.res.population_source_busy += 1;
                    }
                    if w < st.active_workers && room {
                        if let Some(job) = self.core.pick_population(k, Nanos(et)) {
                            let done = self.population_io(et, job.len, &job.runs);
                            self.push(done, Event::PopDone(job.into_token()));
                            next = done + st.after_pick.as_nanos() as u64;
                        }
                    }
                    self.push(next, Event::Wake(w));
                }
                Event::PopDone(pop) => pop.complete(&mut self.core, true),
                Event::SourceDone(source) => source.done(&mut self.core, true),
                Event::CacheDone(copy) => copy.done(&mut self.core, true),
                Event::CleanWake => {
                    self.commit_duties(et);
                    self.clean(et, false);
                    if intervals {
                        self.push(et + writeback::CLEAN_PERIOD, Event::CleanWake);
                    }
                }
                Event::Appended(g, lpos, n) => self.appended(g, lpos, n, et),
                Event::RunCleaned => {
                    self.run_cleaned(et);
                    // After the trace (`finish`), what is in flight completes; nothing new.
                    if intervals {
                        self.clean(et, false);
                    }
                }
            }
        }
        if intervals {
            self.now = self.now.max(t);
            self.close_intervals(t);
        }
    }

    /// Runs what the simulation has due up to trace time `t` (population workers, completions)
    /// without a request: a driver that samples [`Self::cache_bytes_written`] at a time calls
    /// this first. Does nothing before the origin is set.
    pub fn advance(&mut self, t: u64) {
        if let Some(origin) = self.origin {
            self.run_until(t.saturating_sub(origin));
        }
    }

    /// Bytes written to the cache device so far (counted when each write is issued).
    pub fn cache_bytes_written(&self) -> u64 {
        self.res.cache_bytes_written
    }

    /// Sets the trace time that is time zero of the simulation, if no request has set it yet
    /// (by default the first request's time). Hosts of a shared trace use one origin.
    pub fn set_origin(&mut self, t: u64) {
        self.origin.get_or_insert(t);
    }

    /// Read pages hit (the log's among them) and missed so far.
    pub fn read_pages(&self) -> (u64, u64) {
        (
            self.core.stat(|s| s.read_pages_hit) + self.wb.log_read_pages,
            self.core.stat(|s| s.read_pages_missed),
        )
    }

    /// The core shards simulated.
    pub fn core_shards(&self) -> usize {
        self.core.shards()
    }

    /// The configuration simulated.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// Feeds one trace request, issued at `r.time_ns`. Requests must come in time order (a
    /// request earlier than the previous one is taken as happening at the same time).
    ///
    /// Returns the request's modelled completion, in the clock of `r.time_ns`: a read
    /// completes when its runs (and inline fills) are done; a write when it is acknowledged
    /// (AWT and write-around: the source write done; synchronous write-through: the source
    /// write and every cache copy done). A request outside the volume completes at once.
    pub fn request(&mut self, r: &TraceRequest) -> u64 {
        let origin = *self.origin.get_or_insert(r.time_ns);
        let t = r.time_ns.saturating_sub(origin).max(self.now);
        self.run_until(t);
        origin + self.issue(r, t)
    }

    /// Plans and models request `r` at simulation time `t`; returns its completion time.
    fn issue(&mut self, r: &TraceRequest, t: u64) -> u64 {
        self.core.advance_clock(Nanos(t));
        let size = self.core.geometry().source_size();
        // Clip to the volume and round to sectors, as a block layer would have.
        let unit = if self.core.config().widen_to_pages {
            4096
        } else {
            512
        };
        let off = (r.offset / unit * unit).min(size);
        let end = (r.offset + r.len)
            .div_ceil(unit)
            .saturating_mul(unit)
            .min(size);
        if end <= off {
            return t;
        }
        let len = end - off;
        self.res.requests += 1;
        self.last_request = t;
        match r.kind {
            IoKind::Read => {
                let done = if self.log.is_some() {
                    self.read_through_log(t, off, len)
                } else {
                    self.read(t, off, len)
                };
                self.lat.record(done - t);
                done
            }
            IoKind::Write if self.log.is_some() => self.write_back(t, off, len),
            IoKind::Write => self.write_through(t, off, len),
        }
    }

    /// Runs what is left in flight and returns the results.
    pub fn finish(mut self) -> EngineResult {
        // Let in-flight I/O complete, but do not keep the workers populating forever.
        let end = self.now;
        let pending: Vec<_> = self
            .events
            .drain()
            .filter(|Reverse(d)| !matches!(d.e, Event::Wake(_) | Event::CleanWake))
            .collect();
        self.events.extend(pending);
        self.run_events(u64::MAX, false);
        self.now = end;
        let (hit, missed) = self.read_pages();
        let total = hit + missed;
        self.res.read_hit_ratio = if total == 0 {
            0.0
        } else {
            hit as f64 / total as f64
        };
        // Drop the intervals closed after the end of the trace, keep the partial last one.
        self.res
            .intervals
            .retain(|(t, _)| *t * 1e9 <= end as f64 + self.interval_ns as f64);
        let (h, m) = (hit - self.last_pages.0, missed - self.last_pages.1);
        if h + m > 0 {
            self.res
                .intervals
                .push(((end as f64 / 1e9).max(0.0), h as f64 / (h + m) as f64));
        }
        let finals: Vec<f64> = self
            .res
            .intervals
            .iter()
            .map(|x| x.1)
            .filter(|x| !x.is_nan())
            .collect();
        if let Some(&last) = finals.last() {
            self.res.warmup_seconds = self
                .res
                .intervals
                .iter()
                .find(|(_, r)| !r.is_nan() && *r >= 0.9 * last)
                .map(|(t, _)| *t);
        }
        self.res.mean_read_latency = self.lat.mean();
        self.res.p99_read_latency = self.lat.quantile(0.99);
        self.res.mean_write_latency = self.wlat.mean();
        self.res.p99_write_latency = self.wlat.quantile(0.99);
        self.res.read_latency = std::mem::take(&mut self.lat);
        self.res.write_latency = std::mem::take(&mut self.wlat);
        self.res.source_busy_ns = self.source.busy_ns();
        self.res.cache_busy_ns = self.ssd.busy_ns();
        self.res.fragments_populated = self.core.stat(|s| s.populations_completed);
        self.res.miss_fills = self.core.stat(|s| s.miss_fills);
        self.res.fragments_evicted = self.core.stat(|s| s.fragments_evicted);
        if let Some(l) = &self.log {
            self.res.dirty_bytes_at_end = l.dirty_pages() * 4096;
            self.res.writeback = Some(std::mem::take(&mut self.wb));
        }
        std::mem::take(&mut self.res)
    }
}

impl Drop for EngineSim {
    /// A simulation dropped before `finish` (or with events left) completes what is in
    /// flight as failed, so that no completion token is dropped uncompleted.
    fn drop(&mut self) {
        for Reverse(d) in std::mem::take(&mut self.events).into_vec() {
            match d.e {
                Event::Wake(_) | Event::CleanWake | Event::RunCleaned | Event::Appended(..) => {}
                Event::PopDone(pop) => pop.complete(&mut self.core, false),
                Event::SourceDone(source) => source.done(&mut self.core, false),
                Event::CacheDone(copy) => copy.done(&mut self.core, false),
            }
        }
    }
}
