//! The read path: a request is cut into pieces, one per core shard it touches (with one
//! shard, the request itself), each read on its own: plan under its core shard's shared
//! lock (its accounting deferred to a log shard), or under the shard's exclusive lock when
//! admission `always` wants inline fills; run the
//! planned I/O on the caller's thread, cached runs verified against their checksums; write
//! the inline fills; release the pins (the read's [`PinnedRead`] guard does, when dropped).

use crate::shard::thread_index;
use crate::shared::{request_error, Shared, LOG_BATCH, LOG_CAP, LOG_SHARDS};
use sce_core::{PinnedRead, Populating, ReadPlan, RunTarget, SourceOffset};
use sce_io::{BlockDevice, IoError, Op};
use std::cell::RefCell;
use std::sync::atomic::Ordering::Relaxed;

/// A read's plan and the checksums its cached pages had when it was planned.
#[derive(Default)]
struct PlannedRead {
    plan: ReadPlan,
    /// For each `RunTarget::Cache` run, in order: the expected checksum of every page the run
    /// touches, taken under the core lock that made the pages hits.
    want: Vec<u32>,
}

thread_local! {
    static PLAN: RefCell<PlannedRead> = RefCell::new(PlannedRead::default());
}

impl Shared {
    /// Reads `buf.len()` bytes at `offset` (a range the caller checked) through the cache.
    pub(crate) fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        if self.passthrough.load(Relaxed) {
            let r = self.source.read_at(offset, buf);
            if r.is_ok() {
                self.counters.source_bytes_read.add(len);
            }
            return r;
        }
        if self.map.shards() == 1 {
            return self.read_piece(0, offset, offset, buf).map(|_| ());
        }
        let (mut result, mut pieces, mut full) = (Ok(()), 0, 0);
        for p in self.map.pieces(offset, len) {
            let b = &mut buf[p.buf_offset as usize..(p.buf_offset + p.len) as usize];
            match self.read_piece(p.shard, p.offset, p.local, b) {
                Ok(f) => {
                    pieces += 1;
                    full += f as u64;
                }
                Err(e) => result = Err(e),
            }
        }
        self.counters.split_request(true, pieces, full);
        result
    }

    /// Reads the piece at global offset `offset` (`local` on core shard `k`'s source) into
    /// `buf`. Returns whether it was a full hit.
    fn read_piece(
        &self,
        k: usize,
        offset: u64,
        local: u64,
        buf: &mut [u8],
    ) -> Result<bool, IoError> {
        PLAN.with(|cell| {
            let mut planned = cell.borrow_mut();
            let PlannedRead { plan, want } = &mut *planned;
            let mut read = self.plan(k, (offset, local), buf.len() as u64, plan, want)?;
            self.preset_intents(&read);
            let result = self.read_runs(offset, buf, &read, want);
            let pops = read.take_populations();
            if !pops.is_empty() {
                self.write_fills(k, offset, buf, &read, pops, result.is_ok());
            }
            let full = read.full_hit;
            // Dropping the read releases its pins, without the core lock.
            drop(read);
            result.map(|()| full)
        })
    }

    /// Plans a read of core shard `k` (`at`: its global and local offsets) and takes the
    /// expected checksums of its cached pages with it: under the shared lock, its
    /// accounting deferred to a log shard; or, if it wants inline fills, again under the
    /// exclusive lock, the fills' slots guarded by write intents (a fill whose intents
    /// cannot be written is dropped). The plan's addresses are global.
    fn plan<'p>(
        &'p self,
        k: usize,
        at: (u64, u64),
        len: u64,
        plan: &'p mut ReadPlan,
        want: &mut Vec<u32>,
    ) -> Result<PinnedRead<'p>, IoError> {
        let (offset, local) = at;
        let err = |e| request_error(Op::Read, e, offset, len, self.source.size(), self.lbs);
        let mut read = {
            let core = self.cores[k].read();
            let mut read = PinnedRead::plan(&core, &self.pins[k], SourceOffset(local), len, plan)
                .map_err(err)?;
            read.globalize(&self.map, k);
            self.expected_crcs(&read, want);
            read
        };
        if !read.needs_commit() {
            self.log_read(k, &read);
            return Ok(read);
        }
        // An inline fill is wanted (admission `always`): redo it exclusively.
        let mut core = self.cores[k].write();
        core.advance_clock(self.now());
        read.commit(&mut core).map_err(err)?;
        read.globalize(&self.map, k);
        self.expected_crcs(&read, want);
        if let Some(p) = &self.persist {
            // Inline fills go to freshly allocated slots: guard them as populations.
            let mut t = Vec::new();
            for f in &read.fills {
                let slot = (f.cache.0 >> self.fshift) as u32;
                let frag = (offset + f.buf_offset) >> self.fshift;
                t.extend(p.guard_slot(slot, frag));
            }
            drop(core);
            if !self.wait_intents(&t) {
                read.clear_fills();
            }
        }
        Ok(read)
    }

    /// Records a read planned under core shard `k`'s shared lock in this thread's log shard
    /// for it, and applies the log to the core shard once it holds `LOG_BATCH` reads and the
    /// exclusive lock is free at once, or once it holds `LOG_CAP` reads whatever it costs.
    pub(crate) fn log_read(&self, k: usize, plan: &ReadPlan) {
        // Lock order: a log shard is a leaf lock, released before the core lock is taken;
        // the log is then taken out of the shard under the core lock (core, then leaf).
        let shard = &self.logs_of(k)[thread_index() % LOG_SHARDS];
        let pending = {
            let mut log = shard.0.lock();
            log.record(plan);
            log.requests()
        };
        if pending < LOG_BATCH {
            return;
        }
        let core = if pending < LOG_CAP {
            self.cores[k].try_write()
        } else {
            Some(self.cores[k].write())
        };
        if let Some(mut core) = core {
            core.apply_access_log(&mut shard.0.lock());
        }
    }

    /// Runs a read's I/O into `buf` (the request at `offset`): cached runs verified against
    /// `want` and served from the source when the cache cannot supply correct data, the
    /// others from the source.
    fn read_runs(
        &self,
        offset: u64,
        buf: &mut [u8],
        plan: &ReadPlan,
        want: &[u32],
    ) -> Result<(), IoError> {
        let mut result = Ok(());
        let (mut from_source, mut from_cache) = (0, 0);
        let mut w = 0;
        for run in &plan.runs {
            let dst = &mut buf[run.buf_offset as usize..(run.buf_offset + run.len) as usize];
            let src_off = offset + run.buf_offset;
            match run.target {
                RunTarget::Cache(c) => {
                    // Without checksums (`verify` off) `want` is empty.
                    let n = self.run_pages(c.0, run.len);
                    let expect = want.get(w..w + n).unwrap_or(&[]);
                    w += n;
                    if self.read_cache_run(c.0, src_off, dst, expect) {
                        from_cache += run.len;
                    } else {
                        // Unreadable or bad cached data: serve the run from the source.
                        match self.source.read_at(src_off, dst) {
                            Ok(()) => from_source += run.len,
                            Err(e) => result = Err(e),
                        }
                    }
                }
                RunTarget::Source(so) => match self.source.read_at(so.0, dst) {
                    Ok(()) => from_source += run.len,
                    Err(e) => result = Err(e),
                },
            }
        }
        // Shared counters: a hit leaves the source's alone (no write to a shared line).
        if from_source > 0 {
            self.counters.source_bytes_read.add(from_source);
        }
        if from_cache > 0 {
            self.counters.cache_bytes_read.add(from_cache);
        }
        result
    }

    /// Writes a read's inline fills (admission `always`, core shard `k`) from the data it read into `buf`
    /// and completes their populations: failed if the read failed, if a population has no
    /// fill left, or if a fill could not be written.
    fn write_fills(
        &self,
        k: usize,
        offset: u64,
        buf: &[u8],
        plan: &ReadPlan,
        pops: Vec<Populating>,
        read_ok: bool,
    ) {
        let mut done = Vec::with_capacity(pops.len());
        for pop in pops {
            let mut ok = read_ok;
            if ok {
                let fills = plan.fills.iter().filter(|f| f.pop == pop.id());
                ok &= fills.clone().next().is_some();
                for f in fills {
                    let piece = &buf[f.buf_offset as usize..(f.buf_offset + f.len) as usize];
                    self.record_crcs(offset + f.buf_offset, f.cache.0, piece);
                    ok &= self.cache_write(f.cache.0, piece);
                }
            }
            done.push((pop, ok));
        }
        let mut core = self.cores[k].write();
        for (pop, ok) in done {
            pop.complete(&mut core, ok);
        }
    }

    /// Sets ahead of need the intents of recently written slots that this read hits, and
    /// wakes the intent writer if any was set (see `Persist::preset`).
    pub(crate) fn preset_intents(&self, plan: &ReadPlan) {
        let Some(p) = &self.persist else { return };
        let mut last = u32::MAX;
        let mut any = false;
        for run in &plan.runs {
            if let RunTarget::Cache(c) = run.target {
                let slot = (c.0 >> self.fshift) as u32;
                if slot != last {
                    any |= p.preset(slot);
                    last = slot;
                }
            }
        }
        if any {
            *self.intent_pending.lock() = true;
            self.intent_wake.notify_one();
        }
    }
}
