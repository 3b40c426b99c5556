//! Counters kept by the core. They count decisions (pages hit, fragments populated); byte
//! counts of device I/O are kept by the driver, which does the I/O.

/// Core counters. Monotonic except where noted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Read requests.
    pub read_requests: u64,
    /// Read requests served entirely from the cache.
    pub read_requests_full_hit: u64,
    /// 4 KiB pages of reads served from the cache.
    pub read_pages_hit: u64,
    /// 4 KiB pages of reads served from the source.
    pub read_pages_missed: u64,
    /// Write requests (including discards).
    pub write_requests: u64,
    /// Pages touched by writes.
    pub write_pages: u64,
    /// Populations started (background and inline).
    pub populations_started: u64,
    /// Populations that completed and validated pages.
    pub populations_completed: u64,
    /// Populations that failed (source read or cache write error).
    pub populations_failed: u64,
    /// Pages made valid by population.
    pub pages_populated: u64,
    /// Fragments evicted from their slot.
    pub fragments_evicted: u64,
    /// Writes that sent a copy to the cache (AWT or synchronous write-through).
    pub awt_started: u64,
    /// Such writes whose copy completed and re-validated at least one page.
    pub awt_completed: u64,
    /// Writes that fell back to write-around because the AWT budget was exhausted.
    pub awt_fallbacks: u64,
    /// Writes that skipped the cache copy because another write or a population was in flight
    /// on the same pages (duplicate-write tracking).
    pub awt_duplicates: u64,
    /// Cache copies of writes that failed.
    pub awt_cache_failures: u64,
    /// Source writes that failed.
    pub source_write_failures: u64,
    /// Pages that a completing write or population could not validate because a concurrent
    /// write touched them.
    pub pages_spoiled: u64,
    /// Pages invalidated because their cached copy was found bad.
    pub pages_invalidated: u64,
    /// Candidates refused by the admission duel (not hotter than the fragment they would
    /// evict).
    pub admissions_rejected: u64,
    /// Requests found to be part of a sequential stream (no heat, no admission, writes
    /// bypass).
    pub sequential_requests: u64,
    /// Population picks deferred because the population budget was spent.
    pub population_budget_waits: u64,
    /// Cache writes (populations, fills, write copies) refused by the endurance budget.
    pub endurance_refusals: u64,
    /// Bytes the core planned to write to the cache device (populations, fills, copies).
    pub cache_bytes_planned: u64,
    /// Write-back writes started.
    pub writeback_writes: u64,
    /// Write-back writes whose cache copy failed.
    pub writeback_failures: u64,
    /// Dirty pages whose only copy was lost (a failed write-back copy, a bad cached page).
    pub pages_lost: u64,
    /// Dirty pages cleaned (written back to the source).
    pub pages_cleaned: u64,
    /// Cleaning jobs that failed (their pages stay dirty).
    pub clean_failures: u64,
}
