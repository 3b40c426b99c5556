//! Model-based property test of write-back in the core: random sequences of write-back
//! writes (landing on the cache device and completing in any order, some failing), reads
//! (with inline fills), populations, cleaning (reading the cache, writing the source,
//! completing, some failing), evictions, `evict_range`, `forget` and bad cached pages are
//! applied to the core, driven by a simulated source and cache device in memory.
//!
//! Every read returns, byte for byte, the newest acknowledged data (or that of a write in
//! flight over it), or is refused as lost if a dirty page's only copy went bad. Dirty pages
//! are never evicted or dropped. When everything is cleaned, the source alone holds every
//! acknowledged byte that was not lost.

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};
use sce_core::*;

#[derive(Clone, Debug)]
enum Op {
    Read {
        off: u32,
        len: u32,
    },
    Write {
        off: u32,
        len: u32,
        fail: bool,
    },
    Land(u16),
    Complete(u16),
    PickPopulation,
    PopRead(u16),
    PopWrite(u16, bool),
    PickClean,
    CleanRead(u16),
    CleanWrite(u16, bool),
    EvictOne,
    EvictRange {
        off: u32,
        len: u32,
    },
    Forget,
    BadPage(u32),
    /// The cache device fails: everything unpinned is dropped, dirty pages are lost.
    DropAll,
    EvictFragment(u32),
    /// The source changes behind the cache's back where nothing is dirty or in flight, then
    /// `forget`: every read after sees the new bytes.
    ForgetExternal {
        off: u32,
        len: u32,
        byte: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u32>(), 1u32..24).prop_map(|(off, len)| Op::Read { off, len }),
        6 => (any::<u32>(), 1u32..24, prop::bool::weighted(0.08))
            .prop_map(|(off, len, fail)| Op::Write { off, len, fail }),
        3 => any::<u16>().prop_map(Op::Land),
        4 => any::<u16>().prop_map(Op::Complete),
        2 => Just(Op::PickPopulation),
        2 => any::<u16>().prop_map(Op::PopRead),
        2 => (any::<u16>(), prop::bool::weighted(0.1)).prop_map(|(i, f)| Op::PopWrite(i, f)),
        3 => Just(Op::PickClean),
        3 => any::<u16>().prop_map(Op::CleanRead),
        3 => (any::<u16>(), prop::bool::weighted(0.15)).prop_map(|(i, f)| Op::CleanWrite(i, f)),
        1 => Just(Op::EvictOne),
        1 => (any::<u32>(), 1u32..24).prop_map(|(off, len)| Op::EvictRange { off, len }),
        1 => Just(Op::Forget),
        1 => any::<u32>().prop_map(Op::BadPage),
        1 => Just(Op::DropAll),
        1 => any::<u32>().prop_map(Op::EvictFragment),
        1 => (any::<u32>(), 1u32..24, any::<u8>())
            .prop_map(|(off, len, byte)| Op::ForgetExternal { off, len, byte }),
    ]
}

struct PendingWrite {
    plan: WriteBackPlan,
    off: usize,
    data: Vec<u8>,
    fail: bool,
    landed: bool,
    /// Pages written in part whose other bytes a `forget` made stale: lost at completion.
    spoiled: Vec<usize>,
}

struct PendingClean {
    job: CleanJob,
    data: Option<Vec<Vec<u8>>>,
}

struct Harness {
    core: CacheCore,
    source: Vec<u8>,
    cache: Vec<u8>,
    acked: Vec<u8>,
    /// Bytes whose only copy was lost (a read of them must be refused or, once rewritten,
    /// return the new data).
    lost: Vec<bool>,
    writes: Vec<PendingWrite>,
    pops: Vec<(PopulationJob, Option<Vec<u8>>)>,
    cleans: Vec<PendingClean>,
    plan: ReadPlan,
    seq: u8,
    refusals: [u64; 3],
}

const PAGE: usize = 4096;

impl Harness {
    fn new(fragment: u64, slots: u64, frags: u64, admission: Admission) -> Self {
        let size = fragment * frags;
        let source: Vec<u8> = (0..size as usize).map(|i| (i / 512) as u8 ^ 0x5a).collect();
        let cfg = CoreConfig {
            fragment_size: fragment,
            admission,
            write_mode: WriteMode::WriteBack,
            hot_window: 4,
            ..CoreConfig::default()
        };
        let map = ShardMap::new(1, fragment, size, slots as u32);
        let core = map.build(&cfg, slots * fragment).unwrap().remove(0);
        Harness {
            core,
            acked: source.clone(),
            lost: vec![false; size as usize],
            source,
            cache: vec![0xEE; (slots * fragment) as usize],
            writes: Vec::new(),
            pops: Vec::new(),
            cleans: Vec::new(),
            plan: ReadPlan::new(),
            seq: 0,
            refusals: [0; 3],
        }
    }

    /// A page-aligned range most of the time, a sector-aligned one sometimes.
    fn range(&self, off: u32, len: u32) -> (u64, u64) {
        let sectors = self.source.len() as u64 / 512;
        let mut o = off as u64 % sectors;
        let mut l = len as u64;
        if !off.is_multiple_of(4) {
            o -= o % 8;
            l = l.div_ceil(8) * 8;
        }
        (o * 512, (l * 512).min((sectors - o) * 512))
    }

    fn read(&mut self, off: u32, len: u32) -> Result<(), TestCaseError> {
        let (off, len) = self.range(off, len);
        let r = self.core.begin_read(SourceOffset(off), len, &mut self.plan);
        let span = off as usize..(off + len) as usize;
        if let Err(RequestError::Lost { .. }) = r {
            prop_assert!(
                self.lost[span.clone()].iter().any(|&l| l),
                "a read of {off}+{len} was refused as lost, but nothing there was lost"
            );
            return Ok(());
        }
        r.expect("in range");
        let mut buf = vec![0u8; len as usize];
        for run in &self.plan.runs {
            let dst = &mut buf[run.buf_offset as usize..(run.buf_offset + run.len) as usize];
            match run.target {
                RunTarget::Source(s) => {
                    dst.copy_from_slice(&self.source[s.0 as usize..(s.0 + run.len) as usize])
                }
                RunTarget::Cache(c) => {
                    dst.copy_from_slice(&self.cache[c.0 as usize..(c.0 + run.len) as usize])
                }
            }
        }
        for i in span.clone() {
            let got = buf[i - off as usize];
            prop_assert!(!self.lost[i], "a lost byte at {i} was served");
            // A read overlapping a write in flight may see that write's bytes, or, if it is
            // failing, what its failed copy left (concurrent overlapping I/O: either is
            // allowed; the write's own error tells the client).
            let ok = got == self.acked[i]
                || self.writes.iter().any(|w| {
                    i >= w.off
                        && i < w.off + w.data.len()
                        && (w.data[i - w.off] == got || (w.fail && w.landed && got == 0xBD))
                });
            prop_assert!(
                ok,
                "stale byte at {i}: got {got:#x}, acknowledged {:#x}, runs {:?}",
                self.acked[i],
                self.plan.runs
            );
        }
        for f in &self.plan.fills {
            let src = &buf[f.buf_offset as usize..(f.buf_offset + f.len) as usize];
            self.cache[f.cache.0 as usize..(f.cache.0 + f.len) as usize].copy_from_slice(src);
        }
        for id in self.plan.pops.clone() {
            self.core.complete_population(id, true).expect("live pop");
        }
        self.core.end_read(&mut self.plan);
        Ok(())
    }

    fn write(&mut self, off: u32, len: u32, fail: bool) {
        let (off, len) = self.range(off, len);
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let data: Vec<u8> = (0..len)
            .map(|i| seq.wrapping_mul(29) ^ (i / 512) as u8 ^ 0x3c)
            .collect();
        let r = self.core.begin_writeback(SourceOffset(off), len);
        if std::env::var("WB_DEBUG").is_ok() {
            eprintln!("  write {off}+{len}: {r:?}");
        }
        match r {
            Ok(plan) => self.writes.push(PendingWrite {
                plan,
                off: off as usize,
                data,
                fail,
                landed: false,
                spoiled: Vec::new(),
            }),
            Err(WriteBackRefusal::Full) => self.refusals[0] += 1,
            Err(WriteBackRefusal::PartialPage) => self.refusals[1] += 1,
            Err(WriteBackRefusal::Busy) => self.refusals[2] += 1,
            Err(e) => panic!("{e}"),
        }
    }

    /// The cache copies of a write land (or, failing, leave garbage).
    fn land(&mut self, i: u16) {
        let open: Vec<usize> = (0..self.writes.len())
            .filter(|&k| !self.writes[k].landed)
            .collect();
        if open.is_empty() {
            return;
        }
        let w = &mut self.writes[open[i as usize % open.len()]];
        for c in &w.plan.copies {
            let dst = &mut self.cache[c.cache.0 as usize..(c.cache.0 + c.len) as usize];
            if w.fail {
                dst.iter_mut().for_each(|b| *b = 0xBD);
            } else {
                let from = c.buf_offset as usize;
                dst.copy_from_slice(&w.data[from..from + c.len as usize]);
            }
        }
        w.landed = true;
    }

    /// A landed write completes: acknowledged, or failed (its bytes may be anything; the
    /// dirty ones it covered are lost).
    fn complete(&mut self, i: u16) {
        let landed: Vec<usize> = (0..self.writes.len())
            .filter(|&k| self.writes[k].landed)
            .collect();
        if landed.is_empty() {
            return;
        }
        let w = self.writes.remove(landed[i as usize % landed.len()]);
        let dirty_before = self.dirty_bytes(w.off, w.data.len());
        self.core
            .complete_writeback(w.plan.id, !w.fail)
            .expect("live write");
        let span = w.off..w.off + w.data.len();
        if w.fail {
            // The client got an error: the bytes are undefined. The pages it touched that
            // were dirty are lost whole (validity is per page); the others read as the
            // source's.
            let pages = span.start / PAGE..span.end.div_ceil(PAGE);
            for p in pages {
                let at = p * PAGE;
                let was_dirty = if at >= w.off {
                    dirty_before[at - w.off]
                } else {
                    dirty_before[0]
                };
                for i in at..(at + PAGE).min(self.source.len()) {
                    if was_dirty {
                        self.lost[i] = true;
                    } else if !self.lost[i] {
                        self.acked[i] = self.source[i];
                    }
                }
            }
        } else {
            self.acked[span.clone()].copy_from_slice(&w.data);
            for &p in &w.spoiled {
                let end = ((p + 1) * PAGE).min(self.source.len());
                self.lost[p * PAGE..end].fill(true);
            }
            // Whole pages written clear their loss.
            for p in span.start.div_ceil(PAGE)..span.end / PAGE {
                self.lost[p * PAGE..(p + 1) * PAGE].fill(false);
            }
        }
    }

    /// Per byte of `[off, off + n)`: is its page dirty in the core now?
    fn dirty_bytes(&self, off: usize, n: usize) -> Vec<bool> {
        (off..off + n)
            .map(|i| self.core.page_dirty(SourceOffset(i as u64)))
            .collect()
    }

    fn pick_population(&mut self) {
        if let Some(job) = self.core.pick_population_unthrottled() {
            self.pops.push((job, None));
        }
    }

    fn pop_read(&mut self, i: u16) {
        let idle: Vec<usize> = (0..self.pops.len())
            .filter(|&k| self.pops[k].1.is_none())
            .collect();
        if let Some(&k) = idle.get(i as usize % idle.len().max(1)) {
            let j = &self.pops[k].0;
            let span = self.source[j.source.0 as usize..(j.source.0 + j.len) as usize].to_vec();
            self.pops[k].1 = Some(span);
        }
    }

    fn pop_write(&mut self, i: u16, fail: bool) {
        let read: Vec<usize> = (0..self.pops.len())
            .filter(|&k| self.pops[k].1.is_some())
            .collect();
        let Some(&k) = read.get(i as usize % read.len().max(1)) else {
            return;
        };
        let (job, data) = self.pops.remove(k);
        let data = data.expect("read");
        for &(o, l, c) in &job.runs {
            let dst = &mut self.cache[c.0 as usize..(c.0 + l) as usize];
            if fail {
                dst.iter_mut().for_each(|b| *b = 0xC3);
            } else {
                dst.copy_from_slice(&data[o as usize..(o + l) as usize]);
            }
        }
        self.core
            .complete_population(job.id, !fail)
            .expect("live pop");
    }

    fn pick_clean(&mut self) {
        if let Some(job) = self.core.pick_clean() {
            self.cleans.push(PendingClean { job, data: None });
        }
    }

    fn clean_read(&mut self, i: u16) {
        let idle: Vec<usize> = (0..self.cleans.len())
            .filter(|&k| self.cleans[k].data.is_none())
            .collect();
        if let Some(&k) = idle.get(i as usize % idle.len().max(1)) {
            let runs = &self.cleans[k].job.runs;
            let data = runs
                .iter()
                .map(|&(_, c, l)| self.cache[c.0 as usize..(c.0 + l) as usize].to_vec())
                .collect();
            self.cleans[k].data = Some(data);
        }
    }

    fn clean_write(&mut self, i: u16, fail: bool) {
        let read: Vec<usize> = (0..self.cleans.len())
            .filter(|&k| self.cleans[k].data.is_some())
            .collect();
        let Some(&k) = read.get(i as usize % read.len().max(1)) else {
            return;
        };
        let c = self.cleans.remove(k);
        if !fail {
            for (&(s, _, l), d) in c.job.runs.iter().zip(c.data.expect("read")) {
                self.source[s.0 as usize..(s.0 + l) as usize].copy_from_slice(&d);
            }
        }
        self.core
            .complete_clean(c.job.id, !fail)
            .expect("live clean");
    }

    /// A cached page goes bad (as a read would find by its checksum).
    fn bad_page(&mut self, p: u32) {
        let pages = self.source.len() / PAGE;
        let p = p as usize % pages;
        let f = (p * PAGE) as u64 / self.core.geometry().fragment_size();
        let ppf = self.core.geometry().pages_per_fragment() as usize;
        let q = (p % ppf) as u32;
        if self.core.exists(FragNo(f)).is_none() {
            return;
        }
        // Only pages no write-back write or cleaning has in flight: a driver finds a bad
        // page by reading it, which it does not do under a write (the read plan serves it
        // from the cache, but the write's copy replaces it).
        let busy = self
            .writes
            .iter()
            .any(|w| w.off < (p + 1) * PAGE && p * PAGE < w.off + w.data.len())
            || self.cleans.iter().any(|c| c.job.frag == FragNo(f));
        if busy {
            return;
        }
        if self.core.page_dirty(SourceOffset((p * PAGE) as u64)) {
            self.lost[p * PAGE..(p + 1) * PAGE].fill(true);
        }
        self.core.invalidate(FragNo(f), q, q + 1);
    }

    /// The cache device fails: what is not pinned is dropped; dirty pages dropped are lost.
    fn drop_all(&mut self) {
        let pages = self.source.len().div_ceil(PAGE);
        let before: Vec<bool> = (0..pages)
            .map(|p| self.core.page_dirty(SourceOffset((p * PAGE) as u64)))
            .collect();
        self.core.drop_all();
        for (p, &was) in before.iter().enumerate() {
            if was && !self.core.page_dirty(SourceOffset((p * PAGE) as u64)) {
                let end = ((p + 1) * PAGE).min(self.source.len());
                self.lost[p * PAGE..end].fill(true);
            }
        }
    }

    /// Someone else writes the source where no page is dirty, lost or under a write-back
    /// write or cleaning in flight; then `forget`.
    fn forget_external(&mut self, off: u32, len: u32, byte: u8) {
        let (off, len) = self.range(off, len);
        let fsize = self.core.geometry().fragment_size() as usize;
        for i in off as usize..(off + len) as usize {
            let p = i / PAGE;
            let under_write = self
                .writes
                .iter()
                .any(|w| w.off < (p + 1) * PAGE && p * PAGE < w.off + w.data.len());
            let cleaning = self
                .cleans
                .iter()
                .any(|c| c.job.frag.0 as usize == i / fsize);
            if self.core.page_dirty(SourceOffset(i as u64))
                || self.lost[i]
                || under_write
                || cleaning
            {
                continue;
            }
            self.source[i] = byte;
            self.acked[i] = byte;
        }
        self.forget();
    }

    /// `forget`, as after a change of the source behind the cache's back.
    fn forget(&mut self) {
        // Write-back writes in flight over a page in part that is not dirty: the page's
        // other bytes were the old source's, so it is lost when the write completes.
        for w in &mut self.writes {
            let (a, b) = (w.off, w.off + w.data.len());
            let edges = [
                (a / PAGE, a % PAGE != 0),
                ((b - 1) / PAGE, b % PAGE != 0 && b < self.source.len()),
            ];
            for (p, partial) in edges {
                if partial
                    && !self.core.page_dirty(SourceOffset((p * PAGE) as u64))
                    && !w.spoiled.contains(&p)
                {
                    w.spoiled.push(p);
                }
            }
        }
        self.core.forget();
    }

    /// Completes everything, cleans everything, and checks that the source holds every
    /// acknowledged byte that was not lost.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        while !self.writes.is_empty() {
            self.land(0);
            self.complete(0);
        }
        while let Some((job, _)) = self.pops.pop() {
            self.core
                .complete_population(job.id, false)
                .expect("live pop");
        }
        while !self.cleans.is_empty() {
            self.clean_read(0);
            self.clean_write(0, false);
        }
        for _ in 0..10_000 {
            if self.core.dirty_pages() == 0 {
                break;
            }
            self.pick_clean();
            self.clean_read(0);
            self.clean_write(0, false);
        }
        prop_assert_eq!(self.core.dirty_pages(), 0, "cleaning never finished");
        for i in 0..self.source.len() {
            if !self.lost[i] {
                prop_assert_eq!(
                    self.source[i],
                    self.acked[i],
                    "after cleaning the source is stale at {}",
                    i
                );
            }
        }
        Ok(())
    }
}

fn run(ops: &[Op], shape: (u64, u64, u64, Admission)) -> Result<[u64; 3], TestCaseError> {
    let (fragment, slots, frags, admission) = shape;
    let mut h = Harness::new(fragment, slots, frags, admission);
    for op in ops {
        if std::env::var("WB_DEBUG").is_ok() {
            eprintln!(
                "{op:?} dirty={} writes={} cleans={}",
                h.core.dirty_pages(),
                h.writes.len(),
                h.cleans.len()
            );
        }
        match *op {
            Op::Read { off, len } => h.read(off, len)?,
            Op::Write { off, len, fail } => h.write(off, len, fail),
            Op::Land(i) => h.land(i),
            Op::Complete(i) => h.complete(i),
            Op::PickPopulation => h.pick_population(),
            Op::PopRead(i) => h.pop_read(i),
            Op::PopWrite(i, f) => h.pop_write(i, f),
            Op::PickClean => h.pick_clean(),
            Op::CleanRead(i) => h.clean_read(i),
            Op::CleanWrite(i, f) => h.clean_write(i, f),
            Op::EvictOne => {
                h.core.evict_one();
            }
            Op::EvictRange { off, len } => {
                let (o, l) = h.range(off, len);
                h.core.evict_range(SourceOffset(o), l);
            }
            Op::Forget => h.forget(),
            Op::BadPage(p) => h.bad_page(p),
            Op::DropAll => h.drop_all(),
            Op::EvictFragment(f) => {
                let n = h.source.len() as u64 / h.core.geometry().fragment_size();
                h.core.evict_fragment(FragNo(f as u64 % n));
            }
            Op::ForgetExternal { off, len, byte } => h.forget_external(off, len, byte),
        }
    }
    h.finish()?;
    Ok(h.refusals)
}

fn shape() -> impl Strategy<Value = (u64, u64, u64, Admission)> {
    (
        prop_oneof![Just(4096u64), Just(16384)],
        2u64..8,
        2u64..10,
        prop_oneof![Just(Admission::Always), Just(Admission::Sce)],
    )
}

proptest! {
    #![proptest_config(Config {
        cases: 400,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..Config::default()
    })]

    #[test]
    fn writeback_never_serves_stale_and_cleaning_catches_the_source_up(
        shape in shape(),
        ops in prop::collection::vec(op(), 1..160),
    ) {
        run(&ops, shape)?;
    }
}

/// Dirty data fills the cache: writes are refused as full until cleaning frees slots, and
/// no dirty slot is ever evicted.
#[test]
fn a_cache_full_of_dirty_data_refuses_writes_until_cleaned() {
    let mut h = Harness::new(4096, 2, 8, Admission::Always);
    for p in 0..2u32 {
        h.write(p * 8, 8, false);
        h.land(0);
        h.complete(0);
    }
    assert_eq!(h.core.dirty_pages(), 2);
    assert!(h.core.evict_one().is_none(), "a dirty slot was evicted");
    h.write(2 * 8, 8, false);
    assert_eq!(h.refusals[0], 1, "a third write found the cache full");
    h.pick_clean();
    h.clean_read(0);
    h.clean_write(0, false);
    h.write(2 * 8, 8, false);
    assert_eq!(
        h.writes.len(),
        1,
        "after cleaning one slot, the write goes ahead"
    );
    h.land(0);
    h.complete(0);
    h.finish().unwrap();
}

/// Leaving write-back is refused while dirty data is in the cache; cleaning a range cleans
/// only it; a restart's records bring dirty pages back as dirty (never evicted, served from
/// the cache, cleaned again).
#[test]
fn mode_changes_range_cleaning_and_restored_dirty_pages() {
    let mut h = Harness::new(4096, 8, 8, Admission::Always);
    let to = |m| Retune {
        write_mode: Some(m),
        ..Retune::default()
    };
    h.core.retune(&to(WriteMode::WriteBack)).unwrap();
    for p in [0u32, 3, 5] {
        h.write(p * 8, 8, false);
        h.land(0);
        h.complete(0);
    }
    assert_eq!(h.core.dirty_pages(), 3);
    let e = h.core.retune(&to(WriteMode::Awt)).unwrap_err();
    assert!(e.to_string().contains("3 dirty pages"), "{e}");
    // Clean pages 3..8 only: pages 3 and 5.
    let (from, len) = (SourceOffset(3 * 4096), 5 * 4096);
    assert_eq!(h.core.dirty_in(from, len), 2);
    while let Some(job) = h.core.pick_clean_in(from, len) {
        assert!(job.frag.0 >= 3, "picked {:?} outside the range", job.frag);
        h.cleans.push(PendingClean { job, data: None });
        h.clean_read(0);
        h.clean_write(0, false);
    }
    assert_eq!(h.core.dirty_in(from, len), 0);
    assert_eq!(h.core.dirty_pages(), 1, "page 0 is still dirty");
    // A restart: the slots' records (fragment, bitmap) and the dirty pages come back.
    let ppf = h.core.geometry().pages_per_fragment();
    let mut records = Vec::new();
    for s in 0..h.core.geometry().slots() {
        let (f, bits) = h.core.slot_state(SlotNo(s));
        if let Some(f) = f {
            records.push((SlotNo(s), f, bits.to_vec()));
        }
    }
    let mut again = Harness::new(4096, 8, 8, Admission::Always);
    again.source = h.source.clone();
    again.cache = h.cache.clone();
    again.acked = h.acked.clone();
    again
        .core
        .restore(records.iter().map(|(s, f, b)| (*s, *f, &b[..])));
    for (_, f, _) in &records {
        let mut d = sce_core::bitmap::PageSet::new(ppf);
        if h.core.page_dirty(SourceOffset(f.0 * 4096)) {
            d.insert_range(0, 1);
        }
        assert!(again.core.restore_dirty(*f, &d));
    }
    assert_eq!(again.core.dirty_pages(), 1);
    for _ in 0..8 {
        again.core.evict_one();
    }
    assert!(
        again.core.page_dirty(SourceOffset(0)),
        "a restored dirty page was evicted"
    );
    again.read(0, 8).unwrap();
    again.finish().unwrap();
}

/// A write-through write next to a write-back write in flight on the same page is refused
/// (the write-back copy would bring the page's older bytes back as dirty); write-back
/// writes need writeback mode; restored dirty pages add up, and those not restored valid
/// are lost.
#[test]
fn mixed_writes_modes_and_restores_are_refused_or_kept_safe() {
    let mut h = Harness::new(4096, 4, 4, Admission::Always);
    h.read(0, 8).unwrap();
    let plan = h
        .core
        .begin_writeback(SourceOffset(0), 2048)
        .expect("page 0 is cached: a partial write-back write goes");
    let e = h
        .core
        .begin_write(SourceOffset(2048), 2048, WriteKind::Data)
        .unwrap_err();
    assert!(matches!(e, RequestError::Dirty { .. }), "{e}");
    h.core.complete_writeback(plan.id, true).unwrap();
    // Not in writeback mode: refused.
    let mut other = Harness::new(4096, 4, 4, Admission::Always);
    other
        .core
        .retune(&Retune {
            write_mode: Some(WriteMode::Awt),
            ..Retune::default()
        })
        .unwrap();
    assert_eq!(
        other
            .core
            .begin_writeback(SourceOffset(0), 4096)
            .unwrap_err(),
        WriteBackRefusal::NotWriteBack
    );
    // Restores merge, and a page recorded dirty but not restored valid is lost.
    let mut r = Harness::new(16384, 4, 4, Admission::Always);
    r.read(0, 32).unwrap();
    let ppf = r.core.geometry().pages_per_fragment();
    let mut one = sce_core::bitmap::PageSet::new(ppf);
    one.insert_range(0, 1);
    let mut two = sce_core::bitmap::PageSet::new(ppf);
    two.insert_range(2, 3);
    assert!(r.core.restore_dirty(FragNo(0), &one));
    assert!(r.core.restore_dirty(FragNo(0), &two));
    assert_eq!(
        r.core.dirty_pages(),
        2,
        "the second restore kept the first's page"
    );
    assert!(
        !r.core.restore_dirty(FragNo(3), &one),
        "fragment 3 is not cached"
    );
    assert_eq!(r.core.lost_pages(), 1);
    let mut plan = ReadPlan::new();
    let e = r
        .core
        .begin_read(SourceOffset(3 * 16384), 4096, &mut plan)
        .unwrap_err();
    assert!(matches!(e, RequestError::Lost { .. }), "{e}");
}
