//! Ownership of a volume's regions (issue 31, Mercury's release consistency), the rule
//! `sce serve --shared` runs: a volume is cut into regions of `region_size` bytes, and each
//! region has at most one owner host. Host H writing region R at virtual time t:
//!
//! - R owned by H: an *owned* write, no etcd operation.
//! - R owned by another host O: today's per-write rule (one publication, one acknowledgement
//!   per other host; the others drop the written range). H counts R as *contended* until
//!   t + idle; so does every other host that hears the publication, and O, which owns it,
//!   releases it at once (as a release below).
//! - R free but contended in H's view: published the same way, no acquisition.
//! - R free and not contended: H acquires it, one etcd transaction (the owner key under its
//!   lease) and one acknowledgement put per other host, each of which drops everything it
//!   caches of the region; then it is an owned write.
//! - The owner releases a region once it has not written it for `idle`: one etcd delete, and
//!   every other host drops the region again. The simulator counts one acknowledgement per
//!   other host for a release too, to be conservative.
//! - A host reads a region another host owns from the source: no hit, no fill. A region
//!   nobody owns, contended or not, every host caches.
//!
//! So a region several hosts write at once ends up nobody's, every write there published
//! (the rule before ownership), while a region one host writes stays that host's.
//!
//! Each host's view is the machine `sce serve --shared` runs, [`sce_core::regions::Regions`]
//! (host `i` under lease `i + 1`, always valid), and [`Owners`] stands for etcd: a table of
//! owner keys (region -> holder, revision) that takes a key only if it is free, and tells
//! every other host's machine of each change at once (the sim's hosts acknowledge in no
//! time). The decisions are the machine's: a write over more than
//! [`sce_core::regions::MAX_OWNED_SPAN`] regions is published, as the server's is.
//! Ownership is decided at a request's issue time: an owned write ends, for the idle
//! clock, when it is issued (the simulator keeps no owned write in flight).
//!
//! Per host, [`Owners`] also keeps the regions it may cache something of (it read or wrote
//! them through its caches since it last dropped them), so that dropping a region skips the
//! hosts that cannot hold any of it instead of searching their caches.

use super::host::Host;
use super::stack::StackResult;
use sce_core::regions::{Heard, Regions, Release, Take};
use std::collections::{HashMap, HashSet};

/// The ownership rule's settings.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    /// Bytes per region (a multiple of 4 KiB).
    pub region_size: u64,
    /// Virtual nanoseconds without a write from its owner after which a region is
    /// released; also how long a host counts a region as contended after a write there by
    /// two hosts.
    pub idle_ns: u64,
}

impl Ownership {
    /// The default region size: 1 GiB.
    pub const DEFAULT_REGION_SIZE: u64 = 1 << 30;
    /// The default idle time before a release, and of a contended region: 10 s, the
    /// server's `--ownership-idle` default.
    pub const DEFAULT_IDLE_SECS: f64 = 10.0;

    /// The rule with regions of `region_size` bytes released after `idle_secs` seconds
    /// without a write; an error names the setting at fault.
    pub fn new(region_size: u64, idle_secs: f64) -> Result<Self, String> {
        if region_size == 0 || !region_size.is_multiple_of(4096) {
            return Err(format!(
                "invalid --region-size {region_size}: a positive multiple of 4 KiB"
            ));
        }
        if !(idle_secs.is_finite() && (0.0..=1e9).contains(&idle_secs)) {
            return Err(format!(
                "invalid --ownership-idle {idle_secs}: seconds, at least 0"
            ));
        }
        Ok(Ownership {
            region_size,
            idle_ns: (idle_secs * 1e9).round() as u64,
        })
    }
}

impl Default for Ownership {
    fn default() -> Self {
        Ownership {
            region_size: Self::DEFAULT_REGION_SIZE,
            idle_ns: (Self::DEFAULT_IDLE_SECS * 1e9) as u64,
        }
    }
}

/// The hosts' views of the regions, and etcd's owner keys.
#[derive(Debug)]
pub(super) struct Owners {
    /// Per host, its machine.
    views: Vec<Regions>,
    /// Region -> (holder host, revision): the owner keys.
    keys: HashMap<u64, (usize, i64)>,
    /// etcd's last revision.
    rev: i64,
    /// Per host, the regions it may cache something of.
    touched: Vec<HashSet<u64>>,
}

/// Host `h`'s lease.
fn lease(h: usize) -> i64 {
    h as i64 + 1
}

impl Owners {
    pub(super) fn new(rule: Ownership, hosts: usize) -> Self {
        let size = rule.region_size;
        Owners {
            views: (0..hosts)
                .map(|_| Regions::new(size, true, rule.idle_ns))
                .collect(),
            keys: HashMap::new(),
            rev: 0,
            touched: vec![HashSet::new(); hosts],
        }
    }

    /// Whether `host` counts region `r` as another host's (its reads there go to the
    /// source).
    pub(super) fn theirs(&self, host: usize, r: u64) -> bool {
        self.views[host].theirs(r).is_some()
    }

    /// `host` read or wrote region `r` through its caches: it may cache something of it
    /// from now on.
    pub(super) fn touch(&mut self, host: usize, r: u64) {
        self.touched[host].insert(r);
    }

    /// The regions `[offset, offset + len)` touches (none if `len` is 0).
    pub(super) fn regions(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        if len == 0 {
            return 0..0;
        }
        let r = self.views[0].cut().of(offset, len);
        *r.start()..r.end() + 1
    }

    /// The byte range of region `r`.
    pub(super) fn span(&self, r: u64) -> (u64, u64) {
        self.views[0].cut().span(r)
    }

    /// The holder of region `r`'s owner key, if any.
    #[cfg(test)]
    pub(super) fn owner(&self, r: u64) -> Option<usize> {
        self.keys.get(&r).map(|k| k.0)
    }

    /// Host `me`'s write at `t`, as the server's `begin_write` takes its regions: in order,
    /// acquiring the free ones, until one its machine says to publish (the regions taken
    /// before stay `me`'s). Returns whether the write is owned and how many other hosts'
    /// caches held part of a region acquired.
    pub(super) fn take(
        &mut self,
        hosts: &mut [Host],
        res: &mut StackResult,
        me: usize,
        t: u64,
        offset: u64,
        len: u64,
    ) -> (bool, u64) {
        for r in self.regions(offset, len) {
            self.touch(me, r);
        }
        let (mut found, mut taken) = (0, Vec::new());
        let Some(rs) = self.views[me].plan(offset, len) else {
            return (false, 0);
        };
        for r in rs {
            let token =
                match self.views[me].take(r, lease(me), Some(lease(me)), !taken.is_empty(), t) {
                    Take::Owned(token) => Some(token),
                    Take::Acquire(token) => {
                        let got = self.acquire(hosts, res, me, r, &mut found);
                        self.views[me].acquired(r, token, got, t).then_some(token)
                    }
                    // Waits only on an acquisition or a release under way: none here.
                    Take::Publish | Take::Wait => None,
                };
            match token {
                Some(token) => taken.push((r, token)),
                None => {
                    self.views[me].put_back(&taken, t);
                    return (false, found);
                }
            }
        }
        let stands = self.views[me].end_write(&taken, lease(me), Some(lease(me)), t);
        debug_assert!(stands, "the simulator's leases never lapse");
        (true, found)
    }

    /// etcd puts region `r`'s owner key for host `me` if it is free: one transaction, and
    /// every other host drops the region (its acknowledgement). Adds to `found` the other
    /// hosts' caches that held part of it.
    fn acquire(
        &mut self,
        hosts: &mut [Host],
        res: &mut StackResult,
        me: usize,
        r: u64,
        found: &mut u64,
    ) -> Option<i64> {
        if self.keys.contains_key(&r) {
            return None;
        }
        self.rev += 1;
        let rev = self.rev;
        self.keys.insert(r, (me, rev));
        res.region_acquisitions += 1;
        for h in (0..hosts.len()).filter(|&h| h != me) {
            res.acknowledgements += 1;
            let heard = self.views[h].owner_put(r, (lease(me), rev, false), rev, lease(h));
            *found += self.heard(hosts, h, r, heard) as u64;
        }
        Some(rev)
    }

    /// Host `h` does what its machine `heard` asks of region `r`: returns whether its caches
    /// held part of the region it dropped.
    fn heard(&mut self, hosts: &mut [Host], h: usize, r: u64, heard: Heard) -> bool {
        let Heard::Drop(after) = heard else {
            return false;
        };
        let (at, size) = self.span(r);
        let held = self.touched[h].remove(&r) && hosts[h].invalidate(at, size);
        self.views[h].dropped(r, after, lease(h), 0);
        held
    }

    /// Every host but `me` hears `me`'s publication of `[offset, offset + len)` at `t`: its
    /// regions count as contended, and each host releases at once those it owns.
    pub(super) fn published(
        &mut self,
        hosts: &mut [Host],
        res: &mut StackResult,
        me: usize,
        t: u64,
        offset: u64,
        len: u64,
    ) {
        for h in (0..hosts.len()).filter(|&h| h != me) {
            self.views[h].foreign_write(offset, len, t);
            self.release(hosts, res, h, t);
        }
    }

    /// Every host releases the regions its machine says to by `t`: unwritten for the idle
    /// time (or contended).
    pub(super) fn release_idle(&mut self, hosts: &mut [Host], res: &mut StackResult, t: u64) {
        for h in 0..hosts.len() {
            self.release(hosts, res, h, t);
        }
    }

    /// Host `h` releases what its machine says to at `t`: one etcd delete each, and every
    /// other host drops the region again (one acknowledgement each, counted to be
    /// conservative).
    fn release(&mut self, hosts: &mut [Host], res: &mut StackResult, h: usize, t: u64) {
        while let Some(Release {
            region: r,
            token,
            revision,
            contended,
        }) = self.views[h].next_release(t)
        {
            let ok = self.keys.get(&r) == Some(&(h, revision));
            if ok {
                self.keys.remove(&r);
                self.rev += 1;
            }
            self.views[h].released(r, token, revision, ok);
            debug_assert!(ok, "released a key it did not hold");
            res.region_releases += 1;
            res.contention_releases += contended as u64;
            for o in (0..hosts.len()).filter(|&o| o != h) {
                res.acknowledgements += 1;
                let heard = self.views[o].owner_deleted(r, self.rev, lease(o));
                res.release_invalidations += self.heard(hosts, o, r, heard) as u64;
            }
        }
    }

    /// Regions owned now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }
}
