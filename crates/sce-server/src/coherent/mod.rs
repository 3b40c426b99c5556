//! Shared mode (issue 16, docs/SHARED.md): several hosts cache one volume, coordinated
//! through etcd.
//!
//! The guarantee: once a write through any host is acknowledged, no read that starts
//! afterwards on any host returns the bytes it replaced.
//!
//! * A write goes to the source (and this host's cache) first; then its range is published
//!   under `PREFIX/VOLUME/inval/HOST` and the write waits until every other registered host
//!   has acknowledged that revision, or left. Only then is it acknowledged. Publishing after
//!   the source write matters: a population another host starts after dropping the pages
//!   reads the new bytes, and one it started before is spoiled by the drop.
//! * Each host watches the volume's invalidations in revision order, drops those pages
//!   (`evict`, which also spoils populations and copies in flight) and acknowledges.
//! * A host serves hits only while its lease is valid by its own clock (a deadline that
//!   ends before the cluster can expire the lease) and its listener has processed every
//!   invalidation others may have stopped waiting for it to process. Otherwise it passes
//!   reads through to the source.
//! * A write whose publication fails fails (EIO); its range is published again, from a
//!   background thread, as soon as etcd answers.
//! * A restart catches up from the revision saved under `PREFIX/VOLUME/seen/HOST` (saved
//!   only after a metadata round made the drops before it durable), or forgets the volume.

mod batch;
mod device;
mod handoff;
mod identity;
mod listen;
mod own;
mod owners;

pub use device::Coherent;
pub use handoff::{handoff, handoff_verb, refuse_in_shared_mode};
pub use identity::HostIdentity;

use crate::attach::Attachable;
use crate::config::SharedConfig;
use anyhow::{bail, Context, Result};
use sce_engine::order::{levels, OrderedMutex};
/// This file's locks, unless named otherwise (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;

use sce_coord::inval::Listener;
use sce_coord::{Coord, Etcd, EtcdError, Membership, Tracker};
use sce_io::IoError;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

sce_core::stats_table! {
    /// Counters of shared mode, for `ctl status` and /metrics.
    #[derive(Default, Debug)]
    pub struct Counters {
        /// Publications of this host's writes (one may carry several writes).
        published: AtomicU64, Counter("sce_shared_publications_total", "", "Invalidations this host published (one may carry several writes).");
        /// Writes that waited for a publication.
        writes: AtomicU64, Counter("sce_shared_writes_published_total", "", "Writes that waited until the other hosts dropped their range.");
        /// Nanoseconds writes spent publishing and waiting for the others (exported in
        /// whole seconds as `sce_shared_publish_seconds_total`).
        publish_ns: AtomicU64;
        /// Writes failed because their invalidation could not be published in time.
        publish_failures: AtomicU64, Counter("sce_shared_publish_failures_total", "", "Writes failed because the other hosts could not be told in time.");
        /// Invalidations of other hosts processed.
        received: AtomicU64, Counter("sce_shared_invalidations_received_total", "", "Invalidations of other hosts processed.");
        /// Bytes those dropped from this host's cache.
        dropped_bytes: AtomicU64, Counter("sce_shared_dropped_bytes_total", "bytes", "Bytes those invalidations dropped from this cache.");
        /// Reads passed through to the source because this host could not vouch for its cache.
        passthrough_reads: AtomicU64, Counter("sce_shared_passthrough_reads_total", "", "Reads passed through to the source while this host could not vouch for its cache.");
        /// Times the whole volume was forgotten (a start without a revision to catch up from,
        /// or one etcd had compacted).
        forgotten: AtomicU64;
        /// Regions this host acquired for its writes.
        acquisitions: AtomicU64, Counter("sce_shared_region_acquisitions_total", "", "Regions this host took for its writes (one etcd transaction and every other host's acknowledgement each).");
        /// Acquisitions refused: another host owned the region.
        acquisitions_refused: AtomicU64, Counter("sce_shared_region_acquisitions_refused_total", "", "Acquisitions refused because another host owned the region (its writes there are then published).");
        /// Owned regions released after their idle time.
        releases: AtomicU64, Counter("sce_shared_region_releases_total", "", "Owned regions released after going unwritten for the idle time.");
        /// Writes to owned regions: no etcd call.
        owned_writes: AtomicU64, Counter("sce_shared_owned_writes_total", "", "Writes to regions this host owns, acknowledged without an etcd call.");
        /// Owned writes failed because the lease lapsed while they were in flight.
        owned_writes_fenced: AtomicU64, Counter("sce_shared_owned_writes_fenced_total", "", "Owned writes failed because this host's lease lapsed while they were in flight (announced to the others later).");
        /// Regions handed to this host.
        handoff_regions: AtomicU64, Counter("sce_shared_handoff_regions_total", "", "Regions another host handed to this one with a hand-off.");
        /// Reads of regions another host owns (from the source).
        region_reads: AtomicU64, Counter("sce_shared_region_reads_total", "", "Reads passed to the source because another host owns their region for writing.");
        /// Acknowledgements this host put (one may cover several changes).
        acks: AtomicU64, Counter("sce_shared_acknowledgements_total", "", "Acknowledgements this host put in etcd (one may cover several invalidations and ownership changes).");
        /// Moves into shared passthrough (every read to the source).
        passthrough_entered: AtomicU64, Counter("sce_shared_passthrough_entered_total", "", "Times this host started passing every read through to the source (lease not valid by its clock, or catching up).");
        /// Hand-offs received and prefetched.
        handoffs: AtomicU64;
        /// Bytes prefetched for them.
        handoff_bytes: AtomicU64;
    }
}

/// Why shared mode refuses write-back: said by `sce serve` before it opens anything, and by
/// [`Coherence::start`] for a volume that is in write-back all the same.
pub(crate) const NO_WRITEBACK: &str = "shared mode keeps write-through caches coherent; \
     write-back would keep the only copy of acknowledged writes on this host, where the \
     others cannot see it: give --mode writethrough";

/// Makes a client of the coordination store (etcd's, or a test's in-memory one).
pub type Connect<'a> = &'a dyn Fn() -> Result<Box<dyn Coord>, EtcdError>;

/// What `serving_logged` logged last: nothing yet, serving hits, passing reads through.
const STARTING: u8 = 0;
const SERVING: u8 = 1;
const PASSING: u8 = 2;

/// One export's membership in its shared volume.
pub struct Coherence {
    cfg: SharedConfig,
    volume_prefix: String,
    att: Arc<Attachable>,
    etcd: Box<dyn Coord>,
    member: Membership,
    tracker: Tracker,
    batcher: batch::Batcher,
    /// Ownership of the volume's regions.
    regions: own::Regions,
    /// The registration the listener has caught up with (see `serving`).
    caught_up: AtomicU64,
    /// The last revision the listener processed.
    done: AtomicI64,
    /// Ranges whose publication failed: published again from the background thread.
    unpublished: Mutex<Vec<(u64, u64)>>,
    stop: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// A hand-off is being prefetched.
    handoff_running: AtomicBool,
    /// Whether reads are served or passed through, as last logged (see `serving_logged`).
    logged_mode: std::sync::atomic::AtomicU8,
    /// This host's id: its file stays locked while the export is in shared mode.
    identity: Arc<HostIdentity>,
    pub(crate) counters: Counters,
}

/// The exports that joined shared mode, each with its state: [`Coherence::start`] enters
/// its export once, and [`of`] looks it up. Kept here, not in the export: shared mode wraps
/// an [`Attachable`], which knows nothing of it. A weak export holds its allocation, so
/// its address is not reused while its entry stands; entries of dropped exports are
/// removed as others join.
static MEMBERS: Mutex<Vec<(Weak<Attachable>, Weak<Coherence>)>> = Mutex::new(Vec::new());

/// The shared-mode state of the export `att`, if it is in shared mode.
pub fn of(att: &Arc<Attachable>) -> Option<Arc<Coherence>> {
    let members = MEMBERS.lock();
    let (_, c) = members
        .iter()
        .find(|(a, _)| a.as_ptr() == Arc::as_ptr(att))?;
    c.upgrade()
}

/// Enters `c` as the shared-mode state of its export; false if the export joined before.
fn enter(c: &Arc<Coherence>) -> bool {
    let mut members = MEMBERS.lock();
    members.retain(|(a, _)| a.strong_count() > 0);
    if members
        .iter()
        .any(|(a, _)| a.as_ptr() == Arc::as_ptr(&c.att))
    {
        return false;
    }
    members.push((Arc::downgrade(&c.att), Arc::downgrade(c)));
    true
}

/// The revision a `seen/HOST` value saves, if the host of id `id` saved it. Another id's
/// (a server that had this host name before: its cache is not this one, and this host's
/// listener skips what was published under the name) or one without an id (saved before
/// ids) is not this cache's to catch up from.
fn saved_by(value: &[u8], id: &str) -> Option<i64> {
    let text = String::from_utf8_lossy(value);
    match text.split_whitespace().collect::<Vec<_>>()[..] {
        [rev, by] if by == id => rev.parse().ok(),
        _ => None,
    }
}

/// The volume's regions: the size the first host recorded (every host must count regions
/// alike, or one would serve a region another owns), which this host's `--region-size`
/// must match unless it is 0 (this host takes no region but honours the others').
fn agree_regions(cfg: &SharedConfig, etcd: &dyn Coord, volume: &str) -> Result<own::Regions> {
    let wanted = match cfg.region_size {
        0 => crate::config::DEFAULT_REGION_SIZE,
        n => n,
    };
    let size = sce_coord::own::agree_size(etcd, volume, wanted)
        .with_context(|| format!("agreeing on the region size of {volume} in etcd"))?;
    if cfg.region_size != 0 && size != cfg.region_size {
        bail!(
            "the shared volume {volume} has regions of {size} bytes (set by the first host \
             that joined it); give --region-size {size} (every host must count regions \
             alike), or 0 to take none"
        );
    }
    Ok(own::Regions::new(
        size,
        cfg.region_size != 0,
        cfg.ownership_idle,
    ))
}

/// How long a write waits for the other hosts: long enough for a host that died to lose
/// its lease (then it is not waited for).
fn ack_timeout(ttl: i64) -> Duration {
    Duration::from_secs(2 * ttl as u64 + 2)
}

/// Registers this host under `key`: its id, then what tells an operator where it runs.
/// Another server holding the name is refused with what to do about it.
fn join(
    cfg: &SharedConfig,
    id: &HostIdentity,
    etcd: Box<dyn Coord>,
    key: &str,
) -> Result<Membership> {
    let machine = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let value = format!(
        "{} pid={} machine={}",
        id.id(),
        std::process::id(),
        machine.trim()
    );
    match Membership::join(etcd, key.as_bytes(), value.as_bytes(), cfg.lease_ttl) {
        Ok(m) => Ok(m),
        Err(EtcdError::Taken { holder, .. }) => bail!(
            "host name {:?} is registered by another live server (id pid machine: {holder}), \
             waited {}s for its lease to lapse. Each server in shared mode needs a name of \
             its own: give --host-name NAME (the default, the machine's host name, is the \
             same on cloned machines). This host's id is kept in {}",
            cfg.host,
            cfg.lease_ttl + 1,
            id.path().display()
        ),
        Err(e) => Err(e.into()),
    }
}

impl Coherence {
    /// Joins the shared volume `name` for the export `att`: registers under a lease, then
    /// catches up from the revision this host saved, or forgets what the cache holds. Fails
    /// if etcd does not answer (a start needs it).
    pub fn start(
        cfg: &SharedConfig,
        identity: &Arc<HostIdentity>,
        name: &str,
        att: Arc<Attachable>,
    ) -> Result<Arc<Coherence>> {
        let eps: Vec<&str> = cfg.endpoints.iter().map(String::as_str).collect();
        let connect = || -> Result<Box<dyn Coord>, EtcdError> {
            Ok(Box::new(Etcd::new(&eps, Duration::from_secs(2))?))
        };
        Self::start_with(cfg, identity, name, att, &connect)
    }

    /// `start` over the clients `connect` makes (one per thread that waits on the store),
    /// instead of etcd at `cfg.endpoints`: an in-process test's store (`sce_coord::mem`).
    pub fn start_with(
        cfg: &SharedConfig,
        identity: &Arc<HostIdentity>,
        name: &str,
        att: Arc<Attachable>,
        connect: Connect,
    ) -> Result<Arc<Coherence>> {
        if let Some(v) = att.live_volume() {
            if v.config().write_mode == sce_core::WriteMode::WriteBack {
                bail!("{NO_WRITEBACK}");
            }
        }
        let client = connect;
        let etcd = client()?;
        let volume_prefix = format!(
            "{}/{}",
            cfg.prefix,
            if name.is_empty() { "_" } else { name }
        );
        let regions = agree_regions(cfg, &etcd, &volume_prefix)?;
        let member_key = format!("{volume_prefix}/hosts/{}", cfg.host);
        let member = join(cfg, identity, client()?, &member_key)
            .with_context(|| format!("joining the shared volume {volume_prefix} in etcd"))?;
        let tracker = Tracker::start(client()?, &volume_prefix, &cfg.host)?;
        let c = Arc::new(Coherence {
            cfg: cfg.clone(),
            volume_prefix,
            att,
            etcd,
            member,
            tracker,
            batcher: Default::default(),
            regions,
            caught_up: AtomicU64::new(0),
            done: AtomicI64::new(0),
            unpublished: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            handoff_running: AtomicBool::new(false),
            logged_mode: Default::default(),
            identity: identity.clone(),
            counters: Counters::default(),
        });
        if !enter(&c) {
            bail!("export {name:?} is in shared mode already");
        }
        let from = c.resume_point()?;
        c.done.store(from - 1, SeqCst);
        for (name, f) in [
            (
                "sce-shared",
                Coherence::run as fn(Arc<Coherence>, Box<dyn Coord>),
            ),
            ("sce-shared-bg", Coherence::maintain),
        ] {
            let (me, etcd) = (c.clone(), client()?);
            let t = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || f(me, etcd))
                .context("starting the shared-mode threads")?;
            c.threads.lock().push(t);
        }
        Ok(c)
    }

    /// The revision to listen from: the one after what this host saved, if its cache is
    /// persistent and etcd still has that history; else the registration's, after the
    /// cache forgot everything it held.
    fn resume_point(&self) -> Result<i64> {
        let registered = self.member.registered_at();
        let persistent = self
            .att
            .live_volume()
            .is_some_and(|v| v.persist_stats().is_some());
        let seen = self.seen()?;
        if let Some(seen) = seen.filter(|_| persistent) {
            match Listener::new(&self.etcd, &self.volume_prefix, &self.cfg.host, seen + 1) {
                Ok(_) => {
                    tracing::info!(volume = %self.volume_prefix, from = seen + 1, "shared volume: catching up from the saved revision");
                    return Ok(seen + 1);
                }
                Err(EtcdError::Compacted(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.forget("no revision to catch up from");
        Ok(registered)
    }

    /// The revision this host saved (`seen/HOST`), if any.
    fn seen(&self) -> Result<Option<i64>> {
        let key = self.seen_key();
        let value = self.etcd.get(key.as_bytes())?;
        let seen = value.as_deref().map(|v| saved_by(v, self.identity.id()));
        if let Some(None) = seen {
            tracing::info!(volume = %self.volume_prefix, "shared volume: the saved revision is another host id's (a server that had this host name before), not this cache's");
        }
        Ok(seen.flatten())
    }

    fn forget(&self, why: &str) {
        match self.att.forget() {
            Ok((fragments, _)) => {
                tracing::info!(volume = %self.volume_prefix, fragments, "shared volume: cache forgotten ({why})")
            }
            Err(e) => tracing::info!(volume = %self.volume_prefix, "shared volume: {e}"),
        }
        self.counters.forgotten.fetch_add(1, SeqCst);
    }

    /// True while this host may serve hits: its lease is valid by its own clock, and its
    /// listener has processed every invalidation published before its (last) registration.
    pub fn serving(&self) -> bool {
        // The deadline first: a re-registration updates the count before the deadline.
        self.member.valid()
            && self.caught_up.load(SeqCst) == self.member.generation()
            && !self.stop.load(SeqCst)
    }

    /// `serving`, its changes logged once each, not per read: a WARN when this host, having
    /// served hits, starts passing reads through (its lease is not valid by its own clock:
    /// etcd or this host stalled; or it registered again and is catching up), an INFO when
    /// it serves hits again.
    pub fn serving_logged(&self) -> bool {
        let serving = self.serving();
        let now = if serving { SERVING } else { PASSING };
        let was = self.logged_mode.load(SeqCst);
        // Nothing is said before the first catch-up has said "serving hits".
        if was == now || was == STARTING || self.stop.load(SeqCst) {
            return serving;
        }
        // The first start of serving is logged by the catch-up ("serving hits").
        if (self.logged_mode.compare_exchange(was, now, SeqCst, SeqCst)).is_ok() && was != STARTING
        {
            let volume = &self.volume_prefix;
            if serving {
                let passed = self.counters.passthrough_reads.load(SeqCst);
                tracing::warn!(%volume, passthrough_reads = passed, "shared volume: serving hits again: its lease is valid and it caught up with the other hosts");
            } else {
                self.counters.passthrough_entered.fetch_add(1, SeqCst);
                let lease_valid = self.member.valid();
                let why = if lease_valid {
                    "it registered again and is catching up with what the others published"
                } else {
                    "its lease is not valid by its own clock: etcd or this host stalled"
                };
                tracing::warn!(%volume, lease_valid, "shared volume: passing reads through to the source until this host can vouch for its cache again: {why}");
            }
        }
        serving
    }

    /// Refuses a write before it reaches the source while another server holds this host's
    /// name: the holder takes this host's announcements for its own and would not drop
    /// the pages.
    pub fn check_writable(&self, op: sce_io::Op, offset: u64, len: u64) -> Result<(), IoError> {
        if !self.member.displaced() {
            return Ok(());
        }
        Err(IoError::Io {
            op,
            offset,
            len,
            source: std::io::Error::other(format!(
                "shared volume: another server holds this host's name {:?} (--host-name)",
                self.cfg.host
            )),
        })
    }

    /// Publishes the range of a write that reached the source, with the writes in flight
    /// beside it, and waits for every other host. An error: the write must fail.
    pub fn publish(&self, offset: u64, len: u64) -> Result<(), sce_io::IoError> {
        let t0 = Instant::now();
        let c = &self.counters;
        c.writes.fetch_add(1, SeqCst);
        let out = self.batcher.submit((offset, len), &|ranges| {
            c.published.fetch_add(1, SeqCst);
            self.publish_now(ranges).map_err(|e| e.to_string())
        });
        c.publish_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, SeqCst);
        out.map(|_| ()).map_err(|e| {
            c.publish_failures.fetch_add(1, SeqCst);
            self.remember_unpublished([(offset, len)]);
            sce_io::IoError::Io {
                op: sce_io::Op::Write,
                offset,
                len,
                source: std::io::Error::other(format!(
                    "shared volume: the other hosts could not be told of this write ({e}); \
                     it reached the source, and is announced again when etcd answers"
                )),
            }
        })
    }

    fn publish_now(&self, ranges: &[(u64, u64)]) -> Result<i64, EtcdError> {
        (self.tracker).publish(&self.etcd, ranges, ack_timeout(self.cfg.lease_ttl))
    }

    /// Stops listening and leaves the volume (others stop waiting for this host; it no
    /// longer serves hits); returns the revision processed, for `finish`.
    pub fn leave(&self) -> i64 {
        // Resign first: the others stop waiting for this host at once.
        self.stop.store(true, SeqCst);
        if let Err(e) = self.member.resign() {
            tracing::warn!(volume = %self.volume_prefix, "shared volume: leaving: {e}");
        }
        loop {
            let threads = std::mem::take(&mut *self.threads.lock());
            if threads.is_empty() {
                break;
            }
            for t in threads {
                let _ = t.join();
            }
        }
        // One last attempt to announce failed writes (one publication, bounded).
        self.republish();
        self.done.load(SeqCst)
    }

    /// After a shutdown that left the cache clean (its records reflect every drop up to
    /// `done`): saves `done` for the next start. After any other, the revision saved last
    /// stays, and the next start catches up from there.
    pub fn finish(&self, done: i64) {
        if let Err(e) = self.save(&self.etcd, done) {
            tracing::warn!(volume = %self.volume_prefix, "shared volume: saving the revision: {e}");
        }
    }

    fn save(&self, etcd: &dyn Coord, done: i64) -> Result<(), EtcdError> {
        let value = format!("{done} {}", self.identity.id());
        (etcd.put(self.seen_key().as_bytes(), value.as_bytes(), 0)).map(|_| ())
    }

    /// `seen/HOST`: the revision whose drops this host's cache holds durably, and the id of
    /// the host that saved it.
    fn seen_key(&self) -> String {
        format!("{}/seen/{}", self.volume_prefix, self.cfg.host)
    }

    /// The state for `ctl status` and /stats.
    pub fn status(&self) -> serde_json::Value {
        let c = &self.counters;
        let writes = c.writes.load(SeqCst);
        let (owned, others) = self.regions.counts();
        serde_json::json!({
            "volume": self.volume_prefix,
            "host": self.cfg.host,
            "host_id": self.identity.id(),
            "serving_hits": self.serving(),
            "lease_valid": self.member.valid(),
            "revision_processed": self.done.load(SeqCst),
            "publications": c.published.load(SeqCst),
            "writes_published": writes,
            "mean_publish_seconds": c.publish_ns.load(SeqCst) as f64 / 1e9 / writes.max(1) as f64,
            "publish_failures": c.publish_failures.load(SeqCst),
            "invalidations_received": c.received.load(SeqCst),
            "dropped_bytes": c.dropped_bytes.load(SeqCst),
            "passthrough_reads": c.passthrough_reads.load(SeqCst),
            "forgotten": c.forgotten.load(SeqCst),
            "regions_owned": owned,
            "regions_of_others": others,
            "region_size": self.regions.span(0).1,
            "region_acquisitions": c.acquisitions.load(SeqCst),
            "region_acquisitions_refused": c.acquisitions_refused.load(SeqCst),
            "region_releases": c.releases.load(SeqCst),
            "owned_writes": c.owned_writes.load(SeqCst),
            "region_reads": c.region_reads.load(SeqCst),
            "acknowledgements": c.acks.load(SeqCst),
            "owned_writes_fenced": c.owned_writes_fenced.load(SeqCst),
            "passthrough_entered": c.passthrough_entered.load(SeqCst),
            "handoffs_received": c.handoffs.load(SeqCst),
            "handoff_regions": c.handoff_regions.load(SeqCst),
            "handoff_prefetched_bytes": c.handoff_bytes.load(SeqCst),
        })
    }
}

#[cfg(test)]
mod tests {
    /// A saved revision counts only for the id that saved it.
    #[test]
    fn a_saved_revision_is_its_host_ids() {
        let id = "0123456789abcdef0123456789abcdef";
        assert_eq!(super::saved_by(format!("42 {id}").as_bytes(), id), Some(42));
        assert_eq!(
            super::saved_by(b"42 ffffffffffffffffffffffffffffffff", id),
            None
        );
        assert_eq!(super::saved_by(b"42", id), None);
        assert_eq!(super::saved_by(b"", id), None);
    }
}
