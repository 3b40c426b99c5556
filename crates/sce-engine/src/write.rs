//! The write path: plan the write under the core lock (the core invalidates its pages and
//! plans the cache copies) and set the write intents it needs; wait for them; then send the
//! source write from the caller's thread and the cache copies: synchronously in
//! write-through mode, through the AWT writers otherwise. Every half is completed through
//! the write's [`WriteTxn`] tokens.

use crate::awt::{AwtQueue, CopyPiece, Payload};
use crate::persist::Ticket;
use crate::shared::{request_error, Shared};
use sce_core::{SlotNo, SourceOffset, SourceWrite, WriteKind, WriteTxn};
use sce_io::{IoError, Op};
use std::sync::atomic::{Ordering::Relaxed, Ordering::SeqCst};

/// One piece of a write in flight: its core shard, where it lies, its transaction.
struct WritePiece {
    shard: usize,
    /// Global source offset, and the piece's place in the request's buffer.
    offset: u64,
    start: usize,
    len: usize,
    txn: WriteTxn,
}

impl Shared {
    /// Writes `payload` at `offset` (a range the caller checked) through the cache; AWT
    /// copies go to `awt`. The source write is one, whatever the pieces.
    pub(crate) fn write(
        &self,
        awt: &AwtQueue,
        offset: u64,
        payload: Payload,
    ) -> Result<(), IoError> {
        let data = payload.bytes();
        let len = data.len() as u64;
        if self.passthrough.load(Relaxed) {
            return self.source_write(offset, data);
        }
        let (pieces, tickets) = self.begin_write(offset, len, WriteKind::Data)?;
        let synchronous = pieces.iter().any(|p| p.txn.synchronous());
        let mut sources = Vec::with_capacity(pieces.len());
        let mut copies = Vec::new();
        for p in pieces {
            let (source, c) = p.txn.into_parts();
            sources.push((p.shard, source));
            if !c.is_empty() {
                copies.push(CopyPiece {
                    shard: p.shard,
                    offset: p.offset,
                    start: p.start,
                    len: p.len,
                    copies: c,
                });
            }
        }
        if !self.wait_intents(&tickets) {
            // The intents could not be made durable; the cache is now disabled. Send no copy.
            self.fail_copies(std::mem::take(&mut copies));
        }
        if synchronous {
            // Write-through: the source, then the cache copies, before acknowledging.
            let result = self.source_write(offset, data);
            for c in copies {
                let piece = &data[c.start..c.start + c.len];
                self.copy_to_cache(c.shard, c.offset, c.copies, piece);
            }
            self.sources_done(sources, result.is_ok());
            return result;
        }
        if !copies.is_empty() {
            // AWT: hand a copy to the writers before the source write, so both run in parallel.
            awt.send(self, &payload, copies);
        }
        let result = self.source_write(offset, data);
        self.sources_done(sources, result.is_ok());
        result
    }

    /// Discards `len` bytes at `offset` (a range the caller checked): invalidates the cached
    /// pages, then discards on the source.
    pub(crate) fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        if self.passthrough.load(Relaxed) {
            return self.source.discard(offset, len);
        }
        let (pieces, tickets) = self.begin_write(offset, len, WriteKind::Discard)?;
        self.wait_intents(&tickets);
        self.note_source_write(offset);
        self.source_writes_started.fetch_add(1, SeqCst);
        let result = self.source.discard(offset, len);
        self.source_writes_done.fetch_add(1, SeqCst);
        self.abandon(pieces, result.is_ok());
        result
    }

    /// Completes the source halves of a write's pieces, one core shard lock at a time.
    fn sources_done(&self, sources: Vec<(usize, SourceWrite)>, ok: bool) {
        for (k, source) in sources {
            source.done(&mut self.cores[k].write(), ok);
        }
    }

    /// Completes write pieces that send no cache copy: their copies failed, their source
    /// halves `ok`; one core shard lock at a time.
    fn abandon(&self, pieces: Vec<WritePiece>, ok: bool) {
        for p in pieces {
            let (source, copies) = p.txn.into_parts();
            let mut core = self.cores[p.shard].write();
            // A discard plans no cache copy.
            for copy in copies {
                copy.done(&mut core, false);
            }
            source.done(&mut core, ok);
        }
    }

    /// Plans a write or discard, piece by piece (each under its core shard's lock, one at a
    /// time) and, with persistence, sets the intents or appends the journal entries it needs
    /// (under the same lock, right after the core invalidated the pages: a flush round that
    /// notes the journal later snapshots the invalidation); the caller waits for the
    /// tickets before sending anything.
    fn begin_write(
        &self,
        offset: u64,
        len: u64,
        kind: WriteKind,
    ) -> Result<(Vec<WritePiece>, Vec<Ticket>), IoError> {
        let op = if kind == WriteKind::Data {
            Op::Write
        } else {
            Op::Discard
        };
        let mut pieces = Vec::new();
        let mut tickets = Vec::new();
        for p in self.map.pieces(offset, len) {
            let mut core = self.cores[p.shard].write();
            core.advance_clock(self.now());
            let txn = match WriteTxn::begin(&mut core, SourceOffset(p.local), p.len, kind) {
                Ok(txn) => txn,
                Err(e) => {
                    drop(core);
                    self.abandon(pieces, false);
                    return Err(request_error(
                        op,
                        e,
                        offset,
                        len,
                        self.source_size,
                        self.lbs,
                    ));
                }
            };
            if let Some(persist) = self.persist.as_ref().filter(|_| p.len > 0) {
                let (core, map, k) = (&*core, &self.map, p.shard);
                let fshift = self.fshift;
                tickets.extend(persist.guard_write(
                    (p.offset, p.len),
                    txn.copies().iter().map(move |c| {
                        let local = SlotNo((c.write().cache.0 >> fshift) as u32);
                        let f = core.slot_state(local).0;
                        let f = f.map_or(u64::MAX, |f| map.frag_to_global(k, f).0);
                        (map.slot_to_global(k, local).0, f)
                    }),
                ));
            }
            pieces.push(WritePiece {
                shard: p.shard,
                offset: p.offset,
                start: p.buf_offset as usize,
                len: p.len as usize,
                txn,
            });
        }
        self.counters.split_request(false, pieces.len() as u64, 0);
        if self.persist.as_ref().is_some_and(|p| p.round_wanted()) {
            // The journal ring is half full: the intent writer runs a flush round now (no
            // core lock is held here; `intent_pending` is a leaf).
            *self.intent_pending.lock() = true;
            self.intent_wake.notify_one();
        }
        Ok((pieces, tickets))
    }
}
