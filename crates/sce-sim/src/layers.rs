//! What sits around a flash cache in a simulation (Holland et al.'s system model):
//! - [`VolumeLayout`]: the volumes of a trace are separate address spaces, laid side by side
//!   in the one source address space a cache sees;
//! - [`RamCache`]: an LRU page cache in RAM above the flash cache, with Holland's write
//!   policies towards it (synchronous, asynchronous, periodic, none);
//! - [`Stack`]: one or several hosts, each with its RAM cache and flash cache, over one
//!   shared source; a write by one host invalidates the other hosts' copies (the global-
//!   knowledge scheme of Holland's simulator), and the invalidations are counted.
//!
//! The stack also keeps the read hit ratio and the cache bytes written per interval of
//! virtual time (the warm-up curve), issues the requests as [`Replay`] says (at their trace
//! times, or in a closed loop with a fixed number in flight), and models the I/O of the
//! reference policies over the same [`DeviceModel`]s as the engine's: latencies and the
//! devices' utilization come out for every policy alike.

use crate::engine::{Device, DeviceModel, EngineResult, EngineSim, LatencyHistogram};
use crate::reference::BlockCache;
use crate::trace::{IoKind, TraceRequest};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

const PAGE: u64 = 4096;

/// Lays the volumes of a trace side by side: each volume gets its own range of the source
/// address space, `align`-aligned, in volume-number order.
#[derive(Clone, Debug)]
pub struct VolumeLayout {
    align: u64,
    ends: BTreeMap<u32, u64>,
    bases: BTreeMap<u32, u64>,
    size: u64,
}

impl VolumeLayout {
    /// An empty layout whose volumes start at multiples of `align` (a power of two).
    pub fn new(align: u64) -> Self {
        VolumeLayout {
            align: align.max(1).next_power_of_two(),
            ends: BTreeMap::new(),
            bases: BTreeMap::new(),
            size: 0,
        }
    }

    /// Notes that `volume` is addressed up to byte `end` (exclusive).
    pub fn observe(&mut self, volume: u32, end: u64) {
        let e = self.ends.entry(volume).or_insert(0);
        *e = (*e).max(end);
    }

    /// Fixes the bases once every request has been observed.
    pub fn finish(&mut self) {
        let mut base = 0u64;
        self.bases.clear();
        for (&v, &end) in &self.ends {
            self.bases.insert(v, base);
            let span = end.max(1).div_ceil(self.align).saturating_mul(self.align);
            base = base.saturating_add(span);
        }
        self.size = base.max(self.align);
    }

    /// Where byte `offset` of `volume` is in the source address space (None for a volume
    /// that was never observed).
    pub fn place(&self, volume: u32, offset: u64) -> Option<u64> {
        self.bases.get(&volume).map(|b| b.saturating_add(offset))
    }

    /// Bytes of the source address space.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Number of volumes.
    pub fn volumes(&self) -> usize {
        self.ends.len()
    }
}

/// When the RAM cache writes modified pages down to the flash cache (Holland's four).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RamPolicy {
    /// Synchronous write-through: the write goes down at once (the application waits).
    Sync,
    /// Asynchronous write-through: the write goes down at once, the application does not
    /// wait. In a trace replay, which has no application to block, the flash cache sees
    /// the same stream as with `Sync`.
    Async,
    /// Every so many nanoseconds of trace time, all modified pages go down (in address
    /// order, coalesced into runs); a modified page evicted earlier goes down then.
    Periodic(u64),
    /// Modified pages go down only when evicted (and at the end of the trace).
    None,
}

impl std::str::FromStr for RamPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "sync" => RamPolicy::Sync,
            "async" => RamPolicy::Async,
            "none" => RamPolicy::None,
            _ => match s.strip_prefix("periodic:") {
                Some(secs) => {
                    let v: f64 = secs
                        .parse()
                        .map_err(|_| format!("ram policy {s:?}: {secs:?} is not seconds"))?;
                    if !(v.is_finite() && v > 0.0) {
                        return Err(format!("ram policy {s:?}: the period must be > 0"));
                    }
                    RamPolicy::Periodic((v * 1e9) as u64)
                }
                None => {
                    return Err(format!(
                        "unknown ram policy {s:?} (sync, async, periodic:SECS or none)"
                    ))
                }
            },
        })
    }
}

/// How the requests of a trace are issued in virtual time.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Replay {
    /// Open loop: each request issues at its trace time, whatever the devices sustain (a
    /// trace faster than the models queues on them).
    #[default]
    Open,
    /// Closed loop with this many requests in flight: the trace times are ignored, and a
    /// request issues as soon as one of the requests in flight completes (the first `QD` at
    /// time zero). A read completes when its data is read (and inline fills written), a
    /// write when it is acknowledged, a request served by the RAM cache at once.
    Closed(u32),
}

impl Replay {
    /// The most requests in flight `closed:QD` takes.
    pub const MAX_QUEUE_DEPTH: u32 = 1 << 20;
}

impl std::fmt::Display for Replay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Replay::Open => write!(f, "open"),
            Replay::Closed(qd) => write!(f, "closed:{qd}"),
        }
    }
}

impl std::str::FromStr for Replay {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "open" {
            return Ok(Replay::Open);
        }
        let qd = s
            .strip_prefix("closed:")
            .ok_or_else(|| format!("unknown replay {s:?} (open or closed:QD)"))?;
        match qd.parse::<u32>() {
            Ok(n) if (1..=Self::MAX_QUEUE_DEPTH).contains(&n) => Ok(Replay::Closed(n)),
            _ => Err(format!(
                "replay {s:?}: the queue depth must be 1 to {}",
                Self::MAX_QUEUE_DEPTH
            )),
        }
    }
}

/// A flash cache as the stack sees it: a reference policy over blocks or the engine.
pub enum Flash {
    /// A reference policy.
    Reference(Box<BlockCache>),
    /// The sce-core state machine in virtual time.
    Engine(Box<EngineSim>),
}

impl Flash {
    /// Runs the engine's own work (population, completions) due by time `t`.
    fn advance(&mut self, t: u64) {
        if let Flash::Engine(e) = self {
            e.advance(t);
        }
    }

    /// Bytes written to the cache device so far: the engine's count, or one block per
    /// insertion of a reference policy.
    fn cache_bytes_written(&self) -> u64 {
        match self {
            Flash::Reference(c) => inserted(c) * PAGE,
            Flash::Engine(e) => e.cache_bytes_written(),
        }
    }

    fn invalidate(&mut self, offset: u64, len: u64) -> bool {
        match self {
            Flash::Reference(c) => {
                let mut held = false;
                if len > 0 {
                    for b in offset / PAGE..=(offset + len - 1) / PAGE {
                        held |= c.remove(b).is_some();
                    }
                }
                held
            }
            Flash::Engine(e) => e.invalidate(offset, len),
        }
    }
}

/// Blocks a reference cache has written into itself (every miss but LARC's first ones).
fn inserted(c: &BlockCache) -> u64 {
    c.inserts
}

/// The modelled I/O of a host's reference cache: the devices and the latencies seen.
#[derive(Debug)]
struct ReferenceTiming {
    ssd: Device,
    source: Device,
    read_latency: LatencyHistogram,
    write_latency: LatencyHistogram,
}

/// What one block of a reference read did.
#[derive(Copy, Clone, PartialEq, Eq)]
enum BlockRead {
    /// Read from the cache device.
    Hit,
    /// Read from the source, then written into the cache.
    Inserted,
    /// Read from the source only (the policy did not admit it).
    Missed,
}

impl ReferenceTiming {
    /// Models `n` consecutive blocks of a read issued at `t`; returns when they are done.
    fn read_run(&mut self, t: u64, kind: BlockRead, n: u64) -> u64 {
        let bytes = n * PAGE;
        match kind {
            BlockRead::Hit => self.ssd.io(t, bytes, false),
            BlockRead::Missed => self.source.io(t, bytes, false),
            BlockRead::Inserted => {
                let read = self.source.io(t, bytes, false);
                self.ssd.io(read, bytes, true)
            }
        }
    }
}

/// A host's flash layer as the layers above call it: its flash cache and, for a reference
/// policy, the modelled devices.
struct Down<'a> {
    flash: &'a mut Flash,
    timing: Option<&'a mut ReferenceTiming>,
}

impl Down<'_> {
    /// A read issued at `t`; returns (pages hit, pages, completion).
    ///
    /// With a model, a reference read completes when its hit blocks are read from the cache
    /// device and its missed blocks from the source and written into the cache (as the
    /// engine's inline fills, which an insert-on-miss cache performs before it answers).
    fn read(&mut self, t: u64, offset: u64, len: u64) -> (u64, u64, u64) {
        match &mut *self.flash {
            Flash::Reference(c) => {
                if len == 0 {
                    return (0, 0, t);
                }
                let (first, last) = (offset / PAGE, (offset + len - 1) / PAGE);
                let pages = last - first + 1;
                let m0 = c.misses;
                let Some(tm) = self.timing.as_deref_mut() else {
                    c.request(offset, len);
                    return (pages - (c.misses - m0), pages, t);
                };
                // The same accesses as `request`, block by block, in runs of one kind.
                let mut done = t;
                let mut run: Option<(BlockRead, u64)> = None;
                for b in first..=last {
                    let i0 = inserted(c);
                    let kind = if c.access(b) {
                        BlockRead::Hit
                    } else if inserted(c) > i0 {
                        BlockRead::Inserted
                    } else {
                        BlockRead::Missed
                    };
                    run = match run {
                        Some((k, n)) if k == kind => Some((k, n + 1)),
                        Some((k, n)) => {
                            done = done.max(tm.read_run(t, k, n));
                            Some((kind, 1))
                        }
                        None => Some((kind, 1)),
                    };
                }
                if let Some((k, n)) = run {
                    done = done.max(tm.read_run(t, k, n));
                }
                tm.read_latency.record(done - t);
                (pages - (c.misses - m0), pages, done)
            }
            Flash::Engine(e) => {
                let (h0, m0) = e.read_pages();
                let done = e.request(&TraceRequest {
                    time_ns: t,
                    kind: IoKind::Read,
                    volume: 0,
                    offset,
                    len,
                });
                let (h1, m1) = e.read_pages();
                (h1 - h0, (h1 - h0) + (m1 - m0), done)
            }
        }
    }

    /// A write issued at `t`; returns when it is acknowledged.
    ///
    /// With a model, a reference write goes to the source and, at the same time, its blocks
    /// to the cache device (the ones it hits are updated, the ones it inserts written); it
    /// is acknowledged when the source write completes, as AWT.
    fn write(&mut self, t: u64, offset: u64, len: u64) -> u64 {
        match &mut *self.flash {
            Flash::Reference(c) => {
                let Some(tm) = self.timing.as_deref_mut() else {
                    c.request(offset, len);
                    return t;
                };
                if len == 0 {
                    return t;
                }
                // The same accesses as `request`; the blocks the cache holds afterwards
                // (hit or inserted) are the ones written to the cache device.
                let mut copied = 0;
                for b in offset / PAGE..=(offset + len - 1) / PAGE {
                    let i0 = inserted(c);
                    if c.access(b) || inserted(c) > i0 {
                        copied += 1;
                    }
                }
                let done = tm.source.io(t, len, true);
                if copied > 0 {
                    tm.ssd.io(t, copied * PAGE, true);
                }
                tm.write_latency.record(done - t);
                done
            }
            Flash::Engine(e) => e.request(&TraceRequest {
                time_ns: t,
                kind: IoKind::Write,
                volume: 0,
                offset,
                len,
            }),
        }
    }
}

/// An LRU cache of 4 KiB pages in RAM with a write policy towards the flash cache below.
pub struct RamCache {
    pages: BlockCache,
    dirty: Vec<bool>,
    policy: RamPolicy,
    next_flush: Option<u64>,
    /// Read pages served from RAM.
    pub read_hits: u64,
    /// Pages written down to the flash cache.
    pub pages_written_down: u64,
}

impl RamCache {
    /// A RAM cache of `size` bytes (at least one page) with `policy`.
    pub fn new(size: u64, policy: RamPolicy) -> Self {
        let n = (size / PAGE).max(1) as usize;
        RamCache {
            pages: BlockCache::new(crate::ReferencePolicy::Lru, n),
            dirty: vec![false; n],
            policy,
            next_flush: None,
            read_hits: 0,
            pages_written_down: 0,
        }
    }

    /// A RAM cache with another replacement policy (LFU for the analytic model).
    pub fn with_policy(size: u64, policy: RamPolicy, repl: crate::ReferencePolicy) -> Self {
        let mut r = RamCache::new(size, policy);
        r.pages = BlockCache::new(repl, r.dirty.len());
        r
    }

    fn write_down(&mut self, down: &mut Down, t: u64, first: u64, n: u64) {
        self.pages_written_down += n;
        down.write(t, first * PAGE, n * PAGE);
    }

    /// Inserts (or touches) page `b`; a modified page it evicts goes down first.
    fn touch(&mut self, b: u64, t: u64, down: &mut Down) -> (bool, u32) {
        let a = self.pages.access_detailed(b);
        if let Some(old) = a.evicted {
            if std::mem::take(&mut self.dirty[a.slot as usize]) {
                self.write_down(down, t, old, 1);
            }
        }
        (a.hit, a.slot)
    }

    /// Runs the periodic flushes due by `t`.
    fn advance(&mut self, t: u64, down: &mut Down) {
        let RamPolicy::Periodic(p) = self.policy else {
            return;
        };
        let next = *self.next_flush.get_or_insert(t.saturating_add(p));
        if next <= t {
            self.flush(next, down);
            let periods = (t - next) / p.max(1) + 1;
            self.next_flush = Some(next.saturating_add(periods.saturating_mul(p)));
        }
    }

    /// Writes every modified page down, in address order, coalesced into runs.
    fn flush(&mut self, t: u64, down: &mut Down) {
        let mut blocks: Vec<u64> = Vec::new();
        for (b, slot) in self.pages.cached() {
            if std::mem::take(&mut self.dirty[slot as usize]) {
                blocks.push(b);
            }
        }
        blocks.sort_unstable();
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            while j < blocks.len() && blocks[j] == blocks[j - 1] + 1 {
                j += 1;
            }
            self.write_down(down, t, blocks[i], (j - i) as u64);
            i = j;
        }
    }

    /// A write at `t`; returns when the application has it acknowledged: with `Sync`, when
    /// the flash layer acknowledges it; otherwise at once (in RAM).
    fn write(&mut self, t: u64, offset: u64, len: u64, down: &mut Down) -> u64 {
        if len == 0 {
            return t;
        }
        let through = matches!(self.policy, RamPolicy::Sync | RamPolicy::Async);
        for b in offset / PAGE..=(offset + len - 1) / PAGE {
            let (_, slot) = self.touch(b, t, down);
            self.dirty[slot as usize] = !through;
        }
        if through {
            self.pages_written_down += (offset + len - 1) / PAGE - offset / PAGE + 1;
            let acked = down.write(t, offset, len);
            if self.policy == RamPolicy::Sync {
                return acked;
            }
        }
        t
    }

    fn invalidate(&mut self, offset: u64, len: u64) -> bool {
        let mut held = false;
        if len > 0 {
            for b in offset / PAGE..=(offset + len - 1) / PAGE {
                if let Some(slot) = self.pages.remove(b) {
                    self.dirty[slot as usize] = false;
                    held = true;
                }
            }
        }
        held
    }
}

/// One host: an optional RAM cache above a flash cache.
pub struct Host {
    /// The RAM cache, if any.
    pub ram: Option<RamCache>,
    /// The flash cache.
    pub flash: Flash,
    timing: Option<ReferenceTiming>,
    read_pages: u64,
    read_hits: u64,
    ram_hits: u64,
    flash_read_pages: u64,
    flash_read_hits: u64,
}

impl Host {
    /// A host with a flash cache and, optionally, a RAM cache above it. A reference flash
    /// cache does no modelled I/O (its requests complete at once) unless
    /// [`Host::with_devices`] gives it devices.
    pub fn new(flash: Flash, ram: Option<RamCache>) -> Self {
        Host {
            ram,
            flash,
            timing: None,
            read_pages: 0,
            read_hits: 0,
            ram_hits: 0,
            flash_read_pages: 0,
            flash_read_hits: 0,
        }
    }

    /// Models the I/O of a reference flash cache over these devices (an engine flash cache
    /// models its own, and is left as it is): hits are read from `ssd`, misses from
    /// `source` and then written to `ssd`, writes go to `source` and their blocks to `ssd`.
    /// Each host has its own devices, the source included, as each engine has.
    pub fn with_devices(mut self, ssd: DeviceModel, source: DeviceModel) -> Self {
        if matches!(self.flash, Flash::Reference(_)) {
            self.timing = Some(ReferenceTiming {
                ssd: Device::new(ssd),
                source: Device::new(source),
                read_latency: LatencyHistogram::new(),
                write_latency: LatencyHistogram::new(),
            });
        }
        self
    }

    /// A read at `t`; returns its completion.
    fn read(&mut self, t: u64, offset: u64, len: u64) -> u64 {
        let mut down = Down {
            flash: &mut self.flash,
            timing: self.timing.as_mut(),
        };
        match &mut self.ram {
            Some(ram) => {
                let h0 = ram.read_hits;
                let mut flash_pages = 0;
                let mut flash_hits = 0;
                let mut done = t;
                // Count what reaches the flash cache through a counting shim.
                let pages = {
                    let mut shim = |d: &mut Down, tt: u64, o: u64, l: u64| {
                        let (h, p, c) = d.read(tt, o, l);
                        flash_hits += h;
                        flash_pages += p;
                        done = done.max(c);
                    };
                    ram_read(ram, t, offset, len, &mut down, &mut shim)
                };
                let ram_hits = ram.read_hits - h0;
                self.ram_hits += ram_hits;
                self.flash_read_hits += flash_hits;
                self.flash_read_pages += flash_pages;
                self.read_pages += pages;
                self.read_hits += ram_hits + flash_hits;
                done
            }
            None => {
                let (h, p, done) = down.read(t, offset, len);
                self.read_pages += p;
                self.read_hits += h;
                self.flash_read_pages += p;
                self.flash_read_hits += h;
                done
            }
        }
    }

    /// A write at `t`; returns when it is acknowledged.
    fn write(&mut self, t: u64, offset: u64, len: u64) -> u64 {
        let mut down = Down {
            flash: &mut self.flash,
            timing: self.timing.as_mut(),
        };
        match &mut self.ram {
            Some(ram) => ram.write(t, offset, len, &mut down),
            None => down.write(t, offset, len),
        }
    }

    /// Runs the periodic RAM flushes due by `t`.
    fn advance_ram(&mut self, t: u64) {
        if let Some(ram) = &mut self.ram {
            let mut down = Down {
                flash: &mut self.flash,
                timing: self.timing.as_mut(),
            };
            ram.advance(t, &mut down);
        }
    }

    /// Writes down what the RAM cache holds modified (none with a write-through policy).
    fn flush_ram(&mut self, t: u64) {
        if let Some(ram) = &mut self.ram {
            if ram.policy != RamPolicy::Sync && ram.policy != RamPolicy::Async {
                let mut down = Down {
                    flash: &mut self.flash,
                    timing: self.timing.as_mut(),
                };
                ram.flush(t, &mut down);
            }
        }
    }

    fn invalidate(&mut self, offset: u64, len: u64) -> bool {
        let ram = self.ram.as_mut().is_some_and(|r| r.invalidate(offset, len));
        let flash = self.flash.invalidate(offset, len);
        ram || flash
    }
}

/// A RAM-cache read that reports flash reads through `to_flash` (so the host can count
/// them); returns the pages read.
fn ram_read(
    ram: &mut RamCache,
    t: u64,
    offset: u64,
    len: u64,
    down: &mut Down,
    to_flash: &mut dyn FnMut(&mut Down, u64, u64, u64),
) -> u64 {
    if len == 0 {
        return 0;
    }
    let mut pages = 0;
    let mut run: Option<(u64, u64)> = None;
    for b in offset / PAGE..=(offset + len - 1) / PAGE {
        pages += 1;
        let (hit, _) = ram.touch(b, t, down);
        if hit {
            ram.read_hits += 1;
            if let Some((first, n)) = run.take() {
                to_flash(down, t, first * PAGE, n * PAGE);
            }
        } else {
            run = match run {
                Some((first, n)) => Some((first, n + 1)),
                None => Some((b, 1)),
            };
        }
    }
    if let Some((first, n)) = run.take() {
        to_flash(down, t, first * PAGE, n * PAGE);
    }
    pages
}

/// Results of a stack over a trace.
#[derive(Clone, Debug, Default)]
pub struct StackResult {
    /// Read pages (4 KiB) requested by the application, all hosts.
    pub read_pages: u64,
    /// Read pages served from RAM or flash.
    pub read_hits: u64,
    /// Read pages served from RAM.
    pub ram_hits: u64,
    /// Read pages that reached the flash caches (RAM misses).
    pub flash_read_pages: u64,
    /// Of those, pages served from flash.
    pub flash_read_hits: u64,
    /// Pages the RAM caches wrote down to the flash caches.
    pub ram_pages_written_down: u64,
    /// Write requests.
    pub writes: u64,
    /// Writes that found a copy of their pages in another host's cache.
    pub writes_invalidating: u64,
    /// Other hosts' caches that held a copy, summed over writes.
    pub invalidations: u64,
    /// Read hit ratio per interval: (end of interval, trace seconds; ratio or NaN).
    pub intervals: Vec<(f64, f64)>,
    /// Trace seconds until the interval read hit ratio first reached 90% of its final
    /// value.
    pub warmup_seconds: Option<f64>,
    /// Engine results, one per host (engine policies only).
    pub engines: Vec<EngineResult>,
    /// Block accesses and misses summed over hosts (reference policies only).
    pub reference: Option<(u64, u64)>,
    /// Memory of the largest host's reference cache at the end, bytes.
    pub reference_bytes: u64,
    /// Cache bytes written in each interval of `intervals` (all hosts; engine: its count of
    /// cache writes issued, reference: 4 KiB per insertion).
    pub interval_cache_bytes: Vec<u64>,
    /// How the requests were issued.
    pub replay: Replay,
    /// Virtual nanoseconds the replay lasted, the span over which utilizations are taken:
    /// open loop, from the first request's trace time to the last's (the span over which the
    /// trace offers its load); closed loop, until the last request completed.
    pub duration_ns: u64,
    /// Modelled latency of every read that reached a flash cache, all hosts (engine
    /// policies, and reference policies given devices).
    pub read_latency: LatencyHistogram,
    /// Modelled latency of every write that reached a flash cache, until acknowledged.
    pub write_latency: LatencyHistogram,
    /// The most any host's source model was busy (service time per channel) over
    /// `duration_ns`; above 1, the requests offered more than the model sustains.
    pub source_utilization: f64,
    /// The same for the cache device models.
    pub cache_utilization: f64,
}

impl StackResult {
    /// Read hit ratio of the whole stack (RAM and flash), `h`.
    pub fn read_hit_ratio(&self) -> f64 {
        ratio(self.read_hits, self.read_pages)
    }
    /// Read hit ratio of the RAM layer, `h1`.
    pub fn ram_hit_ratio(&self) -> f64 {
        ratio(self.ram_hits, self.read_pages)
    }
    /// Hit ratio of the flash layer on the reads that reach it, `h2`.
    pub fn flash_hit_ratio(&self) -> f64 {
        ratio(self.flash_read_hits, self.flash_read_pages)
    }
    /// Invalidations per write (Holland's Figure 4 counts writes that invalidate).
    pub fn invalidations_per_write(&self) -> f64 {
        ratio(self.invalidations, self.writes)
    }
}

/// Busy time over a span (infinite if work was done in no time at all).
fn utilization(busy_ns: u64, span_ns: u64) -> f64 {
    match (busy_ns, span_ns) {
        (0, _) => 0.0,
        (_, 0) => f64::INFINITY,
        (b, s) => b as f64 / s as f64,
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The first interval whose ratio reaches 90% of the last interval's.
pub fn warmup(intervals: &[(f64, f64)]) -> Option<f64> {
    let last = intervals.iter().rev().find(|x| !x.1.is_nan())?.1;
    intervals
        .iter()
        .find(|(_, r)| !r.is_nan() && *r >= 0.9 * last)
        .map(|(t, _)| *t)
}

/// One or several hosts over one shared source, fed a trace.
pub struct Stack {
    hosts: Vec<Host>,
    origin: Option<u64>,
    interval_ns: u64,
    next_interval: u64,
    last: (u64, u64),
    last_bytes: u64,
    now: u64,
    replay: Replay,
    /// Closed loop: completion times of the requests in flight (virtual, from the origin).
    in_flight: BinaryHeap<Reverse<u64>>,
    /// The latest completion of a request so far (virtual, from the origin).
    last_done: u64,
    res: StackResult,
}

impl Stack {
    /// A stack of `hosts` (at least one), with intervals of `interval_secs` of virtual time,
    /// replaying open loop (see [`Stack::with_replay`]).
    pub fn new(hosts: Vec<Host>, interval_secs: f64) -> Self {
        let interval_ns = (interval_secs * 1e9).max(1.0) as u64;
        Stack {
            hosts,
            origin: None,
            interval_ns,
            next_interval: interval_ns,
            last: (0, 0),
            last_bytes: 0,
            now: 0,
            replay: Replay::Open,
            in_flight: BinaryHeap::new(),
            last_done: 0,
            res: StackResult::default(),
        }
    }

    /// Issues the requests as `replay` says (set before the first request).
    pub fn with_replay(mut self, replay: Replay) -> Self {
        self.replay = replay;
        self
    }

    fn totals(&self) -> (u64, u64) {
        self.hosts
            .iter()
            .fold((0, 0), |a, h| (a.0 + h.read_hits, a.1 + h.read_pages))
    }

    fn cache_bytes(&self) -> u64 {
        self.hosts
            .iter()
            .map(|h| h.flash.cache_bytes_written())
            .sum()
    }

    fn close_intervals(&mut self, upto: u64) {
        while self.next_interval <= upto {
            // What the engines do in the background before the boundary is this interval's.
            let b = self.origin.unwrap_or(0) + self.next_interval - 1;
            for h in &mut self.hosts {
                h.flash.advance(b);
            }
            let (h, p) = self.totals();
            let (dh, dp) = (h - self.last.0, p - self.last.1);
            self.last = (h, p);
            let bytes = self.cache_bytes();
            self.res.interval_cache_bytes.push(bytes - self.last_bytes);
            self.last_bytes = bytes;
            let r = if dp == 0 {
                f64::NAN
            } else {
                dh as f64 / dp as f64
            };
            self.res
                .intervals
                .push((self.next_interval as f64 / 1e9, r));
            self.next_interval += self.interval_ns;
        }
    }

    /// Zeroes the hit counters of every host (not the caches' contents, the warm-up curve
    /// nor the latencies): what follows is measured on warm caches, as Holland's first half
    /// of a trace warms the caches for the second.
    pub fn reset_counters(&mut self) {
        for h in &mut self.hosts {
            h.read_pages = 0;
            h.read_hits = 0;
            h.ram_hits = 0;
            h.flash_read_pages = 0;
            h.flash_read_hits = 0;
        }
        self.last = (0, 0);
    }

    /// When the next request issues, relative to the origin; sets the origin on the first.
    fn issue_time(&mut self, time_ns: u64) -> (u64, u64) {
        let start = match self.replay {
            Replay::Open => time_ns,
            // The trace's clock means nothing here: virtual time starts at zero.
            Replay::Closed(_) => 0,
        };
        let origin = *self.origin.get_or_insert_with(|| {
            for h in &mut self.hosts {
                if let Flash::Engine(e) = &mut h.flash {
                    e.set_origin(start);
                }
            }
            start
        });
        let rel = match self.replay {
            Replay::Open => time_ns.saturating_sub(origin),
            Replay::Closed(qd) => {
                if self.in_flight.len() >= qd as usize {
                    self.in_flight.pop().map_or(0, |Reverse(c)| c)
                } else {
                    0
                }
            }
        };
        (origin, rel.max(self.now))
    }

    /// Feeds one request of `host` at source byte `offset` (already placed by a
    /// [`VolumeLayout`] or shared). Requests come in trace order; `time_ns`, their trace
    /// time, is when they issue under [`Replay::Open`] and is ignored under
    /// [`Replay::Closed`].
    pub fn request(&mut self, host: usize, time_ns: u64, kind: IoKind, offset: u64, len: u64) {
        let (origin, rel) = self.issue_time(time_ns);
        self.now = rel;
        self.close_intervals(rel);
        let t = origin + rel;
        for h in &mut self.hosts {
            h.advance_ram(t);
        }
        let n = self.hosts.len();
        let Some(me) = self.hosts.get_mut(host % n.max(1)) else {
            return;
        };
        let done = match kind {
            IoKind::Read => me.read(t, offset, len),
            IoKind::Write => {
                let done = me.write(t, offset, len);
                self.res.writes += 1;
                let mut found = 0;
                for (i, h) in self.hosts.iter_mut().enumerate() {
                    if i != host % n && h.invalidate(offset, len) {
                        found += 1;
                    }
                }
                self.res.invalidations += found;
                self.res.writes_invalidating += (found > 0) as u64;
                done
            }
        };
        let done = done.saturating_sub(origin).max(rel);
        self.last_done = self.last_done.max(done);
        if let Replay::Closed(_) = self.replay {
            self.in_flight.push(Reverse(done));
        }
    }

    /// Writes down what the RAM caches still hold modified, lets in-flight I/O finish and
    /// returns the results.
    pub fn finish(mut self) -> StackResult {
        let t = self.origin.unwrap_or(0) + self.now;
        // The RAM caches' last writes belong to the last interval.
        for host in &mut self.hosts {
            host.flush_ram(t);
        }
        let (h, p) = self.totals();
        let (dh, dp) = (h - self.last.0, p - self.last.1);
        let bytes = self.cache_bytes() - self.last_bytes;
        if dp > 0 || bytes > 0 {
            let r = if dp == 0 {
                f64::NAN
            } else {
                dh as f64 / dp as f64
            };
            self.res.intervals.push((self.now as f64 / 1e9, r));
            self.res.interval_cache_bytes.push(bytes);
        }
        self.res.warmup_seconds = warmup(&self.res.intervals);
        self.res.replay = self.replay;
        self.res.duration_ns = match self.replay {
            Replay::Open => self.now,
            Replay::Closed(_) => self.last_done.max(self.now),
        };
        let (mut source_busy, mut cache_busy) = (0, 0);
        let mut reference = None;
        for host in self.hosts {
            if let Some(ram) = &host.ram {
                self.res.ram_pages_written_down += ram.pages_written_down;
            }
            self.res.read_pages += host.read_pages;
            self.res.read_hits += host.read_hits;
            self.res.ram_hits += host.ram_hits;
            self.res.flash_read_pages += host.flash_read_pages;
            self.res.flash_read_hits += host.flash_read_hits;
            match host.flash {
                Flash::Reference(c) => {
                    self.res.reference_bytes = self.res.reference_bytes.max(c.memory_bytes());
                    let (a, m) = reference.unwrap_or((0, 0));
                    reference = Some((a + c.accesses, m + c.misses));
                    if let Some(tm) = host.timing {
                        self.res.read_latency.merge(&tm.read_latency);
                        self.res.write_latency.merge(&tm.write_latency);
                        source_busy = tm.source.busy_ns().max(source_busy);
                        cache_busy = tm.ssd.busy_ns().max(cache_busy);
                    }
                }
                Flash::Engine(e) => {
                    let r = e.finish();
                    self.res.read_latency.merge(&r.read_latency);
                    self.res.write_latency.merge(&r.write_latency);
                    source_busy = r.source_busy_ns.max(source_busy);
                    cache_busy = r.cache_busy_ns.max(cache_busy);
                    self.res.engines.push(r);
                }
            }
        }
        self.res.source_utilization = utilization(source_busy, self.res.duration_ns);
        self.res.cache_utilization = utilization(cache_busy, self.res.duration_ns);
        self.res.reference = reference;
        self.res
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReferencePolicy;

    #[test]
    fn volumes_are_separate_address_spaces() {
        let mut l = VolumeLayout::new(1 << 20);
        l.observe(7, 10);
        l.observe(3, (5 << 20) + 1);
        l.observe(7, 3 << 20);
        l.finish();
        assert_eq!(l.place(3, 0), Some(0));
        assert_eq!(
            l.place(7, 0),
            Some(6 << 20),
            "volume 3 spans 6 MiB, aligned"
        );
        assert_eq!(l.place(9, 0), None);
        assert_eq!(l.size(), 9 << 20);
        assert_eq!(l.volumes(), 2);
    }

    fn lru(blocks: usize) -> Flash {
        Flash::Reference(Box::new(BlockCache::new(ReferencePolicy::Lru, blocks)))
    }

    #[test]
    fn a_write_invalidates_the_other_hosts_copies() {
        let mut s = Stack::new(vec![Host::new(lru(8), None), Host::new(lru(8), None)], 1.0);
        s.request(0, 0, IoKind::Read, 0, 8192);
        s.request(1, 1, IoKind::Read, 0, 4096);
        // Host 1 writes a block host 0 holds: one invalidation.
        s.request(1, 2, IoKind::Write, 4096, 4096);
        // Host 0 rereads: page 0 hits, page 1 was invalidated and misses.
        s.request(0, 3, IoKind::Read, 0, 8192);
        // A write to a block nobody else holds invalidates nothing.
        s.request(0, 4, IoKind::Write, 1 << 20, 4096);
        let r = s.finish();
        assert_eq!(
            (r.writes, r.writes_invalidating, r.invalidations),
            (2, 1, 1)
        );
        assert_eq!((r.read_hits, r.read_pages), (1, 5));
        assert_eq!(r.invalidations_per_write(), 0.5);
    }

    #[test]
    fn ram_policies_decide_when_writes_reach_flash() {
        for (policy, after_write, at_end) in [
            (RamPolicy::Sync, 1, 1),
            (RamPolicy::Async, 1, 1),
            (RamPolicy::None, 0, 1),
            (RamPolicy::Periodic(10_000_000_000), 0, 1),
        ] {
            let mut s = Stack::new(
                vec![Host::new(lru(64), Some(RamCache::new(4 * PAGE, policy)))],
                1.0,
            );
            s.request(0, 0, IoKind::Write, 0, 4096);
            s.request(0, 1_000, IoKind::Write, 0, 4096);
            let down = s.hosts[0].ram.as_ref().unwrap().pages_written_down;
            assert_eq!(
                down,
                after_write * 2,
                "{policy:?}: write-through sends both writes"
            );
            // The period passes: a periodic RAM cache writes the page down once.
            s.request(0, 11_000_000_000, IoKind::Read, 1 << 20, 4096);
            let r = s.finish();
            let want = if after_write == 1 { 2 } else { at_end };
            assert_eq!(r.ram_pages_written_down, want, "{policy:?}");
        }
        // A modified page evicted from RAM goes down at once.
        let mut s = Stack::new(
            vec![Host::new(
                lru(64),
                Some(RamCache::new(PAGE, RamPolicy::None)),
            )],
            1.0,
        );
        s.request(0, 0, IoKind::Write, 0, 4096);
        s.request(0, 1, IoKind::Read, 8192, 4096);
        assert_eq!(s.hosts[0].ram.as_ref().unwrap().pages_written_down, 1);
        // RAM hits are not seen by the flash layer.
        s.request(0, 2, IoKind::Read, 8192, 4096);
        let r = s.finish();
        assert_eq!((r.read_pages, r.ram_hits, r.flash_read_pages), (2, 1, 1));
        assert_eq!(r.flash_read_hits, 0);
    }

    #[test]
    fn ram_policy_parses() {
        assert_eq!(
            "periodic:30".parse(),
            Ok(RamPolicy::Periodic(30_000_000_000))
        );
        assert!("periodic:0".parse::<RamPolicy>().is_err());
        assert!("sometimes".parse::<RamPolicy>().is_err());
    }
}
