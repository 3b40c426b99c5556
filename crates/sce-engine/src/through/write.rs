//! The write path: plan the write under the core lock (the core invalidates its pages and
//! plans the cache copies) and set the write intents it needs; wait for them; then send the
//! source write from the caller's thread and the cache copies: synchronously in
//! write-through mode, through the AWT writers otherwise. Every half is completed through
//! the write's [`WriteTxn`] tokens.

use super::awt::{AwtQueue, CopyPiece, Payload};
use crate::checks::Checks;
use crate::cores::Cores;
use crate::devices::Devices;
use crate::engine::{DeviceFaults, Signals};
use crate::health::Health;
use crate::persist::{Persist, Ticket};
use crate::stats::Counters;
use sce_core::{RequestError, SourceWrite, WriteKind, WriteTxn};
use sce_io::{IoError, Op};
use std::sync::atomic::Ordering::Relaxed;

/// One piece of a write in flight: its core shard, where it lies, its transaction (its
/// copies in global cache offsets, their buffer offsets within the piece).
struct WritePiece {
    shard: usize,
    /// Global source offset, and the piece's place in the request's buffer.
    offset: u64,
    start: usize,
    len: usize,
    txn: WriteTxn,
}

/// The role that writes through the cache: plans a write on the core's shards, sets the
/// intents it needs, sends the source write and the cache copies (synchronously or through
/// the AWT queue) and completes them. It holds the subsystems it uses; cache writes and
/// intents are judged through `faults` (the engine). `Engine::writer` builds it.
pub(crate) struct Writer<'a> {
    pub(crate) dev: &'a Devices,
    pub(crate) cores: &'a Cores,
    pub(crate) checks: &'a Checks,
    pub(crate) counters: &'a Counters,
    pub(crate) health: &'a Health,
    pub(crate) persist: Option<&'a Persist>,
    pub(crate) signals: &'a Signals,
    /// log2 of the fragment size.
    pub(crate) fshift: u32,
    pub(crate) faults: &'a dyn DeviceFaults,
}

impl Writer<'_> {
    /// Writes to the source, counting the bytes that made it.
    fn source_write(&self, offset: u64, data: &[u8]) -> Result<(), IoError> {
        let r = self.dev.source_write(offset, |s| s.write_at(offset, data));
        if r.is_ok() {
            self.counters
                .source_bytes_written
                .fetch_add(data.len() as u64, Relaxed);
        }
        r
    }

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
        if self.health.passthrough() {
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
        // The intents that keep a restart from serving the pages this write replaces (and
        // guard its cache copies) are durable before the source write is sent. (Running
        // them alongside it, acknowledging once both were done, was tried in issue 46's
        // first round; a SIGKILL test under load then read an acknowledged write's older
        // bytes once, unexplained: reverted.)
        if !self.faults.wait_intents(&tickets) {
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
        if self.health.passthrough() {
            return self.dev.source.discard(offset, len);
        }
        let (pieces, tickets) = self.begin_write(offset, len, WriteKind::Discard)?;
        self.faults.wait_intents(&tickets);
        let result = self.dev.source_write(offset, |s| s.discard(offset, len));
        self.abandon(pieces, result.is_ok());
        result
    }

    /// Completes the source halves of a write's pieces, one core shard lock at a time.
    fn sources_done(&self, sources: Vec<(usize, SourceWrite)>, ok: bool) {
        for (k, source) in sources {
            self.cores.with_shard(k, |core| source.done(core, ok));
        }
    }

    /// Completes write pieces that send no cache copy: their copies failed, their source
    /// halves `ok`; one core shard lock at a time.
    fn abandon(&self, pieces: Vec<WritePiece>, ok: bool) {
        for p in pieces {
            let (source, copies) = p.txn.into_parts();
            self.cores.with_shard(p.shard, |core| {
                // A discard plans no cache copy.
                for copy in copies {
                    copy.done(core, false);
                }
                source.done(core, ok);
            });
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
        for p in self.cores.pieces(offset, len) {
            let begun: Result<WriteTxn, RequestError> = self.cores.global(p.shard, |core| {
                core.advance_clock(self.cores.now());
                let (_, txn) = core.begin_write(&p, kind)?.into_parts();
                if let Some(persist) = self.persist.as_ref().filter(|_| p.len > 0) {
                    // The copies' cache offsets are global: each names its global slot.
                    tickets.extend(persist.guard_write(
                        (p.offset, p.len),
                        txn.copies().iter().map(|c| {
                            let slot = (c.write().cache.0 >> self.fshift) as u32;
                            (slot, core.slot_fragment(slot).unwrap_or(u64::MAX))
                        }),
                    ));
                }
                Ok(txn)
            });
            let txn = match begun {
                Ok(txn) => txn,
                Err(e) => {
                    self.abandon(pieces, false);
                    return Err(self.dev.refused(op, e, offset, len));
                }
            };
            pieces.push(WritePiece {
                shard: p.shard,
                offset: p.offset,
                start: p.buf_offset as usize,
                len: p.len as usize,
                txn,
            });
        }
        self.counters.split_request(false, pieces.len() as u64, 0);
        if self
            .persist
            .as_ref()
            .is_some_and(|p| p.take_presets() || p.round_wanted())
        {
            // Intents set ahead of need (write-hot slots): the intent writer makes them
            // durable. The journal ring is half full: it runs a flush round now. (No core
            // lock is held here; `intent_pending` is a leaf.)
            self.signals.want_intents();
        }
        Ok((pieces, tickets))
    }
}
