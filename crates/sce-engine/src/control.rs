//! What an operator does to a running cached volume (`sce ctl`): retune it, look at and
//! evict ranges (FlashTier's `exists` and `evict`), forget it, and the latency histograms
//! and in-flight gauge of its requests, and what only the cache holds of a volume.

use crate::volume::CacheVolume;
use sce_core::{CoreConfig, SourceOffset};
use sce_io::IoError;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

impl CacheVolume {
    /// Changes what a running cache may change (`sce ctl set`): the write mode, admission,
    /// sequential cutoff, population rate. Each core shard takes the change under its
    /// exclusive lock, one after the other; requests in flight finish as they were planned
    /// (every mode keeps the cache consistent with the source, so a request planned under
    /// the old mode and one under the new may interleave). Nothing changes if the result is
    /// invalid.
    pub fn retune(&self, t: &sce_core::Retune) -> Result<CoreConfig, sce_core::ConfigError> {
        let mut cfg = self.shared.config.lock();
        let mut next = cfg.clone();
        if let Some(m) = t.write_mode {
            next.write_mode = m;
        }
        if let Some(a) = t.admission {
            next.admission = a;
        }
        if let Some(c) = t.sequential_cutoff {
            next.sequential_cutoff = c;
        }
        if let Some((r, adaptive)) = t.population_rate {
            next.population_rate = r;
            next.population_adaptive = adaptive;
        }
        next.validate()?;
        let wb = sce_core::WriteMode::WriteBack;
        if (next.write_mode == wb) != (cfg.write_mode == wb) {
            return Err(sce_core::ConfigError::new(
                "mode",
                "writeback is chosen when the cache starts: restart it with --mode to enter or \
                 leave it (leaving: `sce ctl flush --to-source` first)"
                    .into(),
            ));
        }
        // Each shard gets its share, as when the volume was built.
        let part = self.shared.map.shard_config(&next);
        let shard_tune = sce_core::Retune {
            write_mode: Some(part.write_mode),
            admission: Some(part.admission),
            sequential_cutoff: Some(part.sequential_cutoff),
            population_rate: Some((part.population_rate, part.population_adaptive)),
        };
        for c in self.shared.cores.iter() {
            c.write().retune(&shard_tune)?;
        }
        *cfg = next;
        tracing::info!(
            mode = %cfg.write_mode,
            admission = %cfg.admission,
            sequential_cutoff = cfg.sequential_cutoff,
            population_rate = cfg.population_rate,
            "cache retuned"
        );
        Ok(cfg.clone())
    }

    /// Runs a write or discard, counted in flight and timed into the write histogram.
    pub(crate) fn timed_write(
        &self,
        f: impl FnOnce() -> Result<(), IoError>,
    ) -> Result<(), IoError> {
        let lat = &self.shared.counters.latencies;
        let _in_flight = crate::stats::InFlight::new(&lat.in_flight);
        let t0 = Instant::now();
        let r = f();
        lat.write.record_since(t0);
        r
    }

    /// The latency histograms (read hit, read miss, write) and requests in flight.
    pub fn latencies(&self) -> &crate::stats::Latencies {
        &self.shared.counters.latencies
    }

    /// Checks that `[offset, offset+len)` lies within the source.
    fn check_range(&self, op: sce_io::Op, offset: u64, len: u64) -> Result<(), IoError> {
        let size = self.shared.source_size;
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(IoError::OutOfRange {
                op,
                offset,
                len,
                size,
            });
        }
        Ok(())
    }

    /// FlashTier's `exists` over `[offset, offset+len)`: the fragments the cache holds there,
    /// each as (source offset, bytes valid within the range), in source order.
    pub fn exists(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64)>, IoError> {
        self.check_range(sce_io::Op::Read, offset, len)?;
        let map = &self.shared.map;
        let mut out = Vec::new();
        for p in map.pieces(offset, len) {
            let core = self.shared.cores[p.shard].read();
            for (local, pages) in core.exists_range(SourceOffset(p.local), p.len) {
                let g = map.source_to_global(p.shard, local);
                out.push((g.0, pages as u64 * sce_core::PAGE_SIZE));
            }
        }
        out.sort_unstable();
        out.dedup_by(|b, a| {
            // One fragment cut into pieces by the request: add its parts up.
            if a.0 == b.0 {
                a.1 += b.1;
                true
            } else {
                false
            }
        });
        Ok(out)
    }

    /// FlashTier's `evict` over `[offset, offset+len)`: drops every cached page there (see
    /// `CacheCore::evict_range`). Returns the bytes dropped. The change reaches the device's
    /// records with the next metadata round; a crash before it may bring the pages back,
    /// which is safe (they hold the source's data), only not evicted.
    pub fn evict(&self, offset: u64, len: u64) -> Result<u64, IoError> {
        self.check_range(sce_io::Op::Discard, offset, len)?;
        Ok(self.evict_unchecked(offset, len))
    }

    /// `evict` of a range the caller vouches for (any alignment): the bytes dropped.
    pub(crate) fn evict_unchecked(&self, offset: u64, len: u64) -> u64 {
        let mut pages = 0;
        for p in self.shared.map.pieces(offset, len) {
            pages += self.shared.cores[p.shard]
                .write()
                .evict_range(SourceOffset(p.local), p.len);
        }
        pages * sce_core::PAGE_SIZE
    }

    /// The dirty and lost write-back pages (4 KiB) of volume `k` (address order; 0 when the
    /// cache serves one): what only the cache device holds for it, which a forget keeps.
    pub fn dirty_pages_of_volume(&self, k: usize) -> (u64, u64) {
        let Some(p) = self.shared.parts.get(k) else {
            return (0, 0);
        };
        let len = p.at.size.min(self.shared.source_size - p.at.base);
        let (mut dirty, mut lost) = (0, 0);
        for piece in self.shared.map.pieces(p.at.base, len) {
            let core = self.shared.cores[piece.shard].read();
            let (d, l) = core.dirty_and_lost_in(SourceOffset(piece.local), piece.len);
            dirty += d;
            lost += l;
        }
        (dirty, lost)
    }

    /// Forgets everything cached for the volume (the source changed behind the cache's
    /// back): every shard drops its pages at once and spoils what is in flight, then, with
    /// persistence, a metadata round writes every record, so that no crash after this
    /// returns can bring the old pages back. Returns the fragments that were cached, and the
    /// metadata errors of the round (if any, the records could not be written: the caller
    /// should report it; the cache disables itself at its error limit as for any).
    pub fn forget(&self) -> (u64, u64) {
        let mut n = 0;
        for c in self.shared.cores.iter() {
            n += c.write().forget();
        }
        let errors = if self.shared.persist.is_some() {
            self.shared.flush_metadata()
        } else {
            0
        };
        tracing::info!(fragments = n, "cache forgotten");
        (n, errors)
    }
}

/// Write-back's state and counters (`CacheVolume::writeback_stats`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WriteBackStats {
    /// Bytes (4 KiB pages) only the cache holds now.
    pub dirty_bytes: u64,
    /// Bytes whose dirty data was lost (reads of them fail).
    pub lost_bytes: u64,
    /// Writes that waited for cleaning or a metadata round (backpressure).
    pub waits: u64,
    /// Bytes the cleaner wrote to the source.
    pub bytes_cleaned: u64,
    /// Cleaning jobs that failed (source errors), retried with backoff.
    pub clean_errors: u64,
    /// The last cleaning error ("" if none).
    pub last_clean_error: String,
}

impl crate::CacheVolume {
    /// Write-back's state, None in the other modes.
    pub fn writeback_stats(&self) -> Option<WriteBackStats> {
        let s = &self.shared;
        let wb = s.wb.as_ref()?;
        let (mut dirty, mut lost) = (0, 0);
        for c in s.cores.iter() {
            let core = c.read();
            dirty += core.dirty_pages();
            lost += core.lost_pages();
        }
        Some(WriteBackStats {
            dirty_bytes: dirty * sce_core::PAGE_SIZE,
            lost_bytes: lost * sce_core::PAGE_SIZE,
            waits: wb.waits.load(Relaxed),
            bytes_cleaned: wb.bytes_cleaned.load(Relaxed),
            clean_errors: wb.clean_errors.load(Relaxed),
            last_clean_error: wb.last_clean_error.lock().clone(),
        })
    }

    /// Writes every dirty page of `range` (global offset, length; everything if None) to
    /// the source and flushes it (`sce ctl flush --to-source`, detach). Returns the bytes
    /// cleaned meanwhile. Fails if no page could be cleaned for `patience` (the source
    /// keeps failing). Without write-back, flushes the source.
    pub fn flush_to_source(
        &self,
        range: Option<(u64, u64)>,
        patience: std::time::Duration,
    ) -> Result<u64, IoError> {
        self.shared.flush_to_source(range, patience)
    }
}
