//! What an operator does to a running cached volume (`sce ctl`): retune it, look at and
//! evict ranges (FlashTier's `exists` and `evict`), forget it, and the latency histograms
//! and in-flight gauge of its requests, and what only the cache holds of a volume.

use crate::log::WriteBackStats;
use crate::parts::Placed;
use crate::path::WritePath;
use crate::volume::CacheVolume;
use sce_core::CoreConfig;
use sce_io::IoError;

impl CacheVolume {
    /// Changes what a running cache may change (`sce ctl set`): the write mode, admission,
    /// sequential cutoff, population rate. Each core shard takes the change under its
    /// exclusive lock, one after the other; requests in flight finish as they were planned
    /// (every mode keeps the cache consistent with the source, so a request planned under
    /// the old mode and one under the new may interleave). Nothing changes if the result is
    /// invalid.
    pub fn retune(&self, t: &sce_core::Retune) -> Result<CoreConfig, sce_core::ConfigError> {
        let e = self.engine.admin();
        let mut cfg = e.config.lock();
        let next = t.applied_to(&cfg);
        next.validate()?;
        let wb = sce_core::WriteMode::WriteBack;
        if (next.write_mode == wb) != (cfg.write_mode == wb) {
            return Err(sce_core::ConfigError::new(
                "mode",
                "writeback is entered and left by reopening the volume: `sce ctl set mode` does \
                 it for a served export"
                    .into(),
            ));
        }
        // Each shard gets its share, as when the volume was built. Write-back through the
        // log runs its shards in write-through: the core never holds dirty pages there.
        let mut part = e.cores.shard_config(&next);
        if let Some(l) = self.path.log() {
            part.write_mode = sce_core::WriteMode::WriteThrough;
            // Its large sequential writes go through to the source from the same cutoff.
            l.set_sequential_cutoff(next.sequential_cutoff);
            l.set_tuning(&next.writeback);
        }
        let shard_tune = sce_core::Retune::all_of(&part);
        for k in 0..e.cores.count() {
            e.cores.with_shard(k, |core| core.retune(&shard_tune))?;
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

    /// The latency histograms (read hit, read miss, write) and requests in flight.
    pub fn latencies(&self) -> &crate::stats::Latencies {
        &self.engine.admin().counters.latencies
    }

    /// Checks that `[offset, offset+len)` lies within the source.
    fn check_range(&self, op: sce_io::Op, offset: u64, len: u64) -> Result<(), IoError> {
        let size = self.engine.admin().dev.size;
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

    /// The heat of the fragment at each of `offsets` (source offsets within the volume;
    /// one past its end counts 0): see `CacheCore::heat_at`.
    pub fn heats(&self, offsets: &[u64]) -> Vec<u32> {
        let cores = &self.engine.admin().cores;
        let size = sce_io::BlockDevice::size(self);
        (offsets.iter())
            .map(|&o| match o < size {
                true => cores.read_at_source(o, |c| c.heat_at(o)),
                false => 0,
            })
            .collect()
    }

    /// FlashTier's `exists` over `[offset, offset+len)`: the fragments the cache holds there,
    /// each as (source offset, bytes valid within the range), in source order.
    pub fn exists(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64)>, IoError> {
        self.check_range(sce_io::Op::Read, offset, len)?;
        let cores = &self.engine.admin().cores;
        let mut out = Vec::new();
        for p in cores.pieces(offset, len) {
            let found = cores.global_read(p.shard, |c| c.exists_range(&p));
            for (g, pages) in found {
                out.push((g, pages as u64 * sce_core::PAGE_SIZE));
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
        let cores = &self.engine.admin().cores;
        let mut pages = 0;
        for p in cores.pieces(offset, len) {
            pages += cores.global(p.shard, |c| c.evict_range(&p));
        }
        pages * sce_core::PAGE_SIZE
    }

    /// The dirty and lost write-back pages (4 KiB) of volume `k` (address order; 0 when the
    /// cache serves one): what only the write-back log holds for it, which a forget keeps
    /// (0 and 0 without a log in write-back).
    pub fn dirty_pages_of_volume(&self, k: usize) -> (u64, u64) {
        let e = self.engine.admin();
        let (Some(p), Some(l)) = (e.dev.volumes().get(k), self.path.log()) else {
            return (0, 0);
        };
        let len = p.at.size.min(e.dev.size - p.at.base);
        let ps = sce_core::PAGE_SIZE;
        l.dirty_in(p.at.base / ps, (p.at.base + len).div_ceil(ps))
    }

    /// Forgets everything cached for the volume (the source changed behind the cache's
    /// back): every shard drops its pages at once and spoils what is in flight, then, with
    /// persistence, a metadata round writes every record, so that no crash after this
    /// returns can bring the old pages back. Returns the fragments that were cached, and the
    /// metadata errors of the round (if any, the records could not be written: the caller
    /// should report it; the cache disables itself at its error limit as for any).
    pub fn forget(&self) -> (u64, u64) {
        self.engine.admin().dev.void_read_ahead();
        let mut n = 0;
        self.engine.admin().cores.each_shard(|_, c| n += c.forget());
        let errors = self.engine.flush_metadata();
        tracing::info!(fragments = n, "cache forgotten");
        (n, errors)
    }
}

impl CacheVolume {
    /// Write-back's state, None in the other modes.
    pub fn writeback_stats(&self) -> Option<WriteBackStats> {
        match &self.path {
            WritePath::Log(l) => Some(l.stats()),
            WritePath::Through(_) => None,
        }
    }

    /// Write-back's dirty bytes of `[offset, offset + len)` (global: one export of a shared
    /// device), None in the other modes.
    pub fn writeback_dirty_in(&self, offset: u64, len: u64) -> Option<u64> {
        let ps = sce_core::PAGE_SIZE;
        let l = self.path.log()?;
        Some(l.dirty_in(offset / ps, (offset + len).div_ceil(ps)).0 * ps)
    }

    /// Write-back's dirty room for the volume at global `offset`: the bytes of dirty data it
    /// may hold before its writers wait for the room the device's other volumes are owed
    /// (its share of the log up to the high watermark), None in the other modes.
    pub fn writeback_share_at(&self, offset: u64) -> Option<u64> {
        Some(
            self.path
                .log()?
                .share_bytes_of(offset / sce_core::PAGE_SIZE),
        )
    }

    /// True if the cache device has a write-back log (formats 6 on): write-back is served
    /// through it. A device formatted without one needs a format to get one.
    pub fn has_writeback_log(&self) -> bool {
        (self.engine.admin().persist.as_ref()).is_some_and(|p| p.log_info().is_some())
    }

    /// Write-back through the log: the source writes the cleaner made and the commits
    /// (None in the other paths).
    pub fn writeback_log_counts(&self) -> Option<(u64, u64)> {
        Some(self.path.log()?.log_counts())
    }

    /// Writes every dirty page of `range` (global offset, length; everything if None) to
    /// the source and flushes it (`sce ctl flush --to-source`, detach). Returns the bytes
    /// cleaned meanwhile. Fails if no page could be cleaned for `patience` (the source
    /// keeps failing). Without write-back, flushes the source. Through the log, writes to
    /// the range go through to the source while it runs, so it ends under any load
    /// ([`Self::drain_writeback`]).
    pub fn flush_to_source(
        &self,
        range: Option<(u64, u64)>,
        patience: std::time::Duration,
    ) -> Result<u64, IoError> {
        let ctl = crate::log::DrainControl {
            cancelled: &|| false,
            progress: &|_| {},
            patience,
        };
        self.drain_writeback(range, &ctl).map(|d| d.cleaned_bytes)
    }

    /// Drains write-back's dirty data of `range` (global offset, length; everything if
    /// None) to the source and flushes it, as `ctl` says: through the log, writes to the
    /// range go through to the source meanwhile (superseding the log's versions), so the
    /// drain is bounded by what was dirty when it began; it stops if `ctl.cancelled` says
    /// so, and fails if nothing is cleaned for `ctl.patience`. Without write-back, flushes the source.
    pub fn drain_writeback(
        &self,
        range: Option<(u64, u64)>,
        ctl: &crate::log::DrainControl<'_>,
    ) -> Result<crate::log::DrainDone, IoError> {
        let e = self.engine.admin();
        match &self.path {
            WritePath::Log(l) => {
                let ps = sce_core::PAGE_SIZE;
                let pages = match range {
                    Some((o, len)) => (o / ps, (o + len).div_ceil(ps)),
                    None => (0, u64::MAX),
                };
                l.drain(&self.engine.log_io(), pages, ctl)
            }
            WritePath::Through(_) => e.dev.flush_source().map(|()| Default::default()),
        }
    }

    /// The volumes this cache serves, in address order: name, where each starts and its
    /// size (one volume at 0 unless opened with `open_shared`).
    pub fn volumes(&self) -> Vec<(String, Placed)> {
        self.engine
            .admin()
            .dev
            .volumes()
            .iter()
            .map(|p| (p.name.clone(), p.at.clone()))
            .collect()
    }

    /// Marks volume `k` detached from its export (`on`), or attached again: durably on the
    /// device (a start drops a volume marked detached), and, where several volumes share the
    /// cache, nothing of it is populated meanwhile (its source may be written behind the
    /// cache's back). The caller forgets the volume's pages.
    pub fn set_detached(&self, k: usize, on: bool) -> Result<(), IoError> {
        let e = self.engine.admin();
        // Its source may be written behind the engine from now on (and was, until now).
        e.dev.void_read_ahead();
        let vols = e.dev.volumes();
        let p = vols
            .get(k)
            .ok_or_else(|| IoError::Invalid(format!("no volume {k}")))?;
        if vols.len() > 1 {
            let fsize = 1u64 << e.fshift;
            let first = p.at.base / fsize;
            let end = (p.at.base + p.at.size).div_ceil(fsize);
            for j in 0..e.cores.count() {
                e.cores.global(j, |core| core.set_disabled(first, end, on));
            }
        }
        match &e.persist {
            Some(persist) => persist.set_detached(k, on),
            None => Ok(()),
        }
    }

    /// The slots each volume holds, in address order, if shares are set (else empty).
    pub fn share_used(&self) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::new();
        let cores = &self.engine.admin().cores;
        for k in 0..cores.count() {
            let used = cores.read_shard(k, |c| c.share_used());
            out.resize(out.len().max(used.len()), 0);
            for (o, u) in out.iter_mut().zip(used) {
                *o += u as u64;
            }
        }
        out
    }

    /// Forgets everything cached for volume `k` (its source changed behind the cache's
    /// back), and leaves the others' alone: its pages are dropped at once and what is in
    /// flight on them spoiled, then, with persistence, its generation is bumped (its
    /// records on the device no longer count) and a metadata round writes the records.
    /// Returns the bytes that were cached, and the metadata errors.
    pub fn forget_volume(&self, k: usize) -> Result<(u64, u64), IoError> {
        let e = self.engine.admin();
        e.dev.void_read_ahead();
        let p = e
            .dev
            .volumes()
            .get(k)
            .ok_or_else(|| IoError::Invalid(format!("no volume {k}")))?;
        let size = p.at.size.div_ceil(sce_core::PAGE_SIZE) * sce_core::PAGE_SIZE;
        let len = size.min(e.dev.size - p.at.base);
        // The volume's whole range, whatever the block size: no range check to fail.
        let bytes = self.evict_unchecked(p.at.base, len);
        let mut errors = 0;
        if let Some(persist) = &e.persist {
            if persist.bump_generation(k).is_err() {
                errors += 1;
            }
            errors += self.engine.flush_metadata();
        }
        tracing::info!(volume = %p.name, bytes, "volume forgotten");
        Ok((bytes, errors))
    }
}
