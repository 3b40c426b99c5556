//! Warm migration (Mercury): `sce ctl handoff EXPORT --to HOST` puts what this host's cache
//! holds of the volume under `PREFIX/VOLUME/handoff/HOST`, fullest fragments first; the
//! receiving server reads it into its own cache in the background (NBD CACHE's prefetch),
//! so that a VM moved there starts warm. Prefetching reads the source, which is always
//! current in write-through, so the list can never bring stale data: at worst it names
//! cold fragments.

use super::Coherence;
use anyhow::{bail, Result};
use sce_io::BlockDevice;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

/// At most this many fragments go in one hand-off (etcd's value limit is 1.5 MiB; a line is
/// at most 21 bytes).
const MAX_FRAGMENTS: usize = 60_000;

/// `ctl handoff` of export `n`: its hot list for host `to`.
pub fn handoff_verb(
    n: &str,
    a: &Arc<crate::attach::Attachable>,
    to: Option<&str>,
) -> Result<serde_json::Value> {
    let c = super::of(a)
        .ok_or_else(|| anyhow::anyhow!("export {n:?} is not in shared mode (--shared)"))?;
    let (fragments, bytes) = handoff(&c, to.unwrap_or(""))?;
    Ok(serde_json::json!({"export": n, "fragments": fragments, "bytes": bytes}))
}

/// Refuses `verb` on export `n` in shared mode: a detached cache hears no invalidation,
/// so an attach would bring back pages other hosts have overwritten.
pub fn refuse_in_shared_mode(
    n: &str,
    a: &Arc<crate::attach::Attachable>,
    verb: &str,
) -> Result<()> {
    if super::of(a).is_some() {
        bail!(
            "export {n:?} is in shared mode: {verb} is refused (a detached cache would miss \
             the other hosts' invalidations); stop the server to take its cache away"
        );
    }
    Ok(())
}

/// Publishes the export's hot list for host `to`: (fragments, bytes) listed.
pub fn handoff(c: &Coherence, to: &str) -> Result<(u64, u64)> {
    if to.is_empty() || to.contains('/') {
        bail!("handoff: give the receiving host's --host-name (no '/'), as --to HOST");
    }
    if to == c.cfg.host {
        bail!("handoff: {to:?} is this host");
    }
    let size = c.att.size();
    let mut held = c.att.exists(0, size)?;
    // Fullest first: the receiver reads them in this order.
    held.sort_by_key(|&(o, n)| (std::cmp::Reverse(n), o));
    held.truncate(MAX_FRAGMENTS);
    let bytes = held.iter().map(|x| x.1).sum();
    let text = sce_coord::inval::encode(&held);
    let key = format!("{}/handoff/{to}", c.volume_prefix);
    c.etcd.put(key.as_bytes(), text.as_bytes(), 0)?;
    tracing::info!(volume = %c.volume_prefix, to, fragments = held.len(), bytes, "handoff published");
    Ok((held.len() as u64, bytes))
}

impl Coherence {
    /// Looks for a hand-off to this host; prefetches a new one from a thread of its own and
    /// deletes it (one at a time).
    pub(super) fn take_handoff(self: &Arc<Self>, etcd: &sce_coord::Etcd) {
        if self.handoff_running.load(SeqCst) {
            return;
        }
        let key = format!("{}/handoff/{}", self.volume_prefix, self.cfg.host);
        let Ok(Some(value)) = etcd.get(key.as_bytes()) else {
            return;
        };
        let text = String::from_utf8_lossy(&value).to_string();
        let _ = etcd.delete(key.as_bytes());
        let Some(list) = sce_coord::inval::decode(&text) else {
            tracing::warn!(volume = %self.volume_prefix, "ignoring a malformed handoff");
            return;
        };
        self.handoff_running.store(true, SeqCst);
        let me = self.clone();
        match std::thread::Builder::new()
            .name("sce-handoff".into())
            .spawn(move || me.prefetch_list(&list))
        {
            // Joined by `leave` with the others.
            Ok(t) => self.threads.lock().push(t),
            Err(_) => self.handoff_running.store(false, SeqCst),
        }
    }

    fn prefetch_list(&self, list: &[(u64, u64)]) {
        let size = self.att.size();
        let frag = self
            .att
            .live_volume()
            .map_or(1 << 20, |v| v.config().fragment_size);
        tracing::info!(volume = %self.volume_prefix, fragments = list.len(), "handoff received: prefetching");
        for &(o, _) in list {
            if self.stop.load(SeqCst) {
                break;
            }
            let len = frag.min(size.saturating_sub(o));
            if len > 0 && self.att.prefetch(o, len).is_ok() {
                self.counters.handoff_bytes.fetch_add(len, SeqCst);
            }
        }
        self.counters.handoffs.fetch_add(1, SeqCst);
        self.handoff_running.store(false, SeqCst);
        tracing::info!(volume = %self.volume_prefix, "handoff prefetched");
    }
}
