//! The log's state in memory (the engine's `LogBack::st`, a leaf lock; the simulator's
//! `--mode writeback`): which version of each dirty page is newest, which versions the tail
//! may not pass yet, what waits for a commit, the pages lost or stuck, the ranges being
//! drained, and what cleaning takes next. No I/O here: the engine does the device and
//! source I/O and reports back, and so does the simulator in virtual time. `T` is the
//! caller's clock (`Instant` in the engine, virtual nanoseconds in the simulator).

use super::{LogWriter, CLEANED, TOMBSTONE};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

/// Pages of one cleaning write to the source, at most (1 MiB).
pub const RUN_PAGES: u64 = 256;
use std::time::Duration;

/// Pages per group of `LogState::groups` (2^8 pages: 1 MiB).
pub const GROUP_SHIFT: u32 = 8;

/// A dirty page's newest version: its log position and checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dirty {
    /// Its position in the log.
    pub lpos: u64,
    /// The CRC-32C of its 4 KiB.
    pub crc: u32,
}

/// A page whose cleaning failed at the source: when to try again, and how often it failed.
#[derive(Clone, Copy, Debug)]
pub struct Stuck<T> {
    /// Failures so far.
    pub tries: u32,
    /// When to try again.
    pub retry_at: T,
}

impl<T> Stuck<T> {
    /// The wait after `tries` failures: 50 ms doubling to 30 s.
    pub fn backoff(tries: u32) -> Duration {
        Duration::from_millis(50)
            .saturating_mul(1 << tries.min(10))
            .min(Duration::from_secs(30))
    }
}

/// The log's state in memory.
pub struct LogState<T> {
    /// The writer: positions, sequence numbers, what waits for a commit.
    pub w: LogWriter,
    /// Global page number → its newest version in the log.
    pub index: HashMap<u64, Dirty>,
    /// Pages of `index` per 1 MiB of the address space (`g >> GROUP_SHIFT`), in address
    /// order: where dirty data is, for block status and drains.
    pub groups: BTreeMap<u64, u32>,
    /// The versions the tail may not pass, by log position (→ page): each page's newest,
    /// and older ones until a newer version is committed or cleaned (a crash before that
    /// must find the older one: it may be what the last FLUSH made durable). The cleaner
    /// takes the pages of the oldest. (Writes complete out of order: a queue in completion
    /// order would put a later position before an earlier one.)
    pub live: BTreeMap<u64, u64>,
    /// Per page, its older versions still in `live`.
    pub older: HashMap<u64, Vec<u64>>,
    /// Completed versions no commit has taken yet, in completion order (the writer's own
    /// pending list, mirrored: a commit takes them from the front). Tombstones and cleaned
    /// entries have `TOMBSTONE` and `CLEANED` as their position.
    pub pending: VecDeque<(u64, u64)>,
    /// Data writes allocated and not yet completed, by first position (count): the tail
    /// never passes one.
    pub inflight: BTreeMap<u64, u32>,
    /// Pages whose only copy was found damaged (at start or while serving): reads fail until
    /// a write covers the page whole (never an older version).
    pub lost: BTreeSet<u64>,
    /// Where the log records each loss (the damaged version, or the commit whose tombstone
    /// carries it): the tail does not pass it until a later commit carries the loss or a
    /// write that replaced the page is committed, so that a replay from any anchor finds the
    /// loss or the newer version.
    pub loss_at: HashMap<u64, u64>,
    /// Lost pages whose tombstone is pending or in a commit not yet durable.
    pub carrying: HashSet<u64>,
    /// Versions superseded by a cleaned entry not yet durable (page → positions). They do
    /// not hold the tail (`supersede`).
    pub superseded: HashMap<u64, Vec<u64>>,
    /// Pages whose write to the source failed, retried after their backoff.
    pub stuck: HashMap<u64, Stuck<T>>,
    /// Cleaned versions a replay could still bring back (at or above the writer's replay
    /// floor), by position → page, and their pages (→ how many): harmless while the source
    /// holds those bytes, so a write or discard that goes to the source behind the log
    /// supersedes them with a cleaned entry, and so does the end of a drain.
    pub cleaned_at: BTreeMap<u64, u64>,
    /// The pages of `cleaned_at` (→ how many versions).
    pub cleaned_pages: BTreeMap<u64, u32>,
    /// Global page ranges `[first, end)` being drained: writes there go through to the
    /// source (one per drain under way).
    pub drains: Vec<(u64, u64)>,
    /// The first global page of each volume, in address order, and its dirty pages.
    pub bases: Vec<u64>,
    /// Dirty pages per volume (same order).
    pub vol_dirty: Vec<u64>,
    /// Write completions so far, and how many of them the last commit covered.
    pub written: u64,
    /// How many of `written` the last commit covered.
    pub committed: u64,
    /// When the last commit, which listed pages, completed, if no commit followed it yet
    /// (it wants a seal: `commit.rs`).
    pub unsealed: Option<T>,
}

impl<T: Copy + Ord> LogState<T> {
    /// The state of a log written by `w` for volumes starting at global pages `bases`.
    pub fn new(w: LogWriter, bases: Vec<u64>) -> Self {
        LogState {
            w,
            index: Default::default(),
            groups: Default::default(),
            live: Default::default(),
            older: Default::default(),
            pending: Default::default(),
            inflight: Default::default(),
            lost: Default::default(),
            loss_at: Default::default(),
            carrying: Default::default(),
            superseded: Default::default(),
            stuck: Default::default(),
            cleaned_at: Default::default(),
            cleaned_pages: Default::default(),
            drains: Vec::new(),
            vol_dirty: vec![0; bases.len().max(1)],
            bases,
            written: 0,
            committed: 0,
            unsealed: None,
        }
    }

    /// The volume (index in address order) global page `g` belongs to.
    pub fn vol_of(&self, g: u64) -> usize {
        self.bases.partition_point(|&b| b <= g).max(1) - 1
    }

    /// Page `g`'s newest version is now `d`, just completed (`pending`: not committed).
    pub fn newest(&mut self, g: u64, d: Dirty, pending: bool) {
        match self.index.insert(g, d) {
            Some(old) => self.older.entry(g).or_default().push(old.lpos),
            None => {
                *self.groups.entry(g >> GROUP_SHIFT).or_default() += 1;
                let v = self.vol_of(g);
                self.vol_dirty[v] += 1;
            }
        }
        self.live.insert(d.lpos, g);
        if pending {
            self.pending.push_back((d.lpos, g));
        }
    }

    /// Page `g` leaves the index (its versions stay where `live` has them).
    fn unindex(&mut self, g: u64) -> Option<Dirty> {
        let d = self.index.remove(&g)?;
        match self.groups.entry(g >> GROUP_SHIFT) {
            std::collections::btree_map::Entry::Occupied(mut n) => {
                *n.get_mut() -= 1;
                if *n.get() == 0 {
                    n.remove();
                }
            }
            std::collections::btree_map::Entry::Vacant(_) => {
                debug_assert!(false, "page {g} left the index uncounted in its group")
            }
        }
        let v = self.vol_of(g);
        self.vol_dirty[v] = self.vol_dirty[v].saturating_sub(1);
        Some(d)
    }

    /// Page `g`'s versions before position `lpos` are no longer needed (a newer one is
    /// committed, or on the source).
    pub fn drop_older(&mut self, g: u64, lpos: u64) {
        if let Some(v) = self.older.get_mut(&g) {
            for l in v.iter().filter(|&&l| l < lpos) {
                self.live.remove(l);
            }
            v.retain(|&l| l >= lpos);
            if v.is_empty() {
                self.older.remove(&g);
            }
        }
    }

    /// A commit (at `at`) of the first `n` pending entries is durable.
    pub fn committed(&mut self, n: usize, at: u64) {
        for _ in 0..n {
            let Some((l, g)) = self.pending.pop_front() else {
                break;
            };
            if l == TOMBSTONE {
                // The loss now lives in this commit (until a committed write ends it).
                self.carrying.remove(&g);
                if let Some(c) = self.loss_at.get_mut(&g) {
                    *c = (*c).max(at);
                }
            } else if l == CLEANED {
                // The source's copy is the newest, durably: the superseded versions go, and
                // so does a loss.
                for p in self.superseded.remove(&g).unwrap_or_default() {
                    self.live.remove(&p);
                }
                self.loss_at.remove(&g);
            } else {
                self.drop_older(g, l);
                // A new version of a lost page is durable: the loss is over for any replay
                // (this entry follows every tombstone of it). Not if the page is lost now:
                // then this version is the damaged one (found while its entry was pending)
                // or older than it, and the loss must stay recorded.
                if !self.lost.contains(&g) {
                    self.loss_at.remove(&g);
                }
            }
        }
    }

    /// Page `g`'s version `lpos` is on the source (flushed): it and every older one go,
    /// and the page leaves the index unless a newer version came meanwhile. (Versions a
    /// cleaned entry superseded stay until it is durable.)
    pub fn cleaned(&mut self, g: u64, lpos: u64) {
        self.drop_older(g, lpos);
        if self.index.get(&g).is_some_and(|d| d.lpos == lpos) {
            self.unindex(g);
            self.live.remove(&lpos);
            self.stuck.remove(&g);
            if self.cleaned_at.insert(lpos, g).is_none() {
                *self.cleaned_pages.entry(g).or_default() += 1;
            }
        } else if !self.superseded.get(&g).is_some_and(|v| v.contains(&lpos)) {
            // A newer version is the newest; this one is now merely older.
            self.live.remove(&lpos);
            if let Some(v) = self.older.get_mut(&g) {
                v.retain(|&l| l != lpos);
            }
        }
    }

    /// Cleaned versions below `floor` (the writer's replay floor) can no longer come back.
    pub fn release_cleaned(&mut self, floor: u64) {
        while let Some(e) = self.cleaned_at.first_entry() {
            if *e.key() >= floor {
                break;
            }
            let g = e.remove();
            if let std::collections::btree_map::Entry::Occupied(mut n) = self.cleaned_pages.entry(g)
            {
                *n.get_mut() -= 1;
                if *n.get() == 0 {
                    n.remove();
                }
            }
        }
    }

    /// True if a replay could bring back a version of a page of `[g0, g1)`, or it is lost:
    /// a write or discard that goes to the source there must supersede it.
    pub fn held_in(&self, g0: u64, g1: u64) -> bool {
        self.dirty_in(g0, g1) != (0, 0) || self.cleaned_pages.range(g0..g1).next().is_some()
    }

    /// The source holds page `g`'s newest bytes now (written through and flushed): its
    /// versions leave the index (and no longer hold the tail) and wait in `superseded` for
    /// the cleaned entry's commit, and a loss of it ends. True if the log held a version of it, had it lost, or holds a
    /// cleaned version a replay could bring back (a cleaned entry is then due).
    /// A lost page is left as it is unless `end_loss` (a write or discard over it ends it;
    /// the end of a drain does not).
    pub fn supersede(&mut self, g: u64, end_loss: bool) -> bool {
        if !end_loss && self.lost.contains(&g) {
            return false;
        }
        let newest = self.unindex(g).map(|d| d.lpos);
        let older = self.older.remove(&g).unwrap_or_default();
        let lost = self.lost.remove(&g);
        self.stuck.remove(&g);
        let replayable = self.cleaned_pages.contains_key(&g);
        if newest.is_none() && older.is_empty() && !lost {
            return replayable;
        }
        // They no longer hold the tail: the source holds newer bytes, flushed, so a replay
        // that no longer finds them serves those (the write through is acknowledged only
        // once the cleaned entry is durable; until then it may land or not). Held, they
        // could keep a full ring waiting for room only that commit's durability frees.
        for p in newest.iter().chain(&older) {
            self.live.remove(p);
        }
        let s = self.superseded.entry(g).or_default();
        s.extend(newest.into_iter().chain(older));
        true
    }

    /// Page `g`'s version `d` failed its checksum (its only copy is damaged): if it is still
    /// the newest, the page is lost from now on, its loss recorded at `d` until a tombstone
    /// carries it (the caller queues one). True if it was.
    pub fn damaged(&mut self, g: u64, d: Dirty) -> bool {
        if self.index.get(&g) != Some(&d) {
            return false;
        }
        self.unindex(g);
        self.live.remove(&d.lpos);
        self.stuck.remove(&g);
        self.lost.insert(g);
        let at = self.loss_at.entry(g).or_insert(d.lpos);
        *at = (*at).min(d.lpos);
        true
    }

    /// The write allocated at `lpos` is no longer in flight (completed, or given up).
    pub fn landed(&mut self, lpos: u64) {
        let left = self.inflight.get_mut(&lpos).map(|c| {
            *c -= 1;
            *c
        });
        if left == Some(0) {
            self.inflight.remove(&lpos);
        }
    }

    /// The oldest position still needed but for the records of losses: the oldest live
    /// version or write in flight.
    pub fn tail_of_data(&self) -> u64 {
        let live = self.live.keys().next().copied().unwrap_or(u64::MAX);
        let inflight = self.inflight.keys().next().copied().unwrap_or(u64::MAX);
        live.min(inflight).min(self.w.head())
    }

    /// The oldest position still needed: the oldest live version, write in flight, or
    /// record of a loss.
    pub fn tail(&self) -> u64 {
        let lost = self.loss_at.values().copied().min().unwrap_or(u64::MAX);
        self.tail_of_data().min(lost)
    }

    /// True if global pages `[g0, g1)` overlap a range being drained.
    pub fn draining(&self, g0: u64, g1: u64) -> bool {
        self.drains.iter().any(|&(a, b)| a < g1 && g0 < b)
    }

    /// Dirty and lost pages among global pages `[g0, g1)`.
    pub fn dirty_in(&self, g0: u64, g1: u64) -> (u64, u64) {
        let mut dirty = 0;
        for (n, span) in self.spans(g0, g1) {
            dirty += if span.end - span.start == 1 << GROUP_SHIFT {
                n as u64
            } else {
                span.filter(|g| self.index.contains_key(g)).count() as u64
            };
        }
        (dirty, self.lost.range(g0..g1).count() as u64)
    }

    /// The groups with dirty pages among global pages `[g0, g1)`, in address order: each
    /// one's count of dirty pages, and its pages within the range.
    pub(super) fn spans(
        &self,
        g0: u64,
        g1: u64,
    ) -> impl Iterator<Item = (u32, std::ops::Range<u64>)> + '_ {
        let groups = (g0 >> GROUP_SHIFT)..=((g1.max(1) - 1) >> GROUP_SHIFT);
        (self.groups.range(groups)).map(move |(&k, &n)| {
            (
                n,
                (k << GROUP_SHIFT).max(g0)..((k + 1) << GROUP_SHIFT).min(g1),
            )
        })
    }

    /// Up to `max` pages with a version among global pages `[g0, g1)`, by the position of
    /// their newest version (oldest first), leaving out stuck pages not due at `now`.
    pub fn dirty_pages_in(&self, g0: u64, g1: u64, max: usize, now: T) -> Vec<u64> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (_, span) in self.spans(g0, g1) {
            for g in span {
                if let Some(d) = self.index.get(&g) {
                    if self.stuck.get(&g).is_none_or(|s| s.retry_at <= now) {
                        out.push((d.lpos, g));
                    }
                }
            }
            if out.len() >= max.saturating_mul(4) {
                break;
            }
        }
        out.sort_unstable();
        out.into_iter().take(max).map(|(_, g)| g).collect()
    }
}
