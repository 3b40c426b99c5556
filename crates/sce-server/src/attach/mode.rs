//! Settings changed at run time (`sce ctl set`), and a switch of write mode into or out of
//! write-back, which reopens the volume: the engine chooses its write path (and whether it
//! keeps a log) when it opens.
//!
//! **The switch.** Leaving write-back first writes every dirty page to the source while
//! requests go on, their writes going through to the source meanwhile so that the drain
//! ends (progress logged every 5 s: what is left, how fast it goes); it stops, and the
//! mode stays, if the operator's client goes away; it is refused at once if the operator
//! asked it not to wait. Then, under the gate taken exclusively (requests wait, as for a
//! detach), what was written before the drain began is drained again, the volume is
//! flushed, shut down clean and closed, and the same device is opened again in the new
//! mode, warm: nothing reached the source behind its back. Should the reopen fail, the old
//! mode is tried, and should that fail too the export is left detached, serving from its
//! source (which holds every acknowledged write), and the error says so. Entering
//! write-back needs a device with a write-back log: one formatted without is refused,
//! naming the command that gives it one.

use super::{Attachable, Watch};
use crate::config::{ExportConfig, ServeConfig};
use crate::LOG_TARGET;
use anyhow::{anyhow, bail, Result};
use sce_core::{CoreConfig, Retune, WriteMode};
use sce_engine::CacheVolume;
use sce_io::BlockDevice;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How leaving write-back treats dirty data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drain {
    /// Write it to the source first, however long that takes (the switch fails if the
    /// source takes no page for a minute).
    Wait,
    /// Refuse if there is any.
    Refuse,
}

/// What `set` did.
#[derive(Debug, Clone)]
pub struct SetDone {
    /// The settings in effect now (or, detached, those the next attach takes).
    pub settings: CoreConfig,
    /// Bytes of dirty data written to the source before leaving write-back.
    pub drained_bytes: u64,
    /// How long that drain took.
    pub drain_seconds: f64,
    /// Whether the volume was closed and opened again (a switch into or out of write-back).
    pub reopened: bool,
    /// Whether the export is detached (the settings wait for the attach).
    pub detached: bool,
}

/// Whether opening failed because the device is locked (by this process's old volume, a
/// moment after its close).
fn busy(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<sce_io::IoError>(),
            Some(sce_io::IoError::Busy { .. })
        )
    })
}

/// `cfg` as attaches and reopens use it: without the start's overrides (`--force`,
/// `--reformat`, `--forget-volume`, `--discard-dirty`), which the operator gave for the
/// devices the start found. Kept, they would let `sce ctl attach` overwrite foreign data at
/// any path it is given (it has no `--force` of its own), and reach every reopen of a mode
/// switch (with `--reformat` a switch into write-back failed; with `--forget-volume` it
/// dropped what the cache held).
pub(super) fn without_start_overrides(cfg: ServeConfig) -> ServeConfig {
    ServeConfig {
        force: false,
        reformat: false,
        forget_volume: false,
        discard_dirty: Vec::new(),
        ..cfg
    }
}

fn is_wb(m: WriteMode) -> bool {
    m == WriteMode::WriteBack
}

impl Attachable {
    /// `sce ctl set`: changes the settings of the attached volume, reopening it to enter or
    /// leave write-back; detached, keeps them for the next attach. A drain stops if `watch`
    /// says the operator went away.
    pub fn set(&self, t: &Retune, drain: Drain, watch: Watch<'_>) -> Result<SetDone> {
        let _op = self.ops.lock();
        let Some(v) = self.volume() else {
            return self.set_detached(t);
        };
        let cur = v.config();
        let crossing = t
            .write_mode
            .is_some_and(|m| is_wb(m) != is_wb(cur.write_mode));
        if !crossing {
            let settings = v.retune(t).map_err(|e| anyhow!("{e}"))?;
            return Ok(SetDone {
                settings,
                drained_bytes: 0,
                drain_seconds: 0.0,
                reopened: false,
                detached: false,
            });
        }
        let next = t.applied_to(&cur);
        next.validate().map_err(|e| anyhow!("{e}"))?;
        self.may_cross(&v, &next)?;
        let mut drained = super::DrainDone::default();
        if is_wb(cur.write_mode) {
            let dirty = v
                .writeback_stats()
                .map_or(0, |s| s.dirty_bytes + s.lost_bytes);
            if dirty > 0 && drain == Drain::Refuse {
                bail!(
                    "the cache holds {} of write-back data the source lacks: not leaving \
                     writeback without waiting (run without --no-wait to write it to the \
                     source first, or `sce ctl flush --to-source` and try again)",
                    sce_core::units::format_size(dirty)
                );
            }
            drained = (self.drain_watched(&v, "leaving writeback", watch)).map_err(|e| {
                e.context(format!("still in {}: the drain stopped", cur.write_mode))
            })?;
        }
        drop(v);
        self.reopen(&cur, &next, watch)?;
        Ok(SetDone {
            settings: self.volume().map_or(next, |v| v.config()),
            drained_bytes: drained.cleaned_bytes,
            drain_seconds: drained.elapsed.as_secs_f64(),
            reopened: true,
            detached: false,
        })
    }

    /// Why the volume may not enter or leave write-back now (a shared device, a failed one,
    /// no persistence to enter with, lost pages to leave with), if it may not. A device
    /// without a write-back log (formatted by an sce before issue 45) is given one by the
    /// reopen into write-back, formatted afresh (its read cache starts cold).
    fn may_cross(&self, v: &CacheVolume, next: &CoreConfig) -> Result<()> {
        if let Some(p) = &self.part {
            bail!(
                "the cache device is shared with {:?}: write-back is entered or left for the \
                 whole device, at its start (restart with --mode)",
                p.siblings
            );
        }
        if v.is_passthrough() {
            bail!(
                "the cache device failed (it passes I/O through): a mode that needs it cannot \
                 be entered or left now; restart on a healthy device"
            );
        }
        if is_wb(next.write_mode) && v.persist_stats().is_none() {
            bail!("writeback needs a persistent cache (this one runs with --no-persist)");
        }
        let lost = v.writeback_stats().map_or(0, |s| s.lost_bytes);
        if lost > 0 {
            bail!(
                "the cache lost {} of write-back data the source lacks (reads of it fail): \
                 leaving writeback would serve the source's older bytes there; write those \
                 pages again first",
                sce_core::units::format_size(lost)
            );
        }
        Ok(())
    }

    /// `set` while detached: the next attach opens the volume with it. An export that
    /// shares its device: the device, open with the others, takes it now.
    fn set_detached(&self, t: &Retune) -> Result<SetDone> {
        if self.part.is_some() {
            let v = (self.draining.lock().clone())
                .ok_or_else(|| anyhow!("the export's shared cache is gone"))?;
            let cur = v.config().write_mode;
            if t.write_mode.is_some_and(|m| is_wb(m) != is_wb(cur)) {
                bail!("the cache device is shared: write-back is entered or left at its start");
            }
            let settings = v.retune(t).map_err(|e| anyhow!("{e}"))?;
            return Ok(SetDone {
                settings,
                drained_bytes: 0,
                drain_seconds: 0.0,
                reopened: false,
                detached: true,
            });
        }
        let mut kept = self.kept.lock();
        let base = match kept.clone() {
            Some(k) => k,
            None => crate::export::core_of(&self.spec.lock())?,
        };
        let next = t.applied_to(&base);
        next.validate().map_err(|e| anyhow!("{e}"))?;
        *kept = Some(next.clone());
        Ok(SetDone {
            settings: next,
            drained_bytes: 0,
            drain_seconds: 0.0,
            reopened: false,
            detached: true,
        })
    }

    /// Closes the volume and opens its device again with `next`, under the gate; on
    /// failure the old settings (`cur`), and detached if those fail too.
    fn reopen(&self, cur: &CoreConfig, next: &CoreConfig, watch: Watch<'_>) -> Result<()> {
        let spec = self.spec.lock().clone();
        let path = self
            .cache_path()
            .ok_or_else(|| anyhow!("the export has no cache device"))?;
        // Reads started on the volume before the swap are submitted to its queue (not
        // waiting for the gate held below: `attach/queued.rs`).
        *self.draining.lock() = self.volume();
        let mut g = self.gate.write();
        let Some(v) = g.clone() else {
            *self.draining.lock() = None;
            bail!("the cache is detached");
        };
        if let Err(e) = self.ready_to_close(&v, watch) {
            *self.draining.lock() = None;
            return Err(e.context(format!(
                "not switched to {}: it serves in {} as before",
                next.write_mode, cur.write_mode
            )));
        }
        *g = None;
        let (flushed, clean) = self.close(v);
        if let Err(e) = flushed {
            // Flushed a moment ago under the gate; the device is marked detached, so a
            // start that finds it so trusts nothing of it.
            tracing::error!(target: LOG_TARGET, export = &spec.name, "mode switch: flushing the closed cache failed: {e}");
        }
        let mut cfg = self.cfg.clone();
        // Its "detached" mark (set before the close) stays until the new volume serves: a
        // reopen that fails must not leave an unmarked device behind a detached export.
        (cfg.reattach, cfg.keep_detached_mark) = (true, true);
        let unmark = |nv: &Arc<CacheVolume>| {
            if let Err(e) = nv.set_detached(0, false) {
                tracing::warn!(target: LOG_TARGET, export = &spec.name, "mode switch: the cache device's detached mark could not be cleared ({e}): a restart will start it cold");
            }
        };
        let err = match self.open(&spec, &cfg, Some(next), &path) {
            Ok(nv) => {
                unmark(&nv);
                *g = Some(nv);
                tracing::warn!(target: LOG_TARGET, export = &spec.name, from = %cur.write_mode, to = %next.write_mode, clean, "write mode switched (the volume was reopened)");
                return Ok(());
            }
            Err(e) => e,
        };
        tracing::error!(target: LOG_TARGET, export = &spec.name, "mode switch to {}: reopening the cache failed: {err:#}; back to {}", next.write_mode, cur.write_mode);
        match self.open(&spec, &cfg, Some(cur), &path) {
            Ok(nv) => {
                unmark(&nv);
                *g = Some(nv);
                Err(err.context(format!(
                    "not switched to {}: the cache could not be opened so; it serves in {} again",
                    next.write_mode, cur.write_mode
                )))
            }
            Err(e2) => {
                *self.kept.lock() = Some(cur.clone());
                self.detached.reset();
                tracing::error!(target: LOG_TARGET, export = &spec.name, "the cache could not be opened again: {e2:#}; the export serves from its source, detached");
                Err(err.context(format!(
                    "the cache could not be opened again ({e2:#}): the export is detached and \
                     serves from its source, which holds every acknowledged write; `sce ctl \
                     attach` once the cause is fixed"
                )))
            }
        }
    }

    /// Under the gate, before a switch closes the volume `v`: what was written since the
    /// drain goes to the source; nothing dirty or lost may remain (the cache's copy is the
    /// only one: a lost page is refused, never dropped); every acknowledged write is
    /// flushed; and the device is marked detached, so that should neither reopen succeed,
    /// a start does not trust it (the reopen, knowing better, clears the mark). Any
    /// failure leaves the volume as it was.
    fn ready_to_close(&self, v: &CacheVolume, watch: Watch<'_>) -> Result<()> {
        self.drain(v, watch)?;
        if let Some(w) = v.writeback_stats() {
            if w.dirty_bytes + w.lost_bytes > 0 {
                bail!(
                    "the cache still holds {} of write-back data the source lacks ({} of it \
                     lost: reads of it fail until it is written again)",
                    sce_core::units::format_size(w.dirty_bytes + w.lost_bytes),
                    sce_core::units::format_size(w.lost_bytes)
                );
            }
        }
        v.flush()
            .map_err(|e| anyhow!("flushing the cache and the source failed: {e}"))?;
        v.set_detached(0, true)
            .map_err(|e| anyhow!("the cache device cannot be marked for the reopen: {e}"))
    }

    /// Opens the export's cache device at `path`, with `settings` where given (those an
    /// operator set at run time) over the configuration's.
    pub(super) fn open(
        &self,
        spec: &ExportConfig,
        cfg: &ServeConfig,
        settings: Option<&CoreConfig>,
        path: &Path,
    ) -> Result<Arc<CacheVolume>> {
        let mut core = crate::export::core_of(spec)?;
        if let Some(s) = settings {
            core.write_mode = s.write_mode;
        }
        // Right after a close, the last of the old volume's threads may still hold the
        // device (and its lock) for a moment.
        let t0 = Instant::now();
        let v = loop {
            match crate::export::open_volume(spec, cfg, core.clone(), self.source.clone(), path) {
                Err(e) if busy(&e) && t0.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                r => break r?,
            }
        };
        if let Some(s) = settings {
            v.retune(&Retune::all_of(s)).map_err(|e| anyhow!("{e}"))?;
        }
        Ok(v)
    }

    /// Closes a volume swapped out of the gate: reads started through its hit queue before
    /// the swap finish first, then it is flushed and shut down, and the last reference to
    /// it is waited for (briefly), so that its device's lock is released when this
    /// returns. Returns the flush's result and whether the device was left clean.
    pub(super) fn close(&self, v: Arc<CacheVolume>) -> (Result<(), sce_io::IoError>, bool) {
        *self.draining.lock() = Some(v.clone());
        let t0 = Instant::now();
        while v.latencies().in_flight.load(Relaxed) > 0 && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(2));
        }
        let flushed = v.flush();
        let clean = flushed.is_ok() && v.shutdown();
        self.carry(&v);
        *self.draining.lock() = None;
        // A metrics scrape or status may hold it for a moment.
        let t0 = Instant::now();
        while Arc::strong_count(&v) > 1 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(2));
        }
        if Arc::strong_count(&v) > 1 {
            tracing::warn!(target: LOG_TARGET, "a closed cache volume is still referenced: its device stays open (and locked) until that ends");
        }
        drop(v);
        (flushed, clean)
    }
}
