//! Counters of a cached volume: the engine's byte and error counts (it does the I/O) joined
//! with the core's decision counts into one snapshot.

use sce_core::CacheCore;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A counter that every thread adds to on a cache line of its own (one of 16, chosen once
/// per thread), summed when read: a hit on one core does not invalidate another core's line.
#[derive(Debug, Default)]
pub struct ShardedCounter([PaddedU64; 16]);

#[derive(Debug, Default)]
#[repr(align(128))]
struct PaddedU64(AtomicU64);

impl ShardedCounter {
    /// Adds `n` on this thread's shard.
    pub fn add(&self, n: u64) {
        self.0[crate::shard::thread_index() % 16]
            .0
            .fetch_add(n, Relaxed);
    }
    /// The total.
    pub fn sum(&self) -> u64 {
        self.0.iter().map(|c| c.0.load(Relaxed)).sum()
    }
}

/// Counters updated by the engine's threads.
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes read from the source.
    pub source_bytes_read: ShardedCounter,
    /// Bytes written to the source.
    pub source_bytes_written: AtomicU64,
    /// Bytes read from the cache device (every hit adds to it: sharded per thread).
    pub cache_bytes_read: ShardedCounter,
    /// Bytes written to the cache device.
    pub cache_bytes_written: AtomicU64,
    /// Failed reads of the cache device (served from the source instead).
    pub cache_read_errors: AtomicU64,
    /// Failed writes to the cache device.
    pub cache_write_errors: AtomicU64,
    /// Cached pages whose data did not match its checksum (served from the source instead).
    pub cache_checksum_errors: AtomicU64,
    /// Population workers the throttle lets run.
    pub active_workers: AtomicU64,
    /// Population wake-ups that left a busy source to the clients (miss fills on).
    pub population_source_busy: AtomicU64,
    /// Bytes of reads' fills dropped because the fill writers were behind (`fills.rs`).
    pub fill_bytes_dropped: AtomicU64,
    /// Read requests cut into several pieces count once per piece in the core shards: the
    /// pieces beyond the first, and the full-hit pieces beyond the request's own full hit,
    /// subtracted when read.
    pub(crate) extra_read_pieces: AtomicU64,
    pub(crate) extra_full_hits: AtomicU64,
    /// The same for writes and discards.
    pub(crate) extra_write_pieces: AtomicU64,
    /// Latency histograms and the in-flight gauge.
    pub latencies: Latencies,
}

sce_core::stats_table! {
    /// A point-in-time view of a cached volume: its figures, their JSON names (the
    /// fields'), and their Prometheus families.
    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct VolumeStats {
        /// Read requests.
        read_requests: u64, Counter("sce_read_requests_total", "", "Read requests served by the cached volume.");
        /// Read requests served entirely from the cache.
        read_requests_full_hit: u64, Counter("sce_read_full_hit_requests_total", "", "Read requests served entirely from the cache.");
        /// 4 KiB pages of reads served from the cache.
        read_pages_hit: u64, Counter("sce_read_hit_pages_total", "", "4 KiB pages of reads served from the cache.");
        /// 4 KiB pages of reads served from the source.
        read_pages_missed: u64, Counter("sce_read_missed_pages_total", "", "4 KiB pages of reads served from the source.");
        /// Write requests.
        write_requests: u64, Counter("sce_write_requests_total", "", "Write and discard requests.");
        /// Bytes read from the source.
        source_bytes_read: u64, Counter("sce_source_read_bytes_total", "bytes", "Bytes read from the source.");
        /// Bytes written to the source.
        source_bytes_written: u64, Counter("sce_source_written_bytes_total", "bytes", "Bytes written to the source.");
        /// Bytes read from the cache device.
        cache_bytes_read: u64, Counter("sce_cache_read_bytes_total", "bytes", "Bytes read from the cache device (hits, checks).");
        /// Bytes written to the cache device.
        cache_bytes_written: u64, Counter("sce_cache_written_bytes_total", "bytes", "Bytes written to the cache device (population, write copies, metadata, journal).");
        /// Cache device read errors.
        cache_read_errors: u64, Counter("sce_cache_read_errors_total", "", "Failed reads of the cache device (served from the source instead).");
        /// Cache device write errors.
        cache_write_errors: u64, Counter("sce_cache_write_errors_total", "", "Failed writes to the cache device.");
        /// Cached pages that failed their checksum (corrupt, torn, lost or misdirected writes).
        cache_checksum_errors: u64, Counter("sce_cache_checksum_errors_total", "", "Cached pages whose data failed its checksum (served from the source instead).");
        /// 1 if the cache disabled itself after device errors and passes I/O through.
        passthrough: u64, Gauge("sce_passthrough", "", "1 if the cache disabled itself after device errors and passes I/O to the source.");
        /// Populations completed.
        fragments_populated: u64, Counter("sce_populated_fragments_total", "", "Fragments populated (read from the source into the cache).");
        /// Populations failed.
        populations_failed: u64, Counter("sce_population_failures_total", "", "Populations that failed.");
        /// Pages made valid by population.
        pages_populated: u64, Counter("sce_populated_pages_total", "", "4 KiB pages made valid by population.");
        /// Fragments evicted.
        fragments_evicted: u64, Counter("sce_evicted_fragments_total", "", "Fragments evicted (by the eviction policy, the evict verb, or the cache disabling itself).");
        /// Fragments dropped by `forget`.
        fragments_forgotten: u64, Counter("sce_forgotten_fragments_total", "", "Fragments dropped by forget (the source changed behind the cache).");
        /// Writes whose cache copy was sent.
        awt_started: u64, Counter("sce_awt_copies_started_total", "", "Writes whose cache copy was sent (write-through).");
        /// Writes whose cache copy completed and re-validated pages.
        awt_completed: u64, Counter("sce_awt_copies_completed_total", "", "Writes whose cache copy completed and re-validated pages.");
        /// Writes that fell back to write-around (AWT budget exhausted).
        awt_fallbacks: u64, Counter("sce_awt_fallbacks_total", "", "Writes that fell back to write-around (AWT budget spent).");
        /// Writes that skipped the cache copy because of a concurrent write to the same pages.
        awt_duplicates: u64, Counter("sce_awt_duplicates_total", "", "Writes that skipped the cache copy for a concurrent write to the same pages.");
        /// Candidates refused by the admission duel (admission `sce`).
        admissions_rejected: u64, Counter("sce_admission_rejections_total", "", "Candidates refused by the admission duel (admission sce).");
        /// Requests found to be part of a sequential stream and bypassed (admission `sce`).
        sequential_requests: u64, Counter("sce_sequential_requests_total", "", "Requests found to be part of a sequential stream and bypassed.");
        /// Population picks deferred by the population budget (admission `sce`).
        population_budget_waits: u64, Counter("sce_population_budget_waits_total", "", "Population picks deferred by the population budget.");
        /// Read misses whose own data filled the cache (admission `sce` with miss fills).
        miss_fills: u64, Counter("sce_miss_fills_total", "", "Read misses whose own data filled the cache (admission sce with miss fills).");
        /// Pages made valid in the page area (single pages of sparse lines, issue 47).
        sparse_pages_filled: u64, Counter("sce_sparse_pages_filled_total", "", "Pages filled one at a time into the page area (sparse lines, admission sce).");
        /// Pages the page area holds now.
        sparse_pages: u64, Gauge("sce_sparse_pages", "", "Pages the page area holds now (single pages of sparse lines, packed into slots of their own).");
        /// Slots of the page area now.
        sparse_slots: u64, Gauge("sce_sparse_slots", "", "Slots the page area holds now (each packs single pages of many lines).");
        /// Population wake-ups that left a busy source to the clients (miss fills on).
        population_source_busy: u64, Counter("sce_population_source_busy_total", "", "Population wake-ups that left a busy source to the clients (miss fills on).");
        /// Bytes the source was read ahead of streams of large reads.
        source_read_ahead_bytes: u64, Counter("sce_source_read_ahead_bytes_total", "bytes", "Bytes read from the source ahead of streams of large reads.");
        /// Bytes of the read-ahead that reads used.
        source_read_ahead_used_bytes: u64, Counter("sce_source_read_ahead_used_bytes_total", "bytes", "Bytes read ahead of streams that reads used.");
        /// Bytes of reads' fills dropped because the cache device was behind.
        fill_bytes_dropped: u64, Counter("sce_fill_dropped_bytes_total", "bytes", "Bytes read misses would have filled the cache with, dropped because the cache device was behind (reads never wait for fills).");
        /// Cache writes refused by the endurance budget (`max_cache_writes`).
        endurance_refusals: u64, Counter("sce_endurance_refusals_total", "", "Cache writes refused by the endurance budget (max_cache_writes).");
        /// The population rate limit now, bytes per second (0: unlimited).
        population_rate: u64, Gauge("sce_population_rate_limit_bytes_per_second", "bytes_per_second", "The population rate allowed now (0: unlimited).");
        /// Population workers allowed by the throttle.
        active_workers: u64, Gauge("sce_population_workers", "", "Population workers the throttle lets run now.");
        /// Free cache slots.
        free_slots: u64, Gauge("sce_cache_free_slots", "", "Slots that hold no fragment.");
        /// All cache slots.
        total_slots: u64, Gauge("sce_cache_slots", "", "Slots (fragment-sized places) of the cache.");
    }
    impl delta, add, carry;
}

impl VolumeStats {
    /// Read hit ratio over 4 KiB pages (0 when nothing was read).
    pub fn read_hit_ratio(&self) -> f64 {
        let t = self.read_pages_hit + self.read_pages_missed;
        if t == 0 {
            0.0
        } else {
            self.read_pages_hit as f64 / t as f64
        }
    }

    /// A core shard's part of a snapshot: its counts and its gauges (the figures the
    /// engine keeps are zero).
    fn of_core(core: &CacheCore) -> VolumeStats {
        let c = core.stats();
        VolumeStats {
            read_requests: c.read_requests,
            read_requests_full_hit: c.read_requests_full_hit,
            read_pages_hit: c.read_pages_hit,
            read_pages_missed: c.read_pages_missed,
            write_requests: c.write_requests,
            fragments_populated: c.populations_completed,
            populations_failed: c.populations_failed,
            pages_populated: c.pages_populated,
            fragments_evicted: c.fragments_evicted,
            fragments_forgotten: c.fragments_forgotten,
            awt_started: c.awt_started,
            awt_completed: c.awt_completed,
            awt_fallbacks: c.awt_fallbacks,
            awt_duplicates: c.awt_duplicates,
            admissions_rejected: c.admissions_rejected,
            sequential_requests: c.sequential_requests,
            population_budget_waits: c.population_budget_waits,
            miss_fills: c.miss_fills,
            sparse_pages_filled: c.sparse_pages_filled,
            sparse_pages: core.page_area().1,
            sparse_slots: core.page_area().0 as u64,
            endurance_refusals: c.endurance_refusals,
            population_rate: core.population_rate(),
            free_slots: core.free_slots() as u64,
            total_slots: core.geometry().slots() as u64,
            ..VolumeStats::default()
        }
    }

    /// Adds another core shard's counts and gauges to a snapshot of the first.
    pub(crate) fn add_core(&mut self, core: &CacheCore) {
        *self += &VolumeStats::of_core(core);
    }
}

impl Counters {
    /// A request cut into `pieces` pieces (`full` of them full hits, for a read) was
    /// counted once per piece by the core shards: records the difference.
    pub(crate) fn split_request(&self, read: bool, pieces: u64, full: u64) {
        if pieces <= 1 {
            return;
        }
        if read {
            self.extra_read_pieces.fetch_add(pieces - 1, Relaxed);
            self.extra_full_hits
                .fetch_add(full - (full == pieces) as u64, Relaxed);
        } else {
            self.extra_write_pieces.fetch_add(pieces - 1, Relaxed);
        }
    }

    /// Takes the pieces' extra counts out of a snapshot that summed the core shards.
    pub(crate) fn unsplit(&self, v: &mut VolumeStats) {
        let sub = |x: &mut u64, c: &AtomicU64| *x = x.saturating_sub(c.load(Relaxed));
        sub(&mut v.read_requests, &self.extra_read_pieces);
        sub(&mut v.read_requests_full_hit, &self.extra_full_hits);
        sub(&mut v.write_requests, &self.extra_write_pieces);
    }

    /// Joins these counters with the core's into a snapshot.
    pub fn snapshot(&self, core: &CacheCore, passthrough: bool) -> VolumeStats {
        VolumeStats {
            source_bytes_read: self.source_bytes_read.sum(),
            source_bytes_written: self.source_bytes_written.load(Relaxed),
            cache_bytes_read: self.cache_bytes_read.sum(),
            cache_bytes_written: self.cache_bytes_written.load(Relaxed),
            cache_read_errors: self.cache_read_errors.load(Relaxed),
            cache_write_errors: self.cache_write_errors.load(Relaxed),
            cache_checksum_errors: self.cache_checksum_errors.load(Relaxed),
            passthrough: passthrough as u64,
            active_workers: self.active_workers.load(Relaxed),
            population_source_busy: self.population_source_busy.load(Relaxed),
            fill_bytes_dropped: self.fill_bytes_dropped.load(Relaxed),
            ..VolumeStats::of_core(core)
        }
    }
}

/// Upper bounds of the latency histograms' buckets, in nanoseconds: 50 µs to 10 s, about
/// three per decade (the last bucket, +Inf, is implied).
pub const LATENCY_BOUNDS_NS: [u64; 17] = [
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// A latency histogram a request adds to with three relaxed atomic adds (its bucket, the
/// count, the sum): no lock on the I/O path.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Requests per bucket (not cumulative), the last for beyond the last bound.
    buckets: [AtomicU64; LATENCY_BOUNDS_NS.len() + 1],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// A point-in-time copy of a [`LatencyHistogram`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LatencySnapshot {
    /// Requests per bucket, cumulative (Prometheus' `le`): entry `i` counts those that took
    /// at most `LATENCY_BOUNDS_NS[i]`.
    pub cumulative: Vec<u64>,
    /// Requests in all.
    pub count: u64,
    /// Their total latency, in nanoseconds.
    pub sum_ns: u64,
}

impl LatencyHistogram {
    /// Records one request that took `ns` nanoseconds.
    pub fn record_ns(&self, ns: u64) {
        let i = LATENCY_BOUNDS_NS.partition_point(|&b| b < ns);
        self.buckets[i].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    /// Records one request that started at `t0`.
    pub fn record_since(&self, t0: std::time::Instant) {
        self.record_ns(t0.elapsed().as_nanos().min(u64::MAX as u128) as u64);
    }

    /// A copy, with cumulative buckets.
    pub fn snapshot(&self) -> LatencySnapshot {
        let mut acc = 0;
        let cumulative = self.buckets[..LATENCY_BOUNDS_NS.len()]
            .iter()
            .map(|b| {
                acc += b.load(Relaxed);
                acc
            })
            .collect();
        LatencySnapshot {
            cumulative,
            count: self.count.load(Relaxed),
            sum_ns: self.sum_ns.load(Relaxed),
        }
    }
}

/// The latency histograms and the in-flight gauge of a cached volume: measured inside the
/// engine, from the call of a read or write to its completion (the NBD server's queueing
/// and the network are not in them).
#[derive(Debug, Default)]
pub struct Latencies {
    /// Reads served entirely from the cache.
    pub read_hit: LatencyHistogram,
    /// Reads that went, in part or whole, to the source.
    pub read_miss: LatencyHistogram,
    /// Writes and discards, to their acknowledgement.
    pub write: LatencyHistogram,
    /// Requests being served now.
    pub in_flight: AtomicU64,
}

/// Counts a request in flight for as long as it lives.
pub(crate) struct InFlight<'a>(&'a AtomicU64);

impl<'a> InFlight<'a> {
    pub(crate) fn new(g: &'a AtomicU64) -> Self {
        g.fetch_add(1, Relaxed);
        InFlight(g)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod latency_tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_bounds_inclusive() {
        let h = LatencyHistogram::default();
        h.record_ns(50_000); // exactly the first bound: in it
        h.record_ns(50_001);
        h.record_ns(3_000_000);
        h.record_ns(20_000_000_000); // beyond the last bound: only in +Inf
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert_eq!(s.sum_ns, 50_000 + 50_001 + 3_000_000 + 20_000_000_000);
        assert_eq!(s.cumulative[0], 1);
        assert_eq!(s.cumulative[1], 2);
        assert_eq!(s.cumulative[5], 2, "2.5 ms");
        assert_eq!(s.cumulative[6], 3, "5 ms");
        assert_eq!(*s.cumulative.last().unwrap(), 3);
    }
}
