//! Write-back in the simulator (issue 45): through the write-back log, on the state
//! machine the server serves (`sce_store::wblog::LogState`, on a virtual clock), with the
//! server's rules. A write waits for writes in flight on its pages (the server's range
//! lock), takes log positions (waiting for room when the ring is full: backpressure, which
//! shows in its latency; committing first when the gap since the last commit is full), and
//! is acknowledged once its device write is done, when its pages become their newest
//! versions (in flight until then, holding the tail). The cleaner commits every second (the
//! autocommit) and seals a lone commit after 10 ms; it cleans from the low watermark (or
//! when the mirror area is short, or the workload idle) with 16 source writes in flight at
//! the background rate, urgently past the high watermark or while a writer waits (64 in
//! flight, no rate); a batch is what the server's takes (`pick`: the oldest versions;
//! `runs`: coalesced in source order up to 1 MiB), each run writing the versions newest
//! when it is issued through the write-through path (the source, and the cache's clean copy
//! where the fragment is cached), and the batch's room is freed when its last run is done.
//! The core's shards run in write-through, as the server's do; a read finds the log's pages
//! first (hits, read from the device).
//!
//! Not modelled: the sequential bypass, FLUSHes from clients (a block trace has none),
//! drains, a source that refuses writes (stuck pages, the copy-forward of versions holding
//! the tail), damage, and the CPU the server spends.

use super::{EngineSim, Event};
use sce_core::{SourceOffset, WriteKind, WritebackTuning, PAGE_SIZE};
use sce_store::wblog::{Full, Lend, LendStep, LogEntry, LogRegion, LogState, LogWriter};
use std::collections::{HashMap, VecDeque};

/// How often the cleaner looks, ns.
pub(super) const CLEAN_PERIOD: u64 = 10_000_000;
/// The server's autocommit (`AUTOCOMMIT`): what completed is committed at least this often.
const AUTOCOMMIT: u64 = 1_000_000_000;
/// The server's seal after a commit that listed pages (`SEAL_AFTER`).
const SEAL_AFTER: u64 = 10_000_000;
/// No request for this long: the workload is idle, and the cleaner cleans everything.
const IDLE: u64 = 1_000_000_000;
/// Source writes one batch keeps in flight, and while cleaning is urgent (the server's).
const SOURCE_WRITERS: usize = 16;
const URGENT_WRITERS: usize = 64;
/// Versions one batch takes per source writer (the server's `BATCH_PAGES`).
const BATCH_PAGES: usize = 64;
/// Stuck pages one batch retries (none are: the modelled source never fails).
const RETRIES: usize = 32;
/// Pages of one log append (the server's `CHUNK_PAGES`).
const CHUNK_PAGES: u64 = 64;
/// The key of the log's records (the simulator writes none to a device).
const KEY: [u8; 16] = *b"sce-simulated-lg";

/// The log and its cleaner, in virtual time.
pub(super) struct LogSim {
    st: LogState<u64>,
    /// Blocks of the ring's own region, of the whole log's (its mirror area too), and of a
    /// lap with every chunk of read slots it may lend (the most the log may hold).
    blocks: u64,
    total: u64,
    lap: u64,
    /// Chunks of read slots lent now (the superblock's count on a device).
    lent: u64,
    tuning: WritebackTuning,
    /// The cleaning batch in flight (one at a time, as the server's `clean_io`).
    batch: Option<Batch>,
    /// When the last autocommit was.
    last_commit: u64,
    /// Writers waiting for room now.
    waiting: u32,
    /// When background cleaning may take its next batch (the rate's pause).
    resume_at: u64,
    /// Pages whose log write is in flight, and when it completes: a later write of one
    /// starts after it (the server's range lock).
    appending: HashMap<u64, u64>,
}

/// A cleaning batch: the runs not yet issued, the writes in flight, and the versions it
/// cleans (page, log position).
struct Batch {
    runs: VecDeque<(u64, u64)>,
    in_flight: usize,
    versions: Vec<(u64, u64)>,
}

/// What the simulator's write-back did, beyond the common counters.
#[derive(Debug, Clone, Default)]
pub struct WritebackResult {
    /// Bytes of the log (the cache's read slots are the rest).
    pub log_bytes: u64,
    /// Source writes the cleaner issued (each a run of up to 1 MiB).
    pub source_writes: u64,
    /// Cleaning batches.
    pub batches: u64,
    /// Commits (records written).
    pub commits: u64,
    /// Read pages served from the log (counted as hits).
    pub log_read_pages: u64,
    /// Bytes the log may hold at most: its region and every chunk of read slots it may
    /// lend.
    pub log_max_bytes: u64,
    /// Chunks of read slots lent.
    pub lends: u64,
    /// Chunks of read slots given back.
    pub give_backs: u64,
    /// Writes that could not get log positions, ever (nothing left to make room): not
    /// logged, counted at what they cost (0 on any trace a working cache serves).
    pub writes_given_up: u64,
}

impl LogSim {
    /// A log of `bytes` (rounded down to whole blocks, at least 128 of them) that may lend
    /// the chunks of read slots `lend` lays out.
    pub(super) fn new(bytes: u64, lend: Lend, tuning: WritebackTuning) -> Self {
        let blocks = (bytes / PAGE_SIZE).max(128);
        let region = LogRegion {
            lend,
            ..LogRegion::laid_out(0, blocks)
        };
        let w = LogWriter::new(region, KEY, 0, 1).expect("a laid-out log region is valid");
        LogSim {
            st: LogState::new(w, vec![0]),
            blocks: region.blocks,
            total: blocks,
            lap: region.lap(),
            lent: 0,
            tuning,
            batch: None,
            last_commit: 0,
            waiting: 0,
            resume_at: 0,
            appending: HashMap::new(),
        }
    }

    /// Bytes of the log (ring and mirror area).
    pub(super) fn bytes(&self) -> u64 {
        self.total * PAGE_SIZE
    }

    /// Bytes the log may hold at most (a lap with every chunk it may lend).
    pub(super) fn max_bytes(&self) -> u64 {
        self.lap * PAGE_SIZE
    }

    pub(super) fn dirty_pages(&self) -> u64 {
        self.st.index.len() as u64
    }

    /// True if global page `g`'s newest bytes are in the log.
    pub(super) fn holds(&self, g: u64) -> bool {
        self.st.index.contains_key(&g)
    }

    /// The newest anchor the writer allows, durable at once (the simulator has no
    /// superblock to write).
    fn anchor(&mut self) {
        if let Some(a) = self.st.anchor_due() {
            self.st.anchored(a);
        }
    }
}

impl EngineSim {
    fn log(&mut self) -> &mut LogSim {
        self.log.as_mut().expect("write-back runs through the log")
    }

    /// Share of the log in use.
    pub(super) fn dirty_share(&self) -> f64 {
        self.log
            .as_ref()
            .map_or(0.0, |l| l.st.w.used() as f64 / l.lap.max(1) as f64)
    }

    /// Commits what completed since the last commit at `t` (the autocommit, or a writer
    /// that found the gap full): the records' device write; returns when it is durable, or
    /// `None` if the ring has no room for the records.
    pub(super) fn log_commit(&mut self, t: u64) -> Option<u64> {
        let mut done = t;
        loop {
            let p = match self.log().st.w.prepare_commit() {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(_) => return None,
            };
            let copies = if p.mirror_at.is_some() { 2 } else { 1 };
            for _ in 0..copies {
                done = done.max(self.ssd.io(t, p.bytes.len() as u64, true));
            }
            self.wb.commits += 1;
            let more = self.log().st.commit_done(&p, done);
            if !more {
                break;
            }
        }
        Some(done)
    }

    /// The cleaner's turn at `t`: commits, then a batch if the watermarks (or `urgent`: a
    /// write waits for room) say so and none is in flight.
    pub(super) fn clean(&mut self, t: u64, urgent: bool) {
        if self.log.is_none() {
            return;
        }
        let idle = t.saturating_sub(self.last_request) >= IDLE;
        if self.log().batch.is_some() {
            // The server's cleaner looks at the room between batches only.
            return;
        }
        self.adjust_lending(t, urgent);
        let l = self.log();
        let (used, blocks, lap, tuning) = (l.st.w.used(), l.blocks, l.lap, l.tuning);
        if l.st.index.is_empty() {
            return;
        }
        // The server's rules (`log/clean.rs`, `log/tune.rs`): watermarks of the most the
        // log may hold.
        let urgent = urgent || l.waiting > 0 || tuning.past_high(lap, l.st.w.room());
        let background = used >= tuning.low_blocks(lap) || l.st.w.mirror_short() || idle;
        if !urgent && (!background || t < l.resume_at) {
            return;
        }
        let depth = if urgent {
            URGENT_WRITERS
        } else {
            SOURCE_WRITERS
        };
        let mut most = (depth * BATCH_PAGES).min((blocks / 4).max(1) as usize);
        if !urgent && tuning.rate > 0 {
            most = most.min((tuning.rate / PAGE_SIZE).max(1) as usize);
        }
        let (pages, alone) = l.st.pick(None, t, most, RETRIES);
        if pages.is_empty() {
            l.st.settle_tail();
            l.anchor();
            return;
        }
        let runs = l.st.runs(&pages, &alone);
        l.batch = Some(Batch {
            runs: runs.into_iter().collect(),
            in_flight: 0,
            versions: Vec::with_capacity(pages.len()),
        });
        self.wb.batches += 1;
        if !urgent && tuning.rate > 0 {
            let bytes = pages.len() as u64 * PAGE_SIZE;
            self.log().resume_at = t + bytes * 1_000_000_000 / tuning.rate;
        }
        // Each of `depth` writers takes the next run once its previous one is done.
        for _ in 0..depth {
            if !self.next_run(t) {
                break;
            }
        }
    }

    /// The cleaner's look at the room at `t`, between batches (the server's `log/lend.rs`,
    /// on the writer's rule, up to four chunks a look): a chunk is lent (its slots evicted
    /// from the read cache, the superblock's count written: one device write, the chunk
    /// usable at once) and writes may use it; the chunks no replay needs go back to the read
    /// cache. A chunk whose slots an operation pins waits for the next look.
    fn adjust_lending(&mut self, t: u64, waiting: bool) {
        let lend = self.log().st.w.region().lend;
        if lend.chunks == 0 {
            return;
        }
        for _ in 0..4 {
            let l = self.log();
            let step = l.st.w.lend_step(waiting || l.waiting > 0);
            match step {
                LendStep::Lend(c) => {
                    if c >= l.lent {
                        if !self.core.lend_slots(lend.slots_of_lent(c)).is_empty() {
                            // A slot an operation pins: the chunk waits for the next look,
                            // and what was taken of it goes back meanwhile.
                            self.core.give_back_slots(lend.slots_of_lent(c));
                            break;
                        }
                        self.ssd.io(t, PAGE_SIZE, true);
                        self.log().lent = c + 1;
                        self.wb.lends += 1;
                    }
                    self.log().st.w.set_usable(c + 1);
                    continue;
                }
                LendStep::Unuse => {
                    let u = l.st.w.usable();
                    l.st.w.set_usable(u.saturating_sub(1));
                }
                LendStep::Stay => {}
            }
            break;
        }
        let l = self.log();
        let (needed, lent) = (l.st.w.needed_lent(), l.lent);
        if needed < lent {
            l.lent = needed;
            self.ssd.io(t, PAGE_SIZE, true);
            for c in needed..lent {
                self.core.give_back_slots(lend.slots_of_lent(c));
            }
            self.wb.give_backs += lent - needed;
        }
    }

    /// Issues the batch's next run at `t` (its versions read from the log, then written to
    /// the source); false if none is left.
    fn next_run(&mut self, t: u64) -> bool {
        let Some(b) = self.log().batch.as_mut() else {
            return false;
        };
        let Some((g0, n)) = b.runs.pop_front() else {
            return false;
        };
        b.in_flight += 1;
        // The versions newest now (the server reads them when the run is written).
        let l = self.log();
        let found: Vec<(u64, u64)> = (g0..g0 + n)
            .filter_map(|g| l.st.index.get(&g).map(|d| (g, d.lpos)))
            .collect();
        if let Some(b) = l.batch.as_mut() {
            b.versions.extend(found);
        }
        let size = self.core.geometry().source_size();
        let off = g0 * PAGE_SIZE;
        let len = (n * PAGE_SIZE).min(size.saturating_sub(off));
        let read = self.ssd.io(t, len, false);
        self.res.cache_bytes_read += len;
        let done = self.clean_write(read, off, len);
        self.wb.source_writes += 1;
        self.res.bytes_written_back += len;
        self.push(done, Event::RunCleaned);
        true
    }

    /// A run of the batch is on the source at `t`: the next one goes; once the last is
    /// done (and the source flushed), the batch's versions leave the index (unless a newer
    /// version came meanwhile), and the tail and the anchor move.
    pub(super) fn run_cleaned(&mut self, t: u64) {
        if let Some(b) = self.log().batch.as_mut() {
            b.in_flight -= 1;
        }
        if self.next_run(t) {
            return;
        }
        let l = self.log();
        if l.batch.as_ref().is_some_and(|b| b.in_flight > 0) {
            return;
        }
        let Some(b) = l.batch.take() else { return };
        for (g, lpos) in b.versions {
            l.st.cleaned(g, lpos);
        }
        l.st.settle_tail();
        l.anchor();
    }

    /// The cleaner's commit duties at `t`: an autocommit once [`AUTOCOMMIT`] passed, and the
    /// seal after a lone commit that listed pages.
    pub(super) fn commit_duties(&mut self, t: u64) {
        let l = self.log();
        if t >= l.last_commit + AUTOCOMMIT {
            l.last_commit = t;
            self.log_commit(t);
        }
        let l = self.log();
        if l.st.unsealed.is_some_and(|u| t >= u + SEAL_AFTER) {
            l.st.w.request_seal();
            self.log_commit(t);
        }
    }

    /// One run's write at `t` through the write-through path: the source, and the cache's
    /// clean copy where the core caches it. Returns when the source has it.
    fn clean_write(&mut self, t: u64, off: u64, len: u64) -> u64 {
        let sdone = self.source.io(t, len, true);
        self.res.source_bytes_written += len;
        if let Ok(txns) = self
            .core
            .begin_write(SourceOffset(off), len, WriteKind::Data)
        {
            for txn in txns {
                let (source, copies) = txn.into_halves();
                self.push(sdone, Event::SourceDone(source));
                for copy in copies {
                    let l = copy.write().len;
                    let cdone = self.ssd.io(t, l, true);
                    self.res.cache_bytes_written += l;
                    self.push(cdone, Event::CacheDone(copy));
                }
            }
        }
        sdone
    }

    /// A write in write-back mode at `t`: returns when it is acknowledged.
    pub(super) fn write_back(&mut self, t: u64, off: u64, len: u64) -> u64 {
        let ps = PAGE_SIZE;
        let size = self.core.geometry().source_size();
        let (a, b) = (off / ps * ps, (off + len).div_ceil(ps) * ps);
        // Writes in flight on these pages first (the server's range lock).
        let l = self.log();
        let mut start = t;
        for g in a / ps..b / ps {
            start = start.max(l.appending.get(&g).copied().unwrap_or(0));
        }
        // Pages written in part are read first: from the log or the cache if either holds
        // them, else from the source (the server's merge).
        let edges = if b - ps > a { vec![a, b - ps] } else { vec![a] };
        let mut now = start;
        for edge in edges {
            let partial = (edge == a && a < off) || (edge + ps > off + len && edge >= off);
            if !partial {
                continue;
            }
            let held = self.log().holds(edge / ps) || self.core.is_cached(SourceOffset(edge));
            now = now.max(if held {
                self.ssd.io(start, ps, false)
            } else {
                self.res.source_bytes_read += ps;
                self.source.io(start, ps.min(size - edge), false)
            });
        }
        let mut ack = now;
        let chunk = CHUNK_PAGES.min(self.log().st.w.region().max_write());
        let mut g = a / ps;
        while g < b / ps {
            let n = chunk.min(b / ps - g);
            let Some(lpos) = self.allocate(&mut now, n) else {
                // Nothing will make room: the write is not logged (counted apart).
                self.wb.writes_given_up += 1;
                self.wlat.record(now - t);
                return now;
            };
            let done = self.ssd.io(now, n * ps, true);
            self.res.cache_bytes_written += n * ps;
            ack = ack.max(done);
            let l = self.log();
            for p in g..g + n {
                l.appending.insert(p, done);
            }
            self.push(done, Event::Appended(g, lpos, n));
            g += n;
        }
        self.wlat.record(ack - t);
        ack
    }

    /// An append's device write is done: its `n` pages from global page `g` (at log
    /// position `lpos`) are their newest versions, pending the next commit.
    pub(super) fn appended(&mut self, g: u64, lpos: u64, n: u64, t: u64) {
        let entries: Vec<LogEntry> = (0..n)
            .map(|i| LogEntry {
                lpos: lpos + i,
                volume: 0,
                page: g + i,
                crc: 0,
            })
            .collect();
        let l = self.log();
        l.st.appended(g, lpos, Some(&entries));
        for p in g..g + n {
            if l.appending.get(&p).is_some_and(|&d| d <= t) {
                l.appending.remove(&p);
            }
        }
    }

    /// `n` log positions at `*now` (in flight until their write is done), waiting for room
    /// (urgent cleaning, the events it brings) or committing first when the gap since the
    /// last commit is full. `None` if nothing can make room.
    fn allocate(&mut self, now: &mut u64, n: u64) -> Option<u64> {
        loop {
            match self.log().st.allocate(n) {
                Ok(lpos) => return Some(lpos),
                Err(Full::Commit) => match self.log_commit(*now) {
                    Some(t) => *now = t,
                    None => self.wait_for_room(now)?,
                },
                Err(Full::Ring) => self.wait_for_room(now)?,
                Err(Full::TooLarge) => return None,
            }
        }
    }

    /// A writer waits for room at `*now`: cleaning turns urgent, and time moves to the next
    /// completion. `None` if nothing is in flight that could make room.
    fn wait_for_room(&mut self, now: &mut u64) -> Option<()> {
        self.res.writeback_waits += 1;
        self.log().waiting += 1;
        let usable = self.log().st.w.usable();
        self.clean(*now, true);
        if self.log().st.w.usable() > usable {
            // A chunk was lent: the writer goes on at once (the server wakes it).
            self.log().waiting -= 1;
            return Some(());
        }
        let next = self.next_event_time();
        self.log().waiting -= 1;
        *now = (*now).max(next?);
        self.run_until(*now);
        Some(())
    }

    /// A read at `t` of `[off, off + len)` whose pages the log may hold: the log's pages
    /// from the device (hits), the rest as the core plans them. Returns when it is done.
    pub(super) fn read_through_log(&mut self, t: u64, off: u64, len: u64) -> u64 {
        let ps = PAGE_SIZE;
        let end = off + len;
        let mut done = t;
        let mut at = off;
        while at < end {
            let held = self.log().holds(at / ps);
            let mut stop = ((at / ps + 1) * ps).min(end);
            while stop < end && self.log().holds(stop / ps) == held {
                stop = ((stop / ps + 1) * ps).min(end);
            }
            done = done.max(if held {
                self.wb.log_read_pages += (stop - at).div_ceil(ps);
                self.ssd.io(t, stop - at, false)
            } else {
                self.read(t, at, stop - at)
            });
            at = stop;
        }
        done
    }
}
