//! The flash layer of a host: a reference policy with its modelled devices, or the engine.

use super::PAGE;
use crate::engine::{Device, EngineSim, LatencyHistogram};
use crate::reference::BlockCache;
use crate::request::{IoKind, TraceRequest};

/// A flash cache as the stack sees it: a reference policy over blocks or the engine.
pub enum Flash {
    /// A reference policy.
    Reference(Box<BlockCache>),
    /// The sce-core state machine in virtual time.
    Engine(Box<EngineSim>),
}

impl Flash {
    /// Runs the engine's own work (population, completions) due by time `t`.
    pub(super) fn advance(&mut self, t: u64) {
        if let Flash::Engine(e) = self {
            e.advance(t);
        }
    }

    /// Bytes written to the cache device so far: the engine's count, or one block per
    /// insertion and per write hit (an update in place) of a reference policy.
    pub(super) fn cache_bytes_written(&self) -> u64 {
        match self {
            Flash::Reference(c) => c.blocks_written() * PAGE,
            Flash::Engine(e) => e.cache_bytes_written(),
        }
    }

    pub(super) fn invalidate(&mut self, offset: u64, len: u64) -> bool {
        match self {
            Flash::Reference(c) => {
                len > 0 && c.remove_range(offset / PAGE, (offset + len - 1) / PAGE + 1, |_| {})
            }
            Flash::Engine(e) => e.invalidate(offset, len),
        }
    }
}

/// Blocks a reference cache has written into itself (every miss but LARC's first ones).
pub(super) fn inserted(c: &BlockCache) -> u64 {
    c.inserts
}

/// The modelled I/O of a host's reference cache: the devices and the latencies seen.
#[derive(Debug)]
pub(super) struct ReferenceTiming {
    pub(super) ssd: Device,
    pub(super) source: Device,
    pub(super) read_latency: LatencyHistogram,
    pub(super) write_latency: LatencyHistogram,
}

/// What one block of a reference read did.
#[derive(Copy, Clone, PartialEq, Eq)]
pub(super) enum BlockRead {
    /// Read from the cache device.
    Hit,
    /// Read from the source, then written into the cache.
    Inserted,
    /// Read from the source only (the policy did not admit it).
    Missed,
}

impl ReferenceTiming {
    /// Models `n` consecutive blocks of a read issued at `t`; returns when they are done.
    pub(super) fn read_run(&mut self, t: u64, kind: BlockRead, n: u64) -> u64 {
        let bytes = n * PAGE;
        match kind {
            BlockRead::Hit => self.ssd.io(t, bytes, false),
            BlockRead::Missed => self.source.io(t, bytes, false),
            BlockRead::Inserted => {
                let read = self.source.io(t, bytes, false);
                self.ssd.io(read, bytes, true)
            }
        }
    }
}

/// A host's flash layer as the layers above call it: its flash cache and, for a reference
/// policy, the modelled devices.
pub(super) struct Down<'a> {
    pub(super) flash: &'a mut Flash,
    pub(super) timing: Option<&'a mut ReferenceTiming>,
}

impl Down<'_> {
    /// A read issued at `t`; returns (pages hit, pages, completion).
    ///
    /// With a model, a reference read completes when its hit blocks are read from the cache
    /// device and its missed blocks from the source and written into the cache (as the
    /// engine's inline fills, which an insert-on-miss cache performs before it answers).
    pub(super) fn read(&mut self, t: u64, offset: u64, len: u64) -> (u64, u64, u64) {
        match &mut *self.flash {
            Flash::Reference(c) => {
                if len == 0 {
                    return (0, 0, t);
                }
                let (first, last) = (offset / PAGE, (offset + len - 1) / PAGE);
                let pages = last - first + 1;
                let m0 = c.misses;
                let Some(tm) = self.timing.as_deref_mut() else {
                    c.request(offset, len);
                    return (pages - (c.misses - m0), pages, t);
                };
                // The same accesses as `request`, block by block, in runs of one kind.
                let mut done = t;
                let mut run: Option<(BlockRead, u64)> = None;
                for b in first..=last {
                    let i0 = inserted(c);
                    let kind = if c.access(b) {
                        BlockRead::Hit
                    } else if inserted(c) > i0 {
                        BlockRead::Inserted
                    } else {
                        BlockRead::Missed
                    };
                    run = match run {
                        Some((k, n)) if k == kind => Some((k, n + 1)),
                        Some((k, n)) => {
                            done = done.max(tm.read_run(t, k, n));
                            Some((kind, 1))
                        }
                        None => Some((kind, 1)),
                    };
                }
                if let Some((k, n)) = run {
                    done = done.max(tm.read_run(t, k, n));
                }
                tm.read_latency.record(done - t);
                (pages - (c.misses - m0), pages, done)
            }
            Flash::Engine(e) => {
                let (h0, m0) = e.read_pages();
                let done = e.request(&TraceRequest {
                    time_ns: t,
                    kind: IoKind::Read,
                    volume: 0,
                    offset,
                    len,
                });
                let (h1, m1) = e.read_pages();
                (h1 - h0, (h1 - h0) + (m1 - m0), done)
            }
        }
    }

    /// A write issued at `t`; returns when it is acknowledged.
    ///
    /// With a model, a reference write goes to the source and, at the same time, its blocks
    /// to the cache device (the ones it hits are updated, the ones it inserts written); it
    /// is acknowledged when the source write completes, as AWT.
    pub(super) fn write(&mut self, t: u64, offset: u64, len: u64) -> u64 {
        match &mut *self.flash {
            Flash::Reference(c) => {
                // The blocks the cache holds afterwards (hit or inserted) are the ones
                // written to the cache device.
                let copied = c.write(offset, len);
                let Some(tm) = self.timing.as_deref_mut() else {
                    return t;
                };
                if len == 0 {
                    return t;
                }
                let done = tm.source.io(t, len, true);
                if copied > 0 {
                    tm.ssd.io(t, copied * PAGE, true);
                }
                tm.write_latency.record(done - t);
                done
            }
            Flash::Engine(e) => e.request(&TraceRequest {
                time_ns: t,
                kind: IoKind::Write,
                volume: 0,
                offset,
                len,
            }),
        }
    }
}
