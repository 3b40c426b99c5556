//! Page verification: the checksum of every cached page is recorded before the core marks
//! it valid, taken with a read's plan under the core lock, and checked after the read; a
//! mismatch counts as a device error only if it is genuine (see `read_cache_run`).

use crate::shared::Shared;
use sce_core::{ReadPlan, RunTarget, SourceOffset};
use sce_io::{AlignedBuf, BlockDevice, IoError};
use sce_store::{page_checksum, page_seed};
use std::sync::atomic::Ordering::Relaxed;

impl Shared {
    /// Stores the checksums of the whole pages of a cache write of `data` at source offset
    /// `src` and cache offset `cache` (the same position within their pages).
    pub(crate) fn record_crcs(&self, src: u64, cache: u64, data: &[u8]) {
        let Some(crcs) = &self.crcs else { return };
        let ps = sce_core::PAGE_SIZE;
        let end = src + data.len() as u64;
        let mut sp = src.div_ceil(ps) * ps;
        while sp < end {
            let pe = (sp + ps).min(self.source_size);
            if pe > end {
                break;
            }
            let (slot, p) = self.slot_page(cache + (sp - src));
            let bytes = &data[(sp - src) as usize..(pe - src) as usize];
            crcs.set(slot as u32, p, page_checksum(bytes, self.seed(sp)));
            sp += ps;
        }
    }

    /// The pages a cache run of `len` bytes at cache offset `c` touches.
    pub(crate) fn run_pages(&self, c: u64, len: u64) -> usize {
        let ps = sce_core::PAGE_SIZE;
        ((c + len).div_ceil(ps) - c / ps) as usize
    }

    /// Appends to `want` the checksum of every page of every cache run of `plan`. The caller
    /// holds the core lock (read or write) under which the plan was made: a page that is
    /// valid under it has its final checksum recorded (writers record a page's checksum
    /// before the core marks it valid, and invalidate it before they change it).
    pub(crate) fn expected_crcs(&self, plan: &ReadPlan, want: &mut Vec<u32>) {
        want.clear();
        let Some(crcs) = &self.crcs else { return };
        let ps = sce_core::PAGE_SIZE;
        for run in &plan.runs {
            if let RunTarget::Cache(c) = run.target {
                let first = c.0 / ps;
                for k in 0..self.run_pages(c.0, run.len) as u64 {
                    let (slot, p) = self.slot_page((first + k) * ps);
                    want.push(crcs.get(slot as u32, p));
                }
            }
        }
    }

    /// The checksum seed of the page at source offset `src` (page-aligned).
    pub(crate) fn seed(&self, src: u64) -> u64 {
        let page = src / sce_core::PAGE_SIZE;
        let k = self
            .seeds
            .partition_point(|s| s.0 <= page)
            .saturating_sub(1);
        let (base, id) = self.seeds[k];
        page_seed(id, page - base)
    }

    /// Reads a run of cached data at cache offset `c` (source offset `src`) into `dst` and
    /// verifies each page against `want` (the checksums taken when the read was planned).
    /// False if the cache could not supply correct data (the caller reads the source
    /// instead). A mismatch is a device error only if the page is still valid with the same
    /// checksum and a re-read, under the core lock so that no write can start on the page,
    /// still mismatches; otherwise a write replaced the page since the read was planned.
    pub(crate) fn read_cache_run(&self, c: u64, src: u64, dst: &mut [u8], want: &[u32]) -> bool {
        if self.crcs.is_none() {
            let r = self.cache.read_at(c, dst);
            if let Err(e) = &r {
                self.cache_read_failed(e);
            }
            return r.is_ok();
        }
        let ps = sce_core::PAGE_SIZE;
        let head = src % ps;
        let len = dst.len() as u64;
        let aligned =
            head == 0 && ((src + len).is_multiple_of(ps) || src + len == self.source_size);
        let mut tmp = None;
        let r = if aligned {
            self.cache.read_at(c, dst)
        } else {
            let span = (head + len).div_ceil(ps) * ps;
            let mut b = AlignedBuf::new(span as usize);
            let r = self.cache.read_at(c - head, &mut b);
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
        self.cache_read_failed(e);
        let (f, p0) = self.slot_page(src);
        let p1 = p0 + span.div_ceil(sce_core::PAGE_SIZE) as u32;
        let (k, f) = self.frag_shard(f);
        self.cores[k].write().invalidate(f, p0, p1);
    }

    /// True if whole pages read from the cache (`bytes`, at the source's `src0`,
    /// page-aligned) match their expected checksums `want` (always without checksums). A
    /// pure comparison: no lock, no I/O (see `check_pages` for what a mismatch means).
    pub(crate) fn pages_match(&self, src0: u64, bytes: &[u8], want: &[u32]) -> bool {
        if self.crcs.is_none() {
            return true;
        }
        let ps = sce_core::PAGE_SIZE as usize;
        bytes.chunks(ps).enumerate().all(|(i, page)| {
            let sp = src0 + (i * ps) as u64;
            sp >= self.source_size || {
                let plen = page.len().min((self.source_size - sp) as usize);
                want.get(i) == Some(&page_checksum(&page[..plen], self.seed(sp)))
            }
        })
    }

    /// Verifies whole pages read from the cache (`bytes`, read at cache offset `c0`, the
    /// source's `src0`, both page-aligned) against their expected checksums `want`. A
    /// genuine mismatch counts as a device error and drops the page. True if every page is
    /// correct (always without checksums).
    pub(crate) fn check_pages(&self, c0: u64, src0: u64, bytes: &[u8], want: &[u32]) -> bool {
        if self.crcs.is_none() {
            return true;
        }
        let ps = sce_core::PAGE_SIZE;
        let mut k = 0u64;
        let mut i = 0;
        while k < bytes.len() as u64 && src0 + k < self.source_size {
            let sp = src0 + k;
            let plen = ps.min(self.source_size - sp);
            let end = (k + plen).min(bytes.len() as u64);
            let expect = want[i];
            if page_checksum(&bytes[k as usize..end as usize], self.seed(sp)) != expect {
                if self.genuine_mismatch(c0 + k, sp, plen, expect) {
                    self.counters.cache_checksum_errors.fetch_add(1, Relaxed);
                    let (_, p) = self.slot_page(c0 + k);
                    let (shard, f) = self.frag_shard(sp >> self.fshift);
                    self.cores[shard].write().invalidate(f, p, p + 1);
                    self.device_errors(1, "checksum mismatch");
                }
                return false;
            }
            k += ps;
            i += 1;
        }
        true
    }

    /// After a checksum mismatch on the page at cache offset `c` (source offset `sp`, `plen`
    /// bytes): true if the page is still valid with checksum `expect` and a re-read still
    /// mismatches. The re-read runs under the core's read lock, so no write can invalidate
    /// and rewrite the page meanwhile (writers take the write lock first); this holds the
    /// lock across one 4 KiB read, on this error path only.
    pub(crate) fn genuine_mismatch(&self, c: u64, sp: u64, plen: u64, expect: u32) -> bool {
        let Some(crcs) = &self.crcs else { return false };
        let (slot, p) = self.slot_page(c);
        let (k, local) = self.map.source_to_local(SourceOffset(sp));
        let (_, f) = self.frag_shard(sp >> self.fshift);
        let core = self.cores[k].read();
        let still = core.is_cached(local)
            && core.exists(f).map(|x| self.map.slot_to_global(k, x.0).0) == Some(slot as u32)
            && crcs.get(slot as u32, p) == expect;
        if !still {
            return false;
        }
        let mut page = AlignedBuf::new(sce_core::PAGE_SIZE as usize);
        match self.cache.read_at(c, &mut page) {
            Ok(()) => page_checksum(&page[..plen as usize], self.seed(sp)) != expect,
            // A read error is a device error in its own right.
            Err(_) => true,
        }
    }
}
