//! Opening a cached volume: the core cut into shards, the store opened and what it holds
//! restored into them, the engine's subsystems built, the write path chosen, and the
//! threads started.

use crate::checks::Checks;
use crate::checks::Crcs;
use crate::cores::Cores;
use crate::crcs::CrcCache;
use crate::devices::{Devices, PartInfo};
use crate::engine::{Engine, EngineParts};
use crate::fills::fill_writer;
use crate::flusher::{flusher, intent_writer};
use crate::health::Health;
use crate::order::{levels, OrderedMutex};
use crate::parts::Placed;
use crate::path::WritePath;
use crate::persist::{OpenVolume, Persist, PersistConfig};
use crate::population::population_worker;
use crate::through::{awt_writer, AwtJob, WriteThrough};
use crate::volume::{CacheVolume, EngineConfig, EngineError};
/// This file's mutexes are leaves of the lock order (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use sce_core::{CacheCore, ConfigError, CoreConfig, GlobalCore, ShardMap};
use sce_io::{BlockDevice, IoError, SliceDevice};
use sce_store::CrcTable;
use std::sync::Arc;
use std::thread::JoinHandle;

/// What `open_core` makes: the core shards and their map, the core configuration, the
/// checksums, the store, the data device (the cache device, or its data area with
/// persistence) and the volume id seeding the checksums.
struct OpenedCore {
    cores: Vec<CacheCore>,
    map: ShardMap,
    config: CoreConfig,
    crcs: Option<Crcs>,
    persist: Option<Persist>,
    data: Arc<dyn BlockDevice>,
    seeds: Vec<(u64, u16)>,
    /// The whole cache device (with persistence: the write-back log lies past the data).
    device: Arc<dyn BlockDevice>,
    /// Write-back goes through the device's write-back log (its core shards then run in
    /// write-through: they never hold dirty pages).
    log: bool,
    /// Dirty data of volumes left out that the operator gave up (logged once open).
    given_up: Vec<sce_store::VolumeDirt>,
}

/// Refuses write-back without a persistent cache and its write journal: dirty data must
/// survive a crash (docs/WRITEBACK.md).
pub(crate) fn engine_supports(
    cfg: &CoreConfig,
    persist: Option<&PersistConfig>,
) -> Result<(), ConfigError> {
    if cfg.write_mode == sce_core::WriteMode::WriteBack && !persist.is_some_and(|p| p.journal) {
        return Err(ConfigError::new(
            "mode",
            "writeback needs a persistent cache with its write journal (dirty data must \
             survive a crash); see docs/WRITEBACK.md"
                .into(),
        ));
    }
    Ok(())
}

/// Cuts the core into shards for a cache of `cache_size` bytes and builds them.
fn build_cores(
    cfg: &CoreConfig,
    config: &EngineConfig,
    source_size: u64,
    cache_size: u64,
) -> Result<(Vec<CacheCore>, ShardMap), EngineError> {
    // The server's and the simulator's one rule; an invalid fragment size or slot count
    // is reported by the core itself (one shard).
    let map = ShardMap::for_cache(config.core_shards, cfg, source_size, cache_size);
    Ok((map.build(cfg, cache_size)?, map))
}

/// Builds the core shards and, with persistence, opens the store on `cache`, restores what
/// it holds into them and starts it.
fn open_core(
    source: &dyn BlockDevice,
    vols: &[OpenVolume],
    cache: Arc<dyn BlockDevice>,
    config: &EngineConfig,
) -> Result<OpenedCore, EngineError> {
    let mut core_cfg = config.core.clone();
    let verify = config.verify || config.persist.is_some();
    if verify {
        core_cfg.revalidate_partial_pages = false;
    }
    let Some(mut pc) = config.persist.clone() else {
        return open_memory_core(source, vols, cache, config, (core_cfg, verify));
    };
    pc.writeback = core_cfg.write_mode == sce_core::WriteMode::WriteBack;
    let opened = open_store(source, &cache, (config, &pc), vols)?;
    let mut persist = opened.persist;
    let loaded = opened.loaded;
    let given_up = opened.given_up;
    let seeds = persist.seeds();
    let l = persist.layout;
    let device = cache.clone();
    let data: Arc<dyn BlockDevice> =
        Arc::new(SliceDevice::new(cache, l.data_offset, l.data_bytes())?);
    // Write-back goes through the log: the shards run in write-through (the log holds the
    // dirty data), and the volume's configuration still says writeback.
    let log = core_cfg.write_mode == sce_core::WriteMode::WriteBack;
    let shard_cfg = CoreConfig {
        write_mode: if log {
            sce_core::WriteMode::WriteThrough
        } else {
            core_cfg.write_mode
        },
        ..core_cfg.clone()
    };
    let (mut cores, map) = build_cores(&shard_cfg, config, source.size(), data.size())?;
    restore(&mut cores, &map, &loaded, l.bitmap_words());
    apply_shares(&mut cores, &map, vols, core_cfg.fragment_size);
    persist.start(
        |s| {
            let k = map.shard_of_slot(s);
            GlobalCore::new(&cores[k], &map, k).slot_fragment(s)
        },
        &loaded,
    )?;
    let crcs = Crcs::Device(Arc::new(checksum_cache(
        config,
        &persist,
        device.clone(),
        &loaded,
    )));
    Ok(OpenedCore {
        cores,
        map,
        config: core_cfg,
        crcs: Some(crcs),
        persist: Some(persist),
        device,
        log,
        data,
        seeds,
        given_up,
    })
}

/// The store opened for `pc`, formatted afresh first if it must be (`crate::slots`);
/// write-back on a device too small for a log is refused before anything is formatted (a
/// format would fail at every start).
fn open_store(
    source: &dyn BlockDevice,
    cache: &Arc<dyn BlockDevice>,
    (config, pc): (&EngineConfig, &PersistConfig),
    vols: &[OpenVolume],
) -> Result<crate::persist::Opened, EngineError> {
    let too_small = || -> EngineError {
        ConfigError::new(
            "mode",
            format!(
                "writeback needs a write-back log, and a cache device of {} bytes is too \
                 small for one (at least 2 MiB)",
                cache.size()
            ),
        )
        .into()
    };
    let fragment = config.core.fragment_size;
    let mut opened = Persist::open(cache.clone(), pc.clone(), fragment, vols)?;
    let no_log = |o: &crate::persist::Opened| pc.writeback && o.persist.log_info().is_none();
    if no_log(&opened) && pc.log_bytes(cache.size()) == 0 {
        return Err(too_small());
    }
    if crate::slots::relayout_needed(&opened.persist, &opened.loaded, pc.writeback)? {
        opened = relayout(source, cache, opened, (config, pc), vols)?;
    }
    if no_log(&opened) {
        return Err(too_small());
    }
    Ok(opened)
}

/// A device found needing a new layout (`crate::slots`): its slots' dirty data drained to
/// the source, then formatted afresh (with a log, in write-back) and opened again.
fn relayout(
    source: &dyn BlockDevice,
    cache: &Arc<dyn BlockDevice>,
    opened: crate::persist::Opened,
    (config, pc): (&EngineConfig, &PersistConfig),
    vols: &[OpenVolume],
) -> Result<crate::persist::Opened, EngineError> {
    let drained = crate::slots::drain(
        source,
        cache.clone(),
        &opened.persist,
        &opened.loaded,
        (config, vols),
    )?;
    let had_log = opened.persist.log_info().is_some();
    // What the operator gave up is logged once the whole open went through (`open_parts`):
    // the first open's (volumes left out) and the drain's (pages without a sound copy).
    let mut given_up = opened.given_up.clone();
    given_up.extend(drained.lost.iter().cloned());
    drop(opened);
    let fragment = config.core.fragment_size;
    let mut again = Persist::open_laid_out(cache.clone(), pc.clone(), fragment, vols, true)?;
    again.given_up.extend(given_up);
    tracing::warn!(
        drained_pages = drained.pages,
        log_bytes = again.persist.log_info().map_or(0, |i| i.blocks * 4096),
        "the cache device held write-back data in its read slots (an sce before issue 45{}): \
         {} dirty pages were written to the source, and the device was formatted afresh{} \
         (its read cache starts cold)",
        if had_log {
            ""
        } else {
            ", formatted without a write-back log"
        },
        drained.pages,
        if pc.writeback {
            " with a write-back log"
        } else {
            ""
        },
    );
    Ok(again)
}

/// Puts the records the store loaded back into the core shards: each goes to the shard
/// that owns its (global) slot, and is dropped if its fragment belongs to another shard (the
/// shard count changed): `Persist::start` then puts an intent on the slot, so the record is
/// never trusted again. (No dirty pages: a device holding any was drained and formatted
/// afresh, `crate::slots`.)
fn restore(cores: &mut [CacheCore], map: &ShardMap, loaded: &sce_store::Loaded, words: usize) {
    type Restored<'a> = (u32, u64, &'a [u64]);
    let mut per: Vec<Vec<Restored>> = vec![Vec::new(); cores.len()];
    for (i, &(s, f)) in loaded.entries.iter().enumerate() {
        per[map.shard_of_slot(s)].push((s, f, &loaded.bitmaps[i * words..(i + 1) * words]));
    }
    for (k, (core, entries)) in cores.iter_mut().zip(per).enumerate() {
        // Every slot that changes from now on is written by the next round.
        core.track_dirty();
        GlobalCore::new(core, map, k).restore(entries);
    }
}

/// The page checksums of a persistent cache just loaded: in its records, the units in use in
/// memory (`crcs.rs`), with the checksums the journal's replay gave.
pub(crate) fn checksum_cache(
    config: &EngineConfig,
    persist: &Persist,
    device: Arc<dyn BlockDevice>,
    loaded: &sce_store::Loaded,
) -> CrcCache {
    let l = persist.layout;
    let units = match config.persist.as_ref().map_or(0, |p| p.checksum_units) {
        0 => crate::crcs::default_capacity(l.units),
        n => n,
    };
    let cache = CrcCache::new(device, l, persist.uuid(), units);
    cache.loaded_seqs(&loaded.unit_seqs);
    // The replay's checksums are newer than the records': kept until a round writes them.
    for &(s, p, c) in &loaded.replayed_crcs {
        cache.set(s, p, c);
    }
    cache
}

/// `open_core` without persistence: the cache's contents live in memory only.
fn open_memory_core(
    source: &dyn BlockDevice,
    vols: &[OpenVolume],
    cache: Arc<dyn BlockDevice>,
    config: &EngineConfig,
    (core_cfg, verify): (CoreConfig, bool),
) -> Result<OpenedCore, EngineError> {
    let (mut cores, map) = build_cores(&core_cfg, config, source.size(), cache.size())?;
    apply_shares(&mut cores, &map, vols, core_cfg.fragment_size);
    let slots = cores.iter().map(|c| c.geometry().slots()).sum();
    let ppf = cores[0].geometry().pages_per_fragment();
    let crcs = verify.then(|| Crcs::Memory(CrcTable::new(slots, ppf)));
    Ok(OpenedCore {
        cores,
        map,
        config: core_cfg,
        crcs,
        persist: None,
        device: cache.clone(),
        log: false,
        data: cache,
        seeds: vols
            .iter()
            .enumerate()
            .map(|(i, v)| (v.base / 4096, i as u16 + 1))
            .collect(),
        given_up: Vec::new(),
    })
}

/// Gives each core shard the volumes' ranges (in its own fragment numbers) and caps (its
/// part of each volume's share of the slots), and counts what each volume holds.
pub(crate) fn apply_shares(
    cores: &mut [sce_core::CacheCore],
    map: &sce_core::ShardMap,
    vols: &[crate::persist::OpenVolume],
    fragment_size: u64,
) {
    if vols.iter().all(|v| v.share.is_none()) {
        return;
    }
    for (k, core) in cores.iter_mut().enumerate() {
        let slots = core.geometry().slots() as f64;
        let parts: Vec<(u64, Option<u32>)> = vols
            .iter()
            .map(|v| {
                let cap = v.share.map(|f| ((f * slots).floor() as u32).max(1));
                (v.base / fragment_size, cap)
            })
            .collect();
        GlobalCore::new(core, map, k).set_shares(&parts);
    }
}

/// Starts a named thread running `f` on the engine.
fn spawn(
    engine: &Arc<Engine>,
    name: String,
    what: &str,
    f: impl FnOnce(&Engine) + Send + 'static,
) -> Result<JoinHandle<()>, IoError> {
    let e = engine.clone();
    std::thread::Builder::new()
        .name(name)
        .spawn(move || f(&e))
        .map_err(|err| IoError::Failed(format!("cannot start {what} thread: {err}")))
}

/// Fill writer threads: a read's inline fills are written by them, after its reply.
const FILL_WRITERS: usize = 2;

/// Starts the path's threads (the AWT writers, or the cleaners), the fill writers, the
/// population workers and, with persistence, the flusher and the intent writer.
fn start_threads(
    engine: &Arc<Engine>,
    path: &WritePath,
    config: &EngineConfig,
    rx: crossbeam_channel::Receiver<AwtJob>,
) -> Result<Vec<JoinHandle<()>>, IoError> {
    let workers = if config.background_population {
        config.core.throttle.max_workers
    } else {
        0
    };
    let mut threads = Vec::new();
    match path {
        WritePath::Through(_) => {
            for i in 0..config.awt_threads.max(1) {
                let rx = rx.clone();
                let name = format!("sce-awt-{i}");
                threads.push(spawn(engine, name, "AWT", move |e| awt_writer(e, rx))?);
            }
        }
        WritePath::Log(l) => {
            let l = l.clone();
            threads.push(spawn(engine, "sce-clean-0".into(), "cleaner", move |e| {
                l.cleaner(&e.log_io())
            })?);
        }
    }
    let (tx, rx) = crossbeam_channel::unbounded();
    engine.keeper().fills.open(tx);
    for i in 0..FILL_WRITERS {
        let rx = rx.clone();
        let name = format!("sce-fill-{i}");
        threads.push(spawn(engine, name, "fill", move |e| fill_writer(e, rx))?);
    }
    for i in 0..workers {
        let name = format!("sce-pop-{i}");
        threads.push(spawn(engine, name, "population", move |e| {
            population_worker(e, i)
        })?);
    }
    let persist = engine.keeper().persist;
    if persist.is_some() {
        threads.push(spawn(engine, "sce-meta".into(), "metadata", flusher)?);
        threads.push(spawn(engine, "sce-intent".into(), "intent", intent_writer)?);
    }
    if persist.is_some_and(|p| p.has_refill()) {
        threads.push(spawn(
            engine,
            "sce-refill".into(),
            "refill",
            crate::refill::refill,
        )?);
    }
    Ok(threads)
}

impl CacheVolume {
    /// Opens one cached volume over several sources (`parts`, which keep their order) on
    /// one cache device: they share its slots under one eviction policy, and each keeps its
    /// own entry in the device's volume table. Offsets are in the shared address space:
    /// volume `k` starts at [`CacheVolume::volumes`]`()[k].base`.
    pub fn open_shared(
        parts: Vec<crate::VolumePart>,
        cache: Arc<dyn BlockDevice>,
        config: EngineConfig,
    ) -> Result<CacheVolume, EngineError> {
        if parts.is_empty() {
            return Err(IoError::Invalid("no volume to cache".into()).into());
        }
        let fsize = config.core.fragment_size.max(1);
        let concat = crate::parts::Concat::new(&parts, fsize)?;
        let placed = concat.placement();
        let vols: Vec<OpenVolume> = parts
            .iter()
            .zip(&placed)
            .map(|(p, at)| OpenVolume {
                name: p.name.clone(),
                size: at.size,
                base: at.base,
                identity: p.source.identity(),
                source_generation: p.source_generation.clone(),
                forget: p.forget,
                share: p.share,
            })
            .collect();
        let infos = parts
            .into_iter()
            .zip(placed)
            .map(|(p, at)| PartInfo {
                name: p.name,
                at,
                source: p.source,
                wrote: Default::default(),
            })
            .collect();
        CacheVolume::open_parts(Arc::new(concat), infos, &vols, cache, config)
    }

    /// Opens a cached volume over `source`, using `cache` as the cache device. The cache holds
    /// `cache.size() / fragment_size` slots. Starts the AWT writers and, unless disabled, the
    /// population workers.
    pub fn open(
        source: Arc<dyn BlockDevice>,
        cache: Arc<dyn BlockDevice>,
        config: EngineConfig,
    ) -> Result<CacheVolume, EngineError> {
        let pc = config.persist.as_ref();
        let part = PartInfo {
            name: pc.map_or_else(|| "source".into(), |p| p.volume_name.clone()),
            at: Placed {
                base: 0,
                size: source.size(),
            },
            source: source.clone(),
            wrote: Default::default(),
        };
        let vol = OpenVolume {
            name: part.name.clone(),
            size: source.size(),
            base: 0,
            identity: source.identity(),
            source_generation: pc.and_then(|p| p.source_generation.clone()),
            forget: pc.is_some_and(|p| p.forget_volume),
            share: None,
        };
        Self::open_parts(source, vec![part], &[vol], cache, config)
    }

    /// `open` for the volumes `parts` (`vols` as the store opens them) laid out in `source`.
    pub(crate) fn open_parts(
        source: Arc<dyn BlockDevice>,
        parts: Vec<PartInfo>,
        vols: &[OpenVolume],
        cache: Arc<dyn BlockDevice>,
        config: EngineConfig,
    ) -> Result<CacheVolume, EngineError> {
        engine_supports(&config.core, config.persist.as_ref())?;
        let lbs = source
            .logical_block_size()
            .max(cache.logical_block_size())
            .max(512);
        if lbs > 4096 {
            return Err(ConfigError::new(
                "logical_block_size",
                format!("{lbs} bytes is larger than a 4 KiB page"),
            )
            .into());
        }
        let o = open_core(&*source, vols, cache, &config)?;
        let (source, read_ahead) = if config.read_ahead {
            let ra = Arc::new(crate::readahead::ReadAhead::new(source)?);
            (ra.clone() as Arc<dyn BlockDevice>, Some(ra))
        } else {
            (source, None)
        };
        // Where each volume ends (the log clamps its cleaning there).
        let ends: Vec<u64> = parts.iter().map(|p| p.at.base + p.at.size).collect();
        let fshift = o.cores[0].geometry().fragment_shift();
        let persist = o.persist.map(Arc::new);
        let engine = Arc::new(Engine::new(EngineParts {
            checks: Checks::new(o.crcs, o.seeds, source.size(), fshift),
            dev: Devices::new(source, o.data, lbs, parts).with_read_ahead(read_ahead),
            cores: Cores::new(o.cores, o.map),
            config: o.config,
            health: Health::new(config.error_limit),
            persist: persist.clone(),
            fshift,
            holds_dirty: config.core.write_mode == sce_core::WriteMode::WriteBack,
        }));
        let (tx, rx) = crossbeam_channel::unbounded::<AwtJob>();
        let limits = (config.writeback_wait, config.writeback_idle);
        let log = match &persist {
            // Replayed in every mode: another mode refuses a log that holds dirty pages.
            Some(p) => {
                let through = WriteThrough::new(tx.clone());
                let l = crate::log::open_log(&o.device, p, through, o.log, limits, &ends)?;
                if let Some(l) = &l {
                    l.set_sequential_cutoff(config.core.sequential_cutoff);
                    l.set_tuning(&config.core.writeback);
                    l.set_shares(&vols.iter().map(|v| v.share).collect::<Vec<_>>());
                    l.claim_lent(&engine.log_io(), o.log)?;
                }
                l
            }
            None => None,
        };
        let path = match log {
            Some(l) if o.log => WritePath::Log(Arc::new(l)),
            _ => WritePath::Through(WriteThrough::new(tx)),
        };
        let threads = start_threads(&engine, &path, &config, rx)?;
        // The whole open went through: what the operator gave up is gone now.
        crate::persist::log_dropped(&o.given_up, "a start that does not serve them");
        Ok(CacheVolume {
            engine,
            path,
            threads: Mutex::new(threads),
        })
    }
}
