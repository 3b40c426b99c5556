//! Population: the background workers (Algorithm 1's throttle decides how many run and how
//! often), explicit population (`populate_now`) and prefetch (NBD CACHE). Each job reads a
//! span of the source and writes its runs into the slot, then completes its [`Population`]
//! token; with persistence, a slot whose record may name another fragment is guarded by its
//! write intent first.

use crate::persist::Ticket;
use crate::shared::Shared;
use sce_core::{Population, SourceOffset};
use sce_io::{AlignedBuf, BlockDevice, IoError, Op};
use std::sync::atomic::Ordering::Relaxed;

/// Performs a population job with `buf` (at least a fragment long) and completes it.
pub(crate) fn run_population(s: &Shared, job: Population, buf: &mut AlignedBuf) {
    if let Some(p) = &s.persist {
        // Data of another fragment may still be claimed by this slot's record.
        let t: Vec<Ticket> = p.guard_slot(job.slot.0, job.frag.0).into_iter().collect();
        if !s.wait_intents(&t) {
            job.complete(&mut s.core.write(), false);
            return;
        }
    }
    let span = &mut buf[..job.len as usize];
    let mut ok = match s.source.read_at(job.source.0, span) {
        Ok(()) => {
            s.counters.source_bytes_read.add(job.len);
            true
        }
        Err(_) => false,
    };
    if ok {
        for &(o, l, c) in &job.runs {
            s.record_crcs(job.source.0 + o, c.0, &buf[o as usize..(o + l) as usize]);
        }
        for &(o, l, c) in &job.runs {
            ok &= s.cache_write(c.0, &buf[o as usize..(o + l) as usize]);
            if !ok {
                break;
            }
        }
    }
    let slot = job.slot.0;
    job.complete(&mut s.core.write(), ok);
    if let (true, Some(p)) = (ok, &s.persist) {
        p.warm(slot);
    }
}

/// Population worker `index`: wakes as the throttle says and, if it may run, populates the
/// fragment the core picks.
pub(crate) fn population_worker(s: &Shared, index: u32) {
    let fsize = s.core.write().geometry().fragment_size() as usize;
    let mut buf: Option<AlignedBuf> = None;
    loop {
        let st = {
            let mut core = s.core.write();
            if index == 0 {
                // Reads batch their accounting per shard; a slow trickle of reads would
                // otherwise never reach the hotness window and the miss rate.
                s.apply_logs(&mut core);
            }
            core.throttle(s.now())
        };
        if index == 0 {
            s.counters
                .active_workers
                .store(st.active_workers as u64, Relaxed);
        }
        if !s.sleep(st.period) {
            return;
        }
        if index >= st.active_workers || s.passthrough.load(Relaxed) {
            continue;
        }
        let job = s.core.write().pick_population(s.now());
        if let Some(job) = job {
            let b = buf.get_or_insert_with(|| AlignedBuf::new(fsize));
            run_population(s, Population::new(job), b);
        }
    }
}

impl Shared {
    /// Runs population on the calling thread until nothing more is picked or `max` jobs ran,
    /// ignoring the throttle. Returns the number of fragments populated.
    pub(crate) fn populate_now(&self, max: usize) -> usize {
        // Reads not yet accounted count as accesses for the pick.
        self.apply_logs(&mut self.core.write());
        let mut buf = AlignedBuf::new(self.core.write().geometry().fragment_size() as usize);
        let mut n = 0;
        while n < max {
            let job = self.core.write().pick_population_unthrottled();
            let Some(job) = job else { break };
            run_population(self, Population::new(job), &mut buf);
            n += 1;
        }
        n
    }

    /// Prefetches `[offset, offset + len)` into the cache on the calling thread (NBD CACHE).
    pub(crate) fn prefetch(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let size = self.source.size();
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(IoError::OutOfRange {
                op: Op::Read,
                offset,
                len,
                size,
            });
        }
        let fsize = self.core.write().geometry().fragment_size();
        let mut buf = AlignedBuf::new(fsize as usize);
        let mut at = offset - offset % fsize;
        while at < offset + len {
            let job = self.core.write().prefetch(SourceOffset(at));
            if let Some(job) = job {
                run_population(self, Population::new(job), &mut buf);
            }
            at += fsize;
        }
        Ok(())
    }
}
