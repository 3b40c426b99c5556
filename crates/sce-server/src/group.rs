//! The exports of a [`ServeConfig`], built: each source and its cache (opened by
//! [`crate::export`]) made into what the NBD server serves, a cached export as an
//! [`Attachable`].
//!
//! Exports that name the same cache device share it (Mercury's volume table): one cached
//! volume over their sources, one slot pool and eviction policy, each export with its own
//! entry in the device's volume table (generation, identity), its own counts, and `forget`
//! and `detach` of its own. The cache's settings (mode, admission, eviction, fragment size,
//! tuning, persistence) belong to the device, so the exports must agree on them.

use crate::attach::{Attachable, Part};
use crate::config::{ExportConfig, ServeConfig};
use crate::export;
use crate::ownership::canonical_name;
use anyhow::{bail, Context, Result};
use sce_engine::{CacheVolume, VolumePart};
use sce_nbd::{Export, ExportIo};
use std::path::PathBuf;
use std::sync::Arc;

/// Builds every export of `cfg`, in order: those that share a cache device together.
pub fn build_all(cfg: &ServeConfig) -> Result<Vec<Built>> {
    let mut groups: Vec<(PathBuf, Vec<usize>)> = Vec::new();
    for (i, spec) in cfg.exports.iter().enumerate() {
        if let Some(c) = &spec.cache {
            let key = canonical_name(c);
            match groups.iter_mut().find(|g| g.0 == key) {
                Some(g) => g.1.push(i),
                None => groups.push((key, vec![i])),
            }
        }
    }
    let mut out: Vec<Option<Built>> = cfg.exports.iter().map(|_| None).collect();
    for (_, members) in groups.iter().filter(|g| g.1.len() > 1) {
        let specs: Vec<&ExportConfig> = members.iter().map(|&i| &cfg.exports[i]).collect();
        for (i, b) in members.iter().zip(build_group(&specs, cfg)?) {
            out[*i] = Some(b);
        }
    }
    let mut built = Vec::with_capacity(out.len());
    for (spec, b) in cfg.exports.iter().zip(out) {
        built.push(match b {
            Some(b) => b,
            None => build(spec, cfg)?,
        });
    }
    Ok(built)
}

/// Refuses exports that share a device but disagree on what belongs to the device.
fn agree(specs: &[&ExportConfig]) -> Result<()> {
    let first = specs[0];
    let core = export::core_config(first)?;
    let size = |s: &ExportConfig| export::size_field(&s.cache_size, "cache_size", &s.name);
    let cache = first.cache.as_deref().unwrap_or(std::path::Path::new(""));
    for s in &specs[1..] {
        let differ = |what: &str| {
            anyhow::anyhow!(
                "exports {:?} and {:?} share the cache device {} but give it different {what}: \
                 the device's settings are shared, so give them the same (or set them on one \
                 export only, where that is allowed)",
                first.name,
                s.name,
                cache.display()
            )
        };
        if export::core_config(s)? != core {
            return Err(differ(
                "cache settings (mode, admission, eviction, fragment size or tuning)",
            ));
        }
        if s.persist != first.persist || s.crash_journal != first.crash_journal {
            return Err(differ("persistence settings (persist, crash_journal)"));
        }
        if let (Some(a), Some(b)) = (size(first)?, size(s)?) {
            if a != b {
                return Err(differ("sizes (cache_size)"));
            }
        }
    }
    Ok(())
}

/// Builds the exports `specs` that share one cache device.
fn build_group(specs: &[&ExportConfig], cfg: &ServeConfig) -> Result<Vec<Built>> {
    agree(specs)?;
    let first = specs[0];
    let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let cache_path = first.cache.clone().expect("a group shares a cache");
    let (parts, watched) = parts_of(specs, cfg)?;
    let sources: Vec<_> = parts.iter().map(|p| p.source.clone()).collect();
    let mut cache_size = None;
    for s in specs {
        cache_size = cache_size.or(export::size_field(&s.cache_size, "cache_size", &s.name)?);
    }
    let named = cfg.devices.get(&cache_path.to_string_lossy()).is_some();
    if cache_size.is_none() && !cache_path.exists() && !named {
        bail!(
            "exports {names:?}: cache {} does not exist; give a cache size to create it",
            cache_path.display()
        );
    }
    let (cache_dev, created) = export::open_cache(&cache_path, cache_size, cfg, &first.name)?;
    let core = export::core_config(first)?;
    let open = |cache, engine| CacheVolume::open_shared(parts, cache, engine);
    let volume = export::build_cached(first, cfg, core, open, cache_dev, &cache_path)
        .with_context(|| format!("exports {names:?} sharing {}", cache_path.display()));
    let volume = match volume {
        Ok(v) => v,
        Err(e) => {
            if created {
                let _ = std::fs::remove_file(&cache_path);
            }
            return Err(e);
        }
    };
    let placed = volume.volumes();
    tracing::info!(
        target: crate::LOG_TARGET,
        cache = %cache_path.display(),
        exports = ?names,
        "exports share one cache device"
    );
    let mut built = Vec::new();
    for (k, s) in specs.iter().enumerate() {
        let part = Part {
            index: k,
            base: placed[k].1.base,
            siblings: names.iter().filter(|n| **n != s.name).cloned().collect(),
        };
        let source = (sources[k].clone(), watched[k].clone());
        built.push(member(s, cfg, source, &volume, part, &cache_path));
    }
    Ok(built)
}

/// Opens the sources of `specs`, each also as a volume of the shared cache, and their
/// health.
fn parts_of(
    specs: &[&ExportConfig],
    cfg: &ServeConfig,
) -> Result<(Vec<VolumePart>, crate::health::Sources)> {
    let (mut parts, mut watched) = (Vec::new(), Vec::new());
    for s in specs {
        let (source, _, w) = export::open_source(s, cfg)
            .with_context(|| format!("export {:?}: source {}", s.name, s.source))?;
        let name = s
            .source_name
            .clone()
            .unwrap_or_else(|| export::source_identity(&s.source));
        if name.len() > sce_store::superblock::MAX_NAME {
            bail!(
                "export {:?}: the source name is longer than {} bytes; give a shorter one with source_name",
                s.name,
                sce_store::superblock::MAX_NAME
            );
        }
        parts.push(VolumePart {
            name,
            source: source.clone(),
            source_generation: s
                .source_generation
                .clone()
                .or_else(|| cfg.source_generation.clone()),
            forget: cfg.forget_volume,
            share: export::share(s)?,
        });
        watched.push(w);
    }
    Ok((parts, watched))
}

/// The export `s` of a shared cache `volume`, where it is `part`.
fn member(
    s: &ExportConfig,
    cfg: &ServeConfig,
    (source, watched): (Arc<dyn sce_io::BlockDevice>, crate::health::WatchedSource),
    volume: &Arc<CacheVolume>,
    part: Part,
    cache_path: &std::path::Path,
) -> Built {
    let description = format!(
        "{} cached on {} (shared with {})",
        s.source,
        cache_path.display(),
        part.siblings.join(", ")
    );
    let att = Attachable::new_part(s.clone(), cfg.clone(), source, volume.clone(), Some(part));
    cached(s, description, att, watched)
}

/// An export ready to serve, and its cached volume if it has a cache.
pub struct Built {
    /// What the NBD server serves.
    pub export: Export,
    /// The cache in front of its source, which can be detached and attached (none for a
    /// source exported as it is).
    pub volume: Option<Arc<Attachable>>,
    /// Its source's health.
    pub source: crate::health::WatchedSource,
}

/// Builds one export: its source, and its cached volume if it has a cache. A cache file
/// this start created is removed again if the build fails.
pub fn build(spec: &ExportConfig, cfg: &ServeConfig) -> Result<Built> {
    let n = &spec.name;
    if export::share(spec)?.is_some() {
        bail!(
            "export {n:?}: cache_share applies to exports that share a cache device (name the \
             same cache on several exports); this one has its device alone"
        );
    }
    let core = export::core_config(spec)?;
    let (source, local, watched) = export::open_source(spec, cfg)
        .with_context(|| format!("export {n:?}: source {}", spec.source))?;
    let Some(cache_path) = &spec.cache else {
        // A local file or device served plainly: through an I/O queue (io_uring).
        // Its requests go through the queue, not the watched device: the queue records
        // their outcomes in the same watch (status, sce_source_up, the outage log).
        let io = local
            .map(|f| sce_io::open_queue(f, cfg.io_backend, sce_io::queue::DEFAULT_DEPTH))
            .transpose()
            .map(|q| {
                q.map(|q| {
                    let w = sce_io::WatchedQueue::new(q, watched.clone());
                    ExportIo::Queue(Arc::new(w))
                })
            })
            .with_context(|| format!("export {n:?}: I/O backend {}", cfg.io_backend))?;
        if let Some(q) = io.as_ref().and_then(|io| io.queue()) {
            tracing::info!("export {n:?}: {} I/O on {}", q.backend(), spec.source);
        }
        return Ok(Built {
            export: Export {
                name: n.clone(),
                description: format!("{} (no cache)", spec.source),
                device: source,
                read_only: spec.read_only,
                prefetch: None,
                io,
            },
            volume: None,
            source: watched,
        });
    };
    let volume = export::open_volume(spec, cfg, core, source.clone(), cache_path)?;
    let att = Attachable::new(spec.clone(), cfg.clone(), source, volume);
    let description = format!("{} cached on {}", spec.source, cache_path.display());
    Ok(cached(spec, description, att, watched))
}

/// The export of `spec` served through its cache `att` (NBD CACHE prefetches into it; hits
/// are read through its I/O queue).
pub(crate) fn cached(
    spec: &ExportConfig,
    description: String,
    att: Arc<Attachable>,
    source: crate::health::WatchedSource,
) -> Built {
    let a = att.clone();
    Built {
        export: Export {
            name: spec.name.clone(),
            description,
            device: att.clone(),
            read_only: spec.read_only,
            prefetch: Some(Arc::new(move |o, l| a.prefetch(o, l))),
            io: Some(ExportIo::Reads(att.clone())),
        },
        volume: Some(att),
        source,
    }
}
