//! A server's life: build the exports, install the signal hook, listen, serve until SIGTERM
//! or SIGINT, then shut down in order: stop accepting, drain what is in flight (or fail it
//! with ESHUTDOWN), flush every export to its source, and persist the caches' records so
//! that the next start is warm.

use crate::attach::Volumes;
use crate::coherent::{Coherence, Coherent, HostIdentity};
use crate::config::ServeConfig;
use crate::export;
use crate::metrics::metrics_server;
use crate::LOG_TARGET;
use anyhow::{Context, Result};
use sce_nbd::{listen_with, Listener, Server};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the shutdown waits for open connections to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// What a running server tells its caller, for it to print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A listener is up at this address, as `--listen` takes it (`unix:PATH` or
    /// `tcp:HOST:PORT`, with the port bound when 0 was given).
    Listening(String),
    /// The metrics endpoint is up at this address (HOST:PORT).
    Metrics(String),
    /// Every listener is up and every export serves (systemd's READY=1).
    Ready,
    /// A signal came: the shutdown begins.
    ShuttingDown,
}

/// How a server stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// Every export was flushed and every cache shut down.
    Clean,
    /// The sources could not be flushed (the error says why). The caches were left as after
    /// a crash, so that the next start recovers them: the process should exit now, and
    /// nothing of the server was dropped (dropping would mark the caches clean).
    Unflushed(String),
}

/// A server with its exports built, before it listens.
struct Assembled {
    server: Arc<Server>,
    volumes: Arc<Volumes>,
    /// Every export's source health, in the same order.
    sources: Arc<crate::health::Sources>,
    /// The exports' memberships in shared volumes (shared mode).
    shared: Vec<Arc<Coherence>>,
}

/// A server that listens.
struct Running {
    assembled: Assembled,
    listeners: Vec<Listener>,
    /// Dropped first at shutdown: no control request runs while the exports are flushed.
    admin: Option<crate::admin::Admin>,
    /// The rate sampler of `ctl status` and /metrics, stopped at shutdown.
    rates: Arc<crate::rates::Rates>,
}

/// Runs a server for `cfg` until SIGTERM or SIGINT, then shuts it down. `report` hears
/// what the caller may want to print.
pub fn run(cfg: ServeConfig, report: &mut dyn FnMut(Event)) -> Result<Stopped> {
    cfg.check()?;
    export::check_ownership(&cfg.exports)?;
    refuse_shared_writeback(&cfg)?;
    // A start refused after it created cache files leaves none behind.
    let new_caches: Vec<&std::path::Path> = cfg
        .exports
        .iter()
        .filter_map(|e| e.cache.as_deref())
        .filter(|c| !c.exists())
        .collect();
    let assembled = assemble(&cfg).inspect_err(|_| remove_new_caches(&new_caches, None))?;
    // Refused later (a listener, the admin socket, TLS): the same.
    let volumes = assembled.volumes.clone();
    let (stop, running) = stop_on_signal()
        .and_then(|stop| Ok((stop, start(assembled, &cfg, report)?)))
        .inspect_err(|_| remove_new_caches(&new_caches, Some(&volumes)))?;
    report(Event::Ready);
    let _ = stop.recv();
    tracing::info!(target: LOG_TARGET, "signal received: shutting down");
    report(Event::ShuttingDown);
    Ok(running.shut_down())
}

/// Removes the cache files `new` that a refused start created, unless a volume already holds
/// write-back data only its cache has (a client served before a later listener failed):
/// those are kept, and said so at ERROR.
fn remove_new_caches(new: &[&std::path::Path], volumes: Option<&Volumes>) {
    if new.is_empty() {
        return;
    }
    let live = volumes.into_iter().flatten();
    let only_copy = live
        .filter_map(|(_, a)| a.as_ref().and_then(|a| a.live_volume()))
        .filter_map(|v| v.writeback_stats())
        .any(|w| w.dirty_bytes + w.lost_bytes > 0);
    if only_copy {
        tracing::error!(target: LOG_TARGET, "the refused start keeps the cache files it created: they hold write-back data the source does not have");
        return;
    }
    for c in new {
        if std::fs::remove_file(c).is_ok() {
            tracing::info!(target: LOG_TARGET, "removed the cache file {} this refused start created", c.display());
        }
    }
}

/// Shared mode keeps write-through caches coherent: an export in write-back is refused before
/// anything is opened or created.
fn refuse_shared_writeback(cfg: &ServeConfig) -> Result<()> {
    if cfg.shared.is_none() {
        return Ok(());
    }
    for spec in cfg.exports.iter().filter(|e| e.cache.is_some()) {
        if export::core_config(spec)?.write_mode == sce_core::WriteMode::WriteBack {
            anyhow::bail!("export {:?}: {}", spec.name, crate::coherent::NO_WRITEBACK);
        }
    }
    Ok(())
}

/// Builds every export, in order, and the NBD server over them.
fn assemble(cfg: &ServeConfig) -> Result<Assembled> {
    let mut exports = Vec::new();
    let mut volumes = Vec::new();
    let mut sources = Vec::new();
    let mut shared = Vec::new();
    let identity = match &cfg.shared {
        Some(sc) => Some(Arc::new(HostIdentity::load(&cfg.state_dir, &sc.host)?)),
        None => None,
    };
    for (spec, mut b) in cfg.exports.iter().zip(crate::group::build_all(cfg)?) {
        if let (Some(sc), Some(id), Some(att)) = (&cfg.shared, &identity, &b.volume) {
            let c = Coherence::start(sc, id, &spec.name, att.clone())
                .with_context(|| format!("export {:?}: shared mode", spec.name))?;
            let dev = Coherent::new(att.clone(), c.clone());
            b.export.device = dev.clone();
            b.export.io = Some(sce_nbd::ExportIo::Reads(dev));
            shared.push(c);
        }
        volumes.push((spec.name.clone(), b.volume));
        sources.push(b.source);
        exports.push(b.export);
    }
    let server = Server::with_config(
        exports,
        sce_nbd::ServerConfig {
            max_connections: cfg.max_connections.max(1),
            idle_timeout: (!cfg.idle_timeout.is_zero()).then_some(cfg.idle_timeout),
            request_timeout: cfg.client_timeout.max(Duration::from_millis(100)),
            reply_timeout: cfg.client_timeout.max(Duration::from_millis(100)),
            inflight_bytes: cfg.inflight_budget.max(1 << 20),
            ..sce_nbd::ServerConfig::default()
        },
    );
    Ok(Assembled {
        server,
        volumes: Arc::new(volumes),
        sources: Arc::new(sources),
        shared,
    })
}

/// Installs the hook of SIGTERM and SIGINT: the receiver hears of each.
fn stop_on_signal() -> Result<Receiver<()>> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<()>(4);
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .context("installing the signal handler")?;
    Ok(rx)
}

/// Starts the admin socket, the metrics endpoint and the listeners, in that order: anything
/// that can fail does before a client is served.
fn start(a: Assembled, cfg: &ServeConfig, report: &mut dyn FnMut(Event)) -> Result<Running> {
    let rates =
        crate::rates::Rates::start(a.volumes.clone()).context("starting the rate sampler")?;
    let admin_path = cfg.admin.clone().or_else(|| {
        cfg.listen.iter().find_map(|l| match l {
            sce_nbd::ListenAddr::Unix(p) => Some(crate::admin::default_path(p)),
            _ => None,
        })
    });
    let admin = match &admin_path {
        Some(p) => Some(crate::admin::start(
            p,
            crate::admin::AdminAccess::new(cfg.admin_group.as_deref())?,
            a.server.clone(),
            (a.volumes.clone(), a.sources.clone()),
            rates.clone(),
            (cfg.exports.clone(), cfg.config_file.clone()),
        )?),
        None => {
            tracing::info!(target: LOG_TARGET, "no admin socket (no Unix listener; give --admin PATH for sce ctl)");
            None
        }
    };
    let mut metrics = None;
    if let Some(m) = &cfg.metrics {
        metrics = Some(metrics_server(
            m,
            a.server.clone(),
            a.volumes.clone(),
            a.sources.clone(),
            rates.clone(),
        )?);
    }
    let mut listeners = Vec::new();
    let tls = cfg.tls.load()?;
    for l in &cfg.listen {
        let opts = sce_nbd::ListenOptions {
            socket_mode: cfg.socket_mode,
            tls: tls.clone(),
        };
        let h = listen_with(&a.server, l, &opts).with_context(|| format!("listening on {l:?}"))?;
        tracing::info!(target: LOG_TARGET, "listening on {}", h.local);
        report(Event::Listening(h.local.clone()));
        listeners.push(h);
    }
    if let Some(local) = metrics {
        tracing::info!(target: LOG_TARGET, "metrics on http://{local}/metrics");
        report(Event::Metrics(local));
    }
    for e in a.server.exports() {
        tracing::info!(target: LOG_TARGET, export = &e.name, size = e.device.size(), read_only = e.read_only, "serving");
    }
    Ok(Running {
        assembled: a,
        listeners,
        admin,
        rates,
    })
}

impl Running {
    /// Stops accepting, drains, flushes, and shuts the caches down.
    fn shut_down(mut self) -> Stopped {
        drop(self.admin.take());
        self.rates.stop();
        for l in &mut self.listeners {
            l.stop();
        }
        let server = &self.assembled.server;
        server.shutdown();
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while server.stats().open_connections.load(Relaxed) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Err(e) = server.flush_all() {
            // A source that is away (an NBD server down) cannot be flushed. Stop anyway,
            // without marking the caches clean: the next start recovers them as after a
            // crash. Nothing is dropped: dropping the volumes would close them and mark
            // their devices clean.
            tracing::error!(target: LOG_TARGET, "flushing the exports failed: {e}; caches are left as after a crash");
            let e = e.to_string();
            std::mem::forget(self);
            return Stopped::Unflushed(e);
        }
        // Shared volumes: stop listening and leave (the others stop waiting for this host),
        // write the caches' records, then save the revision they reflect.
        let left: Vec<i64> = self.assembled.shared.iter().map(|c| c.leave()).collect();
        if persist_caches(&self.assembled.volumes) {
            for (c, done) in self.assembled.shared.iter().zip(left) {
                c.finish(done);
            }
        }
        Stopped::Clean
    }
}

/// Every acknowledged write is on the (flushed) source. Persistent caches now write their
/// records and mark their devices clean, so the next start is warm. False if one was not
/// left clean.
fn persist_caches(volumes: &Volumes) -> bool {
    let mut all_clean = true;
    // Exports that share a cache device share its volume: it is shut down once.
    let mut done: Vec<(*const sce_engine::CacheVolume, bool)> = Vec::new();
    for (name, v) in volumes.iter() {
        let Some(v) = v.as_ref().and_then(|a| a.live_volume()) else {
            continue;
        };
        let persistent = v.persist_stats().is_some();
        let ptr = Arc::as_ptr(&v);
        let clean = match done.iter().find(|d| d.0 == ptr) {
            Some(d) => d.1,
            None => {
                let clean = v.shutdown();
                done.push((ptr, clean));
                clean
            }
        };
        if persistent {
            if clean {
                tracing::info!(target: LOG_TARGET, export = name, "cache device left clean");
            } else {
                all_clean = false;
                tracing::warn!(target: LOG_TARGET, export = name, "cache device not left clean: the next start recovers as after a crash");
            }
        }
    }
    all_clean
}
