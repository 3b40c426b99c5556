//! What the NBD reader asks of an [`Attachable`] without a worker: read hits started
//! through the volume's queue, log writes started through it, and whether a write or flush
//! is served by the cache device alone.

use super::Attachable;
use sce_io::{IoQueue, Op, QueuedReads, StartedRead, StartedWrite};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

impl QueuedReads for Attachable {
    fn start_read(&self, offset: u64, len: u64) -> Option<StartedRead> {
        if offset
            .checked_add(len)
            .is_none_or(|e| e > self.source.size())
        {
            return None;
        }
        // Not waiting for the gate: the reader may hold started writes that a detach
        // waiting for it waits for (`start_write`); the workers take the read instead.
        // The volume counts a started hit in flight at once, under the gate: a swap's
        // close waits for it.
        let r = self
            .gate
            .try_read()?
            .as_deref()?
            .start_read(self.base() + offset, len);
        if r.is_some() {
            self.count_read(len as usize, true);
        }
        r
    }

    /// The attached volume's queue; while a swap holds the gate (or waits for it), the
    /// queue of the volume being swapped out, which every operation started and not yet
    /// submitted came from (nothing starts on a gate a swap holds). Never waiting for the
    /// gate there: a mode switch holds it while it waits for those operations.
    fn queue(&self) -> Option<Arc<dyn IoQueue>> {
        if let Some(g) = self.gate.try_read() {
            if let Some(v) = g.as_deref() {
                return v.queue();
            }
        } else if let Some(v) = self.draining.lock().as_deref() {
            return v.queue();
        }
        if let Some(v) = self.gate.read().as_deref() {
            return v.queue();
        }
        self.draining.lock().as_deref()?.queue()
    }

    fn runs_locally(&self, op: Op, offset: u64, len: u64) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|e| e <= self.source.size())
            && self.gate.try_read().is_some_and(|g| {
                g.as_deref()
                    .is_some_and(|v| v.runs_locally(op, self.base() + offset, len))
            })
    }

    /// The volume's, counted as a write; `None` while a detach or attach holds or waits
    /// for the gate (the workers take the write instead). A detach's drain waits for the
    /// writes started before it, so the reader that holds one unsubmitted must never wait
    /// for the gate: hence `try_read` here and in `start_read` and `runs_locally`.
    fn start_write(&self, offset: u64, len: u64) -> Option<(StartedWrite, Arc<dyn IoQueue>)> {
        if offset
            .checked_add(len)
            .is_none_or(|e| e > self.source.size())
        {
            return None;
        }
        let gate = self.gate.try_read()?;
        let w = gate.as_deref()?.start_write(self.base() + offset, len)?;
        self.counters.write_requests.fetch_add(1, Relaxed);
        self.counters.write_bytes.fetch_add(len, Relaxed);
        Some(w)
    }
}
