//! Several hosts over one source, in virtual time, and what they add up to.

use super::flash::Flash;
use super::host::Host;
use super::ownership::{Owners, Ownership};
use super::Replay;
use crate::engine::{EngineResult, LatencyHistogram};
use crate::request::IoKind;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

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
    /// Writes that made another host's cache drop a copy it held: of the written range
    /// (a contended write), or of the region the write acquired.
    pub writes_invalidating: u64,
    /// Other hosts' caches that held a copy of what a write made them drop, summed over
    /// writes (over the drops of a write that both acquires and contends).
    pub invalidations: u64,
    /// Writes by the owner of every region they touch (after acquiring the free ones): no
    /// etcd operation. Without ownership, none.
    pub owned_writes: u64,
    /// Published writes: to a region another host owns or that the writer counts as
    /// contended, and every write without ownership; one publication and one
    /// acknowledgement per other host each (today's per-write rule).
    pub contended_writes: u64,
    /// Regions acquired by a write: one etcd transaction and one acknowledgement per other
    /// host each.
    pub region_acquisitions: u64,
    /// Regions released by their owner, after the idle time or on hearing another host's
    /// write there: one etcd delete and (counted to be conservative) one acknowledgement
    /// per other host each.
    pub region_releases: u64,
    /// Of `region_releases`, those on hearing another host's write (contention).
    pub contention_releases: u64,
    /// Publications of contended writes (etcd puts).
    pub publications: u64,
    /// Acknowledgement puts by the other hosts, of publications, acquisitions and releases.
    pub acknowledgements: u64,
    /// Other hosts' caches that held part of a region when it was released, summed over
    /// releases.
    pub release_invalidations: u64,
    /// Read pages served from the source past the caches because another host owned their
    /// region (part of `read_pages`, never hits).
    pub read_pages_bypassed: u64,
    /// Read hit ratio per interval: (end of interval, trace seconds; ratio or NaN).
    pub intervals: Vec<(f64, f64)>,
    /// Trace seconds until the interval read hit ratio first reached 90% of its final
    /// value.
    pub warmup_seconds: Option<f64>,
    /// Engine results, one per host (engine policies only).
    pub engines: Vec<EngineResult>,
    /// Block accesses and misses summed over hosts (reference policies only).
    pub reference: Option<(u64, u64)>,
    /// Blocks reference caches rewrote for write hits, summed over hosts.
    pub reference_updates: u64,
    /// Memory of the largest host's reference cache at the end, bytes.
    pub reference_bytes: u64,
    /// Cache bytes written in each interval of `intervals` (all hosts; engine: its count of
    /// cache writes issued, reference: 4 KiB per insertion and per write hit).
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
    /// Modelled latency of every read as the application sees it, RAM cache included (a
    /// RAM hit costs nothing), all hosts.
    pub app_read_latency: LatencyHistogram,
    /// The same for writes, until the RAM cache's policy acknowledges them.
    pub app_write_latency: LatencyHistogram,
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
    /// etcd operations of shared mode: publications, acknowledgements, acquisitions
    /// (transactions) and releases (deletes).
    pub fn coherence_ops(&self) -> u64 {
        self.publications + self.acknowledgements + self.region_acquisitions + self.region_releases
    }
    /// etcd operations per write.
    pub fn coherence_ops_per_write(&self) -> f64 {
        ratio(self.coherence_ops(), self.writes)
    }
    /// etcd puts per write: every operation but the releases' deletes (an acquisition's
    /// transaction puts the owner key). Without ownership, the hosts' number.
    pub fn coherence_puts_per_write(&self) -> f64 {
        ratio(self.coherence_ops() - self.region_releases, self.writes)
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
    pub(super) hosts: Vec<Host>,
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
    /// Ownership of regions (shared mode, issue 31); None: every write is published.
    pub(super) owners: Option<Owners>,
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
            owners: None,
            res: StackResult::default(),
        }
    }

    /// Issues the requests as `replay` says (set before the first request).
    pub fn with_replay(mut self, replay: Replay) -> Self {
        self.replay = replay;
        self
    }

    /// Runs shared mode's ownership of regions (see [`Ownership`]) instead of publishing
    /// every write (`None`, the default: today's per-write rule, each write contended).
    /// Set before the first request.
    pub fn with_ownership(mut self, rule: Option<Ownership>) -> Self {
        self.owners = rule.map(|r| Owners::new(r, self.hosts.len()));
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
            h.read_pages_bypassed = 0;
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
    /// [`VolumeLayout`](super::VolumeLayout) or shared). Requests come in trace order; `time_ns`, their trace
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
        if n == 0 {
            return;
        }
        let me = host % n;
        self.release_idle(t);
        let done = match kind {
            IoKind::Read => self.read(me, t, offset, len),
            IoKind::Write => self.write(me, t, offset, len),
        };
        let done = done.saturating_sub(origin).max(rel);
        match kind {
            IoKind::Read => self.res.app_read_latency.record(done - rel),
            IoKind::Write => self.res.app_write_latency.record(done - rel),
        }
        self.last_done = self.last_done.max(done);
        if let Replay::Closed(_) = self.replay {
            self.in_flight.push(Reverse(done));
        }
    }

    /// Host `me` reads at `t`: from its caches, except the regions another host owns,
    /// which it reads from the source.
    fn read(&mut self, me: usize, t: u64, offset: u64, len: u64) -> u64 {
        let Some(o) = &self.owners else {
            return self.hosts[me].read(t, offset, len);
        };
        let host = &mut self.hosts[me];
        let bypass = |r| o.theirs(me, r);
        let regions = o.regions(offset, len);
        let mut part = |bypass: bool, from: u64, to: u64| match bypass {
            true => host.read_uncached(t, from, to - from),
            false => host.read(t, from, to - from),
        };
        // Cut where the regions change from cached to bypassed or back.
        let (mut from, mut done) = (offset, t);
        let mut cur = bypass(regions.start);
        for r in regions.start + 1..regions.end {
            if bypass(r) != cur {
                let cut = o.span(r).0;
                done = done.max(part(cur, from, cut));
                (from, cur) = (cut, !cur);
            }
        }
        done = done.max(part(cur, from, offset + len));
        // What it read through its caches, it may cache from now on.
        if let Some(o) = &mut self.owners {
            for r in o.regions(offset, len) {
                if !o.theirs(me, r) {
                    o.touch(me, r);
                }
            }
        }
        done
    }

    /// Host `me` writes at `t`: owned if it owns (or acquires) every region it touches,
    /// else published (as every write without ownership).
    fn write(&mut self, me: usize, t: u64, offset: u64, len: u64) -> u64 {
        let done = self.hosts[me].write(t, offset, len);
        self.res.writes += 1;
        let (owned, mut found) = self.take_regions(me, t, offset, len);
        if owned {
            self.res.owned_writes += 1;
        } else {
            found += self.publish(me, t, offset, len);
        }
        self.res.invalidations += found;
        self.res.writes_invalidating += (found > 0) as u64;
        done
    }

    /// Takes the regions of host `me`'s write at `t` (see [`Owners::take`]): whether the
    /// write is owned, and how many other hosts' caches held part of a region acquired.
    fn take_regions(&mut self, me: usize, t: u64, offset: u64, len: u64) -> (bool, u64) {
        match &mut self.owners {
            Some(o) => o.take(&mut self.hosts, &mut self.res, me, t, offset, len),
            None => (false, 0),
        }
    }

    /// Publishes host `me`'s write at `t`: every other host drops the range and counts its
    /// regions as contended, and releases at once those it owns (each other host but the
    /// owner drops them again). Returns how many other hosts' caches held part of the range.
    fn publish(&mut self, me: usize, t: u64, offset: u64, len: u64) -> u64 {
        let others = self.hosts.len() as u64 - 1;
        self.res.contended_writes += 1;
        self.res.publications += 1;
        self.res.acknowledgements += others;
        let found = drop_others(&mut self.hosts, me, offset, len);
        if let Some(o) = &mut self.owners {
            o.published(&mut self.hosts, &mut self.res, me, t, offset, len);
        }
        found
    }

    /// Releases the regions whose owner has not written them for the idle time by `t`:
    /// every other host drops them.
    fn release_idle(&mut self, t: u64) {
        if let Some(o) = &mut self.owners {
            o.release_idle(&mut self.hosts, &mut self.res, t);
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
            self.res.read_pages_bypassed += host.read_pages_bypassed;
            match host.flash {
                Flash::Reference(c) => {
                    self.res.reference_bytes = self.res.reference_bytes.max(c.memory_bytes());
                    let (a, m) = reference.unwrap_or((0, 0));
                    reference = Some((a + c.accesses, m + c.misses));
                    self.res.reference_updates += c.updates;
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

/// Every host but `except` drops `[offset, offset + len)` from its caches; returns how many
/// held some of it.
fn drop_others(hosts: &mut [Host], except: usize, offset: u64, len: u64) -> u64 {
    let mut found = 0;
    for (i, h) in hosts.iter_mut().enumerate() {
        if i != except && h.invalidate(offset, len) {
            found += 1;
        }
    }
    found
}
