//! A write-back write:
//! 1. Takes its pages exclusively in the range lock (reads of them and other writes wait:
//!    a read must never see a page half rewritten in place, whose checksum would then
//!    look like device damage).
//! 2. Reads the edge pages it covers in part (through the cache: the newest bytes) and
//!    writes whole pages from then on, in chunks of at most [`CHUNK`] bytes.
//! 3. Per chunk and core shard: `begin_writeback` under the core lock; the dirty entries
//!    appended under the same lock (`Persist::guard_writeback`); the slots held. A full cache
//!    or I/O in flight on the pages waits for progress (cleaning, a round) and retries:
//!    backpressure, never an error.
//! 4. Waits until the entries are durable, then writes the data, then completes.
//!
//! Without FUA the data may still sit in the cache device's volatile cache; NBD FLUSH (and
//! FUA) flush the cache device (`WriteBack::flush`).

use super::WriteBack;
use crate::engine::{lost_error, Engine};
use crate::persist::{WbGuard, WbPage};
use sce_core::{
    Piece, RequestError, SlotHold, SourceOffset, WriteBackRefusal, WriteBackTxn, PAGE_SIZE,
};
use sce_io::{AlignedBuf, IoError, Op};
use sce_store::journal::PrevPage;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// What `wb_begin` came to.
enum Begun {
    Started(WriteBackTxn, WbGuard),
    /// I/O in flight on the pages.
    Busy,
    /// No clean slot.
    Full,
    /// No room in the journal ring.
    NoJournal,
    /// The checksums of a page the write replaces are not in memory: this unit's.
    Unknown(u32),
}

/// Bytes of one write-back step (its entries must fit the journal ring at once).
pub(crate) const CHUNK: u64 = 256 << 10;

impl WriteBack {
    /// A client's write (`offset`, `data`: a range the caller checked).
    pub(crate) fn write(&self, e: &Engine, offset: u64, data: &[u8]) -> Result<(), IoError> {
        self.last_request.store(e.cores.now().0, Relaxed);
        if e.health.passthrough() {
            return Err(crate::back::cache_failed(offset, data.len() as u64));
        }
        let ps = PAGE_SIZE;
        let end = offset + data.len() as u64;
        let a0 = offset / ps * ps;
        let a1 = (end.div_ceil(ps) * ps).min(e.dev.size);
        // The wait limit counts from here, for the whole write, however many pieces.
        let started = Instant::now();
        let _g = self.ranges.lock(a0, a1, true);
        let merged;
        let bytes: &[u8] = if a0 == offset && a1 == end {
            data
        } else {
            // Whole pages from here on: the edges as they read now (we hold them).
            let mut b = AlignedBuf::new((a1 - a0) as usize);
            if a0 < offset {
                let edge = (a0 + ps).min(a1);
                e.read(a0, &mut b[..(edge - a0) as usize])?;
            }
            let last = (end - 1) / ps * ps;
            if end < a1 && (last > a0 || a0 == offset) {
                e.read(last, &mut b[(last - a0) as usize..])?;
            }
            b[(offset - a0) as usize..(end - a0) as usize].copy_from_slice(data);
            merged = b;
            &merged
        };
        let mut at = a0;
        while at < a1 {
            let n = CHUNK.min(a1 - at);
            let piece = &bytes[(at - a0) as usize..(at - a0 + n) as usize];
            for p in e.cores.pieces(at, n) {
                let buf = &piece[p.buf_offset as usize..(p.buf_offset + p.len) as usize];
                self.piece(e, &p, buf, started)?;
            }
            at += n;
        }
        Ok(())
    }

    /// Zeroes `[offset, offset + len)` (a discard: the dirty pages there must read as
    /// zeroes too, and the source is older).
    pub(crate) fn zero(&self, e: &Engine, offset: u64, len: u64) -> Result<(), IoError> {
        let zeros = AlignedBuf::new(CHUNK.min(len) as usize);
        let mut at = offset;
        while at < offset + len {
            let n = CHUNK.min(offset + len - at);
            self.write(e, at, &zeros[..n as usize])?;
            at += n;
        }
        Ok(())
    }

    /// One piece `p` of a chunk (whole pages).
    fn piece(&self, e: &Engine, p: &Piece, data: &[u8], started: Instant) -> Result<(), IoError> {
        let k = p.shard;
        let (txn, guard) = self.start(e, p, data, started)?;
        let durable = self.persist.sync(&guard.tickets).is_ok();
        // The entries durable: the data written. Otherwise nothing was written, the pages
        // are as they were.
        let ok = durable
            && txn.copies.iter().all(|c| {
                let cache = e.cores.cache_global(k, c.cache);
                let piece = &data[c.buf_offset as usize..(c.buf_offset + c.len) as usize];
                e.checks.record(p.offset + c.buf_offset, cache, piece);
                e.cache_write(cache, piece)
            });
        e.cores.with_shard(k, |core| {
            if durable {
                txn.complete(core, ok);
            } else {
                txn.abort(core);
            }
        });
        self.persist.writeback_done(guard.first);
        self.progress.bump();
        if !durable {
            return Err(IoError::Failed(
                "the write-back journal could not be written to the cache device".into(),
            ));
        }
        if ok {
            Ok(())
        } else {
            Err(lost_error(Op::Write, p.offset, p.len))
        }
    }

    /// Starts a write-back write of `data` at `p`, waiting for room or for I/O in flight on
    /// its pages (backpressure) up to the wait limit.
    fn start(
        &self,
        e: &Engine,
        p: &Piece,
        data: &[u8],
        started: Instant,
    ) -> Result<(WriteBackTxn, WbGuard), IoError> {
        let mut units = Vec::new();
        loop {
            let seen = self.progress.now();
            let room = match self.begin(e, p, data) {
                Ok(Begun::Started(txn, guard)) => return Ok((txn, guard)),
                Ok(Begun::Unknown(unit)) => {
                    units.extend(
                        e.checks
                            .pin(unit)
                            .inspect_err(|err| e.cache_read_failed(err))?,
                    );
                    continue;
                }
                Ok(Begun::Busy) => None,
                Ok(Begun::Full) => Some(true),
                Ok(Begun::NoJournal) => Some(false),
                Err(err) => return Err(e.refused(Op::Write, err, p.offset, p.len)),
            };
            // I/O in flight on the pages: wait for it. No room in the journal: a round
            // frees it. A full cache: cleaning (and a round, which releases cleaned slots).
            self.waits.fetch_add(1, Relaxed);
            if let Some(full) = room {
                if full {
                    self.last_wait.store(e.cores.now().0, Relaxed);
                }
                self.persist.want_round();
            }
            e.signals.want_intents();
            e.signals.wake_all();
            self.progress.wait(seen, Duration::from_millis(20));
            if e.signals.shutting_down() {
                return Err(IoError::ShuttingDown("the cache is shutting down".into()));
            }
            if e.health.passthrough() {
                return Err(IoError::Failed(
                    "the cache device failed: write-back cannot take writes (see the log)".into(),
                ));
            }
            if started.elapsed() > self.wait_limit {
                return Err(IoError::NoRoom(format!(
                    "write of {} bytes at offset {}: no room for write-back data after {:?}: \
                     the cache is full of dirty data the source is not taking, or metadata \
                     cannot be written",
                    p.len, p.offset, self.wait_limit
                )));
            }
        }
    }

    /// Under `p`'s core shard lock: starts the write-back write of `data` there and appends
    /// its dirty entries, or says why it must wait (and retry).
    fn begin(&self, e: &Engine, p: &Piece, data: &[u8]) -> Result<Begun, RequestError> {
        let (k, fshift) = (p.shard, e.fshift);
        e.cores.with_shard(k, |core| {
            core.advance_clock(e.cores.now());
            let txn = match WriteBackTxn::begin(core, SourceOffset(p.local), p.len) {
                Ok(txn) => txn,
                Err(WriteBackRefusal::Request(err)) => return Err(err),
                Err(WriteBackRefusal::NotWriteBack) => {
                    return Err(RequestError::Dirty {
                        offset: p.offset,
                        len: p.len,
                    })
                }
                Err(WriteBackRefusal::Busy | WriteBackRefusal::PartialPage) => {
                    return Ok(Begun::Busy)
                }
                Err(WriteBackRefusal::Full) => return Ok(Begun::Full),
            };
            let mut pages = Vec::new();
            let mut copies = Vec::new();
            for c in &txn.copies {
                let cache = e.cores.cache_global(k, c.cache);
                let slot = (cache >> fshift) as u32;
                let src = p.offset + c.buf_offset;
                let frag = src >> fshift;
                copies.push((slot, frag));
                let mut q = 0;
                while q < c.len {
                    let sp = src + q;
                    let n = PAGE_SIZE.min(c.len - q);
                    let at = (c.buf_offset + q) as usize;
                    let local = SourceOffset(p.local + c.buf_offset + q);
                    let prev = if !core.is_cached(local) {
                        PrevPage::Invalid
                    } else {
                        let crc = match e.checks.try_get(cache + q) {
                            Ok(crc) => crc,
                            Err(unit) => {
                                // Its checksums are read with no lock held; then again.
                                txn.abort(core);
                                return Ok(Begun::Unknown(unit));
                            }
                        };
                        match core.page_dirty(local) {
                            true => PrevPage::Dirty(crc),
                            false => PrevPage::Clean(crc),
                        }
                    };
                    pages.push(WbPage {
                        slot,
                        frag,
                        page: ((sp - (frag << fshift)) / PAGE_SIZE) as u32,
                        crc: e.checks.of(sp, &data[at..at + n as usize]),
                        len: n as u16,
                        prev,
                    });
                    q += n;
                }
            }
            let Some(guard) = self.persist.guard_writeback(&pages, copies.into_iter()) else {
                txn.abort(core);
                return Ok(Begun::NoJournal);
            };
            let holds = guard
                .hold
                .iter()
                .filter_map(|&s| SlotHold::take(core, e.cores.slot(s).1).map(|h| (s, h)));
            self.persist.keep_holds(holds.collect());
            Ok(Begun::Started(txn, guard))
        })
    }
}
