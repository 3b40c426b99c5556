//! Write-back data in the read slots, left by an sce before issue 45 (a device formatted
//! without a write-back log, whose write-back kept dirty pages in the slots): a start drains
//! it to the source before anything is served, and the device is then formatted afresh
//! with a log (`Persist::open_laid_out`). The slots' write side is gone; this is its reader.
//!
//! The order makes every crash safe: the drain writes the dirty pages to the source and
//! flushes it before the format touches the device, so a crash before the new superblock
//! finds the old dirty claims again and drains the same bytes again (no client was served
//! in between); `sce_store::reformat` makes every old record stale before it clears the
//! intents.

use crate::open::checksum_cache;
use crate::persist::{OpenVolume, Persist};
use crate::volume::{EngineConfig, EngineError};
use sce_core::PAGE_SIZE;
use sce_io::{AlignedBuf, BlockDevice};
use sce_store::{bit, Loaded, VolumeDirt};
use std::sync::Arc;

/// Why a start must format the device afresh, if it must: dirty pages in its slots (which
/// it drains first), or write-back wanted of a device without a log.
pub(crate) fn relayout_needed(
    persist: &Persist,
    loaded: &Loaded,
    writeback: bool,
) -> Result<bool, EngineError> {
    let r = &loaded.report;
    let in_slots = r.pages_dirty + r.dirty_pages_lost > 0;
    if in_slots && persist.log_info().is_some() {
        // No sce writes such a device (one with a log served write-back through it):
        // formatting it afresh would drop the log's dirty data.
        return Err(sce_core::ConfigError::new(
            "cache",
            format!(
                "the cache device holds {} dirty pages in its read slots beside a write-back \
                 log; no sce writes such a device, and it is not drained",
                r.pages_dirty + r.dirty_pages_lost
            ),
        )
        .into());
    }
    Ok(in_slots || (writeback && persist.log_info().is_none()))
}

/// What the drain did.
#[derive(Debug, Default)]
pub(crate) struct Drained {
    /// Dirty pages written to the source.
    pub pages: u64,
    /// Dirty pages it could not write: their only copy is lost (never written, or failing
    /// its checksum), per volume (given up by the operator, or the start was refused).
    pub lost: Vec<VolumeDirt>,
}

/// Writes every dirty page the slots hold (as `loaded` found them) to `source` and flushes
/// it. A page without a sound copy is lost: the start is refused unless the operator gave
/// its volume's dirty data up (`--discard-dirty`); what was given up is returned, for the
/// caller to log once the whole open went through.
pub(crate) fn drain(
    source: &dyn BlockDevice,
    device: Arc<dyn BlockDevice>,
    persist: &Persist,
    loaded: &Loaded,
    (config, vols): (&EngineConfig, &[OpenVolume]),
) -> Result<Drained, EngineError> {
    let l = persist.layout;
    let words = l.bitmap_words();
    let ppf = l.pages_per_fragment;
    let mut d = Drainer {
        source,
        device: device.clone(),
        persist,
        crcs: checksum_cache(config, persist, device, loaded),
        seeds: persist.seeds(),
        lost: vec![0u64; vols.len()],
        pages: 0,
        buf: AlignedBuf::new(l.fragment_size as usize),
    };
    for (i, &(s, f)) in loaded.entries.iter().enumerate() {
        let dirty = &loaded.dirty[i * words..(i + 1) * words];
        let valid = &loaded.bitmaps[i * words..(i + 1) * words];
        let base = f * l.fragment_size;
        let pages = ppf.min(source.size().saturating_sub(base).div_ceil(PAGE_SIZE) as u32);
        // Runs of dirty pages: one device read each, then the sound pages written to the
        // source in runs of their own.
        let mut p = 0;
        while p < pages {
            if !bit(dirty, p) {
                p += 1;
                continue;
            }
            let mut q = p;
            while q < pages && bit(dirty, q) {
                q += 1;
            }
            d.run(s, base, (p, q), valid)?;
            p = q;
        }
    }
    let mut out = Drained {
        pages: d.pages,
        ..Drained::default()
    };
    let lost = std::mem::take(&mut d.lost);
    source.flush()?;
    out.lost = vols
        .iter()
        .zip(lost)
        .filter(|(_, n)| *n > 0)
        .map(|(v, n)| VolumeDirt {
            name: v.name.clone(),
            dirty: 0,
            lost: n,
        })
        .collect();
    let discard = &persist.cfg.discard_dirty;
    if let Some(v) = (out.lost.iter()).find(|v| !sce_store::volumes::gives_up(discard, &v.name)) {
        return Err(sce_core::ConfigError::new(
            "discard_dirty",
            format!(
                "{} dirty pages of {:?} in the cache device's read slots (write-back data of \
                 an older sce) have no sound copy (never written, or failing their \
                 checksums): the others were written to the source; start with \
                 --discard-dirty {:?} to give those up",
                v.lost, v.name, v.name
            ),
        )
        .into());
    }
    Ok(out)
}

/// The drain's state: where it reads and writes, the checksums, the seeds of the
/// volumes' pages, and what it lost (per volume) and wrote.
struct Drainer<'a> {
    source: &'a dyn BlockDevice,
    device: Arc<dyn BlockDevice>,
    persist: &'a Persist,
    crcs: crate::crcs::CrcCache,
    seeds: Vec<(u64, u16)>,
    lost: Vec<u64>,
    pages: u64,
    buf: AlignedBuf,
}

impl Drainer<'_> {
    /// Dirty pages `[p, q)` of slot `s` (fragment at source offset `base`; `valid`, the
    /// record's bitmap): read in one device read, each checked against its checksum, the
    /// sound ones written to the source.
    fn run(
        &mut self,
        s: u32,
        base: u64,
        (p, q): (u32, u32),
        valid: &[u64],
    ) -> Result<(), sce_io::IoError> {
        let run = &mut self.buf[..((q - p) as u64 * PAGE_SIZE) as usize];
        self.device.read_at(slot_page(self.persist, s, p), run)?;
        let mut sound = Vec::with_capacity((q - p) as usize);
        for r in p..q {
            let at = base + u64::from(r) * PAGE_SIZE;
            let len = PAGE_SIZE.min(self.source.size() - at) as usize;
            let (k, seed) = crate::checks::volume_seed(&self.seeds, at / PAGE_SIZE);
            let o = ((r - p) as u64 * PAGE_SIZE) as usize;
            let ok = bit(valid, r)
                && self.crcs.get_or_load(s, r)? == sce_store::page_checksum(&run[o..o + len], seed);
            if !ok {
                self.lost[k] += 1;
            }
            sound.push(ok);
        }
        write_sound(self.source, base + u64::from(p) * PAGE_SIZE, run, &sound)?;
        self.pages += sound.iter().filter(|&&x| x).count() as u64;
        Ok(())
    }
}

/// Writes the pages of `run` (read from the slots, for the source from `at`) that are
/// `sound` to the source, adjacent ones in one write; the last page may end past the
/// source's end (written up to it).
fn write_sound(
    source: &dyn BlockDevice,
    at: u64,
    run: &[u8],
    sound: &[bool],
) -> Result<(), sce_io::IoError> {
    let mut i = 0;
    while i < sound.len() {
        if !sound[i] {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < sound.len() && sound[j] {
            j += 1;
        }
        let from = at + i as u64 * PAGE_SIZE;
        let end = (at + j as u64 * PAGE_SIZE).min(source.size());
        let o = (i as u64 * PAGE_SIZE) as usize;
        source.write_at(from, &run[o..o + (end - from) as usize])?;
        i = j;
    }
    Ok(())
}

/// The device offset of page `p` of slot `s`.
fn slot_page(persist: &Persist, s: u32, p: u32) -> u64 {
    let l = persist.layout;
    l.data_offset + u64::from(s) * l.fragment_size + u64::from(p) * PAGE_SIZE
}
