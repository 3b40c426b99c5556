//! The write-back log's storage layer (issue 29, `sce_store::wblog`): its crash model, its
//! records' defences, and one device write per data write and per commit.

#[path = "wblog/crash.rs"]
mod crash;
#[path = "wblog/model.rs"]
mod model;

use crash::CrashDev;
use model::{image, Config, Model, KEY, VOL};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_io::{BlockDevice, MemDevice};
use sce_store::wblog::{
    encode_record, page_crc, record_link, replay, Anchor, Full, LogEntry, LogRegion, LogWriter,
    PreparedCommit, RecordHeader, Replayed, ENTRIES_PER_RECORD, LOG_BLOCK,
};

const FRESH: Anchor = Anchor::Empty {
    lpos: 0,
    next_seq: 1,
};

/// A log on a crash device, driven the way the engine will drive it.
struct Log {
    dev: CrashDev,
    region: LogRegion,
    w: LogWriter,
}

impl Log {
    /// A ring of `blocks` blocks without a mirror area (format 7's layout).
    fn new(blocks: u64) -> Log {
        Self::in_region(LogRegion::ring(0, blocks))
    }
    /// A ring of `blocks` blocks and a mirror area of `mirror` blocks after it.
    fn with_mirror(blocks: u64, mirror: u64) -> Log {
        Self::in_region(LogRegion::laid_out(0, blocks + mirror))
    }
    fn in_region(region: LogRegion) -> Log {
        let end = (region.offset + region.blocks * LOG_BLOCK)
            .max(region.mirror_offset + region.mirror_blocks * LOG_BLOCK);
        Log {
            dev: CrashDev::new(end),
            region,
            w: LogWriter::new(region, KEY, 0, 1).unwrap(),
        }
    }
    /// Writes `bytes` (whole pages) as one data write, completed as `pages` of `VOL`.
    fn write_raw(&mut self, pages: &[u64], bytes: &[u8]) -> u64 {
        self.try_write_raw(pages, bytes).unwrap()
    }
    /// [`Self::write_raw`], or what the writer refused.
    fn try_write_raw(&mut self, pages: &[u64], bytes: &[u8]) -> Result<u64, Full> {
        let lpos = self.w.allocate(pages.len() as u64)?;
        self.dev
            .write_at(self.region.offset_of(lpos), bytes)
            .unwrap();
        let entries: Vec<LogEntry> = pages
            .iter()
            .enumerate()
            .map(|(i, &page)| LogEntry {
                lpos: lpos + i as u64,
                volume: VOL,
                page,
                crc: page_crc(&bytes[i * 4096..(i + 1) * 4096]),
            })
            .collect();
        self.w.completed(&entries);
        Ok(lpos)
    }
    /// Writes `version` of each page, as one data write.
    fn write(&mut self, pages: &[u64], version: u64) -> u64 {
        self.try_write(pages, version).unwrap()
    }
    /// [`Self::write`], or what the writer refused.
    fn try_write(&mut self, pages: &[u64], version: u64) -> Result<u64, Full> {
        let bytes: Vec<u8> = pages.iter().flat_map(|&p| image(VOL, p, version)).collect();
        self.try_write_raw(pages, &bytes)
    }
    /// Everything written is cleaned: the tail moves to the head, the anchor as far as it
    /// may.
    fn clean_all(&mut self) {
        self.w.set_tail(self.w.head());
        self.w.set_anchor(self.w.anchor_candidate());
    }
    /// Writes the next commit without flushing it.
    fn write_commit(&mut self) -> PreparedCommit {
        let p = self
            .w
            .prepare_commit()
            .unwrap()
            .expect("something to commit");
        self.dev
            .write_at(self.region.offset_of(p.lpos), &p.bytes)
            .unwrap();
        if let Some(m) = p.mirror_at {
            self.dev.write_at(m, &p.bytes).unwrap();
        }
        p
    }
    /// FLUSH: commits and flushes; the commits' first positions.
    fn commit(&mut self) -> Vec<u64> {
        let mut at = Vec::new();
        while self.w.pending() > 0 {
            let p = self.write_commit();
            self.dev.flush().unwrap();
            self.w.committed(&p);
            at.push(p.lpos);
        }
        at
    }
    fn replay(&self, anchor: Anchor) -> Replayed {
        replay(&self.dev, self.region, &KEY, anchor).unwrap()
    }
    /// The version the index names for `page`, read and checked.
    fn version(&self, r: &Replayed, page: u64) -> Option<u64> {
        let lp = r.index.get(VOL, page)?;
        let mut b = vec![0u8; 4096];
        self.dev
            .read_at(self.region.offset_of(lp.lpos), &mut b)
            .unwrap();
        let (vol, p, v) = model::decode(&b).expect("a whole page");
        assert_eq!((vol, p), (VOL, page));
        Some(v)
    }
}

fn print_totals(name: &str, t: &model::Totals) {
    println!(
        "{name}: {} crashes, {} pages checked, {} from the log, {} from the source, {} at a \
         newer-than-flushed version; {} data writes, {} commits ({} of several records), \
         refused for a commit {} and for a full ring {}; unflushed writes at the crashes: {} \
         kept, {} dropped, {} torn; replay found {} commit records and skipped {} torn \
         entries; {} laps of the ring",
        t.crashes,
        t.pages_checked,
        t.from_log,
        t.from_source,
        t.newer,
        t.data_writes,
        t.commits,
        t.multi_record_commits,
        t.refused_commit,
        t.refused_ring,
        t.writes_kept,
        t.writes_dropped,
        t.writes_torn,
        t.replayed_commits,
        t.replayed_skipped,
        t.laps
    );
    if t.lends > 0 {
        println!(
            "{name}: {} chunks lent, {} give-backs, at most {} lent at once, {} blocks of read \
             data written over chunks given back",
            t.lends, t.give_backs, t.most_lent, t.scribbled
        );
    }
}

/// 450 crashes on a ring of 128 blocks (512 KiB) over a volume of 48 pages: frequent
/// commits, overwrites, many laps.
#[test]
fn crash_model_small_ring() {
    let mut m = Model::new(Config {
        blocks: 128,
        pages: 48,
        max_write: 8,
        crashes: 450,
        max_steps: 80,
        flush_pct: 8,
        seed: 29,
        mirror: 0,
        ..Config::default()
    });
    m.run();
    print_totals("small ring", &m.t);
    let t = &m.t;
    assert!(t.crashes >= 450 && t.laps >= 20 && t.writes_torn > 0);
    assert!(t.from_log > 0 && t.from_source > 0 && t.newer > 0 && t.replayed_skipped > 0);
}

/// 150 crashes on a ring of 1,024 blocks over 1,024 pages with rare FLUSHes: commits of
/// more entries than one record holds (several records in one write).
#[test]
fn crash_model_multi_record_commits() {
    let mut m = Model::new(Config {
        blocks: 1024,
        pages: 1024,
        max_write: 8,
        crashes: 150,
        max_steps: 400,
        flush_pct: 1,
        seed: 2929,
        mirror: 0,
        ..Config::default()
    });
    m.run();
    print_totals("multi-record", &m.t);
    let t = &m.t;
    assert!(t.crashes >= 150 && t.multi_record_commits > 0 && t.laps >= 2);
    assert!(t.from_log > 0 && t.newer > 0);
}

/// The crash model with a mirror area (format 8): second copies of records go there as a
/// device write of their own, a mirror too small for every commit since the anchor makes
/// some commits keep both copies side by side, and writes through to the source supersede
/// the log's versions. Same rules: nothing older than flushed, nothing torn, no break.
#[test]
fn crash_model_with_a_mirror_area() {
    let mut m = Model::new(Config {
        blocks: 256,
        pages: 64,
        max_write: 8,
        crashes: 400,
        max_steps: 120,
        flush_pct: 10,
        seed: 44,
        mirror: 8,
        ..Config::default()
    });
    m.run();
    print_totals("mirror area", &m.t);
    let t = &m.t;
    assert!(t.crashes >= 400 && t.laps >= 10 && t.writes_torn > 0);
    assert!(t.from_log > 0 && t.from_source > 0 && t.through_writes > 0);
    assert!(t.commits_beside > 0, "the mirror area never ran short");
}

/// What a write that does not fit leaves at the end of the ring counts toward the gap
/// between commits (replay looks for the next commit within `max_gap + 16` of the last):
/// commits as far apart as the writer allows are found. (Format 9's first writer counted
/// no skipped position: a commit 100 positions past replay's window was lost.)
#[test]
fn a_write_that_does_not_fit_at_the_rings_end_counts_toward_the_gap() {
    let mut log = Log::new(1024);
    let (gap, big) = (log.region.max_gap(), log.region.max_write());
    assert_eq!((gap, big), (256, 128));
    // The last commit ends 100 positions before the ring's end, the tail and anchor with it.
    let mut page = 0;
    while log.w.head() < 1024 - 100 - 10 {
        log.write(&(page..page + 8).collect::<Vec<_>>(), 1);
        page += 8;
        log.commit();
        log.clean_all();
    }
    let pad = 1024 - 100 - 2 - log.w.head();
    if pad > 0 {
        log.write(&(page..page + pad).collect::<Vec<_>>(), 1);
        page += pad;
    }
    log.commit();
    log.clean_all();
    assert!(
        (1024 - log.w.committed_end()) % 1024 > 16,
        "{}",
        log.w.committed_end()
    );
    // Writes of 128 pages with no commit until the writer asks for one.
    let mut writes = 0;
    loop {
        match log.try_write(&(page..page + big).collect::<Vec<_>>(), 2) {
            Ok(_) => {
                page += big;
                writes += 1;
            }
            Err(Full::Commit) => break,
            Err(e) => panic!("{e:?} after {writes} writes"),
        }
    }
    assert!(writes >= 1);
    log.commit();
    let last = log.w.next_seq() - 1;
    let r = log.replay(log.w.anchor());
    assert_eq!(r.last_seq, last, "replay missed the last commit");
    assert!(r.broken.is_none(), "{:?}", r.broken);
    assert_eq!(log.version(&r, page - 1), Some(2));
}

/// 300 crashes: the crash model over a ring that lends chunks of read slots (format 9): laps use a
/// varying number of chunks (skipping the rest), chunks are given back once no lap a replay
/// reads uses them and then overwritten with old images of the same pages, and replay reads
/// only the chunks the superblock records lent. Same rules: nothing older than flushed,
/// nothing torn, no loss, no break; and no log write outside a chunk recorded lent.
#[test]
fn crash_model_lending_chunks_of_read_slots() {
    let mut m = Model::new(Config {
        blocks: 128,
        pages: 64,
        max_write: 8,
        crashes: 300,
        max_steps: 300,
        flush_pct: 10,
        seed: 45,
        mirror: 8,
        lend_chunks: 4,
        chunk_blocks: 16,
    });
    m.run();
    print_totals("lending", &m.t);
    let t = &m.t;
    assert!(t.crashes >= 300 && t.laps >= 10 && t.writes_torn > 0);
    assert!(t.from_log > 0 && t.from_source > 0 && t.newer > 0);
    assert!(t.lends > 0 && t.give_backs >= 20 && t.most_lent == 4 && t.scribbled > 0);
}

/// A data page holding a perfect copy of a commit record, the expected seq, position and
/// link included, but checksummed without the key (clients do not know it): never a record.
#[test]
fn a_data_page_copying_a_record_is_not_one() {
    let mut log = Log::new(128);
    log.write(&[1], 1);
    let c1 = log.commit();
    assert_eq!(c1, vec![1]);
    let mut seq1 = vec![0u8; 4096];
    log.dev.read_at(log.region.offset_of(1), &mut seq1).unwrap();
    // The forgery names page 7 at position 0 (page 1's data, whose checksum it carries).
    let forged_entry = LogEntry {
        lpos: 0,
        volume: VOL,
        page: 7,
        crc: page_crc(&image(VOL, 1, 1)),
    };
    let h = RecordHeader {
        seq: 2,
        lpos: 3,
        link: record_link(&seq1),
        group_len: 1,
        ..RecordHeader::default()
    };
    let mut forged = vec![0u8; 4096];
    encode_record(&[0; 16], &h, &[forged_entry], &mut forged);
    // The genuine key takes it: only the key tells them apart.
    let mut genuine = vec![0u8; 4096];
    encode_record(&KEY, &h, &[forged_entry], &mut genuine);
    assert_ne!(forged, genuine);
    let two: Vec<u8> = [forged.clone(), forged].concat();
    assert_eq!(log.write_raw(&[10, 11], &two), 3);
    let r = log.replay(FRESH);
    assert_eq!((r.last_seq, r.commits), (1, 1));
    assert_eq!(log.version(&r, 1), Some(1));
    assert!(
        r.index.get(VOL, 7).is_none(),
        "the forged record was applied"
    );
    // Committed, the pages are what the client wrote: data.
    log.commit();
    let r = log.replay(FRESH);
    assert_eq!(r.last_seq, 2);
    assert_eq!(r.index.get(VOL, 10).map(|p| p.lpos), Some(3));
    assert_eq!(r.index.get(VOL, 11).map(|p| p.lpos), Some(4));
    assert!(
        r.index.get(VOL, 7).is_none(),
        "the forged record was applied"
    );
    assert_eq!(r.index.len(), 3);
}

/// Three commits, the second's record damaged in the copy or copies given.
fn damaged_record(copies: &[u64]) -> (Log, Replayed) {
    let mut log = Log::new(128);
    let mut at = Vec::new();
    for page in 1..=3 {
        log.write(&[page], page * 10);
        at.extend(log.commit());
    }
    for c in copies {
        log.dev.flip(log.region.offset_of(at[1] + c) + 100);
    }
    let r = log.replay(FRESH);
    (log, r)
}

/// One copy of a record damaged (either one): read from the other. Both: the chain ends
/// before it, and the commit after it shows that this is damage (`broken`).
#[test]
fn a_damaged_record_copy_is_read_from_the_other_and_both_end_the_log() {
    for copy in [0, 1] {
        let (log, r) = damaged_record(&[copy]);
        assert_eq!(
            (r.last_seq, r.commits, r.next_seq),
            (3, 3, 4),
            "copy {copy}"
        );
        for page in 1..=3 {
            assert_eq!(log.version(&r, page), Some(page * 10), "copy {copy}");
        }
    }
    let (log, r) = damaged_record(&[0, 1]);
    assert_eq!((r.last_seq, r.commits), (1, 1));
    assert!(!r.anchor_missing());
    // Commit 3 follows it: damage, not the end of the log.
    assert_eq!(r.broken.map(|b| (b.missing, b.evidence)), Some((2, 3)));
    assert_eq!(log.version(&r, 1), Some(10));
    assert!(r.index.get(VOL, 2).is_none() && r.index.get(VOL, 3).is_none());
    // An anchor at the damaged commit: missing, and refused by `resume`.
    let anchor = Anchor::Commit { lpos: 4, seq: 2 };
    let r = log.replay(anchor);
    assert!(r.anchor_missing() && r.last_seq == 1 && r.index.is_empty());
    let resumed = std::panic::catch_unwind(|| LogWriter::resume(log.region, KEY, &r));
    assert!(resumed.is_err());
    // An anchor at the sound commit after it: found (its own entry is older than it).
    let r = log.replay(Anchor::Commit { lpos: 7, seq: 3 });
    assert!(!r.anchor_missing() && r.last_seq == 3 && r.index.is_empty());
}

/// A torn commit of several records whose later record survived, then a new life of the log
/// that writes the same sequence numbers again: the old record, though it has the expected
/// seq, its own position and the key, is not taken for the new commit's successor (it is
/// chained to a record that never counted).
#[test]
fn a_stale_record_of_a_torn_commit_is_not_taken_for_the_next() {
    let mut log = Log::new(1024);
    log.write(&[0], 1);
    log.commit();
    let n = ENTRIES_PER_RECORD as u64 + 20;
    for k in 0..n / 8 + 1 {
        let pages: Vec<u64> = (k * 8 + 100..(k * 8 + 108).min(100 + n)).collect();
        log.write(&pages, 2);
    }
    let p = log.write_commit();
    assert_eq!(p.seqs, 2..4, "two records in one write");
    log.dev.flush().unwrap();
    // The first record is lost in both copies; the second survives.
    log.dev.flip(log.region.offset_of(p.lpos) + 200);
    log.dev.flip(log.region.offset_of(p.lpos + 1) + 200);
    let r = log.replay(FRESH);
    assert_eq!((r.last_seq, r.head), (1, 3));
    // The next life writes one page and commits seq 2 before the stale seq 3.
    let mut w = LogWriter::resume(log.region, KEY, &r);
    std::mem::swap(&mut log.w, &mut w);
    log.write(&[5], 3);
    log.commit();
    let r = log.replay(FRESH);
    assert_eq!(r.last_seq, 2, "the stale record was taken for seq 3");
    assert_eq!(log.version(&r, 5), Some(3));
    assert!((100..100 + n).all(|p| r.index.get(VOL, p).is_none()));
}

/// Data of a commit that a later commit followed (so its flush completed) that fails its
/// checksum is damage: the page is lost, never served at its older version. In the last
/// commit, it is a torn write: the page keeps its older version.
#[test]
fn damaged_flushed_data_is_lost_and_torn_data_keeps_the_older_version() {
    let mut log = Log::new(128);
    log.write(&[5], 1);
    log.commit();
    let v2 = log.write(&[5], 2);
    log.commit();
    log.write(&[6], 3);
    log.commit();
    log.dev.flip(log.region.offset_of(v2) + 7);
    let r = log.replay(FRESH);
    assert_eq!(r.lost, vec![(VOL, 5)]);
    assert!(r.index.get(VOL, 5).is_none());
    assert_eq!((log.version(&r, 6), r.skipped), (Some(3), 0));
    // The same page torn in the last commit.
    let mut log = Log::new(128);
    log.write(&[5], 1);
    log.commit();
    let v2 = log.write(&[5], 2);
    log.commit();
    log.dev.flip(log.region.offset_of(v2) + 7);
    let r = log.replay(FRESH);
    assert!(r.lost.is_empty());
    assert_eq!((log.version(&r, 5), r.skipped), (Some(1), 1));
}

/// A log whose first commit's page `lost` (version 1) is damaged, a second commit (page
/// `other`, version 2) after it: damage, not a torn write. Returns the damaged position.
fn damaged_in_a_flushed_commit(lost: u64, other: u64) -> (Log, u64) {
    let mut log = Log::new(128);
    let v1 = log.write(&[lost], 1);
    log.commit();
    log.write(&[other], 2);
    log.commit();
    log.dev.flip(log.region.offset_of(v1) + 7);
    (log, v1)
}

/// A tombstone carries a loss forward: replayed from an anchor past the damaged version, the
/// page is still lost (at the tombstone's commit), even when that commit is the last one
/// (it names no data a crash could have torn); a later version of the page ends the loss.
/// A version 6 record (written before tombstones) is still read.
#[test]
fn a_tombstone_keeps_a_page_lost_past_its_damaged_version_until_it_is_rewritten() {
    let (mut log, v1) = damaged_in_a_flushed_commit(5, 6);
    let r = log.replay(FRESH);
    assert_eq!(r.lost, vec![(VOL, 5)]);
    assert_eq!(r.lost_at.get(&(VOL, 5)), Some(&v1));
    // Carried forward in a commit of its own, the last one.
    log.w.carry_lost(VOL, 5);
    let at = log.commit();
    assert_eq!(at.len(), 1);
    let past = Anchor::Commit {
        lpos: at[0],
        seq: log.w.next_seq() - 1,
    };
    let r = log.replay(past);
    assert_eq!((r.lost.clone(), r.skipped), (vec![(VOL, 5)], 0));
    assert_eq!(r.lost_at.get(&(VOL, 5)), Some(&at[0]));
    assert!(r.index.get(VOL, 5).is_none());
    // Written again: the newest version wins, from either anchor.
    log.write(&[5], 4);
    log.commit();
    log.write(&[7], 5);
    log.commit();
    for a in [FRESH, past] {
        let r = log.replay(a);
        assert!(r.lost.is_empty(), "{:?}", r.lost);
        assert_eq!(log.version(&r, 5), Some(4));
    }
    // A write of the lost page that was in flight when its tombstone was committed, and
    // committed after it at a position below it: replayed from the tombstone's commit (its
    // version was cleaned, so the tail passed it), the page is no longer lost.
    let (mut log, _) = damaged_in_a_flushed_commit(9, 8);
    assert_eq!(log.replay(FRESH).lost, vec![(VOL, 9)]);
    let d = log.w.allocate(1).unwrap();
    let bytes = image(VOL, 9, 3);
    log.dev.write_at(log.region.offset_of(d), &bytes).unwrap();
    log.w.carry_lost(VOL, 9);
    let c1 = log.commit()[0];
    assert!(c1 > d);
    log.w.completed(&[LogEntry {
        lpos: d,
        volume: VOL,
        page: 9,
        crc: page_crc(&bytes),
    }]);
    log.commit();
    let from_c1 = Anchor::Commit {
        lpos: c1,
        seq: log.w.next_seq() - 2,
    };
    let r = log.replay(from_c1);
    assert!(
        r.lost.is_empty(),
        "a cleaned rewrite left the page lost: {:?}",
        r.lost
    );
    assert!(
        r.index.get(VOL, 9).is_none(),
        "below the anchor: on the source"
    );
    // A record of version 6 decodes as before.
    let h = RecordHeader {
        seq: 1,
        ..Default::default()
    };
    let mut b = vec![0u8; LOG_BLOCK as usize];
    encode_record(&KEY, &h, &[], &mut b);
    b[8..12].copy_from_slice(&6u32.to_le_bytes());
    assert_eq!(
        sce_store::wblog::decode_record(&KEY, &b),
        Err(sce_store::wblog::RecordError::Checksum),
        "the checksum covers the version"
    );
    let mut six = b.clone();
    six[12..16].fill(0);
    let crc = {
        let mut c = crc32c::crc32c(&KEY);
        c = crc32c::crc32c_append(c, &six);
        c
    };
    six[12..16].copy_from_slice(&crc.to_le_bytes());
    let r = sce_store::wblog::decode_record(&KEY, &six).expect("a version 6 record");
    assert_eq!(r.header.seq, 1);
    six[8..12].copy_from_slice(&5u32.to_le_bytes());
    assert_eq!(
        sce_store::wblog::decode_record(&KEY, &six),
        Err(sce_store::wblog::RecordError::NotARecord),
        "version 5 is not ours"
    );
}

/// Every data write of N pages is one device write of N x 4 KiB at its position, and every
/// commit one device write of its records, over many laps of a small ring: none crosses the
/// ring's end.
#[test]
fn each_write_and_each_commit_is_one_device_write() {
    let region = LogRegion::ring(3 * LOG_BLOCK, 128);
    let dev = CrashDev::new((3 + 128 + 5) * LOG_BLOCK);
    let mut w = LogWriter::new(region, KEY, 0, 1).unwrap();
    let mut rng = SmallRng::seed_from_u64(4);
    let mut expected: Vec<(u64, u64)> = Vec::new();
    let (mut writes, mut commits) = (0, 0);
    while writes < 3000 {
        let n = rng.gen_range(1..=8);
        match w.allocate(n) {
            Ok(lpos) => {
                let bytes = vec![n as u8; (n * LOG_BLOCK) as usize];
                dev.write_at(region.offset_of(lpos), &bytes).unwrap();
                expected.push((region.offset_of(lpos), n * LOG_BLOCK));
                let e = LogEntry {
                    lpos,
                    volume: VOL,
                    page: lpos,
                    crc: page_crc(&bytes[..4096]),
                };
                w.completed(&[e]);
                writes += 1;
            }
            Err(Full::Commit) => {}
            Err(Full::Ring) => {
                w.set_tail(w.head());
                w.set_anchor(w.anchor_candidate());
                continue;
            }
            Err(e) => panic!("{e:?}"),
        }
        if rng.gen_ratio(1, 4) || w.pending() > 20 {
            while let Some(p) = w.prepare_commit().unwrap() {
                dev.write_at(region.offset_of(p.lpos), &p.bytes).unwrap();
                expected.push((region.offset_of(p.lpos), p.bytes.len() as u64));
                dev.flush().unwrap();
                w.committed(&p);
                commits += 1;
            }
        }
    }
    let end = region.offset + region.blocks * LOG_BLOCK;
    assert!(expected
        .iter()
        .all(|&(o, l)| o >= region.offset && o + l <= end));
    assert_eq!(dev.writes(), expected);
    println!(
        "{writes} data writes and {commits} commits: {} device writes, {} laps",
        expected.len(),
        w.head() / region.blocks
    );
    assert!(w.head() / region.blocks > 20);
}

/// The replay time of a 64 MiB log region full of data (8-page writes of random pages,
/// committed as the gap requires), on a memory device and on a file read with O_DIRECT
/// where the filesystem allows it. One measurement each, printed.
#[test]
fn replay_of_a_64_mib_log_full_of_data() {
    let region = LogRegion::laid_out(0, 16384);
    let mem = MemDevice::new(16384 * LOG_BLOCK);
    let (pages, committed) = fill(&mem, region);
    let r = timed_replay("memory device", &mem, region, committed);
    assert_eq!(r.index.len(), pages.len());
    for (page, lpos) in &pages {
        assert_eq!(r.index.get(VOL, *page).map(|p| p.lpos), Some(*lpos));
    }
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("wblog-64m");
    let _ = std::fs::remove_file(&path);
    let opts = sce_io::file::FileOptions {
        direct: sce_io::file::DirectMode::Preferred,
        create_size: Some(16384 * LOG_BLOCK),
        ..Default::default()
    };
    let file = sce_io::FileDevice::open(&path, &opts).unwrap();
    let mut buf = sce_io::AlignedBuf::new(1 << 20);
    for at in (0..16384 * LOG_BLOCK).step_by(1 << 20) {
        mem.read_at(at, &mut buf).unwrap();
        file.write_at(at, &buf).unwrap();
    }
    file.flush().unwrap();
    let what = format!("file (O_DIRECT {})", file.is_direct());
    let r2 = timed_replay(&what, &file, region, committed);
    assert_eq!(r2.index.len(), r.index.len());
    drop(file);
    std::fs::remove_file(&path).unwrap();
}

/// Fills the region with committed data: (page, position) of every page's newest version,
/// and the entries committed.
fn fill(dev: &dyn BlockDevice, region: LogRegion) -> (std::collections::HashMap<u64, u64>, u64) {
    let mut w = LogWriter::new(region, KEY, 0, 1).unwrap();
    let mut rng = SmallRng::seed_from_u64(64);
    let mut newest = std::collections::HashMap::new();
    let mut committed = 0u64;
    loop {
        let lpos = match w.allocate(8) {
            Ok(l) => l,
            Err(Full::Commit) => {
                committed += flush(dev, region, &mut w);
                continue;
            }
            Err(_) => break,
        };
        let first = rng.gen_range(0..1u64 << 20);
        let pages: Vec<u64> = (first..first + 8).collect();
        let bytes: Vec<u8> = pages.iter().flat_map(|&p| image(VOL, p, lpos)).collect();
        dev.write_at(region.offset_of(lpos), &bytes).unwrap();
        let entries: Vec<LogEntry> = pages
            .iter()
            .enumerate()
            .map(|(i, &page)| {
                newest.insert(page, lpos + i as u64);
                LogEntry {
                    lpos: lpos + i as u64,
                    volume: VOL,
                    page,
                    crc: page_crc(&bytes[i * 4096..(i + 1) * 4096]),
                }
            })
            .collect();
        w.completed(&entries);
    }
    committed += flush(dev, region, &mut w);
    (newest, committed)
}

fn flush(dev: &dyn BlockDevice, region: LogRegion, w: &mut LogWriter) -> u64 {
    let mut n = 0;
    while let Some(p) = w.prepare_commit().unwrap() {
        dev.write_at(region.offset_of(p.lpos), &p.bytes).unwrap();
        if let Some(m) = p.mirror_at {
            dev.write_at(m, &p.bytes).unwrap();
        }
        dev.flush().unwrap();
        w.committed(&p);
        n += p.entries as u64;
    }
    n
}

fn timed_replay(what: &str, dev: &dyn BlockDevice, region: LogRegion, committed: u64) -> Replayed {
    let t = std::time::Instant::now();
    let r = replay(dev, region, &KEY, FRESH).unwrap();
    let secs = t.elapsed().as_secs_f64();
    println!(
        "replay of a 64 MiB log on a {what}: {:.1} ms ({:.0} MiB/s), {} commit records, {} \
         pages, {} indexed, head {}",
        secs * 1e3,
        64.0 / secs,
        r.commits,
        r.pages,
        r.index.len(),
        r.head
    );
    assert_eq!(r.pages, committed);
    assert_eq!((r.skipped, r.lost.len()), (0, 0));
    r
}

/// A commit whose write or flush failed is retried as it was: same position, same bytes, and
/// entries completed meanwhile wait for the next commit.
#[test]
fn a_failed_commit_is_retried_as_it_was() {
    let mut log = Log::new(128);
    log.write(&[1], 1);
    let p = log.w.prepare_commit().unwrap().unwrap();
    log.w.commit_failed(&p);
    log.write(&[2], 2);
    let q = log.write_commit();
    assert_eq!(
        (q.lpos, &q.seqs, &q.bytes[..]),
        (p.lpos, &p.seqs, &p.bytes[..])
    );
    log.dev.flush().unwrap();
    log.w.committed(&q);
    assert_eq!(log.w.pending(), 1);
    log.commit();
    let r = log.replay(FRESH);
    assert_eq!(r.last_seq, 2);
    assert_eq!((log.version(&r, 1), log.version(&r, 2)), (Some(1), Some(2)));
}

/// Three commits on a log with a mirror area, the second's record damaged where `damage`
/// says (0: its ring copy, 1: its mirror copy).
fn damaged_with_mirror(damage: &[u8]) -> (Log, Replayed, u64) {
    let mut log = Log::with_mirror(192, 64);
    let mut ps = Vec::new();
    for page in 1..=3 {
        log.write(&[page], page * 10);
        let p = log.write_commit();
        assert!(
            p.mirror_at.is_some(),
            "the second copy goes to the mirror area"
        );
        log.dev.flush().unwrap();
        log.w.committed(&p);
        ps.push(p);
    }
    let p = &ps[1];
    for &d in damage {
        let at = match d {
            0 => log.region.offset_of(p.lpos),
            _ => p.mirror_at.unwrap(),
        };
        log.dev.flip(at + 100);
    }
    let r = log.replay(FRESH);
    (log, r, p.seqs.start)
}

/// The two copies of a record lie apart (the ring and the mirror area, a separate device
/// write): either one damaged, the record is read from the other; both damaged, the sound
/// commit after it shows the chain was broken by damage, not torn at its end: `broken`
/// names it, and no page is served from before it as if the log ended there.
#[test]
fn a_record_is_read_from_its_mirror_copy_and_a_break_is_never_the_end() {
    for copy in [0u8, 1] {
        let (log, r, _) = damaged_with_mirror(&[copy]);
        assert_eq!((r.last_seq, r.commits), (3, 3), "copy {copy}");
        assert_eq!(r.broken, None);
        assert_eq!(r.repaired, (copy == 0) as u64);
        for page in 1..=3 {
            assert_eq!(log.version(&r, page), Some(page * 10), "copy {copy}");
        }
    }
    let (_, r, seq) = damaged_with_mirror(&[0, 1]);
    assert_eq!(r.last_seq, seq - 1);
    let b = r.broken.expect("a break, not the end of the log");
    assert_eq!((b.missing, b.evidence), (seq, seq + 1));
    // The copies are apart: a mirror slot is never next to its ring copy.
    let mut log = Log::with_mirror(1024, 64);
    for k in 0..200 {
        log.write(&[k % 50], k);
        let p = log.write_commit();
        let m = p.mirror_at.expect("a mirror slot");
        let ring = log.region.offset_of(p.lpos);
        let gap = if ring < m {
            m - ring - p.bytes.len() as u64
        } else {
            ring - m - p.bytes.len() as u64
        };
        assert!(gap >= 32 * LOG_BLOCK, "copies {gap} bytes apart");
        log.dev.flush().unwrap();
        log.w.committed(&p);
        log.clean_all();
    }
}

/// A commit of several records torn at a crash (its first record lost, a later record of
/// the same commit intact, nothing after it) is the end of the log, not a break: the next
/// commit is only written after the one before is durable.
#[test]
fn a_torn_commit_of_several_records_is_the_end_not_a_break() {
    let mut log = Log::with_mirror(1024, 64);
    log.write(&[0], 1);
    log.commit();
    let n = ENTRIES_PER_RECORD as u64 + 20;
    for k in 0..n / 8 + 1 {
        let pages: Vec<u64> = (k * 8 + 100..(k * 8 + 108).min(100 + n)).collect();
        log.write(&pages, 2);
    }
    let p = log.write_commit();
    assert_eq!(p.seqs, 2..4);
    log.dev.flush().unwrap();
    log.dev.flip(log.region.offset_of(p.lpos) + 200);
    log.dev.flip(p.mirror_at.unwrap() + 200);
    let r = log.replay(FRESH);
    assert_eq!((r.last_seq, r.broken), (1, None));
    // A commit after it (which only a durable commit allows) makes it a break.
    log.w.committed(&p);
    log.write(&[7], 3);
    log.commit();
    let r = log.replay(FRESH);
    assert_eq!(r.last_seq, 1);
    assert_eq!(r.broken.map(|b| (b.missing, b.evidence)), Some((2, 4)));
}

/// A cleaned entry (the source holds the page's newest bytes) supersedes every version the
/// log held before it and ends a loss; a version written after it is the newest again.
#[test]
fn a_cleaned_entry_supersedes_the_logs_versions_and_ends_a_loss() {
    let mut log = Log::with_mirror(192, 64);
    log.write(&[5], 1);
    log.write(&[6], 1);
    log.commit();
    log.w.supersede(VOL, 5, false);
    log.commit();
    let r = log.replay(FRESH);
    assert!(r.index.get(VOL, 5).is_none(), "superseded");
    assert_eq!(log.version(&r, 6), Some(1));
    log.write(&[5], 2);
    log.commit();
    assert_eq!(log.version(&log.replay(FRESH), 5), Some(2));
    // A lost page (damaged, then carried in a tombstone) is no longer lost once cleaned.
    let (mut log, _) = damaged_in_a_flushed_commit(9, 8);
    assert_eq!(log.replay(FRESH).lost, vec![(VOL, 9)]);
    log.w.supersede(VOL, 9, false);
    log.commit();
    let r = log.replay(FRESH);
    assert!(r.lost.is_empty() && r.index.get(VOL, 9).is_none());
}

/// When every mirror slot holds a record replay still needs (the anchor has not moved), a
/// commit keeps both copies side by side in the ring; replay reads both layouts, and a
/// format 7 log (no mirror area) goes on as before.
#[test]
fn a_full_mirror_area_keeps_both_copies_in_the_ring() {
    let mut log = Log::with_mirror(512, 32);
    for k in 0..100 {
        log.write(&[k % 40], k);
        log.commit();
    }
    assert!(log.w.commits_beside() > 0 && log.w.commits_beside() < 100);
    let r = log.replay(FRESH);
    assert_eq!((r.last_seq, r.broken), (100, None));
    for p in 0..40 {
        assert!(log.version(&r, p).is_some());
    }
}
