//! The engine policies in virtual time: the very `sce-core` state machine the server runs,
//! driven by a trace instead of clients and by modelled devices instead of real ones.
//!
//! Events run in time order. A trace request is planned by the core (`begin_read`,
//! `begin_write`); its I/O goes to the modelled cache device or source, whose completion
//! times come from a latency + bandwidth model with a number of parallel channels. The
//! halves of an AWT write and population jobs complete as events later. Population workers
//! wake as Algorithm 1 says (`throttle`), pick with `pick_population`, and sleep `period`.

use crate::trace::{IoKind, TraceRequest};
use sce_core::{
    CacheCore, CoreConfig, Nanos, PopId, ReadPlan, RunTarget, SourceOffset, WriteId, WriteKind,
};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A device: per-I/O latency plus transfer time, with `channels` I/Os served at once.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceModel {
    /// Latency of a read, nanoseconds.
    pub read_ns: u64,
    /// Read bandwidth, bytes per second.
    pub read_bw: u64,
    /// Latency of a write, nanoseconds.
    pub write_ns: u64,
    /// Write bandwidth, bytes per second.
    pub write_bw: u64,
    /// I/Os served at once.
    pub channels: usize,
}

impl DeviceModel {
    /// Mercury's Table I "SSD Y": random read 240 µs at 110 MB/s, random write 225 µs at
    /// 39 MB/s; 8 channels.
    pub fn mercury_ssd() -> Self {
        DeviceModel {
            read_ns: 240_000,
            read_bw: 110_000_000,
            write_ns: 225_000,
            write_bw: 39_000_000,
            channels: 8,
        }
    }
    /// A disk-backed volume: 5 ms per I/O, 100 MB/s, 4 at once.
    pub fn disk() -> Self {
        DeviceModel {
            read_ns: 5_000_000,
            read_bw: 100_000_000,
            write_ns: 5_000_000,
            write_bw: 100_000_000,
            channels: 4,
        }
    }
}

/// The state of a modelled device: when each channel is next free.
#[derive(Debug)]
struct Device {
    model: DeviceModel,
    free_at: Vec<u64>,
}

impl Device {
    fn new(model: DeviceModel) -> Self {
        let n = model.channels.max(1);
        Device {
            model,
            free_at: vec![0; n],
        }
    }
    /// Issues an I/O at `now`; returns its completion time.
    fn io(&mut self, now: u64, bytes: u64, write: bool) -> u64 {
        let (lat, bw) = if write {
            (self.model.write_ns, self.model.write_bw)
        } else {
            (self.model.read_ns, self.model.read_bw)
        };
        let service = lat + bytes.saturating_mul(1_000_000_000) / bw.max(1);
        let (i, &free) = self
            .free_at
            .iter()
            .enumerate()
            .min_by_key(|(_, t)| **t)
            .expect("channels >= 1");
        let done = free.max(now) + service;
        self.free_at[i] = done;
        done
    }
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Wake(u32),
    PopDone(PopId),
    SourceDone(WriteId),
    CacheDone(WriteId, u32),
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
    /// Fragments populated.
    pub fragments_populated: u64,
    /// Fragments evicted.
    pub fragments_evicted: u64,
}

/// Log-bucketed latency histogram: bounded memory on any trace length.
struct Histogram {
    buckets: Vec<u64>,
    sum: f64,
    n: u64,
}

impl Histogram {
    const PER_OCTAVE: f64 = 8.0;
    fn new() -> Self {
        Histogram {
            buckets: vec![0; 64 * 8 + 1],
            sum: 0.0,
            n: 0,
        }
    }
    fn add(&mut self, ns: u64) {
        let b = ((ns.max(1) as f64).log2() * Self::PER_OCTAVE) as usize;
        let last = self.buckets.len() - 1;
        self.buckets[b.min(last)] += 1;
        self.sum += ns as f64;
        self.n += 1;
    }
    fn quantile(&self, q: f64) -> f64 {
        let target = (self.n as f64 * q).ceil() as u64;
        let mut seen = 0;
        for (i, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= target && c > 0 {
                return 2f64.powf((i as f64 + 1.0) / Self::PER_OCTAVE) / 1e9;
            }
        }
        0.0
    }
}

/// Simulates `cfg` with a cache of `cache_size` bytes over a source of `source_size` bytes.
pub struct EngineSim {
    core: CacheCore,
    ssd: Device,
    source: Device,
    events: BinaryHeap<Reverse<Due>>,
    seq: u64,
    plan: ReadPlan,
    lat: Histogram,
    res: EngineResult,
    interval_ns: u64,
    next_interval: u64,
    last_pages: (u64, u64),
    origin: Option<u64>,
    now: u64,
    workers: u32,
}

impl EngineSim {
    /// A simulation; errors name the config field at fault.
    pub fn new(
        cfg: CoreConfig,
        source_size: u64,
        cache_size: u64,
        ssd: DeviceModel,
        source: DeviceModel,
        interval_secs: f64,
    ) -> Result<Self, sce_core::ConfigError> {
        let workers = cfg.throttle.max_workers;
        let uses_workers = cfg.admission != sce_core::Admission::Always;
        let core = CacheCore::new(cfg, source_size, cache_size)?;
        let interval_ns = (interval_secs * 1e9).max(1.0) as u64;
        let mut s = EngineSim {
            core,
            ssd: Device::new(ssd),
            source: Device::new(source),
            events: BinaryHeap::new(),
            seq: 0,
            plan: ReadPlan::new(),
            lat: Histogram::new(),
            res: EngineResult::default(),
            interval_ns,
            next_interval: interval_ns,
            last_pages: (0, 0),
            origin: None,
            now: 0,
            workers: if uses_workers { workers } else { 0 },
        };
        for w in 0..s.workers {
            s.push(0, Event::Wake(w));
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
            let st = self.core.stats();
            let (h, m) = (
                st.read_pages_hit - self.last_pages.0,
                st.read_pages_missed - self.last_pages.1,
            );
            self.last_pages = (st.read_pages_hit, st.read_pages_missed);
            let ratio = if h + m == 0 {
                f64::NAN
            } else {
                h as f64 / (h + m) as f64
            };
            self.res
                .intervals
                .push((self.next_interval as f64 / 1e9, ratio));
            self.next_interval += self.interval_ns;
        }
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
            let (et, e) = (d.t, d.e);
            self.events.pop();
            self.now = et;
            if intervals {
                self.close_intervals(et);
            }
            match e {
                Event::Wake(w) => {
                    let st = self.core.throttle(Nanos(et));
                    let mut next = et + st.period.as_nanos() as u64;
                    if w < st.active_workers {
                        if let Some(job) = self.core.pick_population(Nanos(et)) {
                            let read_done = self.source.io(et, job.len, false);
                            self.res.source_bytes_read += job.len;
                            let mut done = read_done;
                            for &(_, l, _) in &job.runs {
                                done = self.ssd.io(read_done, l, true);
                                self.res.cache_bytes_written += l;
                            }
                            self.push(done, Event::PopDone(job.id));
                            next = done + st.period.as_nanos() as u64;
                        }
                    }
                    self.push(next, Event::Wake(w));
                }
                Event::PopDone(id) => {
                    let _ = self.core.complete_population(id, true);
                }
                Event::SourceDone(id) => {
                    let _ = self.core.write_source_done(id, true);
                }
                Event::CacheDone(id, part) => {
                    let _ = self.core.write_cache_done(id, part, true);
                }
            }
        }
        if intervals {
            self.now = self.now.max(t);
            self.close_intervals(t);
        }
    }

    /// Sets the trace time that is time zero of the simulation, if no request has set it yet
    /// (by default the first request's time). Hosts of a shared trace use one origin.
    pub fn set_origin(&mut self, t: u64) {
        self.origin.get_or_insert(t);
    }

    /// Read pages hit and missed so far.
    pub fn read_pages(&self) -> (u64, u64) {
        let st = self.core.stats();
        (st.read_pages_hit, st.read_pages_missed)
    }

    /// The core's configuration.
    pub fn config(&self) -> &CoreConfig {
        self.core.config()
    }

    /// Another host wrote `[offset, offset+len)` of the shared source: drops this cache's
    /// copies of those pages (and spoils population in flight over them, as a local write
    /// would), without writing anything. Returns true if a valid page was dropped.
    pub fn invalidate(&mut self, offset: u64, len: u64) -> bool {
        let size = self.core.geometry().source_size();
        let (off, end) = (offset.min(size), offset.saturating_add(len).min(size));
        if end <= off {
            return false;
        }
        let geo = *self.core.geometry();
        let mut held = false;
        let mut mapped = false;
        let mut f = geo.fragment_of(SourceOffset(off));
        while geo.fragment_start(f).0 < end {
            if self.core.exists(f).is_some() {
                mapped = true;
                let lo = geo.fragment_start(f).0.max(off);
                let hi = (geo.fragment_start(f).0 + geo.fragment_len(f)).min(end);
                let mut p = lo & !4095;
                while p < hi && !held {
                    held = self.core.is_cached(SourceOffset(p));
                    p += 4096;
                }
            }
            f = sce_core::FragNo(f.0 + 1);
        }
        if mapped {
            let (o, l) = (off / 512 * 512, end.div_ceil(512) * 512 - off / 512 * 512);
            if let Ok(plan) =
                self.core
                    .begin_write(SourceOffset(o), l.min(size - o), WriteKind::Discard)
            {
                let _ = self.core.write_source_done(plan.id, true);
            }
        }
        held
    }

    /// Feeds one trace request. Requests must come in time order (a request earlier than
    /// the previous one is taken as happening at the same time).
    pub fn request(&mut self, r: &TraceRequest) {
        let origin = *self.origin.get_or_insert(r.time_ns);
        let t = r.time_ns.saturating_sub(origin).max(self.now);
        self.run_until(t);
        let size = self.core.geometry().source_size();
        // Clip to the volume and round to sectors, as a block layer would have.
        let off = (r.offset / 512 * 512).min(size);
        let end = (r.offset + r.len)
            .div_ceil(512)
            .saturating_mul(512)
            .min(size);
        if end <= off {
            return;
        }
        let len = end - off;
        self.res.requests += 1;
        match r.kind {
            IoKind::Read => {
                if self
                    .core
                    .begin_read(SourceOffset(off), len, &mut self.plan)
                    .is_err()
                {
                    return;
                }
                let mut done = t;
                let mut source_done = t;
                for run in &self.plan.runs {
                    let d = match run.target {
                        RunTarget::Cache(_) => self.ssd.io(t, run.len, false),
                        RunTarget::Source(_) => {
                            self.res.source_bytes_read += run.len;
                            let d = self.source.io(t, run.len, false);
                            source_done = source_done.max(d);
                            d
                        }
                    };
                    done = done.max(d);
                }
                // Inline fills (admission `always`) are written before the read completes.
                for f in &self.plan.fills {
                    done = done.max(self.ssd.io(source_done, f.len, true));
                    self.res.cache_bytes_written += f.len;
                }
                for &p in &self.plan.pops.clone() {
                    let _ = self.core.complete_population(p, true);
                }
                self.core.end_read(&mut self.plan);
                self.lat.add(done - t);
            }
            IoKind::Write => {
                let Ok(plan) = self
                    .core
                    .begin_write(SourceOffset(off), len, WriteKind::Data)
                else {
                    return;
                };
                let sdone = self.source.io(t, len, true);
                self.res.source_bytes_written += len;
                self.push(sdone, Event::SourceDone(plan.id));
                for w in &plan.cache_writes {
                    let cdone = self.ssd.io(t, w.len, true);
                    self.res.cache_bytes_written += w.len;
                    self.push(cdone, Event::CacheDone(plan.id, w.part));
                }
            }
        }
    }

    /// Runs what is left in flight and returns the results.
    pub fn finish(mut self) -> EngineResult {
        // Let in-flight I/O complete, but do not keep the workers populating forever.
        let end = self.now;
        let pending: Vec<_> = self
            .events
            .drain()
            .filter(|Reverse(d)| !matches!(d.e, Event::Wake(_)))
            .collect();
        self.events.extend(pending);
        self.run_events(u64::MAX, false);
        self.now = end;
        let st = self.core.stats().clone();
        let total = st.read_pages_hit + st.read_pages_missed;
        self.res.read_hit_ratio = if total == 0 {
            0.0
        } else {
            st.read_pages_hit as f64 / total as f64
        };
        // Drop the intervals closed after the end of the trace, keep the partial last one.
        self.res
            .intervals
            .retain(|(t, _)| *t * 1e9 <= end as f64 + self.interval_ns as f64);
        let (h, m) = (
            st.read_pages_hit - self.last_pages.0,
            st.read_pages_missed - self.last_pages.1,
        );
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
        self.res.mean_read_latency = if self.lat.n == 0 {
            0.0
        } else {
            self.lat.sum / self.lat.n as f64 / 1e9
        };
        self.res.p99_read_latency = self.lat.quantile(0.99);
        self.res.fragments_populated = st.populations_completed;
        self.res.fragments_evicted = st.fragments_evicted;
        self.res
    }
}
