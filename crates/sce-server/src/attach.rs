//! An export whose cache can be detached and attached while it serves (`sce ctl detach`,
//! `sce ctl attach`). [`Attachable`] is what the NBD server serves: while attached, every
//! request goes to the cached volume; detached, to the source alone.
//!
//! **Never stale across a detach.** A detach takes the gate exclusively: it waits for every
//! request on the volume to finish (requests hold the gate shared for their whole length),
//! and no request starts on the volume after it (a write-back log write the NBD reader
//! started through the volume's queue holds it only to start, and is waited for by the
//! detach's drain of the log instead: `attach/queued.rs`). It then flushes the volume (every
//! acknowledged write is on the source), shuts it down (its records written, the device
//! marked clean) and drops it, which closes the cache device and releases its lock.
//! Writes served while detached never reach the cache device, which therefore no longer
//! matches the source where they landed: an `attach` after such writes forgets everything
//! the device holds (it starts cold, and says why), and writes that arrive while the attach
//! opens the device make it forget again before the volume takes a request.
//!
//! **Settings stick.** What `sce ctl set` changed (mode, admission, sequential cutoff,
//! population rate) is kept across a detach and put back by the next attach, and a switch
//! into or out of write-back reopens the volume under the gate with them (`attach/mode.rs`).
//!
//! Lock order (levels in the locks' types, `sce_io::order`, re-exported by sce-engine): `ops` (one detach,
//! attach or mode switch at a time) before `gate`, before `draining`, `kept` and `carried`,
//! before `spec`; `gate` is held shared by requests across their I/O, exclusively only to
//! swap the volume in or out.

mod carry;
mod detached;
mod mode;
mod part;
mod queued;

pub use mode::{Drain, SetDone};
pub use sce_engine::DrainDone;

/// How an operator's long verb (a drain) learns that the operator gave up, their `sce ctl`
/// gone: it then stops, and everything stays as it was.
#[derive(Clone, Copy)]
pub struct Watch<'a> {
    gone: &'a (dyn Fn() -> bool + Sync),
}

impl<'a> Watch<'a> {
    /// Stops once `gone` says so.
    pub fn new(gone: &'a (dyn Fn() -> bool + Sync)) -> Self {
        Watch { gone }
    }
    /// Never stops (nobody to go away: a shutdown, a test).
    pub fn never() -> Watch<'static> {
        Watch { gone: &|| false }
    }
}

/// How long a drain may go without cleaning a page before it fails.
const DRAIN_PATIENCE: Duration = Duration::from_secs(60);

use crate::config::{ExportConfig, ServeConfig};
pub use crate::counters::ExportCounters;
use anyhow::{anyhow, bail, Result};
use sce_core::units::format_size;
use sce_engine::order::{levels, OrderedMutex as Mutex, OrderedRwLock as RwLock};
use sce_engine::{CacheVolume, DrainControl};
use sce_io::{BlockDevice, IoError, SharedBytes};
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// Where an export sits in a cache device it shares with other exports.
#[derive(Clone, Debug)]
pub struct Part {
    /// Its volume's index in the shared cache (address order).
    pub index: usize,
    /// Where its byte 0 is in the shared cache's address space.
    pub base: u64,
    /// The other exports on the device.
    pub siblings: Vec<String>,
}

/// Every export's name and its cache, which may be detached (none for a source exported as
/// it is): what the metrics endpoint, the rates sampler and the admin socket read.
pub type Volumes = Vec<(String, Option<Arc<Attachable>>)>;

/// A cached export that can lose and regain its cache while it serves.
pub struct Attachable {
    /// Set when the cache device is shared with other exports.
    part: Option<Part>,
    /// This export's own counts.
    pub counters: ExportCounters,
    spec: Mutex<levels::Leaf, ExportConfig>,
    cfg: ServeConfig,
    source: Arc<dyn BlockDevice>,
    /// The volume while attached. Requests hold it shared for their whole length.
    gate: RwLock<levels::AttachGate, Option<Arc<CacheVolume>>>,
    /// A volume being detached: its hit queue stays reachable until its started reads
    /// complete (they were started before the swap and are submitted after it).
    draining: Mutex<levels::AttachVolumes, Option<Arc<CacheVolume>>>,
    /// One detach or attach at a time.
    ops: Mutex<levels::AttachOps, ()>,
    /// Writes and discards served while detached, since the last attach, and their ranges.
    detached: detached::DetachedWrites,
    /// The settings in effect when the cache was detached, or set while it was: the next
    /// attach opens the volume with them (None: the export's configuration's).
    kept: Mutex<levels::AttachVolumes, Option<sce_core::CoreConfig>>,
    /// The counters of the volumes closed since the server started (`carry.rs`).
    carried: Mutex<levels::AttachVolumes, sce_engine::VolumeStats>,
}

/// What `attach` did.
#[derive(Debug, Clone, PartialEq)]
pub struct Attached {
    /// The cache device.
    pub cache: PathBuf,
    /// Fragments the device brought back (0 when it starts cold).
    pub fragments_restored: u64,
    /// Why it starts cold, if it does.
    pub forgot: Option<String>,
    /// The settings it runs with.
    pub settings: sce_core::CoreConfig,
    /// Whether they are those in effect at the detach (or set since), not the
    /// configuration's.
    pub settings_kept: bool,
}

impl Attachable {
    /// An export of `source` cached by `volume`, as `spec` declares it.
    pub fn new(
        spec: ExportConfig,
        cfg: ServeConfig,
        source: Arc<dyn BlockDevice>,
        volume: Arc<CacheVolume>,
    ) -> Arc<Attachable> {
        Self::new_part(spec, cfg, source, volume, None)
    }

    /// `new` for an export that shares its cache device (`part`), or not (None).
    pub fn new_part(
        spec: ExportConfig,
        cfg: ServeConfig,
        source: Arc<dyn BlockDevice>,
        volume: Arc<CacheVolume>,
        part: Option<Part>,
    ) -> Arc<Attachable> {
        Arc::new(Attachable {
            part,
            counters: ExportCounters::default(),
            spec: Mutex::new(spec),
            cfg: mode::without_start_overrides(cfg),
            source,
            gate: RwLock::new(Some(volume)),
            draining: Mutex::new(None),
            ops: Mutex::new(()),
            detached: detached::DetachedWrites::new(),
            kept: Mutex::new(None),
            carried: Mutex::default(),
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

    /// The cached volume, attached or (for an export that shares its device) detached but
    /// alive with the others: what a shutdown must close.
    pub fn live_volume(&self) -> Option<Arc<CacheVolume>> {
        self.volume().or_else(|| {
            self.part
                .as_ref()
                .and_then(|_| self.draining.lock().clone())
        })
    }

    /// Where the export sits in a shared cache device (None: it has its device alone).
    pub fn part(&self) -> Option<&Part> {
        self.part.as_ref()
    }

    /// The source the export caches.
    pub fn source(&self) -> &Arc<dyn BlockDevice> {
        &self.source
    }

    /// The export's byte 0 in its cached volume's address space.
    fn base(&self) -> u64 {
        self.part.as_ref().map_or(0, |p| p.base)
    }

    /// FlashTier's `exists` over the export's `[offset, offset+len)`: (offset in the export,
    /// bytes cached) per fragment; empty when detached.
    pub fn exists(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64)>, IoError> {
        let b = self.base();
        self.with(
            |v| {
                let r = v.exists(b + offset, len)?;
                Ok(r.into_iter().map(|(o, n)| (o - b, n)).collect())
            },
            |_| Ok(Vec::new()),
        )
    }

    /// The heat of the fragment at each of the export's `offsets` (all 0 when detached).
    pub fn heats(&self, offsets: &[u64]) -> Vec<u32> {
        let global: Vec<u64> = offsets.iter().map(|o| self.base() + o).collect();
        let heats = |v: &CacheVolume| Ok::<_, IoError>(v.heats(&global));
        (self.with(heats, |_| Ok(vec![0; offsets.len()]))).unwrap_or_default()
    }

    /// Bytes of the export the cache holds.
    pub fn cached_bytes(&self) -> u64 {
        let size = self.source.size();
        self.exists(0, size)
            .map_or(0, |e| e.iter().map(|x| x.1).sum::<u64>().min(size))
    }

    /// Bytes of this export only the cache holds (write-back's dirty data), None unless in
    /// write-back.
    pub fn dirty_bytes(&self) -> Option<u64> {
        let (b, size) = (self.base(), self.source.size());
        self.with(|v| v.writeback_dirty_in(b, size), |_| None)
    }

    /// Bytes of dirty data this export may hold before its writers wait for the room the
    /// device's other exports are owed (its share of the log), None unless in write-back.
    pub fn dirty_share_bytes(&self) -> Option<u64> {
        let b = self.base();
        self.with(|v| v.writeback_share_at(b), |_| None)
    }

    /// FlashTier's `evict` over the export's `[offset, offset+len)`: bytes dropped.
    pub fn evict(&self, offset: u64, len: u64) -> Result<u64, IoError> {
        let b = self.base();
        self.with(|v| v.evict(b + offset, len), |_| Ok(0))
    }

    /// Forgets what the cache holds for this export (the source changed behind its back):
    /// the fragments dropped and the metadata errors. An export that shares its device
    /// forgets only its own volume.
    pub fn forget(&self) -> Result<(u64, u64)> {
        let gate = self.gate.read();
        let v = gate
            .as_deref()
            .ok_or_else(|| anyhow!("the cache is detached"))?;
        match &self.part {
            None => Ok(v.forget()),
            Some(p) => {
                let (bytes, errors) = v.forget_volume(p.index)?;
                Ok((bytes.div_ceil(v.config().fragment_size.max(1)), errors))
            }
        }
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

    /// A write or discard of `range`: to the volume, or to the source when detached.
    fn write_with(
        &self,
        (offset, len): (u64, u64),
        f: impl FnOnce(&CacheVolume) -> Result<(), IoError>,
        g: impl FnOnce(&dyn BlockDevice) -> Result<(), IoError>,
    ) -> Result<(), IoError> {
        let gate = self.gate.read();
        match gate.as_deref() {
            Some(v) => f(v),
            None => {
                self.detached.note(offset, len);
                g(&*self.source)
            }
        }
    }

    /// NBD CACHE: prefetches into the cache while attached; nothing when detached.
    pub fn prefetch(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let b = self.base();
        self.with(|v| v.prefetch(b + offset, len), |_| Ok(()))
    }

    /// The export's range of its cache's address space (everything if it has the device
    /// alone).
    fn range(&self) -> Option<(u64, u64)> {
        self.part.as_ref().map(|p| (p.base, self.source.size()))
    }

    /// Write-back: writes the export's dirty data to the source and flushes it
    /// (`sce ctl flush --to-source`), while writes to it go through to the source, so that
    /// it ends under any load; stops if `watch` says the operator went away. Returns how
    /// it went; nothing when detached or in another mode (the source is then whole
    /// already, and flushed).
    pub fn flush_to_source(&self, watch: Watch<'_>) -> Result<DrainDone> {
        let gate = self.gate.read();
        match gate.as_deref() {
            Some(v) => self.drain_watched(v, "flush --to-source", watch),
            None => {
                self.source.flush()?;
                Ok(DrainDone::default())
            }
        }
    }

    /// Write-back: writes the dirty data of the export's `[offset, offset + len)` to the
    /// source (FlashTier's clean, `sce ctl clean`). Returns the bytes cleaned.
    pub fn clean(&self, offset: u64, len: u64, patience: Duration) -> Result<u64, IoError> {
        let b = self.base();
        self.with(
            |v| v.flush_to_source(Some((b + offset, len)), patience),
            |_| Ok(0),
        )
    }

    /// Drains the export's write-back data to its source while requests go on (writes to
    /// it go through to the source meanwhile, so the drain ends), logging every 5 s what is
    /// left and how fast it goes; stops, leaving everything as it was, if `watch` says the
    /// operator went away. `what` names the operation in the logs.
    fn drain_watched(&self, v: &CacheVolume, what: &str, watch: Watch<'_>) -> Result<DrainDone> {
        if v.writeback_stats().is_none() {
            v.flush()?;
            return Ok(DrainDone::default());
        }
        let name = self.spec.lock().name.clone();
        let told = parking_lot::Mutex::new(std::time::Instant::now());
        let progress = |d: &DrainDone| {
            let mut t = told.lock();
            if t.elapsed() >= Duration::from_secs(5) {
                *t = std::time::Instant::now();
                let rate = d.rate();
                let eta = if rate > 0.0 {
                    format!("about {:.0} s to go", d.left_bytes as f64 / rate)
                } else {
                    "no page cleaned yet".to_string()
                };
                tracing::info!(target: crate::LOG_TARGET, export = &name, left_bytes = d.left_bytes, cleaned_bytes = d.cleaned_bytes, bytes_per_second = rate as u64, "{what}: draining: {} left of {}, cleaning {}/s, {eta}", format_size(d.left_bytes), format_size(d.dirty_at_start), format_size(rate as u64));
            }
        };
        let ctl = DrainControl {
            cancelled: watch.gone,
            progress: &progress,
            patience: DRAIN_PATIENCE,
        };
        let d = v.drain_writeback(self.range(), &ctl).map_err(|e| {
            tracing::warn!(target: crate::LOG_TARGET, export = &name, "{what}: the drain stopped, and the export stays as it was: {e}");
            anyhow!("the export's write-back data could not be written to its source: {e}")
        })?;
        tracing::info!(target: crate::LOG_TARGET, export = &name, bytes = d.cleaned_bytes, seconds = d.elapsed.as_secs_f64(), "{what}: drained {} in {:.1} s", format_size(d.cleaned_bytes), d.elapsed.as_secs_f64());
        Ok(d)
    }

    /// Before a detach in write-back, under the gate: what was written since the drain
    /// (nothing new can come: requests wait at the gate) goes to the source too.
    fn drain(&self, v: &CacheVolume, watch: Watch<'_>) -> Result<()> {
        self.drain_watched(v, "the last pass", watch).map(|_| ())
    }

    /// Detaches the cache: the export serves from the source alone from now on, and the
    /// cache device is flushed, left clean and released. Returns the device's path and
    /// whether it was left clean.
    pub fn detach(&self, watch: Watch<'_>) -> Result<(PathBuf, bool)> {
        if let Some(p) = &self.part {
            return self.detach_part(p, watch);
        }
        let _op = self.ops.lock();
        let name = self.spec.lock().name.clone();
        // Write-back: the dirty data goes to the source first, while I/O goes on (writes
        // go through to the source meanwhile, so this ends), and what was written before
        // that began again under the gate, so the source is whole at the swap.
        if let Some(v) = self.volume() {
            (self.drain_watched(&v, "detach", watch)).map_err(|e| e.context("detach refused"))?;
        }
        // Reads started on the volume before the swap are submitted to its queue from now
        // on, not waiting for the gate (`attach/queued.rs`).
        *self.draining.lock() = self.volume();
        let swapped = || -> Result<Arc<CacheVolume>> {
            let mut g = self.gate.write();
            let v = g
                .clone()
                .ok_or_else(|| anyhow!("export {name:?} is detached already"))?;
            self.drain(&v, watch)
                .map_err(|e| e.context("detach refused"))?;
            // Marked detached on the device before the swap: writes from then on reach the
            // source only, so a start (rather than an attach that knows better) must not
            // trust the device. If the mark cannot be written, the export stays attached.
            v.set_detached(0, true).map_err(|e| {
                anyhow!("detach refused: the cache device cannot be marked detached: {e}")
            })?;
            *g = None;
            // Zeroed under the gate: a write waiting for it counts after this.
            self.detached.reset();
            Ok(v)
        };
        let v = swapped().inspect_err(|_| *self.draining.lock() = None)?;
        *self.kept.lock() = Some(v.config());
        let (flushed, clean) = self.close(v);
        let path = self.cache_path().unwrap_or_default();
        (self.detached).set_device(clean.then(|| self.device_mark(&path)).flatten());
        if let Err(e) = flushed {
            tracing::error!(target: crate::LOG_TARGET, export = &name, "detach: flushing failed: {e}; the cache device is left as after a crash");
            bail!("detached, but flushing failed: {e}; the cache device is left as after a crash (the next attach recovers it)");
        }
        tracing::info!(target: crate::LOG_TARGET, export = &name, cache = %path.display(), clean, "cache detached");
        Ok((path, clean))
    }

    /// Attaches a cache device (`cache`, or the last one): warm if it still matches the
    /// source, less what was written while detached (cold if too much was: `detached.rs`).
    /// `others` are the server's other exports, which the device must not belong to.
    pub fn attach(&self, cache: Option<PathBuf>, others: &[ExportConfig]) -> Result<Attached> {
        if let Some(p) = &self.part {
            return self.attach_part(p, cache);
        }
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
        part::refuse_anothers_cache(&name, &path, others)?;
        crate::export::check_ownership(&all)?;
        let written = self.detached.count();
        let (warm, own_writes) = self.warm_attach(&path);
        let mut cfg = self.cfg.clone();
        let mut forgot = None;
        // Only the device this export detached is trusted (`detached.rs`).
        (cfg.reattach, cfg.keep_detached_mark, cfg.own_writes) = (warm, warm, own_writes);
        if !warm && written > 0 {
            cfg.forget_volume = true;
            forgot = Some(format!(
                "{written} write(s) reached the source while the cache was detached (over \
                 more ranges than are kept, or not the device that was detached)"
            ));
        }
        let kept = self.kept.lock().clone();
        let v = self.open(&spec, &cfg, kept.as_ref(), &path)?;
        let restored = v.persist_stats().map_or(0, |p| p.fragments_restored);
        let mut g = self.gate.write();
        // Under the gate: no write reaches the source behind the volume from now on.
        if let Some(why) = self.settle_detached(&v, warm, written) {
            forgot = Some(why);
        }
        *g = Some(v);
        self.detached.reset();
        drop(g);
        *self.spec.lock() = spec;
        let fragments_restored = if forgot.is_some() { 0 } else { restored };
        let settings = self.volume().map(|v| v.config()).unwrap_or_default();
        tracing::info!(target: crate::LOG_TARGET, export = &name, cache = %path.display(), fragments_restored, forgot = forgot.as_deref().unwrap_or(""), mode = %settings.write_mode, admission = %settings.admission, settings_kept = kept.is_some(), "cache attached");
        Ok(Attached {
            cache: path,
            fragments_restored,
            forgot,
            settings,
            settings_kept: kept.is_some(),
        })
    }
}

impl Attachable {
    fn count_read(&self, len: usize, hit: bool) {
        let c = &self.counters;
        c.read_requests.fetch_add(1, Relaxed);
        c.read_bytes.fetch_add(len as u64, Relaxed);
        if hit {
            c.read_hits.fetch_add(1, Relaxed);
        }
    }

    /// Refuses a request beyond the export (on a shared device it would reach another
    /// export's volume); alignment is the volume's to check.
    fn within(&self, op: sce_io::Op, offset: u64, len: u64) -> Result<(), IoError> {
        sce_io::check_range(op, offset, len, self.source.size(), 1)
    }

    /// `within`, then counts the write or discard (of `len` bytes, `bytes` of them data).
    fn admit_write(
        &self,
        op: sce_io::Op,
        offset: u64,
        len: u64,
        bytes: u64,
    ) -> Result<(), IoError> {
        self.within(op, offset, len)?;
        self.counters.write_requests.fetch_add(1, Relaxed);
        self.counters.write_bytes.fetch_add(bytes, Relaxed);
        Ok(())
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
        self.within(sce_io::Op::Read, offset, buf.len() as u64)?;
        let gate = self.gate.read();
        match gate.as_deref() {
            Some(v) => {
                let hit = v.read_hit(self.base() + offset, buf)?;
                self.count_read(buf.len(), hit);
                Ok(())
            }
            None => self.source.read_at(offset, buf),
        }
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.admit_write(
            sce_io::Op::Write,
            offset,
            buf.len() as u64,
            buf.len() as u64,
        )?;
        let b = self.base();
        let range = (offset, buf.len() as u64);
        self.write_with(
            range,
            |v| v.write_at(b + offset, buf),
            |s| s.write_at(offset, buf),
        )
    }

    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        self.admit_write(
            sce_io::Op::Write,
            offset,
            data.len() as u64,
            data.len() as u64,
        )?;
        let gate = self.gate.read();
        match gate.as_deref() {
            Some(v) => v.write_shared(self.base() + offset, data),
            None => {
                self.detached.note(offset, data.len() as u64);
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
        self.admit_write(sce_io::Op::Discard, offset, len, 0)?;
        let b = self.base();
        let range = (offset, len);
        self.write_with(
            range,
            |v| v.discard(b + offset, len),
            |s| s.discard(offset, len),
        )
    }

    /// The cached volume's while attached (the source's, except in write-back, where the
    /// cache holds data the source lacks), the source's when detached.
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<sce_io::Extent>, IoError> {
        let b = self.base();
        self.with(
            |v| v.extents(b + offset, len, max),
            |s| s.extents(offset, len, max),
        )
    }

    fn extents_are_local(&self) -> bool {
        self.with(|v| v.extents_are_local(), |s| s.extents_are_local())
    }
}
