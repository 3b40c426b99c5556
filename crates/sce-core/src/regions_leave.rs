//! The ownership machine's releases: of idle or contended regions, of every region for a
//! hand-off, and of stray keys (see `regions.rs`).

use super::{Phase, Regions, Release};

impl Regions {
    /// The next region to release at `now`: held, no owned write in flight, and contended
    /// or unwritten for the idle time. It is marked leaving; the driver deletes its key and
    /// reports with [`Regions::released`].
    pub fn next_release(&mut self, now: u64) -> Option<Release> {
        let soon: Vec<u64> = self.soon.iter().copied().collect();
        for r in soon {
            let phase = self.mine.get(&r).map(|m| (m.phase, m.inflight));
            match phase {
                _ if !self.contended(r, now) => {}
                Some((Phase::Held, 0)) => {
                    self.soon.remove(&r);
                    return self.leave(r, true);
                }
                // Released once taken, or once the last write there ends, if still
                // contended then.
                Some(_) => continue,
                None => {}
            }
            self.soon.remove(&r);
        }
        while let Some(&(last, r)) = self.by_last.first() {
            let live = self
                .mine
                .get(&r)
                .filter(|m| m.last == last && m.phase == Phase::Held);
            match live {
                Some(m) if m.inflight == 0 && now.saturating_sub(last) >= self.idle => {
                    self.by_last.pop_first();
                    return self.leave(r, false);
                }
                Some(m) if m.inflight == 0 => return None,
                // Written again (indexed again at its end), or no longer held.
                _ => {
                    self.by_last.pop_first();
                }
            }
        }
        None
    }

    /// Marks region `r` leaving: its release.
    fn leave(&mut self, r: u64, contended: bool) -> Option<Release> {
        let m = self.mine.get_mut(&r)?;
        m.phase = Phase::Leaving;
        Some(Release {
            region: r,
            token: m.token,
            revision: m.revision,
            contended,
        })
    }

    /// The delete or move of the key of region `r` (`token`) ended: `ok`, or perhaps not
    /// (it is deleted again later: a stray). No longer owned here either way.
    pub fn released(&mut self, r: u64, token: u64, revision: i64, ok: bool) {
        if self.entry(r, token).is_some() {
            self.mine.remove(&r);
        }
        if !ok {
            self.stray.push((r, revision));
        }
    }

    /// Keys to delete again (region, revision): their deletion failed.
    pub fn add_stray(&mut self, keys: &[(u64, i64)]) {
        self.stray.extend_from_slice(keys);
    }

    /// The keys to delete again, taken.
    pub fn take_stray(&mut self) -> Vec<(u64, i64)> {
        std::mem::take(&mut self.stray)
    }

    /// A hand-off begins: every held region is marked leaving; returns them (region,
    /// token).
    pub fn mark_handoff(&mut self) -> Vec<(u64, u64)> {
        let mut marked = Vec::new();
        for (r, m) in self.mine.iter_mut().filter(|(_, m)| m.phase == Phase::Held) {
            m.phase = Phase::Leaving;
            marked.push((*r, m.token));
        }
        marked
    }

    /// Whether a region `marked` by a hand-off still has an owned write in flight.
    pub fn handoff_busy(&mut self, marked: &[(u64, u64)]) -> bool {
        (marked.iter()).any(|&(r, t)| self.entry(r, t).is_some_and(|m| m.inflight > 0))
    }

    /// The hand-off's wait ended: the regions `marked` with no write in flight count as
    /// another's and are returned (region, token, revision) to be moved; those still
    /// written stay held, and those gone were lost meanwhile.
    pub fn handoff_ready(&mut self, marked: &[(u64, u64)]) -> Vec<(u64, u64, i64)> {
        let mut ready = Vec::new();
        for &(r, token) in marked {
            let Some(m) = self.entry(r, token) else {
                continue;
            };
            if m.inflight > 0 {
                m.phase = Phase::Held;
                continue;
            }
            let rev = m.revision;
            self.theirs.insert(r, rev);
            ready.push((r, token, rev));
        }
        ready
    }
}
