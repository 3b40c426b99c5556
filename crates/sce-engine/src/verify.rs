//! Verified reads of cached data: a run read from the cache device is checked against the
//! checksums taken with its plan (`checks.rs`); a mismatch counts as a device error only if
//! it is genuine (see `Verifier::read_cache_run`).
//!
//! The verifier is a role: it holds the subsystems it uses (the cache device, the core's
//! shards, the checksums, the counters) and reports device errors through the narrow
//! [`DeviceFaults`] interface, which the engine implements (the error count, and disabling
//! the cache at its limit). `Engine::verifier` builds it.

use crate::checks::Checks;
use crate::cores::Cores;
use crate::devices::Devices;
use crate::engine::DeviceFaults;
use crate::stats::Counters;
use sce_core::PAGE_SIZE;
use sce_io::{AlignedBuf, IoError};
use std::sync::atomic::Ordering::Relaxed;

/// Reads of cached data, verified against their checksums.
pub(crate) struct Verifier<'a> {
    pub(crate) dev: &'a Devices,
    pub(crate) cores: &'a Cores,
    pub(crate) checks: &'a Checks,
    pub(crate) counters: &'a Counters,
    /// log2 of the fragment size.
    pub(crate) fshift: u32,
    pub(crate) faults: &'a dyn DeviceFaults,
}

impl Verifier<'_> {
    /// Reads a run of cached data at cache offset `c` (source offset `src`) into `dst` and
    /// verifies each page against `want` (the checksums taken when the read was planned).
    /// False if the cache could not supply correct data (the caller reads the source
    /// instead). A mismatch is a device error only if the page is still valid with the same
    /// checksum and a re-read, under the core lock so that no write can start on the page,
    /// still mismatches; otherwise a write replaced the page since the read was planned.
    pub(crate) fn read_cache_run(&self, c: u64, src: u64, dst: &mut [u8], want: &[u32]) -> bool {
        let cache = &self.dev.cache;
        if !self.checks.on() {
            let r = cache.read_at(c, dst);
            if let Err(e) = &r {
                self.faults.cache_read_failed(e);
            }
            return r.is_ok();
        }
        let head = src % PAGE_SIZE;
        let len = dst.len() as u64;
        let end = src + len;
        let aligned = head == 0 && (end.is_multiple_of(PAGE_SIZE) || end == self.dev.size);
        let mut tmp = None;
        let r = if aligned {
            cache.read_at(c, dst)
        } else {
            let span = (head + len).div_ceil(PAGE_SIZE) * PAGE_SIZE;
            let mut b = AlignedBuf::new(span as usize);
            let r = cache.read_at(c - head, &mut b);
            tmp = Some(b);
            r
        };
        if let Err(e) = r {
            self.cache_run_failed(&e, src - head, head + len);
            return false;
        }
        let (bytes, c0, src0): (&[u8], u64, u64) = match &tmp {
            Some(b) => (&b[..], c - head, src - head),
            None => (&*dst, c, src),
        };
        if !self.check_pages(c0, src0, bytes, want) {
            return false;
        }
        if let Some(b) = tmp {
            dst.copy_from_slice(&b[head as usize..(head + len) as usize]);
        }
        true
    }

    /// A read of the cached pages from source offset `src` (page-aligned, `span` bytes)
    /// failed: counts the device error and drops the pages (the device may keep failing
    /// there).
    pub(crate) fn cache_run_failed(&self, e: &IoError, src: u64, span: u64) {
        self.faults.cache_read_failed(e);
        let (f, p0) = self.checks.slot_page(src);
        let p1 = p0 + span.div_ceil(PAGE_SIZE) as u32;
        self.cores.invalidate(f, p0, p1);
    }

    /// Verifies whole pages read from the cache (`bytes`, read at cache offset `c0`, the
    /// source's `src0`, both page-aligned) against their expected checksums `want`. A
    /// genuine mismatch counts as a device error and drops the page. True if every page is
    /// correct (always without checksums).
    pub(crate) fn check_pages(&self, c0: u64, src0: u64, bytes: &[u8], want: &[u32]) -> bool {
        let Some((k, plen, expect)) = self.checks.first_mismatch(src0, bytes, want) else {
            return true;
        };
        let sp = src0 + k;
        if self.genuine_mismatch(c0 + k, sp, plen, expect) {
            self.counters.cache_checksum_errors.fetch_add(1, Relaxed);
            let (_, p) = self.checks.slot_page(c0 + k);
            self.cores.invalidate(sp >> self.fshift, p, p + 1);
            self.faults.device_errors(
                1,
                &format!(
                    "checksum mismatch of the cached page at source offset {sp} (cache \
                     offset {}): dropped, read from the source",
                    c0 + k
                ),
            );
        }
        false
    }

    /// After a checksum mismatch on the page at cache offset `c` (source offset `sp`, `plen`
    /// bytes): true if the page is still valid with checksum `expect` and a re-read still
    /// mismatches. The re-read runs under the core's read lock, so no write can invalidate
    /// and rewrite the page meanwhile (writers take the write lock first); this holds the
    /// lock across one 4 KiB read, on this error path only (the checksum's unit is pinned
    /// in memory before the lock is taken).
    fn genuine_mismatch(&self, c: u64, sp: u64, plen: u64, expect: u32) -> bool {
        if !self.checks.on() {
            return false;
        }
        let (slot, _) = self.checks.slot_page(c);
        // The page's checksum in memory for the check (its unit's records read now, with no
        // lock held): under the lock it is taken without I/O. Records that cannot be read
        // leave the mismatch unjudged: not counted, the page kept (a write-back read of a
        // dirty page then fails rather than serve the source).
        let unit = match self.checks.pin_page(c) {
            Ok(u) => u,
            Err(e) => {
                self.faults.cache_read_failed(&e);
                return false;
            }
        };
        let genuine = self.cores.read_at_source(sp, |core| {
            let still = core.is_cached(sp)
                && core.slot_of(sp >> self.fshift) == Some(slot as u32)
                && self.checks.try_get(c) == Ok(expect);
            if !still {
                return false;
            }
            let mut page = AlignedBuf::new(PAGE_SIZE as usize);
            match self.dev.cache.read_at(c, &mut page) {
                Ok(()) => self.checks.of(sp, &page[..plen as usize]) != expect,
                // A read error is a device error in its own right.
                Err(_) => true,
            }
        });
        drop(unit);
        genuine
    }
}
