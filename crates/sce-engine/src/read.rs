//! The read path: a request is cut into pieces, one per core shard it touches (with one
//! shard, the request itself). Every piece is planned first: under its core shard's shared
//! lock (its accounting deferred to a log shard), or under the shard's exclusive lock when
//! admission `always` (or `sce` with miss fills) wants inline fills. Then the planned I/O
//! runs on the caller's thread:
//! cached runs verified against their checksums, and source runs that follow each other
//! across pieces merged into one source read (a request over several fragments costs one
//! round trip to the source, not one per fragment). Then the inline fills are handed to
//! the fill writers (`fills.rs`), which write them once their intents are durable, and the
//! pins are released (each piece's [`PinnedRead`] guard does, when dropped): the reply
//! waits for neither the fills nor their intents.

use crate::checks::Checks;
use crate::cores::Cores;
use crate::engine::{DeviceFaults, Signals};
use crate::fills::{FillJob, FillQueue};
use crate::health::Health;
use crate::load::SourceLoad;
use crate::persist::{Persist, Ticket};
use crate::verify::Verifier;
use sce_core::{Piece, PinnedRead, ReadPlan, RunTarget};
use sce_io::{BlockDevice, IoError, Op};
use std::cell::RefCell;

/// A read's plan and the checksums its cached pages had when it was planned.
#[derive(Default)]
struct PlannedRead {
    plan: ReadPlan,
    /// For each `RunTarget::Cache` run, in order: the expected checksum of every page the run
    /// touches, taken under the core lock that made the pages hits.
    want: Vec<u32>,
}

/// One planned piece of a request: where it lies in the request's buffer, its plan (pins
/// held) and its cached pages' expected checksums.
struct PlannedPiece<'p> {
    buf_offset: u64,
    read: PinnedRead<'p>,
    want: &'p [u32],
}

thread_local! {
    /// The plans of this thread's reads, one per piece, reused from read to read.
    static PLANS: RefCell<Vec<PlannedRead>> = const { RefCell::new(Vec::new()) };
}

/// A source read being gathered from runs that follow each other in the source and in the
/// request's buffer: (source offset, buffer offset, length).
type SourceSpan = (u64, u64, u64);

/// The role that reads through the cache: plans each piece on its core shard, reads the
/// cached runs (verified) and the source runs, and hands the inline fills to the fill
/// writers. It holds the subsystems it uses; device errors, cache writes and intents are
/// judged through `faults` (the engine). `Engine::reader` builds it.
pub(crate) struct Reader<'a> {
    /// Its verifier of cached runs, which holds the devices, the shards, the checksums, the
    /// counters, the fragment size and the engine's judged I/O (`faults`) for both.
    pub(crate) verify: Verifier<'a>,
    pub(crate) health: &'a Health,
    pub(crate) persist: Option<&'a Persist>,
    pub(crate) signals: &'a Signals,
    pub(crate) source_load: &'a SourceLoad,
    pub(crate) fills: &'a FillQueue,
}

impl<'a> Reader<'a> {
    /// What its fills are written with.
    fn fill_parts(&self) -> (&Cores, &Checks, &dyn DeviceFaults) {
        (self.verify.cores, self.verify.checks, self.verify.faults)
    }
}

impl Reader<'_> {
    /// Reads `buf.len()` bytes at `offset` (a range the caller checked) through the cache,
    /// timed into the hit or the miss histogram; true if every byte came from the cache.
    pub(crate) fn read(&self, offset: u64, buf: &mut [u8]) -> Result<bool, IoError> {
        let lat = &self.verify.counters.latencies;
        let _in_flight = crate::stats::InFlight::new(&lat.in_flight);
        let t0 = std::time::Instant::now();
        let r = self.read_timed(offset, buf);
        match r {
            Ok(true) => lat.read_hit.record_since(t0),
            _ => lat.read_miss.record_since(t0),
        }
        r
    }

    /// `read`'s work: true if every byte came from the cache.
    fn read_timed(&self, offset: u64, buf: &mut [u8]) -> Result<bool, IoError> {
        let len = buf.len() as u64;
        if self.health.passthrough() {
            let r = self.verify.dev.source.read_at(offset, buf);
            if r.is_ok() {
                self.verify.counters.source_bytes_read.add(len);
            }
            return r.map(|_| false);
        }
        PLANS.with(|cell| {
            let mut plans = cell.borrow_mut();
            let n = self.verify.cores.pieces(offset, len).count();
            if plans.len() < n {
                plans.resize_with(n, PlannedRead::default);
            }
            if n == 1 {
                // One piece (always, with one core shard): no gathering, no allocation.
                return self.read_one(offset, buf, &mut plans[0]);
            }
            self.read_split(offset, buf, n, &mut plans)
        })
    }

    /// `read_timed` of a request that is one piece.
    fn read_one(
        &self,
        offset: u64,
        buf: &mut [u8],
        planned: &mut PlannedRead,
    ) -> Result<bool, IoError> {
        let mut tickets = Vec::new();
        let len = buf.len() as u64;
        let p = self
            .verify
            .cores
            .pieces(offset, len)
            .next()
            .expect("a piece");
        let PlannedRead { plan, want } = planned;
        let read = self.plan(&p, plan, want, &mut tickets)?;
        let mut piece = PlannedPiece {
            buf_offset: 0,
            read,
            want,
        };
        self.preset_intents(&piece.read);
        let result = self.read_runs(offset, buf, &[&piece]);
        let full = piece.read.full_hit;
        // The fills go to the fill writers with the intents that guard them: the
        // reply waits for neither.
        let mut fills = FillJob::new(tickets);
        let pops = piece.read.take_populations();
        fills.add(
            self.fills,
            (p.shard, p.offset),
            buf,
            &piece.read,
            pops,
            result.is_ok(),
        );
        if !fills.is_empty() {
            self.fills
                .send(self.verify.counters, self.fill_parts(), fills);
        }
        result.map(|_| full)
    }

    /// `read_timed` of a request cut into `n` pieces (across core shards).
    fn read_split(
        &self,
        offset: u64,
        buf: &mut [u8],
        n: usize,
        plans: &mut [PlannedRead],
    ) -> Result<bool, IoError> {
        let len = buf.len() as u64;
        let mut tickets = Vec::new();
        let mut result = Ok(());
        let mut pieces = Vec::with_capacity(n);
        let mut placed = Vec::with_capacity(n);
        for (p, planned) in self.verify.cores.pieces(offset, len).zip(plans.iter_mut()) {
            let PlannedRead { plan, want } = planned;
            match self.plan(&p, plan, want, &mut tickets) {
                Ok(read) => {
                    self.preset_intents(&read);
                    placed.push(p);
                    let buf_offset = p.buf_offset;
                    pieces.push(PlannedPiece {
                        buf_offset,
                        read,
                        want,
                    });
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() {
            let planned: Vec<&PlannedPiece> = pieces.iter().collect();
            result = self.read_runs(offset, buf, &planned);
        }
        let full = pieces.iter().filter(|x| x.read.full_hit).count() as u64;
        self.verify
            .counters
            .split_request(true, pieces.len() as u64, full);
        let all_hit = full == pieces.len() as u64 && pieces.len() == n;
        // Every piece's fills in one job, behind the intents of all (one wait).
        let mut fills = FillJob::new(tickets);
        for (p, mut x) in placed.into_iter().zip(pieces) {
            let b = &buf[p.buf_offset as usize..(p.buf_offset + p.len) as usize];
            let pops = x.read.take_populations();
            fills.add(
                self.fills,
                (p.shard, p.offset),
                b,
                &x.read,
                pops,
                result.is_ok(),
            );
        }
        if !fills.is_empty() {
            self.fills
                .send(self.verify.counters, self.fill_parts(), fills);
        }
        result.map(|_| all_hit)
    }

    /// Plans a read of `p` and takes the expected checksums of its cached pages with it:
    /// under the shard's shared lock, its accounting deferred to a log shard; or, if it
    /// wants inline fills, again under the exclusive lock, the fills' slots guarded by write
    /// intents (the caller waits for `tickets`, which this adds to, before it writes the
    /// fills). The plan's addresses are global.
    fn plan<'p>(
        &'p self,
        p: &Piece,
        plan: &'p mut ReadPlan,
        want: &mut Vec<u32>,
        tickets: &mut Vec<Ticket>,
    ) -> Result<PinnedRead<'p>, IoError> {
        let err = |e| self.verify.dev.refused(Op::Read, e, p.offset, p.len);
        let mut missing = None;
        let mut read = self
            .verify
            .cores
            .plan_read(p, plan, |read| {
                missing = self.verify.checks.expected(read, want).err();
            })
            .map_err(err)?;
        // Checksums not in memory: read with no lock held (the plan's pins keep its slots).
        let mut units = Vec::new();
        self.expected_unlocked(&read, want, missing, &mut units);
        if !read.needs_commit() {
            self.verify.cores.log_read(p.shard, &read);
            return Ok(read);
        }
        // An inline fill is wanted (admission `always`, or a miss fill): redo it exclusively.
        self.verify
            .cores
            .commit_read(p.shard, &mut read, |read, _| {
                missing = self.verify.checks.expected(read, want).err();
            })
            .map_err(err)?;
        self.expected_unlocked(&read, want, missing, &mut units);
        if let Some(persist) = self.persist {
            // Inline fills go to freshly allocated slots: guard them as populations.
            for f in &read.fills {
                let slot = (f.cache.0 >> self.verify.fshift) as u32;
                let src = p.offset + f.buf_offset;
                let frag =
                    crate::persist::Persist::fill_fragment(src, f.cache.0, 1 << self.verify.fshift);
                tickets.extend(persist.guard_slot(slot, frag));
            }
        }
        Ok(read)
    }

    /// Completes `want` for `read` when its plan named a unit whose checksums are not in
    /// memory (`missing`): pins that unit (reads its records; kept in `units`), and again
    /// until every page's checksum is known. Taken after the lock, a checksum may be newer
    /// than the plan (a write replaced the page since): the page then fails verification
    /// and is read from the source, as when a write replaces it after its checksum was
    /// taken (see `read_cache_run`).
    fn expected_unlocked<'c>(
        &'c self,
        read: &ReadPlan,
        want: &mut Vec<u32>,
        mut missing: Option<u32>,
        units: &mut Vec<crate::crcs::UnitPin<'c>>,
    ) {
        while let Some(u) = missing {
            match self.verify.checks.pin(u) {
                Ok(pin) => units.extend(pin),
                // The source has every page the core holds: those of this unit are read
                // from it (their checksums unknown, they fail verification).
                Err(e) => {
                    self.verify.faults.cache_read_failed(&e);
                    self.verify.checks.expected_or_unknown(read, want);
                    return;
                }
            }
            missing = self.verify.checks.expected(read, want).err();
        }
    }

    /// Runs the I/O of a request's planned pieces into `buf` (the request at `offset`):
    /// cached runs verified against their checksums and served from the source when the
    /// cache cannot supply correct data; source runs gathered into one source read while
    /// they follow each other in the source and in the buffer.
    fn read_runs(
        &self,
        offset: u64,
        buf: &mut [u8],
        pieces: &[&PlannedPiece],
    ) -> Result<(), IoError> {
        let mut result = Ok(());
        let (mut from_source, mut from_cache) = (0, 0);
        let mut span: Option<SourceSpan> = None;
        let mut source_read = |span: SourceSpan, buf: &mut [u8], from_source: &mut u64| {
            let (so, at, len) = span;
            let t0 = std::time::Instant::now();
            match self
                .verify
                .dev
                .source
                .read_at(so, &mut buf[at as usize..(at + len) as usize])
            {
                Ok(()) => {
                    *from_source += len;
                    self.source_load.record(len, t0.elapsed());
                }
                Err(e) => result = Err(e),
            }
        };
        let verifier = &self.verify;
        for piece in pieces {
            let mut w = 0;
            for run in &piece.read.runs {
                let at = piece.buf_offset + run.buf_offset;
                match run.target {
                    RunTarget::Cache(c) => {
                        // Without checksums (`verify` off) `want` is empty.
                        let n = Checks::run_pages(c.0, run.len);
                        let expect = piece.want.get(w..w + n).unwrap_or(&[]);
                        w += n;
                        let dst = &mut buf[at as usize..(at + run.len) as usize];
                        if verifier.read_cache_run(c.0, offset + at, dst, expect) {
                            from_cache += run.len;
                        } else {
                            // Unreadable or bad cached data: serve the run from the source.
                            source_read((offset + at, at, run.len), buf, &mut from_source);
                        }
                    }
                    RunTarget::Source(so) => match &mut span {
                        Some((s0, a0, l)) if *s0 + *l == so.0 && *a0 + *l == at => *l += run.len,
                        _ => {
                            if let Some(done) = span.replace((so.0, at, run.len)) {
                                source_read(done, buf, &mut from_source);
                            }
                        }
                    },
                }
            }
        }
        if let Some(done) = span {
            source_read(done, buf, &mut from_source);
        }
        // Shared counters: a hit leaves the source's alone (no write to a shared line).
        if from_source > 0 {
            self.verify.counters.source_bytes_read.add(from_source);
        }
        if from_cache > 0 {
            self.verify.counters.cache_bytes_read.add(from_cache);
        }
        result
    }

    /// Sets ahead of need the intents of recently written slots that this read hits, and
    /// wakes the intent writer if any was set (see `Persist::preset`).
    pub(crate) fn preset_intents(&self, plan: &ReadPlan) {
        preset_intents(self.persist, self.signals, self.verify.fshift, plan);
    }
}

/// Sets the intents of the slots `plan` reads from ahead of need where they are write-warm
/// (`Persist::preset`), and wakes the intent writer if any was set. A function of what it
/// uses, so that a queued hit calls it without building a reader.
pub(crate) fn preset_intents(
    persist: Option<&Persist>,
    signals: &Signals,
    fshift: u32,
    plan: &ReadPlan,
) {
    let Some(p) = persist else { return };
    let mut last = u32::MAX;
    let mut any = false;
    for run in &plan.runs {
        if let RunTarget::Cache(c) = run.target {
            let slot = (c.0 >> fshift) as u32;
            if slot != last {
                any |= p.preset(slot);
                last = slot;
            }
        }
    }
    if any {
        signals.want_intents();
    }
}
