//! Opening an export: checks that no export uses another's device, parses its settings,
//! opens its source (an NBD client, or a local file held locked) and cache device, and
//! opens the cached volume over them. What serves it is assembled in [`crate::group`].

use crate::admission::AdmissionOptions;
use crate::config::{ExportConfig, LogSize, ServeConfig};
use crate::ownership::{self, Contents};
use crate::LOG_TARGET;
use anyhow::{anyhow, bail, Context, Result};
use sce_core::units::parse_size;
use sce_core::{Admission, CoreConfig, EvictionKind, WriteMode};
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::{BlockDevice, FileDevice, FileOptions, LockMode};
use sce_nbd::{NbdClient, NbdUri};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Refuses exports that share storage: no export may use a source (its own or another's)
/// as a cache, nor the same storage under two names as two caches, and no two may cache
/// the same NBD export. Exports that name the same cache share it (`crate::group`).
pub fn check_ownership(exports: &[ExportConfig]) -> Result<()> {
    let mut claims = Vec::new();
    for spec in exports {
        claims.push(ownership::Claim {
            export: spec.name.clone(),
            role: "source",
            path: spec.source.clone(),
        });
        if let Some(c) = &spec.cache {
            claims.push(ownership::Claim {
                export: spec.name.clone(),
                role: "cache",
                path: c.display().to_string(),
            });
        }
    }
    ownership::refuse_overlaps(&claims)?;
    // Two caches of one NBD export would never see each other's writes.
    let mut cached_uris: Vec<&str> = exports
        .iter()
        .filter(|e| e.cache.is_some() && e.source.contains("://"))
        .map(|e| e.source.as_str())
        .collect();
    cached_uris.sort_unstable();
    if let Some(w) = cached_uris.windows(2).find(|w| w[0] == w[1]) {
        bail!(
            "two exports cache the same source {}: neither cache would see the other's writes",
            w[0]
        );
    }
    Ok(())
}

/// Parses an optional text field of an export.
fn field<T: std::str::FromStr<Err = String>>(
    v: &Option<String>,
    what: &str,
    export: &str,
) -> Result<Option<T>> {
    v.as_deref()
        .map(|s| {
            s.parse::<T>()
                .map_err(|e| anyhow!("export {export:?}: {what}: {e}"))
        })
        .transpose()
}

/// Parses an optional size field of an export.
pub(crate) fn size_field(v: &Option<String>, what: &str, export: &str) -> Result<Option<u64>> {
    v.as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| anyhow!("export {export:?}: {what}: {e}"))
}

/// A source as a device (watched: every request's outcome tells its health), as a local
/// file or device if it is one, and its health.
type OpenedSource = (
    Arc<dyn BlockDevice>,
    Option<Arc<FileDevice>>,
    crate::health::WatchedSource,
);

/// Opens an export's source: an NBD client, or a local file or device (also returned as
/// such, for its I/O queue, which records its outcomes in the same watch), watched.
pub(crate) fn open_source(spec: &ExportConfig, cfg: &ServeConfig) -> Result<OpenedSource> {
    let (dev, local) = open_source_device(spec, cfg)?;
    let what = format!("the source of export {:?} ({})", spec.name, spec.source);
    let watched = Arc::new(sce_io::WatchedDevice::new(dev, what));
    Ok((watched.clone(), local, watched))
}

/// A source as a device, and as a local file or device if it is one.
type SourceDevice = (Arc<dyn BlockDevice>, Option<Arc<FileDevice>>);

fn open_source_device(spec: &ExportConfig, cfg: &ServeConfig) -> Result<SourceDevice> {
    if let Some(dev) = cfg.devices.get(&spec.source) {
        return Ok((dev, None));
    }
    if spec.source.starts_with("nbd://") || spec.source.starts_with("nbd+unix://") {
        let uri: NbdUri = spec.source.parse().map_err(|e: String| anyhow!(e))?;
        let opts = sce_nbd::ClientOptions {
            request_timeout: cfg.source_timeout.max(Duration::from_millis(100)),
            queue_depth: cfg.source_queue_depth.max(1),
            ..sce_nbd::ClientOptions::default()
        };
        let client = NbdClient::connect_with(&uri, cfg.source_connections, opts)?;
        return Ok((Arc::new(client), None));
    }
    // A local source is held locked while served: exclusively when it is cached or written
    // (a second cache of it would never see this one's writes), shared when only read, or
    // in shared mode, where the other hosts' caches do see this one's writes.
    let coherent = cfg.shared.is_some() && spec.cache.is_some();
    let lock = if (spec.cache.is_none() && spec.read_only) || coherent {
        LockMode::Shared
    } else {
        LockMode::Exclusive
    };
    let opts = FileOptions {
        direct: cfg.direct,
        create_size: None,
        read_only: spec.read_only,
        lock,
    };
    let f = Arc::new(FileDevice::open(Path::new(&spec.source), &opts)?);
    Ok((f.clone(), Some(f)))
}

/// An export's cache device, opened: as a device, and as the file or block device it is
/// (for its I/O queue) unless a test's device table gave it.
#[derive(Clone)]
pub(crate) struct CacheDev {
    pub(crate) dev: Arc<dyn BlockDevice>,
    pub(crate) file: Option<Arc<FileDevice>>,
}

/// Opens the cache device, locked exclusively, refusing to resize an existing file. The
/// flag says whether this open created the file (so that a failed start removes it).
pub(crate) fn open_cache(
    path: &Path,
    size: Option<u64>,
    cfg: &ServeConfig,
    export: &str,
) -> Result<(CacheDev, bool)> {
    if let Some(dev) = cfg.devices.get(&path.to_string_lossy()) {
        return Ok((CacheDev { dev, file: None }, false));
    }
    let opts = FileOptions {
        direct: cfg.direct,
        create_size: size,
        read_only: false,
        lock: LockMode::Exclusive,
    };
    match FileDevice::open(path, &opts) {
        Ok(d) => {
            let created = d.created();
            if created {
                // The size as understood, in both units: `1GB` is 10^9 bytes, `1G` 2^30.
                let n = d.size();
                tracing::info!(
                    target: LOG_TARGET,
                    "created the cache {} of {} ({n} bytes)",
                    path.display(),
                    sce_core::units::format_size(n)
                );
            }
            let f = Arc::new(d);
            Ok((
                CacheDev {
                    dev: f.clone(),
                    file: Some(f),
                },
                created,
            ))
        }
        Err(sce_io::IoError::Invalid(m)) if m.contains("refusing to resize") => bail!(
            "export {export:?}: cache {}: {m}. sce never resizes a cache: omit --cache-size to \
             use it at its size, or remove the file (or reformat it with `sce format --force`) \
             to start over at another size",
            path.display()
        ),
        Err(e) => Err(e).with_context(|| format!("export {export:?}: cache {}", path.display())),
    }
}

/// The core configuration an export declares, every field checked (whether or not the
/// export has a cache). The admission options that depend on the cache's size are applied
/// again once it is known.
pub(crate) fn core_config(spec: &ExportConfig) -> Result<CoreConfig> {
    let n = &spec.name;
    let mut core = CoreConfig::default();
    if let Some(m) = field::<WriteMode>(&spec.mode, "mode", n)? {
        core.write_mode = m;
    }
    if let Some(m) = field::<Admission>(&spec.admission, "admission", n)? {
        core.admission = m;
    }
    if let Some(e) = field::<EvictionKind>(&spec.eviction, "eviction", n)? {
        core.eviction = e;
    }
    let fragment = size_field(&spec.fragment_size, "fragment_size", n)?;
    let line = size_field(&spec.line_size, "line_size", n)?;
    let heat = fragment.unwrap_or(core.fragment_size);
    if let Some(l) = line.filter(|&l| l > heat) {
        bail!(
            "export {n:?}: line_size {l} is larger than the fragment size {heat} (a line is a \
             part of a fragment)"
        );
    }
    crate::admission::geometry(&mut core, fragment, line);
    if let Some(t) = spec.target_missrate {
        core.throttle.target_missrate = t;
    }
    if let Some(on) = spec.awt {
        core.write_mode = core.write_mode.with_awt(on);
    }
    if let Some(h) = spec.hot_window {
        core.hot_window = h;
    }
    if let Some(b) = size_field(&spec.awt_budget, "awt_budget", n)? {
        core.awt_budget = b;
    }
    if let Some(p) = &spec.period {
        core.throttle.period =
            sce_core::units::parse_duration(p).map_err(|e| anyhow!("export {n:?}: period: {e}"))?;
    }
    if let Some(p) = spec.min_free_pcnt {
        if !(0.0..=100.0).contains(&p) {
            bail!("export {n:?}: min_free_pcnt: {p} is not a percentage (0 to 100)");
        }
        core.throttle.min_free_pcnt = p;
    }
    if let Some(e) = spec.evict_for_population {
        core.throttle.allow_eviction = e;
    }
    writeback_tuning(spec, &mut core.writeback)?;
    admission_options(spec)?.apply(&mut core, 1 << 30);
    core.validate().map_err(|e| anyhow!("export {n:?}: {e}"))?;
    Ok(core)
}

/// An export's write-back cleaning settings, over the defaults.
fn writeback_tuning(spec: &ExportConfig, t: &mut sce_core::WritebackTuning) -> Result<()> {
    use sce_core::wbtune::{parse_rate, parse_share};
    let n = &spec.name;
    let bad = |k: &str, e: String| anyhow!("export {n:?}: {k}: {e}");
    if let Some(s) = &spec.writeback_low_watermark {
        t.low_watermark = parse_share(s).map_err(|e| bad("writeback_low_watermark", e))?;
    }
    if let Some(s) = &spec.writeback_high_watermark {
        t.high_watermark = parse_share(s).map_err(|e| bad("writeback_high_watermark", e))?;
    }
    if let Some(s) = &spec.writeback_rate {
        t.rate = parse_rate(s).map_err(|e| bad("writeback_rate", e))?;
    }
    Ok(())
}

/// The admission options of an export: the parsed ones it carries, or its text fields.
fn admission_options(spec: &ExportConfig) -> Result<AdmissionOptions> {
    if let Some(o) = &spec.admission_options {
        return Ok(o.clone());
    }
    let n = &spec.name;
    Ok(AdmissionOptions {
        population_rate: field(&spec.population_rate, "population_rate", n)?,
        sequential_cutoff: size_field(&spec.sequential_cutoff, "sequential_cutoff", n)?,
        admission_margin: spec.admission_margin,
        partial_fill: spec.partial_fill.unwrap_or(false),
        miss_fills: field(&spec.miss_fills.as_ref().map(|m| m.text()), "miss_fills", n)?,
        recency_window: field(&spec.recency_window, "recency_window", n)?,
        dense_line: field(&spec.dense_line, "dense_line", n)?,
        max_cache_writes: field(&spec.max_cache_writes, "max_cache_writes", n)?,
    })
}

/// Opens the cache device at `cache_path` (created with the spec's size if missing; a file
/// this call created is removed again if it fails) and the cached volume over `source`.
pub fn open_volume(
    spec: &ExportConfig,
    cfg: &ServeConfig,
    core: CoreConfig,
    source: Arc<dyn BlockDevice>,
    cache_path: &Path,
) -> Result<Arc<CacheVolume>> {
    let n = &spec.name;
    let cache_size = size_field(&spec.cache_size, "cache_size", n)?;
    let named = cfg.devices.get(&cache_path.to_string_lossy()).is_some();
    if cache_size.is_none() && !cache_path.exists() && !named {
        bail!(
            "export {n:?}: cache {} does not exist; give a cache size to create it",
            cache_path.display()
        );
    }
    let (cache_dev, created) = open_cache(cache_path, cache_size, cfg, n)?;
    let open = |cache, engine| CacheVolume::open(source, cache, engine);
    let built = build_cached(spec, cfg, core, open, cache_dev, cache_path);
    if built.is_err() && created {
        // Leave nothing behind: the file was ours, made by this start.
        let _ = std::fs::remove_file(cache_path);
    }
    built
}

/// The core configuration of an export, checked (for `attach`).
pub fn core_of(spec: &ExportConfig) -> Result<CoreConfig> {
    core_config(spec)
}

/// A formatted device brings its slot size when none is asked for. Its heat size is not
/// recorded, and the core shards stripe the source by it, so a restart must find the one the
/// device was served with: the default geometry's (1 MiB over 512 KiB lines) for slots of the
/// default line under admission sce (`core` has it then), and the slot itself for any other
/// (as every device was served before lines).
fn device_geometry(core: &mut CoreConfig, cache: &dyn BlockDevice) {
    if let Ok(sb) = sce_store::read_superblock(cache) {
        let slot = sb.layout.fragment_size;
        let default_lines =
            core.heat_size > core.fragment_size && slot == crate::admission::DEFAULT_LINE_SIZE;
        core.fragment_size = slot;
        if !default_lines {
            core.heat_size = 0;
        }
    }
}

/// The rest of `open_volume` once the cache device is open (`open` opens the volume: over
/// one source, or several sharing the device).
pub(crate) fn build_cached<'a>(
    spec: &ExportConfig,
    cfg: &ServeConfig,
    mut core: CoreConfig,
    open: impl FnOnce(Arc<dyn BlockDevice>, EngineConfig) -> Result<CacheVolume, sce_engine::EngineError>
        + 'a,
    cache_dev: CacheDev,
    cache_path: &Path,
) -> Result<Arc<CacheVolume>> {
    let n = &spec.name;
    let persist_wanted = spec.persist.unwrap_or(true) && cfg.persist;
    let found = check_cache_contents(spec, cfg, &*cache_dev.dev, cache_path, persist_wanted)?;
    let cache = cache_device(cache_dev.dev.clone(), persist_wanted)
        .with_context(|| format!("export {n:?}: cache {}", cache_path.display()))?;
    let persist = persist_wanted
        .then(|| persist_config(spec, cfg, &found, cache.size()))
        .transpose()?;
    if persist.is_some() && spec.fragment_size.is_none() && spec.line_size.is_none() {
        device_geometry(&mut core, &*cache);
    }
    admission_options(spec)?.apply(&mut core, cache.size());
    let persistent = persist.is_some();
    tracing::debug!(
        target: LOG_TARGET,
        export = n,
        mode = %core.write_mode,
        admission = %core.admission,
        fragment_size = core.fragment_size,
        eviction = %core.eviction,
        persistent,
        "cache settings"
    );
    let engine = EngineConfig {
        core,
        persist,
        error_limit: cfg.error_limit,
        // In shared mode other hosts write the source too: no read-ahead of it.
        read_ahead: cfg.shared.is_none(),
        ..EngineConfig::default()
    };
    let volume = Arc::new(open(cache, engine).with_context(|| format!("export {n:?}"))?);
    log_loaded(n, &volume, persistent);
    // Hits are read through an I/O queue on the cache device (io_uring), started by the
    // connection's reader; the volume's data starts after the volatile header when it
    // does not persist.
    let hits: Arc<dyn sce_io::IoQueue> = match cache_dev.file {
        Some(f) => sce_io::open_queue(f, cfg.io_backend, sce_io::queue::DEFAULT_DEPTH)
            .with_context(|| format!("export {n:?}: I/O backend {}", cfg.io_backend))?,
        None => Arc::new(sce_io::queue::ThreadQueue::new(
            cache_dev.dev,
            sce_io::queue::DEFAULT_THREADS,
        )),
    };
    tracing::info!(
        "export {n:?}: hits through {} on {}",
        hits.backend(),
        cache_path.display()
    );
    let base = if persistent {
        0
    } else {
        ownership::VOLATILE_HEADER
    };
    volume.serve_hits_from(hits, base);
    Ok(volume)
}

/// Never formats or overwrites what is not ours: looks at what the cache device holds and
/// refuses foreign data (without `force`) and a persistent cache about to be used as a
/// non-persistent one (without `force` or `reformat`).
fn check_cache_contents(
    spec: &ExportConfig,
    cfg: &ServeConfig,
    cache_dev: &dyn BlockDevice,
    cache_path: &Path,
    persist_wanted: bool,
) -> Result<Contents> {
    let n = &spec.name;
    let found = ownership::contents_at(cache_dev, Some(cache_path))
        .with_context(|| format!("export {n:?}: reading cache {}", cache_path.display()))?;
    if let Contents::Foreign(what) = &found {
        if !cfg.force {
            bail!(
                "export {n:?}: cache {} holds data that is not an sce cache ({what}); refusing \
                 to overwrite it. Pass --force if it really is meant to be the cache (its \
                 contents are lost)",
                cache_path.display()
            );
        }
        tracing::warn!(target: LOG_TARGET, export = n, "--force: overwriting {}: {what}", cache_path.display());
    }
    if !persist_wanted && matches!(found, Contents::SceCache) && !cfg.force && !cfg.reformat {
        bail!(
            "export {n:?}: cache {} holds a persistent sce cache; --no-persist would overwrite it. \
             Pass --reformat (or --force) to use it as a cache that starts cold",
            cache_path.display()
        );
    }
    Ok(found)
}

/// The device the cache uses: all of it when persistent; else all but a first 8 KiB that
/// hold a marker, so that the next start knows the device is sce's to overwrite.
fn cache_device(cache_dev: Arc<dyn BlockDevice>, persist: bool) -> Result<Arc<dyn BlockDevice>> {
    if persist {
        return Ok(cache_dev);
    }
    if cache_dev.size() <= ownership::VOLATILE_HEADER {
        bail!(
            "{} bytes are too few for a cache that does not persist (its first {} bytes hold \
             a marker)",
            cache_dev.size(),
            ownership::VOLATILE_HEADER
        );
    }
    ownership::mark_volatile(&*cache_dev)?;
    let size = cache_dev.size() - ownership::VOLATILE_HEADER;
    Ok(Arc::new(sce_io::SliceDevice::new(
        cache_dev,
        ownership::VOLATILE_HEADER,
        size,
    )?))
}

/// How a persistent cache is kept: under the source's name, reformatted if it held
/// something else.
pub(crate) fn persist_config(
    spec: &ExportConfig,
    cfg: &ServeConfig,
    found: &Contents,
    device_bytes: u64,
) -> Result<PersistConfig> {
    let name = spec
        .source_name
        .clone()
        .unwrap_or_else(|| source_identity(&spec.source));
    let p = PersistConfig {
        reformat: cfg.reformat || matches!(found, Contents::Foreign(_) | Contents::VolatileCache),
        forget_volume: cfg.forget_volume,
        discard_dirty: cfg.discard_dirty.clone(),
        reattach: cfg.reattach,
        keep_detached_mark: cfg.keep_detached_mark,
        own_writes: cfg.own_writes,
        state_dir: Some(cfg.state_dir.clone()),
        flush_interval: cfg.metadata_interval,
        journal: spec.crash_journal.unwrap_or(cfg.crash_journal),
        // Shared mode serves write-through only: auto gives its caches no log.
        writeback_log: match cfg.writeback_log {
            LogSize::Auto if cfg.shared.is_some() => 0,
            l => l.bytes(device_bytes),
        },
        writeback_grow: cfg.writeback_grow.explicit(),
        warm_rounds: if cfg.write_hot {
            PersistConfig::new("").warm_rounds
        } else {
            0
        },
        source_generation: spec
            .source_generation
            .clone()
            .or_else(|| cfg.source_generation.clone()),
        ..PersistConfig::new(name)
    };
    if p.volume_name.len() > sce_store::superblock::MAX_NAME {
        bail!(
            "export {:?}: the source name is longer than {} bytes; give a shorter one with --source-name",
            spec.name,
            sce_store::superblock::MAX_NAME
        );
    }
    Ok(p)
}

/// Logs how the cache device was found and loaded.
fn log_loaded(n: &str, volume: &CacheVolume, persistent: bool) {
    if let Some(p) = volume.persist_stats() {
        tracing::info!(
            target: LOG_TARGET,
            export = n,
            formatted = p.formatted_now,
            previous_shutdown_clean = p.previous_shutdown_clean,
            fragments_restored = p.fragments_restored,
            dropped_by_intent = p.fragments_dropped_intent,
            dropped_bad_metadata = p.fragments_dropped_bad_metadata,
            crash_journal = p.journal,
            journal_blocks_replayed = p.journal_blocks_replayed,
            journal_fragments_hit = p.journal_fragments_hit,
            journal_pages_dropped = p.journal_pages_dropped,
            load_ms = p.load_millis,
            "cache device loaded"
        );
    } else if !persistent {
        tracing::info!(target: LOG_TARGET, export = n, "cache is not persistent: starting cold");
    }
}

/// The name a source gets in the volume table: its canonical path, or the URI as given.
pub(crate) fn source_identity(source: &str) -> String {
    if source.contains("://") {
        return source.to_string();
    }
    std::fs::canonicalize(source)
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| source.to_string())
}

/// An export's `cache_share`: "40%" or "0.4", a fraction above 0 and at most 1.
pub fn share(s: &ExportConfig) -> Result<Option<f64>> {
    let Some(text) = s.cache_share.as_deref() else {
        return Ok(None);
    };
    let t = text.trim();
    let v = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|x| x / 100.0),
        None => t.parse::<f64>(),
    };
    match v {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(Some(x)),
        _ => bail!(
            "export {:?}: cache_share: {text:?} is not a share of the device (like \"40%\" or 0.4)",
            s.name
        ),
    }
}
