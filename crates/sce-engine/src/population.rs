//! Population: the background workers (Algorithm 1's throttle decides how many run and how
//! often), explicit population (`populate_now`) and prefetch (NBD CACHE). Each job reads a
//! span of the source and writes its runs into the slot, then completes its [`Population`]
//! token; with persistence, a slot whose record may name another fragment is guarded by its
//! write intent first.

use crate::checks::Checks;
use crate::cores::Cores;
use crate::devices::Devices;
use crate::engine::{DeviceFaults, Engine};
use crate::order::{levels, OrderedMutex};
use crate::persist::{Persist, Ticket};
use crate::stats::Counters;
use sce_core::{OnShard, Population};
use sce_io::{AlignedBuf, BlockDevice, IoError, Op};
use std::sync::atomic::Ordering::Relaxed;

/// The role that populates: reads a job's span of the source and writes its runs into the
/// cache, holding the subsystems it uses; device writes and intents are judged through
/// `faults` (the engine). `Engine::populator` builds it.
pub(crate) struct Populator<'a> {
    pub(crate) dev: &'a Devices,
    pub(crate) cores: &'a Cores,
    pub(crate) checks: &'a Checks,
    pub(crate) counters: &'a Counters,
    pub(crate) persist: Option<&'a Persist>,
    /// log2 of the fragment size.
    pub(crate) fshift: u32,
    pub(crate) faults: &'a dyn DeviceFaults,
    /// When to populate: the volume's configuration (miss fills), the source's load,
    /// passthrough and shutdown.
    pub(crate) config: &'a OrderedMutex<levels::EngineConfig, sce_core::CoreConfig>,
    pub(crate) source_load: &'a crate::load::SourceLoad,
    pub(crate) health: &'a crate::health::Health,
    pub(crate) signals: &'a crate::engine::Signals,
}

impl Populator<'_> {
    /// Performs a population job (in global addresses) with `buf` (at least a fragment long)
    /// and completes it on its shard; true if its data was read and written.
    pub(crate) fn run(&self, job: OnShard<Population>, buf: &mut AlignedBuf) -> bool {
        let cores = self.cores;
        let slot = job.slot.0;
        let source = job.source.0;
        if let Some(p) = &self.persist {
            // Data of another fragment may still be claimed by a slot's record: the job's, or
            // (a job of the page area) each packed slot its runs write to.
            let line = 1u64 << self.fshift;
            let mut guards: Vec<(u32, u64)> = job
                .runs
                .iter()
                .map(|&(o, _, c)| {
                    let c = c.0;
                    let f = crate::persist::Persist::fill_fragment(source + o, c, line);
                    ((c >> self.fshift) as u32, f)
                })
                .collect();
            guards.sort_unstable();
            guards.dedup();
            let t: Vec<Ticket> = guards
                .into_iter()
                .flat_map(|(sl, f)| p.guard_slot(sl, f))
                .collect();
            if !self.faults.wait_intents(&t) {
                cores.finish(job, |job, core| job.complete(core, false));
                return false;
            }
        }
        let span = &mut buf[..job.len as usize];
        let mut ok = match self.dev.source.read_at(source, span) {
            Ok(()) => {
                self.counters.source_bytes_read.add(job.len);
                true
            }
            Err(_) => false,
        };
        if ok {
            for &(o, l, c) in &job.runs {
                self.checks
                    .record(source + o, c.0, &buf[o as usize..(o + l) as usize]);
            }
            for &(o, l, c) in &job.runs {
                ok &= self
                    .faults
                    .cache_write(c.0, &buf[o as usize..(o + l) as usize]);
                if !ok {
                    break;
                }
            }
        }
        cores.finish(job, |job, core| job.complete(core, ok));
        if let (true, Some(p)) = (ok, &self.persist) {
            p.warm(slot);
        }
        ok
    }
}

/// Population worker `index`: visits the core shards in turn, one per wake-up (so the
/// workers pick as often as with one shard, and each shard's throttle, Algorithm 1, sees
/// its own miss rate and free space); wakes as the visited shard's throttle says and, if
/// it may run, populates the fragment that shard picks (after a cycle that populated, it
/// wakes after the throttle's `after_pick` instead). Worker 0 applies the visited
/// shard's read logs before it reads the throttle, and every worker that picks applies
/// them right before it picks.
pub(crate) fn population_worker(e: &Engine, index: u32) {
    let s = e.populator();
    let fsize = 1usize << s.fshift;
    let mut buf: Option<AlignedBuf> = None;
    let cores = s.cores;
    let shards = cores.count();
    let mut turn = index as usize % shards;
    // After a cycle that populated: the picked shard's `after_pick`, as the simulator sleeps.
    let mut after_pick = None;
    loop {
        let k = turn;
        turn = (turn + 1) % shards;
        // With miss fills the cache fills from the clients' misses while the source shows a
        // queue; re-reading the source for population waits until it shows none.
        let busy = !s.source_load.has_room() && s.config.lock().fills_from_misses();
        let st = cores.with_shard(k, |core| {
            core.set_source_busy(busy);
            if index == 0 {
                // Reads batch their accounting per shard; a slow trickle of reads would
                // otherwise never reach the hotness window and the miss rate.
                cores.apply_logs(k, core);
            }
            core.throttle(cores.now())
        });
        if index == 0 {
            s.counters
                .active_workers
                .store(st.active_workers as u64, Relaxed);
        }
        if !s.signals.sleep(after_pick.take().unwrap_or(st.period)) {
            return;
        }
        if index >= st.active_workers || s.health.passthrough() {
            continue;
        }
        if busy {
            s.counters.population_source_busy.fetch_add(1, Relaxed);
            continue;
        }
        let job = cores.global(k, |core| {
            // The misses since the throttle was read: a batch of hits applied meanwhile has
            // pushed those applied then out of the hotness window.
            cores.apply_logs(k, core);
            core.pick_population(cores.now())
        });
        if let Some(job) = job {
            after_pick = Some(st.after_pick);
            let b = buf.get_or_insert_with(|| AlignedBuf::new(fsize));
            s.run(job, b);
        }
    }
}

impl Populator<'_> {
    /// Runs population on the calling thread until nothing more is picked (in any shard) or
    /// `max` jobs ran, ignoring the throttle; the shards are asked in turn. Returns the
    /// number of fragments populated.
    pub(crate) fn populate_now(&self, max: usize) -> usize {
        // Reads not yet accounted count as accesses for the pick.
        self.cores.apply_all_logs();
        let mut buf = AlignedBuf::new(1 << self.fshift);
        let shards = self.cores.count();
        let (mut n, mut k, mut idle) = (0, 0, 0);
        while n < max && idle < shards {
            let job = self
                .cores
                .global(k, |core| core.pick_population_unthrottled());
            match job {
                Some(job) => {
                    self.run(job, &mut buf);
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
        let size = self.dev.size;
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
            if let Some(job) = self.cores.at_source(at, |core| core.prefetch(at)) {
                self.run(job, &mut buf);
            }
            at += fsize;
        }
        Ok(())
    }
}
