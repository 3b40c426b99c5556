//! The engine's requests in the simulator: a read as the core plans it, a write in the
//! write-through modes, and another host's write that invalidates this cache's copies.

use super::{EngineSim, Event};
use sce_core::{RunTarget, SourceOffset, WriteKind, WriteMode};

impl EngineSim {
    /// Another host wrote `[offset, offset+len)` of the shared source: drops this cache's
    /// copies of those pages (and spoils population in flight over them, as a local write
    /// would), without writing anything. Returns true if a valid page was dropped.
    pub fn invalidate(&mut self, offset: u64, len: u64) -> bool {
        let size = self.core.geometry().source_size();
        let (off, end) = (offset.min(size), offset.saturating_add(len).min(size));
        if end <= off {
            return false;
        }
        let geo = *self.core.geometry();
        let mut held = false;
        let mut mapped = false;
        let mut f = geo.fragment_of(SourceOffset(off));
        while geo.fragment_start(f).0 < end {
            if self.core.exists(f).is_some() {
                mapped = true;
                let lo = geo.fragment_start(f).0.max(off);
                let hi = (geo.fragment_start(f).0 + geo.fragment_len(f)).min(end);
                let mut p = lo & !4095;
                while p < hi && !held {
                    held = self.core.is_cached(SourceOffset(p));
                    p += 4096;
                }
            }
            f = sce_core::FragNo(f.0 + 1);
        }
        if mapped {
            let (o, l) = (off / 512 * 512, end.div_ceil(512) * 512 - off / 512 * 512);
            let at = SourceOffset(o);
            if let Ok(txns) = self
                .core
                .begin_write(at, l.min(size - o), WriteKind::Discard)
            {
                for txn in txns {
                    let (source, copies) = txn.into_halves();
                    // A discard plans no cache copy.
                    for copy in copies {
                        copy.done(&mut self.core, false);
                    }
                    source.done(&mut self.core, true);
                }
            }
        }
        held
    }

    /// A read at `t` as the core plans it (the cache's runs, the source's, inline fills):
    /// returns when it is done.
    pub(super) fn read(&mut self, t: u64, off: u64, len: u64) -> u64 {
        let Ok(mut read) = self.core.begin_read(SourceOffset(off), len) else {
            return t;
        };
        let mut done = t;
        let mut source_done = t;
        for run in read.pieces().flat_map(|(_, plan)| &plan.runs) {
            let d = match run.target {
                RunTarget::Cache(_) => self.ssd.io(t, run.len, false),
                RunTarget::Source(_) => {
                    self.res.source_bytes_read += run.len;
                    let d = self.source.io(t, run.len, false);
                    source_done = source_done.max(d);
                    d
                }
            };
            done = done.max(d);
        }
        // Inline fills (admission `always`) are written before the read completes.
        for f in read.pieces().flat_map(|(_, plan)| &plan.fills) {
            done = done.max(self.ssd.io(source_done, f.len, true));
            self.res.cache_bytes_written += f.len;
        }
        for pop in read.take_populations() {
            pop.complete(&mut self.core, true);
        }
        drop(read);
        done
    }

    /// A write in the write-through modes (and write-around, passthrough) at `t`: returns
    /// when it is acknowledged.
    pub(super) fn write_through(&mut self, t: u64, off: u64, len: u64) -> u64 {
        let Ok(txns) = self
            .core
            .begin_write(SourceOffset(off), len, WriteKind::Data)
        else {
            return t;
        };
        let synchronous = self.core.config().write_mode == WriteMode::WriteThrough;
        let sdone = self.source.io(t, len, true);
        self.res.source_bytes_written += len;
        let mut ack = sdone;
        // One source write for the request; its pieces' halves complete with it.
        let copies: Vec<_> = txns
            .into_iter()
            .flat_map(|txn| {
                let (source, copies) = txn.into_halves();
                self.push(sdone, Event::SourceDone(source));
                copies
            })
            .collect();
        for copy in copies {
            let l = copy.write().len;
            let cdone = self.ssd.io(t, l, true);
            self.res.cache_bytes_written += l;
            self.push(cdone, Event::CacheDone(copy));
            if synchronous {
                ack = ack.max(cdone);
            }
        }
        self.wlat.record(ack - t);
        ack
    }
}
