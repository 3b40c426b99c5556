//! `sce serve`: exports cached volumes over NBD, and `sce stats`: reads a running server's
//! counters from its metrics endpoint.
//!
//! One export comes from the flags, several from a TOML file. A source is a file, a block
//! device or an NBD URI; without a cache the source is exported as it is (the baseline of
//! every comparison). SIGTERM or SIGINT: stop accepting, answer or fail (ESHUTDOWN) what is
//! in flight, flush every export, exit 0. The server is `sce_server`'s: this module turns
//! the flags (and the TOML file) into a `ServeConfig` and prints what the server reports.

use crate::policy_args::parse_on_off;
use crate::units::parse_size;
use anyhow::{bail, Result};
use sce_core::{Admission, EvictionKind, WriteMode};
use sce_io::DirectMode;
use sce_nbd::ListenAddr;
use sce_server::config::SharedConfig;
use sce_server::{ConfigFile, ExportConfig, ServeConfig, Stopped};
use std::path::PathBuf;
use std::time::Duration;

/// Options of `sce serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// A TOML file declaring listeners and one or more exports (docs/SERVING.md; the
    /// example configuration, contrib/sce.toml, is installed as
    /// share/doc/sce/examples/sce.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The source volume: a file, a block device, or an NBD URI (nbd://HOST:PORT/NAME,
    /// nbd+unix:///NAME?socket=PATH).
    #[arg(help_heading = "Source and export", long)]
    pub source: Option<String>,
    /// The cache device (file or block device). Without it the source is exported as is.
    #[arg(help_heading = "Cache device", long)]
    pub cache: Option<PathBuf>,
    /// Where to listen: unix:PATH or tcp:HOST:PORT (repeatable). A TCP address other than
    /// loopback is refused unless TLS is required (--tls-cert) or --insecure is given.
    #[arg(help_heading = "Network and TLS", long)]
    pub listen: Vec<ListenAddr>,
    /// Allow TCP listeners on addresses other than loopback, without TLS or authentication
    /// (a warning is logged).
    #[arg(help_heading = "Network and TLS", long)]
    pub insecure: bool,
    /// TLS on TCP listeners (NBD STARTTLS): off, on (offered) or require. Default: require
    /// when --tls-cert or --tls-psk is given, else off. Unix sockets stay plain.
    #[arg(help_heading = "Network and TLS", long)]
    pub tls: Option<sce_nbd::TlsMode>,
    /// The server's X.509 certificate chain (PEM).
    #[arg(help_heading = "Network and TLS", long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(help_heading = "Network and TLS", long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA certificates (PEM) of the clients to accept: every client must then present a
    /// certificate they signed (mutual TLS).
    #[arg(help_heading = "Network and TLS", long, requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// TLS-PSK instead of certificates, as qemu-nbd and nbdkit do it: a key file of
    /// USERNAME:HEXKEY lines (`psktool -u alice -p keys.psk` writes one). Clients need one
    /// of its keys. Runs on the system's GnuTLS (libgnutls30).
    #[arg(help_heading = "Network and TLS", long, conflicts_with_all = ["tls_cert", "tls_key", "tls_client_ca"])]
    pub tls_psk: Option<PathBuf>,
    /// Export name ("" is the default export).
    #[arg(help_heading = "Source and export", long, default_value = "")]
    pub export: String,
    /// Create the cache file with this size if it does not exist. An existing cache is never
    /// resized: a different size is refused before anything is written. Sizes here and
    /// everywhere: K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024 (1G = 1GiB = 2^30
    /// bytes); kB, MB, GB, TB powers of 1000 (1GB = 10^9 bytes). The size created is logged
    /// in bytes.
    #[arg(help_heading = "Cache device", long, value_parser = parse_size, value_name = "SIZE")]
    pub cache_size: Option<u64>,
    /// Use a cache device that holds data which is not an sce cache (its contents are lost).
    /// Without it such a device is refused.
    #[arg(help_heading = "Cache device", long)]
    pub force: bool,
    /// A version string for the source's content, recorded with the cache: change it
    /// whenever the source was changed while sce was not running and sce cannot see it
    /// (an NBD export, a block device written by another host). A different value drops
    /// everything cached for the source at start.
    #[arg(help_heading = "Source and export", long)]
    pub source_generation: Option<String>,
    /// Cache mode: writethrough (asynchronous, as SCE's AWT; --awt off for the synchronous
    /// flavour), writearound, writeback or passthrough. The old names awt, write-through and
    /// write-around work too. Change it at run time with `sce ctl set EXPORT mode M`
    /// (into or out of writeback too: the cache is reopened, and leaving drains it first).
    /// Write-back acknowledges writes once they are on the cache device and a cleaner
    /// copies them to the source; `sce ctl flush --to-source` drains it; one SSD is then
    /// the only copy of that data.
    /// [default: writethrough]
    #[arg(help_heading = "Policy", long)]
    pub mode: Option<WriteMode>,
    /// The engine's tuning knobs (as in demo and the TOML file).
    #[command(flatten, next_help_heading = "Policy")]
    pub tuning: crate::policy_args::TuningArgs,
    /// Admission: sce (flash-conscious), sce-paper (the paper's Algorithm 1), always or
    /// nhit:K. [default: sce]
    #[arg(help_heading = "Policy", long)]
    pub admission: Option<Admission>,
    /// Options of admission sce and the endurance budget.
    #[command(flatten, next_help_heading = "Policy")]
    pub admission_opts: crate::policy_args::AdmissionArgs,
    /// Fragment size, the unit of heat: a power of two from 4KiB to 64MiB. Given without
    /// --line-size it is the cache line too (lvmcache's chunk). A formatted cache device
    /// keeps its own. [default: 1MiB, in lines of 512KiB under admission sce]
    #[arg(help_heading = "Cache device", long, visible_alias = "chunk-size", value_parser = parse_size)]
    pub fragment_size: Option<u64>,
    /// Lines inside fragments: cache space is allocated and filled per line of this size,
    /// heat is counted per fragment (a power of two from a 64th of the fragment to it). A
    /// formatted cache device keeps its own. [default: 512KiB under admission sce with the
    /// default fragment size, else the fragment size]
    #[arg(help_heading = "Cache device", long, value_parser = parse_size)]
    pub line_size: Option<u64>,
    /// Eviction policy: clock, lru or fifo. [default: clock]
    #[arg(help_heading = "Policy", long)]
    pub eviction: Option<EvictionKind>,
    /// Algorithm 1: populate only while the read miss rate is at least this (0..=1).
    /// [default: 0.01]
    #[arg(help_heading = "Policy", long)]
    pub target_missrate: Option<f64>,
    /// Export read-only.
    #[arg(help_heading = "Source and export", long)]
    pub read_only: bool,
    /// Serve counters over HTTP at HOST:PORT: /metrics (Prometheus text), /stats (JSON).
    /// An address other than loopback is refused unless --metrics-public is given.
    #[arg(help_heading = "Control and metrics", long)]
    pub metrics: Option<String>,
    /// Allow --metrics on an address other than loopback: anyone who can reach it reads
    /// the counters (export names, sizes, rates) without authentication.
    #[arg(help_heading = "Control and metrics", long)]
    pub metrics_public: bool,
    /// The admin socket `sce ctl` talks to (mode 0600). [default: the first --listen
    /// unix:PATH with .ctl added, e.g. /run/sce/lun0.sock.ctl]
    #[arg(help_heading = "Control and metrics", long, value_name = "PATH")]
    pub admin: Option<PathBuf>,
    /// A group (name or number) whose members may use the admin socket too; without it,
    /// only the server's own uid and root may (checked on every connection).
    #[arg(help_heading = "Control and metrics", long, value_name = "GROUP")]
    pub admin_group: Option<String>,
    /// Fall back to buffered I/O where the filesystem refuses O_DIRECT.
    #[arg(help_heading = "Cache device", long)]
    pub allow_buffered: bool,
    /// Use buffered I/O (the page cache) for files and devices instead of O_DIRECT.
    #[arg(help_heading = "Cache device", long)]
    pub buffered: bool,
    /// Connections to an NBD source (if it allows several, CAN_MULTI_CONN; else 1).
    #[arg(help_heading = "Source and export", long, default_value_t = 4)]
    pub source_connections: usize,
    /// Requests in flight on each connection to an NBD source (pipelined, answered by
    /// cookie). With the default 4 connections, up to 128 requests reach the source at once.
    #[arg(help_heading = "Source and export", long, default_value_t = 32)]
    pub source_queue_depth: usize,
    /// How an export of a local file or block device without a cache does its I/O:
    /// io_uring (many requests in flight from one thread, replies sent as they complete),
    /// threads (a pool of 32 doing blocking I/O), or auto (io_uring where a probe read
    /// through it works, else threads). Cached exports run through the cache engine.
    #[arg(help_heading = "Cache device", long, default_value_t = sce_io::Backend::Auto, value_parser = parse_backend)]
    pub io_backend: sce_io::Backend,
    /// Do not keep the cache contents across restarts: the cache device holds data only and
    /// starts cold every time.
    #[arg(help_heading = "Persistence and failures", long)]
    pub no_persist: bool,
    /// Reformat the cache device if it belongs to another source, has another fragment size
    /// or format version, is corrupt, or was disabled after errors. Its contents are lost;
    /// refused if it holds dirty write-back data, unless --discard-dirty.
    #[arg(help_heading = "Persistence and failures", long)]
    pub reformat: bool,
    /// Invalidate everything the cache device holds for this source, at start (dirty
    /// write-back data is kept: it is newer than the source).
    #[arg(help_heading = "Persistence and failures", long)]
    pub forget_volume: bool,
    /// Give up the dirty write-back data of this volume (its name in the cache device's
    /// table, as `sce check` prints it; or `all`): without it, `--reformat` or a start that
    /// leaves a volume holding dirty data out is refused. Repeatable. What is dropped is
    /// logged at ERROR.
    #[arg(help_heading = "Persistence and failures", long, value_name = "VOLUME")]
    pub discard_dirty: Vec<String>,
    /// The source's name in the cache device's volume table (default: the source's
    /// canonical path, or its URI).
    #[arg(help_heading = "Source and export", long)]
    pub source_name: Option<String>,
    /// Host directory for failure markers of cache devices that failed and could not record
    /// it themselves.
    #[arg(
        help_heading = "Persistence and failures",
        long,
        default_value = "/var/lib/sce"
    )]
    pub state_dir: PathBuf,
    /// Cache-device errors (I/O errors, checksum mismatches) after which the cache disables
    /// itself and passes I/O through to the source.
    #[arg(help_heading = "Persistence and failures", long, default_value_t = 16)]
    pub error_limit: u64,
    /// How often changed slot records are written and quiet write intents cleared. Shorter:
    /// more of the cache survives a crash, more metadata writes.
    #[arg(help_heading = "Persistence and failures", long, default_value = "1s", value_parser = parse_metadata_interval)]
    pub metadata_interval: Duration,
    /// What a crash of sce serve costs a persistent cache. on: each write to a cached
    /// fragment first names its pages in a journal on the cache device (one 4 KiB write and
    /// a cache flush before the source write, shared by concurrent writes), and a crash drops
    /// only the pages being written. off: a write marks its whole fragment (no cache-device
    /// write for a fragment written lately), and a crash drops every fragment written in the
    /// last seconds, whole: after a crash under a database load the cache restarts cold.
    /// An export's `crash_journal` in the config file overrides it.
    #[arg(help_heading = "Persistence and failures", long, default_value = "on", value_parser = parse_on_off, value_name = "on|off", action = clap::ArgAction::Set)]
    pub crash_journal: bool,
    /// on: a cached slot written twice within 30 metadata intervals turns write-hot: its
    /// write intent is set ahead of the next write (in the background), and writes to it
    /// then wait for no journal write or cache flush: over a 2 ms source, writes cost what
    /// they cost without persistence. The price: a crash drops the write-hot slots whole
    /// (the cache restarts colder after a SIGKILL amid writes). off: every write to a cached
    /// fragment waits for its journal entry, and a crash drops only the pages written.
    #[arg(help_heading = "Policy", long, default_value = "on", value_parser = parse_on_off, value_name = "on|off", action = clap::ArgAction::Set)]
    pub write_hot: bool,
    /// How much of a cache device to give a write-back log when sce formats it: auto (a
    /// sixteenth of the device, 16MiB to 4GiB, in every mode, so that `sce ctl set mode
    /// writeback` can switch a write-through export live), a size (at least 1MiB), or 0
    /// (none; write-back still gets auto). `--mode writeback` writes each write once to the
    /// log and makes it durable at FLUSH or FUA (one commit and one cache flush). A device
    /// without a log (formatted by an sce before issue 45, or with 0) is formatted afresh
    /// with one when write-back starts on it, its read cache cold; any dirty pages an older
    /// sce left in its read slots are written to the source first. Otherwise only a format
    /// (a new cache, or --reformat) takes it.
    #[arg(
        help_heading = "Persistence and failures",
        long,
        default_value = "auto",
        value_name = "auto|SIZE"
    )]
    pub writeback_log: sce_server::config::LogSize,
    /// How much of the read slots the write-back log may borrow, when sce formats the
    /// device, as dirty data outgrows the log (format 9): auto (up to half the device in
    /// all, given back as it is cleaned), a size, or 0 (none: the log's own size is the
    /// most dirty data the cache holds). Example: --writeback-grow 8GiB
    #[arg(
        help_heading = "Persistence and failures",
        long,
        default_value = "auto",
        value_name = "auto|SIZE"
    )]
    pub writeback_grow: sce_server::config::LogSize,
    /// Write-back: the cleaner cleans in the background once this share of the most the log
    /// may hold is in use (its own region and the read slots it may lend: up to half the
    /// device; gently: 16 source writes in flight, a lower CPU priority, --writeback-rate), and
    /// urgently above --writeback-high-watermark (64 in flight, no rate limit), or while
    /// writers wait for room. `sce ctl set EXPORT writeback-low-watermark 40%` changes it
    /// live. [default: 25%]
    #[arg(help_heading = "Persistence and failures", long, value_name = "SHARE")]
    pub writeback_low_watermark: Option<String>,
    /// Write-back: the share of the most the log may hold in use above which cleaning is
    /// urgent. [default: 75%]
    #[arg(help_heading = "Persistence and failures", long, value_name = "SHARE")]
    pub writeback_high_watermark: Option<String>,
    /// Write-back: the most background cleaning writes to the source per second (SIZE, or
    /// unlimited); urgent cleaning is never limited. Example: --writeback-rate 64MiB
    /// [default: unlimited]
    #[arg(help_heading = "Persistence and failures", long, value_name = "RATE")]
    pub writeback_rate: Option<String>,
    /// NBD connections served at once; more are refused. Each costs two threads.
    #[arg(help_heading = "Limits", long, default_value_t = 256)]
    pub max_connections: usize,
    /// Close a client connection idle this long between requests (0: never; NBD clients
    /// such as qemu keep idle connections for hours).
    #[arg(help_heading = "Limits", long, default_value = "0s", value_parser = crate::units::parse_duration)]
    pub idle_timeout: Duration,
    /// Longest time a client may take to send a request once it started, or to read a
    /// reply: slower clients are disconnected.
    #[arg(help_heading = "Limits", long, default_value = "60s", value_parser = crate::units::parse_duration)]
    pub client_timeout: Duration,
    /// Payload bytes held in flight for all clients together (write data received, read
    /// replies not yet sent); clients wait beyond it.
    #[arg(help_heading = "Limits", long, default_value = "256MiB", value_parser = parse_size)]
    pub inflight_budget: u64,
    /// Permission bits of Unix sockets, in octal, whatever the umask.
    #[arg(help_heading = "Network and TLS", long, default_value = "600", value_parser = parse_mode)]
    pub socket_mode: u32,
    /// An NBD source request that takes longer fails (EIO) and its connection is reopened;
    /// while the source is unreachable requests fail at once, never hang.
    #[arg(help_heading = "Source and export", long, default_value = "60s", value_parser = crate::units::parse_duration)]
    pub source_timeout: Duration,
    /// Shared mode: other hosts cache the same volumes (same source, same export name),
    /// kept coherent through etcd: etcd://HOST:PORT[,HOST:PORT...]/PREFIX. A write is
    /// acknowledged once every other host has dropped its range; a host that loses its
    /// etcd lease passes reads through to the source until it has caught up
    /// (docs/SHARED.md). Not with --mode writeback.
    #[arg(
        help_heading = "Shared mode (several hosts)",
        long,
        value_name = "etcd://HOSTS/PREFIX"
    )]
    pub shared: Option<String>,
    /// This host's name among the hosts of --shared (default: the machine's host name).
    /// One server per name: a name another live server holds is refused (clones share
    /// host names); the host's id is kept in --state-dir, so a restart is recognised.
    #[arg(
        help_heading = "Shared mode (several hosts)",
        long,
        requires = "shared"
    )]
    pub host_name: Option<String>,
    /// Shared mode: the etcd lease's time to live. A host that cannot renew it stops
    /// serving hits within this time; a host that died is waited for at most about twice it.
    #[arg(help_heading = "Shared mode (several hosts)", long, default_value = "5s", value_parser = crate::units::parse_duration)]
    pub lease_ttl: Duration,
    /// Shared mode: the size of the regions a host owns for writing. A host's first write
    /// to a region nobody owns takes it (one etcd transaction and every other host's
    /// acknowledgement); its later writes there need no etcd call, while the other hosts
    /// read that region from the source. A region written by two hosts at once stays with
    /// one of them and the other's writes are published one by one. 0: no ownership, every
    /// write is published and waits for every other host. Larger regions cost fewer
    /// acquisitions and etcd keys; smaller ones let hosts that write near each other cache
    /// what the others do not write
    #[arg(help_heading = "Shared mode (several hosts)", long, default_value = "1GiB", value_parser = parse_size, value_name = "SIZE")]
    pub region_size: u64,
    /// Shared mode: an owned region that no write used for this long is released, so
    /// that other hosts cache it again (or take it for their writes). A region another
    /// host wrote within this time is not taken: several hosts writing one region at once
    /// publish every write and all cache it, as with --region-size 0.
    #[arg(help_heading = "Shared mode (several hosts)", long, default_value = "10s", value_parser = crate::units::parse_duration)]
    pub ownership_idle: Duration,
}

/// The machine's host name (for --shared without --host-name).
fn machine_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
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

impl ServeArgs {
    fn direct_mode(&self) -> DirectMode {
        match (self.buffered, self.allow_buffered) {
            (true, _) => DirectMode::Off,
            (false, true) => DirectMode::Preferred,
            (false, false) => DirectMode::Required,
        }
    }

    /// The export the flags declare, if they give a source.
    fn export(&self) -> Result<Option<ExportConfig>> {
        let Some(src) = &self.source else {
            if self.cache.is_some() {
                bail!("--cache needs --source");
            }
            return Ok(None);
        };
        Ok(Some(ExportConfig {
            name: self.export.clone(),
            source: src.clone(),
            cache: self.cache.clone(),
            cache_size: self.cache_size.map(|n| n.to_string()),
            mode: self.mode.map(|m| m.to_string()),
            admission: self.admission.map(|m| m.to_string()),
            fragment_size: self.fragment_size.map(|n| n.to_string()),
            line_size: self.line_size.map(|n| n.to_string()),
            eviction: self.eviction.map(|m| m.to_string()),
            target_missrate: self.target_missrate,
            read_only: self.read_only,
            source_name: self.source_name.clone(),
            admission_options: Some(self.admission_opts.options()),
            awt: self.tuning.awt,
            hot_window: self.tuning.hot_window,
            awt_budget: self.tuning.awt_budget.map(|n| n.to_string()),
            period: self.tuning.period.map(|d| format!("{}us", d.as_micros())),
            min_free_pcnt: self.tuning.min_free_pcnt,
            evict_for_population: self.tuning.no_evict_for_population.then_some(false),
            writeback_low_watermark: self.writeback_low_watermark.clone(),
            writeback_high_watermark: self.writeback_high_watermark.clone(),
            writeback_rate: self.writeback_rate.clone(),
            ..ExportConfig::default()
        }))
    }

    /// The server's configuration: the flags', then the TOML file's exports and listeners.
    fn config(&self) -> Result<ServeConfig> {
        let file = match &self.config {
            Some(p) => ConfigFile::load(p)?,
            None => ConfigFile::default(),
        };
        let mut cfg = ServeConfig {
            exports: self.export()?.into_iter().collect(),
            config_file: self.config.clone(),
            listen: self.listen.clone(),
            metrics: self.metrics.clone(),
            admin: self.admin.clone(),
            admin_group: self.admin_group.clone(),
            metrics_public: self.metrics_public,
            insecure: self.insecure,
            tls: sce_server::config::TlsConfig {
                mode: self.tls,
                cert: self.tls_cert.clone(),
                key: self.tls_key.clone(),
                client_ca: self.tls_client_ca.clone(),
                psk: self.tls_psk.clone(),
            },
            direct: self.direct_mode(),
            source_connections: self.source_connections,
            source_queue_depth: self.source_queue_depth,
            io_backend: self.io_backend,
            source_timeout: self.source_timeout,
            persist: !self.no_persist,
            force: self.force,
            reformat: self.reformat,
            forget_volume: self.forget_volume,
            discard_dirty: self.discard_dirty.clone(),
            reattach: false,
            keep_detached_mark: false,
            own_writes: false,
            source_generation: self.source_generation.clone(),
            state_dir: self.state_dir.clone(),
            error_limit: self.error_limit,
            metadata_interval: self.metadata_interval,
            crash_journal: self.crash_journal,
            write_hot: self.write_hot,
            writeback_log: self.writeback_log,
            writeback_grow: self.writeback_grow,
            max_connections: self.max_connections,
            idle_timeout: self.idle_timeout,
            client_timeout: self.client_timeout,
            inflight_budget: self.inflight_budget,
            socket_mode: self.socket_mode,
            shared: match (&self.shared, &file.shared) {
                (Some(url), _) | (None, Some(url)) => {
                    let host = (self.host_name.clone())
                        .or(file.host_name.clone())
                        .unwrap_or_else(machine_name);
                    Some(
                        SharedConfig::parse(url, &host, self.lease_ttl)?
                            .with_ownership(self.region_size, self.ownership_idle)?,
                    )
                }
                (None, None) => None,
            },
            devices: Default::default(),
        };
        cfg.merge_file(file)?;
        Ok(cfg)
    }
}

/// Runs the server until SIGTERM or SIGINT. The server logs what it does (listening,
/// metrics, shutting down), each line once; this only ends the process as the stop asks.
pub fn serve(a: ServeArgs) -> Result<()> {
    let mut told = |e: sce_server::Event| match e {
        sce_server::Event::Ready => crate::notify::tell("READY=1\nSTATUS=serving"),
        sce_server::Event::ShuttingDown => crate::notify::tell("STOPPING=1"),
        _ => {}
    };
    match sce_server::run(a.config()?, &mut told)? {
        Stopped::Clean => {
            tracing::info!(target: "sce::serve", "stopped cleanly");
            Ok(())
        }
        // The server logged why. Exit here, with the caches as after a crash: the next
        // start recovers them.
        Stopped::Unflushed(_) => std::process::exit(1),
    }
}

/// Options of `sce stats`.
#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// The metrics endpoint of a running `sce serve`: HOST:PORT or its URL
    /// (http://HOST:PORT/metrics). Given, it is used whatever -s or $SCE_CTL say (an
    /// operator who exported SCE_CTL, as the README shows, can still ask an endpoint).
    #[arg(long, value_name = "ADDR|URL")]
    pub metrics: Option<String>,
    /// Or its admin socket (or data socket) [default: $SCE_CTL].
    #[arg(short = 's', long, env = "SCE_CTL", value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Print again every this many seconds, with the rates since the last print.
    #[arg(long, value_name = "SECONDS")]
    pub watch: Option<f64>,
    /// With --watch: stop after this many prints (0: until interrupted).
    #[arg(long, default_value_t = 0)]
    pub count: u64,
}

/// HOST:PORT of a metrics address or URL.
fn metrics_addr(s: &str) -> String {
    let rest = s
        .strip_prefix("http://")
        .unwrap_or(s)
        .split('/')
        .next()
        .unwrap_or("");
    rest.to_string()
}

/// Prints a running server's counters, from its metrics endpoint or its admin socket.
pub fn stats(a: StatsArgs) -> Result<()> {
    let fetch = || -> Result<serde_json::Value> {
        match (&a.metrics, &a.socket) {
            (Some(m), _) => sce_server::metrics::fetch_stats(&metrics_addr(m)),
            (None, Some(_)) => {
                let path = crate::ctl::admin_socket(a.socket.as_deref())?;
                sce_server::admin::call(
                    &path,
                    &sce_server::admin::Request {
                        verb: "stats".into(),
                        ..Default::default()
                    },
                )
            }
            (None, None) => bail!(
                "give the server: --metrics HOST:PORT (or its URL), or -s SOCKET (or set SCE_CTL)"
            ),
        }
    };
    if let Some(secs) = a.watch {
        if !(secs.is_finite() && secs > 0.0) {
            bail!("--watch takes a positive number of seconds");
        }
    }
    let mut prev: Option<(serde_json::Value, std::time::Instant)> = None;
    let mut n = 0;
    loop {
        let v = fetch()?;
        let now = std::time::Instant::now();
        if a.json {
            match a.watch {
                Some(_) => println!("{}", serde_json::to_string(&v)?),
                None => println!("{}", serde_json::to_string_pretty(&v)?),
            }
        } else {
            if n > 0 {
                println!();
            }
            let since = prev
                .as_ref()
                .map(|(p, t)| (p, now.duration_since(*t).as_secs_f64()));
            crate::ctl::print_stats(&v, since);
        }
        n += 1;
        let Some(secs) = a.watch else {
            return Ok(());
        };
        if a.count > 0 && n >= a.count {
            return Ok(());
        }
        prev = Some((v, now));
        std::thread::sleep(Duration::from_secs_f64(secs));
    }
}

fn parse_backend(s: &str) -> Result<sce_io::Backend, String> {
    s.parse()
}
