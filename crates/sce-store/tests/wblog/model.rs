//! The crash model of the write-back log (issue 29): random writes of 1-8 pages to a small
//! volume (overwriting the same pages), FLUSHes (commits), a cleaner that moves the tail,
//! new anchors, the ring wrapping, then a crash that keeps, drops or tears each unflushed
//! write, replay, and a check of every page: its last write acknowledged before the last
//! completed FLUSH, or a later one (acknowledged or in flight); never older, never a torn
//! mix. A page the log no longer holds reads from the model source, under the same rule.
//! With a mirror area, second copies of records go there (another device write); writes
//! that go through to the source (a drain's, a discard's) supersede the log's versions with
//! cleaned entries, acknowledged once their commit is durable.

use super::crash::CrashDev;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_io::BlockDevice;
use sce_store::wblog::{
    page_crc, replay_lent, Anchor, Full, Lend, LogEntry, LogRegion, LogWriter, LOG_BLOCK,
};
use std::collections::BTreeSet;

/// The volume id the model writes.
pub const VOL: u32 = 3;
/// The caller's key.
pub const KEY: [u8; 16] = *b"sce-wblog-test-k";
/// Blocks before and after the region, which must stay untouched.
const GUARD: u64 = 2;

/// The 4 KiB image of `version` of `page`: every 512-byte sector names (volume, page,
/// version, sector) and is filled from them, so a torn mix of two versions is seen.
pub fn image(vol: u32, page: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; LOG_BLOCK as usize];
    for (s, sec) in b.chunks_mut(512).enumerate() {
        sec[0..4].copy_from_slice(&vol.to_le_bytes());
        sec[4..12].copy_from_slice(&page.to_le_bytes());
        sec[12..20].copy_from_slice(&version.to_le_bytes());
        sec[20] = s as u8;
        let mut x = version.wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ page.rotate_left(17)
            ^ ((vol as u64) << 40)
            ^ ((s as u64) << 56)
            | 1;
        for c in sec[24..].chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = c.len();
            c.copy_from_slice(&x.to_le_bytes()[..n]);
        }
    }
    b
}

/// The (volume, page, version) of a whole page image; None for anything else (a torn mix).
pub fn decode(b: &[u8]) -> Option<(u32, u64, u64)> {
    let vol = u32::from_le_bytes(b[0..4].try_into().unwrap());
    let page = u64::from_le_bytes(b[4..12].try_into().unwrap());
    let version = u64::from_le_bytes(b[12..20].try_into().unwrap());
    (image(vol, page, version) == b).then_some((vol, page, version))
}

/// One run's shape.
#[derive(Default)]
pub struct Config {
    pub blocks: u64,
    pub pages: u64,
    pub max_write: u64,
    pub crashes: u64,
    pub max_steps: u64,
    /// Percent of steps that FLUSH.
    pub flush_pct: u32,
    pub seed: u64,
    /// Blocks of the mirror area (0: none, records keep both copies in the ring).
    pub mirror: u64,
    /// Chunks of read slots the ring may lend (format 9; 0: none), of `chunk_blocks` each.
    pub lend_chunks: u64,
    pub chunk_blocks: u64,
}

/// Slots per band of the model's slot area (a chunk takes the last few), 4 blocks each.
const BAND_SLOTS: u64 = 6;
const SLOT_BLOCKS: u64 = 4;

/// What the runs did and found.
#[derive(Debug, Default)]
pub struct Totals {
    pub crashes: u64,
    pub pages_checked: u64,
    pub from_log: u64,
    pub from_source: u64,
    pub newer: u64,
    pub data_writes: u64,
    pub commits: u64,
    pub multi_record_commits: u64,
    pub refused_commit: u64,
    pub refused_ring: u64,
    pub writes_kept: u64,
    pub writes_dropped: u64,
    pub writes_torn: u64,
    pub replayed_commits: u64,
    pub replayed_skipped: u64,
    pub laps: u64,
    pub through_writes: u64,
    pub commits_beside: u64,
    pub lends: u64,
    pub give_backs: u64,
    pub most_lent: u64,
    pub scribbled: u64,
}

/// The test chose to crash here.
struct Crash;

struct Write {
    lpos: u64,
    first: u64,
    versions: Vec<u64>,
}

pub struct Model {
    cfg: Config,
    rng: SmallRng,
    region: LogRegion,
    dev: CrashDev,
    w: LogWriter,
    version: u64,
    /// The model source: a version per page (0: what it held at the start).
    source: Vec<u64>,
    /// Versions a page may read as: written since its last recovery, and that one.
    written: Vec<BTreeSet<u64>>,
    /// The version a page may not read older than.
    floor: Vec<u64>,
    /// The newest completed version.
    acked: Vec<u64>,
    /// The newest completed version's position, while the log holds it.
    live: Vec<Option<u64>>,
    /// The lowest position of a version of the page not yet cleaned to the source.
    unclean: Vec<Option<u64>>,
    busy: Vec<bool>,
    inflight: Vec<Write>,
    issued: usize,
    /// Chunks lent as the superblock records them (durable at once in this model).
    sb_lent: u64,
    pub t: Totals,
}

impl Model {
    pub fn new(cfg: Config) -> Model {
        let mirror_at = (2 * GUARD + cfg.blocks) * LOG_BLOCK;
        let area_at = (3 * GUARD + cfg.blocks + cfg.mirror) * LOG_BLOCK;
        let area_slots = cfg.lend_chunks * BAND_SLOTS;
        let region = LogRegion {
            offset: GUARD * LOG_BLOCK,
            blocks: cfg.blocks,
            mirror_offset: if cfg.mirror > 0 { mirror_at } else { 0 },
            mirror_blocks: cfg.mirror,
            lend: Lend {
                chunks: cfg.lend_chunks,
                chunk_blocks: cfg.chunk_blocks,
                area_offset: area_at,
                area_slots,
                slot_bytes: SLOT_BLOCKS * LOG_BLOCK,
            },
        };
        region.check().unwrap();
        let n = cfg.pages as usize;
        let size = area_at + (area_slots * SLOT_BLOCKS + GUARD) * LOG_BLOCK;
        Model {
            rng: SmallRng::seed_from_u64(cfg.seed),
            region,
            dev: CrashDev::new(size),
            w: LogWriter::new(region, KEY, 0, 1).unwrap(),
            version: 0,
            source: vec![0; n],
            written: vec![BTreeSet::from([0]); n],
            floor: vec![0; n],
            acked: vec![0; n],
            live: vec![None; n],
            unclean: vec![None; n],
            busy: vec![false; n],
            inflight: Vec::new(),
            issued: 0,
            sb_lent: 0,
            t: Totals::default(),
            cfg,
        }
    }

    pub fn run(&mut self) {
        for _ in 0..self.cfg.crashes {
            let steps = self.rng.gen_range(1..=self.cfg.max_steps);
            for _ in 0..steps {
                if self.step().is_err() {
                    break;
                }
            }
            self.crash_and_check();
        }
    }

    fn step(&mut self) -> Result<(), Crash> {
        if self.cfg.lend_chunks > 0 && self.rng.gen_ratio(1, 6) {
            self.lending();
            return Ok(());
        }
        let f = self.cfg.flush_pct;
        match self.rng.gen_range(0..100) {
            x if x < f => self.flush(),
            x if x < f + 45 => self.start_write(),
            x if x < f + 80 => {
                self.complete_one();
                Ok(())
            }
            // Over lent chunks the cleaner lags more, so that the log holds more than its
            // own region and the anchor falls a lap behind the head.
            x if x < f + 87 - 4 * (self.cfg.lend_chunks > 0) as u32 => {
                let to = self.w.tail() + self.rng.gen_range(0..=self.cfg.blocks / 3);
                self.clean(to);
                Ok(())
            }
            x if x < f + 87 => Ok(()),
            x if x < f + 90 => self.through_write(),
            _ => {
                self.anchor();
                Ok(())
            }
        }
    }

    fn write_dev(&mut self, lpos: u64, bytes: &[u8]) {
        let blocks = bytes.len() as u64 / LOG_BLOCK;
        assert!(
            lpos + blocks <= self.region.segment_end(lpos),
            "a write crosses the ring's end or a chunk's"
        );
        assert!(
            self.region.is_read(lpos, self.sb_lent),
            "a write at {lpos} in a chunk not recorded lent ({} lent)",
            self.sb_lent
        );
        self.dev
            .write_at(self.region.offset_of(lpos), bytes)
            .unwrap();
        self.issued += 1;
        self.t.laps = self.t.laps.max(lpos / self.region.lap());
    }

    /// What the engine does with chunks of read slots: lends one more (recorded durably
    /// before a lap uses it), stops using one (laps started from now on skip it), or gives
    /// back those no lap a replay reads uses, which the read cache then fills with its own
    /// data: here old images of the log's own pages, the most confusing bytes there are.
    fn lending(&mut self) {
        let u = self.w.usable();
        match self.rng.gen_range(0..10) {
            0..3 if u < self.cfg.lend_chunks => {
                self.sb_lent = self.sb_lent.max(u + 1);
                self.w.set_usable(u + 1);
                self.t.lends += 1;
                self.t.most_lent = self.t.most_lent.max(u + 1);
            }
            3..7 if u > 0 => {
                self.w.set_usable(u - 1);
                self.give_back();
            }
            _ => self.give_back(),
        }
    }

    fn give_back(&mut self) {
        let needed = self.w.needed_lent();
        if needed >= self.sb_lent {
            return;
        }
        self.sb_lent = needed;
        self.t.give_backs += 1;
        let lend = self.region.lend;
        for c in needed..lend.chunks {
            for slot in lend.slots_of_lent(c) {
                for b in 0..SLOT_BLOCKS {
                    let page = self.rng.gen_range(0..self.cfg.pages);
                    let v = self.rng.gen_range(0..=self.version);
                    let at = lend.area_offset + (slot * SLOT_BLOCKS + b) * LOG_BLOCK;
                    self.dev.write_at(at, &image(VOL, page, v)).unwrap();
                    self.issued += 1;
                    self.t.scribbled += 1;
                }
            }
        }
    }

    fn start_write(&mut self) -> Result<(), Crash> {
        let n = self.rng.gen_range(1..=self.cfg.max_write);
        let first = self.rng.gen_range(0..=self.cfg.pages - n);
        if (first..first + n).any(|p| self.busy[p as usize]) {
            return Ok(());
        }
        let lpos = match self.w.allocate(n) {
            Ok(l) => l,
            Err(Full::Commit) => {
                self.t.refused_commit += 1;
                return self.flush();
            }
            Err(Full::Ring) => {
                self.t.refused_ring += 1;
                self.drain();
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
        self.write_dev(lpos, &buf);
        self.t.data_writes += 1;
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
        let mut entries = Vec::new();
        for (k, &v) in wr.versions.iter().enumerate() {
            let (page, lpos) = (wr.first + k as u64, wr.lpos + k as u64);
            let p = page as usize;
            entries.push(LogEntry {
                lpos,
                volume: VOL,
                page,
                crc: page_crc(&image(VOL, page, v)),
            });
            self.acked[p] = v;
            self.live[p] = Some(lpos);
            self.unclean[p].get_or_insert(lpos);
            self.busy[p] = false;
        }
        self.w.completed(&entries);
    }

    /// FLUSH: commits every completed write; the pages acknowledged before it may no
    /// longer read older once it completes. May crash with a commit written, not flushed.
    fn flush(&mut self) -> Result<(), Crash> {
        let snapshot = self.acked.clone();
        loop {
            let p = match self.w.prepare_commit() {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(Full::Ring) => {
                    self.t.refused_ring += 1;
                    self.drain();
                    continue;
                }
                Err(e) => panic!("a commit refused: {e:?}"),
            };
            self.write_dev(p.lpos, &p.bytes);
            if let Some(m) = p.mirror_at {
                self.dev.write_at(m, &p.bytes).unwrap();
                self.issued += 1;
            }
            self.t.commits += 1;
            self.t.multi_record_commits += (p.seqs.end - p.seqs.start > 1) as u64;
            if self.rng.gen_ratio(1, 6) {
                return Err(Crash);
            }
            self.dev.flush().unwrap();
            self.w.committed(&p);
        }
        for (f, s) in self.floor.iter_mut().zip(snapshot) {
            *f = (*f).max(s);
        }
        Ok(())
    }

    /// A write that goes through to the source while the log holds a version of its page
    /// (a drain's): the source has it (durable at once in this model), a cleaned entry
    /// supersedes the log's versions, and it is acknowledged once that is committed. May
    /// crash before: the page then reads as its log version or the new one.
    fn through_write(&mut self) -> Result<(), Crash> {
        let p = self.rng.gen_range(0..self.cfg.pages);
        let i = p as usize;
        if self.busy[i] {
            return Ok(());
        }
        self.version += 1;
        let v = self.version;
        self.source[i] = v;
        self.written[i].insert(v);
        self.acked[i] = v;
        // Its live version holds the tail until the cleaned entry is durable.
        let holds = self.live[i].is_some();
        self.w.supersede(VOL, p, holds);
        self.t.through_writes += 1;
        self.flush()?;
        // Superseded durably: the log's versions of it no longer hold the tail.
        self.live[i] = None;
        self.unclean[i] = None;
        Ok(())
    }

    /// The cleaner: every page with a version below `to` has its newest completed version
    /// written to the source (durable at once), then the tail moves to `to` (never past a
    /// write in flight).
    fn clean(&mut self, to: u64) {
        let inflight = self.inflight.iter().map(|w| w.lpos).min();
        let to = to
            .min(self.w.head())
            .min(inflight.unwrap_or(u64::MAX))
            .max(self.w.tail());
        for p in 0..self.cfg.pages as usize {
            if self.unclean[p].is_some_and(|u| u < to) {
                self.source[p] = self.acked[p];
                self.live[p] = self.live[p].filter(|&l| l >= to);
                self.unclean[p] = self.live[p];
            }
        }
        self.w.set_tail(to);
    }

    /// Makes the newest possible anchor durable (the superblock, outside the crash device).
    fn anchor(&mut self) {
        let a = self.w.anchor_candidate();
        if a != self.w.anchor() {
            self.w.set_anchor(a);
        }
    }

    /// The ring is full: complete every write, clean everything, move the anchor.
    fn drain(&mut self) {
        while !self.inflight.is_empty() {
            self.complete_one();
        }
        self.clean(u64::MAX);
        self.anchor();
    }

    fn crash_and_check(&mut self) {
        let c = self.dev.crash(&mut self.rng);
        assert!(self.dev.write_at(self.region.offset, &[0; 4096]).is_err());
        assert!(self.dev.flush().is_err());
        self.t.crashes += 1;
        self.t.writes_kept += c.kept;
        self.t.writes_dropped += c.dropped;
        self.t.writes_torn += c.torn;
        self.check_writes();
        self.dev = self.dev.restart();
        // Every other crash, the anchor as format 6's superblock keeps it: a position and a
        // seq, replayed as an empty log's anchor whatever it named.
        let a = self.w.anchor();
        let anchor = if self.t.crashes.is_multiple_of(2) {
            Anchor::Empty {
                lpos: a.lpos(),
                next_seq: a.seq(),
            }
        } else {
            a
        };
        let durable_seq = self.w.next_seq() - 1;
        let r = replay_lent(&self.dev, self.region, &KEY, anchor, self.sb_lent).unwrap();
        assert!(r.lost.is_empty(), "no damage, yet lost pages: {:?}", r.lost);
        assert!(
            r.last_seq >= durable_seq,
            "replay ended at seq {} before the durable {durable_seq}",
            r.last_seq
        );
        self.t.replayed_commits += r.commits;
        self.t.replayed_skipped += r.skipped;
        let mut from_log = 0;
        for p in 0..self.cfg.pages {
            let (v, live) = match r.index.get(VOL, p) {
                Some(lp) => {
                    let mut b = vec![0u8; LOG_BLOCK as usize];
                    self.dev
                        .read_at(self.region.offset_of(lp.lpos), &mut b)
                        .unwrap();
                    let Some((vol, page, v)) = decode(&b) else {
                        panic!("page {p} (log position {}) reads as a torn mix", lp.lpos)
                    };
                    assert_eq!((vol, page), (VOL, p), "the index points at another page");
                    from_log += 1;
                    (v, Some(lp.lpos))
                }
                None => (self.source[p as usize], None),
            };
            self.check_page(p as usize, v, live.is_some());
            let i = p as usize;
            (self.floor[i], self.acked[i], self.live[i]) = (v, v, live);
            self.written[i] = BTreeSet::from([v]);
            self.unclean[i] = live;
            self.busy[i] = false;
        }
        assert_eq!(
            r.index.len(),
            from_log as usize,
            "pages of no write indexed"
        );
        assert!(r.broken.is_none(), "no damage, yet a break: {:?}", r.broken);
        self.inflight.clear();
        self.t.commits_beside += self.w.commits_beside();
        self.w = LogWriter::resume(self.region, KEY, &r);
    }

    fn check_page(&mut self, p: usize, v: u64, from_log: bool) {
        let floor = self.floor[p];
        let whence = if from_log { "the log" } else { "the source" };
        assert!(
            v >= floor,
            "page {p} reads version {v} from {whence}, older than {floor} (flushed)"
        );
        assert!(
            self.written[p].contains(&v),
            "page {p} reads version {v} from {whence}, which nobody wrote since its last recovery"
        );
        self.t.pages_checked += 1;
        self.t.newer += (v > floor) as u64;
        if from_log {
            self.t.from_log += 1;
        } else {
            self.t.from_source += 1;
        }
    }

    /// Every data write and every commit was one device write, inside the region; the
    /// guard blocks around it were never written.
    fn check_writes(&mut self) {
        let w = self.dev.writes();
        assert_eq!(w.len(), self.issued, "device writes against writes issued");
        let (lo, hi) = (
            self.region.offset,
            self.region.offset + self.cfg.blocks * LOG_BLOCK,
        );
        let (mlo, mhi) = (
            self.region.mirror_offset,
            self.region.mirror_offset + self.cfg.mirror * LOG_BLOCK,
        );
        let lend = self.region.lend;
        let (alo, ahi) = (
            lend.area_offset,
            lend.area_offset + lend.area_slots * lend.slot_bytes,
        );
        for &(off, len) in &w {
            assert!(
                (off >= lo && off + len <= hi)
                    || (off >= mlo && off + len <= mhi)
                    || (off >= alo && off + len <= ahi),
                "a write at {off}+{len} leaves the region"
            );
        }
        self.issued = 0;
    }
}
