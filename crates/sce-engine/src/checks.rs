//! Page checksums: a checksum per cached page, recorded before the core marks the page
//! valid, taken with a read's plan under the core lock, and compared after the read. A
//! persistent cache keeps them in its records and in memory only for the units in use
//! (`crcs.rs`); taking them under a lock never does I/O (a unit not in memory is named for
//! the caller to read with no lock held). What a mismatch means is `verify.rs`'s.

use crate::crcs::CrcCache;
use sce_core::{ReadPlan, RunTarget, PAGE_SIZE};
use sce_io::IoError;
use sce_store::{page_checksum, page_seed, CrcTable};
use std::sync::Arc;

/// Where a volume's page checksums live.
pub(crate) enum Crcs {
    /// In memory, every page's (a cache without persistence: nothing else holds them).
    Memory(CrcTable),
    /// In the device's records, and in memory for the units in use (`crcs.rs`).
    Device(Arc<CrcCache>),
}

/// The checksums of a cached volume (none without `verify`).
pub(crate) struct Checks {
    crcs: Option<Crcs>,
    /// What seeds page checksums: per volume, in address order, its first page in the
    /// cache's address space and its id (the volume table's, or 1).
    seeds: Vec<(u64, u16)>,
    source_size: u64,
    fshift: u32,
}

/// Of the volumes whose first pages are `seeds` (first global page, volume id; in address
/// order), the one global page `page` lies in (its index) and the page's checksum seed.
pub(crate) fn volume_seed(seeds: &[(u64, u16)], page: u64) -> (usize, u64) {
    let k = seeds.partition_point(|s| s.0 <= page).saturating_sub(1);
    let (base, id) = seeds[k];
    (k, page_seed(id, page - base))
}

impl Checks {
    pub(crate) fn new(
        crcs: Option<Crcs>,
        seeds: Vec<(u64, u16)>,
        source_size: u64,
        fshift: u32,
    ) -> Checks {
        Checks {
            crcs,
            seeds,
            source_size,
            fshift,
        }
    }

    /// True if pages are checked.
    pub(crate) fn on(&self) -> bool {
        self.crcs.is_some()
    }

    /// The device's checksum cache (a persistent cache's flush rounds write its changes).
    pub(crate) fn cache(&self) -> Option<&CrcCache> {
        match &self.crcs {
            Some(Crcs::Device(c)) => Some(c),
            _ => None,
        }
    }

    /// Splits a cache (or source) offset into its slot (or fragment) number and the page
    /// within it.
    pub(crate) fn slot_page(&self, off: u64) -> (u64, u32) {
        (
            off >> self.fshift,
            ((off & ((1 << self.fshift) - 1)) / PAGE_SIZE) as u32,
        )
    }

    /// The recorded checksum of the page at cache offset `c` (0 without checksums), if
    /// known without I/O (always, but for a unit of a persistent cache that is not in
    /// memory: None names it, for the caller to `pin` with no lock held).
    pub(crate) fn try_get(&self, c: u64) -> Result<u32, u32> {
        let (slot, p) = self.slot_page(c);
        match &self.crcs {
            None => Ok(0),
            Some(Crcs::Memory(t)) => Ok(t.get(slot as u32, p)),
            Some(Crcs::Device(d)) => d.get(slot as u32, p).ok_or(d.unit_of(slot as u32)),
        }
    }

    /// Holds in memory the unit of the page at cache offset `c` (I/O; no lock held).
    pub(crate) fn pin_page(&self, c: u64) -> Result<Option<crate::crcs::UnitPin<'_>>, IoError> {
        match &self.crcs {
            Some(Crcs::Device(d)) => d.pin(d.unit_of(self.slot_page(c).0 as u32)).map(Some),
            _ => Ok(None),
        }
    }

    /// `expected`, with 0 for the pages whose checksums are not in memory: they fail
    /// verification (but by a 2^-32 chance) and are read from the source, which a
    /// write-through cache may do when a unit's records cannot be read.
    pub(crate) fn expected_or_unknown(&self, plan: &ReadPlan, want: &mut Vec<u32>) {
        let known = self.expected_with(plan, want, Some(0));
        debug_assert!(known.is_ok());
    }

    /// Holds the unit named by `try_get` or `expected` in memory (I/O; no lock held) for as
    /// long as the pin lives.
    pub(crate) fn pin(&self, unit: u32) -> Result<Option<crate::crcs::UnitPin<'_>>, IoError> {
        match &self.crcs {
            Some(Crcs::Device(d)) => d.pin(unit).map(Some),
            _ => Ok(None),
        }
    }

    /// The checksum of `bytes`, the page at source offset `src`.
    pub(crate) fn of(&self, src: u64, bytes: &[u8]) -> u32 {
        page_checksum(bytes, self.seed(src))
    }

    /// Stores the checksums of the whole pages of a cache write of `data` at source offset
    /// `src` and cache offset `cache` (the same position within their pages).
    pub(crate) fn record(&self, src: u64, cache: u64, data: &[u8]) {
        let Some(crcs) = &self.crcs else { return };
        let set = |slot: u32, p: u32, crc: u32| match crcs {
            Crcs::Memory(t) => t.set(slot, p, crc),
            Crcs::Device(d) => d.set(slot, p, crc),
        };
        let ps = PAGE_SIZE;
        let end = src + data.len() as u64;
        let mut sp = src.div_ceil(ps) * ps;
        while sp < end {
            let pe = (sp + ps).min(self.source_size);
            if pe > end {
                break;
            }
            let (slot, p) = self.slot_page(cache + (sp - src));
            let bytes = &data[(sp - src) as usize..(pe - src) as usize];
            set(slot as u32, p, page_checksum(bytes, self.seed(sp)));
            sp += ps;
        }
    }

    /// The pages a cache run of `len` bytes at cache offset `c` touches.
    pub(crate) fn run_pages(c: u64, len: u64) -> usize {
        ((c + len).div_ceil(PAGE_SIZE) - c / PAGE_SIZE) as usize
    }

    /// Sets `want` to the checksum of every page of every cache run of `plan`. The caller
    /// holds the core lock (read or write) under which the plan was made: a page that is
    /// valid under it has its final checksum recorded (writers record a page's checksum
    /// before the core marks it valid, and invalidate it before they change it). No I/O:
    /// Err names a unit of a persistent cache whose checksums are not in memory (the caller
    /// lets the lock go, pins it and plans again).
    pub(crate) fn expected(&self, plan: &ReadPlan, want: &mut Vec<u32>) -> Result<(), u32> {
        self.expected_with(plan, want, None)
    }

    /// `expected`, a page whose checksum is not in memory taking `unknown` (None: Err).
    /// The pages of one slot are taken together (one lookup of their unit, not one per page:
    /// a read hit of 1 MiB has 256).
    fn expected_with(
        &self,
        plan: &ReadPlan,
        want: &mut Vec<u32>,
        unknown: Option<u32>,
    ) -> Result<(), u32> {
        want.clear();
        let Some(crcs) = &self.crcs else {
            return Ok(());
        };
        let per_slot = 1u64 << (self.fshift - PAGE_SIZE.trailing_zeros());
        for run in &plan.runs {
            if let RunTarget::Cache(c) = run.target {
                let mut page = c.0 / PAGE_SIZE;
                let end = page + Self::run_pages(c.0, run.len) as u64;
                while page < end {
                    let (slot, p) = self.slot_page(page * PAGE_SIZE);
                    let n = (end - page).min(per_slot - p as u64) as u32;
                    match crcs {
                        Crcs::Memory(t) => want.extend((p..p + n).map(|q| t.get(slot as u32, q))),
                        Crcs::Device(d) => d.get_pages(slot as u32, p..p + n, want, unknown)?,
                    }
                    page += n as u64;
                }
            }
        }
        Ok(())
    }

    /// The checksum seed of the page at source offset `src` (page-aligned).
    fn seed(&self, src: u64) -> u64 {
        volume_seed(&self.seeds, src / PAGE_SIZE).1
    }

    /// True if whole pages read from the cache (`bytes`, at the source's `src0`,
    /// page-aligned) match their expected checksums `want` (always without checksums).
    pub(crate) fn pages_match(&self, src0: u64, bytes: &[u8], want: &[u32]) -> bool {
        self.first_mismatch(src0, bytes, want).is_none()
    }

    /// The first page of `bytes` (read at the source's `src0`, page-aligned) that does not
    /// match its expected checksum in `want`: its offset in `bytes`, its length and its
    /// expected checksum. None if all match (always without checksums).
    pub(crate) fn first_mismatch(
        &self,
        src0: u64,
        bytes: &[u8],
        want: &[u32],
    ) -> Option<(u64, u64, u32)> {
        self.crcs.as_ref()?;
        let ps = PAGE_SIZE;
        let (mut k, mut i) = (0u64, 0);
        while k < bytes.len() as u64 && src0 + k < self.source_size {
            let sp = src0 + k;
            let plen = ps.min(self.source_size - sp);
            let end = (k + plen).min(bytes.len() as u64);
            let expect = want.get(i).copied();
            if expect
                != Some(page_checksum(
                    &bytes[k as usize..end as usize],
                    self.seed(sp),
                ))
            {
                return Some((k, plen, expect.unwrap_or(0)));
            }
            k += ps;
            i += 1;
        }
        None
    }
}
