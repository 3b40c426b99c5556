//! `sce serve`: exports cached volumes over NBD, and `sce stats`: reads a running server's
//! counters from its metrics endpoint.
//!
//! One export comes from the flags, several from a TOML file. A source is a file, a block
//! device or an NBD URI; without a cache the source is exported as it is (the baseline of
//! every comparison). SIGTERM or SIGINT: stop accepting, answer or fail (ESHUTDOWN) what is
//! in flight, flush every export, exit 0.

use crate::ownership;
use crate::units::parse_size;
use anyhow::{anyhow, bail, Context, Result};
use sce_core::{Admission, CoreConfig, EvictionKind, WriteMode};
use sce_engine::{CacheVolume, EngineConfig, PersistConfig, PersistStats};
use sce_io::{BlockDevice, DirectMode, FileDevice, FileOptions, LockMode};
use sce_nbd::{listen_with, Export, ListenAddr, NbdClient, NbdUri, Server};
use serde::Deserialize;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of `sce serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// The source volume: a file, a block device, or an NBD URI (nbd://HOST:PORT/NAME,
    /// nbd+unix:///NAME?socket=PATH).
    #[arg(long)]
    pub source: Option<String>,
    /// The cache device (file or block device). Without it the source is exported as is.
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Where to listen: unix:PATH or tcp:HOST:PORT (repeatable).
    #[arg(long)]
    pub listen: Vec<ListenAddr>,
    /// Export name ("" is the default export).
    #[arg(long, default_value = "")]
    pub export: String,
    /// Create the cache file with this size if it does not exist. An existing cache is never
    /// resized: a different size is refused before anything is written.
    #[arg(long, value_parser = parse_size)]
    pub cache_size: Option<u64>,
    /// Use a cache device that holds data which is not an sce cache (its contents are lost).
    /// Without it such a device is refused.
    #[arg(long)]
    pub force: bool,
    /// A version string for the source's content, recorded with the cache: change it
    /// whenever the source was changed while sce was not running and sce cannot see it
    /// (an NBD export, a block device written by another host). A different value drops
    /// everything cached for the source at start.
    #[arg(long)]
    pub source_generation: Option<String>,
    /// Write mode: awt, write-around or write-through.
    #[arg(long)]
    pub mode: Option<WriteMode>,
    /// Admission: sce (flash-conscious, the default), sce-paper (the paper's Algorithm 1),
    /// always or nhit:K.
    #[arg(long)]
    pub admission: Option<Admission>,
    /// Options of admission sce and the endurance budget.
    #[command(flatten)]
    pub admission_opts: crate::policy_args::AdmissionArgs,
    /// Fragment size: a power of two from 4KiB to 64MiB.
    #[arg(long, value_parser = parse_size)]
    pub fragment_size: Option<u64>,
    /// Eviction policy: clock, lru or fifo.
    #[arg(long)]
    pub eviction: Option<EvictionKind>,
    /// Algorithm 1: populate only while the read miss rate is at least this (0..=1).
    #[arg(long)]
    pub target_missrate: Option<f64>,
    /// Export read-only.
    #[arg(long)]
    pub read_only: bool,
    /// A TOML file declaring listeners and one or more exports (see README).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Serve counters over HTTP at HOST:PORT: /metrics (Prometheus text), /stats (JSON).
    #[arg(long)]
    pub metrics: Option<String>,
    /// Fall back to buffered I/O where the filesystem refuses O_DIRECT.
    #[arg(long)]
    pub allow_buffered: bool,
    /// Use buffered I/O (the page cache) for files and devices instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// Connections to an NBD source (if it allows several, CAN_MULTI_CONN; else 1).
    #[arg(long, default_value_t = 4)]
    pub source_connections: usize,
    /// Requests in flight on each connection to an NBD source (pipelined, answered by
    /// cookie). With the default 4 connections, up to 128 requests reach the source at once.
    #[arg(long, default_value_t = 32)]
    pub source_queue_depth: usize,
    /// Do not keep the cache contents across restarts: the cache device holds data only and
    /// starts cold every time.
    #[arg(long)]
    pub no_persist: bool,
    /// Reformat the cache device if it belongs to another source, has another fragment size
    /// or format version, is corrupt, or was disabled after errors. Its contents are lost.
    #[arg(long)]
    pub reformat: bool,
    /// Invalidate everything the cache device holds for this source, at start.
    #[arg(long)]
    pub forget_volume: bool,
    /// The source's name in the cache device's volume table (default: the source's
    /// canonical path, or its URI).
    #[arg(long)]
    pub source_name: Option<String>,
    /// Host directory for failure markers of cache devices that failed and could not record
    /// it themselves.
    #[arg(long, default_value = "/var/lib/sce")]
    pub state_dir: PathBuf,
    /// Cache-device errors (I/O errors, checksum mismatches) after which the cache disables
    /// itself and passes I/O through to the source.
    #[arg(long, default_value_t = 16)]
    pub error_limit: u64,
    /// How often changed slot records are written and quiet write intents cleared. Shorter:
    /// more of the cache survives a crash, more metadata writes.
    #[arg(long, default_value = "1s", value_parser = parse_metadata_interval)]
    pub metadata_interval: Duration,
    /// NBD connections served at once; more are refused. Each costs two threads.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Close a client connection idle this long between requests (0: never; NBD clients
    /// such as qemu keep idle connections for hours).
    #[arg(long, default_value = "0s", value_parser = crate::units::parse_duration)]
    pub idle_timeout: Duration,
    /// Longest time a client may take to send a request once it started, or to read a
    /// reply: slower clients are disconnected.
    #[arg(long, default_value = "60s", value_parser = crate::units::parse_duration)]
    pub client_timeout: Duration,
    /// Payload bytes held in flight for all clients together (write data received, read
    /// replies not yet sent); clients wait beyond it.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub inflight_budget: u64,
    /// Permission bits of Unix sockets, in octal, whatever the umask.
    #[arg(long, default_value = "600", value_parser = parse_mode)]
    pub socket_mode: u32,
    /// An NBD source request that takes longer fails (EIO) and its connection is reopened;
    /// while the source is unreachable requests fail at once, never hang.
    #[arg(long, default_value = "60s", value_parser = crate::units::parse_duration)]
    pub source_timeout: Duration,
}

/// `--socket-mode`: octal permission bits.
fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s} is not an octal mode like 600 or 660"))
}

/// `--metadata-interval`: at least 10 ms (0 would make the flusher spin).
fn parse_metadata_interval(s: &str) -> Result<Duration, String> {
    let d = crate::units::parse_duration(s)?;
    if d < Duration::from_millis(10) {
        return Err(format!(
            "{s} is too short: the metadata interval must be at least 10ms"
        ));
    }
    Ok(d)
}

/// One export as declared.
#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
struct ExportSpec {
    #[serde(default)]
    name: String,
    source: String,
    cache: Option<PathBuf>,
    cache_size: Option<String>,
    mode: Option<String>,
    admission: Option<String>,
    fragment_size: Option<String>,
    eviction: Option<String>,
    target_missrate: Option<f64>,
    #[serde(default)]
    read_only: bool,
    /// Keep the cache contents across restarts (default true).
    persist: Option<bool>,
    source_name: Option<String>,
    source_generation: Option<String>,
    /// Admission sce: auto, auto:SIZE, SIZE (per second) or unlimited.
    population_rate: Option<String>,
    /// Admission sce: bytes of a sequential run from which it is bypassed (0: never).
    sequential_cutoff: Option<String>,
    /// Admission sce: touches by which a candidate must beat its victim.
    admission_margin: Option<u32>,
    /// Admission sce: fill only the touched parts of a fragment.
    partial_fill: Option<bool>,
    /// Endurance budget: SIZE per day or N dwpd.
    max_cache_writes: Option<String>,
    /// The export comes from the command line (whose admission options apply to it).
    #[serde(skip)]
    from_cli: bool,
}

/// The TOML file.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    listen: Vec<String>,
    metrics: Option<String>,
    #[serde(default)]
    export: Vec<ExportSpec>,
}

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

struct Built {
    export: Export,
    volume: Option<Arc<CacheVolume>>,
}

fn direct_mode(a: &ServeArgs) -> DirectMode {
    match (a.buffered, a.allow_buffered) {
        (true, _) => DirectMode::Off,
        (false, true) => DirectMode::Preferred,
        (false, false) => DirectMode::Required,
    }
}

fn open_source(spec: &ExportSpec, a: &ServeArgs) -> Result<Arc<dyn BlockDevice>> {
    if spec.source.starts_with("nbd://") || spec.source.starts_with("nbd+unix://") {
        let uri: NbdUri = spec.source.parse().map_err(|e: String| anyhow!(e))?;
        let opts = sce_nbd::ClientOptions {
            request_timeout: a.source_timeout.max(Duration::from_millis(100)),
            queue_depth: a.source_queue_depth.max(1),
            ..sce_nbd::ClientOptions::default()
        };
        return Ok(Arc::new(NbdClient::connect_with(
            &uri,
            a.source_connections,
            opts,
        )?));
    }
    let direct = direct_mode(a);
    // A local source is held locked while served: exclusively when it is cached or written
    // (a second cache of it would never see this one's writes), shared when only read.
    let lock = if spec.cache.is_none() && spec.read_only {
        LockMode::Shared
    } else {
        LockMode::Exclusive
    };
    let opts = FileOptions {
        direct,
        create_size: None,
        read_only: spec.read_only,
        lock,
    };
    Ok(Arc::new(FileDevice::open(Path::new(&spec.source), &opts)?))
}

/// Opens the cache device, locked exclusively, refusing to resize an existing file. The
/// flag says whether this open created the file (so that a failed start removes it).
fn open_cache(
    path: &Path,
    size: Option<u64>,
    direct: DirectMode,
    export: &str,
) -> Result<(Arc<FileDevice>, bool)> {
    let opts = FileOptions {
        direct,
        create_size: size,
        read_only: false,
        lock: LockMode::Exclusive,
    };
    match FileDevice::open(path, &opts) {
        Ok(d) => {
            let created = d.created();
            Ok((Arc::new(d), created))
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

fn build(spec: &ExportSpec, a: &ServeArgs) -> Result<Built> {
    let n = &spec.name;
    // Every field is checked, whether or not this export has a cache.
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
    if let Some(f) = &spec.fragment_size {
        core.fragment_size =
            parse_size(f).map_err(|e| anyhow!("export {n:?}: fragment_size: {e}"))?;
    }
    if let Some(t) = spec.target_missrate {
        core.throttle.target_missrate = t;
    }
    // Checked here, applied once the cache device's size is known (for N dwpd).
    admission_opts(spec, a)?.apply(&mut core, 1 << 30);
    core.validate().map_err(|e| anyhow!("export {n:?}: {e}"))?;
    let source =
        open_source(spec, a).with_context(|| format!("export {n:?}: source {}", spec.source))?;
    let Some(cache_path) = &spec.cache else {
        return Ok(Built {
            export: Export {
                name: n.clone(),
                description: format!("{} (no cache)", spec.source),
                device: source,
                read_only: spec.read_only,
                prefetch: None,
            },
            volume: None,
        });
    };
    let cache_size = spec
        .cache_size
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| anyhow!("export {n:?}: cache_size: {e}"))?;
    if cache_size.is_none() && !cache_path.exists() {
        bail!(
            "export {n:?}: cache {} does not exist; give a cache size to create it",
            cache_path.display()
        );
    }
    let direct = direct_mode(a);
    let (cache_dev, created) = open_cache(cache_path, cache_size, direct, n)?;
    let built = build_cached(spec, a, core, source, cache_dev, cache_path);
    if built.is_err() && created {
        // Leave nothing behind: the file was ours, made by this start.
        let _ = std::fs::remove_file(cache_path);
    }
    built
}

/// The admission options of an export: its TOML fields, or the command line's.
fn admission_opts(spec: &ExportSpec, a: &ServeArgs) -> Result<crate::policy_args::AdmissionArgs> {
    if spec.from_cli {
        return Ok(a.admission_opts.clone());
    }
    let n = &spec.name;
    Ok(crate::policy_args::AdmissionArgs {
        population_rate: field(&spec.population_rate, "population_rate", n)?,
        sequential_cutoff: spec
            .sequential_cutoff
            .as_deref()
            .map(parse_size)
            .transpose()
            .map_err(|e| anyhow!("export {n:?}: sequential_cutoff: {e}"))?,
        admission_margin: spec.admission_margin,
        partial_fill: spec.partial_fill.unwrap_or(false),
        max_cache_writes: field(&spec.max_cache_writes, "max_cache_writes", n)?,
    })
}

/// The rest of `build` once the cache device is open.
fn build_cached(
    spec: &ExportSpec,
    a: &ServeArgs,
    mut core: CoreConfig,
    source: Arc<dyn BlockDevice>,
    cache_dev: Arc<FileDevice>,
    cache_path: &Path,
) -> Result<Built> {
    let n = &spec.name;
    let persist_wanted = spec.persist.unwrap_or(true) && !a.no_persist;
    // Never format or overwrite what is not ours.
    let found = ownership::contents_at(&*cache_dev, Some(cache_path))
        .with_context(|| format!("export {n:?}: reading cache {}", cache_path.display()))?;
    if let ownership::Contents::Foreign(what) = &found {
        if !a.force {
            bail!(
                "export {n:?}: cache {} holds data that is not an sce cache ({what}); refusing \
                 to overwrite it. Pass --force if it really is meant to be the cache (its \
                 contents are lost)",
                cache_path.display()
            );
        }
        tracing::warn!(export = %n, "--force: overwriting {}: {what}", cache_path.display());
    }
    if !persist_wanted && matches!(found, ownership::Contents::SceCache) && !a.force && !a.reformat
    {
        bail!(
            "export {n:?}: cache {} holds a persistent sce cache; --no-persist would overwrite it. \
             Pass --reformat (or --force) to use it as a cache that starts cold",
            cache_path.display()
        );
    }
    let cache: Arc<dyn BlockDevice> = if persist_wanted {
        cache_dev
    } else {
        // A non-persistent cache keeps a marker in its first 8 KiB, so that the next start
        // knows the device is sce's to overwrite.
        ownership::mark_volatile(&*cache_dev)?;
        let size = cache_dev.size() - ownership::VOLATILE_HEADER;
        Arc::new(sce_io::SliceDevice::new(
            cache_dev,
            ownership::VOLATILE_HEADER,
            size,
        )?)
    };
    let persist = persist_wanted.then(|| {
        let name = spec
            .source_name
            .clone()
            .unwrap_or_else(|| source_identity(&spec.source));
        PersistConfig {
            reformat: a.reformat
                || matches!(
                    found,
                    ownership::Contents::Foreign(_) | ownership::Contents::VolatileCache
                ),
            forget_volume: a.forget_volume,
            state_dir: Some(a.state_dir.clone()),
            flush_interval: a.metadata_interval,
            source_generation: spec
                .source_generation
                .clone()
                .or_else(|| a.source_generation.clone()),
            ..PersistConfig::new(name)
        }
    });
    if let Some(p) = &persist {
        if p.volume_name.len() > sce_store::superblock::MAX_NAME {
            bail!(
                "export {n:?}: the source name is longer than {} bytes; give a shorter one with --source-name",
                sce_store::superblock::MAX_NAME
            );
        }
        // A formatted device brings its fragment size unless one is asked for.
        if spec.fragment_size.is_none() {
            if let Ok(sb) = sce_store::read_superblock(&*cache) {
                core.fragment_size = sb.layout.fragment_size;
            }
        }
    }
    admission_opts(spec, a)?.apply(&mut core, cache.size());
    let persistent = persist.is_some();
    let volume = Arc::new(
        CacheVolume::open(
            source,
            cache,
            EngineConfig {
                core,
                persist,
                error_limit: a.error_limit,
                ..EngineConfig::default()
            },
        )
        .with_context(|| format!("export {n:?}"))?,
    );
    if let Some(p) = volume.persist_stats() {
        tracing::info!(
            export = %n,
            formatted = p.formatted_now,
            previous_shutdown_clean = p.previous_shutdown_clean,
            fragments_restored = p.fragments_restored,
            dropped_by_intent = p.fragments_dropped_intent,
            dropped_bad_metadata = p.fragments_dropped_bad_metadata,
            load_ms = p.load_millis,
            "cache device loaded"
        );
    } else if !persistent {
        tracing::info!(export = %n, "cache is not persistent: starting cold");
    }
    let v = volume.clone();
    Ok(Built {
        export: Export {
            name: n.clone(),
            description: format!("{} cached on {}", spec.source, cache_path.display()),
            device: volume.clone(),
            read_only: spec.read_only,
            prefetch: Some(Arc::new(move |o, l| v.prefetch(o, l))),
        },
        volume: Some(volume),
    })
}

/// The name a source gets in the volume table: its canonical path, or the URI as given.
fn source_identity(source: &str) -> String {
    if source.contains("://") {
        return source.to_string();
    }
    std::fs::canonicalize(source)
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| source.to_string())
}

/// The persistence fields exported as metrics and in /stats: (name, value, is a counter).
fn persist_fields(p: &PersistStats) -> [(&'static str, u64, bool); 11] {
    [
        ("persist_format_version", p.format_version as u64, false),
        (
            "persist_previous_shutdown_clean",
            p.previous_shutdown_clean as u64,
            false,
        ),
        ("persist_last_clean_shutdown", p.last_clean_shutdown, false),
        ("persist_fragments_restored", p.fragments_restored, false),
        ("persist_dirty_intents", p.dirty_intents, false),
        ("persist_intent_syncs", p.intent_syncs, true),
        ("persist_intent_presets", p.intent_presets, true),
        ("persist_units_written", p.units_written, true),
        (
            "persist_metadata_bytes_written",
            p.metadata_bytes_written,
            true,
        ),
        ("persist_metadata_errors", p.metadata_errors, true),
        ("persist_load_millis", p.load_millis, false),
    ]
}

/// A named value for the exporters: (name, value, is a counter).
type Field = (&'static str, u64, bool);

/// Appends one Prometheus family per field, with a sample per export. Every export lists
/// the same fields, as (name, value, is a counter), in the same order.
fn export_families(out: &mut String, rows: &[(&str, Vec<Field>)]) {
    let Some((_, first)) = rows.first() else {
        return;
    };
    for (i, &(field, _, counter)) in first.iter().enumerate() {
        let (name, kind) = if counter {
            (format!("sce_{field}_total"), "counter")
        } else {
            (format!("sce_{field}"), "gauge")
        };
        *out += &format!("# TYPE {name} {kind}\n");
        for (export, fields) in rows {
            *out += &format!(
                "{name}{{export=\"{}\"}} {}\n",
                export.replace('"', "\\\""),
                fields[i].1
            );
        }
    }
}

/// Prometheus text of every export's counters and the server's.
fn prometheus(server: &Server, volumes: &[(String, Option<Arc<CacheVolume>>)]) -> String {
    let mut out = String::new();
    let s = server.stats();
    for (name, v) in [
        ("sce_nbd_connections_total", s.connections.load(Relaxed)),
        ("sce_nbd_open_connections", s.open_connections.load(Relaxed)),
        ("sce_nbd_requests_total", s.requests.load(Relaxed)),
        (
            "sce_nbd_request_errors_total",
            s.request_errors.load(Relaxed),
        ),
        (
            "sce_nbd_protocol_errors_total",
            s.protocol_errors.load(Relaxed),
        ),
        (
            "sce_nbd_refused_connections_total",
            s.refused_connections.load(Relaxed),
        ),
        (
            "sce_nbd_handshake_timeouts_total",
            s.handshake_timeouts.load(Relaxed),
        ),
        (
            "sce_nbd_request_timeouts_total",
            s.request_timeouts.load(Relaxed),
        ),
        ("sce_nbd_idle_timeouts_total", s.idle_timeouts.load(Relaxed)),
        (
            "sce_nbd_reply_timeouts_total",
            s.reply_timeouts.load(Relaxed),
        ),
        ("sce_nbd_inflight_bytes", s.inflight_bytes.load(Relaxed)),
        (
            "sce_nbd_inflight_bytes_peak",
            s.inflight_bytes_peak.load(Relaxed),
        ),
    ] {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        out += &format!("# TYPE {name} {kind}\n{name} {v}\n");
    }
    let cached: Vec<(&str, &CacheVolume)> = volumes
        .iter()
        .filter_map(|(n, v)| v.as_deref().map(|v| (n.as_str(), v)))
        .collect();
    let counters: Vec<_> = cached
        .iter()
        .map(|&(n, v)| (n, v.stats().fields().to_vec()))
        .collect();
    export_families(&mut out, &counters);
    let persisted: Vec<_> = cached
        .iter()
        .filter_map(|&(n, v)| v.persist_stats().map(|p| (n, persist_fields(&p).to_vec())))
        .collect();
    export_families(&mut out, &persisted);
    out
}

fn stats_json(
    server: &Server,
    volumes: &[(String, Option<Arc<CacheVolume>>)],
) -> serde_json::Value {
    let s = server.stats();
    let mut exports = serde_json::Map::new();
    for (name, v) in volumes {
        let mut m = serde_json::Map::new();
        m.insert("cached".into(), v.is_some().into());
        if let Some(v) = v {
            let st = v.stats();
            let state = if v.is_passthrough() {
                "passthrough"
            } else {
                "active"
            };
            m.insert("state".into(), state.into());
            for (f, val, _) in st.fields() {
                m.insert(f.into(), val.into());
            }
            m.insert("read_hit_ratio".into(), st.read_hit_ratio().into());
            if let Some(p) = v.persist_stats() {
                for (f, val, _) in persist_fields(&p) {
                    m.insert(f.into(), val.into());
                }
                m.insert("persist_uuid".into(), p.uuid.clone().into());
            } else {
                m.insert("persist_format_version".into(), serde_json::Value::Null);
            }
        }
        exports.insert(name.clone(), m.into());
    }
    serde_json::json!({
        "connections": s.connections.load(Relaxed),
        "open_connections": s.open_connections.load(Relaxed),
        "requests": s.requests.load(Relaxed),
        "request_errors": s.request_errors.load(Relaxed),
        "protocol_errors": s.protocol_errors.load(Relaxed),
        "refused_connections": s.refused_connections.load(Relaxed),
        "handshake_timeouts": s.handshake_timeouts.load(Relaxed),
        "request_timeouts": s.request_timeouts.load(Relaxed),
        "idle_timeouts": s.idle_timeouts.load(Relaxed),
        "reply_timeouts": s.reply_timeouts.load(Relaxed),
        "inflight_bytes": s.inflight_bytes.load(Relaxed),
        "exports": exports,
    })
}

fn metrics_server(
    addr: &str,
    server: Arc<Server>,
    volumes: Arc<Vec<(String, Option<Arc<CacheVolume>>)>>,
) -> Result<String> {
    let l = TcpListener::bind(addr).with_context(|| format!("metrics endpoint {addr}"))?;
    let local = l.local_addr()?.to_string();
    std::thread::spawn(move || {
        for conn in l.incoming().flatten() {
            let (server, volumes) = (server.clone(), volumes.clone());
            std::thread::spawn(move || {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                let mut r = BufReader::new(&conn);
                let mut line = String::new();
                if r.read_line(&mut line).is_err() {
                    return;
                }
                let path = line.split_whitespace().nth(1).unwrap_or("/");
                let (status, ctype, body) = match path {
                    "/metrics" => (
                        "200 OK",
                        "text/plain; version=0.0.4",
                        prometheus(&server, &volumes),
                    ),
                    "/stats" => (
                        "200 OK",
                        "application/json",
                        stats_json(&server, &volumes).to_string(),
                    ),
                    _ => (
                        "404 Not Found",
                        "text/plain",
                        "try /metrics or /stats\n".into(),
                    ),
                };
                let mut w = &conn;
                let _ = write!(w, "HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n\r\n{body}", body.len());
            });
        }
    });
    Ok(local)
}

/// Runs the server until SIGTERM or SIGINT.
pub fn serve(a: ServeArgs) -> Result<()> {
    let mut file = match &a.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            toml::from_str::<ConfigFile>(&text).map_err(|e| anyhow!("{}: {e}", p.display()))?
        }
        None => ConfigFile::default(),
    };
    if let Some(src) = &a.source {
        file.export.push(ExportSpec {
            name: a.export.clone(),
            source: src.clone(),
            cache: a.cache.clone(),
            cache_size: a.cache_size.map(|n| n.to_string()),
            mode: a.mode.map(|m| m.to_string()),
            admission: a.admission.map(|m| m.to_string()),
            fragment_size: a.fragment_size.map(|n| n.to_string()),
            eviction: a.eviction.map(|m| m.to_string()),
            target_missrate: a.target_missrate,
            read_only: a.read_only,
            persist: None,
            source_name: a.source_name.clone(),
            source_generation: None,
            from_cli: true,
            ..ExportSpec::default()
        });
    } else if a.cache.is_some() {
        bail!("--cache needs --source");
    }
    if file.export.is_empty() {
        bail!("nothing to serve: give --source (and --cache), or --config with [[export]] tables");
    }
    let mut names: Vec<&str> = file.export.iter().map(|e| e.name.as_str()).collect();
    names.sort_unstable();
    if names.windows(2).any(|w| w[0] == w[1]) {
        bail!("two exports have the same name");
    }
    let mut listens = a.listen.clone();
    for l in &file.listen {
        listens.push(l.parse().map_err(|e: String| anyhow!("listen: {e}"))?);
    }
    if listens.is_empty() {
        bail!("nowhere to listen: give --listen unix:PATH or tcp:HOST:PORT");
    }
    // No export may use another's cache, or its own source, as a cache.
    let mut claims = Vec::new();
    for spec in &file.export {
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
    let mut cached_uris: Vec<&str> = file
        .export
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
    let mut exports = Vec::new();
    let mut volumes = Vec::new();
    for spec in &file.export {
        let b = build(spec, &a)?;
        volumes.push((spec.name.clone(), b.volume));
        exports.push(b.export);
    }
    let server = Server::with_config(
        exports,
        sce_nbd::ServerConfig {
            max_connections: a.max_connections.max(1),
            idle_timeout: (!a.idle_timeout.is_zero()).then_some(a.idle_timeout),
            request_timeout: a.client_timeout.max(Duration::from_millis(100)),
            reply_timeout: a.client_timeout.max(Duration::from_millis(100)),
            inflight_bytes: a.inflight_budget.max(1 << 20),
            ..sce_nbd::ServerConfig::default()
        },
    );
    let volumes = Arc::new(volumes);
    let (tx, rx) = std::sync::mpsc::sync_channel::<()>(4);
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .context("installing the signal handler")?;
    let mut listeners = Vec::new();
    for l in &listens {
        let h = listen_with(
            &server,
            l,
            &sce_nbd::ListenOptions {
                socket_mode: a.socket_mode,
            },
        )
        .with_context(|| format!("listening on {l:?}"))?;
        tracing::info!(address = %h.local, "listening");
        eprintln!("sce serve: listening on {}", h.local);
        listeners.push(h);
    }
    if let Some(m) = a.metrics.as_ref().or(file.metrics.as_ref()) {
        let local = metrics_server(m, server.clone(), volumes.clone())?;
        eprintln!("sce serve: metrics on http://{local}/metrics");
    }
    for e in server.exports() {
        tracing::info!(export = %e.name, size = e.device.size(), read_only = e.read_only, "serving");
    }
    let _ = rx.recv();
    tracing::info!("signal received: shutting down");
    eprintln!("sce serve: shutting down");
    for l in &mut listeners {
        l.stop();
    }
    server.shutdown();
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.stats().open_connections.load(Relaxed) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if let Err(e) = server.flush_all() {
        // A source that is away (an NBD server down) cannot be flushed. Stop anyway, without
        // marking the caches clean: the next start recovers them as after a crash.
        tracing::error!("flushing the exports failed: {e}; caches are left as after a crash");
        eprintln!("sce serve: stopped, but the sources could not be flushed: {e}");
        // Exit here: dropping the volumes would close them and mark their devices clean.
        std::process::exit(1);
    }
    // Every acknowledged write is on the (flushed) source. Persistent caches now write their
    // records and mark their devices clean, so the next start is warm.
    for (name, v) in volumes.iter() {
        let Some(v) = v else { continue };
        let persistent = v.persist_stats().is_some();
        let clean = v.shutdown();
        if persistent {
            if clean {
                tracing::info!(export = %name, "cache device left clean");
            } else {
                tracing::warn!(export = %name, "cache device not left clean: the next start recovers as after a crash");
            }
        }
    }
    eprintln!("sce serve: stopped cleanly");
    Ok(())
}

/// Options of `sce stats`.
#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// The metrics endpoint of a running `sce serve` (HOST:PORT).
    #[arg(long)]
    pub metrics: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Prints a running server's counters.
pub fn stats(a: StatsArgs) -> Result<()> {
    let mut c =
        TcpStream::connect(&a.metrics).with_context(|| format!("connecting to {}", a.metrics))?;
    write!(c, "GET /stats HTTP/1.0\r\n\r\n")?;
    let mut resp = String::new();
    c.read_to_string(&mut resp)?;
    let body = resp
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .ok_or_else(|| anyhow!("bad HTTP response"))?;
    let v: serde_json::Value = serde_json::from_str(body).context("bad stats document")?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "connections {} (open {}), requests {} ({} errors), protocol errors {}",
        v["connections"],
        v["open_connections"],
        v["requests"],
        v["request_errors"],
        v["protocol_errors"]
    );
    if let Some(ex) = v["exports"].as_object() {
        for (name, e) in ex {
            println!("export {name:?}:");
            match e.as_object() {
                Some(m) if m.get("cached") == Some(&serde_json::Value::Bool(true)) => {
                    for (k, val) in m {
                        if k != "cached" {
                            println!("  {k:<24} {val}");
                        }
                    }
                }
                _ => println!("  not cached"),
            }
        }
    }
    Ok(())
}
