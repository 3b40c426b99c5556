//! The write path: plan the write under the core lock (the core invalidates its pages and
//! plans the cache copies) and set the write intents it needs; wait for them; then send the
//! source write from the caller's thread and the cache copies: synchronously in
//! write-through mode, through the AWT writers otherwise. Every half is completed through
//! the write's [`WriteTxn`] tokens.

use crate::awt::{AwtQueue, Payload};
use crate::persist::Ticket;
use crate::shared::{request_error, Shared};
use sce_core::{SourceOffset, WriteKind, WriteTxn};
use sce_io::{IoError, Op};
use std::sync::atomic::{Ordering::Relaxed, Ordering::SeqCst};

impl Shared {
    /// Writes `payload` at `offset` (a range the caller checked) through the cache; AWT
    /// copies go to `awt`.
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
        let (txn, tickets) = self.begin_write(offset, len, WriteKind::Data)?;
        let synchronous = txn.synchronous();
        let (source, mut copies) = txn.into_parts();
        if !self.wait_intents(&tickets) {
            // The intents could not be made durable; the cache is now disabled. Send no copy.
            let mut core = self.core.write();
            for copy in copies.drain(..) {
                copy.done(&mut core, false);
            }
        }
        if synchronous {
            // Write-through: the source, then the cache copies, before acknowledging.
            let result = self.source_write(offset, data);
            self.copy_to_cache(offset, copies, data);
            source.done(&mut self.core.write(), result.is_ok());
            return result;
        }
        if !copies.is_empty() {
            // AWT: hand a copy to the writers before the source write, so both run in parallel.
            awt.send(self, offset, &payload, copies);
        }
        let result = self.source_write(offset, data);
        source.done(&mut self.core.write(), result.is_ok());
        result
    }

    /// Discards `len` bytes at `offset` (a range the caller checked): invalidates the cached
    /// pages, then discards on the source.
    pub(crate) fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        if self.passthrough.load(Relaxed) {
            return self.source.discard(offset, len);
        }
        let (txn, tickets) = self.begin_write(offset, len, WriteKind::Discard)?;
        self.wait_intents(&tickets);
        self.source_writes_started.fetch_add(1, SeqCst);
        let result = self.source.discard(offset, len);
        self.source_writes_done.fetch_add(1, SeqCst);
        let (source, copies) = txn.into_parts();
        let mut core = self.core.write();
        // A discard plans no cache copy.
        for copy in copies {
            copy.done(&mut core, false);
        }
        source.done(&mut core, result.is_ok());
        result
    }

    /// Plans a write or discard and, with persistence, sets the intents it needs (under the
    /// core lock); the caller waits for the tickets before sending anything.
    fn begin_write(
        &self,
        offset: u64,
        len: u64,
        kind: WriteKind,
    ) -> Result<(WriteTxn, Vec<Ticket>), IoError> {
        let op = if kind == WriteKind::Data {
            Op::Write
        } else {
            Op::Discard
        };
        let mut core = self.core.write();
        core.advance_clock(self.now());
        let txn = WriteTxn::begin(&mut core, SourceOffset(offset), len, kind)
            .map_err(|e| request_error(op, e, offset, len, self.source_size, self.lbs))?;
        let tickets = match &self.persist {
            Some(p) if len > 0 => {
                let first = offset >> self.fshift;
                let last = (offset + len - 1) >> self.fshift;
                let core = &*core;
                let fshift = self.fshift;
                p.guard_write(
                    first..=last,
                    txn.copies().iter().map(move |c| {
                        let slot = (c.write().cache.0 >> fshift) as u32;
                        let f = core.slot_state(sce_core::SlotNo(slot)).0;
                        (slot, f.map_or(u64::MAX, |f| f.0))
                    }),
                )
            }
            _ => Vec::new(),
        };
        Ok((txn, tickets))
    }
}
