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

/// Performs a population job of core shard `k` with `buf` (at least a fragment long) and
/// completes it.
pub(crate) fn run_population(s: &Shared, k: usize, job: Population, buf: &mut AlignedBuf) {
    let slot = s.map.slot_to_global(k, job.slot).0;
    if let Some(p) = &s.persist {
        // Data of another fragment may still be claimed by this slot's record.
        let frag = s.map.frag_to_global(k, job.frag).0;
        let t: Vec<Ticket> = p.guard_slot(slot, frag).into_iter().collect();
        if !s.wait_intents(&t) {
            job.complete(&mut s.cores[k].write(), false);
            return;
        }
    }
    let source = s.map.source_to_global(k, job.source).0;
    let span = &mut buf[..job.len as usize];
    let mut ok = match s.source.read_at(source, span) {
        Ok(()) => {
            s.counters.source_bytes_read.add(job.len);
            true
        }
        Err(_) => false,
    };
    if ok {
        for &(o, l, c) in &job.runs {
            let c = s.map.cache_to_global(k, c).0;
            s.record_crcs(source + o, c, &buf[o as usize..(o + l) as usize]);
        }
        for &(o, l, c) in &job.runs {
            let c = s.map.cache_to_global(k, c).0;
            ok &= s.cache_write(c, &buf[o as usize..(o + l) as usize]);
            if !ok {
                break;
            }
        }
    }
    job.complete(&mut s.cores[k].write(), ok);
    if let (true, Some(p)) = (ok, &s.persist) {
        p.warm(slot);
    }
}

/// Population worker `index`: visits the core shards in turn, one per wake-up (so the
/// workers pick as often as with one shard, and each shard's throttle, Algorithm 1, sees
/// its own miss rate and free space); wakes as the visited shard's throttle says and, if
/// it may run, populates the fragment that shard picks. Worker 0 applies the visited
/// shard's read logs before it reads the throttle, and every worker that picks applies
/// them right before it picks.
pub(crate) fn population_worker(s: &Shared, index: u32) {
    let fsize = 1usize << s.fshift;
    let mut buf: Option<AlignedBuf> = None;
    let shards = s.cores.len();
    let mut turn = index as usize % shards;
    loop {
        let k = turn;
        turn = (turn + 1) % shards;
        let st = {
            let mut core = s.cores[k].write();
            if index == 0 {
                // Reads batch their accounting per shard; a slow trickle of reads would
                // otherwise never reach the hotness window and the miss rate.
                s.apply_logs(k, &mut core);
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
        let job = {
            let mut core = s.cores[k].write();
            // The misses since the throttle was read: a batch of hits applied meanwhile has
            // pushed those applied then out of the hotness window.
            s.apply_logs(k, &mut core);
            core.pick_population(s.now())
        };
        if let Some(job) = job {
            let b = buf.get_or_insert_with(|| AlignedBuf::new(fsize));
            run_population(s, k, Population::new(job), b);
        }
    }
}

impl Shared {
    /// Runs population on the calling thread until nothing more is picked (in any shard) or
    /// `max` jobs ran, ignoring the throttle; the shards are asked in turn. Returns the
    /// number of fragments populated.
    pub(crate) fn populate_now(&self, max: usize) -> usize {
        // Reads not yet accounted count as accesses for the pick.
        self.apply_all_logs();
        let mut buf = AlignedBuf::new(1 << self.fshift);
        let shards = self.cores.len();
        let (mut n, mut k, mut idle) = (0, 0, 0);
        while n < max && idle < shards {
            let job = self.cores[k].write().pick_population_unthrottled();
            match job {
                Some(job) => {
                    run_population(self, k, Population::new(job), &mut buf);
                    n += 1;
                    idle = 0;
                }
                None => idle += 1,
            }
            k = (k + 1) % shards;
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
        let fsize = 1u64 << self.fshift;
        let mut buf = AlignedBuf::new(fsize as usize);
        let mut at = offset - offset % fsize;
        while at < offset + len {
            let (k, local) = self.map.source_to_local(SourceOffset(at));
            let job = self.cores[k].write().prefetch(local);
            if let Some(job) = job {
                run_population(self, k, Population::new(job), &mut buf);
            }
            at += fsize;
        }
        Ok(())
    }
}
