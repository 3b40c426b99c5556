//! `set` and `attach`: the settings an operator changes at run time, and what both report.

use super::{Ctx, Request};
use crate::attach::Drain;
use crate::LOG_TARGET;
use anyhow::{anyhow, bail, Result};
use sce_core::{Admission, Retune, WriteMode};
use serde_json::{json, Value};

impl Ctx {
    pub(super) fn set(&self, req: &Request, watch: crate::attach::Watch<'_>) -> Result<Value> {
        let (n, a) = self.attachable(req.export.as_deref())?;
        let (Some(key), Some(value)) = (req.key.as_deref(), req.value.as_deref()) else {
            bail!("set needs a key and a value");
        };
        let t = retune(key, value)?;
        if t.write_mode == Some(WriteMode::WriteBack) && crate::coherent::of(a).is_some() {
            bail!(
                "shared mode does not run write-back: another host would read the source \
                 without this host's dirty data"
            );
        }
        let drain = if req.no_wait {
            Drain::Refuse
        } else {
            Drain::Wait
        };
        // Settings are the cache device's: exports that share it change together.
        let also: Vec<String> = a.part().map_or_else(Vec::new, |p| p.siblings.clone());
        // --save: the file's edit is prepared and checked before anything changes, and
        // written after (under the save lock throughout: saves do not interleave).
        let _saving = req.save.then(super::save::lock);
        let pending = match (req.save, &self.config_file) {
            (true, None) => bail!(
                "--save: this server was started without --config, from flags alone: there is \
                 no file to save to (nothing was changed)"
            ),
            (true, Some(f)) => {
                let names: Vec<String> =
                    std::iter::once(n.to_string()).chain(also.clone()).collect();
                Some(super::save::prepare(f, &names, key, value)?)
            }
            (false, _) => None,
        };
        let done = a.set(&t, drain, watch)?;
        tracing::info!(target: LOG_TARGET, export = n, key, value, reopened = done.reopened, detached = done.detached, "ctl set");
        if let Some(p) = &pending {
            if let Err(e) = p.write() {
                let e = crate::error_text(&e);
                tracing::warn!(target: LOG_TARGET, export = n, key, value, "ctl set: applied, but not saved: {e}");
                bail!("{key} is {value} now, but it was not saved: {e}");
            }
            tracing::info!(target: LOG_TARGET, export = n, key, value, file = %p.file().display(), "ctl set: saved");
        }
        let mut m = settings_json(&done.settings);
        m["export"] = json!(n);
        m["also_applies_to"] = json!(also);
        m["reopened"] = json!(done.reopened);
        m["drained_bytes"] = json!(done.drained_bytes);
        m["drain_seconds"] = json!(done.drain_seconds);
        m["detached"] = json!(done.detached);
        m["saved_to"] = json!(pending.map(|p| p.file().display().to_string()));
        Ok(m)
    }

    pub(super) fn attach(&self, req: &Request) -> Result<Value> {
        let (n, a) = self.attachable(req.export.as_deref())?;
        let cache = req.value.as_deref().map(std::path::PathBuf::from);
        // The other exports as they are now (their caches may have moved).
        let others: Vec<_> = self
            .exports
            .iter()
            .map(|e| {
                let mut e = e.clone();
                if let Some((_, Some(att))) = self.volumes.iter().find(|(x, _)| *x == e.name) {
                    e.cache = att.cache_path().or(e.cache);
                }
                e
            })
            .collect();
        let r = a.attach(cache, &others)?;
        let mut m = settings_json(&r.settings);
        m["export"] = json!(n);
        m["cache"] = json!(r.cache.display().to_string());
        m["warm"] = json!(r.forgot.is_none());
        m["fragments_restored"] = json!(r.fragments_restored);
        m["cold_because"] = json!(r.forgot);
        m["settings_kept"] = json!(r.settings_kept);
        Ok(m)
    }
}

/// The settings `set` changes, as `set` and `attach` report them.
fn settings_json(cfg: &sce_core::CoreConfig) -> Value {
    json!({
        "mode": cfg.write_mode.to_string(),
        "admission": cfg.admission.to_string(),
        "sequential_cutoff_bytes": cfg.sequential_cutoff,
        "population_rate_bytes_per_second": cfg.population_rate,
        "population_rate_adaptive": cfg.population_adaptive,
        "writeback_low_watermark": cfg.writeback.low_watermark,
        "writeback_high_watermark": cfg.writeback.high_watermark,
        "writeback_rate_bytes_per_second": cfg.writeback.rate,
    })
}

/// A watermark: a share of the write-back log, "40%" or 0.4.
fn share(key: &str, value: &str) -> Result<f64> {
    sce_core::wbtune::parse_share(value).map_err(|e| anyhow!("{key}: {e}"))
}

/// What `set KEY VALUE` changes.
pub fn retune(key: &str, value: &str) -> Result<Retune> {
    let mut t = Retune::default();
    match key {
        "mode" => t.write_mode = Some(value.parse::<WriteMode>().map_err(|e| anyhow!(e))?),
        "admission" => t.admission = Some(value.parse::<Admission>().map_err(|e| anyhow!(e))?),
        "seq-cutoff" | "sequential-cutoff" => {
            t.sequential_cutoff =
                Some(sce_core::units::parse_size(value).map_err(|e| anyhow!("seq-cutoff: {e}"))?)
        }
        "population-rate" => {
            let r = value
                .parse::<crate::admission::PopulationRate>()
                .map_err(|e| anyhow!(e))?;
            let d = sce_core::CoreConfig::default();
            t.population_rate = Some(match r {
                crate::admission::PopulationRate::Auto => (d.population_rate, true),
                crate::admission::PopulationRate::AutoUpTo(n) => (n, true),
                crate::admission::PopulationRate::Fixed(n) => (n, false),
                crate::admission::PopulationRate::Unlimited => (0, false),
            });
        }
        "writeback-low-watermark" => {
            t.writeback_low_watermark = Some(share(key, value)?);
        }
        "writeback-high-watermark" => {
            t.writeback_high_watermark = Some(share(key, value)?);
        }
        "writeback-rate" => {
            t.writeback_rate =
                Some(sce_core::wbtune::parse_rate(value).map_err(|e| anyhow!("{key}: {e}"))?)
        }
        k => bail!(
            "cannot set {k:?} at run time (mode, admission, seq-cutoff, population-rate, \
             writeback-low-watermark, writeback-high-watermark, writeback-rate)"
        ),
    }
    Ok(t)
}
