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
//! [`Owners`] is the table the [`super::Stack`] keeps: region -> (owner, last write), and
//! the regions ordered by their last write, so that the idle ones are found without a scan;
//! per host the regions it counts as contended, until when; and per host the regions it may
//! cache something of (it read or wrote them through its caches since it last dropped
//! them), so that dropping a region skips the hosts that cannot hold any of it instead of
//! searching their caches.

use std::collections::{BTreeSet, HashMap, HashSet};

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

/// Who owns which region, and since when it was last written by its owner.
#[derive(Debug)]
pub(super) struct Owners {
    rule: Ownership,
    /// Region -> (owner host, the owner's last write to it).
    owner: HashMap<u64, (usize, u64)>,
    /// (last write, region) of every owned region: the oldest first.
    by_last: BTreeSet<(u64, u64)>,
    /// Per host, the regions it may cache something of.
    touched: Vec<HashSet<u64>>,
    /// Per host, the regions it counts as contended, until when (expired entries are
    /// purged when the map doubles).
    contended: Vec<HashMap<u64, u64>>,
    /// Per host, the size of its `contended` map at which expired entries are purged.
    purge_at: Vec<usize>,
}

/// The least size of a host's `contended` map at which expired entries are purged.
const PURGE_MIN: usize = 64;

impl Owners {
    pub(super) fn new(rule: Ownership, hosts: usize) -> Self {
        Owners {
            rule,
            owner: HashMap::new(),
            by_last: BTreeSet::new(),
            touched: vec![HashSet::new(); hosts],
            contended: vec![HashMap::new(); hosts],
            purge_at: vec![PURGE_MIN; hosts],
        }
    }

    /// Whether `host` counts region `r` as contended at `t`.
    pub(super) fn contended(&self, host: usize, r: u64, t: u64) -> bool {
        self.contended[host].get(&r).is_some_and(|&until| until > t)
    }

    /// `host` counts region `r` as contended from `t` for the idle time (it wrote a region
    /// another host owned, or heard another host's write there).
    pub(super) fn mark_contended(&mut self, host: usize, r: u64, t: u64) {
        let m = &mut self.contended[host];
        m.insert(r, t.saturating_add(self.rule.idle_ns));
        if m.len() >= self.purge_at[host] {
            m.retain(|_, until| *until > t);
            self.purge_at[host] = (2 * m.len()).max(PURGE_MIN);
        }
    }

    /// `host` read or wrote region `r` through its caches: it may cache something of it
    /// from now on.
    pub(super) fn touch(&mut self, host: usize, r: u64) {
        self.touched[host].insert(r);
    }

    /// Forgets that `host` may cache region `r` (it is dropping it); returns whether it
    /// might have.
    pub(super) fn untouch(&mut self, host: usize, r: u64) -> bool {
        self.touched[host].remove(&r)
    }

    /// The regions `[offset, offset + len)` touches (none if `len` is 0).
    pub(super) fn regions(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        if len == 0 {
            return 0..0;
        }
        let r = self.rule.region_size;
        offset / r..(offset.saturating_add(len - 1)) / r + 1
    }

    /// The byte range of region `r`.
    pub(super) fn span(&self, r: u64) -> (u64, u64) {
        let s = self.rule.region_size;
        (r.saturating_mul(s), s)
    }

    /// The owner of region `r`, if any.
    pub(super) fn owner(&self, r: u64) -> Option<usize> {
        self.owner.get(&r).map(|o| o.0)
    }

    /// `host` writes region `r` at `t`: it becomes (or stays) its owner, last written at
    /// `t`. Returns true if the region had no owner (an acquisition). The region must not
    /// be owned by another host.
    pub(super) fn write(&mut self, r: u64, host: usize, t: u64) -> bool {
        let prev = self.owner.insert(r, (host, t));
        debug_assert!(prev.is_none_or(|p| p.0 == host), "{r} owned by another");
        if let Some((_, last)) = prev {
            self.by_last.remove(&(last, r));
        }
        self.by_last.insert((t, r));
        prev.is_none()
    }

    /// Releases region `r` now (its owner heard another host write it); returns its former
    /// owner, if it had one.
    pub(super) fn release(&mut self, r: u64) -> Option<usize> {
        let (host, last) = self.owner.remove(&r)?;
        self.by_last.remove(&(last, r));
        Some(host)
    }

    /// Releases the first region idle at `t` (its owner's last write at least the idle
    /// time ago); returns it and its former owner. Call until None.
    pub(super) fn release_idle(&mut self, t: u64) -> Option<(u64, usize)> {
        let &(last, r) = self.by_last.first()?;
        if last.saturating_add(self.rule.idle_ns) > t {
            return None;
        }
        self.by_last.pop_first();
        let (host, _) = self.owner.remove(&r)?;
        Some((r, host))
    }

    /// Regions owned now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.owner.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_released_oldest_first_once_idle() {
        let mut o = Owners::new(
            Ownership {
                region_size: 1 << 20,
                idle_ns: 100,
            },
            2,
        );
        assert_eq!(o.regions(0, 0), 0..0);
        assert_eq!(o.regions((1 << 20) - 1, 2), 0..2);
        assert_eq!(o.regions(3 << 20, 1 << 20), 3..4);
        assert!(o.write(5, 1, 10), "acquired");
        assert!(o.write(2, 0, 20));
        assert!(!o.write(5, 1, 30), "owned: no acquisition");
        assert_eq!(
            (o.owner(5), o.owner(2), o.owner(3)),
            (Some(1), Some(0), None)
        );
        assert_eq!(o.release_idle(119), None, "region 2 idle for 99 ns");
        assert_eq!(o.release_idle(120), Some((2, 0)));
        assert_eq!(o.release_idle(129), None, "region 5 was rewritten at 30");
        assert_eq!(o.release_idle(1000), Some((5, 1)));
        assert_eq!((o.release_idle(1000), o.len()), (None, 0));
        // A region released at once leaves the idle order too.
        assert!(o.write(7, 0, 2000) && o.write(8, 0, 2000));
        assert_eq!((o.release(7), o.release(7), o.len()), (Some(0), None, 1));
        assert_eq!(o.release_idle(2100), Some((8, 0)));
        assert_eq!(o.release_idle(1 << 40), None);
        // Contended until 100 ns after the mark, in the marking host's view only.
        o.mark_contended(1, 4, 50);
        assert!(o.contended(1, 4, 149) && !o.contended(1, 4, 150) && !o.contended(0, 4, 60));
        o.mark_contended(1, 4, 120);
        assert!(o.contended(1, 4, 219));
        for r in 0..PURGE_MIN as u64 {
            o.mark_contended(0, 100 + r, r * 200);
        }
        assert_eq!(o.contended[0].len(), 1, "the expired marks were purged");
        o.touch(1, 0);
        o.touch(1, 1);
        assert!(o.untouch(1, 0) && o.untouch(1, 1) && !o.untouch(1, 0) && !o.untouch(0, 1));
        assert!(Ownership::new(1000, 1.0).is_err());
        assert!(Ownership::new(4096, -1.0).is_err());
        assert_eq!(Ownership::new(1 << 30, 10.0), Ok(Ownership::default()));
    }
}
