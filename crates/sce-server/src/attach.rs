//! An export whose cache can be detached and attached while it serves (`sce ctl detach`,
//! `sce ctl attach`). [`Attachable`] is what the NBD server serves: while attached, every
//! request goes to the cached volume; detached, to the source alone.
//!
//! **Never stale across a detach.** A detach takes the gate exclusively: it waits for every
//! request on the volume to finish (requests hold the gate shared for their whole length),
//! and no request starts on the volume after it. It then flushes the volume (every
//! acknowledged write is on the source), shuts it down (its records written, the device
//! marked clean) and drops it, which closes the cache device and releases its lock.
//! Writes served while detached never reach the cache device, which therefore no longer
//! matches the source where they landed: an `attach` after such writes forgets everything
//! the device holds (it starts cold, and says why), and writes that arrive while the attach
//! opens the device make it forget again before the volume takes a request.
//!
//! Lock order: `ops` (one detach or attach at a time) before `gate`; `gate` is held shared
//! by requests across their I/O, exclusively only to swap the volume in or out.

use crate::config::{ExportConfig, ServeConfig};
use anyhow::{anyhow, bail, Result};
use parking_lot::{Mutex, RwLock};
use sce_engine::CacheVolume;
use sce_io::{BlockDevice, IoError, IoQueue, QueuedReads, SharedBytes, StartedRead};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A cached export that can lose and regain its cache while it serves.
pub struct Attachable {
    spec: Mutex<ExportConfig>,
    cfg: ServeConfig,
    source: Arc<dyn BlockDevice>,
    /// The volume while attached. Requests hold it shared for their whole length.
    gate: RwLock<Option<Arc<CacheVolume>>>,
    /// A volume being detached: its hit queue stays reachable until its started reads
    /// complete (they were started before the swap and are submitted after it).
    draining: Mutex<Option<Arc<CacheVolume>>>,
    /// One detach or attach at a time.
    ops: Mutex<()>,
    /// Writes and discards served while detached, since the last attach.
    writes_detached: AtomicU64,
}

/// What `attach` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    /// The cache device.
    pub cache: PathBuf,
    /// Fragments the device brought back (0 when it starts cold).
    pub fragments_restored: u64,
    /// Why it starts cold, if it does.
    pub forgot: Option<String>,
}

impl Attachable {
    /// An export of `source` cached by `volume`, as `spec` declares it.
    pub fn new(
        spec: ExportConfig,
        cfg: ServeConfig,
        source: Arc<dyn BlockDevice>,
        volume: Arc<CacheVolume>,
    ) -> Arc<Attachable> {
        Arc::new(Attachable {
            spec: Mutex::new(spec),
            cfg,
            source,
            gate: RwLock::new(Some(volume)),
            draining: Mutex::new(None),
            ops: Mutex::new(()),
            writes_detached: AtomicU64::new(0),
        })
    }

    /// The cached volume, while attached.
    pub fn volume(&self) -> Option<Arc<CacheVolume>> {
        self.gate.read().clone()
    }

    /// The cache device's path (the last attached).
    pub fn cache_path(&self) -> Option<PathBuf> {
        self.spec.lock().cache.clone()
    }

    /// Writes served while detached since the last attach.
    pub fn writes_while_detached(&self) -> u64 {
        self.writes_detached.load(Relaxed)
    }

    /// Runs `f` on the volume, or `g` on the source when detached, holding the gate.
    fn with<R>(
        &self,
        f: impl FnOnce(&CacheVolume) -> R,
        g: impl FnOnce(&dyn BlockDevice) -> R,
    ) -> R {
        let gate = self.gate.read();
        match gate.as_deref() {
            Some(v) => f(v),
            None => g(&*self.source),
        }
    }

    /// A write or discard: to the volume, or to the source (counted) when detached.
    fn write_with(
        &self,
        f: impl FnOnce(&CacheVolume) -> Result<(), IoError>,
        g: impl FnOnce(&dyn BlockDevice) -> Result<(), IoError>,
    ) -> Result<(), IoError> {
        let gate = self.gate.read();
        match gate.as_deref() {
            Some(v) => f(v),
            None => {
                // Counted before it is sent: an attach that sees the count unchanged knows
                // no write it missed can land on the source later.
                self.writes_detached.fetch_add(1, Relaxed);
                g(&*self.source)
            }
        }
    }

    /// NBD CACHE: prefetches into the cache while attached; nothing when detached.
    pub fn prefetch(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.with(|v| v.prefetch(offset, len), |_| Ok(()))
    }

    /// Detaches the cache: the export serves from the source alone from now on, and the
    /// cache device is flushed, left clean and released. Returns the device's path and
    /// whether it was left clean.
    pub fn detach(&self) -> Result<(PathBuf, bool)> {
        let _op = self.ops.lock();
        let name = self.spec.lock().name.clone();
        let v = {
            let mut g = self.gate.write();
            g.take()
                .ok_or_else(|| anyhow!("export {name:?} is detached already"))?
        };
        self.writes_detached.store(0, Relaxed);
        // Reads started through the hit queue before the swap finish on it.
        *self.draining.lock() = Some(v.clone());
        let t0 = Instant::now();
        while v.latencies().in_flight.load(Relaxed) > 0 && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(2));
        }
        let flushed = v.flush();
        let clean = flushed.is_ok() && v.shutdown();
        *self.draining.lock() = None;
        let path = self.cache_path().unwrap_or_default();
        drop(v);
        if let Err(e) = flushed {
            tracing::error!(target: crate::LOG_TARGET, export = %name, "detach: flushing failed: {e}; the cache device is left as after a crash");
            bail!("detached, but flushing failed: {e}; the cache device is left as after a crash (the next attach recovers it)");
        }
        tracing::info!(target: crate::LOG_TARGET, export = %name, cache = %path.display(), clean, "cache detached");
        Ok((path, clean))
    }

    /// Attaches a cache device (`cache`, or the last one): warm if it still matches the
    /// source and nothing was written while detached, else cold. `others` are the server's
    /// other exports, which the device must not belong to.
    pub fn attach(&self, cache: Option<PathBuf>, others: &[ExportConfig]) -> Result<Attached> {
        let _op = self.ops.lock();
        let mut spec = self.spec.lock().clone();
        let name = spec.name.clone();
        if self.gate.read().is_some() {
            bail!("export {name:?} has a cache attached already; detach it first");
        }
        if let Some(c) = cache {
            spec.cache = Some(c);
        }
        let path = spec
            .cache
            .clone()
            .ok_or_else(|| anyhow!("export {name:?}: give the cache device to attach"))?;
        let mut all: Vec<ExportConfig> =
            others.iter().filter(|e| e.name != name).cloned().collect();
        all.push(spec.clone());
        crate::export::check_ownership(&all)?;
        let written = self.writes_detached.load(Relaxed);
        let mut cfg = self.cfg.clone();
        let mut forgot = None;
        if written > 0 {
            cfg.forget_volume = true;
            forgot = Some(format!(
                "{written} write(s) reached the source while the cache was detached"
            ));
        }
        let core = crate::export::core_of(&spec)?;
        let v = crate::export::open_volume(&spec, &cfg, core, self.source.clone(), &path)?;
        let restored = v.persist_stats().map_or(0, |p| p.fragments_restored);
        let mut g = self.gate.write();
        let late = self.writes_detached.load(Relaxed);
        if late != written {
            // Written while the device was opening: the volume restored pages those writes
            // changed on the source. Forget before the first request.
            let (_, errors) = v.forget();
            forgot = Some(format!(
                "{} write(s) reached the source while the cache was detached or attaching{}",
                late,
                if errors > 0 {
                    " (and its records could not be written)"
                } else {
                    ""
                }
            ));
        }
        *g = Some(v);
        self.writes_detached.store(0, Relaxed);
        drop(g);
        *self.spec.lock() = spec;
        let fragments_restored = if forgot.is_some() { 0 } else { restored };
        tracing::info!(target: crate::LOG_TARGET, export = %name, cache = %path.display(), fragments_restored, forgot = forgot.as_deref().unwrap_or(""), "cache attached");
        Ok(Attached {
            cache: path,
            fragments_restored,
            forgot,
        })
    }
}

impl BlockDevice for Attachable {
    fn size(&self) -> u64 {
        self.source.size()
    }

    fn logical_block_size(&self) -> u32 {
        self.with(|v| v.logical_block_size(), |s| s.logical_block_size())
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let gate = self.gate.read();
        match gate.as_deref() {
            Some(v) => v.read_at(offset, buf),
            None => self.source.read_at(offset, buf),
        }
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.write_with(|v| v.write_at(offset, buf), |s| s.write_at(offset, buf))
    }

    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        let gate = self.gate.read();
        match gate.as_deref() {
            Some(v) => v.write_shared(offset, data),
            None => {
                self.writes_detached.fetch_add(1, Relaxed);
                self.source.write_shared(offset, data)
            }
        }
    }

    fn identity(&self) -> Option<String> {
        self.source.identity()
    }

    fn flush(&self) -> Result<(), IoError> {
        self.with(|v| v.flush(), |s| s.flush())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.write_with(|v| v.discard(offset, len), |s| s.discard(offset, len))
    }

    /// The source's, attached or not: it holds every acknowledged write either way.
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<sce_io::Extent>, IoError> {
        self.source.extents(offset, len)
    }
}

impl QueuedReads for Attachable {
    fn start_read(&self, offset: u64, len: u64) -> Option<StartedRead> {
        self.gate.read().as_deref()?.start_read(offset, len)
    }

    fn queue(&self) -> Option<Arc<dyn IoQueue>> {
        if let Some(v) = self.gate.read().as_deref() {
            return v.queue();
        }
        self.draining.lock().as_deref()?.queue()
    }
}
