//! The write-back log's state machine (`sce_store::wblog::LogState`, issue 45), the one the
//! engine serves and the simulator drives, against a simple model: random writes of 1-6
//! pages (overwriting the same pages), completions out of order, FLUSHes (group commits),
//! cleaning batches as the engine takes them (`pick`, `runs`; each run a step of its own
//! that writes the versions newest when it runs, as the engine's do under `source_order`,
//! so that writes complete, writes through supersede and crashes come between a batch's
//! runs and its `cleaned`; a source that refuses some pages for a while, their retries
//! after the backoff), writes through to the source that supersede the log's versions, new
//! anchors, the ring wrapping, and a crash at any step (a commit written but not flushed, or between steps: each unflushed
//! device write kept, dropped or torn), each followed by a replay and a state restored as
//! a start restores it.
//!
//! After every step: each page the state indexes reads, from the device at the indexed
//! position, as its newest completed write, and each page it does not index has that write
//! on the source; the counts per volume and per group agree with the index; the tail never
//! passes an indexed version or a write in flight; what cleaning picks is dirty, due,
//! sorted, oldest first and whole when it is less than asked for, and its runs cover it
//! exactly. After every crash: every page reads as its last write acknowledged before the
//! last completed FLUSH or a later one, never older, never torn.

#[allow(dead_code)]
#[path = "wblog/crash.rs"]
mod crash;
#[allow(dead_code)]
#[path = "wblog/model.rs"]
mod model;

use crash::CrashDev;
use model::{decode, image, KEY, VOL};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_io::BlockDevice;
use sce_store::wblog::{
    page_crc, replay, state::RUN_PAGES, Full, LogEntry, LogRegion, LogState, LogWriter, Stuck,
    LOG_BLOCK,
};
use std::collections::{BTreeSet, HashSet};

/// Stuck pages a batch retries (the engine's `RETRIES_PER_BATCH` is 32; fewer here, so
/// that the limit is met).
const RETRIES: usize = 3;

struct Crash;

struct Write {
    lpos: u64,
    first: u64,
    versions: Vec<u64>,
}

/// A cleaning batch under way: its runs not yet written, the versions written (page,
/// position) and the pages the source refused.
#[derive(Default)]
struct Batch {
    runs: Vec<(u64, u64)>,
    cleaned: Vec<(u64, u64)>,
    failed: Vec<u64>,
}

#[derive(Debug, Default)]
struct Totals {
    steps: u64,
    crashes: u64,
    /// Versions a batch's `cleaned` found superseded or replaced by a newer version
    /// written while the batch ran.
    overtaken: u64,
    commits: u64,
    cleaned: u64,
    refused: u64,
    retried: u64,
    through: u64,
    from_log: u64,
    laps: u64,
}

struct M {
    rng: SmallRng,
    region: LogRegion,
    dev: CrashDev,
    st: LogState<u64>,
    /// Virtual nanoseconds.
    now: u64,
    pages: u64,
    max_write: u64,
    version: u64,
    /// The model: the source's version of each page (durable at once), the newest
    /// completed write, the version a page may not read older than after a crash, and the
    /// versions it may read as.
    source: Vec<u64>,
    acked: Vec<u64>,
    floor: Vec<u64>,
    written: Vec<BTreeSet<u64>>,
    busy: Vec<bool>,
    inflight: Vec<Write>,
    /// Pages the source refuses to write, for now.
    bad: BTreeSet<u64>,
    batch: Option<Batch>,
    t: Totals,
}

impl M {
    fn new(seed: u64, blocks: u64, mirror: u64, pages: u64) -> M {
        const GUARD: u64 = 2;
        let region = LogRegion {
            offset: GUARD * LOG_BLOCK,
            blocks,
            mirror_offset: if mirror > 0 {
                (2 * GUARD + blocks) * LOG_BLOCK
            } else {
                0
            },
            mirror_blocks: mirror,
            ..Default::default()
        };
        let n = pages as usize;
        M {
            rng: SmallRng::seed_from_u64(seed),
            region,
            dev: CrashDev::new((blocks + mirror + 3 * GUARD) * LOG_BLOCK),
            st: LogState::new(LogWriter::new(region, KEY, 0, 1).unwrap(), vec![0]),
            now: 0,
            pages,
            max_write: 6,
            version: 0,
            source: vec![0; n],
            acked: vec![0; n],
            floor: vec![0; n],
            written: vec![BTreeSet::from([0]); n],
            busy: vec![false; n],
            inflight: Vec::new(),
            bad: BTreeSet::new(),
            batch: None,
            t: Totals::default(),
        }
    }

    fn run(&mut self, steps: u64) {
        for _ in 0..steps {
            self.t.steps += 1;
            let crashed = self.step().is_err() || self.rng.gen_ratio(1, 150);
            if crashed {
                self.crash_and_check();
            }
            self.check();
        }
    }

    fn step(&mut self) -> Result<(), Crash> {
        match self.rng.gen_range(0..100) {
            0..30 => self.write(),
            30..55 => {
                self.complete_one();
                Ok(())
            }
            55..67 => self.flush(),
            67..82 => {
                self.clean();
                Ok(())
            }
            82..86 => self.through_write(),
            86..91 => {
                self.anchor();
                Ok(())
            }
            91..95 => {
                let p = self.rng.gen_range(0..self.pages);
                if !self.bad.remove(&p) {
                    self.bad.insert(p);
                }
                Ok(())
            }
            _ => {
                self.now += self.rng.gen_range(0..200_000_000);
                Ok(())
            }
        }
    }

    fn write(&mut self) -> Result<(), Crash> {
        let n = self.rng.gen_range(1..=self.max_write);
        let first = self.rng.gen_range(0..=self.pages - n);
        if (first..first + n).any(|p| self.busy[p as usize]) {
            return Ok(());
        }
        let lpos = match self.st.allocate(n) {
            Ok(l) => l,
            Err(Full::Commit) => return self.flush(),
            Err(Full::Ring) => {
                self.make_room();
                return Ok(());
            }
            Err(Full::TooLarge) => panic!("{n} pages refused as too large"),
        };
        let mut buf = Vec::with_capacity((n * LOG_BLOCK) as usize);
        let mut versions = Vec::new();
        for p in first..first + n {
            self.version += 1;
            buf.extend_from_slice(&image(VOL, p, self.version));
            versions.push(self.version);
            self.busy[p as usize] = true;
            self.written[p as usize].insert(self.version);
        }
        let blocks = self.region.blocks;
        assert!(
            lpos % blocks + n <= blocks,
            "a write crosses the ring's end"
        );
        self.t.laps = self.t.laps.max(lpos / blocks);
        self.dev
            .write_at(self.region.offset_of(lpos), &buf)
            .unwrap();
        self.inflight.push(Write {
            lpos,
            first,
            versions,
        });
        Ok(())
    }

    fn complete_one(&mut self) {
        if self.inflight.is_empty() {
            return;
        }
        let i = self.rng.gen_range(0..self.inflight.len());
        let wr = self.inflight.swap_remove(i);
        let entries: Vec<LogEntry> = (wr.versions.iter().enumerate())
            .map(|(k, &v)| {
                let page = wr.first + k as u64;
                self.acked[page as usize] = v;
                self.busy[page as usize] = false;
                LogEntry {
                    lpos: wr.lpos + k as u64,
                    volume: VOL,
                    page,
                    crc: page_crc(&image(VOL, page, v)),
                }
            })
            .collect();
        self.st.appended(wr.first, wr.lpos, Some(&entries));
    }

    /// FLUSH: commits until nothing waits; pages acknowledged before it may no longer read
    /// older once it completes. May crash with a commit written and not flushed.
    fn flush(&mut self) -> Result<(), Crash> {
        let snapshot = self.acked.clone();
        loop {
            let p = match self.st.w.prepare_commit() {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(Full::Ring) => {
                    self.make_room();
                    continue;
                }
                Err(e) => panic!("a commit refused: {e:?}"),
            };
            self.dev
                .write_at(self.region.offset_of(p.lpos), &p.bytes)
                .unwrap();
            if let Some(m) = p.mirror_at {
                self.dev.write_at(m, &p.bytes).unwrap();
            }
            if self.rng.gen_ratio(1, 10) {
                return Err(Crash);
            }
            self.dev.flush().unwrap();
            self.t.commits += 1;
            self.st.commit_done(&p, self.now);
        }
        for (f, s) in self.floor.iter_mut().zip(snapshot) {
            *f = (*f).max(s);
        }
        Ok(())
    }

    /// The cleaner's next step, as the engine's batch takes them: a new batch (what `pick`
    /// takes, cut into `runs`), one run written (each page's version newest now, read from
    /// the device and written to the source unless the source refuses the page), or, once
    /// every run is written, the batch's end (the source flushed: the versions written
    /// leave the index unless overtaken, the refused pages stuck with their backoff, the
    /// tail and the anchor moved).
    fn clean(&mut self) {
        let Some(b) = self.batch.as_mut() else {
            return self.start_batch();
        };
        let Some((g0, n)) = b.runs.pop() else {
            return self.end_batch();
        };
        for g in g0..g0 + n {
            let Some(d) = self.st.index.get(&g).copied() else {
                continue;
            };
            let v = self.read_version(g, d.lpos);
            assert_eq!(
                v, self.acked[g as usize],
                "page {g}: the cleaner takes its newest"
            );
            let b = self.batch.as_mut().expect("a batch");
            if self.bad.contains(&g) {
                b.failed.push(g);
            } else {
                b.cleaned.push((g, d.lpos));
                self.source[g as usize] = v;
            }
        }
    }

    fn start_batch(&mut self) {
        let max = self.rng.gen_range(1..=24);
        let (pages, alone) = self.st.pick(None, self.now, max, RETRIES);
        self.check_pick(&pages, &alone, max);
        let runs = self.st.runs(&pages, &alone);
        let covered: Vec<u64> = runs.iter().flat_map(|&(g, n)| g..g + n).collect();
        assert_eq!(covered, pages, "the runs cover the pages picked, in order");
        assert!(runs.iter().all(|&(_, n)| (1..=RUN_PAGES).contains(&n)));
        assert!(
            (runs.iter()).all(|&(g, n)| n == 1 || !(g..g + n).any(|p| alone.contains(&p))),
            "a retry is written alone"
        );
        self.t.retried += alone.len() as u64;
        let mut runs = runs;
        runs.reverse();
        self.batch = Some(Batch {
            runs,
            ..Batch::default()
        });
    }

    fn end_batch(&mut self) {
        let b = self.batch.take().expect("a batch");
        for (g, lpos) in b.cleaned {
            let newest = self.st.index.get(&g).is_some_and(|d| d.lpos == lpos);
            self.t.overtaken += u64::from(!newest);
            self.st.cleaned(g, lpos);
            self.t.cleaned += 1;
        }
        let now = self.now;
        for g in b.failed {
            self.t.refused += 1;
            self.st.clean_failed(g, now, |tries| {
                now + Stuck::<u64>::backoff(tries).as_nanos() as u64
            });
        }
        self.st.settle_tail();
        self.anchor();
    }

    /// The version at `lpos` on the device, which must be page `g`'s, whole.
    fn read_version(&self, g: u64, lpos: u64) -> u64 {
        let mut b = vec![0u8; LOG_BLOCK as usize];
        self.dev
            .read_at(self.region.offset_of(lpos), &mut b)
            .unwrap();
        let Some((vol, page, v)) = decode(&b) else {
            panic!("page {g} (log position {lpos}) reads as a torn mix")
        };
        assert_eq!((vol, page), (VOL, g), "the index points at another page");
        v
    }

    /// A write through to the source over a page the log may hold (a drain's, a
    /// discard's): durable on the source, then superseded by a cleaned entry, acknowledged
    /// once that is committed.
    fn through_write(&mut self) -> Result<(), Crash> {
        let p = self.rng.gen_range(0..self.pages);
        if self.busy[p as usize] {
            return Ok(());
        }
        self.version += 1;
        let v = self.version;
        self.source[p as usize] = v;
        self.written[p as usize].insert(v);
        self.st.supersede_range(p, p + 1, true, |g| (VOL, g));
        self.t.through += 1;
        self.flush()?;
        self.acked[p as usize] = v;
        Ok(())
    }

    /// The newest anchor the writer allows, durable at once (the superblock).
    fn anchor(&mut self) {
        if let Some(a) = self.st.anchor_due() {
            self.st.anchored(a);
        }
    }

    /// The ring is full: every write completes, the batch under way ends, the source heals,
    /// time passes beyond any backoff, and cleaning runs until nothing is dirty.
    fn make_room(&mut self) {
        while !self.inflight.is_empty() {
            self.complete_one();
        }
        while self.batch.is_some() {
            self.clean();
        }
        self.bad.clear();
        self.now += 60_000_000_000;
        while !self.st.index.is_empty() {
            self.clean();
        }
        self.st.settle_tail();
        self.anchor();
    }

    fn check_pick(&self, pages: &[u64], alone: &HashSet<u64>, max: usize) {
        let st = &self.st;
        assert!(pages.len() <= max, "more picked than asked for");
        assert!(pages.windows(2).all(|w| w[0] < w[1]), "sorted, once each");
        for g in pages {
            assert!(st.index.contains_key(g), "page {g} picked, not dirty");
            let due = st.stuck.get(g).is_none_or(|s| s.retry_at <= self.now);
            assert!(due, "page {g} picked before its retry");
            assert_eq!(st.stuck.contains_key(g), alone.contains(g));
        }
        assert!(alone.len() <= RETRIES);
        let due = |g: &u64| st.stuck.get(g).is_none_or(|s| s.retry_at <= self.now);
        if let Some((_, &g)) = st.live.iter().next().filter(|(_, g)| due(g)) {
            assert!(
                pages.contains(&g) || max == 0,
                "the oldest version's page {g} not picked: {pages:?}"
            );
        }
        if pages.len() < max && alone.len() < RETRIES {
            for g in st.index.keys().filter(|g| due(g)) {
                assert!(pages.contains(g), "page {g} left out of a batch with room");
            }
        }
    }

    /// The state against the model (see the module's doc).
    fn check(&self) {
        let st = &self.st;
        let n = st.index.len() as u64;
        assert_eq!(st.vol_dirty.iter().sum::<u64>(), n, "dirty per volume");
        assert_eq!(
            st.groups.values().map(|&k| k as u64).sum::<u64>(),
            n,
            "dirty per group"
        );
        let tail = st.w.tail();
        for p in 0..self.pages {
            let i = p as usize;
            match st.index.get(&p) {
                Some(d) => {
                    assert!(
                        d.lpos >= tail,
                        "page {p}'s version {} behind the tail",
                        d.lpos
                    );
                    assert_eq!(st.live.get(&d.lpos), Some(&p), "page {p} not live");
                    let v = self.read_version(p, d.lpos);
                    assert_eq!(v, self.acked[i], "page {p}: the index is not its newest");
                    assert_eq!(d.crc, page_crc(&image(VOL, p, v)));
                }
                None => assert_eq!(
                    self.source[i], self.acked[i],
                    "page {p} not dirty, yet the source lacks its newest write"
                ),
            }
        }
        for w in &self.inflight {
            assert!(w.lpos >= tail, "a write in flight behind the tail");
        }
    }

    fn crash_and_check(&mut self) {
        self.dev.crash(&mut self.rng);
        self.t.crashes += 1;
        self.dev = self.dev.restart();
        let durable_seq = self.st.w.next_seq() - 1;
        let r = replay(&self.dev, self.region, &KEY, self.st.w.anchor()).unwrap();
        assert!(r.lost.is_empty(), "no damage, yet lost pages: {:?}", r.lost);
        assert!(r.broken.is_none(), "no damage, yet a break: {:?}", r.broken);
        assert!(
            r.last_seq >= durable_seq,
            "replay ended before the durable commit"
        );
        let mut versions = Vec::new();
        for p in 0..self.pages {
            let i = p as usize;
            let v = match r.index.get(VOL, p) {
                Some(lp) => {
                    versions.push((lp.lpos, p, lp.crc));
                    self.t.from_log += 1;
                    self.read_version(p, lp.lpos)
                }
                None => self.source[i],
            };
            assert!(
                v >= self.floor[i],
                "page {p} reads version {v}, older than {} (flushed)",
                self.floor[i]
            );
            assert!(
                self.written[i].contains(&v),
                "page {p} reads {v}, never written"
            );
            (self.floor[i], self.acked[i]) = (v, v);
            self.written[i] = BTreeSet::from([v]);
            self.busy[i] = false;
            // What the source holds stays; the log's version is the newest now.
        }
        self.inflight.clear();
        self.batch = None;
        self.st = LogState::new(LogWriter::resume(self.region, KEY, &r), vec![0]);
        self.st.restore(Vec::new(), versions);
    }
}

fn run(seed: u64, blocks: u64, mirror: u64, pages: u64, steps: u64) -> Totals {
    let mut m = M::new(seed, blocks, mirror, pages);
    m.run(steps);
    println!(
        "seed {seed}, ring {blocks}, mirror {mirror}, pages {pages}: {:?}",
        m.t
    );
    m.t
}

#[test]
fn the_log_state_keeps_to_the_model_through_cleaning_and_crashes() {
    let mut all = Totals::default();
    for seed in 0..12 {
        let (blocks, mirror) = if seed % 2 == 0 { (128, 0) } else { (192, 12) };
        let t = run(seed, blocks, mirror, 48, 3000);
        all.crashes += t.crashes;
        all.cleaned += t.cleaned;
        all.refused += t.refused;
        all.retried += t.retried;
        all.through += t.through;
        all.from_log += t.from_log;
        all.laps += t.laps;
        all.commits += t.commits;
        all.overtaken += t.overtaken;
    }
    println!("all: {all:?}");
    // The runs did what they are for: many crashes, cleaning, refusals and their retries,
    // writes through, pages found in the log after a crash, the ring wrapped many times.
    assert!(all.crashes >= 100, "{all:?}");
    assert!(
        all.cleaned >= 1000 && all.refused >= 20 && all.retried >= 10,
        "{all:?}"
    );
    assert!(all.through >= 100 && all.from_log >= 1000, "{all:?}");
    assert!(all.laps >= 100 && all.commits >= 1000, "{all:?}");
    assert!(all.overtaken >= 50, "{all:?}");
}
