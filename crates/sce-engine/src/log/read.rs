//! A read in write-back through the log: each page from its newest version in the log if
//! it has one (checked against its checksum: a version that fails it is the only copy,
//! damaged, and the read fails; never an older version), the rest from the cache or the
//! source as in write-through. No range lock: versions are never rewritten in place, so a
//! read that races a write of the same pages returns, page by page, the version before it
//! or after it. A version the cleaner let go and the ring reused under the read is seen by
//! its checksum and the page read again from where it is now.

use super::batch::Unread;
use super::LogBack;
use super::LogIo;
use sce_core::PAGE_SIZE;
use sce_io::{AlignedBuf, IoError};
use sce_store::wblog::Dirty;
use std::sync::atomic::Ordering::Relaxed;

/// The most pages of the log one device read of a client's read takes (1 MiB).
const MAX_RUN: usize = 256;

impl LogBack {
    /// A client's read; true if every byte came from the cache device.
    pub(crate) fn read(&self, e: &LogIo<'_>, offset: u64, buf: &mut [u8]) -> Result<bool, IoError> {
        self.last_request.store(e.cores.now().0, Relaxed);
        self.read_locked(e, offset, buf)
    }

    /// `read` (a write merging its edge pages holds them in the range lock).
    pub(super) fn read_locked(
        &self,
        e: &LogIo<'_>,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<bool, IoError> {
        let ps = PAGE_SIZE;
        let end = offset + buf.len() as u64;
        let (p0, p1) = (offset / ps, end.div_ceil(ps));
        let found: Vec<(u64, Dirty)> = {
            let st = self.st.lock();
            let lost = (!st.lost.is_empty())
                .then(|| (p0..p1).find(|p| st.lost.contains(p)))
                .flatten();
            if let Some(p) = lost {
                return Err(lost_error(p));
            }
            if st.index.is_empty() {
                Vec::new()
            } else {
                (p0..p1)
                    .filter_map(|p| st.index.get(&p).map(|d| (p, *d)))
                    .collect()
            }
        };
        if found.is_empty() {
            return e.reader.read(offset, buf);
        }
        // Pages served from the log are hits (`CacheVolume::stats` adds them to the core's),
        // and a request they cover whole is a request hit whole.
        self.read_pages.fetch_add(found.len() as u64, Relaxed);
        if found.len() as u64 == p1 - p0 {
            self.read_requests.fetch_add(1, Relaxed);
        }
        let mut hit = true;
        let mut at = offset;
        let mut run = AlignedBuf::new(0);
        let mut page = AlignedBuf::new(ps as usize);
        let mut k = 0;
        while k < found.len() {
            // A run of pages whose versions lie side by side on the device (a multi-page
            // write's): one device read, each page checked on its own.
            let n = self.contiguous(&found[k..]);
            let (first, last) = (found[k].0, found[k + n - 1].0);
            let (lo, hi) = ((first * ps).max(offset), ((last + 1) * ps).min(end));
            if at < lo {
                let r = (at - offset) as usize..(lo - offset) as usize;
                hit &= e.reader.read(at, &mut buf[r])?;
            }
            hit &= self.read_run(e, &found[k..k + n], (offset, buf), &mut run, &mut page)?;
            at = hi;
            k += n;
        }
        if at < end {
            hit &= e.reader.read(at, &mut buf[(at - offset) as usize..])?;
        }
        Ok(hit)
    }

    /// Reads `run` (adjacent pages whose versions are adjacent blocks of the device) in one
    /// device read into `scratch`, and each page's part of the client's read `(offset, buf)`
    /// from it once it passes its checksum; a page that does not (a failed read, a version
    /// cleaned and reused under the read, damage) is read on its own, as it is now. True if
    /// every page came from the cache device.
    fn read_run(
        &self,
        e: &LogIo<'_>,
        run: &[(u64, Dirty)],
        (offset, buf): (u64, &mut [u8]),
        scratch: &mut AlignedBuf,
        page: &mut AlignedBuf,
    ) -> Result<bool, IoError> {
        let ps = PAGE_SIZE;
        let end = offset + buf.len() as u64;
        let bytes = run.len() * ps as usize;
        if scratch.len() < bytes {
            *scratch = AlignedBuf::new(bytes);
        }
        let got = &mut scratch[..bytes];
        let whole = match self.dev.read_at(self.at(run[0].1.lpos), got) {
            Ok(()) => true,
            Err(err) => {
                // Counted once; each page is then read on its own.
                e.faults.cache_read_failed(&err);
                false
            }
        };
        let mut hit = true;
        for (i, &(p, d)) in run.iter().enumerate() {
            let mine = &got[i * ps as usize..(i + 1) * ps as usize];
            let src: &[u8] = if whole && sce_store::wblog::page_crc(mine) == d.crc {
                mine
            } else {
                hit &= self.read_current(e, p, d, page)?;
                page
            };
            let (lo, hi) = ((p * ps).max(offset), ((p + 1) * ps).min(end));
            let from = (lo - p * ps) as usize;
            buf[(lo - offset) as usize..(hi - offset) as usize]
                .copy_from_slice(&src[from..from + (hi - lo) as usize]);
        }
        Ok(hit)
    }

    /// How many of `found` (pages in order, with their versions), from the first, are
    /// adjacent pages whose versions are adjacent blocks of the device (at most 256).
    fn contiguous(&self, found: &[(u64, Dirty)]) -> usize {
        let (p0, d0) = found[0];
        let at0 = self.at(d0.lpos);
        let same = |i: usize| {
            let (p, d) = found[i];
            p == p0 + i as u64
                && d.lpos == d0.lpos + i as u64
                && self.at(d.lpos) == at0 + i as u64 * PAGE_SIZE
        };
        1 + (1..found.len().min(MAX_RUN))
            .take_while(|&i| same(i))
            .count()
    }

    /// Reads page `p`'s newest version (`d` when the read began) into `page`: if `d`
    /// fails its checksum because it was cleaned and its blocks reused meanwhile, the page
    /// as it is now (a newer version, or the cache's or source's copy). A version that
    /// fails its checksum and is still the newest is damaged: the page is lost from now on
    /// (`found_damaged`), and the read fails. True if it came from the cache device.
    fn read_current(
        &self,
        e: &LogIo<'_>,
        p: u64,
        d: Dirty,
        page: &mut AlignedBuf,
    ) -> Result<bool, IoError> {
        let mut d = d;
        loop {
            let err = match self.read_checked(d, page) {
                Ok(()) => return Ok(true),
                Err(Unread::Io(err)) => {
                    e.faults.cache_read_failed(&err);
                    err
                }
                Err(Unread::Damaged) => IoError::Failed(format!(
                    "write-back data at offset {} failed its checksum in the log (its only \
                     copy is damaged on the cache device)",
                    p * PAGE_SIZE
                )),
            };
            let now = {
                let st = self.st.lock();
                // Gone from the index because the cleaner found this very version damaged
                // (it is lost now), not because it was cleaned: never the source's bytes.
                if st.lost.contains(&p) {
                    return Err(lost_error(p));
                }
                st.index.get(&p).copied()
            };
            match now {
                Some(now) if now != d => {
                    d = now;
                    continue;
                }
                Some(_) => {}
                None => {
                    let n = PAGE_SIZE.min(e.dev.size - p * PAGE_SIZE) as usize;
                    return e.reader.read(p * PAGE_SIZE, &mut page[..n]);
                }
            }
            if matches!(err, IoError::Failed(_)) {
                self.found_damaged(p, d);
            }
            return Err(err);
        }
    }
}

/// The error a read of page `p` gets once its only copy was found damaged.
fn lost_error(p: u64) -> IoError {
    IoError::Failed(format!(
        "write-back data at offset {} was found damaged in the log (its only copy): it reads \
         as an error until it is written again",
        p * PAGE_SIZE
    ))
}
