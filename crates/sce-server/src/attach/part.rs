//! `detach` and `attach` of an export that shares its cache device with other exports:
//! the device stays open with them, and only this export's part of it is dropped.

use super::{Attachable, Attached, Part, Watch};
use anyhow::{anyhow, bail, Result};
use std::path::PathBuf;

impl Attachable {
    /// `detach` of an export that shares its cache device: the device stays with the other
    /// exports; this one serves from its source, and what the cache held for it is dropped
    /// (writes while detached do not reach the cache).
    pub(super) fn detach_part(&self, p: &Part, watch: Watch<'_>) -> Result<(PathBuf, bool)> {
        let _op = self.ops.lock();
        let name = self.spec.lock().name.clone();
        // The export's dirty data first, while I/O goes on; then the rest under the gate.
        if let Some(v) = self.volume() {
            (self.drain_watched(&v, "detach", watch)).map_err(|e| e.context("detach refused"))?;
        }
        let mut g = self.gate.write();
        let v = g
            .clone()
            .ok_or_else(|| anyhow!("export {name:?} is detached already"))?;
        self.drain(&v, watch)?;
        // Under the gate, before the swap: first marked detached (durably, and nothing of
        // it is populated from now on), then its pages dropped. Whatever fails after the
        // mark, no start trusts what the device holds for it.
        v.set_detached(p.index, true)?;
        let forgot = v.forget_volume(p.index);
        *g = None;
        self.detached.reset();
        // Reads started through the hit queue before the swap finish on it; the volume
        // lives on with the other exports, so its queue stays.
        *self.draining.lock() = Some(v.clone());
        drop(g);
        let (bytes, errors) = forgot?;
        let path = self.cache_path().unwrap_or_default();
        tracing::info!(target: crate::LOG_TARGET, export = &name, cache = %path.display(), bytes_dropped = bytes, shared_with = ?p.siblings, "cache detached from this export; the device stays with the others");
        if errors > 0 {
            bail!("detached, but {errors} metadata writes failed: the cache device may bring this export's old records back after a crash; check it");
        }
        Ok((path, false))
    }

    /// `attach` of an export that shares its cache device: back to that device only, cold
    /// (what it held for the export was dropped at detach, and is again now, under the gate,
    /// for whatever a population brought in since from a source detached writes changed).
    pub(super) fn attach_part(&self, p: &Part, cache: Option<PathBuf>) -> Result<Attached> {
        let _op = self.ops.lock();
        let name = self.spec.lock().name.clone();
        let path = self.cache_path().unwrap_or_default();
        if let Some(c) = cache.filter(|c| *c != path) {
            bail!(
                "export {name:?} shares cache {} with {:?}; it can only be attached back to it, not to {}",
                path.display(),
                p.siblings,
                c.display()
            );
        }
        let mut g = self.gate.write();
        if g.is_some() {
            bail!("export {name:?} has a cache attached already; detach it first");
        }
        let v = self
            .draining
            .lock()
            .clone()
            .ok_or_else(|| anyhow!("export {name:?}: its shared cache is gone"))?;
        let (_, errors) = v.forget_volume(p.index)?;
        if errors > 0 {
            bail!("attach: {errors} metadata writes failed while dropping the export's old pages; not attached");
        }
        v.set_detached(p.index, false)?;
        let written = self.detached.count();
        self.detached.reset();
        let settings = v.config();
        *g = Some(v);
        drop(g);
        tracing::info!(target: crate::LOG_TARGET, export = &name, cache = %path.display(), "cache attached again (cold: a shared device keeps nothing of a detached export)");
        Ok(Attached {
            settings,
            // The device stayed open with the others: its settings never left.
            settings_kept: true,
            cache: path,
            fragments_restored: 0,
            forgot: Some(format!(
                "the device is shared with {:?}: what it held for this export was dropped at detach ({written} write(s) while detached)",
                p.siblings
            )),
        })
    }
}

/// An attach never takes another export's cache device, whether that export holds it now or
/// has it detached (it would be reformatted for this export's source; exports that share a
/// device name it in the configuration): refused naming the export. The device's lock alone
/// would refuse only the first, as "in use by another process".
pub(super) fn refuse_anothers_cache(
    name: &str,
    path: &std::path::Path,
    others: &[crate::config::ExportConfig],
) -> Result<()> {
    let key = crate::ownership::canonical_name(path);
    let theirs = |o: &&crate::config::ExportConfig| {
        o.name != name
            && (o.cache.as_deref()).is_some_and(|c| crate::ownership::canonical_name(c) == key)
    };
    if let Some(o) = others.iter().find(theirs) {
        bail!(
            "export {name:?}: {} is the cache device of export {:?}: an attach never takes \
             another export's device (exports that share one name it in the configuration)",
            path.display(),
            o.name
        );
    }
    Ok(())
}
