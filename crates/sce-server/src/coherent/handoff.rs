//! Warm migration (Mercury): `sce ctl handoff EXPORT --to HOST` moves what this host owns
//! of the volume to HOST and puts what its cache holds under
//! `PREFIX/VOLUME/handoff/HOST/NNNNNN`, hottest fragments first, in chunks of at most
//! [`CHUNK`] fragments (as many as the cache holds), then `PREFIX/VOLUME/handoff/HOST`:
//! `chunks N fragments F bytes B`. The receiving server reads the chunks once the head is
//! there, waits until its listener has applied the move of the regions, and reads the
//! fragments into its own cache in the background (NBD CACHE's prefetch), hottest first,
//! so that a VM moved there starts warm. Prefetching reads the source, which is always
//! current in write-through, so the list can never bring stale data: at worst it names
//! cold fragments.

use super::Coherence;
use anyhow::{bail, Result};
use sce_coord::Coord;
use sce_io::BlockDevice;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Fragments per chunk: etcd's request limit is 1.5 MiB by default, and a line is at most
/// 21 bytes.
pub(crate) const CHUNK: usize = 40_000;

/// Fragments a receiving host reads at once.
const PREFETCHERS: usize = 8;

/// `ctl handoff` of export `n`: its regions and hot list to host `to`.
pub fn handoff_verb(
    n: &str,
    a: &Arc<crate::attach::Attachable>,
    to: Option<&str>,
) -> Result<serde_json::Value> {
    let c = super::of(a)
        .ok_or_else(|| anyhow::anyhow!("export {n:?} is not in shared mode (--shared)"))?;
    let (fragments, bytes, regions) = handoff(&c, to.unwrap_or(""))?;
    Ok(
        serde_json::json!({"export": n, "fragments": fragments, "bytes": bytes, "regions_moved": regions}),
    )
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

/// Moves the regions this host owns to host `to`, then publishes the export's hot list for
/// it: (fragments, bytes, regions moved).
pub fn handoff(c: &Coherence, to: &str) -> Result<(u64, u64, u64)> {
    if to.is_empty() || to.contains('/') {
        bail!("handoff: give the receiving host's --host-name (no '/'), as --to HOST");
    }
    if to == c.cfg.host {
        bail!("handoff: {to:?} is this host");
    }
    // The list first: once a region is moved, this host drops it.
    let list = hot_list(c)?;
    let (moved, moved_at) = c.hand_regions(to)?;
    let bytes = list.iter().map(|x| x.1).sum();
    let head = format!("{}/handoff/{to}", c.volume_prefix);
    c.etcd.delete_prefix(format!("{head}/").as_bytes())?;
    let chunks: Vec<&[(u64, u64)]> = list.chunks(CHUNK).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let text = sce_coord::inval::encode(chunk);
        c.etcd
            .put(format!("{head}/{i:06}").as_bytes(), text.as_bytes(), 0)?;
    }
    let value = format!(
        "chunks {} fragments {} bytes {bytes} moved {moved} at {moved_at}",
        chunks.len(),
        list.len()
    );
    c.etcd.put(head.as_bytes(), value.as_bytes(), 0)?;
    tracing::info!(volume = %c.volume_prefix, to, fragments = list.len(), bytes, chunks = chunks.len(), regions = moved, "handoff published");
    Ok((list.len() as u64, bytes, moved))
}

/// What the cache holds of the export, hottest first (fuller first among equals).
fn hot_list(c: &Coherence) -> Result<Vec<(u64, u64)>> {
    let held = c.att.exists(0, c.att.size())?;
    let offsets: Vec<u64> = held.iter().map(|x| x.0).collect();
    let heats = c.att.heats(&offsets);
    let mut ranked: Vec<(u32, u64, u64)> = (held.iter().zip(heats))
        .map(|(&(o, n), h)| (h, n, o))
        .collect();
    ranked.sort_by_key(|&(h, n, o)| (std::cmp::Reverse(h), std::cmp::Reverse(n), o));
    Ok(ranked.into_iter().map(|(_, n, o)| (o, n)).collect())
}

/// A hand-off's head: the number of chunks, and the revision of the last region moved
/// (0: none).
fn chunks_of(head: &str) -> Option<(usize, i64)> {
    match head.split(' ').collect::<Vec<_>>()[..] {
        ["chunks", n, "fragments", _, "bytes", _, "moved", _, "at", r] => {
            Some((n.parse().ok()?, r.parse().ok()?))
        }
        _ => None,
    }
}

impl Coherence {
    /// Looks for a hand-off to this host; takes a new one (its chunks, in order), deletes
    /// it, and prefetches it from a thread of its own (one at a time).
    pub(super) fn take_handoff(self: &Arc<Self>, etcd: &dyn Coord) {
        if self.handoff_running.load(SeqCst) {
            return;
        }
        let head = format!("{}/handoff/{}", self.volume_prefix, self.cfg.host);
        let Ok(Some(kv)) = etcd.get_kv(head.as_bytes()) else {
            return;
        };
        let Ok((kvs, _)) = etcd.range_prefix(format!("{head}/").as_bytes()) else {
            return;
        };
        let _ = etcd.delete(head.as_bytes());
        let _ = etcd.delete_prefix(format!("{head}/").as_bytes());
        let chunks = chunks_of(&String::from_utf8_lossy(&kv.value));
        // The chunks in key order; every one the head counts, each readable.
        let list: Option<Vec<(u64, u64)>> = chunks.filter(|c| c.0 == kvs.len()).and_then(|_| {
            let texts = kvs
                .iter()
                .map(|c| String::from_utf8_lossy(&c.value).to_string());
            let lists: Option<Vec<_>> = texts.map(|t| sce_coord::inval::decode(&t)).collect();
            lists.map(|l| l.concat())
        });
        let Some(list) = list else {
            tracing::warn!(volume = %self.volume_prefix, "ignoring a malformed handoff");
            return;
        };
        self.handoff_running.store(true, SeqCst);
        let (me, moved_at) = (self.clone(), chunks.map_or(0, |c| c.1));
        match std::thread::Builder::new()
            .name("sce-handoff".into())
            .spawn(move || me.prefetch_list(&list, moved_at))
        {
            // Joined by `leave` with the others.
            Ok(t) => self.threads.lock().push(t),
            Err(_) => self.handoff_running.store(false, SeqCst),
        }
    }

    fn prefetch_list(&self, list: &[(u64, u64)], moved_at: i64) {
        // The regions were moved before the list was put: once the listener applied the
        // last move (each moved region dropped, then owned), what is prefetched stays.
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.done.load(SeqCst) < moved_at && Instant::now() < deadline {
            if self.stop.load(SeqCst) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let size = self.att.size();
        let frag = self
            .att
            .live_volume()
            .map_or(1 << 20, |v| v.config().fragment_size);
        tracing::info!(volume = %self.volume_prefix, fragments = list.len(), "handoff received: prefetching");
        // A few readers, each taking the hottest fragment not yet taken: the source serves
        // several reads at once, and the hottest still come first.
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..PREFETCHERS {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, SeqCst);
                    let Some(&(o, _)) = list.get(i) else { break };
                    if self.stop.load(SeqCst) {
                        break;
                    }
                    let len = frag.min(size.saturating_sub(o));
                    if len > 0 && self.att.prefetch(o, len).is_ok() {
                        self.counters.handoff_bytes.fetch_add(len, SeqCst);
                    }
                });
            }
        });
        self.counters.handoffs.fetch_add(1, SeqCst);
        self.handoff_running.store(false, SeqCst);
        tracing::info!(volume = %self.volume_prefix, "handoff prefetched");
    }
}
