//! A read's inline fills (admission `always`, and admission `sce`'s miss fills), written
//! after the read is answered: the read copies the bytes it fills the cache with, hands them
//! to the fill writers and returns, so a miss waits for the source and for nothing else
//! (issue 46: a 1 MiB miss used to wait for its 1 MiB cache write, and for the intents
//! that guard it, before its reply went out). Their populations are completed by the
//! writers; until then the pages are not valid, so reads of them go to the source, as
//! they do while a background population is under way.
//!
//! The writers are the volume's own threads (`sce-fill-N`). The queue holds at most
//! [`QUEUED_MAX`] bytes: a fill that finds it full is dropped (its population completes as
//! failed, its pages stay uncached, `fill_bytes_dropped` counts it), so that a cache device
//! slower than the source (a stream read faster than the device writes) never slows the
//! reads; a fill is an offer, not a duty. Once the volume is closing, a read writes its own.

use crate::checks::Checks;
use crate::cores::Cores;
use crate::engine::{DeviceFaults, Engine};
use crate::order::{levels, OrderedMutex};
use crate::persist::Ticket;
use crate::stats::Counters;
use crossbeam_channel::{Receiver, Sender};
/// This file's mutexes are leaves of the lock order (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use sce_core::{Populating, ReadPlan};
use sce_io::AlignedBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The most bytes of fills waiting for the writers (beyond it a fill is dropped).
pub(crate) const QUEUED_MAX: u64 = 64 << 20;

/// One cache write of a fill: the bytes read for global source offset `global`, to write at
/// cache device offset `cache`.
struct FillWrite {
    global: u64,
    cache: u64,
    data: AlignedBuf,
}

/// The fills of one piece of a read (one core shard's): per population, its writes.
struct FillPiece {
    shard: usize,
    pops: Vec<(Populating, Vec<FillWrite>)>,
}

/// A read's fills, taken from its plans: what the writers need once the read is answered.
#[derive(Default)]
pub(crate) struct FillJob {
    /// The intents that guard the fills' slots (written while the source read ran).
    tickets: Vec<Ticket>,
    pieces: Vec<FillPiece>,
    /// Bytes of the fills kept, their room taken in the queue.
    bytes: u64,
    /// Bytes of the fills dropped because the queue had no room for them.
    dropped: u64,
}

thread_local! {
    /// Set while a read on this thread must not fill the cache (`without_fills`).
    static NO_FILLS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the reads it makes on this thread filling nothing: the write-back log's
/// merge of a write's edge pages reads them only to overwrite them in the log, and a fill
/// of their old bytes (into the page area, say) would be a cache write for nothing.
pub(crate) fn without_fills<T>(f: impl FnOnce() -> T) -> T {
    let before = NO_FILLS.with(|c| c.replace(true));
    let r = f();
    NO_FILLS.with(|c| c.set(before));
    r
}

impl FillJob {
    /// A job waiting for `tickets`.
    pub(crate) fn new(tickets: Vec<Ticket>) -> Self {
        FillJob {
            tickets,
            ..Default::default()
        }
    }

    /// Takes the populations of a piece's plan (`(k, offset)`: its core shard and the global
    /// offset its data `buf` starts at) with copies of the bytes each fill writes, if `queue` has
    /// room for them (else they are dropped, and not copied); none if the read failed (`ok`
    /// false). Populations without fills complete as failed.
    pub(crate) fn add(
        &mut self,
        queue: &FillQueue,
        (k, offset): (usize, u64),
        buf: &[u8],
        plan: &ReadPlan,
        pops: Vec<Populating>,
        ok: bool,
    ) {
        if pops.is_empty() {
            return;
        }
        let bytes: u64 = plan.fills.iter().map(|f| f.len).sum();
        let wanted = !NO_FILLS.with(|c| c.get());
        let keep = ok && wanted && bytes > 0 && queue.reserve(bytes);
        if keep {
            self.bytes += bytes;
        } else if ok && wanted {
            self.dropped += bytes;
        }
        let pops = pops
            .into_iter()
            .map(|pop| {
                let writes: Vec<FillWrite> = (plan.fills.iter())
                    .filter(|f| keep && f.pop == pop.id())
                    .map(|f| {
                        let src = &buf[f.buf_offset as usize..(f.buf_offset + f.len) as usize];
                        let mut data = AlignedBuf::new(src.len());
                        data.copy_from_slice(src);
                        FillWrite {
                            global: offset + f.buf_offset,
                            cache: f.cache.0,
                            data,
                        }
                    })
                    .collect();
                (pop, writes)
            })
            .collect();
        self.pieces.push(FillPiece { shard: k, pops });
    }

    /// True if there is nothing to complete.
    pub(crate) fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Waits for the intents, writes the fills and completes their populations: failed if
    /// the intents could not be made durable, if a population has no fill (the read failed),
    /// or if a fill could not be written.
    pub(crate) fn run(self, (cores, checks, faults): FillParts) {
        // Nothing to write (the read failed, or the fills were dropped): no intent to wait for.
        let guarded = self.bytes > 0 && faults.wait_intents(&self.tickets);
        for piece in self.pieces {
            let mut done = Vec::with_capacity(piece.pops.len());
            for (pop, writes) in piece.pops {
                let mut ok = guarded && !writes.is_empty();
                if ok {
                    for w in &writes {
                        checks.record(w.global, w.cache, &w.data);
                        ok &= faults.cache_write(w.cache, &w.data);
                    }
                }
                done.push((pop, ok));
            }
            cores.with_shard(piece.shard, |core| {
                for (pop, ok) in done {
                    pop.complete(core, ok);
                }
            });
        }
    }
}

/// What a fill job is written with: the core's shards (to complete its populations), the
/// checksums, and the engine's judged device I/O.
pub(crate) type FillParts<'a> = (&'a Cores, &'a Checks, &'a dyn DeviceFaults);

/// The queue to the fill writers (`tx` a leaf lock: `FillQueue::tx` in the lock order).
#[derive(Default)]
pub(crate) struct FillQueue {
    tx: Mutex<Option<Sender<FillJob>>>,
    /// Bytes of fills queued and not yet written.
    queued: AtomicU64,
}

impl FillQueue {
    /// Opens the queue: jobs go to the writers receiving from the other end of `tx`.
    pub(crate) fn open(&self, tx: Sender<FillJob>) {
        *self.tx.lock() = Some(tx);
    }

    /// Closes the queue: the writers finish what is queued, then exit; later reads write
    /// their own fills.
    pub(crate) fn close(&self) {
        self.tx.lock().take();
    }

    /// Takes room for `bytes` of fills: false if the queue holds [`QUEUED_MAX`] already.
    fn reserve(&self, bytes: u64) -> bool {
        if self.queued.fetch_add(bytes, Relaxed) + bytes > QUEUED_MAX {
            self.queued.fetch_sub(bytes, Relaxed);
            return false;
        }
        true
    }

    /// Hands `job` (its room taken by [`FillJob::add`]) to the writers; runs it on this
    /// thread if it writes nothing (its fills dropped, or its read failed) or the queue is
    /// closed.
    pub(crate) fn send(&self, counters: &Counters, parts: FillParts, job: FillJob) {
        if job.is_empty() {
            return;
        }
        counters.fill_bytes_dropped.fetch_add(job.dropped, Relaxed);
        let bytes = job.bytes;
        if bytes == 0 {
            return job.run(parts);
        }
        let unsent = match self.tx.lock().as_ref() {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            self.queued.fetch_sub(bytes, Relaxed);
            job.run(parts);
        }
    }
}

/// A fill writer thread: runs the queued jobs until the queue is closed and empty.
pub(crate) fn fill_writer(e: &Engine, rx: Receiver<FillJob>) {
    let k = e.keeper();
    for job in rx.iter() {
        let bytes = job.bytes;
        job.run(k.fill_parts);
        k.fills.queued.fetch_sub(bytes, Relaxed);
    }
}
