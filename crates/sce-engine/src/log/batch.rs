//! One cleaning batch: the oldest live versions (up to [`BATCH_PAGES`] per source writer; a
//! drain's range first), sorted by source offset and coalesced into runs of up to
//! [`RUN_PAGES`] (1 MiB), written up to [`SOURCE_WRITERS`] at once (four times as many while
//! cleaning is urgent) through the write-through path (the source, and
//! the clean cache's copy where the fragment is cached, with that path's own journal), one
//! source flush, then the versions written leave the index (unless a newer one came
//! meanwhile), the tail moves, and the anchor follows.
//!
//! **Per page, never per batch.** A run the source refuses fails alone: its pages stay
//! dirty, *stuck*, each retried on its own after its backoff (so one bad block is found and
//! holds only itself), while every other run of the batch is cleaned and released. A page
//! whose copy in the log fails its checksum is lost at once (counted, logged, a tombstone
//! queued: reads of it fail, never an older version) and the rest of its run is cleaned.
//! A page past the end of a source that is not a whole number of pages is written up to
//! that end.

use super::prefetch::Prefetched;
use super::LogBack;
use super::LogIo;
use crate::through::Payload;
use sce_core::PAGE_SIZE;
use sce_io::{AlignedBuf, IoError};
use sce_store::wblog::{Dirty, Stuck};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// Versions one batch takes per source writer (4 MiB of pages for 16 writers).
const BATCH_PAGES: usize = 64;
/// Source writes a batch keeps in flight, and while cleaning is urgent (the room is short,
/// writers wait for it, or a drain runs): a SAN LUN or an NBD export serves many writes at
/// once, and the cleaner must outpace the writers it keeps waiting, who would have had the
/// source's whole depth to themselves without a cache.
const SOURCE_WRITERS: usize = 16;
const URGENT_WRITERS: usize = 4 * SOURCE_WRITERS;
/// Stuck pages one batch retries, each on its own.
const RETRIES_PER_BATCH: usize = 2 * SOURCE_WRITERS;

/// What one batch came to.
#[derive(Debug, Default)]
pub(super) struct Batch {
    /// Pages written to the source and released.
    pub(super) cleaned: u64,
    /// Pages whose source write failed (stuck, retried later).
    pub(super) failed: u64,
    /// Of those, pages taken for the first time (not retries of stuck pages): when every
    /// page failed and some were fresh, the source itself is failing (an outage).
    pub(super) fresh_failed: u64,
    /// The last source error.
    pub(super) error: Option<String>,
    /// Whether it cleaned urgently (64 writes in flight), how long it took once it held
    /// the cleaning lock, and the source writes it made (none for a batch with nothing to
    /// take).
    pub(super) urgent: bool,
    pub(super) busy: std::time::Duration,
    pub(super) source_writes: u64,
}

/// What one run came to: (page, position) of each version written, and the pages whose
/// write failed.
#[derive(Default)]
struct RunOut {
    cleaned: Vec<(u64, u64)>,
    failed: Vec<u64>,
    error: Option<String>,
}

/// Why a version could not be taken from the log.
pub(super) enum Unread {
    /// Its copy fails its checksum: damaged, the page is lost.
    Damaged,
    /// The device would not read it.
    Io(IoError),
}

impl LogBack {
    /// One batch (see the module's doc), of `focus` first if given. Never fails as a
    /// whole: what was cleaned is released, what failed is counted. Once `stop` says so
    /// (its caller gave up, the volume shuts down), no further run starts: what was not
    /// written stays dirty.
    pub(super) fn clean_batch(
        &self,
        e: &LogIo<'_>,
        focus: Option<(u64, u64)>,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> Batch {
        let _one = self.clean_io.lock();
        let now = Instant::now();
        let w0 = self.source_writes.load(Relaxed);
        let urgent = self.urgent();
        let depth = if urgent {
            URGENT_WRITERS
        } else {
            SOURCE_WRITERS
        };
        // A batch releases its room only once done: never more than a quarter of the ring
        // (a small log's writers get room back in steps, not in one lump at the end); in the
        // background at a rate, at most a second of it.
        let most = (depth * BATCH_PAGES)
            .min((self.region.blocks / 4).max(1) as usize)
            .min(if urgent || focus.is_some() {
                usize::MAX
            } else {
                self.rate_pages()
            });
        // What the batch takes, its runs, and where their versions lie, in one look.
        let (pages, alone, runs, positions) = {
            let st = self.st.lock();
            let (pages, alone) = st.pick(focus, now, most, RETRIES_PER_BATCH);
            let runs = st.runs(&pages, &alone);
            let positions: Vec<u64> = (pages.iter())
                .filter_map(|g| st.index.get(g))
                .map(|d| d.lpos)
                .collect();
            (pages, alone, runs, positions)
        };
        if pages.is_empty() {
            self.settle_tail();
            return Batch::default();
        }
        let pre = Prefetched::read(self, positions);
        let outs = self.write_runs(e, &pre, &runs, depth, stop);
        let mut b = Batch::default();
        let mut cleaned: Vec<(u64, u64)> = Vec::with_capacity(pages.len());
        let mut failed = Vec::new();
        for o in outs {
            cleaned.extend(o.cleaned);
            failed.extend(o.failed);
            b.error = o.error.or(b.error);
        }
        if !cleaned.is_empty() {
            if let Err(err) = e.dev.flush_source() {
                // Nothing is on the source for sure: all of it stays dirty.
                failed.extend(cleaned.drain(..).map(|(g, _)| g));
                b.error = Some(format!("the source could not be flushed: {err}"));
            }
        }
        (b.cleaned, b.failed) = (cleaned.len() as u64, failed.len() as u64);
        b.fresh_failed = failed.iter().filter(|g| !alone.contains(g)).count() as u64;
        {
            let mut st = self.st.lock();
            for (g, l) in cleaned {
                st.cleaned(g, l);
            }
            for g in failed {
                st.clean_failed(g, now, |tries| {
                    Instant::now() + Stuck::<Instant>::backoff(tries)
                });
            }
        }
        self.bytes_cleaned.fetch_add(b.cleaned * PAGE_SIZE, Relaxed);
        self.settle_tail();
        (b.urgent, b.busy) = (urgent, now.elapsed());
        b.source_writes = self.source_writes.load(Relaxed) - w0;
        b
    }

    /// Moves the tail as far as the log's state allows, and the anchor after it; wakes the
    /// writers waiting for room only if either moved (else a writer that wakes the cleaner
    /// for room and a cleaner with nothing it may take would wake each other in a loop).
    pub(super) fn settle_tail(&self) {
        let moved = self.st.lock().settle_tail();
        let anchored = self.advance_anchor().unwrap_or_else(|err| {
            tracing::warn!("write-back log: the anchor could not be moved: {err}");
            false
        });
        if moved || anchored {
            self.progress.bump();
        }
    }

    /// Writes `runs` from `depth` threads at once (a SAN serves many writes in flight; one
    /// at a time, 4 KiB runs over a 2 ms source drain 2 MB/s).
    fn write_runs(
        &self,
        e: &LogIo<'_>,
        pre: &Prefetched,
        runs: &[(u64, u64)],
        depth: usize,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> Vec<RunOut> {
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|sc| {
            let workers: Vec<_> = (0..depth.min(runs.len()))
                .map(|_| {
                    sc.spawn(|| {
                        let mut mine = RunOut::default();
                        while let Some(&(g0, n)) = runs.get(next.fetch_add(1, Relaxed)) {
                            if stop() {
                                break;
                            }
                            self.clean_run(e, pre, g0, n, &mut mine);
                        }
                        mine
                    })
                })
                .collect();
            (workers.into_iter())
                .map(|w| w.join().expect("a cleaning thread panicked"))
                .collect()
        })
    }

    /// Writes the newest versions of pages `[g0, g0 + n)` (those that still have one) to
    /// the source through the write-through path, holding them in `source_order`; notes in
    /// `out` what was written and what failed. A damaged copy is lost there and then, and
    /// the rest of the run goes on.
    fn clean_run(&self, e: &LogIo<'_>, pre: &Prefetched, g0: u64, n: u64, out: &mut RunOut) {
        let ps = PAGE_SIZE;
        let _o = self.source_order.lock(g0 * ps, (g0 + n) * ps, true);
        // The newest versions now, read under `source_order`: a write that went through to
        // the source and superseded them meanwhile left none. A version's blocks stay as
        // they are until the tail passes them, which only the cleaner moves.
        let vers: Vec<Option<Dirty>> = {
            let st = self.st.lock();
            (g0..g0 + n).map(|g| st.index.get(&g).copied()).collect()
        };
        let mut buf = AlignedBuf::new((n * ps) as usize);
        let mut k = 0;
        while k < vers.len() {
            let start = k;
            while k < vers.len() {
                let Some(d) = vers[k] else { break };
                let g = g0 + k as u64;
                match self.take(pre, d, &mut buf[k * ps as usize..(k + 1) * ps as usize]) {
                    Ok(()) => k += 1,
                    Err(Unread::Damaged) => {
                        self.found_damaged(g, d);
                        break;
                    }
                    Err(Unread::Io(err)) => {
                        e.faults.cache_read_failed(&err);
                        out.failed.push(g);
                        out.error = Some(format!("reading the write-back log failed: {err}"));
                        break;
                    }
                }
            }
            if k > start {
                let pages: Vec<(u64, u64)> = (start..k)
                    .map(|j| (g0 + j as u64, vers[j].expect("read").lpos))
                    .collect();
                let bytes = &buf[start * ps as usize..k * ps as usize];
                self.write_source(e, &pages, bytes, out);
            }
            // Past the page that stopped the sub-run (none, damaged, or unreadable).
            k += 1;
        }
    }

    /// Writes consecutive pages `pages` ((page, version's position), `bytes` their bytes) to
    /// the source through the write-through path, cut at the volume's end. If the source
    /// refuses, the run is split (`split`) down to the page that fails.
    fn write_source(&self, e: &LogIo<'_>, pages: &[(u64, u64)], bytes: &[u8], out: &mut RunOut) {
        match self.write_run(e, pages, bytes) {
            Ok(()) => out.cleaned.extend_from_slice(pages),
            Err(err) => self.split(e, pages, bytes, err, out),
        }
    }

    /// A run the source refused (`err`): each half written on its own; a half that fails
    /// is split again, so one bad block is found in a few writes. If both halves fail, the
    /// source itself is failing here and splitting stops: every page is noted failed.
    fn split(
        &self,
        e: &LogIo<'_>,
        pages: &[(u64, u64)],
        bytes: &[u8],
        err: String,
        out: &mut RunOut,
    ) {
        if pages.len() == 1 {
            out.failed.push(pages[0].0);
            out.error = Some(err);
            return;
        }
        let half = pages.len() / 2;
        let at = half * PAGE_SIZE as usize;
        let (p1, p2) = pages.split_at(half);
        let (b1, b2) = bytes.split_at(at);
        match (self.write_run(e, p1, b1), self.write_run(e, p2, b2)) {
            (Ok(()), Ok(())) => out.cleaned.extend_from_slice(pages),
            (Err(err), Err(_)) => {
                out.failed.extend(pages.iter().map(|p| p.0));
                out.error = Some(err);
            }
            (Err(err), Ok(())) => {
                out.cleaned.extend_from_slice(p2);
                self.split(e, p1, b1, err, out);
            }
            (Ok(()), Err(err)) => {
                out.cleaned.extend_from_slice(p1);
                self.split(e, p2, b2, err, out);
            }
        }
    }

    /// One source write of consecutive pages `pages` (their `bytes`), cut at the volume's
    /// end.
    fn write_run(&self, e: &LogIo<'_>, pages: &[(u64, u64)], bytes: &[u8]) -> Result<(), String> {
        let first = pages[0].0;
        let len = self.bytes_within(first, pages.len() as u64) as usize;
        let at = first * PAGE_SIZE;
        match self
            .through
            .write(&e.writer, at, Payload::Borrowed(&bytes[..len]))
        {
            Ok(()) => {
                self.source_writes.fetch_add(1, Relaxed);
                Ok(())
            }
            Err(err) => Err(err.to_string()),
        }
    }

    /// Version `d` into `to`: from the read-ahead if it holds it intact, else read on its
    /// own (a damaged block is read again alone: the error names the page).
    fn take(&self, pre: &Prefetched, d: Dirty, to: &mut [u8]) -> Result<(), Unread> {
        if let Some(b) = pre.block(d.lpos) {
            if sce_store::wblog::page_crc(b) == d.crc {
                to.copy_from_slice(b);
                return Ok(());
            }
        }
        self.read_checked(d, to)
    }

    /// Version `d` read from the log into `to` (4 KiB), checked against its checksum.
    pub(super) fn read_checked(&self, d: Dirty, to: &mut [u8]) -> Result<(), Unread> {
        let mut page = AlignedBuf::new(PAGE_SIZE as usize);
        self.dev
            .read_at(self.at(d.lpos), &mut page)
            .map_err(Unread::Io)?;
        if sce_store::wblog::page_crc(&page) != d.crc {
            return Err(Unread::Damaged);
        }
        to.copy_from_slice(&page);
        Ok(())
    }

    /// Page `g`'s version `d` fails its checksum in the log (read twice): its only copy is
    /// damaged. If it is still the newest, the page is lost from now on (reads fail, never
    /// an older version), which a tombstone in the next commit records; logged once.
    pub(super) fn found_damaged(&self, g: u64, d: Dirty) {
        if !self.st.lock().damaged_found(g, d, |g| self.local(g)) {
            return;
        }
        self.damaged_found.fetch_add(1, Relaxed);
        tracing::error!(
            offset = g * PAGE_SIZE,
            "write-back data failed its checksum in the log (its only copy is damaged on the \
             cache device): the page is lost, and reads of it fail until it is written again"
        );
        self.cleaner_wanted();
    }
}
