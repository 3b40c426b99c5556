//! Model-based property test of the core: random operation sequences are applied to the core
//! (driven by a simulated source and cache device held in memory) and to a plain reference
//! volume. Every read must return, byte for byte, either the newest acknowledged data or the
//! data of a write still in flight over that byte.
//!
//! The harness plays the engine's part, but delivers every I/O completion as its own step, in
//! any order: source writes land, are acknowledged later; AWT cache copies complete before or
//! after them; populations read the source, then write the cache, at arbitrary points in
//! between; evictions happen in the middle. Failed cache writes leave garbage on the cache
//! device (a partly written copy); failed source writes leave the source untouched.

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
        fail_source: bool,
        fail_cache: bool,
    },
    Discard {
        off: u32,
        len: u32,
    },
    SourceLand(u16),
    SourceAck(u16),
    CacheCopy(u16, u16),
    PickPopulation,
    Prefetch(u32),
    PopReadSource(u16, bool),
    PopWriteCache(u16, bool),
    EvictOne,
    EvictFragment(u32),
}

fn op() -> impl Strategy<Value = Op> {
    // Offsets and lengths are in 512-byte sectors, scaled to the volume at run time.
    prop_oneof![
        6 => (any::<u32>(), 1u32..40).prop_map(|(off, len)| Op::Read { off, len }),
        4 => (any::<u32>(), 1u32..40, prop::bool::weighted(0.1), prop::bool::weighted(0.1))
            .prop_map(|(off, len, fail_source, fail_cache)| Op::Write { off, len, fail_source, fail_cache }),
        1 => (any::<u32>(), 1u32..24).prop_map(|(off, len)| Op::Discard { off, len }),
        3 => any::<u16>().prop_map(Op::SourceLand),
        3 => any::<u16>().prop_map(Op::SourceAck),
        3 => (any::<u16>(), any::<u16>()).prop_map(|(a, b)| Op::CacheCopy(a, b)),
        3 => Just(Op::PickPopulation),
        1 => any::<u32>().prop_map(Op::Prefetch),
        3 => (any::<u16>(), prop::bool::weighted(0.1)).prop_map(|(i, f)| Op::PopReadSource(i, f)),
        3 => (any::<u16>(), prop::bool::weighted(0.1)).prop_map(|(i, f)| Op::PopWriteCache(i, f)),
        1 => Just(Op::EvictOne),
        1 => any::<u32>().prop_map(Op::EvictFragment),
    ]
}

fn config() -> impl Strategy<Value = (CoreConfig, u64, u64)> {
    (
        prop_oneof![Just(4096u64), Just(8192), Just(16384)],
        2u64..7,
        prop_oneof![
            Just(Admission::Sce),
            Just(Admission::ScePaper),
            Just(Admission::Always),
            Just(Admission::NHit(2))
        ],
        prop_oneof![
            Just(WriteMode::Awt),
            Just(WriteMode::WriteAround),
            Just(WriteMode::WriteThrough)
        ],
        prop_oneof![
            Just(EvictionKind::Clock),
            Just(EvictionKind::Lru),
            Just(EvictionKind::Fifo)
        ],
        prop_oneof![Just(8192u64), Just(64 << 10), Just(8 << 20)],
        1u64..12,
    )
        .prop_map(
            |(fs, slots, admission, write_mode, eviction, awt_budget, src_frags)| {
                let cfg = CoreConfig {
                    fragment_size: fs,
                    admission,
                    write_mode,
                    eviction,
                    awt_budget,
                    hot_window: 4,
                    // A third of the cases run as a checksumming driver does.
                    revalidate_partial_pages: src_frags % 3 != 0,
                    // Admission `sce`: sometimes partial fills, and streams from two fragments.
                    partial_fill: src_frags % 2 == 1,
                    sequential_cutoff: if slots % 2 == 0 { 2 * fs } else { 0 },
                    ..CoreConfig::default()
                };
                // Source sizes that are not a multiple of the page or fragment size on purpose.
                let source = src_frags * fs + if src_frags % 2 == 0 { 1536 } else { 0 };
                (cfg, source, slots * fs)
            },
        )
}

#[derive(Debug, PartialEq)]
enum SourceState {
    Pending,
    Landed,
    Acked,
}

struct PendingWrite {
    plan: WritePlan,
    off: usize,
    data: Vec<u8>,
    fail_source: bool,
    fail_cache: bool,
    source: SourceState,
    copies_done: Vec<bool>,
}

struct PendingPop {
    job: PopulationJob,
    data: Option<Result<Vec<u8>, ()>>,
}

struct Harness {
    core: CacheCore,
    source: Vec<u8>,
    cache: Vec<u8>,
    acked: Vec<u8>,
    writes: Vec<PendingWrite>,
    pops: Vec<PendingPop>,
    seq: u8,
    plan: ReadPlan,
}

impl Harness {
    fn new(cfg: CoreConfig, source_size: u64, cache_size: u64) -> Self {
        let mut source = vec![0u8; source_size as usize];
        for (i, b) in source.iter_mut().enumerate() {
            *b = (i / 512) as u8 ^ 0x5a;
        }
        Harness {
            core: CacheCore::new(cfg, source_size, cache_size).expect("valid config"),
            acked: source.clone(),
            source,
            cache: vec![0xEE; cache_size as usize],
            writes: Vec::new(),
            pops: Vec::new(),
            seq: 0,
            plan: ReadPlan::new(),
        }
    }

    fn range(&self, off: u32, len: u32) -> (u64, u64) {
        let sectors = self.source.len() as u64 / 512;
        let off = off as u64 % sectors;
        let len = (len as u64).min(sectors - off);
        (off * 512, len * 512)
    }

    fn read(&mut self, off: u32, len: u32) -> Result<(), TestCaseError> {
        let (off, len) = self.range(off, len);
        self.core
            .begin_read(SourceOffset(off), len, &mut self.plan)
            .expect("in range");
        let mut buf = vec![0u8; len as usize];
        let mut covered = 0;
        for r in &self.plan.runs {
            prop_assert_eq!(r.buf_offset, covered, "runs must tile the request");
            covered += r.len;
            let dst = &mut buf[r.buf_offset as usize..(r.buf_offset + r.len) as usize];
            match r.target {
                RunTarget::Source(s) => {
                    dst.copy_from_slice(&self.source[s.0 as usize..(s.0 + r.len) as usize])
                }
                RunTarget::Cache(c) => {
                    dst.copy_from_slice(&self.cache[c.0 as usize..(c.0 + r.len) as usize])
                }
            }
        }
        prop_assert_eq!(covered, len);
        for (i, &got) in buf.iter().enumerate() {
            let at = off as usize + i;
            let ok = got == self.acked[at]
                || self.writes.iter().any(|w| {
                    w.source != SourceState::Acked
                        && at >= w.off
                        && at < w.off + w.data.len()
                        && w.data[at - w.off] == got
                });
            prop_assert!(
                ok,
                "stale byte at {} (read {}+{}): got {:#x}, acknowledged {:#x}, runs {:?}",
                at,
                off,
                len,
                got,
                self.acked[at],
                self.plan.runs
            );
        }
        // Inline fills, then the pins go.
        for f in &self.plan.fills {
            let src = &buf[f.buf_offset as usize..(f.buf_offset + f.len) as usize];
            self.cache[f.cache.0 as usize..(f.cache.0 + f.len) as usize].copy_from_slice(src);
        }
        for p in self.plan.pops.clone() {
            self.core.complete_population(p, true).expect("live pop");
        }
        self.core.end_read(&mut self.plan);
        Ok(())
    }

    fn write(&mut self, off: u32, len: u32, kind: WriteKind, fail_source: bool, fail_cache: bool) {
        let (off, len) = self.range(off, len);
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let data: Vec<u8> = match kind {
            WriteKind::Data => (0..len)
                .map(|i| seq.wrapping_mul(31) ^ (i / 512) as u8 ^ 0xA5)
                .collect(),
            WriteKind::Discard => vec![0; len as usize],
        };
        let plan = self
            .core
            .begin_write(SourceOffset(off), len, kind)
            .expect("in range");
        let n = plan.cache_writes.len();
        self.writes.push(PendingWrite {
            plan,
            off: off as usize,
            data,
            fail_source,
            fail_cache,
            source: SourceState::Pending,
            copies_done: vec![false; n],
        });
    }

    fn source_land(&mut self, i: u16) {
        let pending: Vec<usize> = (0..self.writes.len())
            .filter(|&k| self.writes[k].source == SourceState::Pending)
            .collect();
        if pending.is_empty() {
            return;
        }
        let w = &mut self.writes[pending[i as usize % pending.len()]];
        if !w.fail_source {
            self.source[w.off..w.off + w.data.len()].copy_from_slice(&w.data);
        }
        w.source = SourceState::Landed;
    }

    fn source_ack(&mut self, i: u16) {
        let landed: Vec<usize> = (0..self.writes.len())
            .filter(|&k| self.writes[k].source == SourceState::Landed)
            .collect();
        if landed.is_empty() {
            return;
        }
        let k = landed[i as usize % landed.len()];
        let w = &mut self.writes[k];
        // The client now learns the outcome: what the source holds there is acknowledged.
        let (off, len) = (w.off, w.data.len());
        self.acked[off..off + len].copy_from_slice(&self.source[off..off + len]);
        w.source = SourceState::Acked;
        let (id, ok) = (w.plan.id, !w.fail_source);
        self.core.write_source_done(id, ok).expect("live write");
        self.retire(k);
    }

    /// Forgets a write once it is acknowledged and all its cache copies are done.
    fn retire(&mut self, k: usize) {
        let w = &self.writes[k];
        if w.source == SourceState::Acked && w.copies_done.iter().all(|d| *d) {
            self.writes.remove(k);
        }
    }

    fn cache_copy(&mut self, i: u16, j: u16) -> Result<(), TestCaseError> {
        let cands: Vec<usize> = (0..self.writes.len())
            .filter(|&k| self.writes[k].copies_done.iter().any(|d| !d))
            .collect();
        if cands.is_empty() {
            return Ok(());
        }
        let k = cands[i as usize % cands.len()];
        let w = &mut self.writes[k];
        let open: Vec<usize> = (0..w.copies_done.len())
            .filter(|&c| !w.copies_done[c])
            .collect();
        let c = open[j as usize % open.len()];
        let cw = w.plan.cache_writes[c];
        let dst = &mut self.cache[cw.cache.0 as usize..(cw.cache.0 + cw.len) as usize];
        if w.fail_cache {
            dst.iter_mut().for_each(|b| *b = 0xBD);
        } else {
            dst.copy_from_slice(&w.data[cw.buf_offset as usize..(cw.buf_offset + cw.len) as usize]);
        }
        w.copies_done[c] = true;
        let id = w.plan.id;
        let ok = !w.fail_cache;
        self.core
            .write_cache_done(id, cw.part, ok)
            .expect("live copy");
        self.retire(k);
        Ok(())
    }
}

proptest! {
    #![proptest_config(Config {
        cases: 10_000,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..Config::default()
    })]

    #[test]
    fn reads_never_return_stale_data((cfg, source_size, cache_size) in config(), ops in prop::collection::vec(op(), 1..80)) {
        let mut h = Harness::new(cfg, source_size, cache_size);
        for op in ops {
            match op {
                Op::Read { off, len } => h.read(off, len)?,
                Op::Write { off, len, fail_source, fail_cache } => h.write(off, len, WriteKind::Data, fail_source, fail_cache),
                Op::Discard { off, len } => h.write(off, len, WriteKind::Discard, false, false),
                Op::SourceLand(i) => h.source_land(i),
                Op::SourceAck(i) => h.source_ack(i),
                Op::CacheCopy(i, j) => h.cache_copy(i, j)?,
                Op::PickPopulation => {
                    if let Some(job) = h.core.pick_population_unthrottled() {
                        h.pops.push(PendingPop { job, data: None });
                    }
                }
                Op::Prefetch(o) => {
                    let off = (o as u64 % (source_size / 512)) * 512;
                    if let Some(job) = h.core.prefetch(SourceOffset(off)) {
                        h.pops.push(PendingPop { job, data: None });
                    }
                }
                Op::PopReadSource(i, fail) => {
                    let idle: Vec<usize> = (0..h.pops.len()).filter(|&k| h.pops[k].data.is_none()).collect();
                    if !idle.is_empty() {
                        let k = idle[i as usize % idle.len()];
                        let j = &h.pops[k].job;
                        let span = h.source[j.source.0 as usize..(j.source.0 + j.len) as usize].to_vec();
                        h.pops[k].data = Some(if fail { Err(()) } else { Ok(span) });
                    }
                }
                Op::PopWriteCache(i, fail) => {
                    let read: Vec<usize> = (0..h.pops.len()).filter(|&k| h.pops[k].data.is_some()).collect();
                    if !read.is_empty() {
                        let k = read[i as usize % read.len()];
                        let p = h.pops.remove(k);
                        let ok = match (&p.data, fail) {
                            (Some(Ok(span)), false) => {
                                for &(o, l, c) in &p.job.runs {
                                    h.cache[c.0 as usize..(c.0 + l) as usize].copy_from_slice(&span[o as usize..(o + l) as usize]);
                                }
                                true
                            }
                            (Some(Ok(_)), true) => {
                                // A failed cache write may have landed partly: garbage.
                                for &(_, l, c) in &p.job.runs {
                                    h.cache[c.0 as usize..(c.0 + l) as usize].iter_mut().for_each(|b| *b = 0xC3);
                                }
                                false
                            }
                            _ => false,
                        };
                        h.core.complete_population(p.job.id, ok).expect("live pop");
                    }
                }
                Op::EvictOne => {
                    h.core.evict_one();
                }
                Op::EvictFragment(f) => {
                    let n = source_size.div_ceil(h.core.geometry().fragment_size());
                    h.core.evict_fragment(FragNo(f as u64 % n));
                }
            }
        }
        // Drain everything in flight, then every byte must read back as acknowledged.
        while !h.pops.is_empty() {
            let p = h.pops.remove(0);
            h.core.complete_population(p.job.id, false).expect("live pop");
        }
        while h.writes.iter().any(|w| w.source == SourceState::Pending) {
            h.source_land(0);
        }
        while h.writes.iter().any(|w| w.source == SourceState::Landed) {
            h.source_ack(0);
        }
        while h.writes.iter().any(|w| w.copies_done.iter().any(|d| !d)) {
            h.cache_copy(0, 0)?;
        }
        prop_assert_eq!(h.core.operations_in_flight(), (0, 0));
        prop_assert_eq!(h.core.awt_bytes_in_flight(), 0);
        let sectors = (source_size / 512) as u32;
        h.read(0, sectors)?;
        prop_assert_eq!(&h.acked, &h.source);
    }
}
