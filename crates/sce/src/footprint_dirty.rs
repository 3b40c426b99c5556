//! `sce footprint`'s write-back part (issue 45): the memory that indexes dirty data, per
//! dirty MiB, on top of the read cache's. Counted the same way as the rest (the allocator's
//! growth), over a real volume in write-back on sparse devices: `SAMPLE_PAGES` scattered
//! 4 KiB writes, committed, none cleaned (the watermarks at 99% and 100%, no idle rule),
//! then the growth divided by the dirty MiB. What a cache holding more dirty data would
//! take is that rate times its dirty MiB (the index grows by doubling: a measured rate, not
//! a bound).

use crate::sparse::SparseDevice;
use anyhow::{Context, Result};
use sce_core::{CoreConfig, WriteMode, WritebackTuning};
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::BlockDevice;
use std::sync::Arc;
use std::time::Duration;

/// Dirty pages written for the measurement (256 MiB).
pub const SAMPLE_PAGES: u64 = 65_536;
/// The log of the measured volume: room for the sample under its watermarks.
const LOG_BYTES: u64 = 512 << 20;

/// Bytes the index of `SAMPLE_PAGES` dirty pages took (None if the cache is too small for
/// the sample's log).
pub fn measure(core: &CoreConfig, cache_size: u64, source_size: u64) -> Result<Option<u64>> {
    if cache_size < 4 * LOG_BYTES || source_size < 2 * SAMPLE_PAGES * 4096 {
        return Ok(None);
    }
    let source: Arc<dyn BlockDevice> = Arc::new(SparseDevice::new(source_size)?);
    let cache: Arc<dyn BlockDevice> = Arc::new(SparseDevice::new(cache_size)?);
    let config = EngineConfig {
        core: CoreConfig {
            write_mode: WriteMode::WriteBack,
            writeback: WritebackTuning {
                low_watermark: 0.99,
                high_watermark: 1.0,
                rate: 0,
            },
            ..core.clone()
        },
        background_population: false,
        writeback_idle: Duration::from_secs(3600),
        persist: Some(PersistConfig {
            flush_interval: Duration::from_secs(3600),
            writeback_log: LOG_BYTES,
            ..PersistConfig::new("footprint")
        }),
        ..EngineConfig::default()
    };
    let volume = CacheVolume::open(source, cache, config)
        .context("opening a write-back volume over sparse devices")?;
    // Zero pages: the sparse cache device keeps none of them (their checksums hold).
    let page = vec![0u8; 4096];
    let before = crate::alloc::live_bytes();
    // Every other page: no two dirty pages adjacent, as random writes leave them.
    for k in 0..SAMPLE_PAGES {
        volume
            .write_at(2 * k * 4096, &page)
            .context("a write-back write")?;
        if k % 1024 == 1023 {
            volume.flush().context("a FLUSH")?;
        }
    }
    volume.flush().context("a FLUSH")?;
    let grown = crate::alloc::grown_since(before);
    let dirty = volume.writeback_stats().map_or(0, |w| w.dirty_bytes);
    anyhow::ensure!(
        dirty == SAMPLE_PAGES * 4096,
        "the measured volume cleaned some of its dirty data ({dirty} bytes left)"
    );
    volume.shutdown();
    Ok(Some(grown))
}
