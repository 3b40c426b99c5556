//! What the engine and the simulator do with the log's state, each a whole step under the
//! state's lock: what cleaning takes next and how it is cut into source writes, positions
//! taken and landed, commits made durable, the tail moved, ranges superseded, losses found
//! and carried, copies forward landed, and what a replay found put back (issue 45).

use super::state::{Dirty, LogState, Stuck, RUN_PAGES};
use super::{Anchor, Full, LogEntry, PreparedCommit, CLEANED, TOMBSTONE};
use std::collections::HashSet;

impl<T: Copy + Ord> LogState<T> {
    /// The first global page after `g`'s volume (`u64::MAX` for the last volume).
    pub fn volume_end(&self, g: u64) -> u64 {
        let i = self.bases.partition_point(|&b| b <= g);
        self.bases.get(i).copied().unwrap_or(u64::MAX)
    }

    /// What cleaning takes next, up to `max` pages: in `focus` first (a drain's range), then
    /// the pages of the oldest live versions (the tail's); stuck pages only once due at
    /// `now`, at most `retries` of them. Returns the pages and which of them are retries
    /// (each written alone, so that one bad block holds only itself).
    pub fn pick(
        &self,
        focus: Option<(u64, u64)>,
        now: T,
        max: usize,
        retries: usize,
    ) -> (Vec<u64>, HashSet<u64>) {
        let mut pages = match focus {
            Some((a, b)) => self.dirty_pages_in(a, b, max, now),
            None => Vec::new(),
        };
        let mut seen: HashSet<u64> = pages.iter().copied().collect();
        for &g in self.live.values() {
            if pages.len() >= max {
                break;
            }
            if self.stuck.get(&g).is_none_or(|s| s.retry_at <= now) && seen.insert(g) {
                pages.push(g);
            }
        }
        let mut alone = HashSet::new();
        pages.retain(|g| match self.stuck.get(g) {
            None => true,
            Some(_) if alone.len() < retries => alone.insert(*g),
            Some(_) => false,
        });
        pages.retain(|g| self.index.contains_key(g));
        pages.sort_unstable();
        pages.dedup();
        (pages, alone)
    }

    /// Sorted `pages` cut into the source writes that clean them: runs of consecutive pages
    /// within one volume, at most [`RUN_PAGES`] each, a page of `alone` a run of its own:
    /// (first page, pages).
    pub fn runs(&self, pages: &[u64], alone: &HashSet<u64>) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < pages.len() {
            let g0 = pages[i];
            let stop = self.volume_end(g0);
            let mut n = 1;
            while !alone.contains(&g0)
                && i + (n as usize) < pages.len()
                && pages[i + n as usize] == g0 + n
                && !alone.contains(&(g0 + n))
                && g0 + n < stop
                && n < RUN_PAGES
            {
                n += 1;
            }
            out.push((g0, n));
            i += n as usize;
        }
        out
    }

    /// Cleaning page `g` failed at the source: it stays dirty, stuck, retried at
    /// `retry(tries)` (the caller's clock after [`Stuck::backoff`]).
    pub fn clean_failed(&mut self, g: u64, now: T, retry: impl FnOnce(u32) -> T) {
        if self.index.contains_key(&g) {
            let s = self.stuck.entry(g).or_insert(Stuck {
                tries: 0,
                retry_at: now,
            });
            s.tries += 1;
            s.retry_at = retry(s.tries);
        }
    }

    /// A data write allocated at `lpos` completed (`entries`, of global pages `g0..`, or
    /// `None` if it failed: its positions stay unused and the pages keep their versions):
    /// no longer in flight, and each page's newest version, pending the next commit. A new
    /// version ends a loss; a page the source refused stays stuck (a new version does not
    /// mend the source's block).
    pub fn appended(&mut self, g0: u64, lpos: u64, entries: Option<&[LogEntry]>) {
        self.landed(lpos);
        let Some(entries) = entries else { return };
        self.w.completed(entries);
        for (i, en) in entries.iter().enumerate() {
            let g = g0 + i as u64;
            let d = Dirty {
                lpos: en.lpos,
                crc: en.crc,
            };
            self.newest(g, d, true);
            self.lost.remove(&g);
        }
        self.written += 1;
    }

    /// Commit `p` is durable (written and flushed) at `now`: the writer told, the versions
    /// it names take over from older ones, cleaned versions below the replay floor
    /// released. True if more completions wait for a commit.
    pub fn commit_done(&mut self, p: &PreparedCommit, now: T) -> bool {
        self.w.committed(p);
        // A commit that listed pages wants a seal; any commit seals the ones before it.
        self.unsealed = (p.entries > 0).then_some(now);
        self.committed(p.entries, p.lpos);
        let floor = self.w.replay_floor();
        self.release_cleaned(floor);
        self.w.pending() > 0
    }

    /// The tail as far as the state allows: true if it moved.
    pub fn settle_tail(&mut self) -> bool {
        let (tail, was) = (self.tail(), self.w.tail());
        self.w.set_tail(tail);
        self.w.tail() != was
    }

    /// The pages of `[g0, g1)` the log holds a version of (stuck or not), has lost (if
    /// `lost`), or holds a cleaned version of that a replay could bring back, sorted.
    pub fn held_pages(&self, g0: u64, g1: u64, lost: bool) -> Vec<u64> {
        let mut v: Vec<u64> = Vec::new();
        for (_, span) in self.spans(g0, g1) {
            v.extend(span.filter(|g| self.index.contains_key(g)));
        }
        if lost {
            v.extend(self.lost.range(g0..g1).copied());
        }
        v.extend(self.cleaned_pages.range(g0..g1).map(|(&g, _)| g));
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The source holds the newest bytes of pages `[g0, g1)`, flushed (a write through, a
    /// discard, a drain's end): a cleaned entry for each page the log holds a version of
    /// (and each it had lost, if `lost`: a write or discard over a lost page ends the loss)
    /// goes into the next commit, counted as a completion so that a FLUSH from now on
    /// commits it. `local` names a global page's (volume id, page).
    pub fn supersede_range(
        &mut self,
        g0: u64,
        g1: u64,
        lost: bool,
        local: impl Fn(u64) -> (u32, u64),
    ) {
        for g in self.held_pages(g0, g1, lost) {
            // A loss the cleaned entry ends holds the tail until it is durable: its commit
            // may take the copy reserve.
            let holds = lost && self.loss_at.contains_key(&g);
            if self.supersede(g, lost) {
                let (volume, page) = local(g);
                self.w.supersede(volume, page, holds);
                self.pending.push_back((CLEANED, g));
                self.written += 1;
            }
        }
    }

    /// What a replay found, put back: `lost` pages (global page, where the log records the
    /// loss) and the newest `versions` (position, global page, checksum).
    pub fn restore(&mut self, lost: Vec<(u64, u64)>, mut versions: Vec<(u64, u64, u32)>) {
        for (g, at) in lost {
            self.lost.insert(g);
            self.loss_at.insert(g, at);
        }
        // Room for their tombstones stays kept (never given back: a handful of blocks).
        let carried = self.loss_at.len() as u64;
        self.w.set_carried(carried);
        versions.sort_unstable();
        for (lpos, g, crc) in versions {
            self.newest(g, Dirty { lpos, crc }, false);
        }
    }

    /// Page `g` is lost and a tombstone in the next commit says so (counted as a completion,
    /// so that a FLUSH from now on commits it). `local` names the global page's (volume id,
    /// page).
    pub fn tombstone(&mut self, g: u64, local: impl Fn(u64) -> (u32, u64)) {
        let (volume, page) = local(g);
        self.w.carry_lost(volume, page);
        self.pending.push_back((TOMBSTONE, g));
        self.carrying.insert(g);
        self.written += 1;
    }

    /// Version `d` of page `g` failed its checksum: if it was the newest, the page is lost
    /// and a tombstone of its own is queued (even if one of an earlier loss is pending: that
    /// one comes before this version's entry, and a replay must find the loss after it).
    /// True if it was.
    pub fn damaged_found(&mut self, g: u64, d: Dirty, local: impl Fn(u64) -> (u32, u64)) -> bool {
        if !self.damaged(g, d) {
            return false;
        }
        self.tombstone(g, local);
        true
    }

    /// Tombstones for each loss recorded below position `before` that no tombstone carries
    /// yet (not a page rewritten since: its loss ends when that write is committed). Returns
    /// how many were queued.
    pub fn carry_losses(&mut self, before: u64, local: impl Fn(u64) -> (u32, u64)) -> usize {
        let due: Vec<u64> = (self.loss_at.iter())
            .filter(|&(g, &at)| at < before && self.lost.contains(g))
            .filter(|&(g, _)| !self.carrying.contains(g))
            .map(|(&g, _)| g)
            .collect();
        for &g in &due {
            self.tombstone(g, &local);
        }
        due.len()
    }

    /// A copy of page `g`'s version `was`, written to the head at `lpos` (allocated and in
    /// flight) with checksum `crc` to free the tail, landed (`ok`): it is the page's newest
    /// version, pending the next commit, unless the write failed or a client's write
    /// replaced `was` meanwhile. True if it took.
    pub fn copied(
        &mut self,
        g: u64,
        was: Dirty,
        lpos: u64,
        crc: u32,
        ok: bool,
        volume_page: (u32, u64),
    ) -> bool {
        self.landed(lpos);
        if !ok || self.index.get(&g) != Some(&was) {
            return false;
        }
        let (volume, page) = volume_page;
        self.w.completed(&[LogEntry {
            lpos,
            volume,
            page,
            crc,
        }]);
        self.newest(g, Dirty { lpos, crc }, true);
        self.written += 1;
        true
    }

    /// Positions a client's write leaves free before the anchor besides what the writer
    /// keeps for copies (a 64th of the ring, 16 to 1,024): room that commits, seals and
    /// tombstones take while writers wait.
    pub fn spare(&self) -> u64 {
        (self.w.region().blocks / 64).clamp(16, 1024)
    }

    /// `n` consecutive positions for a client's data write, leaving [`Self::spare`] (the
    /// writer's `allocate_leaving`), counted in flight until [`Self::landed`] (or
    /// [`Self::appended`]).
    pub fn allocate(&mut self, n: u64) -> Result<u64, Full> {
        let spare = self.spare();
        let lpos = self.w.allocate_leaving(n, spare)?;
        *self.inflight.entry(lpos).or_default() += 1;
        Ok(lpos)
    }

    /// `n` positions for a copy forward of versions holding the tail (the writer's
    /// `allocate_copy`: from the reserve no client write takes), counted in flight.
    pub fn allocate_copy(&mut self, n: u64) -> Result<u64, Full> {
        let lpos = self.w.allocate_copy(n)?;
        *self.inflight.entry(lpos).or_default() += 1;
        Ok(lpos)
    }

    /// The anchor to make durable next: the newest the writer allows, if it is past the
    /// current one.
    pub fn anchor_due(&self) -> Option<Anchor> {
        let (a, now) = (self.w.anchor_candidate(), self.w.anchor());
        (a != now && a.lpos() >= now.lpos()).then_some(a)
    }

    /// Anchor `a` is durable: the ring may reuse what lies before it, and cleaned versions
    /// below the new replay floor can no longer come back.
    pub fn anchored(&mut self, a: Anchor) {
        self.w.set_anchor(a);
        let floor = self.w.replay_floor();
        self.release_cleaned(floor);
    }
}
