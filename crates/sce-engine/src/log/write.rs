//! A write-back write through the log: its pages taken exclusively in the range lock, the
//! edge pages of an unaligned write read (the newest bytes, from the log or the cache) and
//! merged, then each chunk of at most [`CHUNK_PAGES`] pages appended to the log in ONE
//! device write, its pages indexed, and the write acknowledged. Nothing waits for a flush:
//! the next NBD FLUSH (or FUA) commits it (`commit.rs`). A write to a range being drained,
//! and a large write of a long sequential stream (`seq.rs`), go through to the source
//! instead (`drain.rs`).

use super::LogBack;
use super::LogIo;
use sce_core::PAGE_SIZE;
use sce_io::{AlignedBuf, IoError};
use sce_store::wblog::{page_crc, Full, LogEntry};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// Pages of one log append (256 KiB).
pub(super) const CHUNK_PAGES: u64 = 64;

impl LogBack {
    /// A client's write (`offset`, `data`: a range the caller checked).
    pub(crate) fn write(&self, e: &LogIo<'_>, offset: u64, data: &[u8]) -> Result<(), IoError> {
        self.last_request.store(e.cores.now().0, Relaxed);
        if e.health.passthrough() {
            return Err(crate::log::cache_failed(offset, data.len() as u64));
        }
        let ps = PAGE_SIZE;
        let end = offset + data.len() as u64;
        let (a0, a1) = (offset / ps * ps, end.div_ceil(ps) * ps);
        if self.sequential(offset, data.len() as u64) {
            self.write_through(e, offset, data)?;
            self.bypassed.fetch_add(data.len() as u64, Relaxed);
            return Ok(());
        }
        if self.goes_through(a0 / ps, a1 / ps) {
            return self.write_through(e, offset, data);
        }
        let started = Instant::now();
        let _g = self.ranges.lock(a0, a1, true);
        let b = self.merged(e, offset, data)?;
        let pages = (a1 - a0) / ps;
        let chunk = CHUNK_PAGES.min(self.region.max_write());
        let mut done = 0;
        while done < pages {
            let n = chunk.min(pages - done);
            let bytes = &b[(done * ps) as usize..((done + n) * ps) as usize];
            if !self.append(e, a0 / ps + done, bytes, started)? {
                // A drain of the range began before this write took log positions: the
                // write goes through to the source, all of it (chunks already in the
                // log are dirty there, and the drain cleans them too).
                drop(_g);
                return self.write_through(e, offset, data);
            }
            done += n;
        }
        Ok(())
    }

    /// `data` at `offset` within whole pages: the edge pages as they read now (the caller
    /// holds them in the range lock), merged. A page past the volume's end reads as zeroes
    /// beyond it.
    pub(super) fn merged(
        &self,
        e: &LogIo<'_>,
        offset: u64,
        data: &[u8],
    ) -> Result<AlignedBuf, IoError> {
        let ps = PAGE_SIZE;
        let end = offset + data.len() as u64;
        let (a0, a1) = (offset / ps * ps, end.div_ceil(ps) * ps);
        let mut b = AlignedBuf::new((a1 - a0) as usize);
        let size = e.dev.size;
        if a0 < offset {
            let stop = (a0 + ps).min(size);
            crate::fills::without_fills(|| {
                self.read_locked(e, a0, &mut b[..(stop - a0) as usize])
            })?;
        }
        let last = a1 - ps;
        if end < a1 && (last > a0 || a0 == offset) {
            let stop = a1.min(size);
            crate::fills::without_fills(|| {
                self.read_locked(e, last, &mut b[(last - a0) as usize..(stop - a0) as usize])
            })?;
        }
        b[(offset - a0) as usize..(end - a0) as usize].copy_from_slice(data);
        Ok(b)
    }

    /// Appends whole pages `bytes` of global page `g0` on: one device write, then indexed.
    /// False, with nothing written, if a drain of those pages began first.
    fn append(
        &self,
        e: &LogIo<'_>,
        g0: u64,
        bytes: &[u8],
        started: Instant,
    ) -> Result<bool, IoError> {
        let n = bytes.len() as u64 / PAGE_SIZE;
        let Some(lpos) = self.allocate(e, g0, n, started)? else {
            return Ok(false);
        };
        let written = self.dev.write_at(self.at(lpos), bytes);
        self.appended(e, g0, lpos, bytes, written)?;
        Ok(true)
    }

    /// The log entries of whole pages `bytes` of global page `g0` on, written at `lpos`.
    pub(super) fn entries(&self, g0: u64, lpos: u64, bytes: &[u8]) -> Vec<LogEntry> {
        (bytes.chunks(PAGE_SIZE as usize).enumerate())
            .map(|(i, page)| {
                let (volume, p) = self.local(g0 + i as u64);
                LogEntry {
                    lpos: lpos + i as u64,
                    volume,
                    page: p,
                    crc: page_crc(page),
                }
            })
            .collect()
    }

    /// After the device write (`written`) of pages `bytes` of global page `g0` on at log
    /// position `lpos` (allocated, counted in flight): no longer in flight, and, if the
    /// write succeeded, each page's newest version, pending the next commit.
    pub(super) fn appended(
        &self,
        e: &LogIo<'_>,
        g0: u64,
        lpos: u64,
        bytes: &[u8],
        written: Result<(), IoError>,
    ) -> Result<(), IoError> {
        let entries = match written {
            Ok(()) => self.entries(g0, lpos, bytes),
            Err(_) => Vec::new(),
        };
        let ok = written.is_ok().then_some(&entries[..]);
        self.st.lock().appended(g0, lpos, ok);
        if let Err(err) = written {
            // The positions stay unused (never committed); the pages keep their versions.
            e.faults
                .device_errors(1, &format!("write-back log write failed: {err}"));
            return Err(IoError::Failed(format!(
                "the write-back log could not be written: {err}"
            )));
        }
        Ok(())
    }

    /// `n` consecutive log positions for pages from global page `g0` on (counted in flight
    /// until the write completes), waiting for room (a commit, or cleaning that moves the
    /// tail and the anchor) up to the wait limit: backpressure, never an error before it.
    /// A client's write leaves the room that copying the tail forward needs
    /// ([`super::room`]), and a volume whose source fails takes no more than its share.
    /// `None` if a drain of the pages began: checked under the state lock in which the
    /// positions are taken and in which a drain notes the writes in flight it waits for,
    /// so a write the drain did not see can no longer enter the log there.
    fn allocate(
        &self,
        e: &LogIo<'_>,
        g0: u64,
        n: u64,
        started: Instant,
    ) -> Result<Option<u64>, IoError> {
        loop {
            let seen = self.progress.now();
            let full = {
                let mut st = self.st.lock();
                if !st.drains.is_empty() && st.draining(g0, g0 + n) {
                    return Ok(None);
                }
                if self.over_share(&st, g0, n) {
                    Full::Ring
                } else {
                    match st.allocate(n) {
                        Ok(lpos) => return Ok(Some(lpos)),
                        Err(full) => full,
                    }
                }
            };
            match full {
                // Too far from the last commit: commit, then go on.
                Full::Commit => self.commit(e)?,
                // The ring: cleaning (and a new anchor) frees it.
                Full::Ring => {
                    self.waits.fetch_add(1, Relaxed);
                    self.waiting.fetch_add(1, Relaxed);
                    self.cleaner_wanted();
                    self.progress.wait(seen, Duration::from_millis(20));
                    self.waiting.fetch_sub(1, Relaxed);
                }
                Full::TooLarge => {
                    return Err(IoError::Invalid(format!(
                        "{n} pages is more than one write-back log write takes"
                    )))
                }
            }
            if e.signals.shutting_down() {
                return Err(IoError::ShuttingDown("the cache is shutting down".into()));
            }
            if e.health.passthrough() {
                // The cache device failed meanwhile: nothing will make room.
                return Err(crate::log::cache_failed(g0 * PAGE_SIZE, n * PAGE_SIZE));
            }
            if started.elapsed() > self.wait_limit {
                return Err(IoError::NoRoom(format!(
                    "no room in the write-back log after {:?}: it is full of dirty data the \
                     source is not taking",
                    self.wait_limit
                )));
            }
        }
    }
}
