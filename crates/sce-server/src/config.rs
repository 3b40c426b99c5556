//! What a server serves and how: [`ServeConfig`], with the exports declared in a TOML file
//! ([`ConfigFile`]) merged into those of the command line.
//!
//! An export's settings stay text, as the file gives them, until the export is built: every
//! field is then checked, with the export's name and the field's in the error.

use crate::admission::AdmissionOptions;
pub use crate::log_size::LogSize;
use anyhow::{anyhow, bail, Context, Result};
use sce_io::DirectMode;
use sce_nbd::{ListenAddr, ServerTls, TlsMode};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Everything `sce serve` is told: what to export, where to listen, and every setting.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The exports, in the order they are built.
    pub exports: Vec<ExportConfig>,
    /// The TOML file the exports were read from, if any (`sce ctl set --save` writes to it).
    pub config_file: Option<PathBuf>,
    /// Where to listen (at least one place).
    pub listen: Vec<ListenAddr>,
    /// Serve counters over HTTP at HOST:PORT: /metrics (Prometheus text), /stats (JSON).
    pub metrics: Option<String>,
    /// The admin socket `sce ctl` talks to (default: the first Unix listener's path with
    /// `.ctl` added; none if there is no Unix listener and none is given).
    pub admin: Option<PathBuf>,
    /// A group (name or number) whose members may use the admin socket too (besides the
    /// server's uid and root).
    pub admin_group: Option<String>,
    /// Serve the metrics endpoint on an address other than loopback.
    pub metrics_public: bool,
    /// Listen on TCP addresses other than loopback without TLS or authentication.
    pub insecure: bool,
    /// TLS on the TCP listeners.
    pub tls: TlsConfig,
    /// O_DIRECT for files and devices: required, preferred (buffered where the filesystem
    /// refuses it) or off.
    pub direct: DirectMode,
    /// Connections to an NBD source (if it allows several; else 1).
    pub source_connections: usize,
    /// Requests in flight on each connection to an NBD source.
    pub source_queue_depth: usize,
    /// How an export of a local file or block device without a cache does its I/O: io_uring,
    /// a pool of threads, or io_uring where it works (`auto`).
    pub io_backend: sce_io::Backend,
    /// An NBD source request that takes longer fails (EIO) and its connection is reopened.
    pub source_timeout: Duration,
    /// Keep cache contents across restarts (an export's `persist = false` still turns it off).
    pub persist: bool,
    /// Use a cache device that holds data which is not an sce cache (its contents are lost).
    pub force: bool,
    /// Reformat a cache device that belongs to another source, has another geometry or
    /// format version, is corrupt or was disabled after errors.
    pub reformat: bool,
    /// Invalidate everything the cache device holds for the source, at start.
    pub forget_volume: bool,
    /// Volumes (names in a cache device's table, as `sce check` prints them, or "all")
    /// whose dirty write-back data the operator gives up: a `--reformat`, or a start that
    /// leaves them out, may then drop it. Without it such a start is refused.
    pub discard_dirty: Vec<String>,
    /// Set by an attach that knows nothing reached the source while the cache was
    /// detached: the volume's "detached" mark on the device does not drop it.
    pub reattach: bool,
    /// With `reattach`: the "detached" mark stays on the device until the attach cleared it
    /// (`PersistConfig::keep_detached_mark`).
    pub keep_detached_mark: bool,
    /// With `reattach`: the source changed by writes this process served while detached
    /// (`PersistConfig::own_writes`).
    pub own_writes: bool,
    /// A version string of the sources' content, for exports that give none of their own.
    pub source_generation: Option<String>,
    /// Host directory for failure markers of cache devices.
    pub state_dir: PathBuf,
    /// Cache-device errors after which a cache disables itself.
    pub error_limit: u64,
    /// How often changed slot records are written and quiet write intents cleared.
    pub metadata_interval: Duration,
    /// Journal writes to cached pages on a persistent cache (an export's `crash_journal`
    /// overrides it): a crash then drops only the pages being written, at the cost of one
    /// group-committed cache-device write before each source write to a cached slot. Off:
    /// a crash drops every recently written fragment whole.
    pub crash_journal: bool,
    /// A slot written twice within 30 metadata rounds turns write-hot: its write intent is
    /// set ahead of the next write, and writes to it wait for no journal entry (a crash
    /// drops such slots whole). Off: every write to a cached fragment is journaled.
    pub write_hot: bool,
    /// How much of a cache device to give a write-back log when sce formats it. A device
    /// with one serves `--mode writeback` through it (issue 29, docs/WRITEBACK.md): a write
    /// costs one cache-device write, a FLUSH one commit and one flush.
    pub writeback_log: crate::log_size::LogSize,
    /// How much of the read slots that log may borrow as dirty data outgrows it, when sce
    /// formats a device (format 9): auto, up to half the device in all; 0: none.
    pub writeback_grow: crate::log_size::LogSize,
    /// NBD connections served at once; more are refused.
    pub max_connections: usize,
    /// Close a client connection idle this long between requests (zero: never).
    pub idle_timeout: Duration,
    /// Longest time a client may take to send a request once started, or to read a reply.
    pub client_timeout: Duration,
    /// Payload bytes held in flight for all clients together.
    pub inflight_budget: u64,
    /// Permission bits of Unix sockets.
    pub socket_mode: u32,
    /// Shared mode: the cached exports are volumes other hosts cache too, kept coherent
    /// through etcd (`--shared`).
    pub shared: Option<SharedConfig>,
    /// Devices opened by name instead of from the filesystem (tests: a power-cut model of
    /// the cache device and the sources, in process). Empty in a server.
    #[doc(hidden)]
    pub devices: DeviceTable,
}

/// Devices by name: an export whose source or cache names one of them uses that device
/// (no file is opened or locked, and hits and log writes go through a pool of I/O
/// threads over it). For tests that put the server's devices behind models.
#[doc(hidden)]
#[derive(Clone, Default)]
pub struct DeviceTable(
    pub std::sync::Arc<parking_lot::Mutex<std::collections::HashMap<String, DeviceRef>>>,
);

/// A device of a [`DeviceTable`].
pub type DeviceRef = std::sync::Arc<dyn sce_io::BlockDevice>;

impl DeviceTable {
    /// The device named `name`, if the table has one.
    pub fn get(&self, name: &str) -> Option<DeviceRef> {
        self.0.lock().get(name).cloned()
    }
    /// Names `dev` `name` (replacing what had the name).
    pub fn put(&self, name: &str, dev: DeviceRef) {
        self.0.lock().insert(name.to_string(), dev);
    }
}

impl std::fmt::Debug for DeviceTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.0.lock().keys().cloned().collect();
        f.debug_tuple("DeviceTable").field(&names).finish()
    }
}

/// The defaults of `sce serve`: nothing exported or listened on yet, every setting as the
/// command line's default.
impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            exports: Vec::new(),
            config_file: None,
            listen: Vec::new(),
            metrics: None,
            admin: None,
            admin_group: None,
            metrics_public: false,
            insecure: false,
            tls: TlsConfig::default(),
            direct: DirectMode::Required,
            source_connections: 4,
            source_queue_depth: 32,
            io_backend: sce_io::Backend::Auto,
            source_timeout: Duration::from_secs(60),
            persist: true,
            force: false,
            reformat: false,
            forget_volume: false,
            discard_dirty: Vec::new(),
            reattach: false,
            keep_detached_mark: false,
            own_writes: false,
            source_generation: None,
            state_dir: "/var/lib/sce".into(),
            error_limit: 16,
            metadata_interval: Duration::from_secs(1),
            crash_journal: true,
            write_hot: true,
            writeback_log: crate::log_size::LogSize::Auto,
            writeback_grow: crate::log_size::LogSize::Auto,
            max_connections: 256,
            idle_timeout: Duration::ZERO,
            client_timeout: Duration::from_secs(60),
            inflight_budget: 256 << 20,
            socket_mode: 0o600,
            shared: None,
            devices: Default::default(),
        }
    }
}

/// Shared mode's settings (`--shared`, `--host-name`, `--lease-ttl`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedConfig {
    /// The etcd members' client addresses (HOST:PORT).
    pub endpoints: Vec<String>,
    /// The key prefix of this group of hosts (the volumes go under it by export name).
    pub prefix: String,
    /// This host's name among them.
    pub host: String,
    /// The lease's time to live, in seconds.
    pub lease_ttl: i64,
    /// The size of the regions a host owns for writing (a power of two; 0: no ownership,
    /// every write is published to the others, as before issue 31).
    pub region_size: u64,
    /// An owned region no write used for this long is released.
    pub ownership_idle: Duration,
}

/// The default region size: see `--region-size`.
pub const DEFAULT_REGION_SIZE: u64 = 1 << 30;

impl SharedConfig {
    /// Parses `etcd://HOST:PORT[,HOST:PORT…]/PREFIX`.
    pub fn parse(url: &str, host: &str, lease_ttl: Duration) -> Result<SharedConfig> {
        let rest = url.strip_prefix("etcd://").ok_or_else(|| {
            anyhow!("--shared {url:?}: give etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
        })?;
        let (hosts, prefix) = rest.split_once('/').unwrap_or((rest, "sce"));
        let endpoints: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(str::to_string)
            .collect();
        if endpoints.is_empty() || endpoints.iter().any(|e| !e.contains(':')) {
            bail!("--shared {url:?}: each etcd member is HOST:PORT");
        }
        let prefix = format!("/{}", prefix.trim_matches('/'));
        if host.is_empty() || host.contains('/') {
            bail!("host name {host:?}: give a name without '/' (--host-name)");
        }
        let ttl = lease_ttl.as_secs() as i64;
        if !(1..=3600).contains(&ttl) {
            bail!("--lease-ttl {lease_ttl:?}: give 1s to 1h");
        }
        Ok(SharedConfig {
            endpoints,
            prefix,
            host: host.to_string(),
            lease_ttl: ttl,
            region_size: DEFAULT_REGION_SIZE,
            ownership_idle: Duration::from_secs(10),
        })
    }

    /// With regions of `size` bytes (0: no ownership) released after `idle`.
    pub fn with_ownership(mut self, size: u64, idle: Duration) -> Result<SharedConfig> {
        if size != 0 && (!size.is_power_of_two() || size < 1 << 20) {
            bail!("--region-size {size}: give a power of two of at least 1MiB, or 0 (no ownership: every write is published)");
        }
        if idle.is_zero() || idle > Duration::from_secs(3600) {
            bail!("--ownership-idle {idle:?}: give more than 0 and at most 1h");
        }
        self.region_size = size;
        self.ownership_idle = idle;
        Ok(self)
    }
}

/// One export as declared: a `[[export]]` table of the TOML file, or the command line's.
#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct ExportConfig {
    /// The export's name ("" is the default export).
    #[serde(default)]
    pub name: String,
    /// A file, a block device or an NBD URI.
    pub source: String,
    /// The cache device; without it the source is exported as it is.
    pub cache: Option<PathBuf>,
    /// Create the cache file with this size if it does not exist.
    pub cache_size: Option<String>,
    /// Where exports share a cache device: the most of it this one may hold ("40%" or
    /// 0.4 as text). Default: no cap.
    pub cache_share: Option<String>,
    /// Cache mode: writethrough, writethrough-sync, writearound or passthrough (old names:
    /// awt, write-through, write-around).
    pub mode: Option<String>,
    /// Asynchronous write-through on or off (writethrough's flavour).
    pub awt: Option<bool>,
    /// Fragments in the MRU hotness window that population picks from.
    pub hot_window: Option<usize>,
    /// Bytes of AWT copies in flight before writes fall back to write-around.
    pub awt_budget: Option<String>,
    /// Write-back: the share of the log in use from which the cleaner cleans in the
    /// background ("25%" or 0.25).
    pub writeback_low_watermark: Option<String>,
    /// Write-back: the share of the log in use above which cleaning is urgent ("75%").
    pub writeback_high_watermark: Option<String>,
    /// Write-back: background cleaning's rate, SIZE per second or "unlimited".
    pub writeback_rate: Option<String>,
    /// Algorithm 1: sleep of a population worker between cycles.
    pub period: Option<String>,
    /// Algorithm 1: populate only while this percentage of slots is free, unless
    /// `evict_for_population`.
    pub min_free_pcnt: Option<f64>,
    /// Algorithm 1: evict to populate (default true).
    pub evict_for_population: Option<bool>,
    /// Admission: sce, sce-paper, always or nhit:K.
    pub admission: Option<String>,
    /// Fragment size: a power of two from 4KiB to 64MiB (`chunk_size` is the same).
    #[serde(alias = "chunk_size")]
    pub fragment_size: Option<String>,
    /// Lines inside fragments: cache space is allocated and filled per line of this size,
    /// heat counted per fragment (a power of two from a 64th of the fragment size to it).
    pub line_size: Option<String>,
    /// Eviction policy: clock, lru or fifo.
    pub eviction: Option<String>,
    /// Algorithm 1: populate only while the read miss rate is at least this.
    pub target_missrate: Option<f64>,
    /// Export read-only.
    #[serde(default)]
    pub read_only: bool,
    /// Keep the cache contents across restarts (default true).
    pub persist: Option<bool>,
    /// Journal writes to cached pages, so a crash drops only them (default: the server's
    /// `--crash-journal`, on).
    pub crash_journal: Option<bool>,
    /// The source's name in the cache device's volume table.
    pub source_name: Option<String>,
    /// A version string for the source's content, recorded with the cache.
    pub source_generation: Option<String>,
    /// Admission sce: auto, auto:SIZE, SIZE (per second) or unlimited.
    pub population_rate: Option<String>,
    /// Admission sce: bytes of a sequential run from which it is bypassed (0: never).
    pub sequential_cutoff: Option<String>,
    /// Admission sce: touches by which a candidate must beat its victim.
    pub admission_margin: Option<u32>,
    /// Admission sce: fill only the touched parts of a fragment.
    pub partial_fill: Option<bool>,
    /// Admission sce: fill the cache from read misses' own data: "on", "off" or "auto" (a
    /// boolean is on or off).
    pub miss_fills: Option<crate::admission::OnOffAuto>,
    /// Admission sce: the recency window, a percentage of the cache ("1%") or "off".
    pub recency_window: Option<String>,
    /// Admission sce: the page area, the percentage of a line's pages admitted one at a
    /// time that makes it fill as a line ("6%"), or "off".
    pub dense_line: Option<String>,
    /// Endurance budget: SIZE per day or N dwpd.
    pub max_cache_writes: Option<String>,
    /// Admission options already parsed (the command line's): when given, they replace the
    /// five text fields above.
    #[serde(skip)]
    pub admission_options: Option<AdmissionOptions>,
}

/// The TOML file of `sce serve --config`.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Where to listen: unix:PATH or tcp:HOST:PORT.
    #[serde(default)]
    pub listen: Vec<String>,
    /// The metrics endpoint, unless the command line gives one.
    pub metrics: Option<String>,
    /// The admin socket for `sce ctl`, unless the command line gives one.
    pub admin: Option<PathBuf>,
    /// The group whose members may use the admin socket too (as `--admin-group`).
    pub admin_group: Option<String>,
    /// Allow a metrics endpoint on an address other than loopback (as `--metrics-public`).
    #[serde(default)]
    pub metrics_public: bool,
    /// Allow TCP listeners on addresses other than loopback without TLS (as `--insecure`).
    #[serde(default)]
    pub insecure: bool,
    /// TLS on TCP listeners: off, on or require (as `--tls`).
    pub tls: Option<String>,
    /// The server's PEM certificate chain (as `--tls-cert`).
    pub tls_cert: Option<PathBuf>,
    /// Its PEM private key (as `--tls-key`).
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates of the clients to accept (as `--tls-client-ca`).
    pub tls_client_ca: Option<PathBuf>,
    /// A psktool key file for TLS-PSK (as `--tls-psk`).
    pub tls_psk: Option<PathBuf>,
    /// Shared mode, unless the command line gives it (as `--shared`).
    pub shared: Option<String>,
    /// This host's name in shared mode (as `--host-name`).
    pub host_name: Option<String>,
    /// Volumes whose dirty write-back data may be dropped (as `--discard-dirty`, added to it).
    #[serde(default)]
    pub discard_dirty: Vec<String>,
    /// The exports.
    #[serde(default)]
    pub export: Vec<ExportConfig>,
}

impl ConfigFile {
    /// Reads and parses the file at `path`.
    pub fn load(path: &Path) -> Result<ConfigFile> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))
    }
}

impl ServeConfig {
    /// Adds what `file` declares: its exports before this config's, its listeners after,
    /// its metrics endpoint unless this config has one. Checks the exports first, then the
    /// listeners' syntax.
    pub fn merge_file(&mut self, file: ConfigFile) -> Result<()> {
        let own = std::mem::replace(&mut self.exports, file.export);
        self.exports.extend(own);
        check_exports(&self.exports)?;
        for l in &file.listen {
            self.listen
                .push(l.parse().map_err(|e: String| anyhow!("listen: {e}"))?);
        }
        if self.metrics.is_none() {
            self.metrics = file.metrics;
        }
        if self.admin.is_none() {
            self.admin = file.admin;
        }
        if self.admin_group.is_none() {
            self.admin_group = file.admin_group;
        }
        self.metrics_public |= file.metrics_public;
        self.insecure |= file.insecure;
        self.discard_dirty.extend(file.discard_dirty);
        if self.tls.mode.is_none() {
            self.tls.mode = file
                .tls
                .map(|m| m.parse())
                .transpose()
                .map_err(|e: String| anyhow!("tls: {e}"))?;
        }
        let t = &mut self.tls;
        t.cert = t.cert.take().or(file.tls_cert);
        t.key = t.key.take().or(file.tls_key);
        t.client_ca = t.client_ca.take().or(file.tls_client_ca);
        t.psk = t.psk.take().or(file.tls_psk);
        Ok(())
    }

    /// Checks that there is something to serve, under distinct names, and somewhere to
    /// listen.
    pub fn check(&self) -> Result<()> {
        check_exports(&self.exports)?;
        if self.listen.is_empty() {
            bail!("nowhere to listen: give --listen unix:PATH or tcp:HOST:PORT");
        }
        let require = self.tls.mode() == TlsMode::Require;
        for l in &self.listen {
            if let ListenAddr::Tcp(hp) = l {
                if !self.insecure && !require && !is_loopback(hp)? {
                    bail!(
                        "refusing to listen on tcp:{hp}: it is not a loopback address, and \
                         without --tls require the connection may carry the volume's data in \
                         the clear, to anyone who can reach it. Give --tls-cert and --tls-key \
                         (TLS is then required), listen on 127.0.0.1 or a Unix socket, or pass \
                         --insecure on a network you trust"
                    );
                }
                if self.insecure && !require && !is_loopback(hp)? {
                    tracing::warn!(
                        "listening on tcp:{hp} without TLS or authentication (--insecure): \
                         anyone who can reach it can read and write the volume"
                    );
                }
            }
        }
        self.check_metrics()
    }

    /// A metrics endpoint on an address other than loopback needs `--metrics-public`.
    fn check_metrics(&self) -> Result<()> {
        let Some(m) = &self.metrics else {
            return Ok(());
        };
        if is_loopback(m).with_context(|| format!("--metrics {m}"))? {
            return Ok(());
        }
        if !self.metrics_public {
            bail!(
                "refusing to serve metrics on {m}: it is not a loopback address, and anyone \
                 who can reach it would read the counters (export names, sizes, rates) and \
                 could tie up the endpoint. Serve them on 127.0.0.1 (a local agent or a proxy \
                 can forward them), or pass --metrics-public (TOML metrics_public = true)"
            );
        }
        tracing::warn!(
            "metrics on {m}, not loopback (--metrics-public): anyone who can reach it reads them"
        );
        Ok(())
    }
}

/// TLS on the TCP listeners, as given (`mode` `None`: require if a certificate is given,
/// else off).
#[derive(Debug, Clone, Default)]
pub struct TlsConfig {
    /// `--tls`.
    pub mode: Option<TlsMode>,
    /// `--tls-cert`: the server's PEM certificate chain.
    pub cert: Option<PathBuf>,
    /// `--tls-key`: its PEM private key.
    pub key: Option<PathBuf>,
    /// `--tls-client-ca`: PEM CA certificates; clients must then present a certificate
    /// signed by one of them (mutual TLS).
    pub client_ca: Option<PathBuf>,
    /// `--tls-psk`: a psktool key file (`USERNAME:HEXKEY` lines); TLS-PSK instead of X.509.
    pub psk: Option<PathBuf>,
}

impl TlsConfig {
    /// The mode in force: as given, else require with a certificate or a key file and off
    /// without.
    pub fn mode(&self) -> TlsMode {
        self.mode
            .unwrap_or(if self.cert.is_some() || self.psk.is_some() {
                TlsMode::Require
            } else {
                TlsMode::Off
            })
    }

    /// The listeners' TLS, loaded from the files; `None` when off. Errors say which flag or
    /// file is missing or wrong.
    pub fn load(&self) -> Result<Option<ServerTls>> {
        let mode = self.mode();
        if mode == TlsMode::Off {
            return Ok(None);
        }
        if let Some(psk) = &self.psk {
            if self.cert.is_some() || self.key.is_some() || self.client_ca.is_some() {
                bail!("--tls-psk and X.509 credentials (--tls-cert, --tls-key, --tls-client-ca) exclude each other: give one kind");
            }
            return ServerTls::from_psk_file(mode, psk)
                .map(Some)
                .map_err(|e| anyhow!(e));
        }
        let (Some(cert), Some(key)) = (&self.cert, &self.key) else {
            bail!("--tls {mode} needs --tls-cert FILE and --tls-key FILE (PEM), or --tls-psk FILE");
        };
        ServerTls::from_files(mode, cert, key, self.client_ca.as_deref())
            .map(Some)
            .map_err(|e| anyhow!(e))
    }
}

/// True if every address `host:port` resolves to is a loopback address.
fn is_loopback(host_port: &str) -> Result<bool> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<_> = host_port
        .to_socket_addrs()
        .with_context(|| format!("tcp:{host_port}: not an address to listen on"))?
        .collect();
    Ok(!addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback()))
}

/// At least one export, no two with the same name.
fn check_exports(exports: &[ExportConfig]) -> Result<()> {
    if exports.is_empty() {
        bail!("nothing to serve: give --source (and --cache), or --config with [[export]] tables");
    }
    let mut names: Vec<&str> = exports.iter().map(|e| e.name.as_str()).collect();
    names.sort_unstable();
    if names.windows(2).any(|w| w[0] == w[1]) {
        bail!("two exports have the same name");
    }
    Ok(())
}
