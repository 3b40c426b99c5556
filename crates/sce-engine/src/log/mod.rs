//! Write-back through the log (issue 29; docs/WRITEBACK.md, "the write-back log"): a
//! write-back write is one device write of its pages into the log region
//! (`sce_store::wblog`), acknowledged at once; an NBD FLUSH (or FUA) commits what was
//! written (one commit record and one cache-device flush, shared by concurrent callers);
//! an index in memory maps each dirty page to its newest version in the log, and reads look
//! there before the clean cache. Nothing is ever overwritten in place: a page's older
//! committed version stays intact until the ring passes it, which only happens once a newer
//! version is committed or the page was cleaned. The cleaner (`clean.rs`) drains the log,
//! oldest first, to the source through the write-through path, which keeps the clean
//! cache's copies right; dirty data never takes a read slot.
//!
//! A write of whole pages that can go out at once may also be started by the NBD reader
//! and finished on the cache device's I/O queue (`queued.rs`): the same device write,
//! acknowledged from its completion.
//!
//! Lock order: the range lock (outermost, as in `back/`; only writes take it), then
//! `clean_io`, then `commit_io`, then `st` (a leaf: no other lock is taken while it is held,
//! and no device I/O happens under it). `progress` and `wanted` are leaves.

mod clean;
mod commit;
mod open;
mod prefetch;
mod queued;
mod read;
mod write;

pub(crate) use open::open_log;

use crate::back::WriteBackStats;
use crate::engine::Engine;
use crate::progress::Progress;
use crate::ranges::RangeLock;
use crate::through::WriteThrough;
use parking_lot::{Condvar, Mutex};
use sce_core::PAGE_SIZE;
use sce_io::BlockDevice;
use sce_store::wblog::{LogRegion, LogWriter, TOMBSTONE};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Pages per group of `St::groups` (2^8 pages: 1 MiB).
const GROUP_SHIFT: u32 = 8;

/// A dirty page's newest version: its log position and checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dirty {
    lpos: u64,
    crc: u32,
}

/// The log's state in memory (under `LogBack::st`).
struct St {
    w: LogWriter,
    /// Global page number → its newest version in the log.
    index: HashMap<u64, Dirty>,
    /// Pages of `index` per 1 MiB of the address space (`g >> GROUP_SHIFT`), in address
    /// order: where dirty data is, for block status (`dirty_group_from`).
    groups: BTreeMap<u64, u32>,
    /// The versions the tail may not pass, by log position (→ page): each page's newest,
    /// and older ones until a newer version is committed or cleaned (a crash before that
    /// must find the older one: it may be what the last FLUSH made durable). The cleaner
    /// takes the pages of the oldest. (Writes complete out of order: a queue in completion
    /// order would put a later position before an earlier one.)
    live: BTreeMap<u64, u64>,
    /// Per page, its older versions still in `live`.
    older: HashMap<u64, Vec<u64>>,
    /// Completed versions no commit has taken yet, in completion order (the writer's own
    /// pending list, mirrored: a commit takes them from the front).
    pending: VecDeque<(u64, u64)>,
    /// Data writes allocated and not yet completed, by first position (count): the tail
    /// never passes one.
    inflight: BTreeMap<u64, u32>,
    /// Pages whose newest committed version was found damaged at start: reads fail until a
    /// write covers the page whole (never an older version).
    lost: BTreeSet<u64>,
    /// Where the log records each loss (the damaged version, or the commit whose tombstone
    /// carries it): the tail does not pass it until a later commit carries the loss
    /// (`carry_lost`) or a write that replaced the page is committed, so that a replay from
    /// any anchor finds the loss or the newer version.
    loss_at: HashMap<u64, u64>,
    /// Lost pages whose tombstone is pending or in a commit not yet durable.
    carrying: HashSet<u64>,
    /// Write completions so far, and how many of them the last commit covered.
    written: u64,
    committed: u64,
    /// When the last commit, which listed pages, completed, if no commit followed it yet
    /// (it wants a seal: `commit.rs`).
    unsealed: Option<std::time::Instant>,
}

impl St {
    /// Page `g`'s newest version is now `d`, just completed (`pending`: not committed).
    fn newest(&mut self, g: u64, d: Dirty, pending: bool) {
        match self.index.insert(g, d) {
            Some(old) => self.older.entry(g).or_default().push(old.lpos),
            None => *self.groups.entry(g >> GROUP_SHIFT).or_default() += 1,
        }
        self.live.insert(d.lpos, g);
        if pending {
            self.pending.push_back((d.lpos, g));
        }
    }

    /// Page `g`'s versions before position `lpos` are no longer needed (a newer one is
    /// committed, or on the source).
    fn drop_older(&mut self, g: u64, lpos: u64) {
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
    fn committed(&mut self, n: usize, at: u64) {
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
            } else {
                self.drop_older(g, l);
                // A new version of a lost page is durable: the loss is over for any replay
                // (this entry follows every tombstone of it).
                self.loss_at.remove(&g);
            }
        }
    }

    /// Page `g`'s version `lpos` is on the source (flushed): it and every older one go,
    /// and the page leaves the index unless a newer version came meanwhile.
    fn cleaned(&mut self, g: u64, lpos: u64) {
        self.drop_older(g, lpos);
        if self.index.get(&g).is_some_and(|d| d.lpos == lpos) {
            self.index.remove(&g);
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
            self.live.remove(&lpos);
        } else {
            // A newer version is the newest; this one is now merely older.
            self.live.remove(&lpos);
            if let Some(v) = self.older.get_mut(&g) {
                v.retain(|&l| l != lpos);
            }
        }
    }

    /// The write allocated at `lpos` is no longer in flight (completed, or given up).
    fn landed(&mut self, lpos: u64) {
        let left = self.inflight.get_mut(&lpos).map(|c| {
            *c -= 1;
            *c
        });
        if left == Some(0) {
            self.inflight.remove(&lpos);
        }
    }

    /// The oldest position still needed: the oldest live version, write in flight, or
    /// record of a loss.
    fn tail(&self) -> u64 {
        let live = self.live.keys().next().copied().unwrap_or(u64::MAX);
        let inflight = self.inflight.keys().next().copied().unwrap_or(u64::MAX);
        let lost = self.loss_at.values().copied().min().unwrap_or(u64::MAX);
        live.min(inflight).min(lost).min(self.w.head())
    }
}

/// The write-back-through-the-log path.
pub(crate) struct LogBack {
    /// The write-through path: clean reads, and the cleaner's writes to the source.
    through: WriteThrough,
    /// The cache device, and its log region.
    dev: Arc<dyn BlockDevice>,
    region: LogRegion,
    /// Volume bases (first global page, id), in address order: log entries name pages by
    /// volume id and page within the volume.
    seeds: Vec<(u64, u16)>,
    persist: Arc<crate::persist::Persist>,
    st: Mutex<St>,
    /// One commit at a time (group commit: the others find theirs done).
    commit_io: Mutex<()>,
    /// One cleaning batch at a time (the cleaner's, `flush --to-source`'s).
    clean_io: Mutex<()>,
    /// Writes hold their pages exclusively (a write merging a partial page must not lose a
    /// concurrent write's other bytes of it); reads and the cleaner take none. A write
    /// started through the queue holds them until its completion ran.
    ranges: RangeLock,
    /// The cache device's I/O queue writes may start through, and where the cache device
    /// starts on its device (`queued.rs`).
    queue: OnceLock<(Arc<dyn sce_io::IoQueue>, u64)>,
    /// The cleaner is wanted now (writers waiting for room, `flush --to-source`).
    wanted: Mutex<bool>,
    wanted_cv: Condvar,
    /// Bumped when room may have come back or a commit completed.
    progress: Progress,
    /// `flush --to-source` callers waiting (the cleaner cleans everything meanwhile).
    forced: AtomicU64,
    /// Engine clock (ns) of the last client request: the cleaner cleans all when idle.
    last_request: AtomicU64,
    waits: AtomicU64,
    bytes_cleaned: AtomicU64,
    clean_errors: AtomicU64,
    source_writes: AtomicU64,
    commits: AtomicU64,
    last_clean_error: Mutex<String>,
    /// The current source outage, for rate-limited logs (as `back/`'s cleaners).
    outage: crate::back::outage::OutageLog,
    wait_limit: Duration,
    idle: Duration,
}

impl LogBack {
    /// The device offset of log position `lpos`.
    fn at(&self, lpos: u64) -> u64 {
        self.region.offset_of(lpos)
    }

    /// The log's name of global page `g`: (volume id, page within the volume).
    fn local(&self, g: u64) -> (u32, u64) {
        let i = self.seeds.partition_point(|&(base, _)| base <= g).max(1) - 1;
        let (base, id) = self.seeds[i];
        (id as u32, g - base)
    }

    /// Global page of (volume id, page), if the volume is served and the page lies before
    /// the next volume's first.
    fn global(&self, volume: u32, page: u64) -> Option<u64> {
        let i = self.seeds.iter().position(|&(_, id)| id as u32 == volume)?;
        let g = self.seeds[i].0 + page;
        let end = self.seeds.get(i + 1).map_or(u64::MAX, |&(base, _)| base);
        (g < end).then_some(g)
    }

    /// The volume boundary after global page `g` (runs never cross one).
    fn volume_end(&self, g: u64) -> u64 {
        let i = self.seeds.partition_point(|&(base, _)| base <= g);
        self.seeds.get(i).map_or(u64::MAX, |&(base, _)| base)
    }

    /// Write-back's state and counters (the same figures as the slot path's).
    pub(crate) fn stats(&self) -> WriteBackStats {
        let (dirty, lost) = {
            let st = self.st.lock();
            (st.index.len() as u64, st.lost.len() as u64)
        };
        WriteBackStats {
            dirty_bytes: dirty * PAGE_SIZE,
            lost_bytes: lost * PAGE_SIZE,
            waits: self.waits.load(Relaxed),
            cleaned_bytes: self.bytes_cleaned.load(Relaxed),
            clean_errors: self.clean_errors.load(Relaxed),
            log_commits: self.commits.load(Relaxed),
            log_source_writes: self.source_writes.load(Relaxed),
            last_clean_error: self.last_clean_error.lock().clone(),
        }
    }

    /// Dirty and lost pages among global pages `first..end` (a volume's: `ctl forget`
    /// keeps them and says how many).
    pub(crate) fn dirty_in(&self, first: u64, end: u64) -> (u64, u64) {
        let st = self.st.lock();
        let inside = |g: &&u64| (first..end).contains(*g);
        let dirty = st.index.keys().filter(inside).count() as u64;
        (dirty, st.lost.iter().filter(inside).count() as u64)
    }

    /// The first 1 MiB group of global pages at or after page `first` and before `end`
    /// that holds a dirty or lost page, as its page range: what block status must report
    /// as data whatever the source's map says.
    pub(crate) fn dirty_group_from(&self, first: u64, end: u64) -> Option<(u64, u64)> {
        let st = self.st.lock();
        let dirty = (st.groups.range(first >> GROUP_SHIFT..).next()).map(|(&k, _)| k);
        let lost = st.lost.range(first..).next().map(|g| g >> GROUP_SHIFT);
        let k = dirty.into_iter().chain(lost).min()?;
        let (lo, hi) = (
            (k << GROUP_SHIFT).max(first),
            ((k + 1) << GROUP_SHIFT).min(end),
        );
        (lo < hi).then_some((lo, hi))
    }

    /// Source writes the cleaner made, and commits (figures for the benchmarks).
    pub(crate) fn log_counts(&self) -> (u64, u64) {
        (self.source_writes.load(Relaxed), self.commits.load(Relaxed))
    }

    /// The cleaner thread's work (`clean.rs`).
    pub(crate) fn cleaner(&self, e: &Engine) {
        clean::cleaner(e, self)
    }
}
